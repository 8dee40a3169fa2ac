"""A prepared corpus: token ids on disk, its tokenizer and a manifest.

``python -m ocformer.tasks.prepare text --input FILES --tokenizer T --out DIR`` writes::

    DIR/train.bin       training ids, raw little-endian uint16 (uint32 when the
    DIR/val.bin         vocabulary exceeds 65536), no header: nanoGPT's layout,
                        np.fromfile(path, dtype) or np.memmap reads it
    DIR/tokenizer.json  the tokenizer (tokenizers library format)
    DIR/manifest.json   sources and their SHA-256, split rule, dtype, vocabulary size,
                        tokenizer identity, token counts and SHA-256 of each .bin

Preparation streams: the files are read in chunks of ``chunk_bytes``, each chunk is
encoded on its own and its ids appended to the split's file, so memory is bounded by
the chunk (and, for BPE training, by the table of distinct words). A chunk ends just
before a space or newline that follows a printable ASCII character: every pre-tokenizer
of the ``char`` and ``bpe`` tokenizers (and of GPT-2-style byte-level ones) splits
there anyway, so the ids do not depend on the chunk size (a tokenizer given by path
whose ids do, as one adding a prefix space to each text, is found by
``_cuts_change_ids`` on the start of the first file longer than a chunk, and encodes
each file whole). A run of more than
``MAX_CHUNKS`` chunks without such a place is cut at a character boundary instead.
Files are read in the order given and their ids concatenated; each file is encoded on
its own.

The validation split (``val.bin``) is the end of the corpus: it starts at the first
chunk boundary (as above, or the start of a file) at or after byte
``s = ceil((1 - VALIDATION_FRACTION) * total)`` of the corpus and at most
``split_search(total)`` bytes (1 % of the corpus, at least 4 KiB) past it; where there
is none, at the first character boundary at or after ``s``, so that text without such
places (Japanese, say, with one ASCII line at its end) still leaves validation its
share. ``split_point`` finds it by reading on from that byte, and no chunk crosses it,
so the split does not depend on the chunk size (``MAX_CHUNKS`` does not apply to it).

The directory appears whole: it is built in a temporary sibling and renamed into place.
An existing ``DIR`` is replaced only if it is empty or was written by this function.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import hashlib
import json
import math
import os
import pathlib
import re
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, BinaryIO

import numpy as np
from tqdm.auto import tqdm

from .._cli import process_exists
from ._base import DataNotFoundError
from ._tokenizer import (
    TOKENIZER_FILE,
    TokenizerSpec,
    bpe_tokenizer,
    char_table,
    char_tokenizer,
    encode,
    encodes_whole,
    id_range,
    load_tokenizer,
    read_tokenizer,
    unencodable,
    unknown_id,
)

if TYPE_CHECKING:
    from tokenizers import Tokenizer

FORMAT = "ocformer-tokens"
FORMAT_VERSION = 1
MANIFEST_FILE = "manifest.json"
SPLIT_FILES = {"train": "train.bin", "validation": "val.bin"}
DATASET_FILES = {MANIFEST_FILE, TOKENIZER_FILE, *SPLIT_FILES.values()}
VALIDATION_FRACTION = 0.1
# Validation starts at a chunk boundary or file start at most this far past its split
# byte (a share of the corpus, at least SPLIT_SEARCH_MIN bytes), else at a character.
SPLIT_SEARCH_FRACTION = 0.01
SPLIT_SEARCH_MIN = 4096
CHUNK_BYTES = 1 << 20
UNKNOWN_WARN = 0.01  # prepare warns when more of the corpus's tokens are the unknown one
MAX_CHUNKS = 8
# Open checks the full SHA-256 and id range of .bin files up to this total size (well
# under a second); larger datasets get the size check on open, the range check on each
# window read, and the full check from `prepare verify`.
FULL_CHECK_BYTES = 64 << 20
_CUT = re.compile(rb"[\x21-\x7e](?=[ \n])")


class CorpusError(ValueError):
    """Input that cannot be prepared: missing, empty or non-UTF-8 files, a refused
    ``--out``. The message names the file."""


class DatasetError(ValueError):
    """A dataset directory that is not one, or is corrupted. The message names the file."""


def sha256_file(path: str | os.PathLike, block: int = 1 << 22) -> str:
    """The SHA-256 of a file's bytes (hex), read in blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            h.update(chunk)
    return h.hexdigest()


def dtype_for(vocab_size: int) -> np.dtype:
    """uint16 when every id fits, else uint32 (little-endian either way)."""
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def expand_inputs(patterns: Sequence[str]) -> list[pathlib.Path]:
    """The files of ``patterns`` (paths or globs, each glob's matches sorted), in order.
    A pattern that names an existing file is that file, glob characters or not; the
    directories a glob matches (``data/*`` matching ``data/sub``) are passed over.

    Raises:
        CorpusError: a pattern matching no file, a path that is not a file, an empty or
            unreadable file, a file given twice (by two paths or links to it; its text
            would be trained on twice).
    """
    if not patterns:
        raise CorpusError("--input: give at least one text file or glob")
    files: list[pathlib.Path] = []
    seen: dict[tuple[int, int], tuple[pathlib.Path, str]] = {}  # (device, inode) -> given
    for pattern in patterns:
        # A file named with glob characters ("notes [v2].txt") is that file, not a glob.
        globbed = glob.has_magic(pattern) and not os.path.isfile(pattern)
        if globbed:
            found = sorted(glob.glob(pattern, recursive=True))
            matches = [m for m in found if not os.path.isdir(m)]
            if not matches:
                raise CorpusError(
                    f"--input {pattern!r} matches no file"
                    + (f" (only the directories {', '.join(found[:3])})" if found else "")
                    + ", and no file has that name; in a glob, * ? and [...] are wildcards: "
                    f"to match them literally, write [*] [?] [[] (glob.escape gives "
                    f"{glob.escape(pattern)!r})"
                )
        else:
            matches = [pattern]
        for match in matches:
            path = pathlib.Path(match)
            by = f" (matched by {pattern!r}: narrow the glob)" if globbed else ""
            if not path.exists():
                raise CorpusError(f"--input {path}: no such file")
            if path.is_dir():
                raise CorpusError(
                    f"--input {path} is a directory; give its files, e.g. --input "
                    f"'{glob.escape(str(path))}/**/*.txt' (quoted: the glob is expanded here)"
                )
            if not path.is_file():
                raise CorpusError(f"--input {path}: not a regular file")
            if not os.access(path, os.R_OK):
                raise CorpusError(f"--input {path}: this user cannot read it (permission denied)")
            stat = path.stat()
            if stat.st_size == 0:
                raise CorpusError(f"--input {path}: the file is empty{by}; remove it from --input")
            key = (stat.st_dev, stat.st_ino)
            if key in seen:
                first, by_first = seen[key]
                also = "" if first.resolve() == path.resolve() else f" (as {first})"
                raise CorpusError(
                    f"--input {path} is given twice{also} (by {by_first!r} and by "
                    f"{pattern!r}); give each file once"
                )
            seen[key] = (path, pattern)
            files.append(path)
    return files


def equal_contents(files: Sequence[pathlib.Path]) -> list[list[pathlib.Path]]:
    """The groups of ``files`` with the same bytes (copies kept beside their original),
    each in the order given. Files are compared by size, then by their first MiB, and
    read whole only when both agree (shards of one size, as ``split -b`` writes, differ
    in their first MiB)."""
    groups: dict[tuple, list[pathlib.Path]] = {}
    for f in files:
        groups.setdefault((f.stat().st_size,), []).append(f)
    for step in (_head_sha256, sha256_file):
        regrouped: dict[tuple, list[pathlib.Path]] = {}
        for key, same in groups.items():
            if len(same) > 1:
                for f in same:
                    regrouped.setdefault((*key, step(f)), []).append(f)
        groups = regrouped
    return [same for same in groups.values() if len(same) > 1]


def _check_copies(files: Sequence[pathlib.Path]) -> None:
    """Refuse copies of one text on both sides of the validation split (the validation
    loss would measure text that was trained on), naming every such group; warn of
    copies on one side (their text counts twice there)."""
    split_file, split_at = split_point(files)
    index = {f: i for i, f in enumerate(files)}

    def sides(f: pathlib.Path) -> set[str]:
        i = index[f]
        train = i < split_file or (i == split_file and split_at > 0)
        validation = i > split_file or (i == split_file and split_at < f.stat().st_size)
        return {name for name, on in (("training", train), ("validation", validation)) if on}

    leaking, doubled = [], []
    for group in equal_contents(files):
        each = [sides(f) for f in group]
        seen = set().union(*each)
        if "training" in seen and "validation" in seen:
            leaking.append(group)
        else:
            doubled.append((group, seen.pop()))
    if leaking:
        named = "; ".join(" and ".join(map(str, g)) for g in leaking)
        raise CorpusError(
            f"--input files of the same contents fall in both the training and the "
            f"validation split ({named}): the validation loss would measure text that was "
            "trained on; give one file of each"
        )
    for group, side in doubled:
        print(
            f"ocformer: warning: --input {' and '.join(map(str, group))} have the same "
            f"contents: their text is {len(group)} times in the {side} split",
            file=sys.stderr,
            flush=True,
        )


def _head_sha256(file: pathlib.Path, size: int = 1 << 20) -> str:
    with open(file, "rb") as f:
        return hashlib.sha256(f.read(size)).hexdigest()


@dataclasses.dataclass(frozen=True)
class Piece:
    """A chunk of one file: its split, bytes and byte offset in that file."""

    split: str
    data: bytes
    file: pathlib.Path
    offset: int

    def text(self) -> str:
        if (nul := self.data.find(b"\0")) >= 0:
            raise CorpusError(
                f"{self.file}: a NUL byte at byte offset {self.offset + nul}: a binary file "
                "(a prepared dataset's .bin, say), UTF-16 text (convert it: iconv -f "
                "UTF-16 -t UTF-8), or text with stray NULs (remove them: tr -d '\\000'); "
                "give UTF-8 text without NULs"
            )
        try:
            return self.data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise CorpusError(
                f"{self.file}: not UTF-8 at byte offset {self.offset + e.start} "
                f"({e.reason}); convert the file to UTF-8 (e.g. iconv -t UTF-8)"
            ) from None


def _last_cut(buf: bytes, end: int) -> int:
    """The largest chunk boundary ``0 < i < end`` of ``buf``, else 0."""
    width = 4096
    while True:
        lo = max(0, end - width)
        # endpos=end hides buf[end:] from the look-ahead too, so every boundary is < end.
        found = [m.start() + 1 for m in _CUT.finditer(buf, lo, end)]
        if found:
            return found[-1]
        if lo == 0:
            return 0
        width *= 4


# The text a tokenizer's chunk-size independence is tried on: the start of the corpus.
_PROBE_BYTES = 1 << 16


def _cuts_change_ids(tok: Tokenizer, files: Sequence[pathlib.Path], chunk_bytes: int) -> bool:
    """Whether ``tok`` gives other ids for the start of a file cut at chunk boundaries
    (see the module docstring) than for it whole: a pre-tokenizer that adds a prefix
    space to each text, or that reads the whole text as one piece, does. Tried on the
    first file longer than a chunk (a shorter one is encoded whole) whose start has a
    boundary; False where there is none, or the sample does not encode (the encoding
    proper reports that)."""
    for file in files:
        if file.stat().st_size > chunk_bytes:
            changes = _cuts_change_start(tok, file)
            if changes is not None:
                return changes
    return False


def _cuts_change_start(tok: Tokenizer, file: pathlib.Path) -> bool | None:
    """``_cuts_change_ids`` on the first ``_PROBE_BYTES`` of ``file``; None where they
    hold no chunk boundary."""
    with open(file, "rb") as f:
        sample = f.read(_PROBE_BYTES)
    # A cut of each kind: before a newline and before a space (GPT-2's prefix space is
    # added to a text that does not start with one, so only the first kind shows it).
    cuts = set()
    for kind in (b"\n", b" "):
        at = next((m.start() + 1 for m in _CUT.finditer(sample) if sample[m.end()] == kind[0]), 0)
        cuts.add(at)
    cuts = sorted(c for c in cuts | {_last_cut(sample, len(sample))} if c > 0)
    if not cuts:
        return None
    pieces = [sample[a:b] for a, b in zip([0, *cuts], [*cuts, len(sample)])]
    try:
        whole = encode(tok, sample[: len(sample)].decode("utf-8", errors="ignore"))
        parts = [encode(tok, p.decode("utf-8", errors="ignore")) for p in pieces]
    except Exception:  # tokenizers raises a bare Exception
        return False
    return not np.array_equal(whole, np.concatenate(parts))


def _char_boundary(buf: bytes, at: int) -> int:
    """The first UTF-8 character boundary at or after ``at`` in ``buf``. Valid UTF-8 has
    one within 3 bytes; in invalid text this may be ``len(buf)``, and decoding the piece
    reports the first bad byte."""
    while at < len(buf) and (buf[at] & 0xC0) == 0x80:
        at += 1
    return at


def _scan_cut(fh: BinaryIO, at: int, last: int, block: int = 1 << 20) -> int | None:
    """The first chunk boundary of the open file ``fh`` in ``[at, last]`` (``at >= 1``),
    read in blocks from byte ``at - 1`` on (the character before a boundary is part of
    it); None if the file has none there."""
    fh.seek(at - 1)
    pos, buf = at - 1, fh.read(min(block, last + 2 - at))  # pos: the offset of buf[0]
    while buf:
        if (m := _CUT.search(buf)) and pos + m.start() + 1 <= last:
            return pos + m.start() + 1
        data = fh.read(max(0, min(block, last + 1 - (pos + len(buf)))))
        if not data:
            return None
        # Keep the last byte: it may be the printable character of a boundary at data[0].
        pos, buf = pos + len(buf) - 1, buf[-1:] + data
    return None


def split_search(total: int) -> int:
    """How far past the split byte a corpus of ``total`` bytes is searched for a place
    to start validation (the module docstring)."""
    return max(SPLIT_SEARCH_MIN, math.ceil(total * SPLIT_SEARCH_FRACTION))


def split_point(files: Sequence[pathlib.Path]) -> tuple[int, int]:
    """Where the validation split starts: (index of the file in ``files``, byte offset
    in it), by the rule of the module docstring. The offset is the file's size when
    validation would be empty (a corpus too short to split)."""
    sizes = [f.stat().st_size for f in files]
    split_byte = math.ceil(sum(sizes) * (1.0 - VALIDATION_FRACTION))
    last = split_byte + split_search(sum(sizes))  # the last corpus offset searched
    start = 0  # corpus offset of the file
    for index, (file, size) in enumerate(zip(files, sizes, strict=True)):
        if start >= split_byte:
            return index, 0  # the first file starting at or past the split byte
        rel = split_byte - start
        if rel < size:
            with open(file, "rb") as fh:
                cut = _scan_cut(fh, rel, last - start)
                if cut is not None:
                    return index, cut
                if index + 1 < len(files) and start + size <= last:
                    return index + 1, 0
                fh.seek(rel)
                return index, rel + _char_boundary(fh.read(4), 0)
        start += size
    return len(files) - 1, sizes[-1]


def _chunks(
    fh: BinaryIO, length: int | None, chunk_bytes: int, progress: Callable[[int], object]
) -> Iterator[bytes]:
    """The next ``length`` bytes of ``fh`` (all the rest if None) in chunks that end at
    chunk boundaries (see the module docstring), or at a character boundary after a run
    of ``MAX_CHUNKS`` chunks without one."""
    buf, eof, want = b"", False, chunk_bytes
    while buf or not eof:
        if not eof and len(buf) < want:
            n = want - len(buf) if length is None else min(want - len(buf), length)
            block = fh.read(n) if n else b""
            if length is not None:
                length -= len(block)
            eof = not block
            buf += block
            progress(len(block))
            continue
        if eof:
            yield buf
            return
        cut = _last_cut(buf, len(buf))
        if not cut and len(buf) >= MAX_CHUNKS * chunk_bytes:
            cut = _char_boundary(buf, len(buf) // 2)
        if not cut:
            want = len(buf) + chunk_bytes  # read on until a boundary comes
            continue
        yield buf[:cut]
        buf, want = buf[cut:], chunk_bytes


def stream_pieces(
    files: Sequence[pathlib.Path],
    chunk_bytes: int = CHUNK_BYTES,
    progress: Callable[[int], object] = lambda n: None,
) -> Iterator[Piece]:
    """The corpus as chunks, each tagged with its split (see the module docstring)."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}.")
    if not files:
        return
    split_file, split_at = split_point(files)
    for index, file in enumerate(files):
        # Each file's spans: (split, length, None for the rest of the file).
        if index < split_file:
            spans = [("train", None)]
        elif index > split_file:
            spans = [("validation", None)]
        else:
            spans = [("train", split_at), ("validation", None)]
        off = 0
        with open(file, "rb") as fh:
            for split, length in spans:
                for data in _chunks(fh, length, chunk_bytes, progress):
                    yield Piece(split, data, file, off)
                    off += len(data)


class _Writer:
    """Appends ids to one split's .bin file, hashing and counting as it goes."""

    def __init__(self, file: BinaryIO, dtype: np.dtype):
        self.file, self.dtype = file, dtype
        self.hash = hashlib.sha256()
        self.tokens = 0
        self.max_id = -1

    def write(self, ids: np.ndarray) -> None:
        if not ids.size:
            return
        data = ids.astype(self.dtype).tobytes()
        self.file.write(data)
        self.hash.update(data)
        self.tokens += int(ids.size)
        self.max_id = max(self.max_id, int(ids.max()))

    def finish(self) -> dict:
        self.file.flush()
        os.fsync(self.file.fileno())
        return {
            "file": pathlib.Path(self.file.name).name,
            "tokens": self.tokens,
            "bytes": self.tokens * self.dtype.itemsize,
            "sha256": self.hash.hexdigest(),
            "max_id": self.max_id,
        }


def check_out(out: pathlib.Path) -> None:
    """Refuse an ``--out`` that exists and is not empty and not a dataset of ours alone
    (replacing it would delete the other files), and one below a file."""
    if out.is_symlink():
        raise CorpusError(
            f"--out {out} is a symbolic link; give the directory itself ({out.resolve()})"
        )
    try:
        here = pathlib.Path.cwd().resolve()
    except OSError:  # the current directory was deleted: no path can hold it
        here = None
    if here is not None and (out.resolve() == here or out.resolve() in here.parents):
        raise CorpusError(
            f"--out {out} is the current directory or holds it; preparing replaces "
            "the directory whole, which would leave this shell in a deleted directory: "
            "give a new directory, e.g. --out data/"
        )
    if out.exists() and not out.is_dir():
        raise CorpusError(f"--out {out} exists and is not a directory; choose another path")
    if out.is_dir() and any(out.iterdir()):
        names = sorted(p.name for p in out.iterdir())
        if _read_format(out) != FORMAT:
            raise CorpusError(
                f"--out {out} is a non-empty directory not written by ocformer (it holds "
                f"{', '.join(names[:5])}, and no {MANIFEST_FILE} of format {FORMAT!r}); "
                "choose an empty or new directory"
            )
        foreign = [n for n in names if n not in DATASET_FILES]
        if foreign:
            raise CorpusError(
                f"--out {out} is a dataset but also holds {', '.join(foreign[:5])}, which "
                "replacing the dataset would delete; move them out or choose another "
                "directory"
            )
    for parent in out.parents:
        if parent.exists() and not parent.is_dir():
            raise CorpusError(f"--out {out}: {parent} is not a directory")


def _read_format(out: pathlib.Path) -> str | None:
    try:
        return json.loads((out / MANIFEST_FILE).read_text(encoding="utf-8")).get("format")
    except (OSError, ValueError, AttributeError):
        return None


def prepare_text(
    inputs: Sequence[str],
    tokenizer: str,
    out: str | os.PathLike,
    *,
    chunk_bytes: int = CHUNK_BYTES,
    progress: bool = True,
) -> dict:
    """Tokenize text files into the dataset directory ``out``; returns its manifest.

    Args:
        inputs: text files or globs (UTF-8), read in this order.
        tokenizer: ``"char"``, ``"bpe:N"`` or the path of a ``tokenizer.json`` (or of a
            directory holding one).
        out: the dataset directory (created, or replaced if it is ours).
        chunk_bytes: bytes read and encoded at a time (memory bound, not the result).
        progress: show tqdm bars (bytes read, tokens written) on stderr.

    Raises:
        CorpusError: missing, empty, unreadable, binary or non-UTF-8 input, copies of
            one text on both sides of the validation split, a file inside ``out`` or
            changed while it was prepared, or a refused ``out``.
        TokenizerSpecError: a bad ``bpe:N`` or a path that is not a tokenizer.
    """
    spec = TokenizerSpec.parse(tokenizer)
    files = expand_inputs(inputs)
    _check_copies(files)
    out = pathlib.Path(out)
    check_out(out)
    out = pathlib.Path(os.path.abspath(out))  # "data/.." has a parent, "." a name
    for f in files:
        if out.resolve() in f.resolve().parents:
            raise CorpusError(
                f"--input {f} is inside --out {out}, which preparing replaces whole; "
                "give the corpus from outside the dataset directory"
            )
    sizes = {f: f.stat().st_size for f in files}
    total = sum(sizes.values())

    def bar(desc: str):
        return tqdm(
            total=total, unit="B", unit_scale=True, desc=desc, disable=not progress,
            file=sys.stderr, dynamic_ncols=True,
        )  # fmt: skip

    def texts(desc: str) -> Iterator[str]:
        with bar(desc) as b:
            for piece in stream_pieces(files, chunk_bytes, b.update):
                yield piece.text()

    tmp = _scratch(out)  # first: an --out that cannot be written fails at once
    try:
        if spec.kind == "char":
            symbols: set[str] = set()
            for text in texts("characters"):
                symbols.update(text)
            tok = char_tokenizer(symbols)
        elif spec.kind == "bpe":
            assert spec.bpe_size is not None
            tok = bpe_tokenizer(texts("bpe training"), spec.bpe_size)
        else:
            assert spec.file is not None
            tok = read_tokenizer(spec.file)
            if switched := encodes_whole(tok):
                print(
                    f"ocformer: {tokenizer}: its {' and '.join(switched)} "
                    f"{'is' if len(switched) == 1 else 'are'} switched off: a corpus is "
                    "encoded whole, and so is a sampling prompt",
                    file=sys.stderr,
                    flush=True,
                )
        vocab_size = id_range(tok)
        dtype = dtype_for(vocab_size)
        table = char_table(tok) if spec.kind == "char" else None
        encode_bytes = chunk_bytes
        if spec.file is not None and _cuts_change_ids(tok, files, chunk_bytes):
            # The tokenizer's ids depend on where the text is cut (a prefix space added
            # to every text, a SentencePiece-style whole-text piece): each file is
            # encoded whole (each split's part of it), as the tokenizer would encode it.
            encode_bytes = max(chunk_bytes, 1 + max(f.stat().st_size for f in files))
            print(
                f"ocformer: {tokenizer}: this tokenizer encodes a text cut in two otherwise "
                "than the whole (it adds a prefix space, say), so each file is encoded whole: "
                "memory grows with the largest file",
                file=sys.stderr,
                flush=True,
            )
        tok_file = tmp / TOKENIZER_FILE
        if spec.file is not None:
            shutil.copyfile(spec.file, tok_file)  # byte for byte: its hash is the source's
        else:
            tok_file.write_text(tok.to_str(pretty=True), encoding="utf-8")
        with contextlib.ExitStack() as stack:
            writers = {
                s: _Writer(stack.enter_context(open(tmp / name, "wb")), dtype)
                for s, name in SPLIT_FILES.items()
            }
            sources = {f: hashlib.sha256() for f in files}
            unk_id, unknown = unknown_id(tok), 0
            unk_text = "" if unk_id is None else tok.id_to_token(unk_id) or ""
            with bar("encoding") as b:
                for piece in stream_pieces(files, encode_bytes, b.update):
                    sources[piece.file].update(piece.data)
                    text = piece.text()
                    if table is not None:
                        codes = np.frombuffer(text.encode("utf-32-le"), dtype="<u4")
                        ids = table[np.minimum(codes, len(table) - 1)]
                        if np.any((codes >= len(table)) | (ids < 0)):
                            raise CorpusError(_changed(piece.file))  # not in the alphabet
                    else:
                        try:
                            ids = encode(tok, text)
                        except Exception as e:  # tokenizers raises a bare Exception
                            why = _cannot_encode(piece.file, tokenizer, tok, text, e)
                            raise CorpusError(why) from None
                    writers[piece.split].write(ids)
                    if unk_id is not None:
                        # Less the unknown token's own text in the corpus ("<unk>" in
                        # WikiText), which encodes to it as a known word.
                        unknown += int(np.count_nonzero(ids == unk_id))
                        unknown -= text.count(unk_text) if unk_text else 0
                    b.set_postfix(tokens=sum(w.tokens for w in writers.values()), refresh=False)
            splits = {s: w.finish() for s, w in writers.items()}
        for f in files:
            if f.stat().st_size != sizes[f]:
                raise CorpusError(_changed(f))
        for s, record in splits.items():
            if not record["tokens"]:
                size = f"{total} byte" + ("" if total == 1 else "s")
                raise CorpusError(
                    f"--input: the corpus ({size}) gives no {s} tokens: it is too short "
                    "to split; give more text"
                )
        tokens = sum(r["tokens"] for r in splits.values())
        if unk_id is not None and unknown > UNKNOWN_WARN * tokens:
            print(
                f"ocformer: warning: {tokenizer}: {unknown} of the corpus's {tokens} tokens "
                f"({unknown / tokens:.1%}) are its unknown token "
                f"{unk_text!r}: the tokenizer does not cover this text "
                "well; a model trained on it learns to predict that token (char or bpe:N "
                "are made from the corpus)",
                file=sys.stderr,
                flush=True,
            )
        manifest = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "sources": [
                {"path": str(f.resolve()), "bytes": sizes[f], "sha256": h.hexdigest()}
                for f, h in sources.items()
            ],
            "tokenizer": {
                "kind": spec.kind,
                "spec": tokenizer,
                "file": TOKENIZER_FILE,
                "sha256": sha256_file(tok_file),
                "vocab_size": vocab_size,
            },
            "vocab_size": vocab_size,
            "dtype": dtype.name,
            "byte_order": "little",
            "split_rule": (
                f"validation = the corpus from the first chunk boundary (before a space or "
                f"newline that follows a printable ASCII character, or a file start) at or "
                f"after byte s = ceil({1 - VALIDATION_FRACTION:g} * total bytes) and at "
                f"most max({SPLIT_SEARCH_MIN}, ceil({SPLIT_SEARCH_FRACTION:g} * total "
                "bytes)) bytes after it, or where there is none, from the first character "
                "boundary at or after s; training = the rest"
            ),
            "validation_fraction": VALIDATION_FRACTION,
            "chunk_bytes": chunk_bytes,
            "splits": splits,
        }
        _write_json(tmp / MANIFEST_FILE, manifest)
        _replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def _scratch(out: pathlib.Path) -> pathlib.Path:
    """A new temporary sibling of ``out`` (its parents created), where the dataset is
    built before it is renamed into place; stale ones a killed preparation left go."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CorpusError(f"--out {out}: cannot create {out.parent} ({e.strerror})") from None
    _remove_stale_partials(out)
    try:
        tmp = pathlib.Path(
            tempfile.mkdtemp(
                prefix=f".{out.name}.{os.getpid()}.", suffix=".partial", dir=out.parent
            )
        )
    except OSError as e:
        raise CorpusError(
            f"--out {out}: cannot write in {out.parent} ({e.strerror}); give an --out in "
            "a directory this user can write"
        ) from None
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # mkdtemp's 0700 would outlive the rename
    return tmp


def _changed(file: pathlib.Path) -> str:
    return (
        f"--input {file} changed while it was prepared (its text differs from the first "
        "reading); prepare again once nothing writes to it"
    )


def _cannot_encode(file: pathlib.Path, spec: str, tok: Tokenizer, text: str, err) -> str:
    """The refusal of a corpus ``file`` whose ``text`` the tokenizer ``spec`` cannot
    encode, naming the first character it lacks."""
    c = unencodable(tok, text)
    what = f"its character {c!r} (U+{ord(c):04X})" if c is not None else "its text"
    return (
        f"--input {file}: the tokenizer {spec} cannot encode {what} ({err}); use a "
        "tokenizer that covers the corpus (char or bpe:N, which are made from it, or one "
        "with an unknown token)"
    )


# A temporary sibling of --out: ``.<name>.<pid>.<random>.partial``.
_PARTIAL = re.compile(r"\.(?P<name>.+)\.(?P<pid>\d+)\.[^.]+\.partial")


def _remove_stale_partials(out: pathlib.Path) -> None:
    """Delete the temporary siblings of ``out`` that a killed preparation left (SIGKILL
    leaves no time to remove them); one of a preparation still running is kept."""
    if not out.parent.is_dir():
        return
    for path in out.parent.iterdir():
        m = _PARTIAL.fullmatch(path.name)
        if m and m["name"] == out.name and path.is_dir() and not process_exists(int(m["pid"])):
            shutil.rmtree(path, ignore_errors=True)


def _write_json(path: pathlib.Path, data: dict) -> None:
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    os.replace(partial, path)


def _replace_dir(tmp: pathlib.Path, out: pathlib.Path) -> None:
    """Move the finished ``tmp`` to ``out``; an old ``out`` (empty, or ours) goes whole."""
    check_out(out)  # again: something may have appeared while the corpus was encoded
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.{os.getpid()}.old")
        os.replace(out, old)
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@dataclasses.dataclass(frozen=True)
class Dataset:
    """An opened dataset directory: manifest, tokenizer and memory-mapped splits."""

    path: pathlib.Path
    manifest: dict
    vocab_size: int
    dtype: np.dtype
    splits: dict  # split -> np.memmap of ids
    tokenizer: Tokenizer

    def file(self, split: str) -> pathlib.Path:
        return self.path / SPLIT_FILES[split]


def _manifest(path: pathlib.Path, label: str = "task.path ") -> dict:
    """The manifest of the dataset directory ``path`` (named ``label + path``), with
    every field the readers use checked."""
    if not path.exists():
        raise DataNotFoundError(
            f"{label}{path} does not exist. Prepare a dataset there with `python -m "
            "ocformer.tasks.prepare text --input FILE --tokenizer TOKENIZER --out "
            f"{path}` (TOKENIZER: char, bpe:N, or a tokenizer.json; the experiment's "
            "docstring gives its command)"
        )
    file = path / MANIFEST_FILE
    if not path.is_dir() or not file.is_file():
        raise DatasetError(
            f"{label}{path} is not a dataset directory (no {MANIFEST_FILE}); give a "
            "directory written by `python -m ocformer.tasks.prepare text`"
        )
    try:
        manifest = json.loads(file.read_text(encoding="utf-8"))
        if manifest.get("format") != FORMAT:
            raise ValueError(f"format is {manifest.get('format')!r}, expected {FORMAT!r}")
        for key, expected in (("version", FORMAT_VERSION), ("byte_order", "little")):
            if manifest.get(key) != expected:
                raise ValueError(f"{key} is {manifest.get(key)!r}, expected {expected!r}")
        vocab_size = manifest["vocab_size"]
        if type(vocab_size) is not int or vocab_size < 1:
            raise ValueError(f"vocab_size is {vocab_size!r}, expected a positive integer")
        if manifest["dtype"] not in ("uint16", "uint32"):
            raise ValueError(f"dtype is {manifest['dtype']!r}, expected 'uint16' or 'uint32'")
        records = {"tokenizer": manifest["tokenizer"]} | {
            f"splits.{split}": manifest["splits"][split] for split in SPLIT_FILES
        }
        for name, record in records.items():
            if not isinstance(record.get("sha256"), str):
                raise ValueError(
                    f"{name}.sha256 is {record.get('sha256')!r}, expected a hex digest"
                )
            if name != "tokenizer" and (
                type(record.get("tokens")) is not int or record["tokens"] < 0
            ):
                raise ValueError(f"{name}.tokens is {record.get('tokens')!r}, expected a count")
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise DatasetError(
            f"{file} is not a valid dataset manifest ({type(e).__name__}: {e}); prepare "
            "the dataset again"
        ) from None
    return manifest


def _check_files(path: pathlib.Path, manifest: dict):
    """The tokenizer's SHA-256 and vocabulary size and each .bin file's size against the
    manifest; returns the tokenizer."""
    vocab_size = int(manifest["vocab_size"])
    dtype = np.dtype(manifest["dtype"])
    tok_file = path / TOKENIZER_FILE
    if not tok_file.is_file() or sha256_file(tok_file) != manifest["tokenizer"]["sha256"]:
        raise DatasetError(
            f"{tok_file} is missing or does not match the SHA-256 in {path / MANIFEST_FILE}; "
            "the dataset is corrupted: prepare it again"
        )
    tokenizer = load_tokenizer(tok_file)
    if (ids := id_range(tokenizer)) != vocab_size:
        raise DatasetError(
            f"{tok_file} has ids 0..{ids - 1}, the manifest says "
            f"vocab_size={vocab_size}; prepare the dataset again"
        )
    for split, name in SPLIT_FILES.items():
        file, tokens = path / name, int(manifest["splits"][split]["tokens"])
        expected = tokens * dtype.itemsize
        actual = file.stat().st_size if file.is_file() else None
        if actual != expected:
            raise DatasetError(
                f"{file} has {'no file' if actual is None else f'{actual} bytes'}, the "
                f"manifest says {expected} bytes ({tokens} {dtype.name} ids): the file is "
                "truncated or corrupted; prepare the dataset again"
            )
    return tokenizer


def _check_contents(path: pathlib.Path, manifest: dict) -> None:
    """Every .bin file's SHA-256 against the manifest and every id below the vocabulary
    size, streamed."""
    vocab_size = int(manifest["vocab_size"])
    dtype = np.dtype(manifest["dtype"]).newbyteorder("<")
    for split, name in SPLIT_FILES.items():
        file, record = path / name, manifest["splits"][split]
        h, offset = hashlib.sha256(), 0
        with open(file, "rb") as f:
            while block := f.read(1 << 22):  # a multiple of every itemsize
                h.update(block)
                ids = np.frombuffer(block, dtype)
                if ids.size and int(ids.max()) >= vocab_size:
                    at = int(np.argmax(ids >= vocab_size))
                    raise DatasetError(
                        f"{file}: token {offset + at} is id {int(ids[at])}, not below the "
                        f"vocabulary size {vocab_size}: the file is corrupted; prepare the "
                        "dataset again"
                    )
                offset += ids.size
        if h.hexdigest() != record["sha256"]:
            raise DatasetError(
                f"{file} has SHA-256 {h.hexdigest()}, the manifest says {record['sha256']}: "
                "the file is corrupted; prepare the dataset again"
            )


def open_dataset(path: str | os.PathLike) -> Dataset:
    """Open a dataset directory, checking it against its manifest.

    Always checked: the manifest, the tokenizer's SHA-256 and vocabulary size, and the
    size of each .bin file (a truncated or extended file). When the .bin files total at
    most ``FULL_CHECK_BYTES``, also their SHA-256 and that every id is below the
    vocabulary size; larger ones get that from ``verify_dataset`` (``prepare verify DIR``),
    and the task checks the ids of every window it reads.

    Raises:
        DataNotFoundError: ``path`` does not exist.
        DatasetError: not a dataset directory, or a file that does not match the manifest.
    """
    path = pathlib.Path(path)
    with _readable():
        manifest = _manifest(path)
        tokenizer = _check_files(path, manifest)
        dtype = np.dtype(manifest["dtype"]).newbyteorder("<")
        if sum(int(r["tokens"]) for r in manifest["splits"].values()) * dtype.itemsize <= (
            FULL_CHECK_BYTES
        ):
            _check_contents(path, manifest)
        splits = {s: np.memmap(path / n, dtype=dtype, mode="r") for s, n in SPLIT_FILES.items()}
    return Dataset(path, manifest, int(manifest["vocab_size"]), dtype, splits, tokenizer)


def dataset_identity(path: str | os.PathLike) -> dict | None:
    """What a run records of the dataset it trains on: the directory and the SHA-256 of
    its tokenizer and of each split, as its manifest states them (opening the dataset
    checks the files against the manifest). None if there is no readable manifest
    (opening the dataset reports that)."""
    path = pathlib.Path(path)
    try:
        with _readable():
            manifest = _manifest(path)
    except (DataNotFoundError, DatasetError):
        return None
    splits = manifest["splits"]
    return {
        "path": str(path.resolve()),
        "tokenizer_sha256": manifest["tokenizer"]["sha256"],
        **{f"{split}_sha256": splits[split]["sha256"] for split in SPLIT_FILES},
    }


def verify_dataset(path: str | os.PathLike) -> dict:
    """The full check of a dataset directory: ``open_dataset``'s checks, plus the SHA-256
    of each .bin file and the range of every id, whatever the size. Returns the manifest.

    Raises:
        DataNotFoundError, DatasetError: as ``open_dataset``.
    """
    path = pathlib.Path(path)
    with _readable():
        manifest = _manifest(path, label="")
        _check_files(path, manifest)
        _check_contents(path, manifest)
    return manifest


@contextlib.contextmanager
def _readable() -> Iterator[None]:
    """A dataset file that cannot be read (its permissions, a failing disk) raises
    ``DatasetError`` naming it, as a corrupted one does."""
    try:
        yield
    except DataNotFoundError:
        raise
    except OSError as e:
        fix = (
            "give this user read access to the dataset directory"
            if isinstance(e, PermissionError)
            else "check the disk or file system it is on"
        )
        raise DatasetError(
            f"{e.filename or 'a dataset file'} cannot be read ({e.strerror or e}); {fix}"
        ) from None
