"""ViT (``model_type="vit"``): ``ViTModel`` (with or without the pooler) and
``ViTForImageClassification`` checkpoints.

Pre-LN, with the final LayerNorm; square images and patches, channels-last inputs. The
classifier reads the class token.
"""

import jax
import jax.numpy as jnp
import numpy as np

from ..models import PatchEmbedding, Pooler, Readout, SequenceModel
from ._family import (
    Family,
    Shapes,
    built_activation,
    linear,
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


def _side(c: dict, key: str) -> int:
    value = read_value(c, key, required=True)
    if isinstance(value, (list, tuple)) and len(value) == 2 and value[0] == value[1]:
        value = value[0]
    if type(value) is not int or value < 1:  # JSON's true is no size
        raise ValueError(
            f"config.json: {key} must be a positive integer (square images and patches), "
            f"got {value!r}."
        )
    return value


def _sizes(c: dict) -> tuple[int, int, int]:
    image, patch = _side(c, "image_size"), _side(c, "patch_size")
    if image % patch:
        raise ValueError(f"config.json: patch_size={patch} does not divide image_size={image}.")
    return image, patch, read_int(c, "num_channels", 3)


def _shapes(c: dict):
    d, n_layer, ff = (
        read_int(c, "hidden_size"),
        read_int(c, "num_hidden_layers"),
        read_int(c, "intermediate_size"),
    )
    read_heads(c, "num_attention_heads", d)
    read_activation(c, "hidden_act", "gelu")
    read_eps(c, "layer_norm_eps", 1e-12)
    image, patch, channels = _sizes(c)
    qkv_bias = c.get("qkv_bias", True)
    e = "embeddings."
    shapes: Shapes = {
        e + "cls_token": (1, 1, d),
        e + "position_embeddings": (1, (image // patch) ** 2 + 1, d),
        e + "patch_embeddings.projection.weight": (d, channels, patch, patch),
        e + "patch_embeddings.projection.bias": (d,),
    }
    for i in range(n_layer):
        a, h = f"encoder.layer.{i}.attention.", f"encoder.layer.{i}."
        for k in ("query", "key", "value"):
            shapes[f"{a}attention.{k}.weight"] = (d, d)
            if qkv_bias:
                shapes[f"{a}attention.{k}.bias"] = (d,)
        shapes |= {
            a + "output.dense.weight": (d, d), a + "output.dense.bias": (d,),
            h + "layernorm_before.weight": (d,), h + "layernorm_before.bias": (d,),
            h + "layernorm_after.weight": (d,), h + "layernorm_after.bias": (d,),
            h + "intermediate.dense.weight": (ff, d), h + "intermediate.dense.bias": (ff,),
            h + "output.dense.weight": (d, ff), h + "output.dense.bias": (d,),
        }  # fmt: skip
    shapes |= {"layernorm.weight": (d,), "layernorm.bias": (d,)}
    pool = read_int(c, "pooler_output_size", d)
    labels = len(c["id2label"]) if isinstance(c.get("id2label"), dict) else c.get("num_labels", 2)
    return shapes, {
        "pooler": {"pooler.dense.weight": (pool, d), "pooler.dense.bias": (pool,)},
        "classifier": {"classifier.weight": (labels, d), "classifier.bias": (labels,)},
    }


def _build(c, t, heads):
    if {"pooler", "classifier"} <= heads:
        raise ValueError(
            "The checkpoint has both a pooler and a classifier; ViTForImageClassification "
            "reads the class token without the pooler, so one of them is stray."
        )
    if "pooler" in heads:
        require(c, {"pooler_act": (("tanh",), "tanh")})
    qkv_bias = c.get("qkv_bias", True)
    layers = []
    for i in range(c["num_hidden_layers"]):
        a = lambda k, i=i: t[f"encoder.layer.{i}.attention.{k}"]  # noqa: E731
        h = lambda k, i=i: t[f"encoder.layer.{i}.{k}"]  # noqa: E731
        b = lambda k, a=a: a(f"attention.{k}.bias") if qkv_bias else None  # noqa: E731
        layers.append({
            "wq": linear(a("attention.query.weight")), "bq": b("query"),
            "wk": linear(a("attention.key.weight")), "bk": b("key"),
            "wv": linear(a("attention.value.weight")), "bv": b("value"),
            "wo": linear(a("output.dense.weight")), "bo": a("output.dense.bias"),
            "ln1_scale": h("layernorm_before.weight"), "ln1_bias": h("layernorm_before.bias"),
            "w1": linear(h("intermediate.dense.weight")), "b1": h("intermediate.dense.bias"),
            "w2": linear(h("output.dense.weight")), "b2": h("output.dense.bias"),
            "ln2_scale": h("layernorm_after.weight"), "ln2_bias": h("layernorm_after.bias"),
        })  # fmt: skip
    transformer = from_layers(
        layers,
        norm="pre",
        num_heads=c["num_attention_heads"],
        activation=read_activation(c, "hidden_act", "gelu"),
        ln_eps=read_eps(c, "layer_norm_eps", 1e-12),
        final_norm=norm_dict(t, "layernorm"),
    )
    dtype = transformer.layer(0).attention.wq.dtype
    image, patch, channels = _sizes(c)
    w = t["embeddings.patch_embeddings.projection.weight"]  # (d, C, p, p)
    d = w.shape[0]
    embedding = PatchEmbedding(
        (image, image, channels), patch, d, key=jax.random.key(0), dtype=dtype
    )
    # A patch is flattened as (row, column, channel); the convolution's kernel is
    # (out, channel, row, column).
    kernel = w.transpose(2, 3, 1, 0).reshape(patch * patch * channels, d)
    arrays = (
        kernel,
        t["embeddings.patch_embeddings.projection.bias"],
        t["embeddings.cls_token"].reshape(d),
        t["embeddings.position_embeddings"][0],
    )
    embedding = replace_arrays(
        embedding, lambda m: (m.weight, m.bias, m.cls_token, m.positions), arrays, dtype
    )
    head = None
    if "pooler" in heads:
        head = Pooler(
            weight=jnp.asarray(linear(t["pooler.dense.weight"]), dtype),
            bias=jnp.asarray(t["pooler.dense.bias"], dtype),
        )
    if "classifier" in heads:
        weight = linear(t["classifier.weight"])
        head = Readout(*weight.shape, key=jax.random.key(0), pooling="cls", dtype=dtype)
        head = replace_arrays(
            head, lambda m: (m.weight, m.bias), (weight, t["classifier.bias"]), dtype
        )
    return {"embedding": embedding, "transformer": transformer, "head": head}


def _channels(embedding: PatchEmbedding) -> int:
    """Channels of an image (a grey image of shape (H, W) has one)."""
    return embedding.input_shape[2] if len(embedding.input_shape) == 3 else 1


def describe(model: SequenceModel) -> dict:
    """The ViT ``config.json`` of an image classifier built from an ocformer
    configuration (no checkpoint of its own): square patches of a square image with a
    class token, a pre-LN encoder with the final LayerNorm, and a linear classifier on
    the class token. No dropout (the model was trained without it).

    Raises:
        ValueError: naming each part of ``model`` that ViT does not have.
    """
    t, embedding, head = model.transformer, model.embedding, model.head
    square = isinstance(embedding, PatchEmbedding) and (
        embedding.input_shape[0] == embedding.input_shape[1]
    )
    activation = built_activation(model, "ViT", [
        ("square images (an image task's PatchEmbedding)", square),
        ("a classifier on the class token",
         isinstance(head, Readout) and head.pooling == "cls"),
        ("non-causal attention", not t.attention.causal),
    ])  # fmt: skip
    assert isinstance(embedding, PatchEmbedding) and isinstance(head, Readout)
    labels = int(head.weight.shape[-1])
    return {
        "model_type": "vit",
        "image_size": embedding.input_shape[0],
        "patch_size": embedding.patch_size,
        "num_channels": _channels(embedding),
        "hidden_size": t.width,
        "num_hidden_layers": t.num_layers,
        "num_attention_heads": t.attention.num_heads,
        "intermediate_size": int(t.layer(0).feedforward.weights[0].shape[-1]),
        "hidden_act": activation,
        "layer_norm_eps": float(t.layer_norm.eps),
        "qkv_bias": True,
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
        "id2label": {str(i): f"LABEL_{i}" for i in range(labels)},
        "label2id": {f"LABEL_{i}": i for i in range(labels)},
    }


def _export(model: SequenceModel, c: dict):
    embedding, final = model.embedding, model.transformer.final_norm
    if not isinstance(embedding, PatchEmbedding) or final is None:
        raise ValueError("A ViT model needs a PatchEmbedding and the final LayerNorm.")
    p, channels = embedding.patch_size, _channels(embedding)
    weight = np.asarray(embedding.weight)
    d = weight.shape[1]
    e = "embeddings."
    out = {
        e + "cls_token": np.asarray(embedding.cls_token).reshape(1, 1, d),
        e + "position_embeddings": np.asarray(embedding.positions)[None],
        e + "patch_embeddings.projection.weight": np.ascontiguousarray(
            weight.reshape(p, p, channels, d).transpose(3, 2, 0, 1)
        ),
        e + "patch_embeddings.projection.bias": np.asarray(embedding.bias),
    }
    for i, layer in enumerate(to_layers(model.transformer)):
        a, h = f"encoder.layer.{i}.attention.", f"encoder.layer.{i}."
        for k, name in (("q", "query"), ("k", "key"), ("v", "value")):
            out[f"{a}attention.{name}.weight"] = linear(layer[f"w{k}"])
            if layer[f"b{k}"] is not None:
                out[f"{a}attention.{name}.bias"] = layer[f"b{k}"]
        out |= {
            a + "output.dense.weight": linear(layer["wo"]), a + "output.dense.bias": layer["bo"],
            h + "layernorm_before.weight": layer["ln1_scale"],
            h + "layernorm_before.bias": layer["ln1_bias"],
            h + "layernorm_after.weight": layer["ln2_scale"],
            h + "layernorm_after.bias": layer["ln2_bias"],
            h + "intermediate.dense.weight": linear(layer["w1"]),
            h + "intermediate.dense.bias": layer["b1"],
            h + "output.dense.weight": linear(layer["w2"]), h + "output.dense.bias": layer["b2"],
        }  # fmt: skip
    out |= norm_arrays(final, "layernorm")
    per_feature(out, ("layernorm_before", "layernorm_after", "layernorm"), d)
    head = model.head
    if isinstance(head, Readout) and head.pooling == "cls":
        out |= {
            "classifier.weight": linear(np.asarray(head.weight)),
            "classifier.bias": np.asarray(head.bias),
        }
        return out, {"architectures": ["ViTForImageClassification"]}
    if isinstance(head, Pooler):
        out |= {
            "pooler.dense.weight": linear(np.asarray(head.weight)),
            "pooler.dense.bias": np.asarray(head.bias),
        }
    elif head is not None:
        raise ValueError(
            f"A ViT model's head is a class-token Readout, a Pooler or None, got {head}."
        )
    return out, {"architectures": ["ViTModel"]}


VIT = Family(
    prefix="vit.",
    base_architecture="ViTModel",
    shapes=_shapes,
    build=_build,
    export=_export,
)
