"""The single place where operators, time stepping and gradient method meet."""

import diffrax
import jax.numpy as jnp
from diffrax import MultiTerm

from ..controls._control import AbstractControl
from ._args import DynamicsArgs


def time_grid(control: AbstractControl, steps_per_layer: int, dtype):
    """The step grid: ``steps_per_layer`` equal steps per piece of the layer grid."""
    if not (isinstance(steps_per_layer, int) and steps_per_layer >= 1):
        raise ValueError(
            f"steps_per_layer must be a positive integer, got {steps_per_layer!r}."
        )
    t0, t1 = control.interval
    num_steps = control.num_layers * steps_per_layer
    return jnp.linspace(t0, t1, num_steps + 1, dtype=dtype), num_steps


def solve(
    terms: MultiTerm,
    solver: diffrax.AbstractSolver,
    control: AbstractControl,
    u0,
    *,
    key_mask=None,
    steps_per_layer: int = 1,
    adjoint: diffrax.AbstractAdjoint | None = None,
    saveat: diffrax.SaveAt | None = None,
) -> diffrax.Solution:
    """Solve the controlled equation over the control's interval with one ``diffeqsolve``.

    The grid is ``StepTo`` with ``steps_per_layer`` steps per layer; ``max_steps`` is the
    grid's step count, never a default. ``adjoint`` defaults to discretise-then-optimise
    with one checkpoint per step (``RecursiveCheckpointAdjoint(checkpoints=num_steps)``):
    states are stored, each step is recomputed once in the backward pass, which on CPU
    is as fast as a rematerialised ``lax.scan`` and faster than a plain one.
    """
    ts, num_steps = time_grid(control, steps_per_layer, u0.dtype)
    from ..splitting._base import AbstractSplittingSolver

    if isinstance(solver, AbstractSplittingSolver):
        solver = solver.for_terms(terms)
    return diffrax.diffeqsolve(
        terms,
        solver,
        t0=ts[0],
        t1=ts[-1],
        dt0=None,
        y0=u0,
        args=DynamicsArgs(control=control, key_mask=key_mask),
        stepsize_controller=diffrax.StepTo(ts=ts),
        max_steps=num_steps,
        adjoint=(
            diffrax.RecursiveCheckpointAdjoint(checkpoints=num_steps)
            if adjoint is None
            else adjoint
        ),
        saveat=diffrax.SaveAt(t1=True) if saveat is None else saveat,
    )
