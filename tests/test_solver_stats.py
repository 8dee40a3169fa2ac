"""The NFE a sweep reports (``ocformer.evaluation.count_evaluations``) against the
vector-field calls of a diffrax solve, counted one by one."""

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _layers import random_input, random_stack

from ocformer import Discretisation, rediscretise
from ocformer.convert import from_layers
from ocformer.dynamics._constrained import SumField
from ocformer.evaluation import count_evaluations, evaluations_per_step, solver_stats
from ocformer.models import ContinuousTransformer
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


def _count_calls(monkeypatch, field_class) -> list:
    """A list that gains an entry at every call of ``field_class`` in a solve from now on
    (after ``jax.effects_barrier()``); every solve is traced anew, through the count."""
    calls = []
    field = field_class.__call__

    def counted(self, t, y, args):
        jax.debug.callback(lambda: calls.append(1))
        return field(self, t, y, args)

    monkeypatch.setattr(field_class, "__call__", counted)
    jax.clear_caches()
    eqx.clear_caches()
    return calls


class _Direct(eqx.Module):
    """A model whose inputs are its initial state (what ``solver_stats`` reads)."""

    transformer: ContinuousTransformer

    def initial_state(self, u0):
        return u0


@pytest.mark.parametrize(
    "name, stepsize",
    [("tsit5", "constant"), ("dopri5", "constant"), ("heun", "constant"), ("tsit5", "pid")],
)
def test_a_model_s_nfe_counts_the_first_stage_again_after_each_jump(name, stepsize, monkeypatch):
    """On piecewise-constant controls the solve steps over each of the L - 1 jumps, and a
    first-same-as-last solver (Tsit5, Dopri5) then evaluates its first stage again: the
    reported NFE missed those (25 for 26 calls at L = 2, 49 for 52 at L = 4). Counted
    call by call: exact on the constant-step grid; under PID low by at most the steps
    rejected right after a jump, which diffrax's statistics do not show."""
    calls = _count_calls(monkeypatch, SumField)
    stack = from_layers(random_stack(61, 4, 6, 7), norm="pre", num_heads=2, activation="gelu")
    model = rediscretise(
        stack, Discretisation(SOLVERS[name](), steps_per_layer=2, stepsize=stepsize)
    )
    stats = solver_stats(_Direct(model), {"inputs": jnp.asarray(random_input(61, 2, 5, 6))})
    jax.effects_barrier()  # every callback has run
    assert stats["solver_steps"] >= 8 and stats["nfe"] is not None
    if stepsize == "constant":
        assert stats["nfe"] == len(calls)
    else:
        assert 0 <= len(calls) - stats["nfe"] <= stats["rejected_steps"], (len(calls), stats)
    fsal = evaluations_per_step(SOLVERS[name]())[1]
    assert count_evaluations(SOLVERS[name](), stats["solver_steps"]) == stats["nfe"] - 3 * fsal


@pytest.mark.parametrize(
    "name, stepsize", [("tsit5", "constant"), ("dopri5", "pid"), ("heun", "constant")]
)
def test_the_projected_formulation_s_nfe_is_every_stage_of_every_step(name, stepsize, monkeypatch):
    """Under the projected formulation a first-same-as-last solver evaluates its first
    stage at the projected state in every step: the NFE is the stages times the steps,
    counted call by call (PID too: each attempt evaluates all its stages)."""
    from ocformer.analysis import study_input, study_model
    from ocformer.dynamics._constrained import ProjectedField

    calls = _count_calls(monkeypatch, ProjectedField)
    model = rediscretise(
        study_model("projected", seed=0),
        Discretisation(SOLVERS[name](), steps_per_layer=2, stepsize=stepsize),
    )
    stats = solver_stats(_Direct(model), {"inputs": study_input(model)})
    jax.effects_barrier()
    stages = SOLVERS[name]().tableau.num_stages
    assert stats["nfe"] == len(calls) == stages * stats["solver_steps"], (len(calls), stats)


def test_counts_are_whole_numbers_of_any_kind():
    """diffrax's statistics are JAX arrays, and NumPy integers come from tables."""
    tsit5 = diffrax.Tsit5()
    assert count_evaluations(tsit5, jnp.asarray(4)) == count_evaluations(tsit5, 4) == 25
    assert count_evaluations(tsit5, np.int64(4), np.int64(1)) == 26
    for bad in (-1, True, 2.5):
        for stepper in (tsit5, diffrax.Kvaerno3()):  # refused before a None for implicit
            with pytest.raises(ValueError, match="must be whole numbers >= 0"):
                count_evaluations(stepper, bad)
