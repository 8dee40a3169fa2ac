"""Smooth formulations: any diffrax solver on pre-LN, projected dynamics on S1, the
Moreau-Yosida relaxation, step-size control, and the refusal of incompatible pairs."""

import diffrax
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

from ocformer.analysis import convergence_study, study_input, study_model
from ocformer.controls import PiecewiseConstant, init_stacked_params
from ocformer.dynamics import (
    SOLVERS,
    DynamicsArgs,
    ProjectedField,
    constraint_residual,
    project_onto_set,
    solver_by_name,
)
from ocformer.dynamics._terms import AttentionTerm, FeedForwardTerm
from ocformer.models import ContinuousTransformer, with_scheme
from ocformer.splitting import Lie, Parallel, Strang


@pytest.fixture(scope="module")
def pre():
    return study_model("pre", seed=0)


@pytest.fixture(scope="module")
def post():
    return study_model("projected", seed=0)


def test_solver_registry():
    for name in ("euler", "heun", "midpoint", "ralston", "tsit5", "dopri5", "kvaerno3",
                 "kvaerno5", "kencarp3", "kencarp4", "kencarp5"):  # fmt: skip
        assert isinstance(solver_by_name(name), diffrax.AbstractSolver)
        assert name in SOLVERS
    with pytest.raises(ValueError, match="tsit5"):
        solver_by_name("rk4")


def test_parallel_euler_is_diffrax_euler_on_the_sum():
    # (1/K) sum_k (u + K dt f_k) = u + dt sum_k f_k: the additive splitting with Euler
    # sub-steps and diffrax's Euler on the ODETerm of the summed field are one method.
    # (Piecewise-constant controls: the splitting freezes theta at the step midpoint,
    # Euler reads it at the step start, and both lie on the same piece.)
    values = init_stacked_params(jr.PRNGKey(0), 3, 8, 16, init_scale=0.5, dtype=jnp.float64)
    model = ContinuousTransformer(PiecewiseConstant(values), norm="pre", num_heads=2)
    u0 = jr.normal(jr.PRNGKey(1), (5, 8), jnp.float64)
    a = with_scheme(model, solver=Parallel(), steps_per_layer=2)(u0)
    b = with_scheme(model, solver="euler", steps_per_layer=2)(u0)
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-12)


def test_pid_steps_onto_control_jumps():
    values = init_stacked_params(jr.PRNGKey(0), 3, 8, 16, init_scale=0.5, dtype=jnp.float64)
    control = PiecewiseConstant(values)
    u0 = jr.normal(jr.PRNGKey(1), (5, 8), jnp.float64)
    pid = ContinuousTransformer(
        control, norm="pre", num_heads=2, solver="tsit5", stepsize="pid", rtol=1e-9, atol=1e-11
    )
    ts, ys = pid.trajectory(u0)
    ts = np.asarray(ts)
    accepted = ts[np.isfinite(ts)]
    for jump in (1.0, 2.0):  # the layer boundaries
        assert np.min(np.abs(accepted - jump)) < 1e-12
    fine = ContinuousTransformer(
        control, norm="pre", num_heads=2, solver="tsit5", steps_per_layer=64
    )(u0)
    # Global error of local tolerances 1e-9 over three layers; stepping onto the jumps
    # is what makes it small (at a jump the field changes by O(1)).
    np.testing.assert_allclose(pid(u0), fine, rtol=0, atol=5e-6)
    np.testing.assert_allclose(ys[len(accepted) - 1], pid(u0), rtol=0, atol=1e-14)


def test_single_layer_has_no_jumps_to_step_onto():
    # One piece: the control has no interior jump; PID and the constant grid both run.
    control = PiecewiseConstant(
        init_stacked_params(jr.PRNGKey(0), 1, 8, 16, init_scale=0.5, dtype=jnp.float64)
    )
    u0 = jr.normal(jr.PRNGKey(1), (5, 8), jnp.float64)
    common = dict(norm="pre", num_heads=2, solver="tsit5", ln_eps=1e-5)
    pid = ContinuousTransformer(control, stepsize="pid", rtol=1e-9, atol=1e-11, **common)
    fine = ContinuousTransformer(control, steps_per_layer=64, **common)
    np.testing.assert_allclose(pid(u0), fine(u0), rtol=0, atol=1e-6)


def test_projected_field_keeps_the_moving_constraints(post):
    # On S1(s1(t), s2(t)) the field must satisfy d/dt mean(u) = s1' and
    # d/dt var(u) = 2 s2 s2' (the derivatives of the constraints), to rounding.
    u0 = study_input(post)
    t = 1.3
    theta, rate = post.control(t), post.control.derivative(t)
    assert abs(float(rate.norm2.scale)) > 1e-2 and abs(float(rate.norm2.bias)) > 1e-2
    u = project_onto_set(theta.norm2, u0)
    field = ProjectedField((AttentionTerm(post.attention), FeedForwardTerm(post.feedforward)))
    f = field(t, u, DynamicsArgs(control=post.control))
    mean_rate = jnp.mean(f, axis=-1)
    var_rate = 2 * jnp.mean((u - jnp.mean(u, -1, keepdims=True)) * f, axis=-1)
    np.testing.assert_allclose(mean_rate, rate.norm2.bias, rtol=0, atol=1e-13)
    np.testing.assert_allclose(
        var_rate, 2 * theta.norm2.scale * rate.norm2.scale, rtol=0, atol=1e-12
    )


@pytest.mark.parametrize(
    "options",
    [dict(solver="lie"), dict(solver="strang", sub_solver="midpoint"), dict(solver="tsit5")],
    ids=["lie", "strang", "tsit5"],
)
def test_projected_states_stay_on_s1(post, options):
    u0 = 3.0 * study_input(post)  # far from S1: the start is projected first
    model = with_scheme(post, steps_per_layer=2, **options)
    ts, ys = model.trajectory(u0)
    residuals = jax.vmap(lambda t, y: constraint_residual(model.control(t).norm2, y))(ts, ys)
    assert float(jnp.max(residuals)) <= 1e-10
    assert float(constraint_residual(post.control(0.0).norm2, u0)) > 1.0


@pytest.mark.slow
def test_relaxation_converges_to_projected_dynamics():
    eps = (1e-1, 1e-2, 1e-3)
    result = convergence_study(
        formulation="relaxed", epsilons=eps, relaxed_steps=16, reference_factor=4
    )["relaxation"]
    errors = result["errors"]
    assert errors[0] > errors[1] > errors[2]
    assert 0.8 <= result["slope"] <= 1.2, result


def test_incompatible_pairs_are_refused(pre, post):
    control = post.control
    values = init_stacked_params(jr.PRNGKey(0), 2, 8, 16, dtype=jnp.float64)
    feature = PiecewiseConstant(values)
    bad = [
        (dict(control=feature, norm="post", solver="tsit5"), "only a splitting scheme"),
        (dict(control=control, norm="post", formulation="projected", solver=Parallel()),
         "only Lie and Strang"),
        (dict(control=control, norm="post", formulation="relaxed", solver=Lie()),
         "stiff relaxation"),
        (dict(control=control, norm="pre", solver="kencarp5"), "no stiff part"),
        (dict(control=control, norm="post", formulation="relaxed", solver="tsit5",
              relaxation_eps=1e-3), "unstable"),
        (dict(control=control, norm="pre", solver=Strang(), stepsize="pid"),
         "no error estimate"),
        (dict(control=feature, norm="pre", solver="tsit5",
              stepsize=diffrax.PIDController(rtol=1e-6, atol=1e-8)), "jump_ts"),
        (dict(control=feature, norm="post", formulation="projected", solver="tsit5"),
         "scalar layer-norm"),
        (dict(control=control, norm="pre", formulation="projected", solver="tsit5"),
         "already a smooth ODE"),
        (dict(control=control, norm="pre", solver="rk4"), "Unknown solver name"),
        (dict(control=control, norm="pre", formulation="smooth"), "formulation must be"),
    ]  # fmt: skip
    for kwargs, match in bad:
        with pytest.raises(ValueError, match=match):
            ContinuousTransformer(kwargs.pop("control"), num_heads=2, **kwargs)
    with pytest.warns(UserWarning, match="limited by stability"):
        ContinuousTransformer(
            control, norm="post", formulation="relaxed", solver="tsit5", stepsize="pid",
            num_heads=2,
        )  # fmt: skip
    # Allowed: an implicit solver on the smooth pre-LN ODE; explicit on a mild relaxation.
    ContinuousTransformer(control, norm="pre", solver="kvaerno5", num_heads=2)
    ContinuousTransformer(
        control, norm="post", formulation="relaxed", solver="tsit5", relaxation_eps=0.5,
        num_heads=2,
    )  # fmt: skip
    with pytest.raises(ValueError, match="only the discretisation"):
        with_scheme(pre, num_heads=4)
