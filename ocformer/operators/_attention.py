"""Attention as a non-local integral operator over tokens."""

import math
from typing import Literal, get_args

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float

from .._counts import to_whole_number
from ..controls._params import AttentionParams
from ._grid import Grid, constant_in_x
from ._layernorm import wide_dtype

# Dtypes for which the score softmax may run in float32: jax.nn.dot_product_attention
# always computes it in float32, which would round a float64 model to single precision.
_FUSED_DTYPES = (np.dtype(np.float32), np.dtype(jnp.bfloat16), np.dtype(np.float16))
# What cuDNN's fused attention kernel takes: half-precision states, head widths a
# multiple of 8 up to 128.
_CUDNN_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(np.float16))
AttentionKernel = Literal["xla", "cudnn"]
ATTENTION_KERNELS: tuple[str, ...] = get_args(AttentionKernel)


def _library_kernel_takes(dtype) -> bool:
    """Whether jax.nn.dot_product_attention computes this state's attention. Not in
    float64 (above), and not in float16 on CPU, whose XLA backend has no float16 x
    float16 -> float32 product ("precision 'F16_F16_F32' is not supported by dot_general
    on CPU"); the integral form computes the same operator there."""
    if dtype == np.float16 and jax.default_backend() == "cpu":
        return False
    return dtype in _FUSED_DTYPES


def _transform(u, w, b, h_y: float):
    # An integral transform in y on the grid: h_y * sum_xi u(x, xi) W(xi, y) (+ b(y)).
    out = u @ w
    if h_y != 1.0:
        out = h_y * out
    if b is not None:
        out = out + constant_in_x(b, out.ndim)
    return out


class Attention(eqx.Module):
    r"""The attention operator $\mathcal{A}(u; \theta)$.

    $$\mathcal{A}(u)(x, y) = \sum_h \int_{\Omega_x} \gamma_h(x, x')
      \langle V_h(x', \cdot), W^O_h(\cdot, y)\rangle \,dx' + b^O(y),$$
    $$\gamma_h(x, x') = \frac{\exp s_h(x, x')}{\int_{\Omega_x} \exp s_h(x, x'')\,dx''},
      \qquad s_h(x, x') = \frac{\langle Q_h(x, \cdot), K_h(x', \cdot)\rangle_{\Omega_{y,h}}}
      {\sqrt{|\Omega_{y,h}|}},$$
    with $Q, K, V$ affine integral transforms in $y$ and $\Omega_{y,h}$ the feature
    sub-domain of head $h$ ($|\Omega_{y,h}| = h_y\,d/H$). Causal attention restricts
    the $x'$-integral and its normaliser to $x' \le x$; a key mask removes tokens from
    both. (Tai, Liu, Li, Chan, arXiv 2510.03989, term I; heads, biases and $W^O$ are
    ocformer's extension.)

    The operator holds no parameters: they arrive as ``AttentionParams``.

    Args:
        num_heads: number of heads H; must divide the feature width d.
        causal: restrict to $x' \le x$.
        grid: quadrature spacings.
        kernel: ``"xla"`` (default) or ``"cudnn"``: with unit spacings, where the
            operator is scaled dot-product attention, ``"cudnn"`` computes it with
            cuDNN's fused (flash) kernel on an NVIDIA GPU for bfloat16/float16 states
            without a key mask and with head widths a multiple of 8 up to 128; every
            other case (CPU, float32, float64, masks) is computed as with ``"xla"``.
    """

    num_heads: int = eqx.field(static=True, converter=to_whole_number)
    causal: bool = eqx.field(default=False, static=True)
    grid: Grid = Grid()
    kernel: str = eqx.field(default="xla", static=True)

    def __check_init__(self):
        if type(self.num_heads) is not int or self.num_heads < 1:  # not a bool
            raise ValueError(
                f"Attention.num_heads must be a positive integer, got {self.num_heads!r}."
            )
        if not isinstance(self.causal, bool):
            raise ValueError(f"Attention.causal must be True or False, got {self.causal!r}.")
        if self.kernel not in ATTENTION_KERNELS:
            raise ValueError(
                f"Attention.kernel must be one of {ATTENTION_KERNELS}, got {self.kernel!r}."
            )

    def __call__(
        self,
        p: AttentionParams,
        u: Float[Array, "*batch N d"],
        key_mask: Bool[Array, "*batch N"] | None = None,
    ) -> Float[Array, "*batch N d"]:
        *batch, n, d = u.shape
        heads = self.num_heads
        if d % heads:
            raise ValueError(
                f"The feature width d={d} is not divisible by num_heads={heads}; each "
                "head needs an equal feature sub-domain. Choose num_heads dividing d."
            )
        h_x, h_y = self.grid.h_x, self.grid.h_y
        if key_mask is not None and key_mask.shape != (*batch, n):
            raise ValueError(
                f"key_mask has shape {key_mask.shape}, expected {(*batch, n)} "
                "(the batch axes and the token axis of the state)."
            )
        if h_x == 1.0 and h_y == 1.0 and _library_kernel_takes(u.dtype):
            # Unit spacings: the quadratures are plain sums and the score scale is
            # 1/sqrt(dh), which is standard scaled dot-product attention, so the library
            # kernel (fused on accelerators) computes the same operator. Otherwise, and
            # in float64, the integral-operator form below is evaluated literally.
            z = self._dot_product_attention(p, u, key_mask)
        else:
            z = self._integral_form(p, u, key_mask)
        if p.wo is not None:
            z = _transform(z, p.wo, None, h_y)
        if p.bo is not None:
            z = z + constant_in_x(p.bo, z.ndim)
        return z

    def _dot_product_attention(self, p: AttentionParams, u, key_mask):
        *batch, n, d = u.shape
        heads = self.num_heads
        # One (d, 3d) product for Q, K and V instead of three (d, d) ones.
        w = jnp.concatenate([p.wq, p.wk, p.wv], axis=-1)
        biases = (p.bq, p.bk, p.bv)
        b = None
        if any(x is not None for x in biases):
            b = jnp.concatenate([jnp.zeros((d,), u.dtype) if x is None else x for x in biases])
        qkv = _transform(u, w, b, 1.0).reshape(-1, n, 3, heads, d // heads)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        mask = None if key_mask is None else key_mask.reshape(-1, 1, 1, n)
        # q, k and v share one dtype; the library's XLA kernel promotes it with float32
        # for its scores through jnp.promote_types, which refuses a bfloat16 query under
        # strict dtype promotion, so its own rule runs under the standard one.
        with jax.numpy_dtype_promotion("standard"):
            z = jax.nn.dot_product_attention(
                q,
                k,
                v,
                mask=mask,
                is_causal=self.causal,
                implementation=self._implementation(u, mask),
            )
        return z.reshape(*batch, n, d)

    def _implementation(self, u, mask) -> Literal["cudnn"] | None:
        dh = u.shape[-1] // self.num_heads
        fused = (
            self.kernel == "cudnn"
            and jax.default_backend() == "gpu"
            and u.dtype in _CUDNN_DTYPES
            and mask is None
            and dh % 8 == 0
            and dh <= 128
        )
        return "cudnn" if fused else None

    def _integral_form(self, p: AttentionParams, u, key_mask):
        *batch, n, d = u.shape
        heads = self.num_heads
        dh = d // heads
        h_x, h_y = self.grid.h_x, self.grid.h_y

        def split(z):  # (..., N, d) -> (..., H, N, dh)
            return jnp.swapaxes(z.reshape(*batch, n, heads, dh), -2, -3)

        q = split(_transform(u, p.wq, p.bq, h_y))
        k = split(_transform(u, p.wk, p.bk, h_y))
        v = split(_transform(u, p.wv, p.bv, h_y))
        # <Q_h(x), K_h(x')> over the head's sub-domain, scaled by 1/sqrt(|Omega_y,h|).
        scale = h_y / math.sqrt(dh * h_y)
        s = jnp.einsum("...qc,...kc->...qk", q * scale, k)
        keep = None
        if self.causal:
            keep = jnp.broadcast_to(jnp.tril(jnp.ones((n, n), dtype=bool)), s.shape)
        if key_mask is not None:
            km = jnp.broadcast_to(key_mask[..., None, None, :], s.shape)
            keep = km if keep is None else jnp.logical_and(keep, km)
        # The softmax in float32 or wider: half-precision scores would round the
        # normaliser (jax.nn.dot_product_attention does the same on the fused path).
        s = s.astype(wide_dtype(s.dtype))
        if keep is not None:
            s = jnp.where(keep, s, jnp.finfo(s.dtype).min)
        s = s - jnp.max(s, axis=-1, keepdims=True)
        e = jnp.exp(s)
        # Softmax normalised by the integral over Omega_x; h_x cancels against the
        # quadrature of the outer x'-integral, but is kept so that the discretisation
        # is the literal one (and its invariance is testable).
        if h_x != 1.0:
            gamma = (e / (h_x * jnp.sum(e, axis=-1, keepdims=True))).astype(v.dtype)
            z = h_x * jnp.einsum("...qk,...kc->...qc", gamma, v)
        else:
            gamma = (e / jnp.sum(e, axis=-1, keepdims=True)).astype(v.dtype)
            z = jnp.einsum("...qk,...kc->...qc", gamma, v)
        return jnp.swapaxes(z, -2, -3).reshape(*batch, n, d)
