"""A time stepper for projected dynamics: any one-step solver, then the projection."""

import dataclasses
from typing import ClassVar

import diffrax

from ..dynamics import project_onto_set


class ProjectedSolver(diffrax.AbstractSolver):
    r"""Any one-step solver followed by the projection onto $S_1(\theta(t_{n+1}))$.

    $$u^{n+1} = P_{S_1(\theta(t_{n+1}))}\big(\Psi^{\delta t}(P_{S_1(\theta(t_n))}\,u^n)\big):$$
    every step first projects its state onto $S_1(\theta(t_n))$, which changes nothing
    within a layer (the last step ended on that set) and, at a step that starts just
    past a jump of the controls, moves the state onto the new set: the state jumps with
    them. So does the first step of each chunk of a depth-parallel solve, which is a
    solve of its own (starting past the jump, it is not told it made one).
    Projecting after each step of a one-step method of order p keeps order p on the
    manifold (Hairer, Lubich, Wanner, *Geometric Numerical Integration*, IV.4), and
    the states lie on $S_1$ to rounding. The error estimate of an adaptive solver is
    that of the unprojected step, which is of the same order. A first-same-as-last
    solver (Tsit5, Dopri5) evaluates its first stage at the projected state, as after a
    jump, rather than take the previous step's last stage, which was evaluated at the
    unprojected one: one more evaluation per step, and each step is the formula above,
    a map of the state alone (``ocformer.analysis.StepMap``, the costates and the
    Lyapunov exponents linearise that map).

    Args:
        solver: the wrapped solver (a diffrax solver or a splitting scheme).
    """

    solver: diffrax.AbstractSolver

    # Not `AbstractWrappedSolver`: diffrax then treats the solver as its inner one in
    # places (e.g. root-finder tolerances), which the model handles itself.
    interpolation_cls: ClassVar = diffrax.LocalLinearInterpolation

    @property
    def term_structure(self):
        return self.solver.term_structure

    def order(self, terms):
        return self.solver.order(terms)

    def error_order(self, terms):
        return self.solver.error_order(terms)

    def init(self, terms, t0, t1, y0, args):
        return self.solver.init(terms, t0, t1, y0, args)

    def step(self, terms, t0, t1, y0, args, solver_state, made_jump):
        # Onto S_1(theta(t0)): past a jump of the controls (a layer boundary of
        # piecewise-constant ones) the state jumps with them, onto the new set. Left on
        # the old set, the first step of every layer was off the manifold by O(1), and
        # every solver first order; only after a jump the solve reports (made_jump)
        # missed the chunks of a depth-parallel solve, each a solve of its own.
        y0 = project_onto_set(args.control(t0).norm2, y0)
        # made_jump=True: a first-same-as-last solver evaluates its first stage at y0,
        # which the last step's projection moved from where its last stage was taken.
        y1, y_error, _, solver_state, result = self.solver.step(
            terms, t0, t1, y0, args, solver_state, True
        )
        y1 = project_onto_set(args.control(t1).norm2, y1)
        # Linear dense output between the projected states: the wrapped solver's own
        # interpolant would end off the set.
        return y1, y_error, dict(y0=y0, y1=y1), solver_state, result

    def func(self, terms, t0, y0, args):
        return self.solver.func(terms, t0, y0, args)


def inner_solver(stepper: diffrax.AbstractSolver) -> diffrax.AbstractSolver:
    """The solver that steps the dynamics: the one a ``ProjectedSolver`` wraps, or
    ``stepper`` itself."""
    return stepper.solver if isinstance(stepper, ProjectedSolver) else stepper


def with_inner_solver(
    stepper: diffrax.AbstractSolver, solver: diffrax.AbstractSolver
) -> diffrax.AbstractSolver:
    """``stepper`` with ``solver`` in place of its ``inner_solver``: wrapped in the
    projection if ``stepper`` is a ``ProjectedSolver``, ``solver`` itself otherwise."""
    return ProjectedSolver(solver) if isinstance(stepper, ProjectedSolver) else solver


def with_bounded_stages(stepper: diffrax.AbstractSolver) -> diffrax.AbstractSolver:
    """``stepper`` with a Runge-Kutta inner solver's stages in a bounded loop (nested
    scans): diffrax's default checkpointed stage loop differentiates once in reverse
    mode and not in forward mode, a plain ``lax.while_loop`` not in reverse mode; the
    bounded loop differentiates both ways, to any order, and the numbers are the same.
    Any other stepper is returned as it is."""
    inner = inner_solver(stepper)
    if isinstance(inner, diffrax.AbstractRungeKutta):
        return with_inner_solver(stepper, dataclasses.replace(inner, scan_kind="bounded"))
    return stepper
