"""One compiled training step per shape: runs that differ only in the schedule (steps,
warmup, peak rate) share the step, across ``train()`` calls in a process; the learning
rate of each update is computed on the device from the optimiser state."""

import glob
import os

import numpy as np
import pytest

from ocformer.config import OptimiserConfig, resolve
from ocformer.objective import Objective
from ocformer.training import _step, build, make_schedule, train
from ocformer.training._optimiser import learning_rate_of, with_schedule

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOKE = os.path.join(ROOT, "experiments", "smoke.py")
RUN = ["train.progress=false", "train.eval_every=100", "train.checkpoint_every=100"]


def test_runs_differing_in_schedule_trace_the_step_once(tmp_path, monkeypatch):
    """The objective is called only while a step is traced: the second run, with
    other steps, warmup and peak rate, traces (and so compiles) nothing. Its
    profile (train.profile_steps) is written as a trace TensorBoard and Perfetto read."""
    traces = []
    real = Objective.__call__

    def counting(self, model, batch):
        traces.append(1)
        return real(self, model, batch)

    monkeypatch.setattr(Objective, "__call__", counting)
    # Start from no compiled step in this process, whatever ran before in this worker.
    monkeypatch.setattr(_step, "_TRAIN_STEPS", {})
    monkeypatch.setattr(_step, "_EVAL_STEPS", {})
    first = resolve(SMOKE, [*RUN, "train.steps=2"])
    summary = train(first, str(tmp_path / "a"))
    assert summary["step"] == 2
    assert len(traces) >= 2  # the training step and the evaluation step
    assert 0.0 <= summary["data_wait_fraction"] < 1.0
    traces.clear()
    second = resolve(
        SMOKE,
        [*RUN, "train.steps=3", "optimiser.warmup_steps=1", "optimiser.learning_rate=1e-2",
         "train.profile_steps=1:2"],
    )  # fmt: skip
    again = train(second, str(tmp_path / "b"))
    assert again["step"] == 3 and np.isfinite(again["loss"])
    assert traces == [], f"the second run traced the objective {len(traces)} times"
    profiles = glob.glob(str(tmp_path / "b" / "profile" / "plugins" / "profile" / "*" / "*"))
    assert any(p.endswith(".xplane.pb") for p in profiles), profiles
    assert any(p.endswith(".trace.json.gz") for p in profiles), profiles


def test_a_run_resumed_inside_the_profile_window_traces_what_is_left(tmp_path, capsys):
    """A resume inside ``train.profile_steps`` traced nothing (the trace began only at
    step A+1 exactly) and said nothing: it traces the steps left and says so; a resume
    past the window says that nothing is traced."""
    workdir = str(tmp_path / "run")
    train(resolve(SMOKE, [*RUN, "train.steps=2"]), workdir)
    capsys.readouterr()
    config = resolve(SMOKE, [*RUN, "train.steps=4", "train.profile_steps=1:3"])
    assert train(config, workdir, allow_config_change=True)["step"] == 4
    out = capsys.readouterr().out
    assert "train.profile_steps=1:3: the run resumes inside the window; tracing steps 3..3" in out
    profiles = glob.glob(os.path.join(workdir, "profile", "plugins", "profile", "*", "*"))
    assert any(p.endswith(".xplane.pb") for p in profiles), profiles
    past = resolve(SMOKE, [*RUN, "train.steps=5", "train.profile_steps=1:4"])
    assert train(past, workdir, allow_config_change=True)["step"] == 5
    assert "resumes after step 4, past the window, so nothing is traced" in capsys.readouterr().out
    # A run that stops inside the window (preempted) keeps the trace of its steps.
    from ocformer.training._loop import _Profile

    profile = _Profile("1:3", str(tmp_path / "stopped"), True, 0, 4)
    profile.before(2)
    profile.after(2, None)
    profile.stop()
    said = capsys.readouterr().out
    assert "stopped inside train.profile_steps=1:3: the trace in" in said
    assert said.strip().endswith("holds steps 2..2"), said


def test_learning_rate_in_the_state_follows_the_schedule():
    """The rate the optimiser applies after n updates is the schedule's value at n
    (optax's warmup-cosine formula), and a new schedule keeps the count."""
    config = resolve(SMOKE, ["optimiser.warmup_steps=4", "optimiser.learning_rate=1e-2"])
    exp = build(config)
    params = {"w": np.ones(3, np.float32)}
    state = exp.optimiser.init(params)
    grads = {"w": np.ones(3, np.float32)}
    rates = []
    for _ in range(6):
        rates.append(learning_rate_of(state))
        _, state = exp.optimiser.update(grads, state, params)
    schedule = make_schedule(config.optimiser, config.train.steps)
    want = [float(np.asarray(schedule(n))) for n in range(6)]
    np.testing.assert_allclose(rates, want, rtol=1e-6)
    np.testing.assert_allclose(rates[:5], [0.0, 2.5e-3, 5e-3, 7.5e-3, 1e-2], rtol=1e-6)
    longer = with_schedule(state, OptimiserConfig(learning_rate=2e-2), 1000)
    schedule = make_schedule(OptimiserConfig(learning_rate=2e-2), 1000)
    np.testing.assert_allclose(learning_rate_of(longer), float(np.asarray(schedule(6))), rtol=1e-6)


def test_compile_cache_directory_and_switch(monkeypatch, tmp_path):
    """The cache lives under $XDG_CACHE_HOME/ocformer/jax (else ~/.cache); the
    environment turns it off; a directory JAX was already given is kept."""
    import jax

    from ocformer.training._step import (
        COMPILE_CACHE_ENV,
        default_compile_cache_dir,
        enable_compile_cache,
    )

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_compile_cache_dir() == str(tmp_path / "ocformer" / "jax")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_compile_cache_dir() == str(tmp_path / "home" / ".cache" / "ocformer" / "jax")
    previous = getattr(jax.config, "jax_compilation_cache_dir", None)
    enabled = jax.config.jax_enable_compilation_cache  # pyright: ignore
    try:
        # Off is off even where JAX was given a directory itself (it used that one).
        jax.config.update("jax_compilation_cache_dir", str(tmp_path / "given"))
        monkeypatch.setenv(COMPILE_CACHE_ENV, "off")
        assert enable_compile_cache() is None
        assert jax.config.jax_enable_compilation_cache is False  # pyright: ignore
        # Off for JAX is off: a later call does not report a directory it will not use.
        monkeypatch.setenv(COMPILE_CACHE_ENV, str(tmp_path / "later"))
        assert enable_compile_cache() is None
    finally:
        jax.config.update("jax_enable_compilation_cache", enabled)
        jax.config.update("jax_compilation_cache_dir", previous)
    # A ~ is the home directory (it made a folder named '~' in the working directory).
    monkeypatch.setenv(COMPILE_CACHE_ENV, "~/cache")
    try:
        jax.config.update("jax_compilation_cache_dir", None)
        assert enable_compile_cache() == str(tmp_path / "home" / "cache")
    finally:
        jax.config.update("jax_compilation_cache_dir", previous)
    monkeypatch.setenv(COMPILE_CACHE_ENV, str(tmp_path / "mine"))
    try:
        jax.config.update("jax_compilation_cache_dir", str(tmp_path / "given"))
        assert enable_compile_cache() == str(tmp_path / "given")
        jax.config.update("jax_compilation_cache_dir", None)
        assert enable_compile_cache() == str(tmp_path / "mine")
        assert getattr(jax.config, "jax_compilation_cache_dir", None) == str(tmp_path / "mine")
    finally:
        jax.config.update("jax_compilation_cache_dir", previous)


@pytest.mark.slow
def test_a_second_process_loads_the_training_step_from_the_cache(tmp_path):
    """The training and evaluation steps of a constant-step run call nothing back on the
    host (the grid's controller and the solve have no run-time checks), so JAX writes
    them to the persistent cache and a second process loads them instead of compiling,
    with equinox's checks left on (``EQX_ON_ERROR`` unset); ``ocformer.evaluate`` of the
    run loads its evaluation step too."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "EQX_ON_ERROR"}
    env.update(
        JAX_PLATFORMS="cpu",
        JAX_COMPILATION_CACHE_DIR=str(tmp_path / "cache"),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_LOG_COMPILES="1",
    )
    logs = []
    for run in ("first", "second"):
        cmd = [sys.executable, "-m", "ocformer.train", "--config", SMOKE]
        cmd += ["--workdir", str(tmp_path / run)]
        for o in (*RUN, "train.steps=2"):
            cmd += ["--set", o]
        done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        logs.append(done.stderr)
    first, second = logs
    assert "cache hit for 'jit_step'" not in first
    assert "cache hit for 'jit_step'" in second, second[-3000:]
    assert "cache hit for 'jit_evaluate'" in second, [
        line for line in second.splitlines() if "cache hit" in line
    ]
    # Every program of the second process came from the cache.
    hits = second.count("Persistent compilation cache hit")
    assert hits == second.count("Finished XLA compilation") > 0, hits
    # The evaluation of the trained run uses the same cache, unless told not to.
    evaluate = [sys.executable, "-m", "ocformer.evaluate", str(tmp_path / "second")]
    for off in ([], ["--no-compile-cache"]):
        done = subprocess.run(
            [*evaluate, *off], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600
        )
        assert done.returncode == 0, done.stderr[-3000:]
        hit = "cache hit for 'jit_evaluate'" in done.stderr
        assert hit != bool(off), done.stderr[-3000:]
