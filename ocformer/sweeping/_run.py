"""Running a sweep's points: one ``python -m ocformer.train`` process per point, then
``python -m ocformer.evaluate`` for its solver statistics and evaluation-time
discretisations.

Layout of a sweep directory::

    DIR/sweep.json                 command, git revision, versions, resolved points
    DIR/points/<slug>-<hash>/      one folder per point:
        run/                       its ocformer.train work directory
        sweep_point.json           status, exit code, error line, wall/compile time, RSS
        train.log, evaluate.log    the processes' output
        evaluations/<name>.json    python -m ocformer.evaluate --json (``trained.json``:
                                   the trained discretisation)
    DIR/cache/jax/                 JAX's persistent compilation cache, shared by points
    DIR/results.csv, results.md, plots/

A point's status file is written (atomically) only by the process running it; a
point is finished when its status is ``done`` and every evaluation it asks for exists,
so re-running a sweep skips it, and a point left ``running`` by a killed sweep resumes
from its checkpoint (``ocformer.train`` does that on its own).
"""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

from ..checkpointing import CheckpointManager, atomic_write_text
from ..distributed import stop_processes, supervised
from ._spec import SweepError

STATUS_FILE = "sweep_point.json"
TRAINED = "trained"  # the evaluation under the trained discretisation

_COMPILE_LINE = re.compile(
    r"^Finished (?:tracing|jaxpr to MLIR module conversion|XLA compilation) .* in "
    r"([0-9.eE+-]+) sec"
)
_LOG_NOISE = ("Finished ", "Compiling ", "Persistent compilation cache", "Not writing persistent")

# Processes started by this sweep, so that an interrupted sweep can stop them cleanly.
_children: set[subprocess.Popen] = set()
_children_lock = threading.Lock()
# The signal that is stopping this sweep (None while it runs): no point starts after
# it, and the points it cut short are recorded as interrupted.
_stopping: dict[str, int | None] = {"signal": None}
# Seconds a point's processes get to checkpoint and exit once the sweep stops, before
# SIGKILL.
STOP_GRACE_S = 60.0
# Seconds between the records of a running point's times so far, so that a sweep
# killed without warning (SIGKILL, a lost node) still counts the attempt it cut short.
HEARTBEAT_S = 10.0
_TIMES = ("wall_time_s", "compile_time_s", "cache_hits")  # summed over a point's attempts


class SweepInterrupted(Exception):
    """The sweep was stopped by a signal (SIGTERM or SIGINT) after its running points
    were stopped and recorded as interrupted; the command exits with 128 + signal. The
    message names what the stop left: the points interrupted in training (each with the
    step of its last committed checkpoint, where it resumes, or as stopped before its
    first checkpoint, so that it starts again from step 0), those trained whose
    evaluations were not all written, and how many did not start."""

    def __init__(
        self,
        signum: int,
        interrupted: Mapping[str, int | None] | None = None,
        unevaluated: Sequence[str] = (),
        not_started: int = 0,
    ):
        self.signum = signum
        self.exit_code = 128 + signum
        interrupted = dict(interrupted or {})
        left = []
        for step, names in sorted(_by_step(interrupted).items()):
            resume = "resumes" if len(names) == 1 else "resume"
            left.append(f"{_named(names)} checkpointed at step {step} ({resume} there)")
        before = [n for n, step in interrupted.items() if step is None]
        if before:
            their, restart = ("its", "restarts") if len(before) == 1 else ("their", "restart")
            left.append(
                f"{_named(before)} stopped before {their} first checkpoint ({restart} from step 0)"
            )
        if unevaluated:
            left.append(f"{_named(unevaluated)} trained, with evaluations still to run")
        if not_started:
            left.append(f"{not_started} point(s) not started")
        said = "; ".join(left) if left else "no point was running"
        super().__init__(
            f"stopped by {signal.Signals(signum).name}: {said}. Rerun the same command to resume"
        )


def _by_step(interrupted: Mapping[str, int | None]) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for name, step in interrupted.items():
        if step is not None:
            out.setdefault(step, []).append(name)
    return out


def _named(names: Sequence[str]) -> str:
    return ("point " if len(names) == 1 else "points ") + ", ".join(names)


def checkpoint_step(sweep_dir: str, name: str) -> int | None:
    """The step of the point's last committed checkpoint (where its training resumes),
    None if it has none."""
    return CheckpointManager(os.path.join(run_dir(sweep_dir, name), "checkpoints")).latest()


def point_dir(sweep_dir: str, name: str) -> str:
    return os.path.join(sweep_dir, "points", name)


def run_dir(sweep_dir: str, name: str) -> str:
    """The point's training work directory."""
    return os.path.join(point_dir(sweep_dir, name), "run")


def _json_or_empty(file: str) -> dict:
    if not os.path.isfile(file):
        return {}
    with open(file, encoding="utf-8") as f:
        return json.load(f)


def read_status(path: str) -> dict:
    return _json_or_empty(os.path.join(path, STATUS_FILE))


def _write_status(path: str, status: dict) -> None:
    atomic_write_text(os.path.join(path, STATUS_FILE), json.dumps(status, indent=2) + "\n")


def evaluation_file(path: str, name: str) -> str:
    return os.path.join(path, "evaluations", f"{name}.json")


def is_finished(sweep_dir: str, point: dict) -> bool:
    """Trained, and evaluated under every discretisation the point asks for."""
    path = point_dir(sweep_dir, point["name"])
    if read_status(path).get("status") != "done":
        return False
    names = [TRAINED, *(e["name"] for e in point["evaluations"])]
    return all(_evaluated(evaluation_file(path, n)) for n in names)


def _evaluated(file: str) -> bool:
    """An evaluation's result is there (a failed one's record runs again)."""
    return os.path.isfile(file) and _json_or_empty(file).get("status") != "failed"


def child_env(sweep_dir: str) -> dict:
    """The environment of a point's processes: JAX's persistent compilation cache under
    the sweep directory (unless the user chose one), every compilation cached, and
    compilations logged so their time can be read back. Unless the sweep keeps
    runtime checks (``sweep.json``'s ``runtime_checks``), equinox's checks return NaN
    instead of calling back to the host, so that the training and evaluation steps
    can be cached too."""
    env = dict(os.environ)
    info = _json_or_empty(os.path.join(sweep_dir, "sweep.json"))
    if not info.get("runtime_checks", True):
        env.setdefault("EQX_ON_ERROR", "nan")
    env.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(sweep_dir, "cache", "jax"))
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    env["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    env["JAX_LOG_COMPILES"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _read_log(log_path: str, offset: int) -> tuple[list[str], float, int]:
    """The lines ``log_path`` holds after ``offset`` (less the command line written
    there), with the compilation seconds and persistent-cache hits they report."""
    with open(log_path, encoding="utf-8", errors="replace") as f:
        f.seek(offset)
        lines = f.read().splitlines()[1:]
    compile_s = sum(float(m.group(1)) for m in map(_COMPILE_LINE.match, lines) if m)
    hits = sum(1 for line in lines if line.startswith("Persistent compilation cache hit"))
    return lines, compile_s, hits


def _run_logged(
    command: list[str],
    log_path: str,
    env: dict,
    on_start: Callable[[subprocess.Popen], None] | None = None,
    heartbeat: Callable[[dict], None] | None = None,
) -> dict:
    """Run ``command`` with its output appended to ``log_path`` (``on_start`` is called
    with the process once it runs; ``heartbeat``, every ``HEARTBEAT_S`` seconds while
    it runs, with its ``wall_time_s``, ``compile_time_s`` and ``cache_hits`` so far). A
    process started after the sweep was told to stop is stopped at once.

    Returns:
        ``exit_code`` (negative: killed by that signal), ``wall_time_s``,
        ``peak_rss_mb``, ``compile_time_s`` and ``cache_hits`` read from the JAX
        compilation log, and ``error`` (the last meaningful output line on failure).
    """
    started = time.perf_counter()
    finished = threading.Event()

    def beat(offset: int, heartbeat: Callable[[dict], None]) -> None:
        while not finished.wait(HEARTBEAT_S):
            _, compile_s, hits = _read_log(log_path, offset)
            wall = time.perf_counter() - started
            heartbeat({"wall_time_s": wall, "compile_time_s": compile_s, "cache_hits": hits})

    with open(log_path, "ab") as log:
        offset = log.tell()
        log.write(("$ " + " ".join(command) + "\n").encode())
        log.flush()
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, **supervised(env))
        with _children_lock:
            _children.add(proc)
            if _stopping["signal"] is not None:
                os.kill(proc.pid, signal.SIGTERM)
        beats = threading.Thread(target=beat, args=(offset, heartbeat), daemon=True)
        try:
            if on_start is not None:
                on_start(proc)
            if heartbeat is not None:
                beats.start()
            # wait4 gives this child's own resource usage (peak RSS), unlike
            # getrusage(RUSAGE_CHILDREN), which is the maximum over all children.
            _, status, usage = os.wait4(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(status)
        finally:
            finished.set()
            if beats.is_alive():
                beats.join()
            if proc.returncode is None:
                # Left by an exception (of on_start, say): the point is not run unwatched.
                stop_processes([proc], STOP_GRACE_S)
                proc.wait()
            with _children_lock:
                _children.discard(proc)
    assert proc.returncode is not None  # waited for above
    wall = time.perf_counter() - started
    lines, compile_s, hits = _read_log(log_path, offset)
    out = {
        "exit_code": proc.returncode,
        "wall_time_s": wall,
        "peak_rss_mb": usage.ru_maxrss / 1024.0,  # Linux reports KiB
        "compile_time_s": compile_s,
        "cache_hits": hits,
        "error": None,
    }
    if proc.returncode != 0:
        meaningful = [s for s in lines if s.strip() and not s.startswith(_LOG_NOISE)]
        errors = [s for s in meaningful if "error" in s.lower()]
        line = errors[-1] if errors else (meaningful[-1] if meaningful else "")
        if proc.returncode < 0:
            name = signal.Signals(-proc.returncode).name
            line = f"killed by {name}" + (f"; last output: {line}" if line else "")
        out["error"] = line.strip()
    return out


def run_point(sweep_dir: str, point: dict) -> dict:
    """Train one point (resuming it if interrupted) and evaluate it; returns its status.

    ``point`` is its entry in ``sweep.json``. The training process is exactly
    ``python -m ocformer.train --config SPEC --workdir POINT_DIR --set ...``.
    """
    path = point_dir(sweep_dir, point["name"])
    os.makedirs(os.path.join(path, "evaluations"), exist_ok=True)
    env = child_env(sweep_dir)
    status = read_status(path)
    if status.get("status") != "done":
        previous = status
        status = {
            "name": point["name"],
            "status": "running",
            "attempts": previous.get("attempts", 0) + 1,
            "host": os.uname().nodename,
            "pid": os.getpid(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        _write_status(path, status)
        command = [
            sys.executable,
            "-m",
            "ocformer.train",
            "--config",
            point["spec"],
            "--workdir",
            run_dir(sweep_dir, point["name"]),
        ]
        for s in point["sets"]:
            command += ["--set", s]

        # Times accumulate over attempts (an interrupted point resumes, and one whose
        # sweep was killed left the times of its last heartbeat); peak RSS is the
        # largest of them.
        def so_far(times: dict) -> dict:
            return {k: v + (previous.get(k) or 0) for k, v in times.items()}

        running = dict(status)  # the record while the process runs

        def started(proc: subprocess.Popen) -> None:
            running["process"] = proc.pid
            _write_status(path, running)

        def beat(times: dict) -> None:
            _write_status(path, {**running, **so_far(times)})

        result = _run_logged(command, os.path.join(path, "train.log"), env, started, beat)
        result.update(so_far({k: result[k] for k in _TIMES}))
        result["peak_rss_mb"] = max(result["peak_rss_mb"], previous.get("peak_rss_mb") or 0)
        status.update(result)
        code = result["exit_code"]
        stopped_by = _stopping["signal"]
        # 143: ocformer.train was preempted (SIGTERM) after writing a checkpoint.
        status["status"] = "done" if code == 0 else "interrupted" if code == 143 else "failed"
        if code != 0 and stopped_by is not None:
            # Whatever the process made of it (checkpointed and exited 143, was cut
            # short by the terminal's SIGINT, or was SIGKILLed after the grace period),
            # the sweep stopped it.
            status["status"] = "interrupted"
            step = checkpoint_step(sweep_dir, point["name"])
            status["error"] = f"the sweep was stopped by {signal.Signals(stopped_by).name}" + (
                " before the point's first checkpoint: rerun the sweep to train it from step 0"
                if step is None
                else f"; the point's last checkpoint is step {step}: rerun the sweep to resume "
                "from there"
            )
        status["command"] = command
        _write_status(path, status)
        if status["status"] != "done":
            return status
    evaluations = [{"name": TRAINED, "sets": []}, *point["evaluations"]]
    for e in evaluations:
        out = evaluation_file(path, e["name"])
        if _evaluated(out) or _stopping["signal"] is not None:
            continue
        command = [
            sys.executable,
            "-m",
            "ocformer.evaluate",
            run_dir(sweep_dir, point["name"]),
            "--json",
            out,
        ]
        for s in e["sets"]:
            command += ["--set", s]
        result = _run_logged(command, os.path.join(path, "evaluate.log"), env)
        if result["exit_code"] != 0 and _stopping["signal"] is not None:
            continue  # stopped, not failed: it runs again when the sweep is resumed
        failures = status.setdefault("evaluation_failures", {})
        failures.pop(e["name"], None)  # an earlier try's
        if result["exit_code"] != 0:
            failures[e["name"]] = {"exit_code": result["exit_code"], "error": result["error"]}
            # A failed evaluation is recorded as such, so that its row says why; a
            # rerun of the sweep tries it again, as it does a failed training.
            atomic_write_text(
                out,
                json.dumps(
                    {"status": "failed", "exit_code": result["exit_code"], "error": result["error"]}
                )
                + "\n",
            )
        _write_status(path, status)
    return status


def _fmt_time(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


def training_step(workdir: str) -> tuple[int, int] | None:
    """(last logged step, ``train.steps``) of the training run in ``workdir`` while it
    runs: the last whole line of its ``metrics.jsonl`` and its ``config.json``; None
    before it logged a step (or when either cannot be read)."""
    try:
        with open(os.path.join(workdir, "config.json")) as f:
            total = int(json.load(f)["train"]["steps"])
        with open(os.path.join(workdir, "metrics.jsonl"), "rb") as f:
            f.seek(max(f.seek(0, os.SEEK_END) - 4096, 0))
            lines = f.read().split(b"\n")[:-1]  # the last piece may be half-written
        return int(json.loads(lines[-1])["step"]), total
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return None


class Progress:
    """The progress line: points done / running (with each running point's training
    step, once it logged one) / failed (and interrupted, once a stopped sweep recorded
    some), and an ETA. A running point that logged a step needs its elapsed time times
    its steps left over the steps this attempt made (from its last checkpoint's); one
    that did not, the mean time of the points done so far (a failed or
    interrupted point's time is no point's), as do the points not started. ``?`` while
    neither is known, or while a point that logged no step has outlived that mean."""

    def __init__(self, total: int, parallel: int, skipped: int, stream):
        self.total, self.parallel, self.stream = total, parallel, stream
        self.done, self.failed, self.running, self.skipped = skipped, 0, 0, skipped
        self.interrupted = 0
        self.times: list[float] = []
        # Running points by thread: start time, and their training work directory with
        # the step it had logged when this attempt started (a resumed point's).
        self.starts: dict[int, float] = {}
        self.workdirs: dict[int, tuple[str, int]] = {}
        self.started = time.perf_counter()
        self.lock = threading.Lock()
        self.last = ""
        self.last_time = 0.0

    def _counts(self) -> str:
        return (
            f"sweep: {self.done}/{self.total} done, {self.running} running, "
            f"{self.failed} failed"
            + (f", {self.interrupted} interrupted" if self.interrupted else "")
        )

    def line(self) -> str:
        left = self.total - self.done - self.failed - self.interrupted
        now = time.perf_counter()
        per_point = sum(self.times) / len(self.times) if self.times else None
        steps, running_left, known = [], [], True
        for thread, start in self.starts.items():
            workdir, first = self.workdirs.get(thread, (None, 0))
            at = training_step(workdir) if workdir else None
            if at is not None:
                steps.append(f"{at[0]}/{at[1]}")
            if at is not None and at[0] > first:
                running_left.append((now - start) * (at[1] - at[0]) / (at[0] - first))
            elif per_point is not None and now - start < per_point:
                running_left.append(per_point - (now - start))
            else:
                known = False
        waiting = max(left - self.running, 0)
        eta = "?"
        if left == 0:
            eta = "0s"
        elif known and (per_point is not None or not waiting):
            # The work shared by the workers, but never less than the longest running
            # point still needs (one point's time is not shared).
            shared = (waiting * (per_point or 0.0) + sum(running_left)) / self.parallel
            eta = _fmt_time(max(shared, *running_left, 0.0))
        detail = f" (steps {', '.join(steps)})" if steps else ""
        elapsed = _fmt_time(now - self.started)
        return f"{self._counts()}{detail}, ETA {eta} (elapsed {elapsed})"

    def show(self, force: bool = False, every_s: float = 60.0) -> None:
        """Print the line when a count changed, and at least every ``every_s``."""
        with self.lock:
            counts = self._counts()
            if force or counts != self.last or time.monotonic() - self.last_time > every_s:
                print(self.line(), file=self.stream, flush=True)
                self.last, self.last_time = counts, time.monotonic()

    def start(self, workdir: str | None = None, resumes_at: int = 0) -> None:
        """A point is starting, to train in ``workdir`` (read for its step) from step
        ``resumes_at`` (its last checkpoint's)."""
        with self.lock:
            self.running += 1
            self.starts[threading.get_ident()] = time.perf_counter()
            if workdir is not None:
                self.workdirs[threading.get_ident()] = (workdir, resumes_at)
        self.show()

    def finish(self, status: str, seconds: float) -> None:
        """A point ended with ``status`` (``done``, ``interrupted`` or ``failed``)."""
        with self.lock:
            self.running -= 1
            self.starts.pop(threading.get_ident(), None)
            self.workdirs.pop(threading.get_ident(), None)
            if status == "done":
                self.done += 1
            elif status == "interrupted":
                self.interrupted += 1  # it runs again when the sweep is resumed
            else:
                self.failed += 1
            if status == "done":  # a stopped or failed point's time is no point's
                self.times.append(seconds)
        self.show()


def stop_children(grace_s: float | None = None) -> None:
    """SIGTERM every running point process (training checkpoints and exits), then
    SIGKILL whatever is left after ``grace_s``; processes that start meanwhile are
    stopped too once ``_stopping`` is set."""
    grace_s = STOP_GRACE_S if grace_s is None else grace_s
    stopped: set[subprocess.Popen] = set()
    while True:
        with _children_lock:
            procs = [p for p in _children if p not in stopped]
        if not procs:
            return
        stop_processes(procs, grace_s)
        stopped.update(procs)


@contextmanager
def _stop_on_signals() -> Iterator[None]:
    """While running points: SIGTERM and SIGINT set ``_stopping`` (the main loop then
    stops the points) instead of ending this process and orphaning them. Only the main
    thread can install handlers; elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handle(signum, frame):
        del frame
        if _stopping["signal"] is None:
            _stopping["signal"] = signum

    previous = {s: signal.signal(s, handle) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def run_local(
    sweep_dir: str,
    points: Sequence[dict],
    parallel: int = 1,
    stream=None,
) -> list[dict]:
    """Run the unfinished ``points`` with ``parallel`` local workers.

    A failing point is recorded (exit code, error line) and the others go on. On
    SIGTERM or SIGINT the running points' processes get SIGTERM (training checkpoints
    and exits), SIGKILL after ``STOP_GRACE_S``; the points are recorded as interrupted
    and no other point starts.

    Returns:
        The status of every point run now (finished points are skipped).

    Raises:
        SweepInterrupted: the sweep was stopped by a signal (its points are stopped).
    """
    if parallel < 1:
        raise SweepError("--parallel", f"must be >= 1, got {parallel}")
    stream = sys.stderr if stream is None else stream
    todo = [p for p in points if not is_finished(sweep_dir, p)]
    progress = Progress(len(points), parallel, len(points) - len(todo), stream)
    if not todo:
        print(f"sweep: all {len(points)} points finished; nothing to run", file=stream)
        return []
    progress.show(force=True)
    results: list[dict] = []

    def work(point: dict) -> dict:
        if _stopping["signal"] is not None:
            return {"name": point["name"], "status": "not started"}
        name = point["name"]
        progress.start(run_dir(sweep_dir, name), checkpoint_step(sweep_dir, name) or 0)
        t = time.perf_counter()
        status = run_point(sweep_dir, point)
        state = status.get("status", "failed")
        if state == "done" and status.get("evaluation_failures"):
            state = "failed"  # trained, and an evaluation failed
        progress.finish(state, time.perf_counter() - t)
        return status

    pool = ThreadPoolExecutor(max_workers=parallel)
    _stopping["signal"] = None
    with _stop_on_signals():
        futures = [pool.submit(work, p) for p in todo]
        try:
            while not all(f.done() for f in futures) and _stopping["signal"] is None:
                time.sleep(0.1)
                progress.show()
        except KeyboardInterrupt:  # handlers could not be installed (not the main thread)
            _stopping["signal"] = signal.SIGINT
        signum = _stopping["signal"]
        if signum is not None:
            for f in futures:
                f.cancel()
            print(
                f"sweep: {signal.Signals(signum).name} received; stopping the running points "
                f"(SIGTERM, SIGKILL after {STOP_GRACE_S:.0f}s)",
                file=stream,
                flush=True,
            )
            stop_children()
            pool.shutdown(wait=True)
            states = {p["name"]: read_status(point_dir(sweep_dir, p["name"])) for p in todo}
            raise SweepInterrupted(
                signum,
                interrupted={
                    n: checkpoint_step(sweep_dir, n)
                    for n, st in states.items()
                    if st.get("status") == "interrupted"
                },
                unevaluated=[
                    p["name"]
                    for p in todo
                    if states[p["name"]].get("status") == "done" and not is_finished(sweep_dir, p)
                ],
                not_started=sum(1 for st in states.values() if not st),
            )
        results = [f.result() for f in futures]
    pool.shutdown(wait=True)
    progress.show(force=True)
    return results
