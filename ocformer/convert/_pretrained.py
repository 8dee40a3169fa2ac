"""Hugging Face checkpoint directories (GPT-2, BERT, ViT) in and out of the continuous
model, read and written with the ``safetensors`` package's numpy API.

A checkpoint directory holds ``config.json`` and ``model.safetensors`` (or shards listed
in ``model.safetensors.index.json``). Tensor names are accepted with and without the
base-model prefix (``transformer.``, ``bert.``, ``vit.``): checkpoints published on the
Hub and those written by ``transformers`` differ there. Everything (configuration,
every name, every shape) is checked before a model is built, so a bad directory raises
``ValueError`` and nothing is half-loaded.
"""

import contextlib
import dataclasses
import json
import os
import re
import shutil
import uuid
from collections.abc import Callable, Mapping

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from ..controls import NormParams
from ..controls._control import PiecewiseConstant
from ..models import (
    ContinuousTransformer,
    PatchEmbedding,
    Pooler,
    Readout,
    SequenceModel,
    TokenEmbedding,
    TokenTypeEmbedding,
)
from ..operators import Activation
from ..splitting import Lie
from ._layers import from_layers, to_layers

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Written by to_pretrained next to the checkpoint: a directory that holds it (and only
# ocformer's files) was written by ocformer and may be exported into again.
EXPORT_MARKER = "ocformer_export.json"
_EXPORT_FILES = frozenset({CONFIG_FILE, WEIGHTS_FILE, EXPORT_MARKER})

# Hugging Face activation names -> the feed-forward sub-step. "gelu" is the exact (erf)
# GELU; "gelu_new" and "gelu_pytorch_tanh" are its tanh approximation (GPT-2).
_ACTIVATIONS: dict[str, Activation] = {
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "relu": "relu",
}
# Buffers some checkpoints carry that are not parameters: GPT-2's causal-mask tables and
# the position-id ranges of BERT-style embeddings. They are recomputed, never read.
_BUFFERS = re.compile(r"(^|\.)(position_ids|attn\.bias|attn\.masked_bias)$")

Shapes = dict[str, tuple[int, ...]]


# ---------------------------------------------------------------------------------------
# Reading a directory.


def _read_config(path: str) -> dict:
    if not os.path.isdir(path):
        raise ValueError(f"Checkpoint directory {path!r} does not exist or is not a directory.")
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(file):
        raise ValueError(
            f"{path!r} has no {CONFIG_FILE}: a Hugging Face checkpoint directory needs the "
            f"model's configuration next to its weights ({WEIGHTS_FILE})."
        )
    try:
        with open(file) as f:
            config = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{file} is not valid JSON: {e}.") from None
    if not isinstance(config, dict):
        raise ValueError(f"{file} must hold a JSON object, got {type(config).__name__}.")
    return config


def _weight_files(path: str) -> list[str]:
    single, index = os.path.join(path, WEIGHTS_FILE), os.path.join(path, INDEX_FILE)
    if os.path.isfile(single):
        return [single]
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index} has no 'weight_map' of tensor names to shard files.")
        shards = sorted(set(weight_map.values()))
        absent = [s for s in shards if not os.path.isfile(os.path.join(path, s))]
        if absent:
            raise ValueError(f"{index} lists shard files that are not in {path!r}: {absent}.")
        return [os.path.join(path, s) for s in shards]
    others = sorted(f for f in os.listdir(path) if f.endswith((".bin", ".h5", ".msgpack")))
    hint = (
        f" It has {others}: convert them to safetensors with transformers "
        "(model.save_pretrained(path), the default format)."
        if others
        else ""
    )
    raise ValueError(f"{path!r} has neither {WEIGHTS_FILE} nor {INDEX_FILE}.{hint}")


@contextlib.contextmanager
def _open_weights(file: str):
    """``safe_open(file)``, with the library's errors (a truncated or damaged file, on
    opening or on reading a tensor) turned into a ``ValueError`` that names the file."""
    try:
        with safe_open(file, framework="np") as f:
            yield f
    except SafetensorError as e:
        raise ValueError(
            f"{file} cannot be read as a safetensors file ({e}): it is truncated or "
            "damaged; save or download the checkpoint again"
        ) from None


def _tensor_shapes(files: list[str]) -> dict[str, tuple[tuple[int, ...], str, str]]:
    """Every tensor's shape, the file holding it and its stored dtype, without reading
    the data."""
    out: dict[str, tuple[tuple[int, ...], str, str]] = {}
    for file in files:
        with _open_weights(file) as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has keys(), no iteration)
                if name in out:
                    raise ValueError(f"Tensor {name!r} is in two shards: {out[name][1]}, {file}.")
                tensor = f.get_slice(name)
                out[name] = (tuple(tensor.get_shape()), file, tensor.get_dtype())
    return out


# ---------------------------------------------------------------------------------------
# The three families: the tensors a configuration implies, and how they map to the model.


@dataclasses.dataclass(frozen=True)
class _Family:
    """What one ``model_type`` needs.

    Attributes:
        prefix: the base model's tensor prefix, optional in a checkpoint.
        shapes: config -> (required tensors, {head name: its tensors}), canonical names
            (without the prefix); a head is present with all its tensors or absent.
        build: (config, tensors, heads present) -> the model's pieces.
        export: (model, config) -> (canonical tensors, config updates).
    """

    prefix: str
    shapes: Callable[[dict], tuple[Shapes, dict[str, Shapes]]]
    build: Callable[[dict, Mapping[str, np.ndarray], frozenset[str]], dict]
    export: Callable[[SequenceModel, dict], tuple[dict[str, np.ndarray], dict]]


def _get(config: dict, key: str, default=None, *, required: bool = False):
    if key not in config or config[key] is None:
        if required:
            raise ValueError(f"config.json has no {key!r}, which a {config['model_type']} needs.")
        return default
    return config[key]


def _int(config: dict, key: str, default=None) -> int:
    value = _get(config, key, default, required=default is None)
    if not (isinstance(value, int) and value >= 1):
        raise ValueError(f"config.json: {key} must be a positive integer, got {value!r}.")
    return value


def _require(config: dict, key: str, allowed, default) -> None:
    value = config.get(key, default)
    if value not in allowed:
        raise ValueError(
            f"config.json: {key}={value!r} is not supported for {config['model_type']} "
            f"(supported: {list(allowed)}); the continuous model would not reproduce it."
        )


def _activation(config: dict, key: str) -> Activation:
    name = config.get(key)
    if name not in _ACTIVATIONS:
        raise ValueError(
            f"config.json: {key}={name!r} is not supported; supported activations: "
            f"{sorted(_ACTIVATIONS)} ('gelu' is the exact erf GELU, 'gelu_new' its tanh "
            "approximation)."
        )
    return _ACTIVATIONS[name]


def _eps(config: dict, key: str) -> float:
    eps = config.get(key)
    if not (isinstance(eps, (int, float)) and eps >= 0):
        raise ValueError(f"config.json: {key} must be a number >= 0, got {eps!r}.")
    return float(eps)


def _heads(config: dict, key: str, d: int) -> int:
    heads = _int(config, key)
    if d % heads:
        raise ValueError(f"config.json: {key}={heads} does not divide the width {d}.")
    return heads


def _linear(w: np.ndarray) -> np.ndarray:
    """A torch ``Linear`` weight (out, in) as a kernel acting on the right (in, out)."""
    return np.ascontiguousarray(w.T)


def _norm_dict(t, name: str) -> dict:
    return {"scale": t[f"{name}.weight"], "bias": t[f"{name}.bias"]}


def _norm_arrays(p: NormParams, name: str) -> dict[str, np.ndarray]:
    return {f"{name}.weight": np.asarray(p.scale), f"{name}.bias": np.asarray(p.bias)}


# GPT-2 ---------------------------------------------------------------------------------


def _gpt2_sizes(c: dict) -> tuple[int, int, int, int, int]:
    d = _int(c, "n_embd")
    inner = _get(c, "n_inner")
    return d, _int(c, "n_layer"), 4 * d if inner is None else _int(c, "n_inner"), \
        _int(c, "vocab_size"), _int(c, "n_positions")  # fmt: skip


def _gpt2_shapes(c: dict):
    _require(c, "scale_attn_weights", (True,), True)
    _require(c, "scale_attn_by_inverse_layer_idx", (False,), False)
    _require(c, "add_cross_attention", (False,), False)
    _require(c, "tie_word_embeddings", (True,), True)
    d, n_layer, ff, vocab, positions = _gpt2_sizes(c)
    _heads(c, "n_head", d)
    _activation(c, "activation_function")
    _eps(c, "layer_norm_epsilon")
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


def _gpt2_build(c, t, heads):
    if "lm_head" in heads and not np.array_equal(t["lm_head.weight"], t["wte.weight"]):
        raise ValueError(
            "lm_head.weight differs from wte.weight, but GPT-2's language-model head is "
            "tied to the token embedding; an untied head is not supported."
        )
    d, n_layer, *_ = _gpt2_sizes(c)
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
        activation=_activation(c, "activation_function"),
        causal=True,
        ln_eps=_eps(c, "layer_norm_epsilon"),
        final_norm=_norm_dict(t, "ln_f"),
    )
    embedding = _token_embedding(t["wte.weight"], t["wpe.weight"])
    return {"embedding": embedding, "transformer": transformer, "head": None, "tied": True}


def _gpt2_export(model: SequenceModel, c: dict):
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
    out |= _norm_arrays(final, "ln_f")
    return out, {"architectures": ["GPT2LMHeadModel"], "tie_word_embeddings": True}


# BERT ----------------------------------------------------------------------------------


def _bert_shapes(c: dict):
    _require(c, "position_embedding_type", ("absolute",), "absolute")
    _require(c, "is_decoder", (False,), False)
    _require(c, "add_cross_attention", (False,), False)
    d, n_layer, ff = (
        _int(c, "hidden_size"),
        _int(c, "num_hidden_layers"),
        _int(c, "intermediate_size"),
    )
    _heads(c, "num_attention_heads", d)
    _activation(c, "hidden_act")
    _eps(c, "layer_norm_eps")
    e = "embeddings."
    shapes: Shapes = {
        e + "word_embeddings.weight": (_int(c, "vocab_size"), d),
        e + "position_embeddings.weight": (_int(c, "max_position_embeddings"), d),
        e + "token_type_embeddings.weight": (_int(c, "type_vocab_size"), d),
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


def _bert_build(c, t, heads):
    layers = []
    for i in range(c["num_hidden_layers"]):
        a = lambda k, i=i: t[f"encoder.layer.{i}.attention.{k}"]  # noqa: E731
        h = lambda k, i=i: t[f"encoder.layer.{i}.{k}"]  # noqa: E731
        layers.append({
            "wq": _linear(a("self.query.weight")), "bq": a("self.query.bias"),
            "wk": _linear(a("self.key.weight")), "bk": a("self.key.bias"),
            "wv": _linear(a("self.value.weight")), "bv": a("self.value.bias"),
            "wo": _linear(a("output.dense.weight")), "bo": a("output.dense.bias"),
            "ln1_scale": a("output.LayerNorm.weight"), "ln1_bias": a("output.LayerNorm.bias"),
            "w1": _linear(h("intermediate.dense.weight")), "b1": h("intermediate.dense.bias"),
            "w2": _linear(h("output.dense.weight")), "b2": h("output.dense.bias"),
            "ln2_scale": h("output.LayerNorm.weight"), "ln2_bias": h("output.LayerNorm.bias"),
        })  # fmt: skip
    eps = _eps(c, "layer_norm_eps")
    transformer = from_layers(
        layers,
        norm="post",
        num_heads=c["num_attention_heads"],
        activation=_activation(c, "hidden_act"),
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
            weight=jnp.asarray(_linear(t["pooler.dense.weight"]), dtype),
            bias=jnp.asarray(t["pooler.dense.bias"], dtype),
        )
    return {"embedding": embedding, "transformer": transformer, "head": head}


def _bert_export(model: SequenceModel, c: dict):
    embedding = model.embedding
    if not isinstance(embedding, TokenTypeEmbedding):
        raise ValueError("A BERT model needs a TokenTypeEmbedding.")
    e = "embeddings."
    out = {
        e + "word_embeddings.weight": np.asarray(embedding.tokens),
        e + "position_embeddings.weight": np.asarray(embedding.positions),
        e + "token_type_embeddings.weight": np.asarray(embedding.token_types),
    } | _norm_arrays(embedding.norm, e + "LayerNorm")
    for i, layer in enumerate(to_layers(model.transformer)):
        a, h = f"encoder.layer.{i}.attention.", f"encoder.layer.{i}."
        for k, name in (("q", "query"), ("k", "key"), ("v", "value")):
            out |= {
                f"{a}self.{name}.weight": _linear(layer[f"w{k}"]),
                f"{a}self.{name}.bias": layer[f"b{k}"],
            }
        out |= {
            a + "output.dense.weight": _linear(layer["wo"]), a + "output.dense.bias": layer["bo"],
            a + "output.LayerNorm.weight": layer["ln1_scale"],
            a + "output.LayerNorm.bias": layer["ln1_bias"],
            h + "intermediate.dense.weight": _linear(layer["w1"]),
            h + "intermediate.dense.bias": layer["b1"],
            h + "output.dense.weight": _linear(layer["w2"]), h + "output.dense.bias": layer["b2"],
            h + "output.LayerNorm.weight": layer["ln2_scale"],
            h + "output.LayerNorm.bias": layer["ln2_bias"],
        }  # fmt: skip
    if isinstance(model.head, Pooler):
        out |= {
            "pooler.dense.weight": _linear(np.asarray(model.head.weight)),
            "pooler.dense.bias": np.asarray(model.head.bias),
        }
    elif model.head is not None:
        raise ValueError(f"A BERT model's head is a Pooler or None, got {type(model.head)}.")
    return out, {"architectures": ["BertModel"]}


# ViT -----------------------------------------------------------------------------------


def _side(c: dict, key: str) -> int:
    value = _get(c, key, required=True)
    if isinstance(value, (list, tuple)) and len(value) == 2 and value[0] == value[1]:
        value = value[0]
    if not (isinstance(value, int) and value >= 1):
        raise ValueError(
            f"config.json: {key} must be a positive integer (square images and patches), "
            f"got {value!r}."
        )
    return value


def _vit_sizes(c: dict) -> tuple[int, int, int]:
    image, patch = _side(c, "image_size"), _side(c, "patch_size")
    if image % patch:
        raise ValueError(f"config.json: patch_size={patch} does not divide image_size={image}.")
    return image, patch, _int(c, "num_channels", 3)


def _vit_shapes(c: dict):
    d, n_layer, ff = (
        _int(c, "hidden_size"),
        _int(c, "num_hidden_layers"),
        _int(c, "intermediate_size"),
    )
    _heads(c, "num_attention_heads", d)
    _activation(c, "hidden_act")
    _eps(c, "layer_norm_eps")
    image, patch, channels = _vit_sizes(c)
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
    pool = _int(c, "pooler_output_size", d)
    labels = len(c["id2label"]) if isinstance(c.get("id2label"), dict) else c.get("num_labels", 2)
    return shapes, {
        "pooler": {"pooler.dense.weight": (pool, d), "pooler.dense.bias": (pool,)},
        "classifier": {"classifier.weight": (labels, d), "classifier.bias": (labels,)},
    }


def _vit_build(c, t, heads):
    if {"pooler", "classifier"} <= heads:
        raise ValueError(
            "The checkpoint has both a pooler and a classifier; ViTForImageClassification "
            "reads the class token without the pooler, so one of them is stray."
        )
    if "pooler" in heads:
        _require(c, "pooler_act", ("tanh",), "tanh")
    qkv_bias = c.get("qkv_bias", True)
    layers = []
    for i in range(c["num_hidden_layers"]):
        a = lambda k, i=i: t[f"encoder.layer.{i}.attention.{k}"]  # noqa: E731
        h = lambda k, i=i: t[f"encoder.layer.{i}.{k}"]  # noqa: E731
        b = lambda k, a=a: a(f"attention.{k}.bias") if qkv_bias else None  # noqa: E731
        layers.append({
            "wq": _linear(a("attention.query.weight")), "bq": b("query"),
            "wk": _linear(a("attention.key.weight")), "bk": b("key"),
            "wv": _linear(a("attention.value.weight")), "bv": b("value"),
            "wo": _linear(a("output.dense.weight")), "bo": a("output.dense.bias"),
            "ln1_scale": h("layernorm_before.weight"), "ln1_bias": h("layernorm_before.bias"),
            "w1": _linear(h("intermediate.dense.weight")), "b1": h("intermediate.dense.bias"),
            "w2": _linear(h("output.dense.weight")), "b2": h("output.dense.bias"),
            "ln2_scale": h("layernorm_after.weight"), "ln2_bias": h("layernorm_after.bias"),
        })  # fmt: skip
    transformer = from_layers(
        layers,
        norm="pre",
        num_heads=c["num_attention_heads"],
        activation=_activation(c, "hidden_act"),
        ln_eps=_eps(c, "layer_norm_eps"),
        final_norm=_norm_dict(t, "layernorm"),
    )
    dtype = transformer.layer(0).attention.wq.dtype
    image, patch, channels = _vit_sizes(c)
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
    embedding = _replace(
        embedding, lambda m: (m.weight, m.bias, m.cls_token, m.positions), arrays, dtype
    )
    head = None
    if "pooler" in heads:
        head = Pooler(
            weight=jnp.asarray(_linear(t["pooler.dense.weight"]), dtype),
            bias=jnp.asarray(t["pooler.dense.bias"], dtype),
        )
    if "classifier" in heads:
        weight = _linear(t["classifier.weight"])
        head = Readout(*weight.shape, key=jax.random.key(0), pooling="cls", dtype=dtype)
        head = _replace(head, lambda m: (m.weight, m.bias), (weight, t["classifier.bias"]), dtype)
    return {"embedding": embedding, "transformer": transformer, "head": head}


def _vit_export(model: SequenceModel, c: dict):
    embedding, final = model.embedding, model.transformer.final_norm
    if not isinstance(embedding, PatchEmbedding) or final is None:
        raise ValueError("A ViT model needs a PatchEmbedding and the final LayerNorm.")
    p, (_, _, channels) = embedding.patch_size, embedding.input_shape
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
            out[f"{a}attention.{name}.weight"] = _linear(layer[f"w{k}"])
            if layer[f"b{k}"] is not None:
                out[f"{a}attention.{name}.bias"] = layer[f"b{k}"]
        out |= {
            a + "output.dense.weight": _linear(layer["wo"]), a + "output.dense.bias": layer["bo"],
            h + "layernorm_before.weight": layer["ln1_scale"],
            h + "layernorm_before.bias": layer["ln1_bias"],
            h + "layernorm_after.weight": layer["ln2_scale"],
            h + "layernorm_after.bias": layer["ln2_bias"],
            h + "intermediate.dense.weight": _linear(layer["w1"]),
            h + "intermediate.dense.bias": layer["b1"],
            h + "output.dense.weight": _linear(layer["w2"]), h + "output.dense.bias": layer["b2"],
        }  # fmt: skip
    out |= _norm_arrays(final, "layernorm")
    head = model.head
    if isinstance(head, Readout) and head.pooling == "cls":
        out |= {
            "classifier.weight": _linear(np.asarray(head.weight)),
            "classifier.bias": np.asarray(head.bias),
        }
        return out, {"architectures": ["ViTForImageClassification"]}
    if isinstance(head, Pooler):
        out |= {
            "pooler.dense.weight": _linear(np.asarray(head.weight)),
            "pooler.dense.bias": np.asarray(head.bias),
        }
    elif head is not None:
        raise ValueError(
            f"A ViT model's head is a class-token Readout, a Pooler or None, got {head}."
        )
    return out, {"architectures": ["ViTModel"]}


FAMILIES: dict[str, _Family] = {
    "gpt2": _Family("transformer.", _gpt2_shapes, _gpt2_build, _gpt2_export),
    "bert": _Family("bert.", _bert_shapes, _bert_build, _bert_export),
    "vit": _Family("vit.", _vit_shapes, _vit_build, _vit_export),
}
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(FAMILIES)


# ---------------------------------------------------------------------------------------
# Shared pieces.


def _token_embedding(tokens: np.ndarray, positions: np.ndarray) -> TokenEmbedding:
    dtype = jnp.asarray(tokens).dtype
    embedding = TokenEmbedding(
        tokens.shape[0], positions.shape[0], tokens.shape[1], key=jax.random.key(0), dtype=dtype
    )
    return _replace(embedding, lambda m: (m.tokens, m.positions), (tokens, positions), dtype)


def _replace(module, where, arrays, dtype):
    return eqx.tree_at(where, module, tuple(jnp.asarray(a, dtype) for a in arrays))


def _family(config: dict) -> _Family:
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        raise ValueError(
            f"config.json: model_type={model_type!r} is not supported; supported model "
            f"types: {', '.join(SUPPORTED_MODEL_TYPES)}."
        )
    return FAMILIES[model_type]


def _canonical(name: str, prefix: str) -> str:
    if name.startswith(prefix):
        name = name[len(prefix) :]
    # Older BERT checkpoints name LayerNorm parameters gamma and beta.
    name = re.sub(r"LayerNorm\.gamma$", "LayerNorm.weight", name)
    return re.sub(r"LayerNorm\.beta$", "LayerNorm.bias", name)


def _match(
    found: dict[str, tuple[tuple[int, ...], str, str]],
    family: _Family,
    config: dict,
    ignore: tuple[str, ...],
) -> tuple[dict[str, str], frozenset[str]]:
    """Canonical name -> file name, and the heads present; every mismatch named."""
    required, heads = family.shapes(config)
    names: dict[str, str] = {}
    for name in found:
        if _BUFFERS.search(name) or name.startswith(ignore):
            continue
        canonical = _canonical(name, family.prefix)
        if canonical in names:
            raise ValueError(
                f"Tensors {names[canonical]!r} and {name!r} are the same parameter spelt "
                "twice (with and without the base-model prefix)."
            )
        names[canonical] = name
    present = frozenset(h for h, group in heads.items() if set(group) & set(names))
    expected = dict(required)
    for h in present:
        expected |= heads[h]
    missing = sorted(set(expected) - set(names))
    extra = sorted(set(names) - set(expected))
    model_type = config["model_type"]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing tensors {missing}")
        if extra:
            parts.append(f"unexpected tensors {[names[k] for k in extra]}")
        raise ValueError(
            f"The {model_type} checkpoint does not match its config.json: "
            f"{'; '.join(parts)}. Supported heads for {model_type}: "
            f"{sorted(heads) or 'none'}; leave other heads out by name prefix with "
            "from_pretrained(path, ignore=('cls.',)) (for example)."
        )
    for canonical, shape in expected.items():
        got = found[names[canonical]][0]
        if got != shape:
            raise ValueError(
                f"Tensor {names[canonical]!r} has shape {got}, but config.json implies {shape}."
            )
    return names, present


def _target_dtype(dtype, found, names: dict[str, str]) -> np.dtype:
    if dtype is None:
        # The dtype of the parameters (not of buffers such as GPT-2's mask tables).
        stored = {found[name][2] for name in names.values()}
        dtype = np.float64 if stored == {"F64"} else np.float32
    dtype = np.dtype(dtype)
    if not np.issubdtype(dtype, np.floating):
        raise ValueError(f"dtype must be a floating dtype, got {dtype}.")
    if dtype == np.float64 and not jax.config.read("jax_enable_x64"):
        raise ValueError(
            "dtype=float64 needs 64-bit JAX: jax.config.update('jax_enable_x64', True) "
            "before loading (or dtype=None/float32)."
        )
    return dtype


def _read(files: list[str], names: dict[str, str], dtype: np.dtype) -> dict[str, np.ndarray]:
    wanted = {file_name: canonical for canonical, file_name in names.items()}
    out = {}
    for file in files:
        with _open_weights(file) as f:
            for name in f.keys():  # noqa: SIM118
                if name in wanted:
                    try:
                        out[wanted[name]] = f.get_tensor(name).astype(dtype)
                    except TypeError as e:
                        raise ValueError(
                            f"Tensor {name!r} in {file} cannot be read as a numpy array "
                            f"({e}); save the checkpoint in float32 or float64."
                        ) from None
    return out


# ---------------------------------------------------------------------------------------
# The public functions.


def from_pretrained(
    path: str | os.PathLike, *, dtype=None, ignore: tuple[str, ...] = ()
) -> SequenceModel:
    """A local Hugging Face checkpoint of GPT-2, BERT or ViT as a continuous model.

    The embedding is the initial condition f; the layers become piecewise-constant
    controls of the continuous Transformer under the Lie scheme with one step per layer
    (``from_layers``): pre-LN, causal, with the model's GELU variant for GPT-2; post-LN
    for BERT; pre-LN for ViT; each with its LayerNorm epsilon and final LayerNorm. The
    head reads u(T): GPT-2's LM head tied to the token embedding, BERT's pooler, ViT's
    classifier (or pooler) on the class token, or None when the checkpoint has none.

    No network, no torch: ``config.json`` and ``model.safetensors`` (or its shards,
    listed in ``model.safetensors.index.json``) are read with ``safetensors``.

    Args:
        path: the checkpoint directory (what ``save_pretrained`` writes).
        dtype: floating dtype of the model; None keeps the checkpoint's (float32 for
            half-precision checkpoints). float64 needs ``jax_enable_x64``.
        ignore: name prefixes of tensors to leave out, for heads ocformer does not
            import (e.g. ``("cls.",)`` for BERT's pre-training heads on the Hub); by
            default every tensor must be accounted for.

    Returns:
        A ``SequenceModel``: ``logits(inputs)`` (images channels-last for ViT),
        ``hidden_states(inputs, key_mask)``.

    Raises:
        ValueError: no such directory, no ``config.json`` or weights, an unsupported
            ``model_type`` or configuration option, missing or unexpected tensors (all
            named), or a tensor whose shape disagrees with the configuration. Nothing is
            built before every check has passed.
    """
    path = os.fspath(path)
    config = _read_config(path)
    family = _family(config)
    files = _weight_files(path)
    found = _tensor_shapes(files)
    if isinstance(ignore, str) or not all(isinstance(p, str) and p for p in ignore):
        raise ValueError(f"ignore must be a tuple of non-empty name prefixes, got {ignore!r}.")
    names, heads = _match(found, family, config, tuple(ignore))
    target = _target_dtype(dtype, found, names)
    tensors = _read(files, names, target)
    parts = family.build(config, tensors, heads)
    return SequenceModel(source_config=json.dumps(config, sort_keys=True), **parts)


def _check_standard(transformer: ContinuousTransformer) -> None:
    # The file format stores the layers, which a reader evaluates as the standard stack:
    # only the discretisation that is that stack may be written.
    d = transformer.discretisation
    standard = (
        isinstance(d.stepper, Lie)
        and d.stepper.sub_solver == "euler"
        and d.steps_per_layer == 1
        and d.stepsize == "constant"
        and transformer.formulation == "split"
        and isinstance(transformer.control, PiecewiseConstant)
    )
    if not standard:
        raise ValueError(
            "to_pretrained writes the standard layer stack, which is the Lie scheme with "
            "one explicit-Euler step per layer, piecewise-constant controls and the split "
            "formulation; this model is discretised otherwise (stepper "
            f"{type(d.stepper).__name__}, steps_per_layer {d.steps_per_layer}, stepsize "
            f"{d.stepsize!r}, formulation {transformer.formulation!r}). Write the model it "
            "was derived from, or "
            "rediscretise it back with ocformer.models.rediscretise(model, Discretisation())."
        )


def _check_destination(path: str, overwrite: bool) -> None:
    """Refuse a destination that holds anything but ocformer's own export.

    Raises:
        ValueError: ``path`` is a file.
        FileExistsError: ``path`` is a directory that is not empty and is not an
            export of ocformer's (or holds files besides it), and ``overwrite`` is off.
    """
    if os.path.lexists(path) and not os.path.isdir(path):
        raise ValueError(
            f"to_pretrained writes a checkpoint directory, but {path!r} is a file; give "
            "the path of a new or empty directory."
        )
    if overwrite or not os.path.isdir(path):
        return
    names = sorted(os.listdir(path))
    if not names:
        return
    if EXPORT_MARKER in names:
        ours = _EXPORT_FILES | _marker_files(os.path.join(path, EXPORT_MARKER))
        foreign = [n for n in names if n not in ours]
        if not foreign:
            return
        why = f"it holds files that ocformer did not write: {foreign}"
    else:
        shown = names[:6] + ([f"... {len(names) - 6} more"] if len(names) > 6 else [])
        why = f"it was not written by ocformer (no {EXPORT_MARKER}; it holds {shown})"
    raise FileExistsError(
        f"to_pretrained refuses to write into {path!r}: {why}. Writing there would mix "
        "two checkpoints (stale weights, shards or an index next to the new files). Give "
        "a new or empty directory, or pass overwrite=True to replace the whole directory."
    )


def _marker_files(marker: str) -> frozenset[str]:
    """The extra files (a tokenizer) that an export's marker says it wrote."""
    try:
        with open(marker) as f:
            files = json.load(f).get("files", [])
    except (OSError, ValueError, AttributeError):
        return frozenset()
    return frozenset(f for f in files if isinstance(f, str) and os.path.basename(f) == f)


def _sibling(path: str, kind: str) -> str:
    """A new hidden name next to ``path``, on its file system (a rename cannot cross
    file systems)."""
    name = f".{os.path.basename(path)}.{kind}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    return os.path.join(os.path.dirname(path), name)


def _replace_directory(new: str, path: str) -> None:
    """Put the finished directory ``new`` at ``path`` (a sibling): by one rename when
    ``path`` is absent or empty, else by moving the old directory aside first, so that
    ``path`` holds either the old or the new checkpoint whole, never a mix."""
    try:
        os.rename(new, path)  # replaces an empty directory too
        return
    except OSError:
        if not os.path.isdir(path):
            raise
    old = _sibling(path, "old")
    os.rename(path, old)
    try:
        os.rename(new, path)
    except OSError:
        os.rename(old, path)  # put the old checkpoint back
        raise
    shutil.rmtree(old, ignore_errors=True)


def to_pretrained(
    model: SequenceModel,
    path: str | os.PathLike,
    *,
    overwrite: bool = False,
    files: Mapping[str, str | os.PathLike] | None = None,
) -> None:
    """Write ``model`` as a Hugging Face checkpoint directory that ``transformers`` loads.

    ``config.json`` is the source configuration with ``architectures`` and ``dtype``
    set; ``model.safetensors`` holds the tensors in the names the installed
    ``transformers`` writes (GPT2LMHeadModel, BertModel, ViTForImageClassification or
    ViTModel), in the model's dtype. The feed-forward kernels are reassembled as
    E + W_1 and R + W_2, so a round trip is exact up to one rounding of their diagonals.

    The directory is written whole: into a temporary sibling directory, then renamed
    into place, so an interrupted export never leaves half a checkpoint. Besides the
    checkpoint it holds ``ocformer_export.json``, which marks it as ocformer's: it may
    be exported into again (and is then replaced whole). Any other directory that is
    not empty is refused unless ``overwrite=True``, which replaces it whole (no stale
    shard, index or weight file of the old checkpoint is left).

    Args:
        model: the model to export.
        path: the checkpoint directory (new, empty, or an earlier export).
        overwrite: replace a directory that holds anything else.
        files: further files to put in the checkpoint directory (name -> source file),
            such as the run's ``tokenizer.json``; written with the checkpoint and
            listed in its marker, so that exporting into the directory again is allowed.

    Raises:
        ValueError: ``model`` is not a ``SequenceModel`` of a supported family, or its
            transformer is not the standard discretisation (Lie, one step per layer);
            or ``path`` is a file.
        FileExistsError: ``path`` is a directory that is not empty and that ocformer
            did not write (or holds files besides ocformer's export), and ``overwrite``
            is off. Nothing in it is changed.
    """
    if not isinstance(model, SequenceModel):
        raise ValueError(
            f"to_pretrained takes an ocformer.models.SequenceModel, got {type(model).__name__}."
        )
    if model.source_config is None:
        raise ValueError(
            "to_pretrained writes a model in the format of the checkpoint it came from, "
            "and this model came from none (source_config is None): it was built from an "
            "ocformer configuration, whose embedding and head (an untied readout with a "
            "bias) no GPT-2, BERT or ViT checkpoint has. Start the run from a checkpoint "
            "(model.init_from=DIR) to be able to export it."
        )
    _check_standard(model.transformer)
    files = {} if files is None else dict(files)
    for name, source in files.items():
        if os.path.basename(name) != name or name in _EXPORT_FILES:
            raise ValueError(
                f"files: {name!r} must be a plain file name other than {sorted(_EXPORT_FILES)}."
            )
        if not os.path.isfile(source):
            raise ValueError(f"files: {name!r} is to be copied from {source!r}, not a file.")
    path = os.path.abspath(os.fspath(path))
    _check_destination(path, overwrite)
    config = json.loads(model.source_config)
    family = _family(config)
    tensors, updates = family.export(model, config)
    dtype = np.asarray(next(iter(tensors.values()))).dtype
    prefix = family.prefix if updates["architectures"][0] != _base_architecture(config) else ""
    heads_outside = ("lm_head.", "classifier.")
    out = {
        (k if k.startswith(heads_outside) else prefix + k): np.ascontiguousarray(v, dtype=dtype)
        for k, v in tensors.items()
    }
    config |= updates | {"dtype": str(dtype)}
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    staging = _sibling(path, "tmp")
    os.mkdir(staging)  # with the user's umask, as the directory will have
    try:
        with open(os.path.join(staging, CONFIG_FILE), "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
        save_file(out, os.path.join(staging, WEIGHTS_FILE), metadata={"format": "pt"})
        for name, source in files.items():
            shutil.copyfile(source, os.path.join(staging, name))
        marker = {
            "model_type": config["model_type"],
            "architectures": config["architectures"],
            "files": sorted(files),
        }
        with open(os.path.join(staging, EXPORT_MARKER), "w") as f:
            json.dump(marker, f, indent=2)
        for name in os.listdir(staging):  # on disk before the rename makes them visible
            with open(os.path.join(staging, name), "rb") as f:
                os.fsync(f.fileno())
        # Checked again just before the swap: the directory may have changed meanwhile.
        _check_destination(path, overwrite)
        _replace_directory(staging, path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _base_architecture(config: dict) -> str:
    return {"gpt2": "GPT2Model", "bert": "BertModel", "vit": "ViTModel"}[config["model_type"]]
