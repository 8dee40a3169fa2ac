"""Random initial controls."""

from typing import Literal, get_args

import jax
import jax.numpy as jnp
import jax.random as jr

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
    if norm_affine not in NORM_AFFINES:
        raise ValueError(f"norm_affine must be one of {NORM_AFFINES}, got {norm_affine!r}.")
    if width < 1 or hidden < 1:
        raise ValueError(f"width and hidden must be >= 1, got {width}, {hidden}.")
    kq, kk, kv, ko, k1, k2 = jr.split(key, 6)

    def kernel(k, din, dout):
        return (init_scale / jnp.sqrt(din)) * jr.normal(k, (din, dout), dtype)

    def zeros(n):
        return jnp.zeros((n,), dtype) if biases else None

    shape = (width,) if norm_affine == "feature" else ()

    def norm():
        return NormParams(scale=jnp.ones(shape, dtype), bias=jnp.zeros(shape, dtype))

    w1 = kernel(k1, width, hidden) - jnp.eye(width, hidden, dtype=dtype)
    w2 = kernel(k2, hidden, width) - jnp.eye(hidden, width, dtype=dtype)
    return LayerParams(
        attention=AttentionParams(
            wq=kernel(kq, width, width),
            wk=kernel(kk, width, width),
            wv=kernel(kv, width, width),
            wo=kernel(ko, width, width) if output_map else None,
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
    keys = jr.split(key, num_layers)
    return jax.vmap(lambda k: init_layer_params(k, width, hidden, **kwargs))(keys)
