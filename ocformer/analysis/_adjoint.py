r"""Gradients, costates and gradient densities of one objective.

For the discrete model $u_{n+1} = \Psi_n(u_n; \theta)$, $J = \ell(u_N)$, the costate is
$\lambda_n = \partial J / \partial u_n$: $\lambda_N = \nabla\ell(u_N)$ and
$\lambda_n = (\partial_u \Psi_n)^\top \lambda_{n+1}$, the discrete adjoint equation that
backpropagation solves. As the step shrinks it converges to the costate $a(t)$ of the
continuous problem, $\dot a = -(\partial_u f)^\top a$. The gradient w.r.t. a constant
perturbation $\delta$ of the controls during step n is
$g_n = (\partial_\theta \Psi_n)^\top \lambda_{n+1}$; $g_n / \delta t$ is the gradient
density $dJ/d\theta(t)$, whose integral over a layer is the gradient w.r.t. that layer's
piecewise-constant parameters.
"""

from collections.abc import Callable, Sequence
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, Float

from .._counts import whole_number
from ..integration import GRADIENT_METHODS
from ..models import ContinuousTransformer, IncompatibleError, SequenceModel, rediscretise
from ..objective import cross_entropy
from ._steps import ShiftedControl, StepMap, trajectory


def _transformer(model) -> ContinuousTransformer:
    return model if isinstance(model, ContinuousTransformer) else model.transformer


def _require_x64(what: str) -> None:
    if not jax.config.jax_enable_x64:  # pyright: ignore[reportAttributeAccessIssue]
        raise ValueError(
            f"{what} needs float64: call jax.config.update('jax_enable_x64', True) first."
        )


def _control_loss(loss: Callable, model):
    """J as a function of the control's arrays alone."""
    params, static = eqx.partition(_transformer(model).control, eqx.is_inexact_array)

    def replace(p):
        control = eqx.combine(p, static)
        if isinstance(model, ContinuousTransformer):
            return eqx.tree_at(lambda m: m.control, model, control)
        return eqx.tree_at(lambda m: m.transformer.control, model, control)

    return (lambda p: loss(replace(p))), params


def _dot(a, b) -> Array:
    return jnp.asarray(sum(jnp.vdot(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))))


def gradient_check(
    loss: Callable,
    model,
    *,
    methods: Sequence[str] = tuple(GRADIENT_METHODS),
    directions: int = 4,
    step: float = 1e-5,
    seed: int = 0,
) -> dict:
    r"""$dJ/d\theta$ of ``loss(model)`` by every gradient method, against float64 central
    finite differences of $J$ along random unit directions $v$ of the control's arrays:
    $(J(\theta + hv) - J(\theta - hv)) / 2h$, error $O(h^2)$.

    Finite differences differentiate the discrete model the forward solve evaluates, so
    the exact methods (discretise-then-optimise, direct) agree with them to about
    $h^2 + \epsilon/h$; optimise-then-discretise differs by the discretisation error.

    Args:
        loss: ``loss(model) -> scalar``, e.g. ``lambda m: Objective()(m, batch)[0]``.
        model: a ``ContinuousTransformer`` or ``SequenceModel`` (float64), under any
            discretisation.
        methods: names from ``ocformer.integration.GRADIENT_METHODS``.
        directions: how many random directions (>= 1).
        step: the finite-difference step h.
        seed: seeds the directions.

    Returns:
        A JSON-ready dict: ``loss``, ``finite_differences`` (one per direction) and per
        method either ``{"status": "refused", "reason"}`` (the rules refuse it for this
        model) or ``status="ok"``, ``directional`` (<g, v> per direction),
        ``fd_error`` (max over directions of |<g, v> - FD| / max |FD|; not divided
        where every FD is zero) and ``norm``.
        ``gradients`` (not JSON) holds each method's gradient tree.
    """
    _require_x64("A finite-difference check")
    if isinstance(methods, str):  # iterated, it would be one method per character
        raise ValueError(
            f"methods must be a list of names, got the string {methods!r}: give [{methods!r}]."
        )
    unknown = [m for m in methods if m not in GRADIENT_METHODS]
    if unknown:
        raise ValueError(
            f"Unknown gradient methods {unknown}; known: {', '.join(GRADIENT_METHODS)}."
        )
    if (whole_number(directions) or 0) < 1:
        raise ValueError(f"directions must be a whole number >= 1, got {directions!r}.")
    f, params = _control_loss(loss, model)
    if lower := sorted({str(x.dtype) for x in jax.tree.leaves(params) if x.dtype != jnp.float64}):
        raise ValueError(
            f"A finite-difference check needs the controls in float64, got {', '.join(lower)}: "
            f"at step={step:g} the differences of a float32 loss are its rounding (the "
            "check reported every exact method 85 % off). Cast the model first: "
            "ocformer.objective.in_precision(model, jnp.float64)."
        )
    leaves, treedef = jax.tree.flatten(params)
    keys = jr.split(jr.key(seed), directions)
    vs = []
    for k in keys:
        ks = jr.split(k, len(leaves))
        v = [jr.normal(kk, x.shape, x.dtype) for kk, x in zip(ks, leaves)]
        norm = jnp.sqrt(sum(jnp.sum(x**2) for x in v))
        vs.append(jax.tree.unflatten(treedef, [x / norm for x in v]))
    value = float(eqx.filter_jit(f)(params))
    f_jit = eqx.filter_jit(f)
    fds = []
    for v in vs:
        plus = f_jit(jax.tree.map(lambda p, d: p + step * d, params, v))
        minus = f_jit(jax.tree.map(lambda p, d: p - step * d, params, v))
        fds.append(float((plus - minus) / (2 * step)))
    # Relative to the largest difference; absolute where every one is zero (a loss flat
    # along the directions, whose exact gradient is then zero along them too).
    scale = max(abs(x) for x in fds) or 1.0
    out: dict = dict(loss=value, step=step, finite_differences=fds, methods={}, gradients={})
    for name in methods:
        try:
            at = rediscretise(model, gradient=GRADIENT_METHODS[name]())
        except IncompatibleError as e:
            out["methods"][name] = dict(status="refused", reason=str(e))
            continue
        g_of, p = _control_loss(loss, at)
        grad = eqx.filter_jit(jax.grad(g_of))(p)
        directional = [float(_dot(grad, v)) for v in vs]
        out["gradients"][name] = grad
        out["methods"][name] = dict(
            status="ok",
            directional=directional,
            fd_error=max(abs(a - b) for a, b in zip(directional, fds)) / scale,
            norm=float(jnp.sqrt(_dot(grad, grad))),
        )
    return out


def terminal_loss(model: SequenceModel, batch: dict):
    """The terminal cost of ``model`` on ``batch`` as a function of u(T).

    Returns:
        ``(u0, key_mask, loss)``: the embedded input, the batch's key mask (or None) and
        ``loss(u_T)``, the mean cross-entropy of the readout of u(T) after the final
        norm (the task loss of ``ocformer.objective.Objective`` without running costs).
    """
    transformer = model.transformer
    targets = jnp.asarray(batch["targets"])

    def loss(u_t):
        if transformer.final_norm is not None:
            u_t = transformer.layer_norm(transformer.final_norm, u_t)
        return cross_entropy(model.readout(u_t), targets)[0]

    return model.initial_state(batch["inputs"]), batch.get("key_mask"), loss


class Costates(NamedTuple):
    r"""The discrete costate along a trajectory.

    ``ts``, ``states``, ``costates``: the grid t_0..t_N, u_n and $\lambda_n = dJ/du_n$;
    ``norms``: $|\lambda_n|$ (2-norm over every token and feature). With sub-steps:
    ``sub_ts`` (labels ordering the sub-states, as ``trajectory(substeps=True)``),
    ``sub_costates`` and ``sub_norms`` at every sub-state, else None.
    """

    ts: Float[Array, " T"]
    states: Array
    costates: Array
    norms: Float[Array, " T"]
    sub_ts: Float[Array, " S"] | None
    sub_costates: Array | None
    sub_norms: Float[Array, " S"] | None


def _norm(x) -> Array:
    return jnp.sqrt(jnp.sum(x.reshape(x.shape[0], -1) ** 2, axis=1))


@eqx.filter_jit
def _backward(steps: StepMap, ys, terminal, substeps: bool, density: bool):
    """The reverse sweep: lambda_n for every n, and optionally per step the sub-state
    costates and the control gradient g_n."""
    control = steps.transformer.control
    zero_theta = jax.tree.map(jnp.zeros_like, control(control.interval[0]))
    lam_n = jax.grad(terminal)(ys[-1])
    num_sub = steps.num_substates() if substeps else 0

    def body(lam, n):
        y = ys[n]
        _, vjp = jax.vjp(lambda u: steps(n, u), y)
        (prev,) = vjp(lam)
        extra = {}
        if substeps:
            zeros = jnp.zeros((num_sub, *y.shape), y.dtype)
            _, vjp_sub = jax.vjp(lambda d: steps.nudged(n, y, d), zeros)
            extra["sub"] = vjp_sub(lam)[0]
        if density:
            shifted = lambda d: steps(n, y, ShiftedControl(control, d))  # noqa: E731
            _, vjp_theta = jax.vjp(shifted, zero_theta)
            extra["theta"] = vjp_theta(lam)[0]
        return prev, (prev, extra)

    idx = jnp.arange(steps.num_steps)[::-1]
    _, (lams, extra) = jax.lax.scan(body, lam_n, idx)
    lams = jnp.concatenate([lams[::-1], lam_n[None]])
    extra = jax.tree.map(lambda x: x[::-1], extra)
    return lams, extra


def costates(
    transformer: ContinuousTransformer,
    u0,
    loss: Callable,
    *,
    key_mask=None,
    substeps: bool = False,
) -> Costates:
    r"""The costate $\lambda_n = dJ/du_n$ at every step (and sub-step) of the solve.

    The states are those of the model's own solve (``trajectory``); each step is
    linearised about them and its transpose applied backward from
    $\lambda_N = \nabla\ell(u_N)$: exactly what discretise-then-optimise computes, here
    kept at every step. With sub-steps (Lie and Strang, which apply their sub-flows one
    after another) the costate at the state after each sub-flow is the gradient of J
    w.r.t. a perturbation added there.

    Args:
        transformer: a ``ContinuousTransformer`` with constant steps.
        u0: the embedded input (N, d) or (B, N, d), in the dtype to analyse in.
        loss: ``loss(u_T) -> scalar`` (e.g. from ``terminal_loss``).
        key_mask: the key-padding mask, if any.
        substeps: also return the costate after every sub-flow.
    """
    steps = StepMap(transformer, key_mask, u0.dtype)
    model = steps.transformer
    ts, ys = trajectory(model, u0, key_mask)
    lams, extra = _backward(steps, ys, loss, substeps, False)
    sub_ts = sub = sub_norms = None
    if substeps:
        s = extra["sub"]  # (steps, S, ...)
        num_steps, num_sub = s.shape[:2]
        frac = jnp.arange(1, num_sub + 1, dtype=ts.dtype) / num_sub
        sub_ts = (ts[:-1, None] + (ts[1:] - ts[:-1])[:, None] * frac[None]).reshape(-1)
        sub = s.reshape(num_steps * num_sub, *s.shape[2:])
        sub_norms = _norm(sub)
    return Costates(ts, ys, lams, _norm(lams), sub_ts, sub, sub_norms)


def _initial_gradient(model: ContinuousTransformer, u0, lam0):
    """The gradient w.r.t. a constant shift of the controls of J through u(0) =
    ``initial_state(u0)`` alone, given ``lam0`` = dJ/du(0)."""
    zero = jax.tree.map(jnp.zeros_like, model.control(model.control.interval[0]))

    def start(d):
        shifted = eqx.tree_at(lambda m: m.control, model, ShiftedControl(model.control, d))
        return shifted.initial_state(u0)

    _, vjp = jax.vjp(start, zero)
    return vjp(lam0)[0]


class GradientDensity(NamedTuple):
    r"""$dJ/d\theta(t)$ on the step grid.

    ``ts``: step midpoints; ``per_step``: $g_n$, the gradient w.r.t. a constant shift of
    the controls during step n (a ``LayerParams`` with a leading step axis);
    ``density``: $|g_n| / \delta t_n$; ``per_layer``: $\sum_{n \in \text{layer}} g_n$,
    for piecewise-constant controls the gradient w.r.t. each layer's parameters;
    ``per_layer_norms``: their norms.
    """

    ts: Float[Array, " steps"]
    per_step: object
    density: Float[Array, " steps"]
    per_layer: object
    per_layer_norms: Float[Array, " layers"]


def gradient_density(
    transformer: ContinuousTransformer, u0, loss: Callable, *, key_mask=None
) -> GradientDensity:
    r"""The per-time gradient density $dJ/d\theta(t)$: per step, the gradient of J
    w.r.t. the controls used in that step, divided by the step; summed over each layer.

    For piecewise-constant controls ``per_layer`` is exactly $dJ/d\theta_k$; for smooth
    controls the density is a function of t that refines as the step shrinks.
    """
    steps = StepMap(transformer, key_mask, u0.dtype)
    model = steps.transformer
    ts, ys = trajectory(model, u0, key_mask)
    lams, extra = _backward(steps, ys, loss, False, True)
    g = extra["theta"]
    if model.formulation == "relaxed":
        # u(0) is u0 projected onto S1(theta(t0)) outside the steps (a projected step
        # projects its own start, so its gradient has this term already): the controls
        # of the first step move it too.
        g = jax.tree.map(lambda x, y: x.at[0].add(y), g, _initial_gradient(model, u0, lams[0]))
    dt = ts[1:] - ts[:-1]
    squares = sum(jnp.sum(x.reshape(x.shape[0], -1) ** 2, axis=1) for x in jax.tree.leaves(g))
    m = model.steps_per_layer
    layers = jax.tree.map(lambda x: x.reshape(model.num_layers, m, *x.shape[1:]).sum(1), g)
    layer_sq = sum(jnp.sum(x.reshape(x.shape[0], -1) ** 2, axis=1) for x in jax.tree.leaves(layers))
    return GradientDensity(
        0.5 * (ts[1:] + ts[:-1]), g, jnp.sqrt(squares) / dt, layers, jnp.sqrt(layer_sq)
    )
