"""ocformer against the code a user would otherwise write, in one run.

Sections (each described in its module and in benchmarks/README.md):

1. ``_train_step``: a whole training step (forward, backward, clipping, AdamW, donated
   state) of the default experiment's model against an equal-shape flax.linen GPT,
   plain and with ``nn.remat``, and an equal-shape PyTorch GPT (eager and
   ``torch.compile``); tokens/s and achieved FLOP/s against the measured matmul peak.
2. ``_scan``: forward + backward and forward alone of the layer stack through
   ``diffeqsolve`` against a hand-written ``lax.scan`` (plain and rematerialised), and
   their compile times.
3. ``_memory``: peak memory against depth for each gradient method, from the compiled
   executable's memory analysis, and compile time against depth.
4. With ``--end-to-end``: the default experiment's ``short`` run through the command
   line, its wall clock against the time of its own training steps.

Usage::

    python -m benchmarks.run --quick --json FILE   # every key; about 2-2.5 min on the 2-core CPU
    python -m benchmarks.run --json FILE           # more repeats, depths and shapes
    python -m benchmarks.run --tiny --json FILE    # every code path at tiny sizes
"""

import argparse
import sys
import time
from collections.abc import Sequence

from . import _memory, _scan, _train_step
from ._args import output_file
from ._common import matmul_peak, provenance, write_json
from .end_to_end import end_to_end, format_summary as format_end_to_end, ratio

TINY_MODEL = (
    "model.num_layers=2",
    "model.width=32",
    "model.num_heads=2",
    "model.hidden=64",
    "task.seq_len=16",
    "task.batch_size=4",
)

# Per mode: the scan shapes, train-step timing, memory depths, torch modes and matmul
# size. ``budget`` is seconds of interleaved timing per section.
MODES = {
    "tiny": dict(
        scan=_scan.TINY,
        scan_budget=0.2,
        step_overrides=TINY_MODEL,
        step_budget=0.5,
        repeats=(3, 20),
        torch_modes=("eager",),
        depths=(2, 4),
        memory_overrides=TINY_MODEL[1:],
        matmul=(256, 0.2),
        random_tokens=True,
        memory_workers=1,
    ),
    "quick": dict(
        scan=_scan.QUICK,
        scan_budget=3.0,
        step_overrides=(),
        step_budget=6.0,
        repeats=(10, 400),
        # torch.compile alone takes longer than the whole quick budget on 2 cores.
        torch_modes=("eager",),
        depths=(4, 64),
        memory_overrides=(),
        matmul=(1024, 2.0),
        random_tokens=False,
        # Memory analyses of the other models compiled two at a time.
        memory_workers=2,
    ),
    "full": dict(
        scan=_scan.FULL,
        scan_budget=10.0,
        step_overrides=(),
        step_budget=30.0,
        repeats=(20, 2000),
        torch_modes=("eager", "compile"),
        depths=(4, 16, 64),
        memory_overrides=(),
        matmul=(2048, 5.0),
        random_tokens=False,
        memory_workers=1,
    ),
}


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.run", description=__doc__.split("\n")[0]
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--quick",
        action="store_true",
        help="every key: about 2-2.5 minutes on the 2-core CPU",
    )
    mode.add_argument("--tiny", action="store_true", help="tiny sizes: checks the code paths")
    parser.add_argument(
        "--json", metavar="FILE", type=output_file, help="write the results as JSON to FILE"
    )
    parser.add_argument(
        "--end-to-end",
        action="store_true",
        help="also run the default experiment's short variant through the command line",
    )
    parser.add_argument("--no-torch", action="store_true", help="skip the PyTorch reference")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    mode_name = "tiny" if args.tiny else "quick" if args.quick else "full"
    m = MODES[mode_name]
    min_rep, max_rep = m["repeats"]
    started = time.perf_counter()

    def log(text: str) -> None:
        print(f"[{time.perf_counter() - started:6.1f}s] {text}", file=sys.stderr, flush=True)

    log("matmul peak ...")
    peak = matmul_peak(*m["matmul"])
    log("training step: ocformer, flax, flax-remat, torch ...")
    step = _train_step.run(
        m["step_overrides"],
        budget_s=m["step_budget"],
        min_repeats=min_rep,
        max_repeats=max_rep,
        torch_modes=() if args.no_torch else m["torch_modes"],
        random_tokens=m["random_tokens"],
        peak_flop_per_s=peak["median_flop_per_s"],
        seed=args.seed,
    )
    if args.no_torch:
        step["torch"] = {"error": "skipped (--no-torch)"}
    scans = []
    for cfg in m["scan"]:
        log(f"scan comparison {cfg.name} ...")
        scans.append(_scan.run_config(cfg, m["scan_budget"], min_rep, max_rep, seed=args.seed))
    log(f"memory and compile time against depth {m['depths']} ...")
    memory = _memory.run(
        m["memory_overrides"],
        depths=m["depths"],
        steps_layers=m["depths"][0],
        random_tokens=m["random_tokens"],
        workers=m["memory_workers"],
    )
    e2e = None
    if args.end_to_end:
        log("end to end: the default experiment's short run ...")
        e2e = end_to_end()
    headline = scans[0]
    torch_error = step["torch"].get("error")
    report = {
        "benchmark": "ocformer against flax, PyTorch and lax.scan references",
        "mode": mode_name,
        "train_step_ratio_vs_flax": step["ratio_vs_flax"],
        "train_step_ratio_vs_flax_remat": step["ratio_vs_flax_remat"],
        "train_step_ratio_vs_flax_by_gradient": step["ratio_vs_flax_by_gradient"],
        "train_step_ratio_vs_torch": step["ratio_vs_torch"],
        "train_step_ratio_vs_torch_reason": torch_error,
        "ratio_vs_scan": headline["ratio_vs_scan"],
        "ratio_vs_scan_remat": headline["ratio_vs_scan_remat"],
        "forward_ratio_vs_scan": headline["forward_ratio_vs_scan"],
        "compile_ratio_vs_scan": headline["compile_ratio_vs_scan"],
        "compile_growth_4_to_64": memory["compile_growth"]["ratio"],
        "memory_vs_depth": {
            name: {
                "layers_temp_slope": memory["layers"][name]["temp_slope"],
                "layers_peak_slope": memory["layers"][name]["peak_slope"],
                "steps_temp_slope": memory["steps"][name]["temp_slope"],
                "steps_peak_slope": memory["steps"][name]["peak_slope"],
                "layers_temp_bytes_per_layer": memory["layers"][name]["temp_bytes_per_unit"],
                "steps_temp_bytes_per_step": memory["steps"][name]["temp_bytes_per_unit"],
            }
            for name in memory["layers"]
        },
        "flops_fraction": step["flops_fraction"],
        "tokens_per_s": step["tokens_per_s"],
        "end_to_end_ratio": ratio(e2e),
        "end_to_end_ratio_warm_cache": ratio(e2e and e2e["warm_cache"]),
        "train_step": step,
        "matmul_peak": peak,
        "scan": {"headline": headline["name"], "results": scans},
        "memory": memory,
        "end_to_end": e2e
        if e2e is not None
        else {"not_run": "pass --end-to-end (runs experiments/shakespeare_char.py:short)"},
        "shapes": headline["shapes"],
        "results": scans,
        **provenance(started),
    }
    print(format_summary(report))
    if args.json:
        write_json(args.json, report)
    return report


def _fmt(x, spec=".3f") -> str:
    return "n/a" if x is None else format(x, spec)


def format_summary(r: dict) -> str:
    s = r["train_step"]
    med = {k: 1e3 * v["median_s"] for k, v in s["timing"].items()}
    lines = [
        "training step (ms, median): "
        + ", ".join(f"{k} {v:.2f}" for k, v in med.items())
        + f"  [{s['compilations_while_timing']} compilations while timing]",
        f"train_step_ratio_vs_flax       {_fmt(r['train_step_ratio_vs_flax'])}",
        f"train_step_ratio_vs_flax_remat {_fmt(r['train_step_ratio_vs_flax_remat'])}",
        *(
            f"train_step_ratio_vs_flax ({g} gradient) {_fmt(v)}"
            for g, v in r["train_step_ratio_vs_flax_by_gradient"].items()
        ),
        f"train_step_ratio_vs_torch      {_fmt(r['train_step_ratio_vs_torch'])}"
        + (
            f"  ({r['train_step_ratio_vs_torch_reason']})"
            if r["train_step_ratio_vs_torch"] is None
            else f"  (best torch mode: {s['torch_best_mode']})"
        ),
        f"tokens/s {s['tokens_per_s']:.0f}; flops_fraction {_fmt(r['flops_fraction'])} of "
        f"{r['matmul_peak']['median_flop_per_s'] / 1e9:.1f} GFLOP/s measured matmul peak",
        "matmul at the model's shape (GFLOP/s): "
        + ", ".join(
            f"{k} {v / 1e9:.1f}" for k, v in s["matmul_at_model_shape"]["flop_per_s"].items()
        ),
        _scan.format_table(r["scan"]["results"]),
        f"ratio_vs_scan {_fmt(r['ratio_vs_scan'])}, ratio_vs_scan_remat "
        f"{_fmt(r['ratio_vs_scan_remat'])}, forward_ratio_vs_scan "
        f"{_fmt(r['forward_ratio_vs_scan'])} ({r['scan']['headline']})",
        f"compile_ratio_vs_scan {_fmt(r['compile_ratio_vs_scan'])} "
        + "(trace+lower {:.2f} / {:.2f} s, XLA {:.2f} / {:.2f} s); ".format(
            *(
                r["scan"]["results"][0]["compile_phases_s"][name][phase]
                for phase in ("trace_lower_s", "xla_compile_s")
                for name in ("ocformer_fwd_bwd", "scan_fwd_bwd")
            )
        )
        + f"compile_growth_4_to_64 {_fmt(r['compile_growth_4_to_64'])} "
        f"(layers {r['memory']['compile_growth']['from_layers']} -> "
        f"{r['memory']['compile_growth']['to_layers']})",
        "memory_vs_depth, temp bytes: log-log slopes against layers and steps; "
        "MB per layer and per step:",
        *(
            f"  {k:<42} {v['layers_temp_slope']:6.2f} {v['steps_temp_slope']:6.2f} "
            f"{v['layers_temp_bytes_per_layer'] / 1e6:8.3f} "
            f"{v['steps_temp_bytes_per_step'] / 1e6:8.3f}"
            for k, v in r["memory_vs_depth"].items()
        ),
    ]
    if e2e_lines := format_end_to_end(r.get("end_to_end") or {}):  # "" where not run
        lines.append(e2e_lines)
    return "\n".join(lines)


if __name__ == "__main__":
    main()
