"""The single place where operators, time stepping and gradient method meet."""

import diffrax
import equinox as eqx
import jax.numpy as jnp
import numpy as np
from diffrax import RESULTS
from jaxtyping import Array, Bool, Float

from ..controls._control import AbstractControl
from ._args import DynamicsArgs
from ._constrained import ProjectedSolver


def time_grid(control: AbstractControl, steps_per_layer: int, dtype):
    """The step grid: ``steps_per_layer`` equal steps per piece of the layer grid."""
    if not (isinstance(steps_per_layer, int) and steps_per_layer >= 1):
        raise ValueError(f"steps_per_layer must be a positive integer, got {steps_per_layer!r}.")
    t0, t1 = control.interval
    num_steps = control.num_layers * steps_per_layer
    return jnp.linspace(t0, t1, num_steps + 1, dtype=dtype), num_steps


def solve(
    terms: diffrax.AbstractTerm,
    solver: diffrax.AbstractSolver,
    control: AbstractControl,
    u0,
    *,
    key_mask=None,
    steps_per_layer: int = 1,
    adjoint: diffrax.AbstractAdjoint | None = None,
    saveat: diffrax.SaveAt | None = None,
    stepsize_controller: diffrax.AbstractStepSizeController | None = None,
    max_steps: int | None = None,
) -> diffrax.Solution:
    """Solve the controlled equation over the control's interval with one ``diffeqsolve``.

    The grid is ``StepTo`` with ``steps_per_layer`` steps per layer; ``max_steps`` is the
    grid's step count, never a default. ``adjoint`` defaults to discretise-then-optimise
    with one checkpoint per step (``RecursiveCheckpointAdjoint(checkpoints=num_steps)``):
    states are stored, each step is recomputed once in the backward pass, which on CPU
    is as fast as a rematerialised ``lax.scan`` and faster than a plain one.

    An adaptive ``stepsize_controller`` replaces ``StepTo``; it must stop at the
    control's discontinuities (``ClipStepSizeController(..., jump_ts=control.jump_ts)``,
    see ``adaptive_controller``) and ``max_steps`` must then be given (the models derive
    it from the grid, see ``adaptive_max_steps``); the default adjoint then uses
    diffrax's checkpointing for an unknown step count.
    """
    ts, num_steps = time_grid(control, steps_per_layer, u0.dtype)
    solver = bind_solver(solver, terms)
    if stepsize_controller is None:
        controller = _constant_steps(solver, control, ts)
        steps = num_steps
        checkpoints = num_steps
    else:
        if max_steps is None:
            raise ValueError(
                "An adaptive step-size controller needs an explicit max_steps (derived "
                "from the layer grid, e.g. ocformer.dynamics.adaptive_max_steps); diffrax's "
                "default is never used."
            )
        controller, steps, checkpoints = stepsize_controller, max_steps, None
    return diffrax.diffeqsolve(
        terms,
        solver,
        t0=ts[0],
        t1=ts[-1],
        dt0=None,
        y0=u0,
        args=DynamicsArgs(control=control, key_mask=key_mask),
        stepsize_controller=controller,
        max_steps=steps,
        adjoint=(
            diffrax.RecursiveCheckpointAdjoint(checkpoints=checkpoints)
            if adjoint is None
            else adjoint
        ),
        saveat=diffrax.SaveAt(t1=True) if saveat is None else saveat,
    )


def _constant_steps(solver, control: AbstractControl, ts) -> diffrax.AbstractStepSizeController:
    from ..splitting._base import AbstractSplittingSolver

    inner = solver.solver if isinstance(solver, ProjectedSolver) else solver
    jumps = control.jump_ts
    # Splitting schemes read the control once per step, at its midpoint, so a jump on
    # a step boundary is harmless. A Runge-Kutta stage at the end of a step reads it at
    # the boundary itself, where a piecewise-constant control already has the next
    # layer's value: step to just before each jump and restart just after it.
    if jumps is None or jumps.size == 0 or isinstance(inner, AbstractSplittingSolver):
        return diffrax.StepTo(ts=ts)
    scale = ts[-1] - ts[0]
    on_jump = jnp.any(
        jnp.abs(ts[:, None] - jumps[None, :].astype(ts.dtype)) <= 1e-9 * scale, axis=1
    )
    return StepOverJumps(ts=ts, on_jump=on_jump)


class StepOverJumps(diffrax.AbstractStepSizeController):
    r"""``StepTo`` on a grid, stepping over the control's jumps as diffrax's
    ``ClipStepSizeController(jump_ts=...)`` does for adaptive steps: a step that would
    end on a jump $t_j$ ends at the float just below it, and the next starts at the
    float just above it (with ``made_jump``, so first-same-as-last stages are
    recomputed). The control is then never evaluated at a jump.

    Args:
        ts: the grid, strictly increasing, from t0 to t1.
        on_jump: which grid points are jumps (never the ends).
    """

    ts: Float[Array, " times"]
    on_jump: Bool[Array, " times"]

    def wrap(self, direction):
        return StepOverJumps(ts=self.ts * direction, on_jump=self.on_jump)

    def _end(self, i):
        t = self.ts[i]
        return jnp.where(self.on_jump[i], jnp.nextafter(t, jnp.asarray(-jnp.inf, t.dtype)), t)

    def init(self, terms, t0, t1, y0, dt0, args, func, error_order):
        del terms, t0, t1, y0, args, func, error_order
        if dt0 is not None:
            raise ValueError("dt0 must be None: the grid determines the steps.")
        return self._end(1), 2

    def adapt_step_size(
        self, t0, t1, y0, y1_candidate, args, y_error, error_order, controller_state
    ):
        del t0, y0, y1_candidate, args, y_error, error_order
        i = controller_state - 1  # the grid point this step ended at
        jump = self.on_jump[i]
        t = self.ts[i]
        next_t0 = jnp.where(jump, jnp.nextafter(t, jnp.asarray(jnp.inf, t.dtype)), t1)
        return (
            True,
            next_t0,
            self._end(controller_state),
            jump,
            controller_state + 1,
            RESULTS.successful,
        )


class BackwardGrid(diffrax.AbstractStepSizeController):
    """The forward constant-step grid walked from t1 back to t0, for the backward solve of
    a continuous adjoint: the same steps, and over the control's jumps in the same way,
    so that no backward stage reads the neighbouring layer's controls either.

    The grid is held as static tuples and made into arrays only inside the solve: this
    controller lives in a model that is differentiated, and its times must carry no
    tangent.

    Args:
        times: the forward grid t0 < ... < t1.
        on_jump: which grid points are jumps of the control (stepped over).
    """

    times: tuple[float, ...] = eqx.field(static=True)
    on_jump: tuple[bool, ...] = eqx.field(static=True)

    def _controller(self):
        ts = jnp.asarray(self.times[::-1])
        if any(self.on_jump):
            return StepOverJumps(ts=ts, on_jump=jnp.asarray(self.on_jump[::-1]))
        return diffrax.StepTo(ts=ts)

    def wrap(self, direction):
        return self._controller().wrap(direction)

    def init(self, terms, t0, t1, y0, dt0, args, func, error_order):
        return self._controller().init(terms, t0, t1, y0, dt0, args, func, error_order)

    def adapt_step_size(self, *args, **kwargs):
        return self._controller().adapt_step_size(*args, **kwargs)


def backward_grid_controller(
    solver: diffrax.AbstractSolver, control: AbstractControl, steps_per_layer: int
) -> BackwardGrid:
    """``BackwardGrid`` for the constant-step grid of ``solver`` on ``control``."""
    t0, t1 = control.interval
    times = np.linspace(t0, t1, control.num_layers * steps_per_layer + 1)
    forward = _constant_steps(solver, control, jnp.asarray(times))
    if isinstance(forward, StepOverJumps):
        jumps = tuple(bool(j) for j in np.asarray(forward.on_jump))
    else:
        jumps = (False,) * len(times)
    return BackwardGrid(times=tuple(float(t) for t in times), on_jump=jumps)


def bind_solver(solver: diffrax.AbstractSolver, terms) -> diffrax.AbstractSolver:
    """Tell splitting schemes (also inside a ``ProjectedSolver``) how many terms they
    split; other solvers are returned unchanged."""
    from ..splitting._base import AbstractSplittingSolver

    if isinstance(solver, ProjectedSolver):
        return ProjectedSolver(bind_solver(solver.solver, terms))
    if isinstance(solver, AbstractSplittingSolver):
        return solver.for_terms(terms)
    return solver


ADAPTIVE_STEPS_PER_LAYER: int = 256
"""The bound on accepted plus rejected adaptive steps per layer (``max_steps`` =
this * layers * steps_per_layer): generous for non-stiff fields (tsit5 at rtol 1e-8
takes tens per layer), and a clear failure rather than a hang for a stiff field given
to an explicit solver."""


def adaptive_max_steps(control: AbstractControl, steps_per_layer: int = 1) -> int:
    """``max_steps`` for an adaptive controller, derived from the layer grid."""
    return ADAPTIVE_STEPS_PER_LAYER * control.num_layers * steps_per_layer


def adaptive_controller(
    control: AbstractControl, rtol: float, atol: float
) -> diffrax.AbstractAdaptiveStepSizeController:
    """A PID controller that steps onto every discontinuity of the control."""
    pid = diffrax.PIDController(rtol=rtol, atol=atol)
    jumps = control.jump_ts
    if jumps is None or jumps.size == 0:  # e.g. a single layer: nothing to step onto
        return pid
    return diffrax.ClipStepSizeController(pid, jump_ts=jumps)
