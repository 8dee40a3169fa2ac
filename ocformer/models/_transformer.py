"""A Transformer as the solution operator of the controlled equation."""

import warnings
from typing import Any, Literal

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from diffrax import MultiTerm
from jaxtyping import Array, Bool, Float

from ..controls._control import AbstractControl, PiecewiseConstant
from ..controls._params import LayerParams, NormParams
from ..dynamics._args import DynamicsArgs
from ..dynamics._constrained import (
    ProjectedField,
    ProjectedSolver,
    RelaxationField,
    RelaxedField,
    SumField,
    TangentTerm,
    check_scalar_norm,
    project_onto_set,
)
from ..dynamics._solve import (
    adaptive_controller,
    adaptive_max_steps,
    bind_solver,
    solve,
)
from ..dynamics._solvers import SOLVERS, is_imex, is_implicit, solver_by_name, with_root_tolerances
from ..dynamics._terms import (
    SUB_SOLVERS,
    AttentionTerm,
    AveragedFeedForwardTerm,
    FeedForwardTerm,
    ProjectionTerm,
    SubSolver,
)
from ..operators import Activation, Attention, FeedForward, Grid, LayerNormProjection
from ..splitting import SCHEMES, AbstractSplittingSolver, Lie, Strang

NormPosition = Literal["post", "pre"]
Formulation = Literal["split", "projected", "relaxed"]
FORMULATIONS: tuple[str, ...] = ("split", "projected", "relaxed")
StepSize = Literal["constant", "pid"]

EXPLICIT_RELAXATION_LIMIT: float = 2.0
"""An explicit solver on the relaxed formulation needs step <= this * relaxation_eps
with constant steps (the real stability interval of explicit Euler, [-2, 0], for the
normal rate -1/eps; higher-order explicit Runge-Kutta methods have intervals of about
2 to 3.5, so this is the bound that holds for all of them). Beyond it the model refuses."""


def _feature_width(control: AbstractControl) -> int:
    return int(control(control.interval[0]).attention.wq.shape[-1])


def _resolve_solver(solver) -> diffrax.AbstractSolver:
    if solver is None:
        return Lie()
    if isinstance(solver, str):
        if solver in SCHEMES:
            return SCHEMES[solver]()
        if solver in SOLVERS:
            return solver_by_name(solver)
        raise ValueError(
            f"Unknown solver name {solver!r}; splitting schemes: {', '.join(SCHEMES)}; "
            f"diffrax solvers: {', '.join(SOLVERS)}."
        )
    if not isinstance(solver, diffrax.AbstractSolver):
        raise ValueError(
            "solver must be a splitting scheme, a diffrax solver or the name of one, got "
            f"{type(solver).__name__}."
        )
    return solver


def _name(solver) -> str:
    return type(solver).__name__


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

    Formulations (``formulation``):

    - ``"split"``: the above. Post-LN needs a splitting scheme; pre-LN takes a splitting
      scheme or any diffrax solver (the field is the sum of the explicit terms, as one
      ``ODETerm``).
    - ``"projected"`` (post-LN): $u_t = \Pi_{T_u S_1}(\mathcal{A}(u) + \Phi(u))
      + \dot\sigma_1 + (\dot\sigma_2/\sigma_2)(u - \sigma_1)$ on $S_1$ of the ``norm2``
      controls, each step followed by the projection onto $S_1(\theta(t_{n+1}))$; $u_0$
      is first projected onto $S_1(\theta(t_0))$. Takes any explicit or implicit
      diffrax solver, or the ``Lie``/``Strang`` schemes on the split terms
      (projection onto $S_1(\theta)$, tangent attention, tangent feed-forward).
    - ``"relaxed"`` (post-LN): $u_t = \mathcal{A}(u) + \Phi(u) - (u - P_{S_1}(u))/
      \epsilon$, stiff; for implicit (Kvaerno) or IMEX (KenCarp, relaxation implicit)
      solvers; explicit ones only with steps <= ``EXPLICIT_RELAXATION_LIMIT * eps``.

    See ``ocformer.dynamics._constrained`` for the derivation. Incompatible choices
    raise ``ValueError`` here, before anything is traced.

    Args:
        control: theta(t).
        norm: ``"post"`` or ``"pre"``.
        num_heads, causal: the attention operator.
        activation: the feed-forward hidden sub-step.
        ln_eps: the LayerNorm epsilon of the split formulation (the smooth
            formulations use the exact set, eps = 0).
        grid: quadrature spacings.
        final_norm: projection target at t = T, or None.
        solver: a splitting scheme, a diffrax solver, or a name from
            ``ocformer.splitting.SCHEMES`` / ``ocformer.dynamics.SOLVERS``
            (default ``Lie()``).
        steps_per_layer: steps per layer m, dt = 1/m (default 1); for ``"pid"`` the
            grid on which ``max_steps`` is derived.
        adjoint: the gradient method (default: ``RecursiveCheckpointAdjoint``, one
            checkpoint per step with constant steps).
        formulation: ``"split"``, ``"projected"`` or ``"relaxed"``.
        relaxation_eps: epsilon of the relaxation.
        stepsize: ``"constant"`` (``StepTo`` on the grid), ``"pid"`` (a PID controller
            with ``rtol``/``atol`` that steps onto ``control.jump_ts``; ``max_steps =
            ADAPTIVE_STEPS_PER_LAYER * layers * steps_per_layer``), or an adaptive
            diffrax controller.
        rtol, atol: tolerances of the PID controller, and of the Newton iterations of
            implicit solvers.
        sub_solver: the explicit sub-solver of the split terms, ``"euler"``,
            ``"midpoint"`` or ``"heun"`` (second-order ones make Strang second order).
    """

    control: AbstractControl
    attention: Attention
    feedforward: FeedForward
    layer_norm: LayerNormProjection
    final_norm: NormParams | None
    solver: diffrax.AbstractSolver
    adjoint: diffrax.AbstractAdjoint | None
    stepsize_controller: diffrax.AbstractStepSizeController | None
    norm: NormPosition = eqx.field(static=True)
    steps_per_layer: int = eqx.field(static=True)
    formulation: Formulation = eqx.field(static=True)
    relaxation_eps: float = eqx.field(static=True)
    rtol: float = eqx.field(static=True)
    atol: float = eqx.field(static=True)
    sub_solver: SubSolver = eqx.field(static=True)

    def __init__(
        self,
        control: AbstractControl,
        *,
        norm: NormPosition = "post",
        num_heads: int = 1,
        causal: bool = False,
        activation: Activation = "relu",
        ln_eps: float = 0.0,
        grid: Grid = Grid(),  # noqa: B008 (an immutable module)
        final_norm: NormParams | None = None,
        solver: diffrax.AbstractSolver | str | None = None,
        steps_per_layer: int = 1,
        adjoint: diffrax.AbstractAdjoint | None = None,
        formulation: Formulation = "split",
        relaxation_eps: float = 1e-2,
        stepsize: StepSize | diffrax.AbstractAdaptiveStepSizeController = "constant",
        rtol: float = 1e-6,
        atol: float = 1e-8,
        sub_solver: SubSolver = "euler",
    ):
        if norm not in ("post", "pre"):
            raise ValueError(f"norm must be 'post' or 'pre', got {norm!r}.")
        d = _feature_width(control)
        if not (isinstance(num_heads, int) and num_heads >= 1) or d % num_heads:
            raise ValueError(
                f"num_heads={num_heads!r} must be a positive integer dividing the "
                f"feature width d={d}."
            )
        if not (isinstance(steps_per_layer, int) and steps_per_layer >= 1):
            raise ValueError(
                f"steps_per_layer must be a positive integer, got {steps_per_layer!r}."
            )
        if sub_solver not in SUB_SOLVERS:
            raise ValueError(f"sub_solver must be one of {SUB_SOLVERS}, got {sub_solver!r}.")
        for name, value in (("rtol", rtol), ("atol", atol), ("relaxation_eps", relaxation_eps)):
            if not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"{name} must be a number > 0, got {value!r}.")
        self.control = control
        self.attention = Attention(num_heads=num_heads, causal=causal, grid=grid)
        self.feedforward = FeedForward(activation=activation, grid=grid)
        self.layer_norm = LayerNormProjection(eps=ln_eps)
        self.final_norm = final_norm
        self.solver = _resolve_solver(solver)
        self.adjoint = adjoint
        self.norm = norm
        self.steps_per_layer = steps_per_layer
        self.formulation = formulation
        self.relaxation_eps = float(relaxation_eps)
        self.rtol = float(rtol)
        self.atol = float(atol)
        self.sub_solver = sub_solver
        if isinstance(stepsize, diffrax.AbstractAdaptiveStepSizeController):
            self.stepsize_controller = stepsize
        elif stepsize == "pid":
            self.stepsize_controller = adaptive_controller(control, self.rtol, self.atol)
        elif stepsize == "constant":
            self.stepsize_controller = None
        else:
            raise ValueError(
                "stepsize must be 'constant', 'pid' or an adaptive diffrax step-size "
                f"controller, got {stepsize!r}."
            )
        self._check_compatible()

    def _check_compatible(self) -> None:
        solver, form = self.solver, self.formulation
        splitting = isinstance(solver, AbstractSplittingSolver)
        if form not in FORMULATIONS:
            raise ValueError(f"formulation must be one of {FORMULATIONS}, got {form!r}.")
        if form != "split":
            if self.norm != "post":
                raise ValueError(
                    f"formulation={form!r} is a smooth limit of post-LN; pre-LN is already "
                    "a smooth ODE (formulation='split' takes any diffrax solver)."
                )
            t0 = self.control.interval[0]
            check_scalar_norm(self.control(t0).norm2, form)
        if form == "split" and self.norm == "post" and not splitting:
            raise ValueError(
                f"solver {_name(solver)} with formulation='split' and norm='post': the "
                "post-LN split terms include projections (indicator terms) with no "
                "pointwise vector field, so only a splitting scheme can step them. Use "
                "ocformer.splitting.Lie/Strang/..., or formulation='projected'/'relaxed'."
            )
        if is_imex(solver) and form != "relaxed":
            raise ValueError(
                f"solver {_name(solver)} is IMEX (explicit part + implicit part) but "
                f"formulation={form!r} has no stiff part to treat implicitly. Use an "
                "explicit solver, a Kvaerno solver, or formulation='relaxed'."
            )
        if splitting and form == "relaxed":
            raise ValueError(
                f"solver {_name(solver)} with formulation='relaxed': a splitting scheme "
                "would step the stiff relaxation term explicitly. Use an implicit "
                "(kvaerno3/5) or IMEX (kencarp3/4/5) solver."
            )
        if splitting and form == "projected" and not isinstance(solver, (Lie, Strang)):
            raise ValueError(
                f"solver {_name(solver)} with formulation='projected': only Lie and Strang "
                "are supported there (a parallel group would average the projection that "
                "moves the state with S1 against the tangent flows). Use Lie, Strang or "
                "a diffrax solver."
            )
        adaptive = self.stepsize_controller is not None
        if adaptive and not isinstance(solver, diffrax.AbstractAdaptiveSolver):
            raise ValueError(
                f"solver {_name(solver)} with an adaptive step-size controller: it gives "
                "no error estimate (splitting schemes and Euler do not). Use "
                "stepsize='constant', or an embedded Runge-Kutta/implicit solver."
            )
        if (
            # A bare PID controller would step across jumps, rejecting steps until it
            # locates them. Continuous controls with kinks (PiecewiseLinear) are fine.
            isinstance(self.stepsize_controller, diffrax.PIDController)
            and isinstance(self.control, PiecewiseConstant)
            and self.control.num_layers > 1
        ):
            raise ValueError(
                f"A bare PIDController with {type(self.control).__name__} controls, which "
                "jump at layer boundaries: the controller must be told where "
                "(ClipStepSizeController(pid, jump_ts=control.jump_ts)). Use "
                "stepsize='pid', which does this."
            )
        if form == "relaxed" and not is_implicit(solver):
            if adaptive:
                warnings.warn(
                    f"Explicit solver {_name(solver)} on the relaxed formulation with "
                    f"relaxation_eps={self.relaxation_eps}: adaptive steps will be "
                    "limited by stability to about eps, not by accuracy. Prefer kvaerno "
                    "or kencarp solvers.",
                    stacklevel=3,
                )
            else:
                t0, t1 = self.control.interval
                dt = (t1 - t0) / (self.num_layers * self.steps_per_layer)
                limit = EXPLICIT_RELAXATION_LIMIT * self.relaxation_eps
                needed = int((t1 - t0) / (limit * self.num_layers)) + 1
                if dt > limit:
                    raise ValueError(
                        f"Explicit solver {_name(solver)} on the relaxed formulation with "
                        f"step {dt:g} > {EXPLICIT_RELAXATION_LIMIT:g} * relaxation_eps "
                        f"({self.relaxation_eps:g}): unstable for the stiff relaxation. "
                        "Use kvaerno3/5 or kencarp3/4/5, or at least "
                        f"{needed} steps_per_layer."
                    )

    @property
    def num_layers(self) -> int:
        return self.control.num_layers

    @property
    def width(self) -> int:
        return _feature_width(self.control)

    @property
    def is_splitting(self) -> bool:
        return isinstance(self.solver, AbstractSplittingSolver)

    def terms(self) -> diffrax.AbstractTerm:
        """The right-hand side in the form the solver takes: the split terms
        (``MultiTerm``, one per operator) for splitting schemes, one ``ODETerm`` for
        other solvers, ``MultiTerm(explicit ODETerm, implicit ODETerm)`` for IMEX."""
        sub = self.sub_solver
        # Terms are built by keyword: type checkers order their fields differently from
        # equinox, which drops the base class's AbstractVar sub_solver.
        if self.formulation == "split":
            if self.norm == "post":
                return MultiTerm(
                    AttentionTerm(attention=self.attention, sub_solver=sub),
                    ProjectionTerm(self.layer_norm, "norm1"),
                    AveragedFeedForwardTerm(self.feedforward),
                    # After the averaging step the projection sees (a + b)/2: eps/4.
                    ProjectionTerm(self.layer_norm, "norm2", eps_scale=0.25),
                )
            split = (
                AttentionTerm(attention=self.attention, pre_norm=self.layer_norm, sub_solver=sub),
                FeedForwardTerm(
                    feedforward=self.feedforward, pre_norm=self.layer_norm, sub_solver=sub
                ),
            )
            if self.is_splitting:
                return MultiTerm(*split)
            return diffrax.ODETerm(SumField(split))
        smooth = (
            AttentionTerm(attention=self.attention, sub_solver=sub),
            FeedForwardTerm(feedforward=self.feedforward, sub_solver=sub),
        )
        if self.formulation == "projected":
            if self.is_splitting:
                # The projection onto S1(theta) moves the state with the set (for scalar
                # sigma it is the exact flow of the sigma' terms); Strang puts it at
                # both ends, around the tangent flows.
                return MultiTerm(
                    ProjectionTerm(LayerNormProjection(eps=0.0), "norm2"),
                    *(TangentTerm(term=t, sub_solver=sub) for t in smooth),
                )
            return diffrax.ODETerm(ProjectedField(smooth))
        # Weakly typed, so it does not promote a float32 state.
        relax = RelaxationField(jnp.asarray(self.relaxation_eps))
        if is_imex(self.solver):
            return MultiTerm(diffrax.ODETerm(SumField(smooth)), diffrax.ODETerm(relax))
        return diffrax.ODETerm(RelaxedField(SumField(smooth), relax))

    def time_stepper(self) -> diffrax.AbstractSolver:
        """The solver handed to ``diffeqsolve``: ``solver``, wrapped in a
        ``ProjectedSolver`` for the projected formulation, with Newton tolerances set
        for implicit solvers."""
        solver = with_root_tolerances(self.solver, self.rtol, self.atol)
        if self.formulation == "projected":
            solver = ProjectedSolver(solver)
        return solver

    def initial_state(self, u0: Float[Array, "*batch N d"]) -> Float[Array, "*batch N d"]:
        """u(0): ``u0`` itself, or its projection onto S1(theta(t0)) for the smooth
        post-LN formulations (their states live on or near that set)."""
        if self.formulation == "split":
            return u0
        t0 = self.control.interval[0]
        return project_onto_set(self.control(t0).norm2, u0)

    def order(self) -> int | None:
        """The order of the time stepper on these terms (splitting: the smaller of the
        splitting's and the sub-flows' orders)."""
        return self.solver.order(self.terms())

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
        adaptive = model.stepsize_controller is not None
        return solve(
            model.terms(),
            model.time_stepper(),
            model.control,
            model.initial_state(u0),
            key_mask=key_mask,
            steps_per_layer=model.steps_per_layer,
            adjoint=model.adjoint,
            saveat=saveat,
            stepsize_controller=model.stepsize_controller,
            max_steps=(
                adaptive_max_steps(model.control, model.steps_per_layer) if adaptive else None
            ),
        )

    def trajectory(
        self,
        u0: Float[Array, "*batch N d"],
        key_mask: Bool[Array, "*batch N"] | None = None,
        substeps: bool = False,
    ) -> tuple[Float[Array, " T"], Float[Array, "T *batch N d"]]:
        """The states at every step: ``(ts, ys)`` with ``ys[0] = u(0)`` and ``ys[i]``
        the state at ``ts[i]`` (before any final projection).

        With ``stepsize="pid"`` the arrays have ``max_steps + 1`` entries and the slots
        after the last accepted step hold ``inf`` (diffrax's convention).

        ``substeps=True`` (splitting schemes only) adds the state after every sub-flow
        of every step: step n with S sub-flows contributes S states, labelled
        ``t_n + (k + 1) dt / S``; the label orders the sub-steps, it is not the
        physical time of a sub-problem (each spans the whole step). They are recomputed
        from the saved step states (``AbstractSplittingSolver.substates``, vmapped over
        steps), which reproduces the step exactly; for the projected formulation the
        projection that ends each step is the last sub-state.
        """
        sol = self.solve(u0, key_mask, diffrax.SaveAt(t0=True, steps=True))
        assert sol.ts is not None and sol.ys is not None
        if not substeps:
            return sol.ts, sol.ys
        stepper = self.time_stepper()
        inner = stepper.solver if isinstance(stepper, ProjectedSolver) else stepper
        if not isinstance(inner, AbstractSplittingSolver):
            raise ValueError(
                f"substeps=True needs a splitting scheme; solver {_name(self.solver)} has "
                "no sub-flows (use substeps=False)."
            )
        model = self._in_dtype(u0.dtype)
        terms = model.terms()
        inner = bind_solver(inner, terms)
        assert isinstance(inner, AbstractSplittingSolver)  # bind_solver keeps the type
        args = DynamicsArgs(control=model.control, key_mask=key_mask)
        ts, ys = sol.ts, sol.ys

        def one_step(t0, t1, y0):
            sub = inner.substates(terms, t0, t1, y0, args)
            if isinstance(stepper, ProjectedSolver):
                end = project_onto_set(model.control(t1).norm2, sub[-1])
                sub = jnp.concatenate([sub, end[None]], axis=0)
            return sub

        sub = jax.vmap(one_step)(ts[:-1], ts[1:], ys[:-1])  # (steps, S, ...)
        num_steps, num_sub = sub.shape[:2]
        frac = jnp.arange(1, num_sub + 1, dtype=ts.dtype) / num_sub
        sub_ts = ts[:-1, None] + (ts[1:] - ts[:-1])[:, None] * frac[None, :]
        all_ts = jnp.concatenate([ts[:1], sub_ts.reshape(-1)])
        all_ys = jnp.concatenate([ys[:1], sub.reshape(num_steps * num_sub, *ys.shape[1:])])
        return all_ts, all_ys

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
            assert final is not None  # the dtype cast keeps the structure
            u_t = self.layer_norm(final, u_t)
        return u_t

    def layer(self, n: int) -> LayerParams:
        """The controls of layer n (their value on the n-th piece of the grid)."""
        t0, t1 = self.control.interval
        dt = (t1 - t0) / self.num_layers
        return self.control(t0 + (n + 0.5) * dt)

    def _options(self) -> dict[str, Any]:
        # Everything __init__ takes besides the control, read back from the fields.
        return dict(
            norm=self.norm,
            num_heads=self.attention.num_heads,
            causal=self.attention.causal,
            activation=self.feedforward.activation,
            ln_eps=self.layer_norm.eps,
            grid=self.attention.grid,
            final_norm=self.final_norm,
            solver=self.solver,
            steps_per_layer=self.steps_per_layer,
            adjoint=self.adjoint,
            formulation=self.formulation,
            relaxation_eps=self.relaxation_eps,
            stepsize="constant" if self.stepsize_controller is None else self.stepsize_controller,
            rtol=self.rtol,
            atol=self.atol,
            sub_solver=self.sub_solver,
        )


SCHEME_OPTIONS: tuple[str, ...] = (
    "solver",
    "steps_per_layer",
    "formulation",
    "relaxation_eps",
    "stepsize",
    "rtol",
    "atol",
    "sub_solver",
    "adjoint",
)


def with_scheme(model: ContinuousTransformer, **changes) -> ContinuousTransformer:
    """The same controls and operators, discretised differently.

    A model trained with one scheme and step count is evaluated with another:
    ``with_scheme(model, solver="strang", sub_solver="midpoint", steps_per_layer=8)``.
    The new combination is validated like a fresh model. A new ``stepsize="pid"`` (or
    ``"constant"``) is built for the model's control and tolerances.

    Args:
        model: a ``ContinuousTransformer``.
        **changes: any of ``SCHEME_OPTIONS``.

    Raises:
        ValueError: an option that is not a scheme option, or an incompatible result.
    """
    unknown = sorted(set(changes) - set(SCHEME_OPTIONS))
    if unknown:
        raise ValueError(
            f"with_scheme got {unknown}; it changes only the discretisation: "
            f"{', '.join(SCHEME_OPTIONS)}."
        )
    options = model._options()
    if (
        "stepsize" not in changes
        and isinstance(options["stepsize"], diffrax.AbstractStepSizeController)
        and any(k in changes for k in ("rtol", "atol"))
    ):
        options["stepsize"] = "pid"  # rebuilt with the new tolerances
    options.update(changes)
    return ContinuousTransformer(model.control, **options)


def refine(model: ContinuousTransformer, steps_per_layer: int) -> ContinuousTransformer:
    """``model`` with ``steps_per_layer`` steps per layer (dt = 1/m), same scheme.

    With piecewise-constant controls the refined models converge, as m grows, to the
    ODE whose field is frozen on each layer; with smooth controls (``Basis``,
    ``PiecewiseLinear``) to the smooth non-autonomous ODE.
    """
    return with_scheme(model, steps_per_layer=steps_per_layer)
