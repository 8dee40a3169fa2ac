"""The benchmarks' code paths at tiny sizes: every JSON key is written and finite, the
references compute the same function as ocformer, the timed steps are never
recompiled, and the GPU benchmark refuses a machine without a GPU. No timing is
asserted: speed is measured by the benchmarks, not by tests.
"""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from benchmarks._common import entry_copies, log_log_slope
from benchmarks._gpt import GPTShape, model_flops_per_token
from benchmarks.profile_step import _self_times_of_line, category, matmul_ops

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TOP_LEVEL = (
    "train_step_ratio_vs_flax",
    "train_step_ratio_vs_flax_remat",
    "ratio_vs_scan",
    "ratio_vs_scan_remat",
    "forward_ratio_vs_scan",
    "compile_ratio_vs_scan",
    "compile_growth_4_to_64",
    "flops_fraction",
    "tokens_per_s",
)
METHODS = (
    "discretise_then_optimise_full_storage",
    "discretise_then_optimise_recursive",
    "optimise_then_discretise_backsolve_heun",
    "direct",
    "stored",
    "stored_dots",
    "stored_projections",
)


def _run(
    module: str, *args: str, timeout: float = 900, promotion: str | None = None
) -> subprocess.CompletedProcess:
    # A clean process: the test session's float64 setting is not the one a user runs
    # the benchmarks with. It keeps the session's strict dtype promotion unless
    # ``promotion`` is given.
    env = {k: v for k, v in os.environ.items() if k != "JAX_ENABLE_X64"}
    if promotion is not None:
        env["JAX_NUMPY_DTYPE_PROMOTION"] = promotion
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


@pytest.mark.slow
def test_tiny_run_writes_every_key(tmp_path):
    out = tmp_path / "bench.json"
    proc = _run("benchmarks.run", "--tiny", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["mode"] == "tiny"
    assert "ratio_vs_scan" in proc.stdout
    assert set(r["shapes"]) >= {"d", "heads", "d_ff", "N", "B", "L", "dtype"}
    assert r["shapes"]["dtype"] == "float32"
    assert set(r["versions"]) >= {"jax", "diffrax", "equinox"}
    assert set(r["machine"]) >= {"cpu_model", "cpu_cores", "platform"}
    for key in TOP_LEVEL:
        assert _finite(r[key]) and r[key] > 0, (key, r[key])
    # PyTorch: a ratio, or null with the reason.
    torch_ratio = r["train_step_ratio_vs_torch"]
    assert _finite(torch_ratio) or (torch_ratio is None and r["train_step_ratio_vs_torch_reason"])
    assert set(r["memory_vs_depth"]) == set(METHODS)
    for slopes in r["memory_vs_depth"].values():
        assert all(_finite(v) for v in slopes.values()), slopes

    step = r["train_step"]
    # The references compute ocformer's function: same parameters, same loss.
    for name in ("flax", "flax_remat"):
        assert step["flax"][name]["loss_rel_diff_vs_ocformer"] < 1e-5
    for mode, info in step["torch"].get("modes", {}).items():
        assert "error" in info or info["loss_rel_diff_vs_ocformer"] < 1e-5, (mode, info)
    assert step["params"]["ocformer"] == step["params"]["reference"]
    # Every timed step, the loop's own call included, was compiled once, before timing.
    assert step["compilations_while_timing"] == 0
    # The stored gradient's scan copies zero arrays into its residual stacks; the
    # unrolled flax step has no such copy (benchmarks/README.md).
    copies = step["entry_copies"]
    assert copies["ocformer_stored"]["bytes"] > 100 * max(copies["flax"]["bytes"], 1), copies
    assert {"ocformer", "ocformer_loop_call", "flax", "flax_remat"} <= set(step["timing"])
    for t in step["timing"].values():
        assert 0 < t["min_s"] <= t["median_s"] <= t["max_s"]

    # Memory rows: the gradient method's temporaries are positive, and parameters and
    # gradients make the footprint grow with the layer count.
    for method in METHODS:
        rows = r["memory"]["layers"][method]["rows"]
        assert all(row["temp_bytes"] > 0 for row in rows)
        assert rows[-1]["argument_bytes"] > rows[0]["argument_bytes"]
    # The scan guard: the two implementations agree to float32 rounding.
    (scan,) = r["scan"]["results"]
    assert set(scan["median_s"]) == {
        "ocformer_fwd_bwd", "scan_fwd_bwd", "scan_remat_fwd_bwd", "ocformer_fwd", "scan_fwd",
    }  # fmt: skip
    assert set(scan["compile_s"]) == set(scan["median_s"])
    for name, phases in scan["compile_phases_s"].items():
        assert phases["trace_lower_s"] > 0 and phases["xla_compile_s"] > 0
        assert phases["total_s"] == scan["compile_s"][name]
    # Memory per step of the default method: one stored state per step or more.
    per_step = r["memory_vs_depth"]["discretise_then_optimise_full_storage"]
    assert per_step["steps_temp_bytes_per_step"] > 0
    for key in ("ratio_vs_scan", "ratio_vs_scan_remat", "forward_ratio_vs_scan"):
        assert r[key] == scan[key]
    assert scan["max_rel_diff_output"] < 1e-5 and scan["max_rel_diff_grad"] < 1e-4


@pytest.mark.slow
def test_gpu_benchmark_refuses_without_a_gpu_and_dry_runs(tmp_path):
    refused = _run("benchmarks.gpu", timeout=300)
    assert refused.returncode == 2
    assert "needs an NVIDIA GPU" in refused.stderr and "--dry-run" in refused.stderr
    bad = _run("benchmarks.gpu", "--dry-run", "--gradients", "stored,nope", timeout=300)
    assert bad.returncode == 2 and "unknown method(s) ['nope']" in bad.stderr, bad.stderr

    out = tmp_path / "gpu.json"
    # The standard rule: jax cannot lower the gradient of its bfloat16
    # dot_product_attention under strict promotion (a float32 score cotangent against
    # bfloat16 keys in its BF16_BF16_F32 dot), and the benchmark trains in bfloat16.
    proc = _run(
        "benchmarks.gpu", "--dry-run", "--attention", "cudnn", "--json", str(out),
        promotion="standard",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["dry_run"] is True and r["compute_dtype"] == "bfloat16"
    # What ran: on a CPU no cuDNN kernel, whatever --attention asked for.
    assert r["attention_requested"] == "cudnn" and r["attention_implementation"] == "xla"
    # Provenance: the commit measured (null outside a git checkout of its own).
    assert {"git_commit", "git_uncommitted_changes", "versions", "machine"} <= set(r)
    for key in ("tokens_per_s", "ratio_vs_flax", "ratio_vs_flax_remat", "model_flops_per_step"):
        assert _finite(r[key]) and r[key] > 0, key
    # The stored gradients are timed in the same rounds, on the same model.
    assert sorted(r["ratio_vs_flax_by_gradient"]) == ["stored", "stored_dots", "stored_projections"]
    assert all(_finite(v) and v > 0 for v in r["ratio_vs_flax_by_gradient"].values())
    for g in ("stored", "stored_dots", "stored_projections"):
        assert r["last_loss"][f"ocformer_{g}"] == pytest.approx(
            r["last_loss"]["ocformer"], rel=1e-2
        )
    copies = {name: m["entry_copies"]["bytes"] for name, m in r["by_model"].items()}
    assert copies["ocformer_stored"] > 100 * max(copies["flax"], 1), copies
    # bfloat16 losses of the same initial model agree to bfloat16 precision (2^-8).
    losses = r["last_loss"]
    assert all(_finite(v) for v in losses.values())
    assert abs(losses["ocformer"] - losses["flax"]) < 0.05 * abs(losses["flax"])


class _Compiled:
    """What entry_copies reads of a compiled program: its optimised HLO text."""

    def __init__(self, text):
        self.compiled = self
        self.text = text

    def as_text(self):
        return self.text


def test_entry_copies_counts_the_top_level_copies_and_their_bytes():
    hlo = """HloModule m

%body (p: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
  %copy.1 = f32[4,8]{1,0} copy(%x), metadata={op_name="inside the loop"}
}

ENTRY %main.2 (a: f32[4,8], b: bf16[3]) -> (f32[4,8], bf16[3]) {
  %wrapped_broadcast = f32[4,8]{1,0} fusion(%constant), kind=kLoop
  %copy.2 = f32[4,8]{1,0} copy(%wrapped_broadcast), metadata={op_name="a"}
  %copy.3 = f32[4,8]{1,0} copy(%wrapped_broadcast)
  %copy_fusion = f32[4,8]{1,0} fusion(%a), kind=kLoop, calls=%copy_computation
  ROOT %copy.4 = bf16[3]{0} copy(%b)
  %copy.5 = (f32[2], f32[2]) copy(%t)
}
"""
    # Two f32[4,8] copies (128 bytes each) and one bf16[3] (6 bytes); the copy inside
    # the loop body, the fusion and the tuple-shaped copy are not counted.
    assert entry_copies(_Compiled(hlo)) == {"count": 3, "bytes": 2 * 128 + 6}
    assert entry_copies(_Compiled("HloModule empty\n")) == {"count": 0, "bytes": 0}


def test_model_flops_follow_the_written_convention():
    s = GPTShape(vocab=84, seq_len=64, layers=4, width=128, heads=4, hidden=512)
    matmul_params = 4 * (4 * 128 * 128 + 2 * 128 * 512) + 128 * 84  # 797,184
    assert model_flops_per_token(s) == 6 * matmul_params + 12 * 4 * 128 * 64
    assert model_flops_per_token(s) == 5_176_320


def test_reference_parameter_count_is_that_of_the_layers():
    s = GPTShape(vocab=10, seq_len=8, layers=2, width=4, heads=2, hidden=6)
    block = 4 * 4 * 4 + 4 * 4 + 2 * 4 * 6 + 6 + 4 + 4 * 4  # attention, biases, MLP, 2 LNs
    assert s.num_params() == 10 * 4 + 8 * 4 + 2 * block + 2 * 4 + 4 * 10 + 10


def test_log_log_slope_recovers_a_power_law():
    xs = np.array([4, 8, 16, 32, 64])
    assert abs(log_log_slope(xs, 3.0 * xs**0.5) - 0.5) < 1e-12
    assert abs(log_log_slope(xs, 7.0 + 0 * xs)) < 1e-12


def test_profile_self_time_subtracts_nested_events():
    totals = {k: 0.0 for k in ("while", "dot", "fusion")}
    # while [0, 100) contains dot [10, 40) and fusion [50, 60); a later dot [100, 120).
    events = [(0, 100, "while"), (10, 40, "dot"), (50, 60, "fusion"), (100, 120, "dot")]
    _self_times_of_line(events, totals)
    assert totals == pytest.approx({"while": 60e-9, "dot": 50e-9, "fusion": 10e-9}, abs=1e-18)
    assert category("while.1") == "loop machinery" and category("copy.2") == "data movement"


def test_profile_counts_as_matrix_products_what_computes_one():
    """By content, not by name: XLA:CPU hands reductions to YNNPACK as ``ynn_fusion``s
    too; a fusion is a matrix product when its computation holds a dot, at any depth."""
    hlo = """HloModule m

%add (a: f32[], b: f32[]) -> f32[] {
  ROOT %s = f32[] add(%a, %b)
}

%reduction (p0: f32[], p1: f32[8,8]) -> f32[8] {
  %p1 = f32[8,8]{1,0} parameter(1)
  ROOT %r = f32[8]{0} reduce(%p1, %p0), dimensions={1}, to_apply=%add
}

%product (p0: f32[8,8], p1: f32[8,8]) -> f32[8,8] {
  %dot_general.0 = f32[8,8]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}
  ROOT %t = f32[8,8]{1,0} tanh(%dot_general.0)
}

%outer (p0: f32[8,8], p1: f32[8,8]) -> f32[8,8] {
  ROOT %inner = f32[8,8]{1,0} fusion(%p0, %p1), kind=kLoop, calls=%product
}

ENTRY %main (a: f32[8,8], b: f32[8,8]) -> f32[8] {
  %ynn_fusion = f32[8]{0} fusion(%c, %a), kind=kCustom, calls=%reduction
  %ynn_fusion.1 = f32[8,8]{1,0} fusion(%a, %b), kind=kCustom, calls=%product
  %nested_fusion = f32[8,8]{1,0} fusion(%a, %b), kind=kLoop, calls=%outer
  %dot.3 = f32[8,8]{1,0} dot(%a, %b), lhs_contracting_dims={1}
  %custom-call.1 = f32[8,8]{1,0} custom-call(%a, %b), custom_call_target="__onednn$matmul"
  ROOT %copy.2 = f32[8]{0} copy(%ynn_fusion)
}
"""
    matmuls = matmul_ops(hlo)
    assert {"ynn_fusion.1", "nested_fusion", "dot.3", "custom-call.1"} <= matmuls
    assert "ynn_fusion" not in matmuls and "copy.2" not in matmuls
    assert category("ynn_fusion", matmuls) == "other fusions (element-wise, reductions)"
    assert category("ynn_fusion.1", matmuls) == "matmul"
    assert category("dot.3", matmuls) == "matmul"


@pytest.mark.slow
def test_end_to_end_runs_with_an_empty_then_a_warm_cache(tmp_path, capsys):
    """The end-to-end figure, through its command: the training command run twice in a
    compilation cache of its own; the second run loads its programs, so it has less
    fixed cost (its step is loaded, not compiled), and both train the same numbers;
    each run's parts (from its summary.json) add up to its wall clock."""
    from benchmarks.end_to_end import main, time_split

    smoke = os.path.join(REPO, "experiments", "smoke.py")
    out = tmp_path / "e2e.json"
    args = ["--config", smoke, "--set", "train.steps=30", "--set", "train.progress=false"]
    report = main([*args, "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    r = report["end_to_end"]
    warm = r["warm_cache"]
    assert "error" not in r and warm is not None and "error" not in warm, r
    assert report["end_to_end_ratio"] == r["ratio"]
    assert report["end_to_end_ratio_warm_cache"] == warm["ratio"]
    for run in (r, warm):
        assert run["steps"] == 30 and run["ratio"] > 1.0
        assert run["fixed_costs_s"] == pytest.approx(run["wall_clock_s"] - run["training_steps_s"])
        parts = run["time_s"]  # the process before train(), then train()'s parts
        assert list(parts)[:2] == ["before_train", "setup"] and min(parts.values()) >= 0
        assert sum(parts.values()) == pytest.approx(run["wall_clock_s"], rel=0.05)
    assert warm["fixed_costs_s"] < r["fixed_costs_s"]
    # Loading the step from the cache is faster than compiling it.
    assert warm["time_s"]["step_compilation"] < r["time_s"]["step_compilation"]
    line = time_split(warm)  # the summary's line
    assert line.startswith(f"{warm['wall_clock_s']:.1f} s wall") and "step_compilation" in line
    printed = capsys.readouterr().out
    assert f"end_to_end_ratio_warm_cache {warm['ratio']:.3f} (warm cache): {line}" in printed
    assert warm["final_val_loss"] == r["final_val_loss"]


def test_end_to_end_passes_on_a_refused_configuration_as_exit_code_2(tmp_path, capsys):
    """A configuration the training command refuses is the end-to-end command's bad
    argument: exit code 2, the command's own message, nothing run a second time."""
    from benchmarks.end_to_end import main

    smoke = os.path.join(REPO, "experiments", "smoke.py")
    out = tmp_path / "e2e.json"
    with pytest.raises(SystemExit) as exit_info:
        main(["--config", smoke, "--set", "train.steps=-1", "--json", str(out)])
    assert exit_info.value.code == 2
    assert "train.steps: must be >= 0, got -1" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["end_to_end_ratio"] is None and report["end_to_end"]["warm_cache"] is None
    assert report["end_to_end"]["returncode"] == 2


def test_end_to_end_summary_names_a_failure_without_error_output():
    """A run that wrote nothing to stderr (killed by a signal, say) is still reported,
    by its exit status; one that did write is reported by its last line."""
    from benchmarks.end_to_end import format_summary

    killed = {"error": "", "returncode": -9, "command": "-m ocformer.train"}
    assert format_summary(killed) == (
        "end_to_end_ratio: the run failed: killed by signal 9, no error output"
    )
    refused = {"error": "Traceback\nerror: train.steps: must be >= 0\n", "returncode": 2}
    assert format_summary({**refused, "command": ""}).endswith("error: train.steps: must be >= 0")
    silent = {"error": "\n", "returncode": 1, "command": ""}
    assert format_summary(silent).endswith("exit code 1, no error output")


def test_end_to_end_refuses_a_run_without_training_steps(tmp_path, capsys):
    """A run of no steps has no step time to compare its wall clock with: the
    configuration's fault, exit code 2, with a message saying what to give instead."""
    from benchmarks.end_to_end import main

    smoke = os.path.join(REPO, "experiments", "smoke.py")
    with pytest.raises(SystemExit) as exit_info:
        main(["--config", smoke, "--set", "train.steps=0"])
    assert exit_info.value.code == 2
    assert "logged no training steps" in capsys.readouterr().out


@pytest.mark.slow
def test_the_implicit_benchmark_times_both_solves_of_one_batch():
    """``benchmarks.implicit`` at batch 1: every time it reports, and the two
    constant-grid solves agree (float32, Newton at the model's tolerances)."""
    from benchmarks.implicit import run

    [row] = run((1,), repeats=1)["rows"]
    assert row["batch"] == 1 and row["state_size"] == 16 * 16
    for path in ("per_example", "whole"):
        assert set(row[path]) == {"compile_s", "forward_s", "gradient_compile_s", "gradient_s"}
        assert all(t > 0 for t in row[path].values())
    assert set(row["pid"]) == {"compile_s", "forward_s"}
    assert row["max_abs_diff"] < 1e-5


def test_every_benchmark_refuses_bad_arguments_before_it_measures(tmp_path):
    """A result file that could not be written, a count below 1, an unknown config
    field: each benchmark's command line refuses them at once with argparse's exit
    code 2 and the option named, rather than failing after a long measurement. One
    process calls every ``main`` (each would have measured for minutes otherwise)."""
    missing = str(tmp_path / "no" / "such" / "dir" / "r.json")
    cases = [
        ("run", ["--tiny", "--json", missing], "--json: the directory"),
        ("end_to_end", ["--json", missing], "--json: the directory"),
        ("gpu", ["--dry-run", "--json", missing], "--json: the directory"),
        ("gpu", ["--dry-run", "--batch", "0"], "--batch: 0 is not a positive integer"),
        ("depth_parallel", ["--quick", "--json", str(tmp_path)], "is a directory"),
        ("depth_parallel", ["--tol", "nan"], "--tol: nan is not a finite positive number"),
        ("implicit", ["--json", missing], "--json: the directory"),
        ("implicit", ["--repeats", "0"], "--repeats: 0 is not a positive integer"),
        ("scaling", ["--steps", "0"], "--steps: 0 is not a positive integer"),
        ("scaling", ["--set", "train.stepz=3"], "unknown field train.stepz"),
        ("profile_step", ["--set", "train.stepz=3"], "unknown field train.stepz"),
        ("profile_step", ["--json", missing], "--json: the directory"),
        ("prepare_corpus", ["--size", "abc"], "--size: 'abc' is not a size"),
        ("prepare_corpus", ["--chunk-bytes", "0"], "--chunk-bytes: 0 is not a positive"),
    ]
    script = (
        "import contextlib, importlib, io, json, sys\n"
        f"cases = {[(m, a) for m, a, _ in cases]!r}\n"
        "out = []\n"
        "for module, args in cases:\n"
        "    err = io.StringIO()\n"
        "    with contextlib.redirect_stderr(err):\n"
        "        try:\n"
        "            importlib.import_module('benchmarks.' + module).main(args)\n"
        "            code = 0\n"
        "        except SystemExit as e:\n"
        "            code = e.code\n"
        "    out.append([code, err.getvalue()])\n"
        "print(json.dumps(out))\n"
    )
    proc = _run_script(script)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for (module, args, words), (code, err) in zip(cases, json.loads(proc.stdout.splitlines()[-1])):
        assert code == 2 and words in err, (module, args, code, err)
    assert not os.path.exists(os.path.dirname(missing))


def _run_script(script: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "JAX_ENABLE_X64"}
    return subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
