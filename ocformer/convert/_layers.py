"""Standard Transformer layer stacks in and out of the continuous model."""

import math
from collections.abc import Mapping, Sequence
from typing import overload

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from .._counts import whole_number
from ..controls._control import PiecewiseConstant, stack_layers, unstack_layers
from ..controls._params import AttentionParams, FeedForwardParams, LayerParams, NormParams
from ..models._transformer import ContinuousTransformer, NormPosition
from ..operators import Activation, ConvAttention

# What makes a model the standard layer stack, in the plain values of its ``choices()``:
# the stepper and grid of ``Discretisation()`` (the Lie scheme, one explicit-Euler step
# per layer, constant steps, solved serially in depth), the split formulation, one
# parameter set per layer. Only this discretisation *is* the stack that from_layers read
# and to_layers writes.
STANDARD_LAYER_STACK: dict[str, object] = {
    "stepper": "lie",
    "sub_solver": "euler",
    "steps_per_layer": 1,
    "stepsize": "constant",
    "depth_parallel": None,
    "formulation": "split",
    "controls": "piecewise_constant",
}

LAYER_KEYS: tuple[str, ...] = (
    "wq", "wk", "wv", "wo", "bq", "bk", "bv", "bo",
    "w1", "b1", "w2", "b2",
    "ln1_scale", "ln1_bias", "ln2_scale", "ln2_bias",
)  # fmt: skip
# Arrays that may be None: absent from the layer (no output map, no bias).
OPTIONAL_KEYS: frozenset[str] = frozenset({"wo", "bq", "bk", "bv", "bo", "b1", "b2"})


def _expected_shapes(d: int, d_ff: int) -> dict[str, tuple[tuple[int, ...], ...]]:
    sq, vec, ln = ((d, d),), ((d,),), ((d,), ())
    return {
        "wq": sq, "wk": sq, "wv": sq, "wo": sq,
        "bq": vec, "bk": vec, "bv": vec, "bo": vec,
        "w1": ((d, d_ff),), "b1": ((d_ff,),), "w2": ((d_ff, d),), "b2": vec,
        "ln1_scale": ln, "ln1_bias": ln, "ln2_scale": ln, "ln2_bias": ln,
    }  # fmt: skip


def _check_layers(layers: Sequence[Mapping]) -> tuple[int, int]:
    if isinstance(layers, (Mapping, str)) or not isinstance(layers, Sequence) or not layers:
        raise ValueError(
            "`layers` must be a non-empty list with one dict of arrays per layer "
            f"(keys {', '.join(LAYER_KEYS)}); got {type(layers).__name__}."
        )
    d = d_ff = None
    for i, layer in enumerate(layers):
        if not isinstance(layer, Mapping):
            raise ValueError(f"layers[{i}] must be a dict of arrays, got {type(layer).__name__}.")
        missing = [k for k in LAYER_KEYS if k not in layer]
        unknown = [k for k in layer if k not in LAYER_KEYS]
        if missing or unknown:
            raise ValueError(
                f"layers[{i}] has missing keys {missing} and unknown keys {unknown}. "
                f"Expected exactly: {', '.join(LAYER_KEYS)} (use None for an absent "
                f"{'/'.join(sorted(OPTIONAL_KEYS))})."
            )
        for k in LAYER_KEYS:
            if layer[k] is None and k not in OPTIONAL_KEYS:
                raise ValueError(f"layers[{i}]['{k}'] is None, but {k} is required.")
        if d is None:
            wq, w1 = np.shape(layer["wq"]), np.shape(layer["w1"])
            if len(wq) != 2 or len(w1) != 2:
                raise ValueError(
                    f"layers[0]['wq'] and ['w1'] must be matrices; got shapes {wq}, {w1}."
                )
            d, d_ff = wq[0], w1[1]
        assert d_ff is not None  # set together with d, from layers[0]
        expected = _expected_shapes(d, d_ff)
        for k in LAYER_KEYS:
            if layer[k] is None:
                continue
            kind = _dtype(layer[k])
            if not any(jnp.issubdtype(kind, t) for t in (jnp.floating, jnp.integer, jnp.bool_)):
                raise ValueError(
                    f"layers[{i}]['{k}'] has dtype {kind}; give real numbers (a float, "
                    "integer or bool array): a complex part would be dropped, and strings "
                    "or objects are no weights."
                )
            shape = tuple(np.shape(layer[k]))
            if shape not in expected[k]:
                allowed = " or ".join(str(s) for s in expected[k])
                raise ValueError(
                    f"layers[{i}]['{k}'] has shape {shape}, expected {allowed} "
                    f"(d={d}, d_ff={d_ff} from layers[0])."
                )
    for k in OPTIONAL_KEYS:
        present = {layer[k] is None for layer in layers}
        if len(present) > 1:
            raise ValueError(
                f"'{k}' is None in some layers and an array in others; every layer of "
                "a stack must have the same structure."
            )
    for k in ("ln1_scale", "ln1_bias", "ln2_scale", "ln2_bias"):
        if len({np.ndim(layer[k]) for layer in layers}) > 1:
            raise ValueError(f"'{k}' must be scalar in every layer or a vector in every layer.")
    assert d is not None and d_ff is not None
    return d, d_ff


@overload
def _array(x: None, dtype) -> None: ...
@overload
def _array(x: object, dtype) -> Array: ...
def _array(x, dtype):
    return None if x is None else jnp.asarray(x, dtype=dtype)


def _layer_params(layer: Mapping, dtype) -> LayerParams:
    d, d_ff = np.shape(layer["w1"])
    a = lambda k: _array(layer[k], dtype)  # noqa: E731
    # A_j = L_j + W_j: the controls are the deviations from the fixed maps.
    w1 = a("w1") - jnp.eye(d, d_ff, dtype=dtype)
    w2 = a("w2") - jnp.eye(d_ff, d, dtype=dtype)
    return LayerParams(
        attention=AttentionParams(
            wq=a("wq"),
            wk=a("wk"),
            wv=a("wv"),
            wo=a("wo"),
            bq=a("bq"),
            bk=a("bk"),
            bv=a("bv"),
            bo=a("bo"),
        ),  # fmt: skip
        norm1=NormParams(scale=a("ln1_scale"), bias=a("ln1_bias")),
        feedforward=FeedForwardParams(weights=(w1, w2), biases=(a("b1"), a("b2"))),
        norm2=NormParams(scale=a("ln2_scale"), bias=a("ln2_bias")),
    )


def _dtype(value) -> np.dtype:
    """An array's own dtype (a traced array has one: from_layers runs under jax.grad,
    jit and vmap); a list or number's as NumPy reads it."""
    return value.dtype if hasattr(value, "dtype") else np.asarray(value).dtype


def _dtype_of(layers) -> np.dtype:
    dtypes = {_dtype(v) for layer in layers for v in layer.values() if v is not None}
    dtype = jnp.result_type(*dtypes)
    if not jnp.issubdtype(dtype, jnp.floating):  # NumPy's test misses bfloat16
        dtype = np.dtype(np.float32)
    return jnp.zeros((), dtype).dtype  # canonical: float32 unless x64 is enabled


def from_layers(
    layers: Sequence[Mapping],
    *,
    norm: NormPosition = "post",
    num_heads: int,
    activation: Activation = "relu",
    causal: bool = False,
    ln_eps: float = 1e-5,
    final_norm: Mapping | NormParams | None = None,
) -> ContinuousTransformer:
    """A standard Transformer stack as the continuous model under the Lie scheme.

    Args:
        layers: one dict per layer with the arrays ``wq, wk, wv, wo`` (d x d),
            ``bq, bk, bv, bo`` (d), ``w1`` (d x d_ff), ``b1`` (d_ff), ``w2`` (d_ff x d),
            ``b2`` (d), ``ln1_scale, ln1_bias, ln2_scale, ln2_bias`` (d, or scalars for
            the paper's set S1(sigma1, sigma2)); weights act on the right (``u @ w``).
            ``wo`` and the biases may be None (absent).
        norm: ``"post"`` (Vaswani et al., BERT) or ``"pre"`` (GPT-2, ViT).
        num_heads: attention heads; must divide d.
        activation: ``"relu"``, ``"gelu"`` (exact erf) or ``"gelu_tanh"``.
        causal: causal self-attention.
        ln_eps: LayerNorm epsilon (0 for the paper's exact projection).
        final_norm: None, or ``{"scale": (d,), "bias": (d,)}`` (or a ``NormParams``,
            as a model's ``final_norm``) applied at t = T.

    The model's dtype is that of the arrays (float32 for integers), as JAX holds it:
    NumPy's default float64 arrays give a float32 model unless 64-bit JAX is on
    (``jax.config.update("jax_enable_x64", True)``, for float64 exactness).

    Returns:
        A ``ContinuousTransformer`` with piecewise-constant controls on t in [0, L]
        (layer n on [n, n+1)), the Lie scheme and one step per layer.

    Raises:
        ValueError: a key is missing or unknown, an array has the wrong shape, the
            heads do not divide d, or an option is out of range.
    """
    d, _ = _check_layers(layers)
    heads = whole_number(num_heads)
    if heads is None or heads < 1 or d % heads:
        raise ValueError(
            f"num_heads={num_heads!r} must be a positive integer dividing d={d} "
            f"(e.g. one of {[h for h in range(1, d + 1) if d % h == 0][:8]})."
        )
    num_heads = heads
    if isinstance(ln_eps, bool) or not (
        isinstance(ln_eps, int | float | np.floating) and math.isfinite(ln_eps) and ln_eps >= 0
    ):
        raise ValueError(f"ln_eps must be a number >= 0, got {ln_eps!r}.")
    dtype = _dtype_of(layers)
    control = PiecewiseConstant(stack_layers([_layer_params(layer, dtype) for layer in layers]))
    final = None
    if isinstance(final_norm, NormParams):
        final_norm = {"scale": final_norm.scale, "bias": final_norm.bias}
    if final_norm is not None:
        if not isinstance(final_norm, Mapping) or set(final_norm) != {"scale", "bias"}:
            raise ValueError(
                "final_norm must be a dict with keys 'scale' and 'bias' (or a NormParams), "
                f"got {sorted(final_norm) if isinstance(final_norm, Mapping) else final_norm!r}."
            )
        for k in ("scale", "bias"):
            if np.shape(final_norm[k]) not in ((d,), ()):
                raise ValueError(
                    f"final_norm['{k}'] has shape {np.shape(final_norm[k])}, expected ({d},) or ()."
                )
        final = NormParams(
            scale=_array(final_norm["scale"], dtype), bias=_array(final_norm["bias"], dtype)
        )
    return ContinuousTransformer(
        control,
        norm=norm,
        num_heads=num_heads,
        causal=causal,
        activation=activation,
        ln_eps=float(ln_eps),
        final_norm=final,
    )


def nonstandard_fields(model: ContinuousTransformer) -> dict[str, tuple]:
    """``{field: (the model's value, the standard value)}`` for each field of
    ``model.choices()`` in which it differs from ``STANDARD_LAYER_STACK``, and for what
    else the stack cannot hold: CvT's convolutional projections (``attention``), a
    feature spacing ``grid.h_y`` other than 1, and layers of other than unit time (the
    control's ``(t1 - t0) / L``, the explicit-Euler step). Empty when the model is the
    standard layer stack. (The token spacing ``h_x`` cancels from softmax attention.)"""
    choices = model.choices()
    out: dict[str, tuple] = {
        name: (getattr(choices, name), standard)
        for name, standard in STANDARD_LAYER_STACK.items()
        if getattr(choices, name) != standard
    }
    if isinstance(model.attention, ConvAttention):
        out["attention"] = ("ConvAttention", "Attention")
    for operator in ("attention", "feedforward"):
        h_y = getattr(model, operator).grid.h_y
        if h_y != 1.0:
            out["grid.h_y"] = (h_y, 1.0)
    t0, t1 = model.control.interval
    step = (t1 - t0) / model.num_layers  # PiecewiseConstant(values, t0) rounds t0 + L
    if not math.isclose(step, 1.0, rel_tol=1e-9):
        out["layer step"] = (step, 1.0)
    return out


def check_standard(model: ContinuousTransformer, who: str) -> None:
    """Refuse to write ``model`` as a layer stack unless it is the standard one.

    A layer stack is read back (by ``from_layers``, by ``transformers``) as the standard
    discretisation; written from any other, it would silently be a different function.

    Raises:
        ValueError: ``model`` is not a ``ContinuousTransformer``, or differs from the
            standard layer stack; the message names each field that differs.
    """
    if not isinstance(model, ContinuousTransformer):
        raise ValueError(f"{who} takes a ContinuousTransformer, got {type(model).__name__}.")
    differ = nonstandard_fields(model)
    if not differ:
        return
    listed = ", ".join(f"{k}={v!r} (standard: {s!r})" for k, (v, s) in differ.items())
    fixes = []
    if differ.keys() & STANDARD_LAYER_STACK.keys() - {"formulation", "controls"}:
        fixes.append("ocformer.models.rediscretise(model, Discretisation())")
    if "formulation" in differ:
        fixes.append("ocformer.models.reformulate(model, formulation='split')")
    if "controls" in differ:
        fixes.append("piecewise-constant controls sampled on the layer grid")
    if "layer step" in differ:
        fixes.append("controls of unit layer time (PiecewiseConstant(values))")
    back = f", or bring it back to the standard with {' and '.join(fixes)}" if fixes else ""
    raise ValueError(
        f"{who} writes the standard layer stack: the Lie scheme with one explicit-Euler "
        "step per layer at constant steps, the split formulation and piecewise-constant "
        "controls (one parameter set per layer of unit time), with pointwise attention "
        f"projections and unit feature spacing. This model differs: {listed}; the stack "
        f"would not reproduce it. Write the model it was derived from{back}."
    )


def to_layers(model: ContinuousTransformer) -> list[dict]:
    """The inverse of ``from_layers``: the plain per-layer layout, as numpy arrays.

    Needs the standard layer stack (``STANDARD_LAYER_STACK``: the Lie scheme, one
    explicit-Euler step per layer, the split formulation, piecewise-constant controls)
    with two feed-forward maps: under any other discretisation the layers would not
    reproduce the model. ``w1 = E + W_1`` and ``w2 = R + W_2`` are reassembled, so a
    round trip is exact up to one rounding of the diagonal of those two kernels. The
    layers only: the keyword options of ``from_layers`` (``norm``, ``num_heads``,
    ``final_norm`` from ``model.final_norm``, ...) are the model's, to be given again.

    Raises:
        ValueError: ``model`` is discretised otherwise (the fields that differ are
            named), or has other than two feed-forward maps.
    """
    check_standard(model, "to_layers")
    assert isinstance(model.control, PiecewiseConstant)  # "controls" is standard
    out = []
    for p in unstack_layers(model.control.values):
        if len(p.feedforward.weights) != 2:
            raise ValueError(
                f"to_layers supports two feed-forward maps, got {len(p.feedforward.weights)}."
            )
        w1, w2 = p.feedforward.weights
        b1, b2 = p.feedforward.biases
        np_ = lambda x: None if x is None else np.asarray(x)  # noqa: E731
        att = p.attention
        out.append(
            {
                "wq": np_(att.wq),
                "wk": np_(att.wk),
                "wv": np_(att.wv),
                "wo": np_(att.wo),
                "bq": np_(att.bq),
                "bk": np_(att.bk),
                "bv": np_(att.bv),
                "bo": np_(att.bo),
                "w1": np.asarray(w1 + jnp.eye(*w1.shape, dtype=w1.dtype)),
                "b1": np_(b1),
                "w2": np.asarray(w2 + jnp.eye(*w2.shape, dtype=w2.dtype)),
                "b2": np_(b2),
                "ln1_scale": np_(p.norm1.scale),
                "ln1_bias": np_(p.norm1.bias),
                "ln2_scale": np_(p.norm2.scale),
                "ln2_bias": np_(p.norm2.bias),
            }  # fmt: skip
        )
    return out
