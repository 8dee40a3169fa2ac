"""A researcher's own corpus: ``prepare text`` writes exactly the ids its tokenizer
gives, in the layout it documents, whatever the chunk size; the ``tokens`` task reads
pure, contiguous windows from the right split; a short training run samples text."""

import hashlib
import json
import os
import random

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from ocformer import train as cli
from ocformer.tasks import Tokens, make_task, prepare_text
from ocformer.tasks._dataset import dtype_for
from ocformer.tasks.prepare import main as prepare_main
from ocformer.training import ExitCode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOKE = os.path.join(ROOT, "experiments", "smoke.py")
WORDS = ["alpha", "beta", "gamma", "délta", "ε", "zeta\n", "eta,", "θ.", "\n\n", "  "]


def _text(n_words: int, seed: int, words=WORDS) -> str:
    r = random.Random(seed)
    return " ".join(r.choice(words) for _ in range(n_words))


def _write(path, text: str):
    path.write_bytes(text.encode("utf-8"))
    return path


def _ids(directory, name, dtype="<u2"):
    return np.fromfile(directory / name, dtype=dtype)


def _reference_ids(directory, text: str) -> list[int]:
    """The ids of ``text`` from the stored tokenizer.json, loaded by the tokenizers
    library itself (not ocformer's fast path)."""
    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    return tok.encode(text, add_special_tokens=False).ids


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Two files, a.txt with exactly 9/10 of the bytes (so validation is exactly b.txt);
    b.txt's letters are capitals, which a.txt does not have."""
    root = tmp_path_factory.mktemp("corpus")
    b = _text(40, 1, ["XYZ", "QRS\n", "WVU"])
    size = 9 * len(b.encode())
    a = _text(size, 0).encode()[:size].decode("utf-8", errors="ignore")
    a += "." * (size - len(a.encode()))  # pad with one-byte characters to the exact size
    _write(root / "a.txt", a)
    _write(root / "b.txt", b)
    assert (root / "a.txt").stat().st_size == 9 * (root / "b.txt").stat().st_size
    return root, a, b


def test_char_ids_are_the_tokenizers_and_split_by_file(corpus, tmp_path):
    root, a, b = corpus
    out = tmp_path / "ds"
    manifest = prepare_text([str(root / "a.txt"), str(root / "b.txt")], "char", out, progress=False)
    symbols = sorted(set(a + b))
    assert manifest["vocab_size"] == len(symbols) and manifest["dtype"] == "uint16"
    train, val = _ids(out, "train.bin"), _ids(out, "val.bin")
    # b.txt holds 1/10 of the bytes, so the split is exactly at its first byte.
    assert train.tolist() == _reference_ids(out, a)
    assert val.tolist() == _reference_ids(out, b)
    assert train.tolist() == [symbols.index(c) for c in a]  # ids in code-point order
    task = Tokens(out, seq_len=4)
    assert task.decode(task.encode(a + b)) == a + b
    assert task.decode(train) == a and task.decode(val) == b
    assert manifest["splits"]["train"]["tokens"] == len(a)


def test_bpe_round_trip_and_stored_ids(corpus, tmp_path):
    root, a, b = corpus
    out = tmp_path / "ds"
    manifest = prepare_text([str(root / "*.txt")], "bpe:300", out, progress=False)
    assert 256 < manifest["vocab_size"] <= 300 and manifest["dtype"] == "uint16"
    assert manifest["tokenizer"]["kind"] == "bpe"
    train, val = _ids(out, "train.bin"), _ids(out, "val.bin")
    assert train.tolist() == _reference_ids(out, a) and val.tolist() == _reference_ids(out, b)
    assert len(train) < len(a.encode())  # merges were learnt and used
    task = Tokens(out, seq_len=4)
    assert task.vocab_size == manifest["vocab_size"]
    for text in (a, b, "unseen: Ω ∑ 😀 \t\r\n"):
        assert task.decode(task.encode(text)) == text


def test_manifest_hashes_and_layout(corpus, tmp_path):
    root, _, _ = corpus
    out = tmp_path / "ds"
    manifest = prepare_text(
        [str(root / "a.txt"), str(root / "b.txt")], "bpe:260", out, progress=False
    )
    on_disk = json.loads((out / "manifest.json").read_text())
    assert on_disk == manifest
    assert sorted(p.name for p in out.iterdir()) == [
        "manifest.json", "tokenizer.json", "train.bin", "val.bin",
    ]  # fmt: skip

    def sha(path):
        return hashlib.sha256(path.read_bytes()).hexdigest()

    for source, name in zip(manifest["sources"], ["a.txt", "b.txt"], strict=True):
        assert source["sha256"] == sha(root / name) and source["path"] == str(root / name)
    assert manifest["tokenizer"]["sha256"] == sha(out / "tokenizer.json")
    for split, name in [("train", "train.bin"), ("validation", "val.bin")]:
        record = manifest["splits"][split]
        assert record["sha256"] == sha(out / name)
        assert record["tokens"] * 2 == (out / name).stat().st_size == record["bytes"]
    assert not [p for p in tmp_path.iterdir() if p.name != "ds"]  # no temporary left
    assert prepare_main(["verify", str(out)]) == 0


def test_dtype_boundary_and_a_transformers_tokenizer_of_over_65536_symbols(tmp_path):
    assert dtype_for(1 << 16) == np.dtype("<u2") and dtype_for((1 << 16) + 1) == np.dtype("<u4")
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, **{f"w{i}": i + 1 for i in range(70_000)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(
        tmp_path / "checkpoint"
    )
    r = np.random.default_rng(0)
    text = " ".join(f"w{i}" for i in r.integers(0, 70_000, size=2000)) + " w69999 w0"
    corpus = _write(tmp_path / "c.txt", text)
    out = tmp_path / "ds"
    manifest = prepare_text([str(corpus)], str(tmp_path / "checkpoint"), out, progress=False)
    assert manifest["dtype"] == "uint32" and manifest["vocab_size"] == 70_001
    assert manifest["tokenizer"]["kind"] == "file"
    assert (out / "tokenizer.json").read_bytes() == (
        tmp_path / "checkpoint" / "tokenizer.json"
    ).read_bytes()
    ids = np.concatenate([_ids(out, "train.bin", "<u4"), _ids(out, "val.bin", "<u4")])
    assert ids.tolist() == _reference_ids(out, text)
    assert ids.max() == 70_000  # w69999: an id above 65535 survives the round trip


def test_a_tokenizer_whose_ids_skip_some_gives_a_dataset_that_opens(tmp_path):
    """The vocabulary is the id range (largest id + 1), not the number of symbols: a
    dataset of a tokenizer with a gap in its ids verifies and trains."""
    from ocformer.tasks import verify_dataset

    vocab = {c: i for i, c in enumerate("abc ")}
    vocab["z"] = 9  # ids 4..8 unused
    tok = Tokenizer(models.WordLevel(vocab, unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.save(str(tmp_path / "tok.json"))
    corpus = _write(tmp_path / "c.txt", "abc zab " * 300)
    manifest = prepare_text([str(corpus)], str(tmp_path / "tok.json"), tmp_path / "ds",
                            progress=False)  # fmt: skip
    assert manifest["vocab_size"] == 10
    assert verify_dataset(tmp_path / "ds")["vocab_size"] == 10
    assert make_task("tokens", seq_len=8, path=str(tmp_path / "ds")).vocab_size == 10


def test_an_interrupted_preparation_leaves_nothing(tmp_path, corpus, capsys, monkeypatch):
    """SIGTERM unwinds as Ctrl-C does (exit 143, the temporary directory removed), and a
    temporary directory that a SIGKILL left is removed by the next preparation, while
    one of a preparation still running (its process alive) is kept."""
    import signal

    from ocformer.tasks import _dataset

    root, _, _ = corpus
    out = tmp_path / "ds"
    stale = tmp_path / f".ds.{2**22 + 12345}.abc123.partial"  # no such process
    running = tmp_path / f".ds.{os.getpid()}.def456.partial"
    stale.mkdir()
    running.mkdir()
    encode, calls = _dataset.encode, []

    def encode_then_terminate(tok, text):  # SIGTERM while the third chunk is encoded
        calls.append(1)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return encode(tok, text)

    monkeypatch.setattr(_dataset, "encode", encode_then_terminate)
    argv = ["text", "--input", str(root / "a.txt"), "--tokenizer", "bpe:300", "--out", str(out)]
    code = prepare_main([*argv, "--chunk-bytes", "256", "--no-progress"])
    assert code == 143 and len(calls) == 3
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler is undone
    monkeypatch.setattr(_dataset, "encode", encode)
    assert "stopped by SIGTERM" in capsys.readouterr().err
    # The stale directory went when this preparation started; its own when it stopped.
    assert [p.name for p in tmp_path.iterdir()] == [running.name]
    assert prepare_main([*argv, "--no-progress"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["ds", running.name])


def test_an_out_that_cannot_be_written_is_refused_before_any_work(
    tmp_path, corpus, capsys, monkeypatch
):
    """A directory where --out's temporary sibling cannot be made (read-only, or an
    immutable one, which even root cannot write) is refused at once with exit 2 and
    one line, before the tokenizer is trained; it was a traceback after the BPE."""
    import errno

    from ocformer.tasks import _dataset

    def no_directory(**kwargs):
        raise PermissionError(errno.EPERM, "Operation not permitted", kwargs["dir"])

    trained = []
    monkeypatch.setattr(_dataset.tempfile, "mkdtemp", no_directory)
    monkeypatch.setattr(_dataset, "bpe_tokenizer", lambda *a: trained.append(1))
    root, _, _ = corpus
    out = tmp_path / "ro" / "ds"
    argv = ["text", "--input", str(root / "a.txt"), "--tokenizer", "bpe:300", "--out", str(out)]
    assert prepare_main([*argv, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"--out {out}: cannot write in {out.parent} (Operation not permitted)" in err
    assert "Traceback" not in err and not trained and not out.exists()


@pytest.mark.parametrize("tokenizer", ["char", "bpe:280"])
def test_small_chunks_give_the_same_files(tmp_path, tokenizer):
    """Streaming: chunks of 64 bytes (a corpus of ~50 KB, ~800 chunks) give byte for
    byte the files of one chunk."""
    text = _text(8000, 3)
    corpus = _write(tmp_path / "c.txt", text)
    whole = prepare_text([str(corpus)], tokenizer, tmp_path / "one", progress=False)
    small = prepare_text(
        [str(corpus)], tokenizer, tmp_path / "many", chunk_bytes=64, progress=False
    )
    for split in ("train", "validation"):
        assert small["splits"][split]["sha256"] == whole["splits"][split]["sha256"]
        assert small["splits"][split]["tokens"] == whole["splits"][split]["tokens"] > 0
    assert small["tokenizer"]["sha256"] == whole["tokenizer"]["sha256"]
    ids = np.concatenate([_ids(tmp_path / "many", n) for n in ("train.bin", "val.bin")])
    assert ids.tolist() == _reference_ids(tmp_path / "many", text)


@pytest.mark.parametrize("prefix_space, title", [(True, False), (False, False), (True, True)])
def test_a_tokenizer_that_adds_a_prefix_space_encodes_each_file_whole(
    tmp_path, capsys, prefix_space, title
):
    """A byte-level BPE whose pre-tokenizer adds a space before a text that does not
    start with one would give a stray space token at each chunk that starts at a
    newline: the preparation finds that its ids depend on the cuts, says so, and
    encodes each file whole; the ids are the tokenizer's own of each file. Without the
    prefix space, no word, and the same ids by chunks. A first file too short to be cut
    (a title) does not hide it: the tokenizer is tried on the first file that is cut."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    # Prose lines over more than the 64 KiB the preparation tries the tokenizer on,
    # whose first cuts come before spaces (where GPT-2's prefix space changes nothing);
    # validation is exactly b.txt.
    r = random.Random(5)

    def prose(size: int) -> str:
        lines, total = [], 0
        while total < size:
            line = " ".join(r.choice(["alpha", "beta", "gamma", "delta,"]) for _ in range(9))
            lines.append(line + ".\n")
            total += len(lines[-1])
        return "".join(lines)[:size]

    b = prose(12000)
    a = prose(9 * len(b))
    root = tmp_path / "corpus"
    root.mkdir()
    _write(root / "a.txt", a)
    _write(root / "b.txt", b)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=prefix_space)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator([a, b], trainer)
    (tmp_path / "tok").mkdir()
    tok.save(str(tmp_path / "tok" / "tokenizer.json"))
    files = [str(root / "a.txt"), str(root / "b.txt")]
    train = _reference_ids(tmp_path / "tok", a)
    if title:  # 5 bytes: validation is still exactly b.txt
        files.insert(0, str(_write(root / "title.txt", "Title")))
        train = _reference_ids(tmp_path / "tok", "Title") + train
    capsys.readouterr()
    prepare_text(files, str(tmp_path / "tok"), tmp_path / "ds", chunk_bytes=4096, progress=False)
    said = "so each file is encoded whole" in capsys.readouterr().err
    assert said == prefix_space
    assert _ids(tmp_path / "ds", "train.bin").tolist() == train
    assert _ids(tmp_path / "ds", "val.bin").tolist() == _reference_ids(tmp_path / "ds", b)


def test_a_tokenizer_saved_with_truncation_or_padding_encodes_the_whole_corpus(tmp_path, capsys):
    """A tokenizer.json saved with truncation (128 ids) or padding (to 8192) kept 128
    ids of each split, or filled validation with its pad id: both are switched off,
    stderr says so, and the stored ids, and a sampling prompt's, are the tokenizer's
    own without them."""
    from tokenizers import decoders, trainers

    text = _text(4000, 11, ["cat", "sat", "on", "the", "mat\n", "dog,"])
    corpus = _write(tmp_path / "c.txt", text)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([text], trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<pad>"], show_progress=False,
    ))  # fmt: skip
    tok.save(str(tmp_path / "plain.json"))
    plain = Tokenizer.from_file(str(tmp_path / "plain.json"))
    prepare_text([str(corpus)], str(tmp_path / "plain.json"), tmp_path / "ref", progress=False)
    assert capsys.readouterr().err == ""
    ref = {n: _ids(tmp_path / "ref", n) for n in ("train.bin", "val.bin")}
    assert min(len(v) for v in ref.values()) > 300
    assert ref["train.bin"].tolist() + ref["val.bin"].tolist() == (
        plain.encode(text, add_special_tokens=False).ids
    )
    variants = {
        "trunc": (lambda t: t.enable_truncation(max_length=128), "truncation to 128 ids is"),
        "pad": (
            lambda t: t.enable_padding(length=8192, pad_id=0, pad_token="<pad>"),
            "padding to 8192 ids is",
        ),
        "both": (
            lambda t: (t.enable_truncation(max_length=64), t.enable_padding()),
            "truncation to 64 ids and padding are",
        ),
    }
    prompt = " ".join(["the cat sat on the mat"] * 40)
    for name, (switch_on, said) in variants.items():
        saved = Tokenizer.from_file(str(tmp_path / "plain.json"))
        switch_on(saved)
        saved.save(str(tmp_path / f"{name}.json"))
        out = tmp_path / name
        prepare_text([str(corpus)], str(tmp_path / f"{name}.json"), out, progress=False)
        assert f"its {said} switched off: a corpus is encoded whole" in capsys.readouterr().err
        for file, ids in ref.items():
            assert np.array_equal(_ids(out, file), ids), (name, file)
        task = Tokens(out, seq_len=8)
        assert task.encode(prompt).tolist() == plain.encode(prompt).ids


def test_text_without_spaces_splits_at_the_characters_of_the_split_byte(tmp_path):
    """One line of CJK text (no space or newline after 90 % of it) in fewer chunks than
    force a cut: validation starts at the first character boundary at or after the
    split byte, for any chunk size; missing parents of --out are created."""
    text = "".join(chr(0x4E00 + (i * 7919) % 500) for i in range(3000))  # 3 bytes each
    corpus = _write(tmp_path / "zh.txt", text)
    split_byte = -(-len(text.encode()) * 9 // 10)
    for chunk in (1 << 20, 1024):
        out = tmp_path / "new" / "parents" / str(chunk)
        manifest = prepare_text([str(corpus)], "char", out, chunk_bytes=chunk, progress=False)
        split = manifest["splits"]
        assert split["train"]["tokens"] == -(-split_byte // 3) == 2700
        assert split["validation"]["tokens"] == 300
        task = Tokens(out, seq_len=4)
        assert task.decode(_ids(out, "val.bin")) == text[2700:]


def _split_at(data: bytes) -> int:
    """The documented split of a one-file corpus, found independently: the first space
    or newline after a printable ASCII character at or after byte ceil(0.9 * size) and
    at most max(4096, ceil(0.01 * size)) bytes after it, else the first character
    boundary there."""
    at = -(-len(data) * 9 // 10)
    for i in range(at, min(len(data), at + max(4096, -(-len(data) // 100)) + 1)):
        if data[i] in b" \n" and 0x21 <= data[i - 1] <= 0x7E:
            return i
    while at < len(data) and data[at] & 0xC0 == 0x80:
        at += 1
    return at


def test_the_split_does_not_depend_on_the_chunk_size(tmp_path):
    """Validation starts at the documented boundary for chunks of 1, 2, 7, 64 bytes and
    the default, even when the split byte falls in a word longer than the chunks that
    force a cut (8 of them); in a file without a boundary after the split byte that is
    not the last, validation is the next file."""
    head = _text(1500, 4).encode()
    tail = b" " + _text(150, 5).encode()
    # A 40-byte word holding the split byte: 0.9 * (head + 40 + tail) ~ head + 5.
    pad = (len(head) + 5) * 10 // 9 - len(head) - 40 - len(tail)
    data = head + b"x" * 40 + tail + b"." * pad
    assert len(head) < -(-len(data) * 9 // 10) < len(head) + 35
    one = tmp_path / "one.txt"
    one.write_bytes(data)
    split = _split_at(data)
    assert split == data.index(b" ", len(head) + 1)  # after the long word, not in it
    # a.txt: 9/10 of the bytes and CJK text (no boundary) after its split byte; b.txt.
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_bytes((_text(300, 6) + "日本語のテキスト" * 20).encode())
    b.write_bytes(b"tail of it " * (a.stat().st_size // 99))
    assert -(-(a.stat().st_size + b.stat().st_size) * 9 // 10) < a.stat().st_size
    results = {}
    for chunk in (1, 2, 7, 64, 1 << 20):
        for name, inputs in (("one", [one]), ("two", [a, b])):
            out = tmp_path / f"{name}{chunk}"
            manifest = prepare_text([str(f) for f in inputs], "char", out, chunk_bytes=chunk,
                                    progress=False)  # fmt: skip
            splits = manifest["splits"]
            results.setdefault(name, set()).add(
                tuple((splits[s]["tokens"], splits[s]["sha256"]) for s in splits)
            )
            task = Tokens(out, seq_len=4)
            train, val = (task.decode(_ids(out, n)) for n in ("train.bin", "val.bin"))
            if name == "one":
                assert (train, val) == (data[:split].decode(), data[split:].decode())
            else:
                assert (train, val) == (a.read_text(), b.read_text())
    assert [len(r) for r in results.values()] == [1, 1]  # one outcome per corpus


def _two_characters(data: bytes) -> bool:
    try:
        return len(data.decode()) == 2 and "\n" not in data.decode()
    except UnicodeDecodeError:
        return False


def test_a_boundary_far_past_the_split_byte_does_not_shrink_validation(tmp_path):
    """Japanese without spaces and one ASCII line at its end (300 KB): validation starts
    at the split byte's character, not at that line, which lies beyond the 1 % (at least
    4 KiB) searched; a boundary within it is still taken, and so is the start of a next
    file within it, while one beyond it is not."""
    line = "吾輩は猫である。名前はまだ無い。どこで生れたかとんと見当がつかぬ。\n"
    text = line * 3000 + "(c) Natsume Soseki 1905\n"
    data = text.encode()
    corpus = _write(tmp_path / "novel.txt", text)
    at = -(-len(data) * 9 // 10)
    assert len(data) - 24 - at > max(4096, -(-len(data) // 100))  # the line is too far
    split = _split_at(data)
    assert split - at < 3 and data[split] & 0xC0 != 0x80
    manifest = prepare_text([str(corpus)], "char", tmp_path / "ds", progress=False)
    chars = len(data[:split].decode())
    assert manifest["splits"]["train"]["tokens"] == chars
    assert manifest["splits"]["validation"]["tokens"] == len(text) - chars
    assert len(text) - chars > 0.09 * len(text)
    # A boundary about 4000 bytes past the split byte, inside the window: taken (two
    # characters there become "xy zab", as many bytes).
    q = at + 3990
    while not _two_characters(data[q : q + 6]):
        q += 1
    near = data[:q] + b"xy zab" + data[q + 6 :]
    assert _split_at(near) == q + 2 < at + 4096
    corpus.write_bytes(near)
    manifest = prepare_text([str(corpus)], "char", tmp_path / "ds", progress=False)
    assert manifest["splits"]["validation"]["tokens"] == len(near[q + 2 :].decode())
    # Two files: a next file starting within the window is validation; beyond it, not.
    a = _write(tmp_path / "a.txt", "日本" * 10000)  # 60000 bytes, no boundary
    for b_bytes, starts_next in ((3336, True), (1112, False)):
        b = _write(tmp_path / "b.txt", "x y " * (b_bytes // 4))
        s = -(-(60000 + b_bytes) * 9 // 10)
        assert (60000 - s <= 4096) == starts_next and s < 60000
        manifest = prepare_text([str(a), str(b)], "char", tmp_path / "ds2", progress=False)
        train = manifest["splits"]["train"]["tokens"]
        assert train == (20000 if starts_next else -(-s // 3))


@pytest.mark.parametrize("chunk", [1, 7, 1024, 1 << 20])
def test_text_without_spaces_is_cut_between_characters(tmp_path, chunk):
    """Japanese without spaces: every cut, the split included, falls between characters
    at any chunk size (a cut in the middle of one was refused as "not UTF-8"), and the
    ids are those of the whole file. Chunks of 7 bytes on 66 KB, as 1 MiB on 15 MB."""
    text = "日本語のテキストです。" * 2000 + "\n"
    corpus = _write(tmp_path / "ja.txt", text)
    split = _split_at(text.encode())
    assert split % 3 == 0 and split // 3 == 19801  # the split byte 59401 is in a character
    manifest = prepare_text([str(corpus)], "char", tmp_path / "ds", chunk_bytes=chunk,
                            progress=False)  # fmt: skip
    assert manifest["splits"]["train"]["tokens"] == 19801
    assert manifest["splits"]["validation"]["tokens"] == len(text) - 19801
    ids = np.concatenate([_ids(tmp_path / "ds", n) for n in ("train.bin", "val.bin")])
    assert ids.tolist() == _reference_ids(tmp_path / "ds", text)


def test_a_file_named_with_glob_characters_is_that_file(tmp_path, capsys):
    """An --input naming an existing file is that file, "[v2]" and all; a pattern that
    matches nothing, and names no file, is refused with how to write the characters
    literally."""
    import glob

    _write(tmp_path / "notes [v2].txt", _text(2000, 7))
    _write(tmp_path / "notes 2.txt", _text(2000, 8))
    args = ["--tokenizer", "char", "--no-progress"]
    for given, expected in (
        ("notes [v2].txt", "notes [v2].txt"),  # the file, not the glob (matching "notes v.txt")
        ("notes [[]v2].txt", "notes [v2].txt"),  # escaped: the glob of that file
        ("notes [0-9].txt", "notes 2.txt"),  # no such file: a glob, as before
    ):
        out = tmp_path / "ds"
        assert prepare_main(["text", "--input", str(tmp_path / given), "--out", str(out),
                             *args]) == 0  # fmt: skip
        sources = json.loads((out / "manifest.json").read_text())["sources"]
        assert [s["path"] for s in sources] == [str(tmp_path / expected)]
    capsys.readouterr()
    missing = str(tmp_path / "notes [v3].txt")
    assert prepare_main(["text", "--input", missing, "--out", str(tmp_path / "no"), *args]) == 2
    err = capsys.readouterr().err
    assert f"--input {missing!r} matches no file, and no file has that name" in err
    assert "write [*] [?] [[]" in err and f"glob.escape gives {glob.escape(missing)!r}" in err
    assert glob.escape(missing).endswith("notes [[]v3].txt")


def test_a_short_corpus_is_refused_or_warned_of(tmp_path, capsys):
    """A corpus too short to split names its size in proper English; a split too short
    for long contexts is named at preparation with the longest task.seq_len it holds,
    which is the one training then accepts."""

    def prepare(text: str) -> tuple[int, str]:
        corpus = _write(tmp_path / "c.txt", text)
        argv = ["text", "--input", str(corpus), "--tokenizer", "char", "--no-progress"]
        code = prepare_main([*argv, "--out", str(tmp_path / "ds")])
        return code, capsys.readouterr().err

    for text, size in (("a", "1 byte"), ("ab", "2 bytes")):
        code, err = prepare(text)
        assert code == 2 and f"the corpus ({size}) gives no validation tokens" in err
    code, err = prepare("aaaaaaaaab")  # validation: "b"
    assert code == 0 and "warning: val.bin holds 1 token, fewer than any training window" in err
    # 480 bytes: validation starts at the space after "the" at byte 432, 45 characters.
    code, err = prepare("the cat sat on the mat. " * 20)
    assert code == 0
    assert (
        "warning: val.bin holds 45 tokens: training on this dataset needs task.seq_len <= 44" in err
    )
    Tokens(tmp_path / "ds", seq_len=44)
    with pytest.raises(ValueError, match=r"val\.bin holds 45 tokens, fewer than seq_len \+ 1 = 46"):
        Tokens(tmp_path / "ds", seq_len=45)
    code, err = prepare(_text(3000, 9))  # over 1024 tokens in each split: nothing to say
    assert code == 0 and err == ""


@pytest.fixture(scope="module")
def task(corpus, tmp_path_factory):
    root, _, _ = corpus
    out = tmp_path_factory.mktemp("ds") / "ds"
    prepare_text([str(root / "a.txt"), str(root / "b.txt")], "char", out, progress=False)
    return make_task("tokens", path=str(out), seq_len=6)


def _contains(data: np.ndarray, window: np.ndarray) -> bool:
    hits = np.flatnonzero(data[: len(data) - len(window) + 1] == window[0])
    return any(np.array_equal(data[h : h + len(window)], window) for h in hits)


def test_batches_are_pure_and_contiguous_windows_of_their_split(task):
    path = task.dataset.path
    train, val = _ids(path, "train.bin"), _ids(path, "val.bin")
    one = task.batch("train", 3, 16, seed=7)
    assert one["inputs"].dtype == np.int32 and one["inputs"].shape == (16, 6)
    again = task.batch("train", 3, 16, seed=7)
    assert all(np.array_equal(one[k], again[k]) for k in one)
    assert not np.array_equal(one["inputs"], task.batch("train", 4, 16, seed=7)["inputs"])
    assert not np.array_equal(one["inputs"], task.batch("train", 3, 16, seed=8)["inputs"])
    np.testing.assert_array_equal(one["inputs"][:, 1:], one["targets"][:, :-1])
    for split, data in (("train", train), ("validation", val)):
        batch = task.batch(split, 0, 32, seed=0)
        for x, y in zip(batch["inputs"], batch["targets"], strict=True):
            assert _contains(data, np.append(x, y[-1]))
    # Validation windows hold capitals (b.txt's), training windows none.
    capitals = set(task.encode("QRSUVWXYZ").tolist())
    val_ids = np.concatenate([b["inputs"] for b in task.eval_batches(8, 4)]).ravel()
    train_ids = np.concatenate([task.batch("train", i, 8, 0)["inputs"] for i in range(4)])
    assert capitals & set(val_ids.tolist()) and not capitals & set(train_ids.ravel().tolist())
    assert not capitals & set(train.tolist())


def test_rows_are_the_rows_of_the_whole_batch(task):
    whole = task.batch("train", 5, 8, seed=1)
    for rows in (slice(0, 4), slice(4, 8), slice(2, 3)):
        part = task.batch_rows("train", 5, 8, 1, rows)
        assert all(np.array_equal(part[k], whole[k][rows]) for k in whole)


@pytest.mark.slow
def test_train_on_a_prepared_corpus_samples_text(corpus, tmp_path, capsys):
    root, _, _ = corpus
    data = tmp_path / "data"
    vocab = prepare_text([str(root / "*.txt")], "bpe:300", data, progress=False)["vocab_size"]
    argv = [
        "--config", SMOKE, "--workdir", str(tmp_path / "run"),
        "--set", "task.name=tokens", "--set", f"task.path={data}", "--set", "task.seq_len=8",
        "--set", "task.batch_size=4", "--set", "task.eval_batch_size=4",
        "--set", "task.eval_batches=1", "--set", "train.steps=2", "--set", "train.eval_every=2",
        "--set", "train.checkpoint_every=2", "--set", "train.sample_tokens=12",
        "--set", "train.sample_prompt=alpha", "--set", "train.progress=false",
    ]  # fmt: skip
    assert cli.main(argv) == ExitCode.OK
    samples = (tmp_path / "run" / "samples.txt").read_text(encoding="utf-8")
    assert samples.startswith("=== step 2 ===\nalpha")
    assert len(samples.split("\n", 1)[1]) > len("alpha")  # 12 ids decoded after the prompt
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    metrics = json.loads(lines[-1])
    # Two steps from initialisation: the cross-entropy is about ln(vocabulary) (5.7 for
    # the manifest's 300 symbols; the config's vocab_size of 8 would give 2.1).
    assert metrics["step"] == 2
    assert np.log(vocab) - 1 < metrics["val_loss"] < np.log(vocab) + 2


def test_a_run_pins_its_dataset(corpus, tmp_path, capsys):
    """run.json records the SHA-256 of the dataset's files; a dataset prepared again at
    the same task.path (same vocabulary, other text) is named on resume (exit 2, unless
    --allow-config-change) and refused by ocformer.evaluate, instead of silently giving
    the numbers of other data."""
    from ocformer import evaluate as evaluate_cli
    from ocformer.training import load_run

    root, a, b = corpus
    data = tmp_path / "data"
    first = prepare_text([str(root / "a.txt"), str(root / "b.txt")], "char", data, progress=False)
    run = tmp_path / "run"
    argv = [
        "--config", SMOKE, "--workdir", str(run), "--set", "task.name=tokens",
        "--set", f"task.path={data}", "--set", "task.seq_len=8", "--set", "task.batch_size=4",
        "--set", "task.eval_batch_size=4", "--set", "task.eval_batches=1",
        "--set", "train.eval_every=1", "--set", "train.progress=false",
    ]  # fmt: skip
    assert cli.main([*argv, "--set", "train.steps=1"]) == ExitCode.OK
    recorded = json.loads((run / "run.json").read_text())["dataset"]
    assert recorded == {
        "path": str(data.resolve()),
        "tokenizer_sha256": first["tokenizer"]["sha256"],
        "train_sha256": first["splits"]["train"]["sha256"],
        "validation_sha256": first["splits"]["validation"]["sha256"],
    }
    # The same files in another order: the same symbols, other ids.
    again = prepare_text([str(root / "b.txt"), str(root / "a.txt")], "char", data, progress=False)
    assert again["tokenizer"]["sha256"] == first["tokenizer"]["sha256"]
    capsys.readouterr()
    assert cli.main([*argv, "--set", "train.steps=2"]) == ExitCode.USAGE
    err = capsys.readouterr().err
    then, now = first["splits"]["train"]["sha256"][:12], again["splits"]["train"]["sha256"][:12]
    assert f"task.path dataset: 'train.bin {then}," in err and f"'train.bin {now}," in err
    assert "prepared again since the run started" in err
    assert evaluate_cli.main([str(run)]) == ExitCode.USAGE
    assert "was trained on other data than the dataset directory" in capsys.readouterr().err
    # Allowed: the run goes on, on the new data, which it records.
    assert cli.main([*argv, "--set", "train.steps=2", "--allow-config-change"]) == ExitCode.OK
    assert (
        json.loads((run / "run.json").read_text())["dataset"]["train_sha256"]
        == (again["splits"]["train"]["sha256"])
    )
    assert evaluate_cli.main([str(run), "--json", str(tmp_path / "before.json")]) == ExitCode.OK
    # Gone from its path: every reader of the run says which dataset to put back
    # (exit 2), rather than advise preparing a new one there.
    from ocformer import export as export_cli

    data.rename(tmp_path / "moved")
    capsys.readouterr()
    gone = f"{run} was trained on the dataset directory at task.path {data.resolve()}"
    put_back = f"put back the dataset the run trained on (SHA-256 prefixes: train.bin {now},"
    for main, args in [
        (cli.main, [*argv, "--set", "train.steps=2"]),
        (evaluate_cli.main, [str(run)]),
        (export_cli.main, [str(run), "--to", str(tmp_path / "hf")]),
    ]:
        code, err = main(args), capsys.readouterr().err
        assert code == ExitCode.USAGE and gone in err and put_back in err, err
        assert "Traceback" not in err and "Prepare a dataset" not in err
        assert "give its new place: --set task.path=DIR to resume or evaluate" in err
    # Its new place, holding the same files: evaluate takes it (the same numbers), and
    # so does a resume, without --allow-config-change; the run's readers then find it.
    moved = tmp_path / "moved"
    val_loss = json.loads((tmp_path / "before.json").read_text())["val_loss"]
    for args in ([str(run), "--set", f"task.path={moved}"], [str(run), "--set",
                 f"task.path={moved}", "--set", "discretisation.steps_per_layer=1"]):  # fmt: skip
        assert evaluate_cli.main([*args, "--json", str(tmp_path / "after.json")]) == ExitCode.OK
        assert json.loads((tmp_path / "after.json").read_text())["val_loss"] == val_loss
    # The export reads it too (this run's untied readout is then what it refuses).
    assert export_cli.main([str(run), "--to", str(tmp_path / "hf"), "--task-path",
                            str(moved)]) == ExitCode.USAGE  # fmt: skip
    err = capsys.readouterr().err
    assert "model.readout" in err and "holds no dataset" not in err
    # A task.path without a directory is bad input (it was an IndexError traceback).
    capsys.readouterr()
    for bad, said in (("task.path", "bad --set syntax 'task.path'"),
                      ("task.path=none", "'task.path=none' names no directory")):  # fmt: skip
        assert evaluate_cli.main([str(run), "--set", bad]) == 2
        assert said in capsys.readouterr().err
    # Step 1 was written on the first data: the moved files are not what its path held.
    assert evaluate_cli.main([str(run), "--set", f"task.path={moved}", "--step", "1"]) == 2
    assert f"{data}" in capsys.readouterr().err
    other = tmp_path / "other"
    prepare_text([str(root / "a.txt")], "char", other, progress=False)
    capsys.readouterr()
    assert evaluate_cli.main([str(run), "--set", f"task.path={other}"]) == ExitCode.USAGE
    assert f"than the dataset directory at task.path {other} holds now" in capsys.readouterr().err
    there = [f"task.path={moved}" if a == f"task.path={data}" else a for a in argv]
    assert cli.main([*there, "--set", "train.steps=2"]) == ExitCode.OK
    assert json.loads((run / "run.json").read_text())["dataset"]["path"] == str(moved.resolve())
    assert evaluate_cli.main([str(run), "--step", "2"]) == ExitCode.OK  # trained at data/
    config, _ = load_run(run, 2)
    assert config.task.path == str(moved)


def test_a_relative_task_path_is_the_run_start_directorys(corpus, tmp_path, monkeypatch, capsys):
    """A run started with a relative task.path (as the shipped experiments give) is
    read from anywhere: its readers take the path relative to the directory the run
    was started in (run.json's cwd), not to theirs."""
    from ocformer.evaluation import evaluate_run
    from ocformer.training import load_run

    root, _, _ = corpus
    prepare_text([str(root / "a.txt"), str(root / "b.txt")], "char", tmp_path / "data",
                 progress=False)  # fmt: skip
    monkeypatch.chdir(tmp_path)
    argv = [
        "--config", SMOKE, "--workdir", "run", "--set", "task.name=tokens",
        "--set", "task.path=data", "--set", "task.seq_len=8", "--set", "task.batch_size=4",
        "--set", "task.eval_batch_size=4", "--set", "task.eval_batches=1",
        "--set", "train.steps=1", "--set", "train.progress=false",
    ]  # fmt: skip
    assert cli.main(argv) == ExitCode.OK
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    config, _ = load_run(tmp_path / "run")
    assert config.task.path == str(tmp_path / "data")
    assert evaluate_run(str(tmp_path / "run"))["step"] == 1
    # Resumed from here, it names the run's dataset (it said only that task.path data
    # does not exist).
    capsys.readouterr()
    again = [str(tmp_path / "run") if a == "run" else a for a in argv]
    assert cli.main(again) == 2
    err = capsys.readouterr().err
    assert (
        f"task.path data is relative: from this directory it names {elsewhere / 'data'}, "
        f"which does not exist, but {tmp_path / 'run'} started in {tmp_path}, where it names "
        f"the run's dataset {tmp_path / 'data'}; resume from that directory, or give --set "
        f"task.path={tmp_path / 'data'}" in err
    ), err


def test_input_given_more_than_once_reads_every_file_in_order(tmp_path):
    """``--input a --input b`` is ``--input a b``: both files, in that order (the last
    flag alone was read before, silently)."""
    (tmp_path / "a.txt").write_text("alpha beta gamma. " * 30, encoding="utf-8")
    (tmp_path / "b.txt").write_text("delta epsilon. " * 30, encoding="utf-8")
    a, b = str(tmp_path / "a.txt"), str(tmp_path / "b.txt")
    base = ["--tokenizer", "char", "--no-progress"]
    assert (
        prepare_main(["text", "--input", a, "--input", b, "--out", str(tmp_path / "x"), *base]) == 0
    )
    assert prepare_main(["text", "--input", a, b, "--out", str(tmp_path / "y"), *base]) == 0
    manifests = [json.loads((tmp_path / d / "manifest.json").read_text()) for d in "xy"]
    assert [s["path"] for s in manifests[0]["sources"]] == [
        str((tmp_path / n).resolve()) for n in ("a.txt", "b.txt")
    ]
    assert manifests[0]["splits"] == manifests[1]["splits"]


def test_a_glob_passes_over_the_directories_it_matches(tmp_path):
    """``--input 'data/*'`` with a folder among the matches reads the files (the
    folder was refused as "not a regular file", the whole corpus with it)."""
    (tmp_path / "in" / "sub").mkdir(parents=True)
    _write(tmp_path / "in" / "a.txt", _text(300, 0))
    _write(tmp_path / "in" / "b.txt", _text(300, 1))
    manifest = prepare_text([str(tmp_path / "in" / "*")], "char", tmp_path / "ds", progress=False)
    assert [os.path.basename(s["path"]) for s in manifest["sources"]] == ["a.txt", "b.txt"]


def test_a_file_changed_while_it_is_prepared_is_refused(tmp_path, monkeypatch):
    """The character alphabet is read in a first pass: a file that gains a character
    before the second (encoding) pass was written as id 65535 (the table's -1 cast to
    uint16) with exit 0; it is refused, and nothing is written."""
    from ocformer.tasks import _dataset

    corpus = _write(tmp_path / "a.txt", _text(400, 0))
    made = _dataset.char_tokenizer

    def then_edited(symbols):
        with open(corpus, "a", encoding="utf-8") as f:
            f.write(" naïve €")
        return made(symbols)

    monkeypatch.setattr(_dataset, "char_tokenizer", then_edited)
    with pytest.raises(ValueError, match=r"a\.txt changed while it was prepared"):
        prepare_text([str(corpus)], "char", tmp_path / "ds", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt"]


def test_a_tokenizer_that_leaves_much_of_the_corpus_unknown_is_warned_of(tmp_path, capsys):
    """A word-level tokenizer that knows 3 of the corpus's 10 words writes its unknown
    token for most of it: the preparation says how much (it was silent); one that
    covers the corpus gets no warning."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    corpus = _write(tmp_path / "a.txt", _text(2000, 0))
    words = sorted({w.strip() for w in WORDS if w.strip()})
    for name, known in (("few", words[:3]), ("all", words)):
        tok = Tokenizer(models.WordLevel({"[UNK]": 0, **{w: i + 1 for i, w in enumerate(known)}},
                                         unk_token="[UNK]"))  # fmt: skip
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tok.save(str(tmp_path / f"{name}.json"))
        capsys.readouterr()
        prepare_text([str(corpus)], str(tmp_path / f"{name}.json"), tmp_path / name,
                     progress=False)  # fmt: skip
        ids = np.concatenate([_ids(tmp_path / name, f) for f in ("train.bin", "val.bin")])
        share = np.mean(ids == 0)
        err = capsys.readouterr().err
        if name == "few":
            assert share > 0.5
            assert f"of the corpus's {ids.size} tokens ({share:.1%}) are its unknown token " \
                   "'[UNK]'" in err, err  # fmt: skip
        else:
            assert share == 0 and "unknown token" not in err
    # The unknown token's own text in the corpus (WikiText's "<unk>") is no gap of the
    # tokenizer: 20 % of the ids, and no warning.
    marked = _write(tmp_path / "marked.txt", _text(2000, 0) + " [UNK]" * 500)
    capsys.readouterr()
    prepare_text([str(marked)], str(tmp_path / "all.json"), tmp_path / "marked", progress=False)
    ids = np.concatenate([_ids(tmp_path / "marked", f) for f in ("train.bin", "val.bin")])
    assert np.mean(ids == 0) > 0.1 and "unknown token" not in capsys.readouterr().err
    # A SentencePiece-style (Unigram) tokenizer records the id, not the token.
    from ocformer.tasks._tokenizer import unknown_id

    unigram = Tokenizer(models.Unigram([("<unk>", 0.0), ("a", -1.0), ("b", -2.0)], unk_id=0))
    assert unknown_id(unigram) == 0 and unigram.encode("ac").ids == [1, 0]


def test_an_unreadable_input_or_dataset_is_named_not_a_traceback(tmp_path, monkeypatch):
    """As a user without read permission sees them (``os.access`` and ``open`` refused
    here: the suite may run as root, whom permissions do not stop)."""
    from ocformer.tasks import open_dataset, verify_dataset

    corpus = _write(tmp_path / "a.txt", _text(400, 0))
    prepare_text([str(corpus)], "char", tmp_path / "ds", progress=False)
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: str(p) != str(corpus)
                        and real_access(p, mode, **kw))  # fmt: skip
    with pytest.raises(ValueError, match=r"--input .*a\.txt: this user cannot read it"):
        prepare_text([str(corpus)], "char", tmp_path / "ds2", progress=False)
    import builtins

    real_open = builtins.open

    def denied(file, *args, **kwargs):
        if str(file).endswith("val.bin"):
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", denied)
    for read in (open_dataset, verify_dataset):
        with pytest.raises(ValueError, match=r"ds/val\.bin cannot be read \(Permission denied\)"):
            read(tmp_path / "ds")


def test_bpe_trains_on_long_runs_without_spaces_in_bounded_pieces(tmp_path, monkeypatch):
    """A run of characters without white space is cut for the BPE trainer (whose time
    grows with the square of a word's length) into pieces of at most ``BPE_MAX_RUN``
    characters that join to the text: what the trainer is given, seen through a spy;
    the corpus still decodes back exactly."""
    from ocformer.tasks import _tokenizer
    from ocformer.tasks._tokenizer import BPE_MAX_RUN, bounded_runs

    given: list[str] = []

    def spy(texts, run=None):
        for piece in bounded_runs(texts, run):
            given.append(piece)
            yield piece

    monkeypatch.setattr(_tokenizer, "bounded_runs", spy)

    texts = ["ab cd", "x" * (2 * BPE_MAX_RUN + 5) + " yy", "", "z" * BPE_MAX_RUN]
    pieces = list(bounded_runs(texts))
    assert "".join(pieces) == "".join(texts)
    assert max(len(p) for p in pieces) == BPE_MAX_RUN
    assert [len(p) for p in bounded_runs(["x" * 10], run=4)] == [4, 4, 2]
    text = "ACGT" * 5000 + "\n"  # DNA: 20,000 characters in one run
    _write(tmp_path / "dna.txt", text)
    prepare_text([str(tmp_path / "dna.txt")], "bpe:300", tmp_path / "ds", progress=False)
    tok = Tokenizer.from_file(str(tmp_path / "ds" / "tokenizer.json"))
    ids = np.concatenate([_ids(tmp_path / "ds", f) for f in ("train.bin", "val.bin")])
    assert len(tok.get_vocab()) > 256 and tok.decode(ids.tolist()) == text
    assert "".join(given) == text and max(map(len, given)) == BPE_MAX_RUN


def test_a_validation_set_of_more_windows_than_the_split_holds_is_warned_of(
    corpus, tmp_path, capsys
):
    """Validation windows are drawn with replacement: 4 x 64 of them from a split of
    fewer distinct ones repeat some, which the run says (it was silent); a set that
    fits gets no warning."""
    root, _, _ = corpus
    prepare_text([str(root / "a.txt"), str(root / "b.txt")], "char", tmp_path / "data",
                 progress=False)  # fmt: skip
    held = Tokens(tmp_path / "data", seq_len=8).windows("validation")
    assert held == len(_ids(tmp_path / "data", "val.bin")) - 8 and held < 4 * 64
    said = "the validation set draws 256 windows of 9 tokens from"
    for size, warned in ((64, True), (held // 4, False)):
        argv = [
            "--config", SMOKE, "--workdir", str(tmp_path / f"run{size}"),
            "--set", "task.name=tokens", "--set", f"task.path={tmp_path / 'data'}",
            "--set", "task.seq_len=8", "--set", "task.batch_size=4",
            "--set", f"task.eval_batch_size={size}", "--set", "task.eval_batches=4",
            "--set", "train.steps=1", "--set", "train.progress=false",
        ]  # fmt: skip
        capsys.readouterr()
        assert cli.main(argv) == ExitCode.OK
        err = capsys.readouterr().err
        assert (said in err) == warned, err
        if warned:
            assert f"which holds {held} distinct ones: windows repeat" in err, err


def test_files_of_one_size_and_one_first_mib_are_told_apart_by_their_whole_bytes(tmp_path):
    """Copies are found by their whole bytes: two files of one size whose first MiB
    agree and whose ends differ are two texts."""
    from ocformer.tasks._dataset import equal_contents

    head = ("abc " * (1 << 18)).encode()  # 1 MiB
    a = _write(tmp_path / "a.txt", (head + b"tail one").decode())
    b = _write(tmp_path / "b.txt", (head + b"tail two").decode())
    c = _write(tmp_path / "c.txt", (head + b"tail one").decode())
    assert equal_contents([a, b]) == [] and equal_contents([a, b, c]) == [[a, c]]


def test_copies_on_one_side_of_the_split_are_warned_of_not_refused(tmp_path, capsys):
    """Two copies of one boilerplate file, both in training, leak nothing into the
    validation loss: prepared, with a warning that their text counts twice (copies on
    both sides are refused: tests/test_bad_input.py)."""
    text = _text(300, 0)
    files = [_write(tmp_path / n, t) for n, t in
             (("a.txt", text), ("b.txt", text), ("c.txt", _text(8000, 1)))]  # fmt: skip
    prepare_text([str(f) for f in files], "char", tmp_path / "ds", progress=False)
    err = capsys.readouterr().err
    assert f"--input {files[0]} and {files[1]} have the same contents: their text is 2 times " \
           "in the training split" in err, err  # fmt: skip
