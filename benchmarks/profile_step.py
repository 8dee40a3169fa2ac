"""Where the time of one training step goes: a ``jax.profiler`` trace, summarised.

Runs the default experiment's donated training step (as in ``benchmarks.run``: the
training loop's ``make_train_step``, non-finite updates skipped, ``_common.loop_step``)
and the flax reference under ``jax.profiler.trace``, then reads the trace back
(``jax.profiler.ProfileData``) and sums the *self* time (an event's duration minus that
of the events nested in it on the same thread) of every XLA operation over the traced
steps. Each operation is put in a category by what it computes in the optimised HLO:
matrix products (a ``dot`` or ``convolution``, a fusion whose fused computation
contains one, a custom call to a matmul library), then by name the loop machinery
(``while``, ``conditional``, ``call``), data movement (``copy``, ``transpose``,
``dynamic-slice``/``dynamic-update-slice``, ``concatenate``) and the other fusions
(element-wise work and reductions: layer norms, softmax, GELU, the optimiser). A
fusion's name does not say which it is: XLA:CPU hands pure reductions to YNNPACK as
``ynn_fusion``s too. The top operations are listed with the source operation XLA
recorded for them.

Usage::

    python -m benchmarks.profile_step --steps 20 --trace-dir /tmp/trace --json FILE

The trace directory can be opened with TensorBoard's profile plugin or Perfetto.
"""

import argparse
import collections
import glob
import re
import tempfile
from collections.abc import Sequence

import equinox as eqx
import jax
import jax.numpy as jnp

from ocformer.config import ConfigError
from ocformer.training import build

from . import _flax_gpt
from ._args import output_file, positive_int
from ._common import (
    donated,
    experiment_config,
    experiment_task,
    jax_compiled,
    loop_step,
    provenance,
    write_json,
)
from ._gpt import gpt_shape

MATMUL = "matmul"
CATEGORIES = (
    ("loop machinery", re.compile(r"^(while|conditional|call|body|cond)")),
    (
        "data movement",
        re.compile(
            r"^(copy|transpose|dynamic-slice|dynamic-update-slice|concatenate|slice|pad|bitcast|broadcast|reshape|gather|scatter)"
        ),
    ),
)


# Trace events that are not XLA operations: thread-pool bookkeeping, and the executor's
# own spans, which enclose the operations they run (its self time is scheduling).
NOT_OPS = ("ThreadpoolListener", "end: ")
EXECUTOR = "ThunkExecutor"


# An HLO computation's header (``%name (params) -> shape {``, ``ENTRY %name ... {``), an
# instruction's name, and the computations an instruction calls.
_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = ")
_CALLED = re.compile(
    r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)"
    r"|(?:called_computations|branch_computations)=\{([^}]*)\}"
)
_PRODUCT = re.compile(r" (?:dot|convolution)\(")
_MATMUL_TARGET = re.compile(r'custom_call_target="[^"]*(?:matmul|gemm|conv|dot)', re.IGNORECASE)


def _called(line: str) -> list[str]:
    names = []
    for single, listed in _CALLED.findall(line):
        names += [single] if single else [n.strip().lstrip("%") for n in listed.split(",")]
    return [n for n in names if n]


def matmul_ops(hlo_text: str) -> frozenset[str]:
    """The instructions of an optimised HLO module that compute matrix products: a
    ``dot`` or ``convolution``, a fusion whose computation contains one (at any depth
    of nested computations), and a custom call to a matmul library. By content, not
    by name: on XLA:CPU a ``ynn_fusion`` is often a reduction with no product."""
    bodies: dict[str, list[str]] = {}
    lines: list[str] | None = None
    for line in hlo_text.splitlines():
        if m := _COMPUTATION.match(line):
            lines = bodies.setdefault(m.group(1), [])
        elif line.startswith("}"):
            lines = None
        elif lines is not None:
            lines.append(line)

    memo: dict[str, bool] = {}

    def has_product(computation: str) -> bool:
        if computation not in memo:
            memo[computation] = False  # a cycle (there is none in HLO) ends here
            memo[computation] = any(
                _PRODUCT.search(line) or any(has_product(c) for c in _called(line))
                for line in bodies.get(computation, ())
            )
        return memo[computation]

    out = set()
    for body in bodies.values():
        for line in body:
            m = _INSTRUCTION.match(line)
            if m is None:
                continue
            rest = line[m.end() :]
            if (
                _PRODUCT.search(rest)
                or (" fusion(" in rest and any(has_product(c) for c in _called(rest)))
                or (" custom-call(" in rest and _MATMUL_TARGET.search(rest))
            ):
                out.add(m.group(1))
    return frozenset(out)


def category(op: str, matmuls: frozenset[str] = frozenset()) -> str:
    """``op``'s category; ``matmuls``: the names of the instructions that compute matrix
    products (``matmul_ops`` of the compiled program's HLO)."""
    if op.startswith(EXECUTOR):
        return "executor (scheduling, waiting)"
    if op in matmuls:
        return MATMUL
    for name, pattern in CATEGORIES:
        if pattern.match(op):
            return name
    return "other fusions (element-wise, reductions)"


def _hlo_sources(hlo_text: str) -> dict[str, str]:
    """Instruction name -> the ``op_name`` metadata XLA kept for it."""
    out = {}
    for m in re.finditer(r"%?([\w.\-]+) = [^\n]*?metadata=\{[^}]*op_name=\"([^\"]*)\"", hlo_text):
        out.setdefault(m.group(1), m.group(2))
    return out


def _self_times_of_line(events, totals) -> None:
    stack: list[list] = []  # [start, end, name, nested time]

    def pop():
        start, end, name, nested = stack.pop()
        totals[name] += (end - start - nested) * 1e-9
        if stack:
            stack[-1][3] += end - start

    for start, end, name in sorted(events):
        while stack and stack[-1][1] <= start:
            pop()
        stack.append([start, end, name, 0])
    while stack:
        pop()


def _self_times(path: str) -> dict[str, float]:
    """Per event name, its summed self time in seconds, over the XLA threads."""
    data = jax.profiler.ProfileData.from_file(path)
    totals: dict[str, float] = collections.defaultdict(float)
    for plane in data.planes:
        for line in plane.lines:
            if "XLA" in line.name:
                events = [
                    (e.start_ns, e.start_ns + e.duration_ns, e.name)
                    for e in line.events
                    if e.duration_ns > 0 and not e.name.startswith(("ThreadpoolListener", "end: "))
                ]
                _self_times_of_line(events, totals)
    return dict(totals)


def profile(step, state: tuple, fixed: tuple, n_state: int, steps: int, trace_dir: str) -> dict:
    for _ in range(2):  # warm up
        out = step(*state, *fixed)
        jax.block_until_ready(out)
        state = tuple(out[:n_state])
    with jax.profiler.trace(trace_dir):
        for _ in range(steps):
            out = step(*state, *fixed)
            jax.block_until_ready(out)
            state = tuple(out[:n_state])
    (path,) = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
    return _self_times(path)


def summarise(
    times: dict[str, float],
    sources: dict[str, str],
    matmuls: frozenset[str],
    steps: int,
    top: int,
) -> dict:
    per_step = {k: v / steps for k, v in times.items() if not k.startswith(EXECUTOR)}
    total = sum(per_step.values())
    by_category: dict[str, float] = collections.defaultdict(float)
    for op, t in per_step.items():
        by_category[category(op, matmuls)] += t
    ranked = sorted(per_step.items(), key=lambda kv: -kv[1])[:top]
    return {
        "op_time_per_step_s": total,
        "executor_self_time_per_step_s": sum(
            v / steps for k, v in times.items() if k.startswith(EXECUTOR)
        ),
        "by_category": {k: {"s": v, "fraction": v / total} for k, v in by_category.items()},
        "top_ops": [
            {
                "op": op,
                "s": t,
                "fraction": t / total,
                "category": category(op, matmuls),
                "source": sources.get(op, ""),
            }
            for op, t in ranked
        ],
    }


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.profile_step")
    parser.add_argument("--steps", type=positive_int, default=20)
    parser.add_argument("--top", type=positive_int, default=15)
    parser.add_argument("--trace-dir", default=None)
    parser.add_argument("--json", metavar="FILE", type=output_file)
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    args = parser.parse_args(argv)

    try:
        config = experiment_config(args.set)
    except ConfigError as e:
        parser.error(str(e))
    task, task_name = experiment_task(config)
    exp = build(config, task=task)
    batch = {
        k: jnp.asarray(v) for k, v in task.batch("train", 0, config.task.batch_size, 0).items()
    }
    jitted, params = donated(loop_step(exp), exp.model)
    opt_state = exp.optimiser.init(eqx.filter(exp.model, eqx.is_inexact_array))
    oc = jitted.lower(params, opt_state, batch).compile()

    gpt = _flax_gpt.GPT(gpt_shape(config, task.vocab_size))
    flax_params = _flax_gpt.params_from_ocformer(exp.model)
    flax_opt = exp.optimiser.init(flax_params)
    fx = _flax_gpt.make_train_step(gpt, exp.optimiser).lower(flax_params, flax_opt, batch).compile()

    report = {"task": task_name, "steps": args.steps, "overrides": args.set}
    base = args.trace_dir or tempfile.mkdtemp(prefix="ocformer-trace-")
    for name, compiled, state in (
        ("ocformer", oc, (params, opt_state)),
        ("flax", fx, (flax_params, flax_opt)),
    ):
        times = profile(compiled, state, (batch,), 2, args.steps, f"{base}/{name}")
        hlo = jax_compiled(compiled).as_text()
        report[name] = summarise(times, _hlo_sources(hlo), matmul_ops(hlo), args.steps, args.top)
    report["trace_dir"] = base
    report.update(provenance())
    print(f"trace: {base} (open with TensorBoard's profile plugin or ui.perfetto.dev)")
    for name in ("ocformer", "flax"):
        r = report[name]
        print(f"== {name}: {1e3 * r['op_time_per_step_s']:.2f} ms of XLA op time per step")
        for cat, v in sorted(r["by_category"].items(), key=lambda kv: -kv[1]["s"]):
            print(f"   {cat:<42} {1e3 * v['s']:7.2f} ms  {100 * v['fraction']:5.1f} %")
        for op in r["top_ops"]:
            print(
                f"   {op['op']:<28} {1e3 * op['s']:7.3f} ms {100 * op['fraction']:5.1f} %  "
                f"{op['source'][-90:]}"
            )
    if args.json:
        write_json(args.json, report)
    return report


if __name__ == "__main__":
    main()
