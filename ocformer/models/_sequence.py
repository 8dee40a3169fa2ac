"""The model: embedding (the initial condition f), the continuous Transformer, and the
readout of u(T). Built, imported and trained models are all this one class."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from jaxtyping import Array, Bool, Float

from .._counts import whole_number
from ._embedding import (
    AbstractEmbedding,
    AbstractReadout,
    PatchEmbedding,
    TiedReadout,
    TokenEmbedding,
    TokenTypeEmbedding,
)
from ._transformer import ContinuousTransformer

# How a language model built from a configuration reads its logits from u(T)
# (``model.readout``): a ``Readout`` (u W + b), or ``tied`` to the token embedding
# (u E^T, GPT-2's head).
READOUTS: tuple[str, ...] = ("linear", "tied")


class SequenceModel(eqx.Module):
    r"""$\text{inputs} \mapsto g(u(T))$ with $u(0) = f(\text{inputs})$ and $u$ the solution
    of the controlled equation (``transformer``).

    One class for every model: a language model built for training pairs a
    ``TokenEmbedding``, a causal transformer and a per-token ``Readout``; a classifier a
    ``PatchEmbedding`` and a class-token ``Readout``; an imported checkpoint
    (``ocformer.convert.from_pretrained``) is GPT-2's ``TokenEmbedding`` with a tied
    readout, BERT's ``TokenTypeEmbedding`` with a ``Pooler`` (or no head), ViT's
    ``PatchEmbedding`` with a class-token ``Readout`` or a ``Pooler``. Re-discretise the
    transformer and put it back with ``with_transformer``.

    Args:
        embedding: builds u(0) of shape (B, N, d).
        transformer: the solution operator u(0) -> u(T), including any final projection.
        head: the readout of u(T) with its own parameters; None for a tied readout or a
            model without a head (an imported encoder).
        tied: the readout is $u\,E^\top$ with $E$ the embedding's symbol table (GPT-2);
            ``head`` must then be None.
        source_config: for a model imported from a checkpoint, the JSON text of its
            ``config.json``, kept so that the model can be written back in that format.
    """

    embedding: AbstractEmbedding
    transformer: ContinuousTransformer
    head: AbstractReadout | None = None
    tied: bool = eqx.field(default=False, static=True)
    source_config: str | None = eqx.field(default=None, static=True)

    def __check_init__(self):
        if not isinstance(self.transformer, ContinuousTransformer):
            raise ValueError(
                "SequenceModel.transformer must be an ocformer.models.ContinuousTransformer, "
                f"got {type(self.transformer).__name__}."
            )
        if self.tied and self.head is not None:
            raise ValueError(
                "A tied SequenceModel reads its logits from the embedding's symbol table; "
                "give head=None with tied=True (or an untied head with tied=False)."
            )
        if self.tied and not isinstance(self.embedding, (TokenEmbedding, TokenTypeEmbedding)):
            raise ValueError(
                "tied=True reads the symbol table of a TokenEmbedding or TokenTypeEmbedding, "
                f"got a {type(self.embedding).__name__}."
            )

    @property
    def readout(self) -> AbstractReadout:
        """The readout g of u(T): the head, or for a tied model the symbol table's."""
        if self.tied:
            assert isinstance(self.embedding, (TokenEmbedding, TokenTypeEmbedding))
            return TiedReadout(self.embedding.tokens)
        if self.head is None:
            raise ValueError(
                "This model has no head (the checkpoint held none); use hidden_states."
            )
        return self.head

    def initial_state(self, inputs, token_type_ids=None) -> Float[Array, "B N d"]:
        """u(0) = f(inputs): symbol ids (B, N), or images (B, H, W, C) for patches.

        ``token_type_ids`` (B, N) are read by a ``TokenTypeEmbedding`` (BERT) only.
        """
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
            and inputs.shape[-1] != (*self.embedding.input_shape, 1)[2]  # channels
        ):
            raise ValueError(
                f"Images are channels-last, (B, H, W, C) = (B, "
                f"{', '.join(map(str, (*self.embedding.input_shape, 1)[:3]))}); got shape "
                f"{inputs.shape}. Transpose (B, C, H, W) pixel values with "
                "x.transpose(0, 2, 3, 1)."
            )
        return self.embedding(inputs)

    def hidden_states(
        self, inputs, key_mask: Bool[Array, "B N"] | None = None, token_type_ids=None
    ) -> Float[Array, "B N d"]:
        """u(T), after the final projection when the model has one (the last hidden
        state of a standard Transformer). ``key_mask`` (True keeps a token) is the
        padding mask."""
        u0 = self.initial_state(inputs, token_type_ids)
        return self.transformer(u0, None if key_mask is None else jnp.asarray(key_mask))

    def __call__(
        self, inputs, key_mask: Bool[Array, "B N"] | None = None, token_type_ids=None
    ) -> Float[Array, "B *N K"]:
        """The readout's output, batched over the leading axis: LM logits (B, N, V),
        class logits (B, K) or the pooled first token (B, P)."""
        return self.readout(self.hidden_states(inputs, key_mask, token_type_ids))

    def logits(self, inputs, key_mask: Bool[Array, "B N"] | None = None, token_type_ids=None):
        """The same as calling the model."""
        return self(inputs, key_mask, token_type_ids)

    def with_transformer(self, transformer: ContinuousTransformer) -> "SequenceModel":
        """This model with another transformer (another scheme, adjoint, step count)."""
        return eqx.tree_at(lambda m: m.transformer, self, transformer)

    def generate(
        self,
        key,
        prompt_tokens,
        num_new: int,
        temperature: float = 1.0,
        vocab_size: int | None = None,
    ) -> np.ndarray:
        """Sample ``num_new`` symbols after ``prompt_tokens`` (a causal LM only).

        The context is a window of the embedding's ``seq_len`` tokens: filled from the
        left while the text is shorter, then sliding. Causal attention makes the logits
        at position i depend on tokens 0..i only, so the unused tail of a part-filled
        window does not matter. One compiled step serves every symbol; a new
        compilation happens only for a new ``num_new``.

        Args:
            key: a ``jax.random`` key.
            prompt_tokens: 1-D symbol ids, at least one.
            num_new: how many symbols to sample.
            temperature: softmax temperature; 0 samples greedily (argmax).
            vocab_size: sample only ids below it (a task whose symbols fill only the
                first rows of the embedding's table, as one started from a larger
                checkpoint does); None: every row.

        Returns:
            The ``num_new`` sampled ids, int32.
        """
        if not (
            isinstance(self.embedding, TokenEmbedding)
            and (self.tied or (self.head is not None and self.head.per_token))
        ):
            raise ValueError(
                "generate needs a language model: a TokenEmbedding and a per-token readout."
            )
        if not self.transformer.attention.causal:
            raise ValueError(
                "generate needs causal attention (the transformer built with causal=True); "
                "otherwise later tokens change the logits of earlier ones."
            )
        prompt = np.asarray(prompt_tokens)
        if prompt.size and not np.issubdtype(prompt.dtype, np.integer):
            raise ValueError(
                f"generate takes integer symbol ids as its prompt, got {prompt.dtype} "
                f"({prompt.reshape(-1)[:3].tolist()}...); encode text with the task's "
                "tokenizer first."
            )
        prompt = prompt.astype(np.int32)
        if prompt.ndim > 1:
            raise ValueError(
                f"generate continues one prompt, 1-D symbol ids, got shape {prompt.shape}; "
                "call it per prompt."
            )
        prompt = prompt.reshape(-1)
        if prompt.size == 0:
            raise ValueError("generate needs a prompt of at least one token.")
        vocab = self.embedding.tokens.shape[0]
        if prompt.min() < 0 or prompt.max() >= vocab:
            raise ValueError(
                f"the prompt holds ids outside the vocabulary 0..{vocab - 1}: "
                f"{sorted({int(i) for i in prompt if not 0 <= i < vocab})[:5]}."
            )
        count = whole_number(num_new)
        if count is None or count < 0:
            raise ValueError(f"num_new must be an integer >= 0, got {num_new!r}.")
        num_new = count
        if not temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {temperature!r}.")
        if vocab_size is not None and not 1 <= (whole_number(vocab_size) or 0) <= vocab:
            raise ValueError(
                f"vocab_size must be an integer in 1..{vocab} (the rows of the embedding's "
                f"table), got {vocab_size!r}."
            )
        if num_new == 0:
            return np.zeros((0,), np.int32)
        n = self.embedding.seq_len
        prompt = prompt[-n:]
        window = np.zeros((n,), np.int32)
        window[: prompt.size] = prompt
        out = _sample(
            self,
            jnp.asarray(window),
            jnp.asarray(prompt.size, jnp.int32),
            jr.split(key, num_new),
            jnp.asarray(temperature, self.embedding.tokens.dtype),
            vocab if vocab_size is None else int(vocab_size),
        )
        return np.asarray(out)


@eqx.filter_jit
def _sample(model: SequenceModel, window, length, keys, temperature, vocab_size: int):
    n = window.shape[0]

    def step(carry, key):
        window, length = carry
        logits = model(window[None])[0]
        row = jax.lax.dynamic_index_in_dim(logits, length - 1, keepdims=False)
        row = jnp.where(jnp.arange(row.shape[0]) < vocab_size, row, -jnp.inf)
        greedy = temperature <= 0
        scaled = row / jnp.where(greedy, 1.0, temperature)
        token = jnp.where(greedy, jnp.argmax(row), jr.categorical(key, scaled)).astype(jnp.int32)
        full = length >= n
        # Part-filled: write at `length`. Full: slide left by one and write at the end.
        slid = jnp.roll(window, -1).at[n - 1].set(token)
        filled = window.at[jnp.minimum(length, n - 1)].set(token)
        window = jnp.where(full, slid, filled)
        return (window, jnp.minimum(length + 1, n)), token

    _, tokens = jax.lax.scan(step, (window, length), keys)
    return tokens
