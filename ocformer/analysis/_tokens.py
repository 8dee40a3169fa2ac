r"""The dynamics of tokens: clustering and finite-time Lyapunov exponents.

Self-attention dynamics drive tokens together: in the model of Geshkovski, Letrouit,
Polyanskiy and Rigollet (A mathematical perspective on Transformers, 2023) the tokens
cluster as t grows, so the pairwise cosine similarities $\langle u_i, u_j\rangle /
|u_i||u_j|$ tend to 1 (or to a few clusters). The finite-time Lyapunov exponents
$\lambda_k = \frac{1}{T}\log\sigma_k(\partial u(T)/\partial u(0))$ measure how the flow
stretches perturbations of the input; they are computed from the variational equation
$\dot v = \partial_u f\,v$, i.e. Jacobian-vector products through the steps, with QR
re-orthonormalisation (Benettin et al., 1980) so the directions do not collapse onto
the fastest one.
"""

from collections.abc import Callable, Sequence
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from jaxtyping import Array, Float

from ..models import ContinuousTransformer, refine
from ._convergence import fitted_slope
from ._steps import StepMap, trajectory


class TokenSimilarity(NamedTuple):
    """Pairwise cosine similarities of the tokens along the trajectory.

    ``ts``: the grid; ``cosine``: (T, *batch, N, N); ``mean``: the mean over pairs
    i != j (and the batch) at each time; ``min``: the smallest over pairs.
    """

    ts: Float[Array, " T"]
    cosine: Array
    mean: Float[Array, " T"]
    min: Float[Array, " T"]


def token_similarity(transformer: ContinuousTransformer, u0, *, key_mask=None) -> TokenSimilarity:
    """Cosine similarities of every pair of tokens at every step of the solve
    (``key_mask``: only kept tokens are paired)."""
    ts, ys = trajectory(transformer, u0, key_mask)
    unit = ys / jnp.linalg.norm(ys, axis=-1, keepdims=True)
    cosine = jnp.einsum("...id,...jd->...ij", unit, unit)
    n = cosine.shape[-1]
    pair = ~jnp.eye(n, dtype=bool)
    if key_mask is not None:
        pair = pair & key_mask[..., :, None] & key_mask[..., None, :]
    pair = jnp.broadcast_to(pair, cosine.shape)
    axes = tuple(range(1, cosine.ndim))
    mean = jnp.sum(jnp.where(pair, cosine, 0.0), axis=axes) / jnp.sum(pair, axis=axes)
    smallest = jnp.min(jnp.where(pair, cosine, jnp.inf), axis=axes)
    return TokenSimilarity(ts, cosine, mean, smallest)


class Lyapunov(NamedTuple):
    r"""Finite-time Lyapunov exponents.

    ``exponents``: the ``num`` largest, in decreasing order, over $[t_0, t_N]$;
    ``ts`` and ``running``: after each step n, the exponent of each re-orthonormalised
    direction over $[t_0, t_n]$ (in the order of the directions, not sorted).
    """

    exponents: Float[Array, " k"]
    ts: Float[Array, " T"]
    running: Float[Array, "T k"]


@eqx.filter_jit
def _benettin(step, times, y0, q0):
    def body(carry, n):
        y, q, logs = carry
        y1 = step(n, y)
        # The variational equation advanced by the same step: one JVP per direction.
        tangents = jax.vmap(
            lambda v: jax.jvp(lambda u: step(n, u), (y,), (v.reshape(y.shape),))[1]
        )(q.T)
        w = tangents.reshape(q.shape[1], -1).T
        q1, r = jnp.linalg.qr(w)
        diag = jnp.diagonal(r)
        # QR's signs are arbitrary: fix them so that the columns do not flip.
        q1 = q1 * jnp.sign(diag)[None, :]
        logs = logs + jnp.log(jnp.abs(diag))
        return (y1, q1, logs), logs

    num = q0.shape[1]
    init = (y0, q0, jnp.zeros((num,), y0.dtype))
    (_, _, logs), history = jax.lax.scan(body, init, jnp.arange(times.shape[0] - 1))
    elapsed = times[1:] - times[0]
    return logs / (times[-1] - times[0]), history / elapsed[:, None]


def lyapunov_exponents(step: Callable, times, y0, num: int, *, seed: int = 0) -> Lyapunov:
    r"""The ``num`` largest finite-time Lyapunov exponents of the discrete flow
    ``y_{n+1} = step(n, y_n)`` on the grid ``times`` (Benettin's algorithm).

    Starting from ``num`` random orthonormal directions, each step maps them by the
    Jacobian of ``step`` (``jax.jvp``), and a QR factorisation re-orthonormalises them;
    the logarithms of the diagonal of R, summed and divided by $t_N - t_0$, are the
    exponents.

    Args:
        step: ``step(n, y) -> y``, differentiable in forward mode.
        times: the grid t_0 < ... < t_N (N steps).
        y0: the initial state (any shape; its size is the dimension).
        num: how many exponents (at most the dimension).
        seed: seeds the initial directions.
    """
    dim = int(np.prod(y0.shape))
    if not 1 <= num <= dim:
        raise ValueError(f"num must be between 1 and the state's dimension {dim}, got {num}.")
    q0, _ = jnp.linalg.qr(jr.normal(jr.key(seed), (dim, num), y0.dtype))
    times = jnp.asarray(times, y0.dtype)
    exponents, running = _benettin(step, times, y0, q0)
    # Over a short horizon the direction that stretches most need not be the first one
    # QR kept; sorted, the k-th exponent is the k-th largest.
    return Lyapunov(jnp.sort(exponents)[::-1], times[1:], running)


def model_lyapunov(
    transformer: ContinuousTransformer, u0, num: int = 4, *, key_mask=None, seed: int = 0
) -> Lyapunov:
    """Finite-time Lyapunov exponents of the model's discrete flow from one input u0
    (N, d), over the whole depth, per unit time (a layer is one unit)."""
    steps = StepMap(transformer, key_mask, u0.dtype)
    y0 = steps.transformer.initial_state(u0)
    return lyapunov_exponents(steps, steps.times, y0, num, seed=seed)


def lyapunov_refinement(
    transformer: ContinuousTransformer,
    u0,
    steps_per_layer: Sequence[int] = (1, 2, 4, 8, 16),
    num: int = 4,
    *,
    seed: int = 0,
) -> dict:
    r"""The exponents as the step shrinks: per m, the exponents and their distance to
    those at the finest m (max over the ``num`` exponents), and the fitted slope of that
    distance against dt (the order at which they converge; the finest point is left
    out of the fit).

    Returns:
        A JSON-ready dict: ``steps_per_layer``, ``dt``, ``exponents`` (per m),
        ``distance_to_finest`` and ``slope``.
    """
    steps = sorted(int(m) for m in steps_per_layer)
    if len(steps) < 3:
        raise ValueError(f"A slope against the finest grid needs three step counts, got {steps}.")
    exps = [
        np.asarray(model_lyapunov(refine(transformer, m), u0, num, seed=seed).exponents)
        for m in steps
    ]
    dist = [float(np.max(np.abs(e - exps[-1]))) for e in exps]
    dts = [1.0 / m for m in steps]
    return dict(
        steps_per_layer=steps,
        dt=dts,
        exponents=[e.tolist() for e in exps],
        distance_to_finest=dist,
        slope=fitted_slope(dts[:-1], dist[:-1]),
    )
