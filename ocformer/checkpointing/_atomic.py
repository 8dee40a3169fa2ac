"""Atomic file replacement: a reader sees the old file or the new one, never a torn one."""

import contextlib
import os
import re

# The name atomic_write_text gives its temporary files, and no other.
_TEMPORARY = re.compile(r".+\.tmp-\d+")


def _fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_text(path: str, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and ``os.replace``.

    ``os.replace`` is atomic on POSIX within one file system, so a process killed at any
    moment leaves either the previous content or the new one. The temporary file (named
    ``<path>.tmp-<pid>``) is removed when the write fails; one a killed process left is
    removed by ``remove_stale_temporaries`` on the next start.
    """
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_bytes(path: str, data: bytes) -> None:
    """``atomic_write_text`` of bytes (a figure's file, say)."""
    directory = os.path.dirname(os.path.abspath(path))
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # a full disk, a Ctrl-C: no temporary left where no one looks
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    _fsync_dir(directory)


def remove_stale_temporaries(directory: str) -> list[str]:
    """Delete the ``<name>.tmp-<pid>`` files left in ``directory`` by killed writers
    (a name that merely contains ``.tmp-`` is not one)."""
    removed = []
    if not os.path.isdir(directory):
        return removed
    for name in os.listdir(directory):
        if _TEMPORARY.fullmatch(name) and os.path.isfile(os.path.join(directory, name)):
            os.remove(os.path.join(directory, name))
            removed.append(name)
    return removed


def output_problem(path: str, option: str) -> str | None:
    """Why the file ``path`` given by the command-line ``option`` cannot be written
    (None: it can), for commands that check their output before computing anything."""
    if not path.strip():
        return f"{option} is an empty path"
    full = os.path.abspath(path)
    folder = os.path.dirname(full)
    if os.path.isdir(full):
        return f"{option} {path} is a directory; give the path of a file to write"
    if not os.path.isdir(folder):
        return f"{option} {path}: the folder {folder} does not exist; create it first"
    if not os.access(folder, os.W_OK | os.X_OK) or (
        os.path.exists(full) and not os.access(full, os.W_OK)
    ):
        return f"{option} {path} cannot be written by this user; choose another path"
    return None
