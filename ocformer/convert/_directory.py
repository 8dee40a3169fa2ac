"""A Hugging Face checkpoint directory on disk, read and written with the ``safetensors``
package's numpy API.

A checkpoint directory holds ``config.json`` and ``model.safetensors`` (or shards listed
in ``model.safetensors.index.json``). Reading lists every tensor's shape before any data
is read, so the caller can check them all first; writing stages the whole directory next
to its destination and renames it into place, so a destination holds one checkpoint
whole, never a mix of two.
"""

import contextlib
import json
import os
import re
import shutil
import uuid
from collections.abc import Mapping
from typing import Any

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Written by to_pretrained next to the checkpoint: a directory that holds it (and only
# ocformer's files) was written by ocformer and may be exported into again.
EXPORT_MARKER = "ocformer_export.json"
EXPORT_FILES = frozenset({CONFIG_FILE, WEIGHTS_FILE, EXPORT_MARKER})

# name -> (shape, the file holding it, its stored safetensors dtype, e.g. "F32").
Found = dict[str, tuple[tuple[int, ...], str, str]]


# ---------------------------------------------------------------------------------------
# Reading.


def read_config(path: str) -> dict:
    """The directory's ``config.json`` as a dict.

    Raises:
        ValueError: ``path`` is not a directory, or has no ``config.json``, or it is not
            a JSON object.
    """
    if not os.path.isdir(path):
        raise ValueError(f"Checkpoint directory {path!r} does not exist or is not a directory.")
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(file):
        raise ValueError(
            f"{path!r} has no {CONFIG_FILE}: a Hugging Face checkpoint directory needs the "
            f"model's configuration next to its weights ({WEIGHTS_FILE})."
        )
    try:
        with open(file) as f:
            config = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{file} is not valid JSON: {e}.") from None
    if not isinstance(config, dict):
        raise ValueError(f"{file} must hold a JSON object, got {type(config).__name__}.")
    return config


def weight_files(path: str) -> list[str]:
    """The safetensors files of the directory: ``model.safetensors``, or the shards its
    index lists.

    Raises:
        ValueError: neither file is there (weights in another format are named, with
            how to convert them), or the index is malformed or names absent shards.
    """
    single, index = os.path.join(path, WEIGHTS_FILE), os.path.join(path, INDEX_FILE)
    if os.path.isfile(single):
        return [single]
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index} has no 'weight_map' of tensor names to shard files.")
        shards = sorted(set(weight_map.values()))
        absent = [s for s in shards if not os.path.isfile(os.path.join(path, s))]
        if absent:
            raise ValueError(f"{index} lists shard files that are not in {path!r}: {absent}.")
        return [os.path.join(path, s) for s in shards]
    others = sorted(f for f in os.listdir(path) if f.endswith((".bin", ".h5", ".msgpack")))
    hint = (
        f" It has {others}: convert them to safetensors with transformers "
        "(model.save_pretrained(path), the default format)."
        if others
        else ""
    )
    raise ValueError(f"{path!r} has neither {WEIGHTS_FILE} nor {INDEX_FILE}.{hint}")


@contextlib.contextmanager
def _open_weights(file: str):
    """``safe_open(file)``, with the library's errors (a truncated or damaged file, on
    opening or on reading a tensor) turned into a ``ValueError`` that names the file."""
    try:
        with safe_open(file, framework="np") as f:
            yield f
    except SafetensorError as e:
        raise ValueError(
            f"{file} cannot be read as a safetensors file ({e}): it is truncated or "
            "damaged; save or download the checkpoint again"
        ) from None


def tensor_shapes(files: list[str]) -> Found:
    """Every tensor's shape, the file holding it and its stored dtype, without reading
    the data.

    Raises:
        ValueError: a file cannot be read, or a tensor is in two shards.
    """
    out: Found = {}
    for file in files:
        with _open_weights(file) as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has keys(), no iteration)
                if name in out:
                    raise ValueError(f"Tensor {name!r} is in two shards: {out[name][1]}, {file}.")
                tensor = f.get_slice(name)
                out[name] = (tuple(tensor.get_shape()), file, tensor.get_dtype())
    return out


def read_tensors(
    files: list[str], names: Mapping[str, str], dtype: np.dtype
) -> dict[str, np.ndarray]:
    """The tensors ``names`` maps to (canonical name -> name in the files), read as
    ``dtype`` and keyed by their canonical names.

    Raises:
        ValueError: a tensor cannot be read as a numpy array (e.g. bfloat16).
    """
    wanted = {file_name: canonical for canonical, file_name in names.items()}
    out = {}
    for file in files:
        with _open_weights(file) as f:
            for name in f.keys():  # noqa: SIM118
                if name in wanted:
                    try:
                        out[wanted[name]] = f.get_tensor(name).astype(dtype)
                    except TypeError as e:
                        raise ValueError(
                            f"Tensor {name!r} in {file} cannot be read as a numpy array "
                            f"({e}); save the checkpoint in float32 or float64."
                        ) from None
    return out


# ---------------------------------------------------------------------------------------
# Writing.


def check_extra_files(files: Mapping[str, str | os.PathLike] | None) -> dict:
    """``files`` (name in the checkpoint -> source file) as a dict, each checked.

    Raises:
        ValueError: a name is not a plain file name, or is one of the checkpoint's own
            files, or a source is not a file.
    """
    files = {} if files is None else dict(files)
    for name, source in files.items():
        if os.path.basename(name) != name or name in EXPORT_FILES:
            raise ValueError(
                f"files: {name!r} must be a plain file name other than {sorted(EXPORT_FILES)}."
            )
        if not os.path.isfile(source):
            raise ValueError(f"files: {name!r} is to be copied from {source!r}, not a file.")
    return files


def check_destination(path: str, overwrite: bool) -> None:
    """Refuse a destination that holds anything but ocformer's own export.

    Raises:
        ValueError: ``path`` is empty; ``path``, or a folder above it, is a file;
            ``path`` is or holds the current working directory;
            ``path`` is a symbolic link (the directory is replaced whole, by a rename,
            which would replace the link and leave its target as it was); or the
            folder it is written in cannot be written.
        FileExistsError: ``path`` is a directory that is not empty and is not an
            export of ocformer's (or holds files besides it), and ``overwrite`` is off.
    """
    if not path.strip():  # os.path reads "" as the current directory
        raise ValueError("to_pretrained needs the path of a directory, got an empty one.")
    if os.path.islink(path):
        raise ValueError(
            f"to_pretrained writes a checkpoint directory, but {path!r} is a symbolic link "
            f"(to {os.readlink(path)!r}), which the new directory would replace, leaving "
            f"its target as it was; give the directory itself ({os.path.realpath(path)!r})."
        )
    if os.path.lexists(path) and not os.path.isdir(path):
        raise ValueError(
            f"to_pretrained writes a checkpoint directory, but {path!r} is a file; give "
            "the path of a new or empty directory."
        )
    above = os.path.dirname(os.path.abspath(path))
    while not os.path.lexists(above) and os.path.dirname(above) != above:
        above = os.path.dirname(above)
    if not os.path.isdir(above):
        raise ValueError(
            f"to_pretrained writes a checkpoint directory at {path!r}, but {above!r} above "
            "it is a file; give a path under a directory."
        )
    if not os.access(above, os.W_OK | os.X_OK):
        raise ValueError(
            f"to_pretrained writes a checkpoint directory at {path!r}, but {above!r} "
            "cannot be written (no permission, or a read-only file system; the directory is "
            "written next to its place, then renamed); give a path under a writable directory."
        )
    if not os.path.isdir(path):
        return
    with contextlib.suppress(OSError):  # a working directory deleted meanwhile has none
        here, target = os.path.realpath(os.getcwd()), os.path.realpath(path)
        if here == target or here.startswith(target.rstrip(os.sep) + os.sep):
            raise ValueError(
                f"to_pretrained replaces the directory {path!r} whole (the new one is "
                "renamed into its place), but the current working directory "
                f"({here}) is in it, and would be left deleted under the shell that "
                "works there; write it from another directory."
            )
    if overwrite:
        return
    names = sorted(os.listdir(path))
    if not names:
        return
    if EXPORT_MARKER in names:
        ours = EXPORT_FILES | _marker_files(os.path.join(path, EXPORT_MARKER))
        foreign = [n for n in names if n not in ours]
        if not foreign:
            return
        why = f"it holds files that ocformer did not write: {foreign}"
    else:
        shown = names[:6] + ([f"... {len(names) - 6} more"] if len(names) > 6 else [])
        why = f"it was not written by ocformer (no {EXPORT_MARKER}; it holds {shown})"
    raise FileExistsError(
        f"to_pretrained refuses to write into {path!r}: {why}. Writing there would mix "
        "two checkpoints (stale weights, shards or an index next to the new files). Give "
        "a new or empty directory, or pass overwrite=True to replace the whole directory."
    )


def _marker_files(marker: str) -> frozenset[str]:
    """The extra files (a tokenizer) that an export's marker says it wrote."""
    try:
        with open(marker) as f:
            files = json.load(f).get("files", [])
    except (OSError, ValueError, AttributeError):
        return frozenset()
    return frozenset(f for f in files if isinstance(f, str) and os.path.basename(f) == f)


def _sibling(path: str, kind: str) -> str:
    """A new hidden name next to ``path``, on its file system (a rename cannot cross
    file systems)."""
    name = f".{os.path.basename(path)}.{kind}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    return os.path.join(os.path.dirname(path), name)


def recover_interrupted(path: str) -> None:
    """Tidy what an export to ``path`` killed part-way left beside it: its staging
    directory is removed, and the old export it had moved aside is put back when
    nothing took its place (the kill came between ``_replace_directory``'s two
    renames; of several, the newest). Siblings of an export still running (its process
    alive, on this machine: one running on another host that shares the file system
    is not seen) are left alone."""
    folder, base = os.path.split(path)
    left = re.compile(rf"\.{re.escape(base)}\.(tmp|old)-(\d+)-[0-9a-f]{{8}}")
    try:
        names = os.listdir(folder or ".")
    except OSError:
        return
    # The newest first: the old export a later interrupted export moved aside is the
    # one that was at ``path`` last.
    names.sort(key=lambda n: -_mtime(os.path.join(folder, n)))
    for name in names:
        match = left.fullmatch(name)
        if match is None or _running(int(match[2])):
            continue
        full = os.path.join(folder, name)
        if match[1] == "old" and not os.path.lexists(path):
            os.rename(full, path)
        else:
            shutil.rmtree(full, ignore_errors=True)


def _mtime(path: str) -> int:
    try:
        return os.lstat(path).st_mtime_ns
    except OSError:  # gone meanwhile
        return 0


def _running(pid: int) -> bool:
    """Whether process ``pid`` (not this one) exists."""
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's
    return True


def _replace_directory(new: str, path: str) -> None:
    """Put the finished directory ``new`` at ``path`` (a sibling): by one rename when
    ``path`` is absent or empty, else by moving the old directory aside first, so that
    ``path`` holds either the old or the new checkpoint whole, never a mix (a kill
    between the two renames leaves the old one aside, hidden; the next export to
    ``path``, through ``recover_interrupted``, puts it back first)."""
    try:
        os.rename(new, path)  # replaces an empty directory too
        return
    except OSError:
        if not os.path.isdir(path):
            raise
    old = _sibling(path, "old")
    os.rename(path, old)
    try:
        os.rename(new, path)
    except OSError:
        os.rename(old, path)  # put the old checkpoint back
        raise
    shutil.rmtree(old, ignore_errors=True)


def write_directory(
    path: str,
    config: dict,
    tensors: dict[str, np.ndarray],
    *,
    files: Mapping[str, str | os.PathLike],
    overwrite: bool,
    origin: Mapping[str, Any] | None = None,
) -> None:
    """Write ``config.json``, ``model.safetensors``, the copied ``files`` and the export
    marker into a staging sibling of ``path``, then rename it into place.

    ``path`` must be absolute and already accepted by ``check_destination``; it is
    checked again just before the swap, since it may have changed meanwhile.
    """
    os.makedirs(os.path.dirname(path), exist_ok=True)
    staging = _sibling(path, "tmp")
    os.mkdir(staging)  # with the user's umask, as the directory will have
    try:
        with open(os.path.join(staging, CONFIG_FILE), "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
        save_file(tensors, os.path.join(staging, WEIGHTS_FILE), metadata={"format": "pt"})
        # safetensors creates its file readable by its owner alone (0600); the others
        # have the user's umask, as a file written with open() does.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(os.path.join(staging, WEIGHTS_FILE), 0o666 & ~umask)
        for name, source in files.items():
            shutil.copyfile(source, os.path.join(staging, name))
        marker = {
            "model_type": config["model_type"],
            "architectures": config["architectures"],
            "files": sorted(files),
            **({} if origin is None else {"origin": dict(origin)}),
        }
        with open(os.path.join(staging, EXPORT_MARKER), "w") as f:
            json.dump(marker, f, indent=2)
        for name in os.listdir(staging):  # on disk before the rename makes them visible
            with open(os.path.join(staging, name), "rb") as f:
                os.fsync(f.fileno())
        check_destination(path, overwrite)
        _replace_directory(staging, path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
