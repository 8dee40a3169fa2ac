"""The time grid: constant steps on the layer grid (stepping over the controls' jumps
where a solver would read them), its backward walk, and adaptive steps that stop at
the jumps."""

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from diffrax import RESULTS
from jaxtyping import Array, Bool, Float

from .._counts import whole_number
from ..controls import AbstractControl
from ..operators import wide_dtype
from ..splitting import AbstractSplittingSolver, inner_solver


def time_dtype(state_dtype) -> jnp.dtype:
    """The dtype of time, of the time grid and of the control index for a state of
    ``state_dtype``: at least float32 (float64 for a float64 state).

    Never the state's own dtype when that is narrower: bfloat16 has 8 significant bits,
    so on 64 layers x 4 steps a bfloat16 grid puts 31 of the 256 step midpoints on the
    neighbouring layer's controls, and 24 layers x 16 steps is not even increasing.
    """
    return wide_dtype(state_dtype)


# The most steps per layer a grid takes: each step is a layer's work, and the grid of L
# layers is L * steps_per_layer + 1 times built on the host (10^9 asked 15 GiB before a
# word was said, 10^8 grew past 3.6 GB for minutes).
MAX_STEPS_PER_LAYER = 2**20


def check_steps_per_layer(steps_per_layer) -> int:
    """``steps_per_layer``, after checking that it is a positive integer (not a bool)
    of at most ``MAX_STEPS_PER_LAYER``.

    Raises:
        ValueError: naming the value received.
    """
    m = whole_number(steps_per_layer)  # NumPy's from np.arange, a sweep's grid
    if m is None or m < 1:
        raise ValueError(f"steps_per_layer must be a positive integer, got {steps_per_layer!r}.")
    if m > MAX_STEPS_PER_LAYER:
        raise ValueError(
            f"steps_per_layer must be at most {MAX_STEPS_PER_LAYER} (2^20; each step is a "
            f"layer's work, and the step grid is built whole), got {m}."
        )
    return m


# The most steps a solve takes over all its layers (layers x steps per layer): the grid's
# times are built whole on the host, and an adaptive solve's max_steps is 512 times this.
MAX_SOLVE_STEPS = 2**24


def check_solve_steps(control: AbstractControl, steps_per_layer: int) -> int:
    """``steps_per_layer``, checked (``check_steps_per_layer``) and with the solve's
    steps over all of ``control``'s layers at most ``MAX_SOLVE_STEPS``.

    Raises:
        ValueError: naming the layers, the steps per layer and their product.
    """
    m = check_steps_per_layer(steps_per_layer)
    if control.num_layers * m > MAX_SOLVE_STEPS:
        raise ValueError(
            f"{control.num_layers} layers x steps_per_layer={m} is "
            f"{control.num_layers * m} steps, more than a solve takes "
            f"({MAX_SOLVE_STEPS} = 2^24): lower steps_per_layer."
        )
    return m


def time_grid(control: AbstractControl, steps_per_layer: int, dtype):
    """The step grid: ``steps_per_layer`` equal steps per piece of the layer grid, in
    ``time_dtype(dtype)`` for a state of ``dtype`` (at least float32), its points on the
    control's jumps exactly those jumps' times in that dtype (``grid_points``)."""
    steps_per_layer = check_solve_steps(control, steps_per_layer)
    times = grid_points(control, steps_per_layer)
    return jnp.asarray(times, time_dtype(dtype)), len(times) - 1


def grid_points(control: AbstractControl, steps_per_layer: int) -> np.ndarray:
    """The points of the constant-step grid in float64 (numpy, static), the points on
    the control's jumps set to the jumps' own times.

    Rounded to a narrower dtype, such a point is then the very float at which the
    control switches pieces (``PiecewiseConstant.index`` compares with the jumps in
    the time's dtype), and the float just below it, where ``StepOverJumps`` ends a
    step, reads the piece before. A grid computed in float32 instead (``linspace``)
    puts some of them 1 ulp off the jump: on 24 layers x 5 steps, 1.0000001 for 1, and
    every last stage of a layer read the next layer's controls.
    """
    t0, t1 = control.interval
    times = np.linspace(t0, t1, control.num_layers * steps_per_layer + 1)
    jumps = control.jump_ts
    if jumps is not None and np.size(jumps):
        jumps = np.asarray(jumps, np.float64)
        at, which = _on_jumps(times, jumps)
        times[at] = jumps[which]
    return times


def jump_flags(solver: diffrax.AbstractSolver, control: AbstractControl, times) -> np.ndarray:
    """Which points of the grid ``times`` (numpy) are jumps that ``solver`` must step
    over. Computed in numpy from the control's static jump times, so it is concrete
    under ``jit`` too."""
    inner = inner_solver(solver)
    jumps = control.jump_ts
    # Splitting schemes read the control once per step, at its midpoint, so a jump on
    # a step boundary is harmless. A Runge-Kutta stage at the end of a step reads it at
    # the boundary itself, where a piecewise-constant control already has the next
    # layer's value: step to just before each jump and restart just after it.
    flags = np.zeros(len(times), bool)
    if jumps is None or np.size(jumps) == 0 or isinstance(inner, AbstractSplittingSolver):
        return flags
    flags[_on_jumps(np.asarray(times, np.float64), np.asarray(jumps, np.float64))[0]] = True
    return flags


def _on_jumps(times: np.ndarray, jumps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(grid indices, jump indices)`` of the grid points (float64, evenly spaced) that
    lie on a jump, within rounding: each jump's nearest point, found from its position
    rather than by comparing every point with every jump."""
    t0, t1, n = times[0], times[-1], len(times) - 1
    nearest = np.clip(np.rint((jumps - t0) / (t1 - t0) * n).astype(np.int64), 0, n)
    close = np.abs(times[nearest] - jumps) <= 1e-9 * (t1 - t0)
    return nearest[close], np.nonzero(close)[0]


def jumps_stepped_over(
    solver: diffrax.AbstractSolver, control: AbstractControl, discretisation
) -> int:
    """How many of the control's jumps a forward solve steps over with ``made_jump``:
    after each, a first-same-as-last solver evaluates its first stage again. On the
    constant-step grid, the jumps ``constant_controller`` steps over; under the PID
    controller, each jump it is told of (``discretisation.jump_ts``)."""
    jumps = control.jump_ts
    if jumps is None or np.size(jumps) == 0:
        return 0
    if discretisation.is_adaptive:
        return int(np.size(jumps)) if discretisation.jump_ts else 0
    times = grid_points(control, discretisation.steps_per_layer)
    return int(jump_flags(solver, control, times).sum())


def constant_controller(
    solver: diffrax.AbstractSolver, control: AbstractControl, ts
) -> diffrax.AbstractStepSizeController:
    """``GridSteps`` on ``ts``, or ``StepOverJumps`` where ``solver`` would read a jump."""
    steps_per_layer = (ts.shape[0] - 1) // control.num_layers
    on_jump = jump_flags(solver, control, grid_points(control, steps_per_layer))
    if not on_jump.any():
        return GridSteps(ts=ts)
    return StepOverJumps(ts=ts, on_jump=jnp.asarray(on_jump))


class GridSteps(diffrax.AbstractStepSizeController):
    """Steps to the points of ``ts`` in turn, as diffrax's ``StepTo``, from ``ts[0]``.

    Unlike ``StepTo`` it checks nothing at run time: the grid is ``time_grid``'s, made
    strictly increasing from t0 to t1 (``time_dtype``), and ``solve`` starts at its first
    point. ``StepTo``'s two checks are ``equinox.error_if`` calls, host callbacks, and
    JAX never writes a program with a host callback to its persistent compilation
    cache: without them a training step is compiled once per machine, not once per
    process.

    Args:
        ts: the grid, strictly increasing, from the solve's t0 to its t1.
    """

    ts: Float[Array, " times"]

    def wrap(self, direction):
        return GridSteps(ts=self.ts * direction)

    def init(self, terms, t0, t1, y0, dt0, args, func, error_order):
        del terms, t0, t1, y0, args, func, error_order
        if dt0 is not None:
            raise ValueError("dt0 must be None: the grid determines the steps.")
        return self.ts[1], jnp.asarray(2)

    def adapt_step_size(
        self, t0, t1, y0, y1_candidate, args, y_error, error_order, controller_state
    ):
        del t0, y0, y1_candidate, args, y_error, error_order
        i = jnp.minimum(controller_state, self.ts.shape[0] - 1)
        return True, t1, self.ts[i], False, controller_state + 1, RESULTS.successful


class StepOverJumps(diffrax.AbstractStepSizeController):
    r"""``GridSteps`` on a grid, stepping over the control's jumps as diffrax's
    ``ClipStepSizeController(jump_ts=...)`` does for adaptive steps: a step that would
    end on a jump $t_j$ ends at the float just below it, and the next starts at the
    float just above it (with ``made_jump``, so first-same-as-last stages are
    recomputed). The control is then never evaluated at a jump.

    A solve may start at any point of the grid, not only at its first: the step that
    follows is found from where the solve (or the previous step) stands, never from a
    count carried in the controller's state. diffrax's ``BacksolveAdjoint`` needs this:
    with states saved inside the interval (a running cost on the grid's states) it
    solves backward one saved interval at a time, each a ``diffeqsolve`` from a saved
    time that is a point of this grid, carrying the controller's state over from the
    previous interval. A start on a jump first takes a step of one float's width past
    it (made over the jump, where the control is the other side's), so that the first
    full step reads the controls of its own piece only.

    Args:
        ts: the grid, strictly increasing, from t0 to t1.
        on_jump: which grid points are jumps (never the ends).
    """

    ts: Float[Array, " times"]
    on_jump: Bool[Array, " times"]

    def wrap(self, direction):
        return StepOverJumps(ts=self.ts * direction, on_jump=self.on_jump)

    def _end(self, i):
        """Where a step towards grid point ``i`` ends: just below it if it is a jump."""
        i = jnp.minimum(i, self.ts.shape[0] - 1)
        t = self.ts[i]
        return jnp.where(self.on_jump[i], jnp.nextafter(t, jnp.asarray(-jnp.inf, t.dtype)), t)

    def _nearest(self, t):
        """The grid point a time sits on: a step that ends just below a jump, or a
        start just above one, is on the jump's grid point."""
        return jnp.argmin(jnp.abs(self.ts - t))

    def init(self, terms, t0, t1, y0, dt0, args, func, error_order):
        del terms, t1, y0, args, func, error_order
        if dt0 is not None:
            raise ValueError("dt0 must be None: the grid determines the steps.")
        t0 = jnp.asarray(t0)
        i = self._nearest(t0)
        step_past_jump = jnp.nextafter(t0, jnp.asarray(jnp.inf, t0.dtype))
        return jnp.where(self.on_jump[i], step_past_jump, self._end(i + 1)), None

    def adapt_step_size(
        self, t0, t1, y0, y1_candidate, args, y_error, error_order, controller_state
    ):
        del t0, y0, y1_candidate, args, y_error, error_order, controller_state
        t1 = jnp.asarray(t1)
        i = self._nearest(t1)  # the grid point this step ended at (or just past)
        jump = self.on_jump[i]
        next_t0 = jnp.where(
            jump, jnp.maximum(jnp.nextafter(self.ts[i], jnp.asarray(jnp.inf, t1.dtype)), t1), t1
        )
        return True, next_t0, self._end(i + 1), jump, None, RESULTS.successful


class BackwardGrid(diffrax.AbstractStepSizeController):
    """The forward constant-step grid walked from t1 back to t0, for the backward solve of
    a continuous adjoint: the same steps, and over the control's jumps in the same way,
    so that no backward stage reads the neighbouring layer's controls either.

    The grid is held as static tuples and made into arrays only inside the solve: this
    controller lives in a model that is differentiated, and its times must carry no
    tangent.

    Args:
        times: the forward grid t0 < ... < t1.
        on_jump: which grid points are jumps of the control (stepped over).
        dtype: the dtype of the solve's times (``time_dtype``), whatever JAX's default
            float is (float64 under ``jax_enable_x64`` for a float32 model would mix).
    """

    times: tuple[float, ...] = eqx.field(static=True)
    on_jump: tuple[bool, ...] = eqx.field(static=True)
    dtype: str = eqx.field(static=True, default="float32")

    def _controller(self):
        # Not ``GridSteps`` even without jumps: a backward solve may start at any point of
        # the grid (see ``StepOverJumps``), which ``GridSteps`` does not (it starts at the first).
        return StepOverJumps(
            ts=jnp.asarray(self.times[::-1], self.dtype), on_jump=jnp.asarray(self.on_jump[::-1])
        )

    def wrap(self, direction):
        return self._controller().wrap(direction)

    def init(self, terms, t0, t1, y0, dt0, args, func, error_order):
        return self._controller().init(terms, t0, t1, y0, dt0, args, func, error_order)

    def adapt_step_size(self, *args, **kwargs):
        return self._controller().adapt_step_size(*args, **kwargs)


def backward_grid_controller(
    solver: diffrax.AbstractSolver, control: AbstractControl, steps_per_layer: int
) -> BackwardGrid:
    """``BackwardGrid`` for the constant-step grid of ``solver`` on ``control``, in the
    time dtype of a state of the control's dtype (as ``time_grid``)."""
    times = grid_points(control, steps_per_layer)
    jumps = jump_flags(solver, control, times)
    floats = [x.dtype for x in jax.tree.leaves(control) if eqx.is_inexact_array(x)]
    return BackwardGrid(
        times=tuple(float(t) for t in times),
        on_jump=tuple(bool(j) for j in jumps),
        dtype=jnp.dtype(time_dtype(floats[0] if floats else jnp.float32)).name,
    )


ADAPTIVE_STEPS_PER_LAYER: int = 512
"""The bound on accepted plus rejected adaptive steps per layer (``max_steps`` =
this * layers * steps_per_layer): twice what the README's example needs (tsit5 at
rtol 1e-8 on a 4-layer pre-LN model: 1044 steps, 613 of them rejected, about 260 per
layer), and a clear failure rather than a hang for a stiff field given to an explicit
solver."""


def adaptive_max_steps(control: AbstractControl, steps_per_layer: int = 1) -> int:
    """``max_steps`` for an adaptive controller, derived from the layer grid (a count
    diffrax keeps in int32: at most 2^31 - 1)."""
    steps = check_solve_steps(control, steps_per_layer)
    return min(ADAPTIVE_STEPS_PER_LAYER * control.num_layers * steps, 2**31 - 1)


def adaptive_controller(
    control: AbstractControl, rtol: float, atol: float, jump_ts: bool = True, dtype=None
) -> diffrax.AbstractAdaptiveStepSizeController:
    """A PID controller that steps onto every discontinuity of the control (unless
    ``jump_ts`` is False: then it is a bare PID controller); the jump times in ``dtype``,
    the dtype of the solve's times, as diffrax requires."""
    pid = diffrax.PIDController(rtol=rtol, atol=atol)
    jumps = control.jump_ts
    if not jump_ts or jumps is None or jumps.size == 0:  # e.g. a single layer
        return pid
    return diffrax.ClipStepSizeController(pid, jump_ts=jnp.asarray(jumps, dtype))
