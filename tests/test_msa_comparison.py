"""The report of experiments/sweeps/msa_vs_adamw.py on synthetic sweep directories:
the passes it counts, the training seconds it reads from the steps_per_s windows, the
mean and std over seeds and the matched comparisons, against numbers worked by hand."""

import importlib.util
import json
import math
import os

import numpy as np
import pytest

from ocformer.training import MetricsLog

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location(
    "msa_vs_adamw", os.path.join(ROOT, "experiments", "sweeps", "msa_vs_adamw.py")
)
assert _spec is not None and _spec.loader is not None
report = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(report)


def test_passes_per_iteration_count_the_sweep_inner_steps_and_the_extra_solves():
    assert report.passes_per_iteration("gradient", 10) == 2
    # 2 (sweep) + 4 per inner step + 2 (H at the new controls) + 1 (J after).
    assert report.passes_per_iteration("msa", 10) == 45
    assert report.passes_per_iteration("msa", 1) == 9
    # AdamW gets the passes of the MSA runs: 50 iterations x 45 / 2.
    assert report.gradient_steps("digits") == 1125
    with pytest.raises(ValueError, match="unknown train.method"):
        report.passes_per_iteration("newton", 1)


def _point(arm, seed):
    method = "msa" if arm == "msa" else "gradient"
    return {
        "name": f"method={arm}_seed={seed}-0",
        "labels": {"method": arm, "seed": str(seed)},
        "config": {"train": {"method": method, "msa_inner_steps": 10}},
    }


def _write_sweep(path, model, runs, pending=()):
    """A sweep directory holding the finished ``runs``, (arm, seed, records) each,
    and the ``pending`` ones, (arm, seed) each, which have not started."""
    points = []
    for arm, seed in pending:
        points.append(_point(arm, seed))
        (path / "points" / points[-1]["name"] / "run").mkdir(parents=True)
    for arm, seed, records in runs:
        points.append(_point(arm, seed))
        run = path / "points" / points[-1]["name"] / "run"
        run.mkdir(parents=True)
        (run.parent / report.STATUS_FILE).write_text(json.dumps({"status": "done"}))
        log = MetricsLog(str(run / "metrics.jsonl"))
        for r in records:
            log.append(r)
    (path / "sweep.json").write_text(json.dumps({"arg": model, "points": points}))


def _records(every, rates, losses, accuracies=None):
    """Logged windows of ``every`` steps at ``rates`` steps/s, each evaluated."""
    out = []
    for i, (rate, loss) in enumerate(zip(rates, losses)):
        r = {"step": every * (i + 1), "loss": loss, "steps_per_s": rate, "val_loss": loss}
        if accuracies is not None:
            r["val_accuracy"] = accuracies[i]
        out.append(r)
    return out


def test_training_seconds_replace_the_compilation_window_by_the_second_rate():
    # Windows of 5 steps at 0.5 (compilation), 2 and 4 steps/s, and a log line
    # between evaluations (no val_loss) whose window still counts.
    records = _records(5, [0.5, 2.0, 4.0], [2.0, 1.5, 1.0])
    records.insert(2, {"step": 12, "loss": 1.4, "steps_per_s": 2.0})
    curve = report.Curve("msa", 10, records)
    assert curve.first_window_s == pytest.approx(10.0)  # 5 / 0.5, measured
    # 5/2 (the first window at the second's rate), + 5/2, + 2/2 (steps 11-12), + 3/4.
    np.testing.assert_allclose(curve.seconds, [2.5, 5.0, 6.75], rtol=0, atol=1e-12)
    np.testing.assert_array_equal(curve.steps, [5, 10, 15])
    np.testing.assert_array_equal(curve.passes, [225, 450, 675])
    assert curve.val_accuracy is None
    # Linear interpolation between evaluations, NaN outside them.
    assert curve.at("seconds", 3.75) == pytest.approx(1.75)
    assert curve.at("passes", 562.5) == pytest.approx(1.25)
    assert math.isnan(curve.at("steps", 20))
    with pytest.raises(ValueError, match="two logged windows"):
        report.Curve("gradient", 10, records[:1])


def test_tables_give_mean_and_population_std_over_seeds(tmp_path):
    runs = []
    for seed, (a, b) in enumerate([(1.0, 0.5), (2.0, 0.7), (3.0, 0.9)]):
        # MSA: 2 windows of 5 iterations at 1 iteration/s; AdamW: 6 windows of 25 steps
        # at 25 steps/s, its loss falling linearly from 4 to b.
        runs.append(("msa", seed, _records(5, [1.0, 1.0], [a + 1, a], [0.5, 0.6 + seed / 10])))
        adamw = list(np.linspace(4.0, b, 6))
        runs.append(("adamw", seed, _records(25, [25.0] * 6, adamw, [0.9] * 6)))
    _write_sweep(tmp_path, "digits", runs)
    model, curves = report.read_sweep(str(tmp_path))
    assert model == "digits" and [len(curves[m]) for m in ("msa", "adamw")] == [3, 3]
    assert report.mean_std([1.0, 2.0, 3.0]) == pytest.approx((2.0, math.sqrt(2 / 3)))
    text = report.tables([(model, curves)])
    # Final MSA loss 1, 2, 3: 2 +- 0.816; its accuracy 0.6, 0.7, 0.8; AdamW 0.7 +- 0.163.
    msa = "| digits | msa | 3 | 10 | 450 | 10.0 ± 0.0 | 1000.0 ± 0.0 | 5.0 ± 0.0 | 2.000 ± 0.816 |"
    assert msa + " 0.700 ± 0.082 |" in text
    adamw = (
        "| digits | adamw | 3 | 150 | 300 | 6.0 ± 0.0 | 40.0 ± 0.0 | 1.0 ± 0.0 | 0.700 ± 0.163 |"
    )
    assert adamw + " 0.900 ± 0.000 |" in text
    # At MSA's 10 iterations (450 passes) AdamW has run 225 steps: beyond its 150, so
    # n/a; matched iterations at the last common step is none (MSA stops at 10 < 25).
    assert "| digits | passes | 450 | 2.000 ± 0.816 | n/a |" in text
    # Matched seconds: the shortest run is 6 s (AdamW); at 6 s MSA has done 6
    # iterations, 2 + a - 0.2 = a + 0.8 (mean 2.8); AdamW is at its end, b.
    assert "| digits | seconds | 6.0 s | 2.800 ± 0.816 | 0.700 ± 0.163 |" in text
    # The first time every run has been evaluated: 5 s (MSA's first evaluation), where
    # MSA is at a + 1 and AdamW at step 125, its fifth evaluation, 4 - 4 (4 - b) / 5.
    fifth = [4.0 - 4 * (4.0 - b) / 5 for b in (0.5, 0.7, 0.9)]
    m, s = report.mean_std(fifth)
    assert f"| digits | seconds | 5.0 s | 3.000 ± 0.816 | {m:.3f} ± {s:.3f} |" in text
    assert text.count("| digits | seconds |") == 2
    assert "| digits | iterations |" not in text and text.count("| digits | passes |") == 1


def test_figure_draws_the_seed_means_against_each_axis(tmp_path):
    runs = [
        ("msa", 0, _records(5, [1.0, 1.0], [3.0, 1.0])),
        ("msa", 1, _records(5, [1.0, 0.5], [2.0, 2.0])),
        ("adamw", 0, _records(25, [25.0] * 2, [2.0, 1.0])),
        ("adamw", 1, _records(25, [25.0] * 2, [1.0, 1.0])),
        ("adamw-short", 0, _records(5, [25.0] * 2, [2.0, 1.5])),
    ]
    _write_sweep(tmp_path, "char", runs, pending=[("msa", 2)])
    models = [report.read_sweep(str(tmp_path))]
    assert [len(models[0][1][m]) for m in report.ARMS] == [2, 2, 1]
    fig = report.figure(models, str(tmp_path / "f.png"))
    assert os.path.getsize(tmp_path / "f.png") > 0
    iterations, passes, seconds = fig.axes
    msa = [line for line in seconds.get_lines() if line.get_label().startswith("msa")][0]
    # Seed 0 at 5, 10 s; seed 1 at 10, 20 s (both windows at the second rate, 0.5/s).
    np.testing.assert_allclose(msa.get_xdata(), [7.5, 15.0])
    np.testing.assert_allclose(msa.get_ydata(), [2.5, 1.5])
    adamw = [line for line in passes.get_lines() if line.get_label().startswith("adamw")][0]
    np.testing.assert_allclose(adamw.get_xdata(), [50, 100])
    np.testing.assert_allclose(adamw.get_ydata(), [1.5, 1.0])
    short = [line for line in iterations.get_lines() if line.get_label().startswith("adamw-")]
    np.testing.assert_allclose(short[0].get_xdata(), [5, 10])
    np.testing.assert_allclose(short[0].get_ydata(), [2.0, 1.5])
    assert iterations.get_xlabel() == "iterations"


def test_the_report_refuses_a_directory_without_a_sweep_or_without_finished_arms(tmp_path, capsys):
    with pytest.raises(SystemExit) as refused:
        report.main([str(tmp_path / "nowhere")])
    assert refused.value.code == 2
    assert "is not a sweep directory (no sweep.json)" in capsys.readouterr().err
    # One finished msa point; the adamw one has not run (an interrupted --only loop).
    sweep = tmp_path / "digits"
    sweep.mkdir()
    _write_sweep(sweep, "digits", [("msa", 0, _records(5, [1.0, 2.0], [2.0, 1.0]))], [("adamw", 0)])
    with pytest.raises(SystemExit) as refused:
        report.main([str(sweep)])
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert "not finished, left out" in err and "has no finished adamw point yet" in err
    # Another sweep's directory (its points labelled by other axes), or a damaged file.
    other = tmp_path / "other"
    other.mkdir()
    (other / "sweep.json").write_text(json.dumps({"arg": None, "points": [{"labels": {"lr": 1}}]}))
    with pytest.raises(SystemExit) as refused:
        report.main([str(other)])
    assert refused.value.code == 2
    assert "is not an msa_vs_adamw sweep" in capsys.readouterr().err
    (other / "sweep.json").write_text("{")
    with pytest.raises(SystemExit) as refused:
        report.main([str(other)])
    assert refused.value.code == 2
    assert "sweep.json cannot be read" in capsys.readouterr().err
