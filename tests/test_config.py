"""The configuration schema: typed overrides, validation messages, and the bad-input table.

Every bad input is refused with exit code 2 (command line) or ``ConfigError`` (library),
with a message that names the field and what is allowed, before anything is built.
"""

import dataclasses
import glob
import json
import os
import re
import time

import pytest

from ocformer import train as cli
from ocformer.config import (
    Config,
    ConfigError,
    apply_overrides,
    from_dict,
    is_set,
    load_experiment,
    parse_override,
    resolve,
    to_dict,
    validate,
)
from ocformer.training import ExitCode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOKE = os.path.join(ROOT, "experiments", "smoke.py")
EXPERIMENTS = sorted(glob.glob(os.path.join(ROOT, "experiments", "*.py")))


def test_every_experiment_file_validates():
    names = {os.path.basename(p) for p in EXPERIMENTS}
    assert {"smoke.py", "shakespeare_char.py", "digits_vit.py"} <= names
    for path in EXPERIMENTS:
        config = resolve(path)
        assert isinstance(config, Config)
        # Each file documents how to run it and what it should give.
        with open(path, encoding="utf-8") as f:
            text = f.read()
        assert "python -m ocformer.train --config experiments/" in text
        assert "Expected" in text


def test_overrides_are_parsed_by_field_type():
    c = apply_overrides(
        Config(),
        [
            "model.num_layers=3",
            "optimiser.learning_rate=2.5e-4",
            "model.final_norm=false",
            "objective.kernel_norm=spectral",
            "objective.kernel_bound=2",
            "optimiser.clip_norm=none",
            "discretisation.stepper=strang",
            "discretisation.sub_solver=midpoint",
            "train.keep_checkpoints=7",
            "train.sample_prompt=ROMEO: x=1",
        ],
    )
    assert c.model.num_layers == 3 and type(c.model.num_layers) is int
    assert c.optimiser.learning_rate == 2.5e-4
    assert c.model.final_norm is False
    assert c.objective.kernel_norm == "spectral" and c.objective.kernel_bound == 2.0
    assert c.optimiser.clip_norm is None
    assert c.discretisation.stepper == "strang" and c.discretisation.sub_solver == "midpoint"
    assert c.train.keep_checkpoints == 7
    assert c.train.sample_prompt == "ROMEO: x=1"  # only the first '=' splits
    validate(c)
    # Unchanged sections are the same objects: overrides touch only what they name.
    assert c.task is Config().task or c.task == Config().task
    # One string is not a list of overrides (it was read a character at a time).
    with pytest.raises(ConfigError, match=r"got the string 'train.steps=5': give \['train"):
        resolve(SMOKE, "train.steps=5")  # type: ignore[arg-type]
    from ocformer.evaluation import evaluate_run

    with pytest.raises(ConfigError, match=r"got the string 'discretisation.stepper=strang'"):
        evaluate_run("unread", "discretisation.stepper=strang")  # type: ignore[arg-type]


def test_config_round_trips_through_json():
    c = apply_overrides(
        resolve(SMOKE), ["objective.kernel_norm=frobenius", "objective.kernel_bound=3"]
    )
    again = from_dict(json.loads(json.dumps(to_dict(c))))
    assert again == c


def test_unknown_field_suggests_the_nearest():
    with pytest.raises(ConfigError) as e:
        parse_override("model.num_layer=3")
    msg = str(e.value)
    assert e.value.field == "model.num_layer"
    assert "did you mean model.num_layers?" in msg
    assert "allowed:" in msg and "model.width" in msg


def _registries() -> dict:
    """Each configuration field whose names a library registry holds: the registry."""
    from ocformer.controls import CONTROL_KINDS, NORM_AFFINES
    from ocformer.dynamics import SUB_SOLVERS
    from ocformer.integration import GRADIENT_METHODS, STEPSIZES
    from ocformer.models import FORMULATIONS, NORM_POSITIONS, WEIGHT_DECAY_ON
    from ocformer.objective import KERNEL_NORMS, PRECISIONS
    from ocformer.operators import ACTIVATIONS, ATTENTION_KERNELS
    from ocformer.splitting import SCHEMES, SOLVERS
    from ocformer.tasks import FALLBACKS, TASKS

    return {
        "model.norm": NORM_POSITIONS,
        "model.activation": ACTIVATIONS,
        "model.formulation": FORMULATIONS,
        "model.precision": (None, *PRECISIONS),
        "model.attention_kernel": ATTENTION_KERNELS,
        "controls.kind": CONTROL_KINDS,
        "controls.norm_affine": NORM_AFFINES,
        "discretisation.stepper": (*SCHEMES, *SOLVERS),
        "discretisation.sub_solver": SUB_SOLVERS,
        "discretisation.stepsize": STEPSIZES,
        "discretisation.gradient": tuple(GRADIENT_METHODS),
        "objective.kernel_norm": (None, *KERNEL_NORMS),
        "optimiser.weight_decay_on": WEIGHT_DECAY_ON,
        "task.name": tuple(TASKS),
        "task.fallback": (None, *FALLBACKS),
    }


@pytest.mark.parametrize("path", list(_registries()))
def test_the_schemas_choices_are_the_registrys_names(path):
    """A field's allowed names are its registry's, in the schema, in validation's message
    and in the docs reference."""
    from ocformer.config import reference_table
    from ocformer.config._validate import check_keys

    registry = _registries()[path]
    section, name = path.split(".")
    assert tuple(check_keys(path).metadata["choices"]) == tuple(registry)
    bad = dataclasses.replace(Config(), **{section: dataclasses.replace(
        getattr(Config(), section), **{name: "no-such-name"})})  # fmt: skip
    with pytest.raises(ConfigError) as e:
        validate(bad)
    assert e.value.field == path
    names = ("none (None)" if c is None else repr(c) for c in registry)
    assert str(e.value).endswith("allowed: " + ", ".join(names))
    row = next(r for r in reference_table().splitlines() if r.startswith(f"| `{path}` "))
    allowed = " / ".join("None" if c is None else repr(c) for c in registry)
    assert f"| {allowed} |" in row


def test_every_task_is_built_from_the_task_fields_its_registry_entry_names():
    """The registry's options of each task are ``task.*`` fields and exactly the
    keyword arguments of its constructor, and ``build_task`` passes the configuration's
    values of those fields and no others."""
    import inspect

    from ocformer.config import TaskConfig
    from ocformer.tasks import TASKS
    from ocformer.training import _build

    fields = {f.name for f in dataclasses.fields(TaskConfig)}
    for name, spec in TASKS.items():
        assert set(spec.options) <= fields, name
        assert set(spec.options) == set(inspect.signature(spec.make).parameters), name
    task = TaskConfig(name="shakespeare_char", seq_len=7, data_dir="/d", fallback="stdlib")
    config = dataclasses.replace(Config(), task=task)
    assert _build._task_kwargs(config) == {"seq_len": 7, "data_dir": "/d", "fallback": "stdlib"}


def test_the_experiment_s_options_of_its_own_task_do_not_follow_another_task():
    """``--set task.name=X`` on an experiment written for another task: the options the
    file gave its task and X does not read go back to their defaults, unrecorded (the
    run's config.json holds no stale value); the same option given by ``--set``, in
    either order, or by a file that names a task that does not read it, is refused; a
    configuration a run recorded reads its other tasks' options as their defaults."""
    from ocformer.config import TaskConfig, as_recorded

    smoke = load_experiment(SMOKE)
    # An experiment for a copy task of 50 symbols (smoke.py's 8 are the default).
    wide = dataclasses.replace(smoke, task=dataclasses.replace(smoke.task, vocab_size=50))
    assert is_set(wide.task, "vocab_size")
    moved = apply_overrides(wide, ["task.name=tokens", "task.path=d", "task.seq_len=9"])
    assert not is_set(moved.task, "vocab_size") and moved.task.vocab_size == 8
    assert is_set(moved.task, "seq_len") and moved.task.seq_len == 9
    validate(moved)
    assert apply_overrides(wide, ["task.name=sort"]).task.vocab_size == 50  # sort reads it
    for sets in (
        ["task.vocab_size=50", "task.name=tokens"],
        ["task.name=tokens", "task.vocab_size=50"],
    ):
        with pytest.raises(ConfigError) as e:
            validate(apply_overrides(smoke, [*sets, "task.path=d"]))
        assert e.value.field == "task.vocab_size"
    file_made = dataclasses.replace(
        Config(), task=TaskConfig(name="tokens", path="d", vocab_size=50)
    )
    with pytest.raises(ConfigError, match="task.name=tokens does not read it"):
        validate(file_made)
    stored = to_dict(file_made)
    assert as_recorded(stored)["task"]["vocab_size"] == 8 and stored["task"]["vocab_size"] == 50
    validate(from_dict(as_recorded(stored)))


# (overrides, dotted field expected in the message, words the message must contain)
BAD_CONFIGS = [
    (["model.num_layer=3"], "model.num_layer", "did you mean model.num_layers"),
    (["modle.width=3"], "modle.width", "did you mean model"),
    (["train.steps=ten"], "train.steps", "expected an int"),
    (["train.steps=1e3"], "train.steps", "expected an int"),
    (["model.final_norm=maybe"], "model.final_norm", "expected a bool"),
    (["optimiser.learning_rate=fast"], "optimiser.learning_rate", "expected a float"),
    (["model.width=-4"], "model.width", ">= 1"),
    (["task.batch_size=0"], "task.batch_size", ">= 1"),
    (["optimiser.learning_rate=0"], "optimiser.learning_rate", "> 0"),
    (["optimiser.b2=1.0"], "optimiser.b2", "< 1"),
    (["model.width=30", "model.num_heads=4"], "model.num_heads", "must divide model.width=30"),
    (["discretisation.stepper=verlet"], "discretisation.stepper", "allowed: 'lie'"),
    (["foo.bar=1"], "foo.bar", "unknown section foo; allowed: model"),
    (["train.qqqqqqqq=1"], "train.qqqqqqqq", "unknown field train.qqqqqqqq; allowed: train.steps"),
    (["discretisation.stepper=tsit"], "discretisation.stepper", "did you mean 'tsit5'"),
    (["discretisation.sub_solver=rk4"], "discretisation.sub_solver", "'midpoint'"),
    (["task.name=imagenet"], "task.name", "allowed: 'shakespeare_char'"),
    (["task.path=data/mine"], "task.path", "task.name=copy would ignore it"),
    (
        ["task.name=tokens", "task.path=d", "task.vocab_size=100"],
        "task.vocab_size",
        "is 100, but task.name=tokens does not read it (only copy, sort do; the vocabulary "
        "size of task.name=tokens is its dataset manifest's); drop task.vocab_size",
    ),
    (["task.data_dir=/d"], "task.data_dir", "task.name=copy does not read it (only shakespeare"),
    (["task.name=digits", "task.seq_len=10"], "task.seq_len", "task.name=digits does not read"),
    (["model.init_from="], "model.init_from", "is empty (it would name the current directory)"),
    (["train.progress=maybe"], "train.progress", "expected a bool (true/false; also 1/0"),
    (["model.norm=middle"], "model.norm", "allowed: 'pre', 'post'"),
    (
        ["discretisation.depth_parallel=foo"],
        "discretisation.depth_parallel",
        "allowed: none (None), 'parareal', 'mgrit'",
    ),
    (["optimiser.name=lion"], "optimiser.name", "'adamw'"),
    (
        ["optimiser.weight_decay_on=biases"],
        "optimiser.weight_decay_on",
        "got 'biases'; allowed: 'all', 'matrices'",
    ),
    (
        ["optimiser.name=sgd", "optimiser.weight_decay_on=matrices"],
        "optimiser.weight_decay_on",
        "optimiser.name=sgd applies no weight decay; set optimiser.name=adamw",
    ),
    (["train.on_nonfinite=ignore"], "train.on_nonfinite", "'abort', 'skip'"),
    (
        [
            "discretisation.stepper=tsit5",
            "discretisation.stepsize=pid",
            "discretisation.jump_ts=false",
        ],
        "discretisation.jump_ts",
        "where they jump",
    ),
    (["discretisation.stepsize=pid"], "discretisation.stepsize", "error estimate"),
    (
        ["discretisation.stepper=kvaerno4"],
        "discretisation.steps_per_layer",
        "steps_per_layer >= 4",
    ),
    (["discretisation.stepsize=adaptive"], "discretisation.stepsize", "'pid'"),
    (
        ["discretisation.gradient=optimise_then_discretise"],
        "discretisation.gradient",
        "pre-LN is a smooth ODE",
    ),
    (["discretisation.gradient=backprop"], "discretisation.gradient", "allowed"),
    (
        ["model.norm=post", "discretisation.stepper=tsit5"],
        "discretisation.stepper",
        "projection (indicator) terms",
    ),
    (
        # The cause is the per-feature layer norm, and the message says so.
        ["model.norm=post", "model.formulation=projected", "discretisation.stepper=tsit5"],
        "controls.norm_affine",
        "scalar",
    ),
    (
        ["model.norm=post", "discretisation.steps_per_layer=4"],
        "discretisation.steps_per_layer",
        "no continuous limit",
    ),
    (
        ["discretisation.stepper=heun", "discretisation.sub_solver=midpoint"],
        "discretisation.sub_solver",
        "not a splitting scheme",
    ),
    (["model.formulation=relaxed"], "model.formulation", "smooth limit of post-LN"),
    (["objective.kernel_norm=spectral"], "objective.kernel_bound", "go together"),
    (["objective.sigma_floor=0"], "objective.sigma_floor", "> 0"),
    (["controls.kind=basis", "controls.basis_size=5"], "controls.basis_size", "must be <= 2"),
    (
        ["controls.kind=basis", "controls.basis_size=2"],
        "objective.sigma_floor",
        "expansion coefficients",
    ),
    (["train.method=newton"], "train.method", "allowed: 'gradient', 'msa'"),
    (
        ["train.method=msa", "discretisation.stepper=tsit5", "discretisation.stepsize=pid"],
        "discretisation.stepsize",
        "layer map Phi of a fixed grid",
    ),
    (["train.method=msa", "controls.kind=piecewise_linear"], "controls.kind", "not independent"),
    (["train.method=msa", "train.msa_inner_steps=0"], "train.msa_inner_steps", ">= 1"),
    (
        ["train.method=msa", "discretisation.depth_parallel=parareal"],
        "discretisation.depth_parallel",
        "sweeps the layer maps serially",
    ),
    (["train.method=msa", "train.msa_rho=0"], "train.msa_rho", "> 0"),
    (
        ["train.method=msa", "objective.control_smoothness=0.1"],
        "objective.control_smoothness",
        "couples neighbouring layers",
    ),
    (
        [
            "train.method=msa",
            "discretisation.stepper=heun",
            "discretisation.gradient=optimise_then_discretise",
        ],
        "discretisation.gradient",
        "the continuous adjoint",
    ),
    (
        ["objective.ternary=true", "controls.kind=piecewise_linear"],
        "controls.kind",
        "theta(t) between them is not ternary",
    ),
    (
        ["objective.ternary=true", "objective.kernel_norm=spectral", "objective.kernel_bound=2"],
        "objective.kernel_norm",
        "off the ternary set",
    ),
    (["objective.ternary_sparsity=0.1"], "objective.ternary_sparsity", "the kernels are real"),
    (
        ["train.method=msa", "objective.ternary=true", "train.msa_ternary_memory=0"],
        "train.msa_ternary_memory",
        "> 0",
    ),
    # The schedule's step and the data's indices are int32, JAX's keys 32-bit seeds:
    # larger values were an OverflowError traceback (or seed 2**32 the key of seed 0).
    (
        ["train.steps=3000000000"],
        "train.steps",
        "must lie in [0, 2147483647] (it is held as a 32-bit integer)",
    ),
    (["optimiser.warmup_steps=99999999999999999999999"], "optimiser.warmup_steps", "32-bit"),
    (["train.seed=4294967296"], "train.seed", "must be < 4294967296"),
    (["train.steps"], "--set", "bad --set syntax"),
    (["model=3"], "model", "not a whole section"),
    (["a.b.c=1"], "a.b.c", "malformed key"),
]


@pytest.mark.parametrize(
    "overrides, field, words", BAD_CONFIGS, ids=[" ".join(b[0]) for b in BAD_CONFIGS]
)
def test_bad_config_is_refused_by_name(overrides, field, words, tmp_path, capsys):
    with pytest.raises(ConfigError) as e:
        resolve(SMOKE, overrides)
    assert e.value.field == field
    assert words in str(e.value)
    # The command line: exit code 2, the same message, and no work directory made.
    workdir = tmp_path / "run"
    argv = ["--config", SMOKE, "--workdir", str(workdir)]
    for o in overrides:
        argv += ["--set", o]
    assert cli.main(argv) == ExitCode.USAGE == 2
    err = capsys.readouterr().err
    assert words in err and field in err
    assert not workdir.exists()


@pytest.mark.parametrize(
    "spec, words",
    [
        ("experiments/no_such_experiment.py", "does not exist"),
        ("experiments/smoke.txt", "expected a Python experiment file"),
        ("{tmp}/no_get_config.py", "defines no get_config"),
        ("{tmp}/wrong_type.py", "get_config returned dict"),
        # Ending the process is an error of the file too (it exited 7, without a word).
        ("{tmp}/exits.py", "importing it raised SystemExit: 7"),
        ("{tmp}/exits_in_get_config.py", "get_config(None) raised SystemExit: 5"),
        # A section that is not one: named (model.dtype was read before validation).
        ("{tmp}/no_model.py", "model: expected ModelConfig, got NoneType"),
    ],
)
def test_bad_experiment_file(spec, words, tmp_path, capsys):
    (tmp_path / "no_get_config.py").write_text("X = 1\n")
    (tmp_path / "wrong_type.py").write_text("def get_config(arg):\n    return {}\n")
    (tmp_path / "exits.py").write_text("import sys\nsys.exit(7)\n")
    (tmp_path / "exits_in_get_config.py").write_text(
        "def get_config(arg=None):\n    raise SystemExit(5)\n"
    )
    (tmp_path / "no_model.py").write_text(
        "from ocformer.config import Config\n\n\ndef get_config(arg=None):\n"
        "    return Config(model=None)\n"
    )
    spec = spec.format(tmp=tmp_path)
    if "no_model" not in spec:
        with pytest.raises(ConfigError, match=re.escape(words)):
            load_experiment(spec)
    code = cli.main(["--config", spec, "--workdir", str(tmp_path / "run")])
    assert code == 2 and words in capsys.readouterr().err


def test_experiment_argument_is_passed():
    assert load_experiment(f"{SMOKE}:float64").model.dtype == "float64"
    assert load_experiment(SMOKE).model.dtype == "float32"


def test_validation_precedes_any_build(monkeypatch, tmp_path):
    """A bad config fails before the model is built, anything traced or a file written."""
    import ocformer.training._loop as loop
    from ocformer.training import train

    def forbidden(*args, **kwargs):
        raise AssertionError("build() was called for an invalid configuration")

    monkeypatch.setattr(loop, "build", forbidden)
    bad = dataclasses.replace(Config(), model=dataclasses.replace(Config().model, num_heads=3))
    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match="num_heads=3 must divide model.width=32"):
        train(bad, str(tmp_path / "run"))
    assert time.perf_counter() - t0 < 1.0
    assert not (tmp_path / "run").exists()
    # A wrong type in a section constructed directly (not via --set) is caught too.
    bad = dataclasses.replace(Config(), train=dataclasses.replace(Config().train, steps="10"))
    with pytest.raises(ConfigError, match=r"train.steps: expected int, got '10'"):
        train(bad, str(tmp_path / "run"))


def test_building_an_unvalidated_refused_config_reports_the_rules_field_and_message():
    """``build`` on a configuration that skipped ``validate`` reports the model's
    ``IncompatibleError`` as the ``ConfigError`` validation would give: the same field,
    the same message."""
    import jax.random as jr

    from ocformer.config import choices
    from ocformer.models import refusals
    from ocformer.training import build_model, build_task

    base = Config()
    bad = dataclasses.replace(
        base,
        model=dataclasses.replace(base.model, norm="post"),
        discretisation=dataclasses.replace(base.discretisation, stepper="tsit5"),
    )
    (refusal, *_) = refusals(choices(bad))
    with pytest.raises(ConfigError) as built:
        build_model(bad, build_task(bad), jr.key(0))
    with pytest.raises(ConfigError) as validated:
        validate(bad)
    assert built.value.field == validated.value.field == refusal.field
    assert str(built.value) == str(validated.value) == f"{refusal.field}: {refusal.message}"


def test_missing_data_file_is_a_usage_error(tmp_path, capsys):
    argv = [
        "--config",
        SMOKE,
        "--workdir",
        str(tmp_path / "run"),
        "--set",
        "task.name=shakespeare_char",
        "--set",
        f"task.data_dir={tmp_path / 'nowhere'}",
    ]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "nowhere" in err and "make data" in err
    assert "--set task.fallback=stdlib" in err  # the command line's way, not Python's alone
    assert not (tmp_path / "run").exists()


def test_task_refusal_is_a_usage_error(tmp_path, capsys):
    # The copy task needs an even length: the task's own check, reported by field.
    argv = ["--config", SMOKE, "--workdir", str(tmp_path / "run"), "--set", "task.seq_len=15"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "error: task.seq_len: must be an even integer >= 2" in err
    assert "got 15 (the copy task)" in err


def test_sampling_a_task_without_text_is_a_usage_error(tmp_path, capsys):
    argv = [
        "--config",
        SMOKE,
        "--workdir",
        str(tmp_path / "run"),
        "--set",
        "train.sample_tokens=10",
    ]
    assert cli.main(argv) == 2
    assert "train.sample_tokens" in capsys.readouterr().err


_SETS = """
import dataclasses
from ocformer.config import Config, ControlsConfig, ModelConfig


def get_config(arg=None):
    model = ModelConfig(4, width=32)  # num_layers by position; width at its default
    if arg == "replace":
        model = dataclasses.replace(model, hidden=64)  # every field passed: a copy
    return Config(model=model, controls=ControlsConfig(kind="piecewise_constant"))
"""


def _set_names(section) -> list[str]:
    return [f.name for f in dataclasses.fields(section) if is_set(section, f.name)]


def test_fields_set_explicitly_are_recorded_at_the_config_edge(tmp_path):
    """The experiment file's constructor arguments and ``--set`` count as set, default
    values included; the record changes neither the value nor ``config.json``."""
    path = tmp_path / "sets.py"
    path.write_text(_SETS)
    c = load_experiment(str(path))
    assert _set_names(c.model) == ["num_layers", "width"]
    assert _set_names(c.controls) == ["kind"]
    c = apply_overrides(c, ["model.hidden=64", "model.norm=pre"])
    assert _set_names(c.model) == ["num_layers", "width", "hidden", "norm"]
    assert c == Config(model=dataclasses.replace(Config().model, num_layers=4))
    assert to_dict(c) == json.loads(json.dumps(to_dict(c)))  # no record in the data
    # Without a record (built outside an experiment file, a dataclasses.replace copy,
    # a stored configuration) a field counts as set when it differs from its default.
    assert _set_names(Config().model) == []
    assert _set_names(from_dict(to_dict(c)).model) == ["num_layers"]
    copy = load_experiment(f"{path}:replace")
    assert _set_names(copy.model) == ["num_layers"]
    assert _set_names(apply_overrides(copy, ["model.width=32"]).model) == [
        "num_layers",
        "width",
    ]


def test_a_recorded_run_of_a_combination_refused_since_is_read_by_its_forward_solve():
    """optimise_then_discretise on the relaxed formulation is refused (its gradients
    were wrong by orders of magnitude); a run that recorded it is still read (load_run,
    evaluate, export need only the forward solve, which the gradient method does not
    change), as the default gradient method."""
    from ocformer.config import as_recorded

    sets = ["model.norm=post", "model.formulation=relaxed", "controls.norm_affine=scalar",
            "discretisation.stepper=kencarp3", "discretisation.steps_per_layer=4"]  # fmt: skip
    stored = json.loads(json.dumps(to_dict(resolve(SMOKE, sets))))
    stored["discretisation"]["gradient"] = "optimise_then_discretise"
    with pytest.raises(ConfigError, match="optimise_then_discretise on the relaxed formulation"):
        validate(from_dict(stored))
    read = validate(from_dict(as_recorded(stored)))
    assert read.discretisation.gradient == "discretise_then_optimise"


def test_a_weight_decay_adam_or_sgd_would_ignore_is_refused_and_a_recorded_one_read():
    """Only adamw decays weights: a decay given with adam or sgd was accepted and
    trained without (a run of its own would think it regularised). Refused now; a run
    that recorded one is read as it trained, without a decay."""
    from ocformer.config import as_recorded

    for name in ("adam", "sgd"):
        with pytest.raises(ConfigError, match=f"optimiser.name={name} applies none"):
            resolve(SMOKE, [f"optimiser.name={name}", "optimiser.weight_decay=0.1"])
        stored = json.loads(json.dumps(to_dict(resolve(SMOKE, [f"optimiser.name={name}"]))))
        stored["optimiser"]["weight_decay"] = 0.1
        assert validate(from_dict(as_recorded(stored))).optimiser.weight_decay == 0.0
    assert resolve(SMOKE, ["optimiser.weight_decay=0.1"]).optimiser.weight_decay == 0.1


def test_fields_the_run_would_not_read_are_listed_with_why():
    """Accepted (a sweep's axis may set them on every point) but listed, and the
    training command warns of each: the run would not read them."""
    from ocformer.config import unread_fields

    assert unread_fields(resolve(SMOKE, [])) == {}
    listed = unread_fields(resolve(SMOKE, [
        "optimiser.momentum=0.9", "optimiser.schedule=constant", "optimiser.end_lr_ratio=0.5",
        "model.relaxation_eps=5", "model.conv_kernel=4", "controls.basis_size=3",
        "train.sample_temperature=2", "train.msa_rho=7", "train.msa_ternary_step=5",
    ]))  # fmt: skip
    assert listed == {
        "optimiser.momentum": "only sgd has a momentum, not adamw",
        "optimiser.end_lr_ratio": "the constant schedule keeps its peak rate",
        "model.relaxation_eps": "it is the relaxed formulation's, and model.formulation=split",
        "model.conv_kernel": "model.attention=dot has no kernels",
        "controls.basis_size": "controls.kind=piecewise_constant has no basis",
        "train.sample_temperature": "train.sample_tokens=0 samples nothing",
        "train.msa_rho": "train.method=gradient runs no MSA iteration",
        "train.msa_ternary_step": "train.method=gradient runs no MSA iteration",
    }
    # Under MSA the optimiser section is unused, and kept so that one file serves both
    # methods: not listed (nor given a gradient optimiser's reason).
    assert unread_fields(resolve(SMOKE, ["train.method=msa", "optimiser.momentum=0.9"])) == {}
    # Read where the mode reads them.
    assert unread_fields(resolve(SMOKE, [
        "optimiser.name=sgd", "optimiser.momentum=0.9", "controls.kind=basis",
        "objective.sigma_floor=none",
        "controls.basis_size=2", "train.sample_tokens=4", "train.sample_temperature=2",
    ])) == {}  # fmt: skip


def test_a_recorded_serial_run_with_a_fallback_condition_is_read():
    """A fallback condition without a depth-parallel solve is refused since (it did
    nothing); a run that recorded one is still read, the condition at its default."""
    from ocformer.config import as_recorded

    stored = json.loads(json.dumps(to_dict(resolve(SMOKE, []))))
    stored["train"] |= {"depth_fallback_patience": 3, "depth_fallback_cosine": 0.9}
    with pytest.raises(ConfigError, match="train.depth_fallback_cosine=0.9 acts on a depth"):
        validate(from_dict(stored))
    read = validate(from_dict(as_recorded(stored)))
    assert (read.train.depth_fallback_patience, read.train.depth_fallback_cosine) == (0, None)


def test_an_evaluation_under_a_diffrax_solver_drops_the_trained_sub_solver():
    """A run trained under Strang with a midpoint sub-solver, evaluated under tsit5:
    its sub-solver gives way (it was refused: "Leave sub_solver=euler", a field the
    user never gave); given with the new stepper, it is still refused."""
    from ocformer.evaluation import evaluation_config

    trained = resolve(
        SMOKE, ["discretisation.stepper=strang", "discretisation.sub_solver=midpoint"]
    )
    tsit5 = evaluation_config(trained, ["discretisation.stepper=tsit5"]).discretisation
    assert (tsit5.stepper, tsit5.sub_solver) == ("tsit5", "euler")
    with pytest.raises(ConfigError, match=r"discretisation.sub_solver: sub_solver='midpoint'"):
        evaluation_config(
            trained, ["discretisation.stepper=tsit5", "discretisation.sub_solver=midpoint"]
        )


def test_an_evaluation_refusal_says_which_remedies_an_evaluation_cannot_take():
    """A refusal whose remedies include a field of the trained run (model.precision
    under bfloat16 with an implicit solver; the formulation of a post-LN run refined)
    says that the evaluation cannot change it; one naming the discretisation alone is
    left as it is."""
    from ocformer.evaluation import evaluation_config

    bf16 = resolve(SMOKE, ["model.precision=bfloat16"])
    with pytest.raises(ConfigError) as e:
        evaluation_config(bf16, ["discretisation.stepper=kvaerno3"])
    assert e.value.field == "model.precision"
    assert str(e.value).endswith(
        "(model.precision belongs to the trained run, which an evaluation does not "
        "change: of these remedies, take one in the discretisation.)"
    )
    post = resolve(SMOKE, ["model.norm=post"])
    with pytest.raises(ConfigError, match=r"\(controls.norm_affine, model.formulation belong"):
        evaluation_config(post, ["discretisation.steps_per_layer=2"])
    with pytest.raises(ConfigError) as e:
        evaluation_config(bf16, ["discretisation.stepsize=pid"])
    assert "belong" not in str(e.value)
