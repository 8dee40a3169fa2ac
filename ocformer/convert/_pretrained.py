"""Hugging Face checkpoint directories (GPT-2, BERT, ViT) in and out of the continuous
model.

A checkpoint directory holds ``config.json`` and ``model.safetensors`` (or shards listed
in ``model.safetensors.index.json``); ``_directory`` reads and writes it. Each
``model_type`` is a ``Family`` (``_gpt2``, ``_bert``, ``_vit``): the tensors its
configuration implies and how they map to the model. ``_matching`` checks the names and
shapes found against them. Everything (configuration, every name, every shape) is
checked before a model is built, so a bad directory raises ``ValueError`` and nothing is
half-loaded.
"""

import json
import os
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ..models import PatchEmbedding, SequenceModel
from ._bert import BERT
from ._directory import (
    CONFIG_FILE as CONFIG_FILE,  # the file names are read by training's init_from too
    INDEX_FILE as INDEX_FILE,
    WEIGHTS_FILE as WEIGHTS_FILE,
    check_destination,
    check_extra_files,
    read_config,
    read_tensors,
    recover_interrupted,
    tensor_shapes,
    weight_files,
    write_directory,
)
from ._family import Family
from ._gpt2 import GPT2, describe as describe_gpt2
from ._layers import check_standard
from ._matching import match_names, target_dtype
from ._vit import VIT, describe as describe_vit

FAMILIES: dict[str, Family] = {"gpt2": GPT2, "bert": BERT, "vit": VIT}
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(FAMILIES)


def _family(config: dict) -> Family:
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        raise ValueError(
            f"config.json: model_type={model_type!r} is not supported; supported model "
            f"types: {', '.join(SUPPORTED_MODEL_TYPES)}."
        )
    return FAMILIES[model_type]


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
    config = read_config(path)
    family = _family(config)
    files = weight_files(path)
    found = tensor_shapes(files)
    if isinstance(ignore, str) or not all(isinstance(p, str) and p for p in ignore):
        raise ValueError(f"ignore must be a tuple of non-empty name prefixes, got {ignore!r}.")
    names, heads = match_names(found, family, config, tuple(ignore))
    target = target_dtype(dtype, found, names)
    tensors = read_tensors(files, names, target)
    parts = family.build(config, tensors, heads)
    return SequenceModel(source_config=json.dumps(config, sort_keys=True), **parts)


def export_config(model: SequenceModel) -> dict:
    """The configuration ``to_pretrained`` writes ``model`` with (before it sets
    ``architectures`` and ``dtype``): that of the checkpoint the model came from
    (``source_config``), or for a model built from an ocformer configuration the one
    that describes it: GPT-2's for a language model with GPT-2's architecture (a tied
    readout, ``model.readout=tied``, pre-LN with the final LayerNorm), ViT's for an
    image classifier with ViT's (square images, pre-LN with the final LayerNorm).

    Raises:
        ValueError: the model came from no checkpoint and has neither architecture
            (naming what it lacks).
    """
    if model.source_config is not None:
        return json.loads(model.source_config)
    if isinstance(model.embedding, PatchEmbedding):
        return describe_vit(model)
    return describe_gpt2(model)


# What the configuration ``to_pretrained`` writes must give back, by name.
_ARCHITECTURE: dict[str, Callable[[SequenceModel], object]] = {
    "layers": lambda m: m.transformer.num_layers,
    "width": lambda m: m.transformer.width,
    "attention heads": lambda m: m.transformer.attention.num_heads,
    "causal attention": lambda m: m.transformer.attention.causal,
    "activation": lambda m: m.transformer.feedforward.activation,
    "LayerNorm epsilon": lambda m: m.transformer.layer_norm.eps,
    "LayerNorm position": lambda m: m.transformer.norm,
    "final LayerNorm": lambda m: m.transformer.final_norm is not None,
    "embedding": lambda m: type(m.embedding).__name__,
    "readout": lambda m: "tied" if m.tied else type(m.head).__name__,
}


def _check_describes(model: SequenceModel, family: Family, config: dict, tensors) -> None:
    """Refuse to write ``config`` with ``tensors`` unless ``transformers`` would compute
    ``model`` with them: every tensor the configuration implies, of its shape, and no
    other; and the model ``from_pretrained`` builds from them of ``model``'s
    architecture. A model from ``from_pretrained`` whose transformer was replaced
    (``with_transformer``) still carries its source's configuration, which may no
    longer describe it: written as it was, the checkpoint computed another function
    (another activation, epsilon, head count or causality), or left layers for
    ``transformers`` to initialise at random.

    Raises:
        ValueError: naming the tensors or the architecture's parts that differ.
    """
    required, optional = family.shapes(config)
    present = frozenset(h for h, group in optional.items() if set(group) <= set(tensors))
    expected = dict(required)
    for head in present:
        expected |= optional[head]
    found = {k: tuple(np.shape(v)) for k, v in tensors.items()}
    differ = [
        f"{k} {found.get(k, 'absent')} (the configuration: {expected.get(k, 'absent')})"
        for k in sorted(set(expected) | set(found))
        if found.get(k) != (tuple(expected[k]) if k in expected else None)
    ]
    if not differ:
        rebuilt = SequenceModel(**family.build(config, tensors, present))
        differ = [
            f"{what} {get(model)!r} (the configuration: {get(rebuilt)!r})"
            for what, get in _ARCHITECTURE.items()
            if get(model) != get(rebuilt)
        ]
    if differ:
        more = f"; and {len(differ) - 4} more" if len(differ) > 4 else ""
        whose = (
            "this model carries (source_config, from the checkpoint it was imported from)"
            if model.source_config is not None
            else "made for this model"
        )
        raise ValueError(
            f"to_pretrained: the {config['model_type']} configuration {whose} does not "
            f"describe it: {'; '.join(differ[:4])}{more}. A model whose transformer was replaced "
            "after from_pretrained keeps its source's configuration; give it the "
            "source's architecture, or build it from an ocformer configuration, which is "
            "written with one of its own."
        )


def to_pretrained(
    model: SequenceModel,
    path: str | os.PathLike,
    *,
    overwrite: bool = False,
    files: Mapping[str, str | os.PathLike] | None = None,
    origin: Mapping[str, Any] | None = None,
) -> None:
    """Write ``model`` as a Hugging Face checkpoint directory that ``transformers`` loads.

    ``config.json`` is the source configuration with ``architectures`` and ``dtype``
    set (``export_config``: a model built from an ocformer configuration is written as
    GPT-2 or ViT when it has that architecture); ``model.safetensors`` holds the tensors in
    the names the installed ``transformers`` writes (GPT2LMHeadModel, BertModel,
    ViTForImageClassification or ViTModel), in the model's dtype. The feed-forward
    kernels are reassembled as E + W_1 and R + W_2, so a round trip is exact up to one
    rounding of their diagonals.

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
        origin: where the model came from (JSON data, e.g. the run and step that
            trained it), recorded in the marker as ``origin``.

    Raises:
        ValueError: ``model`` is not a ``SequenceModel`` of a supported family (one
            built from an ocformer configuration: neither GPT-2's nor ViT's
            architecture, naming what it lacks), or its transformer is not the
            standard layer stack (the Lie scheme, one explicit-Euler step per layer,
            the split formulation, piecewise-constant controls; the fields that
            differ are named); or ``path`` is a file.
        FileExistsError: ``path`` is a directory that is not empty and that ocformer
            did not write (or holds files besides ocformer's export), and ``overwrite``
            is off. Nothing in it is changed.
    """
    if not isinstance(model, SequenceModel):
        raise ValueError(
            f"to_pretrained takes an ocformer.models.SequenceModel, got {type(model).__name__}."
        )
    check_standard(model.transformer, "to_pretrained")
    config = export_config(model)
    files = check_extra_files(files)
    check_destination(os.fspath(path), overwrite=True)  # an empty path, before abspath
    path = os.path.abspath(os.fspath(path))
    recover_interrupted(path)
    check_destination(path, overwrite)
    family = _family(config)
    tensors, updates = family.export(model, config)
    _check_describes(model, family, config | updates, tensors)
    dtype = np.asarray(next(iter(tensors.values()))).dtype
    prefix = family.prefix if updates["architectures"][0] != family.base_architecture else ""
    heads_outside = ("lm_head.", "classifier.")
    out = {
        (k if k.startswith(heads_outside) else prefix + k): np.ascontiguousarray(v, dtype=dtype)
        for k, v in tensors.items()
    }
    config |= updates | {"dtype": str(dtype)}
    write_directory(path, config, out, files=files, overwrite=overwrite, origin=origin)
