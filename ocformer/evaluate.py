"""Command line: ``python -m ocformer.evaluate WORKDIR [--set field=value ...] [--json FILE]``.

Evaluates the trained model of a ``python -m ocformer.train`` work directory on its
task's validation split, under its own discretisation or under another one given by
``--set`` (discretisation fields only: the trained controls are kept, the time stepper,
step count and tolerances change). A thin wrapper over
``ocformer.evaluation.evaluate_run``.

Exit codes as ``ocformer.train``: 0 done, 2 bad input (not a run directory, a field
that is not a discretisation field, an invalid value, no checkpoint), 3 solver failure,
4 a validation loss that is NaN or Inf (``NonFiniteEvaluation``; with ``EQX_ON_ERROR=nan``
a failed solve ends so too).
"""

import argparse
import json

from ._cli import exit_with, fail
from .checkpointing import CheckpointError, atomic_write_text, output_problem
from .config import ConfigError
from .evaluation import evaluate_run
from .training import ExitCode, TrainingError, WorkdirError

_PROGRAM = "ocformer.evaluate"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m ocformer.evaluate",
        description="Evaluate a trained run on its validation split, under any discretisation.",
    )
    p.add_argument("workdir", metavar="WORKDIR", help="work directory of a training run")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.FIELD=VALUE",
        help=(
            "change one discretisation field (repeatable), e.g. "
            "--set discretisation.steps_per_layer=4"
        ),
    )
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    p.add_argument("--json", metavar="FILE", default=None, help="also write the result here")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    args = _parser().parse_args(argv)
    if args.json is not None and (problem := output_problem(args.json, "--json")):
        return fail(_PROGRAM, ExitCode.USAGE, problem)  # before anything is evaluated
    try:
        result = evaluate_run(args.workdir, args.overrides, args.step)
    except (ConfigError, CheckpointError, WorkdirError, FileNotFoundError) as e:
        return fail(_PROGRAM, ExitCode.USAGE, str(e))
    except TrainingError as e:
        return fail(_PROGRAM, e.exit_code, f"{type(e).__name__}: {e}")
    text = json.dumps(result, indent=2)
    if args.json:
        atomic_write_text(args.json, text + "\n")
    changed = ", ".join(args.overrides) or "as trained"
    acc = result.get("val_accuracy")
    print(
        f"ocformer: evaluated {args.workdir} at step {result['step']} ({changed}): "
        f"val loss {result['val_loss']:.4f}"
        + ("" if acc is None else f"   val accuracy {acc:.3f}")
        + ("" if result["nfe"] is None else f"   NFE {result['nfe']}")
        + ("" if result["solver_steps"] is None else f"   solver steps {result['solver_steps']}"),
        flush=True,
    )
    return ExitCode.OK


if __name__ == "__main__":
    exit_with(main)
