r"""The dynamics of tokens: clustering and finite-time Lyapunov exponents.

Self-attention dynamics drive tokens together: in the model of Geshkovski, Letrouit,
Polyanskiy and Rigollet (A mathematical perspective on Transformers, 2023) the tokens
cluster as t grows, so the pairwise cosine similarities $\langle u_i, u_j\rangle /
|u_i||u_j|$ tend to 1 (or to a few clusters). The finite-time Lyapunov exponents
$\lambda_k = \frac{1}{T}\log\sigma_k(\partial u(T)/\partial u(0))$ measure how the flow
stretches perturbations of the input. They are computed as defined, from the Jacobian
of the discrete flow (Jacobian-vector products through the steps): materialised and
decomposed for the notebooks' sizes, or by randomised subspace iteration with JVPs and
VJPs for larger states. Benettin's algorithm (random directions with QR
re-orthonormalisation) is kept under its own name: it is the long-time estimator, equal
to the exponents only as T grows without bound.
"""

import functools
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
    (``key_mask``: only kept tokens are paired); constant steps only (an adaptive
    solve's trajectory is padded to its step budget)."""
    if transformer.discretisation.is_adaptive:
        raise ValueError(
            "token_similarity follows the states of the grid's steps; the model has "
            "stepsize='pid'. Use ocformer.models.rediscretise(model, stepsize='constant')."
        )
    ts, ys = trajectory(transformer, u0, key_mask)
    unit = ys / jnp.linalg.norm(ys, axis=-1, keepdims=True)
    cosine = jnp.einsum("...id,...jd->...ij", unit, unit)
    n = cosine.shape[-1]
    pair = ~jnp.eye(n, dtype=bool)
    if key_mask is not None:
        pair = pair & key_mask[..., :, None] & key_mask[..., None, :]
    pair = jnp.broadcast_to(pair, cosine.shape)
    axes = tuple(range(1, cosine.ndim))
    count = jnp.sum(pair, axis=axes).astype(cosine.dtype)
    mean = jnp.sum(jnp.where(pair, cosine, 0.0), axis=axes) / count
    smallest = jnp.min(jnp.where(pair, cosine, jnp.inf), axis=axes)
    return TokenSimilarity(ts, cosine, mean, smallest)


class Lyapunov(NamedTuple):
    r"""Lyapunov exponents of a discrete flow, over $[t_0, t_N]$ and as they run.

    ``exponents``: the ``num`` largest, in decreasing order, over $[t_0, t_N]$;
    ``ts`` and ``running``: ``running[n]`` is the same quantity over $[t_0,
    \mathrm{ts}[n]]$. What the quantity is depends on the estimator: the finite-time
    exponents $\frac{1}{t_n - t_0}\log\sigma_k(\partial u(t_n)/\partial u(t_0))$ for
    ``lyapunov_exponents`` (at every step) and ``randomised_lyapunov_exponents`` (at
    $t_N$ only); the growth rates of re-orthonormalised directions, in the order of
    the directions, for ``benettin_exponents``.
    """

    exponents: Float[Array, " k"]
    ts: Float[Array, " T"]
    running: Float[Array, "T k"]


def _check_num(y0, num: int) -> int:
    dim = int(np.prod(y0.shape))
    if not 1 <= num <= dim:
        raise ValueError(f"num must be between 1 and the state's dimension {dim}, got {num}.")
    return dim


def _columns(linear, y0, block):
    """``linear`` (a linear map on states shaped like ``y0``) applied to each column of
    ``block`` (dim, k), as a (dim, k) block."""
    return jax.vmap(lambda v: linear(v.reshape(y0.shape)).reshape(-1), in_axes=1, out_axes=1)(block)


@eqx.filter_jit
def _running_singular_values(step, times, y0, num):
    def body(carry, n):
        y, jac = carry
        y1, tangent = jax.linearize(lambda u: step(n, u), y)
        # The chain rule, one column at a time: du_{n+1}/du_0 = D step_n (du_n/du_0).
        jac1 = _columns(tangent, y, jac)
        sigma = jnp.linalg.svd(jac1, compute_uv=False)[:num]
        return (y1, jac1), jnp.log(sigma)

    eye = jnp.eye(y0.size, dtype=y0.dtype)
    _, logs = jax.lax.scan(body, (y0, eye), jnp.arange(times.shape[0] - 1))
    return logs / (times[1:] - times[0])[:, None]


def lyapunov_exponents(step: Callable, times, y0, num: int) -> Lyapunov:
    r"""The ``num`` largest finite-time Lyapunov exponents of the discrete flow
    ``y_{n+1} = step(n, y_n)`` on the grid ``times``, exactly as defined:

    $$\lambda_k(t_n) = \frac{1}{t_n - t_0}\log\sigma_k\Big(\frac{\partial y_n}
    {\partial y_0}\Big),$$

    $\sigma_k$ the k-th largest singular value. The Jacobian is materialised: each
    step maps its columns by the step's Jacobian (``jax.linearize``, one JVP per
    column), and its singular values are taken after every step, so ``running`` is the
    definition at every $t_n$.

    Cost and range: dim JVPs and one dim x dim SVD per step, for the sizes of the
    notebooks (dim a few hundred); beyond that use ``randomised_lyapunov_exponents``.
    The Jacobian's entries grow like $e^{\lambda_1 (t_n - t_0)}$, so the horizon must
    keep $\lambda_1 (t_N - t_0)$ below the dtype's overflow (709 in float64), and an
    exponent with $\sigma_k / \sigma_1$ below the dtype's epsilon is rounding: over
    long horizons the exponents are ``benettin_exponents``' limit.

    Args:
        step: ``step(n, y) -> y``, differentiable in forward mode.
        times: the grid t_0 < ... < t_N (N steps).
        y0: the initial state (any shape; its size is the dimension).
        num: how many exponents (at most the dimension).
    """
    _check_num(y0, num)
    times = jnp.asarray(times, y0.dtype)
    running = _running_singular_values(step, times, y0, num)
    return Lyapunov(running[-1], times[1:], running)


@eqx.filter_jit
def _subspace_iteration(step, times, y0, omega, num, iterations):
    def flow(y):
        return jax.lax.scan(lambda u, n: (step(n, u), None), y, jnp.arange(times.shape[0] - 1))[0]

    # J v by forward mode through the whole solve, J^T w by transposing the same
    # linearisation (reverse mode over its stored residuals).
    _, forward = jax.linearize(flow, y0)
    transpose = jax.linear_transpose(forward, y0)

    def backward(w):
        return transpose(w)[0]

    def orth(block):
        return jnp.linalg.qr(block)[0]

    q = orth(_columns(forward, y0, omega))
    for _ in range(iterations):
        q = orth(_columns(forward, y0, orth(_columns(backward, y0, q))))
    # Q^T J, transposed: its singular values are those of J on the range of Q.
    sigma = jnp.linalg.svd(_columns(backward, y0, q), compute_uv=False)[:num]
    return jnp.log(sigma) / (times[-1] - times[0])


def randomised_lyapunov_exponents(
    step: Callable, times, y0, num: int, *, oversample: int = 4, iterations: int = 2, seed: int = 0
) -> Lyapunov:
    r"""The ``num`` largest finite-time Lyapunov exponents over $[t_0, t_N]$, as
    ``lyapunov_exponents`` defines them, by randomised subspace iteration (Halko,
    Martinsson and Tropp, SIAM Review 2011) without materialising the Jacobian $J =
    \partial y_N / \partial y_0$: for states too large for dim JVPs per step.

    With $l$ = ``num + oversample`` columns of $\Omega$ = ``jr.normal(jr.key(seed),
    (dim, l))``, $Q = \mathrm{orth}((JJ^\top)^q J\Omega)$ ($q$ = ``iterations``, each
    product one sweep of $l$ JVPs or VJPs through the solve, with re-orthonormalisation
    between sweeps), and the exponents are $\frac1T\log\sigma_k(Q^\top J)$. The cost is
    $2(q + 1)$ sweeps of $l$ JVPs or VJPs, against dim JVPs for the exact method.

    Error: $\sigma_k(Q^\top J) \le \sigma_k(J)$, so the estimate never exceeds the
    exponent, and (Gu, SIAM J. Sci. Comput. 2015; Saibaba, SIAM J. Matrix Anal. Appl.
    2019) for k <= ``num``

    $$0 \le \lambda_k - \hat\lambda_k \le \frac{1}{2T}\log\Big(1 + C^2
    e^{-2(2q+1)T(\lambda_k - \lambda_{\mathrm{num}+1})}\Big),\qquad
    C = \|\Omega_2\Omega_1^\dagger\|,$$

    $\Omega_1, \Omega_2$ the components of $\Omega$ on the leading ``num`` right
    singular vectors of J and on the rest ($C \approx (\sqrt{\mathrm{dim}} + \sqrt l)\,
    e\sqrt l / \mathrm{oversample}$ for a Gaussian $\Omega$): each iteration multiplies
    the error by the squared ratio $(\sigma_{\mathrm{num}+1}/\sigma_k)^2$.
    ``pytest tests/test_analysis.py -k randomised`` checks the bound with the drawn
    $\Omega$: on its two-layer model (dim 12, 4 Heun steps, ``num=2``, the defaults,
    seed 0) the error is 5.1e-5 against a bound of 1.4e-2.

    Args:
        step: ``step(n, y) -> y``, differentiable in forward and reverse mode.
        times: the grid t_0 < ... < t_N (N steps).
        y0: the initial state (any shape; its size is the dimension).
        num: how many exponents (``num + oversample`` at most the dimension).
        oversample: extra columns beyond ``num`` (the $p$ of the bound).
        iterations: subspace iterations $q$.
        seed: seeds $\Omega$.

    Returns:
        A ``Lyapunov`` whose ``running`` holds only $t_N$ (each earlier time would
        need sweeps of its own; ``lyapunov_exponents`` gives them all).
    """
    dim = _check_num(y0, num)
    if oversample < 0 or num + oversample > dim:
        raise ValueError(
            f"num + oversample must be at most the state's dimension {dim}, got {num} + "
            f"{oversample}; lower oversample, or use lyapunov_exponents, which is exact "
            "and cheaper at this size."
        )
    times = jnp.asarray(times, y0.dtype)
    omega = jr.normal(jr.key(seed), (dim, num + oversample), y0.dtype)
    exponents = _subspace_iteration(step, times, y0, omega, num, iterations)
    return Lyapunov(exponents, times[-1:], exponents[None])


@eqx.filter_jit
def _benettin(step, times, y0, q0):
    def body(carry, n):
        y, q, logs = carry
        y1, tangent = jax.linearize(lambda u: step(n, u), y)
        # The variational equation advanced by the same step: one JVP per direction.
        q1, r = jnp.linalg.qr(_columns(tangent, y, q))
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


def benettin_exponents(step: Callable, times, y0, num: int, *, seed: int = 0) -> Lyapunov:
    r"""Benettin's estimate (Benettin, Galgani, Giorgilli and Strelcyn, 1980) of the
    ``num`` largest Lyapunov exponents of ``y_{n+1} = step(n, y_n)``: the long-time
    estimator, which converges to the Lyapunov exponents only as $t_N \to \infty$.

    Starting from ``num`` random orthonormal directions, each step maps them by the
    Jacobian of ``step`` (JVPs), and a QR factorisation re-orthonormalises them; the
    logarithms of the diagonal of R, summed and divided by $t_N - t_0$, are the
    estimates. Over a finite horizon they are the growth rates of the random
    directions, not $\frac1T\log\sigma_k(\partial y_N/\partial y_0)$
    (``lyapunov_exponents``): they depend on ``seed`` and differ from the limit by
    $O(1/T)$ (for a linear map $y \mapsto Ay$ with eigenvalue moduli $e^2, e^1$,
    ``pytest tests/test_analysis.py -k benettin`` measures 4.9e-2 at T = 10 and
    4.9e-3 at T = 100, where
    the finite-time exponents are within 1.3e-3 of the limit at T = 10). Unlike the
    exact method they stay finite and resolve every exponent over any horizon.

    Args:
        step: ``step(n, y) -> y``, differentiable in forward mode.
        times: the grid t_0 < ... < t_N (N steps).
        y0: the initial state (any shape; its size is the dimension).
        num: how many exponents (at most the dimension).
        seed: seeds the initial directions.
    """
    dim = _check_num(y0, num)
    q0, _ = jnp.linalg.qr(jr.normal(jr.key(seed), (dim, num), y0.dtype))
    times = jnp.asarray(times, y0.dtype)
    exponents, running = _benettin(step, times, y0, q0)
    # Over a short horizon the direction that stretches most need not be the first one
    # QR kept; sorted, the k-th estimate is the k-th largest.
    return Lyapunov(jnp.sort(exponents)[::-1], times[1:], running)


def model_lyapunov(
    transformer: ContinuousTransformer,
    u0,
    num: int = 4,
    *,
    key_mask=None,
    estimator: Callable[..., Lyapunov] = lyapunov_exponents,
) -> Lyapunov:
    """Finite-time Lyapunov exponents of the model's discrete flow from one input u0
    (N, d), over the whole depth, per unit time (a layer is one unit).

    ``estimator(step, times, y0, num)``: ``lyapunov_exponents`` (exact, the default),
    ``randomised_lyapunov_exponents`` (``functools.partial`` sets its options) for
    large states, or ``benettin_exponents`` (see ``model_benettin``).
    """
    if getattr(u0, "ndim", None) != 2:
        raise ValueError(
            f"model_lyapunov takes one input u0 of shape (N, d), got shape "
            f"{getattr(u0, 'shape', type(u0).__name__)}; for a batch, call it per input "
            "(the exponents of a batch as one state would be those of its most unstable "
            "member only)."
        )
    steps = StepMap(transformer, key_mask, u0.dtype)
    y0 = steps.transformer.initial_state(u0)
    return estimator(steps, steps.times, y0, num)


def model_benettin(
    transformer: ContinuousTransformer, u0, num: int = 4, *, key_mask=None, seed: int = 0
) -> Lyapunov:
    """Benettin's long-time estimate (``benettin_exponents``) on the model's discrete
    flow from one input u0 (N, d); over the model's depth it is not the finite-time
    exponents of ``model_lyapunov``."""
    return model_lyapunov(
        transformer,
        u0,
        num,
        key_mask=key_mask,
        estimator=functools.partial(benettin_exponents, seed=seed),
    )


def lyapunov_refinement(
    transformer: ContinuousTransformer,
    u0,
    steps_per_layer: Sequence[int] = (1, 2, 4, 8, 16),
    num: int = 4,
    *,
    estimator: Callable[..., Lyapunov] = lyapunov_exponents,
) -> dict:
    r"""The exponents as the step shrinks: per m, the exponents (``model_lyapunov``
    with ``estimator``) and their distance to those at the finest m (max over the
    ``num`` exponents), and the fitted slope of that distance against dt (the order at
    which they converge; the finest point is left out of the fit).

    Returns:
        A JSON-ready dict: ``steps_per_layer``, ``dt``, ``exponents`` (per m),
        ``distance_to_finest`` and ``slope``.
    """
    steps = sorted(int(m) for m in steps_per_layer)
    if len(steps) < 3:
        raise ValueError(f"A slope against the finest grid needs three step counts, got {steps}.")
    exps = [
        np.asarray(model_lyapunov(refine(transformer, m), u0, num, estimator=estimator).exponents)
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
