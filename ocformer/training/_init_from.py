"""A pretrained start (``model.init_from``): which source a path names, the architecture
it fixes, and whether a run's configuration and task agree with it.

The source is a Hugging Face checkpoint directory (what ``ocformer.convert.from_pretrained``
reads) or an ocformer work directory, optionally ``PATH@STEP`` for the checkpoint of that
step. The architecture (depth, width, heads, hidden width, norm position, activation,
LayerNorm epsilon, the final norm, the control family) comes from the source; every
discretisation field stays free, so a checkpoint can be re-discretised and fine-tuned in
one run. The optimiser starts fresh.
"""

import dataclasses
import hashlib
import json
import os
import re
import sys
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp

from ..config import Config, ConfigError, is_set, validate
from ..config._explicit import with_field
from ..convert import from_pretrained
from ..convert._pretrained import CONFIG_FILE, INDEX_FILE, WEIGHTS_FILE
from ..models import (
    IncompatibleError,
    PatchEmbedding,
    Pooler,
    Readout,
    SequenceModel,
    TiedReadout,
    TokenEmbedding,
    reformulate,
)
from ..objective import Constraints
from ..operators import ConvAttention
from ..tasks import TOKENIZER_FILE, Tokens
from ._rundir import RUN_MARKER, run_record

FIELD = "model.init_from"


@dataclasses.dataclass(frozen=True)
class Source:
    """Where a run starts from.

    Attributes:
        path: the absolute path of the directory.
        kind: ``"checkpoint"`` (Hugging Face) or ``"run"`` (an ocformer work directory).
        step: the work directory's checkpoint to start from; None: its newest.
    """

    path: str
    kind: Literal["checkpoint", "run"]
    step: int | None = None


def parse_source(spec: str) -> Source:
    """The ``Source`` that ``model.init_from`` names.

    Raises:
        ConfigError: the path is neither a checkpoint nor a work directory, or a step is
            given for a Hugging Face checkpoint (which has no steps).
    """
    path, step = spec, None
    match = re.fullmatch(r"(.+)@(\d+)", spec)
    if match and not os.path.exists(spec):
        path, step = match.group(1), int(match.group(2))
    path = os.path.abspath(os.path.expanduser(path))
    if os.path.isfile(os.path.join(path, RUN_MARKER)):
        return Source(path, "run", step)
    if os.path.isfile(os.path.join(path, CONFIG_FILE)):
        if step is not None:
            raise ConfigError(
                FIELD,
                f"{spec!r}: a step selects a checkpoint of an ocformer work directory, and "
                f"{path} is a Hugging Face checkpoint directory (one set of weights); drop "
                f"the '@{step}'",
            )
        return Source(path, "checkpoint")
    hf, run = f"{CONFIG_FILE} with {WEIGHTS_FILE}", RUN_MARKER
    if os.path.exists(path):
        found = (
            f"{path} holds neither a Hugging Face checkpoint ({hf}) nor an ocformer "
            f"work directory ({run})"
        )
    else:
        found = f"{path} does not exist"
    raise ConfigError(
        FIELD,
        f"{found}; give a Hugging Face checkpoint directory (what save_pretrained wrote) "
        "or an ocformer work directory (what python -m ocformer.train wrote; PATH@STEP "
        "for a step of its run)",
    )


def run_needs_x64(workdir: str | os.PathLike, _seen: tuple[str, ...] = ()) -> bool:
    """Whether rebuilding the run in ``workdir`` needs 64-bit JAX: its model is float64,
    or it started from a work directory whose run needs it (a float32 fine-tune of a
    float64 run rebuilds that run's structure), followed along the chain of starts. An
    unreadable ``config.json`` counts as no: the reader of the run reports it."""
    path = os.path.abspath(os.fspath(workdir))
    try:
        with open(os.path.join(path, CONFIG_FILE), encoding="utf-8") as f:
            model = json.load(f).get("model")
    except (OSError, ValueError, AttributeError):
        return False
    if not isinstance(model, dict):
        return False
    if model.get("dtype") == "float64":
        return True
    return start_needs_x64(model.get("init_from"), (*_seen, path))


def start_needs_x64(spec: object, _seen: tuple[str, ...] = ()) -> bool:
    """Whether the start ``model.init_from=spec`` is a work directory whose run needs
    64-bit JAX to be rebuilt (``run_needs_x64``); a Hugging Face checkpoint is read in
    the run's own dtype and never does."""
    if not isinstance(spec, str):
        return False
    try:
        source = parse_source(spec)
    except ConfigError:
        return False  # refused, with its reason, when the run is built
    return source.kind == "run" and source.path not in _seen and run_needs_x64(source.path, _seen)


def enable_x64_for_run(workdir: str | os.PathLike) -> None:
    """Turn on 64-bit JAX when the run in ``workdir`` needs it to be rebuilt
    (``run_needs_x64``), before anything is built: what ``ocformer.evaluate`` and
    ``ocformer.export`` do for the run they read."""
    if run_needs_x64(workdir):
        jax.config.update("jax_enable_x64", True)


def enable_x64_for_config(config: Config) -> None:
    """Turn on 64-bit JAX when a run of ``config`` needs it (a float64 model, or a
    start whose run does: ``start_needs_x64``), before anything is built: what
    ``ocformer.train`` and ``ocformer.evaluate --config`` do."""
    if config.model.dtype == "float64" or start_needs_x64(config.model.init_from):
        jax.config.update("jax_enable_x64", True)


def read_checkpoint(source: Source, dtype) -> SequenceModel:
    """The model of a Hugging Face checkpoint; its refusals become ``ConfigError``."""
    try:
        return from_pretrained(source.path, dtype=dtype)
    except ValueError as e:
        raise ConfigError(FIELD, f"{source.path}: {e}") from None


def architecture(model: SequenceModel) -> dict[tuple[str, str], Any]:
    """The configuration fields that ``model`` fixes, ``{(section, field): value}``; any
    other field may be set freely."""
    t = model.transformer
    c = t.choices()
    layer = t.layer(0)
    return {
        ("model", "num_layers"): t.num_layers,
        ("model", "width"): t.width,
        ("model", "num_heads"): t.attention.num_heads,
        ("model", "hidden"): int(layer.feedforward.weights[0].shape[-1]),
        ("model", "norm"): t.norm,
        ("model", "activation"): t.feedforward.activation,
        ("model", "ln_eps"): t.layer_norm.eps,
        ("model", "final_norm"): t.final_norm is not None,
        ("model", "readout"): "tied" if model.tied else "linear",
        ("model", "attention"): "conv" if isinstance(t.attention, ConvAttention) else "dot",
        ("controls", "kind"): c.controls,
        ("controls", "norm_affine"): "scalar" if c.scalar_norm else "feature",
    }


def check_architecture(config: Config, source: Source, fixed: dict) -> None:
    """Refuse a field set explicitly to a value other than the source's.

    A field left unset takes the source's value; a field set explicitly (by ``--set``
    or in the experiment file, even to its default value: ``ocformer.config.is_set``)
    must agree with the source.

    Raises:
        ConfigError: on the first conflicting field, naming every conflicting field and
            both values of each.
    """
    conflicts = {}
    for (section, name), value in fixed.items():
        part = getattr(config, section)
        ours = getattr(part, name)
        if is_set(part, name) and ours != value:
            conflicts[f"{section}.{name}"] = (ours, value)
    if conflicts:
        listed = "; ".join(
            f"{k} is {o!r}, the checkpoint's {v!r}" for k, (o, v) in conflicts.items()
        )
        names = " and ".join(conflicts)
        raise ConfigError(
            next(iter(conflicts)),
            f"the run starts from {source.path} (model.init_from), which fixes the "
            f"architecture, and {len(conflicts)} set field(s) disagree with it: {listed}; "
            f"leave {names} unset or set them to the checkpoint's values",
        )
    # The combinations the configuration was checked for without the source's values
    # (a heads count against the default width), checked again with them.
    validate(with_architecture(config, fixed))


def with_architecture(config: Config, fixed: dict[tuple[str, str], Any]) -> Config:
    """``config`` with the fields that a source model fixes (``architecture(model)``:
    its width, depth, heads, hidden width, norm, activation, ...) set to its values: a
    run that started from a checkpoint (``model.init_from``) takes them from it, and
    its config.json holds only what was set."""
    sections = {}
    for (section, name), value in fixed.items():
        part = sections.get(section, getattr(config, section))
        sections[section] = with_field(part, name, value)
    return dataclasses.replace(config, **sections)


def check_task(config: Config, task, model: SequenceModel, source: Source) -> None:
    """Refuse a task the source model cannot run.

    Raises:
        ConfigError: a language task with a model that is not a causal language model, a
            sequence longer than the position table, a vocabulary larger than the symbol
            table (or the readout), or an image task with another image or patch shape.
    """
    embedding, readout_size = model.embedding, _readout_size(model)
    if task.kind == "lm":
        if not (
            isinstance(embedding, TokenEmbedding)
            and model.transformer.attention.causal
            and (model.tied or (model.head is not None and model.head.per_token))
        ):
            raise ConfigError(
                FIELD,
                f"{source.path} is not a causal language model: it has {_kind(model)}, "
                f"where task {config.task.name!r} (language modelling) needs a token "
                "embedding, causal attention and per-token logits; start from a GPT-2 "
                "checkpoint or a language-model run",
            )
        if task.seq_len > embedding.seq_len:
            raise ConfigError(
                "task.seq_len",
                f"is {task.seq_len}, but the checkpoint at {source.path} has "
                f"{embedding.seq_len} positions (its position table); set "
                f"task.seq_len <= {embedding.seq_len}",
            )
        rows = min(embedding.tokens.shape[0], readout_size)
        if task.vocab_size > rows:
            raise ConfigError(
                f"task ({config.task.name})",
                f"its vocabulary has {task.vocab_size} symbols, but the checkpoint at "
                f"{source.path} embeds {rows}; symbol ids must be < {rows}: use a task "
                "whose tokenizer is the checkpoint's (or a smaller vocabulary)",
            )
        return
    if isinstance(embedding, PatchEmbedding) and (
        model.head is None or isinstance(model.head, Pooler)
    ):
        # ViTModel (the usual checkpoint to fine-tune, as vit-base-patch16-224-in21k):
        # trained as the class logits, a pooler's tanh would bound them to [-1, 1].
        has = (
            "no head"
            if model.head is None
            else f"ViT's pooler (tanh(u(x_0) W + b), {_readout_size(model)} outputs)"
        )
        raise ConfigError(
            FIELD,
            f"the checkpoint at {source.path} has {has} and no classifier, which task "
            f"{config.task.name!r} needs ({task.num_classes} class logits of the class "
            "token). Attach a new classifier the way transformers does, and start from "
            "that: ViTForImageClassification.from_pretrained(SOURCE, "
            f"num_labels={task.num_classes}).save_pretrained(DIR), then "
            "model.init_from=DIR",
        )
    if not isinstance(embedding, PatchEmbedding) or model.head is None or model.head.per_token:
        raise ConfigError(
            FIELD,
            f"{source.path} is not an image classifier: it has {_kind(model)}, where task "
            f"{config.task.name!r} (image classification) needs a patch embedding and a "
            "class-token head",
        )
    example = task.batch("train", 0, 1, config.train.seed)["inputs"]
    shape = tuple(example.shape[1:])
    if len(shape) == 2:
        shape = (*shape, 1)
    if shape != embedding.input_shape:
        raise ConfigError(
            FIELD,
            f"the checkpoint at {source.path} reads images of shape {embedding.input_shape} "
            f"(H, W, C), and task {config.task.name!r} gives {shape}",
        )
    patch = getattr(task, "patch_size", None)
    if patch is not None and patch != embedding.patch_size:
        raise ConfigError(
            "task.patch_size",
            f"is {patch}, but the checkpoint at {source.path} cuts images into patches "
            f"of {embedding.patch_size} x {embedding.patch_size}; set "
            f"task.patch_size={embedding.patch_size}",
        )
    if task.num_classes > readout_size:
        raise ConfigError(
            f"task ({config.task.name})",
            f"has {task.num_classes} classes, but the checkpoint's classifier has "
            f"{readout_size} outputs",
        )


def _readout_size(model: SequenceModel) -> int:
    if model.tied:
        readout = model.readout
        assert isinstance(readout, TiedReadout)
        u = jnp.zeros((1, 1, model.transformer.width), readout.tokens.dtype)
        return int(readout(u).shape[-1])
    if isinstance(model.head, (Readout, Pooler)):
        return int(model.head.weight.shape[-1])
    return 0


def tokenizer_mismatch(config: Config, task) -> str | None:
    """Why ``task``'s ids may not mean what the start of ``config``
    (``model.init_from``) learned: it reads a dataset prepared with another tokenizer
    than the source's (the ``tokenizer.json`` of a Hugging Face directory, or the
    dataset tokenizer a source run recorded), or a Hugging Face start has no
    ``tokenizer.json`` to compare with. None when they agree, when a source run's is
    unknown, or when there is no start. Not a refusal: a checkpoint may be trained on
    other symbols on purpose, its embedding rows then taking new meanings.
    ``ocformer.train`` (on a fresh start) and ``ocformer.evaluate --config`` warn with it."""
    if config.model.init_from is None or not isinstance(task, Tokens):
        return None
    source = parse_source(config.model.init_from)
    ours = task.dataset.manifest["tokenizer"]["sha256"]
    if source.kind == "checkpoint":
        file = os.path.join(source.path, TOKENIZER_FILE)
        if not os.path.isfile(file):
            return (
                f"the start {source.path} holds no {TOKENIZER_FILE}, so whether the ids of "
                f"the dataset at task.path {task.dataset.path} (tokenizer.json SHA-256 "
                f"{ours[:12]}) name the symbols the model learned cannot be checked. To "
                "fine-tune on the model's own symbols, prepare the corpus with --tokenizer "
                "set to the tokenizer.json it was trained with"
            )
        theirs = _sha256(file)
        where = file
    else:
        recorded = run_record(source.path, "dataset")
        theirs = recorded.get("tokenizer_sha256") if isinstance(recorded, dict) else None
        where = f"the dataset that {source.path} trained on"
        file = None
        if isinstance(recorded, dict) and isinstance(recorded.get("path"), str):
            file = os.path.join(recorded["path"], TOKENIZER_FILE)
            if not os.path.isfile(file) or _sha256(file) != theirs:
                file = None  # that dataset was prepared again, or has gone
    if theirs is None or theirs == ours:
        return None
    mine = os.path.join(task.dataset.path, TOKENIZER_FILE)
    if file is not None and _same_symbols(file, mine):
        return None  # another file (saved again, say) with the same id -> symbol table
    return (
        f"the dataset at task.path {task.dataset.path} was prepared with another tokenizer "
        f"(tokenizer.json SHA-256 {ours[:12]}) than the start's ({where}: {theirs[:12]}), "
        "so its ids name other symbols than the model learned. To fine-tune on the "
        "model's own symbols, prepare the corpus with --tokenizer "
        + (
            source.path
            if source.kind == "checkpoint"
            else file
            if file is not None
            else f"set to the tokenizer.json of the dataset {source.path} trained on "
            "(prepared again or gone since)"
        )
    )


def _same_symbols(a: str, b: str) -> bool:
    """Whether two ``tokenizer.json`` files give every id the same symbol (their
    vocabularies, added tokens included, are equal); False if either cannot be read."""
    from tokenizers import Tokenizer

    try:
        vocab = [Tokenizer.from_file(f).get_vocab(with_added_tokens=True) for f in (a, b)]
    except Exception:  # any file the tokenizers library does not read
        return False
    return vocab[0] == vocab[1]


def warn_of_tokenizer_mismatch(config: Config, task) -> None:
    """Print ``tokenizer_mismatch``'s warning on stderr, if there is one."""
    if (mismatch := tokenizer_mismatch(config, task)) is not None:
        print(f"ocformer: warning: {mismatch}", file=sys.stderr, flush=True)


def check_admissible(config: Config, model: SequenceModel, constraints: Constraints) -> None:
    """The start lies in the run's admissible set: training projects every update onto
    it (``objective.sigma_floor``, ``objective.kernel_bound``), so a pretrained start
    outside it (a checkpoint's negative layer-norm gains, say) would be changed by the
    first update, however small, without a word.

    Raises:
        ConfigError: on the constraint the start violates, with the amount and the fix.
    """
    gaps = constraints.violation(model)
    source = config.model.init_from
    if gaps["sigma_floor"] > 0:
        floor = config.objective.sigma_floor
        lowest = float(floor) - gaps["sigma_floor"]  # type: ignore[arg-type]
        raise ConfigError(
            "objective.sigma_floor",
            f"the start {source} has layer-norm gains below the floor {floor} (the lowest "
            f"is {lowest:.6g}): training projects each update onto the floor, so the first "
            "one would raise them to it and change the pretrained model; set "
            "objective.sigma_floor=none to train without the floor, or a floor below "
            f"{lowest:.6g} if it is positive",
        )
    if gaps["kernel_norm"] > 0:
        bound = config.objective.kernel_bound
        raise ConfigError(
            "objective.kernel_bound",
            f"the start {source} has kernels whose {config.objective.kernel_norm} norm "
            f"exceeds objective.kernel_bound={bound} by up to {gaps['kernel_norm']:.6g}: "
            "the first update would project them onto the bound and change the pretrained "
            "model; raise the bound, or set objective.kernel_norm=none and "
            "objective.kernel_bound=none",
        )


def _kind(model: SequenceModel) -> str:
    head = "tied readout" if model.tied else type(model.head).__name__
    causal = "causal" if model.transformer.attention.causal else "bidirectional"
    return f"{type(model.embedding).__name__}, {causal} attention, {head}"


def adapt(model: SequenceModel, config: Config, discretisation) -> SequenceModel:
    """The source model in the run's dtype, formulation, discretisation and attention
    kernel (fields the source does not fix).

    Raises:
        ConfigError: the formulation and discretisation are a pair the rules refuse.
    """
    dtype = jnp.dtype(config.model.dtype)
    model = jax.tree.map(lambda x: x.astype(dtype) if eqx.is_inexact_array(x) else x, model)
    m = config.model
    try:
        transformer = reformulate(
            model.transformer,
            formulation=m.formulation,  # type: ignore[arg-type]
            relaxation_eps=m.relaxation_eps,
            discretisation=discretisation,
        )
    except IncompatibleError as e:
        raise ConfigError(e.field, e.message) from None
    if transformer.attention.kernel != m.attention_kernel:
        attention = dataclasses.replace(transformer.attention, kernel=m.attention_kernel)
        transformer = eqx.tree_at(lambda t: t.attention, transformer, attention)
    return model.with_transformer(transformer)


def record(source: Source, step: int | None, files: list[str], model: SequenceModel) -> dict:
    """Where a run started: the source, the step of a work directory's checkpoint, the
    SHA-256 of each file that holds the weights, and the architecture ``model`` took
    from it (config.json holds only the fields that were set)."""
    return {
        "path": source.path,
        "kind": source.kind,
        "step": step,
        "sha256": {os.path.relpath(f, source.path): _sha256(f) for f in sorted(files)},
        "architecture": {f"{s}.{n}": v for (s, n), v in architecture(model).items()},
    }


def checkpoint_files(source: Source) -> list[str]:
    """The weight files of a Hugging Face checkpoint (one file, or an index and shards)."""
    single = os.path.join(source.path, WEIGHTS_FILE)
    if os.path.isfile(single):
        return [single]
    index = os.path.join(source.path, INDEX_FILE)
    with open(index) as f:
        shards = sorted(set(json.load(f)["weight_map"].values()))
    return [index, *(os.path.join(source.path, s) for s in shards)]


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
