"""Training with a depth-parallel solve, in float64 on the smoke model (2 layers): the
gradient's bias against the serial gradient, and the fallback rule."""

import dataclasses
import json
import os

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

from ocformer import train as cli
from ocformer.config import Config, ConfigError, resolve
from ocformer.training import (
    DepthFallback,
    build,
    gradient_bias,
    load_run_at,
    make_bias_step,
    train,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOKE = os.path.join(ROOT, "experiments", "smoke.py")
SMOKE64 = f"{SMOKE}:float64"
# Parareal on one chunk per layer with a coarse Euler step per chunk: K = 1 is not
# exact (2 chunks), K = 2 is.
PARAREAL = [
    "discretisation.depth_parallel=parareal",
    "discretisation.coarse_stepper=euler",
    "train.progress=false",
]


def _gradient(objective, model, batch):
    grads = eqx.filter_jit(eqx.filter_grad(lambda m, b: objective(m, b)[0]))(model, batch)
    return np.asarray(ravel_pytree(eqx.filter(grads, eqx.is_inexact_array))[0])


def test_gradient_bias_is_the_cosine_and_relative_norm_of_the_flattened_trees():
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    g = {"a": jax.random.normal(keys[0], (3, 4)), "b": (jax.random.normal(keys[1], (5,)), None)}
    r = {"a": jax.random.normal(keys[2], (3, 4)), "b": (jax.random.normal(keys[3], (5,)), None)}
    x, y = np.asarray(ravel_pytree(g)[0]), np.asarray(ravel_pytree(r)[0])
    got = {k: float(v) for k, v in gradient_bias(g, r).items()}
    assert got["grad_cosine"] == pytest.approx(
        x @ y / np.linalg.norm(x) / np.linalg.norm(y), rel=1e-13
    )
    assert got["grad_rel_norm"] == pytest.approx(
        np.linalg.norm(x - y) / np.linalg.norm(y), rel=1e-13
    )
    assert float(gradient_bias(r, r)["grad_cosine"]) == pytest.approx(1.0, abs=1e-15)


# A few parareal gradient programs compile here (about 25 s of CPU): marked slow.
@pytest.mark.slow
@pytest.mark.parametrize("iterations, exact", [(1, False), (2, True)])
def test_bias_metrics_equal_the_direct_cosine_and_relative_norm(iterations, exact):
    parallel = build(resolve(SMOKE64, [*PARAREAL, f"discretisation.iterations={iterations}"]))
    serial = build(resolve(SMOKE64, ["train.progress=false"]))  # the same seed and batch
    batch = {k: jnp.asarray(v) for k, v in parallel.task.batch("train", 0, 4, 0).items()}
    got = {
        k: float(v) for k, v in make_bias_step(parallel.objective)(parallel.model, batch).items()
    }
    g = _gradient(parallel.objective, parallel.model, batch)
    r = _gradient(serial.objective, serial.model, batch)
    cosine = float(g @ r / (np.linalg.norm(g) * np.linalg.norm(r)))
    rel = float(np.linalg.norm(g - r) / np.linalg.norm(r))
    assert got["grad_cosine"] == pytest.approx(cosine, rel=1e-12, abs=1e-14)
    assert got["grad_rel_norm"] == pytest.approx(rel, rel=1e-10, abs=1e-14)
    if exact:  # K = N: the serial gradient to rounding
        assert rel < 1e-12
    else:  # a bias the metrics can see
        assert rel > 1e-4 and cosine < 1 - 1e-8


def _records(workdir) -> dict[int, dict]:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return {r["step"]: r for r in map(json.loads, f)}


def _steps(config, steps: int):
    return dataclasses.replace(config, train=dataclasses.replace(config.train, steps=steps))


@pytest.mark.slow
def test_fallback_fires_and_the_run_continues_as_a_serial_run_from_that_state(tmp_path):
    common = [*PARAREAL, "train.checkpoint_every=2", "train.eval_every=2", "train.steps=4"]
    # The cosine is below 1 at the first bias check (step 2), so the rule fires there.
    fallback = resolve(SMOKE64, [*common, "train.depth_bias_every=2",
                                 "train.depth_fallback=serial",
                                 "train.depth_fallback_cosine=1.0"])  # fmt: skip
    a = str(tmp_path / "a")
    train(fallback, a)
    records = _records(a)
    assert records[2]["grad_cosine"] < 1.0 and records[2]["depth_fallback_iterations"] == 0
    assert "grad_cosine" not in records[4]  # serial: nothing left to measure
    # The same two depth-parallel steps, then the serial solve from their checkpoint.
    b = str(tmp_path / "b")
    train(resolve(SMOKE64, [*common, "train.steps=2"]), b)
    serial = resolve(SMOKE64, ["train.progress=false", "train.checkpoint_every=2",
                               "train.eval_every=2", "train.steps=4"])  # fmt: skip
    train(serial, b, allow_config_change=True)
    again = _records(b)
    for step in (1, 2, 3, 4):
        assert records[step]["loss"] == pytest.approx(again[step]["loss"], rel=1e-12)
    assert records[4]["val_loss"] == pytest.approx(again[4]["val_loss"], rel=1e-12)
    # Resumed, the fallback run keeps the serial solve that the rule left. The resume
    # validates the run's configuration again: the rule changed the solve, not the
    # configuration, whose chunk and coarse-stepper fields stay those of its parareal.
    train(_steps(fallback, 6), a, allow_config_change=True)
    train(_steps(serial, 6), b, allow_config_change=True)
    assert _records(a)[6]["loss"] == pytest.approx(_records(b)[6]["loss"], rel=1e-12)
    config, _, step = load_run_at(a)  # validates config.json and the checkpoint's own
    assert step == 6 and config.discretisation == fallback.discretisation
    # Evaluated as trained: under the serial solve the rule left (the configured
    # parareal gave another loss than the run's own), unless the solve is given.
    from ocformer.evaluation import evaluate_run

    as_trained = evaluate_run(a)
    assert as_trained["depth_fallback_iterations"] == 0
    assert as_trained["discretisation"]["discretisation.depth_parallel"] is None
    assert as_trained["val_loss"] == pytest.approx(_records(a)[6]["val_loss"], rel=1e-12)
    configured = evaluate_run(a, ["discretisation.depth_parallel=parareal"])
    assert configured["depth_fallback_iterations"] is None
    assert configured["val_loss"] != pytest.approx(as_trained["val_loss"], rel=1e-12)
    # A field of the depth-parallel solve chooses it too (it was refused: the serial
    # solve the fallback left does not take it).
    coarse = evaluate_run(a, ["discretisation.coarse_steps=2"])
    assert coarse["depth_fallback_iterations"] is None
    assert coarse["discretisation"]["discretisation.depth_parallel"] == "parareal"


def test_raise_iterations_goes_serial_once_doubling_k_would_be_exact():
    config = resolve(SMOKE64, [*PARAREAL, "discretisation.chunks=2",
                               "train.depth_fallback=raise_iterations",
                               "train.depth_fallback_patience=2"])  # fmt: skip
    model = build(config).model
    rule = DepthFallback(config.train, model)
    assert rule.after_evaluation(1.0) is None and rule.after_evaluation(1.5) is None
    assert rule.after_evaluation(0.9) is None  # a new best: the count starts again
    assert rule.after_evaluation(0.9) is None
    reason = rule.after_evaluation(1.0)
    assert reason is not None and "2 evaluations" in reason
    model = rule.fire(model)  # K = 1 -> 2 would be exact on 2 chunks: serial
    assert model.transformer.discretisation.depth_parallel is None and not rule.parallel


def test_after_a_fallback_the_new_solve_is_compared_with_itself(tmp_path):
    """The best validation loss starts again with the new solve (a higher loss of the
    new solve at the same parameters counted as a stall, and fired again), live and
    when a resumed run replays its log; ``fallback_iterations`` reads the solve a run
    had at a step from that log."""
    from ocformer.training import fallback_iterations

    config = resolve(SMOKE64, [*PARAREAL, "model.num_layers=4", "discretisation.chunks=4",
                               "train.depth_fallback=raise_iterations",
                               "train.depth_fallback_patience=1"])  # fmt: skip
    model = build(config).model
    rule = DepthFallback(config.train, model)
    assert rule.after_evaluation(2.0) is None
    assert rule.after_evaluation(2.1) is not None
    rule.fire(model)  # K = 1 -> 2
    assert rule.iterations == 2 and rule.after_evaluation(2.2) is None  # its first
    assert (rule.best, rule.stalled) == (2.2, 0)
    log = tmp_path / "metrics.jsonl"
    fell = "depth_fallback_iterations"
    records = [{"step": 2, "val_loss": 2.0}, {"step": 4, "val_loss": 2.1, fell: 2},
               {"step": 6, "val_loss": 2.2}, {"step": 8, "val_loss": 2.1, fell: 0}]  # fmt: skip
    log.write_text("".join(json.dumps(r) + "\n" for r in records))
    replayed = DepthFallback(config.train, model)
    replayed.replay(records, 6)
    assert (replayed.iterations, replayed.best, replayed.stalled) == (2, 2.2, 0)
    assert [fallback_iterations(str(tmp_path), s) for s in (2, 4, 7, 8)] == [None, 2, 2, 0]


BAD = [
    (["train.depth_bias_every=5"], "train.depth_bias_every", "depth_parallel is none"),
    (["train.depth_fallback=serial", "train.depth_fallback_patience=2"], "train.depth_fallback",
     "discretisation.depth_parallel is none"),
    # A condition alone was accepted, and did nothing.
    (["train.depth_fallback_patience=3"], "train.depth_fallback_patience",
     "discretisation.depth_parallel is none"),
    (["train.depth_fallback_cosine=0.9"], "train.depth_fallback_cosine",
     "or train.depth_fallback_cosine=none"),
    ([*PARAREAL, "train.depth_fallback=serial"], "train.depth_fallback", "no condition to fire"),
    ([*PARAREAL, "train.depth_fallback_cosine=0.9"], "train.depth_fallback_cosine",
     "train.depth_bias_every=0"),
    ([*PARAREAL, "train.depth_bias_every=5", "train.depth_fallback_cosine=0.9"],
     "train.depth_fallback", "does nothing"),
    ([*PARAREAL, "train.depth_fallback_cosine=2"], "train.depth_fallback_cosine", "<= 1"),
]  # fmt: skip


@pytest.mark.parametrize("overrides, field, words", BAD, ids=[b[1] + ":" + b[2] for b in BAD])
def test_bad_depth_training_is_refused_by_name(overrides, field, words, tmp_path, capsys):
    with pytest.raises(ConfigError) as e:
        resolve(SMOKE, overrides)
    assert e.value.field == field and words in str(e.value)
    argv = ["--config", SMOKE, "--workdir", str(tmp_path / "run")]
    for o in overrides:
        argv += ["--set", o]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert field in err and words in err


@pytest.mark.slow
def test_a_depth_parallel_run_is_evaluated_as_trained_and_serially(tmp_path, capsys):
    """``ocformer.evaluate`` of a depth-parallel run gives its training's validation loss
    (the depth-parallel solve), without solver counts (many chunk solves are not one
    solve's steps), and under the serial solve the counts of that solve."""
    from ocformer import evaluate as evaluate_cli

    run = tmp_path / "run"
    train(resolve(SMOKE64, [*PARAREAL, "train.steps=2", "train.eval_every=2"]), str(run))
    trained = _records(str(run))[2]["val_loss"]
    capsys.readouterr()
    out = tmp_path / "as_trained.json"
    assert evaluate_cli.main([str(run), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["val_loss"] == pytest.approx(trained, rel=1e-12)
    assert result["solver_steps"] is None and result["nfe"] is None
    assert "solver steps" not in capsys.readouterr().out
    serial = tmp_path / "serial.json"
    argv = [str(run), "--set", "discretisation.depth_parallel=none", "--json", str(serial)]
    assert evaluate_cli.main(argv) == 0
    result = json.loads(serial.read_text())
    assert result["solver_steps"] == 2 and result["val_loss"] != pytest.approx(trained, rel=1e-9)


def test_an_fcf_run_with_a_parallel_costate_is_evaluated_under_the_serial_solve():
    """``--set discretisation.depth_parallel=none`` on an MGRIT run with FCF-relaxation
    and the parallel costate: the relaxation and the costate belong to the solve the
    override replaced (and the costate to training), so they give way to their
    defaults; set by the evaluation itself, the refusal stands."""
    from ocformer.evaluation import evaluation_config

    trained = resolve(
        SMOKE,
        ["discretisation.depth_parallel=mgrit", "discretisation.relaxation=FCF",
         "discretisation.depth_costate=parallel"],
    )  # fmt: skip
    serial = evaluation_config(trained, ["discretisation.depth_parallel=none"])
    d = serial.discretisation
    assert (d.depth_parallel, d.relaxation, d.depth_costate) == (None, "F", "reverse")
    parareal = evaluation_config(trained, ["discretisation.depth_parallel=parareal"])
    assert parareal.discretisation.relaxation == "F"
    assert parareal.discretisation.depth_costate == "parallel"  # parareal takes it
    as_trained = evaluation_config(trained, [])
    assert as_trained.discretisation == trained.discretisation
    with pytest.raises(ConfigError, match="relaxation='FCF' is a relaxation of two-level"):
        evaluation_config(
            trained, ["discretisation.depth_parallel=none", "discretisation.relaxation=FCF"]
        )


# The fields only a depth-parallel solve reads, set on a parareal run, with values the
# smoke model (2 layers) takes.
DEPTH_FIELDS = {
    "discretisation.chunks": 2,
    "discretisation.iterations": 2,
    "discretisation.coarse_stepper": "euler",
    "discretisation.coarse_steps": 2,
}


def test_a_parareal_runs_chunks_iterations_and_coarse_solve_give_way_to_the_serial_solve():
    """``--set discretisation.depth_parallel=none`` on a parareal run: its chunks,
    iterations and coarse stepper and steps belong to the solve the override replaced,
    so they give way to their defaults (the serial solve refuses them); another
    depth-parallel solve keeps them, and set by the evaluation itself they are refused."""
    from ocformer.evaluation import evaluation_config

    trained = resolve(SMOKE, [*PARAREAL, *(f"{k}={v}" for k, v in DEPTH_FIELDS.items())])
    serial = evaluation_config(trained, ["discretisation.depth_parallel=none"])
    defaults = Config().discretisation
    assert serial.discretisation == dataclasses.replace(
        trained.discretisation,
        depth_parallel=None,
        **{k.split(".")[1]: getattr(defaults, k.split(".")[1]) for k in DEPTH_FIELDS},
    )
    mgrit = evaluation_config(trained, ["discretisation.depth_parallel=mgrit"]).discretisation
    assert [getattr(mgrit, k.split(".")[1]) for k in DEPTH_FIELDS] == list(DEPTH_FIELDS.values())
    for field, value in DEPTH_FIELDS.items():
        with pytest.raises(ConfigError) as e:
            evaluation_config(trained, ["discretisation.depth_parallel=none", f"{field}={value}"])
        assert e.value.field == field and "but depth_parallel is none" in str(e.value)


def test_a_run_on_depth_devices_is_evaluated_under_the_serial_solve():
    """The devices a parareal run split its chunks over (``mesh.depth``) belong to the
    solve an evaluation under ``depth_parallel=none`` replaces: they give way to one
    device, where the serial solve refuses more."""
    from ocformer.evaluation import evaluation_config

    trained = resolve(SMOKE, [*PARAREAL, "mesh.depth=2"])
    serial = evaluation_config(trained, ["discretisation.depth_parallel=none"])
    assert serial.mesh == dataclasses.replace(trained.mesh, depth=1)
    assert serial.discretisation.depth_parallel is None
    kept = evaluation_config(trained, ["discretisation.iterations=2"])
    assert kept.mesh == trained.mesh


def test_the_bias_checks_of_a_run_do_not_stop_its_serial_evaluation_config():
    """``evaluation_config`` (a sweep's evaluation axis calls it directly) idles the
    bias checks and fallback, which act on training: a run with them is evaluated
    under ``depth_parallel=none``."""
    from ocformer.evaluation import evaluation_config

    trained = resolve(
        SMOKE,
        [*PARAREAL, "train.depth_bias_every=2", "train.depth_fallback=serial",
         "train.depth_fallback_cosine=0.9"],
    )  # fmt: skip
    serial = evaluation_config(trained, ["discretisation.depth_parallel=none"])
    assert serial.discretisation.depth_parallel is None


@pytest.mark.slow
def test_a_resume_whose_metrics_lost_records_warns_that_the_fallback_state_is_unknown(
    tmp_path, capsys
):
    """The depth fallback's state is replayed from metrics.jsonl; with the file gone
    the resume took the configured solve without a word, though a fallback may have
    changed it. It says so now; a run whose rule cannot fire does not."""
    common = [*PARAREAL, "train.checkpoint_every=2", "train.steps=2"]
    for name, rule in (("watched", ["train.depth_fallback=serial",
                                    "train.depth_fallback_cosine=0.5",
                                    "train.depth_bias_every=2"]), ("unwatched", [])):  # fmt: skip
        run = str(tmp_path / name)
        train(resolve(SMOKE64, [*common, *rule]), run)
        os.remove(os.path.join(run, "metrics.jsonl"))
        capsys.readouterr()
        train(resolve(SMOKE64, [*common, *rule, "train.steps=3"]), run, allow_config_change=True)
        err = capsys.readouterr().err
        said = "the depth fallback's state (train.depth_fallback) is read from metrics.jsonl"
        assert (said in err) == (name == "watched"), err
        if name == "watched":
            assert "the solve resumes with 1 iteration, which may not be how the run solved" in err
