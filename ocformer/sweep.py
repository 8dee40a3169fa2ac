"""Command line of sweeps.

``python -m ocformer.sweep FILE[:arg] --workdir DIR [--launcher local|slurm [--wait]]
[--parallel N] [--seeds K] [--only field=value ...] [--dry-run]`` runs a sweep file
(``experiments/sweeps/<name>.py``); ``python -m ocformer.sweep report DIR`` rebuilds
``results.csv``, ``results.md`` and ``plots/`` without running anything. Running the
same sweep again skips finished points and resumes interrupted ones.

Exit codes: 0 every point done, 1 some failed (listed), 2 an invalid sweep, point,
field or work directory (reported before anything runs), 143 / 130 stopped by SIGTERM /
SIGINT (the running points get SIGTERM, checkpoint and are recorded as interrupted, the
last line naming the step each resumes at, or that it stopped before its first checkpoint;
SIGKILL after 60 s; rerun the same command to resume).
"""

# ruff: noqa: E402 (the imports after the first wait for the command's Ctrl-C handler)
from ._cli import record_interrupts

if __name__ == "__main__":  # before JAX loads: a Ctrl-C meanwhile is noted, not lost
    record_interrupts()

import argparse
import sys

from ._cli import exit_with, fail
from .sweeping import SweepError, SweepInterrupted, report, run_sweep

_PROGRAM = "ocformer.sweep"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m ocformer.sweep",
        # No abbreviated options: whole_sweep removes --only from the recorded command.
        allow_abbrev=False,
        description="Train an experiment over a grid of config values and seeds.",
        epilog="python -m ocformer.sweep report DIR: re-aggregate results without running.",
    )
    p.add_argument("sweep", metavar="FILE.py[:ARG]", help="sweep file defining get_sweep(arg)")
    p.add_argument(
        "--workdir", required=True, metavar="DIR", help="sweep directory (reuse to resume)"
    )
    p.add_argument("--launcher", choices=("local", "slurm"), default="local")
    p.add_argument(
        "--parallel", type=int, default=None, metavar="N", help="local worker processes (1)"
    )
    p.add_argument("--seeds", type=int, default=None, metavar="K", help="run seeds 0..K-1")
    p.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help=(
            "run only the points with this axis value (field or axis name; repeatable: "
            "the points with every value given)"
        ),
    )
    p.add_argument("--dry-run", action="store_true", help="show the points (and job script)")
    p.add_argument(
        "--runtime-checks",
        action="store_true",
        help="keep equinox's runtime error checks in the compiled steps: a solver failure "
        "then names the step, but those steps are host callbacks that JAX's persistent "
        "cache never stores, so every point compiles them again (default: checks return "
        "NaN, EQX_ON_ERROR=nan, and points that share shapes compile once)",
    )
    g = p.add_argument_group("SLURM (--launcher slurm; defaults from the sweep file)")
    g.add_argument("--partition", default=None)
    g.add_argument("--time-min", type=int, default=None, help="minutes per array task")
    g.add_argument("--cpus", type=int, default=None, help="CPUs per task")
    g.add_argument("--gpus", type=int, default=None, help="GPUs per node")
    g.add_argument("--nodes", type=int, default=None, help="nodes per task")
    g.add_argument("--array-parallelism", type=int, default=None, help="tasks running at once")
    g.add_argument(
        "--wait",
        action="store_true",
        help="wait for the job array to finish and report (default: return once submitted; "
        "python -m ocformer.sweep report DIR reports later)",
    )
    return p


def _report_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m ocformer.sweep report",
        description="Rebuild results.csv, results.md and plots/ of a sweep directory from "
        "its points, without running anything.",
    )
    p.add_argument("dir", metavar="DIR", help="the sweep directory (--workdir of the sweep)")
    return p


def whole_sweep(argv: list[str]) -> list[str]:
    """The arguments without their ``--only`` selections: the command of the whole
    sweep, which ``sweep.json`` and ``results.md`` record (the report covers every point,
    whichever of them a command ran)."""
    out: list[str] = []
    selection = False
    for a in argv:
        if selection:
            selection = False
        elif a == "--only":
            selection = True
        elif not a.startswith("--only="):
            out.append(a)
    return out


_SLURM_FLAGS = ("partition", "time_min", "cpus", "gpus", "nodes", "array_parallelism", "wait")


def _unread_options(args: argparse.Namespace) -> str | None:
    """A refusal of the options the chosen launcher would ignore, or None."""
    if args.launcher == "local":
        # (is, not ==: --gpus 0 is given, and 0 == False)
        given = [f"--{k.replace('_', '-')}" for k in _SLURM_FLAGS
                 if getattr(args, k) is not None and getattr(args, k) is not False]  # fmt: skip
        if given:
            one = len(given) == 1
            return (
                f"{', '.join(given)} {'is a SLURM option' if one else 'are SLURM options'}, "
                "which the local launcher does not read: add --launcher slurm, or drop "
                f"{'it' if one else 'them'}"
            )
    elif args.parallel is not None:
        return (
            "--parallel is the number of local worker processes, which --launcher slurm "
            "does not read (its tasks run at once up to --array-parallelism): drop it"
        )
    return None


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    args_list = sys.argv[1:] if argv is None else list(argv)
    if args_list[:1] == ["report"]:
        directory = _report_parser().parse_args(args_list[1:]).dir
        try:
            result = report(directory)
        except SweepError as e:
            return fail(_PROGRAM, 2, str(e))
        print(f"sweep: {len(result['rows'])} rows, {len(result['plots'])} plots in {directory}")
        if result["unfinished"]:
            print(f"sweep: {result['unfinished']}", file=sys.stderr)
        return 0
    args = _parser().parse_args(args_list)
    if (problem := _unread_options(args)) is not None:
        return fail(_PROGRAM, 2, problem)
    slurm = {
        "partition": args.partition,
        "time_min": args.time_min,
        "cpus": args.cpus,
        "gpus": args.gpus,
        "nodes": args.nodes,
        "array_parallelism": args.array_parallelism,
    }
    try:
        return run_sweep(
            args.sweep,
            args.workdir,
            launcher=args.launcher,
            parallel=1 if args.parallel is None else args.parallel,
            seeds=args.seeds,
            only=args.only,
            dry_run=args.dry_run,
            slurm=slurm,
            wait=args.wait,
            argv=[sys.executable, "-m", "ocformer.sweep", *whole_sweep(args_list)],
            runtime_checks=args.runtime_checks,
        )
    except SweepError as e:
        return fail(_PROGRAM, 2, str(e))
    except SweepInterrupted as e:
        return fail(_PROGRAM, e.exit_code, str(e))
    except KeyboardInterrupt:
        return fail(_PROGRAM, 130, "interrupted; rerun the same command to resume")


if __name__ == "__main__":
    exit_with(main, _PROGRAM, "rerun the same command to resume")
