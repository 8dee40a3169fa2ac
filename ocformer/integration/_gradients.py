"""Gradient methods: how dJ/dtheta is obtained, one interface.

A gradient method is part of the discretisation: it chooses the diffrax adjoint, and
everything that adjoint depends on (checkpoint count, backward grid) is derived from
the grid of the solve it is used in, never stored. Whether a method can differentiate a
given model is a rule of ``ocformer.models.RULES``.
"""

import abc
from typing import ClassVar

import diffrax
import equinox as eqx

from ..controls import AbstractControl
from ..splitting import ProjectedSolver
from ._grid import backward_grid_controller


class AbstractGradientMethod(eqx.Module):
    """Chooses the diffrax adjoint of a solve; the training loop never branches on it."""

    name: ClassVar[str]

    @abc.abstractmethod
    def adjoint(
        self,
        stepper: diffrax.AbstractSolver,
        control: AbstractControl,
        steps_per_layer: int,
        adaptive: bool,
    ) -> diffrax.AbstractAdjoint:
        """The diffrax adjoint for a solve with ``stepper`` on the grid of ``control``
        with ``steps_per_layer`` (constant steps unless ``adaptive``)."""


class DiscretiseThenOptimise(AbstractGradientMethod):
    r"""Backpropagation through the scheme: the exact gradient of the discrete $J$.

    diffrax ``RecursiveCheckpointAdjoint`` with ``checkpoints`` equal to the number of
    steps of the grid (layers x steps per layer) by default: every state is stored and
    each step is recomputed once in the backward pass. Fewer checkpoints trade memory
    for recomputation (treeverse).

    Args:
        checkpoints: override the number of checkpoints (None: one per step).
    """

    name: ClassVar[str] = "discretise_then_optimise"
    checkpoints: int | None = eqx.field(default=None, static=True)

    def __check_init__(self):
        if self.checkpoints is not None and not (
            isinstance(self.checkpoints, int) and self.checkpoints >= 1
        ):
            raise ValueError(
                f"checkpoints must be a positive integer or None, got {self.checkpoints!r}."
            )

    def adjoint(self, stepper, control, steps_per_layer, adaptive):
        n = self.checkpoints
        if n is None and not adaptive:
            n = control.num_layers * steps_per_layer
        # None with adaptive steps: diffrax then checkpoints for an unknown step count.
        return diffrax.RecursiveCheckpointAdjoint(checkpoints=n)


class OptimiseThenDiscretise(AbstractGradientMethod):
    r"""The continuous adjoint: the costate $a(t) = \partial J / \partial u(t)$ solves
    $\dot a = -a^\top \partial_u f(t, u; \theta)$ backward from $a(T)$, alongside $u$
    re-solved backward, and $dJ/d\theta = \int_0^T a^\top \partial_\theta f\,dt$
    (diffrax ``BacksolveAdjoint``, the same solver and grid backward).

    It is the gradient of the continuous problem discretised, not the gradient of the
    discrete problem: the two differ by the discretisation error, which shrinks with the
    step size. It needs a smooth single-term formulation and a non-splitting diffrax
    solver: pre-LN with a solver such as ``diffrax.Heun()``, or the projected/relaxed
    formulations of post-LN.
    """

    name: ClassVar[str] = "optimise_then_discretise"

    def adjoint(self, stepper, control, steps_per_layer, adaptive):
        kwargs = {}
        if isinstance(stepper, ProjectedSolver):
            # The projection after each step keeps the discrete states on S1; the exact
            # solution of the projected dynamics stays there by itself. The continuous
            # adjoint is that of the tangent field alone, so the backward solve (on the
            # augmented state (u, a, ...), which has no S1 to project onto) uses the
            # wrapped solver.
            kwargs["solver"] = stepper.solver
        if not adaptive:
            # The forward grid (StepTo, or stepping over the control's jumps) is walked
            # backward from t1: with plain constant steps the first backward stage of
            # every layer would sit on its boundary and read the next layer's controls,
            # which costs an order of the solver.
            kwargs["stepsize_controller"] = backward_grid_controller(
                stepper, control, steps_per_layer
            )
        return diffrax.BacksolveAdjoint(**kwargs)


class Direct(AbstractGradientMethod):
    r"""Forward-mode-compatible backpropagation through the scheme (diffrax
    ``DirectAdjoint``): the exact gradient of the discrete $J$, like
    discretise-then-optimise, but without checkpointing and usable with
    ``jax.jvp``/``jax.jacfwd``; it costs more memory and compile time."""

    name: ClassVar[str] = "direct"

    def adjoint(self, stepper, control, steps_per_layer, adaptive):
        del stepper, control, steps_per_layer, adaptive
        return diffrax.DirectAdjoint()


GRADIENT_METHODS: dict[str, type[AbstractGradientMethod]] = {
    DiscretiseThenOptimise.name: DiscretiseThenOptimise,
    OptimiseThenDiscretise.name: OptimiseThenDiscretise,
    Direct.name: Direct,
}
"""Gradient methods by name; each class is constructible with no arguments."""
