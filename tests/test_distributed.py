"""Many devices and many processes: the mesh equals one device, two processes equal one,
checkpoints cross between them, and every bad input ends with a clear message.

The runs on several devices or processes are subprocesses: 4 CPU devices forced with
``XLA_FLAGS=--xla_force_host_platform_device_count=4``, or 2 processes of 1 CPU device
each started by ``python -m ocformer.launch local`` (gloo collectives over loopback).
Losses are compared in float32 to 1e-6 relative: the layouts sum in another order.
"""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from _devices import xla_flags

from ocformer import launch, train as cli
from ocformer.checkpointing import MARKER
from ocformer.config import ConfigError, resolve
from ocformer.distributed import (
    DistributedError,
    Layout,
    MeshError,
    initialize,
    mesh_shape,
    process_environment,
    process_settings,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOKE = os.path.join(ROOT, "experiments", "smoke.py")
RTOL = 1e-6
STEPS = 6
# Evaluation only at the end; checkpoints every 2 steps.
BASE = [
    f"train.steps={STEPS}",
    "train.checkpoint_every=2",
    f"train.eval_every={STEPS}",
    "train.progress=false",
]


def _start_each(commands, env) -> list[subprocess.Popen]:
    """One process per command, their output piped (text)."""
    return [
        subprocess.Popen(
            c, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for c in commands
    ]


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (an orphan that ended may stay a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- refused before anything runs ------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, devices, field, words",
    [
        (["mesh.data=3"], 4, "mesh.data", "mesh.data=3 devices must divide task.batch_size=16"),
        (["mesh.data=3"], 1, "mesh.data", "3 x 1 = 3 devices is larger than the 1 device of"),
        (["mesh.model=4"], 4, "mesh.model", "model.num_heads=2"),
        (["mesh.model=2", "model.hidden=33"], 2, "mesh.model", "model.hidden=33"),
        # Too deep a mesh is named as such, not as mesh.model=1 (which fits).
        (
            ["mesh.depth=2", "discretisation.depth_parallel=parareal"],
            1,
            "mesh.depth",
            "mesh.depth=2 needs more devices than the 1 there are",
        ),
        (
            ["mesh.depth=2", "mesh.model=2", "discretisation.depth_parallel=parareal"],
            3,
            "mesh.model",
            "mesh.model=2 x mesh.depth=2 needs more devices than the 3 there are; "
            "lower mesh.model or mesh.depth",
        ),
    ],
)
def test_mesh_that_does_not_divide_is_refused_at_start(overrides, devices, field, words):
    """Divisibility needs the device count: on too few devices the count is named first
    (the batch size is not blamed for a missing device)."""
    config = resolve(SMOKE, overrides)
    with pytest.raises(MeshError) as e:
        mesh_shape(config, devices)
    assert e.value.field == field and words in str(e.value)
    if "batch_size" not in words:
        assert "batch_size" not in str(e.value)


@pytest.mark.parametrize(
    "overrides, field, words",
    [
        (["mesh.data=0"], "mesh.data", "-1 for the rest"),
        (["mesh.data=-1", "mesh.model=-1"], "mesh.model", "both -1"),
    ],
)
def test_mesh_that_does_not_divide_is_refused_at_config_time(overrides, field, words):
    with pytest.raises(ConfigError) as e:
        resolve(SMOKE, overrides)
    assert e.value.field == field and words in str(e.value)


def test_mesh_larger_than_the_devices_is_refused_at_start(tmp_path, capsys):
    config = resolve(SMOKE, ["mesh.data=2"])  # valid: 2 divides the batch of 16
    with pytest.raises(MeshError) as e:
        Layout(config)
    assert e.value.field == "mesh.data"
    assert "2 x 1 = 2 devices is larger than the 1 device of" in str(e.value)
    # The command line: exit 2, nothing written.
    code = cli.main(["--config", SMOKE, "--workdir", str(tmp_path / "w"), "--set", "mesh.data=2"])
    assert code == 2 and "larger than the 1 device of" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()


def test_default_mesh_is_one_device_and_inactive():
    layout = Layout(resolve(SMOKE, []))
    assert (layout.data, layout.model, layout.active) == (1, 1, False)


@pytest.mark.parametrize(
    "args, words",
    [
        (("127.0.0.1:1234", 2, 2), "process id 2 is out of range for 2 processes (ids 0..1)"),
        (("127.0.0.1:1234", 2, -1), "process id -1 is out of range"),
        (("127.0.0.1:1234", 0, 0), "number of processes must be >= 1, got 0"),
        (("127.0.0.1:1234", 2, None), "go together"),
        (("localhost", 2, 0), "is not HOST:PORT"),
        (("127.0.0.1:99999", 2, 0), "port 99999 is not a port number (1..65535)"),
        (("127.0.0.1:0", 2, 1), "port 0 is not a port number"),
    ],
)
def test_bad_process_settings(args, words):
    with pytest.raises(DistributedError) as e:
        process_settings(*args)
    assert words in str(e.value)


def test_no_settings_means_one_process(monkeypatch):
    for name in ("OCFORMER_COORDINATOR", "SLURM_JOB_ID", "TPU_WORKER_HOSTNAMES"):
        monkeypatch.delenv(name, raising=False)
    assert process_settings() is None and initialize() is False


def test_the_launchers_variables_are_what_a_process_reads(monkeypatch):
    """``process_environment`` (what ``ocformer.launch local`` gives each process) and
    ``process_settings`` (what a process reads) use one set of names."""
    for name in ("OCFORMER_COORDINATOR", "OCFORMER_NUM_PROCESSES", "OCFORMER_PROCESS_ID"):
        monkeypatch.delenv(name, raising=False)
    written = process_environment("10.0.0.1:1234", 3, 2)
    assert written == {
        "OCFORMER_COORDINATOR": "10.0.0.1:1234",
        "OCFORMER_NUM_PROCESSES": "3",
        "OCFORMER_PROCESS_ID": "2",
    }
    for name, value in written.items():
        monkeypatch.setenv(name, value)
    assert process_settings() == ("10.0.0.1:1234", 3, 2)


def test_unreachable_coordinator_ends_with_address_and_timeout():
    address = f"127.0.0.1:{_free_port()}"  # nothing listens there
    started = time.monotonic()
    with pytest.raises(DistributedError) as e:
        initialize(address, 2, 1, timeout_s=2)
    elapsed = time.monotonic() - started
    assert f"coordinator at {address} could not be reached within 2s" in str(e.value)
    assert 2 <= elapsed < 10


def test_process_0_on_a_taken_port_is_told_so_before_jax_tries_it():
    """Process 0 hosts the coordinator: on a port another program holds, JAX's service
    failed to bind and ended the process in a segmentation fault (or said "Failed to
    start RPC server", with the advice to start process 0 on that address). It is
    refused first, naming the port as taken."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        address = f"127.0.0.1:{holder.getsockname()[1]}"
        with pytest.raises(DistributedError) as e:
            initialize(address, 2, 0, timeout_s=2)
    assert str(e.value) == (
        f"process 0 of 2 hosts the coordinator at {address}, and its port is taken on "
        "this machine (Address already in use); give every process another --coordinator port"
    )


# -- subprocesses ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    e = dict(os.environ)
    for name in ("OCFORMER_COORDINATOR", "OCFORMER_NUM_PROCESSES", "OCFORMER_PROCESS_ID"):
        e.pop(name, None)
    e.update(
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=xla_flags(devices=1),
        JAX_COMPILATION_CACHE_DIR=str(tmp_path_factory.mktemp("jax_cache")),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=ROOT,
        OCFORMER_DISTRIBUTED_TIMEOUT_S="900",  # a loaded machine starts processes slowly
    )
    return e


_COUNTS = """
import sys
from ocformer.distributed import DistributedError, initialize
try:
    initialize(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), timeout_s=30)
except DistributedError as e:
    print(e, flush=True)
    sys.exit(2)
"""


@pytest.mark.slow
def test_mismatched_process_counts_are_refused_by_both(env):
    address = f"127.0.0.1:{_free_port()}"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _COUNTS, address, str(n), str(i)],
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for n, i in ((2, 0), (3, 1))
    ]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [2, 2], outs
    assert "process 1 was started with --num-processes 3, process 0 with 2" in outs[0]
    assert "process 0 was started with --num-processes 2, process 1 with 3" in outs[1]


@pytest.mark.slow
@pytest.mark.xdist_group(name="distributed")
def test_a_process_started_by_hand_whose_peer_is_killed_exits_with_the_lost_peer_code(
    env, tmp_path
):
    """Two processes started by hand (as SLURM's tasks are, with no launcher to stop
    the other): process 1 SIGKILLs itself at its third update. Process 0 reports the
    failed collective and exits 5 at once (it waited in the interpreter's shutdown at a
    barrier with the dead process until the runtime aborted it: exit 134 and a native
    stack trace, 15 s later)."""
    address = f"127.0.0.1:{_free_port()}"
    workdir = tmp_path / "run"
    marker = workdir / "checkpoints" / "step_2" / MARKER
    faults = os.path.join(ROOT, "tests", "_faults.py")
    fault = [sys.executable, faults, "--kill-at", "3", "--process", "1", "--after", str(marker)]
    procs = [
        subprocess.Popen(
            [*fault, "--", *_train_command(workdir)],
            env={
                **env,
                "OCFORMER_COORDINATOR": address,
                "OCFORMER_NUM_PROCESSES": "2",
                "OCFORMER_PROCESS_ID": str(i),
            },
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for i in range(2)
    ]
    _, err = procs[0].communicate(timeout=1200)
    procs[1].communicate(timeout=600)
    assert procs[1].returncode == -signal.SIGKILL
    assert procs[0].returncode == 5, err[-3000:]
    assert "process 0: a collective with the other processes failed" in err, err[-3000:]
    assert "Terminating process" not in err and "Traceback" not in err, err[-3000:]


@pytest.mark.slow
@pytest.mark.xdist_group(name="distributed")
def test_a_work_directory_that_the_processes_do_not_share_is_refused_by_all(env, tmp_path):
    """Two processes whose work directories differ (as a path on each host's local disk
    would): each sees only its own file, so every process refuses the directory
    together (exit 2) before reading a checkpoint, rather than hanging in the first
    save; nothing of the check is left behind."""
    address = f"127.0.0.1:{_free_port()}"
    quick = {**env, "OCFORMER_DISTRIBUTED_TIMEOUT_S": "20"}
    procs = _start_each(
        [
            [sys.executable, "-m", "ocformer.train", *_train_command(tmp_path / f"run{i}"),
             "--coordinator", address, "--num-processes", "2", "--process-id", str(i)]
            for i in range(2)
        ],
        quick,
    )  # fmt: skip
    errs = [p.communicate(timeout=600)[1] for p in procs]
    assert [p.returncode for p in procs] == [2, 2], [e[-3000:] for e in errs]
    for i, err in enumerate(errs):
        assert "is not one directory for all 2 processes" in err, err[-3000:]
        assert f"process {i} does not see the files of processes [{1 - i}]" in err, err[-3000:]
        assert not (tmp_path / f"run{i}" / ".processes").exists()
        assert not (tmp_path / f"run{i}" / "checkpoints").exists()


@pytest.mark.slow
@pytest.mark.xdist_group(name="distributed")
def test_a_work_directory_in_use_is_refused_by_all_processes(env, tmp_path):
    """Two processes started by hand on a directory another run holds: process 0 cannot
    take the lock and the other learns it from process 0, so both exit 2 together
    (before, the other waited at the next barrier until JAX's coordination service
    aborted it: exit 134). The holder's lock is untouched."""
    from test_workdir_lock import hold, kill

    workdir = tmp_path / "run"
    workdir.mkdir()
    holder = hold(workdir, env)
    try:
        address = f"127.0.0.1:{_free_port()}"
        procs = _start_each(
            [
                [sys.executable, "-m", "ocformer.train", *_train_command(workdir),
                 "--coordinator", address, "--num-processes", "2", "--process-id", str(i)]
                for i in range(2)
            ],
            {**env, "OCFORMER_DISTRIBUTED_TIMEOUT_S": "60"},
        )  # fmt: skip
        errs = [p.communicate(timeout=600)[1] for p in procs]
        assert [p.returncode for p in procs] == [2, 2], [e[-3000:] for e in errs]
        assert f"pid {holder.pid}" in " ".join(errs[0].split()), errs[0][-3000:]
        assert "process 0 could not claim the work directory" in errs[1], errs[1][-3000:]
        assert holder.poll() is None
        assert sorted(os.listdir(workdir)) == [".lock"]
    finally:
        kill(holder)


_MESHES = """
import json, os, sys, tempfile
import equinox as eqx, jax, numpy as np
from ocformer.config import resolve
from ocformer.distributed import Layout
from ocformer.training import build, make_train_step, train

base = sys.argv[2:]
out = {"devices": jax.device_count(), "losses": {}}
for d, m in [(1, 1), (4, 1), (2, 2)]:
    config = resolve(sys.argv[1], [*base, f"mesh.data={d}", f"mesh.model={m}"])
    with tempfile.TemporaryDirectory() as w:
        train(config, w)
        with open(os.path.join(w, "metrics.jsonl")) as f:
            out["losses"][f"{d}x{m}"] = [json.loads(line)["loss"] for line in f]
    if (d, m) == (1, 1):
        continue
    exp, layout = build(config), Layout(config)
    model = layout.put_model(exp.model)
    state = exp.optimiser.init(eqx.filter(exp.model, eqx.is_inexact_array))
    state = layout.put_state(state, exp.model)
    step = layout.compile_train_step(
        make_train_step(exp.objective, exp.constraints, exp.optimiser, skip_nonfinite=False),
        model, state,
    )
    batch = layout.put_batch(exp.task.batch("train", 0, config.task.batch_size, 0))
    hlo = step.lower(model, state, batch).compile().as_text()
    values = model.transformer.control.values
    out[f"{d}x{m}"] = {
        "all_reduce": "all-reduce" in hlo,
        "wq": list(values.attention.wq.sharding.spec),
        "wo": list(values.attention.wo.sharding.spec),
        "ff0": list(values.feedforward.weights[0].sharding.spec),
        "ff1": list(values.feedforward.weights[1].sharding.spec),
        "moments_wq": sorted(
            {tuple(x.sharding.spec) for path, x in jax.tree_util.tree_flatten_with_path(state)[0]
             if "attention.wq" in jax.tree_util.keystr(path)}, key=str
        ),
        "batch": sorted({tuple(x.sharding.spec) for x in batch.values()}, key=str),
    }
print("RESULT " + json.dumps(out))
"""


def _relative(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b) / np.abs(b)))


@pytest.mark.slow
@pytest.mark.xdist_group(name="distributed")
def test_meshes_of_four_devices_equal_one_device(env):
    """20 steps on meshes (4, 1) and (2, 2) of 4 forced CPU devices give the losses of
    one device with the same global batch, and the compiled step all-reduces."""
    e = dict(env, XLA_FLAGS=xla_flags(devices=4))
    overrides = [
        "train.steps=20",
        "train.eval_every=20",
        "train.checkpoint_every=20",
        "train.progress=false",
    ]
    proc = subprocess.run(
        [sys.executable, "-c", _MESHES, SMOKE, *overrides],
        env=e, cwd=ROOT, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert out["devices"] == 4
    one = out["losses"]["1x1"]
    assert len(one) == 20
    for mesh in ("4x1", "2x2"):
        assert _relative(out["losses"][mesh], one) < RTOL, (mesh, out["losses"][mesh], one)
        assert out[mesh]["all_reduce"], mesh  # gradients summed over the data devices
    assert out["4x1"]["wq"] == []  # replicated when mesh.model = 1
    two = out["2x2"]
    assert two["wq"] == [None, None, "model"]  # by heads: output columns
    assert two["wo"] == [None, "model", None]  # by heads: input rows
    assert two["ff0"] == [None, None, "model"]  # by hidden columns
    assert two["ff1"] == [None, "model", None]  # by hidden rows
    # The optimiser's moments follow the controls; the batch is split by rows.
    assert two["moments_wq"] == [two["wq"]]
    assert out["4x1"]["batch"] == two["batch"] == [["data"]]


_ROWS = """
import json, sys
import jax, numpy as np
from ocformer.config import resolve
from ocformer.distributed import Layout, initialize
from ocformer.tasks import AbstractTask, make_task
from ocformer.training._loop import train_batches

smoke, data, count, pid = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
if count > 1:
    initialize(sys.argv[5], count, pid, timeout_s=600)


class Counting(AbstractTask):
    # Counts the rows the loop's batch function makes; `rows` decides whether the
    # task draws its rows alone or falls back to the interface's whole-batch default.
    def __init__(self, inner, rows):
        self.inner, self.kind, self.seq_len = inner, inner.kind, inner.seq_len
        self.vocab_size, self.num_classes = inner.vocab_size, inner.num_classes
        self.rows, self.whole, self.own_rows = 0, 0, rows

    def batch(self, *args):
        self.whole += 1
        return self.inner.batch(*args)

    def batch_rows(self, split, index, batch_size, seed, rows):
        if not self.own_rows:
            return super().batch_rows(split, index, batch_size, seed, rows)
        part = self.inner.batch_rows(split, index, batch_size, seed, rows)
        self.rows += len(part["inputs"])
        return part


config = resolve(smoke, ["task.batch_size=8", "mesh.data=-1"])
layout = Layout(config)
out = {"process": jax.process_index(), "devices": jax.device_count(), "tasks": {}}
tokens = make_task("tokens", path=data, seq_len=6)
copy = make_task("copy", seq_len=16, vocab_size=8)
for name, inner, own in [("tokens", tokens, True), ("copy", copy, True), ("copy", copy, False)]:
    task = Counting(inner, own)
    produce = train_batches(task, layout, 8, 5)
    equal, shards = True, []
    for n in (0, 1, 7):
        batch = produce(n)
        want = inner.batch("train", n, 8, 5)  # the one-process global batch
        got = layout.to_host(batch)
        for k in want:
            equal &= got[k].dtype == want[k].dtype and got[k].tobytes() == want[k].tobytes()
            for shard in batch[k].addressable_shards:
                rows = shard.index[0].indices(8)[:2]
                equal &= np.asarray(shard.data).tobytes() == want[k][slice(*rows)].tobytes()
                shards.append(rows)
    rows = layout.process_rows(8)
    out["tasks"][name + ("" if own else "_whole")] = {
        "rows": [rows.start, rows.stop], "made": task.rows, "whole": task.whole,
        "equal": bool(equal), "shards": sorted(set(map(tuple, shards))),
    }
print("RESULT " + json.dumps(out), flush=True)
"""


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    from ocformer.tasks import prepare_text

    root = tmp_path_factory.mktemp("rows")
    (root / "text.txt").write_text("the cat sat on the mat.\n" * 200, encoding="utf-8")
    prepare_text([str(root / "text.txt")], "char", root / "data", progress=False)
    return str(root / "data")


def _rows_result(text: str) -> dict:
    return json.loads(text.split("RESULT ", 1)[1].splitlines()[0])


@pytest.mark.slow
@pytest.mark.xdist_group(name="distributed")
def test_each_process_makes_only_its_rows_of_the_global_batch(env, prepared):
    """The loop's batches (``train_batches``) on 4 devices of one process and on two
    processes: each process makes only its own rows (counted), falls back to the whole
    batch for a task that cannot draw rows alone, and the global batch its devices
    assemble is bitwise the one-process batch."""
    e = dict(env, XLA_FLAGS=xla_flags(devices=4))
    one = subprocess.run(
        [sys.executable, "-c", _ROWS, SMOKE, prepared, "1", "0"],
        env=e, cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert one.returncode == 0, one.stderr[-3000:]
    got = _rows_result(one.stdout)
    assert got["devices"] == 4
    for name in ("tokens", "copy"):
        t = got["tasks"][name]
        assert t == {"rows": [0, 8], "made": 24, "whole": 0, "equal": True,
                     "shards": [[0, 2], [2, 4], [4, 6], [6, 8]]}, (name, t)  # fmt: skip
    assert got["tasks"]["copy_whole"]["whole"] == 3 and got["tasks"]["copy_whole"]["equal"]

    address = f"127.0.0.1:{_free_port()}"
    procs = _start_each(
        [[sys.executable, "-c", _ROWS, SMOKE, prepared, "2", str(i), address] for i in range(2)],
        env,
    )
    outs = [p.communicate(timeout=900) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-3000:] for _, err in outs]
    for i, (out, _) in enumerate(outs):
        got = _rows_result(out)
        assert got["process"] == i and got["devices"] == 2
        mine = [4 * i, 4 * i + 4]
        for name in ("tokens", "copy"):
            t = got["tasks"][name]
            # 3 batches of 4 rows: half of the 8-row global batch, never the whole.
            assert t == {"rows": mine, "made": 12, "whole": 0, "equal": True,
                         "shards": [mine]}, (i, name, t)  # fmt: skip
        whole = got["tasks"]["copy_whole"]
        assert whole["whole"] == 3 and whole["equal"] and whole["rows"] == mine


def _train_command(workdir, *overrides):
    cmd = ["--config", SMOKE, "--workdir", str(workdir)]
    for o in (*BASE, *overrides):
        cmd += ["--set", o]
    return cmd


def _one_process(env, workdir, *overrides):
    return subprocess.run(
        [sys.executable, "-m", "ocformer.train", *_train_command(workdir, *overrides)],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=1200,
    )  # fmt: skip


# ``python -m ocformer.launch`` whose processes run ``tests/_faults.py FAULT -- ARGS``
# in place of ``python -m ocformer.train ARGS``.
_FAULTY_LAUNCH = """
import sys
from ocformer import launch
from ocformer.distributed import _launcher
fault, argv = sys.argv[1].split(), sys.argv[2:]
_launcher.train_command = lambda args: [sys.executable, {faults!r}, *fault, "--", *args]
sys.exit(launch.main(argv))
"""


def _launch(env, workdir, *overrides, grace=5, fault=None):
    """``ocformer.launch local`` of two processes; with ``fault`` (the options of
    ``tests/_faults.py``), each runs under that fault."""
    if fault is None:
        launch = [sys.executable, "-m", "ocformer.launch"]
    else:
        faults = os.path.join(ROOT, "tests", "_faults.py")
        launch = [sys.executable, "-c", _FAULTY_LAUNCH.format(faults=faults), " ".join(fault)]
    return subprocess.Popen(
        [*launch, "local", "--nproc", "2", "--grace", str(grace), "--",
         *_train_command(workdir, *overrides)],
        env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def _wait_for_records(launcher, workdir, n: int):
    """Wait until the run in ``workdir`` has logged ``n`` records (failing the test if
    it ends first); returns the path of its metrics file."""
    metrics = workdir / "metrics.jsonl"
    deadline = time.monotonic() + 1200
    while time.monotonic() < deadline and launcher.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= n:
            break
        time.sleep(0.05)
    if launcher.poll() is not None:
        out, err = launcher.communicate()
        pytest.fail(f"the run ended before the signal:\n{out[-3000:]}\n{err[-5000:]}")
    return metrics


def _losses(workdir) -> dict[int, float]:
    with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f)}


def _assert_close(got: dict, want: dict, steps) -> None:
    steps = list(steps)
    assert steps and all(s in got for s in steps), (sorted(got), steps)
    assert _relative([got[s] for s in steps], [want[s] for s in steps]) < RTOL, (got, want)


@pytest.mark.slow
@pytest.mark.xdist_group(name="distributed")
def test_two_processes_equal_one_and_survive_a_killed_process(env, tmp_path):
    """Two processes give the one-process losses; SIGKILL of one ends the run with a
    clear error within a bounded time; a checkpoint of 2 processes resumes in 1 and one
    of 1 process resumes in 2, with the one-process losses."""
    one = tmp_path / "one"
    proc = _one_process(env, one)
    assert proc.returncode == 0, proc.stderr[-3000:]
    want = _losses(one)
    assert sorted(want) == list(range(1, STEPS + 1))

    # Two processes; process 1 SIGKILLs itself at its third update, once the checkpoint
    # of step 2 is committed, so that process 0 is in that update's collective however
    # loaded the machine is (a kill from here could land after the run's last step,
    # where process 0 has no collective left to fail). Process 0 needs the time to
    # reach its failing collective and report it: on a loaded machine more than 5 s,
    # after which the launcher's SIGKILL would silence it.
    two = tmp_path / "two"
    marker = two / "checkpoints" / "step_2" / MARKER
    fault = ["--kill-at", "3", "--process", "1", "--after", str(marker)]
    launcher = _launch(env, two, grace=30, fault=fault)
    deadline = time.monotonic() + 1200
    while not marker.exists() and launcher.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    killed = time.monotonic()  # within 0.05 s of process 1's kill
    out, err = launcher.communicate(timeout=1200)
    stopped_after = time.monotonic() - killed
    assert launcher.returncode == 128 + signal.SIGKILL, err[-3000:]
    assert "process 1 (pid" in err and "was killed by SIGKILL" in err
    # Process 0's collective fails: one line naming the resume point, no traceback.
    assert "Traceback" not in err, err[-5000:]
    assert "process 0: a collective with the other processes failed" in err, err[-3000:]
    assert stopped_after < 60, stopped_after  # the launcher's grace (30 s) bounds it
    got = _losses(two)
    _assert_close(got, want, range(1, 3))

    # The rerun, in one process, resumes from the checkpoint the two processes wrote.
    resumed = _one_process(env, two)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    start = int(re.search(r"resuming .* from step (\d+)", resumed.stdout).group(1))
    assert start >= 2
    _assert_close(_losses(two), want, range(1, STEPS + 1))

    # The reverse: a checkpoint of one process (step 4) resumes in two.
    back = tmp_path / "back"
    shutil.copytree(one, back)
    os.remove(back / "checkpoints" / f"step_{STEPS}" / MARKER)  # uncommitted: deleted
    launcher = _launch(env, back)
    out, err = launcher.communicate(timeout=1200)
    assert launcher.returncode == 0, err[-3000:]
    assert f"resuming {back} from step 4" in out
    _assert_close(_losses(back), want, range(1, STEPS + 1))
    assert sorted(_losses(back)) == list(range(1, STEPS + 1))


@pytest.mark.slow
@pytest.mark.xdist_group(name="distributed")
def test_two_processes_agree_to_stop_at_a_checked_step(env, tmp_path):
    """SIGTERM to a run of two processes (the launcher passes it on to both): they agree
    on it only every ``train.stop_check_every`` steps, so both stop, and checkpoint
    together, at the first multiple of it after the signal; the run resumes from
    there."""
    every = 4
    workdir = tmp_path / "run"
    launcher = _launch(
        env, workdir, "train.steps=100000", "train.checkpoint_every=100000",
        "train.eval_every=100000", f"train.stop_check_every={every}",
    )  # fmt: skip
    metrics = _wait_for_records(launcher, workdir, 5)
    signalled_after = len(metrics.read_text().splitlines())
    launcher.send_signal(signal.SIGTERM)
    out, err = launcher.communicate(timeout=600)
    assert launcher.returncode == 128 + signal.SIGTERM, err[-3000:]
    steps = sorted(_losses(workdir))
    stopped = steps[-1]
    assert stopped % every == 0 and stopped >= signalled_after, (stopped, signalled_after)
    assert steps == list(range(1, stopped + 1))
    assert sorted(os.listdir(workdir / "checkpoints")) == [f"step_{stopped}"]
    assert (workdir / "checkpoints" / f"step_{stopped}" / MARKER).exists()
    # One process, two steps more: the length is a changed field, allowed explicitly.
    command = _train_command(
        workdir,
        f"train.steps={stopped + 2}",
        "train.checkpoint_every=100000",
        "train.eval_every=100000",
    )
    resumed = subprocess.run(
        [sys.executable, "-m", "ocformer.train", *command, "--allow-config-change"],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"from step {stopped}" in resumed.stdout
    assert sorted(_losses(workdir)) == list(range(1, stopped + 3))


@pytest.mark.slow
@pytest.mark.xdist_group(name="distributed")
@pytest.mark.parametrize("how", ["ctrl-c", "killed"])
def test_a_stopped_launcher_leaves_a_checkpoint_and_no_process(env, tmp_path, how):
    """Ctrl-C at a terminal signals the launcher's whole process group; SIGKILL ends the
    launcher alone. Either way both training processes checkpoint together (SIGTERM,
    once: they have their own process group and end with the launcher) and none is
    left running; Ctrl-C ends the launcher with 130."""
    workdir = tmp_path / "run"
    command = [
        sys.executable, "-m", "ocformer.launch", "local", "--nproc", "2", "--grace", "60",
        "--", *_train_command(
            workdir, "train.steps=100000", "train.checkpoint_every=100000",
            "train.eval_every=100000", "train.stop_check_every=2",
        ),
    ]  # fmt: skip
    launcher = subprocess.Popen(
        command, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True,
    )  # fmt: skip
    pids = [int(p) for p in re.findall(r"\d+", launcher.stderr.readline().split("pids")[-1])]
    assert len(pids) == 2, pids
    _wait_for_records(launcher, workdir, 3)
    for pid in pids:  # its own group, not the launcher's
        assert os.getpgid(pid) == pid != os.getpgid(launcher.pid)
    if how == "ctrl-c":
        os.killpg(launcher.pid, signal.SIGINT)
    else:
        launcher.kill()
    out, err = launcher.communicate(timeout=600)
    if how == "ctrl-c":
        assert launcher.returncode == 130, err[-3000:]
        assert "interrupted: the processes checkpointed" in err, err[-3000:]
    deadline = time.monotonic() + 300
    while any(map(_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(map(_alive, pids)), pids
    saved = sorted(os.listdir(workdir / "checkpoints"))
    assert len(saved) == 1 and (workdir / "checkpoints" / saved[0] / MARKER).exists(), saved
    assert int(saved[0].removeprefix("step_")) % 2 == 0  # agreed on a checked step


def test_a_supervised_process_ends_with_its_supervisor():
    """A child started with ``supervised`` (as the launcher and a sweep start theirs) has
    its own process group, does not pass the supervisor's id on, and gets SIGTERM when
    the supervisor ends, however it ends (here ``os._exit``, as SIGKILL would)."""
    child = (
        "import os, time\n"
        "from ocformer._cli import PARENT_ENV, end_with_parent\n"
        "end_with_parent()\n"
        "print(os.getpgid(0) == os.getpid(), PARENT_ENV in os.environ, flush=True)\n"
        "time.sleep(300)\n"
    )
    supervisor = (
        "import os, subprocess, sys\n"
        "from ocformer.distributed import supervised\n"
        f"p = subprocess.Popen([sys.executable, '-c', {child!r}], **supervised(os.environ))\n"
        "print(p.pid, flush=True)\n"
        "sys.stdin.readline()\n"
        "os._exit(0)\n"
    )
    with subprocess.Popen(
        [sys.executable, "-c", supervisor], cwd=ROOT, stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, text=True,
    ) as proc:  # fmt: skip
        pid = int(proc.stdout.readline())
        assert proc.stdout.readline().split() == ["True", "False"]
        assert _alive(pid)
        proc.stdin.write("\n")
        proc.stdin.flush()
        proc.wait(timeout=60)
        deadline = time.monotonic() + 60
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(pid)


def test_launch_local_stops_the_others_when_one_fails(tmp_path, capsys):
    """A process that fails ends the launch with its code, and the others are stopped:
    here each training process refuses a missing experiment file (exit 2)."""
    from ocformer.distributed import launch_local

    missing = str(tmp_path / "missing.py")
    started = time.monotonic()
    code = launch_local(2, ["--config", missing, "--workdir", str(tmp_path / "run")])
    assert code == 2
    err = capsys.readouterr().err
    assert re.search(r"process [01] \(pid \d+\) exited with code 2; (stopping the other "
                     r"processes|the others had ended too: process [01] exited with code 2)",
                     err), err  # fmt: skip
    assert time.monotonic() - started < 120
    assert not (tmp_path / "run").exists()


def test_the_launcher_tags_the_other_processes_lines_on_their_own_streams(capsys, monkeypatch):
    """Process 1's lines come prefixed ``[process 1]``, its standard error on the
    launcher's standard error (``2>file`` keeps every process's errors), its output on
    standard output."""
    from ocformer.distributed import _launcher

    code = "import sys; print('said'); print('failed', file=sys.stderr)"
    monkeypatch.setattr(_launcher, "train_command", lambda args: [sys.executable, "-c", code])
    assert _launcher.launch_local(2, ["--config", "x"]) == 0
    out, err = capsys.readouterr()
    assert "[process 1] said\n" in out and "failed" not in out, out
    assert "[process 1] failed\n" in err and "said" not in err, err


def test_the_launcher_stops_only_processes_still_running(capsys):
    """Processes that had all ended when the first failure was seen are described as
    such, not as being stopped."""
    from ocformer.distributed._launcher import _Stop, _supervise

    procs = [subprocess.Popen([sys.executable, "-c", f"raise SystemExit({c})"]) for c in (2, 3)]
    for p in procs:
        p.wait()
    assert _supervise(procs, 1.0, _Stop(procs)) == 2
    err = capsys.readouterr().err
    assert (
        f"process 0 (pid {procs[0].pid}) exited with code 2; the others had ended too: "
        "process 1 exited with code 3" in err
    ), err
    assert "stopping" not in err


def test_the_launcher_says_how_the_processes_it_stopped_ended(capsys):
    """After one process fails, the launcher says how each process it stopped ended:
    by SIGTERM, or killed after the grace period when it did not end."""
    from ocformer.distributed._launcher import _Stop, _supervise

    deaf = (  # ignores SIGTERM, then says so
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "print(1, flush=True); time.sleep(60)"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", "raise SystemExit(2)"]),
        subprocess.Popen([sys.executable, "-c", deaf], stdout=subprocess.PIPE),
        subprocess.Popen(["sleep", "60"]),
    ]
    procs[0].wait()
    assert procs[1].stdout is not None and procs[1].stdout.readline()  # SIGTERM ignored
    started = time.monotonic()
    assert _supervise(procs, 1.0, _Stop(procs)) == 2
    assert time.monotonic() - started < 30
    procs[1].stdout.close()
    err = capsys.readouterr().err
    assert (
        "stopped: process 1 was killed by SIGKILL (no end within 1s of SIGTERM), "
        "process 2 was killed by SIGTERM" in err
    ), err


def test_the_launcher_names_the_process_that_ended_before_the_one_that_lost_it(capsys):
    """A process whose collective failed because another one ended exits with
    ``PEER_LOST``; when both have ended by the time the launcher looks, it reports the
    other one (the cause), whatever their order."""
    from ocformer.distributed import PEER_LOST
    from ocformer.distributed._launcher import _Stop, _supervise
    from ocformer.training import ExitCode

    assert ExitCode.PEER_LOST == PEER_LOST == 5
    procs = [
        subprocess.Popen([sys.executable, "-c", f"raise SystemExit({PEER_LOST})"]),
        subprocess.Popen([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), 9)"]),
    ]
    for p in procs:
        p.wait()
    assert _supervise(procs, 1.0, _Stop(procs)) == 128 + signal.SIGKILL
    err = capsys.readouterr().err
    assert (
        f"process 1 (pid {procs[1].pid}) was killed by SIGKILL; the others had ended "
        "too: process 0 exited with code 5" in err
    ), err


def test_only_a_transport_failure_of_several_processes_is_a_lost_peer(monkeypatch):
    import jax

    from ocformer.distributed import lost_peer

    gloo = jax.errors.JaxRuntimeError(
        "UNKNOWN: Gloo all-reduce failed: [pair.cc:538] Read error: Connection reset by peer"
    )
    oom = jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 8 bytes")
    assert not lost_peer(gloo)  # one process: there is no peer to lose
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    assert lost_peer(gloo)
    assert not lost_peer(oom)
    assert not lost_peer(ValueError("Connection reset by peer"))
    # What a jitted gather raises when the peer goes during a checkpoint's barrier.
    barrier = ValueError("UNKNOWN: Gloo AllGather failed: [pair.cc:538] Read error "
                         "[127.0.0.1]:12484: Connection reset by peer")  # fmt: skip
    assert lost_peer(barrier)
    assert not lost_peer(ValueError("INVALID_ARGUMENT: shapes (2,) and (3,) differ"))


@pytest.mark.parametrize(
    "signum, killed, code, exit_code, line",
    [
        (signal.SIGTERM, False, 143, 143, "stopped by SIGTERM: the processes checkpointed; rerun"),
        (signal.SIGHUP, False, 1, 1, "stopped by SIGHUP: the processes ended with code 1; the"),
        (signal.SIGINT, False, 143, 130, "interrupted: the processes checkpointed; rerun"),
        (signal.SIGINT, True, 137, 130, "interrupted: the processes were killed; the newest"),
        (None, False, 0, 0, ""),
    ],
)
def test_a_stopped_launch_says_how_it_ended(signum, killed, code, exit_code, line, capsys):
    from ocformer.distributed._launcher import _Stop, _stopped

    stop = _Stop([])
    stop.signum, stop.killed = signum, killed
    assert _stopped(stop, code) == exit_code
    err = capsys.readouterr().err
    assert line in err and (line or not err), err


@pytest.mark.slow
def test_train_task_requeues_after_the_training_process_checkpointed(env, tmp_path):
    """SLURM's timeout or preemption signal, as submitit handles it: its handler runs on
    the thread that waits for the training process and calls ``checkpoint``. The
    process gets SIGTERM, checkpoints and exits 143, and only then is the task requeued,
    with the same arguments, without waiting out the grace period."""
    import threading

    from ocformer.checkpointing import CheckpointManager
    from ocformer.distributed import GRACE_S, TrainTask

    workdir = tmp_path / "run"
    args = _train_command(
        workdir, "train.steps=100000", "train.checkpoint_every=100000",
        "train.eval_every=100000", "train.log_every=1",
    )  # fmt: skip
    task = TrainTask(args)
    seen: dict = {}

    def requeue(signum, frame):
        started = time.monotonic()
        seen["delayed"] = task.checkpoint()
        seen["waited"] = time.monotonic() - started

    def when_training() -> None:
        metrics = workdir / "metrics.jsonl"
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline and not (metrics.exists() and metrics.stat().st_size):
            time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGUSR2)

    previous = signal.signal(signal.SIGUSR2, requeue)
    signaller = threading.Thread(target=when_training)
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        signaller.start()
        seen["code"] = task()  # preempted and checkpointed: not a failed task
    finally:
        os.environ.clear()
        os.environ.update(saved)
        signal.signal(signal.SIGUSR2, previous)
        signaller.join(timeout=60)
    assert seen["code"] == 143
    assert seen["waited"] < GRACE_S, seen["waited"]
    assert CheckpointManager(str(workdir / "checkpoints")).latest() is not None
    delayed = seen["delayed"]
    assert isinstance(delayed.function, TrainTask) and delayed.function.train_args == args


def test_slurm_dry_run_prints_a_multi_node_job(capsys):
    code = launch.main(
        ["slurm", "--nodes", "2", "--gpus-per-node", "4", "--partition", "gpu", "--time", "30",
         "--dry-run", "--", "--config", SMOKE, "--workdir", "runs/smoke"]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    for line in (
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=4",
        "#SBATCH --gpus-per-node=4",
        "#SBATCH --partition=gpu",
        "#SBATCH --time=30",
    ):
        assert line in out, out
    assert "-m ocformer.train --config" in out and "--workdir runs/smoke" in out


def test_launch_refuses_bad_invocations(capsys, monkeypatch):
    assert launch.main(["local", "--nproc", "2"]) == 2
    assert "after --" in capsys.readouterr().err
    assert launch.main(["local", "--nproc", "2", "--config", SMOKE]) == 2  # -- forgotten
    assert "give the training arguments after --" in capsys.readouterr().err
    # What the launcher itself lacks is named first.
    for argv, lacking in [([], "{local,slurm}"), (["--", "--config", SMOKE], "{local,slurm}"),
                          (["local", "--", "--config", SMOKE], "--nproc")]:  # fmt: skip
        assert launch.main(argv) == 2
        assert f"the following arguments are required: {lacking}" in capsys.readouterr().err
    assert launch.main(["local", "--nproc", "2", "--bogus", "--", "x"]) == 2
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err
    assert launch.main(["local", "--nproc", "0", "--", "--config", SMOKE]) == 2
    assert "--nproc must be >= 1" in capsys.readouterr().err
    for grace in ("-5", "nan", "inf"):
        assert launch.main(["local", "--nproc", "2", "--grace", grace, "--", "x"]) == 2
        assert "--grace must be a finite number of seconds >= 0" in capsys.readouterr().err
    # Training arguments every task would refuse are refused at submission, not after
    # the job waited in the queue; a machine without SLURM's commands is named.
    slurm = ["slurm", "--nodes", "2", "--gpus-per-node", "1"]
    assert launch.main([*slurm, "--dry-run", "--", "x"]) == 2
    assert "the training arguments need --config FILE.py and --workdir DIR" in (
        capsys.readouterr().err
    )
    train = ["--config", SMOKE, "--workdir", "runs/x"]
    assert launch.main([*slurm, "--partition=", "--dry-run", "--", *train]) == 2
    assert "--partition must name a partition" in capsys.readouterr().err  # was --partition=''
    assert launch.main([*slurm, "--dry-run", "--", *train, "--set", "train.stepz=3"]) == 2
    assert (
        "the training arguments would be refused by every task: train.stepz: unknown field"
        in capsys.readouterr().err
    )
    monkeypatch.setenv("PATH", "")
    assert launch.main([*slurm, "--", *train]) == 2
    assert "(sbatch and srun not found)" in capsys.readouterr().err


def test_a_failed_count_check_names_the_store_s_error(monkeypatch):
    """A process whose peer's count cannot be read says why (the key-value store's
    first line), not only that the peer did not join."""
    from ocformer.distributed import DistributedError, _process

    class Client:
        def key_value_set(self, key, value):
            pass

        def blocking_key_value_get(self, key, timeout_ms):
            raise RuntimeError("UNAVAILABLE: the coordinator went away\nmore detail")

    monkeypatch.setattr(_process.jax_distributed_state, "client", Client())
    with pytest.raises(DistributedError) as e:
        _process._check_counts(2, 0, 5)
    assert "process 1 of 2 did not join within 5s (UNAVAILABLE: the coordinator went away)" in (
        str(e.value)
    )
    assert "more detail" not in str(e.value)
