"""An experiment end to end: the training command's wall clock against the time of its
own training steps (``end_to_end_ratio``).

The command runs twice in a persistent compilation cache of its own, first empty (every
program compiled, as in a machine's first run), then again (the programs loaded from the
cache the first run filled, as in every later run of the same shapes). Each run's
``summary.json`` says where the rest of its wall clock went. ``make bench`` runs this
for the default experiment's ``short`` variant; alone it runs any experiment, by
default the full default experiment (what ``make train`` runs):

    python -m benchmarks.end_to_end --json FILE                      # about 16 min on 2 cores
    python -m benchmarks.end_to_end --config experiments/shakespeare_char.py:short --json FILE
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

from ._args import output_file
from ._common import DEFAULT_EXPERIMENT, provenance, write_json


def _run_once(spec: str, cache: str, overrides: Sequence[str]) -> dict:
    with tempfile.TemporaryDirectory() as workdir:
        command = [sys.executable, "-m", "ocformer.train", "--config", spec]
        for o in overrides:
            command += ["--set", o]
        command += ["--workdir", workdir]
        env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
        env["OCFORMER_COMPILE_CACHE"] = cache
        start = time.perf_counter()
        proc = subprocess.run(command, capture_output=True, text=True, env=env)
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            return {
                "error": proc.stderr[-2000:],
                "returncode": proc.returncode,
                "command": " ".join(command[1:]),
            }
        metrics = os.path.join(workdir, "metrics.jsonl")
        records = []
        if os.path.exists(metrics):
            with open(metrics) as f:
                records = [json.loads(line) for line in f if line.strip()]
        rates = [r["steps_per_s"] for r in records if "steps_per_s" in r]
        if not rates:
            # Nothing to compare the wall clock with: the configuration's fault.
            return {
                "error": "error: the run logged no training steps, so it has no step time "
                "to compare its wall clock with; give it train.steps >= 1",
                "returncode": 2,
                "command": " ".join(command[1:]),
            }
        with open(os.path.join(workdir, "summary.json")) as f:
            summary = json.load(f)
    steps = max(r["step"] for r in records)
    train_s = steps / statistics.median(rates)
    val = [r["val_loss"] for r in records if "val_loss" in r]
    return {
        "command": "python " + " ".join(command[1:-1]) + " <tmp>",
        "steps": steps,
        "wall_clock_s": wall,
        "training_steps_s": train_s,
        "median_step_s": 1.0 / statistics.median(rates),
        "ratio": wall / train_s,
        "fixed_costs_s": wall - train_s,
        # Where the wall clock went, from the run's summary.json: the process before
        # train() (interpreter, imports, configuration), then train()'s own parts.
        "time_s": {"before_train": wall - summary["wall_time_s"], **summary["time_s"]},
        "final_val_loss": val[-1] if val else None,
    }


def end_to_end(spec: str = f"{DEFAULT_EXPERIMENT}:short", overrides: Sequence[str] = ()) -> dict:
    """Run the experiment through the command line, as ``make train`` does, and compare
    its wall clock with ``steps / median(steps_per_s)`` from its own metrics log.

    It runs twice, with a persistent compilation cache of its own: first empty (``cold``:
    every program is compiled, as in a machine's first run), then the same command again
    (``warm``: the programs load from the cache the first run filled, as in every later
    run of the same shapes, the cache being on by default). ``overrides``: ``--set``
    arguments of both runs."""
    with tempfile.TemporaryDirectory() as cache:
        _say(f"run 1 of 2, empty compilation cache: {spec}")
        cold = _run_once(spec, cache, overrides)
        _say(_outcome(cold))
        warm = None
        if "error" not in cold:
            _say("run 2 of 2, with the cache run 1 filled")
            warm = _run_once(spec, cache, overrides)
            _say(_outcome(warm))
    return {**cold, "warm_cache": warm}


def _say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] end to end: {text}", file=sys.stderr, flush=True)


def _outcome(run: dict) -> str:
    if "error" in run:
        return "failed"
    return f"{run['steps']} steps in {run['wall_clock_s']:.1f} s, ratio {run['ratio']:.3f}"


def ratio(run: dict | None) -> float | None:
    """An end-to-end run's ratio; None where it did not run or failed."""
    return None if not run or "ratio" not in run else run["ratio"]


def time_split(run: dict) -> str:
    """An end-to-end run's wall clock and where it went."""
    parts = ", ".join(f"{k} {v:.1f}" for k, v in run.get("time_s", {}).items())
    return f"{run['wall_clock_s']:.1f} s wall, {run['training_steps_s']:.1f} s of steps; {parts}"


def format_summary(r: dict) -> str:
    """The two ratios, each with where its run's wall clock went."""
    lines = []
    for key, run, label in (
        ("end_to_end_ratio", r, "empty compilation cache"),
        ("end_to_end_ratio_warm_cache", r.get("warm_cache"), "warm cache"),
    ):
        if run and "ratio" in run:
            lines.append(f"{key} {run['ratio']:.3f} ({label}): {time_split(run)}")
        elif run is not None and "error" in run:
            lines.append(f"{key}: the run failed: {_failure(run)}")
    return "\n".join(lines)


def _failure(run: dict) -> str:
    """A failed run's last line of error output, or its exit status where it wrote none
    (a run killed by a signal, say)."""
    output = run["error"].strip().splitlines()
    code = run["returncode"]
    status = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
    return output[-1] if output else f"{status}, no error output"


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.end_to_end", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--config",
        default=DEFAULT_EXPERIMENT,
        metavar="SPEC",
        help=f"the experiment, as the training command takes it (default {DEFAULT_EXPERIMENT})",
    )
    parser.add_argument(
        "--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
        help="a config override of both runs (repeatable)",
    )  # fmt: skip
    parser.add_argument(
        "--json", metavar="FILE", type=output_file, help="write the result as JSON to FILE"
    )
    args = parser.parse_args(argv)
    started = time.perf_counter()
    result = end_to_end(args.config, args.set)
    report = {
        "benchmark": "the training command end to end, against its own training steps",
        "config": args.config,
        "overrides": args.set,
        "end_to_end_ratio": ratio(result),
        "end_to_end_ratio_warm_cache": ratio(result.get("warm_cache")),
        "end_to_end": result,
        **provenance(started),
    }
    print(format_summary(result))
    if args.json:
        write_json(args.json, report)
    if "error" in result:
        # A configuration the training command refused (exit code 2) is this
        # command's bad argument too.
        sys.exit(2 if result["returncode"] == 2 else 1)
    if "error" in (result.get("warm_cache") or {}):
        sys.exit(1)
    return report


if __name__ == "__main__":
    main()
