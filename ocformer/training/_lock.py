"""An exclusive lock on a directory that one process writes (a run's or a sweep's).

Two writers of one directory would interleave their records (every step logged
twice, logs rewound under a running process), so a writer holds an OS file lock,
``fcntl.flock`` on ``DIR/.lock``, for as long as it writes. The kernel releases the
lock when the process ends, however it ends, so a killed writer never leaves a stale
lock behind; the file itself stays (removing it would let two processes lock two
different files of one name). After taking the lock the holder writes its pid and host
into the file, so that a refused writer can say who holds the directory. Readers
(evaluation, ``load_run``, sweep reports) take no lock.
"""

import fcntl
import json
import os
import socket

from ._errors import WorkdirError

LOCK_FILE = ".lock"


def _holder(path: str) -> str:
    """Who holds the lock at ``path``, as written by the holder ("unknown" while it has
    not written yet, or from a file it did not write)."""
    try:
        with open(path, encoding="utf-8") as f:
            info = json.loads(f.read() or "{}")
        return f"pid {int(info['pid'])} on host {info['host']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that has not recorded its pid and host yet"


class DirectoryLock:
    """The exclusive write lock of ``directory`` (which must exist), held from
    ``acquire`` until ``release`` or the end of the process.

    Args:
        directory: the directory to lock.
        what: how the refusal names the directory, e.g. ``"work directory"``.
        flag: the option that chooses another directory, named in the refusal's fix,
            e.g. ``"--workdir"``.

    Raises:
        WorkdirError: (from ``acquire``) another process holds the lock; the message
            names the directory and the holder's pid and host.
    """

    def __init__(self, directory: str, *, what: str = "work directory", flag: str = "--workdir"):
        self.directory = os.path.abspath(directory)
        self.path = os.path.join(self.directory, LOCK_FILE)
        self._what, self._flag = what, flag
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> "DirectoryLock":
        if self._fd is not None:
            return self
        try:
            # Not O_TRUNC: the file holds the current holder's pid until we own it.
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise WorkdirError(
                f"{self._what} {self.directory} cannot be locked for writing "
                f"({self.path}: {e.strerror}); choose another {self._flag} or change its "
                "permissions"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if not isinstance(e, BlockingIOError):  # no locks on this file system (ENOLCK)
                raise WorkdirError(
                    f"{self._what} {self.directory} cannot be locked for writing "
                    f"({self.path}: {e.strerror}); choose another {self._flag} on a file "
                    "system that supports locks"
                ) from None
            raise WorkdirError(
                f"{self._what} {self.directory} is in use: another ocformer process "
                f"({_holder(self.path)}) is writing to it and holds {self.path}. Two "
                "writers would mix their records, so nothing was written. Wait for that "
                "process to finish (or stop it) and run again, or choose another "
                f"{self._flag}"
            ) from None
        record = json.dumps({"pid": os.getpid(), "host": socket.gethostname()}) + "\n"
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, record.encode(), 0)
        except OSError as e:  # a full disk, a quota: the lock is not kept for nothing
            os.close(fd)
            raise WorkdirError(
                f"{self._what} {self.directory} cannot be written ({self.path}: "
                f"{e.strerror}); free space there or choose another {self._flag}"
            ) from None
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        # Closing the descriptor releases the flock.
        os.close(fd)

    def __enter__(self) -> "DirectoryLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
