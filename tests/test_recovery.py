"""Exact recovery of standard Transformers, against references built outside ocformer.

Two independent references:

- a float64 numpy transcription of the paper's six sub-steps, in
  the paper's own notation (W_j = A_j - I, scalar sigma1/sigma2, eps = 0);
- standard layers composed from ``flax.linen`` modules (``MultiHeadDotProductAttention``,
  ``Dense``, ``LayerNorm``, ``gelu``), with their parameters set from the plain layout
  and flax's own forward pass: post-LN encoder layers (Vaswani et al.) and pre-LN causal
  blocks with a final LayerNorm (GPT-2).

The continuous model is ``from_layers(...)``: the Lie scheme through one ``diffeqsolve``
on the layer grid. Recovery means a maximum relative error of at most 1e-12 in float64
(1e-5 in float32), over odd sizes, d_ff < d, one head per feature, one token and one
layer, with and without a batch axis.
"""

import re

import diffrax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _layers import random_input, random_stack

from ocformer import Discretisation, Lie, Strang, rediscretise
from ocformer.convert import LAYER_KEYS, from_layers, to_layers
from ocformer.integration import Parareal

F64_TOL = 1e-12
F32_TOL = 1e-5


def rel_err(a, ref) -> float:
    """max |a - ref| / max |ref|: the error relative to the size of the reference."""
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(a - ref)) / np.max(np.abs(ref)))


# ---------------------------------------------------------------------------------------
# Reference 1: the paper's six sub-steps in float64 numpy (one head, W^O folded into
# W^V, no Q/K/V biases, d_ff = d, scalar sigma1/sigma2, eps = 0).


def _project_s1(v, sigma1, sigma2):
    # P_S1(v) = sigma2 (v - mean v) / sqrt(var v) + sigma1, token by token.
    mean = v.mean(axis=-1, keepdims=True)
    std = np.sqrt(((v - mean) ** 2).mean(axis=-1, keepdims=True))
    return sigma2 * (v - mean) / std + sigma1


def _paper_layer(u, layer):
    d = u.shape[-1]
    eye = np.eye(d)
    q, k, v = u @ layer["wq"], u @ layer["wk"], u @ layer["wv"]
    scores = q @ k.T / np.sqrt(d)
    gamma = np.exp(scores - scores.max(axis=-1, keepdims=True))
    gamma /= gamma.sum(axis=-1, keepdims=True)
    b1 = 0.0 if layer["b1"] is None else layer["b1"]
    b2 = 0.0 if layer["b2"] is None else layer["b2"]
    u1 = u + gamma @ v  # 1. explicit Euler on attention
    u2 = _project_s1(u1, layer["ln1_bias"], layer["ln1_scale"])  # 2. LN 1
    w1, w2 = layer["w1"] - eye, layer["w2"] - eye  # the controls W_j = A_j - I
    u3 = np.maximum(u2 + u2 @ w1 + b1, 0.0)  # 3. linear step, ReLU = P_S2
    u4 = u3 + u3 @ w2 + b2  # 4. last linear step
    u5 = 0.5 * (u4 + u2)  # 5. averaging (the FFN skip)
    return _project_s1(u5, layer["ln2_bias"], layer["ln2_scale"])  # 6. LN 2


def paper_reference(layers, u):
    u = np.asarray(u, np.float64)
    if u.ndim == 3:
        return np.stack([paper_reference(layers, ub) for ub in u])
    for layer in layers:
        u = _paper_layer(u, layer)
    return u


# ---------------------------------------------------------------------------------------
# Reference 2: standard blocks composed from flax.linen modules.

_FLAX_ACTIVATIONS = {
    "relu": nn.relu,
    "gelu": lambda z: nn.gelu(z, approximate=False),
    "gelu_tanh": lambda z: nn.gelu(z, approximate=True),
}


class FlaxBlock(nn.Module):
    """A post-LN encoder layer or a pre-LN (GPT-2) block, from flax.linen parts."""

    d: int
    d_ff: int
    heads: int
    norm: str
    activation: str
    eps: float
    dtype: type

    @nn.compact
    def __call__(self, x, mask=None):
        def layer_norm(name):
            # use_fast_variance=False: E[(x - mean)^2], not E[x^2] - mean^2, so that
            # the reference is as accurate as the quantity it checks.
            return nn.LayerNorm(
                epsilon=self.eps, use_fast_variance=False, param_dtype=self.dtype, name=name
            )

        attention = nn.MultiHeadDotProductAttention(
            num_heads=self.heads,
            qkv_features=self.d,
            out_features=self.d,
            dropout_rate=0.0,
            deterministic=True,
            param_dtype=self.dtype,
            name="attn",
        )

        def mlp(z):
            z = nn.Dense(self.d_ff, param_dtype=self.dtype, name="fc1")(z)
            z = _FLAX_ACTIVATIONS[self.activation](z)
            return nn.Dense(self.d, param_dtype=self.dtype, name="fc2")(z)

        if self.norm == "post":
            x = layer_norm("ln1")(x + attention(x, mask=mask))
            return layer_norm("ln2")(x + mlp(x))
        x = x + attention(layer_norm("ln1")(x), mask=mask)
        return x + mlp(layer_norm("ln2")(x))


def flax_variables(layer, heads):
    """The layout's arrays as flax parameters: (d, heads, head_dim) kernels, absent
    biases as zeros, an absent W^O as the identity, scalar LN targets as constant
    vectors."""
    d = layer["wq"].shape[0]
    dh = d // heads
    dtype = layer["wq"].dtype

    def arr(key, n):
        return np.zeros(n, dtype) if layer[key] is None else layer[key]

    def head_dense(w, b):
        return {"kernel": w.reshape(d, heads, dh), "bias": b.reshape(heads, dh)}

    def ln(prefix):
        return {
            "scale": np.broadcast_to(layer[f"{prefix}_scale"], (d,)).astype(dtype),
            "bias": np.broadcast_to(layer[f"{prefix}_bias"], (d,)).astype(dtype),
        }

    wo = np.eye(d, dtype=dtype) if layer["wo"] is None else layer["wo"]
    d_ff = layer["w1"].shape[1]
    params = {
        "attn": {
            "query": head_dense(layer["wq"], arr("bq", d)),
            "key": head_dense(layer["wk"], arr("bk", d)),
            "value": head_dense(layer["wv"], arr("bv", d)),
            "out": {"kernel": wo.reshape(heads, dh, d), "bias": arr("bo", d)},
        },
        "fc1": {"kernel": layer["w1"], "bias": arr("b1", d_ff)},
        "fc2": {"kernel": layer["w2"], "bias": arr("b2", d)},
        "ln1": ln("ln1"),
        "ln2": ln("ln2"),
    }
    return {"params": params}


def flax_reference(
    layers,
    x,
    *,
    norm,
    heads,
    activation="relu",
    causal=False,
    eps=1e-5,
    final_norm=None,
    key_mask=None,
):
    d, d_ff = layers[0]["w1"].shape
    dtype = layers[0]["wq"].dtype
    block = FlaxBlock(d, d_ff, heads, norm, activation, eps, dtype)
    x = jnp.asarray(x)
    mask = None
    if causal:
        mask = nn.make_causal_mask(x[..., 0])
    if key_mask is not None:
        keys = nn.make_attention_mask(jnp.ones(x.shape[:-1], bool), jnp.asarray(key_mask))
        mask = nn.combine_masks(mask, keys)
    # One compiled block for the whole stack (every layer has the same shapes). flax's
    # LayerNorm picks its statistics' dtype by jnp.promote_types(dtype, float32), which
    # strict promotion refuses for a float64 block whose every input is float64; the
    # reference runs under the standard rule.
    with jax.numpy_dtype_promotion("standard"):
        apply = jax.jit(block.apply)
        for layer in layers:
            x = apply(flax_variables(layer, heads), x, mask)
        if final_norm is not None:
            ln = nn.LayerNorm(epsilon=eps, use_fast_variance=False, param_dtype=dtype)
            x = ln.apply({"params": final_norm}, x)
    return np.asarray(x)


def random_final_norm(seed, d, dtype=np.float64):
    rng = np.random.default_rng(seed + 2000)
    return {
        "scale": (1.0 + 0.1 * rng.standard_normal(d)).astype(dtype),
        "bias": (0.1 * rng.standard_normal(d)).astype(dtype),
    }


# ---------------------------------------------------------------------------------------
# The paper's class.

# (d, N, layers, batch, FFN biases b_1, b_2): odd widths, a single token, a single
# layer, with and without a batch axis.
PAPER_CASES = [
    (8, 6, 4, None, True),
    (8, 6, 4, 3, True),
    (5, 1, 4, 2, True),
    (7, 9, 1, None, True),
    (3, 4, 6, 2, False),
]


@pytest.mark.parametrize("d, n, num_layers, batch, ffn_biases", PAPER_CASES)
def test_paper_class_matches_numpy_transcription(d, n, num_layers, batch, ffn_biases):
    layers = random_stack(d + n, num_layers, d, d, output_map=False, scalar_norm=True, biases=False)
    if ffn_biases:
        rng = np.random.default_rng(d)
        for layer in layers:
            layer["b1"] = 0.1 * rng.standard_normal(d)
            layer["b2"] = 0.1 * rng.standard_normal(d)
    u0 = random_input(d, batch, n, d)
    model = from_layers(layers, norm="post", num_heads=1, ln_eps=0.0)
    out = model(jnp.asarray(u0))
    assert out.shape == u0.shape and out.dtype == jnp.float64
    assert model.layer(0).norm1.scale.shape == ()  # sigma2 stays a scalar control
    assert rel_err(out, paper_reference(layers, u0)) <= F64_TOL


def test_paper_transcription_is_a_post_ln_layer():
    """The reference's own claim (DESIGN.md section 2): the six sub-steps are the post-LN
    encoder layer with A_j = I + W_j. Checked between the two references, so that a
    mistake in either cannot hide behind the other."""
    layers = random_stack(3, 4, 6, 6, output_map=False, scalar_norm=True, biases=False)
    for layer in layers:
        layer["b1"], layer["b2"] = np.full(6, 0.05), np.full(6, -0.1)
    u0 = random_input(3, 2, 5, 6)
    ref = flax_reference(layers, u0, norm="post", heads=1, eps=0.0)
    assert rel_err(paper_reference(layers, u0), ref) <= F64_TOL


# ---------------------------------------------------------------------------------------
# Standard post-LN encoders and pre-LN causal decoders against flax.

# (d, heads, d_ff, N, layers, batch)
POST_CASES = [
    pytest.param(16, 4, 64, 7, 4, 2, "relu", 1e-5, id="d16h4-ff4d-L4-B2"),
    pytest.param(12, 3, 48, 5, 5, None, "gelu", 1e-5, id="d12h3-gelu-nobatch"),
    pytest.param(9, 3, 5, 6, 4, 3, "gelu_tanh", 1e-5, id="odd-dff<d"),
    pytest.param(5, 5, 20, 4, 4, 2, "relu", 1e-5, id="heads=d"),
    pytest.param(6, 2, 24, 1, 4, 2, "relu", 1e-5, id="N=1"),
    pytest.param(8, 2, 32, 6, 1, None, "relu", 1e-5, id="L=1"),
    # A large eps makes the closing projection's eps/4 rule visible far above 1e-12.
    pytest.param(8, 4, 16, 5, 4, 2, "gelu", 0.3, id="eps=0.3"),
]


@pytest.mark.parametrize("d, heads, d_ff, n, num_layers, batch, activation, eps", POST_CASES)
def test_post_ln_encoder_matches_flax(d, heads, d_ff, n, num_layers, batch, activation, eps):
    seed = d * 100 + heads * 10 + num_layers
    layers = random_stack(seed, num_layers, d, d_ff)
    u0 = random_input(seed, batch, n, d)
    model = from_layers(layers, norm="post", num_heads=heads, activation=activation, ln_eps=eps)
    ref = flax_reference(layers, u0, norm="post", heads=heads, activation=activation, eps=eps)
    out = model(jnp.asarray(u0))
    assert out.shape == ref.shape
    assert rel_err(out, ref) <= F64_TOL


PRE_CASES = [
    pytest.param(16, 4, 64, 8, 4, 2, "gelu_tanh", True, id="gpt2-like"),
    pytest.param(12, 2, 48, 6, 6, None, "gelu", True, id="nobatch-L6"),
    pytest.param(7, 7, 3, 5, 4, 2, "relu", True, id="heads=d-dff<d"),
    pytest.param(6, 3, 24, 1, 4, 3, "gelu_tanh", True, id="N=1"),
    pytest.param(10, 5, 40, 6, 1, 2, "gelu_tanh", True, id="L=1"),
    pytest.param(8, 2, 32, 5, 4, 2, "relu", False, id="bidirectional-ViT-like"),
]


@pytest.mark.parametrize("d, heads, d_ff, n, num_layers, batch, activation, causal", PRE_CASES)
def test_pre_ln_block_matches_flax(d, heads, d_ff, n, num_layers, batch, activation, causal):
    seed = d * 100 + heads * 10 + num_layers + 7
    layers = random_stack(seed, num_layers, d, d_ff)
    final = random_final_norm(seed, d)
    u0 = random_input(seed, batch, n, d)
    model = from_layers(
        layers,
        norm="pre",
        num_heads=heads,
        activation=activation,
        causal=causal,
        ln_eps=1e-5,
        final_norm=final,
    )
    ref = flax_reference(
        layers,
        u0,
        norm="pre",
        heads=heads,
        activation=activation,
        causal=causal,
        final_norm=final,
    )
    assert rel_err(model(jnp.asarray(u0)), ref) <= F64_TOL


def test_pre_ln_without_final_norm_matches_flax():
    layers = random_stack(11, 4, 8, 16)
    u0 = random_input(11, 2, 6, 8)
    model = from_layers(layers, norm="pre", num_heads=2, causal=True, ln_eps=1e-6)
    ref = flax_reference(layers, u0, norm="pre", heads=2, causal=True, eps=1e-6)
    assert rel_err(model(jnp.asarray(u0)), ref) <= F64_TOL


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_absent_output_map_and_biases_match_flax(norm):
    """wo = None (W^O folded into W^V) and absent biases with several heads: flax sees
    an identity output kernel and zero biases."""
    layers = random_stack(21, 4, 12, 30, biases=False, output_map=False)
    u0 = random_input(21, 2, 5, 12)
    model = from_layers(layers, norm=norm, num_heads=4, causal=norm == "pre")
    ref = flax_reference(layers, u0, norm=norm, heads=4, causal=norm == "pre")
    assert model.layer(0).attention.wo is None and model.layer(0).attention.bq is None
    assert rel_err(model(jnp.asarray(u0)), ref) <= F64_TOL


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_key_padding_mask_matches_flax(norm):
    """A key-padding mask removes keys from the x'-integral and its normaliser, as
    flax's ``mask`` argument does; combined with causality for pre-LN."""
    d, heads, n, batch = 12, 3, 7, 3
    layers = random_stack(31, 4, d, 2 * d)
    u0 = random_input(31, batch, n, d)
    key_mask = np.ones((batch, n), bool)
    key_mask[0, 4:] = False  # right padding
    key_mask[1, [1, 3, 6]] = False  # scattered holes
    # Row 2 keeps every key. Token 0 stays visible everywhere so that no causal row is
    # left without keys.
    causal = norm == "pre"
    model = from_layers(layers, norm=norm, num_heads=heads, causal=causal)
    ref = flax_reference(layers, u0, norm=norm, heads=heads, causal=causal, key_mask=key_mask)
    out = model(jnp.asarray(u0), jnp.asarray(key_mask))
    assert rel_err(out, ref) <= F64_TOL
    # The mask really acts: without it the result differs at O(1).
    assert rel_err(model(jnp.asarray(u0)), ref) > 1e-3


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_float32_matches_flax(norm):
    d, heads, d_ff = 16, 4, 64
    layers = random_stack(41, 4, d, d_ff, dtype=np.float32)
    final = random_final_norm(41, d, np.float32) if norm == "pre" else None
    u0 = random_input(41, 2, 8, d, np.float32)
    model = from_layers(
        layers, norm=norm, num_heads=heads, activation="gelu", causal=norm == "pre",
        final_norm=final,
    )  # fmt: skip
    out = model(jnp.asarray(u0))
    ref = flax_reference(
        layers, u0, norm=norm, heads=heads, activation="gelu", causal=norm == "pre",
        final_norm=final,
    )  # fmt: skip
    assert out.dtype == jnp.float32 and ref.dtype == np.float32
    assert rel_err(out, ref) <= F32_TOL


# ---------------------------------------------------------------------------------------
# The layout round trip.


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"biases": False, "output_map": False, "scalar_norm": True}],
    ids=["full", "paper-class"],
)
def test_to_layers_inverts_from_layers(kwargs):
    layers = random_stack(51, 4, 10, 7, **kwargs)
    model = from_layers(layers, norm="post", num_heads=2)
    back = to_layers(model)
    assert len(back) == len(layers)
    for original, recovered in zip(layers, back):
        assert set(recovered) == set(LAYER_KEYS)
        for k in LAYER_KEYS:
            if original[k] is None:
                assert recovered[k] is None, k
                continue
            assert recovered[k].shape == original[k].shape, k
            assert recovered[k].dtype == np.float64, k
            if k in ("w1", "w2"):
                # A_j = L_j + (A_j - L_j): one rounding on the diagonal of E and R.
                np.testing.assert_allclose(recovered[k], original[k], rtol=0, atol=3e-16)
            else:
                np.testing.assert_array_equal(recovered[k], original[k], err_msg=k)
    u0 = jnp.asarray(random_input(51, 2, 5, 10))
    again = from_layers(back, norm="post", num_heads=2)
    assert rel_err(again(u0), model(u0)) <= 1e-14


@pytest.mark.parametrize(
    "changes, differ",
    [
        ({"stepper": Strang()}, {"stepper='strang' (standard: 'lie')"}),
        ({"steps_per_layer": 2}, {"steps_per_layer=2 (standard: 1)"}),
        ({"stepper": Lie(sub_solver="heun")}, {"sub_solver='heun' (standard: 'euler')"}),
        (
            {"stepper": Strang(), "steps_per_layer": 2},
            {"stepper='strang' (standard: 'lie')", "steps_per_layer=2 (standard: 1)"},
        ),
        # Parareal with fewer iterations than chunks: an approximation of the stack.
        (
            {"depth_parallel": Parareal(diffrax.Euler(), iterations=1, chunks=3)},
            {"depth_parallel='parareal' (standard: None)"},
        ),
    ],
    ids=["strang", "two-steps", "heun-sub-solver", "strang-two-steps", "parareal"],
)
def test_to_layers_refuses_a_rediscretised_model(changes, differ):
    """Re-discretised, the model is another function of its input, which its layers, read
    back as the standard stack, would not compute: to_layers refuses it, naming exactly
    the fields that differ; discretised back to Discretisation(), it gives the layers
    again."""
    layers = random_stack(52, 3, 6, 5)
    final = {"scale": np.full(6, 1.5), "bias": np.linspace(-1, 1, 6)}
    model = from_layers(layers, norm="pre", num_heads=2, activation="gelu", final_norm=final)
    other = rediscretise(model, **changes)
    u0 = jnp.asarray(random_input(52, 2, 4, 6))
    assert rel_err(other(u0), model(u0)) > 1e-4  # not the stack's function
    with pytest.raises(ValueError, match=r"to_layers writes the standard layer stack") as e:
        to_layers(other)
    named = set(re.findall(r"\w+=\S+ \(standard: [^)]*\)", str(e.value)))
    assert named == differ
    back = to_layers(rediscretise(other, Discretisation()))
    for original, recovered in zip(to_layers(model), back, strict=True):
        for k in LAYER_KEYS:
            np.testing.assert_array_equal(recovered[k], original[k], err_msg=k)


def test_to_layers_refuses_what_the_stack_cannot_hold():
    """CvT's convolutional projections, a feature spacing h_y other than 1, and layers
    of other than unit time are other functions of the input under the standard
    discretisation too: each was written as the stack without a word (the kernels
    dropped, the spacing and step lost). Each is refused, named."""
    import equinox as eqx
    import jax.random as jr

    from ocformer.controls import PiecewiseConstant
    from ocformer.models import ContinuousTransformer, with_conv_projections
    from ocformer.operators import Grid

    layers = random_stack(53, 3, 6, 5)
    model = from_layers(layers, norm="pre", num_heads=2, activation="gelu")
    u0 = jnp.asarray(random_input(53, 2, 4, 6))
    eps = model.layer_norm.eps
    cvt = with_conv_projections(
        model, token_grid=(2, 2), num_prefix=0, init_scale=0.5, key=jr.key(0)
    )
    longer = eqx.tree_at(
        lambda m: m.control, model, PiecewiseConstant(model.control.values, 0.0, 6.0)
    )
    spaced = ContinuousTransformer(
        model.control, norm="pre", num_heads=2, activation="gelu", ln_eps=eps, grid=Grid(h_y=0.5)
    )
    for other, named in [
        (cvt, "attention='ConvAttention' (standard: 'Attention')"),
        (longer, "layer step=2.0 (standard: 1.0)"),
        (spaced, "grid.h_y=0.5 (standard: 1.0)"),
    ]:
        assert rel_err(other(u0), model(u0)) > 1e-4  # not the stack's function
        with pytest.raises(ValueError, match=r"to_layers writes the standard layer stack") as e:
            to_layers(other)
        assert f"This model differs: {named};" in str(e.value), str(e.value)
    # The token spacing cancels from softmax attention: that model is the stack.
    tokens = ContinuousTransformer(
        model.control, norm="pre", num_heads=2, activation="gelu", ln_eps=eps, grid=Grid(h_x=0.5)
    )
    assert rel_err(tokens(u0), model(u0)) < 1e-12
    to_layers(tokens)
    # Nor does a shift in time: layers on [1.1, 4.1] are of unit time (to rounding).
    shifted = eqx.tree_at(lambda m: m.control, model, PiecewiseConstant(model.control.values, 1.1))
    assert shifted.control.interval[1] - 1.1 != 3.0  # the rounding that was refused
    to_layers(shifted)
