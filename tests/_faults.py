"""Faults injected into training by monkeypatching, for the tests only.

In-process: ``monkeypatch.setattr(ocformer.training._loop, "make_train_step",
nan_at_update(3))``. In a subprocess: ``python tests/_faults.py --nan-at 3 -- <arguments
of python -m ocformer.train>`` patches the same way and runs the command line.
``flip_bytes`` damages a committed checkpoint's array data on disk.
"""

import itertools
import os
import sys

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
    if len(argv) < 3 or argv[0] != "--nan-at" or argv[2] != "--":
        raise SystemExit("usage: python tests/_faults.py --nan-at N -- <ocformer.train arguments>")
    from ocformer import train as cli

    _loop.make_train_step = nan_at_update(int(argv[1]))
    return int(cli.main(argv[3:]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
