"""Throughput and peak memory of ``python -m ocformer.tasks.prepare text``.

    python -m benchmarks.prepare_corpus --size 1G --tokenizer char bpe:4096 --json prep.json

writes a deterministic corpus of at least ``--size`` bytes (words of a seeded
vocabulary, drawn with Zipf-like frequencies, lines of about twelve words, in whole
blocks of 2^20 words, about 7 MB: ``--size 1G`` gives 1.08 GB, and every size below
7 MB gives one block; ``corpus_bytes`` in the result is the size), then prepares it once per
tokenizer in a fresh subprocess and reports its wall time, MB/s (corpus bytes / wall
time), the CPU seconds it used (user + system: on a machine shared with other work,
this rather than the wall time is the cost) and its peak resident memory (``ru_maxrss``
of ``os.wait4``). Starting the interpreter and importing ocformer (JAX included) is
measured the same way and reported apart (``startup_s``, ``startup_cpu_s``,
``startup_rss_mb``); ``mb_per_s_after_startup`` excludes it.
"""

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

from ._args import output_file, positive_int
from ._common import write_json

WORDS = 20_000
WORDS_PER_BLOCK = 1 << 20


DEFAULT_TOKENIZERS = ("char", "bpe:4096")


def parse_size(text: str) -> int:
    """``--size``: bytes, or a number with K, M or G (binary units); at least 1."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    spec = text.strip().upper()
    try:
        if spec and spec[-1] in units:
            size = int(float(spec[:-1]) * units[spec[-1]])
        else:
            size = int(spec)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size; give bytes or a number with K, M or G (1G, 300M)"
        ) from None
    if size < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive size")
    return size


class _PrepareFailed(Exception):
    """The preparing subprocess exited with an error (its message is on stderr)."""

    def __init__(self, command: list[str], code: int):
        super().__init__(f"{' '.join(command)} exited with {code}")
        self.code = code


def write_corpus(path: pathlib.Path, size: int, seed: int = 0) -> int:
    """A corpus of at least ``size`` bytes, the same for the same (size, seed)."""
    rng = np.random.default_rng(seed)
    letters = np.frombuffer(b"etaoinshrdlucmfwypvbgkjqxz", dtype=np.uint8)
    lengths = rng.integers(1, 11, size=WORDS)
    vocab = [letters[rng.integers(0, 26, size=n)].tobytes() for n in lengths]
    vocab[:20] = [w.capitalize() for w in vocab[:20]]
    p = 1.0 / np.arange(1, WORDS + 1)  # Zipf's law, exponent 1
    p /= p.sum()
    words = np.array(vocab, dtype=object)
    written = 0
    with open(path, "wb") as f:
        while written < size:
            drawn = words[rng.choice(WORDS, size=WORDS_PER_BLOCK, p=p)]
            seps = np.where(rng.random(WORDS_PER_BLOCK) < 1 / 12, b".\n", b" ")
            block = b"".join((drawn + seps).tolist())
            f.write(block)
            written += len(block)
    return written


def run(cmd: list[str]) -> tuple[float, float, float]:
    """Wall seconds, CPU seconds (user + system) and peak RSS (MB) of ``cmd`` in a
    subprocess."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise _PrepareFailed(cmd, proc.returncode)
    cpu = usage.ru_utime + usage.ru_stime
    return wall, cpu, usage.ru_maxrss / 1024  # ru_maxrss is in KiB on Linux


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.prepare_corpus", description=__doc__
    )
    parser.add_argument(
        "--size", type=parse_size, default="100M",
        help="corpus bytes (at least; whole blocks of about 7 MB): 1G, 300M, 1000000",
    )  # fmt: skip
    parser.add_argument(
        "--tokenizer", nargs="+", action="extend", default=None,
        help=f"tokenizers to measure (repeatable; default: {' '.join(DEFAULT_TOKENIZERS)})",
    )  # fmt: skip
    parser.add_argument("--chunk-bytes", type=positive_int, default=None)
    parser.add_argument("--dir", type=pathlib.Path, default=None, help="scratch (default: temp)")
    parser.add_argument("--json", type=output_file, default=None, help="write the results here")
    args = parser.parse_args(argv)
    try:
        return _measure(args)
    except _PrepareFailed as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return e.code


def _measure(args: argparse.Namespace) -> int:
    if args.dir is not None:
        args.dir.mkdir(parents=True, exist_ok=True)  # the scratch folder's parent
    scratch = pathlib.Path(tempfile.mkdtemp(dir=args.dir, prefix="prepare-bench-"))
    try:
        corpus = scratch / "corpus.txt"
        started = time.perf_counter()
        size = write_corpus(corpus, args.size)
        print(f"corpus: {size} bytes in {time.perf_counter() - started:.1f} s", flush=True)
        startup_s, startup_cpu, startup_rss = run(
            [sys.executable, "-c", "import ocformer.tasks.prepare"]
        )
        results = {
            "corpus_bytes": size,
            "startup_s": round(startup_s, 2),
            "startup_cpu_s": round(startup_cpu, 2),
            "startup_rss_mb": round(startup_rss, 1),
            "runs": [],
        }
        for tokenizer in args.tokenizer or DEFAULT_TOKENIZERS:
            out = scratch / tokenizer.replace(":", "_")
            cmd = [sys.executable, "-m", "ocformer.tasks.prepare", "text", "--input", str(corpus),
                   "--tokenizer", tokenizer, "--out", str(out), "--no-progress"]  # fmt: skip
            if args.chunk_bytes is not None:
                cmd += ["--chunk-bytes", str(args.chunk_bytes)]
            wall, cpu, rss = run(cmd)
            manifest = json.loads((out / "manifest.json").read_text())
            row = {
                "tokenizer": tokenizer,
                "wall_s": round(wall, 2),
                "cpu_s": round(cpu, 2),
                "mb_per_cpu_s": round(size / 1e6 / cpu, 2),
                "mb_per_s": round(size / 1e6 / wall, 2),
                "mb_per_s_after_startup": round(size / 1e6 / max(wall - startup_s, 1e-9), 2),
                "peak_rss_mb": round(rss, 1),
                "tokens": sum(r["tokens"] for r in manifest["splits"].values()),
                "vocab_size": manifest["vocab_size"],
                "dtype": manifest["dtype"],
            }
            results["runs"].append(row)
            print(json.dumps(row), flush=True)
            shutil.rmtree(out)
        if args.json:
            write_json(args.json, results)
        print(json.dumps(results, indent=2))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
