"""BERT (``model_type="bert"``): ``BertModel`` checkpoints, with or without the pooler.

Post-LN, with token-type embeddings and the embedding LayerNorm. Older checkpoints spell
the LayerNorm parameters ``gamma``/``beta``; name matching reads them as
``weight``/``bias``.
"""

import jax.numpy as jnp
import numpy as np

from ..controls import NormParams
from ..models import Pooler, SequenceModel, TokenTypeEmbedding
from ._family import (
    Family,
    Shapes,
    linear,
    norm_arrays,
    read_activation,
    read_eps,
    read_heads,
    read_int,
    require,
)
from ._layers import from_layers, to_layers


def _shapes(c: dict):
    require(
        c,
        {
            "position_embedding_type": (("absolute",), "absolute"),
            "is_decoder": ((False,), False),
            "add_cross_attention": ((False,), False),
        },
    )
    d, n_layer, ff = (
        read_int(c, "hidden_size"),
        read_int(c, "num_hidden_layers"),
        read_int(c, "intermediate_size"),
    )
    read_heads(c, "num_attention_heads", d)
    read_activation(c, "hidden_act", "gelu")
    read_eps(c, "layer_norm_eps", 1e-12)
    e = "embeddings."
    shapes: Shapes = {
        e + "word_embeddings.weight": (read_int(c, "vocab_size"), d),
        e + "position_embeddings.weight": (read_int(c, "max_position_embeddings"), d),
        e + "token_type_embeddings.weight": (read_int(c, "type_vocab_size"), d),
        e + "LayerNorm.weight": (d,), e + "LayerNorm.bias": (d,),
    }  # fmt: skip
    for i in range(n_layer):
        a, h = f"encoder.layer.{i}.attention.", f"encoder.layer.{i}."
        for k in ("query", "key", "value"):
            shapes |= {f"{a}self.{k}.weight": (d, d), f"{a}self.{k}.bias": (d,)}
        shapes |= {
            a + "output.dense.weight": (d, d), a + "output.dense.bias": (d,),
            a + "output.LayerNorm.weight": (d,), a + "output.LayerNorm.bias": (d,),
            h + "intermediate.dense.weight": (ff, d), h + "intermediate.dense.bias": (ff,),
            h + "output.dense.weight": (d, ff), h + "output.dense.bias": (d,),
            h + "output.LayerNorm.weight": (d,), h + "output.LayerNorm.bias": (d,),
        }  # fmt: skip
    return shapes, {"pooler": {"pooler.dense.weight": (d, d), "pooler.dense.bias": (d,)}}


def _build(c, t, heads):
    layers = []
    for i in range(c["num_hidden_layers"]):
        a = lambda k, i=i: t[f"encoder.layer.{i}.attention.{k}"]  # noqa: E731
        h = lambda k, i=i: t[f"encoder.layer.{i}.{k}"]  # noqa: E731
        layers.append({
            "wq": linear(a("self.query.weight")), "bq": a("self.query.bias"),
            "wk": linear(a("self.key.weight")), "bk": a("self.key.bias"),
            "wv": linear(a("self.value.weight")), "bv": a("self.value.bias"),
            "wo": linear(a("output.dense.weight")), "bo": a("output.dense.bias"),
            "ln1_scale": a("output.LayerNorm.weight"), "ln1_bias": a("output.LayerNorm.bias"),
            "w1": linear(h("intermediate.dense.weight")), "b1": h("intermediate.dense.bias"),
            "w2": linear(h("output.dense.weight")), "b2": h("output.dense.bias"),
            "ln2_scale": h("output.LayerNorm.weight"), "ln2_bias": h("output.LayerNorm.bias"),
        })  # fmt: skip
    eps = read_eps(c, "layer_norm_eps", 1e-12)
    transformer = from_layers(
        layers,
        norm="post",
        num_heads=c["num_attention_heads"],
        activation=read_activation(c, "hidden_act", "gelu"),
        ln_eps=eps,
    )
    dtype = transformer.layer(0).attention.wq.dtype
    e = lambda k: jnp.asarray(t[f"embeddings.{k}"], dtype)  # noqa: E731
    embedding = TokenTypeEmbedding(
        tokens=e("word_embeddings.weight"),
        positions=e("position_embeddings.weight"),
        token_types=e("token_type_embeddings.weight"),
        norm=NormParams(scale=e("LayerNorm.weight"), bias=e("LayerNorm.bias")),
        eps=eps,
    )
    head = None
    if "pooler" in heads:
        head = Pooler(
            weight=jnp.asarray(linear(t["pooler.dense.weight"]), dtype),
            bias=jnp.asarray(t["pooler.dense.bias"], dtype),
        )
    return {"embedding": embedding, "transformer": transformer, "head": head}


def _export(model: SequenceModel, c: dict):
    embedding = model.embedding
    if not isinstance(embedding, TokenTypeEmbedding):
        raise ValueError("A BERT model needs a TokenTypeEmbedding.")
    e = "embeddings."
    out = {
        e + "word_embeddings.weight": np.asarray(embedding.tokens),
        e + "position_embeddings.weight": np.asarray(embedding.positions),
        e + "token_type_embeddings.weight": np.asarray(embedding.token_types),
    } | norm_arrays(embedding.norm, e + "LayerNorm")
    for i, layer in enumerate(to_layers(model.transformer)):
        a, h = f"encoder.layer.{i}.attention.", f"encoder.layer.{i}."
        for k, name in (("q", "query"), ("k", "key"), ("v", "value")):
            out |= {
                f"{a}self.{name}.weight": linear(layer[f"w{k}"]),
                f"{a}self.{name}.bias": layer[f"b{k}"],
            }
        out |= {
            a + "output.dense.weight": linear(layer["wo"]), a + "output.dense.bias": layer["bo"],
            a + "output.LayerNorm.weight": layer["ln1_scale"],
            a + "output.LayerNorm.bias": layer["ln1_bias"],
            h + "intermediate.dense.weight": linear(layer["w1"]),
            h + "intermediate.dense.bias": layer["b1"],
            h + "output.dense.weight": linear(layer["w2"]), h + "output.dense.bias": layer["b2"],
            h + "output.LayerNorm.weight": layer["ln2_scale"],
            h + "output.LayerNorm.bias": layer["ln2_bias"],
        }  # fmt: skip
    if isinstance(model.head, Pooler):
        out |= {
            "pooler.dense.weight": linear(np.asarray(model.head.weight)),
            "pooler.dense.bias": np.asarray(model.head.bias),
        }
    elif model.head is not None:
        raise ValueError(f"A BERT model's head is a Pooler or None, got {type(model.head)}.")
    return out, {"architectures": ["BertModel"]}


BERT = Family(
    prefix="bert.",
    base_architecture="BertModel",
    shapes=_shapes,
    build=_build,
    export=_export,
)
