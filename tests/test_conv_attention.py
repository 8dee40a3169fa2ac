"""Attention with convolutional token projections (CvT), against a numpy transcription.

The reference convolves every feature of the grid tokens with its own k x k kernel by
explicit loops over the offsets (zero outside the grid, class token untouched), then
runs multi-head softmax attention in float64. ``ConvAttention`` must agree to 1e-12;
with unit kernels it must be plain ``Attention``; inside a continuous Transformer
(pre-LN, Lie, one step per layer) it must equal a layer-by-layer numpy stack.
"""

import importlib.util
import os

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

from ocformer.controls import AttentionParams, ConvAttentionParams
from ocformer.convert import from_layers
from ocformer.models import refine, with_conv_projections
from ocformer.operators import Attention, ConvAttention

TOL = 1e-12


def rel_err(a, ref) -> float:
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(a - ref)) / np.max(np.abs(ref)))


def conv_ref(u, kernel, rows, cols, prefix):
    """Depthwise cross-correlation over the token grid by explicit loops."""
    out = u.copy()
    k = kernel.shape[0]
    r = k // 2
    grid = u[..., prefix:, :].reshape(*u.shape[:-2], rows, cols, u.shape[-1])
    res = np.zeros_like(grid)
    for i in range(rows):
        for j in range(cols):
            for a in range(k):
                for b in range(k):
                    ii, jj = i + a - r, j + b - r
                    if 0 <= ii < rows and 0 <= jj < cols:
                        res[..., i, j, :] += kernel[a, b] * grid[..., ii, jj, :]
    out[..., prefix:, :] = res.reshape(*u.shape[:-2], rows * cols, u.shape[-1])
    return out


def attention_ref(p, u, heads, rows, cols, prefix, key_mask=None):
    d = u.shape[-1]
    dh = d // heads

    def proj(kernel, w, b):
        z = conv_ref(u, kernel, rows, cols, prefix) @ w + b
        return z.reshape(*z.shape[:-1], heads, dh)

    q, k, v = (proj(p[f"k{c}"], p[f"w{c}"], p[f"b{c}"]) for c in "qkv")
    s = np.einsum("...qhc,...khc->...hqk", q, k) / np.sqrt(dh)
    if key_mask is not None:
        s = np.where(key_mask[..., None, None, :], s, -np.inf)
    s = s - s.max(-1, keepdims=True)
    g = np.exp(s) / np.exp(s).sum(-1, keepdims=True)
    z = np.einsum("...hqk,...khc->...qhc", g, v).reshape(u.shape)
    return z @ p["wo"] + p["bo"]


def random_params(rng, d, k):
    p = {f"w{c}": rng.standard_normal((d, d)) / np.sqrt(d) for c in "qkvo"}
    p |= {f"b{c}": 0.1 * rng.standard_normal(d) for c in "qkvo"}
    p |= {f"k{c}": rng.standard_normal((k, k, d)) / k for c in "qkv"}
    return p


@pytest.mark.parametrize(
    ("rows", "cols", "prefix", "k", "batch"),
    [(4, 4, 1, 3, (2,)), (3, 5, 0, 5, ()), (2, 3, 2, 1, (2,))],
)
def test_matches_reference(rng, rows, cols, prefix, k, batch):
    d, heads = 12, 3
    p = random_params(rng, d, k)
    u = rng.standard_normal((*batch, prefix + rows * cols, d))
    op = ConvAttention(num_heads=heads, token_grid=(rows, cols), num_prefix=prefix)
    got = op(ConvAttentionParams(**{n: jnp.asarray(a) for n, a in p.items()}), jnp.asarray(u))
    assert rel_err(got, attention_ref(p, u, heads, rows, cols, prefix)) < TOL
    mask = rng.random(u.shape[:-1]) > 0.3
    mask[..., 0] = True
    got = op(
        ConvAttentionParams(**{n: jnp.asarray(a) for n, a in p.items()}),
        jnp.asarray(u),
        jnp.asarray(mask),
    )
    assert rel_err(got, attention_ref(p, u, heads, rows, cols, prefix, mask)) < TOL


def test_unit_kernels_give_plain_attention(rng):
    d, k = 8, 3
    p = random_params(rng, d, k)
    unit = np.zeros((k, k, d))
    unit[1, 1] = 1.0
    p |= {"kq": unit, "kk": unit, "kv": unit}
    u = jnp.asarray(rng.standard_normal((2, 1 + 9, d)))
    conv = ConvAttention(num_heads=2, token_grid=(3, 3))(
        ConvAttentionParams(**{n: jnp.asarray(a) for n, a in p.items()}), u
    )
    plain_p = AttentionParams(**{n: jnp.asarray(a) for n, a in p.items() if n[0] != "k"})
    plain = Attention(num_heads=2)(plain_p, u)
    assert rel_err(conv, plain) < 1e-14


def test_refuses_plain_params_and_wrong_token_count(rng):
    op = ConvAttention(num_heads=2, token_grid=(3, 3))
    p = AttentionParams(*(jnp.eye(4) for _ in range(3)))
    with pytest.raises(ValueError, match="needs ConvAttentionParams"):
        op(p, jnp.zeros((10, 4)))
    conv_p = ConvAttentionParams(
        *(jnp.eye(4) for _ in range(3)), *(jnp.ones((3, 3, 4)) for _ in range(3))
    )
    with pytest.raises(ValueError, match=r"1 prefix tokens plus a 3 x 3 grid \(10 tokens\), got 9"):
        op(conv_p, jnp.zeros((9, 4)))


def _layer(rng, d, d_ff):
    g = lambda *s: rng.standard_normal(s) / np.sqrt(s[0])  # noqa: E731
    b = lambda n: 0.1 * rng.standard_normal(n)  # noqa: E731
    return {
        "wq": g(d, d), "wk": g(d, d), "wv": g(d, d), "wo": g(d, d),
        "bq": b(d), "bk": b(d), "bv": b(d), "bo": b(d),
        "w1": g(d, d_ff), "b1": b(d_ff), "w2": g(d_ff, d), "b2": b(d),
        "ln1_scale": 1 + b(d), "ln1_bias": b(d), "ln2_scale": 1 + b(d), "ln2_bias": b(d),
    }  # fmt: skip


def test_cvt_stack_is_a_discretisation(rng):
    """A pre-LN CvT encoder (convolutional projections in every layer) is the Lie scheme
    with one step per layer, and refines like any continuous model."""
    d, d_ff, heads, rows, cols, num_layers, eps = 8, 16, 2, 3, 3, 3, 1e-5
    layers = [_layer(rng, d, d_ff) for _ in range(num_layers)]
    transformer = from_layers(layers, norm="pre", num_heads=heads, activation="gelu", ln_eps=eps)
    cvt = with_conv_projections(transformer, token_grid=(rows, cols), key=jr.key(0), init_scale=1.0)
    kernels = cvt.control.values.attention
    u0 = rng.standard_normal((2, 1 + rows * cols, d))

    def ln(x, g, b):
        m = x.mean(-1, keepdims=True)
        return (x - m) / np.sqrt(((x - m) ** 2).mean(-1, keepdims=True) + eps) * g + b

    ref = u0
    for n, layer in enumerate(layers):
        p = dict(layer) | {f"k{c}": np.asarray(getattr(kernels, f"k{c}"))[n] for c in "qkv"}
        ref = ref + attention_ref(p, ln(ref, p["ln1_scale"], p["ln1_bias"]), heads, rows, cols, 1)
        h = ln(ref, p["ln2_scale"], p["ln2_bias"]) @ p["w1"] + p["b1"]
        h = np.asarray(jax.nn.gelu(h, approximate=False))
        ref = ref + h @ p["w2"] + p["b2"]
    assert rel_err(cvt(jnp.asarray(u0)), ref) < TOL
    # The kernels are controls: the loss reaches them.
    grads = eqx.filter_grad(lambda m: jnp.sum(m(jnp.asarray(u0)) ** 2))(cvt)
    assert float(jnp.abs(grads.control.values.attention.kq).max()) > 1e-3
    # Re-discretised, the plain operator comes back; re-applying keeps the kernels.
    fine = with_conv_projections(refine(cvt, 4), token_grid=(rows, cols))
    assert isinstance(fine.attention, ConvAttention) and fine.steps_per_layer == 4
    assert fine.control.values.attention.kq is kernels.kq
    assert 1e-3 < rel_err(fine(jnp.asarray(u0)), ref) < 1.0


def test_digits_cvt_experiment_one_step():
    """experiments/digits_cvt.py builds the CvT model and takes a training step."""
    path = os.path.join(os.path.dirname(os.path.dirname(__file__)), "experiments", "digits_cvt.py")
    spec = importlib.util.spec_from_file_location("digits_cvt", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    _, model = module.build_cvt(module.get_config())
    assert isinstance(model.transformer.attention, ConvAttention)
    assert model.transformer.control.values.attention.kq.shape == (4, 3, 3, 64)
    result = module.main(["--steps", "1"])
    assert result["step"] == 1 and np.isfinite(result["val_loss"])
