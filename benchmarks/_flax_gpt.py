"""The reference a user would otherwise write: a GPT in ``flax.linen``.

Pre-LN causal blocks (LayerNorm, fused QKV projection, ``jax.nn.dot_product_attention``,
output projection; LayerNorm, dense, GELU, dense), learned token and position
embeddings, a final LayerNorm and a dense head: the same shapes and the same function
as ocformer's default model, so that ``params_from_ocformer`` can load ocformer's
parameters into it and the two losses can be compared. ``remat=True`` wraps every block
in ``nn.remat`` (activations inside a block are recomputed in the backward pass).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from ocformer.convert import to_layers

from ._gpt import GPTShape


class Block(nn.Module):
    shape: GPTShape
    dtype: jnp.dtype = jnp.float32
    attention: str | None = None  # jax.nn.dot_product_attention's implementation

    @nn.compact
    def __call__(self, x):
        s = self.shape
        b, n, d = x.shape
        dh = d // s.heads
        h = nn.LayerNorm(epsilon=s.ln_eps, dtype=self.dtype, name="ln1")(x)
        qkv = nn.Dense(3 * d, dtype=self.dtype, name="qkv")(h)
        q, k, v = (z.reshape(b, n, s.heads, dh) for z in jnp.split(qkv, 3, axis=-1))
        z = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=self.attention)
        z = z.reshape(b, n, d)
        x = x + nn.Dense(d, dtype=self.dtype, name="proj")(z)
        h = nn.LayerNorm(epsilon=s.ln_eps, dtype=self.dtype, name="ln2")(x)
        h = nn.Dense(s.hidden, dtype=self.dtype, name="fc")(h)
        h = nn.gelu(h, approximate=s.approximate_gelu)
        return x + nn.Dense(d, dtype=self.dtype, name="out")(h)


class GPT(nn.Module):
    shape: GPTShape
    remat: bool = False
    dtype: jnp.dtype = jnp.float32
    attention: str | None = None

    @nn.compact
    def __call__(self, tokens):
        s = self.shape
        x = nn.Embed(s.vocab, s.width, name="tokens")(tokens)
        pos = self.param("positions", nn.initializers.normal(1.0), (s.seq_len, s.width))
        x = (x + pos[None, : tokens.shape[1]]).astype(self.dtype)
        block = nn.remat(Block) if self.remat else Block
        for i in range(s.layers):
            x = block(s, self.dtype, self.attention, name=f"block{i}")(x)
        x = nn.LayerNorm(epsilon=s.ln_eps, dtype=self.dtype, name="ln_f")(x)
        return nn.Dense(s.vocab, dtype=self.dtype, name="head")(x).astype(jnp.float32)


def cross_entropy(logits, targets):
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def make_train_step(model: GPT, optimiser: optax.GradientTransformation):
    """``step(params, opt_state, batch) -> (params, opt_state, loss)``, jitted with the
    parameters and optimiser state donated. A model with ``dtype=jnp.bfloat16`` computes
    in bfloat16 from float32 parameters (flax's mixed precision)."""

    def loss_fn(params, batch):
        return cross_entropy(model.apply(params, batch["inputs"]), batch["targets"])

    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = optimiser.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1))


def params_from_ocformer(model) -> dict:
    """The flax parameters of ocformer's ``SequenceModel`` (pre-LN, piecewise-constant
    controls, two feed-forward maps, per-feature norms): the same function."""
    layers = to_layers(model.transformer)
    final = model.transformer.final_norm

    def a(x):
        return jnp.asarray(np.asarray(x))

    params = {
        "tokens": {"embedding": a(model.embedding.tokens)},
        "positions": a(model.embedding.positions),
        "ln_f": {"scale": a(final.scale), "bias": a(final.bias)},
        "head": {"kernel": a(model.readout.weight), "bias": a(model.readout.bias)},
    }
    for i, p in enumerate(layers):
        params[f"block{i}"] = {
            "ln1": {"scale": a(p["ln1_scale"]), "bias": a(p["ln1_bias"])},
            "qkv": {
                "kernel": a(np.concatenate([p["wq"], p["wk"], p["wv"]], axis=1)),
                "bias": a(np.concatenate([p["bq"], p["bk"], p["bv"]])),
            },
            "proj": {"kernel": a(p["wo"]), "bias": a(p["bo"])},
            "ln2": {"scale": a(p["ln2_scale"]), "bias": a(p["ln2_bias"])},
            "fc": {"kernel": a(p["w1"]), "bias": a(p["b1"])},
            "out": {"kernel": a(p["w2"]), "bias": a(p["b2"])},
        }
    return {"params": params}
