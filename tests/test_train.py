"""The training loop in-process: every experiment runs, outputs are written, non-finite
updates are skipped or abort, solver failures are named, the schedule is what it says."""

import ast
import glob
import json
import math
import os
import shutil
import time
import types

import diffrax
import equinox as eqx
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from _faults import nan_at_update

from ocformer import train as cli
from ocformer.checkpointing import CheckpointManager, NonFiniteCheckpointError
from ocformer.config import ConfigError, OptimiserConfig, resolve
from ocformer.objective import Objective
from ocformer.tasks import AbstractTextTask, prepare_text
from ocformer.training import (
    ExitCode,
    NonFiniteError,
    SolverFailure,
    _loop,
    build,
    load_run,
    make_eval_step,
    make_schedule,
    train,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOKE = os.path.join(ROOT, "experiments", "smoke.py")
EXPERIMENTS = sorted(glob.glob(os.path.join(ROOT, "experiments", "*.py")))
QUIET = ["train.progress=false"]


def read_metrics(workdir) -> list[dict]:
    with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow
@pytest.mark.parametrize("path", EXPERIMENTS, ids=[os.path.basename(p) for p in EXPERIMENTS])
def test_every_experiment_runs_a_few_steps(path, tmp_path):
    overrides = [
        *QUIET,
        "train.steps=2",
        "train.eval_every=2",
        "train.checkpoint_every=2",
        "train.log_every=1",
        "task.eval_batches=1",
        "task.eval_batch_size=8",
    ]
    if "shakespeare" in path:
        overrides.append("train.sample_tokens=5")
        # The corpus comes from `make data`; the standard library stands in where it
        # has not been fetched, so the experiment's model and loop are still exercised.
        overrides.append("task.fallback=stdlib")
    if path.endswith("shakespeare_bpe.py"):
        # Its corpus is prepared from `make data`'s file; a tiny one stands in.
        text = tmp_path / "corpus.txt"
        text.write_text("To be, or not to be, that is the question.\n" * 400, encoding="utf-8")
        prepare_text([str(text)], "bpe:300", tmp_path / "bpe", progress=False)
        overrides = [o for o in overrides if o != "task.fallback=stdlib"]
        overrides.append(f"task.path={tmp_path / 'bpe'}")
        tmp_path = tmp_path / "run"
    if path.endswith("finetune_rediscretise.py"):
        # It starts from the default experiment's run; a two-step one stands in.
        overrides += ["task.fallback=stdlib", "train.sample_tokens=5"]
        source = os.path.join(ROOT, "experiments", "shakespeare_char.py")
        train(resolve(source, overrides), str(tmp_path / "source"))
        overrides.append(f"model.init_from={tmp_path / 'source'}")
        tmp_path = tmp_path / "run"
    if path.endswith("finetune.py"):
        # It starts from a Hugging Face GPT-2 on a prepared corpus: a tiny random one
        # (16 symbols and positions) and a corpus of 5 characters stand in.
        from transformers import GPT2Config, GPT2LMHeadModel

        gpt2 = GPT2Config(vocab_size=16, n_positions=16, n_embd=8, n_layer=2, n_head=2)
        GPT2LMHeadModel(gpt2).save_pretrained(tmp_path / "gpt2")
        text = tmp_path / "corpus.txt"
        text.write_text("abc ab\n" * 400, encoding="utf-8")
        prepare_text([str(text)], "char", tmp_path / "data", progress=False)
        overrides += [f"model.init_from={tmp_path / 'gpt2'}", f"task.path={tmp_path / 'data'}"]
        overrides += ["task.seq_len=8", "train.sample_tokens=5"]
        tmp_path = tmp_path / "run"
    config = resolve(path, overrides)
    summary = train(config, str(tmp_path))
    assert summary["step"] == 2 and summary["resumed_from"] is None
    assert math.isfinite(summary["loss"]) and math.isfinite(summary["val_loss"])
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2]
    assert "val_loss" in records[-1] and "val_accuracy" in records[-1]
    assert CheckpointManager(str(tmp_path / "checkpoints")).steps() == [2]
    if config.train.sample_tokens:
        with open(tmp_path / "samples.txt", encoding="utf-8") as f:
            assert f.read().startswith("=== step 2 ===")


def test_outputs_resume_and_summary(tmp_path, capsys):
    config = resolve(
        SMOKE, [*QUIET, "train.steps=6", "train.checkpoint_every=3", "train.eval_every=3"]
    )
    first = train(config, str(tmp_path), argv=["prog", "--flag"])
    out = capsys.readouterr().out
    assert "finished step 6" in out and str(tmp_path) in out and "val loss" in out
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == list(range(1, 7))
    assert {
        "loss",
        "task_loss",
        "accuracy",
        "grad_norm",
        "lr",
        "skipped_steps",
        "tok_per_s",
    } <= set(records[0])
    assert "val_loss" in records[2] and "val_loss" not in records[1]
    assert first["val_loss"] == records[-1]["val_loss"]
    # Warmup of 5 steps from 0: the first update has learning rate 0.
    assert records[0]["lr"] == 0.0 and records[5]["lr"] > 0
    with open(tmp_path / "run.json", encoding="utf-8") as f:
        info = json.load(f)
    assert info["command"] == "prog --flag" and info["seed"] == 0
    assert os.listdir(tmp_path / "tb")
    # Re-running a finished run resumes at its end and has nothing left to do.
    again = train(config, str(tmp_path))
    assert again["resumed_from"] == 6 and again["step"] == 6
    assert again["val_loss"] == first["val_loss"]
    assert read_metrics(tmp_path) == records
    # run.json describes the newest start and keeps the earlier one.
    with open(tmp_path / "run.json", encoding="utf-8") as f:
        resumed = json.load(f)
    assert resumed["resumed_from_step"] == 6 and resumed["init_from"] is None
    (earlier,) = resumed["earlier_starts"]
    assert earlier["command"] == "prog --flag" and earlier["resumed_from_step"] is None
    assert earlier["started"] == info["started"] and "config" not in earlier


def _checkpoint_arrays(workdir, step):
    mgr = CheckpointManager(str(workdir / "checkpoints"))
    return mgr._orbax().restore(mgr.path(step))


def test_nonfinite_update_is_skipped_and_counted(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(_loop, "make_train_step", nan_at_update(3))
    config = resolve(
        SMOKE,
        [
            *QUIET,
            "train.steps=4",
            "train.checkpoint_every=1",
            "train.keep_checkpoints=5",
            "train.eval_every=4",
            "train.on_nonfinite=skip",
        ],
    )
    summary = train(config, str(tmp_path))
    assert summary["skipped_steps"] == 1
    # Said at the end, as a run whose every update is skipped would otherwise end quietly.
    assert "warning: 1 of the run's 4 updates were non-finite and skipped" in (
        capsys.readouterr().err
    )
    records = read_metrics(tmp_path)
    assert [r["skipped_steps"] for r in records] == [0, 0, 1, 1]
    assert records[2]["loss"] == "nan" and math.isfinite(records[3]["loss"])
    # The skipped update changed nothing: parameters and optimiser state after step 3
    # are those after step 2, bit for bit (only the step counters differ).
    after2, after3 = _checkpoint_arrays(tmp_path, 2), _checkpoint_arrays(tmp_path, 3)
    differ = [k for k in after2 if not np.array_equal(after2[k], after3[k])]
    leaves = CheckpointManager(str(tmp_path / "checkpoints")).read_marker(3)["leaves"]
    assert [leaves[int(k)]["path"] for k in differ] == [".step", ".skipped"]
    # ... while the update of step 4 did change them.
    after4 = _checkpoint_arrays(tmp_path, 4)
    assert not np.array_equal(after3["000000"], after4["000000"])


def test_a_skip_run_with_a_nonfinite_validation_loss_resumes(tmp_path, capsys):
    """A run that diverged under ``on_nonfinite=skip`` logs its validation loss as
    "nan"; resuming it (longer, or with nothing left to do) read that string back as a
    number to compare, and ended in a TypeError (exit 1): the run could not go on."""
    sets = [*QUIET, "train.on_nonfinite=skip", "optimiser.learning_rate=1e30"]
    sets += ["optimiser.clip_norm=none", "train.eval_every=2", "train.checkpoint_every=2"]
    train(resolve(SMOKE, [*sets, "train.steps=4"]), str(tmp_path))
    assert any(r.get("val_loss") == "nan" for r in read_metrics(tmp_path))
    summary = train(resolve(SMOKE, [*sets, "train.steps=6"]), str(tmp_path),
                    allow_config_change=True)  # fmt: skip
    assert summary["step"] == 6 and math.isnan(summary["val_loss"])
    again = train(resolve(SMOKE, [*sets, "train.steps=6"]), str(tmp_path))  # nothing to do
    assert again["step"] == 6 and math.isnan(again["val_loss"])
    assert "val loss n/a" in capsys.readouterr().out


def test_nonfinite_update_aborts_without_checkpointing_it(tmp_path, monkeypatch):
    monkeypatch.setattr(_loop, "make_train_step", nan_at_update(3))
    overrides = [*QUIET, "train.steps=4", "train.checkpoint_every=1"]
    config = resolve(SMOKE, overrides)
    with pytest.raises(NonFiniteError) as e:
        train(config, str(tmp_path / "lib"))
    # (The command line maps it to ExitCode.NON_FINITE like every TrainingError; see
    # test_solver_failure_is_named_with_step_and_message for that path.)
    assert e.value.exit_code == ExitCode.NON_FINITE
    assert e.value.step == 3 and e.value.source == "loss"
    assert "non-finite loss at training step 3" in str(e.value)
    assert "EQX_ON_ERROR" not in str(e.value)
    # Clipping is on by default (1.0): the advice is to lower it, not to enable it.
    assert "Lower optimiser.learning_rate, lower optimiser.clip_norm (now 1)," in str(e.value)
    assert "enable optimiser.clip_norm" in str(NonFiniteError(3, "loss"))
    # Under EQX_ON_ERROR=nan a failed solve is a NaN loss: the message says so.
    monkeypatch.setenv("EQX_ON_ERROR", "nan")
    assert "a failed solve is NaN too: run without it" in str(NonFiniteError(3, "loss"))
    step_2 = str(tmp_path / "lib" / "checkpoints" / "step_2")
    assert e.value.checkpoint == step_2
    assert f"The last checkpoint, {step_2}, is finite and is the resume point" in str(e.value)
    assert CheckpointManager(str(tmp_path / "lib" / "checkpoints")).steps() == [1, 2]
    assert [r["step"] for r in read_metrics(tmp_path / "lib")] == [1, 2]


@pytest.mark.slow
def test_an_overflowing_optimiser_state_is_found_at_its_step(tmp_path):
    """A gradient finite in every entry but large enough for Adam's second moment to
    overflow leaves the parameters finite (the update m / sqrt(inf) is zero) and the
    optimiser state not: the step names it at once, rather than the run going on with
    parameters that no longer move until a checkpoint refuses to be written."""
    overrides = [*QUIET, "train.steps=2", "objective.control_size=1e30"]
    config = resolve(SMOKE, [*overrides, "optimiser.clip_norm=none"])
    with pytest.raises(NonFiniteError) as e:
        train(config, str(tmp_path / "run"))
    assert e.value.step == 1 and e.value.source == "optimiser state"
    assert CheckpointManager(str(tmp_path / "run" / "checkpoints")).steps() == []


def test_an_overflowing_optimiser_state_is_skipped_under_skip(tmp_path, capsys):
    """``on_nonfinite=skip`` skips an update whose loss is finite but whose optimiser
    state overflowed (each update here): the run ends with every update skipped and
    its parameters and optimiser state those it started with, which checkpoint."""
    steps = 3
    overrides = [*QUIET, f"train.steps={steps}", "train.checkpoint_every=1"]
    overrides += ["objective.control_size=1e30", "optimiser.clip_norm=none"]
    summary = train(resolve(SMOKE, [*overrides, "train.on_nonfinite=skip"]), str(tmp_path))
    assert summary["skipped_steps"] == steps
    assert all(math.isfinite(r["loss"]) for r in read_metrics(tmp_path))
    first, last = _checkpoint_arrays(tmp_path, 1), _checkpoint_arrays(tmp_path, steps)
    leaves = CheckpointManager(str(tmp_path / "checkpoints")).read_marker(steps)["leaves"]
    differ = [leaves[int(k)]["path"] for k in first if not np.array_equal(first[k], last[k])]
    assert differ == [".step", ".skipped"]


def test_checkpoint_with_nonfinite_values_is_never_written(tmp_path):
    mgr = CheckpointManager(str(tmp_path), keep=2)
    mgr.save(1, {"w": np.ones(3)})
    with pytest.raises(NonFiniteCheckpointError, match=r"step 2: leaf \['w'\] holds NaN"):
        mgr.save(2, {"w": np.array([1.0, np.nan, 0.0])})
    with pytest.raises(NonFiniteCheckpointError):
        mgr.save(3, {"w": np.array([np.inf])})
    # bfloat16 too (NumPy does not count it as inexact: its NaN passed as finite).
    with pytest.raises(NonFiniteCheckpointError, match=r"step 4: leaf \['w'\] holds NaN"):
        mgr.save(4, {"w": np.array([1.0, np.nan]).astype(jnp.bfloat16)})
    assert mgr.steps() == [1] and os.listdir(tmp_path) == ["step_1"]


def test_checkpoints_take_the_primary_process_and_barrier_of_their_run(tmp_path):
    """Which process commits a checkpoint and how the processes wait for each other are
    the run's (the distributed layer's, through ``RunDirectory``), not the checkpoint
    manager's own: a secondary process writes its pieces and commits nothing, and every
    process passes the same two barriers around a save."""
    from ocformer.training import RunDirectory

    names = {"primary": [], "secondary": []}
    primary = CheckpointManager(str(tmp_path / "a"), primary=True, barrier=names["primary"].append)
    secondary = CheckpointManager(
        str(tmp_path / "b"), primary=False, barrier=names["secondary"].append
    )
    primary.save(4, {"w": np.ones(3)})
    secondary.save(4, {"w": np.ones(3)})
    assert primary.steps() == [4] and secondary.steps() == []  # no marker: not committed
    expected = ["ocformer:checkpoint:4:cleared", "ocformer:checkpoint:4:committed"]
    assert names["primary"] == names["secondary"] == expected
    # The run directory hands its own primary flag and barrier to its checkpoints.
    seen = []
    config = resolve(SMOKE, ["train.steps=1"])
    with RunDirectory(tmp_path / "run", barrier=seen.append) as run:
        run.start(config, {"w": np.zeros(3)}, keep_checkpoints=2)
        assert run.checkpoints is not None and run.checkpoints.primary
        run.save(1, {"w": np.ones(3)}, config)
    assert seen[-2:] == ["ocformer:checkpoint:1:cleared", "ocformer:checkpoint:1:committed"]


def test_validation_metrics_and_a_failed_solve_are_reported_in_one_way():
    """The loop's metrics log and ``evaluate`` name validation metrics and describe a
    failed solve with one function each: the means as ``val_*``, and diffrax's message
    without equinox's stack and notes."""
    import equinox as eqx

    from ocformer.training import SolverFailure, validation_metrics

    records = [
        {"loss": 1.0, "task_loss": 0.5, "accuracy": 0.25},
        {"loss": 3.0, "task_loss": 1.5, "accuracy": 0.75},
    ]
    assert validation_metrics(records) == {
        "val_objective": 2.0,
        "val_loss": 1.0,
        "val_accuracy": 0.5,
    }
    message = "The maximum number of solver steps was reached."
    failing = eqx.filter_jit(lambda x: eqx.error_if(x, x > 0, message))
    with pytest.raises(eqx.EquinoxRuntimeError) as raised:
        failing(jnp.asarray(1.0))
    failure = SolverFailure.from_error(7, raised.value)
    assert failure.step == 7 and failure.solver_message == message
    assert str(failure).startswith(f"the ODE solve failed at training step 7: {message} Loosen")


@pytest.mark.slow
def test_solver_failure_is_named_with_step_and_message(tmp_path, capsys):
    """An adaptive solve whose tolerance cannot be met in float32 runs out of steps: the
    run stops with SolverFailure (exit 3), not with NaN."""
    argv = ["--config", SMOKE, "--workdir", str(tmp_path)]
    for o in [
        *QUIET,
        "train.steps=2",
        "discretisation.stepper=heun",
        "discretisation.stepsize=pid",
        "discretisation.rtol=1e-14",
        "discretisation.atol=1e-14",
    ]:
        argv += ["--set", o]
    assert cli.main(argv) == ExitCode.SOLVER_FAILURE == 3
    err = capsys.readouterr().err
    assert "SolverFailure: the ODE solve failed at training step 1" in err
    assert "maximum number of solver steps" in err
    assert CheckpointManager(str(tmp_path / "checkpoints")).steps() == []


class _Text(AbstractTextTask):
    """A text task of the symbols ``a`` and ``b``, for what only encodes and decodes (its
    batches repeat one text)."""

    kind, vocab_size, seq_len = "lm", 2, 8

    def batch(self, split, index, batch_size, seed):
        inputs = np.tile(np.array([0, 1, 1, 0, 1, 0, 0, 1], np.int32), (batch_size, 1))
        return {"inputs": inputs, "targets": np.roll(inputs, -1, axis=1)}

    def encode(self, text):
        if set(text) - {"a", "b"}:
            raise ValueError(f"characters {sorted(set(text) - {'a', 'b'})} are not in 'ab'.")
        return np.array([text.index(c) for c in text], np.int32)

    def decode(self, tokens):
        return "".join("ab"[t] for t in tokens)


@pytest.mark.parametrize(
    ("prompt", "words"),
    [("", ["'' encodes to no symbols", "such as 'abbabaab'", "set train.sample_tokens=0"]),
     ("abc", ["'abc' cannot be encoded: characters ['c'] are not in 'ab'; or set"])],
)  # fmt: skip
def test_a_prompt_the_task_cannot_encode_is_refused_before_the_run(prompt, words):
    """Sampling's prompt is checked when the run is built, not at its first evaluation
    after steps of training."""
    config = resolve(SMOKE, ["train.sample_tokens=5", f"train.sample_prompt={prompt}"])
    with pytest.raises(ConfigError) as e:
        build(config, task=_Text())
    assert e.value.field == "train.sample_prompt"
    for word in words:
        assert word in str(e.value)


def test_a_failed_sampling_solve_is_a_solver_failure():
    """Sampling solves at sequence lengths the training never ran: a solve that fails
    there is a SolverFailure of the step (exit code 3), not a raw runtime error."""

    class Failing:
        def generate(self, key, prompt, n, temperature, vocab_size=None):
            raise eqx.EquinoxRuntimeError("The maximum number of solver steps was reached.")

    evaluation = _loop._Evaluation.__new__(_loop._Evaluation)
    evaluation.task, evaluation.layout = _Text(), types.SimpleNamespace(processes=1)
    evaluation.ternary = None
    evaluation.tc = resolve(SMOKE, ["train.sample_tokens=5", "train.sample_prompt=ab"]).train
    with pytest.raises(SolverFailure) as e:
        evaluation.sample(Failing(), jr.key(0), 7)
    assert e.value.step == 7 and "maximum number of solver steps" in str(e.value)


def test_schedule_is_warmup_then_cosine():
    cfg = OptimiserConfig(learning_rate=1e-3, warmup_steps=10, end_lr_ratio=0.1)
    lr = make_schedule(cfg, total_steps=110)
    assert float(lr(0)) == 0.0
    np.testing.assert_allclose(float(lr(5)), 0.5e-3, rtol=1e-6)
    np.testing.assert_allclose(float(lr(10)), 1e-3, rtol=1e-6)
    # Half-way through the decay: end + (peak - end) * (1 + cos(pi/2)) / 2.
    np.testing.assert_allclose(float(lr(60)), 1e-4 + 0.9e-3 * 0.5, rtol=1e-5)
    np.testing.assert_allclose(float(lr(110)), 1e-4, rtol=1e-5)
    const = make_schedule(OptimiserConfig(learning_rate=2e-3, schedule="constant"), 100)
    assert float(const(0)) == float(const(99)) == 2e-3


def test_resume_drops_samples_written_after_the_checkpoint(tmp_path):
    from ocformer.training._metrics import rewind_samples

    path = tmp_path / "samples.txt"
    path.write_text("=== step 10 ===\nabc\n\n=== step 20 ===\nde\nf\n\n=== step 30 ===\nxyz\n\n")
    rewind_samples(str(path), 20)
    assert path.read_text() == "=== step 10 ===\nabc\n\n=== step 20 ===\nde\nf\n\n"
    rewind_samples(str(path), 25)  # nothing after the checkpoint: unchanged
    assert path.read_text().count("=== step") == 2
    rewind_samples(str(path), 5)
    assert path.read_text() == ""


def test_nonfinite_abort_before_any_checkpoint_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(_loop, "make_train_step", nan_at_update(2))
    argv = ["--config", SMOKE, "--workdir", str(tmp_path / "run")]
    for o in [*QUIET, "train.steps=4", "train.checkpoint_every=3"]:
        argv += ["--set", o]
    assert cli.main(argv) == ExitCode.NON_FINITE == 4
    err = capsys.readouterr().err
    assert "non-finite loss at training step 2" in err
    assert "No checkpoint has been written yet: a re-run starts from step 0" in err
    assert "last checkpoint" not in err and "Traceback" not in err
    assert CheckpointManager(str(tmp_path / "run" / "checkpoints")).steps() == []


def test_zero_steps_summary_lists_only_existing_files(tmp_path, capsys):
    config = resolve(SMOKE, [*QUIET, "train.steps=0"])
    summary = train(config, str(tmp_path / "run"))
    out = capsys.readouterr().out
    assert summary["step"] == 0 and summary["metrics"] is None and summary["checkpoint"] is None
    assert "metrics.jsonl" not in out and "checkpoint" not in out
    assert not os.path.exists(tmp_path / "run" / "metrics.jsonl")
    for key in ("metrics", "tensorboard", "checkpoint", "samples"):
        assert summary[key] is None or os.path.exists(summary[key]), key


def test_a_field_the_run_does_not_read_is_warned_of_at_its_start(tmp_path, capsys):
    """Accepted (a sweep's axis may set it everywhere) and named with why, on stderr."""
    train(resolve(SMOKE, [*QUIET, "train.steps=0", "optimiser.momentum=0.5"]), str(tmp_path))
    err = capsys.readouterr().err
    assert "warning: optimiser.momentum is set but not read: only sgd has a momentum" in err
    train(resolve(SMOKE, [*QUIET, "train.steps=0"]), str(tmp_path / "plain"))
    assert "is set but not read" not in capsys.readouterr().err


def test_an_interrupted_run_names_its_resume_point(tmp_path, monkeypatch, capsys):
    """Ctrl-C writes no checkpoint of its own: its line names the newest committed one,
    which a rerun resumes from (or says that there is none yet)."""
    workdir = str(tmp_path / "run")
    argv = ["--config", SMOKE, "--workdir", workdir, "--set", "train.progress=false"]
    argv += ["--set", "train.steps=3", "--set", "train.checkpoint_every=2"]

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_train", interrupted)
    assert cli.main(argv) == 130
    assert "interrupted; nothing was trained" in capsys.readouterr().err
    monkeypatch.undo()
    assert cli.main(argv) == 0
    # As if stopped before the last checkpoint (step 3) committed.
    shutil.rmtree(os.path.join(workdir, "checkpoints", "step_3"))
    capsys.readouterr()
    monkeypatch.setattr(cli, "_train", interrupted)
    assert cli.main(argv) == 130
    err = capsys.readouterr().err
    assert f"newest committed checkpoint is step 2 ({workdir}/checkpoints/step_2)" in err
    assert "re-run the same command to resume from it" in err
    shutil.rmtree(os.path.join(workdir, "checkpoints", "step_2"))
    assert cli.main(argv) == 130
    assert "no checkpoint was committed yet" in capsys.readouterr().err


def test_load_run_gives_the_trained_model(tmp_path):
    """The model loaded from a finished run reproduces the run's last validation loss."""
    config = resolve(SMOKE, [*QUIET, "train.steps=5", "train.eval_every=5"])
    train(config, str(tmp_path))
    last = read_metrics(tmp_path)[-1]
    loaded_config, model = load_run(tmp_path)
    assert loaded_config == config
    exp = build(loaded_config)
    evaluate = make_eval_step(exp.objective)
    t = loaded_config.task
    batches = exp.task.eval_batches(t.eval_batch_size, t.eval_batches, loaded_config.eval_seed)
    losses = [float(evaluate(model, {k: jnp.asarray(v) for k, v in b.items()})["task_loss"])
              for b in batches]  # fmt: skip
    assert jnp.asarray(model.readout.weight).dtype == jnp.float32
    np.testing.assert_allclose(np.mean(losses), last["val_loss"], rtol=1e-6)
    # ... and differs from the untrained model's by far more than that tolerance.
    untrained = [float(evaluate(exp.model, {k: jnp.asarray(v) for k, v in b.items()})["task_loss"])
                 for b in batches]  # fmt: skip
    assert abs(np.mean(untrained) - last["val_loss"]) > 1e-3
    # An earlier checkpoint by step; a step that was not kept is refused by name.
    with pytest.raises(ValueError, match=r"no committed checkpoint of step 3; committed steps"):
        load_run(tmp_path, step=3)
    # The evaluation command takes another set of validation windows: seed 0's are the
    # run's own (train.seed 0), seed 1's another set.
    from ocformer.evaluation import evaluate_run

    own = evaluate_run(str(tmp_path), ["task.eval_seed=0"])["val_loss"]
    other = evaluate_run(str(tmp_path), ["task.eval_seed=1"])["val_loss"]
    np.testing.assert_allclose(own, last["val_loss"], rtol=1e-6)
    assert abs(other - own) > 1e-4


def test_task_eval_seed_gives_runs_of_every_train_seed_one_validation_set():
    """``train.seed`` draws the validation windows unless ``task.eval_seed`` is set;
    with it set, configurations of other training seeds evaluate a model on the same
    windows (the same loss to the last bit), and another ``eval_seed`` on others."""
    from ocformer.evaluation import evaluate

    config = resolve(SMOKE, ["task.eval_batches=1", "task.eval_batch_size=4"])
    model = build(config).model

    def val_loss(*overrides):
        return evaluate(resolve(SMOKE, [*overrides, "task.eval_batches=1",
                                        "task.eval_batch_size=4"]), model)["val_loss"]  # fmt: skip

    assert val_loss("train.seed=3", "task.eval_seed=0") == val_loss("task.eval_seed=0")
    assert val_loss("train.seed=3", "task.eval_seed=0") == val_loss("train.seed=0")
    assert val_loss("train.seed=3") == val_loss("train.seed=5", "task.eval_seed=3")
    assert abs(val_loss("train.seed=3") - val_loss("train.seed=0")) > 1e-4


@pytest.mark.parametrize("norm", ["pre", "post"])
def test_kinetic_energy_comes_from_the_solve_of_the_loss(norm, monkeypatch):
    """With kappa > 0 the objective runs one diffeqsolve (as with kappa = 0), and its
    task loss is that of the plain forward pass."""
    config = resolve(SMOKE, [*QUIET, f"model.norm={norm}", "model.dtype=float64"])
    exp = build(config)
    batch = {k: jnp.asarray(v) for k, v in exp.task.batch("train", 0, 4, 0).items()}
    calls = []
    real = diffrax.diffeqsolve
    monkeypatch.setattr(diffrax, "diffeqsolve", lambda *a, **k: calls.append(1) or real(*a, **k))
    plain_loss, plain = Objective()(exp.model, batch)
    assert len(calls) == 1
    loss, metrics = Objective(kinetic_energy=0.5)(exp.model, batch)
    assert len(calls) == 2
    assert abs(float(metrics["task_loss"]) - float(plain["task_loss"])) < 1e-12
    expect = float(plain_loss) + 0.5 * float(metrics["kinetic_energy"])
    assert abs(float(loss) - expect) < 1e-12 and float(metrics["kinetic_energy"]) > 0.01


def test_prefetch_keeps_order_raises_in_the_loop_and_stops():
    """Batches come in order whatever the producer's timing; an error making batch n
    is raised when batch n is asked for (not before); closing stops a producer that
    waits on a full queue."""
    import threading
    import time

    made = []

    def produce(n):
        time.sleep(0.01 * (n % 3))
        if n == 5:
            raise FileNotFoundError("batch 5 is missing")
        made.append(n)
        return {"n": n}

    with _loop._Prefetch(produce, 2, 9, depth=2) as prefetch:
        assert [prefetch.get(n)["n"] for n in (2, 3, 4)] == [2, 3, 4]
        with pytest.raises(FileNotFoundError, match="batch 5 is missing"):
            prefetch.get(5)
    assert made == [2, 3, 4]
    assert prefetch.wait_s > 0
    blocked = _loop._Prefetch(lambda n: n, 0, 1000, depth=1)
    time.sleep(0.1)  # the producer fills the queue and waits
    blocked.close()
    assert not blocked.thread.is_alive()
    assert not any(t.name == "ocformer-prefetch" and t.is_alive() for t in threading.enumerate())


def test_tensorboard_scalars_are_written_without_importing_torch(tmp_path):
    """tensorboardX imports PyTorch when it is installed (benchmarks/README.md, end to end);
    the run's writer loads it with ``torch`` hidden. Here a ``torch`` that ends the
    process on import stands for an installed PyTorch."""
    import subprocess
    import sys

    fake = tmp_path / "site"
    fake.mkdir()
    (fake / "torch.py").write_text("raise SystemExit('torch was imported')\n")
    code = (
        "import sys\n"
        "from ocformer.training._metrics import TensorBoard\n"
        "tb = TensorBoard(sys.argv[1], None)\n"
        "tb.scalars(3, {'step': 3, 'loss': 1.5, 'val_loss': float('nan')})\n"
        "tb.close()\n"
        "print('torch' in sys.modules)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(fake), ROOT])}
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "tb")],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "False"
    # A NaN is written as it is, without tensorboardX's warning for each one (a run
    # that skips non-finite updates logs them on purpose).
    assert "NaN or Inf" not in done.stderr, done.stderr
    (events,) = list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert _scalars(events) == {("loss", 3): 1.5, ("val_loss", 3): "nan"}


def _scalars(path) -> dict:
    """{(tag, step): value} of an event file (TFRecord: length, CRC, event, CRC), NaN
    as "nan" (NaN != NaN)."""
    import math
    import struct

    from tensorboardX.proto import event_pb2

    data, out, at = path.read_bytes(), {}, 0
    while at < len(data):
        (length,) = struct.unpack("<Q", data[at : at + 8])
        event = event_pb2.Event.FromString(data[at + 12 : at + 12 + length])
        at += 12 + length + 4
        for v in event.summary.value:
            out[v.tag, event.step] = "nan" if math.isnan(v.simple_value) else v.simple_value
    return out


def test_a_tensorboard_write_that_fails_raises_instead_of_blocking_the_run(tmp_path):
    """A full disk under the TensorBoard directory: the write fails in the run's own
    thread and raises. (tensorboardX's SummaryWriter wrote from a thread, which died of
    the error while the run blocked on its full queue, with no message, until killed.)"""
    import subprocess
    import sys

    code = (
        "import errno, sys\n"
        "from tensorboardX import record_writer\n"
        "from ocformer.training._metrics import TensorBoard\n"
        "tb = TensorBoard(sys.argv[1], None)\n"
        "def full(self, data):\n"
        "    raise OSError(errno.ENOSPC, 'No space left on device')\n"
        "record_writer.RecordWriter.write = full\n"
        "try:\n"
        "    for step in range(100):\n"
        "        tb.scalars(step, {f'metric{i}': 1.0 for i in range(20)})\n"
        "except OSError as e:\n"
        "    print('raised', e.errno == errno.ENOSPC)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "tb")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "raised True"


def test_the_sigterm_grace_period_runs_out_inside_a_long_compiled_computation():
    """Python runs a signal's handler only once the main thread is back in Python code;
    a compiled computation that runs synchronously (one with a host callback, as an
    adaptive solve's error check) held the SIGTERM handler, and with it the grace
    period's timer, until it ended. The guard's watchdog reads the signal from the
    interpreter's wake-up pipe: the process ends at the grace period (exit 143)."""
    import signal
    import subprocess
    import sys

    code = (
        "import jax, jax.numpy as jnp\n"
        "from ocformer.training._preempt import PreemptionGuard\n"
        "@jax.jit\n"
        "def long(x):\n"
        "    y = jax.lax.fori_loop(0, 2_000_000, lambda i, y: jnp.sin(y @ y) / 64.0, x)\n"
        "    jax.debug.callback(lambda v: None, y[0, 0])\n"
        "    return y\n"
        "x = jnp.ones((64, 64))\n"
        "long.lower(x).compile()\n"
        "with PreemptionGuard(1.0, lambda: 'No checkpoint was committed yet.'):\n"
        "    print('running', flush=True)\n"
        "    long(x).block_until_ready()\n"
        "print('finished', flush=True)\n"
    )
    run = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert run.stdout is not None and run.stdout.readline().strip() == "running"
    time.sleep(0.5)
    run.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    out, err = run.communicate(timeout=300)
    assert run.returncode == 143, (out, err[-2000:])
    assert "grace period of 1.0s expired" in err and "finished" not in out
    # Where a rerun resumes, as the run knows it (it named "the previous checkpoint" of
    # a run that had none).
    assert "exiting. No checkpoint was committed yet." in err, err[-2000:]
    assert time.monotonic() - sent < 10  # the computation alone takes far longer


def test_a_forked_child_s_sigterm_is_not_a_request_to_stop_the_parent():
    """A child forked while the guard is active (a ``multiprocessing`` worker of task
    code, which ``terminate`` ends with SIGTERM) would write its signal into the
    parent's wake-up pipe, and the parent would stop as if preempted; the child drops
    the pipe. A second signal while the first is being noted does not deadlock."""
    import subprocess
    import sys

    code = (
        "import os, signal, time\n"
        "from ocformer.training._preempt import PreemptionGuard\n"
        "with PreemptionGuard(60.0) as guard:\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        os.kill(os.getpid(), signal.SIGTERM)\n"
        "        time.sleep(0.2)\n"
        "        os._exit(0)\n"
        "    os.waitpid(pid, 0)\n"
        "    time.sleep(0.5)\n"
        "    print('parent requested', guard.requested, flush=True)\n"
        "    with guard._lock:\n"
        "        guard._handle(signal.SIGTERM, None)\n"
        "    print('noted', guard.requested, flush=True)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[:2] == ["parent requested False", "noted True"]


def test_slurms_warning_signal_asks_the_run_to_stop_like_sigterm():
    """SLURM signals every process of a job step with SIGUSR2 ahead of its time limit
    (``--signal=USR2@90``): the run takes it as SIGTERM, a request to checkpoint and
    stop, rather than dying of its default action; the handlers are put back after."""
    import signal

    from ocformer.training import _preempt

    before = signal.getsignal(signal.SIGUSR2)
    for signum in (signal.SIGUSR2, signal.SIGTERM):
        with _preempt.PreemptionGuard(60.0) as guard:
            assert not guard.requested
            signal.raise_signal(signum)
            assert guard.requested
        assert guard._timer is not None and guard._timer.finished.is_set()  # cancelled
    assert signal.getsignal(signal.SIGUSR2) == before


def test_a_ctrl_c_during_a_checkpoint_save_comes_at_its_end(monkeypatch):
    """An interrupt inside orbax's save would leave its threads and event loops broken
    (tracebacks after the run's last line, an uncommitted save): the loop holds a
    Ctrl-C that comes during a save until the save has finished."""
    import signal

    from ocformer.training import _preempt

    monkeypatch.setattr(_preempt, "_exit_on_second_interrupt", False)
    finished = []
    with _preempt.PreemptionGuard(60.0) as guard:
        with pytest.raises(KeyboardInterrupt), guard.holding_interrupts():
            signal.raise_signal(signal.SIGINT)
            finished.append("the save")  # not cut short
        assert finished == ["the save"]
        with pytest.raises(KeyboardInterrupt):  # outside a save, at once
            signal.raise_signal(signal.SIGINT)


def test_a_ctrl_c_during_a_write_of_the_records_comes_at_its_end(tmp_path, monkeypatch):
    """TensorBoard's writer hands each event to a thread through a condition variable,
    and a Ctrl-C raised inside its ``notify`` can lose that thread's wake-up: the run's
    close then waited for ever on the thread (one Ctrl-C, a command that never ended).
    A Ctrl-C during a write of the step's records comes at the write's end: the record
    is whole in both files, and the run stops there."""
    import signal

    from ocformer.training import _metrics, _preempt

    monkeypatch.setattr(_preempt, "_exit_on_second_interrupt", False)
    written = []
    scalars = _metrics.TensorBoard.scalars

    def interrupted(self, step, record):
        if step == 2:
            signal.raise_signal(signal.SIGINT)  # its handler runs before the next line
        scalars(self, step, record)
        written.append(step)

    monkeypatch.setattr(_metrics.TensorBoard, "scalars", interrupted)
    config = resolve(SMOKE, [*QUIET, "train.steps=5", "train.eval_every=5"])
    with pytest.raises(KeyboardInterrupt):
        train(config, str(tmp_path))
    assert written == [1, 2]
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]


def test_a_ctrl_c_that_python_ignores_still_stops_the_run():
    """A Ctrl-C whose handler runs inside a garbage-collection callback (jax registers
    one) raised there, and Python printed and ignored it: the run went on to its end
    and exit code 0. Now it raises nothing there, and the loop, asking the guard at
    every step, stops. (In a process of its own: pytest reports ignored exceptions.)"""
    import subprocess
    import sys

    code = (
        "import gc, signal\n"
        "from ocformer.training import _preempt\n"
        "def callback(phase, info):\n"
        "    if phase == 'start':\n"
        "        signal.raise_signal(signal.SIGINT)\n"
        "        sum(range(10))  # the handler runs at a bytecode boundary in here\n"
        "with _preempt.PreemptionGuard(60.0) as guard:\n"
        "    gc.callbacks.append(callback)\n"
        "    gc.collect()\n"
        "    gc.callbacks.remove(callback)\n"
        "    print('lost', flush=True)\n"
        "    try:\n"
        "        guard.check_interrupted()\n"
        "    except KeyboardInterrupt:\n"
        "        print('raised', flush=True)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["lost", "raised"], (done.stdout, done.stderr[-2000:])
    assert "Exception ignored" not in done.stderr, done.stderr  # not raised in there


def test_a_ctrl_c_while_the_command_starts_is_noted_and_stops_the_run():
    """Before the loop's guard, the command line's own handler (``record_interrupts``):
    while JAX imports it only notes a Ctrl-C (Python's handler raised it inside the
    import: a long traceback, and the runtime aborted at exit), and once the imports
    are done it raises, except inside a garbage-collection callback, where it is noted
    and raised once the callback has returned (it was printed and ignored there), and
    the guard, when the run starts, stops the run at its first step."""
    import subprocess
    import sys

    code = (
        "import gc, signal, time\n"
        "from ocformer import _cli\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)  # not ignored\n"
        "_cli.record_interrupts()\n"
        "signal.raise_signal(signal.SIGINT)  # importing: noted only\n"
        "sum(range(10))\n"
        "print('noted', _cli.interrupted(), flush=True)\n"
        "_cli.raise_interrupts()\n"
        "def callback(phase, info):\n"
        "    if phase == 'start':\n"
        "        signal.raise_signal(signal.SIGINT)\n"
        "        sum(range(10))  # the handler runs at a bytecode boundary in here\n"
        "gc.callbacks.append(callback)\n"
        "try:\n"
        "    gc.collect()  # not raised in the callback (it would print 'Exception ignored')\n"
        "    time.sleep(5)\n"
        "    print('not raised', flush=True)\n"
        "except KeyboardInterrupt:\n"
        "    print('raised once it returned', flush=True)\n"
        "gc.callbacks.remove(callback)\n"
        "from ocformer.training import _preempt\n"
        "with _preempt.PreemptionGuard(60.0) as guard:\n"
        "    try:\n"
        "        guard.check_interrupted()\n"
        "    except KeyboardInterrupt:\n"
        "        print('the run stops', flush=True)\n"
        "try:\n"
        "    signal.raise_signal(signal.SIGINT)\n"
        "    sum(range(10))\n"
        "except KeyboardInterrupt:\n"
        "    print('raised', flush=True)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == [
        "noted True", "raised once it returned", "the run stops", "raised",
    ], (done.stdout, done.stderr[-2000:])  # fmt: skip
    assert "Exception ignored" not in done.stderr, done.stderr


def test_a_retried_ctrl_c_reaches_the_handler_installed_since_once():
    """A Ctrl-C noted in a garbage-collection callback is raised again once it returns,
    in whichever handler the command has installed by then: the training loop's guard
    (which took it from ``interrupted``) does not count it as a second Ctrl-C, which
    would end the run at once; a sweep's stop handler, which had not seen it, stops the
    sweep (it was lost). A command whose ``main`` returns just after one ends without
    the traceback of a retry raised during the interpreter's shutdown."""
    import subprocess
    import sys

    code = (
        "import gc, signal, sys, time\n"
        "from ocformer import _cli\n"
        "from ocformer.sweeping import _run\n"
        "from ocformer.training import _preempt\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)  # not ignored\n"
        "_cli.record_interrupts()\n"
        "_cli.raise_interrupts()\n"
        "_preempt.exit_on_second_interrupt()\n"
        "def ctrl_c_in_gc():\n"
        "    def callback(phase, info):\n"
        "        if phase == 'start':\n"
        "            signal.raise_signal(signal.SIGINT)\n"
        "            sum(range(10))\n"
        "    gc.callbacks.append(callback)\n"
        "    gc.collect()\n"
        "    gc.callbacks.remove(callback)\n"
        "ctrl_c_in_gc()\n"
        "with _preempt.PreemptionGuard(60.0) as guard:  # before the retry comes\n"
        "    time.sleep(0.3)\n"
        "    try:\n"
        "        guard.check_interrupted()\n"
        "    except KeyboardInterrupt:\n"
        "        print('the run stops at its step', flush=True)\n"
        "ctrl_c_in_gc()\n"
        "with _run._stop_on_signals():\n"
        "    time.sleep(0.3)\n"
        "    print('the sweep stops', _run._stopping['signal'] == signal.SIGINT, flush=True)\n"
        "def main():\n"
        "    ctrl_c_in_gc()\n"
        "    return 0\n"
        "_cli.exit_with(main)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["the run stops at its step", "the sweep stops True"], (
        done.stdout, done.stderr[-2000:]
    )  # fmt: skip
    assert "Exception ignored" not in done.stderr and "Traceback" not in done.stderr, done.stderr


def _ctrl_c(cmd: list[str], after_s: float = 0.0) -> tuple[int, str, str]:
    """Run ``cmd`` and send it a Ctrl-C, as at a terminal, ``after_s`` seconds after
    jaxlib's library is mapped (while JAX imports, for 0: the command's handler is
    installed before JAX is imported); its exit code, stdout and stderr."""
    import signal
    import subprocess
    import time

    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        # Ctrl-C as at a terminal (a suite started in the background ignores it).
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        with open(f"/proc/{proc.pid}/maps") as f:
            if "jaxlib" in f.read():
                break
        time.sleep(0.005)
    time.sleep(after_s)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    return proc.returncode, out, err


def test_a_ctrl_c_while_jax_imports_ends_the_command_in_one_line(tmp_path):
    """A Ctrl-C while ``python -m ocformer.train`` imports JAX ended in a traceback of
    some hundred lines and exit 134 or a segmentation fault (or, landing in JAX's
    garbage-collection callback, was ignored and the run went on): now it is the
    command's one line, exit 130, and nothing is written."""
    import sys

    workdir = tmp_path / "run"
    cmd = [sys.executable, "-m", "ocformer.train", "--config", SMOKE, "--workdir", str(workdir)]
    code, out, err = _ctrl_c([*cmd, "--set", "train.progress=false"])
    assert code == 130, (out, err[-3000:])
    assert "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1].startswith("ocformer.train: error: interrupted; "), err
    assert not workdir.exists() or "nothing was trained" in err


@pytest.mark.parametrize(
    "command",
    [
        "evaluate RUN",
        "export RUN --to OUT",
        "analysis convergence --schemes lie --steps 4,8",
        "sweep experiments/sweeps/smoke.py --workdir OUT --dry-run",
        "launch local --nproc 2 -- --config experiments/smoke.py --workdir OUT",
    ],
)
def test_every_command_ends_a_ctrl_c_while_jax_imports_in_one_line(command, tmp_path):
    """As the training command: the others too printed a long traceback, aborted or
    ran on (measured on ``evaluate``: exit 0 after a printed traceback, -2, and a
    segmentation fault, for a Ctrl-C at 0.5, 1.5 and 3 s)."""
    import sys

    name, *args = command.replace("RUN", str(tmp_path / "run")).split()
    args = [a.replace("OUT", str(tmp_path / "out")) for a in args]
    code, out, err = _ctrl_c([sys.executable, "-m", f"ocformer.{name}", *args])
    assert code == 130, (out, err[-3000:])
    assert err.strip().splitlines() == [f"ocformer.{name}: error: interrupted" + {
        "evaluate": "; nothing was written",
        "export": "; nothing was written",
        "analysis": "; no --json or --plot file is left half-written",
        "sweep": "; rerun the same command to resume",
        "launch": "",
    }[name]], err[-3000:]  # fmt: skip
    assert not (tmp_path / "out").exists()


def test_a_ctrl_c_while_a_command_computes_ends_it_in_one_line(tmp_path):
    """Interrupted while it compiles or computes, a command ended in Python's traceback
    and, with XLA's compiler threads still at work, often a segmentation fault at the
    interpreter's shutdown (exit -11)."""
    import sys

    plot = tmp_path / "orders.png"
    cmd = [sys.executable, "-m", "ocformer.analysis", "convergence", "--plot", str(plot)]
    code, out, err = _ctrl_c([*cmd, "--schemes", "lie,strang", "--steps", "4,8,16"], 1.5)
    assert code == 130, (out, err[-3000:])
    assert err.strip().splitlines()[-1] == (
        "ocformer.analysis: error: interrupted; no --json or --plot file is left half-written"
    ), err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert not plot.exists()


def test_a_library_caller_survives_a_second_interrupt(monkeypatch):
    """In a notebook a second interrupt while the run stops raises KeyboardInterrupt
    again (the kernel lives on); only the command line makes it end the process."""
    import signal

    from ocformer.training import _preempt

    monkeypatch.setattr(_preempt, "_exit_on_second_interrupt", False)
    # Python's own handler, or SIG_IGN where the suite was started in the background.
    before = signal.getsignal(signal.SIGINT)
    with _preempt.PreemptionGuard(60.0) as guard:
        assert signal.getsignal(signal.SIGINT) == guard._interrupt
        for _ in range(2):
            with pytest.raises(KeyboardInterrupt):
                signal.raise_signal(signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) == before


def test_subword_samples_are_decoded_with_their_prompt(tmp_path, capsys):
    """A WordPiece tokenizer drops whitespace, so '\\n' encodes to nothing: the refusal
    suggests a word of the corpus that encodes. A sample is decoded whole, so the
    continuation's '##' pieces join the prompt's word instead of being printed."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    r = np.random.default_rng(0)
    words = ["".join(r.choice(list("abcdefgh"), size=r.integers(3, 9))) for _ in range(400)]
    corpus = tmp_path / "c.txt"
    corpus.write_text(" ".join(words) + "\n", encoding="utf-8")
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.Whitespace(), decoders.WordPiece()
    tok.train([str(corpus)], trainers.WordPieceTrainer(vocab_size=60, special_tokens=["[UNK]"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    data = tmp_path / "data"
    prepare_text([str(corpus)], str(tmp_path / "tokenizer.json"), data, progress=False)
    sets = [
        "task.name=tokens", f"task.path={data}", "task.seq_len=8", "task.batch_size=4",
        "task.eval_batch_size=4", "task.eval_batches=1", "train.steps=1", "train.eval_every=1",
        "train.checkpoint_every=1", "train.sample_tokens=12", "train.progress=false",
    ]  # fmt: skip
    with pytest.raises(ConfigError, match="encodes to no symbols") as refused:
        build(resolve(SMOKE, [*sets, "train.sample_prompt=\n"]))
    suggested = str(refused.value).split("such as ", 1)[1].split(", or set")[0]
    assert len(tok.encode(ast.literal_eval(suggested)).ids) >= 1  # a word that encodes
    argv = ["--config", SMOKE, "--workdir", str(tmp_path / "run")]
    argv += [a for s in [*sets, f"train.sample_prompt={words[0]}"] for a in ("--set", s)]
    assert cli.main(argv) == ExitCode.OK
    sample = (tmp_path / "run" / "samples.txt").read_text(encoding="utf-8").split("\n", 1)[1]
    assert sample.startswith(words[0][:2]) and "##" not in sample, sample


def test_a_non_finite_evaluation_is_refused_with_exit_code_4(monkeypatch):
    """A NaN validation loss is no result: ``evaluate`` raises ``NonFiniteEvaluation``
    (exit code 4), and says the solve failed when its step counts hold the fill value
    that a failed solve gives under ``EQX_ON_ERROR=nan``."""
    import jax

    from ocformer.evaluation import _evaluate, evaluate
    from ocformer.training import NonFiniteEvaluation

    config = resolve(SMOKE, ["task.eval_batches=1", "task.eval_batch_size=4"])
    model = build(config).model
    nan = jax.tree.map(lambda x: x * jnp.nan if eqx.is_inexact_array(x) else x, model)
    with pytest.raises(NonFiniteEvaluation, match="diverges under this discretisation") as e:
        evaluate(config, nan)
    assert e.value.exit_code == ExitCode.NON_FINITE == 4 and not e.value.solve_failed
    assert "or its parameters give a non-finite loss under any" in str(e.value)
    failed = dict.fromkeys(("solver_steps", "accepted_steps", "rejected_steps"), 2**31 - 1)
    monkeypatch.setattr(_evaluate, "solver_stats", lambda m, b: {**failed, "nfe": None})
    with pytest.raises(NonFiniteEvaluation, match="its solve failed") as e:
        evaluate(config, nan)
    assert e.value.solve_failed
    assert np.isfinite(evaluate(config, model)["val_loss"])


@pytest.mark.parametrize(
    ("key", "words"),
    [
        ("model.widht", "unknown field model.widht; did you mean model.width?"),
        ("steps_per_layer", "give the field with its section: discretisation.steps_per_layer"),
        ("discretisaton.rtol", "unknown section discretisaton; did you mean discretisation?"),
        ("model.width", "model.width changes the trained problem itself"),
    ],
)
def test_an_evaluation_override_is_named_for_what_is_wrong_with_it(key, words):
    """A typo is a typo (with the nearest field), a field without its section is told
    its section, and only a real field outside the discretisation is "the trained
    problem"."""
    from ocformer.evaluation._evaluate import check_evaluation_field

    with pytest.raises(ConfigError, match=words.replace("?", r"\?")):
        check_evaluation_field(key)
    check_evaluation_field("discretisation.steps_per_layer")


def test_the_summarys_tensorboard_command_can_be_pasted_for_a_path_with_spaces(capsys):
    """The end-of-run summary's TensorBoard command quotes its directory: pasted into a
    shell it names the run's tb directory, not two arguments."""
    import shlex

    from ocformer.training._loop import _print_summary

    tb = "/tmp/my runs/sp ace run/tb"
    _print_summary(dict(
        step=3, wall_time_s=1.0, resumed_from=None, loss=1.0, val_loss=1.0,
        val_accuracy=None, skipped_steps=0, data_wait_fraction=0.0, time_s={},
        workdir="/tmp/my runs/sp ace run", metrics=None, tensorboard=tb, checkpoint=None,
        samples=None,
    ))  # fmt: skip
    line = next(x for x in capsys.readouterr().out.splitlines() if "tensorboard --logdir" in x)
    assert shlex.split(line.split("tensorboard  ", 1)[1]) == ["tensorboard", "--logdir", tb]
