"""Terms of the split vector field, one per operator.

Every term is a ``diffrax.AbstractTerm`` (so the smooth ones work with any diffrax
solver) and also knows its own sub-flow over a step with frozen controls, which is what
the splitting solvers compose. The sub-flow of an explicit term is one step of an
explicit sub-solver chosen by the time stepper (explicit Euler, midpoint or Heun: a
numerical choice, so it belongs to the splitting scheme, not to the term); the sub-flow
of an indicator term $\\partial I_S$ is the projection onto S, its resolvent for every
step size.
"""

import abc
from typing import Literal, get_args

import diffrax
import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from ..controls._params import LayerParams
from ..operators import Attention, FeedForward, LayerNormProjection
from ._args import DynamicsArgs

SubSolver = Literal["euler", "midpoint", "heun"]
SUB_SOLVERS: tuple[str, ...] = get_args(SubSolver)
SUB_SOLVER_ORDER: dict[str, int] = {"euler": 1, "midpoint": 2, "heun": 2}
NormSlot = Literal["norm1", "norm2"]


class AbstractSplitTerm(diffrax.AbstractTerm):
    """One operator of the split equation: a vector field and a sub-flow."""

    @abc.abstractmethod
    def flow(
        self, theta: LayerParams, dt, u, args: DynamicsArgs, sub_solver: SubSolver
    ) -> Float[Array, "*batch N d"]:
        """Advance ``u`` over a step of size ``dt`` with the controls frozen at theta,
        by ``sub_solver`` if the term has a pointwise field."""

    @abc.abstractmethod
    def flow_order(self, sub_solver: SubSolver) -> int | None:
        """The order of the sub-flow; None for a projection, which is exact but is the
        same map for every step size (the resolvent of an indicator), not the flow of a
        vector field over the step."""

    # Terms are ODE-like: the control of the equation is time itself.
    def contr(self, t0, t1, **kwargs):
        del kwargs
        return t1 - t0

    def prod(self, vf, control):
        return control * vf


def widened(f: Float[Array, "*batch N d"], u: Float[Array, "*batch N d"]):
    """The field ``f``, computed in the compute dtype, exactly widened to the dtype of
    the update ``u + dt * f``: the state's when that is wider (a float32 state under a
    bfloat16 compute dtype), so the update is a sum in the state's dtype."""
    return f.astype(np.promote_types(u.dtype, f.dtype))  # numpy's: also under strict


def _no_vector_field(t, y, msg: str):
    # diffrax evaluates every term's vf under eval_shape to check its output type, so
    # vf must trace; the error fires only if a solver really evaluates it. (The models
    # refuse such pairings before solving; this guards hand-built terms.)
    return eqx.error_if(jnp.zeros_like(y), jnp.asarray(t) == jnp.asarray(t), msg)


class AbstractExplicitTerm(AbstractSplitTerm):
    r"""A term with a smooth vector field $f(u; \theta)$, advanced by a one-step
    explicit sub-solver (Euler, explicit midpoint or Heun)."""

    @abc.abstractmethod
    def field(self, theta: LayerParams, u, args: DynamicsArgs) -> Float[Array, "*batch N d"]:
        """The vector field with the controls given, computed in ``args.compute_dtype``
        (from a state ``u`` that may be wider: see ``DynamicsArgs``)."""

    def vf(self, t, y, args: DynamicsArgs):
        return widened(self.field(args.control(t), y, args), y)

    def flow(self, theta, dt, u, args, sub_solver):
        def f_at(v):
            return widened(self.field(theta, v, args), v)

        f = f_at(u)
        if sub_solver == "euler":
            return u + dt * f
        if sub_solver == "midpoint":
            return u + dt * f_at(u + (0.5 * dt) * f)
        # Heun: the trapezoidal predictor-corrector.
        g = f_at(u + dt * f)
        return u + (0.5 * dt) * (f + g)

    def flow_order(self, sub_solver) -> int:
        return SUB_SOLVER_ORDER[sub_solver]


class AttentionTerm(AbstractExplicitTerm):
    r"""$u_t = \mathcal{A}(u; \theta)$, or $\mathcal{A}(P_{S_1}(u); \theta)$ when
    ``pre_norm`` is given (pre-LN: the projection sits inside the vector field and uses
    the ``norm1`` controls)."""

    attention: Attention
    pre_norm: LayerNormProjection | None = None

    def field(self, theta, u, args):
        # The pre-norm reads the state before the cast to the compute dtype (its
        # statistics are float32 either way; so is its input, unrounded).
        if self.pre_norm is not None:
            u = self.pre_norm(theta.norm1, u)
        return self.attention(theta.attention, args.compute(u), args.key_mask)


class FeedForwardTerm(AbstractExplicitTerm):
    r"""$u_t = \Phi(u; \theta)$ (the whole MLP as one smooth term), or
    $\Phi(P_{S_1}(u))$ with ``pre_norm`` (pre-LN, ``norm2`` controls)."""

    feedforward: FeedForward
    pre_norm: LayerNormProjection | None = None

    def field(self, theta, u, args):
        if self.pre_norm is not None:
            u = self.pre_norm(theta.norm2, u)
        return self.feedforward(theta.feedforward, args.compute(u))


class ProjectionTerm(AbstractSplitTerm):
    r"""The indicator term $\partial I_{S_1}(u)$: its sub-flow is the projection
    $P_{S_1}$ (backward Euler on the indicator, for any step size).

    ``eps_scale`` scales the LayerNorm epsilon of this projection: the paper's closing
    projection after the averaging step uses 1/4 to stay exact: var((a + b)/2) = var(a + b)/4.
    The indicator has no pointwise vector field, so ``vf`` refuses; smooth limits are
    the projected dynamics and the Moreau-Yosida relaxation.
    """

    norm: LayerNormProjection
    slot: NormSlot = eqx.field(default="norm1", static=True)
    eps_scale: float = eqx.field(default=1.0, static=True)

    def __check_init__(self):
        if self.slot not in ("norm1", "norm2"):
            raise ValueError(f"ProjectionTerm.slot must be 'norm1' or 'norm2', got {self.slot!r}.")

    def flow(self, theta, dt, u, args, sub_solver):
        del dt, args, sub_solver
        return self.norm(getattr(theta, self.slot), u, self.eps_scale)

    def flow_order(self, sub_solver) -> None:
        return None

    def vf(self, t, y, args):
        return _no_vector_field(
            t,
            y,
            "A projection (indicator) term has no pointwise vector field, so it cannot "
            "be used by a non-splitting diffrax solver. Use a splitting scheme, or a "
            "smooth formulation (projected dynamics or Moreau-Yosida relaxation).",
        )


class AveragedFeedForwardTerm(AbstractSplitTerm):
    r"""The paper's feed-forward sub-problem with its averaging step (steps 3-5).

    $$u^{(J)} = \text{chain of } u \mapsto \sigma(L_j u + \delta t(u W_j + b_j)),\qquad
      u \leftarrow \tfrac12 (u^{(J)} + u).$$
    The average is a parallel (additive) splitting of the feed-forward flow with the
    zero operator; it is the FFN skip connection of a post-LN layer. The hidden
    sub-steps are projections onto $S_2$ (ReLU) or pointwise nonlinear sub-steps.
    """

    feedforward: FeedForward

    def flow(self, theta, dt, u, args, sub_solver):
        del sub_solver  # the paper's own sub-steps, whatever the scheme's sub-solver
        # The chain in the compute dtype, the average (the skip) in the state's.
        chain = self.feedforward.chain(theta.feedforward, args.compute(u), dt)
        return 0.5 * (widened(chain, u) + u)

    def flow_order(self, sub_solver) -> int:
        # Order 0: not a consistent flow. It does not tend to the identity as dt -> 0
        # (the average keeps half of the chain's O(1) jump from the hidden projection
        # or activation), so refining it converges to nothing; it is meant for dt = 1,
        # where it is exactly the post-LN feed-forward block.
        return 0

    def vf(self, t, y, args):
        return _no_vector_field(
            t,
            y,
            "The averaged (post-LN) feed-forward sub-problem is a discrete splitting "
            "step with no pointwise vector field; use a splitting scheme, or the "
            "smooth FeedForwardTerm.",
        )


def sum_fields(terms, theta, u, args) -> Float[Array, "*batch N d"]:
    """The full right-hand side with frozen controls: the sum of explicit fields."""
    total = jnp.zeros_like(u)
    for term in terms:
        if not isinstance(term, AbstractExplicitTerm):
            raise ValueError(
                f"{type(term).__name__} has no pointwise vector field; the sum of fields "
                "exists only for smooth formulations."
            )
        total = total + widened(term.field(theta, u, args), u)
    return total
