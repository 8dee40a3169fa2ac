"""Command line: ``python -m ocformer.export WORKDIR --to DIR [--step N]``.

Writes the trained model of an ocformer work directory as a Hugging Face checkpoint
directory (``ocformer.convert.to_pretrained``), with the task's ``tokenizer.json`` when
the run's dataset directory (``task.path``) has one, and a ``tokenizer_config.json``
that has ``AutoTokenizer`` read it as it was written (``PreTrainedTokenizerFast``).
Only a run in the standard discretisation (the Lie scheme, one explicit-Euler step per
layer solved serially in depth, piecewise-constant controls, the split formulation) can
be exported: that discretisation *is* the layer stack which ``transformers`` evaluates;
any other is refused, naming the fields that differ. A model that started from a
checkpoint (``model.init_from``) is written back in its format; a model from a random
start is written as GPT-2 or ViT when it has its architecture (``export_config``): a
language model with logits tied to the token embedding (``model.readout=tied``), or an
image classifier of square images, each pre-LN with the final LayerNorm. A run trained
with ternary feed-forward kernels (``objective.ternary``) is written with them, ``Q(W)``, which it
trained and evaluates with, not with the latent kernels its checkpoints store.

A destination that holds files ocformer did not write is refused unless ``--overwrite``
(which replaces it whole); the work directory itself, its dataset (``task.path``) and
every checkpoint or run in its chain of starts (the start, that start's start, ...),
and any folder inside or above one of them, are refused always.

Exit codes: 0 written, 2 refused (bad work directory, step, discretisation or
destination; nothing written), 1 unexpected error.
"""

# ruff: noqa: E402 (the imports after the first wait for the command's Ctrl-C handler)
from ._cli import record_interrupts

if __name__ == "__main__":  # before JAX loads: a Ctrl-C meanwhile is noted, not lost
    record_interrupts()

import argparse
import errno
import json
import os
import tempfile
from collections.abc import Iterator

from ._cli import add_compile_cache_option, exit_with, fail
from .checkpointing import CheckpointError
from .config import Config, ConfigError, ControlsConfig, DiscretisationConfig, ModelConfig
from .convert import check_destination, export_config, to_pretrained
from .models import TokenEmbedding
from .objective import Ternary, feedforward_kernels, with_feedforward_kernels
from .tasks import TOKENIZER_FILE, sha256_file
from .training import (
    ExitCode,
    WorkdirError,
    enable_compile_cache,
    enable_x64_for_run,
    load_run_at,
    parse_source,
    run_record,
)

_PROGRAM = "ocformer.export"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
# The files beside a checkpoint's tokenizer.json that set how transformers reads it (its
# class, length limit and special tokens, a slow tokenizer's vocabulary, a chat template)
# and how the model generates: written back with that tokenizer.
START_TOKENIZER_FILES = (
    TOKENIZER_CONFIG_FILE, "special_tokens_map.json", "added_tokens.json", "vocab.json",
    "merges.txt", "chat_template.jinja", "chat_template.json", "generation_config.json",
)  # fmt: skip
# The fields that make a run the standard layer stack (the values to_layers reads; CvT's
# convolutional projections are not in it).
_STANDARD = (
    ("discretisation", "stepper", DiscretisationConfig().stepper),
    ("discretisation", "sub_solver", DiscretisationConfig().sub_solver),
    ("discretisation", "steps_per_layer", 1),
    ("discretisation", "stepsize", DiscretisationConfig().stepsize),
    ("discretisation", "depth_parallel", DiscretisationConfig().depth_parallel),
    ("model", "formulation", ModelConfig().formulation),
    ("model", "attention", ModelConfig().attention),
    ("controls", "kind", ControlsConfig().kind),
)


def nonstandard_fields(config: Config) -> dict[str, tuple]:
    """``{dotted field: (the run's value, the standard value)}`` for each field in which
    the run differs from the standard discretisation; empty if it is standard."""
    out = {}
    for section, name, standard in _STANDARD:
        value = getattr(getattr(config, section), name)
        if value != standard:
            out[f"{section}.{name}"] = (value, standard)
    return out


def export(
    workdir: str | os.PathLike,
    to: str | os.PathLike,
    step: int | None = None,
    *,
    overwrite: bool = False,
    task_path: str | None = None,
) -> str:
    """Write the model of ``workdir`` (its newest checkpoint, or ``step``) to ``to`` as
    a Hugging Face checkpoint directory; returns its path.

    Args:
        overwrite: replace ``to`` whole even if it holds files ocformer did not write.
        task_path: where the run's dataset directory was moved (``load_run``), whose
            tokenizer the export writes with the checkpoint.

    Raises:
        ConfigError: the run is not in the standard discretisation (the fields named),
            started from no checkpoint and lacks GPT-2's or ViT's architecture (what
            it lacks named: an untied head, say), or ``to`` is, lies inside or holds the run
            itself, its dataset or a checkpoint of its chain of starts (which loading
            and resuming the run read), or is a file, empty, or under a folder that
            cannot be written; or writing it failed for want of permission or space.
        WorkdirError: not a work directory, or no such checkpoint.
        FileExistsError: ``to`` is a directory that ocformer did not write and is not
            empty, and ``overwrite`` is off. Nothing is written in any of these cases.
    """
    workdir = os.fspath(workdir)
    if not os.fspath(to).strip():  # "" is the current directory to os.path, not "no path"
        raise ConfigError("--to", "is empty; give the directory to write the checkpoint to")
    try:  # before the run is read: a path that can hold no export (not yet what it holds)
        check_destination(os.fspath(to), overwrite=True)
    except ValueError as e:
        raise ConfigError("--to", str(e)) from None
    try:
        config, model, step = load_run_at(workdir, step, task_path=task_path)
    except ConfigError as e:
        if e.field != "task.path" or task_path is None:
            raise
        raise ConfigError(
            "--task-path", str(e).split(": ", 1)[1].replace("task.path", "it")
        ) from None
    differ = nonstandard_fields(config)
    if "model.attention" in differ:
        raise ConfigError(
            "model.attention",
            f"the run in {workdir} has CvT's convolutional attention projections "
            "(model.attention=conv), which no Hugging Face checkpoint format holds; "
            "evaluate it with python -m ocformer.evaluate instead",
        )
    if differ:
        listed = ", ".join(f"{k}={v!r} (standard: {s!r})" for k, (v, s) in differ.items())
        raise ConfigError(
            next(iter(differ)),
            f"the run in {workdir} is discretised otherwise than the standard layer "
            f"stack: {listed}. Only the standard discretisation is a Transformer that "
            "the Hugging Face libraries can run. To export, fine-tune it on: a new run "
            f"with --set model.init_from={workdir} in the standard discretisation, "
            "whose export this is; or evaluate this run with python -m ocformer.evaluate",
        )
    try:
        written_as = export_config(model)  # type: ignore[arg-type]
    except ValueError as e:  # a random start without GPT-2's or ViT's architecture
        untied = isinstance(model.embedding, TokenEmbedding) and not model.tied  # type: ignore[attr-defined]
        raise ConfigError(
            "model.readout" if untied else "model.init_from",
            f"the run in {workdir} started from no Hugging Face checkpoint: {e} To export "
            "a run of your own, train it "
            + ("with --set model.readout=tied" if untied else "with what it lacks")
            + ", or start from a checkpoint (--set model.init_from=DIR), which is written "
            "back in its own format",
        ) from None
    if config.objective.ternary:
        # The kernels the run trained and evaluates with are Q(W), not the latent W the
        # checkpoint stores (the straight-through estimator's): those are exported.
        ternary = Ternary(config.objective.ternary_sparsity)
        kernels = ternary.project(feedforward_kernels(model))  # type: ignore[arg-type]
        model = with_feedforward_kernels(model, kernels)  # type: ignore[arg-type]
    path = os.path.abspath(os.fspath(to))
    for other, what in _protected(workdir, config):
        relation = _nesting(os.path.realpath(path), os.path.realpath(other))
        if relation is not None:
            raise ConfigError(
                "--to",
                f"{path} {relation} {what}, which writing the export (it replaces --to "
                "whole) would destroy; write the export elsewhere",
            )
    with tempfile.TemporaryDirectory() as scratch:
        files = _start_tokenizer_files(workdir, config.task.path)
        files = files or _tokenizer_files(config.task.path, scratch, written_as)
        try:
            origin = {"workdir": os.path.abspath(workdir), "step": step}
            to_pretrained(model, path, files=files, overwrite=overwrite, origin=origin)  # type: ignore[arg-type]
        except ValueError as e:
            raise ConfigError("--to", str(e)) from None
        except OSError as e:
            if not _writing(e, path):
                raise
            raise ConfigError("--to", f"{path} cannot be written ({e})") from None
    return path


def _writing(error: OSError, path: str) -> bool:
    """Whether ``error`` is a failure to write the export at ``path`` (no permission,
    a read-only file system, no space): in it, in its staging sibling or in a folder
    above it, rather than in reading a file copied into it."""
    # ENOENT: a folder that lists but takes no new entry (/proc, say)
    unwritable = (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.ENOENT)
    if error.errno not in unwritable:
        return False
    if not error.filename:
        return True
    where = os.path.abspath(os.fsdecode(error.filename))
    parent, name = os.path.split(path)
    if path.startswith(where.rstrip(os.sep) + os.sep):  # a folder above it
        return True
    top = os.path.relpath(where, parent).split(os.sep)[0]
    return top == name or top.startswith(f".{name}.")


def _starts(workdir: str) -> Iterator[tuple[str, dict]]:
    """The chain of starts of the run in ``workdir`` as each ``run.json`` records it:
    ``(source, record)`` of the checkpoint or work directory it started from, then of
    that work directory's own start, and so on, up to a Hugging Face checkpoint; it
    ends early at a record without a path or at a source met before."""
    seen, run = {os.path.realpath(workdir)}, workdir
    while isinstance(started := run_record(run, "init_from"), dict):
        source = started.get("path")
        if not isinstance(source, str) or os.path.realpath(source) in seen:
            return
        seen.add(os.path.realpath(source))
        yield source, started
        if started.get("kind") != "run":
            return
        run = source


def _start_tokenizer_files(workdir: str, dataset: str | None) -> dict[str, str]:
    """The tokenizer of the Hugging Face checkpoint the run's chain of starts began from,
    with its settings (``START_TOKENIZER_FILES``), when the run's dataset was prepared
    with that very tokenizer (the same ``tokenizer.json``, by SHA-256); else none."""
    if dataset is None or not os.path.isfile(tokenizer := os.path.join(dataset, TOKENIZER_FILE)):
        return {}
    chain = list(_starts(workdir))
    if not chain or chain[-1][1].get("kind") == "run":
        return {}  # no checkpoint began it (a random start, or a broken record)
    source = chain[-1][0]
    theirs = os.path.join(source, TOKENIZER_FILE)
    if not os.path.isfile(os.path.join(source, TOKENIZER_CONFIG_FILE)):
        return {}  # no settings of its own: those _tokenizer_files writes
    if not os.path.isfile(theirs) or sha256_file(theirs) != sha256_file(tokenizer):
        return {}
    files = {TOKENIZER_FILE: tokenizer}
    for name in START_TOKENIZER_FILES:
        if os.path.isfile(os.path.join(source, name)):
            files[name] = os.path.join(source, name)
    return files


def _tokenizer_files(dataset: str | None, scratch: str, written_as: dict) -> dict[str, str]:
    """The dataset's ``tokenizer.json`` (none: no files) with a
    ``tokenizer_config.json`` that names the fast tokenizer which reads it. Without
    one, ``AutoTokenizer`` picks the class of the checkpoint's ``model_type`` (GPT-2's
    byte-level tokenizer for ``gpt2``), which reads the file differently: a character
    tokenizer's spaces are lost. The settings also name the special tokens the model's
    configuration gives ids to (``bos_token_id``, ``eos_token_id``, ``pad_token_id``)
    where the tokenizer has a special token of that id: without them ``generate`` and
    padding would not know GPT-2's ``<|endoftext|>``."""
    if dataset is None or not os.path.isfile(os.path.join(dataset, TOKENIZER_FILE)):
        return {}
    tokenizer = os.path.join(dataset, TOKENIZER_FILE)
    settings = os.path.join(scratch, TOKENIZER_CONFIG_FILE)
    with open(settings, "w", encoding="utf-8") as f:
        special = _special_tokens(tokenizer, written_as)
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", **special}, f, indent=2)
    return {TOKENIZER_FILE: tokenizer, TOKENIZER_CONFIG_FILE: settings}


def _special_tokens(tokenizer: str, config: dict) -> dict[str, str]:
    """``{"eos_token": "<|endoftext|>", ...}``: each of the model's special ids that
    names one of the tokenizer's special (added) tokens."""
    with open(tokenizer, encoding="utf-8") as f:
        added = json.load(f).get("added_tokens") or []
    by_id = {
        t["id"]: t["content"]
        for t in added
        if isinstance(t, dict) and t.get("special") and isinstance(t.get("content"), str)
    }
    return {
        f"{name}_token": by_id[config[f"{name}_token_id"]]
        for name in ("bos", "eos", "pad")
        if isinstance(config.get(f"{name}_token_id"), int) and config[f"{name}_token_id"] in by_id
    }


def _nesting(path: str, protected: str) -> str | None:
    """How ``path`` lies to ``protected`` ("is", "is inside" or "holds"), or None when
    neither lies within the other."""
    if path == protected:
        return "is"
    if os.path.commonpath([path, protected]) == protected:
        return "is inside"
    if os.path.commonpath([path, protected]) == path:
        return "holds"
    return None


def _protected(workdir: str, config: Config) -> list[tuple[str, str]]:
    """``(path, what it is)`` for each directory that loading, resuming or evaluating
    the run reads, which the export (it replaces ``--to`` whole) must not touch: the
    run itself, its dataset, the source its configuration names (``model.init_from``),
    and its chain of starts as each ``run.json`` records it: the checkpoint or work
    directory it started from, that work directory's dataset and start, and so on."""
    out = [(os.path.abspath(workdir), "the run's own work directory")]
    if config.task.path:
        out.append((os.path.abspath(config.task.path), "the run's dataset (task.path)"))
    seen = {os.path.realpath(workdir)}
    for i, (source, started) in enumerate(_starts(workdir)):
        seen.add(os.path.realpath(source))
        out.append((
            source,
            ("the checkpoint this run started from" if i == 0 else
             "a checkpoint in the chain of starts this run came from")
            + " (model.init_from), which loading and resuming it read",
        ))  # fmt: skip
        dataset = run_record(source, "dataset") if started.get("kind") == "run" else None
        if isinstance(dataset, dict) and isinstance(dataset.get("path"), str):
            out.append((dataset["path"], f"the dataset of {source}, a run in the chain of "
                        "starts this run came from, which rebuilding that run reads"))  # fmt: skip
    if config.model.init_from:  # resumed from another source than run.json records
        source = parse_source(config.model.init_from).path  # it loaded: it exists
        if os.path.realpath(source) not in seen:
            out.append((source, "the source this run's configuration starts from "
                        "(model.init_from), which loading and resuming it read"))  # fmt: skip
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m ocformer.export",
        description="Write a trained run as a Hugging Face checkpoint directory.",
    )
    p.add_argument("workdir", metavar="WORKDIR", help="the ocformer work directory")
    p.add_argument("--to", required=True, metavar="DIR", help="the checkpoint directory")
    p.add_argument("--step", type=int, metavar="N", help="the checkpoint (default: newest)")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace --to whole even if it holds files that ocformer did not write",
    )
    p.add_argument(
        "--task-path",
        metavar="DIR",
        default=None,
        help="where the run's dataset directory was moved (it must hold the same files)",
    )
    add_compile_cache_option(p)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    args = _parser().parse_args(argv)
    enable_compile_cache(off=args.no_compile_cache)  # before anything is compiled
    enable_x64_for_run(args.workdir)  # a float64 run (or start) is rebuilt in float64
    try:
        path = export(
            args.workdir, args.to, args.step, overwrite=args.overwrite, task_path=args.task_path
        )
    except (ConfigError, WorkdirError, CheckpointError, FileExistsError, FileNotFoundError) as e:
        # The library's advice in the command line's words.
        return fail(_PROGRAM, ExitCode.USAGE, str(e).replace("overwrite=True", "--overwrite"))
    print(f"ocformer.export: wrote {path}", flush=True)
    return ExitCode.OK


if __name__ == "__main__":
    exit_with(main, _PROGRAM, "nothing was written")
