"""Behavioural contracts of the compiled model (as optax tests them).

- A second call with the same shapes does not trace (nor compile) again, also when the
  parameter values change: every parameter is an array leaf, never static.
- dtypes are preserved: float32 in, float32 out (and float32 gradients); float64 in,
  float64 out, whatever the dtype the model was built in.
- Two calls give bitwise-equal results.
- The zero-cost benchmark runs end to end in its tiny mode and writes its JSON keys.
"""

import json
import os
import pathlib
import subprocess
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _layers import random_stack

from ocformer.convert import from_layers

REPO = pathlib.Path(__file__).resolve().parents[1]


def _layers(seed, dtype=np.float64):
    return random_stack(seed, 3, 8, 12, dtype=dtype)


def _final(d=8, dtype=np.float64):
    return {"scale": np.full(d, 1.1, dtype), "bias": np.full(d, 0.05, dtype)}


def _model(seed=0, norm="post", dtype=np.float64):
    return from_layers(
        _layers(seed, dtype=dtype),
        norm=norm,
        num_heads=2,
        causal=norm == "pre",
        final_norm=_final(dtype=dtype) if norm == "pre" else None,
    )


def _u(seed, shape=(2, 5, 8), dtype=np.float64):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape).astype(dtype))


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_second_call_does_not_retrace(norm):
    traces = []

    @eqx.filter_jit
    def forward(model, u):
        traces.append(u.shape)  # a Python side effect: runs once per trace
        return model(u)

    model = _model(0, norm)
    forward(model, _u(1))
    forward(model, _u(2))
    assert len(traces) == 1
    # New parameter values with the same structure: still the same compiled function.
    forward(_model(3, norm), _u(4))
    assert len(traces) == 1
    # A new shape is a new trace (the counter does count).
    forward(model, _u(5, (3, 5, 8)))
    assert len(traces) == 2


def test_second_gradient_call_does_not_retrace():
    traces = []

    @eqx.filter_jit
    def loss_and_grad(model, u):
        traces.append(None)
        return eqx.filter_value_and_grad(lambda m: jnp.mean(m(u) ** 2))(model)

    loss_and_grad(_model(0), _u(1))
    loss_and_grad(_model(2), _u(3))
    assert len(traces) == 1


@pytest.mark.parametrize("model_dtype", [np.float32, np.float64])
@pytest.mark.parametrize("input_dtype", [jnp.float32, jnp.float64])
def test_dtype_follows_the_input(model_dtype, input_dtype):
    model = _model(0, "pre", dtype=model_dtype)
    out = eqx.filter_jit(lambda m, u: m(u))(model, _u(1, dtype=input_dtype))
    assert out.dtype == input_dtype
    assert np.all(np.isfinite(out))


def test_float32_gradients_stay_float32():
    model = _model(0, dtype=np.float32)
    u = _u(1, dtype=np.float32)
    value, grads = eqx.filter_jit(eqx.filter_value_and_grad(lambda m: jnp.mean(m(u) ** 2)))(model)
    assert value.dtype == jnp.float32
    leaves = jax.tree_util.tree_leaves(eqx.filter(grads, eqx.is_inexact_array))
    assert leaves and {leaf.dtype for leaf in leaves} == {jnp.dtype(jnp.float32)}


def test_float32_and_float64_agree_to_float32_rounding():
    model = _model(0, "pre")
    u = _u(1)
    out64 = np.asarray(model(u))
    out32 = np.asarray(model(u.astype(jnp.float32)), np.float64)
    err = np.max(np.abs(out32 - out64)) / np.max(np.abs(out64))
    assert 1e-9 < err < 1e-5  # genuinely computed in float32, and correct to its rounding


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_two_calls_are_bitwise_equal(norm):
    model, u = _model(0, norm), _u(1)
    mask = jnp.asarray(np.array([[True] * 5, [True, True, False, True, False]]))
    jitted = eqx.filter_jit(lambda m, u, k: m(u, k))
    first, second = jitted(model, u, mask), jitted(model, u, mask)
    np.testing.assert_array_equal(np.asarray(first), np.asarray(second))
    np.testing.assert_array_equal(np.asarray(model(u, mask)), np.asarray(model(u, mask)))


# ---------------------------------------------------------------------------------------
# The zero-cost benchmark, in its tiny mode.

BENCHMARK_KEYS = {
    "ratio_vs_scan",
    "ratio_vs_scan_remat",
    "forward_ratio_vs_scan",
    "shapes",
    "results",
    "versions",
    "machine",
    "mode",
}


@pytest.mark.slow
def test_benchmark_tiny_mode_writes_its_json(tmp_path):
    out = tmp_path / "bench.json"
    env = {k: v for k, v in os.environ.items() if k != "JAX_ENABLE_X64"}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--tiny", "--json", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ratio_vs_scan" in proc.stdout
    report = json.loads(out.read_text())
    assert set(report) >= BENCHMARK_KEYS
    assert report["mode"] == "tiny"
    assert set(report["shapes"]) >= {"d", "heads", "d_ff", "N", "B", "L", "dtype"}
    assert report["shapes"]["dtype"] == "float32"
    assert set(report["versions"]) >= {"jax", "diffrax", "equinox"}
    assert set(report["machine"]) >= {"cpu_model", "cpu_cores", "platform"}
    (result,) = report["results"]
    assert set(result["median_s"]) == {
        "ocformer_fwd_bwd", "scan_fwd_bwd", "scan_remat_fwd_bwd", "ocformer_fwd", "scan_fwd",
    }  # fmt: skip
    assert set(result["compile_s"]) == set(result["median_s"])
    for key in ("ratio_vs_scan", "ratio_vs_scan_remat", "forward_ratio_vs_scan"):
        assert 0 < report[key] < 100 and report[key] == result[key]
    # The two implementations compute the same function, to float32 rounding.
    assert result["max_rel_diff_output"] < 1e-5
    assert result["max_rel_diff_grad"] < 1e-4
