"""The analysis functions against independent references: finite differences through
the model's own solve, autodiff of the whole solve, numpy, a linear map whose
finite-time Lyapunov exponents are the logarithms of the singular values of its powers,
and linear flows whose Lyapunov exponents are the real parts of their eigenvalues."""

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

from ocformer.analysis import (
    StepMap,
    benettin_exponents,
    chain,
    costates,
    discretisation_study,
    fitted_slope,
    gradient_check,
    gradient_density,
    lyapunov_exponents,
    lyapunov_refinement,
    model_benettin,
    model_lyapunov,
    randomised_lyapunov_exponents,
    study_model,
    terminal_loss,
    token_similarity,
)
from ocformer.controls import PiecewiseConstant, init_stacked_params
from ocformer.integration import Discretisation
from ocformer.models import ContinuousTransformer, Readout, SequenceModel, TokenEmbedding
from ocformer.splitting import Lie, Strang

WIDTH, HIDDEN, LAYERS, TOKENS, VOCAB = 4, 8, 2, 3, 5


def _values(seed=0):
    return init_stacked_params(jr.key(seed), LAYERS, WIDTH, HIDDEN, dtype=jnp.float64)


def _transformer(stepper, m, values=None, norm="pre", formulation="split", **kwargs):
    if values is None and formulation != "split":  # the set's scalar controls
        values = init_stacked_params(
            jr.key(0), LAYERS, WIDTH, HIDDEN, dtype=jnp.float64, norm_affine="scalar"
        )
    control = PiecewiseConstant(_values() if values is None else values)
    return ContinuousTransformer(
        control,
        norm=norm,
        formulation=formulation,
        num_heads=2,
        causal=True,
        activation="gelu",
        discretisation=Discretisation(stepper, steps_per_layer=m),
        **kwargs,
    )


def _sequence(transformer):
    k1, k2 = jr.split(jr.key(3))
    return SequenceModel(
        TokenEmbedding(VOCAB, TOKENS, WIDTH, key=k1, dtype=jnp.float64),
        transformer,
        Readout(WIDTH, VOCAB, key=k2, dtype=jnp.float64),
    )


def _batch():
    inputs = jnp.array([[1, 3, 2], [4, 0, 1]])
    return {"inputs": inputs, "targets": jnp.roll(inputs, -1, axis=1)}


def _u0():
    return jr.normal(jr.key(1), (TOKENS, WIDTH), jnp.float64)


def _loss(u):
    return jnp.sum(jnp.sin(u) * jnp.arange(1.0, 1.0 + u.shape[-1])[None, :])


def _direction(shape, seed):
    v = jr.normal(jr.key(seed), shape, jnp.float64)
    return v / jnp.linalg.norm(v)


@pytest.mark.parametrize(
    ("stepper", "formulation"),
    [
        (diffrax.Heun(), "split"),
        (Strang(sub_solver="midpoint"), "split"),
        (diffrax.Tsit5(), "split"),
        (diffrax.Tsit5(), "projected"),
        (diffrax.Dopri5(), "projected"),
    ],
    ids=["heun", "strang", "tsit5", "tsit5-projected", "dopri5-projected"],
)
def test_step_map_reproduces_the_solve(stepper, formulation):
    """Chaining the step map (Heun steps over the layer jumps, Strang's sub-flows, a
    first-same-as-last solver's steps, projected ones too) gives the states diffeqsolve
    saves, to rounding. Projected Tsit5 was 1e-2 off: the solve started each step from
    the last stage of the previous one, evaluated at the unprojected state, which a map
    of the state alone cannot reproduce."""
    norm = "pre" if formulation == "split" else "post"
    model = _transformer(stepper, 2, norm=norm, formulation=formulation)
    steps = StepMap(model, None, jnp.float64)
    ts, ys = model.trajectory(_u0())
    # From the solve's initial state (projected onto S1 in the projected formulation).
    np.testing.assert_allclose(np.asarray(chain(steps, ys[0])), np.asarray(ys), atol=1e-13)
    np.testing.assert_allclose(np.asarray(steps.times), np.asarray(ts), atol=1e-13)


@pytest.mark.slow
def test_gradient_check_agrees_with_finite_differences():
    """Heun, 2 steps per layer, cross-entropy: the exact methods match float64 central
    differences (h = 1e-5) to 1e-8; optimise-then-discretise differs by its
    discretisation error (measured 2e-2), which is far above that."""
    model = _sequence(_transformer(diffrax.Heun(), 2))
    batch = _batch()
    from ocformer.objective import Objective

    result = gradient_check(lambda m: Objective()(m, batch)[0], model, directions=3)
    methods = result["methods"]
    assert methods["discretise_then_optimise"]["fd_error"] < 1e-8, methods
    assert methods["direct"]["fd_error"] < 1e-8, methods
    assert 1e-4 < methods["optimise_then_discretise"]["fd_error"] < 0.5, methods
    lie = _sequence(_transformer(Lie(), 1))
    refused = gradient_check(lambda m: Objective()(m, batch)[0], lie, directions=1)
    assert refused["methods"]["optimise_then_discretise"]["status"] == "refused"
    assert refused["methods"]["discretise_then_optimise"]["fd_error"] < 1e-8


def test_gradient_check_refuses_bad_arguments_and_takes_a_flat_loss():
    """A string for ``methods`` was read a character at a time (``Unknown gradient
    methods ['d', 'i', ...]``), ``directions=0`` failed inside ``max``, and a loss flat
    along every direction divided by zero. Now: a ValueError naming the argument, and
    a flat loss's exact gradient has error 0."""
    model = _transformer(Lie(), 1)
    with pytest.raises(
        ValueError, match=r"methods must be a list of names, got the string 'direct'"
    ):
        gradient_check(lambda m: m(_u0()).sum(), model, methods="direct")
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match=r"directions must be a whole number >= 1"):
            gradient_check(lambda m: m(_u0()).sum(), model, directions=bad)
    # A float32 model: its differences at h = 1e-5 are rounding (every exact method
    # was reported 85 % off a run's trained model).
    from ocformer.objective import in_precision

    with pytest.raises(ValueError, match=r"needs the controls in float64, got float32: "):
        gradient_check(lambda m: m(_u0()).sum(), in_precision(model, jnp.float32))
    flat = gradient_check(
        lambda m: 0.0 * m(_u0()).sum(), model, methods=["discretise_then_optimise"], directions=1
    )
    assert flat["finite_differences"] == [0.0]
    assert flat["methods"]["discretise_then_optimise"]["fd_error"] == 0.0


def test_costates_match_finite_differences_through_the_solve():
    """lambda_n = dJ/du_n. At the layer boundary t = 1 the reference is a central
    difference of J through the model's own solve of the remaining layer (a model of
    layer 1 alone, on [1, 2]); at t = 0 it is autodiff of the whole solve."""
    model = _transformer(diffrax.Heun(), 2)
    u0 = _u0()
    result = costates(model, u0, _loss)
    assert result.costates.shape == (LAYERS * 2 + 1, TOKENS, WIDTH)
    np.testing.assert_allclose(
        np.asarray(result.costates[0]),
        np.asarray(jax.grad(lambda u: _loss(model(u)))(u0)),
        rtol=1e-12,
        atol=1e-12,
    )
    values = jax.tree.map(lambda x: x[1:], model.control.values)
    rest = eqx.tree_at(lambda m: m.control, model, PiecewiseConstant(values, t0=1.0))
    u1 = result.states[2]
    h = 1e-5
    for seed in range(2):
        v = _direction(u1.shape, seed)
        fd = (_loss(rest(u1 + h * v)) - _loss(rest(u1 - h * v))) / (2 * h)
        assert abs(float(jnp.vdot(result.costates[2], v)) - float(fd)) < 1e-9


@pytest.mark.slow
def test_substep_costates_match_finite_differences():
    """Strang on the two pre-LN terms has three sub-flows per step: the costate after
    each is the central difference of J under a perturbation added there (through the
    rest of the step and the remaining steps); the last one of a step is the next
    step's costate."""
    model = _transformer(Strang(sub_solver="midpoint"), 1)
    u0 = _u0()
    result = costates(model, u0, _loss, substeps=True)
    assert result.sub_costates is not None and result.sub_costates.shape[0] == 2 * 3
    steps = StepMap(model, None, jnp.float64)
    np.testing.assert_allclose(
        np.asarray(result.sub_costates[2::3]), np.asarray(result.costates[1:]), atol=1e-12
    )
    h = 1e-5
    for k in range(3):  # the sub-flows of step 0
        v = _direction(u0.shape, k)

        def j(eps, k=k, v=v):
            deltas = jnp.zeros((3, *u0.shape)).at[k].set(eps * v)
            y1 = steps.nudged(0, u0, deltas)
            return _loss(steps(1, y1))

        fd = (j(h) - j(-h)) / (2 * h)
        assert abs(float(jnp.vdot(result.sub_costates[k], v)) - float(fd)) < 1e-9


@pytest.mark.parametrize("formulation", ["split", "projected", "relaxed"])
def test_gradient_density_sums_to_the_layer_gradients(formulation):
    """For piecewise-constant controls the density integrated over each layer is
    dJ/dtheta_k, here against autodiff of the whole solve (Heun, 3 steps per layer;
    KenCarp3 on the relaxed formulation, whose projection of u0 onto S1(theta(t0))
    the density left out: 1.1e-2 off in the layer-norm controls)."""
    if formulation == "split":
        model = _transformer(diffrax.Heun(), 3)
    else:
        stepper = diffrax.Heun() if formulation == "projected" else diffrax.KenCarp3()
        kwargs = {"relaxation_eps": 0.1} if formulation == "relaxed" else {}
        model = _transformer(stepper, 3, norm="post", formulation=formulation, **kwargs)
    u0 = _u0()
    result = gradient_density(model, u0, _loss)
    assert result.density.shape == (LAYERS * 3,)
    exact = jax.grad(lambda v: _loss(eqx.tree_at(lambda m: m.control.values, model, v)(u0)))(
        model.control.values
    )
    for a, b in zip(jax.tree.leaves(result.per_layer), jax.tree.leaves(exact)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-10, atol=1e-12)


def test_terminal_loss_is_the_objective():
    from ocformer.objective import Objective

    model = _sequence(_transformer(diffrax.Heun(), 1))
    u0, key_mask, loss = terminal_loss(model, _batch())
    assert key_mask is None
    np.testing.assert_allclose(
        float(loss(model.transformer(u0))), float(Objective()(model, _batch())[0]), rtol=1e-14
    )


@pytest.mark.slow
def test_discretisation_study_order_of_heun():
    """A smooth-control model under Heun at m = 4, 8, 16 against Tsit5 at 64: the
    distance of u(T) falls at Heun's order (fitted slope 2 +- 0.3); Lie on a smooth
    pre-LN model converges at order 1."""
    from ocformer.analysis import fitted_slope

    transformer = study_model("pre", width=WIDTH, hidden=HIDDEN)
    model = _sequence(transformer)
    study = discretisation_study(
        model,
        _batch(),
        {f"heun {m}": Discretisation(diffrax.Heun(), steps_per_layer=m) for m in (4, 8, 16)}
        | {"lie 8": Discretisation(Lie(), steps_per_layer=8)},
        Discretisation(diffrax.Tsit5(), steps_per_layer=64),
    )
    heun = [study["results"][f"heun {m}"] for m in (4, 8, 16)]
    slope = fitted_slope([1 / 4, 1 / 8, 1 / 16], [r["u_distance"] for r in heun])
    assert 1.7 < slope < 2.3, heun
    assert heun[-1]["loss_gap"] < heun[0]["loss_gap"]
    assert study["results"]["lie 8"]["u_distance"] > heun[1]["u_distance"]
    # {} is the model as it is (rediscretise refused it).
    same = model.transformer.discretisation
    own = discretisation_study(model, _batch(), {"own": {}, "same": same},
                               {"steps_per_layer": 8})  # fmt: skip
    assert own["results"]["own"]["loss"] == own["results"]["same"]["loss"]


def test_token_similarity_against_numpy():
    model = _transformer(diffrax.Heun(), 1)
    u0 = _u0()
    result = token_similarity(model, u0)
    _, ys = model.trajectory(u0)
    y = np.asarray(ys[-1])
    cos = np.array([[a @ b / np.linalg.norm(a) / np.linalg.norm(b) for b in y] for a in y])
    np.testing.assert_allclose(np.asarray(result.cosine[-1]), cos, atol=1e-13)
    off = cos[~np.eye(TOKENS, dtype=bool)]
    np.testing.assert_allclose(float(result.mean[-1]), off.mean(), atol=1e-13)
    np.testing.assert_allclose(float(result.min[-1]), off.min(), atol=1e-13)


def test_token_analyses_refuse_inputs_outside_their_contract():
    """An adaptive solve (a trajectory padded to its step budget) and a batch given as
    one input to the exponents are named, not analysed into padding or one member."""
    from ocformer.models import rediscretise

    model = _transformer(diffrax.Heun(), 1)
    adaptive = rediscretise(model, stepper=diffrax.Tsit5(), stepsize="pid")
    with pytest.raises(ValueError, match="token_similarity follows the states of the grid"):
        token_similarity(adaptive, _u0())
    with pytest.raises(ValueError, match=r"model_lyapunov takes one input u0 of shape \(N, d\)"):
        model_lyapunov(model, jnp.stack([_u0(), _u0()]), 2)
    # A bfloat16 input, whose state the model carries in float32: named, with the cast.
    half = _u0().astype(jnp.bfloat16)
    for analyse in (
        lambda: costates(model, half, lambda u: jnp.sum(u.astype(jnp.float32))),
        lambda: model_lyapunov(model, half, 2),
    ):
        with pytest.raises(ValueError, match=r"the input is bfloat16.*u0.astype\(jnp.float32\)"):
            analyse()


def test_benettin_exponents_of_a_linear_flow():
    """u' = A u with A block upper-triangular: eigenvalues 0.3, -0.2 +- 1.5i and -1.0.
    Benettin's estimates over T = 100 (Tsit5, dt = 0.1) match the real parts
    0.3, -0.2, -0.2, -1.0 to 0.035 (measured: 0.028 at most; the finite-time error is
    O(1/T)), and their sum is
    the trace of A (volume grows as det exp(tA) = exp(t tr A)) to the solver's error."""
    a = jnp.array(
        [
            [0.3, 0.2, 0.1, 0.05],
            [0.0, -0.2, 1.5, 0.1],
            [0.0, -1.5, -0.2, 0.1],
            [0.0, 0.0, 0.0, -1.0],
        ],
        jnp.float64,
    )
    expected = np.array([0.3, -0.2, -0.2, -1.0])
    np.testing.assert_allclose(
        np.sort(np.linalg.eigvals(np.asarray(a)).real)[::-1], expected, atol=1e-12
    )
    term = diffrax.ODETerm(lambda t, y, args: a @ y)
    solver = diffrax.Tsit5(scan_kind="lax")  # forward-mode differentiable stages
    times = jnp.linspace(0.0, 100.0, 1001)

    def step(n, y):
        t0, t1 = times[n], times[n + 1]
        return solver.step(term, t0, t1, y, None, solver.init(term, t0, t1, y, None), True)[0]

    result = benettin_exponents(step, times, jnp.ones(4, jnp.float64), 4)
    np.testing.assert_allclose(np.asarray(result.exponents), expected, atol=0.035)
    np.testing.assert_allclose(float(jnp.sum(result.exponents)), float(jnp.trace(a)), atol=1e-6)
    assert result.running.shape == (1000, 4)


# A diagonalisable, non-normal map with eigenvalue moduli e^2 and e^1: its Lyapunov
# exponents are 2 and 1, and its finite-time ones (1/n) log sigma_k(A^n) differ from
# them by O(1/n).
_EIGENVECTORS = np.array([[1.0, 0.6], [-0.4, 1.0]])
_LINEAR_MAP = _EIGENVECTORS @ np.diag([np.e**2, np.e]) @ np.linalg.inv(_EIGENVECTORS)


def _linear_step(n, y):
    return jnp.asarray(_LINEAR_MAP) @ y


def test_lyapunov_exponents_of_a_linear_map():
    """y -> A y over n = 1..10 steps of unit time: the exponents after each step are
    (1/n) log sigma_k(A^n) from numpy's SVD of the matrix power, to 1e-12 (measured
    6e-14)."""
    steps = 10
    result = lyapunov_exponents(_linear_step, jnp.arange(steps + 1.0), jnp.ones(2), 2)
    powers = [np.linalg.matrix_power(_LINEAR_MAP, n) for n in range(1, steps + 1)]
    exact = np.array(
        [np.log(np.linalg.svd(a, compute_uv=False)) / n for n, a in enumerate(powers, 1)]
    )
    np.testing.assert_allclose(np.asarray(result.ts), np.arange(1.0, steps + 1.0), rtol=0, atol=0)
    np.testing.assert_allclose(np.asarray(result.running), exact, rtol=0, atol=1e-12)
    np.testing.assert_allclose(np.asarray(result.exponents), exact[-1], rtol=0, atol=1e-12)


def test_lyapunov_exponents_match_the_jacobian_of_the_flow():
    """The transformer's flow (Heun, 2 steps per layer): after every step n the
    exponents are (1/t_n) log sigma_k of du_n/du_0, here ``jax.jacfwd`` of the chained
    steps (which reproduce the solve: ``test_step_map_reproduces_the_solve``) and
    numpy's SVD, to 1e-12."""
    model = _transformer(diffrax.Heun(), 2)
    u0 = _u0()
    num, dim = 4, TOKENS * WIDTH
    steps = StepMap(model, None, jnp.float64)
    ts = np.asarray(steps.times)
    jacobians = jax.jit(jax.jacfwd(lambda u: chain(steps, u)))(u0).reshape(-1, dim, dim)
    exact = np.array(
        [
            np.log(np.linalg.svd(np.asarray(j), compute_uv=False)[:num]) / (t - ts[0])
            for j, t in zip(jacobians[1:], ts[1:])
        ]
    )
    result = model_lyapunov(model, u0, num)
    np.testing.assert_allclose(np.asarray(result.ts), ts[1:], rtol=0, atol=0)
    np.testing.assert_allclose(np.asarray(result.running), exact, rtol=0, atol=1e-12)
    np.testing.assert_allclose(np.asarray(result.exponents), exact[-1], rtol=0, atol=1e-12)


def test_randomised_lyapunov_exponents_within_their_bound():
    """Randomised subspace iteration (num = 2 and the defaults: 4 oversampling columns,
    2 iterations) on the transformer's flow against the exact exponents: never above
    them, below by at most the docstring's bound evaluated with the drawn Omega, and by
    at most 1e-4 (measured 5.1e-5, the bound 1.4e-2)."""
    model = _transformer(diffrax.Heun(), 2)
    u0 = _u0()
    num, oversample, iterations, seed = 2, 4, 2, 0
    steps = StepMap(model, None, jnp.float64)
    result = randomised_lyapunov_exponents(steps, steps.times, u0, num, seed=seed)
    horizon = float(steps.times[-1] - steps.times[0])
    assert result.running.shape == (1, num)
    jacobian = jax.jit(jax.jacfwd(lambda u: chain(steps, u)[-1]))(u0).reshape(u0.size, -1)
    _, sigma, vt = np.linalg.svd(np.asarray(jacobian))
    error = np.log(sigma[:num]) / horizon - np.asarray(result.exponents)
    omega = np.asarray(jr.normal(jr.key(seed), (u0.size, num + oversample), jnp.float64))
    c = np.linalg.norm(vt[num:] @ omega @ np.linalg.pinv(vt[:num] @ omega), 2)
    bound = np.log1p(c**2 * (sigma[num] / sigma[:num]) ** (4 * iterations + 2)) / (2 * horizon)
    assert np.all(error > -1e-13), error
    assert np.all(error <= bound), (error, bound)
    assert np.max(error) < 1e-4, error


def test_benettin_converges_to_the_exponents_as_the_horizon_grows():
    """On the linear map, Benettin's estimates over T = 10, 100, 1000 steps miss the
    exponents (2, 1) by 4.9e-2, 4.9e-3, 4.9e-4 (seed 0): O(1/T), fitted slope -1. At
    T = 10 they are also far from the finite-time exponents, which are within 1.3e-3
    of the limit."""
    horizons = (10, 100, 1000)
    errors = []
    for t in horizons:
        estimate = benettin_exponents(_linear_step, jnp.arange(t + 1.0), jnp.ones(2), 2)
        errors.append(float(np.max(np.abs(np.asarray(estimate.exponents) - [2.0, 1.0]))))
    assert 4e-2 < errors[0] < 6e-2 and errors[-1] < 6e-4, errors
    assert abs(fitted_slope(horizons, errors) + 1.0) < 0.01, errors
    finite_time = lyapunov_exponents(_linear_step, jnp.arange(11.0), jnp.ones(2), 2)
    assert float(np.max(np.abs(np.asarray(finite_time.exponents) - [2.0, 1.0]))) < 1.3e-3
    model = _transformer(diffrax.Heun(), 1)
    steps = StepMap(model, None, jnp.float64)
    np.testing.assert_allclose(
        np.asarray(model_benettin(model, _u0(), 2, seed=1).exponents),
        np.asarray(benettin_exponents(steps, steps.times, _u0(), 2, seed=1).exponents),
        rtol=0,
        atol=1e-14,
    )


@pytest.mark.slow
def test_lyapunov_refinement_converges():
    """Heun on the transformer's flow: the exponents at m = 2, 4, 8 approach those at
    m = 16 at Heun's order (fitted slope measured 2.0; from m = 1 to 2 the local slope
    is 0.5, before the asymptotic range)."""
    model = _transformer(diffrax.Heun(), 1)
    result = lyapunov_refinement(model, _u0(), (2, 4, 8, 16), num=2)
    d = result["distance_to_finest"]
    assert d[0] > d[1] > d[2] > 0, d
    assert 1.8 < result["slope"] < 2.3, result
