"""Starting the processes of one training run: several on this machine, or one SLURM
job of nodes x GPUs tasks.

``launch_local`` starts N training processes on this machine, joined over loopback
with CPU collectives (gloo): a multi-host run in miniature, for debugging one without a
cluster. Process 0 hosts the coordinator on a free port; each process gets
``OCFORMER_COORDINATOR``, ``OCFORMER_NUM_PROCESSES`` and ``OCFORMER_PROCESS_ID``. It
watches them: when one ends with an error or a signal, it says which, stops the others
(SIGTERM, then SIGKILL after a grace period) and returns that process's code, so a dead
process never leaves the others waiting. SIGTERM, SIGHUP and Ctrl-C to the launcher
are passed on as SIGTERM: the processes checkpoint together and exit (a second Ctrl-C
kills them). The processes have their own process group and end with the launcher.

``training_job`` and ``submit_training`` make one SLURM job of N x G tasks, one per
GPU, through submitit. Every task (``TrainTask``) runs ``python -m ocformer.train``
with the same arguments; JAX reads each task's place (coordinator, count, id, its GPU)
from SLURM. On preemption or timeout the training processes checkpoint on SIGTERM and
the job is requeued; the rerun resumes from that checkpoint. submitit is imported when
a job is submitted or requeued, not with ``ocformer``.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ._process import PEER_LOST, process_environment
from ._processes import SlurmJob, slurm_job, stop_processes, supervised

if TYPE_CHECKING:
    import submitit

GRACE_S = 30.0
"""Seconds the other processes get after one fails, before SIGKILL."""


class LaunchError(ValueError):
    """A launch refused before any process starts: a bad count, a taken port, no SLURM.

    The command line reports it and exits with code 2.
    """


def train_command(train_args: Sequence[str]) -> list[str]:
    """The command of one training process: ``python -m ocformer.train TRAIN_ARGS``."""
    return [sys.executable, "-m", "ocformer.train", *train_args]


def _say(message: str) -> None:
    print(f"ocformer.launch: {message}", file=sys.stderr, flush=True)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_problem(port: int) -> str | None:
    """Why process 0 cannot host the coordinator on ``port`` (checked before any process
    starts), or None."""
    if not 1 <= port <= 65535:
        return f"--port {port} is not a port number (1..65535)"
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError as e:
            return (
                f"--port {port} is taken on this machine ({e.strerror}); the coordinator "
                "of process 0 needs a free port: choose another --port, or leave it out to "
                "use a free one"
            )
    return None


def _prefix(stream, tag: str, out) -> None:
    for line in iter(stream.readline, b""):
        out.buffer.write(tag.encode() + line)
        out.flush()


def _describe(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def launch_local(
    nproc: int, train_args: Sequence[str], *, port: int | None = None, grace_s: float = GRACE_S
) -> int:
    """Run ``python -m ocformer.train TRAIN_ARGS`` as ``nproc`` processes joined over
    loopback (CPU collectives) and watch them.

    Process 0 hosts the coordinator; each process gets its place from
    ``process_environment``. When one process ends with an error or a signal, the
    others are stopped (``stop_processes``: SIGTERM, SIGKILL after ``grace_s``).
    SIGTERM, SIGHUP and Ctrl-C to this process are passed on to them as SIGTERM (they
    checkpoint together); a second Ctrl-C kills them. The processes have their own
    process group, so a Ctrl-C at the terminal reaches them only through this process,
    and each ends (SIGTERM) if this process is killed.

    Args:
        nproc: how many processes.
        train_args: the arguments of ``python -m ocformer.train``.
        port: the coordinator's port on 127.0.0.1 (default: a free one).
        grace_s: seconds the others get after one process fails, before SIGKILL.

    Returns:
        The exit code: 0 when every process finished; 130 after Ctrl-C; 143 when they
        were all stopped by SIGTERM (each checkpointed); else the first failing
        process's code (``128 + N`` for signal N).

    Raises:
        LaunchError: ``nproc`` below 1, ``grace_s`` negative or not finite, or ``port``
            not a free port (nothing started).
    """
    if nproc < 1:
        raise LaunchError(f"--nproc must be >= 1, got {nproc}")
    if not (math.isfinite(grace_s) and grace_s >= 0):
        raise LaunchError(
            f"--grace must be a finite number of seconds >= 0, got {grace_s}: the "
            "processes get that long to end after SIGTERM, before SIGKILL"
        )
    if port is not None:
        problem = _port_problem(port)
        if problem is not None:
            raise LaunchError(problem)
    address = f"127.0.0.1:{port or _free_port()}"
    env = dict(os.environ)
    env.setdefault("JAX_PLATFORMS", "cpu")
    procs: list[subprocess.Popen] = []
    threads = []
    stop = _Stop(procs)
    previous = {s: signal.signal(s, stop.handle) for s in _STOP_SIGNALS}
    try:
        for i in range(nproc):
            # Process 0 keeps the terminal (its progress bar); the others' lines are
            # tagged, each on the stream it was written to (errors stay on stderr).
            piped = i > 0
            p = subprocess.Popen(
                train_command(train_args),
                stdout=subprocess.PIPE if piped else None,
                stderr=subprocess.PIPE if piped else None,
                **supervised({**env, **process_environment(address, nproc, i)}),
            )
            procs.append(p)
            if piped:
                tag = f"[process {i}] "
                for source, out in ((p.stdout, sys.stdout), (p.stderr, sys.stderr)):
                    t = threading.Thread(target=_prefix, args=(source, tag, out), daemon=True)
                    t.start()
                    threads.append(t)
        _say(f"{nproc} processes, coordinator {address}, pids {[p.pid for p in procs]}")
        stop.started()
        code = _supervise(procs, grace_s, stop)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    for t in threads:
        t.join(timeout=5)
    for p in procs:
        for stream in (p.stdout, p.stderr):
            if stream is not None:
                stream.close()
    return _stopped(stop, code)


def _stopped(stop: "_Stop", code: int) -> int:
    """The launch's exit code, with a line saying how it ended if a signal stopped it:
    130 after Ctrl-C, else the processes' code (143 when they all checkpointed)."""
    if stop.signum == signal.SIGINT:
        if code == 143:
            _say("interrupted: the processes checkpointed; rerun the command to resume")
        else:
            how = "were killed" if stop.killed else f"ended with code {code}"
            _say(f"interrupted: the processes {how}; the newest committed checkpoint is the "
                 "resume point")  # fmt: skip
        return 130
    if stop.signum is not None:  # SIGTERM or SIGHUP
        name = signal.Signals(stop.signum).name
        if code == 143:
            _say(f"stopped by {name}: the processes checkpointed; rerun the command to resume")
        else:
            _say(f"stopped by {name}: the processes ended with code {code}; the newest "
                 "committed checkpoint is the resume point")  # fmt: skip
    return code


# Signals to this process that stop the run: each is passed on as SIGTERM (the
# processes checkpoint together and exit 143). SIGHUP: the terminal or session closed.
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class _Stop:
    """The launcher's handler of ``_STOP_SIGNALS``: the first passes SIGTERM on to the
    processes; a second Ctrl-C kills them. A signal that comes while they are being
    started is passed on once all are started."""

    def __init__(self, procs: list[subprocess.Popen]):
        self.procs = procs
        self.signum: int | None = None
        self.killed = False
        self._started = False

    def handle(self, signum, frame):
        del frame
        if self.signum is not None:
            if signum == signal.SIGINT:
                self.killed = True
                self._send(signal.SIGKILL)
            return
        self.signum = signum
        if self._started:
            self._send(signal.SIGTERM)

    def started(self) -> None:
        self._started = True
        if self.signum is not None:
            self._send(signal.SIGKILL if self.killed else signal.SIGTERM)

    def _send(self, sig: int) -> None:
        for p in self.procs:
            if p.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, sig)


def _supervise(procs: list[subprocess.Popen], grace_s: float, stop: "_Stop") -> int:
    """Wait for the processes; when one fails, stop the others and return its code
    (said on stderr unless the launcher is itself stopping them)."""
    while True:
        codes = [p.poll() for p in procs]
        failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            # A process that lost a peer reports a consequence: name the cause first.
            i, c = min(failed, key=lambda f: f[1] == PEER_LOST)
            if stop.signum is None:
                ended = [(j, e) for j, e in enumerate(codes) if j != i and e is not None]
                then = (
                    f"stopping the other processes (SIGTERM, SIGKILL after {grace_s:.0f}s)"
                    if len(ended) < len(procs) - 1
                    else "the others had ended too: "
                    + ", ".join(f"process {j} {_describe(e)}" for j, e in ended)
                )
                _say(f"process {i} (pid {procs[i].pid}) {_describe(c)}; {then}")
            running = [j for j, e in enumerate(codes) if e is None]
            killed = stop_processes(procs, grace_s)
            for p in procs:
                p.wait()  # ended; collect the exit codes
            if stop.signum is None and running:
                _say("stopped: " + ", ".join(
                    f"process {j} {_describe(procs[j].returncode)}"
                    + (f" (no end within {grace_s:.0f}s of SIGTERM)" if procs[j] in killed else "")
                    for j in running
                ))  # fmt: skip
            if c in (143, -signal.SIGTERM) and all(p.returncode in (143, -15) for p in procs):
                return 143  # preempted together: every process checkpointed
            return c if c > 0 else 128 - c
        if all(c == 0 for c in codes):
            return 0
        time.sleep(0.2)


# -- SLURM ---------------------------------------------------------------------


class TrainTask:
    """One SLURM task of the job: ``python -m ocformer.train`` with the job's arguments
    (JAX reads the task's place from SLURM). On preemption or timeout, SIGTERM lets the
    process checkpoint, and the job is requeued with the same arguments: submitit
    requeues a task whose callable has a ``checkpoint`` method (as its
    ``helpers.Checkpointable`` has), calling it for the resubmission."""

    def __init__(self, train_args: Sequence[str]):
        self.train_args = list(train_args)
        self._proc: subprocess.Popen | None = None

    def __call__(self) -> int:
        """Run the training process; its code 0, or 143 when it checkpointed and
        stopped on a signal (the job is then being requeued, by submitit on the task of
        rank 0, which calls ``checkpoint``; the other tasks' processes stop with it).

        Raises:
            RuntimeError: the training process failed (any other code).
        """
        self._proc = subprocess.Popen(train_command(self.train_args), **supervised(os.environ))
        code = self._proc.wait()
        if code not in (0, 143):  # 143: preempted, checkpointed
            raise RuntimeError(f"python -m ocformer.train {_describe(code)}")
        return code

    def checkpoint(self, *args: Any, **kwargs: Any) -> submitit.helpers.DelayedSubmission:
        proc = self._proc
        if proc is not None:
            stop_processes([proc], GRACE_S * 2)
        self._proc = None
        from submitit.helpers import DelayedSubmission

        return DelayedSubmission(TrainTask(self.train_args))

    def __getstate__(self) -> dict:
        return {"train_args": self.train_args, "_proc": None}


def training_job(
    logs: str,
    *,
    nodes: int,
    gpus_per_node: int,
    cpus_per_task: int = 8,
    time_min: int = 60,
    name: str = "ocformer-train",
    partition: str | None = None,
) -> SlurmJob:
    """One SLURM job of ``nodes`` x ``gpus_per_node`` training tasks, one per GPU, with
    submitit's files under ``logs``.

    Raises:
        LaunchError: a count or limit below 1, or an empty partition.
    """
    counts = {
        "nodes": nodes,
        "gpus-per-node": gpus_per_node,
        "cpus-per-task": cpus_per_task,
        "time": time_min,
    }
    for flag, value in counts.items():
        if value < 1:
            raise LaunchError(f"--{flag} must be >= 1, got {value}")
    if partition is not None and not partition.strip():
        raise LaunchError(
            "--partition must name a partition (leave it out for the cluster's default), "
            f"got {partition!r}"
        )
    return slurm_job(
        logs,
        name=name,
        time_min=time_min,
        cpus_per_task=cpus_per_task,
        nodes=nodes,
        tasks_per_node=gpus_per_node,
        gpus_per_node=gpus_per_node,
        partition=partition,
    )


def submit_training(job: SlurmJob, train_args: Sequence[str]) -> submitit.Job:
    """Submit ``job``, every task running ``python -m ocformer.train TRAIN_ARGS``.

    Raises:
        LaunchError: no SLURM on this machine.
    """
    missing = [c for c in ("sbatch", "srun") if shutil.which(c) is None]
    if missing:  # submitit needs both (srun: its job script's command)
        raise LaunchError(
            f"no SLURM on this machine ({' and '.join(missing)} not found); run from a "
            "SLURM login node, or add --dry-run to see the job script"
        )
    return job.executor().submit(TrainTask(train_args))
