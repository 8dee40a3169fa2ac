"""Smooth formulations: any diffrax solver on pre-LN, projected dynamics on S1, the
Moreau-Yosida relaxation, step-size control, and the refusal of incompatible pairs."""

import re

import diffrax
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

from ocformer.analysis import convergence_study, study_input, study_model
from ocformer.controls import PiecewiseConstant, init_stacked_params
from ocformer.dynamics import (
    AttentionTerm,
    DynamicsArgs,
    FeedForwardTerm,
    ProjectedField,
    constraint_residual,
    project_onto_set,
)
from ocformer.integration import Discretisation
from ocformer.models import (
    IMPLICIT_MIN_STEPS_PER_LAYER,
    ContinuousTransformer,
    IncompatibleError,
    describe_stepper,
    rediscretise,
    refine,
    reformulate,
)
from ocformer.splitting import SOLVERS, Lie, Parallel, Strang, solver_by_name


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
    a = rediscretise(model, stepper=Parallel(), steps_per_layer=2)(u0)
    b = rediscretise(model, stepper=diffrax.Euler(), steps_per_layer=2)(u0)
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-12)


def test_pid_steps_onto_control_jumps():
    values = init_stacked_params(jr.PRNGKey(0), 3, 8, 16, init_scale=0.5, dtype=jnp.float64)
    control = PiecewiseConstant(values)
    u0 = jr.normal(jr.PRNGKey(1), (5, 8), jnp.float64)
    pid = ContinuousTransformer(
        control,
        norm="pre",
        num_heads=2,
        discretisation=Discretisation(diffrax.Tsit5(), stepsize="pid", rtol=1e-9, atol=1e-11),
    )
    ts, ys = pid.trajectory(u0)
    ts = np.asarray(ts)
    accepted = ts[np.isfinite(ts)]
    for jump in (1.0, 2.0):  # the layer boundaries
        assert np.min(np.abs(accepted - jump)) < 1e-12
    fine = ContinuousTransformer(
        control,
        norm="pre",
        num_heads=2,
        discretisation=Discretisation(diffrax.Tsit5(), steps_per_layer=64),
    )(u0)
    # Global error of local tolerances 1e-9 over three layers; stepping onto the jumps
    # is what makes it small (at a jump the field changes by O(1)).
    np.testing.assert_allclose(pid(u0), fine, rtol=0, atol=5e-6)
    np.testing.assert_allclose(ys[len(accepted) - 1], pid(u0), rtol=0, atol=1e-14)


@pytest.mark.parametrize("steps_per_layer", [1, 4])
def test_pid_starts_with_one_grid_step(steps_per_layer):
    """Under PID, ``steps_per_layer`` sets the first step (1 / steps_per_layer of a
    layer): at a loose tolerance it is accepted as it is."""
    values = init_stacked_params(jr.PRNGKey(0), 2, 8, 16, init_scale=0.1, dtype=jnp.float64)
    u0 = jr.normal(jr.PRNGKey(1), (5, 8), jnp.float64)
    pid = ContinuousTransformer(
        PiecewiseConstant(values),
        norm="pre",
        num_heads=2,
        discretisation=Discretisation(
            diffrax.Tsit5(), stepsize="pid", steps_per_layer=steps_per_layer, rtol=1.0, atol=1.0
        ),
    )
    ts = np.asarray(pid.trajectory(u0)[0])
    assert ts[0] == 0.0 and ts[1] == pytest.approx(1.0 / steps_per_layer, rel=1e-12)


def test_single_layer_has_no_jumps_to_step_onto():
    # One piece: the control has no interior jump; PID and the constant grid both run.
    control = PiecewiseConstant(
        init_stacked_params(jr.PRNGKey(0), 1, 8, 16, init_scale=0.5, dtype=jnp.float64)
    )
    u0 = jr.normal(jr.PRNGKey(1), (5, 8), jnp.float64)
    common = dict(norm="pre", num_heads=2, ln_eps=1e-5)
    pid = ContinuousTransformer(
        control,
        discretisation=Discretisation(diffrax.Tsit5(), stepsize="pid", rtol=1e-9, atol=1e-11),
        **common,
    )
    fine = ContinuousTransformer(
        control, discretisation=Discretisation(diffrax.Tsit5(), steps_per_layer=64), **common
    )
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
    "stepper",
    [Lie(), Strang(sub_solver="midpoint"), diffrax.Tsit5()],
    ids=["lie", "strang", "tsit5"],
)
def test_projected_states_stay_on_s1(post, stepper):
    u0 = 3.0 * study_input(post)  # far from S1: the start is projected first
    model = rediscretise(post, stepper=stepper, steps_per_layer=2)
    ts, ys = model.trajectory(u0)
    residuals = jax.vmap(lambda t, y: constraint_residual(model.control(t).norm2, y))(ts, ys)
    assert float(jnp.max(residuals)) <= 1e-10
    assert float(constraint_residual(post.control(0.0).norm2, u0)) > 1.0


@pytest.mark.parametrize("stepper", [diffrax.Heun(), diffrax.Tsit5()], ids=["heun", "tsit5"])
def test_projected_dynamics_jump_onto_each_layer_s_set(post, stepper):
    """With piecewise-constant controls S_1 jumps at each layer boundary and the state
    with it: the whole model equals its layers solved one after the other (each
    projecting its input onto its own set), to rounding. The state stayed on the old
    set into the next layer's first step: 0.1 off at 4 steps per layer, and every
    solver first order."""
    import equinox as eqx

    values = jax.vmap(post.control)(jnp.arange(3.0) + 0.5)  # frozen at the midpoints
    model = eqx.tree_at(lambda m: m.control, post, PiecewiseConstant(values))
    u0 = study_input(model)
    u = u0
    for n in range(3):
        layer = PiecewiseConstant(jax.tree.map(lambda x, n=n: x[n : n + 1], values))
        one = eqx.tree_at(lambda m: m.control, model, layer)
        u = rediscretise(one, stepper=stepper, steps_per_layer=4)(u)
    whole = rediscretise(model, stepper=stepper, steps_per_layer=4)(u0)
    assert float(jnp.max(jnp.abs(whole - u))) <= 1e-13


@pytest.mark.slow
def test_relaxation_converges_to_projected_dynamics():
    eps = (1e-1, 1e-2, 1e-3)
    result = convergence_study(
        formulation="relaxed", epsilons=eps, relaxed_steps=16, reference_factor=4
    )["relaxation"]
    errors = result["errors"]
    assert errors[0] > errors[1] > errors[2]
    assert 0.8 <= result["slope"] <= 1.2, result


def _build(control, *, stepper=None, norm="pre", formulation="split", relaxation_eps=1e-2, **d):
    return ContinuousTransformer(
        control,
        norm=norm,
        num_heads=2,
        formulation=formulation,
        relaxation_eps=relaxation_eps,
        discretisation=Discretisation(stepper, **d),
    )


def test_incompatible_pairs_are_refused_naming_the_field(pre, post):
    control = post.control  # scalar layer-norm sets, Basis controls
    values = init_stacked_params(jr.PRNGKey(0), 2, 8, 16, dtype=jnp.float64)
    feature = PiecewiseConstant(values)
    tsit5 = diffrax.Tsit5()
    bad = [
        (dict(control=feature, norm="post", stepper=tsit5), "discretisation.stepper",
         "splitting scheme"),
        (dict(control=control, norm="post", formulation="projected", stepper=Parallel()),
         "discretisation.stepper", "only lie, strang"),
        (dict(control=control, norm="post", formulation="relaxed", stepper=Lie()),
         "discretisation.stepper", "stiff relaxation"),
        (dict(control=control, stepper=diffrax.KenCarp5()), "discretisation.stepper",
         "no stiff part"),
        (dict(control=control, norm="post", formulation="relaxed", stepper=tsit5,
              relaxation_eps=1e-3), "discretisation.steps_per_layer", "unstable"),
        (dict(control=control, stepper=Strang(), stepsize="pid"), "discretisation.stepsize",
         "error estimate"),
        (dict(control=feature, stepper=tsit5, stepsize="pid", jump_ts=False),
         "discretisation.jump_ts", "jump_ts=true"),
        (dict(control=feature, norm="post", formulation="projected", stepper=tsit5),
         "controls.norm_affine", "scalar"),
        (dict(control=control, formulation="projected", stepper=tsit5), "model.formulation",
         "already a smooth ODE"),
        (dict(control=feature, norm="post", steps_per_layer=2), "discretisation.steps_per_layer",
         "no continuous limit"),
    ]  # fmt: skip
    for kwargs, field, match in bad:
        with pytest.raises(IncompatibleError, match=match) as info:
            _build(kwargs.pop("control"), **kwargs)
        assert info.value.field == field, (kwargs, str(info.value))
        assert str(info.value) == f"{field}: {info.value.message}"
        assert re.search(match, info.value.message), info.value.message
    with pytest.raises(ValueError, match="formulation must be"):
        _build(control, formulation="smooth")
    with pytest.raises(ValueError, match="stepper must be"):
        Discretisation("rk4")  # pyright: ignore[reportArgumentType]
    # Allowed: an implicit solver on the smooth pre-LN ODE (from four steps per layer,
    # or adaptive); explicit on a mild relaxation.
    _build(control, stepper=diffrax.Kvaerno5(), steps_per_layer=IMPLICIT_MIN_STEPS_PER_LAYER)
    _build(control, stepper=diffrax.Kvaerno5(), stepsize="pid")
    _build(control, norm="post", formulation="relaxed", stepper=tsit5, relaxation_eps=0.5)
    with pytest.raises(ValueError, match="has no field num_heads"):
        rediscretise(pre, num_heads=4)


COARSE_IMPLICIT = [
    ("pre", "implicit_euler", 1),
    ("pre", "kvaerno4", 1),
    ("pre", "kvaerno5", 1),
    ("projected", "kvaerno4", 1),
    ("projected", "implicit_euler", 2),
    ("relaxed", "kvaerno4", 2),
]


def test_a_solver_with_stages_past_its_step_is_refused_on_piecewise_constant_controls():
    """Kvaerno4 and Kvaerno5 have stage abscissae 1.1456 and 1.2303: in the last step of
    a layer a stage reads the next layer's controls, however the grid steps over the
    layer boundaries (the end of layer 0 depended on layer 1's controls: a gradient
    norm of 17.5 and 5.3). Refused there; Kvaerno3 and the smooth controls are not."""
    assert {n for n, f in SOLVERS.items() if describe_stepper(f())["stages_past_end"]} == {
        "kvaerno4", "kvaerno5"
    }  # fmt: skip
    values = init_stacked_params(jr.PRNGKey(0), 2, 8, 16, dtype=jnp.float64)
    steps = dict(steps_per_layer=IMPLICIT_MIN_STEPS_PER_LAYER)
    for solver in (diffrax.Kvaerno4(), diffrax.Kvaerno5()):
        with pytest.raises(IncompatibleError, match="reads the next layer's controls") as e:
            _build(PiecewiseConstant(values), stepper=solver, **steps)
        assert e.value.field == "discretisation.stepper"
        _build(study_model("pre", seed=0).control, stepper=solver, **steps)  # a basis
    _build(PiecewiseConstant(values), stepper=diffrax.Kvaerno3(), **steps)


@pytest.mark.parametrize("formulation,name,steps", COARSE_IMPLICIT)
def test_implicit_solvers_at_coarse_steps_are_refused_with_the_step_count_that_works(
    pre, post, formulation, name, steps
):
    # Each of these solves stops in its nonlinear solver ("maximum number of steps was
    # reached"); the rules refuse them before anything is traced, and say what works.
    discretisation = Discretisation(solver_by_name(name), steps_per_layer=steps)
    with pytest.raises(IncompatibleError, match="steps_per_layer >= 4") as info:
        if formulation == "relaxed":
            model = reformulate(
                post, formulation="relaxed", relaxation_eps=1e-2, discretisation=discretisation
            )
        else:
            model = rediscretise(pre if formulation == "pre" else post, discretisation)
        model(study_input(model))
    assert info.value.field == "discretisation.steps_per_layer"
    assert name in str(info.value) and "kencarp" in str(info.value)


def test_reformulate_takes_a_sequence_model_as_rediscretise_does(post):
    """A model with a ``transformer`` field (``SequenceModel``) is reformulated in place
    of its transformer (it raised AttributeError: no ``control``)."""
    import equinox as eqx

    class Wrapped(eqx.Module):
        transformer: ContinuousTransformer

    wrapped = reformulate(Wrapped(post), formulation="relaxed", relaxation_eps=1.0)
    alone = reformulate(post, formulation="relaxed", relaxation_eps=1.0)
    assert isinstance(wrapped, Wrapped) and wrapped.transformer.formulation == "relaxed"
    u0 = study_input(post)
    assert jnp.array_equal(wrapped.transformer(u0), alone(u0))
    with pytest.raises(ValueError, match=r"reformulate takes a ContinuousTransformer or a model"):
        reformulate(object(), formulation="relaxed")


def test_implicit_solver_at_the_minimum_step_count_converges(post):
    # Kvaerno4 on the projected dynamics at 4 and 8 steps per layer against Tsit5 at 64:
    # the errors are those of a fourth-order method (measured 2.5e-3 and 1.4e-4).
    u0 = study_input(post)
    ref = refine(post, 64)(u0)
    errors = []
    for m in (IMPLICIT_MIN_STEPS_PER_LAYER, 2 * IMPLICIT_MIN_STEPS_PER_LAYER):
        u_m = rediscretise(post, stepper=diffrax.Kvaerno4(), steps_per_layer=m)(u0)
        errors.append(float(jnp.max(jnp.abs(u_m - ref))))
    assert errors[0] < 5e-3, errors
    assert 3.5 <= np.log2(errors[0] / errors[1]) <= 4.7, errors


def test_otd_refusals_give_the_reason_per_scheme_and_formulation(pre, post):
    from ocformer.integration import OptimiseThenDiscretise

    otd = OptimiseThenDiscretise()
    with pytest.raises(IncompatibleError, match="pre-LN is a smooth ODE") as info:
        rediscretise(pre, stepper=Strang(), gradient=otd)
    assert info.value.field == "discretisation.gradient"
    assert "projection sub-flows" not in str(info.value)
    with pytest.raises(IncompatibleError, match="projected dynamics stepped by a splitting"):
        rediscretise(post, stepper=Lie(), gradient=otd)
    values = init_stacked_params(jr.PRNGKey(0), 2, 8, 16, dtype=jnp.float64)
    post_split = ContinuousTransformer(PiecewiseConstant(values), norm="post", num_heads=2)
    with pytest.raises(IncompatibleError, match="projection sub-flows"):
        rediscretise(post_split, gradient=otd)
    rediscretise(pre, stepper=diffrax.Heun(), gradient=otd)  # the smooth ODE: allowed
    # The relaxed formulation backward is an expansion of rate 1/eps: refused, with an
    # explicit stepper and with an IMEX one (whose two terms the backsolve cannot take).
    relaxed = reformulate(post, formulation="relaxed", relaxation_eps=1.0)
    for stepper in (diffrax.Heun(), diffrax.KenCarp3()):
        with pytest.raises(IncompatibleError, match="grow like exp.T/eps.") as info:
            rediscretise(relaxed, stepper=stepper, steps_per_layer=8, gradient=otd)
        assert info.value.field == "discretisation.gradient"


def test_a_failed_implicit_stage_on_a_constant_grid_is_raised_not_returned(pre):
    """A stage equation without a root within reach ends diffrax's solve at that step,
    with the state it had: on a constant grid that state used to come back as u(T)
    (a finite, wrong output). The solve raises instead, and the training command's
    SolverFailure names what to change."""
    import equinox as eqx

    from ocformer.training import SolverFailure

    u0 = study_input(pre)
    stiff = jax.tree.map(lambda x: 5.0 * x if eqx.is_inexact_array(x) else x, pre)
    implicit = rediscretise(stiff, stepper=diffrax.Kvaerno3(), steps_per_layer=4)
    with pytest.raises(eqx.EquinoxRuntimeError, match="nonlinear solver"):
        implicit(u0)
    with pytest.raises(eqx.EquinoxRuntimeError, match="nonlinear solver") as raised:
        implicit(jnp.stack([u0, u0]))  # a batch, solved example by example
    message = str(SolverFailure.from_error(3, raised.value))
    assert "found no root" in message and "discretisation.steps_per_layer" in message
    assert "max_steps" not in message
    # The unscaled model solves on the same grid.
    assert jnp.all(
        jnp.isfinite(rediscretise(pre, stepper=diffrax.Kvaerno3(), steps_per_layer=4)(u0))
    )


def _implicit_and_whole(model, batch=2):
    """``model`` under Kvaerno 3 at 4 steps per layer (Newton to 1e-10), a batch of
    inputs with padded keys, and diffrax's solve of that batch as one state."""
    from ocformer.integration import solve

    model = rediscretise(
        model, stepper=diffrax.Kvaerno3(), steps_per_layer=4, rtol=1e-10, atol=1e-10
    )
    u0 = jnp.stack([study_input(model, seed=s) for s in range(batch)])
    key_mask = jnp.ones(u0.shape[:-1], bool).at[1, -2:].set(False)

    def whole(m, saveat=None):
        return solve(
            m.terms(), m.time_stepper(), m.control, m.initial_state(u0), m.discretisation,
            key_mask=key_mask, saveat=saveat,
        )  # fmt: skip

    return model, u0, key_mask, whole


def test_an_implicit_solve_on_a_constant_grid_is_the_batched_one_example_by_example(
    pre, monkeypatch
):
    """An implicit solver on a constant grid solves a batch example by example (its
    Newton Jacobians block by block): the states at every step, the times and the
    statistics are those of diffrax's solve of the whole batch."""
    model, u0, key_mask, whole = _implicit_and_whole(pre)
    saveat = diffrax.SaveAt(t0=True, steps=True)
    import ocformer.models._transformer as transformer_module

    taken = []
    per_example = transformer_module._per_example
    monkeypatch.setattr(
        transformer_module, "_per_example", lambda *a: taken.append(1) or per_example(*a)
    )
    sol, ref = model.solve(u0, key_mask, saveat), whole(model, saveat)
    assert taken == [1]  # the per-example solve, not diffrax's of the whole batch
    # Saves the batch's solve alone can make (a function of the state sees one example
    # in a per-example solve) and an unbatched input: the batched solve (adaptive steps
    # too: the slow test below).
    model.solve(u0, key_mask, diffrax.SaveAt(t1=True, fn=lambda t, y, args: jnp.mean(y)))
    model.solve(u0[0], key_mask[0])
    assert taken == [1]
    steps = 4 * model.num_layers
    assert sol.ys.shape == ref.ys.shape == (steps + 1, 2, 6, model.width)
    np.testing.assert_allclose(sol.ys, ref.ys, rtol=0, atol=1e-12)
    np.testing.assert_array_equal(sol.ts, ref.ts)
    assert int(sol.stats["num_steps"]) == int(ref.stats["num_steps"]) == steps


@pytest.mark.slow
@pytest.mark.parametrize("model_name", ["pre", "post"])
def test_the_gradient_of_an_implicit_solve_example_by_example_is_the_batched_one(
    model_name, request, monkeypatch
):
    """The same gradients as differentiating diffrax's solve of the whole batch (its
    stage solves' implicit-function gradients included), through the projected
    formulation's ``ProjectedSolver`` too."""
    import equinox as eqx

    model, u0, key_mask, whole = _implicit_and_whole(request.getfixturevalue(model_name))

    def loss(m, states):
        return jnp.sum(jnp.sin(states(m)))

    grad = eqx.filter_grad(loss)(model, lambda m: m(u0, key_mask))
    grad_ref = eqx.filter_grad(loss)(model, lambda m: m.final_projection(whole(m).ys[-1]))
    for g, r in zip(jax.tree.leaves(grad.control), jax.tree.leaves(grad_ref.control), strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-9, atol=1e-11)
    # Adaptive steps keep the batch one state (its step sizes are the batch's).
    import ocformer.models._transformer as transformer_module

    def refuse(*args):
        raise AssertionError("an adaptive solve went example by example")

    monkeypatch.setattr(transformer_module, "_per_example", refuse)
    adaptive = rediscretise(model, stepsize="pid")
    np.testing.assert_array_equal(adaptive.solve(u0, key_mask).ys, whole(adaptive, None).ys)
