"""A Transformer as the solution operator of the controlled equation."""

from typing import Literal

import diffrax
import equinox as eqx
import jax.numpy as jnp
import jax.tree_util as jtu
from diffrax import MultiTerm
from jaxtyping import Array, Bool, Float

from ..controls._control import AbstractControl
from ..controls._params import LayerParams, NormParams
from ..dynamics._solve import solve
from ..dynamics._terms import (
    AttentionTerm,
    AveragedFeedForwardTerm,
    FeedForwardTerm,
    ProjectionTerm,
)
from ..operators import Attention, FeedForward, Grid, LayerNormProjection
from ..splitting import Lie

NormPosition = Literal["post", "pre"]


def _feature_width(control: AbstractControl) -> int:
    return int(control(control.interval[0]).attention.wq.shape[-1])


class ContinuousTransformer(eqx.Module):
    r"""The map $f \mapsto u(T)$ of the controlled integro-differential equation.

    Post-LN (``norm="post"``): the split equation
    $u_t = \mathcal{A}(u) + \partial I_{S_1} + \mathcal{F}(u) + \partial I_{S_1}$ with the
    paper's feed-forward sub-problem (averaging step and eps/4 closing projection).
    Pre-LN (``norm="pre"``): the smooth ODE
    $u_t = \mathcal{A}(P_{S_1}(u)) + \Phi(P_{S_1}(u))$, then the final projection at
    $t = T$ when ``final_norm`` is given.

    With the ``Lie`` scheme and one step per layer it is exactly the standard
    Transformer stack whose parameters are the pieces of ``control``.

    Args:
        control: theta(t).
        norm: ``"post"`` or ``"pre"``.
        attention: the attention operator (heads, causal, grid).
        feedforward: the feed-forward operator (activation, grid).
        layer_norm: the layer-norm projection (eps).
        final_norm: projection target at t = T, or None.
        solver: the time stepper (default ``Lie()``).
        steps_per_layer: sub-steps per layer, dt = 1/m (default 1).
        adjoint: the gradient method (default: ``RecursiveCheckpointAdjoint`` with one
            checkpoint per step).
    """

    control: AbstractControl
    attention: Attention
    feedforward: FeedForward
    layer_norm: LayerNormProjection
    final_norm: NormParams | None
    solver: diffrax.AbstractSolver
    adjoint: diffrax.AbstractAdjoint | None
    norm: NormPosition = eqx.field(static=True)
    steps_per_layer: int = eqx.field(static=True)

    def __init__(
        self,
        control: AbstractControl,
        *,
        norm: NormPosition = "post",
        num_heads: int = 1,
        causal: bool = False,
        activation: str = "relu",
        ln_eps: float = 0.0,
        grid: Grid = Grid(),
        final_norm: NormParams | None = None,
        solver: diffrax.AbstractSolver | None = None,
        steps_per_layer: int = 1,
        adjoint: diffrax.AbstractAdjoint | None = None,
    ):
        if norm not in ("post", "pre"):
            raise ValueError(f"norm must be 'post' or 'pre', got {norm!r}.")
        d = _feature_width(control)
        if not (isinstance(num_heads, int) and num_heads >= 1) or d % num_heads:
            raise ValueError(
                f"num_heads={num_heads!r} must be a positive integer dividing the "
                f"feature width d={d}."
            )
        self.control = control
        self.attention = Attention(num_heads=num_heads, causal=causal, grid=grid)
        self.feedforward = FeedForward(activation=activation, grid=grid)
        self.layer_norm = LayerNormProjection(eps=ln_eps)
        self.final_norm = final_norm
        self.solver = Lie() if solver is None else solver
        self.adjoint = adjoint
        self.norm = norm
        self.steps_per_layer = steps_per_layer

    @property
    def num_layers(self) -> int:
        return self.control.num_layers

    @property
    def width(self) -> int:
        return _feature_width(self.control)

    def terms(self) -> MultiTerm:
        """The split right-hand side, one term per operator."""
        if self.norm == "post":
            return MultiTerm(
                AttentionTerm(self.attention),
                ProjectionTerm(self.layer_norm, "norm1"),
                AveragedFeedForwardTerm(self.feedforward),
                # After the averaging step the projection sees (a + b)/2: eps/4.
                ProjectionTerm(self.layer_norm, "norm2", eps_scale=0.25),
            )
        return MultiTerm(
            AttentionTerm(self.attention, pre_norm=self.layer_norm),
            FeedForwardTerm(self.feedforward, pre_norm=self.layer_norm),
        )

    def _check_input(self, u0, key_mask):
        d = self.width
        if not hasattr(u0, "shape") or u0.ndim not in (2, 3) or u0.shape[-1] != d:
            shape = getattr(u0, "shape", type(u0).__name__)
            raise ValueError(
                f"u0 must have shape (N, {d}) or (B, N, {d}) (tokens by the model's "
                f"{d} features), got {shape}."
            )
        if not jnp.issubdtype(u0.dtype, jnp.floating):
            raise ValueError(f"u0 must be a floating-point array, got dtype {u0.dtype}.")
        if key_mask is not None and key_mask.shape != u0.shape[:-1]:
            raise ValueError(
                f"key_mask must have shape {u0.shape[:-1]} (the state without its "
                f"feature axis), got {key_mask.shape}."
            )

    def _in_dtype(self, dtype) -> "ContinuousTransformer":
        def cast(x):
            if eqx.is_inexact_array(x) and x.dtype != dtype:
                return x.astype(dtype)
            return x

        return jtu.tree_map(cast, self)

    def solve(
        self,
        u0: Float[Array, "*batch N d"],
        key_mask: Bool[Array, "*batch N"] | None = None,
        saveat: diffrax.SaveAt | None = None,
    ) -> diffrax.Solution:
        """The diffrax solution from u(0) = u0 (before any final projection)."""
        self._check_input(u0, key_mask)
        model = self._in_dtype(u0.dtype)
        return solve(
            model.terms(),
            model.solver,
            model.control,
            u0,
            key_mask=key_mask,
            steps_per_layer=model.steps_per_layer,
            adjoint=model.adjoint,
            saveat=saveat,
        )

    def __call__(
        self,
        u0: Float[Array, "*batch N d"],
        key_mask: Bool[Array, "*batch N"] | None = None,
    ) -> Float[Array, "*batch N d"]:
        """u(T) from the embedded input u0, in the dtype of u0."""
        sol = self.solve(u0, key_mask)
        assert sol.ys is not None
        u_t = sol.ys[-1]
        if self.final_norm is not None:
            final = self._in_dtype(u0.dtype).final_norm
            u_t = self.layer_norm(final, u_t)
        return u_t

    def layer(self, n: int) -> LayerParams:
        """The controls of layer n (their value on the n-th piece of the grid)."""
        t0, t1 = self.control.interval
        dt = (t1 - t0) / self.num_layers
        return self.control(t0 + (n + 0.5) * dt)
