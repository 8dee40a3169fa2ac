r"""Parallel in depth: the layer grid cut into chunks, solved by parareal or MGRIT.

Time is depth, so a solve over $[t_0, T]$ can be parallel in time: the layers are cut
into $N$ chunks $[T_n, T_{n+1}]$ of $c = L / N$ layers each, an expensive fine
propagator $\mathcal{F}_n$ (the discretisation itself over chunk $n$) runs on every
chunk at once from guessed starting states, and a cheap coarse propagator
$\mathcal{G}_n$, run serially, carries the corrections from chunk to chunk.

Both methods solve a recursion $U_{n+1} = \mathcal{F}_n(U_n) + s_n$ from $U_0$
(``Recursion``): the forward solve has no sources $s_n$; the costate's linear backward
recursion, run from the last chunk to the first, has the loss's cotangents as sources.
"""

import abc
import functools
from collections.abc import Callable
from typing import Any, ClassVar, Literal, NamedTuple, get_args

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxtyping import Array, Float

from .._custom_types import State
from ..controls import AbstractControl, LayerParams, PiecewiseConstant
from ..splitting import Lie

DEPTH_AXIS: str = "depth"
"""The mesh axis over which the chunks of a depth-parallel solve are split."""

Propagator = Callable[[AbstractControl, State], State]
"""A propagator over one chunk: ``(the chunk's control, u(T_n)) -> u(T_{n+1})``."""

Relaxation = Literal["F", "FCF"]
RELAXATIONS: tuple[str, ...] = get_args(Relaxation)
"""MGRIT's relaxations: F (parareal) or FCF."""

Costate = Literal["reverse", "parallel"]
COSTATES: tuple[str, ...] = get_args(Costate)
"""How the gradient of a depth-parallel solve is found: reverse mode through its
iterations, or the costate solved by the same depth-parallel iteration."""


class Recursion(NamedTuple):
    r"""$U_0$ = ``start``, $U_{n+1} = \mathcal{F}_n(U_n) + s_n$ for $n < N$, with a
    coarse propagator $\mathcal{G}_n \approx \mathcal{F}_n$.

    Attributes:
        fine: every chunk's fine propagator at once, ``(U_0..U_{N-1}) ->
            (F_0(U_0)..F_{N-1}(U_{N-1}))`` (stacked on a leading chunk axis).
        coarse: one chunk's coarse propagator, ``(xs[n], U_n) -> G_n(U_n)``.
        xs: what ``coarse`` reads of each chunk, with a leading chunk axis.
        start: $U_0$.
        sources: $s_n$ stacked on a leading chunk axis, or None (no sources).
    """

    fine: Callable[[Array], Array]
    coarse: Callable[[Any, Array], Array]
    xs: Any
    start: Array
    sources: Array | None


def _plus(x: Array, sources: Array | None) -> Array:
    return x if sources is None else x + sources


def _coarse_sweep(r: Recursion, rhs: Array) -> tuple[Array, Array]:
    r"""$V_0 = U_0$, $V_{n+1} = \mathcal{G}_n(V_n) + \mathrm{rhs}_n$, serially (one
    ``lax.scan`` over the chunks): every $V_n$ and every $\mathcal{G}_n(V_n)$."""

    def step(u, x):
        xs, extra = x
        g = r.coarse(xs, u)
        nxt = g + extra
        return nxt, (g, nxt)

    _, (g, nxt) = jax.lax.scan(step, r.start, (r.xs, rhs))
    return jnp.concatenate([r.start[None], nxt]), g


def _sources(r: Recursion) -> Array:
    n = jtu.tree_leaves(r.xs)[0].shape[0]
    return jnp.zeros((n, *r.start.shape), r.start.dtype) if r.sources is None else r.sources


def _check_count(name: str, value, minimum: int = 1) -> None:
    if not (isinstance(value, int) and not isinstance(value, bool) and value >= minimum):
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}.")


class AbstractDepthParallel(eqx.Module):
    """How a solve is made parallel in depth: a value of the discretisation
    (``Discretisation(depth_parallel=...)``), like the gradient method; the model and
    the training loop never branch on which one it is."""

    name: ClassVar[str]
    coarse_stepper: eqx.AbstractVar[diffrax.AbstractSolver]
    coarse_steps: eqx.AbstractVar[int]
    iterations: eqx.AbstractVar[int]
    chunks: eqx.AbstractVar[int | None]
    mesh: eqx.AbstractVar[Mesh | None]
    relaxation: eqx.AbstractVar[Relaxation]
    costate: eqx.AbstractVar[Costate]

    def num_chunks(self, num_layers: int) -> int:
        """The number of chunks N on ``num_layers`` layers (None: one per layer).

        Raises:
            ValueError: N does not divide the layers, or the mesh's ``depth`` axis does
                not divide N.
        """
        n = num_layers if self.chunks is None else self.chunks
        if num_layers % n:
            raise ValueError(
                f"depth_parallel.chunks={n} must divide the {num_layers} layers (each "
                "chunk is a whole number of layers); choose a divisor of the layer count."
            )
        devices = 1 if self.mesh is None else int(self.mesh.shape[DEPTH_AXIS])
        if n % devices:
            raise ValueError(
                f"the mesh's {DEPTH_AXIS!r} axis of {devices} devices must divide the {n} "
                "chunks (each device sweeps an equal number of them); choose a divisor."
            )
        return n

    @abc.abstractmethod
    def solve(self, recursion: Recursion) -> Float[Array, "iterations chunks_plus_one ..."]:
        """$U^k_0, \\dots, U^k_N$ of ``recursion`` for $k = 0, \\dots, K$: iteration 0
        is the coarse guess, $U^0_{n+1} = \\mathcal{G}_n(U^0_n) + s_n$."""

    def iterates(
        self,
        fine: Propagator,
        coarse: Propagator,
        fine_controls: PiecewiseConstant,
        coarse_controls: PiecewiseConstant,
        u0: State,
    ) -> Float[Array, "iterations chunks_plus_one *batch N d"]:
        """The states at the chunk boundaries $T_0, \\dots, T_N$ after each iteration
        (iteration 0 is the coarse guess); the last entry of the last iteration is
        u(T). ``fine_controls`` and ``coarse_controls`` hold each chunk's control with
        a leading chunk axis on their values (``chunk_controls``).

        With ``costate="parallel"`` only the last iteration is differentiable, by the
        costate's depth-parallel solve (``_costate_solve``); the earlier ones are the
        solver's intermediate values and carry no gradient."""
        if self.costate == "reverse":
            return self.solve(_forward(fine, coarse, fine_controls, coarse_controls, u0, self.mesh))
        diff, nondiff = eqx.partition(fine, eqx.is_inexact_array)
        # Only the first argument of a custom VJP is differentiated: the coarse
        # propagator and its controls (the layer means of the fine ones) steer the
        # iteration and get no gradient of their own.
        fixed = jax.lax.stop_gradient((coarse, fine_controls, coarse_controls))
        history = _costate_solve((diff, fine_controls.values, u0), self, nondiff, *fixed)
        return jnp.concatenate([jax.lax.stop_gradient(history[:-1]), history[-1:]])


class Parareal(AbstractDepthParallel):
    r"""Parareal (Lions, Maday, Turinici 2001) over the layer grid.

    With $U^k_n$ the state at chunk boundary $T_n$ after $k$ iterations,
    $U^k_0 = u_0$, the coarse guess $U^0_{n+1} = \mathcal{G}_n(U^0_n)$ and

    $$U^{k+1}_{n+1} = \mathcal{G}_n(U^{k+1}_n) + \mathcal{F}_n(U^k_n)
        - \mathcal{G}_n(U^k_n), \qquad k = 0, \dots, K - 1.$$

    The $N$ fine solves $\mathcal{F}_n(U^k_n)$ of an iteration are independent: they run
    at once (``jax.vmap`` over the chunks; when ``mesh`` is given, the chunk axis is
    split over its ``depth`` axis of $D$ devices, each running the solves of $N / D$
    chunks). The
    coarse sweep is serial (a ``lax.scan`` over the chunks); $\mathcal{G}_n(U^k_n)$ is
    the previous sweep's, so an iteration costs one parallel fine sweep and one coarse
    sweep. By induction $U^k_n$ is the serial solve's state for $n \le k$: after
    $K = N$ iterations parareal returns the serial $u(T)$ to rounding, and for a coarse
    propagator close to the fine one the error falls by a factor of order
    $\|\mathcal{F} - \mathcal{G}\|$ per iteration (Gander and Vandewalle 2007).

    The fine propagator $\mathcal{F}_n$ is the discretisation itself over chunk $n$:
    with the ``Lie`` scheme at one step per layer it is $c$ layers of the Transformer.
    The coarse propagator $\mathcal{G}_n$ takes ``coarse_steps`` equal steps of
    ``coarse_stepper`` over the chunk. When it steps over several layers at once, each
    coarse step uses the mean of those layers' controls (a piecewise-constant control
    on the coarse grid), so that no layer is skipped; a splitting scheme would read only
    the layer at the step's midpoint.

    Gradients (``costate="reverse"``) are reverse mode through the iterations (each
    chunk solve by the discretisation's gradient method, the coarse ones by
    backpropagation through the coarse scheme): at $K = N$ they are the serial solve's
    gradients to rounding; at $K < N$ they are the exact gradients of the parareal
    approximation. With ``costate="parallel"`` the costate's linear backward recursion
    is solved by $K$ parareal iterations as well (``_costate_solve``), linearised at
    the last forward iterate: at $K = N$ the serial gradients to rounding again, at
    $K < N$ an approximation of them.

    Args:
        coarse_stepper: the coarse time stepper (default ``Lie()``): any stepper the
            rules allow for the formulation, with the ``euler`` sub-solver for cheapness.
        coarse_steps: steps of the coarse grid over each chunk; it must divide the
            chunk's layers or be a multiple of them.
        iterations: K >= 1.
        chunks: N, dividing the number of layers (None: one chunk per layer).
        mesh: a ``jax.sharding.Mesh`` with a ``"depth"`` axis to split the chunks over
            (None: one device, ``vmap``).
        relaxation: ``"F"`` only (parareal is MGRIT with F-relaxation).
        costate: ``"reverse"`` (reverse mode through the iterations) or
            ``"parallel"`` (the costate solved by parareal too: a custom VJP).
    """

    name: ClassVar[str] = "parareal"
    coarse_stepper: diffrax.AbstractSolver
    coarse_steps: int = eqx.field(static=True)
    iterations: int = eqx.field(static=True)
    chunks: int | None = eqx.field(static=True)
    mesh: Mesh | None = eqx.field(static=True)
    relaxation: Relaxation = eqx.field(static=True)
    costate: Costate = eqx.field(static=True)

    def __init__(
        self,
        coarse_stepper: diffrax.AbstractSolver | None = None,
        *,
        coarse_steps: int = 1,
        iterations: int = 1,
        chunks: int | None = None,
        mesh: Mesh | None = None,
        relaxation: Relaxation = "F",
        costate: Costate = "reverse",
    ):
        self.coarse_stepper = Lie() if coarse_stepper is None else coarse_stepper
        self.coarse_steps = coarse_steps
        self.iterations = iterations
        self.chunks = chunks
        self.mesh = mesh
        self.relaxation = relaxation
        self.costate = costate

    def __check_init__(self):
        _check_fields(self, "Parareal")
        if self.relaxation != "F":
            raise ValueError(
                f"Parareal is MGRIT with F-relaxation; got relaxation={self.relaxation!r}. "
                "Use MGRIT(relaxation='FCF') for FCF-relaxation."
            )

    def solve(self, recursion):
        r = recursion
        sources = _sources(r)
        states, g = _coarse_sweep(r, sources)

        def iteration(carry, _):
            # U^{k+1}_{n+1} = G_n(U^{k+1}_n) + F_n(U^k_n) + s_n - G_n(U^k_n), where
            # G_n(U^k_n) is the previous sweep's.
            states, g = carry
            states, g = _coarse_sweep(r, r.fine(states[:-1]) + sources - g)
            return (states, g), states

        _, history = jax.lax.scan(iteration, (states, g), length=self.iterations)
        return jnp.concatenate([states[None], history])


class MGRIT(AbstractDepthParallel):
    r"""Two-level MGRIT (Falgout et al., SIAM J. Sci. Comput. 2014) over the layer grid.

    The fine grid is the layer boundaries, the coarse grid (the C-points) the chunk
    boundaries $T_n$; the coarsening factor is the $c$ layers of a chunk, whose
    interior layer boundaries are the F-points. One iteration from the C-point values
    $U_n$:

    - F-relaxation: the fine propagator from each C-point across its chunk, to the
      last F-point before $T_{n+1}$ (every chunk at once);
    - with ``relaxation="FCF"``, first a C-relaxation, $U_{n+1} \leftarrow$ one fine
      layer from that F-point, i.e. $U_{n+1} \leftarrow \mathcal{F}_n(U_n) + s_n$
      (every chunk at once), and a second F-relaxation from the new C-points;
    - the coarse-grid correction in FAS form: the fine residual at the C-points,
      $r_{n+1} = \mathcal{F}_n(U_n) + s_n - U_{n+1}$ (the last fine layer of each
      chunk from its F-point), restricted by injection; the coarse equation
      $V_{n+1} - \mathcal{G}_n(V_n) = U_{n+1} - \mathcal{G}_n(U_n) + r_{n+1}$, $V_0 = U_0$,
      solved by one serial coarse sweep; and $U_n \leftarrow V_n$ (the correction
      $V_n - U_n$ added at the C-points; the F-points follow in the next
      F-relaxation).

    An F-relaxation followed by the last fine layer of the chunk is the fine chunk
    propagator $\mathcal{F}_n$, so both are one fine solve per chunk; the F-points
    are that solve's interior states and are never stored.

    With F-relaxation the update is $U^{k+1}_{n+1} = \mathcal{G}_n(U^{k+1}_n) +
    \mathcal{F}_n(U^k_n) + s_n - \mathcal{G}_n(U^k_n)$: parareal (Gander and
    Vandewalle 2007), to rounding. FCF is parareal applied to the C-relaxed values
    $\tilde U_{n+1} = \mathcal{F}_n(U^k_n) + s_n$: each iteration extends the exact
    C-points by two chunks instead of one, so from the coarse guess (exact at $n = 0$)
    $U^k_n$ is the serial state for $n \le 2k$, and $K = \lceil N / 2\rceil$
    iterations give the serial $u(T)$. An FCF iteration costs two fine sweeps (and a
    parallel coarse one for $\mathcal{G}_n(\tilde U_n)$), an F iteration one.

    Args:
        coarse_stepper, coarse_steps, iterations, chunks, mesh, costate: as for
            ``Parareal`` (``costate="parallel"``: the costate solved by MGRIT too).
        relaxation: ``"F"`` or ``"FCF"``.
    """

    name: ClassVar[str] = "mgrit"
    coarse_stepper: diffrax.AbstractSolver
    coarse_steps: int = eqx.field(static=True)
    iterations: int = eqx.field(static=True)
    chunks: int | None = eqx.field(static=True)
    mesh: Mesh | None = eqx.field(static=True)
    relaxation: Relaxation = eqx.field(static=True)
    costate: Costate = eqx.field(static=True)

    def __init__(
        self,
        coarse_stepper: diffrax.AbstractSolver | None = None,
        *,
        coarse_steps: int = 1,
        iterations: int = 1,
        chunks: int | None = None,
        mesh: Mesh | None = None,
        relaxation: Relaxation = "F",
        costate: Costate = "reverse",
    ):
        self.coarse_stepper = Lie() if coarse_stepper is None else coarse_stepper
        self.coarse_steps = coarse_steps
        self.iterations = iterations
        self.chunks = chunks
        self.mesh = mesh
        self.relaxation = relaxation
        self.costate = costate

    def __check_init__(self):
        _check_fields(self, "MGRIT")
        if self.relaxation not in RELAXATIONS:
            raise ValueError(
                f"MGRIT.relaxation must be one of {', '.join(map(repr, RELAXATIONS))}, "
                f"got {self.relaxation!r}."
            )

    def solve(self, recursion):
        r = recursion
        sources = _sources(r)
        every_coarse = jax.vmap(r.coarse)

        def fine_and_c(states):
            # F-relaxation and the last fine layer of each chunk: F_n(U_n) + s_n.
            return r.fine(states[:-1]) + sources

        def iteration(carry, _):
            states, g = carry  # g = G_n(U_n), from the coarse sweep that made U
            if self.relaxation == "FCF":
                states = jnp.concatenate([r.start[None], fine_and_c(states)])
                g = every_coarse(r.xs, states[:-1])
            residual = fine_and_c(states) - states[1:]
            states, g = _coarse_sweep(r, states[1:] - g + residual)
            return (states, g), states

        states, g = _coarse_sweep(r, sources)
        _, history = jax.lax.scan(iteration, (states, g), length=self.iterations)
        return jnp.concatenate([states[None], history])


def _check_fields(method: AbstractDepthParallel, owner: str) -> None:
    if not isinstance(method.coarse_stepper, diffrax.AbstractSolver):
        raise ValueError(
            f"{owner}.coarse_stepper must be a splitting scheme or a diffrax solver, "
            f"got {type(method.coarse_stepper).__name__}."
        )
    _check_count(f"{owner}.coarse_steps", method.coarse_steps)
    _check_count(f"{owner}.iterations", method.iterations)
    if method.chunks is not None:
        _check_count(f"{owner}.chunks", method.chunks)
    if method.costate not in COSTATES:
        raise ValueError(
            f"{owner}.costate must be one of {', '.join(map(repr, COSTATES))}, got "
            f"{method.costate!r}."
        )
    if method.mesh is not None and DEPTH_AXIS not in method.mesh.shape:
        raise ValueError(
            f"{owner}.mesh must have a {DEPTH_AXIS!r} axis to split the chunks over, "
            f"got axes {tuple(method.mesh.shape)}."
        )


def _piece(template: PiecewiseConstant, values: LayerParams) -> PiecewiseConstant:
    """The control of one chunk: ``template``'s interval with one chunk's ``values``."""
    return PiecewiseConstant(values, template.t0, template.t1)


def _parallel_sweep(propagate: Propagator, controls: PiecewiseConstant, mesh: Mesh | None):
    """``states -> [propagate(control_n, states[n]) for every chunk n]``, all at once."""

    arrays, static = eqx.partition(propagate, eqx.is_array)

    def sweep(arrays, values, states):
        one = eqx.combine(arrays, static)
        return jax.vmap(lambda v, u: one(_piece(controls, v), u))(values, states)

    if mesh is None:
        return lambda states: sweep(arrays, controls.values, states)
    # The chunk axis of the controls, the starting states and the end states is split
    # over the mesh's depth axis, and XLA partitions the vmapped solves along it: each
    # device runs the fine solves of its own chunks, and the end states are gathered for
    # the serial coarse sweep. (Not ``shard_map``: inside it, reverse mode through
    # diffrax's checkpointed step loop fails equinox's closure check on the varying
    # mesh axis, in jax 0.10 and equinox 0.13.) The other axes are left to XLA, so that
    # on a training mesh the batch stays split over ``data`` and the controls over
    # ``model``.
    split = _split_chunks(mesh)
    return lambda states: split(sweep(arrays, split(controls.values), split(states)))


def _forward(fine, coarse, fine_controls, coarse_controls, u0, mesh) -> Recursion:
    r"""The forward solve as a recursion: $U_{n+1} = \mathcal{F}_n(U_n)$ from $u_0$."""
    return Recursion(
        fine=_parallel_sweep(fine, fine_controls, mesh),
        coarse=lambda values, u: coarse(_piece(coarse_controls, values), u),
        xs=coarse_controls.values,
        start=u0,
        sources=None,
    )


def _split_chunks(mesh: Mesh | None):
    """Constrain a tree's leading (chunk) axis to the mesh's depth axis (identity
    without a mesh), leaving the other axes to XLA."""
    if mesh is None:
        return lambda tree: tree

    def one(x):
        spec = P(DEPTH_AXIS, *([P.UNCONSTRAINED] * (x.ndim - 1)))
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

    return lambda tree: jtu.tree_map(one, tree)


@eqx.filter_custom_vjp
def _costate_solve(vjp_arg, method, nondiff, coarse, fine_controls, coarse_controls):
    r"""The forward iterates of ``method``, differentiated through the costate.

    With $U_n$ the last iterate's boundary states, the serial solve's gradient is
    found from the linear backward recursion $P_N = \bar U_N$,
    $P_n = \mathcal{F}_n'(U_n)^\top P_{n+1} + \bar U_n$ ($\bar U_n$: the cotangents
    of the boundary states). Run from the last chunk to the first, it is a
    ``Recursion`` with sources, solved by ``method`` itself: fine, the VJP of every
    chunk's fine propagator at once (linearised once, at $U_n$); coarse, the VJP of
    the coarse propagator, serially. The controls' gradient is each chunk's fine VJP
    with respect to its controls at the converged $P_{n+1}$; u0's is $P_0$. The coarse
    propagator only steers the iteration and gets no gradient.
    """
    return _costate_primal(vjp_arg, method, nondiff, coarse, fine_controls, coarse_controls)


def _costate_primal(vjp_arg, method, nondiff, coarse, fine_controls, coarse_controls):
    diff, values, u0 = vjp_arg
    fine = eqx.combine(diff, nondiff)
    controls = _piece(fine_controls, values)
    return method.solve(_forward(fine, coarse, controls, coarse_controls, u0, method.mesh))


@_costate_solve.def_fwd
def _costate_solve_fwd(perturbed, vjp_arg, method, nondiff, coarse, fine_controls, coarse_controls):
    del perturbed
    history = _costate_primal(vjp_arg, method, nondiff, coarse, fine_controls, coarse_controls)
    return history, history[-1]


@_costate_solve.def_bwd
def _costate_solve_bwd(
    states,
    grad_history,
    perturbed,
    vjp_arg,
    method,
    nondiff,
    coarse,
    fine_controls,
    coarse_controls,
):
    del perturbed
    diff, values, _ = vjp_arg
    # Only the last iterate is differentiable (``iterates`` stops the others).
    bar = jnp.zeros_like(states) if grad_history is None else grad_history[-1]
    split = _split_chunks(method.mesh)

    def chunk(diff, v, u):
        return eqx.combine(diff, nondiff)(_piece(fine_controls, v), u)

    # Every chunk's fine VJP, linearised once at U_n: a pytree of residuals with a
    # leading chunk axis, applied to a new P_{n+1} at every iteration.
    pullbacks = jax.vmap(lambda v, u: jax.vjp(chunk, diff, v, u)[1])(
        split(values), split(states[:-1])
    )

    def pull(p_next):
        return jax.vmap(lambda f, p: f(p))(pullbacks, split(p_next))

    flip = functools.partial(jnp.flip, axis=0)

    def coarse_pull(xs, q):
        v, u = xs
        return jax.vjp(lambda u: coarse(_piece(coarse_controls, v), u), u)[1](q)[0]

    # The backward recursion in reversed chunk order: Q_m = P_{N-m}.
    backward = Recursion(
        fine=lambda q: flip(split(pull(flip(q))[2])),
        coarse=coarse_pull,
        xs=jtu.tree_map(flip, (coarse_controls.values, states[:-1])),
        start=bar[-1],
        sources=flip(bar[:-1]),
    )
    costate = flip(method.solve(backward)[-1])  # P_0, ..., P_N
    grad_diff, grad_values, _ = pull(costate[1:])
    grad_diff = jtu.tree_map(lambda g: jnp.sum(g, axis=0), grad_diff)
    return grad_diff, grad_values, costate[0]


def _layer_mean(values: LayerParams, chunks: int, pieces: int) -> LayerParams:
    """``values`` (leading axis: the L layers) as ``chunks`` x ``pieces`` means of
    consecutive layers."""

    def one(x):
        grouped = x.reshape(chunks, pieces, x.shape[0] // (chunks * pieces), *x.shape[1:])
        return grouped.mean(axis=2)

    return jtu.tree_map(one, values)


def chunk_controls(
    control: AbstractControl, chunks: int, coarse_steps: int
) -> tuple[PiecewiseConstant, PiecewiseConstant, int]:
    """Each chunk's fine and coarse controls, and the coarse steps per piece of the
    coarse control.

    The fine control of chunk n is the layers of chunk n; the coarse one has
    ``coarse_steps`` pieces (the layer means of each coarse step) when that divides
    the chunk's layers, else the chunk's layers. Both are shifted to start at time 0:
    the values of a chunk are traced under ``vmap`` while the times
    of a control are static, and with piecewise-constant controls the equation depends
    on time only through them, so the shift changes nothing but the rounding of the
    grid.

    Raises:
        ValueError: a control that is not piecewise constant, or ``coarse_steps`` that
            neither divides the chunk's layers nor is a multiple of them.
    """
    if not isinstance(control, PiecewiseConstant):
        raise ValueError(
            "a depth-parallel solve cuts the layers of a piecewise-constant control into "
            f"chunks; got {type(control).__name__}. Use controls.kind=piecewise_constant, "
            "or depth_parallel=None."
        )
    layers = control.num_layers
    per_chunk = layers // chunks
    width = (control.t1 - control.t0) / layers
    fine = jtu.tree_map(lambda x: x.reshape(chunks, per_chunk, *x.shape[1:]), control.values)
    if per_chunk % coarse_steps == 0:
        coarse_values, steps_per_piece = _layer_mean(control.values, chunks, coarse_steps), 1
    elif coarse_steps % per_chunk == 0:
        coarse_values, steps_per_piece = fine, coarse_steps // per_chunk
    else:
        raise ValueError(
            f"depth_parallel.coarse_steps={coarse_steps} must divide the {per_chunk} "
            f"layers of a chunk or be a multiple of them ({layers} layers in {chunks} "
            "chunks)."
        )
    span = per_chunk * width
    return (
        PiecewiseConstant(fine, 0.0, span),
        PiecewiseConstant(coarse_values, 0.0, span),
        steps_per_piece,
    )


DEPTH_PARALLEL: dict[str, Callable[..., AbstractDepthParallel]] = {
    Parareal.name: Parareal,
    MGRIT.name: MGRIT,
}
"""Depth-parallel solves by name; each is constructible with no arguments or with the
coarse stepper and the keywords ``coarse_steps``, ``iterations``, ``chunks``, ``mesh``,
``relaxation`` (parareal: ``"F"`` only) and ``costate``."""
