"""Controls as functions of time: values, derivatives, construction, and refinement."""

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np
import pytest
from numpy.polynomial import chebyshev, legendre

from ocformer.analysis import fitted_slope, study_input, study_model
from ocformer.controls import (
    Basis,
    Constant,
    PiecewiseConstant,
    PiecewiseLinear,
    basis_functions,
    init_layer_params,
    init_stacked_params,
    make_control,
)
from ocformer.integration import Discretisation, time_dtype, time_grid
from ocformer.models import ContinuousTransformer, rediscretise, refine
from ocformer.operators import Attention, FeedForward, LayerNormProjection
from ocformer.splitting import Strang

L, D, DFF = 3, 4, 6


@pytest.fixture(scope="module")
def values():
    return init_stacked_params(jr.PRNGKey(0), L, D, DFF, dtype=jnp.float64)


def _leaf(p):
    return np.asarray(p.attention.wq)


def _fd(control, t, h=1e-6):
    return (_leaf(control(t + h)) - _leaf(control(t - h))) / (2 * h)


@pytest.mark.parametrize("family,ref", [("legendre", legendre), ("chebyshev", chebyshev)])
def test_basis_functions_match_numpy(family, ref):
    for tau in (-1.0, -0.3, 0.55, 1.0):
        got = np.asarray(basis_functions(jnp.asarray(tau), 6, family))
        val = ref.legval if family == "legendre" else ref.chebval
        np.testing.assert_allclose(got, [val(tau, np.eye(6)[k]) for k in range(6)], atol=1e-14)


@pytest.mark.parametrize("family", ["legendre", "chebyshev"])
def test_basis_values_and_derivative(values, family):
    control = Basis(values, 0.0, 3.0, family=family)  # K = 3 coefficient sets
    coef = np.asarray(values.attention.wq)
    der = legendre.legder if family == "legendre" else chebyshev.chebder
    val = legendre.legval if family == "legendre" else chebyshev.chebval
    for t in (0.0, 0.7, 2.2, 3.0):
        tau = 2 * t / 3.0 - 1
        np.testing.assert_allclose(_leaf(control(t)), val(tau, coef), atol=1e-13)
        np.testing.assert_allclose(
            _leaf(control.derivative(t)), val(tau, der(coef)) * (2 / 3.0), atol=1e-13
        )
    np.testing.assert_allclose(_leaf(control.derivative(1.1)), _fd(control, 1.1), atol=1e-8)
    assert control.jump_ts is None and control.num_layers == 3 and control.num_basis == 3


def test_piecewise_linear(values):
    control = PiecewiseLinear(values)  # 3 nodes: 2 layers on [0, 2]
    assert control.interval == (0.0, 2.0) and control.num_layers == 2
    np.testing.assert_allclose(np.asarray(control.jump_ts), [1.0])
    w = np.asarray(values.attention.wq)
    for n in range(3):
        np.testing.assert_allclose(_leaf(control(float(n))), w[n], atol=1e-15)
    np.testing.assert_allclose(_leaf(control(0.25)), 0.75 * w[0] + 0.25 * w[1], atol=1e-15)
    np.testing.assert_allclose(_leaf(control.derivative(1.5)), w[2] - w[1], atol=1e-15)
    np.testing.assert_allclose(_leaf(control.derivative(0.4)), _fd(control, 0.4), atol=1e-8)


def test_constant_controls_have_zero_derivative(values):
    pc = PiecewiseConstant(values)
    const = Constant(jtu.tree_map(lambda x: x[0], values), 0.0, 3.0)
    for c in (pc, const):
        for leaf in jtu.tree_leaves(c.derivative(1.3)):
            assert not np.any(np.asarray(leaf))


def test_make_control(values):
    pc = make_control("piecewise_constant", values)
    np.testing.assert_array_equal(_leaf(pc(1.5)), np.asarray(values.attention.wq[1]))
    # K = L: the Legendre fit interpolates the layers at their midpoints.
    basis = make_control("basis", values, num_basis=L)
    for n in range(L):
        np.testing.assert_allclose(_leaf(basis(n + 0.5)), values.attention.wq[n], atol=1e-12)
    pl = make_control("piecewise_linear", values)
    w = np.asarray(values.attention.wq)
    np.testing.assert_allclose(_leaf(pl(1.0)), 0.5 * (w[0] + w[1]), atol=1e-15)
    np.testing.assert_allclose(_leaf(pl(3.0)), w[2], atol=1e-15)
    const = make_control("constant", values)
    np.testing.assert_array_equal(_leaf(const(2.9)), w[0])
    keyed = make_control("basis", jr.PRNGKey(1), num_layers=4, width=D, hidden=DFF, num_basis=2)
    assert keyed.num_layers == 4 and keyed.num_basis == 2
    with pytest.raises(ValueError, match="num_basis"):
        make_control("basis", values, num_basis=5)
    with pytest.raises(ValueError, match="expected one of"):
        make_control("spline", values)
    with pytest.raises(ValueError, match="needs num_layers"):
        make_control("basis", jr.PRNGKey(1))


def test_basis_model_is_the_same_at_different_step_counts():
    # A smooth control is one function of t whatever the grid: Strang (order 2) at
    # m = 4, 8, 16 differs by the discretisation error, which shrinks 4x per halving.
    model = rediscretise(study_model("pre"), stepper=Strang(sub_solver="midpoint"))
    u0 = study_input(model)
    u = [refine(model, m)(u0) for m in (4, 8, 16)]
    d1, d2 = float(jnp.max(jnp.abs(u[0] - u[1]))), float(jnp.max(jnp.abs(u[1] - u[2])))
    assert 3.0 < d1 / d2 < 5.0, (d1, d2)
    assert d2 < 2e-2


def test_piecewise_constant_refinement_converges():
    # The standard Transformer's controls, refined: m steps per layer of the Lie scheme
    # converge to the ODE with the field frozen on each layer (first order). The
    # reference is Tsit5 stepping over the layer jumps.
    values = init_stacked_params(jr.PRNGKey(2), 3, 8, 16, init_scale=0.5, dtype=jnp.float64)
    model = ContinuousTransformer(PiecewiseConstant(values), norm="pre", num_heads=2)
    u0 = jr.normal(jr.PRNGKey(3), (6, 8), jnp.float64)
    ref = rediscretise(model, stepper=diffrax.Tsit5(), steps_per_layer=64)(u0)
    steps = (4, 8, 16)
    errors = [float(jnp.max(jnp.abs(refine(model, m)(u0) - ref))) for m in steps]
    slope = fitted_slope([1 / m for m in steps], errors)
    assert 0.8 <= slope <= 1.3, (errors, slope)


def _bf16_grid(layers, steps_per_layer):
    values = init_stacked_params(jr.PRNGKey(0), layers, 2, 2, dtype=jnp.bfloat16)
    control = PiecewiseConstant(values)
    ts, num = time_grid(control, steps_per_layer, jnp.bfloat16)
    return control, ts, num


def test_time_grid_of_a_bfloat16_state_reads_each_layers_controls():
    """A bfloat16 state gets a float32 grid: in bfloat16 (8 significant bits) 64 layers
    x 4 steps put 31 of the 256 step midpoints in the neighbouring layer."""
    control, ts, num = _bf16_grid(64, 4)
    assert ts.dtype == jnp.float32 and num == 256
    mids = 0.5 * (ts[:-1] + ts[1:])  # where a splitting step reads the controls
    np.testing.assert_array_equal(np.asarray(control.index(mids)), np.arange(256) // 4)
    # The same midpoints in the state's dtype: the defect the float32 grid avoids.
    in_bf16 = jnp.linspace(0.0, 64.0, 257, dtype=jnp.bfloat16)
    wrong = np.asarray(control.index(0.5 * (in_bf16[:-1] + in_bf16[1:]))) != np.arange(256) // 4
    assert int(np.sum(wrong)) == 31


def test_time_grid_of_a_bfloat16_state_is_increasing():
    _, ts, num = _bf16_grid(24, 16)
    assert ts.dtype == jnp.float32 and num == 384
    assert bool(jnp.all(jnp.diff(ts) > 0))
    np.testing.assert_array_equal(np.asarray(ts), np.linspace(0, 24, 385, dtype=np.float32))
    assert not bool(jnp.all(jnp.diff(jnp.linspace(0.0, 24.0, 385, dtype=jnp.bfloat16)) > 0))


def test_time_is_at_least_float32():
    for state, time in [
        ("bfloat16", "float32"),
        ("float16", "float32"),
        ("float32", "float32"),
        ("float64", "float64"),
    ]:
        assert time_dtype(jnp.dtype(state)) == jnp.dtype(time)


def test_bfloat16_state_is_solved_on_a_float32_grid_and_cast_back():
    """A bfloat16 input is solved on a float32 grid with a float32 state (the residual
    stream) and bfloat16 fields, and the saved states are cast back to bfloat16. The
    solve equals, bit for bit, a plain loop over the 256 steps that reads layer n // 4
    for step n: u += dt * A(bf16(LN1(u))), u += dt * F(bf16(LN2(u))). On a bfloat16
    grid (64 layers x 4 steps) a quarter of the last layer's steps read the wrong
    layer's controls and this equality fails."""
    values = init_stacked_params(jr.PRNGKey(4), 64, 4, 4, dtype=jnp.bfloat16)
    model = ContinuousTransformer(
        PiecewiseConstant(values),
        norm="pre",
        num_heads=1,
        discretisation=Discretisation(steps_per_layer=4),
    )
    u0 = jr.normal(jr.PRNGKey(5), (3, 4), jnp.bfloat16)
    sol = model.solve(u0, saveat=diffrax.SaveAt(t0=True, steps=True))
    assert sol.ys is not None and sol.ts is not None
    assert sol.ys.dtype == jnp.bfloat16 and sol.ts.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(sol.ts), np.linspace(0, 64, 257, dtype=np.float32))
    norm, attention, feedforward = LayerNormProjection(), Attention(num_heads=1), FeedForward()
    u, dt, states = u0.astype(jnp.float32), jnp.float32(0.25), [u0.astype(jnp.float32)]
    for n in range(256):
        p = jtu.tree_map(lambda v, layer=n // 4: v[layer], values)
        a = attention(p.attention, norm(p.norm1, u).astype(jnp.bfloat16))
        u = u + dt * a.astype(jnp.float32)
        f = feedforward(p.feedforward, norm(p.norm2, u).astype(jnp.bfloat16))
        u = u + dt * f.astype(jnp.float32)
        states.append(u)
    reference = jnp.stack(states).astype(jnp.bfloat16)
    np.testing.assert_array_equal(
        np.asarray(sol.ys.astype(jnp.float32)), np.asarray(reference.astype(jnp.float32))
    )
    # The fields did compute in bfloat16: the float32 solve of the same input differs.
    float32 = model.solve(u0.astype(jnp.float32)).ys
    assert float32 is not None
    assert float(jnp.max(jnp.abs(float32[-1] - reference[-1].astype(jnp.float32)))) > 1e-3


@pytest.mark.parametrize(
    "layers, steps, t1, dtype, tol",
    [(24, 5, 24.0, jnp.float32, 1e-5), (7, 3, 0.7, jnp.float64, 1e-12)],
)
def test_a_stage_never_reads_the_next_layer_whatever_the_grid_s_rounding(
    layers, steps, t1, dtype, tol
):
    """Tsit5 on 24 layers x 5 steps in float32 (where a float32 linspace puts the jumps
    at 1.0000001, 2.0000002, ...) and on 7 layers over [0, 0.7] in float64 (jumps at
    0.1 k, not floats): the solve equals the same model solved a layer at a time (a
    solve of its own each, with no jump inside) to rounding. When a grid point missed
    its jump by an ulp, the last stage of every layer read the next layer's controls:
    relative errors 0.2 and 1e-3. On the grid, a point on a jump is the first time of
    the next piece and the float below it the last of the previous one."""
    values = init_stacked_params(jr.key(0), layers, D, DFF, dtype=dtype, init_scale=0.5)
    u0 = jr.normal(jr.key(1), (5, D), dtype)

    def model(v, end):
        return ContinuousTransformer(
            PiecewiseConstant(v, 0.0, end),
            norm="pre",
            num_heads=2,
            discretisation=Discretisation(diffrax.Tsit5(), steps_per_layer=steps),
        )

    control = model(values, t1).control
    ts, _ = time_grid(control, steps, dtype)
    on_jumps = np.asarray(ts)[steps:-1:steps]
    pieces = control.index(jnp.asarray(on_jumps))
    below = control.index(jnp.nextafter(jnp.asarray(on_jumps), -jnp.inf))
    np.testing.assert_array_equal(pieces, np.arange(1, layers))
    np.testing.assert_array_equal(below, np.arange(0, layers - 1))
    solve = eqx.filter_jit(lambda m, u: m(u))
    whole, u = solve(model(values, t1), u0), u0
    for n in range(layers):
        u = solve(model(jtu.tree_map(lambda x, n=n: x[n : n + 1], values), t1 / layers), u)
    error = jnp.max(jnp.abs(whole - u)) / jnp.max(jnp.abs(u))
    assert float(error) < tol, float(error)


def test_grid_steps_take_diffrax_step_to_steps_without_host_callbacks():
    """``GridSteps`` against diffrax's own ``StepTo`` on the same non-uniform grid: the
    same step times and states, bit for bit, forward and backward in time; and, unlike
    ``StepTo``, no host callback in the compiled solve (``throw=False``, as ``solve``
    passes for a constant grid). A ``dt0`` is refused."""
    import equinox as eqx

    from ocformer.integration._grid import GridSteps

    term = diffrax.ODETerm(lambda t, y, args: -y * (1.0 + jnp.sin(t)))
    grid = jnp.asarray([0.0, 0.3, 0.5, 1.2, 2.0])
    y0 = jnp.asarray([1.0, -2.0])

    def run(controller, ts, throw):
        return diffrax.diffeqsolve(
            term, diffrax.Heun(), ts[0], ts[-1], None, y0, stepsize_controller=controller,
            saveat=diffrax.SaveAt(steps=True), max_steps=ts.shape[0] - 1, throw=throw,
        )  # fmt: skip

    for ts in (grid, -grid):  # -grid: backward in time, from 0 to -2
        ours = eqx.filter_jit(run)(GridSteps(ts=ts), ts, False)
        theirs = eqx.filter_jit(run)(diffrax.StepTo(ts=ts), ts, False)
        np.testing.assert_array_equal(np.asarray(ours.ts), np.asarray(ts[1:]))
        np.testing.assert_array_equal(np.asarray(ours.ts), np.asarray(theirs.ts))
        np.testing.assert_array_equal(np.asarray(ours.ys), np.asarray(theirs.ys))
    ours_hlo = eqx.filter_jit(run).lower(GridSteps(ts=grid), grid, False).as_text()
    theirs_hlo = eqx.filter_jit(run).lower(diffrax.StepTo(ts=grid), grid, False).as_text()
    assert "callback" not in ours_hlo and "callback" in theirs_hlo
    with pytest.raises(ValueError, match="dt0 must be None"):
        diffrax.diffeqsolve(
            term, diffrax.Heun(), 0.0, 2.0, 0.1, y0, stepsize_controller=GridSteps(ts=grid)
        )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
@pytest.mark.parametrize(
    "options",
    [{}, {"init_scale": 0.02, "norm_affine": "scalar"}, {"biases": False, "output_map": False}],
)
def test_initial_controls_are_the_jax_formula_bit_for_bit(dtype, options):
    """The initial controls (assembled with NumPy around jax's draws) are bitwise
    what the formula gives in jax, layer by layer: one key per layer, six per layer's
    kernels, (init_scale / sqrt(fan_in)) N(0, 1), minus the identity for the
    feed-forward maps, zero biases, layer-norm sets (0, 1)."""
    key, scale = jr.key(3), options.get("init_scale", 1.0)
    stacked = init_stacked_params(key, L, D, DFF, dtype=dtype, **options)
    for layer, k in enumerate(jr.split(key, L)):
        kq, kk, kv, ko, k1, k2 = jr.split(k, 6)

        def kernel(k, din, dout):
            return (scale / jnp.sqrt(din)) * jr.normal(k, (din, dout), dtype)

        zero = jnp.zeros((D,), dtype) if options.get("biases", True) else None
        want = {
            "wq": kernel(kq, D, D),
            "wk": kernel(kk, D, D),
            "wv": kernel(kv, D, D),
            "wo": kernel(ko, D, D) if options.get("output_map", True) else None,
            "bq": zero,
            "w1": kernel(k1, D, DFF) - jnp.eye(D, DFF, dtype=dtype),
            "w2": kernel(k2, DFF, D) - jnp.eye(DFF, D, dtype=dtype),
        }
        a, ff = stacked.attention, stacked.feedforward
        got = {"wq": a.wq, "wk": a.wk, "wv": a.wv, "wo": a.wo, "bq": a.bq,
               "w1": ff.weights[0], "w2": ff.weights[1]}  # fmt: skip
        for name, w in want.items():
            if w is None:
                assert got[name] is None, name
                continue
            g = np.asarray(got[name][layer])
            assert g.dtype == w.dtype and g.tobytes() == np.asarray(w).tobytes(), name
        affine = () if options.get("norm_affine") == "scalar" else (D,)
        for norm in (stacked.norm1, stacked.norm2):
            assert norm.scale[layer].shape == affine and np.all(np.asarray(norm.scale) == 1)
            assert np.all(np.asarray(norm.bias) == 0)


def test_initial_controls_under_transformations():
    """``init_layer_params`` vmapped over one key per layer is ``init_stacked_params``
    bit for bit, and it traces under ``jax.jit`` (to the same values, up to the
    compiler's rounding)."""
    key = jr.key(5)
    stacked = init_stacked_params(key, L, D, DFF, init_scale=0.3)
    vmapped = jax.vmap(lambda k: init_layer_params(k, D, DFF, init_scale=0.3))(jr.split(key, L))
    for a, b in zip(jtu.tree_leaves(stacked), jtu.tree_leaves(vmapped), strict=True):
        assert a.dtype == b.dtype and np.asarray(a).tobytes() == np.asarray(b).tobytes()
    jitted = jax.jit(lambda k: init_layer_params(k, D, DFF, init_scale=0.3))(jr.split(key, L)[1])
    for a, b in zip(jtu.tree_leaves(jitted), jtu.tree_leaves(stacked), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b)[1], rtol=1e-6, atol=0)
