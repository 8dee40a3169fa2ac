"""Ternary feed-forward controls against what must hold: the projection is the exact
maximiser of the penalised linear objective over the ternary set (brute force over
every sign pattern of a tiny kernel), its entry-wise threshold form, the
straight-through gradient is the real gradient at the ternary kernels, and the
discrete MSA lowers J on a tiny model. All in float64."""

import itertools
import os

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_msa import small_batch, small_model

from ocformer.objective import (
    MSA,
    Constraints,
    Objective,
    Ternary,
    feedforward_kernels,
    msa_iteration,
    ternary_projection,
    with_feedforward_kernels,
)
from ocformer.training import under_standard_promotion


def _brute_force(m: np.ndarray, sparsity: float) -> tuple[float, np.ndarray]:
    """max over s in {-1, 0, 1}^n and a >= 0 of a <m, s> - a^2 |s|^2 / 2 - lambda |s|_0:
    every sign pattern, each with its own best scale a = max(0, <m, s>) / |s|_0 (the
    maximiser of a concave quadratic in a)."""
    flat = m.reshape(-1)
    best, arg = 0.0, np.zeros_like(flat)  # s = 0
    for signs in itertools.product((-1.0, 0.0, 1.0), repeat=flat.size):
        s = np.asarray(signs)
        k = np.count_nonzero(s)
        if k == 0:
            continue
        a = max(0.0, float(flat @ s)) / k
        value = a * float(flat @ s) - 0.5 * a * a * k - sparsity * k
        if value > best:
            best, arg = value, a * s
    return best, arg.reshape(m.shape)


def _objective(m, w, sparsity):
    return float(np.sum(m * w) - 0.5 * np.sum(w * w) - sparsity * np.count_nonzero(w))


@pytest.mark.parametrize("sparsity", [0.0, 0.05, 0.3, 10.0])
def test_projection_is_the_exact_argmax_over_the_ternary_set(sparsity):
    """On 2x3 kernels (729 sign patterns) the projection attains the brute-force maximum
    of <M, W> - |W|^2/2 - lambda |W|_0 to 1e-14 and is its maximiser; and it is the
    entry-wise rule W_i = a sign(M_i) where |M_i| > a/2 + lambda/a, else 0."""
    rng = np.random.default_rng(0)
    zeros_seen = nonzeros_seen = 0
    for _ in range(5):
        m = rng.normal(size=(2, 3))
        w, a = ternary_projection(jnp.asarray(m), sparsity)
        w, a = np.asarray(w), float(a)
        best, arg = _brute_force(m, sparsity)
        assert abs(_objective(m, w, sparsity) - best) < 1e-14
        np.testing.assert_allclose(w, arg, rtol=0, atol=1e-14)
        if a > 0:
            rule = np.where(np.abs(m) > a / 2 + sparsity / a, a * np.sign(m), 0.0)
            np.testing.assert_allclose(w, rule, rtol=0, atol=1e-15)
            assert set(np.unique(np.abs(w[w != 0]))) <= {a}
        zeros_seen += int(np.sum(w == 0))
        nonzeros_seen += int(np.sum(w != 0))
    if sparsity == 10.0:
        assert nonzeros_seen == 0  # the penalty outweighs every entry
    else:
        assert nonzeros_seen > 0
    if sparsity == 0.3:
        assert zeros_seen > 0 and nonzeros_seen > 0


def test_projection_keeps_a_ternary_kernel():
    """A kernel already in the set is its own projection (a^2/2 > lambda)."""
    rng = np.random.default_rng(1)
    w = 0.7 * rng.integers(-1, 2, size=(6, 5)).astype(np.float64)
    q, a = ternary_projection(jnp.asarray(w), 0.1)
    np.testing.assert_allclose(np.asarray(q), w, rtol=0, atol=1e-15)
    assert abs(float(a) - 0.7) < 1e-15


def test_straight_through_gradient_is_the_gradient_at_the_ternary_kernels():
    """J of the straight-through model equals J at Q(W), and its gradient with respect
    to the latent kernels W equals the gradient of J at the kernels Q(W) (computed
    without the estimator) to 1e-13; the other parameters' gradients agree too."""
    model, batch = small_model("pre"), small_batch()
    ternary = Ternary(0.0)
    projected = with_feedforward_kernels(model, ternary.project(feedforward_kernels(model)))

    @eqx.filter_jit
    def value_and_grad(objective, m):
        return eqx.filter_value_and_grad(lambda m: objective(m, batch)[0])(m)

    loss_ste, grads_ste = value_and_grad(Objective(ternary=ternary), model)
    loss_q, grads_q = value_and_grad(Objective(), projected)
    assert abs(float(loss_ste) - float(loss_q)) < 1e-13
    for g, h in zip(jax.tree.leaves(grads_ste), jax.tree.leaves(grads_q), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(h), rtol=0, atol=1e-13)
    # The gradient at the real kernels differs: the test would see a missing estimator.
    _, grads_real = value_and_grad(Objective(), model)
    real = feedforward_kernels(grads_real)[0]
    assert float(jnp.max(jnp.abs(real - feedforward_kernels(grads_ste)[0]))) > 1e-4


@pytest.mark.slow
def test_discrete_msa_lowers_j_and_keeps_the_kernels_ternary():
    """The small pre-LN model on one batch: 8 discrete-MSA iterations (eta = 2,
    alpha = 1; 5 inner Adam steps of 1e-2 on the other controls, rho = 1) lower J
    (at the ternary kernels) from its start by more than 0.3, and every kernel of every
    layer stays in {-a, 0, a}."""
    model, batch = small_model("pre"), small_batch()
    start = Ternary(0.0).project(feedforward_kernels(model))
    objective = Objective(ternary=Ternary(0.0))
    # optax's Adam raises a float decay to its int32 count: the standard rule for it.
    method = MSA(
        under_standard_promotion(optax.adam(1e-2)),
        inner_steps=5,
        rho=1.0,
        rho_growth=2.0,
        ternary_step=2.0,
    )
    state = method.init(model, objective)
    step = eqx.filter_jit(msa_iteration)
    losses = []
    for _ in range(8):
        model, state, metrics = step(method, objective, Constraints(), model, state, batch)
        losses.append(float(metrics["loss"]))
    losses.append(float(metrics["loss_after"]))
    assert losses[-1] < losses[0] - 0.3, losses
    for kernels in feedforward_kernels(model):
        for w in np.asarray(kernels):
            magnitudes = np.unique(np.abs(w[w != 0]))
            assert magnitudes.size == 1 or np.ptp(magnitudes) < 1e-15 * magnitudes.max()
    assert 0 < float(metrics["ternary_density"]) <= 1
    flipped = sum(
        int(jnp.sum(jnp.sign(w) != jnp.sign(w0)))
        for w, w0 in zip(feedforward_kernels(model), start, strict=True)
    )
    assert flipped > 0  # the maximisation moved entries between -a, 0 and a


@pytest.mark.slow
def test_a_ternary_msa_run_resumes_from_its_checkpoint(tmp_path):
    """``train.method=msa`` with ``objective.ternary=true`` through the command line: the
    checkpoint of step 2 holds the real kernels M, and the run resumed from it continues
    at step 3 with the same J as an uninterrupted run (the same batches, the same M)."""
    import json
    import os

    from ocformer import train as cli

    smoke = os.path.join(os.path.dirname(os.path.dirname(__file__)), "experiments", "smoke.py")
    sets = ["train.method=msa", "objective.ternary=true", "train.msa_inner_steps=2",
            "train.eval_every=2", "train.checkpoint_every=2", "train.progress=false"]  # fmt: skip

    def run(workdir, steps, *extra):
        argv = ["--config", smoke, "--workdir", str(workdir), "--set", f"train.steps={steps}"]
        for s in sets:
            argv += ["--set", s]
        argv += list(extra)
        assert cli.main(argv) == 0
        with open(os.path.join(workdir, "metrics.jsonl")) as f:
            return {r["step"]: r for r in map(json.loads, f) if "loss_after" in r}

    run(tmp_path / "resumed", 2)
    resumed = run(tmp_path / "resumed", 3, "--allow-config-change")
    straight = run(tmp_path / "straight", 3)
    assert sorted(straight) == [1, 2, 3]
    assert 0 < resumed[3]["ternary_density"] < 1
    assert abs(resumed[3]["loss"] - straight[3]["loss"]) < 1e-6


def test_a_straight_through_run_samples_from_its_ternary_kernels():
    """The text samples of a run with ``objective.ternary`` (gradient training) come
    from the model its evaluation computes, Q(W), not from the latent kernels W."""
    import jax.random as jr

    from ocformer.config import resolve
    from ocformer.distributed import Layout
    from ocformer.objective import Ternary
    from ocformer.training import build
    from ocformer.training._loop import _Evaluation

    smoke = os.path.join(os.path.dirname(os.path.dirname(__file__)), "experiments", "smoke.py")
    sets = ["task.name=stdlib_char", "task.seq_len=16", "objective.ternary=true",
            "train.sample_tokens=40", "train.sample_temperature=0.5"]  # fmt: skip
    config = resolve(smoke, sets)
    exp = build(config)
    model = exp.model
    sample = _Evaluation(exp, Layout(config), model).sample(model, jr.key(3), 7)
    prompt = exp.task.encode(config.train.sample_prompt)

    def text(m):
        tokens = m.generate(
            jr.fold_in(jr.key(3), 7), prompt, 40, 0.5, vocab_size=exp.task.vocab_size
        )
        return exp.task.decode(np.concatenate([np.asarray(prompt), np.asarray(tokens)]))

    assert sample == text(Ternary(0.0).straight_through(model))
    assert sample != text(model)  # the latent kernels write another text
