"""SIGTERM as a request to checkpoint at the next step boundary and stop; a signal
while the run is stopping as a request to exit at once."""

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator

from .._cli import in_gc_callback, interrupted, retried_interrupt
from ._errors import ExitCode

# Whether a second SIGINT while a run stops ends the process at once (the command line)
# or raises KeyboardInterrupt again (a library call: a notebook's kernel must survive).
_exit_on_second_interrupt = False


def exit_on_second_interrupt() -> None:
    """Make a second SIGINT while a run stops end the process at once (``exit_at_once``),
    as the command line wants; a library caller keeps Python's KeyboardInterrupt."""
    global _exit_on_second_interrupt
    _exit_on_second_interrupt = True


# The signals that ask a run to checkpoint and stop: SIGTERM, and SIGUSR2, which SLURM
# sends to every process of a job step ahead of its time limit or preemption
# (``--signal=USR2@N``, as the jobs of ``ocformer.launch slurm`` ask for) and whose
# default action would end the process at once, without a checkpoint.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR2)


class PreemptionGuard:
    """Turns SIGTERM (and SIGUSR2, ``STOP_SIGNALS``) into a flag the loop polls between
    steps.

    A cluster scheduler sends SIGTERM some time before SIGKILL. The loop finishes the
    step in flight, writes a checkpoint and raises ``Preempted``. If that takes longer
    than ``grace_s`` (a slow step or save), a watchdog ends the process with
    ``ExitCode.PREEMPTED`` anyway: an unfinished save has no commit marker and is never
    restored, so the previous checkpoint stays the resume point.

    SIGINT (Ctrl-C) raises ``KeyboardInterrupt`` as usual (in a checkpoint save or a
    write of the run's records, at its end: ``holding_interrupts``); once the run is
    stopping after SIGTERM, a SIGINT exits at once (``exit_at_once``) instead of
    interrupting the checkpoint with a traceback, and so does a second SIGINT after a
    first one when ``exit_on_second_interrupt`` was called (the command line does).

    Handlers can only be installed from the main thread; elsewhere the guard is inert.
    """

    def __init__(self, grace_s: float, resume_point: Callable[[], str] | None = None):
        self.grace_s = grace_s
        # Where a rerun resumes, said when the grace period expires (read then).
        self.resume_point = resume_point
        self.requested_at: float | None = None
        self.interrupted = False
        self._holding = False  # in a block that defers a Ctrl-C (holding_interrupts)
        self._held = False  # a Ctrl-C came in such a block
        self._previous: dict | None = None
        self._previous_interrupt = None
        self._timer: threading.Timer | None = None
        self._lock = threading.RLock()  # a second signal may come while it is held
        self._wakeup: tuple[int, int] | None = None  # (read, write) ends of the pipe
        self._previous_wakeup = -1
        self._watchdog: threading.Thread | None = None

    @property
    def requested(self) -> bool:
        return self.requested_at is not None

    def _handle(self, signum, frame):
        del signum, frame
        self._request()

    def _request(self) -> None:
        """Note the request and start the grace period's timer, once."""
        with self._lock:
            if self.requested_at is not None:
                return
            self.requested_at = time.monotonic()
            self._timer = threading.Timer(self.grace_s, self._expire)
            self._timer.daemon = True
            self._timer.start()

    def _watch(self, read: int) -> None:
        """The watchdog thread: Python runs a signal's handler only when the main
        thread comes back to Python code, which a long compiled computation (an
        implicit solver's many iterations, say) delays for as long as it runs. The
        interpreter's own C-level handler writes the signal's number to the wake-up
        pipe at once; read here, a stop signal starts the grace period even then."""
        stops = {int(s) for s in STOP_SIGNALS}
        while True:
            try:
                data = os.read(read, 64)
            except OSError:
                return
            if not data:  # the guard closed the pipe
                return
            if stops & set(data):
                self._request()
            others = bytes(b for b in data if b not in stops)
            if others and self._previous_wakeup >= 0:  # the signals of its earlier owner
                with contextlib.suppress(OSError):
                    os.write(self._previous_wakeup, others)

    def _interrupt(self, signum, frame):
        del signum
        if retried_interrupt():  # the Ctrl-C this guard took from ``interrupted``
            return
        if self.requested or (self.interrupted and _exit_on_second_interrupt):
            exit_at_once()
        self.interrupted = True
        if self._holding:
            self._held = True
            return
        if in_gc_callback(frame):  # Python would print and ignore it there
            return  # check_interrupted raises it at the next step
        raise KeyboardInterrupt

    def check_interrupted(self) -> None:
        """Raise ``KeyboardInterrupt`` if a Ctrl-C came that could not raise where it
        came: inside a garbage-collection callback (jax has one), where Python would
        print and ignore the exception. The loop asks here at every step."""
        if self.interrupted:
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def holding_interrupts(self) -> Iterator[None]:
        """Defer a Ctrl-C that comes during the block to the block's end, where
        ``KeyboardInterrupt`` is raised; a second one exits at once as at any other time.

        For code that hands work to threads: an interrupt inside a checkpoint save
        leaves orbax's threads and event loops broken (they fail later with tracebacks
        of their own), and one inside ``threading.Condition.notify`` can lose the
        wake-up of the thread waiting on it (TensorBoard's writer, whose close then
        waits for ever)."""
        self._holding = True
        try:
            yield
        finally:
            self._holding = False
        if self._held:
            self._held = False
            raise KeyboardInterrupt

    def _expire(self):
        where = "The previous checkpoint is the resume point."
        if self.resume_point is not None:
            with contextlib.suppress(Exception):  # (it reads no file)
                where = self.resume_point()
        sys.stderr.write(
            f"\nocformer: SIGTERM grace period of {self.grace_s}s expired before a "
            f"checkpoint was committed; exiting. {where}\n"
        )
        sys.stderr.flush()
        os._exit(int(ExitCode.PREEMPTED))

    def __enter__(self):
        # A Ctrl-C the command line noted while it started, where it could not raise
        # (``ocformer._cli.record_interrupts``), stops the run at its first step.
        self.interrupted = self.interrupted or interrupted()
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS}
            self._previous_interrupt = signal.signal(signal.SIGINT, self._interrupt)
            self._start_watchdog()
        return self

    def _start_watchdog(self) -> None:
        """The wake-up pipe and its reader (``_watch``); without them (no descriptor
        left, say) the guard works as before, through Python's handler alone."""
        global _active
        try:
            read, write = os.pipe()
        except OSError:
            return
        try:
            os.set_blocking(write, False)
            self._previous_wakeup = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        except (OSError, ValueError):
            os.close(read)
            os.close(write)
            return
        self._wakeup = (read, write)
        self._watchdog = threading.Thread(
            target=self._watch, args=(read,), name="ocformer-sigterm", daemon=True
        )
        try:
            self._watchdog.start()
        except RuntimeError:  # no thread can be started
            self._watchdog = None
            self._stop_watchdog()
            return
        _active = self

    def _stop_watchdog(self) -> None:
        global _active
        if self._wakeup is None:
            return
        signal.set_wakeup_fd(self._previous_wakeup)
        read, write = self._wakeup
        os.close(write)  # the watchdog reads the end of the pipe and returns
        if self._watchdog is not None:
            self._watchdog.join(timeout=5.0)
        os.close(read)
        self._wakeup, self._watchdog = None, None
        if _active is self:
            _active = None

    def _forget_in_child(self) -> None:
        """In a process forked while the guard is active: its signals are its own,
        not requests to stop the parent (``multiprocessing``'s ``terminate`` sends a
        forked worker SIGTERM), so the pipe and the wake-up descriptor go."""
        if self._wakeup is None:
            return
        with contextlib.suppress(ValueError, OSError):  # not the child's main thread
            signal.set_wakeup_fd(-1)
        for fd in self._wakeup:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._wakeup, self._watchdog = None, None

    def __exit__(self, *exc):
        # The watchdog first, then the handlers, then the timer: a request that comes
        # while the guard ends starts no timer that outlives it.
        self._stop_watchdog()
        if self._previous is not None:
            for s, h in self._previous.items():
                signal.signal(s, h)
            signal.signal(signal.SIGINT, self._previous_interrupt)
            self._previous = self._previous_interrupt = None
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
        return False


# The guard whose watchdog is running, for a forked child to drop (one at a time: a
# guard is entered by the main thread, around one run).
_active: PreemptionGuard | None = None


def _after_fork_in_child() -> None:
    if _active is not None:
        _active._forget_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)


def exit_at_once(signum=None, frame=None) -> None:
    """End the process now with exit code 130, one line on stderr, no clean-up (a
    signal handler for a run that is stopping already: the last committed checkpoint is
    the resume point, and the next run removes an interrupted save)."""
    del signum, frame
    sys.stderr.write(
        "\nocformer: interrupted again while stopping; exiting at once. The last "
        "committed checkpoint is the resume point.\n"
    )
    sys.stderr.flush()
    os._exit(130)
