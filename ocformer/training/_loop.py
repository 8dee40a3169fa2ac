r"""The training loop: minimise $J(\theta)$ over the controls, checkpointed and resumable.

Resuming is exact because everything a step depends on is either restored or a pure
function of the step index: parameters, optimiser state, step, PRNG key and the count
of skipped updates are in the checkpoint, and batch $n$ is
``task.batch("train", n, batch_size, seed)`` (``train_batches``). Everything the run
writes goes through one ``RunDirectory``.

On a mesh of several devices (``config.mesh``, ``ocformer.distributed.Layout``) the
same loop runs with the batch split over ``data`` and the controls over ``model``. In
a run of several processes every process runs it: each makes only its own rows of
batch $n$ (``task.batch_rows``) and transfers them to its devices, process 0 alone
writes logs and samples, checkpoints are written together, and a stop on SIGTERM is
agreed at the same step by all of them.

The loop does not wait for the device between steps: batches are prepared ahead by a
background thread (``_Prefetch``, in order, placed on the devices), the learning rate
is computed on the device from the optimiser state, and the metrics and finiteness
flags of each step stay on the device until a step that logs, evaluates, checkpoints
or stops, where they are fetched and checked. A single process checks its SIGTERM
flag after every step; several processes agree on it every ``train.stop_check_every``
steps, the only steps at which they wait for each other outside the step's own
program. A non-finite update is discarded inside
the compiled step in both ``train.on_nonfinite`` modes, so no state the loop holds,
and no checkpoint, ever contains it; with ``abort`` the run stops at the next such
step naming the first non-finite update, before anything of a later step is written.
"""

import contextlib
import math
import os
import queue
import shlex
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from tqdm.auto import tqdm

from ..config import Config, from_dict, unread_fields, validate
from ..distributed import Layout, is_primary
from ..objective import MixedPrecision
from ..tasks import AbstractTask, AbstractTextTask, Digits, Tokens
from ._build import Experiment, build, build_from_own_checkpoint
from ._depth_fallback import DepthFallback, carry_state
from ._errors import NonFiniteError, Preempted, SolverFailure
from ._init_from import check_admissible, warn_of_tokenizer_mismatch
from ._optimiser import make_schedule, with_schedule
from ._preempt import PreemptionGuard
from ._rundir import RunDirectory
from ._step import (
    FINITE_SOURCES,
    enable_compile_cache,
    make_bias_step,
    make_eval_step,
    make_msa_step,
    make_train_step,
    validation_metrics,
)

# Batches prepared ahead of the step that uses them.
PREFETCH_DEPTH = 4


class _State(eqx.Module):
    """What a checkpoint holds (the arrays; the model's static parts come from the
    configuration)."""

    params: object
    opt_state: object
    key: Any
    step: Any
    skipped: Any


def _to_tree(model, opt_state, key, step: int, skipped: int) -> _State:
    return _State(
        params=eqx.filter(model, eqx.is_array),
        opt_state=opt_state,
        key=np.asarray(jr.key_data(key)),
        step=np.asarray(step, np.int64),
        skipped=np.asarray(skipped, np.int64),
    )


def _initial_tree(exp: Experiment) -> _State:
    opt_state = exp.init_state(exp.model)
    return _to_tree(exp.model, opt_state, jr.fold_in(jr.key(exp.config.train.seed), 1), 0, 0)


def _from_tree(exp: Experiment, tree: _State):
    """(model, opt_state, key, step, skipped) from a restored checkpoint tree."""
    model = eqx.combine(jax.tree.map(jnp.asarray, tree.params), exp.model)
    opt_state = jax.tree.map(jnp.asarray, tree.opt_state)
    key = jr.wrap_key_data(jnp.asarray(tree.key))
    return model, opt_state, key, int(tree.step), int(tree.skipped)


def _announce_schedule(previous: dict, config: Config, step: int, skipped: int) -> None:
    """Say how the learning rate of the next update changes under a new configuration."""
    try:
        old = from_dict(previous)
    except ValueError:
        return  # a configuration of another schema: the change list already said it
    if config.train.method == "msa" or old.train.method == "msa":
        return  # msa follows no schedule (the optimiser section is gradient training's)
    applied = step - skipped  # the schedule advances on applied updates only
    old_lr = float(np.asarray(make_schedule(old.optimiser, old.train.steps)(applied)))
    new_lr = float(np.asarray(make_schedule(config.optimiser, config.train.steps)(applied)))
    if old_lr != new_lr:
        print(
            f"ocformer: the learning-rate schedule changes at step {step + 1}: lr "
            f"{old_lr:.3e} -> {new_lr:.3e} (optimiser or train.steps changed)",
            flush=True,
        )


def with_precision(objective, config: Config):
    """``objective`` under the precision policy of ``config.model``: unchanged when
    the compute dtype is the parameters' (``model.precision`` unset or equal to
    ``model.dtype``), else a ``MixedPrecision`` that computes in ``model.precision``."""
    precision = config.model.precision
    if precision is None or precision == config.model.dtype:
        return objective
    return MixedPrecision(objective, precision)


class _Prefetch:
    """Batches ``first .. last - 1`` of ``produce`` made in order by a background thread,
    at most ``depth`` ahead of the loop.

    ``get(n)`` returns batch ``n`` (the batches are asked for in order) and adds the
    time it waited to ``wait_s``; an exception of ``produce`` is raised there, in the
    loop's thread. ``close`` stops the thread (also while it waits on a full queue).
    """

    def __init__(self, produce: Callable[[int], Any], first: int, last: int, depth: int):
        self.produce, self.first, self.last = produce, first, last
        self.queue: queue.Queue = queue.Queue(maxsize=max(depth, 1))
        self.stopped = threading.Event()
        self.wait_s = 0.0
        self.thread = threading.Thread(target=self._run, name="ocformer-prefetch", daemon=True)
        self.inline = depth == 0  # no thread: each batch is made when asked for
        if not self.inline:
            self.thread.start()

    def _put(self, item) -> bool:
        while not self.stopped.is_set():
            try:
                self.queue.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        for n in range(self.first, self.last):
            try:
                item = (n, self.produce(n), None)
            except BaseException as e:  # handed to the loop, raised there
                self._put((n, None, e))
                return
            if not self._put(item):
                return

    def get(self, n: int):
        t = time.perf_counter()
        if self.inline:
            try:
                return self.produce(n)
            finally:
                self.wait_s += time.perf_counter() - t
        got, batch, error = self.queue.get()
        self.wait_s += time.perf_counter() - t
        if error is not None:
            raise error
        assert got == n, f"prefetched batch {got} where batch {n} was due"
        return batch

    def close(self) -> None:
        self.stopped.set()
        while True:  # unblock a producer waiting on a full queue
            try:
                self.queue.get_nowait()
            except queue.Empty:
                break
        if not self.inline:
            self.thread.join(timeout=10.0)

    def __enter__(self) -> "_Prefetch":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Pending:
    """The steps run since the last check: their finiteness flags, still on the device,
    and the metrics of the newest. ``check`` fetches them in order."""

    def __init__(self):
        self.flags: list[tuple[int, Any]] = []
        self.metrics: dict = {}

    def add(self, step: int, finite, metrics: dict) -> None:
        self.flags.append((step, finite))
        self.metrics = metrics

    def check_finished(self) -> None:
        """Wait for the newest step to finish (raising ``SolverFailure`` if it failed)."""
        if self.flags:
            step, finite = self.flags[-1]
            try:
                jax.block_until_ready(finite)
            except eqx.EquinoxRuntimeError as e:
                raise SolverFailure.from_error(step, e) from None

    def check(self) -> tuple[list[tuple[int, str]], dict]:
        """``(bad, metrics)``: the non-finite steps with their first non-finite source,
        in order, and the newest step's metrics as floats.

        Raises:
            SolverFailure: naming the first step whose solve failed.
        """
        bad = []
        for step, finite in self.flags:
            try:
                flags = np.asarray(finite)
            except eqx.EquinoxRuntimeError as e:
                raise SolverFailure.from_error(step, e) from None
            if not flags.all():
                bad.append((step, FINITE_SOURCES[int(np.argmin(flags))]))
        last = self.flags[-1][0] if self.flags else None
        try:
            metrics = {k: float(v) for k, v in jax.device_get(self.metrics).items()}
        except eqx.EquinoxRuntimeError as e:
            raise SolverFailure.from_error(last or 0, e) from None
        self.flags, self.metrics = [], {}
        return bad, metrics


class _Profile:
    """A ``jax.profiler`` trace of steps ``A+1 .. B`` (``train.profile_steps="A:B"``) in
    ``DIR/profile``: started before step A+1 is dispatched, stopped once step B's
    results exist. A run resumed inside the window traces what is left of it; one that
    stops inside it keeps the trace of the steps it ran; both are said on stdout."""

    def __init__(self, text: str | None, directory: str, active: bool, start: int, end: int):
        self.span = None if text is None or not active else tuple(map(int, text.split(":")))
        self.directory, self.running, self.first, self.last = directory, False, None, None
        if self.span is not None and self.span[1] <= start < end:  # steps left, none traced
            print(
                f"ocformer: train.profile_steps={text}: the run resumes after step "
                f"{start}, past the window, so nothing is traced",
                flush=True,
            )

    def before(self, step: int) -> None:
        """Called with the number of the step about to run."""
        if self.span is None or self.running or self.first is not None:
            return
        a, b = self.span
        if a < step <= b:
            if step > a + 1:
                print(
                    f"ocformer: train.profile_steps={a}:{b}: the run resumes inside the "
                    f"window; tracing steps {step}..{b}",
                    flush=True,
                )
            jax.profiler.start_trace(self.directory)
            self.running, self.first = True, step

    def after(self, step: int, state) -> None:
        if not self.running:
            return
        self.last = step
        if self.span is not None and step == self.span[1]:
            jax.block_until_ready(state)
            self.stop()

    def stop(self) -> None:
        if not self.running:
            return
        self.running = False
        jax.profiler.stop_trace()
        if self.span is not None and self.last != self.span[1]:
            ran = "no step" if self.last is None else f"steps {self.first}..{self.last}"
            print(
                f"ocformer: the run stopped inside train.profile_steps={self.span[0]}:"
                f"{self.span[1]}: the trace in {self.directory} holds {ran}",
                flush=True,
            )


class _Evaluation:
    """The fixed validation set, the compiled evaluation step and text sampling."""

    def __init__(self, exp: Experiment, layout: Layout, model):
        task, tc, t = exp.task, exp.config.train, exp.config.task
        batches = task.eval_batches(t.eval_batch_size, t.eval_batches, exp.config.eval_seed)
        self.evaluate = make_eval_step(with_precision(exp.objective, exp.config))
        if layout.active:
            self.batches = [layout.put_replicated(b) for b in batches]
            self.evaluate = layout.compile_eval_step(self.evaluate, model)
        else:
            self.batches = [{k: jnp.asarray(v) for k, v in b.items()} for b in batches]
        self.task, self.tc, self.layout, self.template = task, tc, layout, exp.model
        self.ternary = exp.objective.ternary

    def __call__(self, model, step: int) -> dict:
        try:
            recs = [{k: float(v) for k, v in self.evaluate(model, b).items()} for b in self.batches]
        except eqx.EquinoxRuntimeError as e:
            raise SolverFailure.from_error(step, e) from None
        return validation_metrics(recs)

    def sample(self, model, key, step: int) -> str | None:
        if not (isinstance(self.task, AbstractTextTask) and self.tc.sample_tokens):
            return None
        if self.layout.processes > 1:
            # The arrays span processes: every process gathers them, process 0 samples.
            params = self.layout.to_host(eqx.filter(model, eqx.is_array))
            if not is_primary():
                return None
            model = eqx.combine(jax.tree.map(jnp.asarray, params), self.template)
        if self.ternary is not None:  # the kernels the objective computes with, as it does
            model = self.ternary.straight_through(model)
        prompt = self.task.encode(self.tc.sample_prompt)
        try:  # a solve of its own, at sequence lengths the training never ran
            tokens = model.generate(
                jr.fold_in(key, step),
                prompt,
                self.tc.sample_tokens,
                self.tc.sample_temperature,
                vocab_size=self.task.vocab_size,
            )
            tokens = np.asarray(tokens)
        except eqx.EquinoxRuntimeError as e:
            raise SolverFailure.from_error(step, e) from None
        # Decoded with the prompt: a subword's join to what precedes it (WordPiece's
        # '##') is the tokenizer's to undo, which it can only do for the whole text.
        return self.task.decode(np.concatenate([np.asarray(prompt), tokens]))


_untimed = contextlib.nullcontext()


class _Timings:
    """Where a run's wall time goes: seconds per part of the loop, summed over its
    spans; ``report`` adds ``setup`` and ``steps`` (the loop's remaining time)."""

    PARTS = ("setup", "step_compilation", "steps", "evaluation", "sampling", "checkpoints")

    def __init__(self):
        spanned = [p for p in self.PARTS if p not in ("setup", "steps")]
        self.seconds: dict[str, float] = dict.fromkeys(spanned, 0.0)

    def add(self, part: str, seconds: float) -> None:
        self.seconds[part] += seconds

    @contextlib.contextmanager
    def span(self, part: str):
        t = time.perf_counter()
        try:
            yield
        finally:
            self.add(part, time.perf_counter() - t)

    def report(self, setup_s: float, loop_s: float) -> dict:
        """``{part: seconds}`` in the order of ``PARTS``: ``setup`` up to the loop,
        ``steps`` the loop's time outside the other parts (its steps and its own work
        between them)."""
        rest = {"setup": setup_s, "steps": max(loop_s - sum(self.seconds.values()), 0.0)}
        return {p: {**self.seconds, **rest}[p] for p in self.PARTS}


class _Throughput:
    """Training steps and units (tokens or examples) per second between two logs."""

    def __init__(self, units_per_step: int, name: str):
        self.units, self.name = units_per_step, name
        self.restart()

    def restart(self) -> None:
        self.t, self.steps = time.perf_counter(), 0

    def exclude(self, seconds: float) -> None:
        """Leave ``seconds`` (spent on something else, e.g. a checkpoint) out of this
        window."""
        self.t += seconds

    def rate(self) -> dict:
        now = time.perf_counter()
        steps_per_s = self.steps / max(now - self.t, 1e-9)
        self.t, self.steps = now, 0
        return {"steps_per_s": steps_per_s, self.name: steps_per_s * self.units}


def train(
    config: Config,
    workdir: str | os.PathLike,
    *,
    argv: list[str] | None = None,
    allow_config_change: bool = False,
) -> dict:
    """Train ``config`` in ``workdir``, resuming from its last committed checkpoint.

    ``workdir`` is a ``RunDirectory``: created (or an empty directory claimed), or an
    ocformer work directory resumed with the configuration it holds.

    Args:
        config: the run; validated once, before anything is built, traced or written.
        workdir: the output directory.
        argv: the command line, recorded for reproduction.
        allow_config_change: resume even if ``config`` differs from the stored one;
            the change is recorded in ``config_history.jsonl`` and a change of the
            learning rate is announced.

    Returns:
        A summary, also written to ``summary.json`` (a rerun of a finished run keeps
        the summary of the run that did the steps): ``step``,
        ``loss`` (last training loss), ``val_loss``, ``val_accuracy``,
        ``skipped_steps``, ``wall_time_s``,
        ``time_s`` (``wall_time_s`` by part: ``setup``, ``step_compilation``,
        ``steps``, ``evaluation``, ``sampling``, ``checkpoints``), ``data_wait_fraction``
        (the share of the loop's wall time spent waiting for a batch),
        ``resumed_from``, ``workdir`` and the paths of the outputs that exist (None
        for the others).

    Raises:
        ConfigError: invalid configuration (nothing built, traced or written).
        WorkdirError: an unusable work directory, or one that is not ocformer's.
        ConfigChanged: resuming with another configuration (nothing written).
        ocformer.tasks.DataNotFoundError: missing data.
        ocformer.checkpointing.CheckpointError: a corrupted or mismatched checkpoint.
        SolverFailure: a diffrax solve failed.
        NonFiniteError: NaN/Inf with ``train.on_nonfinite="abort"``.
        Preempted: SIGTERM; a checkpoint was written first.
    """
    validate(config)
    enable_compile_cache()  # effective if nothing was compiled before in this process
    started = time.perf_counter()
    layout = Layout(config)  # a mesh larger than the devices is refused here
    run = RunDirectory(
        workdir, primary=is_primary(), barrier=layout.barrier, any_process=layout.any_process
    )
    changes = run.check(config, allow_config_change=allow_config_change)
    exp = _build_for(run, config, layout)
    with run:
        resumed_from, state = _start(exp, config, run, layout, changes, argv)
        loop = _Loop(exp, config, run, layout, *state)
        loop.run()
        last = loop.last
        if not last:  # nothing left to do: report the run's last record
            history = run.metrics.read()
            last = history[-1] if history else {}
        summary = {
            "step": loop.step,
            "loss": last.get("loss"),
            "val_loss": last.get("val_loss"),
            "val_accuracy": last.get("val_accuracy"),
            "skipped_steps": loop.skipped,
            "wall_time_s": time.perf_counter() - started,
            "time_s": loop.timings.report(loop.started - started, loop.seconds),
            "data_wait_fraction": loop.wait_fraction(),
            "resumed_from": resumed_from,
            "workdir": run.path,
            **run.outputs(),
        }
        run.finish(summary)
    if is_primary():
        _print_summary(summary)
        if loop.skipped:
            print(
                f"ocformer: warning: {loop.skipped} of the run's {loop.step} updates were "
                "non-finite and skipped (train.on_nonfinite=skip): the parameters are those "
                "of the last update applied. Lower optimiser.learning_rate or clip the "
                "gradient (optimiser.clip_norm), or stop at the first with "
                "train.on_nonfinite=abort",
                file=sys.stderr,
                flush=True,
            )
    return summary


def _build_for(run: RunDirectory, config: Config, layout: Layout) -> Experiment:
    """The run's objects. A run that resumes takes its parameters from its own
    checkpoint (``build_from_own_checkpoint``: ``run.json`` carries the first start's
    record of its source over)."""
    if is_primary():
        for field, why in unread_fields(config).items():
            print(
                f"ocformer: warning: {field} is set but not read: {why}",
                file=sys.stderr,
                flush=True,
            )
    resuming = run.resumable()
    exp = (
        build_from_own_checkpoint(config, run.path, mesh=layout.mesh)
        if resuming
        else build(config, mesh=layout.mesh)
    )
    if is_primary():
        _warn_of_repeated_windows(config, exp.task)
    if resuming:
        return exp
    if config.model.init_from is not None:
        check_admissible(config, exp.model, exp.constraints)
    if is_primary():
        warn_of_tokenizer_mismatch(config, exp.task)
    return exp


def _warn_of_repeated_windows(config: Config, task) -> None:
    """A validation set of more windows (images) than the validation split holds
    repeats some: said, with what to change."""
    t = config.task
    if isinstance(task, Digits):
        drawn, held = t.eval_batches * t.eval_batch_size, len(task.splits["validation"][1])
        if drawn > held:
            print(
                f"ocformer: warning: the validation set takes {drawn} images of the {held} "
                f"held out: {drawn - held} of them count twice or more. Set task.eval_batches "
                f"x task.eval_batch_size to {held} (3 x 99) for each image once",
                file=sys.stderr,
                flush=True,
            )
        return
    if not isinstance(task, Tokens):
        return
    drawn, held = t.eval_batches * t.eval_batch_size, task.windows("validation")
    if drawn > held:
        print(
            f"ocformer: warning: the validation set draws {drawn} windows of "
            f"{t.seq_len + 1} tokens from {task.dataset.file('validation')}, which holds "
            f"{held} distinct one{'' if held == 1 else 's'}: windows repeat, and the "
            "validation loss weighs them by chance. Lower task.eval_batches or "
            "task.eval_batch_size, or prepare more text",
            file=sys.stderr,
            flush=True,
        )


def _start(exp: Experiment, config: Config, run: RunDirectory, layout: Layout, changes, argv):
    """Start the run in ``run`` or resume it: ``(resumed_from, (model, opt_state, key,
    step, skipped, fallback))``, on the devices of ``layout``, the optimiser state with
    the schedule of ``config`` (a resumed run may have changed it; the count of applied
    updates comes from the checkpoint)."""
    tc = config.train
    initial = _initial_tree(exp)
    resumed_from, restored = run.start(
        config,
        initial,
        keep_checkpoints=tc.keep_checkpoints,
        changes=changes,
        argv=argv,
        init_from=exp.init_from,
    )
    model, opt_state, key, step, skipped = _from_tree(exp, restored or initial)
    fallback = DepthFallback(tc, model)
    if resumed_from is not None:  # the solve that earlier fallbacks left
        fallback.replay(run.metrics.read(), step)
        if run.records_missing and fallback.watches and is_primary():
            k = fallback.iterations
            solve = f"with {k} iteration{'' if k == 1 else 's'}" if k else "serially"
            print(
                "ocformer: warning: the depth fallback's state (train.depth_fallback) is "
                "read from metrics.jsonl, which misses records of this run: the solve "
                f"resumes {solve}, which may not be how the run solved at step "
                f"{step}. If a fallback had fired, give its solve (discretisation.iterations, "
                "or discretisation.depth_parallel=none) with --allow-config-change",
                file=sys.stderr,
                flush=True,
            )
        model, old = fallback.solve(model), model
        opt_state = carry_state(opt_state, old, model)
    opt_state = with_schedule(opt_state, config.optimiser, tc.steps)
    if layout.active:
        # Checkpoints hold whole arrays: any mesh restores any other's.
        model, opt_state = layout.put_model(model), layout.put_state(opt_state, model)
    if resumed_from is not None:
        print(f"ocformer: resuming {run.path} from step {step}", flush=True)
        if changes:
            listed = "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in changes.items())
            print(
                f"ocformer: the configuration changes at step {step + 1} (recorded in "
                f"config_history.jsonl): {listed}",
                flush=True,
            )
            _announce_schedule(run.stored_config or {}, config, step, skipped)
    return resumed_from, (model, opt_state, key, step, skipped, fallback)


class _Loop:
    """The training loop from ``step`` to ``train.steps``: the state it advances
    (model, optimiser state, step, skipped updates, the compiled programs of the
    current solve) and, at each step, the update and what the step is due for (a log
    record, an evaluation with a sample, a checkpoint, a stop)."""

    bar: Any  # the progress bar, and the batches prepared ahead, of the running loop
    prefetch: _Prefetch

    def __init__(
        self, exp: Experiment, config: Config, run: RunDirectory, layout: Layout,
        model, opt_state, key, step: int, skipped: int, fallback: DepthFallback,
    ):  # fmt: skip
        self.exp, self.config, self.tc = exp, config, config.train
        self.directory, self.layout = run, layout
        self.model, self.opt_state, self.key = model, opt_state, key
        self.step, self.skipped, self.fallback = step, skipped, fallback
        # Non-finite updates are discarded inside the step in both modes (see the
        # module docstring); "abort" stops at the next check.
        if exp.method is None:
            self.step_fn = make_train_step(
                with_precision(exp.objective, config), exp.constraints, exp.optimiser,
                skip_nonfinite=True,
            )  # fmt: skip
        else:
            self.step_fn = make_msa_step(
                exp.objective, exp.constraints, exp.method, skip_nonfinite=True
            )
        self.bias_fn = make_bias_step(with_precision(exp.objective, config))
        self.train_step, self.bias_step, self.evaluation = self._compiled_steps()
        lm = exp.task.kind == "lm"
        units = config.task.batch_size * (exp.task.seq_len if lm else 1)
        self.throughput = _Throughput(units, "tok_per_s" if lm else "ex_per_s")
        self.last: dict = {}  # the newest fetched record
        self.pending = _Pending()
        self.profile = _Profile(
            self.tc.profile_steps,
            os.path.join(run.path, "profile"),
            is_primary(),
            step,
            self.tc.steps,
        )
        self.several = layout.processes > 1
        self.timings = _Timings()
        self.first_step = step + 1  # its call traces and compiles the step (or loads it)
        self.started = self.seconds = 0.0

    def _compiled_steps(self):
        """The training, bias and evaluation steps of the model's solve (on a mesh the
        programs hold the model's static part, so a fallback recompiles)."""
        layout, model = self.layout, self.model
        if not layout.active:
            return self.step_fn, self.bias_fn, _Evaluation(self.exp, layout, model)
        return (
            layout.compile_train_step(self.step_fn, model, self.opt_state),
            layout.compile_bias_step(self.bias_fn, model),
            _Evaluation(self.exp, layout, model),
        )

    def run(self) -> None:
        """Run the remaining steps; ``seconds`` is then the loop's wall time."""
        tc = self.tc
        quiet = not (tc.progress and is_primary())
        self.bar = tqdm(total=tc.steps, initial=self.step, disable=quiet, desc="train",
                        dynamic_ncols=True, file=sys.stderr)  # fmt: skip
        produce = train_batches(self.exp.task, self.layout, self.config.task.batch_size, tc.seed)
        self.started = time.perf_counter()
        # Batches are only placed on the devices (no program runs), so a run of several
        # processes prefetches them too.
        self.prefetch = _Prefetch(produce, self.step, tc.steps, PREFETCH_DEPTH)
        guard = PreemptionGuard(tc.preempt_grace_s, self._resume_point)
        with self.bar, self.prefetch, guard:
            try:
                while self.step < tc.steps:
                    self._next(guard)
            finally:
                self.profile.stop()
        self.seconds = time.perf_counter() - self.started

    def _resume_point(self) -> str:
        """Where a rerun of the run resumes: its newest committed checkpoint, as the run
        knows it (no file system access: the grace period may be running out on a
        stalled one)."""
        checkpoint = self.directory.checkpoint
        if checkpoint is None:
            return "No checkpoint was committed yet: a rerun starts from step 0."
        return f"The newest committed checkpoint, {checkpoint}, is the resume point."

    def wait_fraction(self) -> float:
        """The share of the loop's wall time spent waiting for a batch."""
        elapsed = self.seconds or time.perf_counter() - self.started
        return self.prefetch.wait_s / elapsed if elapsed > 0 else 0.0

    def _next(self, guard: PreemptionGuard) -> None:
        """One step: the update, then what the step is due for."""
        guard.check_interrupted()
        tc = self.tc
        batch = self.prefetch.get(self.step)
        self.step += 1
        step = self.step
        self.profile.before(step)
        biased = self._bias(batch)
        self._update(batch)
        evaluated = step % tc.eval_every == 0 or step == tc.steps
        logged = evaluated or step % tc.log_every == 0 or biased is not None
        query, stopping = self._stop(guard)
        saving = step % tc.checkpoint_every == 0 or step == tc.steps or stopping
        if logged or saving or query:
            self._fetch()
        if logged:
            self._log(biased, evaluated, guard)
        self.bar.update(1)
        if saving:
            with guard.holding_interrupts():
                self._save()
        if stopping:
            raise Preempted(step, self.directory.checkpoint)

    def _bias(self, batch):
        """The bias of the depth-parallel gradient at this step's parameters and batch,
        before the update; None at a step that does not check it."""
        every = self.tc.depth_bias_every
        if not (self.fallback.parallel and every and self.step % every == 0):
            return None
        try:
            return self.bias_step(self.model, batch)
        except eqx.EquinoxRuntimeError as e:
            raise SolverFailure.from_error(self.step, e) from None

    def _update(self, batch) -> None:
        """Dispatch the step's update; its metrics and finiteness flags stay pending on
        the device."""
        try:
            first = self.step == self.first_step
            with self.timings.span("step_compilation") if first else _untimed:
                self.model, self.opt_state, metrics, finite = self.train_step(
                    self.model, self.opt_state, batch
                )
        except eqx.EquinoxRuntimeError as e:
            raise SolverFailure.from_error(self.step, e) from None
        self.pending.add(self.step, finite, metrics)
        self.profile.after(self.step, (self.model, self.opt_state))
        self.throughput.steps += 1

    def _stop(self, guard: PreemptionGuard) -> tuple[bool, bool]:
        """``(query, stopping)``: whether the processes agree on stopping at this step,
        and whether the run stops after it.

        Every process stops at the same step (a checkpoint is written together): they
        agree on it every ``stop_check_every`` steps, after this step's program has
        finished everywhere (the query is a program across processes too, which must
        not overlap a step's). In between, their steps are dispatched without waiting.
        """
        query = self.several and self.step % self.tc.stop_check_every == 0
        if query:
            self.pending.check_finished()
            stopping = self.layout.any_process(guard.requested)
        else:
            stopping = guard.requested and not self.several
        return query, stopping and self.step < self.tc.steps

    def _fetch(self) -> None:
        """Fetch the pending steps' flags and the newest metrics into ``last``; a
        non-finite update aborts the run under ``on_nonfinite=abort`` and is counted
        as skipped otherwise (it was discarded inside the step)."""
        bad, values = self.pending.check()
        if bad and self.tc.on_nonfinite == "abort":
            clip = self.config.optimiser.clip_norm if self.exp.method is None else None
            raise NonFiniteError(bad[0][0], bad[0][1], self.directory.checkpoint, clip)
        self.skipped += len(bad)
        # The learning rate this update used (the schedule advances on applied updates
        # only).
        this_skipped = bool(bad) and bad[-1][0] == self.step
        applied = self.step - 1 - (self.skipped - int(this_skipped))
        if self.tc.method == "msa":  # no optimiser, no schedule: its inner rate, constant
            lr = self.tc.msa_inner_learning_rate
        else:
            lr = float(np.asarray(self.exp.schedule(applied)))
        self.last = {"step": self.step, **values, "skipped_steps": self.skipped, "lr": lr}

    def _log(self, biased, evaluated: bool, guard: PreemptionGuard) -> None:
        """Write the step's record: throughput, the depth-parallel bias, an evaluation
        with its sample, and the depth fallback they may call for. A Ctrl-C during a
        write comes at its end (``holding_interrupts``): TensorBoard's writer hands its
        events to a thread, and an interrupt inside that hand-over can lose the wake-up
        of the thread, whose close then waits for ever."""
        step, last = self.step, self.last
        # Training throughput only: measured before evaluation and sampling, whose time
        # is then excluded from the next window (as a checkpoint's is, in _save).
        rate = self.throughput.rate()
        rate["data_wait_fraction"] = self.wait_fraction()
        reason = None
        if biased is not None:
            try:  # the serial reference solve's failure shows here first
                last.update({k: float(v) for k, v in jax.device_get(biased).items()})
            except eqx.EquinoxRuntimeError as e:
                raise SolverFailure.from_error(step, e) from None
            reason = self.fallback.after_bias(last["grad_cosine"])
        if evaluated:
            with self.timings.span("evaluation"):
                last.update(self.evaluation(self.model, step))
            reason = self.fallback.after_evaluation(last["val_loss"]) or reason
            with self.timings.span("sampling"):
                text = self.evaluation.sample(self.model, self.key, step)
            if text is not None:
                with guard.holding_interrupts():
                    self.directory.sample(step, text)
                self.bar.write(f"--- sample at step {step} ---\n{text}\n---")
            self.throughput.restart()
        if reason is not None:
            self._fall_back(reason)
            last["depth_fallback_iterations"] = self.fallback.iterations
        with guard.holding_interrupts():
            self.directory.log(step, {**last, **rate})
        last.pop("depth_fallback_iterations", None)
        name = self.throughput.name
        speed = {name.replace("_per_", "/"): f"{rate[name]:,.0f}"}
        self.bar.set_postfix({"loss": f"{last['loss']:.4f}", **speed}, refresh=False)

    def _fall_back(self, reason: str) -> None:
        """Change the solve from the next step on (fewer parallel iterations, or the
        serial solve), with its programs."""
        self.model, old = self.fallback.fire(self.model), self.model
        self.opt_state = carry_state(self.opt_state, old, self.model)
        solve = f"{self.fallback.iterations} iterations" if self.fallback.parallel else "serial"
        self.bar.write(
            f"ocformer: depth fallback at step {self.step}: {reason}; the solve is {solve} "
            f"from step {self.step + 1}"
        )
        self.train_step, self.bias_step, self.evaluation = self._compiled_steps()

    def _save(self) -> None:
        """Checkpoint the state after this step; its time is left out of the throughput
        window."""
        t = time.perf_counter()
        tree = _to_tree(self.model, self.opt_state, self.key, self.step, self.skipped)
        self.directory.save(self.step, tree, self.config)
        seconds = time.perf_counter() - t
        self.timings.add("checkpoints", seconds)
        self.throughput.exclude(seconds)


def train_batches(
    task: AbstractTask, layout: Layout, batch_size: int, seed: int
) -> Callable[[int], dict]:
    """``n -> batch n`` of the training split, on the devices of ``layout``: this
    process makes only its own rows of the global batch (``task.batch_rows``, bitwise
    those rows of ``task.batch``), and its devices take them as their slices of it."""
    rows = layout.process_rows(batch_size)
    if not layout.active:
        return lambda n: _on_device(task.batch_rows("train", n, batch_size, seed, rows))
    return lambda n: layout.put_rows(
        task.batch_rows("train", n, batch_size, seed, rows), rows, batch_size
    )


def _on_device(batch: dict) -> dict:
    return {k: jnp.asarray(v) for k, v in batch.items()}


def _fmt(value, spec=".4f") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return format(value, spec)


def _print_summary(s: dict) -> None:
    lines = [
        "",
        f"ocformer: finished step {s['step']} in {s['wall_time_s']:.1f}s"
        + (f" (resumed from step {s['resumed_from']})" if s["resumed_from"] is not None else ""),
        f"  train loss {_fmt(s['loss'])}   val loss {_fmt(s['val_loss'])}"
        + (
            f"   val accuracy {_fmt(s['val_accuracy'], '.3f')}"
            if s["val_accuracy"] is not None
            else ""
        )
        + (f"   skipped updates {s['skipped_steps']}" if s["skipped_steps"] else "")
        + f"   waiting for data {100 * s['data_wait_fraction']:.1f}% of the loop",
        "  time  "
        + ", ".join(f"{k.replace('_', ' ')} {v:.1f}s" for k, v in s["time_s"].items() if v >= 0.05),
        f"  outputs in {s['workdir']}",
    ]
    if s["metrics"]:
        lines.append(f"    metrics      {s['metrics']}")
    if s["tensorboard"]:
        lines.append(f"    tensorboard  tensorboard --logdir {shlex.quote(s['tensorboard'])}")
    if s["checkpoint"]:
        lines.append(f"    checkpoint   {s['checkpoint']}")
    if s["samples"]:
        lines.append(f"    samples      {s['samples']}")
    print("\n".join(lines), flush=True)
