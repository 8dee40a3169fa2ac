"""A pretrained start (``model.init_from``) and the export back to Hugging Face.

A tiny GPT-2 with random parameters of realistic size is saved by ``transformers``; the
run that starts from it reproduces the checkpoint's loss at step 0 (float64, against
the ``transformers`` model itself), a bad start is refused with exit code 2 before
anything is written, ``PATH@STEP`` starts from one checkpoint of a run, the Strang
re-discretisation trains, and a run exported with ``python -m ocformer.export`` is a
``GPT2LMHeadModel`` with the same logits and the same greedy continuations.
"""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from ocformer import export as export_cli, train as train_cli
from ocformer.checkpointing import CheckpointManager
from ocformer.config import ConfigError, is_set, resolve
from ocformer.evaluation import evaluate, evaluate_run
from ocformer.training import _init_from, build, load_run
from ocformer.training._init_from import architecture

VOCAB, POSITIONS = 16, 16
QUIET = ["train.progress=false"]
QUIET_ARGS = ["--set", "train.progress=false"]
# The run's experiment file: the task, the loop and the optimiser; no model fields
# (the checkpoint fixes the architecture).
EXPERIMENT = """
from ocformer.config import Config, ModelConfig, OptimiserConfig, TaskConfig, TrainConfig


def get_config(arg=None):
    return Config(
        model=ModelConfig(dtype=arg or "float32"),
        optimiser=OptimiserConfig(name="adamw", learning_rate=1e-3, warmup_steps=0),
        task=TaskConfig(name="copy", seq_len=12, vocab_size=8, batch_size=4,
                        eval_batch_size=8, eval_batches=2),
        train=TrainConfig(steps=2, eval_every=2, checkpoint_every=2),
    )
"""


def randomise(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Parameters of realistic size (transformers' std 0.02 makes each layer almost the
    identity, a weak comparison)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            z = torch.randn(p.shape, generator=gen, dtype=torch.float64)
            if "ln_" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * z)
            elif p.ndim == 1:
                p.copy_(0.1 * z)
            elif name.startswith(("transformer.wte", "transformer.wpe")):
                p.copy_(z)
            else:
                p.copy_(z / np.sqrt(p.shape[0]))
    return model.double().eval()


@pytest.fixture(scope="module")
def experiment(tmp_path_factory):
    path = tmp_path_factory.mktemp("experiments") / "finetune.py"
    path.write_text(EXPERIMENT)
    return str(path)


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    """A tiny GPT-2 (2 layers, width 8, 2 heads, 16 symbols and positions), saved in
    float64: (directory, torch model)."""
    path = tmp_path_factory.mktemp("hf") / "gpt2"
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=POSITIONS, n_embd=8, n_layer=2, n_head=2,
        bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    model = randomise(GPT2LMHeadModel(config), 0)
    model.save_pretrained(path)
    return str(path), model


def hf_loss(model, inputs, targets) -> float:
    """Mean next-symbol cross-entropy of the ``transformers`` model over the targets
    that count (target -1: no loss)."""
    with torch.no_grad():
        logits = model(torch.tensor(np.asarray(inputs))).logits.double()
    flat = torch.tensor(np.asarray(targets, np.int64)).reshape(-1)
    loss = torch.nn.functional.cross_entropy(logits.reshape(flat.shape[0], -1), flat,
                                             ignore_index=-1)  # fmt: skip
    return float(loss)


def config(experiment, *sets, arg=None):
    return resolve(experiment if arg is None else f"{experiment}:{arg}", [*QUIET, *sets])


def test_start_reproduces_the_checkpoint_loss(experiment, gpt2):
    """Step 0 of a run from the checkpoint: the first evaluation is the checkpoint's
    loss on the same batches (float64, 1e-12)."""
    path, hf = gpt2
    jax.config.update("jax_enable_x64", True)
    c = config(experiment, f"model.init_from={path}", arg="float64")
    exp = build(c)
    assert exp.model.tied and exp.model.embedding.tokens.dtype == jnp.float64
    assert exp.init_from["kind"] == "checkpoint" and exp.init_from["step"] is None
    assert list(exp.init_from["sha256"]) == ["model.safetensors"]
    batches = exp.task.eval_batches(c.task.eval_batch_size, c.task.eval_batches, c.eval_seed)
    reference = np.mean([hf_loss(hf, b["inputs"], b["targets"]) for b in batches])
    ours = evaluate(c, exp.model, exp.task)["val_loss"]
    assert abs(ours - reference) / reference < 1e-12, (ours, reference)


@pytest.mark.parametrize(
    ("sets", "words"),
    [
        (["model.init_from={empty}"], ["model.init_from", "neither"]),
        (["model.init_from={empty}/gone"], ["model.init_from", "gone does not exist; give"]),
        (
            ["model.init_from={broken}"],
            ["model.init_from", "broken/config.json cannot be rebuilt", "model.bogus"],
        ),
        (["model.init_from={llama}"], ["model.init_from", "model_type='llama'"]),
        (["model.init_from={gpt2}@3"], ["model.init_from", "drop the '@3'"]),
        (["model.init_from={gpt2}", "model.width=24"], ["model.width", "24", "8"]),
        # Set explicitly to the schema's default (width 32, hidden 64): still a conflict.
        (
            ["model.init_from={gpt2}", "model.width=32"],
            ["model.width is 32, the checkpoint's 8"],
        ),
        (
            ["model.init_from={gpt2}", "model.hidden=64"],
            ["model.hidden is 64, the checkpoint's 32"],
        ),
        # Every conflicting field at once, not the first alone.
        (
            ["model.init_from={gpt2}", "model.hidden=64", "model.activation=relu"],
            [
                "2 set field(s) disagree",
                "model.hidden is 64, the checkpoint's 32",
                "model.activation is 'relu', the checkpoint's 'gelu_tanh'",
            ],
        ),
        (["model.init_from={gpt2}", "model.norm=post"], ["model.norm", "'post'", "'pre'"]),
        # A heads count that the default width (32) would refuse is a conflict with the
        # checkpoint's heads, not a question of dividing a width the run does not have.
        (
            ["model.init_from={gpt2}", "model.num_heads=3"],
            ["model.num_heads is 3, the checkpoint's 2"],
        ),
        # The combinations are checked with the checkpoint's values once it is read.
        (
            ["model.init_from={gpt2}", "model.formulation=relaxed"],
            ["model.formulation: formulation='relaxed' is a smooth limit of post-LN"],
        ),
        (["model.init_from={gpt2}", "task.seq_len=32"], ["task.seq_len", "16 positions"]),
        (["model.init_from={gpt2}", "task.vocab_size=20"], ["task (copy)", "< 16"]),
    ],
)
def test_bad_start_is_refused_before_anything_is_written(
    experiment, gpt2, tmp_path, capsys, sets, words
):
    (tmp_path / "empty").mkdir()
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({"model_type": "llama"}))
    broken = tmp_path / "broken"  # a work directory whose configuration is not valid
    broken.mkdir()
    (broken / "ocformer_run.json").write_text("{}")
    (broken / "config.json").write_text(json.dumps({"model": {"bogus": 1}}))
    paths = {"empty": tmp_path / "empty", "llama": llama, "gpt2": gpt2[0], "broken": broken}
    sets = [s.format(**paths) for s in sets]
    argv = ["--config", experiment, "--workdir", str(tmp_path / "run")]
    code = train_cli.main([*argv, *(a for s in [*QUIET, *sets] for a in ("--set", s))])
    err = capsys.readouterr().err
    assert code == 2, err
    for word in words:
        assert word in err, err
    assert not os.path.exists(tmp_path / "run")


def test_a_field_set_in_the_experiment_file_to_its_default_is_checked(
    experiment, gpt2, tmp_path, capsys
):
    """``ModelConfig(width=32)`` in the experiment file is a width set explicitly, even
    though 32 is the default: the width-8 checkpoint refuses it (exit 2, nothing
    written)."""
    path = tmp_path / "width32.py"
    model = 'ModelConfig(dtype=arg or "float32")'
    path.write_text(EXPERIMENT.replace(model, model[:-1] + ", width=32)"))
    assert "width=32" in path.read_text()
    argv = ["--config", str(path), "--workdir", str(tmp_path / "run")]
    code = train_cli.main([*argv, "--set", f"model.init_from={gpt2[0]}", "--set", QUIET[0]])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "model.width: the run starts from" in err, err
    assert "model.width is 32, the checkpoint's 8" in err, err
    assert not os.path.exists(tmp_path / "run")


def test_explicit_matching_fields_are_accepted_and_unset_ones_come_from_the_checkpoint(
    experiment, gpt2
):
    """Fields set to the checkpoint's values are accepted, including ones equal to the
    schema's default too (2 layers, pre-norm); an unset field (hidden, default 64)
    takes the checkpoint's value (32)."""
    c = config(
        experiment,
        f"model.init_from={gpt2[0]}",
        "model.width=8",
        "model.num_layers=2",
        "model.norm=pre",
        "controls.norm_affine=feature",
    )
    assert is_set(c.model, "width") and is_set(c.model, "num_layers")
    assert is_set(c.controls, "norm_affine") and not is_set(c.model, "hidden")
    assert c.model.hidden == 64  # the schema's default, left unset
    arch = architecture(build(c).model)
    assert arch[("model", "width")] == 8 and arch[("model", "num_layers")] == 2
    assert arch[("model", "hidden")] == 32  # the checkpoint's 4 x 8


def test_the_start_fixes_the_fields_whose_checks_wait_for_it(experiment, gpt2):
    """The fields whose combination checks wait for the source (``START_FIELDS``) are
    the ones it fixes; filled in with the source's values, the configuration is checked
    at once, so an evaluation override the rules refuse is refused."""
    from ocformer.config._validate import START_FIELDS
    from ocformer.evaluation import evaluation_config

    c = config(experiment, f"model.init_from={gpt2[0]}")
    fixed = architecture(build(c).model)
    assert {f"{s}.{n}" for s, n in fixed} == set(START_FIELDS)
    filled = _init_from.with_architecture(c, fixed)
    with pytest.raises(ConfigError, match="the adjoint splitting"):
        evaluation_config(filled, ["discretisation.gradient=optimise_then_discretise"])


def _train(experiment, workdir, *sets) -> None:
    argv = ["--config", experiment, "--workdir", str(workdir)]
    code = train_cli.main([*argv, *(a for s in [*QUIET, *sets] for a in ("--set", s))])
    assert code == 0


def test_finetune_export_and_load_in_transformers(experiment, gpt2, tmp_path, capsys):
    """A run from the checkpoint, trained two steps (float32) and exported: the same
    logits in transformers (relative 1e-5) and the same greedy continuation; the run's
    step 1 is a start of its own (``PATH@STEP``)."""
    path, _ = gpt2
    run = tmp_path / "run"
    _train(experiment, run, f"model.init_from={path}", "train.checkpoint_every=1")
    config_run, model = load_run(run)
    assert type(model).__name__ == "SequenceModel" and model.tied
    # The configuration states the architecture the checkpoint fixed (width 8, hidden
    # 32, GPT-2's gelu_tanh), not the schema's defaults (32, 64, gelu) of config.json.
    m = config_run.model
    assert (m.width, m.hidden, m.activation, m.num_layers) == (8, 32, "gelu_tanh", 2)
    stored = json.loads((run / "config.json").read_text())["model"]
    assert stored["width"] == 32
    # The work directory records where the run started.
    started = json.loads((run / "run.json").read_text())["init_from"]
    assert started == build(config_run).init_from and started["kind"] == "checkpoint"
    assert started["architecture"]["model.width"] == 8
    assert started["path"] == os.path.abspath(path) and all(
        len(h) == 64 for h in started["sha256"].values()
    )
    assert export_cli.main([str(run), "--to", str(tmp_path / "hf")]) == 0
    hf = GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    ids = np.random.default_rng(0).integers(0, VOCAB, (2, 12))
    ours = np.asarray(model(jnp.asarray(ids)), np.float64)
    with torch.no_grad():
        theirs = hf(torch.tensor(ids)).logits.double().numpy()
    assert np.max(np.abs(ours - theirs)) / np.max(np.abs(theirs)) < 1e-5
    prompt = ids[0, :4]
    greedy = model.generate(jr.key(0), prompt, 8, temperature=0.0)
    with torch.no_grad():
        out = hf.generate(
            torch.tensor(prompt[None]), max_new_tokens=8, do_sample=False, pad_token_id=0
        )
    np.testing.assert_array_equal(greedy, out[0, 4:].numpy())
    # Exporting into the same directory again is allowed (ocformer wrote it).
    assert export_cli.main([str(run), "--to", str(tmp_path / "hf"), "--step", "1"]) == 0
    # A directory of other files only with --overwrite, which the refusal names; never the
    # checkpoint the run started from (resuming reads it), even with --overwrite.
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    capsys.readouterr()
    assert export_cli.main([str(run), "--to", str(tmp_path / "mine")]) == 2
    assert "pass --overwrite to replace" in capsys.readouterr().err
    assert export_cli.main([str(run), "--to", str(tmp_path / "mine"), "--overwrite"]) == 0
    assert not (tmp_path / "mine" / "notes.txt").exists()
    before = sorted(os.listdir(path))
    assert export_cli.main([str(run), "--to", str(path), "--overwrite"]) == 2
    assert "is the checkpoint this run started from" in capsys.readouterr().err
    assert sorted(os.listdir(path)) == before
    # Nor a folder inside the run or above it: the export replaces --to whole.
    steps = sorted(os.listdir(run / "checkpoints"))
    for inside, word in [(run / "checkpoints", "is inside"), (tmp_path, "holds")]:
        assert export_cli.main([str(run), "--to", str(inside), "--overwrite"]) == 2
        assert f"{word} the run's own work directory" in capsys.readouterr().err
    assert sorted(os.listdir(run / "checkpoints")) == steps
    # Step 1 of the run as a start: its arrays, and the record names that step.
    exp = build(config(experiment, f"model.init_from={run}@1"))
    _, at_1 = load_run(run, 1)
    assert exp.init_from["kind"] == "run" and exp.init_from["step"] == 1
    for a, b in zip(jax.tree.leaves(exp.model), jax.tree.leaves(at_1)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    capsys.readouterr()


def test_the_export_never_replaces_a_start_of_the_chain_or_the_dataset(
    experiment, gpt2, tmp_path, capsys
):
    """A run that started from a run that started from GPT-2: exporting it into the
    GPT-2 checkpoint (which loading both runs reads) is refused even with
    ``--overwrite``, and so is exporting into its dataset directory or the dataset of
    the run it started from (rebuilding that run reads it); all stay as they were.
    (Only the direct start was protected: the root checkpoint was replaced.)"""
    from ocformer.tasks import prepare_text

    source = tmp_path / "gpt2"
    shutil.copytree(gpt2[0], source)
    corpus = tmp_path / "c.txt"
    corpus.write_text("the cat sat on the mat. " * 40, encoding="utf-8")
    for name in ("ds", "ds_a"):
        prepare_text([str(corpus)], "char", tmp_path / name, progress=False)
    task = ["task.name=tokens", "train.steps=1"]
    _train(experiment, tmp_path / "a", f"model.init_from={source}", *task,
           f"task.path={tmp_path / 'ds_a'}")  # fmt: skip
    _train(experiment, tmp_path / "b", f"model.init_from={tmp_path / 'a'}", *task,
           f"task.path={tmp_path / 'ds'}")  # fmt: skip
    kept = ("gpt2", "ds", "ds_a")
    before = {d: sorted(os.listdir(tmp_path / d)) for d in kept}
    capsys.readouterr()
    for to, words in [
        ("gpt2", "is a checkpoint in the chain of starts this run came from"),
        ("ds", "is the run's dataset (task.path)"),
        ("ds_a", f"is the dataset of {tmp_path / 'a'}, a run in the chain of starts"),
    ]:
        for overwrite in (["--overwrite"], []):  # without it: no advice to give it
            argv = [str(tmp_path / "b"), "--to", str(tmp_path / to), *overwrite]
            assert export_cli.main(argv) == 2
            assert words in (err := capsys.readouterr().err) and "pass --overwrite" not in err
    assert {d: sorted(os.listdir(tmp_path / d)) for d in kept} == before
    assert export_cli.main([str(tmp_path / "b"), "--to", str(tmp_path / "hf")]) == 0


def test_a_source_edited_since_the_run_started_is_refused_naming_the_change(
    experiment, gpt2, tmp_path, capsys
):
    """The source gives a trained run its structure: a layer-norm epsilon edited in
    its config.json (no array changes shape) rebuilt the run as another function and
    evaluated it without a word. Loading, resuming
    and exporting now refuse it, naming the field then and now; put back, it loads."""
    from ocformer import evaluate as evaluate_cli

    source, run = tmp_path / "gpt2", tmp_path / "run"
    shutil.copytree(gpt2[0], source)
    _train(experiment, run, f"model.init_from={source}", "train.steps=1")
    settings = source / "config.json"
    original = settings.read_text()
    settings.write_text(json.dumps(json.loads(original) | {"layer_norm_epsilon": 0.5}))
    capsys.readouterr()
    words = "model.ln_eps was 1e-05, is 0.5"
    assert evaluate_cli.main([str(run)]) == 2
    assert words in capsys.readouterr().err
    assert export_cli.main([str(run), "--to", str(tmp_path / "hf")]) == 2
    assert words in capsys.readouterr().err and not (tmp_path / "hf").exists()
    argv = ["--config", experiment, "--workdir", str(run), "--set", f"model.init_from={source}"]
    assert train_cli.main([*argv, "--set", "train.steps=1", *QUIET_ARGS]) == 2
    assert words in capsys.readouterr().err
    settings.write_text(original)
    assert evaluate_cli.main([str(run)]) == 0


def test_a_resumed_run_keeps_its_start_record_and_names_a_missing_source(
    experiment, gpt2, tmp_path, monkeypatch, capsys
):
    """A run that resumes takes its parameters from its own checkpoint: the source of
    ``model.init_from`` gives the model its structure only, so its files are not hashed
    again and ``run.json`` keeps the first start's record; a source that has gone is
    refused with exit code 2, its path and why a resume still reads it."""
    source, run = tmp_path / "gpt2", tmp_path / "run"
    shutil.copytree(gpt2[0], source)
    sets = [f"model.init_from={source}", "train.checkpoint_every=1", "train.steps=1"]
    _train(experiment, run, *sets)
    first = json.loads((run / "run.json").read_text())["init_from"]
    child = tmp_path / "child"  # a run that started from this one
    _train(experiment, child, f"model.init_from={run}@1", "train.steps=1")
    assert first["path"] == str(source) and len(first["sha256"]) == 1

    def no_hashing(path):
        raise AssertionError(f"{path} hashed again on resume")

    monkeypatch.setattr(_init_from, "_sha256", no_hashing)
    _train(experiment, run, *sets)  # resumes at its end
    info = json.loads((run / "run.json").read_text())
    assert info["resumed_from_step"] == 1 and info["init_from"] == first
    assert info["earlier_starts"][0]["init_from"] == first
    shutil.rmtree(source)
    argv = ["--config", experiment, "--workdir", str(run)]
    capsys.readouterr()
    assert train_cli.main([*argv, *(a for s in [*QUIET, *sets] for a in ("--set", s))]) == 2
    err = capsys.readouterr().err
    assert f"model.init_from: {source} does not exist" in err and "Traceback" not in err
    assert (
        f"{run} takes its parameters from its own checkpoint" in err
        and "put the source back" in err
    )
    # So do the readers of the run (evaluate, export), which read the source alike.
    with pytest.raises(ConfigError, match=f"{run} takes its parameters from its own checkpoint"):
        load_run(run)
    # ... and a run that started from it, two starts down the chain: the message says
    # which start is gone, not that the version cannot rebuild the run.
    with pytest.raises(ConfigError) as caught:
        load_run(child)
    assert f"the run in {run} started from another checkpoint, which rebuilding it reads" in str(
        caught.value
    )
    assert f"{source} does not exist" in str(caught.value)
    assert "version" not in str(caught.value)


def test_a_resume_compares_the_architecture_the_run_took_from_its_source(
    experiment, gpt2, tmp_path
):
    """The architecture of a run from ``model.init_from`` is its source's, which its
    config.json does not hold: a resume that drops ``init_from`` lists every field
    whose value the model would change (here the activation, the one field of the
    same shapes that differs, and the readout: GPT-2's is tied, the default a linear
    head), and one that sets a field to the source's value is no
    change."""
    from ocformer.training import ConfigChanged, RunDirectory

    run = tmp_path / "run"
    _train(experiment, run, f"model.init_from={gpt2[0]}", "train.steps=1")
    same_shapes = ["train.steps=1", "model.width=8", "model.hidden=32"]  # the source's
    dropped = config(experiment, *same_shapes)
    with pytest.raises(ConfigChanged) as e:
        RunDirectory(run).check(dropped)
    assert e.value.changes == {
        "model.init_from": (gpt2[0], None),
        "model.activation": ("gelu_tanh", "gelu"),
        "model.readout": ("tied", "linear"),
    }
    kept = config(experiment, f"model.init_from={gpt2[0]}", *same_shapes)
    assert RunDirectory(run).check(kept) == {}


def test_the_export_refuses_every_discretisation_but_the_layer_stack(experiment):
    """Each field that makes the solve other than the standard layer stack is named,
    the depth-parallel solve (an approximation of the serial one) included."""
    assert export_cli.nonstandard_fields(config(experiment)) == {}
    for field, value in [
        ("discretisation.stepper", "strang"), ("discretisation.steps_per_layer", 2),
        ("discretisation.depth_parallel", "parareal"), ("controls.kind", "piecewise_linear"),
        ("model.attention", "conv"),
    ]:  # fmt: skip
        differ = export_cli.nonstandard_fields(config(experiment, f"{field}={value}"))
        assert list(differ) == [field] and differ[field][0] == value


def test_strang_rediscretisation_trains_and_is_not_exported(experiment, gpt2, tmp_path, capsys):
    """Start from GPT-2, run it with Strang at two steps per layer, fine-tune: one
    command; the export refuses it, naming the fields."""
    run = tmp_path / "strang"
    _train(
        experiment,
        run,
        f"model.init_from={gpt2[0]}",
        "discretisation.stepper=strang",
        "discretisation.steps_per_layer=2",
        "train.steps=1",
    )
    capsys.readouterr()
    assert export_cli.main([str(run), "--to", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "discretisation.stepper='strang'" in err and "discretisation.steps_per_layer=2" in err
    assert "only the standard discretisation" in err.lower()
    assert not os.path.exists(tmp_path / "out")
    # What the refusal advises: a run from this one, in the standard discretisation.
    assert f"a new run with --set model.init_from={run} in the standard discretisation" in err
    _train(experiment, tmp_path / "from_strang", f"model.init_from={run}", "train.steps=1")
    assert export_cli.main([str(tmp_path / "from_strang"), "--to", str(tmp_path / "std")]) == 0
    # Continued in the standard discretisation: each checkpoint keeps the one that
    # trained it, so step 1 is still refused (and loads as Strang), step 2 exported.
    sets = [*QUIET, f"model.init_from={gpt2[0]}", "train.steps=2"]
    argv = ["--config", experiment, "--workdir", str(run), "--allow-config-change"]
    assert train_cli.main([*argv, *(a for s in sets for a in ("--set", s))]) == 0
    assert load_run(run)[0].discretisation.stepper == "lie"
    trained, _ = load_run(run, 1)
    assert trained.discretisation.stepper == "strang"
    assert trained.discretisation.steps_per_layer == 2
    capsys.readouterr()
    assert export_cli.main([str(run), "--to", str(tmp_path / "out"), "--step", "1"]) == 2
    assert "discretisation.stepper='strang'" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "out")
    assert export_cli.main([str(run), "--to", str(tmp_path / "out"), "--step", "2"]) == 0
    # evaluate's "as trained" is the checkpoint's discretisation too.
    at_1 = evaluate_run(str(run), step=1)
    assert at_1["step"] == 1 and at_1["discretisation"]["discretisation.stepper"] == "strang"
    assert at_1["discretisation"]["discretisation.steps_per_layer"] == 2


def test_evaluate_config_reports_the_start_in_any_discretisation(
    experiment, gpt2, tmp_path, capsys
):
    """``ocformer.evaluate --config`` evaluates the model a run starts from, before any
    update: the checkpoint's loss (as ``transformers`` computes it, float64) under the
    layer stack, and its loss under Strang at two steps per layer, which differs; it
    trains and writes nothing but its --json file."""
    from ocformer import evaluate as evaluate_cli

    jax.config.update("jax_enable_x64", True)
    start = [f"model.init_from={gpt2[0]}", "model.dtype=float64"]
    out = {}
    for name, sets in [
        ("lie", start),
        ("strang", [*start, "discretisation.stepper=strang", "discretisation.steps_per_layer=2"]),
    ]:
        argv = ["--config", experiment, "--json", str(tmp_path / f"{name}.json")]
        assert evaluate_cli.main([*argv, *(a for s in sets for a in ("--set", s))]) == 0
        out[name] = json.loads((tmp_path / f"{name}.json").read_text())
        assert out[name]["step"] == 0
    said = capsys.readouterr().out
    assert f"ocformer: evaluated the start of {experiment} at step 0" in said
    c = config(experiment, *start)
    task = build(c).task
    batches = list(task.eval_batches(c.task.eval_batch_size, c.task.eval_batches, c.eval_seed))
    losses = [hf_loss(gpt2[1], b["inputs"], b["targets"]) for b in batches]
    assert abs(out["lie"]["val_loss"] - float(np.mean(losses))) < 1e-12
    assert abs(out["strang"]["val_loss"] - out["lie"]["val_loss"]) > 1e-3
    assert out["strang"]["discretisation"]["discretisation.stepper"] == "strang"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lie.json", "strang.json"]
    assert evaluate_cli.main(["--config", experiment, "--step", "1"]) == 2
    assert evaluate_cli.main([str(tmp_path), "--config", experiment]) == 2
    err = capsys.readouterr().err
    assert "drop --step" in err and "or --config EXPERIMENT (a run's start), not both" in err


def test_evaluate_reports_the_step_it_loaded(experiment, tmp_path, monkeypatch):
    """The step an evaluation reports is that of the checkpoint it read, even when a
    newer one is committed meanwhile (a run still training)."""
    from ocformer.training import _load_run

    run = tmp_path / "run"
    _train(experiment, run, "train.steps=1")
    loaded = []
    restore = _load_run.restore_run
    monkeypatch.setattr(
        _load_run, "restore_run", lambda *a, **k: loaded.append(1) or restore(*a, **k)
    )
    latest = CheckpointManager.latest
    # After the load, the directory's newest checkpoint is a later one.
    monkeypatch.setattr(CheckpointManager, "latest", lambda self: latest(self) + len(loaded))
    assert evaluate_run(str(run))["step"] == 1


def test_sampling_keeps_to_the_task_symbols_of_a_larger_checkpoint(experiment, gpt2):
    """The copy task's 8 symbols fill half of the checkpoint's 16 rows: ``vocab_size``
    (what the training loop's samples pass) keeps every sampled id below 8, where the
    whole table puts some at 8 or above; a bad ``vocab_size`` is a ValueError."""
    path, _ = gpt2
    model = build(config(experiment, f"model.init_from={path}")).model
    prompt = np.arange(4)
    free = model.generate(jr.key(0), prompt, 64, temperature=1.0)
    kept = model.generate(jr.key(0), prompt, 64, temperature=1.0, vocab_size=8)
    assert free.max() >= 8 and kept.min() >= 0 and kept.max() < 8
    assert model.generate(jr.key(0), prompt, 4, temperature=0.0, vocab_size=8).max() < 8
    for bad in (0, 17, 8.0, True):
        with pytest.raises(ValueError, match="vocab_size must be an integer in 1..16"):
            model.generate(jr.key(0), prompt, 4, vocab_size=bad)


def test_a_grey_vit_checkpoint_trains_on_digits_and_its_patch_size_is_kept(
    experiment, tmp_path, capsys
):
    """A one-channel ViT (8x8 images, 4x4 patches) starts a run of the digits task,
    whose images have no channel axis; another ``task.patch_size`` is refused with exit
    code 2 naming the checkpoint's, and so is a ViTModel, which has no classifier."""
    from transformers import ViTConfig, ViTForImageClassification

    vit = ViTForImageClassification(
        ViTConfig(
            image_size=8, patch_size=4, num_channels=1, hidden_size=8, num_hidden_layers=1,
            num_attention_heads=2, intermediate_size=16, num_labels=10,
        )
    )  # fmt: skip
    vit.save_pretrained(tmp_path / "vit")
    start = [f"model.init_from={tmp_path / 'vit'}", "task.name=digits", "train.steps=1"]
    _train(experiment, tmp_path / "run", *start, "train.eval_every=1")
    assert (tmp_path / "run" / "checkpoints" / "step_1").is_dir()
    argv = ["--config", experiment, "--workdir", str(tmp_path / "other")]
    sets = [*QUIET, *start, "task.patch_size=2"]
    assert train_cli.main([*argv, *(a for s in sets for a in ("--set", s))]) == 2
    assert "task.patch_size: is 2, but the checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "other").exists()
    # ViTModel (a pooler, or nothing, on the class token; no classifier): refused, with
    # how to attach a classifier; its pooler's tanh had been trained as the logits.
    from transformers import ViTModel

    for pooling in (True, False):
        name = f"vit_model_{pooling}"
        ViTModel(vit.config, add_pooling_layer=pooling).save_pretrained(tmp_path / name)
        sets = [*QUIET, *start, f"model.init_from={tmp_path / name}"]
        assert train_cli.main([*argv, *(a for s in sets for a in ("--set", s))]) == 2
        has = "ViT's pooler (tanh(u(x_0) W + b), 8 outputs)" if pooling else "no head"
        err = capsys.readouterr().err
        assert f"{tmp_path / name} has {has} and no classifier" in err
        assert "ViTForImageClassification.from_pretrained(SOURCE, num_labels=10)" in err
        assert not (tmp_path / "other").exists()


@pytest.mark.slow
def test_a_float32_run_from_a_float64_run_is_rebuilt_without_being_told(experiment, gpt2, tmp_path):
    """Rebuilding a float32 fine-tune of a float64 work directory rebuilds that run too,
    which needs 64-bit JAX: ``start_needs_x64`` follows the chain of starts (a cycle
    ends), and the command lines turn it on themselves (a process of its own, where
    64-bit JAX starts off)."""
    import subprocess
    import sys

    from ocformer.training import run_needs_x64, start_needs_x64

    source, chain = tmp_path / "f64", tmp_path / "chain"
    _train(experiment, source, f"model.init_from={gpt2[0]}", "model.dtype=float64")
    _train(experiment, chain, f"model.init_from={source}@2", "train.steps=1")
    assert run_needs_x64(source) and run_needs_x64(chain)
    assert start_needs_x64(f"{source}@2") and not start_needs_x64(gpt2[0])
    assert not start_needs_x64(None) and not start_needs_x64(str(tmp_path / "gone"))
    config_file = chain / "config.json"
    stored = json.loads(config_file.read_text())
    stored["model"]["init_from"] = str(chain)  # a cycle: no float64 anywhere
    config_file.write_text(json.dumps(stored))
    assert not run_needs_x64(chain)
    stored["model"]["init_from"] = f"{source}@2"
    config_file.write_text(json.dumps(stored))
    env = {k: v for k, v in os.environ.items() if k != "JAX_ENABLE_X64"}
    hf = tmp_path / "hf"
    for cmd, said in [
        (["ocformer.evaluate", str(chain)], "ocformer: evaluated"),
        (["ocformer.export", str(chain), "--to", str(hf)], f"ocformer.export: wrote {hf}"),
    ]:
        done = subprocess.run(
            [sys.executable, "-m", *cmd], env=env, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0 and said in done.stdout, done.stderr[-2000:]


def test_a_start_from_an_unfinished_run_is_warned_of(experiment, gpt2, tmp_path, capsys):
    """A fine-tune of a run that had not reached its train.steps (still training, or
    stopped) started from its newest checkpoint without a word; it says so, and a start
    at an explicit step (PATH@STEP) is taken as asked."""
    import shutil

    source = tmp_path / "source"
    _train(experiment, source, f"model.init_from={gpt2[0]}", "train.checkpoint_every=1")
    shutil.rmtree(source / "checkpoints" / "step_2")  # as if stopped after step 1 of 2
    capsys.readouterr()
    _train(experiment, tmp_path / "from_newest", f"model.init_from={source}", "train.steps=1")
    assert (
        f"model.init_from={source}: the run there is at step 1 of its 2 (still training, "
        "or stopped before its end); starting from step 1" in capsys.readouterr().err
    )
    _train(experiment, tmp_path / "from_step", f"model.init_from={source}@1", "train.steps=1")
    assert "the run there is at step" not in capsys.readouterr().err


def test_a_corpus_of_another_tokenizer_than_the_starts_is_warned_of(
    experiment, gpt2, tmp_path, capsys
):
    """A fine-tune on a dataset prepared with another tokenizer than the checkpoint
    directory's ``tokenizer.json`` (or than the one a source run trained on) trains,
    with a warning naming both; a corpus prepared with the checkpoint's own tokenizer
    (``--tokenizer DIR``) gets none."""
    from ocformer.tasks import prepare_text

    source = tmp_path / "gpt2"
    shutil.copytree(gpt2[0], source)
    (tmp_path / "own.txt").write_text("abcdefgh " * 40, encoding="utf-8")
    prepare_text([str(tmp_path / "own.txt")], "char", tmp_path / "own", progress=False)
    shutil.copy(tmp_path / "own" / "tokenizer.json", source / "tokenizer.json")
    (tmp_path / "other.txt").write_text("dcba " * 80, encoding="utf-8")  # fewer symbols
    prepare_text([str(tmp_path / "other.txt")], "char", tmp_path / "other", progress=False)
    prepare_text([str(tmp_path / "other.txt")], str(source), tmp_path / "same", progress=False)
    warned = "was prepared with another tokenizer"
    runs, errs = {}, {}
    for data in ("other", "same"):
        runs[data] = tmp_path / f"run_{data}"
        capsys.readouterr()
        _train(experiment, runs[data], f"model.init_from={source}", "task.name=tokens",
               f"task.path={tmp_path / data}", "train.steps=1")  # fmt: skip
        errs[data] = capsys.readouterr().err
    assert warned in errs["other"] and warned not in errs["same"], errs
    assert f"than the start's ({source / 'tokenizer.json'}: " in errs["other"]
    assert f"prepare the corpus with --tokenizer {source}" in errs["other"]
    # So does the evaluation of such a start.
    from ocformer import evaluate as evaluate_cli

    sets = [f"model.init_from={source}", "task.name=tokens", f"task.path={tmp_path / 'other'}"]
    assert (
        evaluate_cli.main(["--config", experiment, *(a for s in sets for a in ("--set", s))]) == 0
    )
    assert warned in capsys.readouterr().err
    # From a run: its dataset's tokenizer is the start's.
    capsys.readouterr()
    _train(experiment, tmp_path / "chain", f"model.init_from={runs['same']}",
           "task.name=tokens", f"task.path={tmp_path / 'other'}", "train.steps=1")  # fmt: skip
    err = capsys.readouterr().err
    assert warned in err and f"the dataset that {runs['same']} trained on" in err, err
    # The file to prepare with is named (it said "that tokenizer.json").
    assert f"prepare the corpus with --tokenizer {tmp_path / 'same' / 'tokenizer.json'}" in err
    # The same tokenizer saved again (another file, the same id -> symbol table): the
    # ids mean what the model learned, and no warning is given.
    from tokenizers import Tokenizer

    resaved = tmp_path / "resaved"
    shutil.copytree(source, resaved)
    Tokenizer.from_file(str(source / "tokenizer.json")).save(
        str(resaved / "tokenizer.json"), pretty=False
    )
    files = [(d / "tokenizer.json").read_bytes() for d in (source, resaved)]
    assert files[0] != files[1]
    capsys.readouterr()
    _train(experiment, tmp_path / "again", f"model.init_from={resaved}", "task.name=tokens",
           f"task.path={tmp_path / 'own'}", "train.steps=1")  # fmt: skip
    err = capsys.readouterr().err
    assert warned not in err and "cannot be checked" not in err
    # A checkpoint without a tokenizer.json: nothing to compare with, which is said
    # (it trained without a word).
    capsys.readouterr()
    _train(experiment, tmp_path / "unchecked", f"model.init_from={gpt2[0]}", "task.name=tokens",
           f"task.path={tmp_path / 'own'}", "train.steps=1")  # fmt: skip
    err = capsys.readouterr().err
    assert (
        f"the start {gpt2[0]} holds no tokenizer.json, so whether the ids of the dataset at "
        f"task.path {tmp_path / 'own'} (tokenizer.json SHA-256 "
        in err
        and "name the symbols the model learned cannot be checked" in err
    ), err


def test_an_exported_tokenizer_is_read_by_autotokenizer_as_the_task_reads_it(
    experiment, gpt2, tmp_path
):
    """A character dataset's tokenizer, exported with the run: ``AutoTokenizer`` gives
    the task's ids (with the spaces, which GPT-2's byte-level class, picked from the
    checkpoint's ``model_type`` without a ``tokenizer_config.json``, drops)."""
    from transformers import AutoTokenizer

    from ocformer.tasks import make_task, prepare_text

    corpus = tmp_path / "c.txt"
    corpus.write_text("the cat sat on the mat. " * 40, encoding="utf-8")
    prepare_text([str(corpus)], "char", tmp_path / "ds", progress=False)
    run = tmp_path / "run"
    task = ["task.name=tokens", f"task.path={tmp_path / 'ds'}", "train.steps=1"]
    _train(experiment, run, f"model.init_from={gpt2[0]}", *task)
    assert export_cli.main([str(run), "--to", str(tmp_path / "hf")]) == 0
    theirs = AutoTokenizer.from_pretrained(tmp_path / "hf")("the cat").input_ids
    ours = make_task("tokens", path=str(tmp_path / "ds"), seq_len=12).encode("the cat")
    assert list(theirs) == np.asarray(ours).tolist() and len(theirs) == 7


def test_a_start_outside_the_constraint_set_is_refused_not_clamped(
    experiment, gpt2, tmp_path, capsys
):
    """A checkpoint with negative layer-norm gains: under the default sigma floor the
    first update, however small, would set them to the floor (a silent change of the
    pretrained model), so the run is refused before anything is written, naming the
    lowest gain and the fix; with the floor off it trains and they stay negative."""
    source = tmp_path / "negative"
    model = GPT2LMHeadModel.from_pretrained(gpt2[0], torch_dtype=torch.float64)
    with torch.no_grad():
        model.transformer.h[1].ln_1.weight[:3] = torch.tensor([-1.5, -0.25, 5e-4])
    model.save_pretrained(source)
    argv = ["--config", experiment, "--workdir", str(tmp_path / "run")]
    sets = [*QUIET, f"model.init_from={source}", "optimiser.learning_rate=1e-9"]
    capsys.readouterr()
    assert train_cli.main([*argv, *(a for s in sets for a in ("--set", s))]) == 2
    err = capsys.readouterr().err
    assert "objective.sigma_floor: the start" in err and "(the lowest is -1.5)" in err, err
    assert "set objective.sigma_floor=none" in err
    assert not os.path.exists(tmp_path / "run")
    _train(experiment, tmp_path / "run", *sets[1:], "objective.sigma_floor=none")
    trained = load_run(tmp_path / "run")[1]
    gains = np.asarray(trained.transformer.layer(1).norm1.scale)  # the second layer's ln_1
    np.testing.assert_allclose(gains[:3], [-1.5, -0.25, 5e-4], rtol=1e-6, atol=1e-8)


def test_a_ternary_run_is_exported_with_the_kernels_it_computes_with(experiment, gpt2, tmp_path):
    """``objective.ternary``: the checkpoints store the latent controls W, the run trains
    and evaluates with Q(W); the export's kernels are E + Q(W) (the feed-forward maps
    are the identity-like E plus the control: one magnitude per layer and map, or zero,
    off E), and transformers' logits are those of the model the run evaluates with."""
    from ocformer.objective import Ternary, feedforward_kernels, with_feedforward_kernels

    run = tmp_path / "run"
    _train(experiment, run, f"model.init_from={gpt2[0]}", "objective.ternary=true")
    _, latent = load_run(run)
    assert export_cli.main([str(run), "--to", str(tmp_path / "hf")]) == 0
    hf = GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    for block in hf.transformer.h:
        for kernel in (block.mlp.c_fc.weight, block.mlp.c_proj.weight):
            control = kernel.detach().numpy() - np.eye(*kernel.shape, dtype=np.float32)
            magnitudes = np.abs(control)[np.abs(control) > 1e-6]  # (1 + q) - 1: rounding
            assert np.ptp(magnitudes) < 1e-6 * magnitudes.max(), np.unique(magnitudes)
    ternary = with_feedforward_kernels(latent, Ternary(0.0).project(feedforward_kernels(latent)))
    ids = np.random.default_rng(0).integers(0, VOCAB, (2, 12))
    with torch.no_grad():
        theirs = hf(torch.tensor(ids)).logits.double().numpy()
    for model, agrees in ((ternary, True), (latent, False)):
        ours = np.asarray(model(jnp.asarray(ids)), np.float64)
        close = np.max(np.abs(ours - theirs)) / np.max(np.abs(theirs)) < 1e-5
        assert close == agrees


def test_an_exported_tokenizer_names_the_model_s_special_tokens(experiment, gpt2, tmp_path):
    """A dataset whose tokenizer has a special token at the id the checkpoint's
    configuration names as its end (and start) of text: the export's settings name it,
    so ``AutoTokenizer`` knows its EOS and BOS, as ``generate`` and padding need."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    from ocformer.tasks import prepare_text

    corpus = tmp_path / "c.txt"
    corpus.write_text("the cat sat on the mat. " * 40, encoding="utf-8")
    prepare_text([str(corpus)], "char", tmp_path / "chars", progress=False)
    tok = Tokenizer.from_file(str(tmp_path / "chars" / "tokenizer.json"))
    tok.add_special_tokens(["<|endoftext|>"])
    end = tok.token_to_id("<|endoftext|>")
    (tmp_path / "tok").mkdir()
    tok.save(str(tmp_path / "tok" / "tokenizer.json"))
    prepare_text([str(corpus)], str(tmp_path / "tok"), tmp_path / "ds", progress=False)
    source = tmp_path / "gpt2"
    model = GPT2LMHeadModel.from_pretrained(gpt2[0], torch_dtype=torch.float64)
    model.config.bos_token_id = model.config.eos_token_id = end
    model.save_pretrained(source)
    run = tmp_path / "run"
    task = ["task.name=tokens", f"task.path={tmp_path / 'ds'}", "train.steps=1"]
    _train(experiment, run, f"model.init_from={source}", *task)
    assert export_cli.main([str(run), "--to", str(tmp_path / "hf")]) == 0
    theirs = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert theirs.eos_token == theirs.bos_token == "<|endoftext|>"
    assert theirs.eos_token_id == end and theirs.pad_token is None


def test_an_export_carries_the_settings_of_its_start_s_own_tokenizer(experiment, gpt2, tmp_path):
    """A run whose dataset was prepared with its Hugging Face start's own tokenizer is
    exported with that tokenizer's settings beside it (the files of the start): its
    length limit, special tokens and chat template, as the start had them. They were
    replaced by minimal settings (no limit, no chat template, truncation a no-op)."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from ocformer.tasks import prepare_text

    corpus = tmp_path / "c.txt"
    corpus.write_text("the cat sat on the mat. " * 40, encoding="utf-8")
    prepare_text([str(corpus)], "char", tmp_path / "chars", progress=False)
    tok = Tokenizer.from_file(str(tmp_path / "chars" / "tokenizer.json"))
    tok.add_special_tokens(["<|endoftext|>"])
    theirs = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                     model_max_length=POSITIONS)  # fmt: skip
    theirs.chat_template = "{% for m in messages %}{{ m['content'] }}|{% endfor %}"
    source = tmp_path / "gpt2"
    GPT2LMHeadModel.from_pretrained(gpt2[0], torch_dtype=torch.float64).save_pretrained(source)
    theirs.save_pretrained(source)
    prepare_text([str(corpus)], str(source), tmp_path / "ds", progress=False)
    run = tmp_path / "run"
    task = ["task.name=tokens", f"task.path={tmp_path / 'ds'}", "train.steps=1"]
    _train(experiment, run, f"model.init_from={source}", *task)
    assert export_cli.main([str(run), "--to", str(tmp_path / "hf")]) == 0
    back = AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "the mat sat on the cat. " * 2
    assert back(text).input_ids == theirs(text).input_ids and len(theirs(text).input_ids) > 16
    assert len(back(text, truncation=True).input_ids) == POSITIONS == back.model_max_length
    assert back.eos_token == "<|endoftext|>"
    chat = [{"role": "user", "content": "the cat"}, {"role": "user", "content": "sat"}]
    assert back.apply_chat_template(chat, tokenize=False) == "the cat|sat|"
