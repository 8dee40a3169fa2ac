"""A whole imported model: embedding (the initial condition f), the continuous
Transformer, and the head that reads u(T)."""

import abc

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from ..controls._params import NormParams
from ..operators import LayerNormProjection, constant_in_x
from ._embedding import AbstractEmbedding, PatchEmbedding, TokenEmbedding
from ._transformer import ContinuousTransformer


class TokenTypeEmbedding(AbstractEmbedding):
    r"""BERT-style: $f(x_i, \cdot) = P_{S_1}(E[s_i] + P[i] + T[\tau_i])$.

    A symbol table, learned positions and a table of token types (segments), summed and
    projected onto $S_1$ with a per-feature gain and bias and LayerNorm epsilon ``eps``:
    the embedding's LayerNorm is a projection that ends the construction of $f$.

    Args:
        tokens: (V, d) symbol table.
        positions: (N, d) position table.
        token_types: (T, d) token-type table.
        norm: gain and bias of the projection, each (d,).
        eps: the LayerNorm epsilon.
    """

    tokens: Float[Array, "V d"]
    positions: Float[Array, "N d"]
    token_types: Float[Array, "T d"]
    norm: NormParams
    eps: float = eqx.field(static=True)

    def __check_init__(self):
        d = self.tokens.shape[-1]
        for name in ("positions", "token_types"):
            shape = getattr(self, name).shape
            if len(shape) != 2 or shape[1] != d:
                raise ValueError(
                    f"TokenTypeEmbedding.{name} has shape {shape}, expected (rows, {d})."
                )

    @property
    def seq_len(self) -> int:
        return self.positions.shape[0]

    def __call__(
        self, inputs: Int[Array, "B N"], token_type_ids: Int[Array, "B N"] | None = None
    ) -> Float[Array, "B N d"]:
        if inputs.ndim != 2 or inputs.shape[1] > self.seq_len:
            raise ValueError(
                f"TokenTypeEmbedding takes symbol ids of shape (B, N) with N <= "
                f"{self.seq_len}, got shape {inputs.shape}."
            )
        if token_type_ids is None:
            token_type_ids = jnp.zeros(inputs.shape, jnp.int32)
        elif token_type_ids.shape != inputs.shape:
            raise ValueError(
                f"token_type_ids must have the shape of the symbol ids {inputs.shape}, got "
                f"{token_type_ids.shape}."
            )
        n = inputs.shape[1]
        f = self.tokens[inputs] + self.positions[None, :n] + self.token_types[token_type_ids]
        return LayerNormProjection(eps=self.eps)(self.norm, f)


class AbstractHead(eqx.Module):
    """The readout g(u(T)) of an imported model."""

    @abc.abstractmethod
    def __call__(self, u: Float[Array, "B N d"], embedding: AbstractEmbedding) -> Array:
        """The head's output from the final state (and, for tied heads, the embedding)."""


class TiedHead(AbstractHead):
    r"""Language-model logits tied to the symbol table: $g(u) = u\,E^\top$ (GPT-2).

    The head owns no parameter: it reads the embedding's ``tokens``, so the tie holds
    through training and re-discretisation.
    """

    def __call__(self, u, embedding):
        if not isinstance(embedding, (TokenEmbedding, TokenTypeEmbedding)):
            raise ValueError(
                "TiedHead reads the symbol table of a TokenEmbedding or TokenTypeEmbedding, "
                f"got {type(embedding).__name__}."
            )
        return u @ embedding.tokens.T


class Pooler(AbstractHead):
    r"""$g(u) = \tanh(u(x_0)\,W + b)$ of the first token (BERT's and ViT's pooler).

    Args:
        weight: (d, P), acting on the right.
        bias: (P,).
    """

    weight: Float[Array, "d P"]
    bias: Float[Array, " P"]

    def __call__(self, u, embedding):
        del embedding
        out = u[:, 0] @ self.weight
        return jnp.tanh(out + constant_in_x(self.bias, out.ndim))


class ClassTokenHead(AbstractHead):
    r"""Class logits from the class token: $g(u) = u(x_0)\,W + b$ (ViT's classifier).

    Args:
        weight: (d, K), acting on the right.
        bias: (K,).
    """

    weight: Float[Array, "d K"]
    bias: Float[Array, " K"]

    def __call__(self, u, embedding):
        del embedding
        out = u[:, 0] @ self.weight
        return out + constant_in_x(self.bias, out.ndim)


class PretrainedModel(eqx.Module):
    r"""An imported Transformer: $u(0) = f(\text{inputs})$, the controlled equation up
    to $T = L$, then the head $g(u(T))$.

    Built by ``ocformer.convert.from_pretrained``. ``transformer`` is an ordinary
    ``ContinuousTransformer`` (the Lie scheme, one step per layer, reproduces the
    source model); re-discretise it and put it back with ``with_transformer``.

    Args:
        embedding: ``TokenEmbedding`` (GPT-2), ``TokenTypeEmbedding`` (BERT) or
            ``PatchEmbedding`` (ViT; images channels-last, (B, H, W, C)).
        transformer: the solution operator u(0) -> u(T), including any final projection.
        head: ``TiedHead``, ``Pooler``, ``ClassTokenHead`` or None.
        source_config: the JSON text of the checkpoint's ``config.json``, kept so that
            the model can be written back in the same format.
    """

    embedding: AbstractEmbedding
    transformer: ContinuousTransformer
    head: AbstractHead | None
    source_config: str = eqx.field(static=True)

    def __check_init__(self):
        if not isinstance(self.transformer, ContinuousTransformer):
            raise ValueError(
                "PretrainedModel.transformer must be a ContinuousTransformer, got "
                f"{type(self.transformer).__name__}."
            )

    def initial_state(self, inputs, token_type_ids=None) -> Float[Array, "B N d"]:
        """u(0) = f(inputs): symbol ids (B, N), or images (B, H, W, C) for patches."""
        inputs = jnp.asarray(inputs)
        if isinstance(self.embedding, TokenTypeEmbedding):
            types = None if token_type_ids is None else jnp.asarray(token_type_ids)
            return self.embedding(inputs, types)
        if token_type_ids is not None:
            raise ValueError(
                f"token_type_ids are read by a TokenTypeEmbedding (BERT); this model's "
                f"embedding is a {type(self.embedding).__name__}."
            )
        if (
            isinstance(self.embedding, PatchEmbedding)
            and inputs.ndim == 4
            and inputs.shape[-1] != self.embedding.input_shape[-1]
        ):
            raise ValueError(
                f"Images are channels-last, (B, H, W, C) = (B, "
                f"{', '.join(map(str, self.embedding.input_shape))}); got shape "
                f"{inputs.shape}. Transpose (B, C, H, W) pixel values with "
                "x.transpose(0, 2, 3, 1)."
            )
        return self.embedding(inputs)

    def hidden_states(
        self,
        inputs,
        key_mask: Bool[Array, "B N"] | None = None,
        token_type_ids=None,
    ) -> Float[Array, "B N d"]:
        """u(T), after the final projection when the model has one (the source model's
        last hidden state). ``key_mask`` (True keeps a token) is the padding mask."""
        u0 = self.initial_state(inputs, token_type_ids)
        return self.transformer(u0, None if key_mask is None else jnp.asarray(key_mask))

    def logits(self, inputs, key_mask: Bool[Array, "B N"] | None = None, token_type_ids=None):
        """The head's output: LM logits (B, N, V), class logits (B, K) or the pooled
        first token (B, P)."""
        if self.head is None:
            raise ValueError(
                "This model has no head (the checkpoint held none); use hidden_states."
            )
        return self.head(self.hidden_states(inputs, key_mask, token_type_ids), self.embedding)

    def with_transformer(self, transformer: ContinuousTransformer) -> "PretrainedModel":
        """This model with another transformer (another scheme or step count)."""
        return eqx.tree_at(lambda m: m.transformer, self, transformer)
