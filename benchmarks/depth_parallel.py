"""Parallel in depth: a cost model measured on this CPU, and the speed-up it predicts.

    python -m benchmarks.depth_parallel --json benchmarks/depth_parallel.json
    python -m benchmarks.depth_parallel --quick        # L = 12 and 24 only

Parareal (``ocformer.integration.Parareal``) on the default experiment's layer (pre-LN,
width 128, 4 heads, hidden 512, context 64; fine: Lie with one step per layer, i.e. the
Transformer; coarse: one Lie step per chunk on the layer-mean controls), with random
controls at the default initialisation and N = D chunks, one per depth device.
Measured here, on one CPU device:

- the cost t(c) of a jitted forward solve over c layers, the median of ``--repeats``
  interleaved rounds, for every c the prediction uses: a fine chunk of c layers costs t(c), and a
  serial sweep of the N coarse steps (each one Lie step, whatever the span of its
  chunk) t(N). The prediction uses these medians themselves; the least-squares line
  t(c) = a + b c is reported beside them (a: the cost of a call, b: of a layer), not
  used: its intercept, charged once per coarse step, would count a call's overhead N
  times in a sweep that is one loop;
- the iterations K(L, N) for the boundary state u(T) to be within ``--tol`` (relative,
  max norm) of the serial solve's, up to ``--max-iterations``;
- the bytes the compiled program communicates per iteration on D = 2, 4, 8 forced CPU
  devices: the output sizes of its collectives (the loop body's, counted once), taken
  as linear in D beyond 8.

Predicted, for a machine of D devices each as fast as this CPU device, linked with
latency ``--latency`` and bandwidth ``--bandwidth``:

    T_serial = t(L)
    T_D = t(N) + K (t(L / N) + t(N) + ceil(log2 D) latency + bytes(D) / bandwidth)

(the coarse guess, then K iterations of one parallel fine sweep, one serial coarse
sweep and one gather). The speed-up T_serial / T_D is a prediction: no machine with
several accelerators was available, and forced CPU devices share one machine's cores.
``compute_only`` leaves the communication out; it depends on the ratios of the t(c)
only, not on how fast a device is.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from ocformer.controls import make_control  # noqa: E402
from ocformer.integration import Parareal  # noqa: E402
from ocformer.models import ContinuousTransformer, rediscretise  # noqa: E402
from ocformer.splitting import Lie  # noqa: E402

from ._args import output_file, positive_float, positive_int  # noqa: E402
from ._common import write_json  # noqa: E402

WIDTH, HEADS, HIDDEN, CONTEXT = 128, 4, 512, 64
LAYERS = (12, 24, 48, 96)
COLLECTIVES = ("all-gather", "all-reduce", "collective-permute", "all-to-all", "reduce-scatter")
_BYTES = {"f64": 8, "f32": 4, "bf16": 2, "f16": 2, "s32": 4, "pred": 1}


def _model(layers: int) -> ContinuousTransformer:
    control = make_control(
        "piecewise_constant", jax.random.PRNGKey(0), num_layers=layers, width=WIDTH,
        hidden=HIDDEN,
    )  # fmt: skip
    return ContinuousTransformer(
        control, norm="pre", num_heads=HEADS, activation="gelu", ln_eps=1e-5, causal=True
    )


def _inputs(batch: int):
    return jax.random.normal(jax.random.PRNGKey(1), (batch, CONTEXT, WIDTH), jnp.float32)


def chunk_costs(spans, batch: int, repeats: int) -> dict[int, float]:
    """t(c): the median time of a jitted forward solve over c layers, over ``repeats``
    interleaved rounds (each round times every c once, so that a load that comes and
    goes on a shared machine falls on all of them alike)."""
    u0 = _inputs(batch)
    solves = {c: eqx.filter_jit(_model(c)) for c in spans}
    for solve in solves.values():
        jax.block_until_ready(solve(u0))  # compiled and warm
    times: dict[int, list[float]] = {c: [] for c in spans}
    for _ in range(repeats):
        for c, solve in solves.items():
            t0 = time.perf_counter()
            jax.block_until_ready(solve(u0))
            times[c].append(time.perf_counter() - t0)
    return {c: statistics.median(v) for c, v in times.items()}


def iterations_needed(layers: int, chunks: int, batch: int, tol: float, cap: int):
    """The first K with max|U^K_N - u(T)| <= tol max|u(T)|, and the errors per k."""
    serial = _model(layers)
    u0 = _inputs(batch)
    want = eqx.filter_jit(serial)(u0)
    method = Parareal(Lie(), iterations=min(chunks, cap), chunks=chunks)
    states = eqx.filter_jit(rediscretise(serial, depth_parallel=method).depth_iterates)(u0)
    scale = float(jnp.max(jnp.abs(want)))
    errors = [float(jnp.max(jnp.abs(s - want))) / scale for s in states[:, -1]]
    found = next((k for k, e in enumerate(errors) if e <= tol), None)
    return found, errors


def bytes_per_iteration(devices: int, layers: int, batch: int) -> tuple[int, dict]:
    """The output bytes of the collectives in the compiled parareal program on
    ``devices`` depth devices (one chunk each), and their counts by kind."""
    mesh = Mesh(np.array(jax.devices()[:devices]), ("depth",))
    method = Parareal(Lie(), iterations=2, chunks=devices, mesh=mesh)
    par = rediscretise(_model(layers), depth_parallel=method)
    hlo = jax.jit(lambda u: par.depth_iterates(u)).lower(_inputs(batch)).compile().as_text()
    pattern = re.compile(r"= (\w+)\[([\d,]*)\][^ ]* (" + "|".join(COLLECTIVES) + r")(?:-start)?\(")
    total, kinds = 0, {}
    for dtype, dims, kind in pattern.findall(hlo):
        size = math.prod(int(d) for d in dims.split(",") if d) * _BYTES.get(dtype, 4)
        total += size
        kinds[kind] = kinds.get(kind, 0) + 1
    return total, kinds


def linear_fit(costs: dict[int, float]) -> tuple[float, float]:
    """(a, b) of the least-squares fit t(c) = a + b c."""
    c = np.asarray(list(costs), float)
    b, a = np.polyfit(c, np.asarray(list(costs.values())), 1)
    return float(a), float(b)


def predict(t, layers, devices, k, comm_bytes, latency, bandwidth) -> dict:
    """The predicted times and speed-up from ``t``, the measured cost of a forward
    solve over c layers for every c used (L, N and L / N)."""
    chunks = devices
    coarse_sweep = t[chunks]  # N coarse steps in one serial loop
    compute = coarse_sweep + k * (t[layers // chunks] + coarse_sweep)
    comm = k * (math.ceil(math.log2(devices)) * latency + comm_bytes / bandwidth)
    return {
        "serial_s": t[layers],
        "parareal_s": compute + comm,
        "speedup": t[layers] / (compute + comm),
        "speedup_compute_only": t[layers] / compute,
    }


def _devices_for(layers: int) -> list[int]:
    return sorted({d for d in (2, 4, 8, 16, 32) if layers % d == 0} | {layers})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.depth_parallel", description=__doc__)
    p.add_argument("--quick", action="store_true", help="L = 12 and 24 only")
    p.add_argument("--batch", type=positive_int, default=1, help="sequences per solve")
    p.add_argument("--tol", type=positive_float, default=1e-3, help="relative error of u(T)")
    p.add_argument("--max-iterations", type=positive_int, default=16)
    p.add_argument("--repeats", type=positive_int, default=15, help="interleaved timing rounds")
    p.add_argument("--latency", type=positive_float, default=5e-6, help="seconds per message hop")
    p.add_argument("--bandwidth", type=positive_float, default=100e9, help="bytes per second")
    p.add_argument("--json", default=None, type=output_file, help="write the results here")
    args = p.parse_args(argv)
    layers_list = LAYERS[:2] if args.quick else LAYERS
    devices_used = {d for L in layers_list for d in _devices_for(L)}
    spans = sorted({
        1, *layers_list, *devices_used, *(L // d for L in layers_list for d in _devices_for(L))
    })  # fmt: skip
    started = time.perf_counter()
    t = chunk_costs(spans, args.batch, args.repeats)
    fit = linear_fit(t)
    print("the forward solve over c layers (ms):",
          ", ".join(f"{c}: {1e3 * v:.2f}" for c, v in t.items()),
          f"; least-squares line (not used) t(c) = {1e3 * fit[0]:.3f} + "
          f"{1e3 * fit[1]:.3f} c")  # fmt: skip
    comm = {}
    for d in (2, 4, 8):
        comm[d] = bytes_per_iteration(d, 24, args.batch)
    slope = comm[8][0] / 8  # bytes per device beyond 8: linear in D
    print("bytes per iteration:", {d: b for d, (b, _) in comm.items()})
    rows = []
    for layers in layers_list:
        for devices in _devices_for(layers):
            k, errors = iterations_needed(
                layers, devices, args.batch, args.tol, args.max_iterations
            )
            comm_bytes = comm[devices][0] if devices in comm else slope * devices
            row = {"layers": layers, "devices": devices, "iterations": k, "errors": errors}
            if k is not None:
                row.update(predict(t, layers, devices, k, comm_bytes, args.latency, args.bandwidth))
            rows.append(row)
            print(row["layers"], row["devices"], k, row.get("speedup"), flush=True)
    print(f"\n| L | D = N | K (tol {args.tol:g}) | predicted speed-up | compute only |")
    print("|---|---|---|---|---|")
    for r in rows:
        if r["iterations"] is None:
            cap = f"> {min(r['devices'], args.max_iterations)}"
            print(f"| {r['layers']} | {r['devices']} | {cap} | - | - |")
        else:
            print(f"| {r['layers']} | {r['devices']} | {r['iterations']} | "
                  f"{r['speedup']:.2f} | {r['speedup_compute_only']:.2f} |")  # fmt: skip
    if args.json:
        write_json(
            args.json,
            {
                "date": time.strftime("%Y-%m-%d"),
                "machine": platform.platform(),
                "cpus": os.cpu_count(),
                "jax": jax.__version__,
                "model": {
                    "width": WIDTH,
                    "heads": HEADS,
                    "hidden": HIDDEN,
                    "context": CONTEXT,
                    "batch": args.batch,
                },  # fmt: skip
                "tol": args.tol,
                "latency_s": args.latency,
                "bandwidth_bytes_per_s": args.bandwidth,
                "chunk_cost_s": {str(c): v for c, v in t.items()},
                "chunk_cost_line_s": {"a": fit[0], "b": fit[1], "used": False},
                "bytes_per_iteration": {str(d): b for d, (b, _) in comm.items()},
                "collectives": {str(d): kinds for d, (_, kinds) in comm.items()},
                "note": "a prediction: devices as fast as this CPU device; no machine with "
                "several accelerators was available",
                "rows": rows,
                "wall_s": time.perf_counter() - started,
            },
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
