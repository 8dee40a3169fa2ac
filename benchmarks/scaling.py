"""Layouts on forced CPU devices: a correctness-and-overhead check, not a speed-up.

    python -m benchmarks.scaling                      # meshes (1,1) (2,1) (4,1) (2,2), smoke model
    python -m benchmarks.scaling --json benchmarks/scaling.json

For each mesh ``(data, model)`` of 4 forced CPU devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=4``, set here before JAX starts) it
compiles the sharded training step of ``experiments/smoke.py`` (the step the training
loop runs: ``ocformer.distributed.Layout.compile_train_step``), reports the compiled
memory of one device (arguments, outputs, temporaries: XLA's ``memory_analysis``), the
collectives in the compiled HLO, the steps per second over ``--steps`` steps after two
warm-up steps, and the loss after those steps against one device's.

The forced devices are threads of one process sharing the machine's cores, so steps/s
measures what splitting costs (collectives, smaller per-device work), never a speed-up.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import argparse  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402

import equinox as eqx  # noqa: E402
import jax  # noqa: E402

from ocformer.config import ConfigError, resolve  # noqa: E402
from ocformer.distributed import Layout  # noqa: E402
from ocformer.training import build, make_train_step  # noqa: E402

from ._args import output_file, positive_int  # noqa: E402
from ._common import write_json  # noqa: E402

MESHES = ((1, 1), (2, 1), (4, 1), (2, 2))
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def measure(experiment: str, data: int, model: int, steps: int, overrides: list[str]) -> dict:
    config = resolve(experiment, [*overrides, f"mesh.data={data}", f"mesh.model={model}"])
    exp, layout = build(config), Layout(config)
    params = eqx.filter(exp.model, eqx.is_inexact_array)
    state = layout.put_state(exp.optimiser.init(params), exp.model)
    net = layout.put_model(exp.model)
    plain = make_train_step(exp.objective, exp.constraints, exp.optimiser, skip_nonfinite=False)
    step = layout.compile_train_step(plain, net, state)
    batches = [
        layout.put_batch(exp.task.batch("train", n, config.task.batch_size, 0))
        for n in range(steps + 2)
    ]
    t0 = time.perf_counter()
    compiled = step.lower(net, state, batches[0]).compile()
    compile_s = time.perf_counter() - t0
    memory = compiled.memory_analysis()
    hlo = compiled.as_text()
    counts = {c: len(re.findall(rf"\b{c}(?:-start)?\(", hlo)) for c in COLLECTIVES}
    for batch in batches[:2]:  # warm-up
        net, state, metrics, _ = step(net, state, batch)
    jax.block_until_ready(metrics)
    t0 = time.perf_counter()
    for batch in batches[2:]:
        net, state, metrics, _ = step(net, state, batch)
    jax.block_until_ready(metrics)
    elapsed = time.perf_counter() - t0
    return {
        "mesh": [data, model],
        "devices": data * model,
        "steps_per_s": steps / elapsed,
        "compile_s": compile_s,
        "memory_per_device_bytes": {
            "arguments": int(memory.argument_size_in_bytes),
            "outputs": int(memory.output_size_in_bytes),
            "temporaries": int(memory.temp_size_in_bytes),
        },
        "collectives": {k: v for k, v in counts.items() if v},
        "loss": float(metrics["loss"]),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.scaling", description=__doc__)
    p.add_argument("--experiment", default="experiments/smoke.py")
    p.add_argument("--steps", type=positive_int, default=20, help="timed steps per mesh")
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--json", default=None, type=output_file, help="write the results here")
    args = p.parse_args(argv)
    try:
        for d, m in MESHES:  # every mesh's configuration, before any is measured
            resolve(args.experiment, [*args.overrides, f"mesh.data={d}", f"mesh.model={m}"])
    except ConfigError as e:
        p.error(str(e))
    if jax.device_count() < 4:
        p.error(f"needs 4 devices, found {jax.device_count()}; unset XLA_FLAGS")
    rows = [measure(args.experiment, d, m, args.steps, args.overrides) for d, m in MESHES]
    one = rows[0]["loss"]
    print(f"{jax.device_count()} x {jax.devices()[0].platform}; {args.experiment}; "
          f"{args.steps} steps after 2 warm-up steps")  # fmt: skip
    print("| mesh (data, model) | steps/s | compile s | per-device MiB args / out / temp "
          "| collectives | loss after | rel. diff to (1,1) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        mib = [v / 2**20 for v in r["memory_per_device_bytes"].values()]
        coll = ", ".join(f"{k} x{v}" for k, v in r["collectives"].items()) or "none"
        print(
            f"| ({r['mesh'][0]}, {r['mesh'][1]}) | {r['steps_per_s']:.1f} | "
            f"{r['compile_s']:.1f} | {mib[0]:.3f} / {mib[1]:.3f} / {mib[2]:.3f} | {coll} | "
            f"{r['loss']:.7f} | {abs(r['loss'] - one) / abs(one):.1e} |"
        )
    if args.json:
        record = {
            "date": time.strftime("%Y-%m-%d"),
            "machine": platform.platform(),
            "processor": platform.processor(),
            "cpus": os.cpu_count(),
            "jax": jax.__version__,
            "experiment": args.experiment,
            "overrides": args.overrides,
            "steps": args.steps,
            "note": "forced CPU devices share the cores: a correctness-and-overhead check, "
            "not a speed-up figure",
            "rows": rows,
        }
        write_json(args.json, record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
