"""The objective's terms against independent numpy references, and the projections."""

import diffrax
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

from ocformer.controls import (
    Basis,
    PiecewiseConstant,
    PiecewiseLinear,
    init_layer_params,
    init_stacked_params,
)
from ocformer.integration import Discretisation
from ocformer.models import ContinuousTransformer, Readout, SequenceModel, TokenEmbedding
from ocformer.objective import (
    Constraints,
    Objective,
    control_size,
    control_smoothness,
    cross_entropy,
    kinetic_energy,
    project_frobenius,
    project_spectral,
)

L, D, DFF, V, N = 3, 4, 6, 5, 4


def stacked(num=L, seed=0):
    return init_stacked_params(jr.key(seed), num, D, DFF, dtype=jnp.float64)


def model(norm="post", steps_per_layer=1, control=None):
    k = jr.split(jr.key(1), 2)
    control = PiecewiseConstant(stacked()) if control is None else control
    t = ContinuousTransformer(
        control,
        norm=norm,
        num_heads=2,
        causal=True,
        discretisation=Discretisation(steps_per_layer=steps_per_layer),
    )
    return SequenceModel(
        TokenEmbedding(V, N, D, key=k[0], dtype=jnp.float64),
        t,
        Readout(D, V, key=k[1], dtype=jnp.float64),
    )


def sq(tree):
    return sum(float(np.sum(np.square(np.asarray(x)))) for x in jax.tree.leaves(tree))


def test_cross_entropy_against_numpy(rng):
    logits = rng.normal(size=(3, 4, 5))
    targets = rng.integers(0, 5, size=(3, 4))
    targets[0, :2] = -1  # ignored
    loss, acc = cross_entropy(jnp.asarray(logits), jnp.asarray(targets))
    logp = logits - np.log(np.sum(np.exp(logits), axis=-1, keepdims=True))
    valid = targets >= 0
    ref = -np.mean(np.take_along_axis(logp, np.maximum(targets, 0)[..., None], -1)[..., 0][valid])
    ref_acc = np.mean((np.argmax(logits, -1) == targets)[valid])
    assert abs(float(loss) - ref) < 1e-13 and abs(float(acc) - ref_acc) < 1e-15
    none = cross_entropy(jnp.asarray(logits), jnp.full((3, 4), -1))[0]
    assert float(none) == 0.0


@pytest.mark.parametrize("t1", [3.0, 6.0])
def test_control_size_piecewise_constant_is_exact(t1):
    values = stacked()
    control = PiecewiseConstant(values, 0.0, t1)
    spacing = t1 / L
    ref = sum(
        spacing * sq((jax.tree.map(lambda x, n=n: x[n], values.attention),
                      jax.tree.map(lambda x, n=n: x[n], values.feedforward)))
        for n in range(L)
    )  # fmt: skip
    for m in (1, 3):  # midpoint quadrature is exact on every refinement
        assert abs(float(control_size(control, m)) - ref) < 1e-12 * ref


def test_control_smoothness_is_the_jumps_over_the_spacing():
    values = stacked()
    for t1 in (3.0, 6.0):
        control = PiecewiseConstant(values, 0.0, t1)
        jumps = sum(sq(jax.tree.map(lambda x, n=n: x[n + 1] - x[n], values)) for n in range(L - 1))
        assert abs(float(control_smoothness(control)) - jumps / (t1 / L)) < 1e-12 * jumps
    one = PiecewiseConstant(stacked(1))
    assert float(control_smoothness(one)) == 0.0


def test_control_smoothness_of_a_piecewise_linear_control_is_exact():
    # theta' is constant on each piece: the integral is sum |theta_{n+1}-theta_n|^2 / h.
    nodes = stacked(L + 1)
    control = PiecewiseLinear(nodes, 0.0, 1.5)
    h = 1.5 / L
    ref = sum(sq(jax.tree.map(lambda x, n=n: x[n + 1] - x[n], nodes)) for n in range(L)) / h
    assert abs(float(control_smoothness(control, 2)) - ref) < 1e-10 * ref


def test_kinetic_energy_from_the_trajectory():
    m = model("pre", steps_per_layer=2)
    u0 = m.initial_state(jnp.asarray(np.arange(2 * N).reshape(2, N) % V))
    ts, ys = m.transformer.trajectory(u0)
    ys = np.asarray(ys)
    ref = 0.0
    for k in range(len(ts) - 1):
        ref += np.sum((ys[k + 1] - ys[k]) ** 2) / float(ts[k + 1] - ts[k])
    ref /= 2 * N  # averaged over batch and tokens
    assert abs(float(kinetic_energy(m.transformer, u0)) - ref) < 1e-12 * ref


def test_objective_adds_weighted_costs():
    m = model()
    batch = {
        "inputs": jnp.asarray([[1, 2, 3, 4], [4, 3, 2, 1]]),
        "targets": jnp.asarray([[2, 3, 4, 0], [3, 2, 1, 0]]),
    }
    plain, metrics0 = Objective()(m, batch)
    # Zero weights: those running costs are neither computed nor reported.
    assert set(metrics0) == {"loss", "task_loss", "accuracy"}
    ref = cross_entropy(m(batch["inputs"]), batch["targets"])[0]
    assert abs(float(plain) - float(ref)) < 1e-14
    obj = Objective(control_smoothness=0.5, control_size=0.25, kinetic_energy=2.0)
    loss, metrics = obj(m, batch)
    expect = (
        metrics["task_loss"] + 0.5 * metrics["control_smoothness"]
        + 0.25 * metrics["control_size"] + 2.0 * metrics["kinetic_energy"]
    )  # fmt: skip
    assert abs(float(loss) - float(expect)) < 1e-13 and float(metrics["kinetic_energy"]) > 0
    with pytest.raises(ValueError, match="running-cost weight"):
        Objective(control_size=-1.0)


def test_frobenius_projection(rng):
    w = jnp.asarray(rng.normal(size=(3, 4, 5)))
    p = np.asarray(project_frobenius(w, 1.5))
    norms = np.linalg.norm(p, axis=(-2, -1))
    assert np.allclose(norms, 1.5, rtol=1e-14, atol=0)
    small = 0.1 * w / jnp.linalg.norm(w, axis=(-2, -1), keepdims=True)
    assert np.array_equal(np.asarray(project_frobenius(small, 1.5)), np.asarray(small))


def test_spectral_projection_is_the_nearest_point(rng):
    w = rng.normal(size=(4, 5)) * 2
    p = np.asarray(project_spectral(jnp.asarray(w), 1.0))
    u, s, vt = np.linalg.svd(w, full_matrices=False)
    assert np.allclose(p, (u * np.minimum(s, 1.0)) @ vt, atol=1e-13)
    assert abs(np.linalg.norm(p, 2) - 1.0) < 1e-13
    # Variational inequality of the projection onto a convex set: <w - p, z - p> <= 0.
    for _ in range(20):
        z = rng.normal(size=(4, 5))
        z = z / max(1.0, np.linalg.norm(z, 2))
        assert np.sum((w - p) * (z - p)) <= 1e-12


@pytest.mark.parametrize("kind", ["frobenius", "spectral"])
def test_constraints_project_the_model(kind):
    values = stacked()
    values = jax.tree.map(lambda x: 3.0 * x, values)  # kernels well outside the ball
    values = eqx_set_scale(values, -0.5)
    m = model(control=PiecewiseConstant(values))
    c = Constraints(sigma_floor=1e-2, kernel_norm=kind, kernel_bound=0.5)
    assert c.violation(m)["kernel_norm"] > 0 and c.violation(m)["sigma_floor"] > 0
    p = c.project(m)
    gaps = c.violation(p)
    assert gaps["sigma_floor"] == 0.0 and gaps["kernel_norm"] <= 1e-12
    v = p.transformer.control.values
    assert float(jnp.min(v.norm1.scale)) == 1e-2
    assert np.array_equal(np.asarray(v.attention.bq), np.asarray(values.attention.bq))
    pp = c.project(p)  # idempotent
    for a, b in zip(jax.tree.leaves(pp), jax.tree.leaves(p)):
        assert np.allclose(np.asarray(a), np.asarray(b), atol=1e-13)


def eqx_set_scale(values, value):
    import equinox as eqx

    return eqx.tree_at(lambda v: v.norm1.scale, values, jnp.full_like(values.norm1.scale, value))


def test_constraints_validate_and_refuse_basis_controls():
    with pytest.raises(ValueError, match="go together"):
        Constraints(kernel_norm="spectral")
    with pytest.raises(ValueError, match="sigma_floor"):
        Constraints(sigma_floor=0.0)
    coeffs = jax.vmap(lambda k: init_layer_params(k, D, DFF, dtype=jnp.float64))(
        jr.split(jr.key(2), 3)
    )
    basis = Basis(coeffs, 0.0, 3.0, family="legendre")
    with pytest.raises(ValueError, match="coefficients"):
        Constraints().project(model(control=basis))
    # With nothing to enforce, the model passes through unchanged.
    free = model(control=basis)
    assert Constraints(sigma_floor=None).project(free) is free


def test_objective_under_non_splitting_solver():
    k = jr.split(jr.key(1), 2)
    t = ContinuousTransformer(
        PiecewiseConstant(stacked()),
        norm="pre",
        num_heads=2,
        causal=True,
        discretisation=Discretisation(diffrax.Heun()),
    )
    m = SequenceModel(
        TokenEmbedding(V, N, D, key=k[0], dtype=jnp.float64),
        t,
        Readout(D, V, key=k[1], dtype=jnp.float64),
    )
    batch = {"inputs": jnp.asarray([[1, 2, 3, 4]]), "targets": jnp.asarray([[2, 3, 4, 0]])}
    loss, metrics = Objective(kinetic_energy=1.0)(m, batch)
    assert np.isfinite(float(loss)) and float(metrics["kinetic_energy"]) > 0


def test_bad_arguments_of_the_model_api_are_named():
    """The objective on a bare transformer or a batch without targets, a layer index
    outside the depth, a batch of prompts or an id outside the vocabulary to generate:
    each named, not a KeyError, a wrapped index or a silently joined prompt."""
    import jax.random as jr_

    m = model()
    batch = {"inputs": jnp.zeros((2, N), jnp.int32), "targets": jnp.zeros((2, N), jnp.int32)}
    with pytest.raises(ValueError, match="Objective takes a SequenceModel"):
        Objective()(m.transformer, batch)
    with pytest.raises(ValueError, match="the batch has no 'targets'"):
        Objective()(m, {"inputs": batch["inputs"]})
    for n in (L, -1):
        with pytest.raises(IndexError, match=f"layer {n} of a model of {L} layers"):
            m.transformer.layer(n)
    with pytest.raises(ValueError, match=r"generate continues one prompt, .* got shape \(2, 2\)"):
        m.generate(jr_.key(0), [[1, 2], [3, 4]], 3)
    with pytest.raises(ValueError, match=rf"ids outside the vocabulary 0..{V - 1}: \[{V}\]"):
        m.generate(jr_.key(0), [1, V], 3)
    for prompt in ([1.7, 2.9], [True, False]):  # not silently truncated to ids
        with pytest.raises(ValueError, match="generate takes integer symbol ids"):
            m.generate(jr_.key(0), prompt, 3)
    assert m.generate(jr_.key(0), np.array([1, 2], np.int64), np.int64(2)).shape == (2,)


def test_evaluate_refuses_a_model_that_does_not_fit_the_configuration():
    """A model of another vocabulary than the configuration's task would give a NaN
    loss and a meaningless accuracy: it is refused, naming the array and both shapes."""
    from ocformer.config import Config, ModelConfig, TaskConfig
    from ocformer.evaluation import evaluate
    from ocformer.training import build

    def config(vocab):
        return Config(
            model=ModelConfig(num_layers=1, width=8, hidden=16, num_heads=2),
            task=TaskConfig(name="copy", seq_len=6, vocab_size=vocab, batch_size=4),
        )

    model = build(config(5)).model
    assert np.isfinite(evaluate(config(5), model)["val_loss"])
    with pytest.raises(ValueError, match=r"embedding.tokens has shape \(5, 8\), .* \(7, 8\)"):
        evaluate(config(7), model)
    # Another kind of head (here one without a bias): named, not compared leaf by leaf
    # with the wrong arrays.
    import equinox as eqx

    unbiased = eqx.tree_at(lambda m: m.head.bias, model, None)
    with pytest.raises(ValueError, match=r"head\.bias is missing from the model"):
        evaluate(config(5), unbiased)
