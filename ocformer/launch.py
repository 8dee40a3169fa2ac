"""Command line: start the processes of one training run.

``python -m ocformer.launch local --nproc N -- <ocformer.train arguments>`` starts N
training processes on this machine, joined over loopback with CPU collectives (gloo):
a multi-host run in miniature, for debugging one without a cluster. Process 0 hosts the
coordinator on a free port; each process gets ``OCFORMER_COORDINATOR``,
``OCFORMER_NUM_PROCESSES`` and ``OCFORMER_PROCESS_ID``. The launcher watches them: when
one ends with an error or a signal, it says which, stops the others (SIGTERM, then
SIGKILL after a grace period) and exits with that process's code, so a dead process
never leaves the others waiting. SIGTERM to the launcher is passed on: the processes
checkpoint together and exit with 143.

``python -m ocformer.launch slurm --nodes N --gpus-per-node G [--partition P]
[--time MIN] [--dry-run] -- <ocformer.train arguments>`` submits one SLURM job of
N x G tasks, one per GPU, through submitit. Every task runs ``python -m ocformer.train``
with the same arguments; JAX reads each task's place (coordinator, count, id, its GPU)
from SLURM. On preemption or timeout the training processes checkpoint on SIGTERM and
the job is requeued; the rerun resumes from that checkpoint.
"""

import argparse
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import submitit

from .distributed import SlurmJob, process_environment, slurm_job, stop_processes

TRAIN = ("-m", "ocformer.train")
GRACE_S = 30.0


def _fail(code: int, message: str) -> int:
    print(f"ocformer.launch: error: {message}", file=sys.stderr, flush=True)
    return code


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


def local(
    nproc: int, train_args: list[str], *, port: int | None = None, grace_s: float = GRACE_S
) -> int:
    """Run ``ocformer.train`` as ``nproc`` processes joined on loopback; returns the exit
    code (0 when all finished, else the first failing process's code)."""
    if nproc < 1:
        return _fail(2, f"--nproc must be >= 1, got {nproc}")
    if port is not None:
        problem = _port_problem(port)
        if problem is not None:
            return _fail(2, problem)
    address = f"127.0.0.1:{port or _free_port()}"
    env = dict(os.environ)
    env.setdefault("JAX_PLATFORMS", "cpu")
    procs: list[subprocess.Popen] = []
    threads = []
    for i in range(nproc):
        child_env = {**env, **process_environment(address, nproc, i)}
        piped = i > 0  # process 0 keeps the terminal (its progress bar); others are tagged
        p = subprocess.Popen(
            [sys.executable, *TRAIN, *train_args],
            env=child_env,
            stdout=subprocess.PIPE if piped else None,
            stderr=subprocess.STDOUT if piped else None,
        )
        procs.append(p)
        if piped:
            t = threading.Thread(target=_prefix, args=(p.stdout, f"[process {i}] ", sys.stdout))
            t.daemon = True
            t.start()
            threads.append(t)
    _say(f"{nproc} processes, coordinator {address}, pids {[p.pid for p in procs]}")

    def forward(signum, frame):
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    previous = signal.signal(signal.SIGTERM, forward)
    try:
        code = _supervise(procs, grace_s)
    except KeyboardInterrupt:
        forward(signal.SIGINT, None)
        code = _supervise(procs, grace_s)
    finally:
        signal.signal(signal.SIGTERM, previous)
    for t in threads:
        t.join(timeout=5)
    return code


def _supervise(procs: list[subprocess.Popen], grace_s: float) -> int:
    """Wait for the processes; when one fails, stop the others and return its code."""
    while True:
        codes = [p.poll() for p in procs]
        failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            i, c = failed[0]
            _say(
                f"process {i} (pid {procs[i].pid}) {_describe(c)}; stopping the other "
                f"processes (SIGTERM, SIGKILL after {grace_s:.0f}s)"
            )
            stop_processes(procs, grace_s)
            for p in procs:
                p.wait()  # ended; collect the exit codes
            if c in (143, -signal.SIGTERM) and all(p.returncode in (143, -15) for p in procs):
                return 143  # preempted together: every process checkpointed
            return c if c > 0 else 128 - c
        if all(c == 0 for c in codes):
            return 0
        time.sleep(0.2)


# -- SLURM -------------------------------------------------------------------------


class TrainTask(submitit.helpers.Checkpointable):
    """One SLURM task of the job: ``python -m ocformer.train`` with the job's arguments
    (JAX reads the task's place from SLURM). On preemption or timeout, SIGTERM lets the
    process checkpoint, and the job is requeued with the same arguments."""

    def __init__(self, train_args: list[str]):
        self.train_args = list(train_args)
        self._proc: subprocess.Popen | None = None

    def __call__(self) -> int:
        self._proc = subprocess.Popen([sys.executable, *TRAIN, *self.train_args])
        code = self._proc.wait()
        if code != 0:
            raise RuntimeError(f"python -m ocformer.train {_describe(code)}")
        return code

    def checkpoint(self, *args: Any, **kwargs: Any) -> submitit.helpers.DelayedSubmission:
        proc = self._proc
        if proc is not None:
            stop_processes([proc], GRACE_S * 2)
        self._proc = None
        return submitit.helpers.DelayedSubmission(TrainTask(self.train_args))

    def __getstate__(self) -> dict:
        return {"train_args": self.train_args, "_proc": None}


def _job(args) -> SlurmJob:
    return slurm_job(
        args.folder,
        name=args.name,
        time_min=args.time,
        cpus_per_task=args.cpus_per_task,
        nodes=args.nodes,
        tasks_per_node=args.gpus_per_node,
        gpus_per_node=args.gpus_per_node,
        partition=args.partition,
    )


def job_script(args) -> str:
    """The sbatch script submitit writes for this job."""
    return _job(args).script()


def slurm(args, train_args: list[str]) -> int:
    for name in ("nodes", "gpus_per_node", "cpus_per_task", "time"):
        if getattr(args, name) < 1:
            return _fail(2, f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.dry_run:
        print(job_script(args))
        task = " ".join(shlex.quote(a) for a in (sys.executable, *TRAIN, *train_args))
        print(f"# each task runs: {task}")
        return 0
    if shutil.which("sbatch") is None:
        return _fail(
            2,
            "no SLURM on this machine (sbatch not found); run from a SLURM login node, or "
            "add --dry-run to see the job script",
        )
    job = _job(args).executor().submit(TrainTask(train_args))
    tasks = f"{args.nodes} x {args.gpus_per_node} tasks"
    _say(f"submitted job {job.job_id} ({tasks}); logs in {args.folder}")
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m ocformer.launch",
        description="Start the processes of one training run (arguments after -- go to "
        "python -m ocformer.train).",
    )
    sub = p.add_subparsers(dest="where", required=True)
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
    if "--" not in argv and {"-h", "--help"} & set(argv):
        try:
            _parser().parse_args(argv)  # prints the help
        except SystemExit as e:
            return int(e.code or 0)
    if "--" not in argv:
        return _fail(2, "give the training arguments after --, e.g. -- --config "
                     "experiments/smoke.py --workdir runs/smoke")  # fmt: skip
    cut = argv.index("--")
    args, train_args = _parser().parse_args(argv[:cut]), argv[cut + 1 :]
    if not train_args:
        return _fail(2, "no training arguments after --")
    if args.where == "local":
        return local(args.nproc, train_args, port=args.port, grace_s=args.grace)
    return slurm(args, train_args)


if __name__ == "__main__":
    sys.exit(main())
