"""What every benchmark shares: interleaved timing with medians and spread, the machine
and package versions, the measured matmul peak, and the default experiment's objects."""

import dataclasses
import importlib.metadata
import json
import math
import os
import platform
import re
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from typing import ClassVar, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import ocformer
from ocformer.checkpointing import atomic_write_text
from ocformer.config import Config, resolve
from ocformer.tasks import AbstractTask, DataNotFoundError
from ocformer.training import build_task, make_train_step, with_precision

DEFAULT_EXPERIMENT = "experiments/shakespeare_char.py"
# The vocabulary of the checksummed Shakespeare corpus (its sorted set of characters):
# the stand-in task below uses it when the corpus has not been prepared, so that the
# readout has the size the default experiment trains with.
SHAKESPEARE_VOCAB = 84
# The event jax records for every XLA compilation (jax._src.dispatch).
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


# ---------------------------------------------------------------------------------------
# Timing.


@dataclasses.dataclass
class Candidate:
    """One timed thing: ``run()`` does one call and returns once its results exist."""

    name: str
    run: Callable[[], object]
    compile_s: float | None = None


def summary(times: Sequence[float]) -> dict:
    """Median, quartiles, extremes and count of ``times`` (seconds)."""
    q1, _, q3 = statistics.quantiles(times, n=4) if len(times) > 1 else (times[0],) * 3
    return {
        "median_s": statistics.median(times),
        "q1_s": q1,
        "q3_s": q3,
        "min_s": min(times),
        "max_s": max(times),
        "repeats": len(times),
    }


def time_interleaved(
    candidates: Sequence[Candidate],
    budget_s: float,
    min_repeats: int,
    max_repeats: int,
    warmup: int = 2,
) -> dict[str, dict]:
    """Per candidate, the ``summary`` of one-call times over interleaved rounds.

    Every candidate is called ``warmup`` times first; then rounds call each candidate
    once, in order, until ``budget_s`` is spent (within the repeat bounds), so that drift
    of a shared machine falls on every candidate alike.
    """
    for c in candidates:
        for _ in range(warmup):
            c.run()
    start = time.perf_counter()
    for c in candidates:
        c.run()
    one_round = time.perf_counter() - start
    repeats = int(np.clip(budget_s / max(one_round, 1e-9), min_repeats, max_repeats))
    times: dict[str, list[float]] = {c.name: [] for c in candidates}
    for _ in range(repeats):
        for c in candidates:
            t0 = time.perf_counter()
            c.run()
            times[c.name].append(time.perf_counter() - t0)
    return {name: summary(ts) for name, ts in times.items()}


def aot_compile(jitted, *args, **kwargs):
    """``(compiled, seconds)``: trace, lower and compile ahead of time, so that the
    compile time is its own number."""
    compiled, phases = aot_compile_phases(jitted, *args, **kwargs)
    return compiled, phases["total_s"]


def aot_compile_phases(jitted, *args, **kwargs):
    """``(compiled, phases)``: as ``aot_compile``, with the seconds spent in Python
    (tracing and lowering to StableHLO, ``trace_lower_s``) and in XLA
    (``xla_compile_s``) apart."""
    start = time.perf_counter()
    lowered = jitted.lower(*args, **kwargs)
    lowered_at = time.perf_counter()
    compiled = lowered.compile()
    end = time.perf_counter()
    return compiled, {
        "trace_lower_s": lowered_at - start,
        "xla_compile_s": end - lowered_at,
        "total_s": end - start,
    }


def jax_compiled(compiled) -> jax.stages.Compiled:
    """The ``jax.stages.Compiled`` of an ahead-of-time compilation; ``eqx.filter_jit``
    wraps it (with its argument filtering) in a module holding it as ``.compiled``."""
    return compiled if isinstance(compiled, jax.stages.Compiled) else compiled.compiled


# Bytes per element of the HLO element types a copy can have.
_HLO_ELEMENT_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8,
}  # fmt: skip
_HLO_COPY = re.compile(r"^\s*(?:ROOT\s+)?%\S+ = (\w+)\[([\d,]*)\]\S* copy\(")


def entry_copies(compiled) -> dict:
    """The ``copy`` instructions at the top level of a compiled program (the entry
    computation of XLA's optimised HLO, outside every loop): how many, and the bytes
    they write. A differentiated ``lax.scan`` starts each residual stack from a zero
    array that XLA copies into it (benchmarks/README.md, the stored gradient on the
    CPU); these are those copies, and any others of the program."""
    text = jax_compiled(compiled).as_text() or ""
    start = text.find("\nENTRY ")
    entry = text[start : text.find("\n}", start)] if start >= 0 else ""
    count = nbytes = 0
    for line in entry.splitlines():
        m = _HLO_COPY.match(line)
        if m and m.group(1) in _HLO_ELEMENT_BYTES:
            count += 1
            dims = [int(d) for d in m.group(2).split(",") if d]
            nbytes += _HLO_ELEMENT_BYTES[m.group(1)] * math.prod(dims)
    return {"count": count, "bytes": nbytes}


def log_log_slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """The least-squares slope of log y against log x."""
    slope, _ = np.polyfit(np.log(np.asarray(xs, float)), np.log(np.asarray(ys, float)), 1)
    return float(slope)


# ---------------------------------------------------------------------------------------
# The machine.


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def machine_info() -> dict:
    device = jax.devices()[0]
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    return {
        "cpu_model": _cpu_model(),
        "cpu_cores": os.cpu_count(),
        "cpu_cores_usable": usable_cores(),
        "load_average_1_5_15": load,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "jax_backend": jax.default_backend(),
        "device_kind": device.device_kind,
        "device_count": jax.device_count(),
    }


# The repository holding this package: its git commit is the one measured.
REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _git(*args: str) -> str | None:
    """``git args`` in ``REPOSITORY``, its stdout stripped; ``None`` where git is
    missing or fails."""
    try:
        proc = subprocess.run(
            ["git", *args], cwd=REPOSITORY, capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def git_state() -> dict:
    """``git_commit`` (``git rev-parse HEAD``) and ``git_uncommitted_changes`` (whether
    ``git status --porcelain --untracked-files=no`` lists anything: edits of tracked
    files; the benchmarks' own result files, new in the tree, do not count) of the
    repository measured; both ``None`` where it is not a git checkout of its own (a
    copy of the working tree without ``.git``, which git would otherwise resolve to an
    enclosing repository) or git is missing."""
    top = _git("rev-parse", "--show-toplevel")
    if top is None or os.path.realpath(top) != os.path.realpath(REPOSITORY):
        return {"git_commit": None, "git_uncommitted_changes": None}
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {
        "git_commit": _git("rev-parse", "HEAD"),
        "git_uncommitted_changes": None if status is None else bool(status),
    }


def provenance(started: float | None = None) -> dict:
    """The keys every result file ends with: package versions, the machine, the time,
    the git commit and whether the tree had uncommitted changes (``git_state``), and
    with ``started`` (a ``time.perf_counter()`` reading) the benchmark's wall clock."""
    out = {
        "versions": versions(),
        "machine": machine_info(),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        **git_state(),
    }
    if started is not None:
        out["wall_clock_s"] = time.perf_counter() - started
    return out


def versions() -> dict:
    names = ("jax", "jaxlib", "diffrax", "equinox", "optax", "flax", "numpy")
    out = {n: importlib.metadata.version(n) for n in names}
    try:
        out["torch"] = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        out["torch"] = None
    out["ocformer"] = ocformer.__version__
    return out


def xla_matmul(a, b) -> Callable[[], None]:
    """A call of ``a @ b`` compiled ahead of time by XLA, waiting for its result."""
    matmul = jax.jit(jnp.matmul).lower(a, b).compile()
    return lambda: jax.block_until_ready(matmul(a, b))


def matmul_peak(size: int, budget_s: float, dtype=jnp.float32) -> dict:
    """This machine's measured matmul throughput: the median FLOP/s of ``size``-square
    products (``2 size^3`` FLOPs each) in ``dtype``, on the default JAX device."""
    a = jnp.asarray(np.random.default_rng(0).standard_normal((size, size)), dtype)
    b = jnp.asarray(np.random.default_rng(1).standard_normal((size, size)), dtype)
    stats = time_interleaved([Candidate("matmul", xla_matmul(a, b))], budget_s, 5, 200)["matmul"]
    flops = 2.0 * size**3
    return {
        "size": size,
        "dtype": jnp.dtype(dtype).name,
        "flops_per_call": flops,
        "median_flop_per_s": flops / stats["median_s"],
        "best_flop_per_s": flops / stats["min_s"],
        "timing": stats,
    }


# ---------------------------------------------------------------------------------------
# The default experiment.


class RandomTokens(AbstractTask):
    """Uniform random symbols as a language-modelling task: a stand-in with the shape of
    a real corpus, for timing (the data's content does not change a step's cost)."""

    kind: ClassVar[Literal["lm"]] = "lm"
    num_classes: None = None

    def __init__(self, seq_len: int, vocab_size: int):
        self.seq_len = seq_len
        self.vocab_size = vocab_size

    def batch(self, split: str, index: int, batch_size: int, seed: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng([seed, 0 if split == "train" else 1, index])
        window = rng.integers(0, self.vocab_size, (batch_size, self.seq_len + 1), np.int32)
        return {"inputs": window[:, :-1], "targets": window[:, 1:]}


def experiment_config(overrides: Sequence[str] = ()) -> Config:
    """The default experiment's validated configuration with ``section.field=value``
    overrides (generic dotted names, as on the command line)."""
    return resolve(DEFAULT_EXPERIMENT, ["train.sample_tokens=0", *overrides])


def experiment_task(config: Config, random_tokens: bool = False) -> tuple[AbstractTask, str]:
    """``(task, description)``: the configured task, or random tokens of the Shakespeare
    vocabulary when asked or when the corpus has not been prepared (``make data``)."""
    if not random_tokens:
        try:
            task = build_task(config)
            return task, f"{config.task.name} (vocabulary {task.vocab_size})"
        except DataNotFoundError:
            pass
    task = RandomTokens(config.task.seq_len, SHAKESPEARE_VOCAB)
    return task, f"random tokens, vocabulary {SHAKESPEARE_VOCAB} (the Shakespeare corpus's)"


class CompileCounter:
    """Counts XLA backend compilations while active (``with CompileCounter() as c``):
    a step that is compiled once and then only called leaves ``c.count == 0``."""

    def __init__(self):
        self.count = 0

    def _listener(self, event: str, duration: float, **kwargs) -> None:
        del duration, kwargs
        if event == BACKEND_COMPILE_EVENT:
            self.count += 1

    def __enter__(self) -> "CompileCounter":
        jax.monitoring.register_event_duration_secs_listener(self._listener)
        return self

    def __exit__(self, *exc) -> None:
        jax.monitoring.unregister_event_duration_listener(self._listener)


def loop_step(exp):
    """The training command's step for the experiment ``exp`` (``ocformer.training.
    build``'s): ``make_train_step`` on its objective under the precision policy of
    ``model.precision`` (``with_precision``), its constraints and optimiser, non-finite
    updates discarded inside the step (``skip_nonfinite=True``, as the training loop
    compiles it in both ``train.on_nonfinite`` modes)."""
    return make_train_step(
        with_precision(exp.objective, exp.config),
        exp.constraints,
        exp.optimiser,
        skip_nonfinite=True,
    )


def donated(step, model):
    """``step`` (the loop's) as ``jit((params, opt_state, batch) -> ...)`` with the
    parameter and optimiser-state buffers donated to the update."""
    params, static = eqx.partition(model, eqx.is_array)

    def call(params, opt_state, batch):
        new_model, new_opt, metrics, finite = step(eqx.combine(params, static), opt_state, batch)
        return eqx.filter(new_model, eqx.is_array), new_opt, metrics, finite

    return jax.jit(call, donate_argnums=(0, 1)), params


def write_json(path: str, data) -> None:
    """Write a result file atomically (a temporary file, then ``os.replace``): an
    interrupted benchmark never leaves a half-written JSON that looks complete."""
    atomic_write_text(path, json.dumps(data, indent=2) + "\n")
