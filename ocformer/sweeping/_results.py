"""A sweep's results: ``results.csv`` (one row per point, seed and evaluation),
``results.md`` (mean +- std over seeds) and ``plots/*.png``, rebuilt from the point
directories at any time (``python -m ocformer.sweep report DIR``)."""

import csv
import io
import json
import math
import os
import sys
from collections.abc import Sequence

import numpy as np

from .._cli import process_exists
from ..checkpointing import atomic_write_text
from ..training import MetricsLog
from ._run import TRAINED, evaluation_file, point_dir, read_status, run_dir
from ._spec import SweepError

METRICS: tuple[str, ...] = (
    "final_val_loss",
    "best_val_loss",
    "final_val_accuracy",
    "best_val_accuracy",
    "train_steps_per_s",
    "wall_time_s",
    "compile_time_s",
    "cache_hits",
    "peak_rss_mb",
    "solver_steps",
    "accepted_steps",
    "rejected_steps",
    "nfe",
)
"""The measured columns of ``results.csv``, in order."""

_PLOTS = (
    "final_val_loss",
    "best_val_loss",
    "final_val_accuracy",
    "train_steps_per_s",
    "wall_time_s",
    "compile_time_s",
    "peak_rss_mb",
    "solver_steps",
    "rejected_steps",
    "nfe",
)
_EVAL_PLOTS = ("final_val_loss", "final_val_accuracy", "solver_steps", "rejected_steps", "nfe")
_LOWER_IS_BETTER_LOG = ("final_val_loss", "best_val_loss", "nfe", "solver_steps")


def _number(x) -> float | None:
    if x is None:
        return None
    try:
        x = float(x)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def _training_metrics(path: str) -> dict:
    # The run directory's own reader: a point killed mid-write leaves a partial last
    # line, which it skips.
    records = MetricsLog(os.path.join(path, "metrics.jsonl")).read()
    out: dict = {}
    evals = [r for r in records if "val_loss" in r]
    losses = [v for v in (_number(r["val_loss"]) for r in evals) if v is not None]
    if losses:
        out["final_val_loss"] = _number(evals[-1]["val_loss"])
        out["best_val_loss"] = min(losses)
    accs = [v for v in (_number(r.get("val_accuracy")) for r in evals) if v is not None]
    if accs:
        out["final_val_accuracy"] = _number(evals[-1].get("val_accuracy"))
        out["best_val_accuracy"] = max(accs)
    # The first logged window holds the compilation of the training step.
    rates = [v for v in (_number(r.get("steps_per_s")) for r in records) if v is not None]
    if rates:
        out["train_steps_per_s"] = float(np.median(rates[1:] if len(rates) > 1 else rates))
    if records:
        out["step"] = records[-1].get("step")
    return out


SWEEP_FILE = "sweep.json"
# What ``report`` reads of a sweep record (written by the sweep driver).
_RECORD_KEYS = ("id", "command", "train_fields", "eval_fields", "seed_field", "num_seeds", "points")


def read_sweep_info(sweep_dir: str) -> dict:
    """The record ``sweep.json`` of a sweep directory.

    Raises:
        SweepError: the file is missing, is not JSON (a write cut short) or lacks what
            a sweep writes; the message names the file and the fix.
    """
    if not sweep_dir.strip():  # os.path would read it as the current directory
        raise SweepError("the sweep directory", "is an empty path; give the sweep directory")
    file = os.path.join(sweep_dir, SWEEP_FILE)
    if not os.path.isfile(file):
        raise SweepError(sweep_dir, f"is not a sweep directory (no {SWEEP_FILE})")
    redo = (
        f"rerun the sweep command that made {sweep_dir} (it rewrites "
        f"{SWEEP_FILE}, and skips the points already finished in {sweep_dir}/points)"
    )
    try:
        with open(file, encoding="utf-8") as f:
            info = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SweepError(file, f"is not a readable sweep record ({e}); {redo}") from None
    if not isinstance(info, dict):
        raise SweepError(file, f"holds a {type(info).__name__}, not a sweep record; {redo}")
    missing = [k for k in _RECORD_KEYS if k not in info]
    if missing:
        raise SweepError(file, f"is not a sweep record (no {', '.join(missing)}); {redo}")
    return info


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


# The points submitted to SLURM and their array job: DIR/slurm/submitted.json, a map from
# a point's name to the job id of its newest submission.
SUBMITTED_FILE = os.path.join("slurm", "submitted.json")


def submitted_jobs(sweep_dir: str) -> dict[str, str]:
    """The SLURM array job each submitted point was last submitted in (by name)."""
    return _read_json(os.path.join(sweep_dir, SUBMITTED_FILE))


def _write_submissions(sweep_dir: str, jobs: dict[str, str]) -> None:
    path = os.path.join(sweep_dir, SUBMITTED_FILE)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    atomic_write_text(path, json.dumps(jobs, indent=2) + "\n")


def record_submission(sweep_dir: str, job_id: str, names: Sequence[str]) -> None:
    """Note that ``names`` were submitted as the array job ``job_id``."""
    _write_submissions(sweep_dir, {**submitted_jobs(sweep_dir), **dict.fromkeys(names, job_id)})


def forget_submission(sweep_dir: str, names: Sequence[str]) -> None:
    """Drop ``names`` from the submissions (they are run by the local launcher)."""
    jobs = submitted_jobs(sweep_dir)
    if any(n in jobs for n in names):
        _write_submissions(sweep_dir, {n: job for n, job in jobs.items() if n not in names})


def point_state(sweep_dir: str, point: dict) -> tuple[str, str | None]:
    """Where a point of ``sweep.json`` stands, read from its directory: ``finished``,
    ``failed``, ``interrupted``, ``running``, ``evaluations pending``, ``submitted`` (to
    SLURM, its task not started yet) or ``not started``; for a point whose record says
    ``running`` but whose processes are gone, why it counts as interrupted, and for a
    submitted one, its job.

    A ``running`` record names the host and the pids of the process running the point
    and of its training process; they are looked up only on that host (a record from
    another host, as from a SLURM array task, is taken at its word).
    """
    path = point_dir(sweep_dir, point["name"])
    status = read_status(path)
    state = status.get("status")
    if not status:
        job = submitted_jobs(sweep_dir).get(point["name"])
        if job is not None:  # its array task has not started (queued), or was lost
            return "submitted", f"SLURM job {job}"
        return "not started", None
    if state == "running":
        host = status.get("host")
        pids = [status.get("pid"), status.get("process")]
        if host == os.uname().nodename and not any(
            isinstance(p, int) and process_exists(p) for p in pids
        ):
            gone = " and ".join(dict.fromkeys(str(p) for p in pids if p is not None))
            return "interrupted", (
                f"no process: the record says running, but pid {gone} on {host} is gone "
                "(the sweep was killed); rerun the sweep to resume this point"
            )
        return "running", None
    if state == "done":
        names = [TRAINED, *(e["name"] for e in point["evaluations"])]
        if all(os.path.isfile(evaluation_file(path, n)) for n in names):
            return "finished", None
        return "evaluations pending", None
    return ("failed" if state == "failed" else "interrupted"), None


_HOW = {
    "interrupted": "rerun the sweep to resume",
    "running": "running, or killed on another host",
    "failed": "rerun the sweep to retry",
    "evaluations pending": "rerun the sweep to evaluate",
    "submitted": "queued in SLURM, or lost: see squeue; rerun once its job has left the queue",
    "not started": "rerun the sweep to run",
}


def unfinished_summary(sweep_dir: str, info: dict) -> str | None:
    """``"2 of 4 points unfinished: 1 interrupted (...): a; 1 ..."``, or None when
    every point of ``sweep.json`` is finished."""
    by_state: dict[str, list[str]] = {}
    for p in info["points"]:
        state, _ = point_state(sweep_dir, p)
        if state != "finished":
            by_state.setdefault(state, []).append(p["name"])
    if not by_state:
        return None
    count = sum(len(v) for v in by_state.values())
    parts = []
    for state, how in _HOW.items():
        names = by_state.get(state, [])
        if names:
            shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
            parts.append(f"{len(names)} {state} ({how}): {shown}")
    return f"{count} of {len(info['points'])} points unfinished: " + "; ".join(parts)


def left_out_summary(sweep_dir: str, info: dict) -> str | None:
    """The finished points in ``DIR/points`` that ``sweep.json`` no longer holds (a
    rerun with fewer seeds or values, or an edited sweep file, rewrote it), which the
    report leaves out; None when there are none."""
    folder = os.path.join(sweep_dir, "points")
    names = set(os.listdir(folder)) if os.path.isdir(folder) else set()
    names -= {p["name"] for p in info["points"]}
    done = sorted(n for n in names if read_status(point_dir(sweep_dir, n)).get("status") == "done")
    if not done:
        return None
    shown = ", ".join(done[:5]) + (f" and {len(done) - 5} more" if len(done) > 5 else "")
    are = "are" if len(done) > 1 else "is"
    return (
        f"{len(done)} finished point{'s' if len(done) > 1 else ''} in {folder} {are} no "
        f"longer part of this sweep and {are} left out of the report: {shown} (rerun the "
        "sweep with the seeds and values that made them to report them again; nothing "
        "reruns)"
    )


def rows(sweep_dir: str, info: dict) -> list[dict]:
    """One row per point and seed (the trained discretisation) plus one per
    evaluation-time discretisation, for every point of ``sweep.json``."""
    train_fields = info["train_fields"]
    eval_fields = info["eval_fields"]
    out = []
    for p in info["points"]:
        path = point_dir(sweep_dir, p["name"])
        status = read_status(path)
        base = {"point": p["name"], **{f: p["settings"].get(f) for f in train_fields}}
        config = p["config"]
        trained_values = {f: config[f.split(".")[0]][f.split(".")[1]] for f in eval_fields}
        row = {
            **base,
            "evaluation": TRAINED,
            **{f"eval.{f}": v for f, v in trained_values.items()},
            "status": status.get("status", "pending"),
            "exit_code": status.get("exit_code"),
            "error": status.get("error"),
        }
        state, why = point_state(sweep_dir, p)
        if state == "submitted":  # its SLURM array task has not started
            row.update(status=state)
        elif why is not None:  # recorded as running by a process that is gone
            row.update(status=state, error=why)
        for key in ("wall_time_s", "compile_time_s", "cache_hits", "peak_rss_mb"):
            row[key] = status.get(key)
        row.update(_training_metrics(run_dir(sweep_dir, p["name"])))
        trained = _read_json(evaluation_file(path, TRAINED))
        for key in ("solver_steps", "accepted_steps", "rejected_steps", "nfe"):
            row[key] = trained.get(key)
        out.append(row)
        for e in p["evaluations"]:
            result = _read_json(evaluation_file(path, e["name"]))
            values = {**trained_values, **e["settings"]}
            erow = {
                **base,
                "evaluation": " ".join(f"{k}={v}" for k, v in e["labels"].items()),
                **{f"eval.{f}": values[f] for f in eval_fields},
                "status": result.get("status", "done" if result else "pending"),
                "exit_code": result.get("exit_code", 0 if result else None),
                "error": result.get("error"),
            }
            erow["final_val_loss"] = result.get("val_loss")
            erow["final_val_accuracy"] = result.get("val_accuracy")
            for key in ("solver_steps", "accepted_steps", "rejected_steps", "nfe"):
                erow[key] = result.get(key)
            out.append(erow)
    return out


def columns(info: dict) -> list[str]:
    return [
        "point",
        *info["train_fields"],
        "evaluation",
        *(f"eval.{f}" for f in info["eval_fields"]),
        "status",
        "exit_code",
        "error",
        "step",
        *METRICS,
    ]


def write_csv(path: str, table: list[dict], cols: Sequence[str]) -> None:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(cols), extrasaction="ignore")
    writer.writeheader()
    for r in table:
        writer.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in cols})
    atomic_write_text(path, buf.getvalue())


def _group_keys(info: dict) -> list[str]:
    seed = info["seed_field"]
    return [f for f in info["train_fields"] if f != seed] + [
        f"eval.{f}" for f in info["eval_fields"]
    ]


def aggregate(table: list[dict], info: dict) -> list[dict]:
    """Rows grouped over seeds: for each metric its mean, std (the population std,
    numpy's default ``ddof=0``) and count of the finished rows."""
    keys = _group_keys(info)
    groups: dict[tuple, list[dict]] = {}
    for r in table:
        groups.setdefault(tuple(json.dumps(r.get(k)) for k in keys), []).append(r)
    out = []
    for _, members in groups.items():
        g = {k: members[0].get(k) for k in keys}
        ok = [r for r in members if r.get("status") == "done"]
        g["n"] = len(ok)
        g["failed"] = sum(r.get("status") == "failed" for r in members)
        for m in METRICS:
            vals = [v for v in (_number(r.get(m)) for r in ok) if v is not None]
            g[m] = (float(np.mean(vals)), float(np.std(vals)), len(vals)) if vals else None
        out.append(g)
    return out


def _fmt(x: float) -> str:
    if x == 0 or 1e-3 <= abs(x) < 1e5:
        return f"{x:.4g}"
    return f"{x:.3e}"


_MD_METRICS = (
    "final_val_loss",
    "best_val_loss",
    "final_val_accuracy",
    "solver_steps",
    "nfe",
    "train_steps_per_s",
    "wall_time_s",
    "compile_time_s",
    "peak_rss_mb",
)


def markdown(groups: list[dict], info: dict) -> str:
    keys = _group_keys(info)
    metrics = [m for m in _MD_METRICS if any(g[m] is not None for g in groups)]
    head = [*keys, "n", *metrics]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for g in groups:
        cells = [str(g[k]) for k in keys] + [
            str(g["n"]) + (f" ({g['failed']} failed)" if g["failed"] else "")
        ]
        for m in metrics:
            v = g[m]
            if v is None:
                cells.append("")
            elif v[2] > 1:
                cells.append(f"{_fmt(v[0])} +- {_fmt(v[1])}")
            else:
                cells.append(_fmt(v[0]))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _is_number(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _numeric(groups: list[dict], key: str) -> bool:
    return all(_is_number(g[key]) for g in groups)


def plain_log_xaxis(ax, ticks: Sequence[float] | None = None) -> None:
    """A logarithmic x axis labelled with plain numbers (1, 2, 5, 10, 20, ...), with no
    labelled minor ticks: step counts read as step counts, not as powers of ten.

    Args:
        ax: matplotlib axes.
        ticks: the major ticks (for example the step counts plotted); default: 1, 2
            and 5 times each power of ten.
    """
    # Imported here, as in plot(): a sweep reported without plots does not load matplotlib.
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    ax.set_xscale("log")
    ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.xaxis.set_minor_formatter(NullFormatter())
    if ticks is not None:
        ax.set_xticks(list(ticks))


def plot(groups: list[dict], info: dict, folder: str) -> list[str]:
    """Each metric against each numeric axis (logarithmic where the values span a
    decade or more), one line per value of the other axes; a sweep without numeric
    axes puts each categorical axis on x instead. Where the vector-field evaluations
    (or solver steps) vary, the validation loss is also drawn against them:
    ``final_val_loss_vs_cost_nfe.png``, the accuracy-cost picture, one line per
    trained model through its evaluations where the sweep has evaluation axes. The
    plots of an earlier report are removed first."""
    # Figures of their own, not pyplot's: drawing a sweep's plots leaves the caller's
    # backend (a notebook's) and its open figures as they were.
    from matplotlib.figure import Figure

    keys = _group_keys(info)
    varying = [k for k in keys if len({json.dumps(g[k]) for g in groups}) > 1]
    numeric_axes = [k for k in varying if _numeric(groups, k)]
    os.makedirs(folder, exist_ok=True)
    # The plots of an earlier report go first: one drawn then but not now (a metric
    # that no longer varies, an axis renamed) would read as a result of this sweep.
    for name in os.listdir(folder):
        if name.endswith(".png") and name.startswith(tuple(f"{m}_vs_" for m in _PLOTS)):
            os.remove(os.path.join(folder, name))
    written = []

    def save(fig, ax, title: str, file: str) -> None:
        ax.set_title(f"{info['id']}: {title}", fontsize=10)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
        ax.grid(True, alpha=0.3)
        fig.tight_layout()
        path = os.path.join(folder, file)
        fig.savefig(path, dpi=100)
        written.append(path)

    def ylabel(m: str) -> str:
        return m + (f" (mean ± std, {info['num_seeds']} seeds)" if info["num_seeds"] > 1 else "")

    for x in numeric_axes or varying:
        xs_all = [g[x] for g in groups]
        numeric = x in numeric_axes
        categories = sorted({json.dumps(v) for v in xs_all})
        others = [k for k in varying if k != x]
        # Along an evaluation axis only what the evaluation measures changes.
        candidates = _EVAL_PLOTS if x.startswith("eval.") else _PLOTS
        metrics = [
            m
            for m in candidates
            if len({json.dumps(g[x]) for g in groups if g[m] is not None}) > 1
            and len({g[m][0] for g in groups if g[m] is not None}) > 1
        ]
        for m in metrics:
            fig = Figure(figsize=(5.5, 3.8))
            ax = fig.subplots()
            lines: dict[tuple, list] = {}
            for g in groups:
                if g[m] is not None:
                    lines.setdefault(tuple(str(g[k]) for k in others), []).append(g)
            for label, members in sorted(lines.items()):
                if numeric:
                    members = sorted(members, key=lambda g: g[x])
                    xs = [g[x] for g in members]
                else:
                    members = sorted(members, key=lambda g: categories.index(json.dumps(g[x])))
                    xs = [categories.index(json.dumps(g[x])) for g in members]
                name = ", ".join(f"{k.split('.')[-1]}={v}" for k, v in zip(others, label))
                ax.errorbar(
                    xs,
                    [g[m][0] for g in members],
                    yerr=[g[m][1] for g in members],
                    marker="o",
                    capsize=3,
                    linestyle="-" if numeric else "none",  # no line between categories
                    label=name or None,
                )
            if numeric:
                pos = [v for v in xs_all if v > 0]
                if len(pos) == len(xs_all) and max(pos) / min(pos) >= 10:
                    plain_log_xaxis(ax, ticks=sorted(set(xs_all)))
            else:
                ax.set_xticks(range(len(categories)))
                ax.set_xticklabels([json.loads(c) for c in categories], rotation=15, fontsize=8)
                ax.set_xlim(-0.5, len(categories) - 0.5)
            ys_all = [g[m][0] for g in groups if g[m] is not None]
            if m in _LOWER_IS_BETTER_LOG and min(ys_all) > 0 and max(ys_all) / min(ys_all) >= 10:
                ax.set_yscale("log")
            ax.set_xlabel(x)
            ax.set_ylabel(ylabel(m))
            save(fig, ax, f"{m} vs {x.split('.')[-1]}", f"{m}_vs_{x.replace('.', '_')}.png")

    # Accuracy against cost. With evaluation axes, one line per trained model (and
    # value of the categorical evaluation axes) through its numeric evaluation axes:
    # a line joining different models' evaluations would zig-zag between them.
    # Without, one line per value of the categorical axes through the numeric
    # training axes, in the order of their cost.
    along = [k for k in numeric_axes if k.startswith("eval.")] or numeric_axes
    categorical = [k for k in varying if k not in along]
    for cost in ("nfe", "solver_steps"):
        costed = [g for g in groups if g[cost] is not None and g["final_val_loss"] is not None]
        if len({g[cost][0] for g in costed}) < 2:
            continue
        fig = Figure(figsize=(5.5, 3.8))
        ax = fig.subplots()
        lines = {}
        for g in costed:
            lines.setdefault(tuple(str(g[k]) for k in categorical), []).append(g)
        for label, members in sorted(lines.items()):
            members = sorted(members, key=lambda g: g[cost][0])
            name = ", ".join(f"{k.split('.')[-1]}={v}" for k, v in zip(categorical, label))
            ax.errorbar(
                [g[cost][0] for g in members],
                [g["final_val_loss"][0] for g in members],
                yerr=[g["final_val_loss"][1] for g in members],
                marker="o",
                capsize=3,
                label=name or None,
            )
        costs = [g[cost][0] for g in costed]
        if min(costs) > 0 and max(costs) / min(costs) >= 10:
            plain_log_xaxis(ax)
        ax.set_xlabel(f"{cost} (one forward solve)")
        ax.set_ylabel(ylabel("final_val_loss"))
        save(fig, ax, f"final_val_loss vs {cost}", f"final_val_loss_vs_cost_{cost}.png")
        break
    return written


def report(sweep_dir: str, make_plots: bool = True) -> dict:
    """Re-aggregate a sweep directory from its point directories (runs nothing).

    Returns:
        ``rows`` (results.csv), ``groups`` (results.md), the written ``plots`` and
        ``unfinished``: what is missing (``unfinished_summary``), None if nothing;
        ``left_out``: finished points no longer in ``sweep.json``
        (``left_out_summary``, also printed on stderr), None if none.

    Raises:
        SweepError: ``sweep.json`` is missing or unreadable (see ``read_sweep_info``).
    """
    info = read_sweep_info(sweep_dir)
    table = rows(sweep_dir, info)
    write_csv(os.path.join(sweep_dir, "results.csv"), table, columns(info))
    groups = aggregate(table, info)
    missing = unfinished_summary(sweep_dir, info)
    left_out = left_out_summary(sweep_dir, info)
    text = (
        f"# {info['id']}\n\n`{info['command']}`\n\n"
        + (f"**{missing}.**\n\n" if missing else "")
        + (f"**{left_out}.**\n\n" if left_out else "")
        + "Mean +- std over seeds (the population std, ddof=0; n: finished runs).\n\n"
        + markdown(groups, info)
    )
    atomic_write_text(os.path.join(sweep_dir, "results.md"), text)
    plots = plot(groups, info, os.path.join(sweep_dir, "plots")) if make_plots else []
    if left_out:
        print(f"sweep: warning: {left_out}", file=sys.stderr)
    return {
        "rows": table,
        "groups": groups,
        "plots": plots,
        "unfinished": missing,
        "left_out": left_out,
    }
