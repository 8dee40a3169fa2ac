"""Checkpoints with orbax, committed by a marker written last.

A checkpoint is the directory ``step_<n>`` holding orbax's files and the commit marker
``ocformer_checkpoint.json``. orbax writes into a temporary directory and renames it on
finalisation; the marker is written after that, atomically (temporary file +
``os.replace``). Only directories with a marker are ever restored, so a process killed
at any moment of a save leaves at worst an incomplete directory, which the next start
deletes. Old checkpoints are deleted marker first, for the same reason.

The marker records each array's SHA-256 (of its bytes, as saved from host memory), and
``restore`` checks them: bytes changed on disk after the commit (a bad disk, a stray
write) raise ``ChecksumMismatch`` instead of restoring a silently different state.

In a run of several processes every process calls ``save`` and ``restore``: orbax
writes each array's pieces from the processes that hold them, the primary process
alone deletes, commits and prunes, and all processes wait for each other around it
(which process is primary, and the barrier, are the caller's: the distributed layer's,
passed in by the run directory). A checkpoint holds
whole arrays, not their layout, so it restores on any mesh and any number of processes.
"""

import asyncio
import contextlib
import errno
import hashlib
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from ._atomic import atomic_write_text, remove_stale_temporaries

MARKER = "ocformer_checkpoint.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointError(RuntimeError):
    """A committed checkpoint that cannot be restored (corrupted, or written by a model
    of a different shape). The command line reports it and exits with code 2."""


class CorruptedCheckpoint(CheckpointError):
    """A committed checkpoint whose files cannot be read back (its marker or its array
    data is damaged): unlike a ``ChecksumMismatch`` the damage is loud, not silent."""


class ChecksumMismatch(CheckpointError):
    """A committed checkpoint whose arrays read back with other bytes than were saved
    (their SHA-256 differs from the one its marker records)."""


def _mib(size: int) -> str:
    """``size`` bytes in MiB: three digits below 10 MiB (a small checkpoint on a nearly
    full disk), tenths above (``1,234.5``)."""
    mib = size / 2**20
    return f"{mib:.3g}" if mib < 10 else f"{mib:,.1f}"


class CheckpointMismatch(CheckpointError):
    """A committed checkpoint of other arrays (their number, shapes or dtypes) than the
    model and optimiser it is restored into: written by another configuration."""


class DiskFullError(CheckpointError):
    """No space left on the device while writing a checkpoint; what was written of it
    has been removed and the previous checkpoint is intact."""


def _no_space(e: BaseException) -> bool:
    """Whether ``e`` (an OSError, or orbax's and tensorstore's wrapping of one) reports
    a full device."""
    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
        return True
    return "No space left on device" in str(e) or os.strerror(errno.ENOSPC) in str(e)


class _NoSpaceFilter(logging.Filter):
    """Drops orbax's log records of a full device (its writer threads log the error
    with a traceback before the save raises it): ``DiskFullError`` reports it once."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "No space left on device" not in record.getMessage()


@contextlib.contextmanager
def _quiet_when_full():
    logger = logging.getLogger("absl")
    f = _NoSpaceFilter()
    logger.addFilter(f)
    try:
        yield
    finally:
        logger.removeFilter(f)


class NonFiniteCheckpointError(ValueError):
    """Refusal to write a checkpoint holding NaN or Inf values."""


def _dtype(x) -> str:
    return str(x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype)


def _leaf_spec(tree) -> list[dict[str, Any]]:
    leaves = jtu.tree_flatten_with_path(tree)[0]
    return [
        {"path": jtu.keystr(path), "shape": list(np.shape(x)), "dtype": _dtype(x)}
        for path, x in leaves
    ]


def _check_marker(record) -> None:
    """Raise ``ValueError`` naming what is wrong unless ``record`` has the commit
    marker's layout: ``leaves`` (each a ``path``, a ``shape`` of whole numbers and a
    ``dtype``), ``sha256`` (one digest or null per leaf, if present) and ``metadata``
    (a dict, if present)."""
    if not isinstance(record, dict) or "leaves" not in record:
        raise ValueError("missing 'leaves'")
    leaves = record["leaves"]
    if not isinstance(leaves, list):
        raise ValueError(f"'leaves' is a {type(leaves).__name__}, not a list")
    for i, leaf in enumerate(leaves):
        shape = leaf.get("shape") if isinstance(leaf, dict) else None
        ok = (
            isinstance(shape, list)
            and all(type(n) is int and n >= 0 for n in shape)
            and isinstance(leaf.get("dtype"), str)
            and isinstance(leaf.get("path"), str)
        )
        if not ok:
            raise ValueError(
                f"leaf {i} is {leaf!r}, not a path, a shape (whole numbers) and a dtype"
            )
    digests = record.get("sha256")
    if digests is not None and not (
        isinstance(digests, list)
        and len(digests) == len(leaves)
        and all(d is None or isinstance(d, str) for d in digests)
    ):
        raise ValueError("'sha256' is not one digest (or null) per leaf")
    if not isinstance(record.get("metadata", {}), dict):
        raise ValueError("'metadata' is not a mapping")


def _sha256(a: np.ndarray) -> str:
    """The SHA-256 of an array's bytes (C order)."""
    flat = np.ascontiguousarray(a).reshape(-1)
    return hashlib.sha256(flat.view(np.uint8).data).hexdigest()


def _spans_processes(x) -> bool:
    return isinstance(x, jax.Array) and not x.is_fully_addressable


def _finite(x) -> bool:
    if _spans_processes(x):  # every process computes it, from its own pieces
        return bool(jnp.all(jnp.isfinite(x)))
    a = np.asarray(x)
    # jnp's test: NumPy's own does not count bfloat16 (an ml_dtypes type) as inexact.
    return not jnp.issubdtype(a.dtype, jnp.inexact) or bool(np.all(np.isfinite(a)))


class _DrainingEventLoop(asyncio.SelectorEventLoop):
    """An event loop that lets its unfinished tasks end before it closes.

    orbax restores every array in one ``asyncio.gather``; when one read fails, the
    gather raises at once while the other tensorstore reads are still in flight, and
    orbax closes its loop. Each read that finishes afterwards then tries to wake the
    closed loop and prints "RuntimeError: Event loop is closed" from a tensorstore
    thread. Draining the loop first lets those reads end quietly.
    """

    def close(self) -> None:
        if not self.is_running() and not self.is_closed():
            pending = [t for t in asyncio.all_tasks(self) if not t.done()]
            if pending:
                self.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        super().close()


class _DrainingPolicy(asyncio.DefaultEventLoopPolicy):
    def new_event_loop(self) -> asyncio.AbstractEventLoop:
        return _DrainingEventLoop()


@contextlib.contextmanager
def _draining_event_loops():
    """orbax creates its loops with ``asyncio.new_event_loop()``: for the duration of
    a restore or save, make those loops drain before closing."""
    previous = asyncio.get_event_loop_policy()
    asyncio.set_event_loop_policy(_DrainingPolicy())
    try:
        yield
    finally:
        asyncio.set_event_loop_policy(previous)


# Status codes of tensorstore (orbax's reader) that say a read failed for a reason of
# the moment (the file system, the memory, a permission), not that the bytes are bad.
_TRANSIENT = ("PERMISSION_DENIED", "UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED")


def _damage(e: BaseException) -> bool:
    """Whether a failure to read a checkpoint means its files are damaged, as opposed to
    a failure of the reading (then deleting the checkpoint would lose a good one)."""
    if isinstance(e, MemoryError | PermissionError):
        return False
    damaged = FileNotFoundError | IsADirectoryError | NotADirectoryError  # files gone or swapped
    if isinstance(e, OSError) and not isinstance(e, damaged):
        return False  # an I/O error, a timeout of a network file system: not the bytes
    return not any(code in str(e) for code in _TRANSIENT)


class CheckpointManager:
    """Save and restore pytrees of arrays under ``directory``, keeping the newest ``keep``.

    Args:
        directory: where ``step_<n>`` directories live (created if missing).
        keep: how many committed checkpoints to keep.
        primary: whether this process deletes, commits and prunes (in a run of several
            processes, only one: ``ocformer.distributed.is_primary()``).
        barrier: called with a name by every process of a run to wait for the others
            (``ocformer.distributed.Layout.barrier``); None for a single process.
    """

    def __init__(
        self,
        directory: str,
        keep: int = 3,
        *,
        primary: bool = True,
        barrier: Callable[[str], None] | None = None,
    ):
        if keep < 1:
            raise ValueError(f"keep must be >= 1 (checkpoints to keep), got {keep}.")
        self.directory = os.path.abspath(directory)
        self.keep = keep
        self.primary = primary
        self._barrier = barrier or (lambda name: None)
        self._checkpointer = None

    def _orbax(self):
        if self._checkpointer is None:
            import orbax.checkpoint as ocp

            # The synchronous checkpointer: save returns after orbax has renamed its
            # temporary directory, so the marker written next commits a finished save.
            self._checkpointer = ocp.PyTreeCheckpointer()
        return self._checkpointer

    def close(self) -> None:
        """Release orbax's resources (its background threads); the manager can be used
        again afterwards. Also a context manager: ``with CheckpointManager(d) as m:``."""
        if self._checkpointer is not None:
            self._checkpointer.close()
            self._checkpointer = None

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def path(self, step: int) -> str:
        return os.path.join(self.directory, f"step_{step}")

    def clean(self) -> list[str]:
        """Delete interrupted saves: orbax temporaries, step directories without a
        marker, and temporary marker files. Returns the names removed."""
        removed = []
        if not os.path.isdir(self.directory):
            return removed
        for name in sorted(os.listdir(self.directory)):
            full = os.path.join(self.directory, name)
            if not os.path.isdir(full):
                continue
            committed = _STEP_DIR.match(name) and os.path.isfile(os.path.join(full, MARKER))
            if name.startswith("step_") and not committed:
                shutil.rmtree(full, ignore_errors=True)
                removed.append(name)
            elif committed:
                remove_stale_temporaries(full)
        return removed

    def steps(self) -> list[int]:
        """Committed checkpoint steps, ascending."""
        if not os.path.isdir(self.directory):
            return []
        out = []
        for name in os.listdir(self.directory):
            m = _STEP_DIR.match(name)
            if m and os.path.isfile(os.path.join(self.directory, name, MARKER)):
                out.append(int(m.group(1)))
        return sorted(out)

    def latest(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def save(self, step: int, tree, metadata: dict | None = None) -> str:
        """Write ``tree`` (a pytree of arrays) as the checkpoint of ``step`` and commit it.

        Raises:
            NonFiniteCheckpointError: if a floating leaf holds NaN or Inf (nothing is
                written).
            DiskFullError: no space left on the device (the partial save is removed;
                the message names the directory, the space needed and the space free).
        """
        leaves, _ = jtu.tree_flatten(tree)
        # Arrays that span processes go to orbax as they are (each process writes its
        # pieces); the others as NumPy arrays.
        arrays = [x if _spans_processes(x) else np.asarray(x) for x in leaves]
        spec = _leaf_spec(tree)
        for s, a in zip(spec, arrays):
            if not _finite(a):
                raise NonFiniteCheckpointError(
                    f"refusing to write checkpoint step {step}: leaf {s['path']} holds "
                    "NaN or Inf; the last finite checkpoint is kept."
                )
        target = self.path(step)
        if self.primary:
            self._clear(target)
        self._barrier(f"ocformer:checkpoint:{step}:cleared")
        payload = {f"{i:06d}": a for i, a in enumerate(arrays)}
        try:
            self._write(step, target, payload, spec, arrays, metadata)
        except Exception as e:
            if not _no_space(e):
                raise
            self._remove_partial(target)
            need = sum(int(a.nbytes) for a in arrays)
            free = shutil.disk_usage(self.directory).free
            latest = self.latest()
            kept = (
                f"the previous checkpoint {self.path(latest)} is intact"
                if latest is not None
                else "no checkpoint has been written yet"
            )
            raise DiskFullError(
                f"no space left on the device of {self.directory} while writing the "
                f"checkpoint of step {step}: it needs about {_mib(need)} MiB (and the "
                f"file system's own overhead) and {_mib(free)} MiB are free. Its "
                "partial files were removed and "
                f"{kept}; free some space there (or use another --workdir) and resume"
            ) from None
        self._barrier(f"ocformer:checkpoint:{step}:committed")
        return target

    def _remove_partial(self, target: str) -> None:
        """Delete what an interrupted save of ``target`` left: its directory and orbax's
        temporary directories next to it (``<name>.orbax-checkpoint-tmp-*``)."""
        if not self.primary or not os.path.isdir(self.directory):
            return
        name = os.path.basename(target)
        for entry in os.listdir(self.directory):
            if entry == name or entry.startswith(f"{name}.orbax-checkpoint-tmp"):
                path = os.path.join(self.directory, entry)
                marker = os.path.join(path, MARKER)
                if os.path.exists(marker):
                    os.remove(marker)
                shutil.rmtree(path, ignore_errors=True)

    def _write(self, step: int, target: str, payload, spec, arrays, metadata) -> None:
        """orbax's save of ``payload`` to ``target``, then the commit marker."""
        # Draining loops: a save that fails (a full disk) leaves no "Event loop is
        # closed" tracebacks of orbax's pending tasks.
        with _quiet_when_full(), _draining_event_loops():
            self._orbax().save(target, payload)
        if self.primary:
            record = {
                "step": step,
                "time": time.time(),
                "leaves": spec,
                # None for an array that spans processes (no process holds its bytes).
                "sha256": [None if _spans_processes(a) else _sha256(a) for a in arrays],
                "metadata": metadata or {},
            }
            atomic_write_text(os.path.join(target, MARKER), json.dumps(record))
            self._prune()

    def _clear(self, target: str) -> None:
        os.makedirs(self.directory, exist_ok=True)
        if os.path.exists(target):
            # An earlier save of this step: uncommitted leftovers or (after a resume
            # from an older step) a committed one that is about to be superseded.
            marker = os.path.join(target, MARKER)
            if os.path.exists(marker):
                os.remove(marker)
            shutil.rmtree(target)

    def _prune(self) -> None:
        steps = self.steps()
        for step in steps[: max(0, len(steps) - self.keep)]:
            path = self.path(step)
            os.remove(os.path.join(path, MARKER))
            shutil.rmtree(path, ignore_errors=True)

    def read_marker(self, step: int) -> dict:
        marker = os.path.join(self.path(step), MARKER)
        try:
            with open(marker, encoding="utf-8") as f:
                record = json.load(f)
            _check_marker(record)
        except (OSError, ValueError) as e:
            raise CorruptedCheckpoint(
                f"checkpoint {self.path(step)} is corrupted: its commit marker {MARKER} "
                f"cannot be read ({e}). Delete that directory to resume from an earlier "
                "checkpoint, or use a new work directory."
            ) from None
        return record

    def restore(self, step: int, template):
        """The checkpoint of ``step`` in the structure of ``template``.

        Raises:
            ChecksumMismatch: an array's bytes differ from those saved (corrupted on
                disk after the commit).
            CheckpointError: if the checkpoint holds other shapes or dtypes than
                ``template`` (a different model) or cannot be read (corrupted).
        """
        record = self.read_marker(step)
        want = _leaf_spec(template)
        have = record["leaves"]
        path = self.path(step)
        if len(have) != len(want):
            raise CheckpointMismatch(
                f"checkpoint {path} holds {len(have)} arrays but the configured model and "
                f"optimiser have {len(want)}: it was written by a different configuration. "
                "Use a new --workdir, or the configuration that wrote it."
            )
        for h, w in zip(have, want):
            if h["shape"] != w["shape"] or h["dtype"] != w["dtype"]:
                kind = "shape" if h["shape"] != w["shape"] else "dtype, model.dtype"
                raise CheckpointMismatch(
                    f"checkpoint {path} does not match the configured model: {w['path']} "
                    f"is {h['dtype']}{h['shape']} in the checkpoint but {w['dtype']}"
                    f"{w['shape']} in the configuration (a different model {kind}). Use a "
                    "new --workdir, or the configuration that wrote it."
                )
        try:
            import orbax.checkpoint as ocp

            # Whole arrays as NumPy, whichever mesh and processes wrote them.
            whole = {f"{i:06d}": ocp.RestoreArgs(restore_type=np.ndarray) for i in range(len(want))}
            with _draining_event_loops():
                payload = self._orbax().restore(path, restore_args=whole)
            arrays = [np.asarray(payload[f"{i:06d}"]) for i in range(len(want))]
        except Exception as e:  # orbax raises many kinds for damaged files
            if not _damage(e):
                raise CheckpointError(
                    f"checkpoint {path} could not be read ({type(e).__name__}: "
                    f"{str(e)[:300]}); nothing says it is damaged: fix the cause (memory, "
                    "permissions, the file system) and run again, keeping the checkpoint"
                ) from e
            # Orbax names an array by its key in this file ("000003"); say which it is,
            # by the name the marker records (every reader names it alike).
            keys = sorted({int(k) for k in re.findall(r"\b(\d{6})/", str(e))})
            named = "".join(f"; array {k:06d} is {have[k]['path']}" for k in keys if k < len(have))
            raise CorruptedCheckpoint(
                f"checkpoint {path} is corrupted: orbax cannot read it "
                f"({type(e).__name__}: {str(e)[:300]}{named}). Delete that directory to "
                "resume from an earlier checkpoint, or use a new work directory."
            ) from None
        # (The marker's shapes and dtypes are the template's: checked above.)
        for a, h in zip(arrays, have):
            if list(a.shape) != h["shape"] or str(a.dtype) != h["dtype"]:
                raise CorruptedCheckpoint(
                    f"checkpoint {path} is corrupted: {h['path']} reads back as "
                    f"{a.dtype}{list(a.shape)}, its marker says {h['dtype']}{h['shape']}."
                )
        # Markers written before checksums were recorded have none to compare.
        for a, h, digest in zip(arrays, have, record.get("sha256") or [None] * len(have)):
            if digest is not None and _sha256(a) != digest:
                raise ChecksumMismatch(
                    f"checkpoint {path} is corrupted: the bytes of {h['path']} differ from "
                    "those saved (SHA-256 mismatch; the file was changed on disk after the "
                    "checkpoint was committed)."
                )
        treedef = jtu.tree_structure(template)
        return jtu.tree_unflatten(treedef, arrays)
