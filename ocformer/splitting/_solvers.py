"""diffrax solvers by name, and what kind of solver each one is."""

from collections.abc import Callable

import diffrax
import equinox as eqx
import optimistix as optx

from .._compat import use_stepsize_tol

SOLVERS: dict[str, Callable[[], diffrax.AbstractSolver]] = {
    "euler": diffrax.Euler,
    "heun": diffrax.Heun,
    "midpoint": diffrax.Midpoint,
    "ralston": diffrax.Ralston,
    "bosh3": diffrax.Bosh3,
    "tsit5": diffrax.Tsit5,
    "dopri5": diffrax.Dopri5,
    "dopri8": diffrax.Dopri8,
    "implicit_euler": diffrax.ImplicitEuler,
    "kvaerno3": diffrax.Kvaerno3,
    "kvaerno4": diffrax.Kvaerno4,
    "kvaerno5": diffrax.Kvaerno5,
    "kencarp3": diffrax.KenCarp3,
    "kencarp4": diffrax.KenCarp4,
    "kencarp5": diffrax.KenCarp5,
}
"""Name -> factory of a diffrax solver (call it with no arguments). Explicit
Runge-Kutta: euler, heun, midpoint, ralston, bosh3, tsit5, dopri5, dopri8; implicit
(for stiff problems such as the Moreau-Yosida relaxation): implicit_euler, kvaerno3-5;
IMEX (explicit part plus implicit part, as ``MultiTerm(explicit, implicit)``):
kencarp3-5."""

_IMEX = (diffrax.KenCarp3, diffrax.KenCarp4, diffrax.KenCarp5, diffrax.Sil3)


def solver_by_name(name: str) -> diffrax.AbstractSolver:
    """A fresh diffrax solver from its name in ``SOLVERS``.

    Raises:
        ValueError: the name is unknown; the message lists the known ones.
    """
    if name not in SOLVERS:
        raise ValueError(
            f"Unknown diffrax solver {name!r}; expected one of {', '.join(SOLVERS)}. "
            "Splitting schemes are in ocformer.splitting.SCHEMES."
        )
    return SOLVERS[name]()


def is_imex(solver: diffrax.AbstractSolver) -> bool:
    """An IMEX solver: takes ``MultiTerm(explicit term, implicit term)``."""
    return isinstance(solver, _IMEX)


def is_implicit(solver: diffrax.AbstractSolver) -> bool:
    """Solves a (nonlinear) system per stage: implicit or IMEX."""
    return isinstance(solver, diffrax.AbstractImplicitSolver)


def with_root_tolerances(
    solver: diffrax.AbstractSolver, rtol: float, atol: float
) -> diffrax.AbstractSolver:
    """Give an implicit solver's root finder explicit tolerances.

    diffrax's implicit solvers take their Newton tolerances from an adaptive step-size
    controller; with constant steps there is none, so they are set here (to the
    model's ``rtol``/``atol``). The root finder becomes a full Newton iteration
    (``optimistix.Newton``): diffrax's default chord iteration freezes the Jacobian
    over a step and its divergence test rejects the relaxation's nonlinear projection
    at tight tolerances (measured: every eps in 1e-1..1e-3 fails with VeryChord at
    rtol 1e-8, none with Newton). Solvers whose root finder already has tolerances,
    and explicit solvers, are returned unchanged.
    """
    if not is_implicit(solver):
        return solver
    rf = solver.root_finder  # pyright: ignore[reportAttributeAccessIssue]
    if (
        getattr(rf, "rtol", None) is use_stepsize_tol
        or getattr(rf, "atol", None) is use_stepsize_tol
    ):
        return eqx.tree_at(lambda s: s.root_finder, solver, optx.Newton(rtol=rtol, atol=atol))
    return solver
