"""The single place where terms, time stepper and gradient method meet."""

import diffrax
import equinox as eqx
import jax
import numpy as np
from jaxtyping import Array, Bool

from ..controls import AbstractControl
from ..dynamics import DynamicsArgs
from ..splitting import AbstractSplittingSolver, inner_solver, is_implicit, with_inner_solver
from ._depth import chunk_controls
from ._discretisation import Discretisation
from ._grid import (
    adaptive_controller,
    adaptive_max_steps,
    constant_controller,
    time_dtype,
    time_grid,
)


def bind_solver(solver: diffrax.AbstractSolver, terms) -> diffrax.AbstractSolver:
    """Tell splitting schemes (also inside a ``ProjectedSolver``) how many terms they
    split; other solvers are returned unchanged."""
    inner = inner_solver(solver)
    if isinstance(inner, AbstractSplittingSolver):
        return with_inner_solver(solver, inner.for_terms(terms))
    return solver


def solve(
    terms: diffrax.AbstractTerm,
    stepper: diffrax.AbstractSolver,
    control: AbstractControl,
    u0,
    discretisation: Discretisation,
    *,
    key_mask=None,
    saveat: diffrax.SaveAt | None = None,
    cast_back: bool = True,
    compute_dtype=None,
) -> diffrax.Solution:
    """Solve the controlled equation over the control's interval with one ``diffeqsolve``.

    ``stepper`` is the solver to step ``terms`` with (the discretisation's, possibly
    wrapped for a formulation); the grid, step-size controller, ``max_steps`` and the
    adjoint all come from ``discretisation`` and the control's layer grid, here and
    nowhere else:

    - constant steps: ``GridSteps`` with ``steps_per_layer`` steps per layer (stepping over
      the controls' jumps where a Runge-Kutta stage would read them); ``max_steps`` is
      the step count;
    - ``"pid"``: a PID controller that stops at the jumps, starting with one step of
      the grid (``1 / steps_per_layer`` of the first layer); ``max_steps`` is
      ``ADAPTIVE_STEPS_PER_LAYER`` times the grid's step count;
    - the adjoint is ``discretisation.gradient.adjoint(...)`` for this grid.

    Precision: the dtype of ``u0`` is the compute dtype. Time is at least float32
    whatever it is (``time_dtype``), and diffrax carries the state in the promoted
    dtype of state and time; that promotion is made here, explicitly: a bfloat16 (or
    float16) ``u0`` gives a float32 state, a float32 residual stream whose updates
    ``u + dt * f`` are float32 sums, while the terms compute their fields (every matrix
    product of attention and the feed-forward maps) in the dtype of ``u0``
    (``DynamicsArgs.compute_dtype``). The saved states are cast back to the dtype of
    ``u0`` unless ``cast_back`` is False (what is computed from their differences, the
    kinetic energy, needs the state's own: a bfloat16 difference of nearby states is
    mostly rounding). With a float32 or float64 ``u0`` state and compute dtype are one.

    ``compute_dtype`` (None: the dtype of ``u0``) sets the compute dtype apart from the
    state's: the depth-parallel solve hands each chunk its float32 boundary state with
    bfloat16 compute, so that the residual stream is never rounded to bfloat16 between
    chunks.
    """
    compute_dtype = u0.dtype if compute_dtype is None else np.dtype(compute_dtype)
    ts, num_steps = time_grid(control, discretisation.steps_per_layer, u0.dtype)
    stepper = bind_solver(stepper, terms)
    adaptive = discretisation.is_adaptive
    if adaptive:
        controller = adaptive_controller(
            control, discretisation.rtol, discretisation.atol, discretisation.jump_ts, ts.dtype
        )
        max_steps = adaptive_max_steps(control, discretisation.steps_per_layer)
    else:
        controller = constant_controller(stepper, control, ts)
        max_steps = num_steps
    adjoint = discretisation.gradient.adjoint(
        stepper, control, discretisation.steps_per_layer, adaptive
    )
    sol = diffrax.diffeqsolve(
        terms,
        stepper,
        t0=ts[0],
        t1=ts[-1],
        dt0=ts[1] - ts[0] if adaptive else None,
        y0=u0.astype(np.promote_types(u0.dtype, ts.dtype)),  # numpy's: also under strict
        args=DynamicsArgs(control=control, key_mask=key_mask, compute_dtype=compute_dtype),
        stepsize_controller=controller,
        max_steps=max_steps,
        adjoint=adjoint,
        saveat=diffrax.SaveAt(t1=True) if saveat is None else saveat,
        # A constant grid takes exactly max_steps steps, none of them rejected: an
        # explicit solve on it cannot fail, and throw's check would be a host callback,
        # which keeps the program out of JAX's persistent compilation cache
        # (``GridSteps``). An implicit stage equation can have no root within reach,
        # and diffrax then ends the solve at that step with the state it had: thrown,
        # never returned as u(T).
        throw=adaptive or is_implicit(inner_solver(stepper)),
    )
    if not cast_back or sol.ys is None or jax.tree.leaves(sol.ys)[0].dtype == u0.dtype:
        return sol
    # The state was carried in the dtype of time (see above and ``time_dtype``).
    ys = jax.tree.map(lambda y: y.astype(u0.dtype), sol.ys)
    return eqx.tree_at(lambda s: s.ys, sol, ys)


class _ChunkSolve(eqx.Module):
    """``(chunk control, u(T_n)) -> u(T_{n+1})``: ``solve`` over one chunk. A module,
    not a closure, so that a sweep sharded over devices takes its arrays (the key mask)
    as arguments."""

    terms: diffrax.AbstractTerm
    stepper: diffrax.AbstractSolver
    discretisation: Discretisation
    key_mask: Bool[Array, "*batch N"] | None
    compute_dtype: np.dtype = eqx.field(static=True)

    def __call__(self, chunk: AbstractControl, u):
        sol = solve(
            self.terms,
            self.stepper,
            chunk,
            u,
            self.discretisation,
            key_mask=self.key_mask,
            compute_dtype=self.compute_dtype,
        )
        assert sol.ys is not None
        return sol.ys[-1]


def solve_in_depth(
    fine: tuple[diffrax.AbstractTerm, diffrax.AbstractSolver],
    coarse: tuple[diffrax.AbstractTerm, diffrax.AbstractSolver],
    control: AbstractControl,
    u0,
    discretisation: Discretisation,
    *,
    key_mask=None,
):
    """The states at the chunk boundaries after each iteration of the depth-parallel
    solve of ``discretisation.depth_parallel`` (shape ``(K + 1, N + 1, *u0.shape)``;
    the last entry is u(T)).

    The states are those the serial solve carries (``solve``): float32 for a bfloat16
    ``u0``, whose dtype stays the compute dtype of every chunk's fields; the boundary
    states and the iteration's corrections are never rounded to bfloat16.

    ``fine`` and ``coarse`` are the terms and stepper of the discretisation and of its
    coarse stepper (the model's, posed for each stepper). Every chunk solve, fine or
    coarse, is a ``solve`` above: the fine one with ``discretisation`` over the chunk's
    layers, the coarse one with ``discretisation.coarse(...)`` over the chunk's coarse
    control (``chunk_controls``).
    """
    method = discretisation.depth_parallel
    if method is None:
        raise ValueError("solve_in_depth needs a discretisation with depth_parallel set.")
    chunks = method.num_chunks(control.num_layers)
    fine_controls, coarse_controls, steps_per_piece = chunk_controls(
        control, chunks, method.coarse_steps
    )
    coarse_discretisation = discretisation.coarse(steps_per_piece)
    compute_dtype = u0.dtype
    state = u0.astype(np.promote_types(u0.dtype, time_dtype(u0.dtype)))
    return method.iterates(
        _ChunkSolve(*fine, discretisation, key_mask, compute_dtype),
        _ChunkSolve(*coarse, coarse_discretisation, key_mask, compute_dtype),
        fine_controls,
        coarse_controls,
        state,
    )
