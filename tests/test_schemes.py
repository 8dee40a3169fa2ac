"""Splitting schemes at one step per layer against independent numpy implementations."""

import diffrax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np
import pytest

from ocformer.controls import PiecewiseConstant, init_stacked_params
from ocformer.integration import Discretisation
from ocformer.models import ContinuousTransformer, rediscretise
from ocformer.splitting import (
    SCHEMES,
    Hybrid,
    Lie,
    Parallel,
    ProjectedSolver,
    Strang,
    inner_solver,
    with_inner_solver,
)

L, D, DFF, H, N = 2, 8, 12, 2, 5
LN_EPS = 1e-5


def _control(norm_affine="feature"):
    values = init_stacked_params(
        jr.PRNGKey(3), L, D, DFF, norm_affine=norm_affine, init_scale=0.7, dtype=jnp.float64
    )
    # Non-zero biases and layer-norm targets, so that every parameter is exercised.
    leaves, treedef = jtu.tree_flatten(values)
    keys = jr.split(jr.PRNGKey(4), len(leaves))
    leaves = [
        x + 0.3 * jr.normal(k, x.shape, x.dtype) if x.ndim <= 2 else x for k, x in zip(keys, leaves)
    ]
    return PiecewiseConstant(jtu.tree_unflatten(treedef, leaves))


def _np(tree):
    return jtu.tree_map(np.asarray, tree)


def np_attention(p, u):
    dh = D // H
    q, k, v = u @ p.wq + p.bq, u @ p.wk + p.bk, u @ p.wv + p.bv
    out = np.zeros_like(u)
    for h in range(H):
        sl = slice(h * dh, (h + 1) * dh)
        s = q[:, sl] @ k[:, sl].T / np.sqrt(dh)
        s = np.exp(s - s.max(axis=1, keepdims=True))
        out[:, sl] = (s / s.sum(axis=1, keepdims=True)) @ v[:, sl]
    return out @ p.wo + p.bo


def np_norm(p, v, eps=LN_EPS):
    c = v - v.mean(axis=1, keepdims=True)
    return c / np.sqrt((c**2).mean(axis=1, keepdims=True) + eps) * p.scale + p.bias


def np_mlp(p, u, dt=1.0):
    (w1, w2), (b1, b2) = p.weights, p.biases
    h = np.maximum(u @ (np.eye(D, DFF) + dt * w1) + dt * b1, 0.0)
    return h @ (np.eye(DFF, D) + dt * w2) + dt * b2


def np_pre_fields(p):
    return (
        lambda u: np_attention(p.attention, np_norm(p.norm1, u)),
        lambda u: np_mlp(p.feedforward, np_norm(p.norm2, u)),
    )


def euler(f, h, u):
    return u + h * f(u)


def midpoint(f, h, u):
    return u + h * f(u + 0.5 * h * f(u))


def run(model, u0, layer_step):
    """The model and a numpy loop of ``layer_step`` over its layers."""
    got = np.asarray(model(u0))
    u = np.asarray(u0)
    for n in range(L):
        u = layer_step(_np(model.layer(n)), u)
    return got, u


@pytest.fixture(scope="module")
def u0():
    return jr.normal(jr.PRNGKey(5), (N, D), jnp.float64)


def _pre(stepper, steps_per_layer=1):
    return ContinuousTransformer(
        _control(),
        norm="pre",
        num_heads=H,
        ln_eps=LN_EPS,
        discretisation=Discretisation(stepper, steps_per_layer=steps_per_layer),
    )


def _post(stepper):
    return ContinuousTransformer(
        _control(), norm="post", num_heads=H, ln_eps=LN_EPS, discretisation=Discretisation(stepper)
    )


def post_layer(p, u):
    # Vaswani et al.: LN(u + Attn(u)), then LN(v + FFN(v)).
    v = np_norm(p.norm1, u + np_attention(p.attention, u))
    return np_norm(p.norm2, v + np_mlp(p.feedforward, v))


def test_lie_post_is_the_post_ln_stack(u0):
    got, want = run(_post(Lie()), u0, post_layer)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)


def test_lie_pre_is_the_pre_ln_stack(u0):
    def layer(p, u):
        a, f = np_pre_fields(p)
        u = u + a(u)
        return u + f(u)

    got, want = run(_pre(Lie()), u0, layer)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("sub_solver,flow", [("euler", euler), ("midpoint", midpoint)])
def test_strang_pre(u0, sub_solver, flow):
    def layer(p, u):
        a, f = np_pre_fields(p)
        return flow(a, 0.5, flow(f, 1.0, flow(a, 0.5, u)))

    got, want = run(_pre(Strang(sub_solver=sub_solver)), u0, layer)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)


def test_strang_macaron(u0):
    # sequence=(1, 0): FFN/2, attention, FFN/2.
    def layer(p, u):
        a, f = np_pre_fields(p)
        return euler(f, 0.5, euler(a, 1.0, euler(f, 0.5, u)))

    got, want = run(_pre(Strang(sequence=(1, 0))), u0, layer)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)


def test_strang_post(u0):
    def avg_ffn(p, u, dt):
        return 0.5 * (np_mlp(p.feedforward, u, dt) + u)

    def layer(p, u):
        u = u + 0.5 * np_attention(p.attention, u)
        u = np_norm(p.norm1, u)
        u = avg_ffn(p, u, 0.5)
        u = np_norm(p.norm2, u, LN_EPS / 4)
        u = avg_ffn(p, u, 0.5)
        u = np_norm(p.norm1, u)
        return u + 0.5 * np_attention(p.attention, u)

    got, want = run(_post(Strang()), u0, layer)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("solver", [Parallel(), Hybrid()])
def test_parallel_pre(u0, solver):
    # Each sub-problem from u with twice its operator, averaged; Hybrid's default
    # grouping puts the two smooth pre-LN terms in one parallel group.
    def layer(p, u):
        a, f = np_pre_fields(p)
        return 0.5 * (euler(a, 2.0, u) + euler(f, 2.0, u))

    got, want = run(_pre(solver), u0, layer)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)


def test_hybrid_sequential_groups_and_post_default(u0):
    def layer(p, u):
        a, f = np_pre_fields(p)
        return f(u + a(u)) + u + a(u)

    got, want = run(_pre(Hybrid(groups=((0,), (1,)))), u0, layer)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
    # Post-LN: no two smooth terms are adjacent, so the default grouping is Lie.
    got, want = run(_post(Hybrid()), u0, post_layer)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)


def test_scheme_registry_and_orders():
    assert set(SCHEMES) == {"lie", "strang", "parallel", "hybrid"}
    for cls in SCHEMES.values():
        cls()  # no required arguments
    assert _pre(Lie()).order() == 1
    assert _pre(Strang()).order() == 1  # Euler sub-steps cap Strang at 1
    assert _pre(Strang(sub_solver="midpoint")).order() == 2
    assert _pre(Strang(sub_solver="heun")).order() == 2
    assert _pre(Parallel(sub_solver="midpoint")).order() == 1
    assert _pre(Hybrid(sub_solver="midpoint")).order() == 1
    # The averaged post-LN feed-forward step is not a consistent flow: order 0, and
    # refinement is refused (tests/test_formulations.py).
    assert _post(Strang()).order() == 0
    assert _post(Lie()).order() == 0


@pytest.mark.parametrize(
    "sequence,order",
    [
        (None, 2),
        ((0, 1, 2), 2),
        ((0, 2, 1), 2),
        ((1, 0, 2), 1),
        ((2, 0, 1), 1),
        ((1, 2, 0), 1),
        ((2, 1, 0), 1),
    ],
)
def test_strang_on_projected_is_second_order_only_with_the_projection_first(sequence, order):
    # Projected terms: (projection onto S1, tangent attention, tangent feed-forward).
    # tests/test_convergence.py measures these orders.
    model = ContinuousTransformer(
        _control("scalar"),
        norm="post",
        num_heads=H,
        formulation="projected",
        discretisation=Discretisation(Strang(sub_solver="midpoint", sequence=sequence)),
    )
    assert model.order() == order
    # Euler sub-steps cap every sequence at 1.
    assert rediscretise(model, stepper=Strang(sequence=sequence)).order() == 1


def test_inner_solver_is_the_stepper_inside_the_projection():
    scheme = Strang(sub_solver="midpoint")
    projected = ContinuousTransformer(
        _control("scalar"),
        norm="post",
        num_heads=H,
        formulation="projected",
        discretisation=Discretisation(scheme),
    )
    stepper = projected.time_stepper()
    assert isinstance(stepper, ProjectedSolver)
    assert inner_solver(stepper) is stepper.solver
    assert inner_solver(stepper) == scheme
    split = _pre(scheme).time_stepper()
    assert inner_solver(split) is split
    # Replacing the inner solver keeps the projection where there is one, and only there.
    heun = diffrax.Heun()
    assert with_inner_solver(stepper, heun) == ProjectedSolver(heun)
    assert with_inner_solver(split, heun) is heun


def test_closing_projection_takes_eps_over_4_only_after_the_average(u0):
    # Parallel feeds the closing projection u^n itself, not an average: plain eps.
    def layer(p, u):
        branches = [
            u + 4.0 * np_attention(p.attention, u),
            np_norm(p.norm1, u),
            0.5 * (np_mlp(p.feedforward, u, 4.0) + u),
            np_norm(p.norm2, u),
        ]
        return sum(branches) / 4.0

    got, want = run(_post(Parallel()), u0, layer)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)


def test_bad_scheme_arguments(u0):
    # Refused when the model takes the scheme (they were found at its first solve).
    with pytest.raises(
        ValueError, match=r"Strang.sequence=\(0, 0\) must be a permutation of the 2"
    ):
        _pre(Strang(sequence=(0, 0)))
    with pytest.raises(ValueError, match=r"permutation of the 4 term indices \(0, 1, 2, 3\)"):
        rediscretise(_post(Lie()), stepper=Strang(sequence=(0, 1)))
    with pytest.raises(ValueError, match="exactly once"):
        _pre(Hybrid(groups=((0,),)))
    # The coarse stepper of a depth-parallel solve too.
    from ocformer.integration import Parareal

    coarse = Parareal(Strang(sequence=(1, 0)), chunks=2)
    with pytest.raises(ValueError, match=r"permutation of the 4 term indices"):
        rediscretise(_post(Lie()), Discretisation(Lie(), depth_parallel=coarse))
    with pytest.raises(ValueError, match="tuple of non-empty tuples"):
        Hybrid(groups=((),))


def test_substeps_end_on_the_step_states(u0):
    model = _pre(Strang(), steps_per_layer=2)
    ts, ys = model.trajectory(u0)
    assert ts.shape == (L * 2 + 1,) and ys.shape == (L * 2 + 1, N, D)
    np.testing.assert_allclose(ys[-1], model(u0), rtol=0, atol=1e-13)
    sts, sys = model.trajectory(u0, substeps=True)
    per_step = 3  # Strang on two terms: half, full, half
    assert sys.shape == (L * 2 * per_step + 1, N, D)
    np.testing.assert_allclose(sys[::per_step], ys, rtol=0, atol=1e-13)
    np.testing.assert_allclose(sts[::per_step], ts, rtol=0, atol=1e-15)
    assert np.all(np.diff(np.asarray(sts)) > 0)
    with pytest.raises(ValueError, match="splitting scheme"):
        _pre(diffrax.Heun()).trajectory(u0, substeps=True)
