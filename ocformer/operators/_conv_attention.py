"""Attention with convolutional token projections: CvT's Q/K/V as local integral
kernels over the 2-D token grid."""

import math
from typing import Any, ClassVar

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from .._counts import to_whole_number
from ..controls._conv import ConvAttentionParams
from ._grid import Grid, constant_in_x
from ._layernorm import wide_dtype


def local_transform(
    u: Float[Array, "*batch N d"],
    kernel: Float[Array, "k k d"],
    token_grid: tuple[int, int],
    num_prefix: int,
    h_x: float = 1.0,
) -> Float[Array, "*batch N d"]:
    r"""$(\kappa \star u)(x, \xi) = h_x \sum_{x'} \kappa(x' - x, \xi)\,u(x', \xi)$ over
    the grid tokens, zero outside the grid (a depthwise 'same' convolution); the first
    ``num_prefix`` tokens (class tokens, not on the grid) pass unchanged."""
    *batch, n, d = u.shape
    rows, cols = token_grid
    if n != num_prefix + rows * cols:
        raise ValueError(
            f"ConvAttention expects {num_prefix} prefix tokens plus a {rows} x {cols} grid "
            f"({num_prefix + rows * cols} tokens), got {n}."
        )
    k = kernel.shape[0]
    r = k // 2
    prefix, tokens = u[..., :num_prefix, :], u[..., num_prefix:, :]
    x = tokens.reshape(*batch, rows, cols, d)
    pad = [(0, 0)] * len(batch) + [(r, r), (r, r), (0, 0)]
    padded = jnp.pad(x, pad)
    # The k^2 shifted copies of the grid, weighted per feature: a depthwise 'same'
    # cross-correlation with the kernel read as (offset_row, offset_col, feature), i.e.
    # the local integral kernel itself, not its mirror image. Written as shifts rather
    # than a grouped convolution, which XLA runs (and differentiates) far slower on CPU.
    out = jnp.zeros_like(x)
    for a in range(k):
        for b in range(k):
            weight = kernel[a, b].astype(x.dtype).reshape((1,) * (x.ndim - 1) + (d,))
            out = out + weight * padded[..., a : a + rows, b : b + cols, :]
    if h_x != 1.0:
        out = h_x * out
    return jnp.concatenate([prefix, out.reshape(*batch, rows * cols, d)], axis=-2)


def _whole_numbers(grid) -> Any:
    """The entries of ``grid`` as ``to_whole_number`` gives them (``__check_init__``
    checks the result)."""
    return tuple(map(to_whole_number, grid))


class ConvAttention(eqx.Module):
    r"""Attention whose queries, keys and values read a locally smoothed state (CvT).

    $$Q(x, y) = h_y \int_{\Omega_y} W^Q(\xi, y)\,(\kappa^Q \star u)(x, \xi)\,d\xi + b^Q(y),
      \quad (\kappa \star u)(x, \xi) = \int_{\Omega_x} \kappa(x' - x, \xi)\,u(x', \xi)\,dx',$$
    likewise $K, V$, with $\kappa$ supported on a $k \times k$ neighbourhood of the 2-D
    token grid; then the softmax integral operator of ``Attention``. This is the
    convolutional projection of Wu et al., "CvT: Introducing Convolutions to Vision
    Transformers" (ICCV 2021) with stride 1 and without its batch norm: a depthwise
    convolution followed by the pointwise map $W$. Class tokens (the first
    ``num_prefix``) are not on the grid and are not convolved, as in CvT's last stage.

    Holds no parameters: they arrive as ``ConvAttentionParams``.

    Args:
        num_heads: number of heads H; must divide d.
        token_grid: (rows, columns) of the token grid.
        num_prefix: tokens before the grid (1 for a class token).
        grid: quadrature spacings.
    """

    num_heads: int = eqx.field(static=True, converter=to_whole_number)
    token_grid: tuple[int, int] = eqx.field(static=True, converter=_whole_numbers)
    num_prefix: int = eqx.field(default=1, static=True, converter=to_whole_number)
    grid: Grid = Grid()
    # Non-causal: the grid has no order in which a token may only see its predecessors.
    causal: ClassVar[bool] = False

    def __check_init__(self):
        if type(self.num_heads) is not int or self.num_heads < 1:  # not a bool
            raise ValueError(
                f"ConvAttention.num_heads must be a positive integer, got {self.num_heads!r}."
            )
        rows_cols = tuple(self.token_grid)
        if len(rows_cols) != 2 or not all(type(s) is int and s >= 1 for s in rows_cols):
            raise ValueError(
                f"ConvAttention.token_grid must be (rows, columns), got {self.token_grid!r}."
            )
        if type(self.num_prefix) is not int or self.num_prefix < 0:
            raise ValueError(
                f"ConvAttention.num_prefix must be an integer >= 0, got {self.num_prefix!r}."
            )

    def __call__(
        self,
        p: ConvAttentionParams,
        u: Float[Array, "*batch N d"],
        key_mask: Bool[Array, "*batch N"] | None = None,
    ) -> Float[Array, "*batch N d"]:
        if not isinstance(p, ConvAttentionParams):
            raise ValueError(
                "ConvAttention needs ConvAttentionParams (with the local kernels kq, kk, "
                f"kv), got {type(p).__name__}."
            )
        *batch, n, d = u.shape
        heads = self.num_heads
        if d % heads:
            raise ValueError(f"The feature width d={d} is not divisible by num_heads={heads}.")
        dh = d // heads
        h_x, h_y = self.grid.h_x, self.grid.h_y

        def project(kernel, w, b):  # (..., N, d) -> (..., H, N, dh)
            z = h_y * (local_transform(u, kernel, self.token_grid, self.num_prefix, h_x) @ w)
            if b is not None:
                z = z + constant_in_x(b, z.ndim)
            return jnp.swapaxes(z.reshape(*batch, n, heads, dh), -2, -3)

        q = project(p.kq, p.wq, p.bq)
        k = project(p.kk, p.wk, p.bk)
        v = project(p.kv, p.wv, p.bv)
        scale = h_y / math.sqrt(dh * h_y)
        s = jnp.einsum("...qc,...kc->...qk", q * scale, k)
        s = s.astype(wide_dtype(s.dtype))  # the softmax in >= float32
        if key_mask is not None:
            if key_mask.shape != (*batch, n):
                raise ValueError(f"key_mask has shape {key_mask.shape}, expected {(*batch, n)}.")
            km = jnp.broadcast_to(key_mask[..., None, None, :], s.shape)
            s = jnp.where(km, s, jnp.finfo(s.dtype).min)
        s = s - jnp.max(s, axis=-1, keepdims=True)
        e = jnp.exp(s)
        # gamma normalised by the integral over Omega_x; h_x cancels against the outer
        # quadrature, as in Attention.
        gamma = (e / jnp.sum(e, axis=-1, keepdims=True)).astype(v.dtype)
        z = jnp.einsum("...qk,...kc->...qc", gamma, v)
        z = jnp.swapaxes(z, -2, -3).reshape(*batch, n, d)
        if p.wo is not None:
            z = h_y * (z @ p.wo)
        if p.bo is not None:
            z = z + constant_in_x(p.bo, z.ndim)
        return z
