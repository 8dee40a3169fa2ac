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
    assert evaluate_cli.main([str(run)]) == ExitCode.OK


def test_a_relative_task_path_is_the_run_start_directorys(corpus, tmp_path, monkeypatch):
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
