"""SIGTERM as a request to checkpoint at the next step boundary and stop."""

import os
import signal
import sys
import threading
import time

from ._errors import ExitCode


class PreemptionGuard:
    """Turns SIGTERM into a flag the loop polls between steps.

    A cluster scheduler sends SIGTERM some time before SIGKILL. The loop finishes the
    step in flight, writes a checkpoint and raises ``Preempted``. If that takes longer
    than ``grace_s`` (a slow step or save), a watchdog ends the process with
    ``ExitCode.PREEMPTED`` anyway: an unfinished save has no commit marker and is never
    restored, so the previous checkpoint stays the resume point.

    Handlers can only be installed from the main thread; elsewhere the guard is inert.
    """

    def __init__(self, grace_s: float):
        self.grace_s = grace_s
        self.requested_at: float | None = None
        self._previous = None
        self._timer: threading.Timer | None = None

    @property
    def requested(self) -> bool:
        return self.requested_at is not None

    def _handle(self, signum, frame):
        del signum, frame
        if self.requested_at is not None:
            return
        self.requested_at = time.monotonic()
        self._timer = threading.Timer(self.grace_s, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def _expire(self):
        sys.stderr.write(
            f"\nocformer: SIGTERM grace period of {self.grace_s}s expired before a "
            "checkpoint was committed; exiting. The previous checkpoint is the resume "
            "point.\n"
        )
        sys.stderr.flush()
        os._exit(int(ExitCode.PREEMPTED))

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def __exit__(self, *exc):
        if self._timer is not None:
            self._timer.cancel()
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
        return False
