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
from collections.abc import Sequence
from subprocess import Popen

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
