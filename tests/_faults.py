"""Faults injected into training by monkeypatching, for the tests only.

In-process: ``monkeypatch.setattr(ocformer.training._loop, "make_train_step",
nan_at_update(3))``. In a subprocess: ``python tests/_faults.py --nan-at 3 -- <arguments
of python -m ocformer.train>`` patches the same way and runs the command line, and
``python tests/_faults.py --kill-at 3 --process 1 --after PATH -- <arguments>`` has
process 1 of a run of several SIGKILL itself at its third update, once PATH exists
(``kill_at_update``).
``flip_bytes`` damages a committed checkpoint's array data on disk.
"""

import argparse
import itertools
import os
import signal
import sys
import time

import equinox as eqx
import jax.numpy as jnp
import numpy as np

from ocformer.training import _loop, _step


class _NaNLoss(eqx.Module):
    """The objective with its loss multiplied by NaN (the metrics report it)."""

    objective: eqx.Module

    def __call__(self, model, batch):
        loss, metrics = self.objective(model, batch)  # pyright: ignore[reportCallIssue]
        loss = loss * jnp.nan
        return loss, dict(metrics, loss=loss)


def nan_at_update(n: int):
    """A stand-in for ``make_train_step`` whose ``n``-th call (1-based, counted from the
    first update this process runs) computes a NaN loss; every other call is the real
    step."""

    def make_train_step(objective, constraints, optimiser, *, skip_nonfinite):
        good = _step.make_train_step(
            objective, constraints, optimiser, skip_nonfinite=skip_nonfinite
        )
        bad = _step.make_train_step(
            _NaNLoss(objective), constraints, optimiser, skip_nonfinite=skip_nonfinite
        )
        calls = itertools.count(1)

        def step(model, opt_state, batch):
            return (bad if next(calls) == n else good)(model, opt_state, batch)

        return step

    return make_train_step


def kill_at_update(n: int, process: int, after: str, wait_s: float = 600.0) -> None:
    """Have process ``process`` of a run of several (``OCFORMER_PROCESS_ID``) SIGKILL
    itself when its loop is about to dispatch update ``n`` (1-based, counted from the
    first update this process runs), once the file ``after`` exists (a checkpoint's
    commit marker, waited for up to ``wait_s`` seconds): the other processes are then
    in, or entering, that update's collective, whatever the machine's load. Patches the
    training loop's dispatch (the compiled step on a mesh is one program, so the step
    builder cannot be patched per call)."""
    if os.environ.get("OCFORMER_PROCESS_ID") != str(process):
        return
    update = _loop._Loop._update
    calls = itertools.count(1)

    def dispatch(self, batch):
        if next(calls) == n:
            deadline = time.monotonic() + wait_s
            while not os.path.exists(after) and time.monotonic() < deadline:
                time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGKILL)
        return update(self, batch)

    _loop._Loop._update = dispatch


def flip_bytes(step_dir, count: int = 64) -> str:
    """Invert ``count`` bytes of a checkpoint's largest array data file (orbax's OCDBT
    data under ``ocdbt.process_0/d``) so that orbax still reads the arrays back, with
    other bytes: the case the marker's SHA-256 checksums catch. Returns the file.

    The data is zstd-compressed in blocks, and orbax lays the data files out differently
    from one save to the next, so what a given offset hits varies: in a block's header
    or entropy tables the flipped bytes make the checkpoint unreadable. So the offsets 10 %,
    11 %, ..., 90 % into the file are tried in turn (then with one byte instead of
    ``count``), each checked with ``CheckpointManager.restore``, until one gives a
    checkpoint that reads back and fails its checksums."""
    from ocformer.checkpointing import CheckpointError, CheckpointManager, ChecksumMismatch

    step_dir = os.fspath(step_dir)
    folder = os.path.join(step_dir, "ocdbt.process_0", "d")
    names = sorted(os.listdir(folder), key=lambda n: os.path.getsize(os.path.join(folder, n)))
    path = os.path.join(folder, names[-1])
    with open(path, "rb") as f:
        original = f.read()
    step = int(os.path.basename(step_dir).removeprefix("step_"))
    with CheckpointManager(os.path.dirname(step_dir)) as manager:
        leaves = manager.read_marker(step)["leaves"]
        template = [np.zeros(leaf["shape"], leaf["dtype"]) for leaf in leaves]
        for n, percent in itertools.product((count, 1), range(10, 91)):
            offset = len(original) * percent // 100
            damaged = bytearray(original)
            damaged[offset : offset + n] = bytes(b ^ 0xFF for b in damaged[offset : offset + n])
            with open(path, "wb") as f:
                f.write(damaged)
            try:
                manager.restore(step, template)
            except ChecksumMismatch:
                return path
            except CheckpointError:
                pass  # unreadable there: try the next offset
    with open(path, "wb") as f:
        f.write(original)
    raise AssertionError(f"no offset in {path} gives a checkpoint orbax still reads")


def main(argv: list[str]) -> int:
    if "--" not in argv:
        raise SystemExit("usage: python tests/_faults.py FAULT -- <ocformer.train arguments>")
    cut = argv.index("--")
    p = argparse.ArgumentParser(prog="tests/_faults.py")
    fault = p.add_mutually_exclusive_group(required=True)
    fault.add_argument("--nan-at", type=int, metavar="N", help="a NaN loss at update N")
    fault.add_argument("--kill-at", type=int, metavar="N", help="SIGKILL at update N")
    p.add_argument("--process", type=int, default=0, help="the process --kill-at kills")
    p.add_argument("--after", default="", help="the file --kill-at waits for")
    args = p.parse_args(argv[:cut])
    from ocformer import train as cli

    if args.nan_at is not None:
        _loop.make_train_step = nan_at_update(args.nan_at)
    else:
        kill_at_update(args.kill_at, args.process, args.after)
    return int(cli.main(argv[cut + 1 :]))


if __name__ == "__main__":
    from ocformer._cli import exit_with

    exit_with(lambda: main(sys.argv[1:]))  # as python -m ocformer.train ends
