"""Bad input fails loudly, and the message names the array, the value and the fix.

Trace-time checks raise ``ValueError``. The one check on array values (a token of zero
variance meeting the eps = 0 projection) goes through ``eqx.error_if``: under
``eqx.filter_jit`` (and eagerly, where diffrax's own jit applies) it surfaces as
``eqx.EquinoxRuntimeError``; under a bare ``jax.jit`` as ``jax.errors.JaxRuntimeError``
carrying the same message. It is never a silent NaN.
"""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _layers import random_stack

from ocformer.controls import NormParams
from ocformer.convert import from_layers
from ocformer.operators import Attention, FeedForward, Grid, LayerNormProjection, activate

ZERO_VARIANCE = "zero variance"


def _layers(num_layers=2, d=6, d_ff=10, *, scalar_norm=False):
    return random_stack(0, num_layers, d, d_ff, scalar_norm=scalar_norm)


# ---------------------------------------------------------------------------------------
# The layout.


def test_wrong_shape_names_the_array_and_both_shapes():
    layers = _layers(3)
    layers[1]["w2"] = np.zeros((10, 7))
    with pytest.raises(
        ValueError, match=re.escape("layers[1]['w2'] has shape (10, 7), expected (10, 6)")
    ):
        from_layers(layers, num_heads=2)


@pytest.mark.parametrize(
    "key, shape, expected",
    [
        ("bq", (5,), "(6,)"),
        ("b1", (6,), "(10,)"),
        ("ln2_scale", (6, 1), "(6,) or ()"),
        ("wo", (6, 5), "(6, 6)"),
    ],
)
def test_wrong_shape_of_each_kind(key, shape, expected):
    layers = _layers(2)
    layers[0][key] = np.zeros(shape)
    message = f"layers[0]['{key}'] has shape {shape}, expected {expected}"
    with pytest.raises(ValueError, match=re.escape(message)):
        from_layers(layers, num_heads=2)


def test_width_disagreeing_between_layers_is_named():
    layers = _layers(2) + _layers(1, d=8)
    with pytest.raises(
        ValueError, match=re.escape("layers[2]['wq'] has shape (8, 8), expected (6, 6)")
    ):
        from_layers(layers, num_heads=2)


def test_heads_must_divide_width():
    with pytest.raises(ValueError, match=r"num_heads=4 must be a positive integer dividing d=6"):
        from_layers(_layers(), num_heads=4)
    with pytest.raises(ValueError, match=r"num_heads=0"):
        from_layers(_layers(), num_heads=0)
    p = from_layers(_layers(), num_heads=1).layer(0).attention
    with pytest.raises(ValueError, match=r"d=6 is not divisible by num_heads=4"):
        Attention(num_heads=4)(p, jnp.zeros((3, 6)))


def test_missing_key_is_named():
    layers = _layers(2)
    del layers[1]["b1"]
    with pytest.raises(
        ValueError, match=re.escape("layers[1] has missing keys ['b1'] and unknown keys []")
    ):
        from_layers(layers, num_heads=2)


def test_unknown_key_is_named():
    layers = _layers(2)
    layers[0]["w3"] = np.zeros((6, 6))
    with pytest.raises(
        ValueError, match=re.escape("layers[0] has missing keys [] and unknown keys ['w3']")
    ):
        from_layers(layers, num_heads=2)


def test_required_array_cannot_be_absent():
    layers = _layers(2)
    layers[0]["wk"] = None
    with pytest.raises(ValueError, match=re.escape("layers[0]['wk'] is None, but wk is required")):
        from_layers(layers, num_heads=2)


def test_layers_must_share_one_structure():
    layers = _layers(2)
    layers[1]["bo"] = None
    with pytest.raises(ValueError, match=r"'bo' is None in some layers and an array in others"):
        from_layers(layers, num_heads=2)
    layers = _layers(2) + _layers(1, scalar_norm=True)
    with pytest.raises(ValueError, match=r"'ln1_scale' must be scalar in every layer or a vector"):
        from_layers(layers, num_heads=2)


@pytest.mark.parametrize("layers", [[], {"wq": np.eye(2)}, "layers"], ids=["empty", "dict", "str"])
def test_layers_must_be_a_list_of_dicts(layers):
    with pytest.raises(ValueError, match=r"`layers` must be a non-empty list"):
        from_layers(layers, num_heads=1)


def test_options_out_of_range():
    with pytest.raises(ValueError, match=r"ln_eps must be a number >= 0, got -0.1"):
        from_layers(_layers(), num_heads=2, ln_eps=-0.1)
    with pytest.raises(ValueError, match=r"norm must be 'post' or 'pre', got 'sandwich'"):
        from_layers(_layers(), num_heads=2, norm="sandwich")
    with pytest.raises(ValueError, match=r"activation must be one of .*got 'swish'"):
        from_layers(_layers(), num_heads=2, activation="swish")
    with pytest.raises(ValueError, match=r"final_norm must be a dict with keys 'scale' and 'bias'"):
        from_layers(_layers(), num_heads=2, norm="pre", final_norm={"scale": np.ones(6)})
    with pytest.raises(
        ValueError, match=re.escape("final_norm['bias'] has shape (5,), expected (6,)")
    ):
        from_layers(
            _layers(), num_heads=2, norm="pre", final_norm={"scale": np.ones(6), "bias": np.ones(5)}
        )


def test_operator_options_out_of_range():
    with pytest.raises(ValueError, match=r"Grid.h_x must be a positive number .* got 0.0"):
        Grid(h_x=0.0)
    with pytest.raises(ValueError, match=r"Grid.h_y must be a positive number .* got -1.0"):
        Grid(h_y=-1.0)
    with pytest.raises(ValueError, match=r"LayerNormProjection.eps must be a number >= 0, got -1"):
        LayerNormProjection(eps=-1e-5)
    with pytest.raises(ValueError, match=r"activation must be one of .*got 'tanh'"):
        FeedForward(activation="tanh")
    with pytest.raises(ValueError, match=r"Unknown activation 'tanh'"):
        activate(jnp.zeros(3), "tanh")
    with pytest.raises(ValueError, match=r"Attention.num_heads must be a positive integer, got 0"):
        Attention(num_heads=0)


# ---------------------------------------------------------------------------------------
# The state and the mask.


@pytest.fixture(scope="module")
def model():
    return from_layers(_layers(), num_heads=2)


@pytest.mark.parametrize(
    "shape", [(6,), (2, 3, 4, 6), (4, 5), (2, 4, 7)], ids=["rank1", "rank4", "width5", "width7"]
)
def test_state_of_wrong_rank_or_width(model, shape):
    message = (
        f"u0 must have shape (N, 6) or (B, N, 6) (tokens by the model's 6 features), got {shape}"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        model(jnp.zeros(shape))


def test_state_must_be_floating(model):
    with pytest.raises(ValueError, match=r"u0 must be a floating-point array, got dtype int"):
        model(jnp.zeros((4, 6), jnp.int32))


@pytest.mark.parametrize(
    "u_shape, mask_shape", [((2, 4, 6), (2, 5)), ((2, 4, 6), (4,)), ((4, 6), (1, 4))]
)
def test_key_mask_of_wrong_shape(model, u_shape, mask_shape):
    message = (
        f"key_mask must have shape {u_shape[:-1]} (the state without its feature axis), "
        f"got {mask_shape}"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        model(jnp.ones(u_shape), jnp.ones(mask_shape, bool))


def test_attention_operator_checks_the_key_mask():
    p = from_layers(_layers(), num_heads=2).layer(0).attention
    with pytest.raises(ValueError, match=re.escape("key_mask has shape (3,), expected (2, 4)")):
        Attention(num_heads=2)(p, jnp.ones((2, 4, 6)), jnp.ones(3, bool))


# ---------------------------------------------------------------------------------------
# A token with zero variance and eps = 0: no nearest point in S1.


def _constant_token_input(d=6):
    u = np.random.default_rng(1).standard_normal((2, 4, d))
    u[1, 2] = 0.75  # every feature equal
    return jnp.asarray(u)


def test_zero_variance_projection_raises():
    project = LayerNormProjection(eps=0.0)
    target = NormParams(scale=jnp.asarray(1.0), bias=jnp.asarray(0.0))
    u = _constant_token_input()
    with pytest.raises(eqx.EquinoxRuntimeError, match=ZERO_VARIANCE):
        eqx.filter_jit(project)(target, u)
    # The same input with eps > 0 is the regularised projection: finite, not an error.
    assert np.all(np.isfinite(LayerNormProjection(eps=1e-5)(target, u)))


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_zero_variance_in_the_model_raises_under_jit(norm):
    layers = _layers(2, scalar_norm=True)
    if norm == "post":
        # With W^V = 0 and no value/output biases, attention adds nothing, so the first
        # projection sees the constant token itself.
        for layer in layers:
            layer.update(wv=np.zeros((6, 6)), bv=None, bo=None)
    model = from_layers(layers, norm=norm, num_heads=2, ln_eps=0.0)
    u = _constant_token_input()
    with pytest.raises(eqx.EquinoxRuntimeError, match=ZERO_VARIANCE):
        model(u)
    with pytest.raises(eqx.EquinoxRuntimeError, match=ZERO_VARIANCE):
        eqx.filter_jit(lambda m, x: m(x))(model, u)
    # A bare jax.jit cannot attach equinox's error type; the message still arrives.
    with pytest.raises(jax.errors.JaxRuntimeError, match=ZERO_VARIANCE):
        jax.block_until_ready(jax.jit(lambda x: model(x))(u))
    # The same model with eps > 0 is finite on this input.
    regularised = from_layers(layers, norm=norm, num_heads=2, ln_eps=1e-5)
    assert np.all(np.isfinite(regularised(u)))
