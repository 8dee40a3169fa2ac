"""Language modelling on a prepared corpus (``task.name=tokens``, ``task.path=DIR``)."""

import os
from typing import final

import numpy as np

from .._counts import whole_number
from ._base import (
    AbstractTextTask,
    batch_rng,
    check_batch_args,
    check_rows,
    check_split,
    check_token_ids,
)
from ._dataset import DatasetError, open_dataset


@final
class Tokens(AbstractTextTask):
    """Next-token prediction on a dataset directory written by ``python -m
    ocformer.tasks.prepare text`` (see ``ocformer.tasks._dataset`` for its layout).

    Batch ``index`` of a split is ``batch_size`` windows of ``seq_len + 1`` consecutive
    ids, each starting at a position drawn uniformly from the split's file by
    ``batch_rng(split, index, seed)``: a pure function of its arguments, read from the
    memory-mapped file (only the pages of those windows). ``train`` reads
    ``train.bin``, ``validation`` reads ``val.bin``. The vocabulary size is the
    manifest's; ``encode``/``decode`` go through the dataset's tokenizer.

    Args:
        path: the dataset directory.
        seq_len: tokens the transformer sees.

    Raises:
        DataNotFoundError: ``path`` does not exist.
        ValueError: not a dataset directory, a file that does not match its manifest,
            or a split shorter than ``seq_len + 1`` tokens.
    """

    num_classes: None = None
    vocab_size: int

    def __init__(self, path: str | os.PathLike, seq_len: int):
        if (whole := whole_number(seq_len)) is None or whole < 1:
            raise ValueError(f"seq_len must be an integer >= 1, got {seq_len!r}.")
        self.seq_len = whole
        self.dataset = open_dataset(path)
        self.vocab_size = self.dataset.vocab_size
        for split, data in self.dataset.splits.items():
            if len(data) < seq_len + 1:
                raise ValueError(
                    f"{self.dataset.file(split)} holds {len(data)} tokens, fewer than "
                    f"seq_len + 1 = {seq_len + 1}; use a shorter task.seq_len or more text"
                )

    def windows(self, split: str) -> int:
        """How many distinct windows (start positions) ``split`` holds: a batch draws
        its starts from these, with replacement."""
        check_split(split)
        return len(self.dataset.splits[split]) - self.seq_len

    def batch(self, split: str, index: int, batch_size: int, seed: int) -> dict[str, np.ndarray]:
        return self.batch_rows(split, index, batch_size, seed, slice(None))

    def batch_rows(
        self, split: str, index: int, batch_size: int, seed: int, rows: slice
    ) -> dict[str, np.ndarray]:
        """Only the rows ``rows`` of batch ``index``; only their windows are read from
        disk."""
        check_split(split)
        check_batch_args(index, batch_size, seed)
        rows = check_rows(rows, batch_size)
        data = self.dataset.splits[split]
        starts = batch_rng(split, index, seed).integers(0, self.windows(split), batch_size)
        starts = starts[rows]
        window = np.asarray(data[starts[:, None] + np.arange(self.seq_len + 1)], dtype=np.int64)
        if window.size and int(window.max()) >= self.vocab_size:
            row, col = np.unravel_index(int(np.argmax(window)), window.shape)
            raise DatasetError(
                f"{self.dataset.file(split)}: token {int(starts[row]) + int(col)} is id "
                f"{int(window[row, col])}, not below the vocabulary size {self.vocab_size}: "
                "the file is corrupted; check it with `python -m ocformer.tasks.prepare "
                f"verify {self.dataset.path}` and prepare the dataset again"
            )
        window = window.astype(np.int32)
        return {"inputs": window[:, :-1], "targets": window[:, 1:]}

    def encode(self, text: str) -> np.ndarray:
        """Token ids (int32) of ``text`` under the dataset's tokenizer."""
        try:
            ids = self.dataset.tokenizer.encode(text, add_special_tokens=False).ids
        except Exception as e:  # tokenizers raises a bare Exception (e.g. no [UNK])
            raise ValueError(
                f"The tokenizer of {self.dataset.path} cannot encode {text!r} ({e}); a "
                "character tokenizer knows only the characters of its corpus"
            ) from None
        return np.asarray(ids, dtype=np.int32)

    def decode(self, tokens) -> str:
        """The text of token ids ``tokens``."""
        tokens = check_token_ids(tokens, self.vocab_size)
        return self.dataset.tokenizer.decode(
            [int(t) for t in tokens.reshape(-1)], skip_special_tokens=False
        )
