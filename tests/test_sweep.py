"""Sweeps: points resolve exactly as ``ocformer.train`` resolves a command line, bad
sweeps are refused before anything runs (naming file, point and field), a sweep
writes one row per point and seed, reruns run nothing, failures are recorded and the
sweep goes on, results aggregate over seeds, SLURM job arrays."""

import csv
import glob
import io
import json
import math
import os
import re
import sys
import textwrap

import numpy as np
import pytest

from ocformer.config import resolve, to_dict
from ocformer.sweep import main as sweep_main, whole_sweep
from ocformer.sweeping import (
    Sweep,
    SweepError,
    axis,
    load_sweep,
    plain_log_xaxis,
    plan,
    report,
    resolve_points,
    slurm_options,
    zipped,
)
from ocformer.sweeping._results import METRICS, plot
from ocformer.sweeping._run import _run_logged, read_status

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOKE_SWEEP = os.path.join(ROOT, "experiments", "sweeps", "smoke.py")
SMOKE_EXPERIMENT = os.path.join(ROOT, "experiments", "smoke.py")
# The discretisation field the smoke sweep evaluates at (see experiments/sweeps/smoke.py).
STEPS_PER_LAYER = "discretisation.steps_per_layer"


def write_sweep(folder, name: str, body: str) -> str:
    """A sweep file ``folder/name.py`` over the smoke experiment."""
    path = os.path.join(folder, f"{name}.py")
    head = "from ocformer.sweeping import Sweep, axis, zipped\n"
    head += f"EXPERIMENT = {SMOKE_EXPERIMENT!r}\n\n"
    with open(path, "w", encoding="utf-8") as f:
        f.write(head + textwrap.dedent(body))
    return path


def read_csv(path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory):
    """One persistent compilation cache for every sweep of this module (what a user's
    cache would be), so repeated shapes are compiled once."""
    folder = str(tmp_path_factory.mktemp("jax_cache"))
    old = {k: os.environ.get(k) for k in ("JAX_COMPILATION_CACHE_DIR", "OCFORMER_COMPILE_CACHE")}
    os.environ["JAX_COMPILATION_CACHE_DIR"] = folder
    os.environ.pop("OCFORMER_COMPILE_CACHE", None)  # off would turn that one off too
    yield folder
    for name, value in old.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


# -- points ------------------------------------------------------------------------


def test_points_resolve_as_the_train_command_line():
    sweep, path, arg = load_sweep(SMOKE_SWEEP)
    spec, points = resolve_points(sweep, path)
    assert spec == SMOKE_EXPERIMENT and arg is None
    assert [p.labels for p in points] == [
        {"layers": "1", "seed": "0"},
        {"layers": "2", "seed": "0"},
    ]
    for p, layers in zip(points, [1, 2]):
        # The point's config is the one `python -m ocformer.train --config SPEC --set ...`
        # resolves from the same texts.
        assert p.config == to_dict(resolve(spec, list(p.sets)))
        assert p.config["model"]["num_layers"] == layers and p.config["train"]["steps"] == 4
        assert p.name.startswith(f"layers={layers}_seed=0-")
        [e] = p.evaluations
        assert e.settings == {STEPS_PER_LAYER: 2} and e.sets == (f"{STEPS_PER_LAYER}=2",)
    assert points[0].name != points[1].name


def test_an_msa_point_evaluated_under_its_own_and_other_discretisations(tmp_path):
    """An evaluation axis of a train.method=msa point: PID steps and a depth-parallel
    solve, which MSA's training rules refuse, are evaluations it takes; the trained
    discretisation is the point's own row, not an evaluation."""
    path = write_sweep(
        tmp_path,
        "msa",
        """
        def get_sweep(arg=None):
            return Sweep(
                experiment=EXPERIMENT,
                axes=[axis("train.method", ["msa"])],
                evaluate=[
                    zipped(
                        "solve",
                        {"discretisation.stepper": ["lie", "tsit5", "lie"],
                         "discretisation.stepsize": ["constant", "pid", "constant"],
                         "discretisation.depth_parallel": [None, None, "parareal"]},
                        labels=["trained", "pid", "parareal"],
                    )
                ],
            )
        """,
    )
    sweep, path, _ = load_sweep(path)
    _, [point] = resolve_points(sweep, path)
    assert [e.labels["solve"] for e in point.evaluations] == ["pid", "parareal"]


# The arguments of the shipped sweep files that need one (get_sweep refuses None).
SWEEP_ARGS = {"msa_vs_adamw.py": ("digits", "char")}
SHIPPED = [
    f"{path}:{arg}" if arg else path
    for path in sorted(glob.glob(os.path.join(ROOT, "experiments", "sweeps", "*.py")))
    for arg in SWEEP_ARGS.get(os.path.basename(path), (None,))
]


@pytest.mark.parametrize("spec", SHIPPED, ids=[os.path.basename(s) for s in SHIPPED])
def test_every_shipped_sweep_resolves_and_validates_every_point(spec):
    """A rule added to the table that a shipped sweep's point (or evaluation) breaks is
    found here, not when the sweep is run."""
    sweep, path, _ = load_sweep(spec)
    _, points = resolve_points(sweep, path)
    assert points


def test_a_depth_parallel_field_varies_with_depth_parallel_in_one_zipped_axis(tmp_path):
    """``discretisation.chunks`` set for every point while an axis sweeps
    ``depth_parallel`` over none: the serial point would ignore it, so it is refused,
    naming the point that takes it and the zipped axis that varies the two together.
    So zipped, each point trains what it says, and the parareal point's evaluation
    under the serial solve lets its chunks give way."""
    msg = _refused(
        tmp_path,
        """
        def get_sweep(arg=None):
            return Sweep(
                experiment=EXPERIMENT,
                overrides={"discretisation.chunks": 2},
                axes=[axis("discretisation.depth_parallel", ["parareal", None], name="solve")],
            )
        """,
    )
    assert "point solve=none_seed=0: discretisation.chunks: chunks=2 cuts" in msg
    assert "point solve=parareal takes it and this one does not" in msg
    assert "vary it together with discretisation.depth_parallel in one zipped axis" in msg
    path = write_sweep(
        tmp_path,
        "zipped",
        """
        def get_sweep(arg=None):
            return Sweep(
                experiment=EXPERIMENT,
                axes=[
                    zipped(
                        "solve",
                        {"discretisation.depth_parallel": ["parareal", None],
                         "discretisation.chunks": [2, None]},
                        labels=["parareal", "serial"],
                    )
                ],
                evaluate=[axis("discretisation.depth_parallel", [None], name="as")],
            )
        """,
    )
    sweep, path, _ = load_sweep(path)
    _, [parareal, serial] = resolve_points(sweep, path)
    assert [p.config["discretisation"]["chunks"] for p in (parareal, serial)] == [2, None]
    [evaluation] = parareal.evaluations
    assert evaluation.sets == ("discretisation.depth_parallel=none",)
    assert serial.evaluations == ()  # the serial solve is its own row


def test_product_zip_seeds_and_only(tmp_path):
    path = write_sweep(
        tmp_path,
        "grid",
        """
        def get_sweep(arg=None):
            return Sweep(
                experiment=EXPERIMENT,
                axes=[
                    axis("model.num_layers", [1, 2], name="L"),
                    zipped(
                        "opt",
                        {"optimiser.learning_rate": [1e-3, 3e-3], "optimiser.warmup_steps": [0, 5]},
                        labels=["slow", "fast"],
                    ),
                ],
                seeds=(0, 1),
            )
        """,
    )
    sweep, path, _ = load_sweep(path)
    _, points = resolve_points(sweep, path)
    assert len(points) == 2 * 2 * 2
    assert points[3].labels == {"L": "1", "opt": "fast", "seed": "1"}
    assert points[3].config["optimiser"]["learning_rate"] == 3e-3
    assert points[3].config["optimiser"]["warmup_steps"] == 5
    assert points[3].config["train"]["seed"] == 1
    assert len({p.name for p in points}) == 8
    _, three = resolve_points(sweep, path, seeds=3)
    assert sorted({p.seed for p in three}) == [0, 1, 2] and len(three) == 12
    _, only = resolve_points(sweep, path, only=["opt=slow", "model.num_layers=2"])
    assert [p.labels for p in only] == [
        {"L": "2", "opt": "slow", "seed": "0"},
        {"L": "2", "opt": "slow", "seed": "1"},
    ]
    # Point names depend on the point only: adding a value keeps the others' names (so
    # their finished runs are reused).
    grown = Sweep(experiment=sweep.experiment, axes=[sweep.axes[0]])
    more = Sweep(
        experiment=sweep.experiment,
        axes=[axis("model.num_layers", [1, 2, 3], name="L")],
    )
    old = {p.name for p in resolve_points(grown, path)[1]}
    new = {p.name for p in resolve_points(more, path)[1]}
    assert old < new and len(new - old) == 1


# -- bad input -----------------------------------------------------------------------


def _refused(tmp_path, body: str, name: str = "bad") -> str:
    path = write_sweep(tmp_path, name, body)
    with pytest.raises(SweepError) as e:
        plan(path, workdir=str(tmp_path / "out"), build=False)
    assert not os.path.exists(tmp_path / "out")
    return str(e.value)


def test_sweep_file_that_fails_to_import(tmp_path):
    msg = _refused(tmp_path, "import numpy\nraise RuntimeError('broken on purpose')\n")
    assert str(tmp_path / "bad.py") in msg
    assert "failed to import: RuntimeError: broken on purpose" in msg and "bad.py:5)" in msg
    # A syntax error, and an error raised in a library the file calls, are placed at
    # the sweep file's line, not in importlib's frozen machinery or in the library.
    msg = _refused(tmp_path, "X = (\n", name="syntax")
    assert "failed to import: SyntaxError" in msg and f"(at {tmp_path / 'syntax.py'}:4)" in msg
    msg = _refused(tmp_path, "import json\njson.loads('{')\n", name="call")
    assert "JSONDecodeError" in msg and f"(at {tmp_path / 'call.py'}:5)" in msg
    msg = _refused(tmp_path, "X = 1\n", name="nothing")
    assert "nothing.py: defines no get_sweep" in msg
    # The sweep files of the repository refuse an argument they do not take.
    with pytest.raises(SweepError) as e:
        plan(f"{SMOKE_SWEEP}:foo", workdir=str(tmp_path / "out"), build=False)
    assert "get_sweep('foo') raised ValueError: unknown argument 'foo'" in str(e.value)


def test_axis_over_unknown_field(tmp_path):
    msg = _refused(
        tmp_path,
        """
        def get_sweep(arg=None):
            return Sweep(experiment=EXPERIMENT, axes=[axis("model.num_layer", [1, 2])])
        """,
    )
    assert "training axis 'num_layer'" in msg and "unknown field model.num_layer" in msg
    assert "did you mean model.num_layers" in msg


def test_axis_value_of_the_wrong_type(tmp_path):
    msg = _refused(
        tmp_path,
        """
        def get_sweep(arg=None):
            return Sweep(experiment=EXPERIMENT, axes=[axis("model.num_layers", [2, 2.5])])
        """,
    )
    assert "axis 'num_layers', value '2.5'" in msg
    assert "model.num_layers: expected an int, got '2.5'" in msg
    msg = _refused(
        tmp_path,
        """
        def get_sweep(arg=None):
            return Sweep(experiment=EXPERIMENT, axes=[axis("model.num_layers", [1, "2"])])
        """,
        name="strings",
    )
    assert "strings.py: training axis 'num_layers', value '2'" in msg
    assert "model.num_layers: expected int, got '2' (str)" in msg
    # The fields every point sets are read the same way.
    msg = _refused(
        tmp_path,
        """
        def get_sweep(arg=None):
            return Sweep(experiment=EXPERIMENT, axes=[axis("model.num_layers", [1])],
                         overrides={"train.steps": "4"})
        """,
        name="overrides",
    )
    assert "overrides.py: overrides" in msg
    assert "train.steps: expected int, got '4' (str)" in msg


def test_seeds_that_repeat_or_are_negative_are_named(tmp_path):
    """``seeds=(0, 0)`` was refused as two points resolving to one run, naming two
    other points; ``seeds=(-1,)`` ran as seed 1's slug. Each is named as what it is."""
    for seeds, words in [
        ("(0, 0)", "seeds: seeds must differ (each is one run); repeated: [0]"),
        ("(-1,)", "seeds: a seed is a whole number >= 0, got -1"),
    ]:
        msg = _refused(
            tmp_path,
            f"""
            def get_sweep(arg=None):
                return Sweep(experiment=EXPERIMENT, axes=[axis("model.num_layers", [1])],
                             seeds={seeds})
            """,
        )
        assert words in msg, msg


def test_numpy_values_and_nan_are_read_as_their_python_values(tmp_path):
    """An axis of NumPy integers (``np.arange``) was refused as "expected int, got
    np.int64(1)"; a NaN override as "expected float, got nan" (NaN != NaN). Both are
    their values: the NumPy axis plans, and the NaN reaches the field's own check."""
    path = write_sweep(
        tmp_path,
        "numpy",
        """
        import numpy as np


        def get_sweep(arg=None):
            return Sweep(experiment=EXPERIMENT, axes=[axis("model.num_layers", np.arange(1, 3))])
        """,
    )
    _, _, points = plan(path, workdir=str(tmp_path / "out"), build=False)
    assert len(points) == 2
    msg = _refused(
        tmp_path,
        """
        def get_sweep(arg=None):
            return Sweep(experiment=EXPERIMENT, axes=[axis("model.num_layers", [1])],
                         overrides={"optimiser.learning_rate": float("nan")})
        """,
        name="nan",
    )
    assert "expected float, got nan" not in msg and "optimiser.learning_rate" in msg, msg


def test_empty_axis(tmp_path):
    msg = _refused(
        tmp_path,
        """
        def get_sweep(arg=None):
            return Sweep(experiment=EXPERIMENT, axes=[axis("model.num_layers", [])])
        """,
    )
    assert "bad.py" in msg and "axis 'num_layers': has no values" in msg
    with pytest.raises(SweepError, match=r"axis 'z': sets no field; give each field its values"):
        zipped("z", {})
    # A field is a dotted name (an int was an AttributeError on its name).
    for bad in (lambda: axis(5, [1]), lambda: axis("width", [1]), lambda: zipped("z", {3: [1]})):
        with pytest.raises(SweepError, match="a field is a dotted config name such as"):
            bad()


def test_invalid_point_is_named_with_its_field(tmp_path, capsys):
    path = write_sweep(
        tmp_path,
        "heads",
        """
        def get_sweep(arg=None):
            return Sweep(experiment=EXPERIMENT, axes=[axis("model.num_heads", [2, 3], name="h")])
        """,
    )
    # Exit 2 before anything runs or is written, naming the point and the field.
    assert sweep_main([path, "--workdir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "point h=3_seed=0: model.num_heads" in err and "width" in err
    assert not os.path.exists(tmp_path / "out")


def test_evaluation_axis_must_be_a_discretisation_or_validation_set_field(tmp_path):
    msg = _refused(
        tmp_path,
        """
        def get_sweep(arg=None):
            return Sweep(experiment=EXPERIMENT, evaluate=[axis("model.width", [8])])
        """,
    )
    assert "evaluation axis 'width'" in msg
    assert "model.width: evaluation may change only the discretisation" in msg
    # The validation set is an evaluation's to choose: every seed's run measured on one.
    path = write_sweep(
        tmp_path,
        "windows",
        """
        def get_sweep(arg=None):
            return Sweep(experiment=EXPERIMENT, evaluate=[axis("task.eval_seed", [0])])
        """,
    )
    sweep, path, _ = load_sweep(path)
    _, points = resolve_points(sweep, path)
    assert [[e.sets for e in p.evaluations] for p in points] == [[("task.eval_seed=0",)]]


def test_workdir_holding_another_sweep_or_other_files(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "sweep.json").write_text(json.dumps({"id": "solvers"}))
    with pytest.raises(SweepError, match=r"holds the results of sweep 'solvers', not 'smoke'"):
        plan(SMOKE_SWEEP, workdir=str(out), build=False)
    other = tmp_path / "run"
    other.mkdir()
    (other / "metrics.jsonl").write_text("")
    with pytest.raises(SweepError, match=r"is not a sweep directory \(it holds metrics.jsonl\)"):
        plan(SMOKE_SWEEP, workdir=str(other), build=False)


def test_the_recorded_command_is_the_whole_sweeps():
    """A command that ran some points (``--only``) is recorded without its selections:
    the report covers every point, and rerunning the recorded command completes it."""
    argv = ["s.py", "--only", "layers=1", "--workdir", "w", "--only=seed=0", "--parallel", "2"]
    assert whole_sweep(argv) == ["s.py", "--workdir", "w", "--parallel", "2"]


def test_slurm_options_are_checked_when_no_point_is_left(tmp_path, monkeypatch):
    """A bad option is refused whether or not a point is left to run (it was checked
    only where a job array was about to be submitted)."""
    from ocformer.sweeping import _driver

    monkeypatch.setattr(_driver, "require_slurm", lambda: None)  # no sbatch here
    monkeypatch.setattr(_driver, "is_finished", lambda workdir, point: True)
    with pytest.raises(SweepError, match=r"^--nodes: expected an integer >= 1, got 0$"):
        _driver.run_sweep(SMOKE_SWEEP, str(tmp_path / "s"), launcher="slurm", slurm={"nodes": 0})
    assert not (tmp_path / "s").exists()


def test_slurm_options_are_checked():
    assert slurm_options({"time_min": 10}, {"cpus": 4, "time_min": None}).time_min == 10
    assert slurm_options({"time_min": 10}, {"time_min": 30}).time_min == 30
    with pytest.raises(SweepError, match=r"unknown option\(s\) gpu; allowed: partition"):
        slurm_options({"gpu": 1}, {})
    with pytest.raises(SweepError, match=r"slurm.cpus: expected an integer >= 1, got 'x'"):
        slurm_options({"cpus": "x"}, {})
    # A task of no node, CPU, minute or concurrency would be a job script SLURM refuses.
    for key, flag in [("nodes", "--nodes"), ("cpus", "--cpus"), ("time_min", "--time-min"),
                      ("array_parallelism", "--array-parallelism")]:  # fmt: skip
        with pytest.raises(SweepError, match=rf"^{flag}: expected an integer >= 1, got 0$"):
            slurm_options({}, {key: 0})
        with pytest.raises(SweepError, match=rf"^slurm.{key}: expected an integer >= 1, got 0$"):
            slurm_options({key: 0}, {})
    assert slurm_options({}, {"gpus": 0}).gpus == 0
    # An empty partition was written as "#SBATCH --partition=''".
    with pytest.raises(SweepError, match=r"^--partition: expected a partition's name"):
        slurm_options({}, {"partition": ""})
    with pytest.raises(SweepError, match=r"^slurm.partition: expected a partition's name"):
        slurm_options({"partition": 3}, {})
    with pytest.raises(SweepError, match=r"^--gpus: expected an integer >= 0, got -1$"):
        slurm_options({}, {"gpus": -1})


# -- process bookkeeping -------------------------------------------------------------


def test_process_record_reads_compile_time_error_line_and_rss(tmp_path):
    script = textwrap.dedent(
        """
        import sys
        print("Finished tracing f for jit in 0.25 sec", file=sys.stderr)
        print("Finished jaxpr to MLIR module conversion jit(f) in 0.5 sec", file=sys.stderr)
        print("Persistent compilation cache hit for 'jit_f' with key 'k'", file=sys.stderr)
        print("Finished XLA compilation of jit(f) in 1.125 sec", file=sys.stderr)
        print("ocformer.train: error: NonFiniteError: non-finite loss at step 3")
        print("Finished XLA compilation of jit(g) in 2 sec", file=sys.stderr)
        x = bytearray(200 * 2**20)
        sys.exit(4)
        """
    )
    log = str(tmp_path / "log")
    r = _run_logged([sys.executable, "-c", script], log, dict(os.environ))
    assert r["exit_code"] == 4
    assert r["compile_time_s"] == 0.25 + 0.5 + 1.125 + 2
    assert r["cache_hits"] == 1
    assert r["error"] == "ocformer.train: error: NonFiniteError: non-finite loss at step 3"
    # Linux carries the parent's high-water mark over fork, so a child of a large process
    # (a test worker that has run JAX) reports at least the parent's peak: only the
    # lower bound is the child's own.
    assert r["peak_rss_mb"] > 200
    killed = _run_logged(
        [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"],
        log,
        dict(os.environ),
    )
    assert killed["exit_code"] == -9 and killed["error"] == "killed by SIGKILL"


def test_a_point_cut_short_by_a_killed_sweep_keeps_its_times(tmp_path, monkeypatch):
    """A sweep SIGKILLed while a point trains records nothing on its way out: the
    point's heartbeat has recorded its times so far, and the attempt that resumes it
    adds its own to them."""
    import signal
    import subprocess
    import time

    from ocformer.sweeping import _run

    def shim(name: str, body: str) -> str:  # stands in for `python -m ocformer.train`
        path = tmp_path / name
        path.write_text(
            "#!/bin/sh\necho 'Finished XLA compilation of jit(step) in 1.5 sec' >&2\n" + body
        )
        path.chmod(0o755)
        return str(path)

    point = {"name": "p", "spec": "unused.py", "sets": [], "evaluations": []}
    script = (
        "import sys; from ocformer.sweeping import _run; _run.HEARTBEAT_S = 0.2; "
        f"sys.executable = {shim('slow', 'sleep 60')!r}; "
        f"_run.run_point({str(tmp_path)!r}, {point!r})"
    )
    sweep = subprocess.Popen([sys.executable, "-c", script])
    status_file = tmp_path / "points" / "p" / _run.STATUS_FILE
    deadline = time.monotonic() + 60
    while (read_status(str(status_file.parent)).get("wall_time_s") or 0) < 1.0:
        assert sweep.poll() is None and time.monotonic() < deadline
        time.sleep(0.1)
    sweep.kill()
    sweep.wait()
    killed = read_status(str(status_file.parent))
    os.kill(killed["process"], signal.SIGKILL)  # the training process, in its own group
    assert killed["status"] == "running" and killed["compile_time_s"] == 1.5

    monkeypatch.setattr(sys, "executable", shim("quick", "exit 0"))
    status = _run.run_point(str(tmp_path), point)
    assert status["status"] == "done" and status["attempts"] == 2
    assert status["compile_time_s"] == 3.0
    assert status["wall_time_s"] > killed["wall_time_s"] >= 1.0


def _fake_point(sweep_dir, point, val_losses, accs, status="done"):
    folder = os.path.join(sweep_dir, "points", point["name"])
    os.makedirs(os.path.join(folder, "run"))
    os.makedirs(os.path.join(folder, "evaluations"))
    with open(os.path.join(folder, "run", "metrics.jsonl"), "w") as f:
        for i, (v, a) in enumerate(zip(val_losses, accs)):
            f.write(
                json.dumps(
                    {"step": i + 1, "steps_per_s": 10.0 * (i + 1), "val_loss": v, "val_accuracy": a}
                )
                + "\n"
            )
    with open(os.path.join(folder, "sweep_point.json"), "w") as f:
        json.dump(
            {
                "status": status,
                "exit_code": 0 if status == "done" else 4,
                "wall_time_s": 2.0,
                "compile_time_s": 1.0,
                "peak_rss_mb": 100.0,
            },
            f,
        )
    with open(os.path.join(folder, "evaluations", "trained.json"), "w") as f:
        json.dump(
            {
                "val_loss": val_losses[-1],
                "solver_steps": 2,
                "accepted_steps": 2,
                "rejected_steps": 0,
                "nfe": 4,
            },
            f,
        )


def test_a_failed_evaluation_runs_again_when_the_sweep_is_rerun(tmp_path, monkeypatch):
    """A failed evaluation is recorded with its row's reason, and a rerun tries it
    again, as it does a failed training (it counted as finished: the rerun said
    "nothing to run" and exited 1 every time)."""
    from ocformer.sweeping import _run

    sweep_dir = str(tmp_path)
    point = {
        "name": "p",
        "evaluations": [{"name": "m4", "sets": ["discretisation.steps_per_layer=4"]}],
    }
    _fake_point(sweep_dir, point, [2.0], [0.1])
    failed = os.path.join(sweep_dir, "points", "p", "evaluations", "m4.json")
    with open(failed, "w") as f:
        json.dump({"status": "failed", "exit_code": 4, "error": "NonFiniteEvaluation"}, f)
    assert not _run.is_finished(sweep_dir, point)
    commands = []

    def evaluated(command, log_path, env):
        commands.append(command)
        with open(command[command.index("--json") + 1], "w") as f:
            json.dump({"val_loss": 1.5}, f)
        return {"exit_code": 0, "error": None}

    monkeypatch.setattr(_run, "_run_logged", evaluated)
    status = _run.run_point(sweep_dir, point)
    assert len(commands) == 1 and commands[0][-2:] == ["--set", "discretisation.steps_per_layer=4"]
    assert _run.is_finished(sweep_dir, point) and not status["evaluation_failures"]


def test_report_aggregates_over_seeds(tmp_path):
    """results.csv from point directories, then mean and (population) std over seeds,
    checked against numpy; a failed seed is excluded from the mean and counted."""
    sweep_dir = str(tmp_path)
    points = []
    for layers in (1, 2):
        for seed in (0, 1, 2):
            points.append(
                {
                    "name": f"L={layers}_seed={seed}-h",
                    "evaluations": [],
                    "settings": {"model.num_layers": layers, "train.seed": seed},
                    "config": {},
                }
            )
    info = {
        "id": "fake",
        "command": "c",
        "train_fields": ["model.num_layers", "train.seed"],
        "eval_fields": [],
        "seed_field": "train.seed",
        "num_seeds": 3,
        "points": points,
    }
    with open(os.path.join(sweep_dir, "sweep.json"), "w") as f:
        json.dump(info, f)
    finals = {}
    for i, p in enumerate(points):
        curve = [2.0 - 0.1 * i, 1.5 - 0.1 * i, 1.6 - 0.1 * i]
        failed = p["name"].startswith("L=2_seed=2")
        _fake_point(sweep_dir, p, curve, [0.1, 0.2, 0.3], "failed" if failed else "done")
        finals[p["name"]] = curve
    out = report(sweep_dir)
    table = read_csv(tmp_path / "results.csv")
    assert len(table) == 6
    row = table[1]
    assert row["point"] == "L=1_seed=1-h" and row["status"] == "done"
    assert float(row["final_val_loss"]) == 1.5 and float(row["best_val_loss"]) == 1.4
    assert float(row["best_val_accuracy"]) == 0.3 and float(row["nfe"]) == 4
    # Steps/s: median of the windows after the first (which holds the compilation).
    assert float(row["train_steps_per_s"]) == 25.0
    g1, g2 = out["groups"]
    want = [finals[f"L=1_seed={s}-h"][-1] for s in range(3)]
    assert g1["n"] == 3 and g1["final_val_loss"][:2] == pytest.approx(
        (np.mean(want), np.std(want)), abs=1e-15
    )
    assert g2["n"] == 2 and g2["failed"] == 1
    md = (tmp_path / "results.md").read_text()
    assert "| 2 | 2 (1 failed) |" in md and " +- " in md
    plots = {os.path.basename(p) for p in out["plots"]}
    assert "final_val_loss_vs_model_num_layers.png" in plots
    # NFE is 4 at every point: a flat line is not drawn.
    assert "nfe_vs_model_num_layers.png" not in plots


def test_report_reads_a_metrics_file_cut_by_a_kill(tmp_path):
    """A point killed while writing leaves a partial last line in metrics.jsonl; the
    report reads the whole records before it, as a resumed run does."""
    sweep_dir = str(tmp_path)
    point = {
        "name": "L=1-h",
        "evaluations": [],
        "settings": {"model.num_layers": 1},
        "config": {},
    }
    info = {
        "id": "killed",
        "command": "c",
        "train_fields": ["model.num_layers"],
        "eval_fields": [],
        "seed_field": "train.seed",
        "num_seeds": 1,
        "points": [point],
    }
    with open(os.path.join(sweep_dir, "sweep.json"), "w") as f:
        json.dump(info, f)
    _fake_point(sweep_dir, point, [2.0, 1.5], [0.1, 0.2], status="failed")
    metrics = os.path.join(sweep_dir, "points", point["name"], "run", "metrics.jsonl")
    with open(metrics, "a") as f:
        f.write('{"step": 3, "steps_per_s": 30.0, "val_lo')
    out = report(sweep_dir, make_plots=False)
    [row] = read_csv(tmp_path / "results.csv")
    assert row["status"] == "failed" and row["step"] == "2"
    assert float(row["final_val_loss"]) == 1.5 and float(row["best_val_loss"]) == 1.5
    assert float(row["final_val_accuracy"]) == 0.2
    assert out["rows"][0]["train_steps_per_s"] == 20.0


def test_report_says_which_points_are_unfinished(tmp_path, capsys):
    """A partly finished sweep (its process SIGKILLed): the report names the missing
    points by state, in its summary and results.md, and a point recorded as running
    whose processes are gone on this host reads as interrupted; a record from another
    host is not second-guessed."""
    import subprocess

    sweep_dir = str(tmp_path)
    names = ["done", "killed", "elsewhere", "unevaluated", "unstarted"]
    points = [
        {
            "name": n,
            "evaluations": [{"name": "fine", "sets": [], "labels": {}, "settings": {}}],
            "settings": {"model.num_layers": i},
            "config": {},
        }
        for i, n in enumerate(names)
    ]
    info = {
        "id": "partial",
        "command": "c",
        "train_fields": ["model.num_layers"],
        "eval_fields": [],
        "seed_field": "train.seed",
        "num_seeds": 1,
        "points": points,
    }
    (tmp_path / "sweep.json").write_text(json.dumps(info))
    for p in points[:4]:
        _fake_point(sweep_dir, p, [2.0], [0.1])
    (tmp_path / "points" / "done" / "evaluations" / "fine.json").write_text("{}")
    dead = subprocess.Popen(["true"])
    dead.wait()
    here = os.uname().nodename
    for name, host in (("killed", here), ("elsewhere", "another-node")):
        record = {"status": "running", "host": host, "pid": dead.pid, "process": dead.pid}
        (tmp_path / "points" / name / "sweep_point.json").write_text(json.dumps(record))
    assert sweep_main(["report", sweep_dir]) == 0
    err = capsys.readouterr().err
    want = (
        "4 of 5 points unfinished: 1 interrupted (rerun the sweep to resume): killed; "
        "1 running (running, or killed on another host): elsewhere; 1 evaluations pending "
        "(rerun the sweep to evaluate): unevaluated; 1 not started (rerun the sweep to "
        "run): unstarted"
    )
    assert f"sweep: {want}\n" in err, err
    assert f"**{want}.**" in (tmp_path / "results.md").read_text()
    status = {
        r["point"]: r for r in read_csv(tmp_path / "results.csv") if r["evaluation"] == "trained"
    }
    assert status["killed"]["status"] == "interrupted"
    assert f"pid {dead.pid} on {here} is gone" in status["killed"]["error"]
    assert status["elsewhere"]["status"] == "running" and status["done"]["status"] == "done"
    # Nothing missing: no summary.
    info["points"] = points[:1]
    (tmp_path / "sweep.json").write_text(json.dumps(info))
    assert report(sweep_dir, make_plots=False)["unfinished"] is None


def test_report_warns_of_finished_points_no_longer_in_the_sweep(tmp_path, capsys):
    """A rerun with fewer seeds rewrites sweep.json without the points it dropped: the
    report says, on stderr and in results.md, which finished points it leaves out."""
    sweep_dir = str(tmp_path)
    points = [
        {"name": f"seed={i}-h", "evaluations": [], "settings": {"train.seed": i}, "config": {}}
        for i in range(4)
    ]
    info = {
        "id": "fewer",
        "command": "c",
        "train_fields": ["train.seed"],
        "eval_fields": [],
        "seed_field": "train.seed",
        "num_seeds": 1,
        "points": points[:1],
    }
    (tmp_path / "sweep.json").write_text(json.dumps(info))
    for i, p in enumerate(points):
        _fake_point(sweep_dir, p, [2.0], [0.1], "failed" if i == 3 else "done")
    out = report(sweep_dir, make_plots=False)
    want = (
        f"2 finished points in {tmp_path / 'points'} are no longer part of this sweep and "
        "are left out of the report: seed=1-h, seed=2-h"
    )
    assert out["left_out"].startswith(want)
    assert f"sweep: warning: {want}" in capsys.readouterr().err
    assert want in (tmp_path / "results.md").read_text()
    assert len(out["rows"]) == 1


def _record_plots(monkeypatch) -> dict:
    """What ``plot`` draws, read from each figure as it is saved: file name -> the x
    label, the x tick labels and, for each line, its label, x, y and line style."""
    import matplotlib.figure

    drawn: dict = {}
    savefig = matplotlib.figure.Figure.savefig

    def record(fig, path, *args, **kwargs):
        [ax] = fig.axes
        drawn[os.path.basename(path)] = {
            "xlabel": ax.get_xlabel(),
            "xticklabels": [t.get_text() for t in ax.get_xticklabels()],
            # plot() draws each line with errorbar: the container holds the data line.
            "lines": {
                c.get_label(): (
                    [float(x) for x in c.lines[0].get_xdata()],
                    [float(y) for y in c.lines[0].get_ydata()],
                    c.lines[0].get_linestyle(),
                )
                for c in ax.containers
            },
        }
        savefig(fig, path, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", record)
    return drawn


def test_plots_put_numeric_axes_on_x_and_draw_loss_against_cost(tmp_path, monkeypatch):
    """A categorical axis (the solver) becomes the lines, the numeric one (steps) the x
    axis; the loss-against-NFE picture joins each solver's points in order of cost."""
    stages = {"euler": 1, "heun": 2}
    groups = []
    # Shuffled, so that the lines' order comes from plot(), not from the groups.
    for solver, steps in (("heun", 4), ("euler", 2), ("heun", 1), ("euler", 4), ("euler", 1)):
        g = dict.fromkeys(METRICS)
        g.update({"discretisation.stepper": solver, "discretisation.steps_per_layer": steps})
        g["final_val_loss"] = (1.0 / (steps * stages[solver]), 0.0, 1)
        g["nfe"] = (float(steps * stages[solver]), 0.0, 1)
        groups.append(g)
    info = {
        "id": "solvers",
        "train_fields": ["discretisation.stepper", "discretisation.steps_per_layer"],
        "eval_fields": [],
        "seed_field": "train.seed",
        "num_seeds": 1,
    }
    drawn = _record_plots(monkeypatch)
    import matplotlib
    import matplotlib.pyplot as plt

    # The caller's backend and figures (a notebook's) are left as they were.
    backend = matplotlib.get_backend()
    matplotlib.use("svg")
    try:
        mine = plt.figure()
        names = {os.path.basename(p) for p in plot(groups, info, str(tmp_path))}
        assert matplotlib.get_backend() == "svg" and plt.get_fignums() == [mine.number]
    finally:
        plt.close("all")
        matplotlib.use(backend)
    assert (
        names
        == set(drawn)
        == {
            "final_val_loss_vs_discretisation_steps_per_layer.png",
            "nfe_vs_discretisation_steps_per_layer.png",
            "final_val_loss_vs_cost_nfe.png",
        }
    )
    loss = drawn["final_val_loss_vs_discretisation_steps_per_layer.png"]
    assert loss["xlabel"] == "discretisation.steps_per_layer"
    assert loss["lines"] == {
        "stepper=euler": ([1.0, 2.0, 4.0], [1.0, 0.5, 0.25], "-"),
        "stepper=heun": ([1.0, 4.0], [0.5, 0.125], "-"),
    }
    nfe = drawn["nfe_vs_discretisation_steps_per_layer.png"]
    assert nfe["lines"] == {
        "stepper=euler": ([1.0, 2.0, 4.0], [1.0, 2.0, 4.0], "-"),
        "stepper=heun": ([1.0, 4.0], [2.0, 8.0], "-"),
    }
    cost = drawn["final_val_loss_vs_cost_nfe.png"]
    assert cost["xlabel"] == "nfe (one forward solve)"
    assert cost["lines"] == {
        "stepper=euler": ([1.0, 2.0, 4.0], [1.0, 0.5, 0.25], "-"),
        "stepper=heun": ([2.0, 8.0], [0.5, 0.125], "-"),
    }


def test_loss_against_cost_draws_one_line_per_trained_model(tmp_path, monkeypatch):
    """With an evaluation axis, the loss-against-cost picture joins each trained
    model's evaluations (one line per value of the training axis), not every point in
    order of cost across models; a re-report first removes the plots of an earlier one
    (and only those)."""
    groups = []
    for layers in (2, 1):
        for steps in (2, 1):
            g = dict.fromkeys(METRICS)
            g.update({"model.num_layers": layers, "eval.discretisation.steps_per_layer": steps})
            g["final_val_loss"] = (2.0 + 0.1 * layers + 0.01 * steps, 0.0, 1)
            g["solver_steps"] = (float(layers * steps), 0.0, 1)
            groups.append(g)
    info = {
        "id": "layers",
        "train_fields": ["model.num_layers", "train.seed"],
        "eval_fields": ["discretisation.steps_per_layer"],
        "seed_field": "train.seed",
        "num_seeds": 1,
    }
    stale = tmp_path / "rejected_steps_vs_model_num_layers.png"
    stale.write_bytes(b"an earlier report's plot")
    (tmp_path / "mine.png").write_bytes(b"not the report's")
    drawn = _record_plots(monkeypatch)
    plot(groups, info, str(tmp_path))
    assert drawn["final_val_loss_vs_cost_solver_steps.png"]["lines"] == {
        "num_layers=1": ([1.0, 2.0], [2.11, 2.12], "-"),
        "num_layers=2": ([2.0, 4.0], [2.21, 2.22], "-"),
    }
    assert not stale.exists() and (tmp_path / "mine.png").exists()
    assert {p.name for p in tmp_path.glob("*.png")} == {*drawn, "mine.png"}


def test_plots_put_a_categorical_axis_on_x_when_no_axis_is_numeric(tmp_path, monkeypatch):
    """Without a numeric axis the solvers go on x, one tick each, as points with no line
    between them."""
    groups = []
    for solver, loss in (("heun", 0.25), ("euler", 0.5)):
        g = dict.fromkeys(METRICS)
        g.update({"discretisation.stepper": solver, "final_val_loss": (loss, 0.0, 1)})
        groups.append(g)
    info = {
        "id": "solvers",
        "train_fields": ["discretisation.stepper"],
        "eval_fields": [],
        "seed_field": "train.seed",
        "num_seeds": 1,
    }
    drawn = _record_plots(monkeypatch)
    plot(groups, info, str(tmp_path))
    [(name, figure)] = drawn.items()
    assert name == "final_val_loss_vs_discretisation_stepper.png"
    assert figure["xticklabels"] == ["euler", "heun"]
    [(xs, ys, style)] = figure["lines"].values()
    assert (xs, ys, style) == ([0.0, 1.0], [0.5, 0.25], "None")


def test_plain_log_xaxis_labels_the_numbers_plotted():
    """Step counts on a logarithmic axis read as 1, 2, 4, ..., 32, not as powers of ten,
    and no minor tick is labelled."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [1, 2, 4, 8, 16, 32]
    fig, ax = plt.subplots()
    ax.plot(steps, [1.0 / m for m in steps])
    plain_log_xaxis(ax, ticks=steps)
    fig.canvas.draw()
    assert ax.get_xscale() == "log"
    assert [t.get_text() for t in ax.get_xticklabels()] == [str(m) for m in steps]
    assert not any(t.get_text() for t in ax.get_xticklabels(minor=True))
    plt.close(fig)


# -- running -------------------------------------------------------------------------


@pytest.mark.slow
def test_smoke_sweep_runs_skips_and_grows(tmp_path, compile_cache, capsys):
    """The shipped smoke sweep: first one point (--only), then the whole sweep adds
    only the other one, then a rerun runs nothing."""
    out = tmp_path / "smoke"
    assert sweep_main([SMOKE_SWEEP, "--workdir", str(out), "--only", "layers=1"]) == 0
    table = read_csv(out / "results.csv")
    assert [(r["model.num_layers"], r["evaluation"], r["status"]) for r in table][:2] == [
        ("1", "trained", "done"),
        ("1", "eval_steps=2", "done"),
    ]
    assert table[2]["status"] == table[3]["status"] == "pending"
    first = read_status(out / "points" / table[0]["point"])
    # The record names the command of the whole sweep, which the report covers.
    command = json.loads((out / "sweep.json").read_text())["command"]
    assert command.endswith(f"ocformer.sweep {SMOKE_SWEEP} --workdir {out}"), command
    assert f"`{command}`" in (out / "results.md").read_text()

    assert sweep_main([SMOKE_SWEEP, "--workdir", str(out), "--parallel", "2"]) == 0
    assert read_status(out / "points" / table[0]["point"]) == first  # not run again
    table = read_csv(out / "results.csv")
    assert len(table) == 4 and {r["status"] for r in table} == {"done"}
    info = json.loads((out / "sweep.json").read_text())
    assert info["id"] == "smoke" and len(info["points"]) == 2 and info["git"]["revision"]
    for layers in (1, 2):
        trained, finer = [r for r in table if r["model.num_layers"] == str(layers)]
        run = out / "points" / trained["point"] / "run"
        records = [json.loads(s) for s in (run / "metrics.jsonl").read_text().splitlines()]
        # The evaluation after training reproduces the loop's last validation loss (same
        # model, same validation batches) and counts diffrax's steps: one per layer,
        # two per layer when re-discretised with 2 steps per layer.
        assert float(trained["final_val_loss"]) == records[-1]["val_loss"]
        evaluated = json.loads(
            (out / "points" / trained["point"] / "evaluations" / "trained.json").read_text()
        )
        assert evaluated["val_loss"] == pytest.approx(records[-1]["val_loss"], rel=1e-6)
        assert int(trained["solver_steps"]) == layers and int(trained["rejected_steps"]) == 0
        assert finer[f"eval.{STEPS_PER_LAYER}"] == "2" and int(finer["solver_steps"]) == 2 * layers
        assert float(finer["final_val_loss"]) != float(trained["final_val_loss"])
        assert math.isfinite(float(finer["final_val_loss"]))
        assert float(trained["compile_time_s"]) > 0 and float(trained["peak_rss_mb"]) > 100
        assert float(trained["train_steps_per_s"]) > 0 and float(trained["wall_time_s"]) > 0
    assert os.listdir(compile_cache)  # the points' compilations were cached
    assert (out / "plots" / "final_val_loss_vs_model_num_layers.png").is_file()

    # A second sweep over a shape already compiled compiles nothing: every program,
    # the training and evaluation steps included, comes from the persistent cache
    # (equinox's checks return NaN instead of calling back to the host, by default).
    again = tmp_path / "again"
    assert sweep_main([SMOKE_SWEEP, "--workdir", str(again), "--only", "layers=1"]) == 0
    assert json.loads((again / "sweep.json").read_text())["runtime_checks"] is False
    (row,) = [
        r
        for r in read_csv(again / "results.csv")
        if r["evaluation"] == "trained" and r["status"] == "done"
    ]
    # JAX logs every program it loads from the cache as a hit and as a (fast)
    # "compilation": here the two counts agree, and the training step is among the hits.
    for log_name in ("train.log", "evaluate.log"):
        log = (again / "points" / row["point"] / log_name).read_text()
        hits = log.count("Persistent compilation cache hit")
        assert hits == log.count("Finished XLA compilation") > 0, (log_name, hits)
        if log_name == "train.log":
            assert "cache hit for 'jit_step'" in log

    capsys.readouterr()
    assert sweep_main([SMOKE_SWEEP, "--workdir", str(out)]) == 0
    assert "all 2 points finished; nothing to run" in capsys.readouterr().err

    # report rebuilds the same table without running anything.
    before = (out / "results.csv").read_text()
    (out / "results.csv").unlink()
    assert sweep_main(["report", str(out)]) == 0
    assert (out / "results.csv").read_text() == before

    # A point left 'running' by a killed sweep is resumed from its checkpoint (here the
    # last one, so nothing is retrained) and evaluated again; its results are unchanged.
    name = table[2]["point"]
    status = read_status(out / "points" / name)
    (out / "points" / name / "sweep_point.json").write_text(
        json.dumps({"name": name, "status": "running", "attempts": 1})
    )
    (out / "points" / name / "evaluations" / "trained.json").unlink()
    assert sweep_main([SMOKE_SWEEP, "--workdir", str(out)]) == 0
    again = read_status(out / "points" / name)
    assert again["status"] == "done" and again["attempts"] == 2
    assert (
        f"resuming {out / 'points' / name / 'run'} from step 4"
        in (out / "points" / name / "train.log").read_text()
    )
    assert status["attempts"] == 1
    resumed = read_csv(out / "results.csv")
    for key in ("final_val_loss", "best_val_loss", "final_val_accuracy", "solver_steps"):
        assert [r[key] for r in resumed] == [r[key] for r in table]


@pytest.mark.slow
def test_a_failing_point_is_recorded_and_the_sweep_goes_on(tmp_path, compile_cache, capsys):
    path = write_sweep(
        tmp_path,
        "mixed",
        """
        def get_sweep(arg=None):
            # A learning rate of 1e30 overflows the parameters: training aborts with
            # NonFiniteError (exit 4) after the warmup's first non-zero update.
            return Sweep(
                experiment=EXPERIMENT,
                overrides={"train.steps": 4, "train.eval_every": 4, "task.eval_batches": 1},
                axes=[axis("optimiser.learning_rate", [3e-3, 1e30], name="lr")],
            )
        """,
    )
    out = tmp_path / "out"
    assert sweep_main([path, "--workdir", str(out), "--parallel", "2"]) == 1
    err = capsys.readouterr().err
    assert "sweep: 1 failed:" in err
    assert "lr=1e+30_seed=0-" in err and "exit code 4" in err and "NonFiniteError" in err
    good, bad = read_csv(out / "results.csv")
    assert good["status"] == "done" and math.isfinite(float(good["final_val_loss"]))
    assert bad["status"] == "failed" and bad["exit_code"] == "4"
    assert "non-finite" in bad["error"]


def test_slurm_dry_run_prints_the_job_array_script(tmp_path, capsys):
    out = tmp_path / "out"
    code = sweep_main(
        [
            SMOKE_SWEEP,
            "--workdir",
            str(out),
            "--launcher",
            "slurm",
            "--dry-run",
            "--partition",
            "gpu",
            "--gpus",
            "1",
            "--array-parallelism",
            "1",
        ]
    )
    assert code == 0 and not out.exists()
    text = capsys.readouterr().out
    assert "2 points, 2 selected, 2 to run" in text
    script = text.split("--- job script (one array task per point) ---\n", 1)[1]
    assert script.startswith("#!/bin/bash")
    for line in (
        "#SBATCH --array=0-1%1",
        "#SBATCH --partition=gpu",
        "#SBATCH --gpus-per-node=1",
        "#SBATCH --cpus-per-task=2",  # from the sweep file
        "#SBATCH --time=10",  # from the sweep file
        "#SBATCH --signal=USR2@90",  # timeout/preemption: checkpoint and requeue
    ):
        assert line in script
    assert "-m submitit.core._submit" in script


@pytest.mark.slow
def test_slurm_array_through_submitits_local_executor(tmp_path, compile_cache, monkeypatch, capsys):
    """The job-array path with real subprocesses, through the command line with
    ``--wait``: on a machine that looks like a SLURM login node, the job is submitted to
    submitit's local executor, which runs each array task as SLURM would (the pickled
    PointJob); the sweep waits for it and reports."""
    import shutil

    import submitit

    from ocformer.distributed import SlurmJob

    path = write_sweep(
        tmp_path,
        "one",
        """
        def get_sweep(arg=None):
            return Sweep(
                experiment=EXPERIMENT,
                overrides={"train.steps": 2, "train.eval_every": 2, "task.eval_batches": 1},
                axes=[axis("model.num_layers", [1], name="layers")],
            )
        """,
    )
    out = tmp_path / "out"
    which = shutil.which
    monkeypatch.setattr(
        shutil,
        "which",
        lambda cmd, *a, **k: f"/{cmd}" if cmd in ("sbatch", "srun") else which(cmd, *a, **k),
    )

    def local_executor(job: SlurmJob) -> submitit.LocalExecutor:
        executor = submitit.LocalExecutor(folder=job.folder)
        executor.update_parameters(timeout_min=20)
        return executor

    monkeypatch.setattr(SlurmJob, "executor", local_executor)
    code = sweep_main([path, "--workdir", str(out), "--launcher", "slurm", "--wait"])
    assert code == 0 and "submitted 1 array tasks" in capsys.readouterr().out
    [row] = read_csv(out / "results.csv")
    assert row["status"] == "done" and row["step"] == "2" and int(row["solver_steps"]) == 1
    assert glob.glob(str(out / "slurm" / "*"))  # submitit's files where SLURM's would go


def test_points_submitted_to_slurm_are_not_submitted_again_while_queued(
    tmp_path, monkeypatch, capsys
):
    """Submitted points whose array tasks have not started were reported "not started
    (rerun the sweep to run)", and the rerun submitted them a second time. They are
    recorded as submitted (the report says so), and a rerun refuses them while squeue
    still lists their job; once it has left the queue they are submitted again."""
    import shutil
    import stat

    from ocformer.distributed import SlurmJob

    path = write_sweep(
        tmp_path,
        "two",
        """
        def get_sweep(arg=None):
            return Sweep(
                experiment=EXPERIMENT, overrides={"train.steps": 2},
                axes=[axis("model.num_layers", [1, 2], name="layers")],
            )
        """,
    )  # fmt: skip
    out = tmp_path / "out"
    which = shutil.which
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    squeue = bin_dir / "squeue"  # lists the job while the file "queued" exists
    squeue.write_text(f"#!/bin/sh\n[ -e {tmp_path}/queued ] && echo 4242\nexit 0\n")
    squeue.chmod(squeue.stat().st_mode | stat.S_IEXEC)
    fake = {"sbatch": "/sbatch", "srun": "/srun", "squeue": str(squeue)}
    monkeypatch.setattr(shutil, "which", lambda cmd, *a, **k: fake.get(cmd) or which(cmd, *a, **k))
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")

    class Job:
        def __init__(self, i):
            self.job_id = f"4242_{i}"

    class Executor:  # submits nothing: the tasks stay "queued"
        calls = 0

        def map_array(self, fn, items):
            Executor.calls += 1
            return [Job(i) for i in range(len(items))]

    monkeypatch.setattr(SlurmJob, "executor", lambda job: Executor())
    assert sweep_main([path, "--workdir", str(out), "--launcher", "slurm"]) == 0
    assert Executor.calls == 1
    capsys.readouterr()
    assert sweep_main(["report", str(out)]) == 0
    said = capsys.readouterr()
    assert "2 submitted (queued in SLURM, or lost: see squeue;" in said.out + said.err
    assert {r["status"] for r in read_csv(out / "results.csv")} == {"submitted"}
    (tmp_path / "queued").touch()
    assert sweep_main([path, "--workdir", str(out), "--launcher", "slurm"]) == 2
    err = capsys.readouterr().err
    assert "2 of the points to run (layers=1" in err and "job 4242, which squeue still" in err
    assert sweep_main([path, "--workdir", str(out)]) == 2  # nor run here meanwhile
    assert "--launcher local: 2 of the points to run" in capsys.readouterr().err
    assert Executor.calls == 1
    (tmp_path / "queued").unlink()  # the job has left the queue (its tasks were lost)
    assert sweep_main([path, "--workdir", str(out), "--launcher", "slurm"]) == 0
    assert Executor.calls == 2
    # Where squeue cannot tell, the points are submitted again with a warning.
    del fake["squeue"]
    monkeypatch.setenv("PATH", os.environ["PATH"].split(":", 1)[1])
    assert sweep_main([path, "--workdir", str(out), "--launcher", "slurm"]) == 0
    assert "squeue could not tell whether SLURM job 4242 still holds" in capsys.readouterr().err
    assert Executor.calls == 3


@pytest.mark.parametrize("handler", ["on the waiting thread", "on another thread"])
def test_point_job_requeues_itself_with_the_same_point(tmp_path, handler):
    """On SLURM's timeout or preemption signal submitit calls ``checkpoint``: the
    point's running process gets SIGTERM, checkpoints and exits, and only then is the
    task requeued, with the same point, without waiting out the grace period.

    submitit calls it from its signal handler, so on the thread that is blocked
    waiting for the training process (``on the waiting thread``); a point run by a
    worker thread of a local sweep has its waiter elsewhere (``on another thread``)."""
    import signal
    import threading
    import time

    from ocformer.sweeping import PointJob
    from ocformer.sweeping._run import STOP_GRACE_S, _children, _children_lock

    # A stand-in for the training process: it records the signal it got (its
    # checkpoint) and exits cleanly, as ocformer.train does on SIGTERM.
    checkpointed = tmp_path / "checkpointed"
    script = textwrap.dedent(
        f"""
        import signal, sys, time

        def stop(signum, frame):
            with open({str(checkpointed)!r}, "w") as f:
                f.write(signal.Signals(signum).name)
            sys.exit(0)

        signal.signal(signal.SIGTERM, stop)
        print("waiting", flush=True)
        time.sleep(120)
        """
    )
    log = tmp_path / "point.log"
    result: dict = {}
    seen: dict = {}
    job = PointJob(str(tmp_path))
    point = {"name": "p"}

    def run() -> None:
        # The thread of a point, as in run_point: it owns the child and reaps it.
        result.update(_run_logged([sys.executable, "-c", script], str(log), dict(os.environ)))

    def requeue() -> None:
        with _children_lock:
            [proc] = _children
        started = time.monotonic()
        seen["delayed"] = job.checkpoint(point)
        seen["waited"] = time.monotonic() - started
        # Requeued only after the process exited: its exit is collected already by
        # the thread that waits for it, or left for it to collect (a handler runs
        # while its thread is in the wait).
        try:
            ended = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            # Reaped already by the waiting thread, which reports the exit code (it may
            # not have stored it in the Popen yet).
            seen["exit_code"] = "reaped"
        else:
            assert ended is not None and ended.si_code == os.CLD_EXITED
            seen["exit_code"] = ended.si_status

    def when_waiting(then) -> None:
        deadline = time.monotonic() + 60
        # The first log line is the command itself; "waiting" on its own line means the
        # handler is installed.
        while time.monotonic() < deadline and (
            not log.exists() or "waiting" not in log.read_text().splitlines()[1:]
        ):
            time.sleep(0.05)
        then()

    try:
        if handler == "on the waiting thread":
            previous = signal.signal(signal.SIGUSR2, lambda signum, frame: requeue())
            signaller = threading.Thread(
                target=when_waiting, args=(lambda: os.kill(os.getpid(), signal.SIGUSR2),)
            )
            signaller.start()
            try:
                run()
            finally:
                signal.signal(signal.SIGUSR2, previous)
                signaller.join(timeout=60)
        else:
            worker = threading.Thread(target=run)
            worker.start()
            when_waiting(requeue)
            worker.join(timeout=60)
        assert seen["exit_code"] in (0, "reaped"), seen["exit_code"]
        assert result["exit_code"] == 0 and checkpointed.read_text() == "SIGTERM"
        # It waited for the exit, not for the whole grace period.
        assert seen["waited"] < STOP_GRACE_S / 2, seen["waited"]
        delayed = seen["delayed"]
        assert delayed.function is job and delayed.args == (point,) and delayed.kwargs == {}
    finally:
        with _children_lock:
            for p in _children:
                p.kill()


def test_stop_processes_sigkills_a_process_that_ignores_sigterm():
    """The one supervision routine of the package: SIGTERM, a bounded grace, SIGKILL."""
    import signal
    import subprocess
    import time

    from ocformer.distributed import stop_processes

    script = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "print('ready', flush=True); time.sleep(120)"
    )
    stubborn = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
    polite = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        assert stubborn.stdout is not None and stubborn.stdout.readline() == b"ready\n"
        started = time.monotonic()
        killed = stop_processes([stubborn, polite], grace_s=1.0)
        waited = time.monotonic() - started
        assert killed == [stubborn]
        # Both have ended, and their exits are left for their waiter to collect.
        flags = os.WEXITED | os.WNOHANG | os.WNOWAIT
        for p, sig in ((stubborn, signal.SIGKILL), (polite, signal.SIGTERM)):
            ended = os.waitid(os.P_PID, p.pid, flags)
            assert ended is not None and (ended.si_code, ended.si_status) == (os.CLD_KILLED, sig)
            assert p.returncode is None
            p.wait()
        assert stubborn.returncode == -signal.SIGKILL and polite.returncode == -signal.SIGTERM
        assert 1.0 <= waited < 10.0
    finally:
        for p in (stubborn, polite):
            if p.poll() is None:
                p.kill()
                p.wait()
        assert stubborn.stdout is not None
        stubborn.stdout.close()


@pytest.mark.slow
@pytest.mark.parametrize("signum", ["SIGTERM", "SIGINT"])
def test_a_signal_to_a_sweep_stops_its_point_and_records_it(tmp_path, compile_cache, signum):
    """A real sweep process and its real training process: SIGTERM to the sweep, or
    SIGINT to its process group (Ctrl-C at a terminal), reaches the training process
    as one SIGTERM (it checkpoints and exits, nothing is left running), the point is
    recorded as interrupted, and the sweep exits 128 + signal."""
    import glob
    import signal
    import subprocess
    import time

    from ocformer.checkpointing import CheckpointManager

    path = write_sweep(
        tmp_path,
        "long",
        """
        def get_sweep(arg=None):
            return Sweep(
                experiment=EXPERIMENT,
                overrides={"train.steps": 100000, "train.eval_every": 100000,
                           "train.checkpoint_every": 100000, "task.eval_batches": 1},
                axes=[axis("model.num_layers", [1], name="layers")],
            )
        """,
    )
    out = tmp_path / "out"
    sweep = subprocess.Popen(
        [sys.executable, "-m", "ocformer.sweep", path, "--workdir", str(out)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 600
        metrics: list[str] = []
        while not metrics:  # the training process is past its first step
            assert sweep.poll() is None, sweep.communicate()
            assert time.monotonic() < deadline, "the point did not start training"
            time.sleep(0.2)
            metrics = glob.glob(str(out / "points" / "*" / "run" / "metrics.jsonl"))
            if metrics and os.path.getsize(metrics[0]) == 0:
                metrics = []
        point = os.path.dirname(os.path.dirname(metrics[0]))
        child = read_status(point)["process"]
        if signum == "SIGINT":
            os.killpg(sweep.pid, signal.SIGINT)  # the terminal signals the whole group
        else:
            os.kill(sweep.pid, signal.SIGTERM)
        _, err = sweep.communicate(timeout=300)
    finally:
        if sweep.poll() is None:
            sweep.kill()
            sweep.wait()
    assert sweep.returncode == 128 + getattr(signal, signum), err
    assert f"stopped by {signum}" in err and "Rerun the same command" in err
    name = os.path.basename(point)
    steps = CheckpointManager(os.path.join(point, "run", "checkpoints")).steps()
    assert len(steps) == 1 and steps[0] >= 1
    assert f"point {name} checkpointed at step {steps[0]} (resumes there)" in err, err
    # The training process is gone (its pid no longer exists), not orphaned.
    with pytest.raises(ProcessLookupError):
        os.kill(child, 0)
    status = read_status(point)
    assert status["status"] == "interrupted", status
    assert status["exit_code"] == 143  # it checkpointed on the forwarded SIGTERM
    assert f"stopped by {signum}" in status["error"] and "killed" not in status["error"]
    assert f"last checkpoint is step {steps[0]}" in status["error"]


def test_progress_line_counts_and_eta():
    import threading
    import time

    from ocformer.sweeping._run import Progress

    stream = io.StringIO()
    progress = Progress(total=5, parallel=2, skipped=1, stream=stream)
    assert progress.line().startswith("sweep: 1/5 done, 0 running, 0 failed, ETA ?")
    progress.running, progress.times = 1, [10.0]
    progress.done, progress.failed = 2, 1
    progress.starts = {threading.get_ident(): time.perf_counter() - 4.0}
    # One point not started (10 s) plus the running one's remaining ~6 s, over 2 workers.
    assert progress.line().startswith("sweep: 2/5 done, 1 running, 1 failed, ETA 8s")
    # A point stopped by a signal is interrupted, not failed, and its time is no point's.
    progress.finish("interrupted", 4.0)
    assert progress.line().startswith("sweep: 2/5 done, 0 running, 1 failed, 1 interrupted, ")
    assert progress.times == [10.0]
    # A point that failed at once says nothing of the others' time (ETA 0s was shown
    # while a point still trained); a point running past the mean has an unknown end.
    progress = Progress(total=2, parallel=2, skipped=0, stream=stream)
    progress.start()
    progress.finish("failed", 0.5)
    progress.starts = {threading.get_ident(): time.perf_counter() - 30.0}
    progress.running = 1
    assert progress.times == [] and "ETA ?" in progress.line()
    progress.times = [20.0]  # one done in 20 s: the running one is overdue
    assert "ETA ?" in progress.line()
    progress.running, progress.starts, progress.done = 0, {}, 1
    assert "ETA 0s" in progress.line()


def test_progress_shows_each_running_point_s_step_and_times_it_by_its_steps(tmp_path):
    """A running point's training step (its metrics.jsonl against its train.steps) is
    on the line, and its time left is its elapsed time per step done in this attempt
    (a resumed point's earlier steps are not this attempt's)."""
    import threading
    import time

    from ocformer.sweeping._run import Progress, training_step

    workdir = tmp_path / "run"
    workdir.mkdir()
    assert training_step(str(workdir)) is None  # nothing written yet
    (workdir / "config.json").write_text(json.dumps({"train": {"steps": 100}}))
    (workdir / "metrics.jsonl").write_text('{"step": 20, "loss": 1.0}\n')
    progress = Progress(total=4, parallel=4, skipped=3, stream=io.StringIO())
    progress.start(str(workdir), resumes_at=20)  # its last checkpoint: step 20
    with (workdir / "metrics.jsonl").open("a") as f:
        f.write('{"step": 60, "loss": 0.5}\n{"step": 7')  # a line being written
    assert training_step(str(workdir)) == (60, 100)
    progress.starts[threading.get_ident()] = time.perf_counter() - 40.0
    # 40 steps in 40 s, 40 left: 40 s, not shared by the three idle workers (no point
    # done in this sweep, so no mean to use).
    assert re.search(r"1 running, 0 failed \(steps 60/100\), ETA 4[01]s", progress.line())


# -- evaluation ----------------------------------------------------------------------


@pytest.mark.slow
def test_a_run_with_an_adjoint_gradient_is_evaluated_under_a_splitting_scheme(tmp_path, capsys):
    """Optimise-then-discretise is refused under a splitting scheme for training; an
    evaluation computes no gradient, so its trained gradient gives way to the default,
    unless the evaluation sets it (then the refusal stands)."""
    from ocformer.config import DiscretisationConfig
    from ocformer.evaluate import main as evaluate_main
    from ocformer.training import train

    sets = ["train.steps=1", "train.progress=false", "discretisation.stepper=heun",
            "discretisation.gradient=optimise_then_discretise"]  # fmt: skip
    train(resolve(f"{SMOKE_EXPERIMENT}:float64", sets), str(tmp_path / "run"))
    out = tmp_path / "lie.json"
    lie = ["--set", "discretisation.stepper=lie"]
    assert evaluate_main([str(tmp_path / "run"), *lie, "--json", str(out)]) == 0
    used = json.loads(out.read_text())["discretisation"]
    assert used["discretisation.stepper"] == "lie"
    assert used["discretisation.gradient"] == DiscretisationConfig().gradient
    capsys.readouterr()
    again = [*lie, "--set", "discretisation.gradient=optimise_then_discretise"]
    assert evaluate_main([str(tmp_path / "run"), *again]) == 2
    assert "discretisation.gradient" in capsys.readouterr().err


def test_evaluate_refuses_non_discretisation_fields_and_non_runs(tmp_path, capsys):
    from ocformer.evaluate import main as evaluate_main

    assert evaluate_main([str(tmp_path), "--set", "model.width=8"]) == 2
    err = capsys.readouterr().err
    assert "model.width: evaluation may change only the discretisation" in err
    assert evaluate_main([str(tmp_path)]) == 2
    assert "is not an ocformer work directory" in capsys.readouterr().err
    assert evaluate_main([str(tmp_path / "missing")]) == 2
    assert "missing does not exist: give the work directory" in capsys.readouterr().err
    (tmp_path / "notes.txt").write_text("")
    assert evaluate_main([str(tmp_path / "notes.txt")]) == 2
    assert "notes.txt is a file, not a directory" in capsys.readouterr().err


def test_rediscretise_keeps_every_trained_array():
    """Evaluation re-discretises by replacing the discretisation value: every trained
    array is kept, the new grid is used, and a change the rules refuse is refused."""
    import equinox as eqx
    import jax
    import jax.tree_util as jtu

    from ocformer.config import apply_overrides, validate
    from ocformer.models import IncompatibleError, rediscretise
    from ocformer.training import build, build_discretisation

    config = resolve(SMOKE_EXPERIMENT, ["model.num_layers=2"])
    trained = build(apply_overrides(config, ["train.seed=7"])).model  # stands in for trained
    finer = build_discretisation(validate(apply_overrides(config, [f"{STEPS_PER_LAYER}=4"])))
    moved = rediscretise(trained, finer)
    assert moved.transformer.steps_per_layer == 4
    assert moved.transformer.discretisation == finer
    want = [x for x in jtu.tree_leaves(trained) if eqx.is_array(x)]
    got = [x for x in jtu.tree_leaves(moved) if eqx.is_array(x)]
    assert len(got) == len(want) and all(
        (a == b).all() for a, b in zip(jax.device_get(got), jax.device_get(want))
    )
    post = build(apply_overrides(config, ["model.norm=post"])).model
    with pytest.raises(IncompatibleError, match="no continuous limit"):
        rediscretise(post, finer)


def test_slurm_launch_without_slurm_is_refused_before_writing(tmp_path, capsys, monkeypatch):
    import shutil

    monkeypatch.setattr(shutil, "which", lambda name: None)
    out = tmp_path / "out"
    assert sweep_main([SMOKE_SWEEP, "--workdir", str(out), "--launcher", "slurm"]) == 2
    assert "no SLURM on this machine (sbatch and srun not found)" in capsys.readouterr().err
    assert not out.exists()


def test_an_interrupted_sweep_says_what_it_left(tmp_path):
    """The stop message names the points interrupted in training, each with the step
    of its last committed checkpoint or as stopped before its first one (read from the
    point's run directory: an uncommitted save does not count), those trained but not
    evaluated yet, and counts the points not started; it claims no interrupted point
    when none was."""
    import signal

    from ocformer.checkpointing import MARKER
    from ocformer.sweeping import SweepInterrupted
    from ocformer.sweeping._run import checkpoint_step

    checkpoints = tmp_path / "points" / "a" / "run" / "checkpoints"
    (checkpoints / "step_2").mkdir(parents=True)
    (checkpoints / "step_2" / MARKER).write_text("{}")
    (checkpoints / "step_4").mkdir()  # a save cut short: no marker
    (tmp_path / "points" / "b" / "run").mkdir(parents=True)
    steps = {n: checkpoint_step(str(tmp_path), n) for n in ("a", "b", "x")}
    assert steps == {"a": 2, "b": None, "x": None}

    e = SweepInterrupted(signal.SIGTERM, interrupted=steps, unevaluated=["c"], not_started=2)
    assert e.exit_code == 143
    assert str(e) == (
        "stopped by SIGTERM: point a checkpointed at step 2 (resumes there); points b, x "
        "stopped before their first checkpoint (restart from step 0); point c trained, with "
        "evaluations still to run; 2 point(s) not started. Rerun the same command to resume"
    )
    before = str(SweepInterrupted(signal.SIGINT, interrupted={"b": None}))
    assert "checkpointed" not in before
    assert "point b stopped before its first checkpoint (restarts from step 0)" in before
    only = str(SweepInterrupted(signal.SIGINT, unevaluated=["p"]))
    assert "interrupted" not in only.split(":", 1)[1] and "point p trained" in only


@pytest.mark.parametrize("text", ['{"id": "smoke", "points": [', "{}", "[]"])
def test_an_unreadable_sweep_record_is_refused_naming_the_file(tmp_path, text, capsys):
    """A sweep.json cut short, empty or not a record: the report exits 2 naming the file
    and what to do, with no traceback; a rerun of the sweep into the directory is not
    refused (it rewrites the record under its lock; here a dry run plans both points)."""
    (tmp_path / "sweep.json").write_text(text)
    assert sweep_main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'sweep.json'}: " in err and "rerun the sweep command" in err, err
    assert sweep_main([SMOKE_SWEEP, "--workdir", str(tmp_path), "--dry-run"]) == 0
    assert capsys.readouterr().out.count("evaluations: to run") == 2


def test_report_help_and_usage(tmp_path, capsys):
    """``report --help`` prints the report's help; a directory without sweep.json is
    refused as not a sweep directory."""
    with pytest.raises(SystemExit) as e:
        sweep_main(["report", "--help"])
    assert e.value.code == 0
    assert "usage: python -m ocformer.sweep report [-h] DIR" in capsys.readouterr().out
    assert sweep_main(["report", str(tmp_path)]) == 2
    assert "is not a sweep directory (no sweep.json)" in capsys.readouterr().err


def test_a_point_whose_start_hook_fails_is_not_left_running(tmp_path):
    """An exception after a point's process started (here, of the hook that records its
    start) ends the process before it propagates: nothing trains unwatched."""
    from ocformer.sweeping import _run

    started = []

    def on_start(proc):
        started.append(proc)
        raise RuntimeError("the sweep's record could not be written")

    with pytest.raises(RuntimeError, match="could not be written"):
        _run._run_logged(
            [sys.executable, "-c", "import time; time.sleep(60)"],
            str(tmp_path / "log.txt"),
            dict(os.environ),
            on_start=on_start,
        )
    (proc,) = started
    assert proc.returncode is not None and proc.returncode < 0  # ended by a signal
    assert proc not in _run._children
