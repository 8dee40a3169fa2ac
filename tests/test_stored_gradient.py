"""The stored-residual gradient methods: plain reverse mode through the scanned steps of
a constant grid, with every step's intermediate values kept (``stored``), only its
matrix products (``stored_dots``), or only the products without batch dimensions, the
feature-wise linear maps (``stored_projections``).

They differentiate the same discrete objective as discretise-then-optimise, so in
float64 their gradients equal its gradients to rounding, and their forward values
are the same numbers. What differs is the backward pass: nothing of the forward is
recomputed there, which the jaxpr of the gradient shows.
"""

import dataclasses

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import pytest
from test_gradients import BATCH, OBJECTIVE, _basis_controls, build, relative_gap

from ocformer import _compat
from ocformer.config import ConfigError, resolve
from ocformer.integration import (
    GRADIENT_METHODS,
    AbstractGradientMethod,
    Discretisation,
    DiscretiseThenOptimise,
    StoredDots,
    StoredProjections,
    StoredResiduals,
)
from ocformer.models import Choices, IncompatibleError, rediscretise, refusals
from ocformer.objective import Objective
from ocformer.splitting import Strang


@eqx.filter_jit
def loss_and_grad(objective, model, batch):
    return eqx.filter_value_and_grad(lambda m: objective(m, batch)[0])(model)


CASES = {
    # Lie, piecewise-constant controls, every running cost on (the kinetic energy
    # saves the state at every grid point: SaveAt(ts=...)).
    "lie-piecewise_constant-running_costs": (
        lambda g: build("pre", None, 2, g),
        OBJECTIVE,
    ),
    # Strang, smooth (basis) controls.
    "strang-basis": (
        lambda g: build("pre", Strang(), 2, g, control=_basis_controls()),
        Objective(control_smoothness=0.1),
    ),
    # A diffrax Runge-Kutta solver on pre-LN with piecewise-constant controls: the grid
    # steps over every layer jump (made_jump), running costs on.
    "heun-piecewise_constant-running_costs": (
        lambda g: build("pre", diffrax.Heun(), 2, g),
        OBJECTIVE,
    ),
}


@pytest.mark.parametrize(
    "case",
    [
        "strang-basis",
        pytest.param("lie-piecewise_constant-running_costs", marks=pytest.mark.slow),
        pytest.param("heun-piecewise_constant-running_costs", marks=pytest.mark.slow),
    ],
)
def test_stored_gradient_equals_discretise_then_optimise(case):
    make, objective = CASES[case]
    value, grad = loss_and_grad(objective, make(DiscretiseThenOptimise()), BATCH)
    methods: list[AbstractGradientMethod] = [StoredResiduals()]
    if case != "heun-piecewise_constant-running_costs":
        methods += [StoredDots(), StoredProjections()]
    for method in methods:
        v, g = loss_and_grad(objective, make(method), BATCH)
        assert float(v) == float(value), (method.name, float(v), float(value))
        assert relative_gap(g, grad) <= 1e-12, (method.name, relative_gap(g, grad))
    # The gradient is not trivially equal: it is far from zero.
    assert relative_gap(jax.tree.map(jnp.zeros_like, grad), grad) == 1.0


_NONLINEAR = {"exp", "tanh", "logistic", "rsqrt", "sqrt", "log", "erf", "max"}


def _sub_jaxprs(value):
    if hasattr(value, "jaxpr") and hasattr(value, "consts"):  # a closed jaxpr
        yield value.jaxpr
    elif hasattr(value, "eqns"):
        yield value
    elif isinstance(value, tuple | list):
        for v in value:
            yield from _sub_jaxprs(v)


def _count(jaxpr, names, where=lambda eqn: True) -> int:
    """Equations whose primitive is in ``names`` (and that satisfy ``where``), in
    ``jaxpr`` and every sub-jaxpr."""
    n = 0
    for eqn in jaxpr.eqns:
        n += eqn.primitive.name in names and where(eqn)
        for value in eqn.params.values():
            for sub in _sub_jaxprs(value):
                n += _count(sub, names, where)
    return n


def _batched(eqn) -> bool:
    """A ``dot_general`` with batch dimensions (attention's products over the tokens,
    per batch element and head), unlike the feature-wise linear maps."""
    (_, _), (lhs_batch, _) = eqn.params["dimension_numbers"]
    return len(lhs_batch) > 0


def _solve_loss(model):
    """|u(T)|^2 of the model's transformer as a function of its arrays, and those."""
    transformer = model.transformer
    u0 = jr.normal(jr.key(1), (3, 4, transformer.width), jnp.float64)
    params, static = eqx.partition(transformer, eqx.is_inexact_array)

    def loss(p):
        return jnp.sum(eqx.combine(p, static)(u0) ** 2)

    return loss, params


def test_backward_pass_recomputes_nothing():
    """Structural, on the jaxprs of the forward and of the gradient of |u(T)|^2 (pre-LN,
    Lie, 2 layers x 2 steps). The non-linear primitives (the softmax's exp, the layer
    norm's sqrt, the ReLU's max, ...) appear in the gradient exactly as often as in the
    forward for ``stored``: its backward pass applies transposes to stored values and
    recomputes nothing. Discretise-then-optimise recomputes each step in its backward
    pass, so they appear more often there, and so does each matrix product (measured:
    non-linear 6 in the forward, 6 / 13 / 11 / 11 in the gradients of ``stored`` /
    discretise-then-optimise / ``stored_dots`` / ``stored_projections``; matrix
    products 8 in the forward, 2 of them with batch dimensions, and 24 / 32 / 24 / 26).
    ``stored_dots`` recomputes the element-wise work but no matrix product;
    ``stored_projections`` recomputes attention's two products over the tokens too,
    and none of the feature-wise linear maps."""
    counts = {}
    methods = (DiscretiseThenOptimise(), StoredResiduals(), StoredDots(), StoredProjections())
    for method in methods:
        f, params = _solve_loss(build("pre", None, 2, method))
        forward = jax.make_jaxpr(f)(params).jaxpr
        backward = jax.make_jaxpr(jax.grad(f))(params).jaxpr
        counts[method.name] = {
            "nonlinear": (_count(forward, _NONLINEAR), _count(backward, _NONLINEAR)),
            "dots": (_count(forward, {"dot_general"}), _count(backward, {"dot_general"})),
            "batched": _count(forward, {"dot_general"}, _batched),
        }
    stored, dto, dots, projections = (
        counts[n]
        for n in ("stored", "discretise_then_optimise", "stored_dots", "stored_projections")
    )
    assert stored["nonlinear"][0] > 0 and stored["nonlinear"][1] == stored["nonlinear"][0]
    assert dto["nonlinear"][1] > dto["nonlinear"][0], counts
    assert dots["nonlinear"][1] > dots["nonlinear"][0], counts
    assert projections["nonlinear"][1] > projections["nonlinear"][0], counts
    assert stored["dots"][0] == dto["dots"][0] == dots["dots"][0] > 0, counts
    assert projections["dots"][0] == stored["dots"][0], counts
    assert stored["dots"][1] == dots["dots"][1] < dto["dots"][1], counts
    # The products with batch dimensions, and only those, are computed again.
    batched = projections["batched"]
    assert 0 < batched < projections["dots"][0], counts
    assert projections["dots"][1] == stored["dots"][1] + batched < dto["dots"][1], counts


def test_stored_methods_refuse_adaptive_steps():
    for name in ("stored", "stored_dots", "stored_projections"):
        choices = Choices(
            stepper="tsit5",
            stepper_kind="explicit",
            error_estimate=True,
            stepsize="pid",
            norm="pre",
        )
        assert refusals(choices) == []  # discretise-then-optimise takes adaptive steps
        (refusal,) = refusals(dataclasses.replace(choices, gradient=name))
        assert refusal.field == "discretisation.gradient"
        assert "stepsize=constant" in refusal.message
        assert "gradient=discretise_then_optimise" in refusal.message
    model = build("pre", diffrax.Tsit5(), 1)
    with pytest.raises(IncompatibleError, match="gradient='stored'"):
        rediscretise(model, stepsize="pid", gradient=StoredResiduals())
    # The method itself refuses too, for an adjoint asked for outside a model.
    for method in (StoredResiduals(), StoredDots(), StoredProjections()):
        with pytest.raises(ValueError, match="stepsize='constant'"):
            method.adjoint(diffrax.Tsit5(), model.transformer.control, 1, True)


def test_registry_and_config_take_the_stored_methods():
    assert GRADIENT_METHODS["stored"] is StoredResiduals
    assert GRADIENT_METHODS["stored_dots"] is StoredDots
    assert GRADIENT_METHODS["stored_projections"] is StoredProjections
    assert isinstance(Discretisation(gradient=StoredDots()).gradient, StoredDots)
    smoke = "experiments/smoke.py"
    config = resolve(smoke, ["discretisation.gradient=stored_dots"])
    assert config.discretisation.gradient == "stored_dots"
    pid = ["discretisation.stepper=tsit5", "discretisation.stepsize=pid"]
    with pytest.raises(ConfigError, match="stepsize=constant") as info:
        resolve(smoke, [*pid, "discretisation.gradient=stored"])
    assert info.value.field == "discretisation.gradient"
    # The loop diffrax runs with the adjoint's while loops is where _compat found it.
    from diffrax import _integrate

    assert _compat.diffrax_loop is _integrate.loop
