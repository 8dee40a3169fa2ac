"""E-MSA against AdamW on the digits ViT and a small character model.

Commands (one sweep directory per model; one seed at a time, so that the arms of a
seed run one after the other under the same machine load):

    for seed in 0 1 2; do for model in digits char; do
        python -m ocformer.sweep experiments/sweeps/msa_vs_adamw.py:$model \
            --workdir runs/sweeps/msa_vs_adamw_$model --only seed=$seed
    done; done
    python experiments/sweeps/msa_vs_adamw.py runs/sweeps/msa_vs_adamw_digits \
        runs/sweeps/msa_vs_adamw_char --figure experiments/figures/msa_vs_adamw.png

Three arms (the ``method`` axis), seeds 0, 1, 2: ``msa``, ``train.method=msa`` with its
documented defaults (10 inner Adam steps of 3e-3 per iteration, rho = 1, gamma = 2),
``MSA_ITERATIONS`` iterations; ``adamw``, ``train.method=gradient`` with the
experiment's AdamW for as many forward and backward passes (counted by
``passes_per_iteration``: 45 / 2 times as many steps); ``adamw-short``, the same AdamW
for as many iterations as MSA, its warmup a tenth of them. ``digits`` is
experiments/digits_vit.py as it is; ``char`` is experiments/shakespeare_char.py
narrowed to width 64 and feed-forward size 256 (4 layers, 4 heads, context 64, batch
12), without samples.

The second command (this file run as a script) reads every finished point's
``metrics.jsonl`` through ``ocformer.training.MetricsLog``, prints the tables of
experiments/README.md (mean +- std over seeds at the end of each run, and MSA against
``adamw`` at matched iterations, passes and seconds) and draws the figure: validation
loss against iterations, passes and training seconds, one row per model.

Counting passes. A pass is one forward or one backward evaluation of the layer stack.
A gradient step is 2 (the forward and the backward of the loss). An E-MSA iteration
(``ocformer.objective.msa_iteration``) is 5 + 4K for K inner steps: the sweep's
forward and backward (2); per inner step on every layer, the layer map (a forward),
the costate dH/du (a backward) and the gradient of the augmented Hamiltonian through
both (a backward of each: 2), so 4; after the inner steps, H at the new controls
(a forward and a costate: 2); and J after the update (a forward: 1). K = 10: 45.
Training seconds are the runs' own ``steps_per_s`` windows (training steps only,
evaluation and checkpoints excluded); the first window holds the compilation of the
training step, so it is counted at the rate of the second window, and its measured
length is reported apart.

Measured (commit 5d2f6f7, 2 CPU cores shared with other work at load average 7-10,
32 min for the 18 runs; mean +- std over the 3 seeds): digits, validation loss 0.311 +-
0.105 (accuracy 0.926) for msa after 50 iterations, 0.406 +- 0.067 for adamw-short
after 50 steps, 0.061 +- 0.033 for adamw after the same 2250 passes; character model,
3.267 +- 0.019 for msa after 30 iterations, 3.202 +- 0.027 for adamw-short, 2.384 +-
0.008 for adamw after the same 1350 passes. An MSA iteration took 25 (digits) and 45
(character model) times the training time of an AdamW step. The tables at matched
passes and seconds are in experiments/README.md (msa_vs_adamw).
"""

import argparse
import json
import math
import os
import sys
from collections.abc import Mapping, Sequence

import numpy as np

from ocformer.sweeping import Sweep, zipped
from ocformer.training import MetricsLog

# MSA iterations per run; AdamW takes the same number of passes.
MSA_ITERATIONS = {"digits": 50, "char": 30}
INNER_STEPS = 10  # train.msa_inner_steps' default
MSA_EVAL_EVERY, GRADIENT_EVAL_EVERY = 5, 25
EXPERIMENTS = {"digits": "../digits_vit.py", "char": "../shakespeare_char.py"}
MODEL_OVERRIDES = {
    "digits": {},
    "char": {"model.width": 64, "model.hidden": 256, "train.sample_tokens": 0},
}
SEEDS = (0, 1, 2)
# The arms of the sweep (its method axis): MSA; AdamW with MSA's passes; AdamW with
# MSA's iterations, its warmup scaled to a tenth of them (the experiments' 100 warmup
# steps would outlast the run).
ARMS = ("msa", "adamw", "adamw-short")
# A point's status file in its sweep directory (see ocformer.sweeping's layout).
STATUS_FILE = "sweep_point.json"


def passes_per_iteration(method: str, inner_steps: int) -> int:
    """Forward plus backward passes through the layer stack of one training iteration:
    2 for a gradient step, 5 + 4 K for an E-MSA iteration of K inner steps (see the
    module docstring)."""
    if method == "gradient":
        return 2
    if method == "msa":
        return 5 + 4 * inner_steps
    raise ValueError(f"unknown train.method {method!r}; expected gradient or msa")


def gradient_steps(model: str) -> int:
    """AdamW steps with the passes of ``MSA_ITERATIONS[model]`` MSA iterations."""
    passes = MSA_ITERATIONS[model] * passes_per_iteration("msa", INNER_STEPS)
    return passes // passes_per_iteration("gradient", INNER_STEPS)


def get_sweep(arg: str | None = None) -> Sweep:
    if arg not in EXPERIMENTS:
        raise ValueError(f"unknown argument {arg!r}; msa_vs_adamw.py takes digits or char")
    msa, gradient = MSA_ITERATIONS[arg], gradient_steps(arg)
    warmup = 100  # both experiments' optimiser.warmup_steps
    return Sweep(
        experiment=EXPERIMENTS[arg],
        overrides={"train.msa_inner_steps": INNER_STEPS, **MODEL_OVERRIDES[arg]},
        axes=[
            zipped(
                "method",
                {
                    "train.method": ["msa", "gradient", "gradient"],
                    "train.steps": [msa, gradient, msa],
                    "train.eval_every": [MSA_EVAL_EVERY, GRADIENT_EVAL_EVERY, MSA_EVAL_EVERY],
                    "train.log_every": [MSA_EVAL_EVERY, GRADIENT_EVAL_EVERY, MSA_EVAL_EVERY],
                    "train.checkpoint_every": [msa, gradient, msa],
                    "optimiser.warmup_steps": [warmup, warmup, msa // 10],
                },
                labels=list(ARMS),
            )
        ],
        seeds=SEEDS,
        slurm={"time_min": 30, "cpus": 2},
    )


# ---------------------------------------------------------------------------------------
# The report: curves, table and figure from the points' metrics files.


class Curve:
    """One run's validation curve: at each evaluated step, the iterations, passes and
    training seconds so far, and the validation loss and accuracy.

    ``first_window_s`` is the measured length of the first logged window (the
    compilation of the training step and its first steps), which ``seconds`` replaces
    by the rate of the second window.
    """

    def __init__(self, method: str, inner_steps: int, records: Sequence[Mapping]):
        timed = [r for r in records if _finite(r.get("steps_per_s"))]
        if len(timed) < 2:
            raise ValueError(
                f"a {method} run needs at least two logged windows of steps_per_s to "
                f"time its steps without compilation, got {len(timed)}"
            )
        seconds, previous = {}, 0
        total = 0.0
        for i, r in enumerate(timed):
            rate = float(timed[1 if i == 0 else i]["steps_per_s"])
            total += (r["step"] - previous) / rate
            seconds[r["step"]] = total
            previous = r["step"]
        self.first_window_s = timed[0]["step"] / float(timed[0]["steps_per_s"])
        evals = [r for r in records if _finite(r.get("val_loss"))]
        missing = [r["step"] for r in evals if r["step"] not in seconds]
        if missing:
            raise ValueError(
                f"evaluated steps {missing} have no steps_per_s window; log at every "
                "evaluation (train.log_every dividing train.eval_every)"
            )
        self.method = method
        self.steps = np.array([r["step"] for r in evals], dtype=float)
        self.passes = self.steps * passes_per_iteration(method, inner_steps)
        self.seconds = np.array([seconds[r["step"]] for r in evals])
        self.val_loss = np.array([float(r["val_loss"]) for r in evals])
        accurate = all(_finite(r.get("val_accuracy")) for r in evals)
        self.val_accuracy = (
            np.array([float(r["val_accuracy"]) for r in evals]) if accurate else None
        )

    def at(self, axis: str, x: float, metric: str = "val_loss") -> float:
        """``metric`` at ``x`` on ``axis`` (``steps``, ``passes`` or ``seconds``),
        linearly interpolated between evaluations; NaN outside the evaluated range."""
        xs, ys = getattr(self, axis), getattr(self, metric)
        if ys is None or not xs[0] <= x <= xs[-1]:
            return math.nan
        return float(np.interp(x, xs, ys))


def _read(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _finite(x) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


class NotThisSweep(ValueError):
    """A sweep directory of another sweep than msa_vs_adamw."""


def read_sweep(sweep_dir: str) -> tuple[str, dict[str, list[Curve]]]:
    """The model (the sweep's argument) and the curves of each arm (``ARMS``), by
    seed, of the points the sweep finished (the others are named on stderr and left
    out)."""
    with open(os.path.join(sweep_dir, "sweep.json"), encoding="utf-8") as f:
        info = json.load(f)
    points = info.get("points") if isinstance(info, dict) else None
    if (
        not isinstance(points, list)
        or not points
        or any(
            not (isinstance(p, dict) and isinstance(p.get("labels"), dict))
            or not {"method", "seed"} <= set(p["labels"])
            for p in points
        )
    ):
        raise NotThisSweep(
            f"{sweep_dir} is not an msa_vs_adamw sweep (its points are not labelled by "
            "method and seed); give the --workdir of one"
        )
    curves: dict[str, list[Curve]] = {}
    for p in sorted(info["points"], key=lambda p: int(p["labels"]["seed"])):
        train = p["config"]["train"]
        point = os.path.join(sweep_dir, "points", p["name"])
        status = os.path.join(point, STATUS_FILE)
        if not os.path.isfile(status) or _read(status).get("status") != "done":
            print(f"{point}: not finished, left out", file=sys.stderr)
            continue
        records = MetricsLog(os.path.join(point, "run", "metrics.jsonl")).read()
        curve = Curve(train["method"], train["msa_inner_steps"], records)
        curves.setdefault(p["labels"]["method"], []).append(curve)
    return info["arg"], curves


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and population standard deviation (as the sweep tables give them)."""
    a = np.asarray(values, dtype=float)
    return float(np.mean(a)), float(np.std(a))


def _cell(values: Sequence[float], digits: int = 3) -> str:
    if any(math.isnan(v) for v in values):
        return "n/a"
    m, s = mean_std(values)
    return f"{m:.{digits}f} ± {s:.{digits}f}"


def comparisons(curves: Mapping[str, Sequence[Curve]]) -> list[tuple[str, str, float]]:
    """The matched points of the table: ``(what, axis, x)``. The final step of each
    method; matched iterations at the last step both evaluated; matched passes at
    the passes of MSA iterations 10, 30 and its last; matched seconds when every run
    has been evaluated once, and at the end of the shortest run. The seeds of a method share their
    evaluated steps."""
    msa, gradient = curves["msa"], curves["adamw"]
    common = set(msa[0].steps) & set(gradient[0].steps)
    out = [("iterations", "steps", float(max(common)))] if common else []
    last = float(msa[0].steps[-1])
    per_iteration = msa[0].passes[0] / msa[0].steps[0]
    for n in sorted({n for n in (10.0, 30.0) if n < last} | {last}):
        out.append(("passes", "passes", n * per_iteration))
    runs = [*msa, *gradient]
    first, shortest = max(c.seconds[0] for c in runs), min(c.seconds[-1] for c in runs)
    out += [("seconds", "seconds", x) for x in (first, shortest) if x <= shortest]
    return out


def tables(models: Sequence[tuple[str, Mapping[str, Sequence[Curve]]]]) -> str:
    """The two markdown tables of experiments/README.md: each run at its end, and the
    two methods at matched iterations, passes and seconds (mean ± std over seeds)."""
    final = [
        "| model | method | n | iterations | passes | training s | ms / iteration "
        "| first window s | val loss | val accuracy |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for model, curves in models:
        for arm, runs in curves.items():
            acc = [c.val_accuracy[-1] for c in runs if c.val_accuracy is not None]
            final.append(
                f"| {model} | {arm} | {len(runs)} | {int(runs[0].steps[-1])} "
                f"| {int(runs[0].passes[-1])} | {_cell([c.seconds[-1] for c in runs], 1)} "
                f"| {_cell([1e3 * c.seconds[-1] / c.steps[-1] for c in runs], 1)} "
                f"| {_cell([c.first_window_s for c in runs], 1)} "
                f"| {_cell([c.val_loss[-1] for c in runs])} "
                f"| {_cell(acc) if len(acc) == len(runs) else ''} |"
            )
    matched = [
        "| model | matched | at | msa val loss | adamw val loss | msa val accuracy "
        "| adamw val accuracy |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for model, curves in models:
        for what, axis, x in comparisons(curves):
            cells = []
            for metric in ("val_loss", "val_accuracy"):
                for arm in ("msa", "adamw"):
                    runs = curves[arm]
                    if getattr(runs[0], metric) is None:
                        cells.append("")
                    else:
                        cells.append(_cell([c.at(axis, x, metric) for c in runs]))
            at = f"{x:.1f} s" if axis == "seconds" else f"{x:g}"
            matched.append(f"| {model} | {what} | {at} | " + " | ".join(cells) + " |")
    return "\n".join(final) + "\n\n" + "\n".join(matched) + "\n"


AXES = (("steps", "iterations"), ("passes", "forward + backward passes"),
        ("seconds", "training seconds"))  # fmt: skip
STYLES = {
    "msa": {"color": "tab:red"},
    "adamw": {"color": "tab:blue"},
    "adamw-short": {"color": "tab:green", "linestyle": "--"},
}


def figure(models: Sequence[tuple[str, Mapping[str, Sequence[Curve]]]], path: str):
    """Validation loss against iterations, passes and training seconds (columns), one
    row per model: the mean over seeds with a band of one standard deviation. On the
    seconds axis a point is at the seeds' mean training seconds of its step. Returns
    the figure, written to ``path``."""
    # Imported here, as the sweep reports do: the sweep itself never draws.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(models), len(AXES), figsize=(12, 3.6 * len(models)),
                             squeeze=False)  # fmt: skip
    for row, (model, curves) in zip(axes, models):
        for ax, (axis, label) in zip(row, AXES):
            for arm, runs in curves.items():
                x = np.mean([getattr(c, axis) for c in runs], axis=0)
                losses = np.array([c.val_loss for c in runs])
                mean, std = losses.mean(axis=0), losses.std(axis=0)
                ax.plot(x, mean, marker=".", label=f"{arm} (n = {len(runs)})", **STYLES[arm])
                colour = STYLES[arm]["color"]
                ax.fill_between(x, mean - std, mean + std, color=colour, alpha=0.2)
            ax.set_xscale("log")
            losses = [c.val_loss for runs in curves.values() for c in runs]
            if max(map(max, losses)) > 10 * min(map(min, losses)):
                ax.set_yscale("log")
            ax.set_xlabel(label)
            ax.set_ylabel(f"{model}: validation loss")
            ax.grid(True, which="both", alpha=0.3)
        row[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return fig


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python experiments/sweeps/msa_vs_adamw.py",
        description="Tables and figure of the msa_vs_adamw sweeps (one directory per model).",
    )
    parser.add_argument("sweep_dirs", nargs="+", metavar="DIR")
    parser.add_argument("--figure", default=None, metavar="PNG")
    args = parser.parse_args(argv)
    models = []
    for d in args.sweep_dirs:
        if not os.path.isfile(os.path.join(d, "sweep.json")):
            parser.error(f"{d} is not a sweep directory (no sweep.json); give the --workdir "
                         "of an msa_vs_adamw sweep")  # fmt: skip
        try:
            arg, curves = read_sweep(d)
        except NotThisSweep as e:
            parser.error(str(e))
        except (ValueError, KeyError, TypeError) as e:  # json.JSONDecodeError too
            parser.error(f"{d}/sweep.json cannot be read ({type(e).__name__}: {e}); run the "
                         "sweep again")  # fmt: skip
        missing = [arm for arm in ("msa", "adamw") if not curves.get(arm)]
        if missing:
            parser.error(f"{d} has no finished {' or '.join(missing)} point yet; run the "
                         "sweep's points (the commands above) before the report")  # fmt: skip
        models.append((arg, curves))
    print(tables(models), end="")
    if args.figure:
        figure(models, args.figure)
        print(f"figure: {args.figure}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
