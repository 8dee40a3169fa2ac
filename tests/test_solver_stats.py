"""The NFE a sweep reports (``ocformer.evaluation.count_evaluations``) against the
vector-field calls of a diffrax solve, counted one by one."""

import diffrax
import jax
import jax.numpy as jnp
import pytest

from ocformer.evaluation import count_evaluations, evaluations_per_step
from ocformer.splitting import SCHEMES, SOLVERS

EXPLICIT = ("euler", "heun", "midpoint", "ralston", "bosh3", "tsit5", "dopri5", "dopri8")
IMEX = ("kencarp3", "kencarp4", "kencarp5")
IMPLICIT = ("implicit_euler", "kvaerno3", "kvaerno4", "kvaerno5", *IMEX)


def _counted_solve(solver, term_of, **kwargs) -> tuple[int, int]:
    """(steps, vector-field calls) of a solve of dy/dt = -y on [0, 1] from dt 0.1."""
    calls = []

    def field(t, y, args):
        jax.debug.callback(lambda: calls.append(1))
        return -y

    sol = diffrax.diffeqsolve(term_of(field), solver, 0.0, 1.0, 0.1, jnp.ones(3), **kwargs)
    jax.block_until_ready(sol.ys)
    jax.effects_barrier()  # every callback has run
    return int(sol.stats["num_steps"]), len(calls)


def test_the_registries_are_split_into_explicit_and_implicit_here():
    assert set(EXPLICIT) | set(IMPLICIT) == set(SOLVERS)


@pytest.mark.parametrize("name", EXPLICIT)
def test_an_explicit_solver_s_nfe_is_its_counted_calls(name):
    solver = SOLVERS[name]()
    steps, calls = _counted_solve(solver, diffrax.ODETerm)
    assert steps == 10
    assert count_evaluations(solver, steps) == calls


@pytest.mark.parametrize("name", ("implicit_euler", "kvaerno3", "kvaerno5"))
def test_an_implicit_solver_has_no_nfe_from_its_tableau(name):
    """Its root finder evaluates the field several times per implicit stage, so the
    stages times the steps would undercount (Kvaerno3: 292 calls for 36 steps of 4
    stages); no number is reported rather than a wrong one."""
    solver = SOLVERS[name]()
    controller = diffrax.PIDController(rtol=1e-6, atol=1e-6)
    steps, calls = _counted_solve(solver, diffrax.ODETerm, stepsize_controller=controller)
    assert count_evaluations(solver, steps) is None
    stages = solver.tableau.num_stages if isinstance(solver, diffrax.AbstractRungeKutta) else 1
    assert calls > steps * stages


@pytest.mark.parametrize("name", [*IMEX, *SCHEMES])
def test_imex_solvers_and_splitting_schemes_have_no_nfe(name):
    stepper = (SOLVERS[name] if name in SOLVERS else SCHEMES[name])()
    assert evaluations_per_step(stepper) is None and count_evaluations(stepper, 4) is None
