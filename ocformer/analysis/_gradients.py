r"""The gradient methods compared on one small model as the grid is refined.

Discretise-then-optimise backpropagates through the scheme: it is the exact gradient of
the discrete model. Optimise-then-discretise solves the continuous costate equation
backward with the same solver and grid: it is the gradient of the continuous problem,
discretised, and differs from the exact discrete gradient by the discretisation error,
which shrinks with the step size (measured at order 3 with Heun, one more than its
order 2: README, "Adjoint gradients"). ``direct`` differentiates the
discrete model exactly too, so its gap is rounding.
"""

from collections.abc import Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np

from ..controls import PiecewiseConstant, init_stacked_params
from ..integration import GRADIENT_METHODS, Discretisation
from ..models import ContinuousTransformer, Readout, SequenceModel, TokenEmbedding, rediscretise
from ..objective import Objective
from ..operators import Activation
from ..splitting import SOLVERS
from ..tasks import CopyTask
from ._convergence import fitted_slope, local_slopes

REFERENCE_METHOD = "discretise_then_optimise"
ROUNDING_GAP = 1e-10
"""A gap below this at every step count is rounding: no slope is fitted to it."""


@eqx.filter_jit
def _control_gradient(objective, model, batch):
    """The loss and its gradient w.r.t. the control values alone (embedding and readout
    fixed)."""

    def loss(values):
        at = eqx.tree_at(lambda m: m.transformer.control.values, model, values)
        return objective(at, batch)[0]

    return jax.value_and_grad(loss)(model.transformer.control.values)


def _relative_gap(a, b) -> float:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    num = sum(float(jnp.sum((x - y) ** 2)) for x, y in zip(la, lb))
    return float(np.sqrt(num / sum(float(jnp.sum(y**2)) for y in lb)))


def _per_layer_norms(values) -> list[float]:
    """The gradient's norm on each layer: the leading axis of the stacked values."""
    squares = sum(jnp.sum(x.reshape(x.shape[0], -1) ** 2, axis=1) for x in jax.tree.leaves(values))
    return [float(s) for s in jnp.sqrt(squares)]


def gradient_comparison(
    *,
    steps_per_layer: Sequence[int] = (1, 2, 4, 8, 16),
    methods: Sequence[str] = ("discretise_then_optimise", "optimise_then_discretise", "direct"),
    solver: str = "heun",
    seed: int = 0,
    num_layers: int = 2,
    width: int = 4,
    hidden: int = 8,
    num_heads: int = 2,
    vocab: int = 5,
    seq_len: int = 6,
    batch_size: int = 3,
    activation: Activation = "gelu",
) -> dict:
    r"""Gradients of one scalar loss w.r.t. the controls by each method, per step count.

    The model is a small random float64 pre-LN ``SequenceModel`` (piecewise-constant
    controls from ``init_stacked_params``, ``norm="pre"``, ``solver``, m steps per
    layer); the loss is the cross-entropy on a fixed ``CopyTask`` batch, with no running
    cost, so that every term of the gradient goes through the ODE. For each m, every
    method in ``methods`` differentiates the same model (same controls, only the
    discretisation's gradient method differs); the reference is the
    discretise-then-optimise gradient, the exact gradient of the discrete model.

    The hidden activation defaults to GELU: the field is then smooth in u, and the
    optimise-then-discretise gap reaches its asymptotic order (3 with Heun).

    Args:
        steps_per_layer: step counts m (dt = 1/m), at least two.
        methods: names from ``ocformer.integration.GRADIENT_METHODS``.
        solver: a diffrax solver name (``ocformer.splitting.SOLVERS``) that
            optimise-then-discretise accepts (not a splitting scheme).
        seed: seeds the controls, embedding, readout and batch.
        num_layers, width, hidden, num_heads, vocab, seq_len, batch_size, activation:
            the model and batch sizes.

    Returns:
        A JSON-ready dict: the set-up, ``steps_per_layer``, ``dt``, ``loss`` per m and,
        per method, ``gaps`` (relative 2-norm distance of its control gradient to the
        reference, per m), ``slope`` (fitted log-log slope of the gaps against dt, None
        when every gap is below ``ROUNDING_GAP``), ``local_slopes`` (between
        consecutive step counts) and ``per_layer_norms`` (per m, the
        norm of the control gradient on each layer).
    """
    if not jax.config.jax_enable_x64:  # pyright: ignore[reportAttributeAccessIssue]
        raise ValueError(
            "Gradient gaps go down to rounding: call "
            "jax.config.update('jax_enable_x64', True) first."
        )
    unknown = [name for name in methods if name not in GRADIENT_METHODS]
    if unknown:
        raise ValueError(
            f"Unknown gradient methods {unknown}; known: {', '.join(GRADIENT_METHODS)}."
        )
    if solver not in SOLVERS:
        raise ValueError(f"Unknown diffrax solver {solver!r}; known: {', '.join(SOLVERS)}.")
    steps = sorted(int(m) for m in steps_per_layer)
    if len(set(steps)) < len(steps) or len(steps) < 2 or steps[0] < 1:
        raise ValueError(f"A slope needs at least two distinct positive step counts, got {steps}.")

    k_control, k_embed, k_readout = jr.split(jr.key(seed), 3)
    control = PiecewiseConstant(
        init_stacked_params(k_control, num_layers, width, hidden, dtype=jnp.float64)
    )
    embedding = TokenEmbedding(vocab, seq_len, width, key=k_embed, dtype=jnp.float64)
    readout = Readout(width, vocab, key=k_readout, dtype=jnp.float64)
    batch = {
        k: jnp.asarray(v)
        for k, v in CopyTask(seq_len, vocab).batch("train", seed, batch_size, 0).items()
    }
    objective = Objective()

    losses = []
    per_method: dict[str, dict] = {name: dict(gaps=[], per_layer_norms=[]) for name in methods}
    for m in steps:
        transformer = ContinuousTransformer(
            control,
            norm="pre",
            num_heads=num_heads,
            causal=True,
            activation=activation,
            ln_eps=1e-5,
            discretisation=Discretisation(SOLVERS[solver](), steps_per_layer=m),
        )
        model = SequenceModel(embedding, transformer, readout)
        value, reference = _control_gradient(objective, model, batch)
        losses.append(float(value))
        for name in methods:
            if name == REFERENCE_METHOD:
                grad = reference
            else:
                model_for = rediscretise(model, gradient=GRADIENT_METHODS[name]())
                grad = _control_gradient(objective, model_for, batch)[1]
            per_method[name]["gaps"].append(_relative_gap(grad, reference))
            per_method[name]["per_layer_norms"].append(_per_layer_norms(grad))

    dts = [1.0 / m for m in steps]
    for entry in per_method.values():
        gaps = entry["gaps"]
        above = min(gaps) > ROUNDING_GAP
        entry["slope"] = fitted_slope(dts, gaps) if above else None
        entry["local_slopes"] = local_slopes(dts, gaps) if above else None
    return dict(
        solver=solver,
        seed=seed,
        reference=REFERENCE_METHOD,
        model=dict(
            norm="pre",
            num_layers=num_layers,
            width=width,
            hidden=hidden,
            num_heads=num_heads,
            activation=activation,
            control="PiecewiseConstant",
        ),
        loss_fn="cross-entropy on a CopyTask batch",
        gap="|g - g_dto| / |g_dto| over the control values",
        steps_per_layer=steps,
        dt=dts,
        loss=losses,
        methods=per_method,
    )
