"""The values of the controls theta(t) at one time (one layer's parameters).

These are plain containers of arrays. A control (``AbstractControl``) maps a time t
to one of these; the operators read them. Operators never own parameters.
"""

import equinox as eqx
from jaxtyping import Array, Float


class AttentionParams(eqx.Module):
    r"""Kernels and biases of the attention operator at one time.

    Integral transforms in the feature variable, acting on the right:
    $Q = h_y\,u W^Q + b^Q$, likewise $K, V$; the output transform $W^O, b^O$.
    ``wo is None`` means $W^O$ is folded into $W^V$ (the paper's class). A ``None``
    bias is absent (not a zero array), so it is neither computed nor trained.
    """

    wq: Float[Array, "d d"]
    wk: Float[Array, "d d"]
    wv: Float[Array, "d d"]
    wo: Float[Array, "d d"] | None = None
    bq: Float[Array, " d"] | None = None
    bk: Float[Array, " d"] | None = None
    bv: Float[Array, " d"] | None = None
    bo: Float[Array, " d"] | None = None


class NormParams(eqx.Module):
    r"""The target of the layer-norm projection: the set $S_1(\sigma_1, \sigma_2)$.

    ``scale`` is $\sigma_2$ and ``bias`` is $\sigma_1$. Scalars (shape ``()``) give the
    paper's set; per-feature vectors (shape ``(d,)``) give the projection onto
    $S_1(0, 1)$ followed by an explicit affine sub-step (a standard LayerNorm's
    gain and bias).
    """

    scale: Float[Array, "*d"]
    bias: Float[Array, "*d"]


class FeedForwardParams(eqx.Module):
    r"""The integral maps $W_j$ and biases $b_j$ of the feed-forward operator.

    ``weights[0]`` is ``(d, dff)``, the middle ones ``(dff, dff)``, the last
    ``(dff, d)``. The full maps of a standard FFN are $A_j = L_j + W_j$ with the
    fixed lifting/identity/restriction $L_j$ (see ``FeedForward``).
    """

    weights: tuple[Float[Array, "din dout"], ...]
    biases: tuple[Float[Array, " dout"] | None, ...]


class LayerParams(eqx.Module):
    """All controls of the model at one time: theta(t).

    ``norm1`` and ``norm2`` are the two layer-norm sets (post-LN: after attention and
    after the feed-forward part; pre-LN: inside the attention and feed-forward terms).
    """

    attention: AttentionParams
    norm1: NormParams
    feedforward: FeedForwardParams
    norm2: NormParams
