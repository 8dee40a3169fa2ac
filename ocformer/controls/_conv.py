"""Controls of attention with convolutional token projections (CvT)."""

import equinox as eqx
from jaxtyping import Array, Float


class ConvAttentionParams(eqx.Module):
    r"""The controls of ``ocformer.operators.ConvAttention`` at one time.

    The kernels and biases of ``AttentionParams`` (same names and meaning), plus one
    local kernel over the 2-D token grid per projection and feature:
    ``kq, kk, kv`` of shape (k, k, d), $\kappa^Q(\delta x, \xi)$ for offsets
    $|\delta x|_\infty \le (k - 1)/2$ (a depthwise convolution). A kernel that is 1 at
    the centre and 0 elsewhere gives back plain attention.
    """

    wq: Float[Array, "d d"]
    wk: Float[Array, "d d"]
    wv: Float[Array, "d d"]
    kq: Float[Array, "k k d"]
    kk: Float[Array, "k k d"]
    kv: Float[Array, "k k d"]
    wo: Float[Array, "d d"] | None = None
    bq: Float[Array, " d"] | None = None
    bk: Float[Array, " d"] | None = None
    bv: Float[Array, " d"] | None = None
    bo: Float[Array, " d"] | None = None
