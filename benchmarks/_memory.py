"""Peak memory against depth for each gradient method, and compile time against depth.

For each gradient method the loss gradient of the default experiment's model
(``value_and_grad`` of the objective with respect to every parameter, one batch) is
compiled ahead of time and the compiled executable's ``memory_analysis()`` is read:

- ``temp_bytes``: XLA's temporary buffers: the states kept for the backward pass, the
  working memory of a step, and the carried gradient accumulators of the controls;
- ``peak_bytes``: arguments + outputs + temporaries - aliased bytes, the footprint of
  the call.

Depth is varied two ways, each with a fitted log-log slope:

- ``layers``: L layers at one step per layer (the Transformer). Parameters, gradients
  and the controls' cotangent accumulator grow linearly in L for every method; at the
  default shape a layer's parameters (0.8 MB) outweigh its state (0.4 MB), so here the
  methods differ in the constant, not the slope;
- ``steps``: 4 layers with m steps per layer (the same controls, a finer time grid):
  parameters are fixed, so the slope is that of what the method stores per step
  (expected: full storage linear, recursive checkpointing sub-linear, backsolve flat,
  the stored methods linear with a larger slope: a step's residuals, not just its
  state; benchmarks/README.md has what is measured).

Compile time (trace, lower, compile) of the default method along ``layers`` is
recorded; ``compile_growth`` is its ratio between the deepest and the shallowest model.
"""

import math
from concurrent.futures import ThreadPoolExecutor

import equinox as eqx
import jax.numpy as jnp

from ocformer.integration import GRADIENT_METHODS, DiscretiseThenOptimise
from ocformer.models import rediscretise
from ocformer.training import build

from ._common import (
    aot_compile,
    experiment_config,
    experiment_task,
    jax_compiled,
    log_log_slope,
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
DEFAULT_METHOD = METHODS[0]


def method_overrides(method: str) -> list[str]:
    """The configuration of ``method`` as ``section.field=value`` overrides."""
    gradient = "discretisation.gradient"
    if method.startswith("discretise_then_optimise"):
        return [f"{gradient}=discretise_then_optimise"]
    if method == "optimise_then_discretise_backsolve_heun":
        return ["discretisation.stepper=heun", f"{gradient}=optimise_then_discretise"]
    if method in METHODS and method in GRADIENT_METHODS:  # the registry's own name
        return [f"{gradient}={method}"]
    raise ValueError(f"Unknown method {method!r}; expected one of {METHODS}.")


def recursive_checkpoints(steps: int) -> int:
    """Checkpoints of the recursive variant: ceil(sqrt(steps)) (treeverse), so that
    stored states grow like the square root of the step count."""
    return max(1, math.ceil(math.sqrt(steps)))


def measure(overrides, method: str, layers: int, steps_per_layer: int, task) -> dict:
    steps_field = "discretisation.steps_per_layer"
    config = experiment_config(
        [
            *overrides,
            f"model.num_layers={layers}",
            f"{steps_field}={steps_per_layer}",
            *method_overrides(method),
        ]
    )
    exp = build(config, task=task)
    model = exp.model
    if method == "discretise_then_optimise_recursive":
        checkpoints = recursive_checkpoints(layers * steps_per_layer)
        model = rediscretise(model, gradient=DiscretiseThenOptimise(checkpoints=checkpoints))

    def loss(model, batch):
        return exp.objective(model, batch)[0]

    b = config.task.batch_size
    batch = {k: jnp.asarray(v) for k, v in task.batch("train", 0, b, 0).items()}
    compiled, compile_s = aot_compile(eqx.filter_jit(eqx.filter_value_and_grad(loss)), model, batch)
    m = jax_compiled(compiled).memory_analysis()
    peak = (
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        + m.temp_size_in_bytes
        - m.alias_size_in_bytes
    )
    return {
        "layers": layers,
        "steps_per_layer": steps_per_layer,
        "steps": layers * steps_per_layer,
        "temp_bytes": int(m.temp_size_in_bytes),
        "argument_bytes": int(m.argument_size_in_bytes),
        "output_bytes": int(m.output_size_in_bytes),
        "peak_bytes": int(peak),
        "compile_s": compile_s,
    }


def _fit(rows, key: str) -> dict:
    xs = [r[key] for r in rows]
    first, last = rows[0], rows[-1]
    return {
        "rows": rows,
        "temp_slope": log_log_slope(xs, [r["temp_bytes"] for r in rows]),
        "peak_slope": log_log_slope(xs, [r["peak_bytes"] for r in rows]),
        # What one more layer (or step) adds: the constant part of the footprint, which
        # flattens the log-log slopes, drops out.
        "temp_bytes_per_unit": (last["temp_bytes"] - first["temp_bytes"])
        / (last[key] - first[key]),
    }


def run(
    overrides=(),
    *,
    depths,
    steps_layers: int = 4,
    methods=METHODS,
    random_tokens: bool = False,
    workers: int = 1,
) -> dict:
    """``memory_vs_depth`` along layers and along steps, and the compile-time growth.

    The default method's layer axis is compiled first, one model at a time, since its
    compile times are the ``compile_growth`` measurement. The other models only need
    their memory analysis; with ``workers > 1`` they are compiled that many at a time
    in threads (XLA compiles outside the GIL)."""
    config = experiment_config(overrides)
    task, task_name = experiment_task(config, random_tokens)
    out: dict = {"task": task_name, "depths": list(depths), "layers": {}, "steps": {}}
    per_layer = [d // steps_layers for d in depths if d % steps_layers == 0]
    jobs = [(method, depth, 1) for method in methods for depth in depths]
    # The first row of the steps axis (m = 1) is the same model as on the layer axis
    # when steps_layers is its first depth.
    jobs += [
        (method, steps_layers, m)
        for method in methods
        for m in per_layer
        if not (m == 1 and depths[0] == steps_layers)
    ]
    timed = [job for job in jobs if job[0] == DEFAULT_METHOD and job[2] == 1]
    rows = {job: measure(overrides, *job, task) for job in timed}
    rest = [job for job in jobs if job not in rows]
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        rows.update(zip(rest, pool.map(lambda job: measure(overrides, *job, task), rest)))
    for method in methods:
        out["layers"][method] = _fit([rows[(method, d, 1)] for d in depths], "layers")
        steps_rows = [
            rows[(method, depths[0], 1)]
            if (m == 1 and depths[0] == steps_layers)
            else rows[(method, steps_layers, m)]
            for m in per_layer
        ]
        out["steps"][method] = _fit(steps_rows, "steps")
    default = out["layers"].get(DEFAULT_METHOD)
    if default is not None:
        first, last = default["rows"][0], default["rows"][-1]
        out["compile_growth"] = {
            "from_layers": first["layers"],
            "to_layers": last["layers"],
            "compile_s": [first["compile_s"], last["compile_s"]],
            "ratio": last["compile_s"] / first["compile_s"],
        }
    return out
