r"""The fallback rule of a depth-parallel solve in training (``train.depth_fallback``).

A depth-parallel solve stopped at $K < N$ iterations gives a biased gradient. The rule
watches two signals and, when one of them says the bias is hurting, moves the solve
towards the serial one:

- at a bias check (``train.depth_bias_every``), the cosine between the depth-parallel
  and the serial gradient is below ``train.depth_fallback_cosine``; or
- the last ``train.depth_fallback_patience`` evaluations in a row did not lower the
  best validation loss seen before them.

What it does (``train.depth_fallback``): ``serial`` replaces the solve by the serial
one for the rest of the run; ``raise_iterations`` doubles $K$, and once $2K$ reaches
the count at which the solve is exact ($N$ chunks for parareal and MGRIT with
F-relaxation, $\lceil N / 2 \rceil$ with FCF) it takes the serial solve instead, which
is then the same result at less cost. After an action the patience count starts
again. Once serial the rule and the bias checks stop: there is no bias left.
"""

import dataclasses
import math
import os

import equinox as eqx
import jax

from ..config import TrainConfig
from ..models import rediscretise
from ._metrics import MetricsLog


class DepthFallback:
    """The rule's state during a run: the solve's iterations (0: serial), the best
    validation loss and the evaluations since it last fell or the rule last fired."""

    def __init__(self, train: TrainConfig, model):
        method = model.transformer.discretisation.depth_parallel
        self.action, self.cosine = train.depth_fallback, train.depth_fallback_cosine
        self.patience = train.depth_fallback_patience
        self.iterations = 0 if method is None else method.iterations
        self.iterations_at_start = self.iterations
        if method is not None:
            chunks = method.num_chunks(model.transformer.num_layers)
            self.exact = chunks if method.relaxation == "F" else math.ceil(chunks / 2)
        self.best, self.stalled = math.inf, 0

    @property
    def watches(self) -> bool:
        """Whether the rule can fire in this run (a depth-parallel solve, an action)."""
        return self.action != "none" and self.iterations_at_start > 0

    @property
    def parallel(self) -> bool:
        """Whether the run still solves in depth in parallel."""
        return self.iterations > 0

    def replay(self, history: list[dict], step: int):
        """The rule's state at ``step`` of a resumed run, from its metrics log: the
        evaluations and the fallbacks (``depth_fallback_iterations``) up to it."""
        for record in history:
            if record.get("step", math.inf) > step:
                continue
            if "val_loss" in record:
                if record["val_loss"] < self.best:
                    self.best, self.stalled = record["val_loss"], 0
                else:
                    self.stalled += 1
            if "depth_fallback_iterations" in record:
                self.iterations, self.stalled = int(record["depth_fallback_iterations"]), 0
                self.best = math.inf

    def solve(self, model):
        """``model`` with the solve of the rule's state (the serial one at 0 iterations)."""
        method = model.transformer.discretisation.depth_parallel
        if method is None or method.iterations == self.iterations:
            return model
        if not self.parallel:
            return rediscretise(model, depth_parallel=None)
        return rediscretise(
            model, depth_parallel=dataclasses.replace(method, iterations=self.iterations)
        )

    def after_bias(self, cosine: float) -> str | None:
        """The reason to fire after a bias check, or None."""
        if self.action == "none" or not self.parallel or self.cosine is None:
            return None
        if cosine < self.cosine:
            return f"grad_cosine {cosine:.4f} < train.depth_fallback_cosine={self.cosine}"
        return None

    def after_evaluation(self, val_loss: float) -> str | None:
        """The reason to fire after an evaluation, or None."""
        if val_loss < self.best:
            self.best, self.stalled = val_loss, 0
            return None
        self.stalled += 1
        if self.action == "none" or not self.parallel or not self.patience:
            return None
        if self.stalled >= self.patience:
            return (
                f"the validation loss has not fallen below {self.best:.4f} in "
                f"{self.stalled} evaluations (train.depth_fallback_patience={self.patience})"
            )
        return None

    def fire(self, model):
        """``model`` with the solve the rule moves to; updates the rule's state. The
        patience count and the best validation loss start again: the new solve's losses
        are compared with each other, not with another solve's."""
        self.stalled, self.best = 0, math.inf
        raise_k = self.action == "raise_iterations" and 2 * self.iterations < self.exact
        self.iterations = 2 * self.iterations if raise_k else 0
        return self.solve(model)


def fallback_iterations(workdir: str, step: int) -> int | None:
    """The iterations K of the depth-parallel solve that the run in ``workdir`` had at
    ``step`` after the fallbacks its rule fired by then (0: the serial solve), read
    from its metrics log (``depth_fallback_iterations``); None when none fired: the
    configured solve."""
    found = None
    for record in MetricsLog(os.path.join(workdir, "metrics.jsonl")).read():
        if record["step"] <= step and "depth_fallback_iterations" in record:
            found = int(record["depth_fallback_iterations"])
    return found


def carry_state(state, old_model, new_model):
    """The optimiser state ``state`` of ``old_model``'s parameters for ``new_model``,
    the same parameters under another solve: a depth-parallel solve is a node of the
    model's tree with no parameters, so each subtree of ``state`` shaped as the
    parameters takes the new tree's shape with the same leaves."""
    old = jax.tree.structure(eqx.filter(old_model, eqx.is_inexact_array))
    new = jax.tree.structure(eqx.filter(new_model, eqx.is_inexact_array))
    if old == new:
        return state
    if old.num_leaves != new.num_leaves:
        raise ValueError(
            f"the solves differ in parameters ({old.num_leaves} against {new.num_leaves} "
            "leaves): a fallback changes only the solve"
        )

    def shaped_as_params(x) -> bool:
        return jax.tree.structure(x) == old

    return jax.tree.map(
        lambda x: jax.tree.unflatten(new, jax.tree.leaves(x)) if shaped_as_params(x) else x,
        state,
        is_leaf=shaped_as_params,
    )
