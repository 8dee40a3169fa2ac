"""Stopping child processes: a signal, a bounded grace period, then SIGKILL.

Every command that starts processes (``ocformer.launch``, a sweep's points, a SLURM
task) stops them the same way: the signal (SIGTERM: a training process checkpoints at
its next step and exits 143), at most ``grace_s`` seconds for all of them to end, then
SIGKILL for the rest, so that no process is left running once its parent has gone.
"""

import contextlib
import os
import signal
import time
from collections.abc import Callable, Sequence
from subprocess import Popen

# How long SIGKILLed processes are waited for (the kernel ends them at once; this only
# bounds the wait when another thread reaps them).
_REAP_S = 10.0


def _polled(p: Popen) -> bool:
    return p.poll() is None


def stop_processes(
    procs: Sequence[Popen],
    grace_s: float,
    *,
    signum: int = signal.SIGTERM,
    running: Callable[[Popen], bool] = _polled,
) -> list[Popen]:
    """Send ``signum`` to every process of ``procs`` that is still running, wait up to
    ``grace_s`` seconds for all of them to end, then SIGKILL the others and wait for
    them.

    Args:
        procs: the processes.
        grace_s: seconds the processes get after ``signum``.
        signum: the first signal.
        running: whether a process still runs. The default polls it (and so reaps it);
            for processes that another thread waits for (``os.wait4``), pass
            ``lambda p: p.returncode is None`` and let that thread set ``returncode``.

    Returns:
        The processes that had to be killed.
    """

    def send(p: Popen, sig: int) -> None:
        # os.kill rather than Popen.send_signal, which polls (and so would reap a
        # process that another thread is waiting for).
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, sig)

    for p in procs:
        if running(p):
            send(p, signum)
    deadline = time.monotonic() + grace_s
    while any(running(p) for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    killed = [p for p in procs if running(p)]
    for p in killed:
        send(p, signal.SIGKILL)
    deadline = time.monotonic() + _REAP_S
    while any(running(p) for p in killed) and time.monotonic() < deadline:
        time.sleep(0.05)
    return killed
