"""The task interface: a deterministic stream of batches and a fixed validation set."""

import abc
from typing import ClassVar, Literal

import numpy as np

from .._counts import whole_number

TaskKind = Literal["lm", "classification"]
SPLITS: tuple[str, ...] = ("train", "validation")
# A number per split, mixed into the batch seed so that the two splits never share a
# random stream even when (index, seed) coincide.
_SPLIT_CODE = {"train": 0, "validation": 1}


class DataNotFoundError(FileNotFoundError):
    """A data file that a task needs is not on disk (run ``make data`` to fetch it)."""


def check_split(split: str) -> int:
    if split not in _SPLIT_CODE:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}.")
    return _SPLIT_CODE[split]


def check_batch_args(index: int, batch_size: int, seed: int) -> None:
    for name, value, low in (("index", index, 0), ("batch_size", batch_size, 1), ("seed", seed, 0)):
        if (whole := whole_number(value)) is None or whole < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}.")


def check_token_ids(tokens, vocab_size: int) -> np.ndarray:
    """``tokens`` as an array, after checking that every id lies in [0, vocab_size)."""
    tokens = np.asarray(tokens)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab_size):
        raise ValueError(
            f"Token ids must lie in [0, {vocab_size}), got range [{tokens.min()}, {tokens.max()}]."
        )
    return tokens


def check_rows(rows: slice, batch_size: int) -> slice:
    """``rows`` as ``slice(start, stop)`` within ``range(batch_size)``, after checking
    that it is a slice of consecutive rows."""
    if not (isinstance(rows, slice) and rows.step in (None, 1)):
        raise ValueError(f"rows must be a slice of consecutive rows (step 1), got {rows!r}.")
    start, stop, _ = rows.indices(batch_size)
    return slice(start, max(start, stop))


def batch_rng(split: str, index: int, seed: int) -> np.random.Generator:
    """The generator of batch ``index`` of ``split``: seeded by (seed, split, index) alone,
    so a batch is a pure function of its arguments and a resumed run sees the same data."""
    return np.random.default_rng([int(seed), check_split(split), int(index)])


class AbstractTask(abc.ABC):
    """A learning task as a pure function from (split, index, batch_size, seed) to a batch.

    Attributes:
        kind: ``"lm"`` (next-symbol prediction, causal) or ``"classification"``.
        vocab_size: number of symbols (LM tasks), else None.
        num_classes: number of classes (classification tasks), else None.
        seq_len: the number of tokens the transformer sees.

    LM batches are ``{"inputs": int32 (B, seq_len), "targets": int32 (B, seq_len)}``;
    a target of -1 is ignored by the loss (positions whose next symbol is not
    determined by the task). Classification batches are ``{"inputs": float32 (B, ...),
    "targets": int32 (B,)}``.
    """

    kind: ClassVar[TaskKind]
    vocab_size: int | None
    num_classes: int | None
    seq_len: int

    @abc.abstractmethod
    def batch(self, split: str, index: int, batch_size: int, seed: int) -> dict[str, np.ndarray]:
        """Batch ``index`` of ``split``; the same arguments always give the same arrays."""

    def batch_rows(
        self, split: str, index: int, batch_size: int, seed: int, rows: slice
    ) -> dict[str, np.ndarray]:
        """Only the rows ``rows`` (a slice of ``range(batch_size)``) of batch ``index``,
        bitwise equal to those rows of ``batch(split, index, batch_size, seed)``: what
        one process of a run makes of the global batch.

        This default makes the whole batch and keeps the rows, which is right for every
        task at the cost of the whole batch on every process; a task that can draw its
        rows alone (every built-in task) overrides it.
        """
        rows = check_rows(rows, batch_size)
        return {k: v[rows] for k, v in self.batch(split, index, batch_size, seed).items()}

    def eval_batches(self, batch_size: int, num_batches: int, seed: int = 0) -> list[dict]:
        """A fixed validation set: batches 0 .. num_batches - 1 of the validation split."""
        if (whole_number(num_batches) or 0) < 1:
            raise ValueError(f"num_batches must be an integer >= 1, got {num_batches!r}.")
        return [self.batch("validation", i, batch_size, seed) for i in range(num_batches)]


class AbstractTextTask(AbstractTask):
    """A language model of text: its symbols are a text's, so the training loop can
    prompt the model with text and sample text from it (``train.sample_tokens``)."""

    kind: ClassVar[Literal["lm"]] = "lm"

    @abc.abstractmethod
    def encode(self, text: str) -> np.ndarray:
        """Symbol ids (int32) of ``text``."""

    @abc.abstractmethod
    def decode(self, tokens) -> str:
        """The text of symbol ids ``tokens``."""
