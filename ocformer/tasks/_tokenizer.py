"""The three tokenizers of a prepared corpus, all held as a ``tokenizers.Tokenizer``.

- ``char``: one symbol per character of the corpus, ids in code-point order (as the
  built-in character tasks). Stored as a standard ``tokenizer.json`` (a word-level model
  over single characters, a pre-tokenizer that isolates every character and a decoder
  that joins them), so any ``tokenizers`` user can load it.
- ``bpe:N``: a byte-level BPE of N symbols (256 bytes plus merges) trained on the corpus.
  Every text encodes, and decoding gives the text back exactly.
- a path to a ``tokenizer.json`` file, or to a directory holding one (a Hugging Face
  checkpoint directory): used as it is, copied byte for byte into the dataset, except
  that its truncation and padding, if it has them, are switched off wherever it is
  loaded (``encodes_whole``).

The ``tokenizers`` library is imported by the functions that use it, so that
``import ocformer`` and the built-in tasks run where it is not installed.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Literal

import numpy as np

if TYPE_CHECKING:
    from tokenizers import Tokenizer

TOKENIZER_FILE = "tokenizer.json"
TokenizerKind = Literal["char", "bpe", "file"]
BPE_MIN = 256  # the byte alphabet: a BPE of 256 symbols has no merges
BPE_MAX = 1 << 24
BPE_MAX_RUN = 1024  # the longest run of characters without white space a BPE trains on


class TokenizerSpecError(ValueError):
    """A ``--tokenizer`` argument that names no usable tokenizer."""


@dataclasses.dataclass(frozen=True)
class TokenizerSpec:
    """What ``--tokenizer`` asked for: ``kind``, the BPE size or the tokenizer file."""

    kind: TokenizerKind
    bpe_size: int | None = None
    file: pathlib.Path | None = None

    @classmethod
    def parse(cls, text: str) -> "TokenizerSpec":
        """``char``, ``bpe:N`` or a path to a tokenizer.json (or a directory holding one).

        Raises:
            TokenizerSpecError: a bad N, or a path that is not a tokenizer.
        """
        if text == "char":
            return cls("char")
        if text.startswith("bpe:"):
            n = text[4:]
            if not (n.isascii() and n.isdigit() and BPE_MIN <= int(n) <= BPE_MAX):
                raise TokenizerSpecError(
                    f"--tokenizer {text!r}: N must be an integer between {BPE_MIN} (the "
                    f"byte alphabet, no merges) and {BPE_MAX}, e.g. bpe:4096"
                )
            return cls("bpe", bpe_size=int(n))
        path = pathlib.Path(text)
        file = path / TOKENIZER_FILE if path.is_dir() else path
        if not file.is_file():
            what = (
                f"directory {path} holds no {TOKENIZER_FILE}"
                if path.is_dir()
                else (f"{path} does not exist")
            )
            raise TokenizerSpecError(
                f"--tokenizer {text!r}: {what}; give char, bpe:N or the path of a "
                f"{TOKENIZER_FILE} (or of a directory holding one)"
            )
        load_tokenizer(file, what="--tokenizer")
        return cls("file", file=file)


def load_tokenizer(file: pathlib.Path, what: str = "tokenizer") -> Tokenizer:
    """``read_tokenizer(file, what)`` with its truncation and padding off
    (``encodes_whole``): the tokenizer as a corpus or prompt is encoded with."""
    tok = read_tokenizer(file, what)
    encodes_whole(tok)
    return tok


def read_tokenizer(file: pathlib.Path, what: str = "tokenizer") -> Tokenizer:
    """``Tokenizer.from_file(file)``, with an error naming the file when it is not one."""
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(file))
    except Exception as e:  # tokenizers raises a bare Exception on a malformed file
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise TokenizerSpecError(
            f"{what} {file} is not a tokenizer.json that the tokenizers library can load "
            f"({first}); give char, bpe:N or a tokenizer saved by tokenizers/transformers"
        ) from None


def encodes_whole(tokenizer: Tokenizer) -> list[str]:
    """Switch off ``tokenizer``'s truncation and padding, and say which it had: a
    saved tokenizer may carry either (many sentence-embedding ones truncate to their
    context), and a corpus, a chunk of it or a prompt is encoded whole, every id of
    the text and nothing else (a tokenizer truncating to 128 ids kept 128 of a corpus's
    10,000; one padding to 8192 filled most of the validation split with its pad id)."""
    switched = []
    if (truncation := tokenizer.truncation) is not None:
        switched.append(f"truncation to {truncation['max_length']} ids")
        tokenizer.no_truncation()
    if (padding := tokenizer.padding) is not None:
        length = padding.get("length")
        switched.append("padding" + ("" if length is None else f" to {length} ids"))
        tokenizer.no_padding()
    return switched


def char_tokenizer(symbols: Iterable[str]) -> Tokenizer:
    """A tokenizer with one id per character of ``symbols``, in code-point order."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(sorted(set(symbols)))}
    if not vocab:
        raise ValueError("A character tokenizer needs at least one character.")
    tok = Tokenizer(models.WordLevel(vocab, unk_token=None))
    # [\s\S] matches any one character, newlines included: every character is a piece.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return tok


def char_table(tokenizer: Tokenizer) -> np.ndarray:
    """Code point -> id (-1 where absent) of a ``char_tokenizer``: the fast encoder of
    ``prepare`` (a table look-up instead of one pre-tokenizer piece per character)."""
    vocab = tokenizer.get_vocab()
    codes = np.array([ord(c) for c in vocab], dtype=np.int64)
    table = np.full(int(codes.max()) + 1, -1, dtype=np.int64)
    table[codes] = np.array(list(vocab.values()), dtype=np.int64)
    return table


def bpe_tokenizer(texts: Iterable[str], size: int, run: int | None = None) -> Tokenizer:
    """A byte-level BPE of ``size`` symbols trained on ``texts`` (streamed: the trainer
    keeps word counts, not the texts). A corpus with fewer distinct pairs than merges
    asked for gives fewer symbols; the manifest records the real vocabulary size.

    The trainer's time grows with the square of a word's length, so a run of more than
    ``BPE_MAX_RUN`` characters without white space (minified code, DNA, text in a script
    written without spaces) is trained on in pieces of that length (``bounded_runs``;
    ``run`` another length): only the pairs that straddle a cut go uncounted."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    tok.train_from_iterator(bounded_runs(texts, run), trainer=trainer)
    return tok


def bounded_runs(texts: Iterable[str], run: int | None = None) -> Iterator[str]:
    """``texts`` with every run of more than ``run`` (default ``BPE_MAX_RUN``)
    characters that are not white space cut after each ``run`` of them: the pieces,
    joined, are the texts."""
    cut = re.compile(rf"\S{{{BPE_MAX_RUN if run is None else run}}}")
    for text in texts:
        start = 0
        for m in cut.finditer(text):
            yield text[start : m.end()]
            start = m.end()
        yield text[start:]


def id_range(tokenizer: Tokenizer) -> int:
    """The number of ids a model needs for ``tokenizer``: its largest id plus one. That
    is its number of symbols when the ids are 0..V-1, and more when they skip some
    (a hand-made tokenizer can), whose rows then go unused."""
    ids = tokenizer.get_vocab(with_added_tokens=True).values()
    return max(ids, default=-1) + 1


def unencodable(tokenizer: Tokenizer, text: str) -> str | None:
    """The first character of ``text`` that ``tokenizer`` cannot encode on its own (a
    word-level tokenizer without an unknown token fails on a character it lacks), or
    None."""
    for c in dict.fromkeys(text):
        try:
            tokenizer.encode(c, add_special_tokens=False)
        except Exception:  # tokenizers raises a bare Exception
            return c
    return None


def unknown_id(tokenizer: Tokenizer) -> int | None:
    """The id of ``tokenizer``'s unknown token (what its model, word-level, word-piece
    or BPE, writes for a piece it lacks), or None if it has none."""
    model = json.loads(tokenizer.to_str()).get("model", {})
    if model.get("type") == "Unigram":  # SentencePiece-style: the id itself
        return model.get("unk_id")
    name = model.get("unk_token")
    return None if name is None else tokenizer.token_to_id(name)


def encode(tokenizer: Tokenizer, text: str) -> np.ndarray:
    """The ids (int64) of ``text``, without special tokens (a corpus is raw text)."""
    return np.asarray(tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.int64)
