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


def flip_bytes(step_dir, count: int = 64, at: float = 0.1) -> str:
    """Invert ``count`` bytes of a checkpoint's largest array data file (orbax's OCDBT
    data under ``ocdbt.process_0/d``), starting ``at`` (a fraction) into it; returns
    the file. The data is zstd-compressed in blocks: at 10% of the largest file of a
    smoke run's checkpoint the damaged block still decompresses, so orbax reads the
    arrays back without an error, with other bytes."""
    folder = os.path.join(step_dir, "ocdbt.process_0", "d")
    names = sorted(os.listdir(folder), key=lambda n: os.path.getsize(os.path.join(folder, n)))
    path = os.path.join(folder, names[-1])
    offset = int(os.path.getsize(path) * at)
    with open(path, "r+b") as f:
        f.seek(offset)
        data = f.read(count)
        f.seek(offset)
        f.write(bytes(b ^ 0xFF for b in data))
    return path


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[0] != "--nan-at" or argv[2] != "--":
        raise SystemExit("usage: python tests/_faults.py --nan-at N -- <ocformer.train arguments>")
    from ocformer import train as cli

    _loop.make_train_step = nan_at_update(int(argv[1]))
    return int(cli.main(argv[3:]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
