r"""Ternary feed-forward controls: every feed-forward kernel $W_j$ of every layer in the
set

$$T = \{a\,s : a \ge 0,\ s \in \{-1, 0, 1\}^{d_\mathrm{in} \times d_\mathrm{out}}\},$$

one scale $a$ per layer and per map (the full map stays $A_j = L_j + W_j$, with the
fixed lifting, identity or restriction $L_j$ of ``FeedForward``). The other controls
(attention, layer norms) and the parameters outside the layers stay real.

The one rule that puts a real matrix $M$ into $T$ is the sparsity-penalised projection

$$Q_\lambda(M) = \arg\max_{W \in T}\ \langle M, W\rangle - \tfrac12 |W|^2
  - \lambda\,|W|_0 = \arg\min_{W \in T}\ \tfrac12 |W - M|^2 + \lambda\,|W|_0 .$$

For a fixed scale $a$ it is entry-wise, $s_i = \mathrm{sign}(M_i)$ where
$|M_i| > a/2 + \lambda/a$ and $0$ elsewhere, so the support is a set of the largest
$|M_i|$; for a support of the $k$ largest the best scale is their mean,
$a = C_k / k$ with $C_k$ the sum of the $k$ largest $|M_i|$, and the value is
$C_k^2 / (2k) - \lambda k$. The exact maximiser takes the $k$ of the largest value
($k = 0$: $W = 0$), one sort per matrix. With $\lambda = 0$ it is the exact
least-squares ternary approximation (the problem Ternary Weight Networks approximate
by the threshold $0.7$ mean $|M|$). $Q_\lambda$ leaves a matrix of $T$ unchanged when
$a^2/2 > \lambda$.

The same $Q_\lambda$ serves both trainings: gradient training sees it through the
straight-through estimator (the forward uses $Q_\lambda(W)$, the backward passes
$\partial J / \partial Q_\lambda(W)$ to the real latent $W$ unchanged), and the discrete
MSA maximises the Hamiltonian over $T$ with it (``ocformer.objective.MSA``).
"""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from ..models import Choices, IncompatibleError, Refusal, SequenceModel


def ternary_projection(
    m: Float[Array, "din dout"], sparsity: float = 0.0
) -> tuple[Float[Array, "din dout"], Float[Array, ""]]:
    r"""$(Q_\lambda(M), a)$: the exact maximiser of $\langle M, W\rangle - |W|^2/2 -
    \lambda |W|_0$ over $W = a s$, $a \ge 0$, $s \in \{-1, 0, 1\}^{\cdot}$, and its
    scale (see the module docstring).

    Args:
        m: the real matrix (any shape; one scale for all of it).
        sparsity: $\lambda \ge 0$.
    """
    magnitude = jnp.abs(m).reshape(-1)
    largest = jnp.sort(magnitude)[::-1]
    counts = jnp.arange(1, largest.size + 1, dtype=m.dtype)
    sums = jnp.cumsum(largest)
    values = jnp.square(sums) / (2 * counts) - sparsity * counts
    best = jnp.argmax(values)
    keep = values[best] > 0
    # The support by value: every entry at least the k-th largest. On a matrix of T
    # (all its nonzero entries tied at a) this keeps exactly its nonzero entries.
    support = jnp.abs(m) >= jnp.where(keep, largest[best], jnp.inf)
    count = jnp.sum(support)
    scale = jnp.sum(jnp.where(support, jnp.abs(m), 0)) / jnp.maximum(count, 1).astype(m.dtype)
    scale = jnp.where(keep, scale, 0)
    w = jnp.where(support, scale * jnp.sign(m), 0)
    return jax.lax.stop_gradient(w.astype(m.dtype)), jax.lax.stop_gradient(scale)


class Ternary(eqx.Module):
    r"""The restriction of the feed-forward kernels to the ternary set $T$, with the
    sparsity penalty $\lambda$ of the projection $Q_\lambda$ (module docstring).

    Args:
        sparsity: $\lambda \ge 0$ (``objective.ternary_sparsity``).
    """

    sparsity: float = eqx.field(default=0.0, static=True)

    def __check_init__(self):
        if not (isinstance(self.sparsity, int | float) and self.sparsity >= 0):
            raise ValueError(
                f"Ternary.sparsity is the weight lambda of |W|_0 in the ternary projection "
                f"and must be a number >= 0, got {self.sparsity!r}."
            )

    def project(self, kernels: tuple[Array, ...]) -> tuple[Array, ...]:
        r"""$Q_\lambda$ of every kernel (leading layer axis: one scale per layer and map)."""
        return tuple(
            jax.vmap(lambda m: ternary_projection(m, self.sparsity)[0])(k) for k in kernels
        )

    def scales(self, kernels: tuple[Array, ...]) -> tuple[Array, ...]:
        """The scale a of every layer and map of $Q_\\lambda$ (one ``(L,)`` array a map)."""
        return tuple(
            jax.vmap(lambda m: ternary_projection(m, self.sparsity)[1])(k) for k in kernels
        )

    def straight_through(self, model: SequenceModel) -> SequenceModel:
        r"""``model`` whose forward uses $Q_\lambda(W)$ and whose gradient with respect
        to the latent $W$ is the gradient at $Q_\lambda(W)$ (the straight-through
        estimator): $W + \mathrm{sg}(Q_\lambda(W) - W)$."""
        check_ternary(model)
        kernels = feedforward_kernels(model)
        ternary = self.project(kernels)
        through = tuple(
            w + jax.lax.stop_gradient(q - w) for w, q in zip(kernels, ternary, strict=True)
        )
        return with_feedforward_kernels(model, through)


def feedforward_kernels(model: SequenceModel) -> tuple[Array, ...]:
    """The feed-forward kernels $W_j$ of a piecewise-constant model, each with its
    leading layer axis."""
    return tuple(model.transformer.control.values.feedforward.weights)  # type: ignore[attr-defined]


def with_feedforward_kernels(model: SequenceModel, kernels) -> SequenceModel:
    """``model`` with these feed-forward kernels (``feedforward_kernels``' layout)."""
    return eqx.tree_at(
        lambda m: m.transformer.control.values.feedforward.weights, model, tuple(kernels)
    )


def ternary_refusals(choices: Choices, *, kernel_norm: str | None = None) -> list[Refusal]:
    """Every reason the feed-forward kernels of the model of ``choices`` cannot be
    restricted to the ternary set (``objective.ternary``); empty: they can. Config
    validation and ``check_ternary`` read this one table."""
    found = []
    if choices.controls != "piecewise_constant":
        found.append(
            Refusal(
                "controls.kind",
                f"objective.ternary restricts each layer's feed-forward kernels to "
                f"{{-a, 0, a}}; controls.kind={choices.controls!r} stores node values or "
                "expansion coefficients, and theta(t) between them is not ternary. Use "
                "controls.kind=piecewise_constant, or objective.ternary=false",
            )
        )
    if kernel_norm is not None:
        found.append(
            Refusal(
                "objective.kernel_norm",
                f"objective.ternary is the kernels' constraint; a kernel_norm={kernel_norm!r} "
                "ball would project a ternary kernel off the ternary set. Set "
                "objective.kernel_norm=none (and no kernel_bound), or objective.ternary=false",
            )
        )
    return found


def check_ternary(model: SequenceModel, *, kernel_norm: str | None = None) -> None:
    """Raise ``IncompatibleError`` for the first reason ``ternary_refusals`` gives."""
    found = ternary_refusals(model.transformer.choices(), kernel_norm=kernel_norm)
    if found:
        raise IncompatibleError(found[0])
