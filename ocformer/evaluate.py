"""Command line: ``python -m ocformer.evaluate WORKDIR [--set field=value ...] [--json FILE]``
or ``python -m ocformer.evaluate --config EXPERIMENT [--set field=value ...] [--json FILE]``.

Evaluates the trained model of a ``python -m ocformer.train`` work directory on its
task's validation split, under its own discretisation or under another one given by
``--set`` (discretisation fields only: the trained controls are kept, the time stepper,
step count and tolerances change; the validation set's ``task.eval_seed``,
``task.eval_batches`` and ``task.eval_batch_size``; and ``task.path``, where a moved
dataset is now). A thin wrapper over
``ocformer.evaluation.evaluate_run``.

With ``--config`` instead of a work directory it evaluates the model that
``python -m ocformer.train`` with the same configuration starts from, before its first
update (``ocformer.evaluation.evaluate_start``): a pretrained checkpoint
(``model.init_from``) in any discretisation, or the seeded initialisation. ``--set``
then takes any field, as for training.

Exit codes as ``ocformer.train``: 0 done, 2 bad input (not a run directory, a field
that is not a discretisation field, an invalid value, no checkpoint), 3 solver failure,
4 a validation loss that is NaN or Inf (``NonFiniteEvaluation``; with ``EQX_ON_ERROR=nan``
a failed solve ends so too).
"""

# ruff: noqa: E402 (the imports after the first wait for the command's Ctrl-C handler)
from ._cli import record_interrupts

if __name__ == "__main__":  # before JAX loads: a Ctrl-C meanwhile is noted, not lost
    record_interrupts()

import argparse
import json

from ._cli import add_compile_cache_option, exit_with, fail
from .checkpointing import CheckpointError, atomic_write_text, output_problem
from .config import ConfigError, resolve
from .evaluation import evaluate_run, evaluate_start
from .training import (
    ExitCode,
    TrainingError,
    WorkdirError,
    enable_compile_cache,
    enable_x64_for_config,
)

_PROGRAM = "ocformer.evaluate"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m ocformer.evaluate",
        description="Evaluate a trained run on its validation split, under any discretisation.",
    )
    p.add_argument("workdir", metavar="WORKDIR", nargs="?", help="work directory of a training run")
    p.add_argument(
        "--config",
        metavar="EXPERIMENT",
        help=(
            "instead of WORKDIR: evaluate the model a run of this experiment (file.py or "
            "file.py:arg) starts from, before any update (e.g. with "
            "--set model.init_from=DIR)"
        ),
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.FIELD=VALUE",
        help=(
            "change one discretisation field (repeatable), e.g. "
            "--set discretisation.steps_per_layer=4; task.eval_seed=N draws the "
            "validation windows with seed N (task.eval_batches, task.eval_batch_size: "
            "their number and size), task.path=DIR names where the run's dataset was "
            "moved; with --config, any field"
        ),
    )
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    p.add_argument("--json", metavar="FILE", default=None, help="also write the result here")
    add_compile_cache_option(p)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    args = _parser().parse_args(argv)
    if (args.workdir is None) == (args.config is None):
        both = args.workdir is not None
        return fail(
            _PROGRAM,
            ExitCode.USAGE,
            "give a work directory (a trained run) or --config EXPERIMENT (a run's start)"
            + (", not both" if both else ""),
        )
    if args.config is not None and args.step is not None:
        return fail(
            _PROGRAM,
            ExitCode.USAGE,
            "--step selects a checkpoint of a work directory; --config evaluates a run's "
            "start (step 0): drop --step, or give the run's work directory",
        )
    if args.json is not None and (problem := output_problem(args.json, "--json")):
        return fail(_PROGRAM, ExitCode.USAGE, problem)  # before anything is evaluated
    enable_compile_cache(off=args.no_compile_cache)  # before anything is compiled
    try:
        if args.config is not None:
            config = resolve(args.config, args.overrides)
            enable_x64_for_config(config)
            result = evaluate_start(config)
            what = f"the start of {args.config} at step 0"
        else:
            result = evaluate_run(args.workdir, args.overrides, args.step)
            what = f"{args.workdir} at step {result['step']}"
    except (ConfigError, CheckpointError, WorkdirError, FileNotFoundError) as e:
        return fail(_PROGRAM, ExitCode.USAGE, str(e))
    except TrainingError as e:
        return fail(_PROGRAM, e.exit_code, f"{type(e).__name__}: {e}")
    changed = ", ".join(args.overrides) or ("as configured" if args.config else "as trained")
    if (k := result.get("depth_fallback_iterations")) is not None:
        changed += f"; {'serial' if k == 0 else f'{k} iterations'} since its depth fallback"
    acc = result.get("val_accuracy")
    print(
        f"ocformer: evaluated {what} ({changed}): "
        f"val loss {result['val_loss']:.4f}"
        + ("" if acc is None else f"   val accuracy {acc:.3f}")
        + ("" if result["nfe"] is None else f"   NFE {result['nfe']}")
        + ("" if result["solver_steps"] is None else f"   solver steps {result['solver_steps']}"),
        flush=True,
    )
    if args.json:
        try:
            atomic_write_text(args.json, json.dumps(result, indent=2) + "\n")
        except OSError as e:  # checked writable before; a disk that filled since, say
            return fail(
                _PROGRAM, 1, f"--json {args.json}: the result (above) could not be written: {e}"
            )
    return ExitCode.OK


if __name__ == "__main__":
    exit_with(main, _PROGRAM, "nothing was written")
