"""Command line: ``python -m ocformer.train --config experiments/<name>.py[:arg] --workdir DIR``.

A thin wrapper over ``ocformer.training.train``; one of the package's command lines, the
only modules that read ``argv`` (see ``docs/architecture.md``).
Re-running the same command resumes from the last committed checkpoint in DIR.
One process of a run of many joins the others with ``--coordinator HOST:PORT
--num-processes N --process-id I`` (or from a SLURM step or TPU slice it runs in; see
``ocformer.launch``).

Exit codes (``ocformer.training.ExitCode``): 0 done, 1 unexpected error, 2 bad
configuration or input (experiment file, work directory, changed configuration on resume,
corrupted checkpoint), 3 solver failure, 4 non-finite values (abort), 143 preempted by
SIGTERM (checkpoint written).
"""

# ruff: noqa: E402 (the imports after the first wait for the command's Ctrl-C handler)
from ._cli import record_interrupts

if __name__ == "__main__":  # before JAX loads: a Ctrl-C meanwhile is noted, not lost
    record_interrupts()

import argparse
import logging
import os
import signal
import sys
import threading
import types

import jax

from ._cli import (
    add_compile_cache_option,
    exit_with,
    fail,
    interrupted,
    raise_interrupts,
    skip_shutdown,
)
from .checkpointing import CheckpointError, CheckpointManager
from .config import ConfigError, apply_overrides, load_experiment, validate
from .distributed import DistributedError, initialize, lost_peer
from .training import (
    RUN_MARKER,
    ExitCode,
    Preempted,
    TrainingError,
    WorkdirError,
    enable_compile_cache,
    enable_x64_for_config,
    exit_at_once,
    exit_on_second_interrupt,
    train as _train,
)

_PROGRAM = "ocformer.train"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m ocformer.train",
        description="Train a continuous Transformer as an optimal-control problem.",
    )
    p.add_argument(
        "--config",
        required=True,
        metavar="FILE.py[:ARG]",
        help="experiment file defining get_config(arg) -> ocformer.config.Config",
    )
    p.add_argument(
        "--workdir", required=True, metavar="DIR", help="output directory (re-use to resume)"
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.FIELD=VALUE",
        help="override one config field (repeatable), e.g. --set train.steps=200",
    )
    p.add_argument(
        "--allow-config-change",
        action="store_true",
        help="resume DIR even though the configuration differs from the one it holds "
        "(the change is recorded in DIR/config_history.jsonl)",
    )
    add_compile_cache_option(p)
    group = p.add_argument_group("several processes (default: from SLURM or a TPU slice)")
    group.add_argument("--coordinator", metavar="HOST:PORT", help="process 0's address")
    group.add_argument("--num-processes", type=int, metavar="N", help="processes in the run")
    group.add_argument("--process-id", type=int, metavar="I", help="this process, 0..N-1")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    raise_interrupts()  # the imports are done: a Ctrl-C from now on raises
    args = _parser().parse_args(argv)
    try:
        return _run(args, argv)
    except KeyboardInterrupt:
        _exit_at_once_on_interrupt()
        # A save the interrupt cut short is left uncommitted (the next run removes it);
        # orbax's background threads, finding their executor shut down, would log
        # tracebacks of it while the interpreter ends.
        logging.getLogger("absl").setLevel(logging.CRITICAL)
        # An interrupt during a compilation leaves XLA's compiler threads working; the
        # run's files are closed, so the process ends without the interpreter's shutdown.
        skip_shutdown()
        return fail(_PROGRAM, 130, f"interrupted; {_resume_point(args.workdir)}")


def _run(args: argparse.Namespace, argv: list[str] | None) -> int:
    """The command of ``args``; a Ctrl-C is ``main``'s to report."""
    if interrupted():  # noted while the command started (see record_interrupts)
        raise KeyboardInterrupt
    try:
        # Validated here (64-bit JAX is chosen from model.dtype, before anything is
        # compiled) and by train(), before anything is built or written.
        config = validate(apply_overrides(load_experiment(args.config), args.overrides))
    except ConfigError as e:
        return fail(_PROGRAM, ExitCode.USAGE, str(e))
    enable_x64_for_config(config)
    enable_compile_cache(off=args.no_compile_cache)  # before anything is compiled

    try:
        initialize(args.coordinator, args.num_processes, args.process_id)
    except DistributedError as e:
        return fail(_PROGRAM, ExitCode.USAGE, str(e))
    command = [sys.executable, "-m", "ocformer.train", *(sys.argv[1:] if argv is None else argv)]
    exit_on_second_interrupt()
    try:
        _train(config, args.workdir, argv=command, allow_config_change=args.allow_config_change)
    except (ConfigError, WorkdirError, CheckpointError) as e:
        return fail(_PROGRAM, ExitCode.USAGE, str(e))
    except FileNotFoundError as e:  # ocformer.tasks.DataNotFoundError and its kin
        return fail(_PROGRAM, ExitCode.USAGE, str(e))
    except TrainingError as e:
        if isinstance(e, Preempted):
            _exit_at_once_on_interrupt()
        return fail(_PROGRAM, e.exit_code, f"{type(e).__name__}: {e}")
    except (jax.errors.JaxRuntimeError, ValueError) as e:  # ValueError: see lost_peer
        if not lost_peer(e):
            raise
        # Another process ended (killed, or failed): its own report is the cause; this
        # one says where the run stands, without the runtime's traceback, and ends
        # without the interpreter's shutdown, whose barrier with the process that is
        # gone would end this one in the runtime's abort (exit 134) after a timeout.
        logging.getLogger("absl").setLevel(logging.CRITICAL)
        skip_shutdown()
        first = str(e).strip().splitlines()[0][:300]
        return fail(
            _PROGRAM,
            ExitCode.PEER_LOST,
            f"process {jax.process_index()}: a collective with the other processes failed "
            f"({first}): another process of the run has ended; {_resume_point(args.workdir)}",
        )
    return ExitCode.OK


def _resume_point(workdir: str) -> str:
    """Where a rerun of an interrupted command starts: the newest committed checkpoint
    of ``workdir`` (a Ctrl-C writes none of its own; the steps after it are lost)."""
    if not os.path.isfile(os.path.join(workdir, RUN_MARKER)):
        return "nothing was trained"
    checkpoints = CheckpointManager(os.path.join(workdir, "checkpoints"))
    latest = checkpoints.latest()
    if latest is None:
        return "no checkpoint was committed yet: re-running the same command starts again"
    return (
        f"the newest committed checkpoint is step {latest} "
        f"({checkpoints.path(latest)}); re-run the same command "
        "to resume from it"
    )


def _exit_at_once_on_interrupt() -> None:
    # The run stopped; what is left is the interpreter's shutdown (orbax's threads
    # among it), which a second Ctrl-C would interrupt with a traceback.
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, exit_at_once)


class _TrainModule(types.ModuleType):
    """``ocformer.train`` is both the command line and the library entry point:
    ``from ocformer import train; train(config, workdir)`` runs
    ``ocformer.training.train``, and ``train.main(argv)`` the command line. (A module
    and a function of one name would otherwise shadow each other, depending on import
    order.)"""

    def __call__(self, config, workdir, **kwargs):
        return _train(config, workdir, **kwargs)


sys.modules[__name__].__class__ = _TrainModule

if __name__ == "__main__":
    exit_with(main)
