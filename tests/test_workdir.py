"""The work directory is the user's data: bad inputs are refused by name with their exit
code and change nothing; resuming repairs the logs and refuses (or records) a changed
configuration.

Runs are the command line in-process (``ocformer.train.main``) on experiments/smoke.py.
"""

import hashlib
import json
import os
import random
import shutil

import pytest
from _faults import flip_bytes, nan_at_update

from ocformer import train as cli
from ocformer.checkpointing import MARKER, CheckpointManager
from ocformer.config import ConfigError, resolve
from ocformer.training import (
    RUN_MARKER,
    ConfigChanged,
    ExitCode,
    RunDirectory,
    WorkdirError,
    _loop,
    make_schedule,
    train,
)
from ocformer.training._build import restore_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOKE = os.path.join(ROOT, "experiments", "smoke.py")
STEPS = 12
BASE = [
    "train.progress=false",
    f"train.steps={STEPS}",
    "train.checkpoint_every=4",
    "train.keep_checkpoints=5",
    "train.eval_every=6",
]


def argv(workdir, *overrides, config=SMOKE, flags=()):
    out = ["--config", config, "--workdir", str(workdir), *flags]
    for o in (*BASE, *overrides):
        out += ["--set", o]
    return out


def read_metrics(workdir) -> list[dict]:
    with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def numbers(records) -> list[tuple]:
    keys = ("step", "loss", "grad_norm", "lr", "val_loss", "val_accuracy", "skipped_steps")
    return [tuple(r.get(k) for k in keys) for r in records]


def snapshot(directory) -> dict[str, str]:
    """Every file under ``directory`` (relative path -> SHA-256 of its bytes)."""
    out = {}
    for root, _, files in os.walk(directory):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, directory)] = hashlib.sha256(f.read()).hexdigest()
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """A finished run: checkpoints at steps 4, 8, 12, evaluations at 6 and 12."""
    workdir = tmp_path_factory.mktemp("reference") / "run"
    assert cli.main(argv(workdir)) == 0
    records = read_metrics(workdir)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    return workdir


def copy_of(reference, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(reference, dst)
    return dst


# ---------------------------------------------------------------------------------------
# The table of bad inputs. Each case prepares its input and returns (argv, the directory
# that must come out unchanged, or None); the run must exit with the code and say the
# words, without a traceback.


def _foreign(tmp_path, reference):
    d = tmp_path / "theirs"
    d.mkdir()
    (d / "config.json").write_text('{"lr": 0.1}\n')
    (d / "metrics.jsonl").write_text('{"epoch": 1, "acc": 0.5}\n')
    return argv(d), d


def _empty_path(tmp_path, reference):
    return argv(""), tmp_path  # the current directory (the test's tmp_path)


def _blank_path(tmp_path, reference):
    return argv("   "), tmp_path


def _file(tmp_path, reference):
    (tmp_path / "notes.txt").write_text("my notes\n")
    return argv(tmp_path / "notes.txt"), tmp_path


def _below_a_file(tmp_path, reference):
    (tmp_path / "notes.txt").write_text("my notes\n")
    return argv(tmp_path / "notes.txt" / "run"), tmp_path


def _cannot_create(tmp_path, reference):
    # /proc refuses new directories even to root (where permission bits do not).
    return argv("/proc/ocformer_test_run/run"), None


def _changed_steps(tmp_path, reference):
    d = copy_of(reference, tmp_path)
    return argv(d, "train.steps=16"), d


def _fewer_steps_than_reached(tmp_path, reference):
    d = copy_of(reference, tmp_path)
    return argv(d, "train.steps=6", flags=["--allow-config-change"]), d


def _changed_numerics(tmp_path, reference):
    d = copy_of(reference, tmp_path)
    return argv(d, "optimiser.learning_rate=0.01", "model.activation=relu"), d


def _experiment_argument(tmp_path, reference):
    return argv(tmp_path / "run", config=SMOKE + ":shrt"), tmp_path


def _syntax_error(tmp_path, reference):
    path = tmp_path / "broken.py"
    path.write_text("def get_config(arg=None):\n    return Config(\n\nx = 1\n")
    return argv(tmp_path / "run", config=str(path)), tmp_path


def _get_config_raises(tmp_path, reference):
    path = tmp_path / "raises.py"
    path.write_text("def get_config(arg=None):\n    raise RuntimeError('no GPU here')\n")
    return argv(tmp_path / "run", config=str(path)), tmp_path


def _import_fails(tmp_path, reference):
    path = tmp_path / "imports.py"
    path.write_text("import numpy\nimport ocformer_does_not_exist\n")
    return argv(tmp_path / "run", config=str(path)), tmp_path


def _missing_experiment(tmp_path, reference):
    return argv(tmp_path / "run", config=str(tmp_path / "nope.py")), tmp_path


def _bad_value(tmp_path, reference):
    return argv(tmp_path / "run", "train.steps=-1"), tmp_path


def _unknown_field(tmp_path, reference):
    return argv(tmp_path / "run", "train.stepz=3"), tmp_path


def _infinite_learning_rate(tmp_path, reference):
    return argv(tmp_path / "run", "optimiser.learning_rate=inf"), tmp_path


def _nan_learning_rate(tmp_path, reference):
    return argv(tmp_path / "run", "optimiser.learning_rate=nan"), tmp_path


def _batch_larger_than_memory(tmp_path, reference):
    return argv(tmp_path / "run", "task.batch_size=1000000000"), tmp_path


def _larger_than_memory(*sets):
    def case(tmp_path, reference):
        return argv(tmp_path / "run", *sets), tmp_path

    return case


def test_the_memory_refusal_names_a_field_that_would_make_the_largest_part_fit():
    """Among the fields the run reads that size its largest part, the one whose default
    shrinks that part most: not a field of a smaller part further above its default,
    nor one the run does not read (basis_size under piecewise-constant controls)."""
    from ocformer.training._rundir import check_memory

    for sets, field in [
        (["model.width=4000", "task.eval_batches=100000"], "model.width"),
        (["controls.basis_size=20000", "model.width=20000"], "model.width"),
        (["model.hidden=2147483647"], "model.hidden"),
        (["task.batch_size=100000", "task.seq_len=1024"], "task.batch_size"),
    ]:
        with pytest.raises(ConfigError) as e:
            check_memory(resolve(SMOKE, sets), available=2**30)
        assert e.value.field == field and str(e.value).endswith(f"lower {field}"), sets
    with pytest.raises(ValueError, match=r"Unknown memory parts \['validation'\]"):
        check_memory(resolve(SMOKE, []), available=2**30, parts=("validation",))


def _mesh_larger_than_the_devices(tmp_path, reference):
    return argv(tmp_path / "run", "mesh.data=3"), tmp_path


def _bad_set_syntax(tmp_path, reference):
    return argv(tmp_path / "run", "train.steps"), tmp_path


def _missing_data(tmp_path, reference):
    overrides = ("task.name=shakespeare_char", f"task.data_dir={tmp_path / 'no_data'}")
    return argv(tmp_path / "run", *overrides), tmp_path


def _corrupt_marker(tmp_path, reference):
    d = copy_of(reference, tmp_path)
    (d / "checkpoints" / f"step_{STEPS}" / MARKER).write_text("{not json")
    return argv(d), d


def _corrupt_arrays(tmp_path, reference):
    d = copy_of(reference, tmp_path)
    for root, _, files in os.walk(d / "checkpoints" / f"step_{STEPS}"):
        for name in files:
            if name != MARKER and "ocdbt.process" in root:
                with open(os.path.join(root, name), "wb") as f:
                    f.write(b"\x00garbage")
    return argv(d), d


def _other_shape(tmp_path, reference):
    d = copy_of(reference, tmp_path)
    return argv(d, "model.width=32", flags=["--allow-config-change"]), d


def _other_method(tmp_path, reference):
    d = copy_of(reference, tmp_path)
    return argv(d, "train.method=msa", flags=["--allow-config-change"]), d


def _a_file_of_the_run_not_writable(tmp_path, reference, monkeypatch):
    """As a user who may not write metrics.jsonl sees it (os.access answers no: the
    suite may run as root, whom permissions do not stop). The start-up check looked at
    the directory only: the run trained, then failed at its first log write, exit 1."""
    d = copy_of(reference, tmp_path)
    access = os.access
    monkeypatch.setattr(os, "access", lambda p, m, **kw: not str(p).endswith("metrics.jsonl")
                        and access(p, m, **kw))  # fmt: skip
    return argv(d, "train.steps=16", flags=["--allow-config-change"]), d


def _config_json_deleted_and_changed(tmp_path, reference):
    d = copy_of(reference, tmp_path)
    os.remove(d / "config.json")
    return argv(d, "optimiser.learning_rate=0.01", "model.activation=relu"), d


def _config_json_deleted_and_not_in_the_checkpoint(tmp_path, reference):
    d = copy_of(reference, tmp_path)
    os.remove(d / "config.json")
    marker = d / "checkpoints" / f"step_{STEPS}" / MARKER
    record = json.loads(marker.read_text())
    record["metadata"].pop("config")
    marker.write_text(json.dumps(record))
    return argv(d), d


def _config_json_truncated(tmp_path, reference):
    d = copy_of(reference, tmp_path)
    (d / "config.json").write_text('{"model": {"num_lay')
    return argv(d), d


def _flipped_bytes_in_the_only_checkpoint(tmp_path, reference):
    d = copy_of(reference, tmp_path)
    for step in CheckpointManager(str(d / "checkpoints")).steps()[:-1]:
        os.remove(d / "checkpoints" / f"step_{step}" / MARKER)
        shutil.rmtree(d / "checkpoints" / f"step_{step}")
    flip_bytes(d / "checkpoints" / f"step_{STEPS}")
    return argv(d), d


def _nan_before_checkpoint(tmp_path, reference, monkeypatch):
    monkeypatch.setattr(_loop, "make_train_step", nan_at_update(2))
    return argv(tmp_path / "run"), None


BAD_INPUTS = [
    ("foreign directory", _foreign, 2,
     ["not empty and was not written by ocformer", "config.json, metrics.jsonl", RUN_MARKER]),
    ("--workdir ''", _empty_path, 2, ["work directory path is empty"]),
    ("--workdir '   '", _blank_path, 2, ["work directory path is empty"]),
    ("workdir is a file", _file, 2, ["notes.txt is a file, not a directory"]),
    ("workdir below a file", _below_a_file, 2, ["cannot be created", "is a file"]),
    ("workdir cannot be created", _cannot_create, 2, ["ocformer_test_run/run cannot be created"]),
    ("resume with train.steps changed", _changed_steps, 2,
     ["changed fields: train.steps: 12 -> 16", "--allow-config-change"]),
    ("resume with fewer steps than reached", _fewer_steps_than_reached, 2,
     ["train.steps: 6 is below step 12, which the run in", "a run is not rewound"]),
    ("resume with numerics changed", _changed_numerics, 2,
     ["model.activation: 'gelu' -> 'relu'", "optimiser.learning_rate: 0.003 -> 0.01"]),
    ("unknown experiment argument", _experiment_argument, 2,
     ["smoke.py:shrt", "unknown argument 'shrt'", "'float64' or none"]),
    ("experiment with a syntax error", _syntax_error, 2, ["broken.py, line 2", "SyntaxError"]),
    ("get_config raises", _get_config_raises, 2,
     ["raises.py, line 2", "RuntimeError: no GPU here"]),
    ("experiment import fails", _import_fails, 2,
     ["imports.py, line 2", "ModuleNotFoundError", "ocformer_does_not_exist"]),
    ("missing experiment file", _missing_experiment, 2, ["nope.py", "does not exist"]),
    ("field out of range", _bad_value, 2, ["train.steps", ">= 0"]),
    ("unknown field", _unknown_field, 2, ["train.stepz"]),
    ("learning rate inf", _infinite_learning_rate, 2,
     ["optimiser.learning_rate: must be a finite number, got inf"]),
    ("learning rate nan", _nan_learning_rate, 2,
     ["optimiser.learning_rate: must be a finite number, got nan"]),
    # 1e9 sequences x 16 tokens x (inputs, targets) x 8 bytes = 238.4 GiB.
    ("batch larger than the memory", _batch_larger_than_memory, 2,
     ["task.batch_size: a batch of 1000000000 sequences of 16 tokens needs about 238.4 GiB",
      "of memory available on this machine"]),
    # The parameters and the validation set count too (each was an allocation error
    # after the run's files were written), naming the field that sizes them.
    ("parameters larger than the memory", _larger_than_memory("model.width=200000"), 2,
     ["model.width: the parameters (width 200000, hidden 32, 2 layers, 8 symbols) with "
      "their gradients and optimiser state need about 4768.8 GiB", "lower model.width"]),
    ("a vocabulary larger than the memory", _larger_than_memory("task.vocab_size=2147483647"),
     2, ["task.vocab_size: the parameters", "lower task.vocab_size"]),
    ("validation set larger than the memory",
     _larger_than_memory("task.eval_batch_size=2147483647"), 2,
     ["task.eval_batch_size: the validation set of 4 batches of 2147483647 sequences of 16 "
      "tokens", "lower task.eval_batch_size"]),
    ("feed-forward width larger than the memory", _larger_than_memory("model.hidden=2147483647"),
     2, ["lower model.hidden"]),
    ("depth-parallel iterations larger than the memory", _larger_than_memory(
        "discretisation.depth_parallel=parareal", "discretisation.iterations=2147483647"), 2,
     ["2147483647 parareal iterations; roughly)", "lower discretisation.iterations"]),
    ("mesh.data=3 on one device", _mesh_larger_than_the_devices, 2,
     ["3 x 1 = 3 devices is larger than the 1 device of"]),
    ("bad --set syntax", _bad_set_syntax, 2, ["bad --set syntax"]),
    ("missing data", _missing_data, 2, ["no_data", "make data"]),
    ("corrupted commit marker", _corrupt_marker, 2, [f"step_{STEPS}", "commit marker"]),
    ("corrupted checkpoint arrays", _corrupt_arrays, 2,
     [f"step_{STEPS} is corrupted", "orbax cannot read it"]),
    ("checkpoint of another model shape", _other_shape, 2,
     ["does not match the configured model", "16]", "32]"]),
    ("resume under another train.method", _other_method, 2,
     ["it was written by a different configuration", "train.method, one alters what the "
      "run's checkpoints hold", "train in a new --workdir with --set model.init_from="]),
    ("a file of the run not writable", _a_file_of_the_run_not_writable, 2,
     ["cannot be resumed:", "metrics.jsonl is not writable by this user, and the run writes "
      "to it"]),
    ("config.json deleted, resumed with other numerics", _config_json_deleted_and_changed, 2,
     ["model.activation: 'gelu' -> 'relu'", "optimiser.learning_rate: 0.003 -> 0.01",
      "--allow-config-change"]),
    ("config.json deleted and not in the checkpoint",
     _config_json_deleted_and_not_in_the_checkpoint, 2,
     ["config.json is missing", f"step_{STEPS} does not record the configuration"]),
    # Refused (a half-edited file is not guessed at), with the way to recover it.
    ("config.json truncated", _config_json_truncated, 2,
     ["config.json cannot be read", "or delete it, and the newest checkpoint",
      f"step_{STEPS}), which records the configuration that wrote it, restores it"]),
    ("flipped bytes in the only checkpoint", _flipped_bytes_in_the_only_checkpoint, 2,
     [f"checkpoints/step_{STEPS} is corrupted", "SHA-256 mismatch",
      "no earlier committed checkpoint"]),
    ("NaN before any checkpoint", _nan_before_checkpoint, 4,
     ["non-finite loss at training step 2", "No checkpoint has been written yet"]),
]  # fmt: skip


@pytest.mark.parametrize(
    "case, code, words", [b[1:] for b in BAD_INPUTS], ids=[b[0] for b in BAD_INPUTS]
)
def test_bad_input(case, code, words, reference, tmp_path, monkeypatch, capsys):
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    if case in (_nan_before_checkpoint, _a_file_of_the_run_not_writable):
        args, keep = case(work, reference, monkeypatch)
    else:
        args, keep = case(work, reference)
    before = snapshot(keep) if keep is not None else None
    capsys.readouterr()
    assert cli.main(args) == code
    err = capsys.readouterr().err
    for word in words:
        assert word in err, (word, err)
    assert "Traceback" not in err and "Event loop is closed" not in err, err
    if before is not None:
        assert snapshot(keep) == before, "the directory was changed"
    if code == 2:
        assert not os.path.exists(work / "run"), "a refused run created its directory"


# ---------------------------------------------------------------------------------------
# Resuming.


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_metrics_cut_at_a_random_offset_are_repaired_on_resume(seed, reference, tmp_path, capsys):
    """The state a kill leaves: metrics.jsonl cut at a random byte, checkpoints only up
    to the last whole line. The resumed run drops the partial line and the rows after
    its checkpoint, with a warning, and ends with the uninterrupted run's file."""
    ref = read_metrics(reference)
    workdir = copy_of(reference, tmp_path)
    path = workdir / "metrics.jsonl"
    data = path.read_bytes()
    cut = random.Random(seed).randrange(1, len(data) - 1)
    path.write_bytes(data[:cut])
    whole = data[:cut].count(b"\n")  # rows 1..whole are complete
    mgr = CheckpointManager(str(workdir / "checkpoints"))
    for step in mgr.steps():
        if step > whole:
            shutil.rmtree(mgr.path(step))
    resume_at = max([s for s in mgr.steps() if s <= whole], default=0)
    capsys.readouterr()
    assert cli.main(argv(workdir)) == 0
    err = capsys.readouterr().err
    partial = not data[:cut].endswith(b"\n")
    assert ("dropped a partial last line" in err) == partial, (cut, err)
    if whole > resume_at:
        since = f"step {resume_at}" if resume_at else "the start (no checkpoint)"
        assert f"rewound to {since}" in err, (cut, err)
    assert numbers(read_metrics(workdir)) == numbers(ref), f"seed {seed}: cut at byte {cut}"


def test_metrics_repair_keeps_intact_files_byte_for_byte(tmp_path):
    from ocformer.training import MetricsLog

    path = tmp_path / "metrics.jsonl"
    text = '{"step": 1, "loss": 0.5}\n{"step": 2, "loss": "nan"}\n'
    path.write_text(text)
    assert MetricsLog(str(path)).repair(2) == [] and path.read_text() == text
    path.write_text(text + '{"step": 3, "lo')
    warnings = MetricsLog(str(path)).repair(2)
    assert len(warnings) == 1 and "partial last line (15 bytes)" in warnings[0]
    assert path.read_text() == text
    path.write_text(text + '{"step": 3}\nnot json\n')
    warnings = MetricsLog(str(path)).repair(1)
    assert path.read_text() == '{"step": 1, "loss": 0.5}\n'
    assert "1 line(s) that are not metric records" in warnings[0]
    assert "rewound to step 1" in warnings[1] and "dropped 2 record(s)" in warnings[1]
    # A whole last record without its newline: kept, given its newline, so that the
    # next record is a line of its own and both read back.
    path.write_text(text + '{"step": 3}')
    log = MetricsLog(str(path))
    assert log.repair(3) == [] and path.read_text() == text + '{"step": 3}\n'
    log.append({"step": 4})
    assert [r["step"] for r in log.read()] == [1, 2, 3, 4]


def test_allowed_config_change_is_recorded_and_the_schedule_change_announced(
    reference, tmp_path, capsys
):
    workdir = copy_of(reference, tmp_path)
    capsys.readouterr()
    assert cli.main(argv(workdir, "train.steps=14", flags=["--allow-config-change"])) == 0
    out = capsys.readouterr().out
    config = resolve(SMOKE, BASE)
    old = float(make_schedule(config.optimiser, STEPS)(STEPS))
    new = float(make_schedule(config.optimiser, 14)(STEPS))
    assert old != new
    assert f"schedule changes at step {STEPS + 1}: lr {old:.3e} -> {new:.3e}" in out, out
    # Each changed field is said, not only its effect on the rate.
    said = f"configuration changes at step {STEPS + 1} (recorded in config_history.jsonl): "
    assert said + f"train.steps: {STEPS} -> 14" in out, out
    with open(workdir / "config_history.jsonl", encoding="utf-8") as f:
        (entry,) = [json.loads(line) for line in f]
    assert entry["step"] == STEPS and entry["changes"] == {"train.steps": [STEPS, 14]}
    assert entry["previous"]["train"]["steps"] == STEPS
    with open(workdir / "config.json", encoding="utf-8") as f:
        assert json.load(f)["train"]["steps"] == 14
    records = read_metrics(workdir)
    assert [r["step"] for r in records] == list(range(1, 15))
    assert records[STEPS]["lr"] == pytest.approx(new, rel=1e-6)
    # The changed run resumes with its own configuration without the flag.
    assert cli.main(argv(workdir, "train.steps=14")) == 0


def test_deleted_config_json_is_recovered_byte_for_byte(reference, tmp_path, capsys):
    """Every checkpoint records its configuration: a deleted config.json comes back
    from the newest one, identical, and the resumed run checks changes against it (a
    changed run is refused: see the table of bad inputs)."""
    workdir = copy_of(reference, tmp_path)
    original = (workdir / "config.json").read_bytes()
    os.remove(workdir / "config.json")
    capsys.readouterr()
    assert cli.main(argv(workdir)) == 0
    err = capsys.readouterr().err
    assert "config.json was missing; the configuration was recovered from checkpoint" in err
    assert f"step_{STEPS}" in err
    assert (workdir / "config.json").read_bytes() == original


def test_flip_bytes_leaves_a_checkpoint_that_reads_back_with_other_bytes(tmp_path):
    """The fault of the tests below on compressible arrays, where 64 bytes flipped at a
    fixed place in orbax's zstd data usually make it unreadable (the layout of the data
    files changes from one save to the next): the damaged checkpoint still reads back,
    and fails its checksums."""
    import numpy as np

    from ocformer.checkpointing import ChecksumMismatch

    rng = np.random.default_rng(0)
    tree = {
        f"a{i}": (np.round(rng.standard_normal((64, 32 * (i % 5 + 1))), 1) * (i % 3 > 0))
        for i in range(40)
    }
    tree = {k: v.astype(np.float32) for k, v in tree.items()}
    with CheckpointManager(str(tmp_path)) as manager:
        manager.save(3, tree)
        flip_bytes(tmp_path / "step_3")
        with pytest.raises(ChecksumMismatch, match="SHA-256 mismatch"):
            manager.restore(3, tree)


@pytest.mark.parametrize(
    "error, damaged",
    [
        (ValueError("DATA_LOSS: Error reading 000003/ocdbt.process_0/d/x"), True),
        (FileNotFoundError("000001/manifest.ocdbt"), True),
        (PermissionError(13, "Permission denied"), False),
        (OSError(5, "Input/output error"), False),
        (MemoryError(), False),
        (ValueError("UNAVAILABLE: file system not mounted"), False),
    ],
)
def test_a_checkpoint_that_cannot_be_read_is_called_damaged_only_for_its_bytes(
    tmp_path, monkeypatch, error, damaged
):
    """A read that fails for its files (orbax's data-loss errors, a missing file) is a
    corrupted checkpoint, which the message says to delete; one that fails for the
    reading (memory, permissions, an I/O error, a file system away) is not: its
    message says to keep the checkpoint and names the cause."""
    import numpy as np

    from ocformer.checkpointing import CheckpointError, CorruptedCheckpoint

    tree = {"a": np.arange(6, dtype=np.float32)}
    with CheckpointManager(str(tmp_path)) as manager:
        manager.save(1, tree)

        class Failing:
            def restore(self, *args, **kwargs):
                raise error

        monkeypatch.setattr(manager, "_orbax", lambda: Failing())
        with pytest.raises(CheckpointError) as caught:
            manager.restore(1, tree)
    assert isinstance(caught.value, CorruptedCheckpoint) == damaged, caught.value
    message = str(caught.value)
    assert ("Delete that directory" in message) == damaged, message
    assert type(error).__name__ in message
    if not damaged:
        assert "keeping the checkpoint" in message


def test_flipped_bytes_fall_back_to_the_previous_checkpoint(reference, tmp_path, capsys):
    """64 inverted bytes in the newest checkpoint's array data: orbax reads it without
    an error, its checksum does not match, so the run warns, names it, resumes from the
    previous checkpoint and recomputes the same steps bit for bit."""
    workdir = copy_of(reference, tmp_path)
    checkpoints = CheckpointManager(str(workdir / "checkpoints"))
    saved = checkpoints.read_marker(STEPS)["sha256"]
    flip_bytes(workdir / "checkpoints" / f"step_{STEPS}")
    capsys.readouterr()
    assert cli.main(argv(workdir)) == 0
    err = capsys.readouterr().err
    previous = workdir / "checkpoints" / f"step_{STEPS - 4}"
    assert f"checkpoints/step_{STEPS} is corrupted" in err and "SHA-256 mismatch" in err
    assert f"resuming from the previous committed checkpoint {previous} instead" in err
    assert numbers(read_metrics(workdir)) == numbers(read_metrics(reference))
    # The checkpoint written again holds the bytes the first one held.
    assert checkpoints.read_marker(STEPS)["sha256"] == saved


def test_interrupted_saves_are_removed_with_a_warning(reference, tmp_path, capsys):
    """A save a SIGKILL cut short (orbax's temporary directory, a step without its
    commit marker) is removed when the run resumes, and the warning names it."""
    workdir = copy_of(reference, tmp_path)
    checkpoints = workdir / "checkpoints"
    (checkpoints / f"step_{STEPS + 4}.orbax-checkpoint-tmp-5").mkdir()
    (checkpoints / f"step_{STEPS + 8}").mkdir()
    capsys.readouterr()
    assert cli.main(argv(workdir)) == 0
    err = capsys.readouterr().err
    assert (
        f"warning: removed 2 interrupted checkpoint save(s) in {checkpoints} (never "
        f"committed): step_{STEPS + 4}.orbax-checkpoint-tmp-5, step_{STEPS + 8}" in err
    ), err
    assert CheckpointManager(str(checkpoints)).steps()[-1] == STEPS
    assert not [n for n in os.listdir(checkpoints) if not n.removeprefix("step_").isdigit()]
    assert cli.main(argv(workdir)) == 0
    assert "interrupted checkpoint" not in capsys.readouterr().err


def test_a_full_disk_is_one_message_and_leaves_no_partial_checkpoint(
    reference, tmp_path, monkeypatch, capsys
):
    """orbax runs out of space part-way into the checkpoint of step 8 (its temporary
    directory written): one message naming the directory and the space, exit 2, the
    partial files removed and the checkpoint of step 4 kept."""
    import errno

    real = CheckpointManager._orbax

    class FullDisk:
        def __init__(self, inner):
            self.inner = inner

        def save(self, target, payload):
            if not target.endswith("step_8"):
                return self.inner.save(target, payload)
            partial = f"{target}.orbax-checkpoint-tmp-1234"
            os.makedirs(partial)
            with open(os.path.join(partial, "data"), "wb") as f:
                f.write(b"\0" * 4096)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), partial)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    monkeypatch.setattr(CheckpointManager, "_orbax", lambda self: FullDisk(real(self)))
    workdir = tmp_path / "run"
    capsys.readouterr()
    assert cli.main(argv(workdir)) == 2
    err = capsys.readouterr().err
    checkpoints = workdir / "checkpoints"
    assert f"no space left on the device of {checkpoints} while writing the checkpoint " in err
    assert "of step 8: it needs about" in err and "MiB are free" in err
    assert f"the previous checkpoint {checkpoints / 'step_4'} is intact" in err
    assert "Traceback" not in err
    assert sorted(os.listdir(checkpoints)) == ["step_4"]


# Run on a 256 KiB tmpfs mounted at argv[1]: a first checkpoint that fits, a 0.8 MiB one
# that does not. Prints OK once every check holds.
_FULL_TMPFS = """
import os, sys
import numpy as np
from ocformer.checkpointing import CheckpointManager, DiskFullError

disk = sys.argv[1]
manager = CheckpointManager(os.path.join(disk, "checkpoints"))
manager.save(1, [np.zeros(10, np.float32)])
big = np.random.default_rng(0).standard_normal(200_000).astype(np.float32)
try:
    manager.save(2, [big])
    raise SystemExit("the 0.8 MiB checkpoint was written on a 256 KiB disk")
except DiskFullError as e:
    message = str(e)
manager.close()
checkpoints = os.path.join(disk, "checkpoints")
assert f"no space left on the device of {checkpoints}" in message, message
assert f"it needs about {big.nbytes / 2**20:.3g} MiB" in message, message
step_1 = os.path.join(checkpoints, "step_1")
assert f"the previous checkpoint {step_1} is intact" in message, message
assert sorted(os.listdir(checkpoints)) == ["step_1"], os.listdir(checkpoints)
assert manager.restore(1, [np.ones(10, np.float32)])[0].tolist() == [0.0] * 10
print("OK")
"""


def test_orbax_on_a_full_tmpfs_is_one_error_and_leaves_no_temporaries(tmp_path):
    """The real thing: a real full disk, a tmpfs of 256 KiB mounted in a mount namespace
    of its own (``unshare``: as root, or as any user where user namespaces are allowed,
    so nothing is mounted on the machine itself)."""
    import subprocess
    import sys

    disk = tmp_path / "disk"
    disk.mkdir()
    script = 'mount -t tmpfs -o size=256k tmpfs "$1" && exec "$2" -c "$3" "$1"'
    attempts = []
    for namespaces in (["--user", "--map-root-user", "--mount"], ["--mount"]):
        done = subprocess.run(
            ["unshare", *namespaces, "sh", "-c", script, "sh", str(disk), sys.executable,
             _FULL_TMPFS],
            capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        if done.returncode == 0 or "OK" in done.stdout or "Traceback" in done.stderr:
            break
        attempts.append(f"unshare {' '.join(namespaces)}: {done.stderr.strip()[:200]}")
    else:
        pytest.fail(
            "could not mount a tmpfs in a mount namespace (the real full-disk check needs "
            "root or unprivileged user namespaces): " + "; ".join(attempts)
        )
    assert done.returncode == 0 and done.stdout.strip() == "OK", done.stderr[-3000:]
    assert "No space left" not in done.stderr  # orbax's own logs dropped
    assert "Event loop is closed" not in done.stderr, done.stderr[-3000:]


def test_evaluate_refuses_a_checkpoint_whose_bytes_changed(reference, tmp_path, capsys):
    from ocformer import evaluate

    workdir = copy_of(reference, tmp_path)
    flip_bytes(workdir / "checkpoints" / f"step_{STEPS}")
    capsys.readouterr()
    assert evaluate.main([str(workdir)]) == 2
    err = capsys.readouterr().err
    assert f"checkpoints/step_{STEPS} is corrupted" in err and "SHA-256 mismatch" in err
    earlier = CheckpointManager(str(workdir / "checkpoints")).steps()[:-1]
    assert earlier and f"Its earlier committed steps are {earlier}: read one with --step" in err
    assert evaluate.main([str(workdir), "--step", str(earlier[-1])]) == 0


def _rotating(monkeypatch, times: int):
    """CheckpointManager.restore that, ``times`` times, first deletes the checkpoint it
    was asked for, as a running training's rotation does while a reader reads it."""
    original = CheckpointManager.restore
    left = [times]

    def restore(self, step, template):
        if left[0] > 0:
            left[0] -= 1
            shutil.rmtree(self.path(step))
        return original(self, step, template)

    monkeypatch.setattr(CheckpointManager, "restore", restore)


def test_readers_tolerate_a_checkpoint_rotated_away(reference, tmp_path, monkeypatch, capsys):
    """A reader whose checkpoint the running training deletes picks the newest again,
    and never calls a deleted checkpoint corrupted."""
    from ocformer import evaluate

    workdir = copy_of(reference, tmp_path)
    _rotating(monkeypatch, 1)
    _, _, step, _ = restore_run(workdir)
    assert step == 8  # step 12 was rotated away while it was read
    _rotating(monkeypatch, 1)
    capsys.readouterr()
    assert evaluate.main([str(workdir), "--step", "8"]) == 2
    err = capsys.readouterr().err
    assert "step 8" in err and "was deleted while it was read" in err and "choose one of [4]" in err
    assert "corrupted" not in err and "Delete" not in err


def test_presentation_fields_may_change(reference, tmp_path):
    workdir = copy_of(reference, tmp_path)
    config = resolve(SMOKE, [*BASE, "train.progress=true", "train.preempt_grace_s=5"])
    assert RunDirectory(workdir).check(config) == {}
    with pytest.raises(ConfigChanged, match=r"train.seed: 0 -> 1"):
        RunDirectory(workdir).check(resolve(SMOKE, [*BASE, "train.seed=1"]))


def test_empty_directory_is_claimed_and_marked(tmp_path):
    (tmp_path / "run").mkdir()
    config = resolve(SMOKE, [*BASE, "train.steps=0"])
    train(config, tmp_path / "run")
    with open(tmp_path / "run" / RUN_MARKER, encoding="utf-8") as f:
        assert "created" in json.load(f)
    assert sorted(os.listdir(tmp_path / "run")) == [
        ".lock", "config.json", RUN_MARKER, "run.json", "summary.json", "tb"
    ]  # fmt: skip


def test_a_claim_cut_short_is_not_foreign(tmp_path):
    """A kill between writing the marker's temporary file and renaming it leaves only
    that file: the directory is still ocformer's to claim."""
    (tmp_path / f"{RUN_MARKER}.tmp-999").write_text("{")
    config = resolve(SMOKE, BASE)
    assert RunDirectory(tmp_path).check(config) == {}
    (tmp_path / "x.txt").write_text("")
    with pytest.raises(WorkdirError, match=rf"it holds x.txt; no {RUN_MARKER}"):
        RunDirectory(tmp_path).check(config)


def test_rows_lost_before_the_checkpoint_are_reported(reference, tmp_path, capsys):
    """Rows cut from a finished run cannot be recomputed: the resumed run says which."""
    workdir = copy_of(reference, tmp_path)
    path = workdir / "metrics.jsonl"
    path.write_text("".join(path.read_text().splitlines(keepends=True)[:5]))
    capsys.readouterr()
    assert cli.main(argv(workdir)) == 0
    err = capsys.readouterr().err
    assert f"ends at step 5 but the restored checkpoint is step {STEPS}" in err
    assert f"steps 6..{STEPS} are missing" in err
    assert "has no records of steps" not in err  # the cut end is said once


def test_rows_lost_inside_the_log_are_reported(reference, tmp_path, capsys):
    """Rows removed from the middle of the log (steps 2 and 3 of a run that logs every
    step): the resumed run names them, though the file ends at the checkpoint."""
    workdir = copy_of(reference, tmp_path)
    path = workdir / "metrics.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:1] + lines[3:]))
    capsys.readouterr()
    assert cli.main(argv(workdir)) == 0
    err = capsys.readouterr().err
    assert "has no records of steps 2..3, which the run logged (at least every 1 steps" in err


def test_summary_json_is_the_last_finished_run_and_where_its_time_went(
    reference, tmp_path, monkeypatch
):
    """summary.json holds what the command prints at the end, with the run's wall time
    split into setup, the step's compilation, steps, evaluation, sampling and
    checkpoints (adding up to the wall time of train()); a resumed run that fails
    leaves no summary of the earlier one."""
    with open(reference / "summary.json", encoding="utf-8") as f:
        summary = json.load(f)
    assert summary["step"] == STEPS and summary["resumed_from"] is None
    assert summary["val_loss"] == read_metrics(reference)[-1]["val_loss"]
    parts = summary["time_s"]
    assert list(parts) == list(_loop._Timings.PARTS)
    for part in ("setup", "step_compilation", "steps", "evaluation", "checkpoints"):
        assert parts[part] > 0, (part, parts)
    total = sum(parts.values())
    assert 0.9 * summary["wall_time_s"] < total <= summary["wall_time_s"], parts
    # A rerun of the finished run has nothing to do, and its summary stands; a run
    # stopped after its last step (no summary yet) gets one from its rerun.
    workdir = copy_of(reference, tmp_path)
    written = (workdir / "summary.json").read_bytes()
    assert cli.main(argv(workdir)) == ExitCode.OK
    assert (workdir / "summary.json").read_bytes() == written
    os.remove(workdir / "summary.json")
    assert cli.main(argv(workdir)) == ExitCode.OK
    assert json.loads((workdir / "summary.json").read_text())["resumed_from"] == STEPS
    shutil.rmtree(workdir)
    monkeypatch.setattr(_loop, "make_train_step", nan_at_update(1))
    code = cli.main(argv(workdir, "train.steps=14", flags=["--allow-config-change"]))
    assert code == ExitCode.NON_FINITE
    assert not (workdir / "summary.json").exists()


def test_a_path_spelled_otherwise_is_no_configuration_change(tmp_path, monkeypatch):
    """A resume that names the same dataset, corpus or start by another spelling (the
    stored one relative to where the run started, the new one absolute, or relative to
    another directory) changes nothing; another place does."""
    from ocformer.config import to_dict
    from ocformer.training._rundir import config_changes

    (tmp_path / "a" / "data").mkdir(parents=True)
    (tmp_path / "b").mkdir()
    task = "task.name=shakespeare_char"  # the task that reads task.data_dir
    base = resolve(SMOKE, [task])
    stored = json.loads(json.dumps(to_dict(base)))
    stored["task"]["data_dir"] = "data"
    stored["model"]["init_from"] = "../b"
    then = str(tmp_path / "a")
    monkeypatch.chdir(tmp_path)
    same = resolve(SMOKE, [task, f"task.data_dir={tmp_path / 'a' / 'data'}", "model.init_from=b"])
    assert config_changes(stored, same, then) == {}
    assert set(config_changes(stored, same)) == {"task.data_dir", "model.init_from"}
    other = resolve(SMOKE, [task, "task.data_dir=a", "model.init_from=b"])
    assert set(config_changes(stored, other, then)) == {"task.data_dir"}


def test_a_field_added_since_the_run_started_is_its_default():
    """A stored configuration written before a field existed resumes as that field's
    default (what runs did before it), and another value is a change from it."""
    from ocformer.config import to_dict
    from ocformer.training._rundir import config_changes

    stored = json.loads(json.dumps(to_dict(resolve(SMOKE, []))))
    del stored["optimiser"]["weight_decay_on"]
    assert config_changes(stored, resolve(SMOKE, [])) == {}
    matrices = resolve(SMOKE, ["optimiser.weight_decay_on=matrices"])
    assert config_changes(stored, matrices) == {"optimiser.weight_decay_on": ("all", "matrices")}
    stored["optimiser"]["retired"] = 1  # a field the schema no longer has
    assert config_changes(stored, resolve(SMOKE, [])) == {"optimiser.retired": (1, None)}


def test_a_run_recorded_with_fields_its_version_ignored_still_loads(reference, tmp_path, capsys):
    """A run recorded by a version that accepted ``discretisation.chunks`` (and the
    other depth-parallel fields) under the serial solve and ignored them is read as it
    trained: it loads, evaluates and resumes unchanged, where a new configuration with
    those fields is refused."""
    from ocformer import evaluate

    workdir = copy_of(reference, tmp_path)
    ignored = {"chunks": 2, "iterations": 3, "coarse_steps": 2}

    def record_ignored(path):
        data = json.loads(path.read_text())
        config = data["metadata"]["config"] if "metadata" in data else data
        config["discretisation"].update(ignored)
        path.write_text(json.dumps(data))

    record_ignored(workdir / "config.json")
    for step in CheckpointManager(str(workdir / "checkpoints")).steps():
        record_ignored(workdir / "checkpoints" / f"step_{step}" / MARKER)
    assert restore_run(workdir)[2] == STEPS
    assert RunDirectory(workdir).check(resolve(SMOKE, BASE)) == {}
    capsys.readouterr()
    assert evaluate.main([str(workdir)]) == 0
    assert cli.main(argv(workdir, "train.steps=14", flags=["--allow-config-change"])) == 0
    assert [r["step"] for r in read_metrics(workdir)] == list(range(1, 15))
    assert cli.main(argv(workdir, "train.steps=16", "discretisation.chunks=2")) == 2
    assert "depth_parallel is none and the serial solve ignores it" in capsys.readouterr().err


def test_a_failed_atomic_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    """A write that fails (a full disk at the rename) leaves the previous content and no
    temporary file; the start-up sweep removes only the temporaries' own names."""
    import errno

    from ocformer.checkpointing import atomic_write_text, remove_stale_temporaries

    path = tmp_path / "results.md"
    atomic_write_text(str(path), "old\n")

    def full(src, dst):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "replace", full)
    with pytest.raises(OSError, match="No space left"):
        atomic_write_text(str(path), "new\n")
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["results.md"] and path.read_text() == "old\n"
    for name in ("config.json.tmp-4242", "notes.tmp-draft.txt", "x.tmp-"):
        (tmp_path / name).write_text("")
    assert remove_stale_temporaries(str(tmp_path)) == ["config.json.tmp-4242"]
    assert sorted(os.listdir(tmp_path)) == ["notes.tmp-draft.txt", "results.md", "x.tmp-"]


def test_evaluate_refuses_a_validation_set_larger_than_the_memory(reference, capsys):
    """``evaluate RUN --set task.eval_batch_size=2^31-1`` ended in an allocation
    traceback (exit 1), and 10^8 in the kernel's out-of-memory kill; it is refused as
    training refuses it, naming the field, and so is a run's start (``--config``)."""
    from ocformer.evaluate import main as evaluate_main

    huge = ["--set", "task.eval_batch_size=2147483647"]
    for args in ([str(reference), *huge], ["--config", SMOKE, *huge]):
        assert evaluate_main(args) == 2
        err = capsys.readouterr().err
        assert "task.eval_batch_size: the validation set of 4 batches of 2147483647" in err, err
        assert "lower task.eval_batch_size" in err and "Traceback" not in err


def test_a_config_json_edited_into_another_configuration_is_named_by_its_readers(
    reference, tmp_path
):
    """``load_run`` of a run whose config.json parses but is no configuration (edited
    by hand) said only ``model.num_heads: num_heads=3 must divide ...``, as if the
    caller's own configuration were wrong; the file is named now."""
    from ocformer.training import load_run

    workdir = copy_of(reference, tmp_path)
    stored = json.loads((workdir / "config.json").read_text())
    stored["model"]["num_heads"] = 3
    (workdir / "config.json").write_text(json.dumps(stored))
    with pytest.raises(ConfigError, match=r"num_heads=3 must divide .*\(read from .*config\.json"):
        load_run(workdir)
    (workdir / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match=r"must be a mapping, got list \(read from .*config"):
        load_run(workdir)
