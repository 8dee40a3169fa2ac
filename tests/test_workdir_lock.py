"""One writer per directory: a run's or a sweep's directory is locked by the process
writing it; a second writer is refused (exit code 2, naming the holder) and changes
nothing, and the lock of a killed holder is free again.

The holder is a real process: a helper that takes the lock and sleeps, or a training
run; the refused writers are the command lines in subprocesses.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from test_workdir import snapshot

from ocformer.training import LOCK_FILE, RUN_MARKER, DirectoryLock, WorkdirError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOKE = os.path.join(ROOT, "experiments", "smoke.py")
SMOKE_SWEEP = os.path.join(ROOT, "experiments", "sweeps", "smoke.py")
# Takes the lock of argv[1], says so, and sleeps until it is killed.
HOLDER = """
import sys, time
from ocformer.training import DirectoryLock
DirectoryLock(sys.argv[1]).acquire()
print("held", flush=True)
time.sleep(600)
"""


@pytest.fixture
def env():
    e = dict(os.environ)
    e.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    return e


def hold(directory, env) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(directory)],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline()
    if line.strip() != "held":
        proc.kill()
        raise AssertionError(f"the holder did not take the lock:\n{proc.communicate()[1]}")
    return proc


def kill(proc) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL


def assert_refused(result, directory, holder):
    assert result.returncode == 2, result.stderr
    message = " ".join(result.stderr.split())
    assert str(directory) in message
    assert f"pid {holder.pid} on host {socket.gethostname()}" in message
    assert "Wait for that process to finish" in message


def assert_free(directory):
    """The lock can be taken (and then holds this process's pid)."""
    with DirectoryLock(str(directory)), open(os.path.join(directory, LOCK_FILE)) as f:
        assert json.load(f)["pid"] == os.getpid()


def assert_second_writer_refused(directory, command, env):
    """While a helper holds ``directory``'s lock, ``command`` (a second writer) exits 2
    naming the holder and changes no file; once the holder is killed the lock is free."""
    holder = hold(directory, env)
    try:
        before = snapshot(directory)
        result = subprocess.run(
            command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300
        )
        assert_refused(result, directory, holder)
        assert snapshot(directory) == before
    finally:
        kill(holder)
    assert_free(directory)


def test_second_train_is_refused_and_a_killed_holders_lock_is_free(tmp_path, env):
    workdir = tmp_path / "run"
    workdir.mkdir()
    # A run in progress: its marker and first records.
    (workdir / RUN_MARKER).write_text('{"created": "2026-01-01T00:00:00+0000"}')
    (workdir / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.9}\n')
    assert_second_writer_refused(
        workdir,
        [sys.executable, "-m", "ocformer.train", "--config", SMOKE, "--workdir", str(workdir),
         "--set", "train.steps=2", "--set", "train.progress=false"],
        env,
    )  # fmt: skip


def test_second_sweep_is_refused_and_a_killed_holders_lock_is_free(tmp_path, env):
    out = tmp_path / "sweep"
    out.mkdir()
    # A sweep in progress: its record, naming the same sweep.
    (out / "sweep.json").write_text(json.dumps({"id": "smoke", "points": []}))
    assert_second_writer_refused(
        out,
        [sys.executable, "-m", "ocformer.sweep", SMOKE_SWEEP, "--workdir", str(out),
         "--only", "layers=1"],
        env,
    )  # fmt: skip


def test_lock_is_exclusive_within_and_across_processes(tmp_path):
    lock = DirectoryLock(str(tmp_path)).acquire()
    # A second descriptor conflicts even in the same process (flock locks open files).
    with pytest.raises(WorkdirError, match=f"pid {os.getpid()} on host"):
        DirectoryLock(str(tmp_path)).acquire()
    lock.release()
    assert_free(tmp_path)


def test_a_lock_file_alone_is_not_foreign(tmp_path):
    """A writer killed after locking and before its marker leaves only ``.lock``: the
    directory is still one ocformer may claim."""
    from ocformer.config import resolve
    from ocformer.training import RunDirectory

    (tmp_path / LOCK_FILE).write_text('{"pid": 1, "host": "elsewhere"}\n')
    config = resolve(SMOKE)
    assert RunDirectory(tmp_path).check(config) == {}


@pytest.mark.slow
def test_a_run_in_progress_refuses_a_second_run(tmp_path, env):
    """The reported failure itself: the same command started twice on one directory."""
    workdir = tmp_path / "run"
    cmd = [sys.executable, "-m", "ocformer.train", "--config", SMOKE, "--workdir", str(workdir)]
    for o in ("train.steps=100000", "train.checkpoint_every=100000", "train.progress=false",
              "train.eval_every=100000", "optimiser.schedule=constant"):  # fmt: skip
        cmd += ["--set", o]
    first = subprocess.Popen(
        cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        metrics = workdir / "metrics.jsonl"
        t0 = time.monotonic()
        while not (metrics.exists() and metrics.read_bytes().count(b"\n") >= 2):
            assert first.poll() is None, first.communicate()[1]
            assert time.monotonic() - t0 < 300, "the first run did not start"
            time.sleep(0.05)
        second = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert_refused(second, workdir, first)
        whole = metrics.read_text().rsplit("\n", 1)[0]  # lines the first run finished
        steps = [json.loads(line)["step"] for line in whole.splitlines()]
        assert steps == list(range(1, len(steps) + 1))  # each step once, never rewound
        assert first.poll() is None  # the first run goes on
    finally:
        kill(first)
    assert_free(workdir)


@pytest.mark.parametrize("failing", ["ftruncate", "flock"])
def test_a_lock_that_cannot_be_taken_or_written_is_not_kept(tmp_path, monkeypatch, failing):
    """A full disk while the holder is written, or a file system without locks: a
    WorkdirError naming the cause, and nothing held afterwards (the descriptor is
    closed, so the directory stays free for the next try)."""
    import errno
    import fcntl

    real = {"ftruncate": os.ftruncate, "flock": fcntl.flock}[failing]
    code = {"ftruncate": errno.ENOSPC, "flock": errno.ENOLCK}[failing]

    def fail(*args):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os if failing == "ftruncate" else fcntl, failing, fail)
    lock = DirectoryLock(str(tmp_path))
    with pytest.raises(WorkdirError, match=os.strerror(code)):
        lock.acquire()
    assert not lock.held
    monkeypatch.setattr(os if failing == "ftruncate" else fcntl, failing, real)
    other = DirectoryLock(str(tmp_path)).acquire()  # free: no descriptor kept the flock
    assert other.held
    other.release()
