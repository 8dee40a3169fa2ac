r"""Running costs $\int_0^T L(\theta(t), u(t))\,dt$ by quadrature over the time grid."""

import diffrax
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import Array, Bool, Float

from ..controls import AbstractControl, Constant, PiecewiseConstant
from ..integration import time_dtype, time_grid
from ..models._transformer import ContinuousTransformer


def _sum_squares(tree) -> Float[Array, "*k"]:
    """Squared Euclidean norm of every pytree leaf, summed, per leading index when the
    leaves carry a leading axis (stacked controls)."""
    total = 0.0
    for leaf in jtu.tree_leaves(tree):
        total = total + jnp.sum(jnp.square(leaf).reshape(leaf.shape[0], -1), axis=-1)
    return jnp.asarray(total)


def _midpoints(control: AbstractControl, steps_per_layer: int, dtype):
    ts, _ = time_grid(control, steps_per_layer, dtype)
    return 0.5 * (ts[1:] + ts[:-1]), ts[1:] - ts[:-1]


def control_size(control: AbstractControl, steps_per_layer: int = 1) -> Float[Array, ""]:
    r"""$\int_{t_0}^{t_1} |\theta(t)|^2\,dt$ over the kernels and biases.

    Midpoint quadrature on the step grid: exact for piecewise-constant controls (every
    step lies inside one piece), second order for smooth ones. The layer-norm targets
    $(\sigma_1, \sigma_2)$ are left out: they are constrained (``Constraints``), and
    pulling $\sigma_2$ towards 0 would fight the floor.
    """
    mids, weights = _midpoints(control, steps_per_layer, _float_dtype(control))
    params = jax.vmap(control)(mids)
    sq = _sum_squares((params.attention, params.feedforward))
    return jnp.sum(weights * sq)


def control_smoothness(control: AbstractControl, steps_per_layer: int = 1) -> Float[Array, ""]:
    r"""$\int_{t_0}^{t_1} |\theta'(t)|^2\,dt$ over all controls (layer-norm targets included).

    A piecewise-constant control has no square-integrable derivative (its $\theta'$ is a
    sum of Dirac masses at the jumps). ocformer uses the value of the functional on the
    piecewise-linear interpolant through the piece midpoints, which is
    $\sum_{n} |\theta_{n+1} - \theta_n|^2 / \Delta$ with $\Delta$ the piece length: the
    jumps between consecutive layers divided by their spacing. A constant control costs
    0; other controls use midpoint quadrature of $|\theta'(t)|^2$ on the step grid.
    """
    if isinstance(control, PiecewiseConstant):
        t0, t1 = control.interval
        spacing = (t1 - t0) / control.num_layers
        jumps = jtu.tree_map(lambda x: x[1:] - x[:-1], control.values)
        if control.num_layers == 1:
            return jnp.zeros((), _float_dtype(control))
        return jnp.sum(_sum_squares(jumps)) / spacing
    if isinstance(control, Constant):
        return jnp.zeros((), _float_dtype(control))
    mids, weights = _midpoints(control, steps_per_layer, _float_dtype(control))
    rates = jax.vmap(control.derivative)(mids)
    return jnp.sum(weights * _sum_squares(rates))


def grid_saveat(ts: Float[Array, " T"]) -> diffrax.SaveAt:
    """Save the state at every point of the step grid ``ts``: ``t0`` and ``t1`` are
    saved exactly (the initial and final states), the interior points by ``ts``."""
    if ts.shape[0] > 2:
        return diffrax.SaveAt(t0=True, ts=ts[1:-1], t1=True)
    return diffrax.SaveAt(t0=True, t1=True)


def kinetic_energy_of_states(
    ts: Float[Array, " T"],
    ys: Float[Array, "T *batch N d"],
    h_y: float,
    key_mask: Bool[Array, "*batch N"] | None = None,
) -> Float[Array, ""]:
    r"""$\sum_k |u_{k+1} - u_k|^2 / \delta t_k$ from the states ``ys`` on the grid ``ts``.

    The norm is the feature integral $h_y \sum_y$ averaged over tokens (unmasked ones
    when ``key_mask`` is given) and over the batch, so it does not grow with the length.
    """
    dt = (ts[1:] - ts[:-1]).reshape(-1, *(1,) * (ys.ndim - 2))
    per_token = h_y * jnp.sum(jnp.sum(jnp.square(ys[1:] - ys[:-1]), axis=-1) / dt, axis=0)
    if key_mask is None:
        return jnp.mean(per_token)
    w = key_mask.astype(per_token.dtype)
    return jnp.sum(per_token * w) / jnp.maximum(jnp.sum(w), 1.0)


def kinetic_energy(
    transformer: ContinuousTransformer,
    u0: Float[Array, "B N d"],
    key_mask: Bool[Array, "B N"] | None = None,
) -> Float[Array, ""]:
    r"""$\int_0^T |u_t|^2\,dt$ from the trajectory: $\sum_k |u_{k+1} - u_k|^2 / \delta t_k$.

    The states at every step of the grid come from a forward solve that saves them
    (``grid_saveat``: ``SaveAt`` of t0, the interior grid points and t1, which every
    gradient method supports). On a splitting scheme this is the kinetic energy of the
    discrete trajectory, projections included. ``Objective`` takes the same states from
    the solve that gives its terminal cost, so that the cost needs no extra solve.
    """
    ts, _ = time_grid(transformer.control, transformer.steps_per_layer, u0.dtype)
    # The states in the solve's own dtype: differences of bfloat16 states are rounding.
    ys = transformer.solve(u0, key_mask, saveat=grid_saveat(ts), cast_back=False).ys
    assert ys is not None
    return kinetic_energy_of_states(ts, ys, transformer.attention.grid.h_y, key_mask)


def _float_dtype(control: AbstractControl):
    leaves = [x for x in jtu.tree_leaves(control) if jnp.issubdtype(x.dtype, jnp.floating)]
    return time_dtype(leaves[0].dtype)
