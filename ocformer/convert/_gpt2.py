"""GPT-2 (``model_type="gpt2"``): ``GPT2Model`` and ``GPT2LMHeadModel`` checkpoints.

Pre-LN and causal, with the final LayerNorm ``ln_f``; the language-model head is tied to
the token embedding. GPT-2's ``Conv1D`` weights already act on the right (in, out).
"""

import jax
import jax.numpy as jnp
import numpy as np

from ..models import SequenceModel, TokenEmbedding
from ._family import (
    Family,
    Shapes,
    built_activation,
    norm_arrays,
    norm_dict,
    per_feature,
    read_activation,
    read_eps,
    read_heads,
    read_int,
    read_value,
    replace_arrays,
    require,
)
from ._layers import from_layers, to_layers


def _sizes(c: dict) -> tuple[int, int, int, int, int]:
    d = read_int(c, "n_embd")
    inner = read_value(c, "n_inner")
    return d, read_int(c, "n_layer"), 4 * d if inner is None else read_int(c, "n_inner"), \
        read_int(c, "vocab_size"), read_int(c, "n_positions")  # fmt: skip


def _shapes(c: dict):
    require(
        c,
        {
            "scale_attn_weights": ((True,), True),
            "scale_attn_by_inverse_layer_idx": ((False,), False),
            "add_cross_attention": ((False,), False),
            "tie_word_embeddings": ((True,), True),
        },
    )
    d, n_layer, ff, vocab, positions = _sizes(c)
    read_heads(c, "n_head", d)
    read_activation(c, "activation_function", "gelu_new")
    read_eps(c, "layer_norm_epsilon", 1e-5)
    shapes: Shapes = {"wte.weight": (vocab, d), "wpe.weight": (positions, d)}
    for i in range(n_layer):
        h = f"h.{i}."
        shapes |= {
            h + "ln_1.weight": (d,), h + "ln_1.bias": (d,),
            h + "attn.c_attn.weight": (d, 3 * d), h + "attn.c_attn.bias": (3 * d,),
            h + "attn.c_proj.weight": (d, d), h + "attn.c_proj.bias": (d,),
            h + "ln_2.weight": (d,), h + "ln_2.bias": (d,),
            h + "mlp.c_fc.weight": (d, ff), h + "mlp.c_fc.bias": (ff,),
            h + "mlp.c_proj.weight": (ff, d), h + "mlp.c_proj.bias": (d,),
        }  # fmt: skip
    shapes |= {"ln_f.weight": (d,), "ln_f.bias": (d,)}
    # Tied to wte; written by some exporters as a copy.
    return shapes, {"lm_head": {"lm_head.weight": (vocab, d)}}


def _build(c, t, heads):
    if "lm_head" in heads and not np.array_equal(t["lm_head.weight"], t["wte.weight"]):
        raise ValueError(
            "lm_head.weight differs from wte.weight, but GPT-2's language-model head is "
            "tied to the token embedding; an untied head is not supported."
        )
    d, n_layer, *_ = _sizes(c)
    layers = []
    for i in range(n_layer):
        h = lambda k, i=i: t[f"h.{i}.{k}"]  # noqa: E731
        wqkv, bqkv = h("attn.c_attn.weight"), h("attn.c_attn.bias")
        # GPT-2's Conv1D weights already act on the right: (in, out).
        layers.append({
            "wq": wqkv[:, :d], "wk": wqkv[:, d:2 * d], "wv": wqkv[:, 2 * d:],
            "bq": bqkv[:d], "bk": bqkv[d:2 * d], "bv": bqkv[2 * d:],
            "wo": h("attn.c_proj.weight"), "bo": h("attn.c_proj.bias"),
            "w1": h("mlp.c_fc.weight"), "b1": h("mlp.c_fc.bias"),
            "w2": h("mlp.c_proj.weight"), "b2": h("mlp.c_proj.bias"),
            "ln1_scale": h("ln_1.weight"), "ln1_bias": h("ln_1.bias"),
            "ln2_scale": h("ln_2.weight"), "ln2_bias": h("ln_2.bias"),
        })  # fmt: skip
    transformer = from_layers(
        layers,
        norm="pre",
        num_heads=c["n_head"],
        activation=read_activation(c, "activation_function", "gelu_new"),
        causal=True,
        ln_eps=read_eps(c, "layer_norm_epsilon", 1e-5),
        final_norm=norm_dict(t, "ln_f"),
    )
    embedding = _token_embedding(t["wte.weight"], t["wpe.weight"])
    return {"embedding": embedding, "transformer": transformer, "head": None, "tied": True}


def _export(model: SequenceModel, c: dict):
    embedding = model.embedding
    if not isinstance(embedding, TokenEmbedding) or not model.tied:
        raise ValueError(
            "A GPT-2 model needs a TokenEmbedding and a readout tied to it (tied=True)."
        )
    final = model.transformer.final_norm
    if final is None:
        raise ValueError("A GPT-2 model needs the final LayerNorm (final_norm).")
    out = {
        "wte.weight": np.asarray(embedding.tokens),
        "wpe.weight": np.asarray(embedding.positions),
    }
    for i, layer in enumerate(to_layers(model.transformer)):
        h = f"h.{i}."
        out |= {
            h + "attn.c_attn.weight": np.concatenate([layer[k] for k in ("wq", "wk", "wv")], 1),
            h + "attn.c_attn.bias": np.concatenate([layer[k] for k in ("bq", "bk", "bv")]),
            h + "attn.c_proj.weight": layer["wo"], h + "attn.c_proj.bias": layer["bo"],
            h + "mlp.c_fc.weight": layer["w1"], h + "mlp.c_fc.bias": layer["b1"],
            h + "mlp.c_proj.weight": layer["w2"], h + "mlp.c_proj.bias": layer["b2"],
            h + "ln_1.weight": layer["ln1_scale"], h + "ln_1.bias": layer["ln1_bias"],
            h + "ln_2.weight": layer["ln2_scale"], h + "ln_2.bias": layer["ln2_bias"],
        }  # fmt: skip
    out |= norm_arrays(final, "ln_f")
    per_feature(out, ("ln_1", "ln_2", "ln_f"), embedding.tokens.shape[1])
    return out, {"architectures": ["GPT2LMHeadModel"], "tie_word_embeddings": True}


def describe(model: SequenceModel) -> dict:
    """The GPT-2 ``config.json`` of a language model built from an ocformer
    configuration (no checkpoint of its own): token and position embeddings, a pre-LN
    causal stack with the final LayerNorm, and logits tied to the token embedding
    (``model.readout=tied``). No dropout (the model was trained without it) and no
    special token ids (none was given a role in its training, even where the dataset's
    tokenizer has special tokens).

    Raises:
        ValueError: naming each part of ``model`` that GPT-2 does not have.
    """
    t = model.transformer
    activation = built_activation(model, "GPT-2", [
        ("token and position embeddings (a language task's TokenEmbedding)",
         isinstance(model.embedding, TokenEmbedding)),
        ("logits tied to the token embedding (model.readout=tied; this model has an "
         "untied head with a bias, which GPT-2 does not)", model.tied),
        ("causal attention", t.attention.causal),
    ])  # fmt: skip
    assert isinstance(model.embedding, TokenEmbedding)
    vocab, width = model.embedding.tokens.shape
    return {
        "model_type": "gpt2",
        "vocab_size": int(vocab),
        "n_positions": int(model.embedding.positions.shape[0]),
        "n_embd": int(width),
        "n_layer": t.num_layers,
        "n_head": t.attention.num_heads,
        "n_inner": int(t.layer(0).feedforward.weights[0].shape[-1]),
        "activation_function": activation,
        "layer_norm_epsilon": float(t.layer_norm.eps),
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "bos_token_id": None,
        "eos_token_id": None,
    }


def _token_embedding(tokens: np.ndarray, positions: np.ndarray) -> TokenEmbedding:
    dtype = jnp.asarray(tokens).dtype
    embedding = TokenEmbedding(
        tokens.shape[0], positions.shape[0], tokens.shape[1], key=jax.random.key(0), dtype=dtype
    )
    return replace_arrays(embedding, lambda m: (m.tokens, m.positions), (tokens, positions), dtype)


GPT2 = Family(
    prefix="transformer.",
    base_architecture="GPT2Model",
    shapes=_shapes,
    build=_build,
    export=_export,
)
