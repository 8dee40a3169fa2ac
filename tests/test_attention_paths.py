"""The two evaluations of the attention operator agree.

With unit quadrature spacings and a float32 state, ``Attention`` calls
``jax.nn.dot_product_attention`` (one fused Q/K/V product, the library's scaled
dot-product kernel); in float64, or with non-unit spacings, it evaluates the
integral-operator form literally. The float32 path is checked against the float64
literal form of the same parameters, and against an independent numpy reference, with
and without causality, key masks, biases and the output map.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ocformer.controls import AttentionParams
from ocformer.operators import Attention, Grid


def _params(rng, d, *, biases, output_map):
    def m():
        return rng.standard_normal((d, d)) / np.sqrt(d)

    def v():
        return 0.1 * rng.standard_normal(d) if biases else None

    return dict(
        wq=m(), wk=m(), wv=m(), wo=m() if output_map else None, bq=v(), bk=v(), bv=v(), bo=v()
    )


def _as(p, dtype):
    return AttentionParams(
        **{k: None if x is None else jnp.asarray(x, dtype) for k, x in p.items()}
    )


def _numpy_attention(p, u, heads, causal, key_mask):
    """Multi-head attention written out in float64 numpy."""
    b, n, d = u.shape
    dh = d // heads

    def lin(w, bias):
        return u @ w + (0.0 if bias is None else bias)

    q, k, v = lin(p["wq"], p["bq"]), lin(p["wk"], p["bk"]), lin(p["wv"], p["bv"])
    out = np.zeros_like(u)
    for h in range(heads):
        sl = slice(h * dh, (h + 1) * dh)
        s = np.einsum("bqc,bkc->bqk", q[..., sl], k[..., sl]) / np.sqrt(dh)
        keep = np.ones((b, n, n), bool)
        if causal:
            keep &= np.tril(np.ones((n, n), bool))[None]
        if key_mask is not None:
            keep &= key_mask[:, None, :]
        s = np.where(keep, s, -np.inf)
        e = np.exp(s - s.max(-1, keepdims=True))
        out[..., sl] = np.einsum("bqk,bkc->bqc", e / e.sum(-1, keepdims=True), v[..., sl])
    if p["wo"] is not None:
        out = out @ p["wo"]
    if p["bo"] is not None:
        out = out + p["bo"]
    return out


@pytest.mark.parametrize(
    "causal,masked,biases,output_map",
    [(False, False, False, False), (True, False, True, True), (True, True, True, False)],
)
def test_float32_kernel_path_matches_float64_integral_form(rng, causal, masked, biases, output_map):
    b, n, d, heads = 2, 7, 12, 3
    p = _params(rng, d, biases=biases, output_map=output_map)
    u = rng.standard_normal((b, n, d))
    key_mask = None
    if masked:
        key_mask = np.ones((b, n), bool)
        key_mask[1, [2, 5]] = False
    att = Attention(num_heads=heads, causal=causal)
    km = None if key_mask is None else jnp.asarray(key_mask)
    out32 = att(_as(p, jnp.float32), jnp.asarray(u, jnp.float32), km)
    out64 = att(_as(p, jnp.float64), jnp.asarray(u, jnp.float64), km)
    reference = _numpy_attention(p, u, heads, causal, key_mask)
    assert out32.dtype == jnp.float32 and out64.dtype == jnp.float64
    # float64: the literal integral form, to rounding.
    np.testing.assert_allclose(np.asarray(out64), reference, rtol=0, atol=1e-12)
    # float32: the kernel path, to single-precision rounding of O(1) values.
    np.testing.assert_allclose(np.asarray(out32), reference, rtol=0, atol=2e-5)
    assert np.max(np.abs(np.asarray(out32) - reference)) > 1e-9  # really single precision


def test_non_unit_spacing_keeps_the_integral_form_in_float32(rng):
    # h_y != 1 changes the operator (the transforms carry h_y and the score scale is
    # 1/sqrt(h_y dh) times h_y); the float32 result must follow it, not the kernel's
    # standard scaling.
    b, n, d, heads, h_y = 2, 5, 8, 2, 0.5
    p = _params(rng, d, biases=True, output_map=True)
    u = rng.standard_normal((b, n, d))
    att = Attention(num_heads=heads, causal=True, grid=Grid(h_x=0.25, h_y=h_y))
    out32 = att(_as(p, jnp.float32), jnp.asarray(u, jnp.float32))
    out64 = att(_as(p, jnp.float64), jnp.asarray(u, jnp.float64))
    np.testing.assert_allclose(np.asarray(out32), np.asarray(out64), rtol=0, atol=2e-5)
    unit = Attention(num_heads=heads, causal=True)(_as(p, jnp.float32), jnp.asarray(u, jnp.float32))
    assert np.max(np.abs(np.asarray(unit) - np.asarray(out32))) > 1e-2


def test_unbatched_state(rng):
    n, d, heads = 6, 8, 2
    p = _params(rng, d, biases=True, output_map=True)
    u = rng.standard_normal((n, d))
    att = Attention(num_heads=heads, causal=True)
    out = att(_as(p, jnp.float32), jnp.asarray(u, jnp.float32))
    reference = _numpy_attention(p, u[None], heads, True, None)[0]
    assert out.shape == (n, d)
    np.testing.assert_allclose(np.asarray(out), reference, rtol=0, atol=2e-5)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_half_precision_attention_under_jit(rng, dtype):
    """A float16 or bfloat16 state, compiled, on every backend: XLA on CPU has no
    float16 x float16 -> float32 product, which the library kernel asks for, so float16
    takes the integral form there. Both agree with the numpy reference to half precision."""
    heads, d = 2, 16
    p = _params(rng, d, biases=True, output_map=True)
    u = rng.standard_normal((2, 8, d))
    att = Attention(num_heads=heads, causal=True)
    got = jax.jit(att)(_as(p, dtype), jnp.asarray(u, dtype))
    assert got.dtype == dtype
    err = np.max(np.abs(np.asarray(got, np.float64) - _numpy_attention(p, u, heads, True, None)))
    assert 1e-5 < err < 0.1, err  # half precision: not float32's rounding, nor worse


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_cudnn_kernel_choice(rng, dtype):
    """``kernel="cudnn"`` is cuDNN's fused kernel on an NVIDIA GPU for half-precision
    states (checked against the numpy reference to bfloat16 rounding); everywhere else
    it is the XLA computation, bit for bit."""
    heads, d = 2, 16
    p = _params(rng, d, biases=True, output_map=True)
    u = rng.standard_normal((2, 8, d))
    want = _numpy_attention(p, u, heads, True, None)
    xla = Attention(num_heads=heads, causal=True)(_as(p, dtype), jnp.asarray(u, dtype))
    fused = Attention(num_heads=heads, causal=True, kernel="cudnn")
    got = fused(_as(p, dtype), jnp.asarray(u, dtype))
    if jax.default_backend() == "gpu" and dtype == jnp.bfloat16:
        np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=0.1, rtol=0.05)
    else:
        np.testing.assert_array_equal(np.asarray(got), np.asarray(xla))
    with pytest.raises(ValueError, match="kernel must be one of"):
        Attention(num_heads=heads, kernel="flash")
