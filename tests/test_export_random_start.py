"""A run from a random start exported as GPT-2 (``model.readout=tied``) or ViT.

A character model trained from a random start on a dataset of its own, with its logits
tied to the token embedding, is exported by ``python -m ocformer.export`` and loaded by
``transformers``: the same logits (float32, 1e-5 relative), the same greedy
continuation, and the dataset's tokenizer read by ``AutoTokenizer`` as the task reads
it. In float64, with one LayerNorm gain per layer (``controls.norm_affine=scalar``,
written per feature) and GPT-2's tanh GELU, the logits agree to 1e-12. A ViT trained on
the digits is a ``ViTForImageClassification`` of the same logits. A random start
that is not GPT-2's architecture is refused, naming what it lacks; a tied readout for
an image task, or a readout other than a checkpoint's, is refused by the configuration.
"""

import errno
import json
import os
import re

import equinox as eqx
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
import torch
from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

from ocformer import export as export_cli, train as train_cli
from ocformer.config import ConfigError, resolve
from ocformer.convert import export_config, from_pretrained, to_pretrained
from ocformer.tasks import make_task, prepare_text
from ocformer.training import build, load_run, load_run_at

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOKE = os.path.join(ROOT, "experiments", "smoke.py")
SMALL = [
    "train.progress=false", "train.steps=3", "train.eval_every=3",
    "train.checkpoint_every=3", "task.batch_size=4", "task.eval_batches=1",
    "task.eval_batch_size=4", "model.width=16", "model.hidden=32",
]  # fmt: skip


def _train(workdir, *sets) -> int:
    argv = ["--config", SMOKE, "--workdir", str(workdir)]
    return train_cli.main([*argv, *(a for s in [*SMALL, *sets] for a in ("--set", s))])


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    corpus = root / "c.txt"
    corpus.write_text("the cat sat on the mat. a dog ran. " * 60, encoding="utf-8")
    prepare_text([str(corpus)], "char", root / "ds", progress=False)
    return root / "ds"


def test_a_tied_random_start_is_exported_as_gpt2_with_its_tokenizer(
    dataset, tmp_path, monkeypatch, capsys
):
    run = tmp_path / "run"
    task = ["task.name=tokens", f"task.path={dataset}", "task.seq_len=12"]
    assert _train(run, *task, "model.readout=tied") == 0
    _, model = load_run(run)
    assert model.tied and model.head is None
    # An empty --to is no path (os.path would read it as the current directory, which
    # --overwrite replaces whole), and a folder that cannot be written is named first.
    here = tmp_path / "here"
    here.mkdir()
    (here / "notes.txt").write_text("mine")
    monkeypatch.chdir(here)
    capsys.readouterr()
    assert export_cli.main([str(run), "--to", "", "--overwrite"]) == 2
    assert "--to: is empty" in capsys.readouterr().err
    assert sorted(os.listdir(here)) == ["notes.txt"]
    access = os.access
    monkeypatch.setattr(os, "access", lambda p, m: p != str(here) and access(p, m))
    assert export_cli.main([str(run), "--to", str(here / "hf")]) == 2
    assert f"but '{here}' cannot be written" in capsys.readouterr().err
    assert sorted(os.listdir(here)) == ["notes.txt"]
    monkeypatch.undo()
    assert export_cli.main([str(run), "--to", str(tmp_path / "hf")]) == 0
    # Replaced from inside, it left the shell working there in a deleted directory.
    before = sorted(os.listdir(tmp_path / "hf"))
    monkeypatch.chdir(tmp_path / "hf")
    for to in (".", str(tmp_path / "hf")):
        assert export_cli.main([str(run), "--to", to, "--overwrite"]) == 2
        assert "the current working directory" in capsys.readouterr().err
    assert sorted(os.listdir(".")) == before and os.path.samefile(".", tmp_path / "hf")
    monkeypatch.chdir(tmp_path)
    # A folder that lists but takes no entry (/proc): named as --to, not a bare OS error.
    import ocformer.convert._directory as directory

    mkdir = os.mkdir

    def no_entry(path, *args):
        if not os.path.basename(path).startswith(".hf.tmp-"):  # the export's staging
            return mkdir(path, *args)
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", path)

    monkeypatch.setattr(directory.os, "mkdir", no_entry)
    assert export_cli.main([str(run), "--to", str(here / "hf")]) == 2
    assert f"--to: {here / 'hf'} cannot be written ([Errno 2]" in capsys.readouterr().err
    monkeypatch.undo()
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    # The marker says which run and step the checkpoint is.
    origin = json.loads((tmp_path / "hf" / "ocformer_export.json").read_text())["origin"]
    assert origin == {"workdir": str(run), "step": load_run_at(run)[2]}
    assert (written["n_embd"], written["n_inner"], written["n_positions"]) == (16, 32, 12)
    hf = GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    vocab = model.embedding.tokens.shape[0]
    assert written["vocab_size"] == vocab and hf.config.n_layer == model.transformer.num_layers
    ids = np.random.default_rng(0).integers(0, vocab, (2, 12))
    ours = np.asarray(model(jnp.asarray(ids)), np.float64)
    with torch.no_grad():
        theirs = hf(torch.tensor(ids)).logits.double().numpy()
    assert np.max(np.abs(ours - theirs)) / np.max(np.abs(theirs)) < 1e-5
    prompt = ids[0, :4]
    greedy = model.generate(jr.key(0), prompt, 6, temperature=0.0)
    with torch.no_grad():
        out = hf.generate(
            torch.tensor(prompt[None]), max_new_tokens=6, do_sample=False, pad_token_id=0
        )
    np.testing.assert_array_equal(greedy, out[0, 4:].numpy())
    # The dataset's own tokenizer travels with it and reads text as the task does.
    theirs_ids = AutoTokenizer.from_pretrained(tmp_path / "hf")("a dog sat").input_ids
    ours_ids = make_task("tokens", path=str(dataset), seq_len=12).encode("a dog sat")
    assert list(theirs_ids) == np.asarray(ours_ids).tolist() and len(theirs_ids) == 9


def test_to_pretrained_refuses_an_empty_path(tmp_path, monkeypatch):
    """An empty path is no directory (made absolute it was the current one, which
    ``overwrite=True`` replaced whole)."""
    from ocformer.convert import to_pretrained

    config = resolve(SMOKE, [*SMALL, "model.readout=tied", "task.name=copy"])
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="to_pretrained needs the path of a directory"):
        to_pretrained(build(config).model, "", overwrite=True)
    assert os.listdir(tmp_path) == ["notes.txt"]


def test_float64_export_of_a_built_model_is_gpt2_to_rounding(tmp_path):
    """Scalar LayerNorm gains and biases (one per layer) are written as GPT-2's
    per-feature ones; the tanh GELU as ``gelu_new``. Logits to 1e-12 against
    ``transformers``; read back by ``from_pretrained``, the same model."""
    sets = [
        "model.readout=tied", "controls.norm_affine=scalar", "model.activation=gelu_tanh",
        "model.dtype=float64", "controls.init_scale=0.5",
    ]  # fmt: skip
    model = build(resolve(SMOKE, sets)).model
    config = export_config(model)
    assert config["activation_function"] == "gelu_new" and config["bos_token_id"] is None
    to_pretrained(model, tmp_path / "hf")
    hf = GPT2LMHeadModel.from_pretrained(tmp_path / "hf", dtype=torch.float64).eval()
    assert hf.transformer.h[0].ln_1.weight.shape == (model.transformer.width,)
    ids = np.random.default_rng(1).integers(0, config["vocab_size"], (3, 10))
    ours = np.asarray(model(jnp.asarray(ids)))
    with torch.no_grad():
        theirs = hf(torch.tensor(ids)).logits.numpy()
    assert np.max(np.abs(ours - theirs)) / np.max(np.abs(theirs)) < 1e-12
    back = from_pretrained(tmp_path / "hf")
    np.testing.assert_allclose(np.asarray(back(jnp.asarray(ids))), ours, rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    "sets, words",
    [
        ([], "untied head with a bias"),
        (["model.readout=tied", "model.norm=post"], "pre-LN layers (model.norm=pre)"),
        (["model.readout=tied", "model.final_norm=false"], "the final LayerNorm"),
        (
            ["model.final_norm=false", "task.name=digits"],
            "written as ViT, whose architecture it must have; it lacks the final LayerNorm",
        ),
    ],
)
def test_a_random_start_without_gpt2_s_architecture_is_refused_naming_it(sets, words, tmp_path):
    experiment = SMOKE
    if "task.name=digits" in sets:
        experiment, sets = os.path.join(ROOT, "experiments", "digits_vit.py"), sets[:1]
    model = build(resolve(experiment, sets)).model
    with pytest.raises(ValueError, match=re.escape(words)):
        export_config(model)
    with pytest.raises(ValueError, match=re.escape(words)):
        to_pretrained(model, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


@pytest.mark.slow  # about 17 s on the idle 2-core machine
def test_a_random_start_image_classifier_is_exported_as_vit(tmp_path):
    """A ViT trained two steps from a random start on the digits (grey 8x8 images, 2x2
    patches): ``ViTForImageClassification`` gives its logits (float32, 1e-5); built in
    float64 with GPT-2's tanh GELU and one LayerNorm gain per layer (written per
    feature), to 1e-12, and ``from_pretrained`` reads it back."""
    from transformers import ViTForImageClassification

    vit = os.path.join(ROOT, "experiments", "digits_vit.py")
    small = ["model.num_layers=2", "model.width=16", "model.hidden=32", "train.steps=2",
             "train.eval_every=2", "train.checkpoint_every=2", "train.progress=false"]  # fmt: skip
    argv = ["--config", vit, "--workdir", str(tmp_path / "run")]
    assert train_cli.main([*argv, *(a for s in small for a in ("--set", s))]) == 0
    config, model = load_run(tmp_path / "run")
    assert export_cli.main([str(tmp_path / "run"), "--to", str(tmp_path / "hf")]) == 0
    hf = ViTForImageClassification.from_pretrained(tmp_path / "hf").eval()
    images = np.asarray(build(config).task.batch("validation", 0, 4, 0)["inputs"])  # (B, 8, 8)
    ours = np.asarray(model(jnp.asarray(images)), np.float64)
    with torch.no_grad():
        theirs = hf(torch.tensor(images[:, None])).logits.double().numpy()
    assert ours.shape == theirs.shape == (4, 10)
    assert np.max(np.abs(ours - theirs)) / np.max(np.abs(theirs)) < 1e-5
    sets = [*small[:3], "model.dtype=float64", "model.activation=gelu_tanh",
            "controls.norm_affine=scalar"]  # fmt: skip
    model = build(resolve(vit, sets)).model
    assert export_config(model)["hidden_act"] == "gelu_new"
    to_pretrained(model, tmp_path / "hf64")
    hf = ViTForImageClassification.from_pretrained(tmp_path / "hf64", dtype=torch.float64)
    ours = np.asarray(model(jnp.asarray(images, jnp.float64)))
    with torch.no_grad():
        theirs = hf.eval()(torch.tensor(images[:, None], dtype=torch.float64)).logits.numpy()
    assert np.max(np.abs(ours - theirs)) / np.max(np.abs(theirs)) < 1e-12
    back = from_pretrained(tmp_path / "hf64")  # channels-last (B, 8, 8, 1)
    got = np.asarray(back(jnp.asarray(images[..., None], jnp.float64)))
    np.testing.assert_allclose(got, ours, rtol=0, atol=1e-12)
    # The model built for (B, 8, 8) reads (B, 8, 8, 1) too, as the imported one does (its
    # channel check had compared the width with 1); channels first is still refused.
    np.testing.assert_array_equal(
        np.asarray(model(jnp.asarray(images[..., None], jnp.float64))), ours
    )
    with pytest.raises(
        ValueError, match=r"\(B, H, W, C\) = \(B, 8, 8, 1\); got shape \(4, 1, 8, 8\)"
    ):
        model(jnp.asarray(images[:, None]))


@pytest.mark.slow  # about 20 s
def test_the_export_command_names_the_tied_readout_for_an_untied_run(tmp_path, capsys):
    run = tmp_path / "run"
    assert _train(run) == 0
    capsys.readouterr()
    assert export_cli.main([str(run), "--to", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert "model.readout" in err and "--set model.readout=tied" in err
    assert not (tmp_path / "hf").exists()
    # A dataset's new place for a run of a task without one names the option given.
    assert export_cli.main([str(run), "--to", str(tmp_path / "hf"), "--task-path", "d"]) == 2
    assert "--task-path: " in (err := capsys.readouterr().err) and "drop it" in err, err


def test_a_tied_readout_is_refused_for_an_image_task():
    with pytest.raises(ConfigError, match="model.readout") as e:
        resolve(os.path.join(ROOT, "experiments", "digits_vit.py"), ["model.readout=tied"])
    assert "use model.readout=linear" in str(e.value)


def test_a_checkpoint_start_fixes_the_readout(tmp_path, capsys):
    """GPT-2's head is tied: a start from it takes ``tied`` (recorded in the run's
    configuration), and ``model.readout=linear`` set with it is a conflict."""
    config = GPT2Config(
        vocab_size=8, n_positions=16, n_embd=16, n_layer=2, n_head=2,
        bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2")
    experiment = tmp_path / "start.py"
    experiment.write_text(START)
    argv = ["--config", str(experiment), "--set", f"model.init_from={tmp_path / 'gpt2'}"]
    assert train_cli.main([*argv, "--workdir", str(tmp_path / "a")]) == 0
    assert load_run(tmp_path / "a")[0].model.readout == "tied"
    capsys.readouterr()
    code = train_cli.main(
        [*argv, "--set", "model.readout=linear", "--workdir", str(tmp_path / "b")]
    )
    assert code == 2
    assert "model.readout is 'linear', the checkpoint's 'tied'" in capsys.readouterr().err


# A run of two steps whose architecture a checkpoint gives (no model fields).
START = """
from ocformer.config import Config, TaskConfig, TrainConfig


def get_config(arg=None):
    return Config(
        task=TaskConfig(name="copy", seq_len=12, vocab_size=8, batch_size=4,
                        eval_batch_size=4, eval_batches=1),
        train=TrainConfig(steps=2, eval_every=2, checkpoint_every=2, progress=False),
    )
"""


@pytest.mark.parametrize("width", [16, 64])
def test_a_tied_readout_starts_at_the_loss_of_a_linear_one(width):
    """The tied logits u(T) E^T of a layer-normed u(T) have standard deviation
    init_std sqrt(d): with the symbol table drawn N(0, 1) the smoke model started at a
    loss of 7.6 nats against 2.4 for the linear head (ln 8 = 2.08). Drawn N(0, 1/d),
    the two start within 0.3 nats of each other."""
    losses = {}
    for readout in ("linear", "tied"):
        sets = [f"model.readout={readout}", f"model.width={width}", f"model.hidden={2 * width}"]
        exp = build(resolve(SMOKE, sets))
        batch = {k: jnp.asarray(v) for k, v in exp.task.batch("train", 0, 32, 0).items()}
        _, metrics = eqx.filter_jit(exp.objective)(exp.model, batch)
        losses[readout] = float(metrics["task_loss"])
    assert abs(losses["tied"] - losses["linear"]) < 0.3, losses
