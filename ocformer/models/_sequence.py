"""A sequence model: embedding, the continuous Transformer, readout."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from jaxtyping import Array, Bool, Float

from ._embedding import AbstractEmbedding, Readout, TokenEmbedding
from ._transformer import ContinuousTransformer


class SequenceModel(eqx.Module):
    r"""$\text{inputs} \mapsto g(u(T))$ with $u(0) = f(\text{inputs})$ and $u$ the solution
    of the controlled equation (``transformer``).

    Language models pair a ``TokenEmbedding``, a causal transformer and a per-token
    ``Readout``; classifiers a ``PatchEmbedding`` and a class-token ``Readout``.

    Args:
        embedding: builds u(0) of shape (B, N, d).
        transformer: the solution operator u(0) -> u(T).
        readout: the head applied to u(T).
    """

    embedding: AbstractEmbedding
    transformer: ContinuousTransformer
    readout: Readout

    def __check_init__(self):
        if not isinstance(self.transformer, ContinuousTransformer):
            raise ValueError(
                "SequenceModel.transformer must be an ocformer.models.ContinuousTransformer, "
                f"got {type(self.transformer).__name__}."
            )

    def initial_state(self, inputs) -> Float[Array, "B N d"]:
        """u(0) = f(inputs)."""
        return self.embedding(jnp.asarray(inputs))

    def __call__(
        self, inputs, key_mask: Bool[Array, "B N"] | None = None
    ) -> Float[Array, "B *N K"]:
        """Logits, batched over the leading axis: (B, N, vocab) or (B, num_classes)."""
        return self.readout(self.transformer(self.initial_state(inputs), key_mask))

    def with_transformer(self, transformer: ContinuousTransformer) -> "SequenceModel":
        """This model with another transformer (another scheme, adjoint, step count)."""
        return eqx.tree_at(lambda m: m.transformer, self, transformer)

    def generate(self, key, prompt_tokens, num_new: int, temperature: float = 1.0) -> np.ndarray:
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

        Returns:
            The ``num_new`` sampled ids, int32.
        """
        if not isinstance(self.embedding, TokenEmbedding) or self.readout.pooling != "none":
            raise ValueError(
                "generate needs a language model: a TokenEmbedding and a per-token Readout."
            )
        if not self.transformer.attention.causal:
            raise ValueError(
                "generate needs causal attention (the transformer built with causal=True); "
                "otherwise later tokens change the logits of earlier ones."
            )
        prompt = np.asarray(prompt_tokens, dtype=np.int32).reshape(-1)
        if prompt.size == 0:
            raise ValueError("generate needs a prompt of at least one token.")
        if not (isinstance(num_new, int) and num_new >= 0):
            raise ValueError(f"num_new must be an integer >= 0, got {num_new!r}.")
        if not temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {temperature!r}.")
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
        )
        return np.asarray(out)


@eqx.filter_jit
def _sample(model: SequenceModel, window, length, keys, temperature):
    n = window.shape[0]

    def step(carry, key):
        window, length = carry
        logits = model(window[None])[0]
        row = jax.lax.dynamic_index_in_dim(logits, length - 1, keepdims=False)
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
