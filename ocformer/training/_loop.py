r"""The training loop: minimise $J(\theta)$ over the controls, checkpointed and resumable.

Resuming is exact because everything a step depends on is either restored or a pure
function of the step index: parameters, optimiser state, step, PRNG key and the count
of skipped updates are in the checkpoint, and batch $n$ is
``task.batch("train", n, batch_size, seed)``. Everything the run writes goes through
one ``RunDirectory``.

On a mesh of several devices (``config.mesh``, ``ocformer.distributed.Layout``) the
same loop runs with the batch split over ``data`` and the controls over ``model``. In
a run of several processes every process runs it: each transfers only its own rows of
batch $n$ to its devices, process 0 alone writes logs and samples, checkpoints are
written together, and a stop on SIGTERM is agreed at the same step by all of them.
"""

import math
import os
import sys
import time
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from tqdm.auto import tqdm

from ..config import Config, from_dict, validate
from ..distributed import Layout, is_primary
from ._build import Experiment, build
from ._errors import NonFiniteError, Preempted, SolverFailure
from ._optimiser import make_schedule
from ._preempt import PreemptionGuard
from ._rundir import RunDirectory
from ._step import FINITE_SOURCES, make_eval_step, make_train_step


def _solver_message(error: Exception) -> str:
    text = str(error)
    marker = "EquinoxRuntimeError: "
    if marker in text:
        text = text.split(marker, 1)[1]
    return text.split("\n---", 1)[0].strip()


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
    opt_state = exp.optimiser.init(eqx.filter(exp.model, eqx.is_inexact_array))
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
    applied = step - skipped  # the schedule advances on applied updates only
    old_lr = float(np.asarray(make_schedule(old.optimiser, old.train.steps)(applied)))
    new_lr = float(np.asarray(make_schedule(config.optimiser, config.train.steps)(applied)))
    if old_lr != new_lr:
        print(
            f"ocformer: the learning-rate schedule changes at step {step + 1}: lr "
            f"{old_lr:.3e} -> {new_lr:.3e} (optimiser or train.steps changed)",
            flush=True,
        )


class _Evaluation:
    """The fixed validation set, the compiled evaluation step and text sampling."""

    def __init__(self, exp: Experiment, layout: Layout, model):
        task, tc, t = exp.task, exp.config.train, exp.config.task
        batches = task.eval_batches(t.eval_batch_size, t.eval_batches, tc.seed)
        self.evaluate = make_eval_step(exp.objective)
        if layout.active:
            self.batches = [layout.put_replicated(b) for b in batches]
            self.evaluate = layout.compile_eval_step(self.evaluate, model)
        else:
            self.batches = [{k: jnp.asarray(v) for k, v in b.items()} for b in batches]
        self.task, self.tc, self.layout, self.template = task, tc, layout, exp.model

    def __call__(self, model, step: int) -> dict:
        try:
            recs = [{k: float(v) for k, v in self.evaluate(model, b).items()} for b in self.batches]
        except eqx.EquinoxRuntimeError as e:
            raise SolverFailure(step, _solver_message(e)) from None
        mean = {k: float(np.mean([r[k] for r in recs])) for k in recs[0]}
        out = {"val_objective": mean.pop("loss")}
        out.update({f"val_{k}": v for k, v in mean.items()})
        if "val_task_loss" in out:
            out["val_loss"] = out.pop("val_task_loss")
        return out

    def sample(self, model, key, step: int) -> str | None:
        if not (self.task.kind == "lm" and self.tc.sample_tokens):
            return None
        if self.layout.processes > 1:
            # The arrays span processes: every process gathers them, process 0 samples.
            params = self.layout.to_host(eqx.filter(model, eqx.is_array))
            if not is_primary():
                return None
            model = eqx.combine(jax.tree.map(jnp.asarray, params), self.template)
        prompt = self.task.encode(self.tc.sample_prompt)
        tokens = model.generate(
            jr.fold_in(key, step), prompt, self.tc.sample_tokens, self.tc.sample_temperature
        )
        return self.tc.sample_prompt + self.task.decode(tokens)


class _Throughput:
    """Training steps and units (tokens or examples) per second between two logs."""

    def __init__(self, units_per_step: int, name: str):
        self.units, self.name = units_per_step, name
        self.restart()

    def restart(self) -> None:
        self.t, self.steps = time.perf_counter(), 0

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
        A summary: ``step``, ``loss`` (last training loss), ``val_loss``,
        ``val_accuracy``, ``skipped_steps``, ``wall_time_s``, ``resumed_from``,
        ``workdir`` and the paths of the outputs that exist (None for the others).

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
    started = time.perf_counter()
    layout = Layout(config)  # a mesh larger than the devices is refused here
    run = RunDirectory(workdir, primary=is_primary(), barrier=layout.barrier)
    changes = run.check(config, allow_config_change=allow_config_change)
    exp, tc = build(config), config.train
    lm = exp.task.kind == "lm"
    with run:
        initial = _initial_tree(exp)
        resumed_from, restored = run.start(
            config, initial, keep_checkpoints=tc.keep_checkpoints, changes=changes, argv=argv
        )
        model, opt_state, key, step, skipped = _from_tree(exp, restored or initial)
        if layout.active:
            # Checkpoints hold whole arrays: any mesh restores any other's.
            model, opt_state = layout.put_model(model), layout.put_state(opt_state, model)
        if resumed_from is not None:
            print(f"ocformer: resuming {run.path} from step {step}", flush=True)
            if changes:
                _announce_schedule(run.stored_config or {}, config, step, skipped)
        train_step = make_train_step(
            exp.objective, exp.constraints, exp.optimiser, skip_nonfinite=tc.on_nonfinite == "skip"
        )
        if layout.active:
            train_step = layout.compile_train_step(train_step, model, opt_state)
        place = layout.put_batch if layout.active else _on_device
        evaluation = _Evaluation(exp, layout, model)
        units = config.task.batch_size * (exp.task.seq_len if lm else 1)
        throughput = _Throughput(units, "tok_per_s" if lm else "ex_per_s")
        last: dict = {}
        quiet = not (tc.progress and is_primary())
        bar = tqdm(total=tc.steps, initial=step, disable=quiet, desc="train",
                   dynamic_ncols=True, file=sys.stderr)  # fmt: skip
        with bar, PreemptionGuard(tc.preempt_grace_s) as guard:
            while step < tc.steps:
                batch = exp.task.batch("train", step, config.task.batch_size, tc.seed)
                # The learning rate this update uses: the schedule advances only on
                # applied updates (a skipped one leaves the optimiser state as it was).
                lr = float(np.asarray(exp.schedule(step - skipped)))
                step += 1
                try:
                    new_model, new_opt, metrics, finite = train_step(model, opt_state, place(batch))
                    finite, metrics = np.asarray(finite), {k: float(v) for k, v in metrics.items()}
                except eqx.EquinoxRuntimeError as e:
                    raise SolverFailure(step, _solver_message(e)) from None
                if not finite.all():
                    source = FINITE_SOURCES[int(np.argmin(finite))]
                    if tc.on_nonfinite == "abort":
                        raise NonFiniteError(step, source, run.checkpoint)
                    skipped += 1
                model, opt_state = new_model, new_opt
                throughput.steps += 1
                last = {"step": step, **metrics, "skipped_steps": skipped, "lr": lr}
                evaluated = step % tc.eval_every == 0 or step == tc.steps
                if evaluated or step % tc.log_every == 0:
                    # Training throughput only: measured before evaluation and sampling,
                    # whose time is then excluded from the next window.
                    rate = throughput.rate()
                    if evaluated:
                        last.update(evaluation(model, step))
                        if (text := evaluation.sample(model, key, step)) is not None:
                            run.sample(step, text)
                            bar.write(f"--- sample at step {step} ---\n{text}\n---")
                        throughput.restart()
                    run.log(step, {**last, **rate})
                    speed = {throughput.name.replace("_per_", "/"): f"{rate[throughput.name]:,.0f}"}
                    bar.set_postfix({"loss": f"{metrics['loss']:.4f}", **speed}, refresh=False)
                bar.update(1)
                # Every process stops at the same step (a checkpoint is written together).
                stopping = layout.any_process(guard.requested) and step < tc.steps
                if step % tc.checkpoint_every == 0 or step == tc.steps or stopping:
                    run.save(step, _to_tree(model, opt_state, key, step, skipped), config)
                if stopping:
                    raise Preempted(step, run.checkpoint)
        if not last:  # nothing left to do: report the run's last record
            history = run.metrics.read()
            last = history[-1] if history else {}
        summary = {
            "step": step,
            "loss": last.get("loss"),
            "val_loss": last.get("val_loss"),
            "val_accuracy": last.get("val_accuracy"),
            "skipped_steps": skipped,
            "wall_time_s": time.perf_counter() - started,
            "resumed_from": resumed_from,
            "workdir": run.path,
            **run.outputs(),
        }
    if is_primary():
        _print_summary(summary)
    return summary


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
        + (f"   skipped updates {s['skipped_steps']}" if s["skipped_steps"] else ""),
        f"  outputs in {s['workdir']}",
    ]
    if s["metrics"]:
        lines.append(f"    metrics      {s['metrics']}")
    if s["tensorboard"]:
        lines.append(f"    tensorboard  tensorboard --logdir {s['tensorboard']}")
    if s["checkpoint"]:
        lines.append(f"    checkpoint   {s['checkpoint']}")
    if s["samples"]:
        lines.append(f"    samples      {s['samples']}")
    print("\n".join(lines), flush=True)
