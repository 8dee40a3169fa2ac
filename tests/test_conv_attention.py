"""Attention with convolutional token projections (CvT), against a numpy transcription.

The reference convolves every feature of the grid tokens with its own k x k kernel by
explicit loops over the offsets (zero outside the grid, class token untouched), then
runs multi-head softmax attention in float64. ``ConvAttention`` must agree to 1e-12;
with unit kernels it must be plain ``Attention``; inside a continuous Transformer
(pre-LN, Lie, one step per layer) it must equal a layer-by-layer numpy stack.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from _layers import random_stack

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


def test_cvt_stack_is_a_discretisation(rng):
    """A pre-LN CvT encoder (convolutional projections in every layer) is the Lie scheme
    with one step per layer, and refines like any continuous model."""
    d, d_ff, heads, rows, cols, num_layers, eps = 8, 16, 2, 3, 3, 3, 1e-5
    layers = random_stack(int(rng.integers(1 << 30)), num_layers, d, d_ff)
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
    # Re-discretised, the operator and its kernels stay: only the discretisation changes.
    fine = refine(cvt, 4)
    assert isinstance(fine.attention, ConvAttention) and fine.steps_per_layer == 4
    assert fine.control.values.attention.kq is kernels.kq
    # Applying the projections again keeps the kernels too.
    again = with_conv_projections(cvt, token_grid=(rows, cols))
    assert again.control.values.attention.kq is kernels.kq
    assert 1e-3 < rel_err(fine(jnp.asarray(u0)), ref) < 1.0


@pytest.mark.slow
def test_digits_cvt_experiment_builds_from_its_config(tmp_path):
    """experiments/digits_cvt.py selects the convolutional projections by config
    (model.attention=conv): the built model has them, and a training step runs through
    the same command line as every experiment."""
    from ocformer.config import ConfigError, apply_overrides, resolve
    from ocformer.train import main as train_main
    from ocformer.training import build

    config = resolve("experiments/digits_cvt.py")
    model = build(config).model
    assert isinstance(model.transformer.attention, ConvAttention)
    assert model.transformer.control.values.attention.kq.shape == (4, 3, 3, 64)
    workdir = tmp_path / "run"
    argv = ["--config", "experiments/digits_cvt.py", "--workdir", str(workdir)]
    for o in ("train.steps=1", "train.progress=false", "task.eval_batches=1"):
        argv += ["--set", o]
    assert train_main(argv) == 0
    text_config = apply_overrides(resolve("experiments/smoke.py"), ["model.attention=conv"])
    with pytest.raises(ConfigError, match="2-D grid of tokens") as e:
        build(text_config)
    assert e.value.field == "model.attention"
