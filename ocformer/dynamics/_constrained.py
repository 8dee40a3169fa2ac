r"""Smooth limits of post-LN dynamics: projected dynamics on $S_1$ and the
Moreau-Yosida relaxation.

Post-LN has no smooth continuous limit as written: the state is projected onto
$S_1(\sigma_1, \sigma_2)$ twice per layer. Two honest limits are offered; both use one
constraint set, $S_1$ of the ``norm2`` controls (the set a post-LN layer's output lies
on), since two different sets generally do not intersect.

Projected dynamics. For $u \in S_1(\sigma_1(t), \sigma_2(t))$ write
$u = \sigma_1 + \sigma_2 n$ with $\bar n = 0$, $\overline{n^2} = 1$ (bars: means over
the features of one token). Differentiating the constraints
$\bar u = \sigma_1$, $\overline{(u - \sigma_1)^2} = \sigma_2^2$ in $t$ gives
$\bar{u_t} = \dot\sigma_1$ and $\overline{u_t n} = \dot\sigma_2$; the velocity of least
norm change that satisfies them is

$$u_t = \Pi_{T_u S_1}\big(\mathcal{A}(u) + \Phi(u)\big) + \dot\sigma_1
        + \frac{\dot\sigma_2}{\sigma_2}(u - \sigma_1),\qquad
  \Pi_{T_u S_1} v = v - \bar v - \overline{v n}\, n,$$

where $\Phi$ is the feed-forward map with its hidden ReLU an inner nonlinearity (not a
state constraint). The last two terms move the state with the set: their exact flow
keeps $n$ fixed, $u \mapsto \sigma_1(t') + \sigma_2(t') n$, which for the paper's
scalar $\sigma$ is the projection $P_{S_1(t')}$ of $u \in S_1(t)$.

The Moreau-Yosida relaxation replaces $\partial I_{S_1}(u)$ by the gradient of the
Moreau envelope, $(u - P_{S_1}(u))/\epsilon$, with the sign that pulls $u$ toward
$S_1$:

$$u_t = \mathcal{A}(u) + \Phi(u) - \frac{u - P_{S_1(t)}(u)}{\epsilon}.$$

It is stiff (rate $1/\epsilon$ normal to $S_1$) and converges to the projected dynamics
as $\epsilon \to 0$, with error $O(\epsilon)$.

Both require scalar ``norm2`` controls (the paper's $S_1(\sigma_1, \sigma_2)$): a
per-feature gain and bias is an affine sub-step after the projection onto $S_1(0, 1)$,
not a constraint set, so there is nothing to project the velocity onto.
"""

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from ..controls._params import NormParams
from ..operators import LayerNormProjection, normalise
from ._args import DynamicsArgs
from ._terms import AbstractExplicitTerm, sum_fields


def tangent_projection(
    u: Float[Array, "*batch N d"], v: Float[Array, "*batch N d"]
) -> Float[Array, "*batch N d"]:
    r"""$\Pi_{T_u S_1} v = v - \bar v - \overline{v n}\,n$ with $n$ the normalised $u$.

    The orthogonal projection (per token, in the feature inner product) onto the
    tangent space of $S_1(\sigma_1, \sigma_2)$ at $u$; independent of $\sigma$.
    Computed in the promoted dtype of ``u`` and ``v``: a field in the compute dtype
    (bfloat16) at a float32 state is projected, means included, in float32.
    """
    v = v.astype(np.promote_types(u.dtype, v.dtype))  # numpy's: also under strict promotion
    n = normalise(u, check=False)
    vc = v - jnp.mean(v, axis=-1, keepdims=True)
    return vc - jnp.mean(vc * n, axis=-1, keepdims=True) * n


def constraint_residual(p: NormParams, u: Float[Array, "*batch N d"]) -> Float[Array, ""]:
    r"""$\max_x \max(|\bar u - \sigma_1|, |\overline{(u - \bar u)^2} - \sigma_2^2|)$:
    how far ``u`` is from $S_1(\sigma_1, \sigma_2)$ (zero on the set)."""
    mean = jnp.mean(u, axis=-1)
    var = jnp.mean(jnp.square(u - mean[..., None]), axis=-1)
    return jnp.maximum(jnp.max(jnp.abs(mean - p.bias)), jnp.max(jnp.abs(var - jnp.square(p.scale))))


_EXACT = LayerNormProjection(eps=0.0)


def project_onto_set(p: NormParams, u: Float[Array, "*batch N d"]) -> Float[Array, "*batch N d"]:
    """The exact projection $P_{S_1}$ (eps = 0: the set itself, not a LayerNorm's
    regularised image of it)."""
    return _EXACT(p, u)


class TangentTerm(AbstractExplicitTerm):
    r"""$u_t = \Pi_{T_u S_1}\, f(u; \theta)$ for the field $f$ of an explicit term.

    A split term of the projected dynamics; its sub-flow is one step of its explicit
    sub-solver (the state leaves $S_1$ by the local error, and the projection after
    the step puts it back).
    """

    term: AbstractExplicitTerm

    def field(self, theta, u, args):
        return tangent_projection(u, self.term.field(theta, u, args))


class SumField(eqx.Module):
    r"""$f(t, u) = \sum_k f_k(u; \theta(t))$: the smooth right-hand side as one vector
    field, for ``diffrax.ODETerm`` (any diffrax solver, and ``BacksolveAdjoint``)."""

    terms: tuple[AbstractExplicitTerm, ...]

    def __call__(self, t, y, args: DynamicsArgs):
        return sum_fields(self.terms, args.control(t), y, args)


class ProjectedField(eqx.Module):
    r"""$f(t, u) = \Pi_{T_u S_1}\sum_k f_k(u; \theta(t)) + \dot\sigma_1
    + (\dot\sigma_2/\sigma_2)(u - \sigma_1)$, with $\sigma$ the ``norm2`` controls."""

    terms: tuple[AbstractExplicitTerm, ...]

    def __call__(self, t, y, args: DynamicsArgs):
        theta = args.control(t)
        rate = args.control.derivative(t).norm2
        s1, s2 = theta.norm2.bias, theta.norm2.scale
        drift = rate.bias + (rate.scale / s2) * (y - s1)
        return tangent_projection(y, sum_fields(self.terms, theta, y, args)) + drift


class RelaxationField(eqx.Module):
    r"""$f(t, u) = (P_{S_1(\theta(t))}(u) - u)/\epsilon$: the Moreau-Yosida pull toward
    $S_1$ of the ``norm2`` controls (the stiff part)."""

    # An array leaf, not a static field: a sweep over epsilon reuses one compilation.
    # (The models check eps > 0 before building this.)
    eps: Float[Array, ""]

    def __call__(self, t, y, args: DynamicsArgs):
        p = args.control(t).norm2
        return (project_onto_set(p, y) - y) * (1.0 / self.eps)


class RelaxedField(eqx.Module):
    """The smooth field plus the relaxation, as one vector field (for explicit and
    fully implicit solvers; IMEX solvers take the two parts as separate terms)."""

    smooth: SumField
    relaxation: RelaxationField

    def __call__(self, t, y, args):
        return self.smooth(t, y, args) + self.relaxation(t, y, args)
