r"""Parallel in depth: the layer grid cut into chunks, solved by parareal.

Time is depth, so a solve over $[t_0, T]$ can be parallel in time: the layers are cut
into $N$ chunks $[T_n, T_{n+1}]$ of $c = L / N$ layers each, an expensive fine
propagator $\mathcal{F}_n$ (the discretisation itself over chunk $n$) runs on every
chunk at once from guessed starting states, and a cheap coarse propagator
$\mathcal{G}_n$, run serially, carries the corrections from chunk to chunk.
"""

import abc
from collections.abc import Callable
from typing import ClassVar

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
    chunks: eqx.AbstractVar[int | None]
    mesh: eqx.AbstractVar[Mesh | None]

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
        a leading chunk axis on their values (``chunk_controls``)."""


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

    Gradients are reverse mode through the iterations (each chunk solve by the
    discretisation's gradient method, the coarse ones by backpropagation through the
    coarse scheme): at $K = N$ they are the serial solve's gradients to rounding; at
    $K < N$ they are the exact gradients of the parareal approximation, not a
    parareal solve of the costate.

    Args:
        coarse_stepper: the coarse time stepper (default ``Lie()``): any stepper the
            rules allow for the formulation, with the ``euler`` sub-solver for cheapness.
        coarse_steps: steps of the coarse grid over each chunk; it must divide the
            chunk's layers or be a multiple of them.
        iterations: K >= 1.
        chunks: N, dividing the number of layers (None: one chunk per layer).
        mesh: a ``jax.sharding.Mesh`` with a ``"depth"`` axis to split the chunks over
            (None: one device, ``vmap``).
    """

    name: ClassVar[str] = "parareal"
    coarse_stepper: diffrax.AbstractSolver
    coarse_steps: int = eqx.field(static=True)
    iterations: int = eqx.field(static=True)
    chunks: int | None = eqx.field(static=True)
    mesh: Mesh | None = eqx.field(static=True)

    def __init__(
        self,
        coarse_stepper: diffrax.AbstractSolver | None = None,
        *,
        coarse_steps: int = 1,
        iterations: int = 1,
        chunks: int | None = None,
        mesh: Mesh | None = None,
    ):
        self.coarse_stepper = Lie() if coarse_stepper is None else coarse_stepper
        self.coarse_steps = coarse_steps
        self.iterations = iterations
        self.chunks = chunks
        self.mesh = mesh

    def __check_init__(self):
        if not isinstance(self.coarse_stepper, diffrax.AbstractSolver):
            raise ValueError(
                "Parareal.coarse_stepper must be a splitting scheme or a diffrax solver, "
                f"got {type(self.coarse_stepper).__name__}."
            )
        _check_count("Parareal.coarse_steps", self.coarse_steps)
        _check_count("Parareal.iterations", self.iterations)
        if self.chunks is not None:
            _check_count("Parareal.chunks", self.chunks)
        if self.mesh is not None and DEPTH_AXIS not in self.mesh.shape:
            raise ValueError(
                f"Parareal.mesh must have a {DEPTH_AXIS!r} axis to split the chunks over, "
                f"got axes {tuple(self.mesh.shape)}."
            )

    def iterates(self, fine, coarse, fine_controls, coarse_controls, u0):
        fine_sweep = _parallel_sweep(fine, fine_controls, self.mesh)

        def coarse_sweep(correction):
            # U_{n+1} = G_n(U_n) + correction_n, serially; also returns G_n(U_n).
            def step(u, xs):
                values, corr = xs
                g = coarse(_piece(coarse_controls, values), u)
                nxt = g + corr
                return nxt, (g, nxt)

            _, (g, nxt) = jax.lax.scan(step, u0, (coarse_controls.values, correction))
            return jnp.concatenate([u0[None], nxt]), g

        num = jtu.tree_leaves(fine_controls.values)[0].shape[0]
        states, g = coarse_sweep(jnp.zeros((num, *u0.shape), u0.dtype))

        def iteration(carry, _):
            states, g = carry
            states, g = coarse_sweep(fine_sweep(states[:-1]) - g)
            return (states, g), states

        _, history = jax.lax.scan(iteration, (states, g), length=self.iterations)
        return jnp.concatenate([states[None], history])


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
    # mesh axis, in jax 0.10 and equinox 0.13.)
    chunked = NamedSharding(mesh, P(DEPTH_AXIS))

    def split(tree):
        return jtu.tree_map(lambda x: jax.lax.with_sharding_constraint(x, chunked), tree)

    return lambda states: split(sweep(arrays, split(controls.values), split(states)))


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


DEPTH_PARALLEL: dict[str, Callable[..., AbstractDepthParallel]] = {Parareal.name: Parareal}
"""Depth-parallel solves by name; each is constructible with no arguments or with the
coarse stepper and the keywords ``coarse_steps``, ``iterations`` and ``chunks``."""
