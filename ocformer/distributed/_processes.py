"""Child processes and SLURM jobs: stopping processes (a signal, a bounded grace
period, then SIGKILL) and the jobs submitted through submitit, with their scripts.

Every command that starts processes (``ocformer.launch``, a sweep's points, a SLURM
task) stops them the same way: the signal (SIGTERM: a training process checkpoints at
its next step and exits 143), at most ``grace_s`` seconds for all of them to end, then
SIGKILL for the rest, so that no process is left running once its parent has gone.
Every command that submits to SLURM (a multi-node run, a sweep's job array) describes
its job with ``slurm_job``: the executor that submits it and the script that a dry run
prints come from the same parameters. submitit is imported when a job is submitted,
not with ``ocformer``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import time
from collections.abc import Mapping, Sequence
from subprocess import Popen
from typing import TYPE_CHECKING, Any

from .._cli import PARENT_ENV
from .._compat import sbatch_script

if TYPE_CHECKING:
    import submitit

# How long SIGKILLed processes are waited for (the kernel ends them at once; this only
# bounds the wait for the kernel to report it).
_REAP_S = 10.0


def _running(p: Popen) -> bool:
    """Whether ``p`` has not ended, asked without reaping it.

    Whoever waits for the process keeps reaping it: another thread blocked in
    ``os.wait4`` (a sweep's worker) or, when this runs in a signal handler, the very
    thread the handler interrupted, blocked in ``Popen.wait``. ``Popen.poll`` would
    reap the first one's child from under it, and in the second case it cannot see the
    exit at all (the interrupted ``wait`` holds the lock ``poll`` needs, so ``poll``
    says "running" until the grace period has gone by). ``WNOWAIT`` leaves the exit
    for the waiter to collect.
    """
    if p.returncode is not None:
        return False
    try:
        ended = os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # reaped meanwhile by its waiter
        return False
    return ended is None


def supervised(env: Mapping[str, str]) -> dict[str, Any]:
    """``subprocess.Popen`` keyword arguments of a child that this process supervises,
    with environment ``env``.

    The child gets its own process group, so that a Ctrl-C at the terminal reaches this
    process alone, which then stops the child with ``stop_processes`` (SIGTERM: a
    training process checkpoints) instead of the child being interrupted directly and
    then signalled again. And its environment names this process (``PARENT_ENV``): the
    child's command line asks the kernel for SIGTERM when this process ends, however it
    ends, so that no child runs on unsupervised.
    """
    return {"process_group": 0, "env": {**env, PARENT_ENV: str(os.getpid())}}


def stop_processes(
    procs: Sequence[Popen], grace_s: float, *, signum: int = signal.SIGTERM
) -> list[Popen]:
    """Send ``signum`` to every process of ``procs`` that is still running, wait up to
    ``grace_s`` seconds for all of them to end, then SIGKILL the others and wait for
    them to end.

    The processes are not reaped here (their ``returncode`` is set by whoever waits for
    them, e.g. ``Popen.wait`` afterwards), so this may run in a signal handler or beside
    a thread that waits for them; it returns as soon as they have ended.

    Args:
        procs: child processes of this process.
        grace_s: seconds the processes get after ``signum``.
        signum: the first signal.

    Returns:
        The processes that had to be killed.
    """

    def send(p: Popen, sig: int) -> None:
        # os.kill rather than Popen.send_signal, which polls (and so would reap).
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, sig)

    for p in procs:
        if _running(p):
            send(p, signum)
    deadline = time.monotonic() + grace_s
    while any(_running(p) for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    killed = [p for p in procs if _running(p)]
    for p in killed:
        send(p, signal.SIGKILL)
    deadline = time.monotonic() + _REAP_S
    while any(_running(p) for p in killed) and time.monotonic() < deadline:
        time.sleep(0.05)
    return killed


@dataclasses.dataclass(frozen=True)
class SlurmJob:
    """A SLURM job as submitit submits it.

    Attributes:
        folder: submitit's folder of the job's files, ``LOGS/%j`` (one per job id).
        parameters: the job's resources, by the names that
            ``submitit.AutoExecutor.update_parameters`` takes.
    """

    folder: str
    parameters: Mapping[str, Any]

    def script(self, array_size: int | None = None) -> str:
        """The sbatch script submitit writes for this job: one task, or a job array of
        ``array_size`` tasks (``map_array``)."""
        return sbatch_script(self.folder, self.parameters, array_size=array_size)

    def executor(self) -> submitit.AutoExecutor:
        """A submitit executor that submits this job (on a machine with SLURM)."""
        import submitit

        executor = submitit.AutoExecutor(folder=self.folder, cluster="slurm")
        executor.update_parameters(**self.parameters)
        return executor


def slurm_job(
    logs: str,
    *,
    name: str,
    time_min: int,
    cpus_per_task: int,
    nodes: int = 1,
    tasks_per_node: int | None = None,
    gpus_per_node: int = 0,
    partition: str | None = None,
    array_parallelism: int | None = None,
) -> SlurmJob:
    """A SLURM job whose files go under ``logs``.

    Args:
        logs: the folder of submitit's files (a subfolder per job id).
        name: the job's name.
        time_min: its wall-clock limit, minutes.
        cpus_per_task: CPUs of each task.
        nodes: nodes of each task (of the job, without an array).
        tasks_per_node: tasks started on each node (default: SLURM's, one).
        gpus_per_node: GPUs of each node (0: none asked for).
        partition: the partition (default: the cluster's).
        array_parallelism: of a job array, at most this many tasks at once.
    """
    parameters = {
        "name": name,
        "timeout_min": time_min,
        "nodes": nodes,
        "tasks_per_node": tasks_per_node,
        "cpus_per_task": cpus_per_task,
        "gpus_per_node": gpus_per_node or None,
        "slurm_partition": partition,
        "slurm_array_parallelism": array_parallelism,
    }
    return SlurmJob(
        folder=os.path.join(os.path.abspath(logs), "%j"),
        parameters={k: v for k, v in parameters.items() if v is not None},
    )
