"""Synthetic sequence tasks: copy and sort, posed as causal language modelling."""

import abc
from typing import ClassVar, Literal, final

import numpy as np

from .._counts import whole_number
from ._base import AbstractTask, batch_rng, check_batch_args, check_rows, check_split

SEPARATOR = 0


class AbstractSymbolTask(AbstractTask):
    r"""A sequence $a_1 \dots a_k$, the separator 0, then a target sequence $b_1 \dots b_k$.

    The LM input is the first $2k$ symbols and the target the next $2k$; targets of the
    first $k - 1$ positions (the random source, unpredictable) are -1 and ignored, so
    the loss measures exactly the $k + 1$ predictions the task determines: the separator
    and $b_1 \dots b_k$. Symbols $a_i$ are drawn uniformly from $1 \dots V - 1$.
    """

    kind: ClassVar[Literal["lm"]] = "lm"
    num_classes: None = None

    def __init__(self, seq_len: int, vocab_size: int):
        if (n := whole_number(seq_len)) is None or n < 2 or n % 2:
            raise ValueError(
                f"seq_len must be an even integer >= 2 (a source of seq_len/2 symbols, "
                f"the separator, its target), got {seq_len!r}."
            )
        if (v := whole_number(vocab_size)) is None or v < 3:
            raise ValueError(
                f"vocab_size must be an integer >= 3 (the separator 0 and at least two "
                f"symbols), got {vocab_size!r}."
            )
        self.seq_len = n
        self.vocab_size = v

    @abc.abstractmethod
    def target(self, source: np.ndarray) -> np.ndarray:
        """The sequence to emit after the separator, per row of ``source``."""

    def batch(self, split: str, index: int, batch_size: int, seed: int) -> dict[str, np.ndarray]:
        return self.batch_rows(split, index, batch_size, seed, slice(None))

    def batch_rows(
        self, split: str, index: int, batch_size: int, seed: int, rows: slice
    ) -> dict[str, np.ndarray]:
        check_split(split)
        check_batch_args(index, batch_size, seed)
        rows = check_rows(rows, batch_size)
        k = self.seq_len // 2
        rng = batch_rng(split, index, seed)
        # The whole batch's draw (cheap) fixes the rows; only the rows are built.
        source = rng.integers(1, self.vocab_size, size=(batch_size, k), dtype=np.int64)[rows]
        sep = np.full((len(source), 1), SEPARATOR, dtype=np.int64)
        full = np.concatenate([source, sep, self.target(source)], axis=1).astype(np.int32)
        targets = full[:, 1:].copy()
        targets[:, : k - 1] = -1
        return {"inputs": full[:, :-1], "targets": targets}


@final
class CopyTask(AbstractSymbolTask):
    """Repeat the source after the separator: $b = a$."""

    def target(self, source):
        return source


@final
class SortTask(AbstractSymbolTask):
    """Emit the source in ascending order after the separator: $b = \\mathrm{sort}(a)$."""

    def target(self, source):
        return np.sort(source, axis=1)
