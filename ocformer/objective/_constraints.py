"""Constraints on the controls, enforced by projection after every optimiser update."""

from typing import Literal, get_args

import equinox as eqx
import jax.numpy as jnp
import jax.tree_util as jtu

from ..controls import AttentionParams, Basis, FeedForwardParams, NormParams
from ..models._sequence import SequenceModel

KernelNorm = Literal["frobenius", "spectral"]
KERNEL_NORMS: tuple[str, ...] = get_args(KernelNorm)


def project_frobenius(w, bound: float):
    r"""Nearest point of $\{W : \|W\|_F \le r\}$: $W \min(1, r / \|W\|_F)$, per matrix
    (the last two axes)."""
    norm = jnp.sqrt(jnp.sum(jnp.square(w), axis=(-2, -1), keepdims=True))
    return w * jnp.minimum(1.0, bound / jnp.maximum(norm, jnp.finfo(w.dtype).tiny))


def project_spectral(w, bound: float):
    r"""Nearest point (in Frobenius distance) of $\{W : \|W\|_2 \le r\}$: the singular
    values clipped at r, $U \min(\Sigma, r) V^\top$, per matrix (the last two axes)."""
    u, s, vt = jnp.linalg.svd(w, full_matrices=False)
    return (u * jnp.minimum(s, bound)[..., None, :]) @ vt


class Constraints(eqx.Module):
    r"""The admissible set of the controls and the projection onto it.

    - $\sigma_2(t) \ge$ ``sigma_floor`` for every layer-norm target (per-feature gains
      included, and the final norm): the set $S_1(\sigma_1, \sigma_2)$ needs
      $\sigma_2 > 0$. Projection: clipping.
    - optionally $\|W\| \le$ ``kernel_bound`` for the attention kernels
      $W^Q, W^K, W^V, W^O$ and the feed-forward controls $W_j$ (the deviations from the
      fixed lifting/restriction), in the Frobenius or the spectral norm. Projection:
      rescaling, or clipping the singular values.

    Each constraint set is convex, so the projection of a stored control value is the
    nearest admissible value. It acts on every stored value of the control (each piece
    of a piecewise-constant control); a control that is a convex combination of its
    stored values (piecewise constant or linear, constant) then satisfies the
    constraints at every t.

    Args:
        sigma_floor: lower bound on $\sigma_2$, > 0, or None for no floor.
        kernel_norm: None, ``"frobenius"`` or ``"spectral"``.
        kernel_bound: the radius r > 0 (required with ``kernel_norm``).
    """

    sigma_floor: float | None = eqx.field(default=1e-3, static=True)
    kernel_norm: KernelNorm | None = eqx.field(default=None, static=True)
    kernel_bound: float | None = eqx.field(default=None, static=True)

    def __check_init__(self):
        if self.sigma_floor is not None and not (
            isinstance(self.sigma_floor, (int, float)) and self.sigma_floor > 0
        ):
            raise ValueError(
                f"Constraints.sigma_floor must be a number > 0 (S1 needs sigma2 > 0) or None, "
                f"got {self.sigma_floor!r}."
            )
        if self.kernel_norm is not None and self.kernel_norm not in KERNEL_NORMS:
            raise ValueError(
                f"Constraints.kernel_norm must be None or one of {KERNEL_NORMS}, got "
                f"{self.kernel_norm!r}."
            )
        if (self.kernel_norm is None) != (self.kernel_bound is None):
            raise ValueError(
                "Constraints.kernel_norm and kernel_bound go together: give both (e.g. "
                f"'spectral', 2.0) or neither; got {self.kernel_norm!r}, {self.kernel_bound!r}."
            )
        if self.kernel_bound is not None and not (
            isinstance(self.kernel_bound, (int, float)) and self.kernel_bound > 0
        ):
            raise ValueError(
                f"Constraints.kernel_bound must be a number > 0, got {self.kernel_bound!r}."
            )

    def _kernel(self, w):
        if w is None or self.kernel_bound is None:
            return w
        if self.kernel_norm == "frobenius":
            return project_frobenius(w, self.kernel_bound)
        return project_spectral(w, self.kernel_bound)

    def _project(self, node):
        if isinstance(node, NormParams):
            if self.sigma_floor is None:
                return node
            return NormParams(scale=jnp.maximum(node.scale, self.sigma_floor), bias=node.bias)
        if isinstance(node, AttentionParams):
            k = self._kernel
            return eqx.tree_at(
                lambda p: (p.wq, p.wk, p.wv, p.wo),
                node,
                (k(node.wq), k(node.wk), k(node.wv), k(node.wo)),
                is_leaf=lambda x: x is None,
            )
        if isinstance(node, FeedForwardParams):
            return FeedForwardParams(
                weights=tuple(self._kernel(w) for w in node.weights), biases=node.biases
            )
        return node

    def project_layer(self, params):
        """The controls of one layer (a ``LayerParams``, or any tree of them) projected
        onto the admissible set, as ``project`` does for every layer of a model."""
        is_params = lambda x: isinstance(x, (NormParams, AttentionParams, FeedForwardParams))  # noqa: E731
        return jtu.tree_map(self._project, params, is_leaf=is_params)

    def project(self, model: SequenceModel) -> SequenceModel:
        """The model with its transformer's controls projected onto the admissible set.

        Raises:
            ValueError: a constraint is active and the control is a ``Basis``: its
                stored values are expansion coefficients, and clipping those does not
                bound theta(t).
        """
        if self.sigma_floor is None and self.kernel_norm is None:
            return model  # nothing to enforce
        if isinstance(model.transformer.control, Basis):
            raise ValueError(
                "Constraints cannot be enforced on a Basis control by projection: its "
                "stored values are expansion coefficients, and clipping coefficients "
                "neither bounds theta(t) nor is a projection of it. Use piecewise-constant "
                "or piecewise-linear controls, or Constraints(sigma_floor=None) without "
                "kernel bounds."
            )
        is_params = lambda x: isinstance(x, (NormParams, AttentionParams, FeedForwardParams))  # noqa: E731
        transformer = jtu.tree_map(self._project, model.transformer, is_leaf=is_params)
        return model.with_transformer(transformer)

    def violation(self, model: SequenceModel) -> dict[str, float]:
        """How far the model is outside the admissible set (0.0 inside): the largest
        amount by which sigma2 falls below the floor and a kernel norm exceeds the bound."""
        floor_gap, norm_gap = 0.0, 0.0
        is_params = lambda x: isinstance(x, (NormParams, AttentionParams, FeedForwardParams))  # noqa: E731
        for node in jtu.tree_leaves(model.transformer, is_leaf=is_params):
            if isinstance(node, NormParams) and self.sigma_floor is not None:
                floor_gap = max(floor_gap, float(jnp.max(self.sigma_floor - node.scale)))
            kernels = []
            if isinstance(node, AttentionParams):
                kernels = [w for w in (node.wq, node.wk, node.wv, node.wo) if w is not None]
            elif isinstance(node, FeedForwardParams):
                kernels = list(node.weights)
            for w in kernels if self.kernel_bound is not None else []:
                if self.kernel_norm == "frobenius":
                    norms = jnp.sqrt(jnp.sum(jnp.square(w), axis=(-2, -1)))
                else:
                    norms = jnp.linalg.svd(w, compute_uv=False)[..., 0]
                norm_gap = max(norm_gap, float(jnp.max(norms - self.kernel_bound)))
        return {"sigma_floor": max(floor_gap, 0.0), "kernel_norm": max(norm_gap, 0.0)}
