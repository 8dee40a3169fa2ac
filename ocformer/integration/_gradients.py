"""Gradient methods: how dJ/dtheta is obtained, one interface.

A gradient method is part of the discretisation: it chooses the diffrax adjoint, and
everything that adjoint depends on (checkpoint count, backward grid) is derived from
the grid of the solve it is used in, never stored. Whether a method can differentiate a
given model is a rule of ``ocformer.models.RULES``.
"""

import abc
import functools as ft
from collections.abc import Callable
from typing import ClassVar

import diffrax
import equinox as eqx
import jax

from .._compat import diffrax_loop
from .._counts import to_whole_number
from ..controls import AbstractControl
from ..splitting import inner_solver
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
    checkpoints: int | None = eqx.field(default=None, static=True, converter=to_whole_number)

    def __check_init__(self):
        if self.checkpoints is not None and not (
            type(self.checkpoints) is int and self.checkpoints >= 1  # not a bool
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
        # The projection after each step keeps the discrete states on S1; the exact
        # solution of the projected dynamics stays there by itself. The continuous
        # adjoint is that of the tangent field alone, so the backward solve (on the
        # augmented state (u, a, ...), which has no S1 to project onto) uses the solver
        # inside the projection; any other stepper is its own inner solver.
        kwargs: dict = {"solver": inner_solver(stepper)}
        if not adaptive:
            # The forward grid (GridSteps, or stepping over the control's jumps) is walked
            # backward from t1: with plain constant steps the first backward stage of
            # every layer would sit on its boundary and read the next layer's controls,
            # which costs an order of the solver.
            kwargs["stepsize_controller"] = backward_grid_controller(
                stepper, control, steps_per_layer
            )
        return diffrax.BacksolveAdjoint(**kwargs)


class Direct(AbstractGradientMethod):
    r"""Forward-mode-compatible backpropagation through the scheme (diffrax
    ``DirectAdjoint``): the exact gradient of the discrete $J$ on a constant-step grid,
    like discretise-then-optimise, and usable with ``jax.jvp``/``jax.jacfwd``; it costs
    more memory and compile time.

    Under adaptive steps (``stepsize="pid"``) its forward mode is still exact (on the
    grid its own program chooses), but its reverse mode is not quite the gradient of
    its forward solve: the bounded loop of ``DirectAdjoint`` checkpoints its outer
    levels, and the backward pass recomputes those segments of the solve, step-size
    controller included, in another program (relative gap 6.8e-6 at rtol 1e-8 on the
    test model; the measurement is in ``docs/training_math.md``). For reverse mode
    under PID steps use ``DiscretiseThenOptimise``."""

    name: ClassVar[str] = "direct"

    def adjoint(self, stepper, control, steps_per_layer, adaptive):
        del stepper, control, steps_per_layer, adaptive
        return diffrax.DirectAdjoint()


def _scan_steps(cond_fun, body_fun, init_val, *, max_steps, buffers, policy):
    """diffeqsolve's step loop as ``max_steps`` iterations of ``lax.scan``.

    Only for a constant-step grid solved with ``max_steps`` equal to its step count
    (what ``ocformer.integration.solve`` passes): every step is accepted, so the loop
    runs exactly ``max_steps`` times and ``cond_fun`` holds at each of them; no
    ``lax.cond`` then stands between the steps and XLA's fusion. ``buffers`` (the saved
    states) are ordinary scan carries here, updated by ``.at[].set``.
    """
    del cond_fun, buffers
    if policy is not None:
        # Inside a scan the step needs no protection from common-subexpression
        # elimination (jax.checkpoint's documentation).
        body_fun = jax.checkpoint(body_fun, policy=policy, prevent_cse=False)
    final, _ = jax.lax.scan(lambda val, _: (body_fun(val), None), init_val, length=max_steps)
    return final


def _scan_saves(cond_fun, body_fun, init_val, *, max_steps, buffers, checkpoints=None):
    """diffeqsolve's loop over the ``SaveAt(ts=...)`` times that fall in one step, as a
    ``lax.scan`` of ``max_steps`` (= the number of save times) guarded iterations:
    reverse-mode differentiable, at the price of ``len(ts)`` cheap branch tests per
    step (``SaveAt(steps=True)`` needs none)."""
    del buffers, checkpoints

    def one(val, _):
        return jax.lax.cond(cond_fun(val), body_fun, lambda v: v, val), None

    final, _ = jax.lax.scan(one, init_val, length=max_steps)
    return final


class _StoredAdjoint(diffrax.AbstractAdjoint):
    """Plain reverse mode through the steps of a constant grid, scanned: the forward
    pass keeps every step's intermediate values (all of them, or those ``policy``
    saves) for the backward pass."""

    policy: Callable | None = eqx.field(default=None, static=True)

    def loop(
        self,
        *,
        max_steps,
        terms,
        throw,
        passed_solver_state,
        passed_controller_state,
        **kwargs,
    ):
        del throw, passed_solver_state, passed_controller_state
        if max_steps is None:
            raise ValueError("The stored gradient methods need max_steps (the step count).")
        return diffrax_loop(
            terms=terms,
            max_steps=max_steps,
            inner_while_loop=_scan_saves,
            outer_while_loop=ft.partial(_scan_steps, policy=self.policy),
            **kwargs,
        )


def _refuse_adaptive(name: str) -> None:
    raise ValueError(
        f"discretisation.gradient={name!r} scans the known number of steps of a "
        "constant-step grid; with stepsize='pid' the step count is not known before the "
        "solve. Use stepsize='constant', or gradient='discretise_then_optimise'."
    )


class _AbstractStored(AbstractGradientMethod):
    """A gradient method that scans the steps of a constant grid and keeps residuals:
    all of them, or what the ``jax.checkpoint_policies`` policy named by
    ``_policy`` saves."""

    # The policy's name, not the function: a function stored on the class would be
    # bound as a method when read through ``self``.
    _policy: ClassVar[str | None] = None

    def adjoint(self, stepper, control, steps_per_layer, adaptive):
        del stepper, control, steps_per_layer
        if adaptive:
            _refuse_adaptive(self.name)
        policy = None if self._policy is None else getattr(jax.checkpoint_policies, self._policy)
        return _StoredAdjoint(policy=policy)


class StoredResiduals(_AbstractStored):
    r"""Backpropagation through the scheme with every step's residuals kept: the exact
    gradient of the discrete $J$, like discretise-then-optimise, without recomputing
    any step in the backward pass.

    The steps of the constant grid run as one ``lax.scan`` of the time stepper's step
    (with diffeqsolve's step-size control and saving), differentiated by plain reverse
    mode: the forward pass stores each step's intermediate values (attention scores
    and probabilities, the hidden activations of the feed-forward maps, layer-norm
    statistics, ...) and the backward pass only applies their transposes. Memory per
    step is that of a layer's activations, against one state per step for
    ``DiscretiseThenOptimise``, which recomputes each step instead. Constant steps
    only (``stepsize="constant"``): the scan needs the step count.
    """

    name: ClassVar[str] = "stored"


class StoredDots(_AbstractStored):
    r"""``StoredResiduals`` with a rematerialisation policy: each step is wrapped in
    ``jax.checkpoint`` with ``jax.checkpoint_policies.dots_saveable``, so the forward
    pass stores the results of the matrix products (the projections, the attention
    scores and their application, the feed-forward maps) and the backward pass
    recomputes only the element-wise work between them (softmax, activations,
    normalisations). Less memory than ``StoredResiduals``, less recomputation than
    ``DiscretiseThenOptimise``; constant steps only."""

    name: ClassVar[str] = "stored_dots"
    _policy: ClassVar[str | None] = "dots_saveable"


class StoredProjections(_AbstractStored):
    r"""``StoredResiduals`` with a selective rematerialisation policy: each step is
    wrapped in ``jax.checkpoint`` with
    ``jax.checkpoint_policies.dots_with_no_batch_dims_saveable``, so the forward pass
    stores the results of the feature-wise linear maps (the Q/K/V and output
    projections, the feed-forward maps: products without batch dimensions) and the
    backward pass recomputes attention's own products over the tokens (the scores and
    their application, products with batch and head dimensions), the softmax and the
    element-wise work. This is the selective activation recomputation of large
    Transformer training: what it keeps grows linearly with the context, where the
    attention scores ``StoredDots`` keeps grow with its square. Less memory than
    ``StoredDots``; constant steps only."""

    name: ClassVar[str] = "stored_projections"
    _policy: ClassVar[str | None] = "dots_with_no_batch_dims_saveable"


CONSTANT_STEP_METHODS: tuple[str, ...] = (
    StoredResiduals.name,
    StoredDots.name,
    StoredProjections.name,
)
"""The gradient methods that need a constant-step grid (``ocformer.models.RULES``)."""

GRADIENT_METHODS: dict[str, type[AbstractGradientMethod]] = {
    DiscretiseThenOptimise.name: DiscretiseThenOptimise,
    OptimiseThenDiscretise.name: OptimiseThenDiscretise,
    Direct.name: Direct,
    StoredResiduals.name: StoredResiduals,
    StoredDots.name: StoredDots,
    StoredProjections.name: StoredProjections,
}
"""Gradient methods by name; each class is constructible with no arguments."""
