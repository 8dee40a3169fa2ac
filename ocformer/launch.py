"""Command line: start the processes of one training run.

``python -m ocformer.launch local --nproc N [--port P] [--grace S] -- <ocformer.train
arguments>`` runs N training processes on this machine, joined over loopback
(``ocformer.distributed.launch_local``); ``python -m ocformer.launch slurm --nodes N
--gpus-per-node G [--partition P] [--time MIN] [--dry-run] -- <ocformer.train
arguments>`` submits one SLURM job of N x G training tasks, one per GPU
(``ocformer.distributed.training_job`` and ``submit_training``). A refused launch exits
with 2, before any process starts.
"""

# ruff: noqa: E402 (the imports after the first wait for the command's Ctrl-C handler)
from ._cli import record_interrupts

if __name__ == "__main__":  # before JAX loads: a Ctrl-C meanwhile is noted, not lost
    record_interrupts()

import argparse
import shlex
import sys

from ._cli import exit_with, fail
from .config import ConfigError, apply_overrides, load_experiment, validate
from .distributed import (
    GRACE_S,
    LaunchError,
    launch_local,
    submit_training,
    train_command,
    training_job,
)

_PROGRAM = "ocformer.launch"


def _training_problem(train_args: list[str]) -> str | None:
    """Why every task of the job would refuse ``train_args`` (exit 2 after waiting in
    the queue), or None: the experiment file and its overrides are validated here, as
    the training command does at its start."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--config")
    p.add_argument("--workdir")
    p.add_argument("--set", dest="overrides", action="append", default=[])
    try:
        known, _ = p.parse_known_args(train_args)
    except SystemExit:  # an option without its value
        return "the training arguments are not those of python -m ocformer.train"
    if not known.config or not known.workdir:
        return "the training arguments need --config FILE.py and --workdir DIR"
    try:
        validate(apply_overrides(load_experiment(known.config), known.overrides))
    except ConfigError as e:
        return f"the training arguments would be refused by every task: {e}"
    return None


def _slurm(args, train_args: list[str]) -> int:
    if problem := _training_problem(train_args):
        return fail(_PROGRAM, 2, problem)
    job = training_job(
        args.folder,
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        cpus_per_task=args.cpus_per_task,
        time_min=args.time,
        name=args.name,
        partition=args.partition,
    )
    if args.dry_run:
        print(job.script())
        print(f"# each task runs: {shlex.join(train_command(train_args))}")
        return 0
    submitted = submit_training(job, train_args)
    tasks = f"{args.nodes} x {args.gpus_per_node} tasks"
    print(
        f"ocformer.launch: submitted job {submitted.job_id} ({tasks}); logs in {args.folder}",
        file=sys.stderr,
        flush=True,
    )
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m ocformer.launch",
        description="Start the processes of one training run (arguments after -- go to "
        "python -m ocformer.train).",
    )
    sub = p.add_subparsers(dest="where", required=True, metavar="{local,slurm}")
    loc = sub.add_parser("local", help="N processes on this machine, CPU collectives")
    loc.add_argument("--nproc", type=int, required=True, metavar="N")
    loc.add_argument("--port", type=int, default=None, help="coordinator port (default: free)")
    loc.add_argument(
        "--grace", type=float, default=GRACE_S, metavar="S",
        help="seconds the others get after one process fails, before SIGKILL",
    )  # fmt: skip
    sl = sub.add_parser("slurm", help="one SLURM job of nodes x GPUs tasks, via submitit")
    sl.add_argument("--nodes", type=int, required=True, metavar="N")
    sl.add_argument("--gpus-per-node", type=int, required=True, metavar="G")
    sl.add_argument("--partition", default=None)
    sl.add_argument("--time", type=int, default=60, metavar="MIN", help="wall-clock limit")
    sl.add_argument("--cpus-per-task", type=int, default=8)
    sl.add_argument("--name", default="ocformer-train", help="SLURM job name")
    sl.add_argument("--folder", default="slurm_logs", help="submitit's logs and job files")
    sl.add_argument("--dry-run", action="store_true", help="print the job script, submit nothing")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    parser = _parser()
    try:
        # First the launcher's own arguments, so that a missing local|slurm or --nproc
        # is named; without --, what follows them is taken for training arguments.
        args, rest = parser.parse_known_args(argv[:cut])
        if rest and cut < len(argv):
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
    except SystemExit as e:  # --help (0), or argparse's usage error (2)
        return int(e.code or 0)
    if cut == len(argv):
        example = "-- --config experiments/smoke.py --workdir runs/smoke"
        return fail(_PROGRAM, 2, f"give the training arguments after --, e.g. {example}")
    train_args = argv[cut + 1 :]
    if not train_args:
        return fail(_PROGRAM, 2, "no training arguments after --")
    try:
        if args.where == "local":
            return launch_local(args.nproc, train_args, port=args.port, grace_s=args.grace)
        return _slurm(args, train_args)
    except LaunchError as e:
        return fail(_PROGRAM, 2, str(e))


if __name__ == "__main__":
    exit_with(main, _PROGRAM)
