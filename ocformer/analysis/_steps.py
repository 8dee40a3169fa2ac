r"""One step of a model's discretisation as a function: $u_{n+1} = \Psi_n(u_n)$.

The costate, the per-time gradient density and the Lyapunov exponents all need the
discrete flow piece by piece (its linearisation around the saved trajectory, step by
step), which one ``diffeqsolve`` over the whole interval does not expose. ``StepMap``
takes one step of the model's own time stepper on the model's own grid: the same
terms, the same bound solver, the same control evaluations (stepping over the
control's jumps as the grid does), so that chaining it from u(0) reproduces the states
of ``ContinuousTransformer.trajectory`` to rounding (``tests/test_analysis.py`` checks
1e-12).
"""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from ..controls import AbstractControl, LayerParams
from ..dynamics import AbstractSplitTerm, DynamicsArgs, project_onto_set
from ..integration import bind_solver, grid_points, jump_flags, time_grid
from ..models import ContinuousTransformer
from ..operators import wide_dtype
from ..splitting import AbstractSplittingSolver, Lie, Strang, inner_solver, with_bounded_stages


class ShiftedControl(AbstractControl):
    r"""$\theta(t) + \delta$: a control moved by a constant ``delta`` (the perturbation
    whose gradient over one step is the gradient density at that step)."""

    base: AbstractControl
    delta: LayerParams

    def __call__(self, t) -> LayerParams:
        return jax.tree.map(jnp.add, self.base(t), self.delta)

    def derivative(self, t) -> LayerParams:
        return self.base.derivative(t)

    @property
    def interval(self) -> tuple[float, float]:
        return self.base.interval

    @property
    def jump_ts(self):
        return self.base.jump_ts

    @property
    def num_layers(self) -> int:
        return self.base.num_layers


class _Calls:
    """Counts sub-flow calls while one step is traced (see ``_NudgedTerm``)."""

    def __init__(self):
        self.n = 0


class _NudgedTerm(AbstractSplitTerm):
    r"""A split term whose k-th sub-flow output (k counted over every term of one step,
    in the order the scheme calls them) is moved by ``deltas[k]``.

    Lie and Strang call the sub-flows one after the other, and ``substates`` records
    exactly their outputs in that order; the gradient of J w.r.t. ``deltas[k]`` at zero
    is therefore the costate at the k-th sub-state. The count is Python state during
    tracing, reset before each traced step.
    """

    term: AbstractSplitTerm
    deltas: Array
    calls: _Calls = eqx.field(static=True)

    def vf(self, t, y, args):
        return self.term.vf(t, y, args)

    def flow(self, theta, dt, u, args, sub_solver):
        k = self.calls.n
        self.calls.n += 1
        return self.term.flow(theta, dt, u, args, sub_solver) + self.deltas[k]

    def flow_order(self, sub_solver):
        return self.term.flow_order(sub_solver)


class StepMap(eqx.Module):
    """The steps of ``transformer``'s discretisation, one at a time.

    Args:
        transformer: a ``ContinuousTransformer`` with constant steps (its arrays in the
            dtype of the states it will step).
        key_mask: the key-padding mask of the solve, if any.
        dtype: the dtype of the states (the grid is built in it).

    Raises:
        ValueError: adaptive step sizes (``stepsize="pid"``), whose grid depends on the
            state.
    """

    transformer: ContinuousTransformer
    key_mask: Bool[Array, "*batch N"] | None
    starts: Float[Array, " steps"]
    ends: Float[Array, " steps"]

    def __init__(self, transformer: ContinuousTransformer, key_mask=None, dtype=jnp.float64):
        if jnp.dtype(dtype) != wide_dtype(dtype):
            raise ValueError(
                f"The step-by-step analyses run in one dtype of float32 or wider (states "
                f"and controls alike); the input is {jnp.dtype(dtype)}, which a model "
                "computes with a float32 state. Cast it, u0.astype(jnp.float32), to "
                "analyse the model's dynamics in float32."
            )
        if transformer.discretisation.is_adaptive:
            raise ValueError(
                "The step-by-step analyses need constant steps; the model has "
                "stepsize='pid'. Use ocformer.models.rediscretise(model, "
                "stepsize='constant')."
            )
        self.transformer = jax.tree.map(
            lambda x: x.astype(dtype) if eqx.is_inexact_array(x) else x, transformer
        )
        transformer = self.transformer
        self.key_mask = key_mask
        ts, _ = time_grid(transformer.control, transformer.steps_per_layer, dtype)
        starts, ends = ts[:-1], ts[1:]
        # As the grid's StepOverJumps: a Runge-Kutta step that would end on a jump of a
        # piecewise-constant control ends just below it and the next starts just above,
        # so no stage reads the next layer's control. Splitting schemes read the control
        # at the step's midpoint and need nothing.
        points = grid_points(transformer.control, transformer.steps_per_layer)
        on_jump = jump_flags(self._inner(), transformer.control, points)
        if on_jump.any():
            on_jump = jnp.asarray(on_jump)
            ends = jnp.where(on_jump[1:], jnp.nextafter(ends, -jnp.inf), ends)
            starts = jnp.where(on_jump[:-1], jnp.nextafter(starts, jnp.inf), starts)
        self.starts, self.ends = starts, ends

    def _inner(self):
        stepper = self.transformer.time_stepper()
        return inner_solver(stepper)

    @property
    def num_steps(self) -> int:
        return int(self.starts.shape[0])

    @property
    def times(self) -> Float[Array, " steps+1"]:
        """The nominal grid t_0 < ... < t_N."""
        return jnp.concatenate([self.starts[:1], self.ends])

    def __call__(self, n, y, control: AbstractControl | None = None):
        """u_{n+1} from u_n = ``y`` (step ``n``, an integer or a traced index), with
        ``control`` in place of the model's (the same control moved by a constant, for
        the gradient density)."""
        model = self.transformer
        terms = model.terms()
        # Forward mode (the Lyapunov exponents) and reverse mode (the costates).
        stepper = bind_solver(with_bounded_stages(model.time_stepper()), terms)
        args = DynamicsArgs(
            control=model.control if control is None else control, key_mask=self.key_mask
        )
        t0, t1 = self.starts[n], self.ends[n]
        state = stepper.init(terms, t0, t1, y, args)
        # made_jump: first-same-as-last solvers recompute their first stage, as after a
        # jump; for a continuous field this is the value they would have carried.
        y1, _, _, _, _ = stepper.step(terms, t0, t1, y, args, state, True)
        return y1

    def num_substates(self) -> int:
        """The number of sub-flows of one step (Lie, Strang), plus the closing
        projection of the projected formulation."""
        terms = self.transformer.terms()
        inner = self._inner()
        if not isinstance(inner, Lie | Strang):
            raise ValueError(
                "Sub-step costates need a sequential splitting scheme (Lie or Strang), "
                f"got {type(inner).__name__}; use substeps=False."
            )
        k = len(terms.terms)  # pyright: ignore[reportAttributeAccessIssue]
        calls = k if isinstance(inner, Lie) else 2 * k - 1
        return calls + int(self.transformer.formulation == "projected")

    def nudged(self, n, y, deltas):
        """Step ``n`` from ``y`` with ``deltas[k]`` added after the k-th sub-flow (the
        last slot: after the closing projection of the projected formulation)."""
        model = self.transformer
        inner = self._inner()
        calls = _Calls()
        terms = model.terms()
        split = tuple(_NudgedTerm(t, deltas, calls) for t in terms.terms)  # pyright: ignore[reportAttributeAccessIssue]
        assert isinstance(inner, AbstractSplittingSolver)
        args = DynamicsArgs(control=model.control, key_mask=self.key_mask)
        t0, t1 = self.starts[n], self.ends[n]
        # The scheme's own composition of its sub-flows, with the controls frozen at
        # the step's midpoint as in its ``step``.
        y1 = inner.compose(split, model.control(0.5 * (t0 + t1)), t1 - t0, y, args)
        if model.formulation == "projected":
            y1 = project_onto_set(model.control(t1).norm2, y1) + deltas[calls.n]
            calls.n += 1
        if calls.n != deltas.shape[0]:
            raise AssertionError(f"{calls.n} sub-flows traced, {deltas.shape[0]} expected.")
        return y1


@eqx.filter_jit
def trajectory(transformer: ContinuousTransformer, u0, key_mask=None):
    """``transformer.trajectory(u0, key_mask)``, compiled (the states the analyses
    linearise about)."""
    return transformer.trajectory(u0, key_mask)


def chain(steps: StepMap, u0) -> Float[Array, "steps+1 *batch N d"]:
    """u_0, ..., u_N by chaining the step map from ``u0`` (checks ``StepMap``)."""

    def body(y, n):
        y1 = steps(n, y)
        return y1, y1

    _, ys = jax.lax.scan(body, u0, jnp.arange(steps.num_steps))
    return jnp.concatenate([u0[None], ys])
