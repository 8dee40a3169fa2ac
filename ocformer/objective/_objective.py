"""The optimal-control objective: terminal cost plus weighted running costs."""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from ..integration import time_grid
from ..models._sequence import SequenceModel
from ..models._transformer import ContinuousTransformer
from ..operators import wide_dtype
from ._running import (
    control_size,
    control_smoothness,
    grid_saveat,
    kinetic_energy_of_states,
)
from ._ternary import Ternary


def cross_entropy(
    logits: Float[Array, "*b K"], targets: Int[Array, "*b"]
) -> tuple[Float[Array, ""], Float[Array, ""]]:
    """Mean cross-entropy and accuracy over the entries whose target is >= 0.

    A target of -1 marks a position the task does not score (the synthetic tasks' random
    source symbols); an all-ignored batch gives 0, never NaN. Half-precision logits
    are promoted to float32 first, so a bfloat16 model's loss is not rounded to 8 bits.
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"logits {logits.shape} and targets {targets.shape} disagree: targets must have "
            "the logits' shape without the last (class) axis."
        )
    logits = logits.astype(wide_dtype(logits.dtype))
    valid = targets >= 0
    safe = jnp.where(valid, targets, 0)
    logp = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(logp, safe[..., None], axis=-1)[..., 0]
    weight = valid.astype(logp.dtype)
    count = jnp.maximum(jnp.sum(weight), 1.0)
    loss = -jnp.sum(picked * weight) / count
    guess = jnp.argmax(logits, axis=-1)
    hits = (guess == safe.astype(guess.dtype)).astype(logp.dtype)
    return loss, jnp.sum(hits * weight) / count


PRECISIONS: tuple[str, ...] = ("float32", "bfloat16", "float64")


def in_precision(model, dtype):
    """``model`` with its floating arrays in ``dtype`` (integer arrays and static parts
    unchanged). Inside a differentiated function the cast is part of the graph, so the
    gradients arrive in the dtype of the arrays that were cast."""
    dtype = jnp.dtype(dtype)

    def cast(x):
        if eqx.is_inexact_array(x) and x.dtype != dtype:
            return x.astype(dtype)
        return x

    return jax.tree.map(cast, model)


class MixedPrecision(eqx.Module):
    r"""The precision policy of a run: ``objective`` evaluated in ``compute`` dtype.

    The model's floating arrays (the master parameters, float32 or float64) are cast to
    ``compute`` at the start of the loss, so that the forward solve, attention and
    feed-forward products run in it, while the gradients flow back through the cast to
    the masters: parameters, gradients, optimiser state and checkpoints keep the
    masters' dtype. Inside the solve the state (the residual stream) is carried in the
    dtype of time, at least float32, and the terms compute their fields in ``compute``
    (``ocformer.integration.solve``): a bfloat16 state would drown the increments
    ``dt * f`` of a refined grid. What half precision would spoil stays in float32 (as
    flax does): layer-norm means and variances (``ocformer.operators.normalise``), the attention
    softmax, the cross-entropy and its log-softmax (``cross_entropy``), and times (the
    time grid and the controls' layer index, ``ocformer.integration.time_dtype``). The
    loss and the metrics are returned in float32 or wider.

    The transformer's controls are the exception to the cast at the start: they stay
    the masters, and the solve casts them to the dtype of its input (``compute``), so
    the solve runs exactly as above while the running costs on the controls
    (``control_smoothness``, ``control_size``) are evaluated on the masters. A
    smoothness cost is made of the differences of neighbouring layers: rounded to
    bfloat16 first, layers closer than bfloat16's resolution would give a wrong cost
    and a wrong gradient of it.

    Args:
        objective: the ``Objective`` (or any ``(model, batch) -> (loss, metrics)``).
        compute: ``"float32"``, ``"bfloat16"`` or ``"float64"``.
    """

    objective: Callable[..., tuple[Any, dict]]
    compute: str = eqx.field(static=True)

    def __check_init__(self):
        if self.compute not in PRECISIONS:
            raise ValueError(
                f"MixedPrecision.compute must be one of {PRECISIONS}, got {self.compute!r}."
            )

    def __call__(self, model, batch: dict) -> tuple[Float[Array, ""], dict]:
        computed = in_precision(model, self.compute)
        if isinstance(model, SequenceModel):
            # The solve casts the controls itself (``ContinuousTransformer.solve``).
            computed = eqx.tree_at(
                lambda m: m.transformer.control, computed, model.transformer.control
            )
        loss, metrics = self.objective(computed, batch)

        def wide(x):
            return x.astype(wide_dtype(x.dtype))

        return wide(loss), {k: wide(v) for k, v in metrics.items()}


class Objective(eqx.Module):
    r"""$J(\theta) = \mathbb{E}[\ell(g(u(T)), y)] + \int_0^T L(\theta(t), u(t))\,dt$.

    $$L = \alpha\,|\theta'(t)|^2 + \beta\,|\theta(t)|^2 + \kappa\,|u_t|^2.$$

    The terminal cost $\ell$ is the mean cross-entropy of the task: every scored
    position of a causal language model, or the class token's logits. The running
    costs are integrals over $[t_0, t_1]$ by quadrature on the time grid (see
    ``control_smoothness``, ``control_size``, ``kinetic_energy``). The weights are
    configuration, fixed at trace time: a zero weight costs nothing. The kinetic energy
    is computed and reported only when its weight is positive; it then comes from the
    same forward solve as the terminal cost, which saves the state at every grid point
    instead of only at T (one ``diffeqsolve`` per evaluation either way).

    Args:
        control_smoothness: $\alpha \ge 0$.
        control_size: $\beta \ge 0$.
        kinetic_energy: $\kappa \ge 0$.
        ternary: the feed-forward kernels restricted to $\{-a, 0, a\}$
            (``ocformer.objective.Ternary``): J is that of the ternarised model, and its
            gradient the straight-through estimator's; None: real kernels.

    ``__call__(model, batch)`` returns ``(loss, metrics)`` with metrics ``loss``,
    ``task_loss``, ``accuracy`` and, for each positive weight, ``control_smoothness``,
    ``control_size``, ``kinetic_energy`` (unweighted values).
    """

    control_smoothness: float = eqx.field(default=0.0, static=True)
    control_size: float = eqx.field(default=0.0, static=True)
    kinetic_energy: float = eqx.field(default=0.0, static=True)
    ternary: Ternary | None = eqx.field(default=None, static=True)

    def __check_init__(self):
        for name in ("control_smoothness", "control_size", "kinetic_energy"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value >= 0):
                raise ValueError(
                    f"Objective.{name} is a running-cost weight and must be a number >= 0, "
                    f"got {value!r}."
                )
        if self.ternary is not None and not isinstance(self.ternary, Ternary):
            raise ValueError(
                "Objective.ternary must be an ocformer.objective.Ternary or None, got "
                f"{type(self.ternary).__name__}."
            )

    def __call__(self, model: SequenceModel, batch: dict) -> tuple[Float[Array, ""], dict]:
        if not isinstance(model, SequenceModel):
            raise ValueError(
                "Objective takes a SequenceModel (embedding, transformer, readout: the "
                f"loss needs the logits), got {type(model).__name__}."
            )
        missing = [k for k in ("inputs", "targets") if k not in batch]
        if missing:
            raise ValueError(
                f"the batch has no {' or '.join(map(repr, missing))}; a task's batch is a "
                "dict with 'inputs' and 'targets' (and optionally 'key_mask')."
            )
        inputs, targets = batch["inputs"], jnp.asarray(batch["targets"])
        key_mask = batch.get("key_mask")
        if self.ternary is not None:
            model = self.ternary.straight_through(model)
        transformer = model.transformer
        u0 = model.initial_state(inputs)
        u_final, kinetic = _forward(transformer, u0, key_mask, with_kinetic=self.kinetic_energy > 0)
        logits = model.readout(u_final)
        task_loss, accuracy = cross_entropy(logits, targets)
        m = transformer.steps_per_layer
        loss = task_loss
        metrics = {"task_loss": task_loss, "accuracy": accuracy}
        # A running cost is computed (and reported) only when its weight is positive:
        # the quadratures evaluate theta on the whole time grid, which costs memory in
        # the compiled step for nothing when the weight is zero.
        if self.control_smoothness > 0:
            metrics["control_smoothness"] = control_smoothness(transformer.control, m)
            loss = loss + self.control_smoothness * metrics["control_smoothness"]
        if self.control_size > 0:
            metrics["control_size"] = control_size(transformer.control, m)
            loss = loss + self.control_size * metrics["control_size"]
        if kinetic is not None:
            loss = loss + self.kinetic_energy * kinetic
            metrics["kinetic_energy"] = kinetic
        metrics["loss"] = loss
        return loss, metrics


def _forward(
    transformer: ContinuousTransformer,
    u0: Float[Array, "B N d"],
    key_mask: Bool[Array, "B N"] | None,
    *,
    with_kinetic: bool,
) -> tuple[Float[Array, "B N d"], Float[Array, ""] | None]:
    """u(T) (after the final norm, as ``transformer(u0, key_mask)``) and, with
    ``with_kinetic``, the kinetic energy of the same trajectory: one solve."""
    if not with_kinetic:
        return transformer(u0, key_mask), None
    ts, _ = time_grid(transformer.control, transformer.steps_per_layer, u0.dtype)
    # The states as the solve carries them (float32 under bfloat16): the kinetic energy
    # sums squared differences of nearby states, which in bfloat16 are mostly rounding
    # (+8 % at 64 steps per layer, growing with refinement).
    ys = transformer.solve(u0, key_mask, saveat=grid_saveat(ts), cast_back=False).ys
    assert ys is not None
    kinetic = kinetic_energy_of_states(ts, ys, transformer.attention.grid.h_y, key_mask)
    return transformer.final_projection(ys[-1].astype(u0.dtype)), kinetic
