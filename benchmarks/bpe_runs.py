"""BPE training on a long run without white space, whole and in bounded pieces.

    python -m benchmarks.bpe_runs --length 200000 --size 300

``bpe:N`` gives the ``tokenizers`` trainer runs of more than ``BPE_MAX_RUN`` characters
without white space in pieces of that length (``ocformer.tasks._tokenizer.bounded_runs``):
the trainer's time grows with the square of a word's length. This trains
``bpe_tokenizer`` on one line of ``--length`` random ``ACGT`` letters (seeded), once
in pieces and once whole (``run`` larger than the line), and prints the wall time of each
and the vocabulary sizes (docs/data.md quotes them).
"""

import argparse
import random
import time

from ocformer.tasks import bpe_tokenizer

from ._args import positive_int


def train_seconds(text: str, size: int, run: int | None) -> tuple[float, int]:
    """Wall seconds of ``bpe_tokenizer([text], size, run)`` and the vocabulary size it
    reached."""
    start = time.perf_counter()
    tok = bpe_tokenizer([text], size, run)
    return time.perf_counter() - start, len(tok.get_vocab())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bpe_runs", description=__doc__)
    parser.add_argument("--length", type=positive_int, default=200_000)
    parser.add_argument("--size", type=positive_int, default=300)
    args = parser.parse_args(argv)
    rng = random.Random(0)
    text = "".join(rng.choice("ACGT") for _ in range(args.length))
    for label, run in (("in pieces", None), ("whole", args.length + 1)):
        seconds, vocab = train_seconds(text, args.size, run)
        print(f"{label:>9}: {seconds:.2f} s, {vocab} symbols")


if __name__ == "__main__":
    main()
