r"""The optax optimiser of a configuration: schedule, clipping, update rule.

The learning-rate schedule is not compiled into the update as constants: its numbers
(peak rate, warmup, decay length, final rate) and the count of applied updates are
arrays of the optimiser state (``ScheduleState``), and the update evaluates the
schedule's formula on them. Runs that differ only in ``train.steps``, the warmup or the
rates therefore run one compiled program, and the learning rate of every update is
known on the device: the loop never waits for the host to compute it. A skipped update
(``train.on_nonfinite=skip``) leaves the state, and so the count, as it was.

The schedule, with $n$ applied updates, warmup $W$, decay length $D$ (``train.steps``,
at least $W + 1$), peak $\eta$ and final rate $\eta_e$ (``end_lr_ratio`` times the peak;
the peak itself for the constant schedule):

$$\eta(n) = \eta\,n/W \ (n < W), \qquad
  \eta(n) = \eta_e + (\eta - \eta_e)\,\tfrac12\bigl(1 + \cos(\pi \min(n - W, D - W)/(D - W))\bigr)
  \ (n \ge W),$$

optax's ``warmup_cosine_decay_schedule`` written with array parameters.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ..config import OptimiserConfig
from ..models import WEIGHT_DECAY_MASKS


class ScheduleState(NamedTuple):
    """The schedule's numbers and the count of applied updates (all scalars)."""

    count: jax.Array
    peak: jax.Array
    warmup: jax.Array
    decay_steps: jax.Array
    end: jax.Array


def _schedule_numbers(cfg: OptimiserConfig, total_steps: int) -> dict:
    warmup = cfg.warmup_steps
    end = cfg.learning_rate * cfg.end_lr_ratio if cfg.schedule == "cosine" else cfg.learning_rate
    return {
        "peak": cfg.learning_rate,
        "warmup": warmup,
        "decay_steps": max(total_steps, warmup + 1),
        "end": end,
    }


def schedule_value(s: ScheduleState, count) -> jax.Array:
    """The learning rate after ``count`` applied updates under the numbers of ``s``."""
    dtype = jnp.result_type(s.peak)
    n = jnp.asarray(count).astype(dtype)
    warmup, decay = s.warmup.astype(dtype), s.decay_steps.astype(dtype)
    warm = s.peak * (jnp.minimum(n, warmup) / jnp.maximum(warmup, 1))
    span = jnp.maximum(decay - warmup, 1)
    frac = jnp.clip(n - warmup, 0, span) / span
    decayed = s.end + (s.peak - s.end) * (0.5 * (1 + jnp.cos(jnp.pi * frac)))
    return jnp.where(n < warmup, warm, decayed)


def make_schedule(cfg: OptimiserConfig, total_steps: int) -> optax.Schedule:
    r"""Learning rate by count of applied updates: linear warmup to the peak, then
    cosine decay to ``end_lr_ratio`` times the peak at ``total_steps`` (or constant
    after warmup); the formula the optimiser evaluates on the device."""
    numbers = _schedule_numbers(cfg, total_steps)
    real = jax.dtypes.canonicalize_dtype(np.float64)  # float64 where JAX has it
    state = ScheduleState(
        count=jnp.asarray(0, jnp.int32),
        peak=jnp.asarray(numbers["peak"], real),
        warmup=jnp.asarray(numbers["warmup"], jnp.int32),
        decay_steps=jnp.asarray(numbers["decay_steps"], jnp.int32),
        end=jnp.asarray(numbers["end"], real),
    )
    return lambda count: schedule_value(state, count)


def _is_schedule(node) -> bool:
    return isinstance(node, ScheduleState)


def scale_by_schedule_in_state() -> optax.GradientTransformation:
    """Multiply the updates by the schedule's rate at the state's count (the numbers
    start at a constant rate of 1; ``with_schedule`` sets them), and count the update."""

    def init(params):
        dtype = optax.tree.dtype(params, "highest")
        one = jnp.ones((), dtype)
        zero = jnp.zeros((), jnp.int32)
        return ScheduleState(count=zero, peak=one, warmup=zero, decay_steps=zero + 1, end=one)

    def update(updates, state, params=None):
        del params
        rate = schedule_value(state, state.count)
        updates = jax.tree.map(lambda u: rate.astype(u.dtype) * u, updates)
        return updates, state._replace(count=optax.safe_increment(state.count))

    return optax.GradientTransformation(init, update)


def with_schedule(opt_state, cfg: OptimiserConfig, total_steps: int):
    """``opt_state`` with the schedule numbers of ``cfg`` and ``total_steps`` (the count
    of applied updates kept): what a resumed run with a changed schedule continues
    with."""
    numbers = _schedule_numbers(cfg, total_steps)

    def replace(node):
        if not _is_schedule(node):
            return node
        return node._replace(
            **{k: jnp.asarray(v, jnp.asarray(getattr(node, k)).dtype) for k, v in numbers.items()}
        )

    return jax.tree.map(replace, opt_state, is_leaf=_is_schedule)


def learning_rate_of(opt_state) -> float:
    """The learning rate of the next update ``opt_state`` would apply."""
    (s,) = [n for n in jax.tree.leaves(opt_state, is_leaf=_is_schedule) if _is_schedule(n)]
    s = jax.tree.map(jnp.asarray, s)
    return float(np.asarray(schedule_value(s, s.count)))


def under_standard_promotion(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """``tx`` with its update traced under jax's standard dtype promotion, whatever the
    process sets.

    optax's Adam bias correction raises its python-float decay to the int32 step count
    (``b1 ** count``), which strict promotion (``jax_numpy_dtype_promotion="strict"``,
    as the test suite runs) refuses for any dtypes of parameters and gradients. The
    update is the same under the standard rule.
    """

    def update(updates, state, params=None):
        with jax.numpy_dtype_promotion("standard"):
            return tx.update(updates, state, params)

    return optax.GradientTransformation(tx.init, update)


@functools.cache
def _update_rule(
    name: str, b1: float, b2: float, weight_decay: float, decay_on: str, momentum: float, clip
):
    # Cached on what shapes the compiled update, so that two runs of one rule share the
    # optimiser's update function and with it the compiled training step.
    if name == "adamw":
        # weight_decay_on=all passes no mask, so that its update and state are those of
        # plain adamw; the decay term holds no state either way, so that the two states
        # have the same arrays and a run may resume under the other choice.
        rule = optax.adamw(
            1.0, b1=b1, b2=b2, weight_decay=weight_decay, mask=WEIGHT_DECAY_MASKS[decay_on]
        )
    elif name == "adam":
        rule = optax.adam(1.0, b1=b1, b2=b2)
    else:
        rule = optax.sgd(1.0, momentum=momentum or None)
    # optax scales by -1.0 (exactly), the schedule then by the rate: -lr * u.
    parts = [] if clip is None else [optax.clip_by_global_norm(clip)]
    return optax.chain(*parts, under_standard_promotion(rule), scale_by_schedule_in_state())


def make_optimiser(
    cfg: OptimiserConfig, total_steps: int
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """(optimiser, schedule): optional global-norm clipping, then adamw/adam/sgd, then
    the learning-rate schedule, whose numbers are in the optimiser state.

    adamw's decoupled weight decay acts on every parameter or, with
    ``weight_decay_on="matrices"``, on the weight matrices only
    (``ocformer.models.weight_matrices``), which needs parameters shaped as a model
    (``eqx.filter(model, eqx.is_inexact_array)``, as the training step gives them).
    ``optimiser.update`` depends only on the rule's constants (name, betas, weight
    decay and what it acts on, momentum, clipping); ``optimiser.init`` puts the
    schedule of ``cfg`` and ``total_steps`` into the state.
    """
    rule = _update_rule(
        cfg.name, cfg.b1, cfg.b2, cfg.weight_decay, cfg.weight_decay_on, cfg.momentum, cfg.clip_norm
    )

    def init(params):
        return with_schedule(rule.init(params), cfg, total_steps)

    return optax.GradientTransformation(init, rule.update), make_schedule(cfg, total_steps)
