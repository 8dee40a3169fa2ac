"""Random initial controls."""

import inspect
from typing import Literal, get_args

import jax
import jax.core
import jax.numpy as jnp
import jax.random as jr
import numpy as np

from ._params import AttentionParams, FeedForwardParams, LayerParams, NormParams

# The shape of the layer-norm controls: a gain and bias per feature, or the paper's
# scalar sigma1, sigma2.
NormAffine = Literal["feature", "scalar"]
NORM_AFFINES: tuple[str, ...] = get_args(NormAffine)


def init_layer_params(
    key,
    width: int,
    hidden: int,
    *,
    biases: bool = True,
    output_map: bool = True,
    norm_affine: NormAffine = "feature",
    init_scale: float = 1.0,
    dtype=jnp.float32,
) -> LayerParams:
    """Controls for one layer, initialised as a standard Transformer layer would be.

    Kernels are drawn from N(0, init_scale^2 / fan_in); the feed-forward controls are
    W_j = A_j - L_j for such a draw A_j, so that at dt = 1 the maps A_j have the usual
    statistics. Biases start at zero, layer-norm sets at (sigma1, sigma2) = (0, 1).
    Every kernel gets its own key.

    Args:
        key: a ``jax.random`` key.
        width: d, the feature width.
        hidden: d_ff, the hidden width of the feed-forward maps.
        biases: include Q/K/V/output and feed-forward biases.
        output_map: include the output kernel W^O (else it is folded into W^V).
        norm_affine: ``"feature"`` (per-feature gain/bias) or ``"scalar"`` (the
            paper's sigma1, sigma2).
        init_scale: multiplies every kernel's standard deviation.
        dtype: floating dtype of the arrays.
    """
    _check(norm_affine, width, hidden)
    draws = _draws(key, width, hidden, output_map, dtype)
    return _assemble(draws, (), width, hidden, biases=biases, output_map=output_map,
                     norm_affine=norm_affine, init_scale=init_scale, dtype=dtype)  # fmt: skip


# The keyword arguments of init_layer_params, which init_stacked_params takes too.
_DEFAULTS = {
    name: p.default
    for name, p in inspect.signature(init_layer_params).parameters.items()
    if p.kind is p.KEYWORD_ONLY
}


def _check(norm_affine: str, width: int, hidden: int) -> None:
    if norm_affine not in NORM_AFFINES:
        raise ValueError(f"norm_affine must be one of {NORM_AFFINES}, got {norm_affine!r}.")
    if width < 1 or hidden < 1:
        raise ValueError(f"width and hidden must be >= 1, got {width}, {hidden}.")


def _draws(key, width: int, hidden: int, output_map: bool, dtype) -> dict:
    """The standard normal draws of one layer's kernels, one key each."""
    kq, kk, kv, ko, k1, k2 = jr.split(key, 6)
    draws = {
        "wq": jr.normal(kq, (width, width), dtype),
        "wk": jr.normal(kk, (width, width), dtype),
        "wv": jr.normal(kv, (width, width), dtype),
        "w1": jr.normal(k1, (width, hidden), dtype),
        "w2": jr.normal(k2, (hidden, width), dtype),
    }
    if output_map:
        draws["wo"] = jr.normal(ko, (width, width), dtype)
    return draws


def _assemble(
    draws: dict, lead: tuple, width: int, hidden: int, *, biases: bool, output_map: bool,
    norm_affine: str, init_scale: float, dtype,
) -> LayerParams:  # fmt: skip
    """The parameters from the draws (with ``lead``, the layer axis, in front).

    Called eagerly, everything but the draws is computed with NumPy and transferred with
    ``jax.device_put``: each eager jax operation (``jnp.asarray`` of a NumPy array too)
    would be a program of its own, compiled (or loaded from the compilation cache) on
    its first call, 21 of them for the default experiment. NumPy's float arithmetic
    rounds as XLA's does, so the values are bitwise ``(init_scale / jnp.sqrt(fan_in)) *
    draw``, ``- jnp.eye``, ``jnp.zeros`` and ``jnp.ones`` (``tests/test_controls_time.py``
    checks it). Under a transformation (the draws are tracers) that formula is traced."""
    traced = any(isinstance(d, jax.core.Tracer) for d in draws.values())
    xp = jnp if traced else np
    # jax.device_put transfers a NumPy array; jnp.asarray would compile a copy per shape.
    to_jax = jnp.asarray if traced else jax.device_put
    real = np.dtype(jax.dtypes.canonicalize_dtype(float))  # a weak Python float's dtype
    dtype = np.dtype(dtype)

    def kernel(name, fan_in, minus_identity=False):
        if traced:
            w = (init_scale / jnp.sqrt(fan_in)) * draws[name]
        else:
            scale = np.asarray(init_scale, real) / np.sqrt(np.asarray(fan_in, real))
            w = np.asarray(draws[name]) * scale.astype(dtype)
        if minus_identity:
            w = w - xp.eye(*w.shape[-2:], dtype=dtype)
        return to_jax(w)

    def const(fill, n):
        return to_jax(xp.full((*lead, *n), fill, dtype))

    def zeros(n):
        return const(0, (n,)) if biases else None

    shape = (width,) if norm_affine == "feature" else ()

    def norm():
        return NormParams(scale=const(1, shape), bias=const(0, shape))

    w1 = kernel("w1", width, minus_identity=True)
    w2 = kernel("w2", hidden, minus_identity=True)
    return LayerParams(
        attention=AttentionParams(
            wq=kernel("wq", width),
            wk=kernel("wk", width),
            wv=kernel("wv", width),
            wo=kernel("wo", width) if output_map else None,
            bq=zeros(width),
            bk=zeros(width),
            bv=zeros(width),
            bo=zeros(width) if output_map else None,
        ),
        norm1=norm(),
        feedforward=FeedForwardParams(weights=(w1, w2), biases=(zeros(hidden), zeros(width))),
        norm2=norm(),
    )


def init_stacked_params(key, num_layers: int, width: int, hidden: int, **kwargs) -> LayerParams:
    """``init_layer_params`` for each of ``num_layers`` layers, stacked on a leading
    axis (the values of a ``PiecewiseConstant`` control); one key per layer."""
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}.")
    options = {**_DEFAULTS, **kwargs}
    _check(options["norm_affine"], width, hidden)
    keys = jr.split(key, num_layers)
    output_map, dtype = options["output_map"], options["dtype"]
    draws = jax.vmap(lambda k: _draws(k, width, hidden, output_map, dtype))(keys)
    return _assemble(draws, (num_layers,), width, hidden, **options)
