"""What adamw's weight decay acts on (``optimiser.weight_decay_on``): with ``matrices``
a training step moves each weight matrix as AdamW and every other parameter as Adam,
against the update written out by hand (float64, 1e-12), also under bfloat16 compute;
the default is optax's adamw, update and state; the mask marks every parameter of every
kind of model by its role."""

import os
from typing import cast

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np
import optax
import pytest

from ocformer.config import OptimiserConfig, resolve
from ocformer.controls import NormParams
from ocformer.models import (
    Pooler,
    SequenceModel,
    TokenEmbedding,
    TokenTypeEmbedding,
    weight_matrices,
)
from ocformer.training import build, make_optimiser, make_train_step, with_precision

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOKE = os.path.join(ROOT, "experiments", "smoke.py")
LR, WD = 1e-2, 0.5
# A constant rate, no clipping and no projection: the step is the optimiser's alone.
STEP = [
    f"optimiser.learning_rate={LR}",
    f"optimiser.weight_decay={WD}",
    "optimiser.schedule=constant",
    "optimiser.warmup_steps=0",
    "optimiser.clip_norm=none",
    "objective.sigma_floor=none",
]
# The fields that hold weight matrices, by name: the reference the role table is held
# to (the implementation reads the module that holds a leaf, not only its name).
MATRIX_FIELDS = {"wq", "wk", "wv", "wo", "kq", "kk", "kv", "weights", "tokens", "token_types"}
MATRIX_FIELDS |= {"weight"}  # patch map, readout, pooler


def _field(path) -> str:
    """The name of the module field that holds the leaf at ``path``."""
    return [k.name for k in path if isinstance(k, jtu.GetAttrKey)][-1]


def _perturbed(model, key):
    """``model`` with N(0, 0.1^2) added to every parameter, so that no bias is zero
    (decay of a zero bias would be invisible)."""
    params, static = eqx.partition(model, eqx.is_inexact_array)
    leaves, treedef = jtu.tree_flatten(params)
    keys = jr.split(key, len(leaves))
    moved = [x + 0.1 * jr.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
    return eqx.combine(jtu.tree_unflatten(treedef, moved), static)


def _one_step(config, seed=0):
    """(experiment, model before, model after one training step, Adam's state after it,
    the batch) of ``config``."""
    exp = build(config)
    model = _perturbed(exp.model, jr.key(seed))
    batch = exp.task.batch("train", 0, config.task.batch_size, seed)
    objective = with_precision(exp.objective, config)
    step = make_train_step(objective, exp.constraints, exp.optimiser, skip_nonfinite=False)
    state = exp.optimiser.init(eqx.filter(model, eqx.is_inexact_array))
    after, state, _, finite = step(model, state, batch)
    assert bool(np.all(finite))
    is_adam = lambda x: isinstance(x, optax.ScaleByAdamState)  # noqa: E731
    (adam,) = [s for s in jax.tree.leaves(state, is_leaf=is_adam) if is_adam(s)]
    return exp, model, after, adam, batch


def _leaves(model) -> dict:
    params = eqx.filter(model, eqx.is_inexact_array)
    return {path: np.asarray(x) for path, x in jtu.tree_leaves_with_path(params)}


def test_a_step_decays_the_matrices_as_adamw_and_the_rest_as_adam():
    r"""One step from a perturbed float64 smoke model: every weight matrix moves by
    $-\eta(\hat m/(\sqrt{\hat v} + \epsilon) + \lambda\theta)$ and every other
    parameter (biases, layer-norm gains and biases, the final norm, the positions, the
    readout's bias) by the same without $\lambda\theta$, to 1e-12."""
    config = resolve(f"{SMOKE}:float64", [*STEP, "optimiser.weight_decay_on=matrices"])
    exp, model, after, adam, batch = _one_step(config)
    grads = eqx.filter_grad(lambda m: exp.objective(m, batch)[0])(model)
    b1, b2, eps = config.optimiser.b1, config.optimiser.b2, 1e-8  # optax's eps
    before, moved, g = _leaves(model), _leaves(after), _leaves(grads)
    mu, nu = _leaves(adam.mu), _leaves(adam.nu)
    fields = {_field(path) for path in before}
    assert {"wq", "weights", "tokens", "weight", "bq", "biases", "scale", "positions"} <= fields
    decayed = 0
    for path, p in before.items():
        # The moments after one step are (1 - b) times the gradient and its square.
        np.testing.assert_allclose(mu[path], (1 - b1) * g[path], rtol=0, atol=1e-13)
        np.testing.assert_allclose(nu[path], (1 - b2) * g[path] ** 2, rtol=0, atol=1e-13)
        # The step is then written with the gradient its own program computed: where
        # the loss does not depend on a parameter (b^K: softmax ignores a shift common
        # to a query's scores) the gradient is rounding noise, and Adam's normalised
        # step of it differs between two programs by more than the tolerance.
        m_hat, v_hat = mu[path] / (1 - b1), nu[path] / (1 - b2)
        adam_step = p - LR * m_hat / (np.sqrt(v_hat) + eps)
        decay = LR * WD * p
        matrix = _field(path) in MATRIX_FIELDS
        want = adam_step - decay if matrix else adam_step
        np.testing.assert_allclose(moved[path], want, rtol=0, atol=1e-12, err_msg=str(path))
        # The decay term is far above the tolerance: the other choice would fail.
        assert np.max(np.abs(decay)) > 1e-5, path
        decayed += matrix
    assert 0 < decayed < len(before)


def test_under_bfloat16_compute_the_mask_reads_the_master_parameters():
    r"""``model.precision=bfloat16`` computes in bfloat16 and updates the float32
    masters: a step with ``matrices`` differs from one with ``all`` by the decay of the
    non-matrices, $+\eta\lambda\theta$ (to float32's rounding of the two updates),
    and not at all on the matrices."""
    base = [*STEP, "model.precision=bfloat16"]
    only_matrices = [*base, "optimiser.weight_decay_on=matrices"]
    # The standard rule, as for any bfloat16 run: jax cannot lower the gradient of its
    # bfloat16 dot_product_attention under strict promotion.
    with jax.numpy_dtype_promotion("standard"):
        _, model, matrices, _, _ = _one_step(resolve(SMOKE, only_matrices))
        _, _, every, _, _ = _one_step(resolve(SMOKE, base))
    before, only, both = _leaves(model), _leaves(matrices), _leaves(every)
    for path, p in before.items():
        assert only[path].dtype == np.float32
        difference = only[path].astype(np.float64) - both[path]
        want = 0.0 * p if _field(path) in MATRIX_FIELDS else LR * WD * p.astype(np.float64)
        np.testing.assert_allclose(difference, want, rtol=0, atol=3e-7, err_msg=str(path))
        assert LR * WD * np.max(np.abs(p)) > 1e-4  # the decay is far above the tolerance


def test_the_default_is_optax_adamw_update_and_state():
    """``weight_decay_on=all`` (the default) is ``optax.adamw`` with no mask: the same
    updates bit for bit over three steps and the same state; ``matrices`` keeps the
    state's arrays (the decay holds none), so a run resumes under either choice."""
    config = resolve(f"{SMOKE}:float64", STEP)
    assert config.optimiser.weight_decay_on == "all"
    params = eqx.filter(build(config).model, eqx.is_inexact_array)
    ours, _ = make_optimiser(config.optimiser, total_steps=10)
    o = config.optimiser
    plain = optax.adamw(LR, b1=o.b1, b2=o.b2, weight_decay=WD)
    state, reference = ours.init(params), plain.init(params)
    # Our state is (adamw's state, the schedule's).
    adamw_state = lambda s: cast(tuple, s)[0]  # noqa: E731
    assert jax.tree.structure(adamw_state(state)) == jax.tree.structure(reference)
    leaves, treedef = jtu.tree_flatten(params)
    for n in range(3):
        keys = jr.split(jr.key(n), len(leaves))
        drawn = [jr.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
        grads = jtu.tree_unflatten(treedef, drawn)
        update, state = ours.update(grads, state, params)
        with jax.numpy_dtype_promotion("standard"):  # optax's b1 ** count
            want, reference = plain.update(grads, reference, params)
        for a, b in zip(jax.tree.leaves(update), jax.tree.leaves(want), strict=True):
            assert np.array_equal(np.asarray(a), np.asarray(b))
        for a, b in zip(
            jax.tree.leaves(adamw_state(state)), jax.tree.leaves(reference), strict=True
        ):
            assert np.array_equal(np.asarray(a), np.asarray(b))
    masked, _ = make_optimiser(
        OptimiserConfig(weight_decay=WD, weight_decay_on="matrices"), total_steps=10
    )
    spec = lambda s: [(x.shape, x.dtype) for x in jax.tree.leaves(s)]  # noqa: E731
    assert spec(masked.init(params)) == spec(ours.init(params))
    assert jax.tree.structure(masked.init(params)) != jax.tree.structure(ours.init(params))


def _pretrained_like(model: SequenceModel, d: int) -> dict[str, SequenceModel]:
    """GPT-2's and BERT's shapes of model around ``model``'s transformer of width ``d``:
    a tied symbol table, and a token-type embedding with its norm and a pooler."""
    key = jr.key(3)
    gpt2 = SequenceModel(TokenEmbedding(8, 16, d, key=key), model.transformer, tied=True)
    bert = SequenceModel(
        TokenTypeEmbedding(
            tokens=jnp.ones((8, d)),
            positions=jnp.ones((16, d)),
            token_types=jnp.ones((2, d)),
            norm=NormParams(scale=jnp.ones(d), bias=jnp.zeros(d)),
            eps=1e-12,
        ),
        model.transformer,
        head=Pooler(weight=jnp.ones((d, d)), bias=jnp.zeros(d)),
    )
    return {"gpt2": gpt2, "bert": bert}


MODELS = {
    "piecewise_constant": (SMOKE, []),
    "piecewise_linear": (SMOKE, ["controls.kind=piecewise_linear"]),
    "basis": (
        SMOKE,
        ["controls.kind=basis", "controls.basis_size=2", "objective.sigma_floor=none"],
    ),
    "constant": (SMOKE, ["controls.kind=constant"]),
    "scalar_norms": (SMOKE, ["controls.norm_affine=scalar"]),
    "vit": (os.path.join(ROOT, "experiments", "digits_vit.py"), []),
    "cvt": (os.path.join(ROOT, "experiments", "digits_cvt.py"), []),
}


@pytest.mark.parametrize("kind", MODELS)
def test_the_mask_marks_every_parameter_by_its_role(kind):
    """For every control kind, ViT, CvT and the shapes of GPT-2 and BERT: one bool per
    parameter, in the parameters' structure; True exactly at the weight matrices
    (however many axes the control stacks), so a kernel is in and a bias is out."""
    path, overrides = MODELS[kind]
    config = resolve(path, [*overrides, "optimiser.weight_decay_on=matrices"])
    model = build(config).model
    models = {kind: model}
    if kind == "piecewise_constant":
        models.update(_pretrained_like(model, config.model.width))
    for name, m in models.items():
        params = eqx.filter(m, eqx.is_inexact_array)
        mask = weight_matrices(params)
        assert jax.tree.structure(mask) == jax.tree.structure(params), name
        marked = dict(jtu.tree_leaves_with_path(mask))
        assert all(type(b) is bool for b in marked.values()), name
        want = {p: _field(p) in MATRIX_FIELDS for p, _ in jtu.tree_leaves_with_path(params)}
        assert marked == want, name
        by_field = {(_field(p), b) for p, b in marked.items()}
        assert {("wq", True), ("bq", False), ("scale", False), ("positions", False)} <= by_field


def test_a_parameter_of_no_known_module_is_refused_by_its_path():
    with pytest.raises(ValueError, match=r"array at \['extra'\] \(shape \(3,\)\)"):
        weight_matrices({"extra": jnp.ones(3)})


@pytest.mark.parametrize(
    "overrides",
    [["optimiser.weight_decay=0"], ["train.method=msa"]],
    ids=["no decay", "msa"],
)
def test_matrices_is_accepted_where_it_changes_nothing(overrides):
    """A decay of 0 (a sweep over the decay includes it) and ``train.method=msa``
    (whose file serves gradient training too) take ``matrices`` without complaint."""
    config = resolve(SMOKE, [*overrides, "optimiser.weight_decay_on=matrices"])
    assert config.optimiser.weight_decay_on == "matrices"
