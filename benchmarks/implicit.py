"""Implicit solvers on a constant grid: a batch solved example by example, against
diffrax's solve of the whole batch as one state.

    python -m benchmarks.implicit --json benchmarks/implicit.json
    python -m benchmarks.implicit --quick        # batch 8 only, one timed call

The smoke experiment's model (``experiments/smoke.py``: pre-LN, 2 layers, width 16, 2
heads, hidden 32, float32) on random embedded inputs of 16 tokens, under Kvaerno 3 at 4
steps per layer (8 steps). For each batch size:

- ``per_example``: ``ContinuousTransformer.solve``, which vmaps the solve over the
  batch for an implicit solver on a constant grid (each stage's Newton Jacobian has
  N d columns);
- ``whole``: ``ocformer.integration.solve`` on the same terms, stepper and grid with the
  batch as one state (B N d columns, one factorisation of that size per Newton
  iteration), what the model did before;
- ``pid``: the model under ``stepsize="pid"`` (rtol 1e-3, atol 1e-6; forward only), which keeps the
  whole batch: its step sizes are chosen for the batch, as for the explicit solvers.

Times are seconds of a jitted call: ``compile`` the first call (tracing, compilation and
one run), ``forward`` and ``gradient`` (value and gradient of the mean squared output
with respect to the model) the median of ``--repeats`` further calls. ``max_abs_diff``
is the largest difference of the two constant-grid outputs.
"""

import argparse
import os
import platform
import statistics
import time

import equinox as eqx
import jax
import jax.numpy as jnp

from ocformer.config import resolve
from ocformer.integration import solve
from ocformer.training import build

from ._args import output_file, positive_int
from ._common import write_json

SMOKE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "experiments", "smoke.py")
BATCHES = (1, 4, 8)
STEPS_PER_LAYER = 4


def _model(stepsize: str = "constant"):
    overrides = [
        "discretisation.stepper=kvaerno3",
        f"discretisation.steps_per_layer={STEPS_PER_LAYER}",
        f"discretisation.stepsize={stepsize}",
    ]
    return build(resolve(SMOKE, overrides), record_source=False).model.transformer


def _whole(model, u0):
    sol = solve(
        model.terms(),
        model.time_stepper(),
        model.control,
        model.initial_state(u0),
        model.discretisation,
    )
    assert sol.ys is not None
    return model.final_projection(sol.ys[-1])


def _timed(fn, *args, repeats: int) -> tuple[float, float]:
    """(first call, median of ``repeats`` further calls), in seconds."""
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    first = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return first, statistics.median(times)


def _measure(name: str, forward, model, u0, repeats: int, gradient: bool = True) -> dict:
    jitted = eqx.filter_jit(forward)
    compile_s, forward_s = _timed(jitted, model, u0, repeats=repeats)
    out = {"compile_s": round(compile_s, 3), "forward_s": round(forward_s, 4)}
    print(f"  batch {u0.shape[0]} {name}: {out}", flush=True)
    if gradient:
        grad = eqx.filter_jit(eqx.filter_value_and_grad(lambda m, u: jnp.mean(forward(m, u) ** 2)))
        out["gradient_compile_s"], out["gradient_s"] = (
            round(t, 4) for t in _timed(grad, model, u0, repeats=repeats)
        )
        print(f"  batch {u0.shape[0]} {name}: {out}", flush=True)
    return out


def run(batches, repeats: int) -> dict:
    model, pid = _model(), _model("pid")
    rows = []
    for batch in batches:
        u0 = jax.random.normal(jax.random.PRNGKey(batch), (batch, 16, model.width), jnp.float32)
        diff = float(jnp.max(jnp.abs(model(u0) - _whole(model, u0))))
        row = {
            "batch": batch,
            "state_size": int(u0.size),
            "per_example": _measure("per_example", lambda m, u: m(u), model, u0, repeats),
            "whole": _measure("whole", _whole, model, u0, repeats),
            "pid": _measure("pid", lambda m, u: m(u), pid, u0, repeats, gradient=False),
            "max_abs_diff": diff,
        }
        row["speedup_forward"] = round(
            row["whole"]["forward_s"] / row["per_example"]["forward_s"], 1
        )
        row["speedup_gradient"] = round(
            row["whole"]["gradient_s"] / row["per_example"]["gradient_s"], 1
        )
        print(row, flush=True)
        rows.append(row)
    return {
        "model": "experiments/smoke.py, 16 tokens, float32",
        "stepper": f"kvaerno3, {STEPS_PER_LAYER} steps per layer",
        "repeats": repeats,
        "machine": f"{platform.processor() or platform.machine()}, jax {jax.__version__}, "
        f"{jax.devices()[0].platform}",
        "rows": rows,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=output_file, help="write the results to this file")
    parser.add_argument("--repeats", type=positive_int, default=1, help="timed calls (median)")
    parser.add_argument("--quick", action="store_true", help="batch 8 only, one timed call")
    args = parser.parse_args(argv)
    batches, repeats = ((8,), 1) if args.quick else (BATCHES, args.repeats)
    result = run(batches, repeats)
    if args.json:
        write_json(args.json, result)


if __name__ == "__main__":
    main()
