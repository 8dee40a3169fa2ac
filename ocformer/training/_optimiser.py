"""The optax optimiser of a configuration: schedule, clipping, update rule."""

import optax

from ..config import OptimiserConfig


def make_schedule(cfg: OptimiserConfig, total_steps: int) -> optax.Schedule:
    r"""Learning rate by step: linear warmup to the peak, then cosine decay to
    ``end_lr_ratio`` times the peak at ``total_steps`` (or constant after warmup)."""
    peak = cfg.learning_rate
    warmup = cfg.warmup_steps
    if cfg.schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(
            init_value=0.0 if warmup else peak,
            peak_value=peak,
            warmup_steps=warmup,
            decay_steps=max(total_steps, warmup + 1),
            end_value=peak * cfg.end_lr_ratio,
        )
    if warmup:
        return optax.join_schedules(
            [optax.linear_schedule(0.0, peak, warmup), optax.constant_schedule(peak)],
            [warmup],
        )
    return optax.constant_schedule(peak)


def make_optimiser(
    cfg: OptimiserConfig, total_steps: int
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """(optimiser, schedule): optional global-norm clipping, then adamw/adam/sgd."""
    schedule = make_schedule(cfg, total_steps)
    if cfg.name == "adamw":
        rule = optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay)
    elif cfg.name == "adam":
        rule = optax.adam(schedule, b1=cfg.b1, b2=cfg.b2)
    else:
        rule = optax.sgd(schedule, momentum=cfg.momentum or None)
    parts = [] if cfg.clip_norm is None else [optax.clip_by_global_norm(cfg.clip_norm)]
    return optax.chain(*parts, rule), schedule
