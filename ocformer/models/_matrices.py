r"""The roles of a model's parameters: which are weight matrices.

Decoupled weight decay, $\theta \leftarrow \theta - \eta\,(u + \lambda\,\theta)$, is
usually applied to the weight matrices of a Transformer only: the maps of attention and
of the feed-forward part, the symbol and patch embeddings and the readout, while the
biases, the layer-norm gains and biases, the position tables and the class token keep
their plain update (GPT-2, BERT and ViT training as Hugging Face and timm set them up).
``weight_matrices`` marks those leaves in a model's parameter tree, as ``optax.adamw``
takes it for its ``mask``.

The role of a leaf is read from the module that holds it, never from its number of
axes: every control carries a leading axis (layers, pieces of a piecewise-linear
control, coefficients of a basis), so a bias of a piecewise-constant control is 2-D
and a kernel of a constant (tied) control is 2-D too.
"""

from collections.abc import Callable

import equinox as eqx
import jax.tree_util as jtu

from ..controls import AttentionParams, ConvAttentionParams, FeedForwardParams, NormParams
from ._embedding import (
    PatchEmbedding,
    Pooler,
    Readout,
    TiedReadout,
    TokenEmbedding,
    TokenTypeEmbedding,
)

# The fields of each parameter module that hold weight matrices: the linear maps of the
# equation and of its embedding and readout. Every other field of these modules (biases,
# layer-norm targets, position tables, the class token) is not one. The feed-forward
# controls W_j are the deviations of the maps from the fixed lifting and restriction,
# and CvT's depthwise kernels kq, kk, kv are linear maps of the token grid (timm decays
# its convolution weights likewise). The token-type table of BERT is a symbol table.
_MATRICES: dict[type, tuple[str, ...]] = {
    AttentionParams: ("wq", "wk", "wv", "wo"),
    ConvAttentionParams: ("wq", "wk", "wv", "wo", "kq", "kk", "kv"),
    FeedForwardParams: ("weights",),
    NormParams: (),
    TokenEmbedding: ("tokens",),
    TokenTypeEmbedding: ("tokens", "token_types"),
    PatchEmbedding: ("weight",),
    Readout: ("weight",),
    Pooler: ("weight",),
    TiedReadout: ("tokens",),
}


def _has_role(node) -> bool:
    return type(node) in _MATRICES


def weight_matrices(tree):
    r"""A tree of bools shaped as ``tree``: True at each weight matrix, False elsewhere.

    ``tree`` is a model (a ``SequenceModel``, a ``ContinuousTransformer``, ...) or a
    tree shaped as one: its parameters (``eqx.filter(model, eqx.is_inexact_array)``),
    gradients or updates; a leaf that is not a floating array is not a parameter and
    is marked False. The weight matrices are the attention kernels
    $W^Q, W^K, W^V, W^O$ (with CvT's convolutional kernels $\kappa^Q, \kappa^K,
    \kappa^V$), the feed-forward controls $W_j$, the symbol table of the embedding (and
    BERT's token-type table; GPT-2's tied readout reads it), the patch map of a ViT, and
    the weight of the readout or pooler. Not: the attention and feed-forward biases,
    the layer-norm targets $\sigma_1, \sigma_2$ (every layer's and the final norm's,
    and BERT's embedding norm), the biases of the patch map and of the readout, the
    position tables and the class token.

    Raises:
        ValueError: a floating array of ``tree`` held by no module of known role (the
            message gives its path).
    """

    def mark(path, node):
        if _has_role(node):
            matrices = _MATRICES[type(node)]
            # The first key below the module is the field that holds the leaf.
            return jtu.tree_map_with_path(lambda p, _: p[0].name in matrices, node)
        if not eqx.is_inexact_array(node):
            return False  # not a parameter (a model's static numbers, an index table)
        known = ", ".join(sorted(t.__name__ for t in _MATRICES))
        raise ValueError(
            "weight_matrices reads the role of each parameter from the module that holds "
            f"it ({known}); the floating array at {jtu.keystr(path) or 'the root'} "
            f"(shape {node.shape}) is held by none of them. Give a model, or a tree "
            "shaped as one (its parameters, gradients or updates)."
        )

    return jtu.tree_map_with_path(mark, tree, is_leaf=_has_role)


# The parameters decoupled weight decay acts on (``optimiser.weight_decay_on``), each
# with the mask that ``optax.adamw`` takes for it: None decays every parameter (optax's
# own default, which puts no masking node in the optimiser state).
WEIGHT_DECAY_MASKS: dict[str, Callable | None] = {"all": None, "matrices": weight_matrices}
WEIGHT_DECAY_ON: tuple[str, ...] = tuple(WEIGHT_DECAY_MASKS)
