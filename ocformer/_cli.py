"""How a command line of ocformer reports a refusal: one line on stderr, then its exit
code.

The line reads as argparse's own errors do (``PROG: error: MESSAGE``), so a bad option
and a bad configuration look alike to a user and to whatever reads the process's last
line (the sweep records it as a point's error). Every ``main(argv)`` of the package
reports through :func:`fail`. The module also holds what the commands know of
processes: the parent a supervised child ends with, and whether a recorded process runs,
and what a command does with a Ctrl-C while it starts.
"""

import _thread
import contextlib
import ctypes
import gc
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, NoReturn

if TYPE_CHECKING:
    from argparse import ArgumentParser

PARENT_ENV = "OCFORMER_PARENT_PID"
"""Set by a command that supervises its child processes (``ocformer.launch``, a sweep)
to its own process id: the child asks to end with it (``end_with_parent``)."""

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def fail(program: str | None, code: int, message: str) -> int:
    """Print ``program: error: message`` (``error: message`` without a program) on
    stderr and return ``code``, for ``main`` to return as the exit status.

    Args:
        program: the command, as its usage line names it (``"ocformer.train"``), or
            ``None``.
        code: the exit status (2 for bad input, as argparse; see
            ``ocformer.training.ExitCode``).
        message: what was refused and why, on one line.

    Returns:
        ``code``.
    """
    prefix = "error" if program is None else f"{program}: error"
    print(f"{prefix}: {message}", file=sys.stderr, flush=True)
    return code


class _StdoutOfGoneReader:
    """``sys.stdout`` that stops writing once its reader has gone (a pipe closed early,
    as by ``| head``) instead of raising ``BrokenPipeError`` into the command: a run
    goes on to its end and exit code, and only the lines nobody reads are dropped."""

    def __init__(self, stream):
        self._stream = stream
        self._gone = False

    def write(self, text: str) -> int:
        if not self._gone:
            try:
                return self._stream.write(text)
            except BrokenPipeError:
                self._reader_gone()
        return len(text)

    def flush(self) -> None:
        if not self._gone:
            try:
                self._stream.flush()
            except BrokenPipeError:
                self._reader_gone()

    def _reader_gone(self) -> None:
        self._gone = True
        # What is still buffered is flushed at exit: into /dev/null, not the closed pipe.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, self._stream.fileno())
        os.close(devnull)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def end_with_parent() -> None:
    """When a supervising command started this process (``PARENT_ENV`` names it), have
    the kernel send this process SIGTERM when that command ends, however it ends
    (SIGKILL included): a training process then checkpoints and exits rather than
    running on unsupervised. If the supervisor has already gone, SIGTERM is sent at
    once. The variable is removed, so that this process's own children do not inherit
    it. Linux only (``prctl``); elsewhere nothing is done."""
    parent = os.environ.pop(PARENT_ENV, None)
    if parent is None or not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        done = libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) == 0
    except (OSError, AttributeError, ValueError):
        return
    if done and str(os.getppid()) != parent:  # ended before the request was made
        os.kill(os.getpid(), signal.SIGTERM)


def process_exists(pid: int) -> bool:
    """Whether a process ``pid`` runs on this machine (another user's counts); a pid
    below 1 names none (``os.kill`` would take 0 and -1 for groups)."""
    if pid < 1:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it exists
        return True
    return True


def in_gc_callback(frame) -> bool:
    """Whether ``frame`` (where a signal handler was called) runs inside one of the
    garbage collector's callbacks (jax has one), where an exception is printed and
    ignored."""
    codes = {getattr(c, "__code__", None) for c in gc.callbacks} - {None}
    while frame is not None and codes:
        if frame.f_code in codes:
            return True
        frame = frame.f_back
    return False


# A Ctrl-C while a command starts (``record_interrupts``): whether one came, and whether
# the command's imports are done (from then on it raises KeyboardInterrupt).
_interrupt = {"came": False, "raises": False, "retry": False}


def _starting_interrupt(signum, frame) -> None:
    del signum
    _interrupt["came"] = True
    _interrupt["retry"] = False
    if not _interrupt["raises"]:
        return
    if in_gc_callback(frame):  # raised there, it would be printed and ignored: once the
        # callback has returned, the main thread is interrupted again
        retry = threading.Timer(_RETRY_S, _interrupt_again)
        retry.daemon = True  # the interpreter's shutdown does not wait for it
        retry.start()
        return
    raise KeyboardInterrupt


_RETRY_S = 0.01


def _interrupt_again() -> None:
    # To whichever handler the command has installed by now: this one raises; the
    # training loop's guard has seen the Ctrl-C already (``interrupted``) and takes the
    # retry for no second one (``retried_interrupt``); a sweep's or a launcher's takes
    # it as the Ctrl-C, which they had not seen.
    if _interrupt["raises"]:
        _interrupt["retry"] = True
        _thread.interrupt_main(signal.SIGINT)  # nothing where SIGINT is ignored


def retried_interrupt() -> bool:
    """Whether the SIGINT being handled is ``record_interrupts``' retry of a Ctrl-C that
    was noted (``interrupted``) inside a garbage-collection callback, rather than a new
    one; a handler calls it once, on entry (it clears the mark)."""
    retry, _interrupt["retry"] = _interrupt["retry"], False
    return retry


def record_interrupts() -> None:
    """Take charge of Ctrl-C while a command starts, before it imports JAX.

    Python's own handler raises ``KeyboardInterrupt`` wherever the signal lands: inside
    an import it ends in a long traceback (and the half-loaded runtime aborts the
    process at exit), inside JAX's garbage-collection callback it is printed and
    ignored and the command goes on as if no Ctrl-C had come. Here a Ctrl-C is noted
    (``interrupted``); once ``raise_interrupts`` is called (the imports done) it raises
    ``KeyboardInterrupt`` as usual, except in a garbage-collection callback, where it is
    noted and raised again in the main thread once the callback has returned (the
    training loop's guard, if installed by then, acts on the note at its next step).
    Only from the main thread,
    and not where Ctrl-C is ignored (a command started in the background by a script).
    """
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        signal.signal(signal.SIGINT, _starting_interrupt)


def raise_interrupts() -> None:
    """From now on, a Ctrl-C raises ``KeyboardInterrupt`` (see ``record_interrupts``)."""
    _interrupt["raises"] = True


def interrupted() -> bool:
    """Whether a Ctrl-C came since ``record_interrupts`` (raised or only noted)."""
    return _interrupt["came"]


def add_compile_cache_option(parser: "ArgumentParser") -> None:
    """The ``--no-compile-cache`` option of a command that compiles, for
    ``ocformer.training.enable_compile_cache(off=args.no_compile_cache)``."""
    parser.add_argument(
        "--no-compile-cache",
        action="store_true",
        help="do not use JAX's persistent compilation cache (default: on, in "
        "$OCFORMER_COMPILE_CACHE, else $XDG_CACHE_HOME/ocformer/jax or "
        "~/.cache/ocformer/jax; OCFORMER_COMPILE_CACHE=off also turns it off)",
    )


_skip_shutdown = False


def skip_shutdown() -> None:
    """Have ``exit_with`` end the process without the interpreter's shutdown: for a
    command whose work was cut short where native threads may still run (an interrupt
    during XLA's compilation leaves its compiler threads working, and the shutdown
    would free the runtime under them: a segmentation fault after the command's last
    line). The command must have closed its files first; a library caller of ``main``
    is unaffected."""
    global _skip_shutdown
    _skip_shutdown = True


def exit_with(
    main: Callable[[], int], program: str | None = None, interrupted_note: str = ""
) -> NoReturn:
    """Exit with ``main()``'s code, as a ``python -m`` entry point: its output may go to
    a reader that stops reading early, and its supervisor, if any, may end before it
    (``end_with_parent``).

    With ``program``, a Ctrl-C (noted by ``record_interrupts`` while the command
    started, or raised in ``main``) ends the command with ``program: error:
    interrupted; interrupted_note`` and exit code 130, without the interpreter's
    shutdown (see ``skip_shutdown``): never a traceback, nor the segmentation fault of a
    runtime freed under XLA's compiler threads. A command that reports its own
    interrupts (``ocformer.train``) catches them in ``main``.
    """
    end_with_parent()
    sys.stdout = _StdoutOfGoneReader(sys.stdout)
    try:
        if program is None:
            code = int(main())
        else:
            code = _interruptible(main, program, interrupted_note)
    finally:
        _interrupt["raises"] = False  # a Ctrl-C after the command's end is only noted
    if _skip_shutdown:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):  # a reader that has gone
                stream.flush()
        os._exit(code)
    sys.exit(code)


def _interruptible(main: Callable[[], int], program: str, note: str) -> int:
    raise_interrupts()  # the command's imports are done
    try:
        if interrupted():  # noted while the command started
            raise KeyboardInterrupt
        return int(main())
    except KeyboardInterrupt:
        # orbax's and JAX's background threads would log tracebacks of their executors
        # shut down under them while the process ends.
        logging.getLogger("absl").setLevel(logging.CRITICAL)
        skip_shutdown()
        return fail(program, 130, "interrupted" + (f"; {note}" if note else ""))
