"""The work directory: everything a run writes, in one directory that ocformer owns.

A work directory holds the user's results, so nothing in it is overwritten without
cause. It is ocformer's if it holds the marker ``ocformer_run.json`` (written atomically
when the directory is claimed); any other directory that is not empty is refused. One
process writes it at a time: the writer holds the directory's lock (``DirectoryLock``,
``.lock``) from the claim until it closes the directory. A
resumed run must have the configuration stored in ``config.json``; an allowed change is
recorded in ``config_history.jsonl``, so that the directory keeps describing every step
of its history.
"""

import contextlib
import dataclasses
import importlib.metadata
import json
import os
import shlex
import shutil
import sys
import time
from collections.abc import Callable, Collection

import jax

from ..checkpointing import (
    CheckpointError,
    CheckpointManager,
    CheckpointMismatch,
    ChecksumMismatch,
    CorruptedCheckpoint,
    atomic_write_text,
    remove_stale_temporaries,
)
from ..config import (
    Config,
    ConfigError,
    as_recorded,
    field_value,
    is_set,
    to_dict,
    unread_fields,
    unread_task_options,
)
from ..distributed import wait_timeout_s
from ..tasks import dataset_identity
from ._errors import DATASET_CHANGE, ConfigChanged, WorkdirError
from ._lock import LOCK_FILE, DirectoryLock
from ._metrics import MetricsLog, TensorBoard, rewind_samples
from ._run_info import git_revision, package_versions, platform_info

RUN_MARKER = "ocformer_run.json"
# A run of several processes checks that they all see one directory: each leaves a
# file named by its index here, and each looks for the others' (then it is removed).
PROCESSES_DIR = ".processes"

# Fields that do not change what a run computes: a resumed run may differ in them
# without --allow-config-change (they are still written to config.json).
PRESENTATION_FIELDS: frozenset[str] = frozenset(
    {"train.progress", "train.preempt_grace_s", "train.stop_check_every", "mesh.data", "mesh.model"}
)


def run_dataset(config: Config) -> dict | None:
    """The identity (``dataset_identity``) of the dataset directory a run of ``config``
    trains on; None for a task that reads none."""
    if config.task.name != "tokens" or not config.task.path:
        return None
    return dataset_identity(config.task.path)


def _describe_dataset(identity: dict) -> str:
    files = {"train": "train.bin", "validation": "val.bin", "tokenizer": "tokenizer.json"}
    return ", ".join(f"{name} {identity[f'{key}_sha256'][:12]}" for key, name in files.items())


def run_record(workdir: str | os.PathLike, key: str):
    """Entry ``key`` of the ``run.json`` of ``workdir`` (what its newest start recorded);
    None if the file or the entry is missing or unreadable."""
    try:
        with open(os.path.join(workdir, "run.json"), encoding="utf-8") as f:
            return json.load(f).get(key)
    except (OSError, ValueError, AttributeError):
        return None


def dataset_change(workdir: str, config: Config) -> tuple[str, str] | None:
    """``(then, now)`` (the SHA-256 prefixes of its files) when the dataset directory a
    run of ``config`` reads holds other data than the run in ``workdir`` recorded in its
    ``run.json``; None when they agree, or either is unknown."""
    current = run_dataset(config)
    recorded = run_record(workdir, "dataset")
    if current is None or not isinstance(recorded, dict):
        return None
    keys = [k for k in current if k.endswith("_sha256")]
    if all(recorded.get(k) == current[k] for k in keys):
        return None
    try:
        return _describe_dataset(recorded), _describe_dataset(current)
    except (KeyError, TypeError):
        return "unreadable", _describe_dataset(current)


def dataset_moved(workdir: str, config: Config) -> bool:
    """Whether the dataset directory a run of ``config`` reads holds exactly the data
    (the same SHA-256 of its tokenizer and of each split) that the run in ``workdir``
    recorded in its ``run.json`` at another path: the dataset was moved, or copied,
    and the new ``task.path`` names the same problem."""
    current = run_dataset(config)
    recorded = run_record(workdir, "dataset")
    if current is None or not isinstance(recorded, dict) or recorded.get("path") == current["path"]:
        return False
    return all(recorded.get(k) == v for k, v in current.items() if k.endswith("_sha256"))


def wrote_with_current_dataset(workdir: str, step: int) -> bool:
    """Whether the start of the run in ``workdir`` that wrote checkpoint ``step`` (the
    newest start resumed from an earlier step) read the dataset files that ``run.json``
    records now (the same SHA-256, wherever they were): the files its recorded
    ``task.path`` held. False when a record is missing or unreadable."""
    try:
        with open(os.path.join(workdir, "run.json"), encoding="utf-8") as f:
            info = json.load(f)
        current = info["dataset"]
        starts = [info, *info.get("earlier_starts", [])]  # the newest first
        writer = next(s for s in starts if (s.get("resumed_from_step") or 0) < step)
        then = writer["dataset"]
        keys = [k for k in current if k.endswith("_sha256")]
        return bool(keys) and all(then.get(k) == current[k] for k in keys)
    except (OSError, ValueError, AttributeError, TypeError, KeyError, StopIteration):
        return False


def dataset_missing(workdir: str, config: Config) -> str | None:
    """Why the run in ``workdir`` cannot be read with ``config``: the dataset directory
    it recorded in its ``run.json`` is gone from that path (or holds no readable
    manifest), or ``config`` gives the path relative to another directory than the one
    the run started in, where it names the run's dataset (a resume from elsewhere);
    None when it is there, or the run records none, or ``config`` names another path
    (a run that goes on with other data: that is a configuration change, and a missing
    path there is the task's own error)."""
    recorded = run_record(workdir, "dataset")
    if run_dataset(config) is not None or not isinstance(recorded, dict):
        return None
    path = config.task.path
    if config.task.name != "tokens" or path is None:
        return None
    started = run_record(workdir, "cwd")
    if (
        not os.path.isabs(os.path.expanduser(path))
        and not os.path.exists(path)
        and isinstance(started, str)
        and _same_place(path, recorded.get("path"), started)  # there, it was the run's
        and dataset_identity(recorded["path"]) is not None
    ):
        return (
            f"task.path {path} is relative: from this directory it names "
            f"{os.path.abspath(path)}, which does not exist, but {workdir} started in "
            f"{started}, where it names the run's dataset {recorded['path']}; resume from "
            f"that directory, or give --set task.path={recorded['path']}"
        )
    if recorded.get("path") != os.path.realpath(path):
        return None
    try:
        files = f" (SHA-256 prefixes: {_describe_dataset(recorded)})"
    except (KeyError, TypeError):
        files = ""
    return (
        f"{workdir} was trained on the dataset directory at task.path {recorded['path']}, "
        f"which holds no dataset now: put back the dataset the run trained on{files}, or "
        "where it was moved to, give its new place: --set task.path=DIR to resume or "
        "evaluate, ocformer.export --task-path DIR (when DIR holds those same files); or, "
        "to train on with another dataset, resume with its task.path and "
        "--allow-config-change"
    )


def _flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


# The files of a work directory that a run appends to (the others it replaces whole).
APPENDED_FILES = ("metrics.jsonl", "samples.txt")

# The paths a run's configuration may give relative to the directory it was started in.
RELATIVE_PATHS = (("task", "path"), ("task", "data_dir"), ("model", "init_from"))


def config_changes(
    stored: dict, config: Config, stored_cwd: str | None = None, source: dict | None = None
) -> dict[str, tuple]:
    """The dotted fields in which ``config`` differs from the stored configuration
    ``stored`` (as written to ``config.json``), each as ``(stored, new)``; a field that
    only ``stored`` has (one the schema no longer has) has ``None`` as its new value,
    and one that ``stored`` lacks counts as its default: that run was written before
    the field existed, and a field's default is what runs did before it
    (``optimiser.weight_decay_on=all``, for one). A path (``RELATIVE_PATHS``) that
    names the same place is no change: the stored one taken relative to
    ``stored_cwd`` (where that run started; None: compared as written), the new one
    relative to this process's directory. ``stored`` is read as recorded
    (``ocformer.config.as_recorded``): a field its version ignored is no change.

    The architecture fields compare as the models have them. A run that started from
    ``model.init_from`` took them from its source, whose record in ``run.json``
    (``source``, with its ``architecture``) gives the stored values; config.json holds
    only what was set. A new configuration that starts from the same source takes the
    fields it leaves unset from it, as the stored run did; one without ``init_from``
    takes its own, so dropping ``init_from`` from a run of 4 heads lists
    ``model.num_heads: 4 -> 2`` (the default) rather than letting the model change
    unseen. (Another source is listed as a change of ``model.init_from``; its
    architecture is not read here.)"""
    new = _flatten(json.loads(json.dumps(to_dict(config))))
    old = {**_flatten(json.loads(json.dumps(to_dict(Config())))), **_flatten(as_recorded(stored))}
    architecture = source.get("architecture") if isinstance(source, dict) else None
    started = old.get("model.init_from")
    if started is not None and isinstance(architecture, dict):
        old.update({k: v for k, v in architecture.items() if k in old})
        again = new.get("model.init_from")
        if again == started or _same_place(started, again, stored_cwd):
            for k in architecture:
                section, name = k.split(".", 1)
                if k in new and not is_set(getattr(config, section), name):
                    new[k] = old[k]
    keys = [*new, *(k for k in old if k not in new)]  # every field of new is in old
    paths = {f"{section}.{name}" for section, name in RELATIVE_PATHS}
    return {
        k: (old.get(k), new.get(k))
        for k in keys
        if old.get(k) != new.get(k)
        and k not in PRESENTATION_FIELDS
        and not (k in paths and _same_place(old.get(k), new.get(k), stored_cwd))
    }


def _same_place(stored, new, stored_cwd: str | None) -> bool:
    if not (isinstance(stored, str) and isinstance(new, str) and stored_cwd is not None):
        return False
    then = os.path.join(stored_cwd, os.path.expanduser(stored))
    return os.path.realpath(then) == os.path.realpath(os.path.expanduser(new))


def _unwritable(path: str) -> str:
    """Why ``path``, which ``os.access`` found not writable, is not."""
    try:
        if os.statvfs(path).f_flag & os.ST_RDONLY:
            return "is on a read-only file system"
    except OSError:
        pass
    return "is not writable by this user"


_GIB = float(2**30)


def available_memory() -> int | None:
    """Bytes of memory this process can still use (Linux's MemAvailable), or None
    where it cannot be read."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


def batch_memory(config: Config) -> tuple[int, int]:
    """Rough bytes of one training batch ``(tokens, activations)``: its inputs and
    targets as int64, and the states a step keeps for the backward pass (per token,
    step and layer: queries, keys, values and output of width d, the feed-forward
    hidden units and each head's attention row), in the model's dtype; under a
    depth-parallel solve also the states at the chunk boundaries of every iteration."""
    t, m, d = config.task, config.model, config.discretisation
    tokens = t.batch_size * t.seq_len
    activations = tokens * m.num_layers * d.steps_per_layer * _per_token(config)
    if d.depth_parallel is not None:  # every iteration's states at the chunk boundaries
        chunks = m.num_layers if d.chunks is None else d.chunks
        boundaries = (d.iterations + 1) * (chunks + 1) * tokens * m.width
        activations += boundaries * _itemsize(config)
    return 2 * 8 * tokens, activations


def _itemsize(config: Config) -> int:
    """Bytes of one number of the model's dtype (its master parameters)."""
    return 8 if config.model.dtype == "float64" else 4


def _per_token(config: Config) -> int:
    """Bytes of one token's states in one step (``batch_memory``)."""
    m = config.model
    return (4 * m.width + m.hidden + m.num_heads * config.task.seq_len) * _itemsize(config)


def _symbols(config: Config) -> int:
    """``task.vocab_size`` where the task reads it (the synthetic tasks), else 0."""
    t = config.task
    return 0 if "vocab_size" in unread_task_options(t.name) else t.vocab_size


def memory_parts(config: Config) -> dict[str, int]:
    """Rough bytes of a run's three largest holdings: the training batch with the
    activations its step keeps (``batch_memory``), the validation set (every batch held
    at once, and one batch's forward states), and the parameters with their gradients
    and two optimiser moments (the layers' maps, one copy per control value, and the
    synthetic tasks' symbol tables; a dataset's vocabulary is not known before it is
    opened)."""
    t, m, c = config.task, config.model, config.controls
    tokens, activations = batch_memory(config)
    held = t.eval_batches * t.eval_batch_size * t.seq_len * 2 * 8
    forward = t.eval_batch_size * t.seq_len * _per_token(config)
    layers = {"piecewise_linear": m.num_layers + 1, "basis": c.basis_size, "constant": 1}
    copies = layers.get(c.kind, m.num_layers)
    params = copies * (4 * m.width * m.width + 2 * m.width * m.hidden)
    params += 2 * _symbols(config) * m.width
    return {
        "training batch": tokens + activations,
        "validation set": held + forward,
        "parameters": 4 * params * _itemsize(config),
    }


# The fields that size each of memory_parts: the refusal names the one whose default
# would shrink the largest part most.
_SIZED_BY = {
    "training batch": ("task.batch_size", "task.seq_len", "model.num_layers",
                       "discretisation.steps_per_layer", "model.width", "model.hidden",
                       "model.num_heads", "discretisation.iterations"),
    "validation set": ("task.eval_batch_size", "task.eval_batches", "task.seq_len",
                       "model.width", "model.hidden", "model.num_heads"),
    "parameters": ("model.width", "model.hidden", "model.num_layers", "controls.basis_size",
                   "task.vocab_size"),
}  # fmt: skip


def check_memory(
    config: Config, available: int | None = None, parts: Collection[str] | None = None
) -> None:
    """Refuse a run whose batch, validation set or parameters cannot fit in this
    machine's memory, before anything is built or written (instead of an allocation
    error part-way into the run). ``parts``: those of ``memory_parts`` to count (default
    all; an evaluation holds the validation set alone).

    Raises:
        ConfigError: naming the field, among those the run reads that size the largest
            part, whose default would shrink that part most (``task.batch_size`` for a
            large batch), with the estimate and the memory available.
    """
    available = available_memory() if available is None else available
    if available is None:
        return
    every = memory_parts(config)
    if parts is not None and (unknown := set(parts) - set(every)):
        raise ValueError(f"Unknown memory parts {sorted(unknown)}; known: {', '.join(every)}.")
    parts = {k: v for k, v in every.items() if parts is None or k in parts}
    total = sum(parts.values())
    if total <= available:
        return
    largest = max(parts, key=lambda k: parts[k])
    default, unread = Config(), unread_fields(config)  # basis_size off basis controls

    def at_default(dotted: str) -> int:  # the largest part with this field at its default
        section, name = dotted.split(".")
        value = field_value(default, dotted)
        changed = dataclasses.replace(getattr(config, section), **{name: value})
        return memory_parts(dataclasses.replace(config, **{section: changed}))[largest]

    field = min((f for f in _SIZED_BY[largest] if f not in unread), key=at_default)
    t, m = config.task, config.model
    n, d = config.discretisation.steps_per_layer, config.discretisation
    depth = "" if d.depth_parallel is None else f", {d.iterations} {d.depth_parallel} iterations"
    if largest == "training batch":
        tokens, activations = batch_memory(config)
        what = (
            f"a batch of {t.batch_size} sequences of {t.seq_len} tokens needs about "
            f"{tokens / _GIB:.1f} GiB for its tokens and {activations / _GIB:.1f} GiB for "
            f"the model's activations ({m.num_layers} layers, "
            f"{n} step{'s' * (n != 1)} per layer, width {m.width}, "
            f"hidden {m.hidden}{depth}; roughly)"
        )
    elif largest == "validation set":
        what = (
            f"the validation set of {t.eval_batches} batches of {t.eval_batch_size} "
            f"sequences of {t.seq_len} tokens, with one batch's forward states (width "
            f"{m.width}, hidden {m.hidden}), needs about {parts[largest] / _GIB:.1f} GiB"
        )
    else:
        symbols = f", {t.vocab_size} symbols" if _symbols(config) else ""
        what = (
            f"the parameters (width {m.width}, hidden {m.hidden}, {m.num_layers} layers"
            f"{symbols}) "
            f"with their gradients and optimiser state need about "
            f"{parts[largest] / _GIB:.1f} GiB (roughly)"
        )
    raise ConfigError(
        field,
        f"{what}; the run, about {total / _GIB:.1f} GiB in all, is more than the "
        f"{available / _GIB:.1f} GiB of memory available on this machine; lower {field}",
    )


def _version() -> str | None:
    try:
        return importlib.metadata.version("ocformer")
    except importlib.metadata.PackageNotFoundError:
        return None


def _warn(message: str) -> None:
    print(f"ocformer: warning: {message}", file=sys.stderr, flush=True)


class RunDirectory:
    """A run's work directory and everything written to it.

    Files: the marker ``ocformer_run.json``, ``config.json`` (the resolved
    configuration), ``run.json`` (command, versions, revision, platform),
    ``config_history.jsonl`` (allowed configuration changes), ``metrics.jsonl``,
    TensorBoard events under ``tb/``, ``samples.txt``, ``checkpoints/step_<n>/`` and
    ``summary.json`` (the summary of the last run that finished).

    Use: ``RunDirectory(path)`` checks the path string; ``check(config)`` inspects the
    directory without changing it; ``start(...)`` claims it, restores the newest
    checkpoint and prepares the logs; then ``log``, ``sample`` and ``save``; ``close``
    (or ``with``) flushes and releases everything.

    In a run of several processes every process holds a ``RunDirectory`` of the same
    (shared) path: all of them restore and save checkpoints; only the ``primary`` one
    (process 0) claims (and locks) the directory and writes records, logs and samples, and
    ``barrier`` (called with a name by every process) orders the two.

    Raises:
        WorkdirError: (from ``__init__`` and ``check``) an empty path, a path that is a
            file, a directory that cannot be created or written, or a directory that
            is not empty and has no ocformer marker; (from ``start``) a directory that
            another process is writing (its lock is held).
        ConfigChanged: (from ``check``) a run to resume whose configuration differs.
    """

    def __init__(
        self,
        path: str | os.PathLike | None,
        *,
        primary: bool = True,
        barrier: Callable[[str], None] | None = None,
        any_process: Callable[[bool], bool] | None = None,
    ):
        text = "" if path is None else os.fspath(path)
        if not str(text).strip():
            raise WorkdirError(
                f"the work directory path is empty ({text!r}); give a directory for the "
                "run's outputs, e.g. --workdir runs/smoke"
            )
        self.path = os.path.abspath(text)
        self.config_path = os.path.join(self.path, "config.json")
        self.history_path = os.path.join(self.path, "config_history.jsonl")
        self.summary_path = os.path.join(self.path, "summary.json")
        self._keep_summary = False  # set by start: a rerun of a finished run
        self.samples_path = os.path.join(self.path, "samples.txt")
        self.tb_path = os.path.join(self.path, "tb")
        self.metrics = MetricsLog(os.path.join(self.path, "metrics.jsonl"))
        # Whether a resume found records of the run missing from metrics.jsonl.
        self.records_missing = False
        self.checkpoints: CheckpointManager | None = None
        self.checkpoint: str | None = None  # the newest committed checkpoint
        self._tb: TensorBoard | None = None
        self.stored_config: dict | None = None  # config.json as found by check()
        self.primary = primary
        self._barrier = barrier or (lambda name: None)
        self._any_process = any_process
        self._lock = DirectoryLock(self.path)
        self._allow_config_change = False
        self._config_recovered_from: str | None = None  # checkpoint config.json came from
        self._dataset: dict | None = None  # the identity of the dataset the run reads

    # -- inspecting (changes nothing) ------------------------------------------------

    def _check_writable(self) -> None:
        """The directory, or the nearest existing folder above it, can be written."""
        probe = self.path
        while not os.path.exists(probe):
            parent = os.path.dirname(probe)
            if parent == probe:
                break
            probe = parent
        if not os.path.isdir(probe):
            raise WorkdirError(
                f"work directory {self.path} cannot be created: {probe} is a file, not a directory"
            )
        if not os.access(probe, os.W_OK | os.X_OK):
            what = "is not writable" if probe == self.path else "cannot be created"
            raise WorkdirError(
                f"work directory {self.path} {what}: {probe} {_unwritable(probe)}; choose "
                "another --workdir or change its permissions"
            )

    def _check_run_writable(self) -> None:
        """What a resumed run writes into, besides the files it replaces whole (a
        rename needs the directory alone): the logs it appends to and the folders it
        writes in (its checkpoints'), so that a resume does not train for an hour and
        then fail at its first write."""
        checkpoints = os.path.join(self.path, "checkpoints")
        steps = sorted(os.listdir(checkpoints)) if os.path.isdir(checkpoints) else []
        for path in (
            *(os.path.join(self.path, name) for name in APPENDED_FILES),
            self.tb_path,
            checkpoints,
            *(os.path.join(checkpoints, name) for name in steps),
        ):
            is_dir = os.path.isdir(path)
            if not (is_dir or os.path.isfile(path)) or os.path.islink(path):
                continue
            if not os.access(path, os.W_OK | (os.X_OK if is_dir else 0)):
                raise WorkdirError(
                    f"work directory {self.path} cannot be resumed: {path} "
                    f"{_unwritable(path)}, and the run writes {'in' if is_dir else 'to'} it; "
                    "change its permissions (chown or chmod), or choose another --workdir"
                )

    def check(self, config: Config, *, allow_config_change: bool = False) -> dict[str, tuple]:
        """Inspect the directory for a run of ``config``; nothing is written.

        Returns:
            The changed fields (``{dotted: (stored, new)}``) when resuming with an
            allowed configuration change, else ``{}``.

        Raises:
            ConfigError: a batch larger than this machine's memory (``check_memory``).
        """
        check_memory(config)
        self._dataset = run_dataset(config)
        if os.path.exists(self.path) and not os.path.isdir(self.path):
            raise WorkdirError(
                f"work directory {self.path} is a file, not a directory; choose another --workdir"
            )
        self._check_writable()
        self._allow_config_change = allow_config_change
        if not os.path.isdir(self.path):
            return {}
        try:
            names = sorted(os.listdir(self.path))
        except OSError as e:
            raise WorkdirError(f"work directory {self.path} cannot be read: {e.strerror}") from None
        # A marker's own temporary file (a claim cut short by a kill) is ocformer's too.
        names = [n for n in names if not n.startswith(f"{RUN_MARKER}.tmp-")]
        # So is a lock file alone (a writer killed before it wrote the marker).
        names = [n for n in names if n != LOCK_FILE]
        if names and RUN_MARKER not in names:
            shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
            raise WorkdirError(
                f"work directory {self.path} is not empty and was not written by ocformer "
                f"(it holds {shown}; no {RUN_MARKER}); refusing to write into it. Use a new "
                "or empty --workdir"
            )
        if names:
            self._check_run_writable()
        checkpoints = CheckpointManager(os.path.join(self.path, "checkpoints"))
        latest = checkpoints.latest()
        self._config_recovered_from = None
        if not os.path.exists(self.config_path):
            if latest is None:
                return {}
            # Deleted: the newest checkpoint says which configuration wrote it.
            self.stored_config = checkpoints.read_marker(latest).get("metadata", {}).get("config")
            if not isinstance(self.stored_config, dict):
                raise WorkdirError(
                    f"{self.config_path} is missing and checkpoint {checkpoints.path(latest)} "
                    "does not record the configuration that wrote it, so the run cannot be "
                    "resumed safely. Restore config.json, or use a new --workdir"
                )
            self._config_recovered_from = checkpoints.path(latest)
        else:
            try:
                with open(self.config_path, encoding="utf-8") as f:
                    self.stored_config = json.load(f)
                if not isinstance(self.stored_config, dict):
                    raise ValueError("not a JSON object")
            except (OSError, ValueError) as e:
                recover = (
                    f"; or delete it, and the newest checkpoint ({checkpoints.path(latest)}), "
                    "which records the configuration that wrote it, restores it"
                    if latest is not None
                    else ""
                )
                raise WorkdirError(
                    f"{self.config_path} cannot be read ({e}); it describes the run in this "
                    f"directory. Restore it, or use a new --workdir{recover}"
                ) from None
        if latest is None:
            return {}  # nothing to resume: the new run replaces an empty history
        changes = config_changes(
            self.stored_config,
            config,
            run_record(self.path, "cwd"),
            run_record(self.path, "init_from"),
        )
        if "task.path" in changes and dataset_moved(self.path, config):
            del changes["task.path"]  # the same files elsewhere: the same problem
        if (changed := dataset_change(self.path, config)) is not None:
            changes[DATASET_CHANGE] = changed
        if (missing := dataset_missing(self.path, config)) is not None:
            raise WorkdirError(missing)
        if changes and not allow_config_change:
            raise ConfigChanged(self.path, changes)
        if config.train.steps < latest:
            raise ConfigError(
                "train.steps",
                f"{config.train.steps} is below step {latest}, which the run in "
                f"{self.path} has reached (its newest checkpoint); a run is not rewound: "
                f"give train.steps >= {latest}, or use a new --workdir",
            )
        return changes

    # -- writing -------------------------------------------------------------------

    def resumable(self) -> bool:
        """Whether the directory holds a committed checkpoint, so that ``start`` resumes
        (or refuses a damaged one); reads only."""
        return bool(CheckpointManager(os.path.join(self.path, "checkpoints")).steps())

    def start(
        self,
        config: Config,
        template,
        *,
        keep_checkpoints: int,
        changes: dict[str, tuple] | None = None,
        argv: list[str] | None = None,
        init_from: dict | None = None,
    ):
        """Claim the directory, restore its newest checkpoint into the structure of
        ``template``, record the run, and rewind the logs to the restored step.

        ``init_from`` (where a fresh model came from: ``Experiment.init_from``) goes
        into ``run.json``; each start's record is kept there, the newest first, and a
        resumed start without one keeps the record of the start before it (the model
        still came from there).

        Returns:
            ``(step, restored)``: the restored step and tree, or ``(None, None)`` for a
            fresh run.

        Raises:
            WorkdirError: another process holds the directory's lock (nothing written).
            ConfigChanged: another writer changed the directory since ``check``.
        """
        # Every process has inspected the directory before the primary one writes.
        self._barrier("ocformer:rundir:checked")
        refused: WorkdirError | None = None
        if self.primary:
            try:
                self._lock_directory()
                # Another writer may have run between check() and the lock: what it left
                # is inspected again, under the lock, before anything is written.
                changes = self.check(
                    config, allow_config_change=self._allow_config_change or bool(changes)
                )
                self._claim()
            except WorkdirError as e:
                refused = e
        self._agree_on_claim(refused)
        self._check_shared()
        self.checkpoints = CheckpointManager(
            os.path.join(self.path, "checkpoints"),
            keep=keep_checkpoints,
            primary=self.primary,
            barrier=self._barrier,
        )
        if self.primary and (removed := self.checkpoints.clean()):
            _warn(
                f"removed {len(removed)} interrupted checkpoint save(s) in "
                f"{self.checkpoints.directory} (never committed): {', '.join(removed)}"
            )
        self._barrier("ocformer:rundir:claimed")
        try:
            step, restored = self._restore(template)
        except CheckpointMismatch as e:
            if not changes:
                raise
            raise CheckpointError(
                f"{e} (Of the configuration changes at this resume, {', '.join(changes)}, "
                "one alters what the run's checkpoints hold, so the run cannot go on under "
                "it; to continue from its parameters, train in a new --workdir with --set "
                f"model.init_from={self.path}.)"
            ) from None
        if not self.primary:
            return step, restored
        if self._config_recovered_from is not None:
            _warn(
                f"{self.config_path} was missing; the configuration was recovered from "
                f"checkpoint {self._config_recovered_from} and is written back"
            )
        self._record(config, argv, step, changes or {}, init_from)
        self._continue_logs(config, step)
        # The summary describes a run that finished: this one has not yet. A rerun of a
        # finished run has nothing left to do, and the summary of the run that did the
        # steps stands (one stopped after its last step has none yet: it is written).
        self._keep_summary = (
            step is not None and step >= config.train.steps and os.path.exists(self.summary_path)
        )
        if not self._keep_summary:
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.summary_path)
        return step, restored

    def _restore(self, template):
        """The newest committed checkpoint whose arrays match their checksums, as
        ``(step, tree)`` (``(None, None)`` when there is none); reads only.

        Raises:
            CheckpointError: the only checkpoints there are fail their checksums, or
                one cannot be read at all, or belongs to another model.
        """
        assert self.checkpoints is not None
        steps = self.checkpoints.steps()
        for i in range(len(steps) - 1, -1, -1):
            try:
                restored = self.checkpoints.restore(steps[i], template)
            except CorruptedCheckpoint as e:
                if i == 0:
                    raise
                # Unreadable: the run is not resumed from an earlier step without the
                # user's say (the damage may be a file system's), but the message says
                # what deleting it resumes from.
                e.args = (
                    f"{e} Its earlier committed steps are {steps[:i]}: with it deleted "
                    f"the run resumes from step {steps[i - 1]}.",
                )
                raise
            except ChecksumMismatch as e:
                if i == 0:
                    raise CheckpointError(
                        f"{e}. There is no earlier committed checkpoint to resume from: "
                        "delete that directory to start the run again, or use a new --workdir"
                    ) from None
                if self.primary:
                    _warn(
                        f"{e}; resuming from the previous committed checkpoint "
                        f"{self.checkpoints.path(steps[i - 1])} instead"
                    )
                continue
            self.checkpoint = self.checkpoints.path(steps[i])
            return steps[i], restored
        return None, None

    def _lock_directory(self) -> None:
        try:
            os.makedirs(self.path, exist_ok=True)
        except OSError as e:
            raise WorkdirError(
                f"work directory {self.path} cannot be created or written: {e.strerror}"
            ) from None
        self._lock.acquire()

    def _agree_on_claim(self, refused: WorkdirError | None) -> None:
        """Every process learns whether the primary one claimed the directory, so that a
        refusal (another run holds it, or changed it since ``check``) ends all of them
        together with exit 2, instead of leaving the others waiting at the next barrier
        until JAX's coordination service aborts them.

        Raises:
            WorkdirError: on the primary process its own refusal; on the others, one
                that points to it.
        """
        someone_refused = refused is not None
        any_process = self._any_process
        if any_process is not None and jax.process_count() > 1:
            # Every process takes part in the collective, the refusing one included.
            someone_refused = any_process(someone_refused)
        if someone_refused and refused is None:
            raise WorkdirError(
                f"process 0 could not claim the work directory {self.path} (its message "
                "says why: e.g. another run is writing to it); this process stops too"
            )
        if refused is not None:
            raise refused

    def _check_shared(self) -> None:
        """In a run of several processes (``any_process`` given), that every process
        sees this one directory, before any of them reads a checkpoint from it.

        Raises:
            WorkdirError: (on every process together) some process does not see the
                others' files here: the directory is not on a shared file system.
        """
        count = jax.process_count()
        if count == 1 or self._any_process is None:
            return
        folder = os.path.join(self.path, PROCESSES_DIR)
        if self.primary:
            shutil.rmtree(folder, ignore_errors=True)  # a crashed run's
        self._barrier("ocformer:rundir:shared-cleared")
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, str(jax.process_index())), "w"):
            pass
        self._barrier("ocformer:rundir:shared-written")
        # A network file system may show a file created on another host only once its
        # attribute cache expires (up to a minute): look for as long as for a process.
        wait = wait_timeout_s()
        deadline = time.monotonic() + wait
        while True:
            missing = [i for i in range(count) if not os.path.isfile(os.path.join(folder, str(i)))]
            if not missing or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        if self._any_process(bool(missing)):
            with contextlib.suppress(OSError):
                os.remove(os.path.join(folder, str(jax.process_index())))
                os.rmdir(folder)
            seen = (
                f"process {jax.process_index()} does not see the files of processes {missing} there"
                if missing
                else "another process does not see this one's files there"
            )
            raise WorkdirError(
                f"work directory {self.path} is not one directory for all {count} processes: "
                f"{seen} (looked for {wait}s). It must be on a file system every "
                "process sees (e.g. NFS or Lustre), at the same path"
            )
        self._barrier("ocformer:rundir:shared-checked")
        if self.primary:
            shutil.rmtree(folder, ignore_errors=True)

    def _claim(self) -> None:
        try:
            if not os.path.exists(os.path.join(self.path, RUN_MARKER)):
                marker = {"created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "ocformer": _version()}
                atomic_write_text(os.path.join(self.path, RUN_MARKER), json.dumps(marker))
        except OSError as e:
            raise WorkdirError(
                f"work directory {self.path} cannot be created or written: {e.strerror}"
            ) from None
        remove_stale_temporaries(self.path)

    def _largest_log_every(self, config: Config) -> int:
        """The largest ``train.log_every`` of the run: now, or before an allowed change."""
        every = config.train.log_every
        with (
            contextlib.suppress(OSError, ValueError, TypeError, AttributeError),
            open(self.history_path, encoding="utf-8") as f,
        ):
            for line in f:
                previous = json.loads(line).get("previous") or {}
                every = max(every, int(previous.get("train", {}).get("log_every", 1)))
        return every

    def _continue_logs(self, config: Config, step: int | None) -> None:
        for warning in self.metrics.repair(step or 0):
            _warn(warning)
        records = self.metrics.read()
        last = records[-1]["step"] if records else 0
        self.records_missing = False
        if step is not None and last < step - config.train.log_every:
            self.records_missing = True
            _warn(
                f"{self.metrics.path} ends at step {last} but the restored checkpoint is "
                f"step {step}: the records of steps {last + 1}..{step} are missing from the "
                "file and cannot be recovered"
            )
        # Rows removed inside the file: a run logs at least every log_every steps (the
        # largest it has had, across allowed configuration changes).
        every = self._largest_log_every(config)
        steps = [0, *(r["step"] for r in records)]
        gaps = [(a + 1, b - 1) for a, b in zip(steps, steps[1:]) if b - a > every]
        if gaps:
            self.records_missing = True
            named = ", ".join(f"{a}..{b}" for a, b in gaps[:3]) + (", ..." if len(gaps) > 3 else "")
            _warn(
                f"{self.metrics.path} has no records of steps {named}, which the run "
                f"logged (at least every {every} steps, train.log_every): they are missing "
                "from the file and cannot be recovered"
            )
        rewind_samples(self.samples_path, step or 0)
        has_events = os.path.isdir(self.tb_path) and bool(os.listdir(self.tb_path))
        # purge_step hides events logged after the restored step, so curves do not
        # fold back on resume.
        self._tb = TensorBoard(self.tb_path, purge_step=(step or 0) + 1 if has_events else None)

    def _record(self, config: Config, argv, resumed_from, changes: dict, init_from) -> None:
        resolved = to_dict(config)
        if changes:
            entry = {
                "step": resumed_from,
                "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "changes": {k: list(v) for k, v in changes.items()},
                "previous": self.stored_config,
            }
            history = ""
            if os.path.exists(self.history_path):
                with open(self.history_path, encoding="utf-8") as f:
                    history = f.read()
            atomic_write_text(self.history_path, history + json.dumps(entry) + "\n")
        info = {
            "command": None if argv is None else " ".join(shlex.quote(a) for a in argv),
            "argv": None if argv is None else list(argv),
            "cwd": os.getcwd(),
            "seed": config.train.seed,
            "resumed_from_step": resumed_from,
            "config_changes": {k: list(v) for k, v in changes.items()},
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "versions": package_versions(),
            "git": git_revision(),
            "platform": platform_info(),
            "init_from": init_from,
            "dataset": self._dataset,
            "config": resolved,
        }
        # A resumed run keeps the records of the earlier starts (without their config,
        # which config.json and config_history.jsonl hold).
        run_json = os.path.join(self.path, "run.json")
        earlier = []
        if resumed_from is not None and os.path.exists(run_json):
            try:
                with open(run_json, encoding="utf-8") as f:
                    previous = json.load(f)
                earlier = previous.pop("earlier_starts", [])
                previous.pop("config", None)
                earlier = [previous, *earlier]
                if init_from is None:
                    info["init_from"] = previous.get("init_from")
            except (OSError, ValueError):
                earlier = []  # an unreadable record is replaced, not fatal
        info["earlier_starts"] = earlier
        atomic_write_text(self.config_path, json.dumps(resolved, indent=2))
        atomic_write_text(run_json, json.dumps(info, indent=2))

    def log(self, step: int, record: dict) -> None:
        """One line of ``metrics.jsonl`` and its TensorBoard scalars (process 0 only)."""
        if not self.primary:
            return
        self.metrics.append(record)
        assert self._tb is not None, "RunDirectory.start first"
        self._tb.scalars(step, record)

    def sample(self, step: int, text: str) -> None:
        """A text sample, to ``samples.txt`` and TensorBoard (process 0 only)."""
        if not self.primary:
            return
        with open(self.samples_path, "a", encoding="utf-8") as f:
            f.write(f"=== step {step} ===\n{text}\n\n")
        assert self._tb is not None, "RunDirectory.start first"
        self._tb.text(step, "sample", text)

    def save(self, step: int, tree, config: Config) -> str:
        """Commit the checkpoint of ``step``; returns its path."""
        assert self.checkpoints is not None, "RunDirectory.start first"
        self.checkpoint = self.checkpoints.save(step, tree, {"config": to_dict(config)})
        return self.checkpoint

    def finish(self, summary: dict) -> None:
        """Write the summary of the run that ends (``summary.json``, replacing an
        earlier segment's; process 0 only). A rerun of a finished run, which had
        nothing left to do, keeps the summary of the run that did the steps."""
        if not self.primary or self._keep_summary:
            return
        atomic_write_text(self.summary_path, json.dumps(summary, indent=2, default=float))

    def outputs(self) -> dict[str, str | None]:
        """The outputs that exist: ``metrics``, ``tensorboard``, ``checkpoint``,
        ``samples`` (None for those that do not)."""

        def existing(path):
            return path if path is not None and os.path.exists(path) else None

        return {
            "metrics": existing(self.metrics.path),
            "tensorboard": existing(self.tb_path),
            "checkpoint": existing(self.checkpoint),
            "samples": existing(self.samples_path),
        }

    def close(self) -> None:
        try:
            try:
                if self._tb is not None:
                    tb, self._tb = self._tb, None
                    tb.close()
            finally:  # a TensorBoard file that failed (a full disk) leaves the saves
                if self.checkpoints is not None:
                    self.checkpoints.close()
        finally:
            # Last: every write above is finished before another writer may start.
            self._lock.release()

    def __enter__(self) -> "RunDirectory":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
