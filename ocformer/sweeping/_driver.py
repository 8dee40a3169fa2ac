"""The sweep driver: a sweep from file to results. Resolve and validate every point,
check the work directory, run the unfinished points (locally or as a SLURM job array),
report."""

import json
import os
import shlex
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from ..checkpointing import atomic_write_text
from ..training import DirectoryLock, WorkdirError, git_revision, package_versions
from ._points import Point, check_buildable, resolve_points
from ._results import SWEEP_FILE, forget_submission, report, submitted_jobs
from ._run import is_finished, point_dir, read_status, run_local
from ._slurm import executor_for, job_script, queued, require_slurm, slurm_options, submit
from ._spec import SEED_FIELD, Sweep, SweepError, load_sweep

_SWEEP_FILE = SWEEP_FILE
_OWN = {_SWEEP_FILE, ".lock", "points", "cache", "slurm", "plots", "results.csv", "results.md"}


def sweep_id(sweep_path: str, arg: str | None) -> str:
    """A sweep's identity: its file's name and argument (its contents may change)."""
    name = os.path.splitext(os.path.basename(sweep_path))[0]
    return name if arg is None else f"{name}:{arg}"


def _recorded_id(file: str) -> str | None:
    """The sweep id a ``sweep.json`` names, None if it names none (or is unreadable)."""
    try:
        with open(file, encoding="utf-8") as f:
            info = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    held = info.get("id") if isinstance(info, dict) else None
    return held if isinstance(held, str) else None


def _refuse_empty(workdir: str) -> None:
    if not workdir.strip():  # os.path would read it as the current directory
        raise SweepError("--workdir", "is an empty path; give the sweep directory")


def check_workdir(workdir: str, ident: str) -> None:
    """Refuse a work directory that holds another sweep or something else.

    Raises:
        SweepError: naming the directory, what it holds and the fix.
    """
    _refuse_empty(workdir)
    if not os.path.exists(workdir):
        return
    if not os.path.isdir(workdir):
        raise SweepError(workdir, "is a file; give a directory for --workdir")
    file = os.path.join(workdir, _SWEEP_FILE)
    if os.path.isfile(file):
        held = _recorded_id(file)
        if held is not None and held != ident:
            raise SweepError(
                workdir,
                f"holds the results of sweep {held!r}, not {ident!r}; give another --workdir "
                "(a directory holds one sweep, so that no result is overwritten)",
            )
        return  # a record cut short is this sweep's to rewrite, under its lock
    foreign = sorted(set(os.listdir(workdir)) - _OWN)
    if foreign:
        raise SweepError(
            workdir,
            f"is not a sweep directory (it holds {', '.join(foreign[:5])}); give a new or "
            "empty --workdir",
        )


@contextmanager
def _locked(workdir: str) -> Iterator[None]:
    """Hold the sweep directory's write lock (see ``ocformer.training.DirectoryLock``):
    one sweep writes a directory at a time.

    Raises:
        SweepError: another process holds the lock (naming its pid and host).
    """
    lock = DirectoryLock(workdir, what="sweep directory")
    try:
        lock.acquire()
    except WorkdirError as e:
        raise SweepError("", str(e)) from None
    try:
        yield
    finally:
        lock.release()


def _point_record(spec: str, p: Point) -> dict:
    return {
        "name": p.name,
        "spec": spec,
        "sets": list(p.sets),
        "labels": p.labels,
        "settings": p.settings,
        "config": p.config,
        "evaluations": [
            {"name": e.name, "sets": list(e.sets), "labels": e.labels, "settings": e.settings}
            for e in p.evaluations
        ],
    }


def sweep_info(
    sweep: Sweep, sweep_path: str, arg: str | None, spec: str, points: Sequence[Point], argv
) -> dict:
    """What ``sweep.json`` records: command, revision, versions and resolved points."""
    train_fields = [f for a in sweep.axes for f in a.fields] + [SEED_FIELD]
    eval_fields = [f for a in sweep.evaluate for f in a.fields]
    return {
        "id": sweep_id(sweep_path, arg),
        "sweep_file": sweep_path,
        "arg": arg,
        "experiment": spec,
        "command": " ".join(shlex.quote(a) for a in argv),
        "cwd": os.getcwd(),
        "updated": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "git": git_revision(),
        "versions": package_versions(),
        "axes": {a.name: list(a.fields) for a in sweep.axes},
        "evaluation_axes": {a.name: list(a.fields) for a in sweep.evaluate},
        "train_fields": list(dict.fromkeys(train_fields)),
        "eval_fields": list(dict.fromkeys(eval_fields)),
        "seed_field": SEED_FIELD,
        "num_seeds": len({p.seed for p in points}),
        "points": [_point_record(spec, p) for p in points],
    }


def plan(
    spec: str,
    *,
    workdir: str,
    seeds: int | None = None,
    only: Sequence[str] = (),
    argv: Sequence[str] = (),
    build: bool = True,
) -> tuple[Sweep, dict, list[dict]]:
    """Load, resolve and validate a sweep, and check its work directory.

    Returns:
        The sweep, the ``sweep.json`` record (all points) and the points selected to
        run (``only``). Every point is resolved and validated; the unfinished selected
        ones are also built (``build=True``), as ``ocformer.train`` would build them.

    Raises:
        SweepError: before anything runs or is written.
    """
    sweep, path, arg = load_sweep(spec)
    experiment, points = resolve_points(sweep, path, seeds=seeds)
    selected = {p.name for p in resolve_points(sweep, path, seeds=seeds, only=only)[1]}
    check_workdir(workdir, sweep_id(path, arg))
    info = sweep_info(sweep, path, arg, experiment, points, argv)
    todo = [p for p in info["points"] if p["name"] in selected]
    if build:
        # Finished points were built when they ran.
        pending = {p["name"] for p in todo if not is_finished(workdir, p)}
        check_buildable(path, [p for p in points if p.name in pending])
    return sweep, info, todo


def _failures(workdir: str, info: dict) -> list[str]:
    out = []
    for p in info["points"]:
        status = read_status(point_dir(workdir, p["name"]))
        if status.get("status") in ("failed", "interrupted"):
            out.append(f"{p['name']}: exit code {status.get('exit_code')}: {status.get('error')}")
        for name, f in (status.get("evaluation_failures") or {}).items():
            out.append(f"{p['name']} (evaluation {name}): exit code {f['exit_code']}: {f['error']}")
    return out


def run_sweep(
    spec: str,
    workdir: str,
    *,
    launcher: str = "local",
    parallel: int = 1,
    seeds: int | None = None,
    only: Sequence[str] = (),
    dry_run: bool = False,
    slurm: Mapping[str, Any] | None = None,
    wait: bool = False,
    argv: Sequence[str] = (),
    runtime_checks: bool = False,
) -> int:
    """Run a sweep; returns the exit code (0 all done, 1 some failed).

    Args:
        spec: ``path/to/sweep.py[:arg]``.
        workdir: the sweep directory (created; reused to skip finished points).
        launcher: ``"local"`` (``parallel`` worker processes) or ``"slurm"``.
        seeds, only: see ``resolve_points``.
        dry_run: print what would run (and the SLURM job script) and write nothing.
        slurm: SLURM options given as flags (over the sweep file's).
        wait: with SLURM, wait for the array to finish and report (``--wait``; default:
            return once submitted; ``python -m ocformer.sweep report DIR`` reports
            later).
        argv: the command line, recorded in ``sweep.json``.
        runtime_checks: keep equinox's runtime error checks in the compiled steps.
            They are host callbacks, which JAX's persistent cache never stores, so by
            default the points run with ``EQX_ON_ERROR=nan``: every compiled step is
            cached and points that share shapes compile once, and a solver failure
            shows as a non-finite loss (exit code 4) instead of naming the step.

    Raises:
        SweepError: an invalid sweep, point, field or work directory (nothing ran).
    """
    if parallel < 1:
        raise SweepError("--parallel", f"must be >= 1 (local worker processes), got {parallel}")
    if launcher not in ("local", "slurm"):
        raise SweepError("--launcher", f"expected local or slurm, got {launcher!r}")
    if launcher == "slurm" and not dry_run:
        require_slurm()  # before the points are built
    _refuse_empty(workdir)  # before it is made absolute
    workdir = os.path.abspath(workdir)
    sweep, info, todo = plan(spec, workdir=workdir, seeds=seeds, only=only, argv=argv)
    # Checked whether or not a point is left to run (a bad option is bad either way).
    options = slurm_options(sweep.slurm, slurm or {}) if launcher == "slurm" else None
    info["runtime_checks"] = bool(runtime_checks)
    pending = [p for p in todo if not is_finished(workdir, p)]
    if dry_run:
        print(
            f"sweep {info['id']}: {len(info['points'])} points, {len(todo)} selected, "
            f"{len(pending)} to run (dry run: nothing runs or is written)",
        )
        for p in todo:
            state = "to run" if p in pending else "finished"
            extra = f" + {len(p['evaluations'])} evaluations" if p["evaluations"] else ""
            print(f"  {p['name']}{extra}: {state}")
        if options is not None:
            print("--- job script (one array task per point) ---")
            print(job_script(workdir, max(len(pending), 1), options))
        return 0
    executor = None
    if options is not None and pending:
        executor = executor_for(workdir, options)
    os.makedirs(workdir, exist_ok=True)
    with _locked(workdir):
        # Checked again under the lock: another sweep may have written it since plan().
        check_workdir(workdir, info["id"])
        atomic_write_text(os.path.join(workdir, _SWEEP_FILE), json.dumps(info, indent=2) + "\n")
        return _run_points(workdir, info, todo, pending, launcher, executor, wait, parallel)


def _check_not_queued(workdir: str, pending: Sequence[dict], launcher: str) -> None:
    """Refuse to run again points an earlier ``--launcher slurm`` submitted whose job
    ``squeue`` still lists (they would run twice); where squeue cannot tell, say so.

    Raises:
        SweepError: naming the points and the job.
    """
    submitted = submitted_jobs(workdir)
    jobs = {p["name"]: submitted[p["name"]] for p in pending if p["name"] in submitted}
    if not jobs:
        return
    still = queued(sorted(set(jobs.values())))

    def listed(names: list[str]) -> str:
        more = f" and {len(names) - 5} more" if len(names) > 5 else ""
        return ", ".join(names[:5]) + more

    if still:
        names = [n for n, job in jobs.items() if job in still]
        raise SweepError(
            f"--launcher {launcher}",
            f"{len(names)} of the points to run ({listed(names)}) were submitted as SLURM "
            f"job {', '.join(sorted(still))}, which squeue still lists (queued or running): "
            "running them again would run them twice. Rerun once the job has left the "
            "queue, or cancel it first (scancel)",
        )
    if still is None:
        print(
            f"sweep: warning: squeue could not tell whether SLURM job "
            f"{', '.join(sorted(set(jobs.values())))} still holds {listed(list(jobs))}; they "
            "are run again (if the job is still queued, they run twice: scancel it first)",
            file=sys.stderr,
        )


def _run_points(workdir, info, todo, pending, launcher, executor, wait, parallel) -> int:
    """Run (or submit) the points of a locked sweep directory and report."""
    if launcher == "slurm":
        if not pending:
            print(f"sweep: all {len(todo)} selected points finished; nothing to submit")
            report(workdir)
            return 0
        _check_not_queued(workdir, pending, launcher)
        jobs = submit(workdir, pending, executor)
        print(
            f"sweep: submitted {len(jobs)} array tasks (job {jobs[0].job_id.split('_')[0]}); "
            f"when they finish: python -m ocformer.sweep report {workdir}",
        )
        if not wait:
            return 0
        for job in jobs:
            job.result()
    else:
        _check_not_queued(workdir, pending, launcher)
        forget_submission(workdir, [p["name"] for p in pending])  # run here, not by SLURM
        run_local(workdir, todo, parallel=parallel)
    result = report(workdir)
    print(
        f"sweep: results in {os.path.join(workdir, 'results.csv')} ({len(result['rows'])} rows)",
    )
    failures = _failures(workdir, info)
    if failures:
        print(f"sweep: {len(failures)} failed:", file=sys.stderr)
        for line in failures:
            print(f"  {line}", file=sys.stderr)
        return 1
    return 0
