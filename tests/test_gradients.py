"""Gradient methods against float64 central finite differences, and against each other.

Discretise-then-optimise and direct differentiate the discrete objective exactly, so
they must match finite differences to the differencing error. Optimise-then-discretise
is the gradient of the continuous problem, discretised: it differs from the discrete
gradient by the discretisation error, which must shrink as the grid is refined.
"""

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

from ocformer.controls import Basis, PiecewiseConstant, init_stacked_params
from ocformer.integration import (
    GRADIENT_METHODS,
    BackwardGrid,
    Direct,
    Discretisation,
    DiscretiseThenOptimise,
    OptimiseThenDiscretise,
)
from ocformer.models import (
    ContinuousTransformer,
    IncompatibleError,
    Readout,
    SequenceModel,
    TokenEmbedding,
    rediscretise,
    refine,
)
from ocformer.objective import Objective
from ocformer.tasks import CopyTask

L, D, DFF, V, N = 2, 4, 8, 5, 6


def build(norm="post", stepper=None, steps_per_layer=1, gradient=None, control=None):
    k = jr.split(jr.key(0), 3)
    if control is None:
        control = PiecewiseConstant(init_stacked_params(k[0], L, D, DFF, dtype=jnp.float64))
    transformer = ContinuousTransformer(
        control,
        norm=norm,
        num_heads=2,
        causal=True,
        ln_eps=1e-5 if norm == "pre" else 0.0,
        discretisation=Discretisation(stepper, steps_per_layer=steps_per_layer, gradient=gradient),
    )
    embedding = TokenEmbedding(V, N, D, key=k[1], dtype=jnp.float64)
    return SequenceModel(embedding, transformer, Readout(D, V, key=k[2], dtype=jnp.float64))


BATCH = {k: jnp.asarray(v) for k, v in CopyTask(N, V).batch("train", 0, 3, 0).items()}


@eqx.filter_jit
def value_and_grad(objective, model, batch):
    # Module-level and jitted once per (objective, model structure): the finite
    # differences below reuse one compiled loss.
    return eqx.filter_grad(lambda m: objective(m, batch)[0])(model)


@eqx.filter_jit
def _loss(objective, model, batch):
    return objective(model, batch)[0]


def directional_fd(objective, model, batch, direction, eps=3e-4):
    """The derivative of the loss along ``direction`` by the fourth-order central
    difference along its unit vector (steps of ``eps``): truncation O(eps^4) and
    rounding O(1e-16 / eps) are both below 1e-12 in float64, so it checks a gradient to
    about eleven digits. Steps of 1e-3 and more cross kinks of the loss (errors 5e-5 to
    3e-3 on the pre-LN models here), so ``eps`` stays below them."""
    params, static = eqx.partition(model, eqx.is_inexact_array)
    norm = np.sqrt(sum(float(jnp.vdot(d, d)) for d in jax.tree.leaves(direction)))

    def at(h):
        moved = jax.tree.map(lambda a, b: a + (h / norm) * b, params, direction)
        return float(_loss(objective, eqx.combine(moved, static), batch))

    slope = (8 * (at(eps) - at(-eps)) - (at(2 * eps) - at(-2 * eps))) / (12 * eps)
    return norm * slope


def random_direction(model, seed=7):
    params = eqx.filter(model, eqx.is_inexact_array)
    leaves, treedef = jax.tree.flatten(params)
    keys = jr.split(jr.key(seed), len(leaves))
    return jax.tree.unflatten(
        treedef, [jr.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)]
    )


def dot(a, b):
    return float(sum(jnp.vdot(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))))


def relative_gap(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    num = sum(float(jnp.sum((x - y) ** 2)) for x, y in zip(la, lb))
    return np.sqrt(num / sum(float(jnp.sum(y**2)) for y in lb))


OBJECTIVE = Objective(control_smoothness=0.1, control_size=0.01, kinetic_energy=0.05)


def test_registry_names():
    assert set(GRADIENT_METHODS) == {
        "discretise_then_optimise",
        "optimise_then_discretise",
        "direct",
        "stored",
        "stored_dots",
        "stored_projections",
    }
    for name, cls in GRADIENT_METHODS.items():
        assert cls.name == name


def _adjoint(model):
    t = model.transformer
    d = t.discretisation
    return d.gradient.adjoint(t.time_stepper(), t.control, d.steps_per_layer, d.is_adaptive)


def test_adjoints_are_derived_from_the_grid():
    dto = _adjoint(build())
    assert isinstance(dto, diffrax.RecursiveCheckpointAdjoint) and dto.checkpoints == L
    # Refinement changes the grid, and with it the checkpoints: nothing is copied over.
    assert _adjoint(refine(build("pre"), 3)).checkpoints == 3 * L
    assert isinstance(_adjoint(build(gradient=Direct())), diffrax.DirectAdjoint)
    otd_model = build("pre", diffrax.Euler(), 1, OptimiseThenDiscretise())
    otd = _adjoint(refine(otd_model, 4))
    assert isinstance(otd, diffrax.BacksolveAdjoint)
    # The backward solve walks the refined forward grid from t1 to t0 (4 steps per
    # layer), stepping over the layer jumps as the forward solve of a non-splitting
    # solver does.
    grid = otd.kwargs["stepsize_controller"]
    assert isinstance(grid, BackwardGrid)
    np.testing.assert_allclose(grid.times, np.linspace(0.0, L, 4 * L + 1), rtol=0, atol=1e-15)
    assert [t for t, j in zip(grid.times, grid.on_jump) if j] == list(range(1, L))


@pytest.mark.parametrize(
    "method",
    [
        DiscretiseThenOptimise,
        # The same check for two more methods: the slow tier (each about 16 s).
        pytest.param(OptimiseThenDiscretise, marks=pytest.mark.slow),
        pytest.param(Direct, marks=pytest.mark.slow),
    ],
    ids=lambda c: c.name,
)
def test_refined_model_has_the_gradients_of_a_fresh_one(method):
    """refine(model, m) derives everything grid-dependent (checkpoints, the backward
    grid of the continuous adjoint, max_steps) anew: its gradients equal, in float64,
    those of a model built at m steps per layer."""
    objective = Objective(control_smoothness=0.1)
    coarse = build("pre", diffrax.Heun(), 1, method())
    fresh = build("pre", diffrax.Heun(), 4, method())
    refined = refine(coarse, 4)
    g_refined = value_and_grad(objective, refined, BATCH)
    g_fresh = value_and_grad(objective, fresh, BATCH)
    assert relative_gap(g_refined, g_fresh) <= 1e-12
    # And the coarse model's gradient differs: the test can fail.
    assert relative_gap(value_and_grad(objective, coarse, BATCH), g_fresh) > 1e-3


def test_otd_refuses_splitting_schemes_and_says_why():
    with pytest.raises(IncompatibleError, match="projection sub-flows") as info:
        build("post", gradient=OptimiseThenDiscretise())
    assert info.value.field == "discretisation.gradient"


def test_otd_refuses_projected_dynamics_with_jumping_controls():
    values = init_stacked_params(jr.key(0), L, D, DFF, dtype=jnp.float64, norm_affine="scalar")
    with pytest.raises(IncompatibleError, match="continuous controls.*jumps"):
        ContinuousTransformer(
            PiecewiseConstant(values),
            num_heads=2,
            formulation="projected",
            discretisation=Discretisation(diffrax.Euler(), gradient=OptimiseThenDiscretise()),
        )


@pytest.mark.parametrize("method", [DiscretiseThenOptimise, Direct])
def test_exact_methods_match_finite_differences(method):
    """Pre-LN, Lie scheme, two steps per layer, every running cost on: the gradient of
    the discrete objective, to the float64 central-difference error."""
    model = build("pre", steps_per_layer=2, gradient=method())
    grad = value_and_grad(OBJECTIVE, model, BATCH)
    direction = random_direction(model)
    fd = directional_fd(OBJECTIVE, model, BATCH, direction)
    assert abs(dot(grad, direction) - fd) <= 1e-10 * abs(fd)
    # Per coordinate too, on a few entries of a kernel of the second layer.
    for idx in [(1, 0, 1), (1, 3, 2)]:
        unit = jax.tree.map(jnp.zeros_like, direction)
        unit = eqx.tree_at(
            lambda m: m.transformer.control.values.attention.wq,
            unit,
            unit.transformer.control.values.attention.wq.at[idx].set(1.0),
        )
        g = float(grad.transformer.control.values.attention.wq[idx])
        assert abs(g - directional_fd(OBJECTIVE, model, BATCH, unit)) <= 1e-9 * max(abs(g), 1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["direct", "stored", "stored_dots", "stored_projections"])
def test_hessian_vector_products_match_finite_differences_of_the_gradient(method):
    """Reverse over reverse (a Hessian-vector product) and forward mode work through
    ``Direct`` and the stored methods: the HVP equals the central difference of the
    gradient along the direction. ``DiscretiseThenOptimise`` and
    ``OptimiseThenDiscretise`` are reverse mode only, once (jax refuses the rest)."""
    model = build("pre", steps_per_layer=2, gradient=GRADIENT_METHODS[method]())
    direction = random_direction(model)
    params, static = eqx.partition(model, eqx.is_inexact_array)

    def grad_at(p):
        return value_and_grad(OBJECTIVE, eqx.combine(p, static), BATCH)

    def along(p):
        return dot_traced(grad_at(p), direction)

    hvp = eqx.filter_jit(jax.grad(along))(params)
    eps = 1e-5
    plus = grad_at(jax.tree.map(lambda a, b: a + eps * b, params, direction))
    minus = grad_at(jax.tree.map(lambda a, b: a - eps * b, params, direction))
    fd = jax.tree.map(lambda a, b: (a - b) / (2 * eps), plus, minus)
    assert relative_gap(eqx.filter(hvp, eqx.is_inexact_array), fd) < 1e-6
    # Forward mode: the directional derivative of the loss equals <gradient, direction>.
    _, tangent = jax.jvp(
        lambda p: _loss(OBJECTIVE, eqx.combine(p, static), BATCH), (params,), (direction,)
    )
    grad = grad_at(params)
    assert abs(float(tangent) - dot(grad, direction)) <= 1e-10 * abs(float(tangent))


def dot_traced(a, b):
    return sum(jnp.vdot(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_gradient_under_vmap():
    """Per-example gradients through jax.vmap: each matches finite differences of its
    own example, and their mean is the batch gradient (equal scored positions per
    example make the batch loss the mean of the per-example losses)."""
    model = build("post")
    objective = Objective(control_smoothness=0.1)

    def loss_one(m, inputs, targets):
        return objective(m, {"inputs": inputs[None], "targets": targets[None]})[0]

    per_example = eqx.filter_jit(eqx.filter_vmap(eqx.filter_grad(loss_one), in_axes=(None, 0, 0)))(
        model, BATCH["inputs"], BATCH["targets"]
    )
    batch_grad = value_and_grad(objective, model, BATCH)
    mean = jax.tree.map(lambda g: jnp.mean(g, axis=0), per_example)
    assert relative_gap(mean, batch_grad) < 1e-12
    direction = random_direction(model, seed=3)
    one = {k: v[1:2] for k, v in BATCH.items()}
    fd = directional_fd(objective, model, one, direction)
    g1 = jax.tree.map(lambda g: g[1], per_example)
    assert abs(dot(g1, direction) - fd) <= 1e-10 * abs(fd)


@pytest.mark.slow
def test_otd_converges_to_the_discrete_gradient():
    """Pre-LN with explicit Euler (a smooth single-term ODE): the continuous adjoint
    differs from the exact discrete gradient by O(dt). Measured (this model): relative
    gaps 0.541, 0.177, 0.059 at 1, 4, 16 steps per layer (slope about 0.8). The gap at
    the Transformer's own grid (one step per layer) is O(1): there OtD is not the
    gradient of the network, and the test records that."""
    objective = Objective(control_smoothness=0.1)
    gaps = []
    steps = [1, 4, 16]
    for m in steps:
        model = build("pre", diffrax.Euler(), m)
        exact = value_and_grad(objective, model, BATCH)
        otd_model = rediscretise(model, gradient=OptimiseThenDiscretise())
        otd = value_and_grad(objective, otd_model, BATCH)
        gaps.append(relative_gap(otd, exact))
    assert gaps[0] > 0.3  # the coarse-grid disagreement is real, not rounding
    slope = np.polyfit(np.log(steps), np.log(gaps), 1)[0]
    assert -1.3 < slope < -0.7, (gaps, slope)
    assert gaps[-1] < 0.1


def _basis_controls():
    """Smooth controls: a Legendre basis of 3 coefficient sets, with no jumps, so the
    forward grid is plain ``StepTo``. The coefficients of P_1 and P_2 are scaled by 0.1:
    with all three at the initial layers' size the field varies so fast in t that
    m <= 32 is pre-asymptotic (measured final-state gaps 2.7, 1.09, 0.75 at m = 2, 8,
    32, against 0.43, 0.11, 0.039 with the scaling)."""
    values = init_stacked_params(jr.key(0), 3, D, DFF, dtype=jnp.float64)
    scale = jnp.asarray([1.0, 0.1, 0.1])
    values = jax.tree.map(lambda v: v * scale.reshape(3, *(1,) * (v.ndim - 1)), values)
    return Basis(values, 0.0, float(L), num_layers=L)


@pytest.mark.slow
@pytest.mark.parametrize("controls", ["piecewise_constant", "basis"])
def test_otd_with_running_costs_converges_to_the_discrete_gradient(controls):
    """Every running cost on, the kinetic energy among them, which reads the state at
    every grid point: diffrax's ``BacksolveAdjoint`` then solves backward one saved
    interval at a time, each solve starting inside the backward grid. The gap to the
    exact gradient falls at explicit Euler's order. Measured (piecewise-constant
    controls, relative gaps at m = 1, 2, 4, 8, 16 steps per layer): 0.537, 0.287, 0.175,
    0.0939, 0.0546; when every interval restarted the grid from t1 they grew instead
    (0.875, 1.17, 46.6, 7.97e4, 2.01e11). Smooth controls, which raised diffrax's "Must
    have t0==ts[0]", give (kinetic energy alone) 0.558, 0.144, 0.0397 at m = 2, 8, 32."""
    gaps = []
    steps = [2, 8]
    for m in steps:
        control = _basis_controls() if controls == "basis" else None
        model = build("pre", diffrax.Euler(), m, control=control)
        exact = value_and_grad(OBJECTIVE, model, BATCH)
        otd = value_and_grad(
            OBJECTIVE, rediscretise(model, gradient=OptimiseThenDiscretise()), BATCH
        )
        gaps.append(relative_gap(otd, exact))
    slope = np.log(gaps[1] / gaps[0]) / np.log(steps[1] / steps[0])
    assert -1.2 < slope < -0.6, (gaps, slope)
    assert gaps[-1] < 0.15, gaps


def test_otd_on_pre_ln_vmaps():
    """The continuous adjoint runs under vmap; per-example costates average to the
    batch costate (the backward solve is linear in the terminal condition)."""
    model = build("pre", diffrax.Euler(), 2, OptimiseThenDiscretise())
    objective = Objective()

    def loss_one(m, inputs, targets):
        return objective(m, {"inputs": inputs[None], "targets": targets[None]})[0]

    per_example = eqx.filter_jit(eqx.filter_vmap(eqx.filter_grad(loss_one), in_axes=(None, 0, 0)))(
        model, BATCH["inputs"], BATCH["targets"]
    )
    mean = jax.tree.map(lambda g: jnp.mean(g, axis=0), per_example)
    assert relative_gap(mean, value_and_grad(objective, model, BATCH)) < 1e-10


@pytest.mark.slow
def test_otd_of_a_float32_model_walks_a_float32_grid_back_under_x64():
    """With 64-bit JAX on (this suite), the backward grid of a float32 model is float32
    as the forward's times are (it was JAX's default float64: the backward solve failed
    to trace); its gradient is the float64 model's to float32 rounding."""
    model = build("pre", diffrax.Euler(), 2, OptimiseThenDiscretise())
    to32 = lambda x: x.astype(jnp.float32) if eqx.is_inexact_array(x) else x  # noqa: E731
    model32 = jax.tree.map(to32, model)
    grad32 = value_and_grad(OBJECTIVE, model32, BATCH)
    assert {x.dtype for x in jax.tree.leaves(grad32) if eqx.is_inexact_array(x)} == {
        jnp.dtype("float32")
    }
    grad64 = value_and_grad(OBJECTIVE, model, BATCH)
    assert relative_gap(jax.tree.map(lambda x: x.astype(jnp.float64), grad32), grad64) < 1e-5


def _pid(gradient, tol=1e-8, jump_ts=False):
    """The pre-LN ReLU model of ``build`` under PID steps (Tsit5; by default crossing
    the layer jumps, so that a constant grid of the accepted times repeats the solve
    step for step)."""
    disc = Discretisation(diffrax.Tsit5(), steps_per_layer=2, stepsize="pid", rtol=tol,
                          atol=tol, jump_ts=jump_ts, gradient=gradient)  # fmt: skip
    return eqx.tree_at(lambda m: m.transformer.discretisation, build("pre"), disc)


class _GridSolves:
    """``diffrax.diffeqsolve`` for the test below: with ``grid`` None, the solve as
    asked, its accepted times appended to ``times`` (traced with the program that
    solves); with a ``grid``, the same solve on that constant grid (``diffrax.StepTo``)."""

    def __init__(self):
        self.plain = diffrax.diffeqsolve
        self.grid = None
        self.times = []

    def __call__(self, terms, solver, **kw):
        if self.grid is not None:
            kw.update(stepsize_controller=diffrax.StepTo(ts=self.grid), dt0=None,
                      max_steps=len(self.grid) - 1, adjoint=diffrax.DirectAdjoint())  # fmt: skip
            return self.plain(terms, solver, **kw)
        sol = self.plain(terms, solver, **dict(kw, saveat=diffrax.SaveAt(steps=True)))
        self.times.append(sol.ts)
        n = sol.stats["num_accepted_steps"]  # the model reads u(T), the last saved state
        last = jax.tree.map(lambda y: jax.lax.dynamic_index_in_dim(y, n - 1), sol.ys)
        return eqx.tree_at(lambda s: s.ys, sol, last)

    def on_grid(self, loss, params, direction, times, jumps=()):
        """``loss`` and its forward-mode derivative along ``direction`` on the constant
        grid of the accepted ``times``. A solve that steps onto the control's ``jumps``
        ends a step at the float before a jump and starts the next one at the float
        after it (diffrax records the step there): the grid crosses each jump by a
        step of two ulps, whose last stage reads the new layer, as the solve's next
        first stage does."""
        times = np.asarray(times)
        times = np.concatenate([[0.0], times[np.isfinite(times)]])
        for jump in jumps:
            times = np.union1d(times, [np.nextafter(jump, -np.inf), np.nextafter(jump, np.inf)])
        self.grid = jnp.asarray(times)
        try:
            value, tangent = jax.jvp(lambda p: loss(p)[0], (params,), (direction,))
        finally:
            self.grid = None
        return float(value), float(tangent)


@pytest.mark.slow  # 16 to 25 s each on the 2-core machine
@pytest.mark.parametrize("jump_ts", [True, False])
def test_under_pid_steps_each_gradient_is_exact_on_the_grid_its_program_chose(monkeypatch, jump_ts):
    """Under PID steps the step-size controller's choices carry no derivative (diffrax
    stops their gradients), so a gradient is that of the loss on a fixed grid; the
    reference is ``diffrax.StepTo`` on the accepted times, differentiated in forward
    mode. Discretise-then-optimise gives that of the forward solve's grid, forward mode
    (``jax.jvp`` through ``direct``) that of the grid its own program chose, each to
    1e-12, stepping onto the layer jumps or across them. The two grids may differ (the
    two programs round the error estimate differently), and on a ReLU network the
    discrete derivative moves with the grid: docs/training_math.md measures both."""
    solves = _GridSolves()
    monkeypatch.setattr(diffrax, "diffeqsolve", solves)
    objective = Objective()
    for method in (DiscretiseThenOptimise(), Direct()):
        model = _pid(method, jump_ts=jump_ts)
        params, static = eqx.partition(model, eqx.is_inexact_array)
        direction = random_direction(model)

        def loss(p, static=static):
            return objective(eqx.combine(p, static), BATCH)[0], solves.times[-1]

        if isinstance(method, DiscretiseThenOptimise):
            (value, times), grad = jax.value_and_grad(loss, has_aux=True)(params)
            derivative = dot(grad, direction)
        else:
            value, derivative, times = jax.jvp(loss, (params,), (direction,), has_aux=True)
        jumps = model.transformer.control.jump_ts if jump_ts else ()
        ref_value, ref_derivative = solves.on_grid(loss, params, direction, times, jumps)
        assert ref_value == pytest.approx(float(value), rel=1e-14, abs=0)  # the same steps
        assert float(derivative) == pytest.approx(ref_derivative, rel=1e-12, abs=0), method
