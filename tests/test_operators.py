"""Properties of the operators, in float64 with tight tolerances.

- $P_{S_1}$ is a projection: idempotent, its image satisfies the mean/variance
  constraints, and it is the nearest point of $S_1$ (against random points of $S_1$ and
  against points of $S_1$ close to it).
- ReLU is the nearest point of $S_2 = \\{u \\ge 0\\}$.
- Attention: $h_x$ cancels; permutation equivariance without mask and causality;
  causality (outputs at token i do not see tokens j > i).
- GELU sub-steps equal flax's and the closed forms.
- The feed-forward chain at dt = 1 is the standard MLP with kernels A_j = L_j + W_j.
"""

import math

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import pytest
from _layers import random_stack

from ocformer.controls import AttentionParams, FeedForwardParams, NormParams
from ocformer.convert import from_layers
from ocformer.operators import (
    Attention,
    FeedForward,
    Grid,
    LayerNormProjection,
    activate,
    normalise,
    project_positive_cone,
)


def _kernel(rng, din, dout):
    return jnp.asarray(rng.standard_normal((din, dout)) / np.sqrt(din))


def _vec(rng, n, scale=0.1):
    return jnp.asarray(scale * rng.standard_normal(n))


def _attention_params(rng, d, *, biases=True, output_map=True):
    return AttentionParams(
        wq=_kernel(rng, d, d),
        wk=_kernel(rng, d, d),
        wv=_kernel(rng, d, d),
        wo=_kernel(rng, d, d) if output_map else None,
        bq=_vec(rng, d) if biases else None,
        bk=_vec(rng, d) if biases else None,
        bv=_vec(rng, d) if biases else None,
        bo=_vec(rng, d) if biases and output_map else None,
    )


def _token_norms(u):
    return np.linalg.norm(np.asarray(u), axis=-1)


# ---------------------------------------------------------------------------------------
# Layer norm: the projection onto S1(sigma1, sigma2).


@pytest.fixture
def s1_target():
    return NormParams(scale=jnp.asarray(1.7), bias=jnp.asarray(-0.3))


def test_projection_onto_s1_is_idempotent_and_lands_in_s1(rng, s1_target):
    project = LayerNormProjection()
    v = jnp.asarray(3.0 * rng.standard_normal((4, 9, 13)) + 2.0)
    p = project(s1_target, v)
    np.testing.assert_allclose(np.mean(p, axis=-1), -0.3, rtol=0, atol=1e-14)
    np.testing.assert_allclose(np.var(p, axis=-1), 1.7**2, rtol=1e-14, atol=0)
    np.testing.assert_allclose(project(s1_target, p), p, rtol=0, atol=1e-14)


def test_projection_onto_s1_is_the_nearest_point(rng, s1_target):
    """|v - P(v)| <= |v - w| for w in S1: random w (projections of random vectors) and
    w close to P(v) (small perturbations of it, projected back)."""
    project = LayerNormProjection()
    v = jnp.asarray(2.0 * rng.standard_normal((6, 10)))
    dist = _token_norms(v - project(s1_target, v))
    for scale in (10.0, 1.0, 1e-3):
        for _ in range(20):
            start = (
                project(s1_target, v) + scale * rng.standard_normal(v.shape)
                if scale < 1.0
                else scale * rng.standard_normal(v.shape)
            )
            w = project(s1_target, jnp.asarray(start))
            assert np.all(dist <= _token_norms(v - w) + 1e-13)
    # The closed form: S1 is a sphere of radius sigma2 sqrt(d) in the plane of mean
    # sigma1, so the distance is |v - mean - sigma2 sqrt(d) (v - mean)/|v - mean||.
    c = np.asarray(v) - np.mean(np.asarray(v), axis=-1, keepdims=True)
    r = np.linalg.norm(c, axis=-1)
    expected = np.sqrt((r - 1.7 * np.sqrt(10)) ** 2 + 10 * (np.mean(v, axis=-1) + 0.3) ** 2)
    np.testing.assert_allclose(dist, expected, rtol=1e-13)


def test_per_feature_norm_is_projection_then_affine_step(rng):
    project = LayerNormProjection(eps=1e-3)
    v = jnp.asarray(rng.standard_normal((5, 8)))
    gain, offset = _vec(rng, 8, 1.0) + 1.0, _vec(rng, 8)
    out = project(NormParams(scale=gain, bias=offset), v)
    vn = np.asarray(v)
    standard = (vn - vn.mean(-1, keepdims=True)) / np.sqrt(vn.var(-1, keepdims=True) + 1e-3)
    np.testing.assert_allclose(out, standard * np.asarray(gain) + np.asarray(offset), rtol=1e-14)
    np.testing.assert_allclose(normalise(v, 1e-3), standard, rtol=1e-14, atol=1e-15)


def test_eps_scale_one_quarter_is_the_average_rule(rng):
    """LN((a + b)/2) with eps/4 equals LN(a + b) with eps (DESIGN.md section 2)."""
    project = LayerNormProjection(eps=0.2)
    a, b = jnp.asarray(rng.standard_normal((2, 3, 6)))
    target = NormParams(scale=jnp.asarray(1.0), bias=jnp.asarray(0.0))
    averaged = project(target, 0.5 * (a + b), eps_scale=0.25)
    np.testing.assert_allclose(averaged, project(target, a + b), rtol=1e-14, atol=1e-15)
    assert np.max(np.abs(project(target, 0.5 * (a + b)) - averaged)) > 1e-2


# ---------------------------------------------------------------------------------------
# The hidden sub-steps.


def test_relu_is_the_nearest_point_of_the_positive_cone(rng):
    v = rng.standard_normal((7, 11))
    p = np.asarray(project_positive_cone(jnp.asarray(v)))
    assert np.all(p >= 0)
    np.testing.assert_array_equal(np.asarray(project_positive_cone(jnp.asarray(p))), p)
    dist = np.linalg.norm(v - p)
    for scale in (3.0, 1e-3):
        for _ in range(50):
            # Random points of S2, near and far from P(v).
            w = np.maximum(p + scale * rng.standard_normal(v.shape), 0.0)
            assert dist <= np.linalg.norm(v - w) + 1e-14
    # Optimality (variational inequality): <v - P(v), w - P(v)> <= 0 for every w in S2;
    # v - P(v) = min(v, 0) <= 0 and vanishes where P(v) > 0.
    np.testing.assert_array_equal((v - p) * p, np.zeros_like(v))


def test_gelu_substeps_match_flax_and_closed_forms():
    x = np.linspace(-6.0, 6.0, 1001)
    exact = np.asarray(activate(jnp.asarray(x), "gelu"))
    approx = np.asarray(activate(jnp.asarray(x), "gelu_tanh"))
    np.testing.assert_allclose(exact, nn.gelu(jnp.asarray(x), approximate=False), rtol=1e-15)
    np.testing.assert_allclose(approx, nn.gelu(jnp.asarray(x), approximate=True), rtol=1e-15)
    # x Phi(x) with Phi(x) = erfc(-x / sqrt 2) / 2, free of the cancellation in 1 + erf.
    erfc = np.vectorize(math.erfc)
    # Absolute tolerance 4e-15 (values up to 6): the tanh form cancels in its left tail.
    np.testing.assert_allclose(exact, 0.5 * x * erfc(-x / np.sqrt(2)), rtol=1e-13, atol=4e-15)
    tanh_form = 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))
    np.testing.assert_allclose(approx, tanh_form, rtol=1e-13, atol=4e-15)
    # GELU is no projection: it is not idempotent and it moves points of S2.
    assert np.max(np.abs(np.asarray(activate(jnp.asarray(exact), "gelu")) - exact)) > 1e-2


def test_feedforward_chain_is_the_standard_mlp(rng):
    d, d_ff = 6, 15
    a1, a2 = rng.standard_normal((d, d_ff)), rng.standard_normal((d_ff, d))
    b1, b2 = rng.standard_normal(d_ff), rng.standard_normal(d)
    p = FeedForwardParams(
        weights=(jnp.asarray(a1 - np.eye(d, d_ff)), jnp.asarray(a2 - np.eye(d_ff, d))),
        biases=(jnp.asarray(b1), jnp.asarray(b2)),
    )
    u = rng.standard_normal((3, 4, d))
    out = FeedForward(activation="relu")(p, jnp.asarray(u))
    np.testing.assert_allclose(out, np.maximum(u @ a1 + b1, 0) @ a2 + b2, rtol=1e-13, atol=1e-14)


# ---------------------------------------------------------------------------------------
# Attention.


@pytest.mark.parametrize("h_x", [0.37, 1e-3, 8.0])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_is_invariant_to_token_spacing(rng, h_x, causal):
    d, heads = 12, 3
    p = _attention_params(rng, d)
    u = jnp.asarray(rng.standard_normal((2, 7, d)))
    base = Attention(num_heads=heads, causal=causal)(p, u)
    spaced = Attention(num_heads=heads, causal=causal, grid=Grid(h_x=h_x))(p, u)
    np.testing.assert_allclose(spaced, base, rtol=1e-14, atol=1e-15)


def test_attention_matches_single_head_formula(rng):
    """With one head and no biases or W^O: softmax(u Wq (u Wk)^T / sqrt(d)) u Wv."""
    d = 5
    p = _attention_params(rng, d, biases=False, output_map=False)
    u = rng.standard_normal((4, d))
    s = (u @ np.asarray(p.wq)) @ (u @ np.asarray(p.wk)).T / np.sqrt(d)
    g = np.exp(s - s.max(-1, keepdims=True))
    g /= g.sum(-1, keepdims=True)
    out = Attention(num_heads=1)(p, jnp.asarray(u))
    np.testing.assert_allclose(out, g @ (u @ np.asarray(p.wv)), rtol=1e-13, atol=1e-15)


def test_attention_is_permutation_equivariant(rng):
    d, n = 8, 9
    p = _attention_params(rng, d)
    u = rng.standard_normal((3, n, d))
    perm = rng.permutation(n)
    att = Attention(num_heads=4)
    out = np.asarray(att(p, jnp.asarray(u)))
    np.testing.assert_allclose(
        att(p, jnp.asarray(u[:, perm])), out[:, perm], rtol=1e-13, atol=1e-14
    )
    # With a key mask, permuting the mask with the tokens keeps the equivariance.
    mask = rng.random((3, n)) < 0.7
    mask[:, 0] = True
    out_m = np.asarray(att(p, jnp.asarray(u), jnp.asarray(mask)))
    permuted = att(p, jnp.asarray(u[:, perm]), jnp.asarray(mask[:, perm]))
    np.testing.assert_allclose(permuted, out_m[:, perm], rtol=1e-13, atol=1e-14)
    # Causal attention is not equivariant: the check above is not vacuous.
    causal = Attention(num_heads=4, causal=True)
    moved = np.asarray(causal(p, jnp.asarray(u[:, perm])))
    assert np.max(np.abs(moved - np.asarray(causal(p, jnp.asarray(u)))[:, perm])) > 1e-3


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_model_is_permutation_equivariant(rng, norm):
    d, n = 8, 6
    model = from_layers(
        random_stack(int(rng.integers(1 << 30)), 4, d, 2 * d), norm=norm, num_heads=2
    )
    u = rng.standard_normal((2, n, d))
    perm = rng.permutation(n)
    out = np.asarray(model(jnp.asarray(u)))
    np.testing.assert_allclose(model(jnp.asarray(u[:, perm])), out[:, perm], rtol=1e-12, atol=1e-13)


def test_causal_attention_ignores_later_tokens(rng):
    d, n = 8, 10
    p = _attention_params(rng, d)
    att = Attention(num_heads=2, causal=True)
    u = rng.standard_normal((2, n, d))
    out = np.asarray(att(p, jnp.asarray(u)))
    for i in (0, 4, n - 2):
        w = u.copy()
        w[:, i + 1 :] = 100.0 * rng.standard_normal(w[:, i + 1 :].shape)
        changed = np.asarray(att(p, jnp.asarray(w)))
        np.testing.assert_allclose(changed[:, : i + 1], out[:, : i + 1], rtol=0, atol=1e-15)
        assert np.max(np.abs(changed[:, i + 1 :] - out[:, i + 1 :])) > 1e-3


def test_causal_model_ignores_later_tokens(rng):
    """Through every layer of a pre-LN causal stack with a final LN."""
    d, n = 8, 7
    final = {"scale": 1 + 0.1 * rng.standard_normal(d), "bias": 0.1 * rng.standard_normal(d)}
    model = from_layers(
        random_stack(int(rng.integers(1 << 30)), 4, d, 4 * d),
        norm="pre",
        num_heads=2,
        causal=True,
        activation="gelu_tanh",
        final_norm=final,
    )
    u = rng.standard_normal((2, n, d))
    out = np.asarray(model(jnp.asarray(u)))
    w = u.copy()
    w[:, 3:] = rng.standard_normal(w[:, 3:].shape)
    changed = np.asarray(model(jnp.asarray(w)))
    np.testing.assert_allclose(changed[:, :3], out[:, :3], rtol=0, atol=1e-15)
    assert np.max(np.abs(changed[:, 3:] - out[:, 3:])) > 1e-3
