r"""The training loop: minimise $J(\theta)$ over the controls, checkpointed and resumable.

Resuming is exact because everything a step depends on is either restored or a pure
function of the step index: parameters, optimiser state, step, PRNG key and the count
of skipped updates are in the checkpoint, and batch $n$ is
``task.batch("train", n, batch_size, seed)``.
"""

import json
import math
import os
import shlex
import sys
import time
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np

from ..checkpointing import CheckpointManager, atomic_write_text, remove_stale_temporaries
from ..config import Config, to_dict, validate
from ._build import Experiment, build
from ._errors import NonFiniteError, Preempted, SolverFailure
from ._metrics import MetricsLog, TensorBoard, rewind_samples
from ._preempt import PreemptionGuard
from ._run_info import git_revision, package_versions, platform_info
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
        key=jr.key_data(key),
        step=np.asarray(step, np.int64),
        skipped=np.asarray(skipped, np.int64),
    )


def _write_run_info(workdir: str, config: Config, argv, resumed_from) -> None:
    info = {
        "command": None if argv is None else " ".join(shlex.quote(a) for a in argv),
        "argv": None if argv is None else list(argv),
        "cwd": os.getcwd(),
        "seed": config.train.seed,
        "resumed_from_step": resumed_from,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "versions": package_versions(),
        "git": git_revision(),
        "platform": platform_info(),
        "config": to_dict(config),
    }
    atomic_write_text(os.path.join(workdir, "config.json"), json.dumps(to_dict(config), indent=2))
    atomic_write_text(os.path.join(workdir, "run.json"), json.dumps(info, indent=2))


def _mean_metrics(records: list[dict]) -> dict:
    return {k: float(np.mean([float(r[k]) for r in records])) for k in records[0]}


class _Throughput:
    def __init__(self, units_per_step: int):
        self.units = units_per_step
        self.t = time.perf_counter()
        self.steps = 0

    def tick(self) -> None:
        self.steps += 1

    def restart(self) -> None:
        self.t, self.steps = time.perf_counter(), 0

    def rate(self) -> tuple[float, float]:
        """(steps/s, units/s) since the last call."""
        now = time.perf_counter()
        dt = max(now - self.t, 1e-9)
        steps_per_s = self.steps / dt
        self.t, self.steps = now, 0
        return steps_per_s, steps_per_s * self.units


def train(config: Config, workdir: str, *, argv: list[str] | None = None) -> dict:
    """Train ``config`` in ``workdir``, resuming from its last committed checkpoint.

    Writes ``config.json`` and ``run.json`` (versions, git revision, command, platform),
    ``metrics.jsonl``, TensorBoard events under ``tb/``, ``samples.txt`` (language
    models) and checkpoints under ``checkpoints/``.

    Args:
        config: the run; validated before anything is built or traced.
        workdir: the output directory (created; reused to resume).
        argv: the command line, recorded for reproduction.

    Returns:
        A summary: ``step``, ``loss`` (last training loss), ``val_loss``,
        ``val_accuracy``, ``skipped_steps``, ``wall_time_s``, ``resumed_from``,
        ``workdir`` and the paths of its outputs.

    Raises:
        ConfigError: invalid configuration (nothing traced or written).
        ocformer.tasks.DataNotFoundError: missing data.
        ocformer.checkpointing.CheckpointError: a corrupted or mismatched checkpoint.
        SolverFailure: a diffrax solve failed.
        NonFiniteError: NaN/Inf with ``train.on_nonfinite="abort"``.
        Preempted: SIGTERM; a checkpoint was written first.
    """
    validate(config)
    started = time.perf_counter()
    workdir = os.path.abspath(workdir)
    tc, task_cfg = config.train, config.task
    exp: Experiment = build(config)
    os.makedirs(workdir, exist_ok=True)
    remove_stale_temporaries(workdir)
    ckpt = CheckpointManager(os.path.join(workdir, "checkpoints"), keep=tc.keep_checkpoints)
    ckpt.clean()

    model, opt_state = exp.model, exp.optimiser.init(eqx.filter(exp.model, eqx.is_inexact_array))
    key = jr.fold_in(jr.key(tc.seed), 1)
    step, skipped = 0, 0
    resumed_from = ckpt.latest()
    if resumed_from is not None:
        template = _to_tree(model, opt_state, key, 0, 0)
        restored = ckpt.restore(resumed_from, template)
        model = eqx.combine(jax.tree.map(jnp.asarray, restored.params), model)
        opt_state = jax.tree.map(jnp.asarray, restored.opt_state)
        key = jr.wrap_key_data(jnp.asarray(restored.key))
        step, skipped = int(restored.step), int(restored.skipped)
    _write_run_info(workdir, config, argv, resumed_from)

    metrics_log = MetricsLog(os.path.join(workdir, "metrics.jsonl"))
    metrics_log.rewind(step)
    tb = TensorBoard(os.path.join(workdir, "tb"), purge_step=step + 1 if step else None)
    samples_path = os.path.join(workdir, "samples.txt")
    rewind_samples(samples_path, step)
    task = exp.task
    is_lm = task.kind == "lm"
    eval_set = [
        {k: jnp.asarray(v) for k, v in b.items()}
        for b in task.eval_batches(task_cfg.eval_batch_size, task_cfg.eval_batches, tc.seed)
    ]
    train_step = make_train_step(
        exp.objective, exp.constraints, exp.optimiser, skip_nonfinite=tc.on_nonfinite == "skip"
    )
    evaluate = make_eval_step(exp.objective)
    units = task_cfg.batch_size * (task.seq_len if is_lm else 1)
    unit_name = "tok/s" if is_lm else "ex/s"
    if resumed_from is not None:
        print(f"ocformer: resuming {workdir} from step {step}", flush=True)

    def run_eval(model, at_step: int) -> dict:
        try:
            recs = [{k: float(v) for k, v in evaluate(model, b).items()} for b in eval_set]
        except eqx.EquinoxRuntimeError as e:
            raise SolverFailure(at_step, _solver_message(e)) from None
        mean = _mean_metrics(recs)
        out = {"val_objective": mean.pop("loss")}
        out.update({f"val_{k}": v for k, v in mean.items()})
        if "val_task_loss" in out:
            out["val_loss"] = out.pop("val_task_loss")
        return out

    def write_sample(model, at_step: int) -> str | None:
        if not (is_lm and tc.sample_tokens):
            return None
        prompt = task.encode(tc.sample_prompt)
        tokens = model.generate(
            jr.fold_in(key, at_step), prompt, tc.sample_tokens, tc.sample_temperature
        )
        text = tc.sample_prompt + task.decode(tokens)
        with open(samples_path, "a", encoding="utf-8") as f:
            f.write(f"=== step {at_step} ===\n{text}\n\n")
        tb.text(at_step, "sample", text)
        return text

    from tqdm.auto import tqdm

    bar = tqdm(
        total=tc.steps,
        initial=step,
        disable=not tc.progress,
        dynamic_ncols=True,
        desc="train",
        file=sys.stderr,
    )
    throughput = _Throughput(units)
    last: dict = {}
    last_eval: dict = {}
    checkpoint_path = ckpt.path(step) if resumed_from is not None else None
    try:
        with PreemptionGuard(tc.preempt_grace_s) as guard:
            while step < tc.steps:
                n = step + 1
                batch = {
                    k: jnp.asarray(v)
                    for k, v in task.batch("train", step, task_cfg.batch_size, tc.seed).items()
                }
                scale = np.float32("nan") if n == tc.debug_nan_at_step else np.float32(1.0)
                try:
                    new_model, new_opt, metrics, finite = train_step(model, opt_state, batch, scale)
                    finite = np.asarray(finite)
                    metrics = {k: float(v) for k, v in metrics.items()}
                except eqx.EquinoxRuntimeError as e:
                    raise SolverFailure(n, _solver_message(e)) from None
                # The learning rate this update used: the schedule advances only on
                # applied updates (a skipped one leaves the optimiser state as it was).
                lr = float(np.asarray(exp.schedule(step - skipped)))
                if not finite.all():
                    source = FINITE_SOURCES[int(np.argmin(finite))]
                    if tc.on_nonfinite == "abort":
                        raise NonFiniteError(n, source)
                    skipped += 1
                model, opt_state, step = new_model, new_opt, n
                throughput.tick()
                record = {"step": step, **metrics, "skipped_steps": skipped}
                record["lr"] = lr
                evaluated = step % tc.eval_every == 0 or step == tc.steps
                logged = evaluated or step % tc.log_every == 0
                if logged:
                    # Training throughput only: measured before evaluation and sampling,
                    # whose time is then excluded from the next window.
                    steps_per_s, units_per_s = throughput.rate()
                if evaluated:
                    last_eval = run_eval(model, step)
                    record.update(last_eval)
                    sample = write_sample(model, step)
                    if sample is not None:
                        bar.write(f"--- sample at step {step} ---\n{sample}\n---")
                    throughput.restart()
                if logged:
                    record["steps_per_s"] = steps_per_s
                    record[unit_name.replace("/", "_per_")] = units_per_s
                    metrics_log.append(record)
                    tb.scalars(step, record)
                    bar.set_postfix(
                        {"loss": f"{metrics['loss']:.4f}", unit_name: f"{units_per_s:,.0f}"},
                        refresh=False,
                    )
                last = record
                bar.update(1)
                saved = False
                if step % tc.checkpoint_every == 0 or step == tc.steps:
                    checkpoint_path = ckpt.save(
                        step,
                        _to_tree(model, opt_state, key, step, skipped),
                        {"config": to_dict(config)},
                    )
                    saved = True
                if guard.requested and step < tc.steps:
                    if not saved:
                        checkpoint_path = ckpt.save(
                            step,
                            _to_tree(model, opt_state, key, step, skipped),
                            {"config": to_dict(config)},
                        )
                    raise Preempted(step, checkpoint_path)
    finally:
        bar.close()
        tb.close()

    if not last:
        history = metrics_log.read()
        last = history[-1] if history else {}
        last_eval = {k: v for k, v in last.items() if k.startswith("val_")}
    wall = time.perf_counter() - started
    summary = {
        "step": step,
        "loss": last.get("loss"),
        "val_loss": last_eval.get("val_loss"),
        "val_accuracy": last_eval.get("val_accuracy"),
        "skipped_steps": skipped,
        "wall_time_s": wall,
        "resumed_from": resumed_from,
        "workdir": workdir,
        "metrics": metrics_log.path,
        "checkpoint": checkpoint_path,
        "tensorboard": os.path.join(workdir, "tb"),
        "samples": samples_path if os.path.exists(samples_path) else None,
    }
    _print_summary(summary)
    return summary


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
        f"    metrics      {s['metrics']}",
        f"    tensorboard  tensorboard --logdir {s['tensorboard']}",
        f"    checkpoint   {s['checkpoint']}",
    ]
    if s["samples"]:
        lines.append(f"    samples      {s['samples']}")
    print("\n".join(lines), flush=True)
