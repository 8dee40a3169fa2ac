"""The feed-forward part: integral linear maps in y, biases, and the hidden sub-step."""

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from ..controls._params import FeedForwardParams
from ._activations import Activation, activate, check_activation
from ._grid import Grid, constant_in_x


def _scaled(scale, x):
    """``scale * x`` in the wider of the two dtypes (a python number is weak: ``x``'s),
    rounded to ``x``'s: standard promotion's product, its cast made explicit so that it
    runs under strict dtype promotion too."""
    wide = (
        x if isinstance(scale, (int, float)) else x.astype(np.promote_types(scale.dtype, x.dtype))
    )
    return (scale * wide).astype(x.dtype)


class FeedForward(eqx.Module):
    r"""The feed-forward operator: $J$ integral maps with hidden pointwise sub-steps.

    Each map is a fixed part plus a control, $A_j = L_j + W_j$, acting as
    $u \mapsto L_j u + \delta t\,(h_y\,u W_j + b_j)$: one explicit Euler step of
    $u_t = \langle W_j, u\rangle_{\Omega_y} + b_j$ from the fixed start $L_j u$.
    $L_1 = E$ lifts the $d$ features to the hidden domain of width $d_{ff}$, the middle
    $L_j = I$, and $L_J = R$ restricts back; $E$ and $R$ are ``eye(d, dff)`` and
    ``eye(dff, d)``. After every map but the last comes the hidden sub-step: for ReLU
    the projection onto $S_2 = \{u \ge 0\}$ (term III of Tai, Liu, Li, Chan,
    arXiv 2510.03989), for GELU a pointwise nonlinear sub-step that is no projection.

    With $\delta t = 1$ the chain is a standard MLP with weights $A_j$.

    Args:
        activation: ``"relu"`` (projection onto $S_2$), ``"gelu"`` or ``"gelu_tanh"``.
        grid: quadrature spacings.
    """

    activation: Activation = eqx.field(default="relu", static=True)
    grid: Grid = Grid()

    def __check_init__(self):
        check_activation(self.activation)

    def linear_step(
        self,
        p: FeedForwardParams,
        j: int,
        u: Float[Array, "*batch N din"],
        dt=1.0,
    ) -> Float[Array, "*batch N dout"]:
        """$L_j u + \\delta t\\,(h_y u W_j + b_j)$."""
        w, b = p.weights[j], p.biases[j]
        # L_j u + dt (h_y u W_j + b_j) = u (L_j + dt h_y W_j) + dt b_j: the fixed part is
        # added on the (small) weight side rather than on the activations. At dt = 1
        # this is a standard dense layer with kernel A_j = L_j + W_j.
        # The kernel and bias stay in the controls' dtype: a float32 step size (time is
        # at least float32) would otherwise promote a bfloat16 product to float32.
        if isinstance(dt, float) and dt == 1.0 and self.grid.h_y == 1.0:
            step_w = w
        else:
            step_w = _scaled(dt * self.grid.h_y, w)
        a = jnp.eye(*w.shape, dtype=w.dtype) + step_w
        z = u @ a
        if b is not None:
            if not (isinstance(dt, float) and dt == 1.0):
                b = _scaled(dt, b)
            z = z + constant_in_x(b, z.ndim)
        return z

    def chain(
        self, p: FeedForwardParams, u: Float[Array, "*batch N d"], dt=1.0
    ) -> Float[Array, "*batch N d"]:
        """All J maps in order, the hidden sub-step after each but the last."""
        num_maps = len(p.weights)
        for j in range(num_maps):
            u = self.linear_step(p, j, u, dt)
            if j < num_maps - 1:
                u = activate(u, self.activation)
        return u

    def __call__(
        self, p: FeedForwardParams, u: Float[Array, "*batch N d"]
    ) -> Float[Array, "*batch N d"]:
        r"""The operator $\Phi(u) = A_J\,\sigma(\cdots\sigma(A_1 u + b_1)\cdots) + b_J$."""
        return self.chain(p, u, 1.0)
