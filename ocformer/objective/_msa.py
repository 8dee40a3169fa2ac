r"""Training by the maximum principle: the extended method of successive approximations.

The discretised training problem is a discrete optimal-control problem. With the
controls of layer n, $\theta_n$ (piecewise constant in t), and $\Phi$ the layer map (the
scheme's steps across one layer),

$$u_{n+1} = \Phi(u_n, \theta_n), \quad n = 0, \dots, L-1, \qquad
  J(\theta) = \ell(u_L) + \sum_{n} L(\theta_n, u_n).$$

Pontryagin's maximum principle for it reads, with the Hamiltonian
$H(u, p, \theta) = p \cdot \Phi(u, \theta) - L(\theta, u)$,

$$u_{n+1} = \nabla_p H(u_n, p_{n+1}, \theta_n), \qquad
  p_n = \nabla_u H(u_n, p_{n+1}, \theta_n), \quad p_L = -\nabla \ell(u_L), \qquad
  \theta_n^* \in \arg\max_\theta H(u_n^*, p_{n+1}^*, \theta).$$

The costate is the negative discrete adjoint, $p_n = -\partial J / \partial u_n$: the
reverse sweep of backpropagation through the same steps, so the method is exact for the
discretised problem. Maximising $H$ means minimising $J$:
$\nabla_{\theta_n} H(u_n, p_{n+1}, \theta_n) = -\partial J / \partial \theta_n$.

The extended MSA (E-MSA; Li, Chen, Tai and E, "Maximum principle based algorithms for
deep learning", JMLR 18, 2018) maximises, for every layer independently, the augmented
Hamiltonian

$$\tilde H_n(\theta) = H(u_n, p_{n+1}, \theta)
  - \tfrac{\rho}{2}\,\overline{|u_{n+1} - \Phi(u_n, \theta)|^2}
  - \tfrac{\rho}{2}\,\overline{|\hat p_n - \nabla_u \hat H(u_n, \hat p_{n+1}, \theta)|^2},$$

whose penalties keep the new control where the forward and backward equations still
hold. The bars are means over the batch's $B$ samples and $\hat p = B p$ is the
per-sample costate ($J$ is a batch mean, so $p$ carries a factor $1/B$), as in the
paper, where the Hamiltonian is the sample mean of per-sample ones. With $\rho = 0$ it
is the basic MSA.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import optax
from jaxtyping import Array, Float

from ..controls import PiecewiseConstant
from ..integration import StoredResiduals, solve
from ..models import Choices, ContinuousTransformer, IncompatibleError, Refusal, SequenceModel
from ..splitting import with_bounded_stages
from ._constraints import Constraints
from ._objective import Objective, cross_entropy
from ._running import control_size
from ._ternary import check_ternary, feedforward_kernels, with_feedforward_kernels

TRAINING_METHODS: tuple[str, ...] = ("gradient", "msa")
"""How a run updates its controls (``train.method``): a gradient step of the optimiser
on dJ/dtheta, or an iteration of the method of successive approximations (``MSA``)."""


class MSA(eqx.Module):
    r"""The E-MSA training method: one ``iteration`` per batch instead of a gradient
    step (see the module docstring for the equations).

    One iteration:

    1. the state forward, $u_{n+1} = \Phi(u_n, \theta_n^k)$;
    2. the costate backward, $p_n = \nabla_u H(u_n, p_{n+1}, \theta_n^k)$ from
       $p_L = -\nabla\ell(u_L)$ (reverse mode through the layer maps);
    3. for every layer at once (``jax.vmap`` over n), ``inner_steps`` steps of the
       optax transformation ``inner`` on $-\tilde H_n$, started at $\theta_n^k$ with a
       fresh optimiser state, each followed by the projection onto the constraints.

    The first inner step does not feel the penalties (their gradients vanish at
    $\theta_n^k$); later ones do. With $\rho = 0$ and one step of ``optax.sgd(eta)``
    an iteration is exactly a gradient-descent step of size eta on $J$.

    The parameters outside the layer controls (embedding, readout, final norm) are
    not controls of the dynamics: they take one step of ``inner`` (fresh state) on
    $\partial J / \partial \phi$, which the same backward sweep gives.

    The penalty weight is adapted from the measured decrease of J on the iteration's
    own batch (one more forward solve): with $J^k$ before and $J^{k+1}$ after,

    $$\rho_{k+1} = \gamma\,\rho_k \ \text{ if } J^{k+1} > J^k, \qquad
      \rho_{k+1} = \max(\rho_0, \rho_k / \gamma) \ \text{ otherwise},$$

    with $\gamma$ = ``rho_growth`` ($\gamma = 1$: $\rho$ fixed) and $\rho_0$ = ``rho``,
    the floor. The update is kept either way.

    With ternary feed-forward kernels (``Objective.ternary``) the iteration is the
    discrete MSA (Li and Hao, ICML 2018) for them: before the inner steps, every
    kernel of every layer is set to the exact maximiser over the ternary set $T$ of
    the accumulated linearised Hamiltonians,

    $$M^{k+1} = \alpha\,M^k + \eta\,\nabla_W H(u_n, p_{n+1}, \theta_n^k), \qquad
      W^{k+1} = Q_\lambda(M^{k+1}) = \arg\max_{W \in T}\ \langle M^{k+1}, W\rangle
      - \tfrac12 |W|^2 - \lambda |W|_0,$$

    entry-wise $W_i = a\,\mathrm{sign}(M_i)$ where $|M_i| > a/2 + \lambda/a$, else 0,
    with the scale $a$ of each layer and map in closed form
    (``ocformer.objective.ternary_projection``); $M^0$ is the initial real kernel,
    $\eta$ = ``ternary_step``, $\alpha$ = ``ternary_memory``. The inner steps then
    maximise $\tilde H_n$ over the layer's other controls with the new kernels held.

    Args:
        inner: the optax transformation that maximises $\tilde H_n$ (it minimises
            $-\tilde H_n$), e.g. ``optax.sgd(0.1)`` or ``optax.adam(1e-2)``.
        inner_steps: the fixed budget of inner steps per iteration (>= 1).
        rho: the initial and smallest penalty weight $\rho_0 \ge 0$.
        rho_growth: $\gamma \ge 1$.
        ternary_step: $\eta > 0$, the weight of each new Hamiltonian gradient in $M$.
        ternary_memory: $\alpha \in (0, 1]$, the weight of the past in $M$.
    """

    inner: optax.GradientTransformation = eqx.field(static=True)
    inner_steps: int = eqx.field(default=1, static=True)
    rho: float = eqx.field(default=1.0, static=True)
    rho_growth: float = eqx.field(default=2.0, static=True)
    ternary_step: float = eqx.field(default=1.0, static=True)
    ternary_memory: float = eqx.field(default=1.0, static=True)

    def __check_init__(self):
        if not isinstance(self.inner, optax.GradientTransformation):
            raise ValueError(
                "MSA.inner must be an optax.GradientTransformation (e.g. optax.sgd(0.1)), "
                f"got {type(self.inner).__name__}."
            )
        steps = self.inner_steps
        if not (isinstance(steps, int) and not isinstance(steps, bool) and steps >= 1):
            raise ValueError(
                f"MSA.inner_steps is the budget of inner optimiser steps per iteration and "
                f"must be an integer >= 1, got {steps!r}."
            )
        if not (isinstance(self.rho, int | float) and self.rho >= 0):
            raise ValueError(
                f"MSA.rho is the penalty weight of the augmented Hamiltonian and must be a "
                f"number >= 0 (0: the basic MSA), got {self.rho!r}."
            )
        if not (isinstance(self.rho_growth, int | float) and self.rho_growth >= 1):
            raise ValueError(
                f"MSA.rho_growth must be a number >= 1 (1: rho fixed), got {self.rho_growth!r}."
            )
        if not (isinstance(self.ternary_step, int | float) and self.ternary_step > 0):
            raise ValueError(f"MSA.ternary_step must be a number > 0, got {self.ternary_step!r}.")
        memory = self.ternary_memory
        if not (isinstance(memory, int | float) and 0 < memory <= 1):
            raise ValueError(f"MSA.ternary_memory must be in (0, 1], got {memory!r}.")

    def init(
        self, model: SequenceModel | None = None, objective: Objective | None = None
    ) -> "MSAState":
        """The state of the first iteration: $\rho = \rho_0$, and, when ``objective``
        restricts the feed-forward kernels of ``model`` to the ternary set, the real
        $M^0$: the model's initial kernels."""
        latent = None
        if objective is not None and objective.ternary is not None:
            if model is None:
                raise ValueError(
                    "MSA.init needs the model when the objective's feed-forward kernels are "
                    "ternary: M starts from its real kernels (MSA.init(model, objective))."
                )
            latent = feedforward_kernels(model)
        return MSAState(rho=jnp.asarray(self.rho, jnp.float32), latent=latent)

    def adapt(self, rho, before, after):
        r"""$\rho_{k+1}$ from $\rho_k$ and J before and after the iteration (the rule of
        the class docstring)."""
        rho = jnp.asarray(rho)
        grown = rho * self.rho_growth
        shrunk = jnp.maximum(jnp.asarray(self.rho, rho.dtype), rho / self.rho_growth)
        return jnp.where(after > before, grown, shrunk).astype(rho.dtype)


class MSAState(NamedTuple):
    """What an MSA run carries from one iteration to the next (checkpointed): $\rho$,
    and with ternary feed-forward kernels the real $M$ they are the projection of
    (``feedforward_kernels``' layout; None otherwise)."""

    rho: Float[Array, ""]
    latent: Any = None


class Sweep(NamedTuple):
    r"""The forward and backward sweeps at the current controls.

    ``loss``: $J$; ``states``: $u_0, \dots, u_L$; ``costates``: $p_0, \dots, p_L$
    ($p_n = -\partial J / \partial u_n$); ``grads``: $(\partial J/\partial\phi,
    \partial J/\partial\theta)$; ``aux``: what ``terminal`` returned besides its cost.
    """

    loss: Array
    states: Array
    costates: Array
    grads: Any
    aux: Any


def sweep(
    layer: Callable[[Array, Any], Array],
    running: Callable[[Any, Array], Array],
    initial: Callable[[Any], Array],
    terminal: Callable[[Array, Any], tuple[Array, dict]],
    params,
    thetas,
) -> Sweep:
    r"""States and costates of the discrete control problem

    $$u_0 = \mathrm{initial}(\phi), \quad u_{n+1} = \Phi(u_n, \theta_n), \quad
      J = \mathrm{terminal}(u_L, \phi) + \sum_n L(\theta_n, u_n)$$

    in one forward and one reverse-mode pass: the forward solve adds a perturbation
    $\delta_n$ (zero) to every $u_n$, and $\partial J / \partial \delta_n$ is
    $\partial J / \partial u_n = -p_n$, the discrete costate of the scheme.

    Args:
        layer: $\Phi(u, \theta)$.
        running: $L(\theta, u)$.
        initial: $u_0$ from the parameters $\phi$ outside the layer controls.
        terminal: ``(cost, aux)`` of $u_L$ and $\phi$.
        params: $\phi$ (a pytree of arrays; may be empty).
        thetas: the layer controls, every leaf with a leading axis of L layers.
    """
    u0 = initial(params)

    def cost(phi, th, deltas):
        u = initial(phi) + deltas[0]

        def body(u, xs):
            theta, delta = xs
            return layer(u, theta) + delta, (u, running(theta, u))

        u_last, (us, costs) = jax.lax.scan(body, u, (th, deltas[1:]))
        end, aux = terminal(u_last, phi)
        aux = dict(aux, states=jnp.concatenate([us, u_last[None]]), running=jnp.sum(costs))
        return end + jnp.sum(costs), aux

    num_layers = jtu.tree_leaves(thetas)[0].shape[0]
    deltas = jnp.zeros((num_layers + 1, *u0.shape), u0.dtype)
    (loss, aux), (g_phi, g_theta, lams) = jax.value_and_grad(cost, argnums=(0, 1, 2), has_aux=True)(
        params, thetas, deltas
    )
    states = aux.pop("states")
    return Sweep(loss, states, -lams, (g_phi, g_theta), aux)


def augmented_hamiltonian(
    layer: Callable[[Array, Any], Array],
    running: Callable[[Any, Array], Array],
    theta,
    u,
    u_next,
    p,
    p_next,
    rho,
) -> tuple[Array, Array]:
    r"""$(\tilde H_n(\theta), H(u_n, p_{n+1}, \theta))$ of one layer.

    ``u``, ``u_next``, ``p``, ``p_next`` are $u_n, u_{n+1}, p_n, p_{n+1}$ of the sweep,
    with a leading batch axis of B samples; ``layer(u, theta)`` is $\Phi$ and
    ``running(theta, u)`` is $L$ (of the whole batch).
    """
    batch = u.shape[0]
    x_next, pullback = jax.vjp(lambda v: layer(v, theta), u)
    run, run_du = jax.value_and_grad(lambda v: running(theta, v))(u)
    h = _dot(p_next, x_next) - run
    (dh_du,) = pullback(p_next)
    dh_du = dh_du - run_du
    state_gap = jnp.sum(jnp.square(u_next - x_next)) / batch
    costate_gap = batch * jnp.sum(jnp.square(p - dh_du))  # |B p - B dH/du|^2 / B
    return h - 0.5 * rho * (state_gap + costate_gap), h


def maximise_hamiltonians(
    method: MSA,
    layer: Callable[[Array, Any], Array],
    running: Callable[[Any, Array], Array],
    project: Callable[[Any], Any],
    thetas,
    states,
    costates,
    rho,
    held=None,
):
    r"""$\theta_n^{k+1}$ for every layer at once: ``method.inner_steps`` projected steps
    of ``method.inner`` on $-\tilde H_n$ from $\theta_n^k$ (``thetas``, leading layer
    axis), vmapped over the layers. ``states`` and ``costates`` hold $u_0..u_L$,
    $p_0..p_L$. ``held``: a pytree of bools over ``thetas`` (a prefix of it), True on
    the controls the steps leave as they are (None: none).

    Returns:
        ``(thetas, hamiltonians)``: the new controls, and $H(u_n, p_{n+1}, \theta)$ of
        every layer at the old and at the new controls (shape ``(2, L)``).
    """

    def one(theta, u, u_next, p, p_next):
        fixed = None
        if held is not None:
            fixed, theta = eqx.partition(theta, held)

        def negative(th):
            full = th if fixed is None else eqx.combine(th, fixed)
            value, h = augmented_hamiltonian(layer, running, full, u, u_next, p, p_next, rho)
            return -value, h

        def projected(th):
            if fixed is None:
                return project(th)
            return eqx.partition(project(eqx.combine(th, fixed)), held)[1]

        def step(carry, _):
            th, state = carry
            (_, h), g = jax.value_and_grad(negative, has_aux=True)(th)
            updates, state = method.inner.update(g, state, th)
            return (projected(optax.apply_updates(th, updates)), state), h

        (new, _), hs = jax.lax.scan(
            step, (theta, method.inner.init(theta)), None, length=method.inner_steps
        )
        _, h_new = negative(new)
        new = new if fixed is None else eqx.combine(new, fixed)
        return new, jnp.stack([hs[0], h_new])

    new, hs = jax.vmap(one)(thetas, states[:-1], states[1:], costates[:-1], costates[1:])
    return new, hs.T


def _dot(a, b) -> Array:
    return jnp.sum(a * b)


# ---------------------------------------------------------------------------------------
# The rules: which problems the layer-wise maximisation applies to.


def msa_refusals(
    choices: Choices, *, control_smoothness: float = 0.0, kinetic_energy: float = 0.0
) -> list[Refusal]:
    """Every reason ``train.method=msa`` cannot train the model of ``choices`` with an
    objective of these running-cost weights (empty: it can). Config validation and
    ``check_msa`` both read this one table."""
    found = []
    if choices.controls != "piecewise_constant":
        found.append(
            Refusal(
                "controls.kind",
                f"train.method=msa maximises one Hamiltonian per layer, over that layer's "
                f"own controls; controls.kind={choices.controls!r} shares its parameters "
                "across layers, so the maximisations are not independent. Use "
                "controls.kind=piecewise_constant, or train.method=gradient",
            )
        )
    if choices.stepsize != "constant":
        found.append(
            Refusal(
                "discretisation.stepsize",
                f"train.method=msa needs the layer map Phi of a fixed grid; with "
                f"stepsize={choices.stepsize!r} the steps depend on the state and the "
                "layer map changes with every control. Use discretisation.stepsize="
                "constant, or train.method=gradient",
            )
        )
    if choices.depth_parallel is not None:
        found.append(
            Refusal(
                "discretisation.depth_parallel",
                f"train.method=msa sweeps the layer maps serially, forward and back, while "
                f"depth_parallel={choices.depth_parallel!r} solves for another function of "
                "the input (the depth-parallel approximation): the sweep and the objective "
                "it is judged by would differ. Drop discretisation.depth_parallel, or use "
                "train.method=gradient",
            )
        )
    if choices.stepper_kind in ("implicit", "imex"):
        found.append(
            Refusal(
                "discretisation.stepper",
                f"train.method=msa penalises the gradient of each layer's Hamiltonian, so "
                f"it differentiates the layer map twice; {choices.stepper!r} solves its "
                "stage equations by Newton's method, whose implicit derivative is taken "
                "once only. Use an explicit stepper (a splitting scheme, or euler, heun, "
                "tsit5, ...), or train.method=gradient",
            )
        )
    if choices.gradient == "optimise_then_discretise":
        found.append(
            Refusal(
                "discretisation.gradient",
                "train.method=msa solves for the discrete costate of the scheme (reverse "
                "mode through the layer maps), so that it is exact for the discretised "
                "problem; optimise_then_discretise is the continuous adjoint. Use "
                "discretisation.gradient=discretise_then_optimise (or direct, stored, "
                "stored_dots, stored_projections: all give the discrete costate)",
            )
        )
    if control_smoothness > 0:
        found.append(
            Refusal(
                "objective.control_smoothness",
                "train.method=msa needs a running cost L(theta_n, u_n) of each layer "
                "alone; the control-smoothness cost sums |theta_{n+1} - theta_n|^2 and "
                "couples neighbouring layers. Set objective.control_smoothness=0 "
                "(objective.control_size is per layer), or train.method=gradient",
            )
        )
    if choices.formulation != "split":
        found.append(
            Refusal(
                "model.formulation",
                f"train.method=msa needs an initial state u_0 that does not depend on the "
                f"layer controls; formulation={choices.formulation!r} starts from the "
                "projection of the embedding onto S1(theta_0). Use model.formulation="
                "split, or train.method=gradient",
            )
        )
    if kinetic_energy > 0:
        found.append(
            Refusal(
                "objective.kinetic_energy",
                "train.method=msa takes its running cost per layer from the controls "
                "and the layer's first state; the kinetic energy needs every state "
                "inside the layer, which the layer map does not return. Set "
                "objective.kinetic_energy=0, or train.method=gradient",
            )
        )
    return found


def check_msa(model: SequenceModel, objective: Objective) -> None:
    """Raise ``IncompatibleError`` for the first reason MSA cannot train ``model`` on
    ``objective`` (the rules of ``msa_refusals``)."""
    found = msa_refusals(
        model.transformer.choices(),
        control_smoothness=objective.control_smoothness,
        kinetic_energy=objective.kinetic_energy,
    )
    if found:
        raise IncompatibleError(found[0])


# ---------------------------------------------------------------------------------------
# The transformer as a discrete control problem.


def _layer_map(transformer: ContinuousTransformer, key_mask):
    r"""$\Phi(u, \theta)$: the model's own time stepper across one layer of length
    $\Delta$ with the constant controls $\theta$, through the one ``diffeqsolve``.

    The layers differ only in their controls (time enters the equation only through
    $\theta(t)$), so one map serves them all and can be vmapped. The steps are scanned
    (``StoredResiduals``), which differentiates to any order in reverse mode: the
    penalty on $\nabla_u H$ needs the gradient of a gradient. Every exact gradient
    method gives the same numbers.
    """
    t0, t1 = transformer.control.interval
    length = (t1 - t0) / transformer.num_layers
    discretisation = transformer.discretisation.replace(gradient=StoredResiduals())

    stepper = with_bounded_stages(transformer.time_stepper())  # differentiable twice

    def layer(u, theta):
        values = jtu.tree_map(lambda x: x[None], theta)
        control = PiecewiseConstant(values, 0.0, length)
        one = eqx.tree_at(lambda m: m.control, transformer, control)
        one = eqx.tree_at(lambda m: m.discretisation, one, discretisation)
        sol = solve(one.terms(), stepper, control, u, discretisation, key_mask=key_mask)
        assert sol.ys is not None
        return sol.ys[-1]

    return layer, length


def _with_controls(model: SequenceModel, values) -> SequenceModel:
    return eqx.tree_at(
        lambda m: m.transformer.control.values, model, values, is_leaf=lambda x: x is None
    )


def msa_iteration(
    method: MSA,
    objective: Objective,
    constraints: Constraints,
    model: SequenceModel,
    state: MSAState,
    batch: dict,
) -> tuple[SequenceModel, MSAState, dict]:
    r"""One E-MSA iteration of ``model`` on ``batch`` (see ``MSA``).

    $\Phi$ is the model's own time stepper across one layer (its discretisation,
    ``steps_per_layer`` steps), $\ell$ the task's cross-entropy after the final norm
    and the readout, $L(\theta_n) = \beta\,\Delta\,|\theta_n|^2$ the control-size cost
    of ``objective`` on layer n (exactly its share of ``control_size``).

    Returns:
        The new model (projected onto the constraints), the new state, and the metrics
        ``loss`` ($J$ before the iteration), ``task_loss``, ``accuracy``
        (``control_size`` when weighted), ``loss_after`` ($J$ after it, on the same
        batch), ``grad_norm`` ($|\partial J/\partial(\theta, \phi)|$ of the backward
        sweep), ``rho`` (the weight this iteration used), ``hamiltonian`` and
        ``hamiltonian_after`` ($\sum_n H(u_n, p_{n+1}, \cdot)$ at the old and the new
        controls) and, with ternary kernels, ``ternary_density`` (their fraction of
        nonzero entries).

    Raises:
        IncompatibleError: a combination ``msa_refusals`` refuses.
    """
    check_msa(model, objective)
    ternary = objective.ternary
    if ternary is not None:
        check_ternary(model)
        if state.latent is None:
            raise ValueError(
                "the objective's feed-forward kernels are ternary, but the MSA state holds "
                "no real kernels M: start it with MSA.init(model, objective)."
            )
        # W^k = Q(M^k), whatever kernels the model holds (the real initial ones at k = 0).
        model = with_feedforward_kernels(model, ternary.project(state.latent))
    transformer = model.transformer
    control = transformer.control
    assert isinstance(control, PiecewiseConstant)  # check_msa
    inputs, targets = batch["inputs"], jnp.asarray(batch["targets"])
    layer, length = _layer_map(transformer, batch.get("key_mask"))
    beta, m = objective.control_size, transformer.steps_per_layer

    def running(theta, u):
        if beta == 0:
            return jnp.zeros((), u.dtype)
        values = jtu.tree_map(lambda x: x[None], theta)
        return beta * control_size(PiecewiseConstant(values, 0.0, length), m).astype(u.dtype)

    params, static = eqx.partition(_with_controls(model, None), eqx.is_inexact_array)

    def net(phi):
        return eqx.combine(phi, static)

    def initial(phi):
        # The split formulation starts from the embedding itself (msa_refusals).
        return net(phi).initial_state(inputs)

    def terminal(u, phi):
        n = net(phi)  # the final norm and the readout are parameters phi
        logits = n.readout(n.transformer.final_projection(u))
        task_loss, accuracy = cross_entropy(logits, targets)
        return task_loss, {"task_loss": task_loss, "accuracy": accuracy}

    swept = sweep(layer, running, initial, terminal, params, control.values)
    grad_phi, grad_theta = swept.grads
    rho = state.rho.astype(swept.states.dtype)
    start, held, latent = control.values, None, None
    if ternary is not None:
        # The discrete MSA step on the kernels (see MSA): dH/dW = -dJ/dW.
        grad_w = grad_theta.feedforward.weights
        latent = tuple(
            method.ternary_memory * m - method.ternary_step * g
            for m, g in zip(state.latent, grad_w, strict=True)
        )
        start = eqx.tree_at(lambda v: v.feedforward.weights, start, ternary.project(latent))
        held = jtu.tree_map(lambda _: False, start)
        held = eqx.tree_at(lambda v: v.feedforward.weights, held, tuple(True for _ in grad_w))
    new_thetas, hs = maximise_hamiltonians(
        method,
        layer,
        running,
        constraints.project_layer,
        start,
        swept.states,
        swept.costates,
        rho,
        held,
    )
    if ternary is not None:  # H at the old controls (the inner steps began at new kernels)

        def old_h(theta, u, u_next, p, p_next):
            return augmented_hamiltonian(layer, running, theta, u, u_next, p, p_next, rho)[1]

        states, costates = swept.states, swept.costates
        h_old = jax.vmap(old_h)(
            control.values, states[:-1], states[1:], costates[:-1], costates[1:]
        )
        hs = jnp.stack([h_old, hs[1]])
    updates, _ = method.inner.update(grad_phi, method.inner.init(params), params)
    new_model = _with_controls(net(optax.apply_updates(params, updates)), new_thetas)
    new_model = constraints.project(new_model)
    after, _ = objective(new_model, batch)
    metrics = {k: v for k, v in swept.aux.items() if k != "running"}
    if beta > 0:
        metrics["control_size"] = swept.aux["running"] / beta
    metrics.update(loss=swept.loss, loss_after=after, rho=state.rho)
    metrics["grad_norm"] = optax.tree.norm(swept.grads)
    metrics["hamiltonian"], metrics["hamiltonian_after"] = jnp.sum(hs[0]), jnp.sum(hs[1])
    if latent is not None:
        kernels = new_thetas.feedforward.weights
        nonzero = sum(jnp.sum(k != 0) for k in kernels)
        metrics["ternary_density"] = nonzero / sum(k.size for k in kernels)
    new_state = MSAState(rho=method.adapt(state.rho, swept.loss, after), latent=latent)
    return new_model, new_state, metrics
