"""Convolutional token projections (CvT) on a continuous Transformer."""

import equinox as eqx
import jax.numpy as jnp
import jax.random as jr

from ..controls._control import PiecewiseConstant
from ..controls._conv import ConvAttentionParams
from ..operators import ConvAttention
from ._transformer import ContinuousTransformer


def with_conv_projections(
    transformer: ContinuousTransformer,
    *,
    token_grid: tuple[int, int],
    kernel_size: int = 3,
    num_prefix: int = 1,
    key=None,
    init_scale: float = 0.0,
) -> ContinuousTransformer:
    r"""``transformer`` with CvT's convolutional Q/K/V projections.

    The attention operator becomes ``ConvAttention`` (local integral kernels over the
    ``token_grid`` before the pointwise maps W^Q, W^K, W^V), and every layer's controls
    gain the kernels ``kq, kk, kv`` of shape (k, k, d): the unit kernel (1 at the
    centre, so the model starts as the plain one) plus N(0, init_scale^2 / k^2) noise,
    a separate key per kernel and layer.

    ``rediscretise`` and ``refine`` keep the operator and its kernels (they replace only
    the discretisation); applied to a model that already has kernels, this function
    keeps them.

    Args:
        transformer: a ``ContinuousTransformer`` with piecewise-constant controls.
        token_grid: (rows, columns) of the token grid after the ``num_prefix`` tokens.
        kernel_size: k, odd.
        num_prefix: class tokens before the grid, not convolved.
        key: a ``jax.random`` key (needed when ``init_scale > 0``).
        init_scale: standard deviation scale of the kernels' noise.

    Raises:
        ValueError: controls that are not piecewise constant, an even kernel size, or
            noise without a key.
    """
    control = transformer.control
    if not isinstance(control, PiecewiseConstant):
        raise ValueError(
            "with_conv_projections needs piecewise-constant controls, got "
            f"{type(control).__name__}."
        )
    if not (isinstance(kernel_size, int) and kernel_size >= 1 and kernel_size % 2 == 1):
        raise ValueError(f"kernel_size must be a positive odd integer, got {kernel_size!r}.")
    if init_scale > 0 and key is None:
        raise ValueError("init_scale > 0 draws random kernels: pass key=jax.random.key(...).")
    att = control.values.attention
    if isinstance(att, ConvAttentionParams):
        kernels = (att.kq, att.kk, att.kv)
    else:
        num_layers, d = att.wq.shape[0], att.wq.shape[-1]
        k = kernel_size
        unit = jnp.zeros((num_layers, k, k, d), att.wq.dtype).at[:, k // 2, k // 2].set(1)
        keys = (None,) * 3
        if init_scale > 0:
            assert key is not None  # checked above
            keys = tuple(jr.split(key, 3))
        kernels = tuple(
            unit
            if sub is None
            else unit + (init_scale / k) * jr.normal(sub, unit.shape, unit.dtype)
            for sub in keys
        )
    params = ConvAttentionParams(
        wq=att.wq, wk=att.wk, wv=att.wv, kq=kernels[0], kk=kernels[1], kv=kernels[2],
        wo=att.wo, bq=att.bq, bk=att.bk, bv=att.bv, bo=att.bo,
    )  # fmt: skip
    operator = ConvAttention(
        num_heads=transformer.attention.num_heads,
        token_grid=(int(token_grid[0]), int(token_grid[1])),
        num_prefix=num_prefix,
        grid=transformer.attention.grid,
    )
    out = eqx.tree_at(lambda m: m.control.values.attention, transformer, params)
    return eqx.tree_at(lambda m: m.attention, out, operator)
