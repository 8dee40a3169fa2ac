"""Embeddings (the initial state f(x, y) = u(x, y, 0)) and readouts g(u(T)).

Every model, built, imported or trained, is one ``SequenceModel`` made of these pieces:
GPT-2 is a ``TokenEmbedding`` with a tied readout, BERT a ``TokenTypeEmbedding`` with a
``Pooler``, ViT a ``PatchEmbedding`` with a class-token ``Readout`` or a ``Pooler``.
"""

import abc
import math
from typing import Literal

import equinox as eqx
import jax
import jax.core
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from jaxtyping import Array, Float, Int

from .._counts import whole_number
from ..controls import NormParams
from ..operators import LayerNormProjection, constant_in_x

Pooling = Literal["none", "cls"]


def _rows(table: Float[Array, "V d"], ids: Int[Array, "..."], what: str) -> Float[Array, "... d"]:
    """``table[ids]``, for ids in [0, V) only: concrete ids outside it raise, and traced
    ones (under ``jit``, where no error can be raised) give NaN rows, which the training
    loop's finiteness guard catches, rather than the clamped or wrapped rows of another
    symbol that plain indexing gives."""
    rows = table.shape[0]
    if not isinstance(ids, jax.core.Tracer):
        values = np.asarray(ids)
        if values.size and (values.min() < 0 or values.max() >= rows):
            raise ValueError(
                f"{what} must lie in [0, {rows}), got range [{values.min()}, {values.max()}]; "
                f"map the ids into the table's range (or build the model with a larger one)."
            )
    return table.at[ids].get(mode="fill", fill_value=jnp.nan, wrap_negative_indices=False)


class AbstractEmbedding(eqx.Module):
    """Builds the initial state $u(\\cdot, \\cdot, 0) = f$ from a batch of inputs."""

    @abc.abstractmethod
    def __call__(self, inputs) -> Float[Array, "B N d"]:
        """The initial state of a batch, shape (B, N, d)."""

    @property
    @abc.abstractmethod
    def seq_len(self) -> int:
        """The largest number of tokens the embedding produces (positions it knows)."""


def _check_positive(**values) -> None:
    for name, value in values.items():
        if (whole_number(value) or 0) < 1:  # a bool is no count (True is not 1)
            raise ValueError(f"{name} must be a positive integer, got {value!r}.")


class TokenEmbedding(AbstractEmbedding):
    r"""$f(x_i, \cdot) = E[s_i] + P[i]$: a symbol table plus learned positions.

    Both tables start as N(0, init_std^2) draws (separate keys); the default 1 gives
    tokens O(1) features with non-zero variance, the regime of the layer-norm
    projection. A readout tied to the symbol table (``TiedReadout``) reads logits
    u(T) E^T whose standard deviation is init_std sqrt(d) for a layer-normed u(T):
    1 / sqrt(d) starts them at unit scale, as a ``Readout`` does.

    Args:
        vocab_size: number of symbols.
        seq_len: number of positions.
        width: d, the feature width.
        key: a ``jax.random`` key.
        dtype: floating dtype of the tables.
        init_std: standard deviation of the tables' initial entries.
    """

    tokens: Float[Array, "V d"]
    positions: Float[Array, "N d"]

    def __init__(self, vocab_size: int, seq_len: int, width: int, *, key, dtype=None, init_std=1.0):
        _check_positive(vocab_size=vocab_size, seq_len=seq_len, width=width)
        if isinstance(init_std, bool) or not (isinstance(init_std, (int, float)) and init_std > 0):
            raise ValueError(f"init_std must be a number > 0, got {init_std!r}.")
        dtype = jnp.zeros(()).dtype if dtype is None else dtype
        k_tok, k_pos = jr.split(key)
        self.tokens = init_std * jr.normal(k_tok, (vocab_size, width), dtype)
        self.positions = init_std * jr.normal(k_pos, (seq_len, width), dtype)

    @property
    def seq_len(self) -> int:
        return self.positions.shape[0]

    def __call__(self, inputs: Int[Array, "B N"]) -> Float[Array, "B N d"]:
        if inputs.ndim != 2 or inputs.shape[1] > self.seq_len:
            raise ValueError(
                f"TokenEmbedding takes symbol ids of shape (B, N) with N <= {self.seq_len}, "
                f"got shape {inputs.shape}."
            )
        if not jnp.issubdtype(inputs.dtype, jnp.integer):
            raise ValueError(f"TokenEmbedding takes integer symbol ids, got {inputs.dtype}.")
        n = inputs.shape[1]
        return _rows(self.tokens, inputs, "symbol ids") + self.positions[None, :n]


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
        for name, shape in (
            ("positions", self.positions.shape),
            ("token_types", self.token_types.shape),
        ):
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
        f = (
            _rows(self.tokens, inputs, "symbol ids")
            + self.positions[None, :n]
            + _rows(self.token_types, token_type_ids, "token_type_ids")
        )
        return LayerNormProjection(eps=self.eps)(self.norm, f)


class PatchEmbedding(AbstractEmbedding):
    r"""ViT-style: $f = [c;\ \mathrm{patches}(I)\,W + b] + P$.

    Non-overlapping ``patch_size`` x ``patch_size`` patches are flattened and mapped
    linearly to d features; a learned class token $c$ is prepended and learned
    positions $P$ added. The class token's final state is what a ``Readout`` with
    ``pooling="cls"`` reads.

    Args:
        input_shape: ``(H, W)`` or ``(H, W, C)`` of one image.
        patch_size: side of the square patches; must divide H and W.
        width: d.
        key: a ``jax.random`` key.
        dtype: floating dtype of the parameters.
    """

    weight: Float[Array, "p d"]
    bias: Float[Array, " d"]
    cls_token: Float[Array, " d"]
    positions: Float[Array, "N d"]
    input_shape: tuple[int, ...] = eqx.field(static=True)
    patch_size: int = eqx.field(static=True)

    def __init__(self, input_shape, patch_size: int, width: int, *, key, dtype=None):
        input_shape = tuple(int(s) for s in input_shape)
        if len(input_shape) not in (2, 3):
            raise ValueError(f"input_shape must be (H, W) or (H, W, C), got {input_shape}.")
        _check_positive(patch_size=patch_size, width=width)
        height, width_px = input_shape[:2]
        if height % patch_size or width_px % patch_size:
            raise ValueError(
                f"patch_size={patch_size} must divide the image sides {height} x {width_px}."
            )
        dtype = jnp.zeros(()).dtype if dtype is None else dtype
        channels = input_shape[2] if len(input_shape) == 3 else 1
        fan_in = patch_size * patch_size * channels
        num_tokens = (height // patch_size) * (width_px // patch_size) + 1
        k_w, k_cls, k_pos = jr.split(key, 3)
        self.weight = jr.normal(k_w, (fan_in, width), dtype) / math.sqrt(fan_in)
        self.bias = jnp.zeros((width,), dtype)
        self.cls_token = jr.normal(k_cls, (width,), dtype)
        self.positions = jr.normal(k_pos, (num_tokens, width), dtype)
        self.input_shape = input_shape
        self.patch_size = patch_size

    @property
    def seq_len(self) -> int:
        return self.positions.shape[0]

    def patches(self, images: Float[Array, "B ..."]) -> Float[Array, "B P p"]:
        """Flattened non-overlapping patches in row-major patch order."""
        if _grey(tuple(images.shape[1:])) != _grey(self.input_shape):
            raise ValueError(
                f"PatchEmbedding expects images of shape (B, *{self.input_shape}), got "
                f"{images.shape}."
            )
        batch = images.shape[0]
        p = self.patch_size
        x = images.reshape(batch, *self.input_shape[:2], -1)
        h, w, c = x.shape[1] // p, x.shape[2] // p, x.shape[3]
        x = x.reshape(batch, h, p, w, p, c).transpose(0, 1, 3, 2, 4, 5)
        return x.reshape(batch, h * w, p * p * c)

    def __call__(self, inputs: Float[Array, "B ..."]) -> Float[Array, "B N d"]:
        tokens = self.patches(inputs.astype(self.weight.dtype)) @ self.weight
        tokens = tokens + constant_in_x(self.bias, tokens.ndim)
        cls = jnp.broadcast_to(self.cls_token, (tokens.shape[0], 1, tokens.shape[2]))
        return jnp.concatenate([cls, tokens], axis=1) + self.positions[None]


def _grey(shape: tuple[int, ...]) -> tuple[int, ...]:
    """An image shape with a single channel's axis left out: (H, W, 1) and (H, W) are
    the same images."""
    return shape[:2] if len(shape) == 3 and shape[2] == 1 else shape


class AbstractReadout(eqx.Module):
    """The readout $g(u(T))$: language-model logits, class logits or a pooled feature."""

    @abc.abstractmethod
    def __call__(self, u: Float[Array, "B N d"]) -> Float[Array, "B *N K"]:
        """The outputs read from the final state."""

    @property
    @abc.abstractmethod
    def per_token(self) -> bool:
        """Whether there is one output per token (a language model) or one per input."""


class Readout(AbstractReadout):
    r"""The head $g(u(T)) = u(T)\,W + b$, per token or of the class token (ViT's
    classifier).

    Args:
        width: d.
        num_outputs: symbols (LM) or classes.
        key: a ``jax.random`` key.
        pooling: ``"none"`` (logits for every token, language modelling) or ``"cls"``
            (logits of token 0, the class token).
        dtype: floating dtype of the parameters.
    """

    weight: Float[Array, "d K"]
    bias: Float[Array, " K"]
    pooling: Pooling = eqx.field(static=True)

    def __init__(self, width: int, num_outputs: int, *, key, pooling: Pooling = "none", dtype=None):
        _check_positive(width=width, num_outputs=num_outputs)
        if pooling not in ("none", "cls"):
            raise ValueError(f"pooling must be 'none' or 'cls', got {pooling!r}.")
        dtype = jnp.zeros(()).dtype if dtype is None else dtype
        self.weight = jr.normal(key, (width, num_outputs), dtype) / math.sqrt(width)
        self.bias = jnp.zeros((num_outputs,), dtype)
        self.pooling = pooling

    @property
    def per_token(self) -> bool:
        return self.pooling == "none"

    def __call__(self, u: Float[Array, "B N d"]) -> Float[Array, "B *N K"]:
        if self.pooling == "cls":
            u = u[:, 0]
        out = u @ self.weight
        return out + constant_in_x(self.bias, out.ndim)


class TiedReadout(AbstractReadout):
    r"""Language-model logits tied to the symbol table: $g(u) = u\,E^\top$ (GPT-2).

    A ``SequenceModel`` with ``tied=True`` stores no head and builds this readout from
    its embedding's ``tokens`` when it is read, so the tie holds through training and
    re-discretisation (one table, one gradient).

    Args:
        tokens: the (V, d) symbol table of the embedding.
    """

    tokens: Float[Array, "V d"]

    @property
    def per_token(self) -> bool:
        return True

    def __call__(self, u: Float[Array, "B N d"]) -> Float[Array, "B N V"]:
        return u @ self.tokens.T


class Pooler(AbstractReadout):
    r"""$g(u) = \tanh(u(x_0)\,W + b)$ of the first token (BERT's and ViT's pooler).

    Args:
        weight: (d, P), acting on the right.
        bias: (P,).
    """

    weight: Float[Array, "d P"]
    bias: Float[Array, " P"]

    @property
    def per_token(self) -> bool:
        return False

    def __call__(self, u: Float[Array, "B N d"]) -> Float[Array, "B P"]:
        out = u[:, 0] @ self.weight
        return jnp.tanh(out + constant_in_x(self.bias, out.ndim))
