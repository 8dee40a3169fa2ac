"""A Transformer as the solution operator of the controlled equation."""

import math
from typing import Literal, TypeVar, cast, get_args

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from diffrax import MultiTerm
from jaxtyping import Array, Float

from .._counts import whole_number
from .._custom_types import KeyMask, State
from ..controls import AbstractControl, Basis, Constant, LayerParams, NormParams, PiecewiseLinear
from ..dynamics import (
    AttentionTerm,
    AveragedFeedForwardTerm,
    DynamicsArgs,
    FeedForwardTerm,
    ProjectedField,
    ProjectionTerm,
    RelaxationField,
    RelaxedField,
    SumField,
    TangentTerm,
    project_onto_set,
)
from ..integration import Discretisation, bind_solver, solve, solve_in_depth
from ..operators import Activation, Attention, FeedForward, Grid, LayerNormProjection
from ..splitting import (
    AbstractSplittingSolver,
    ProjectedSolver,
    inner_solver,
    is_imex,
    is_implicit,
    with_root_tolerances,
)
from ._rules import Choices, check, describe_stepper

NormPosition = Literal["pre", "post"]
NORM_POSITIONS: tuple[str, ...] = get_args(NormPosition)
Formulation = Literal["split", "projected", "relaxed"]
_Model = TypeVar("_Model")  # a ContinuousTransformer, or a model holding one
FORMULATIONS: tuple[str, ...] = get_args(Formulation)

# Post-LN split terms: attention, LN 1, the averaged feed-forward step, LN 2.
_AVERAGED_FFN, _CLOSING_NORM = 2, 3


def _feature_width(control: AbstractControl) -> int:
    # By shape only: an eager evaluation would compile a program per parameter.
    return int(jax.eval_shape(control, control.interval[0]).attention.wq.shape[-1])


def _control_kind(control: AbstractControl) -> str:
    if isinstance(control, Basis):
        return "basis"
    if isinstance(control, PiecewiseLinear):
        return "piecewise_linear"
    if isinstance(control, Constant):
        return "constant"
    return "piecewise_constant"


class ContinuousTransformer(eqx.Module):
    r"""The map $f \mapsto u(T)$ of the controlled integro-differential equation.

    Post-LN (``norm="post"``): the split equation
    $u_t = \mathcal{A}(u) + \partial I_{S_1} + \mathcal{F}(u) + \partial I_{S_1}$ with the
    paper's feed-forward sub-problem (averaging step and eps/4 closing projection).
    Pre-LN (``norm="pre"``): the smooth ODE
    $u_t = \mathcal{A}(P_{S_1}(u)) + \Phi(P_{S_1}(u))$, then the final projection at
    $t = T$ when ``final_norm`` is given.

    The model holds the equation (controls, operators, norm position, formulation) and
    one ``Discretisation`` (time stepper, grid, step-size control, gradient method),
    as diffrax keeps terms apart from the solver. With the default discretisation
    (``Lie`` scheme, one step per layer) it is exactly the standard Transformer stack
    whose parameters are the pieces of ``control``; ``rediscretise`` changes only the
    numerics.

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
      Their nominal orders (``order()``) hold once the step is small against
      $\epsilon$; at larger steps the stiffness reduces them (see ``order``).

    Incompatible choices raise ``IncompatibleError`` (a ``ValueError``) here, before
    anything is traced, from the rules of ``ocformer.models.RULES``.

    Args:
        control: theta(t).
        norm: ``"post"`` or ``"pre"``.
        num_heads, causal: the attention operator.
        activation: the feed-forward hidden sub-step.
        ln_eps: the LayerNorm epsilon of the split formulation (the smooth
            formulations use the exact set, eps = 0).
        grid: quadrature spacings.
        final_norm: projection target at t = T, or None.
        formulation: ``"split"``, ``"projected"`` or ``"relaxed"``.
        relaxation_eps: epsilon of the relaxation.
        discretisation: how the equation is solved (default ``Discretisation()``: the
            Lie scheme with one step per layer, discretise-then-optimise).
        attention_kernel: ``"xla"`` or ``"cudnn"`` (cuDNN's fused attention for
            bfloat16/float16 states on NVIDIA GPUs; see ``ocformer.operators.Attention``).
    """

    control: AbstractControl
    attention: Attention
    feedforward: FeedForward
    layer_norm: LayerNormProjection
    final_norm: NormParams | None
    discretisation: Discretisation
    norm: NormPosition = eqx.field(static=True)
    formulation: Formulation = eqx.field(static=True)
    relaxation_eps: float = eqx.field(static=True)

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
        formulation: Formulation = "split",
        relaxation_eps: float = 1e-2,
        discretisation: Discretisation | None = None,
        attention_kernel: str = "xla",
    ):
        if norm not in NORM_POSITIONS:
            raise ValueError(f"norm must be one of {NORM_POSITIONS}, got {norm!r}.")
        if formulation not in FORMULATIONS:
            raise ValueError(f"formulation must be one of {FORMULATIONS}, got {formulation!r}.")
        if not isinstance(control, AbstractControl):
            raise ValueError(
                "control must be an ocformer.controls.AbstractControl, the parameters as a "
                f"function of time (e.g. PiecewiseConstant(params)), got {type(control).__name__}."
            )
        d = _feature_width(control)
        heads = whole_number(num_heads)
        if heads is None or heads < 1 or d % heads:
            raise ValueError(
                f"num_heads={num_heads!r} must be a positive integer dividing the "
                f"feature width d={d}."
            )
        num_heads = heads
        if final_norm is not None and not (
            isinstance(final_norm, NormParams)
            and all(jnp.shape(x) in ((d,), ()) for x in (final_norm.scale, final_norm.bias))
        ):
            raise ValueError(
                "final_norm must be None or an ocformer.controls.NormParams whose scale and "
                f"bias have shape ({d},) or () (from_layers takes a dict), got "
                + (
                    f"shapes {jnp.shape(final_norm.scale)} and {jnp.shape(final_norm.bias)}."
                    if isinstance(final_norm, NormParams)
                    else f"{type(final_norm).__name__}."
                )
            )
        if isinstance(relaxation_eps, bool) or not (
            isinstance(relaxation_eps, int | float | np.integer | np.floating)
            and math.isfinite(relaxation_eps)
            and relaxation_eps > 0
        ):
            raise ValueError(f"relaxation_eps must be a number > 0, got {relaxation_eps!r}.")
        discretisation = Discretisation() if discretisation is None else discretisation
        if not isinstance(discretisation, Discretisation):
            raise ValueError(
                "discretisation must be an ocformer.integration.Discretisation, got "
                f"{type(discretisation).__name__}."
            )
        self.control = control
        self.attention = Attention(
            num_heads=num_heads, causal=causal, grid=grid, kernel=attention_kernel
        )
        self.feedforward = FeedForward(activation=activation, grid=grid)
        self.layer_norm = LayerNormProjection(eps=ln_eps)
        self.final_norm = final_norm
        self.discretisation = discretisation
        self.norm = norm
        self.formulation = formulation
        self.relaxation_eps = float(relaxation_eps)
        self.check()

    def choices(self) -> Choices:
        """This model's equation and discretisation as the plain values of the rules."""
        d = self.discretisation
        norm2 = jax.eval_shape(self.control, self.control.interval[0]).norm2  # shapes only
        depth: dict = {}
        if d.depth_parallel is not None:
            coarse = describe_stepper(d.depth_parallel.coarse_stepper)
            depth = dict(
                depth_parallel=d.depth_parallel.name,
                coarse_stepper=coarse["stepper"],
                coarse_stepper_kind=coarse["stepper_kind"],
                coarse_error_estimate=coarse["error_estimate"],
                coarse_steps=d.depth_parallel.coarse_steps,
                iterations=d.depth_parallel.iterations,
                chunks=d.depth_parallel.chunks,
                relaxation=d.depth_parallel.relaxation,
                depth_costate=d.depth_parallel.costate,
            )
        return Choices(
            **describe_stepper(d.stepper),
            **depth,
            steps_per_layer=d.steps_per_layer,
            stepsize=d.stepsize,
            jump_ts=d.jump_ts,
            gradient=d.gradient.name,
            norm=self.norm,
            formulation=self.formulation,
            relaxation_eps=self.relaxation_eps,
            controls=_control_kind(self.control),
            scalar_norm=jnp.shape(norm2.scale) == () and jnp.shape(norm2.bias) == (),
            num_layers=self.num_layers,
        )

    def check(self) -> None:
        """Raise ``IncompatibleError`` if a rule refuses this equation-discretisation
        pair (called on construction and by ``rediscretise``), and ``ValueError`` if a
        splitting scheme's sequence or groups do not fit the equation's terms."""
        check(self.choices())
        d = self.discretisation
        posed = [(d.stepper, self)]
        if d.depth_parallel is not None:
            # The coarse stepper steps the equation posed for it: split terms for a
            # splitting scheme under a fine diffrax solver's single ODETerm, say.
            coarse = eqx.tree_at(lambda m: m.discretisation, self, d.coarse())
            posed.append((d.depth_parallel.coarse_stepper, coarse))
        for stepper, model in posed:
            if isinstance(stepper, AbstractSplittingSolver):
                stepper.check_terms(len(model.terms().terms))  # pyright: ignore[reportAttributeAccessIssue]

    @property
    def num_layers(self) -> int:
        return self.control.num_layers

    @property
    def width(self) -> int:
        return _feature_width(self.control)

    @property
    def steps_per_layer(self) -> int:
        return self.discretisation.steps_per_layer

    @property
    def is_splitting(self) -> bool:
        return self.discretisation.is_splitting

    def terms(self) -> diffrax.AbstractTerm:
        """The right-hand side in the form the time stepper takes: the split terms
        (``MultiTerm``, one per operator) for splitting schemes, one ``ODETerm`` for
        other solvers, ``MultiTerm(explicit ODETerm, implicit ODETerm)`` for IMEX."""
        stepper = self.discretisation.stepper
        splitting = isinstance(stepper, AbstractSplittingSolver)
        if self.formulation == "split":
            if self.norm == "post":
                terms = [
                    AttentionTerm(attention=self.attention),
                    ProjectionTerm(self.layer_norm, "norm1"),
                    AveragedFeedForwardTerm(self.feedforward),
                    ProjectionTerm(self.layer_norm, "norm2"),
                ]
                # LayerNorm(a + b) with eps is P_{eps/4}((a + b)/2): the closing projection
                # takes eps/4 where the scheme always enters it from the averaging step
                # (Lie; Strang's middle), and the plain eps where it is fed anything else.
                if isinstance(stepper, AbstractSplittingSolver) and stepper.feeds(
                    _AVERAGED_FFN, _CLOSING_NORM, terms
                ):
                    terms[_CLOSING_NORM] = ProjectionTerm(self.layer_norm, "norm2", 0.25)
                return MultiTerm(*terms)
            split = (
                AttentionTerm(attention=self.attention, pre_norm=self.layer_norm),
                FeedForwardTerm(feedforward=self.feedforward, pre_norm=self.layer_norm),
            )
            if splitting:
                return MultiTerm(*split)
            return diffrax.ODETerm(SumField(split))
        smooth = (
            AttentionTerm(attention=self.attention),
            FeedForwardTerm(feedforward=self.feedforward),
        )
        if self.formulation == "projected":
            if splitting:
                # The projection onto S1(theta) moves the state with the set (for scalar
                # sigma it is the exact flow of the sigma' terms); Strang puts it at
                # both ends, around the tangent flows.
                return MultiTerm(
                    ProjectionTerm(LayerNormProjection(eps=0.0), "norm2"),
                    *(TangentTerm(term=t) for t in smooth),
                )
            return diffrax.ODETerm(ProjectedField(smooth))
        # Weakly typed, so it does not promote a float32 state.
        relax = RelaxationField(jnp.asarray(self.relaxation_eps))
        if is_imex(stepper):
            return MultiTerm(diffrax.ODETerm(SumField(smooth)), diffrax.ODETerm(relax))
        return diffrax.ODETerm(RelaxedField(SumField(smooth), relax))

    def time_stepper(self) -> diffrax.AbstractSolver:
        """The solver handed to ``diffeqsolve``: the discretisation's stepper, wrapped in
        a ``ProjectedSolver`` for the projected formulation, with Newton tolerances set
        for implicit solvers."""
        d = self.discretisation
        solver = with_root_tolerances(d.stepper, d.rtol, d.atol)
        if self.formulation == "projected":
            solver = ProjectedSolver(solver)
        return solver

    def initial_state(self, u0: State) -> State:
        """u(0): ``u0`` itself, or its projection onto S1(theta(t0)) for the smooth
        post-LN formulations (their states live on or near that set)."""
        if self.formulation == "split":
            return u0
        t0 = self.control.interval[0]
        return project_onto_set(self.control(t0).norm2, u0)

    def order(self) -> int | None:
        """The order of the time stepper on these terms (splitting: the smaller of the
        splitting's and the sub-flows' orders; 0 for the post-LN split equation, which
        has no continuous limit and is not refined).

        On the relaxed formulation it is the nominal, non-stiff order, which the errors
        show only once the step is small against ``relaxation_eps``. With steps of the
        size of eps or larger the implicit solvers lose order to the stiff relaxation
        (measured at eps = 1e-2 and up to 64 steps per layer: local slopes 2.66, 2.70,
        4.45 for Kvaerno 3, 4, 5; the table against dt/eps, and its command, are in
        docs/continuous.md, Convergence study)."""
        return self.time_stepper().order(self.terms())

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
        if u0.shape[-2] == 0:
            raise ValueError(f"u0 holds no tokens (shape {u0.shape}); give at least one.")
        if key_mask is not None and getattr(key_mask, "dtype", None) != jnp.bool_:
            what = getattr(key_mask, "dtype", type(key_mask).__name__)
            raise ValueError(
                f"key_mask must be a boolean array (True keeps a token), got {what}; a 0/1 "
                "attention mask is key_mask=jnp.asarray(mask, bool)."
            )
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
        u0: State,
        key_mask: KeyMask | None = None,
        saveat: diffrax.SaveAt | None = None,
        *,
        cast_back: bool = True,
    ) -> diffrax.Solution:
        """The diffrax solution from u(0) = u0 (before any final projection); its
        ``stats`` count the steps and vector-field evaluations. The saved states are in
        the dtype of ``u0``, or with ``cast_back=False`` in that of the state the solve
        carries (float32 for a bfloat16 ``u0``: ``ocformer.integration.solve``).

        Under a depth-parallel discretisation the solution holds u(T) alone (the last
        iterate of ``depth_iterates``), with no statistics, and ``saveat`` is refused:
        the chunks' interior states are not those of one solve.

        An implicit solver on a constant grid solves a batch example by example (the
        stage equations' Jacobians are block diagonal over the batch); the solution is
        that of the batch solved as one state, up to the Newton tolerances. A ``saveat``
        that saves more than states (dense output, a function of the state, nested
        saves, solver state) keeps the batched solve, as do the chunks of a
        depth-parallel solve.
        """
        self._check_input(u0, key_mask)
        if self.discretisation.depth_parallel is not None:
            if saveat is not None:
                raise ValueError(
                    "a depth-parallel solve (discretisation.depth_parallel) gives u(T) "
                    "only; saving the states of the grid (a trajectory, the kinetic "
                    "energy) needs the serial solve: rediscretise(model, "
                    "depth_parallel=None)."
                )
            u_t = self.depth_iterates(u0, key_mask, cast_back=cast_back)[-1, -1]
            t0, t1 = self.control.interval
            return diffrax.Solution(
                t0=jnp.asarray(t0),
                t1=jnp.asarray(t1),
                ts=jnp.asarray([t1]),
                ys=u_t[None],
                interpolation=None,
                stats={},
                result=diffrax.RESULTS.successful,
                solver_state=None,
                controller_state=None,
                made_jump=None,
                event_mask=None,
            )
        model = self._in_dtype(u0.dtype)
        terms, stepper, d = model.terms(), model.time_stepper(), model.discretisation

        def one(u, mask):
            return solve(
                terms,
                stepper,
                model.control,
                u,
                d,
                key_mask=mask,
                saveat=saveat,
                cast_back=cast_back,
            )

        u_0 = model.initial_state(u0)
        if (
            u0.ndim == 2
            or d.is_adaptive
            or not is_implicit(inner_solver(stepper))
            or not _states_only(saveat)
        ):
            return one(u_0, key_mask)
        return _per_example(one, u_0, key_mask)

    def depth_iterates(
        self, u0: State, key_mask: KeyMask | None = None, *, cast_back: bool = True
    ) -> Float[Array, "iterations chunks_plus_one *batch N d"]:
        """The states at the chunk boundaries after each iteration of the
        depth-parallel solve (before any final projection): entry ``[k, n]`` is
        $U^k_n$, iteration 0 the coarse guess, ``[-1, -1]`` u(T). As for ``solve``,
        they are in the dtype of ``u0``, or with ``cast_back=False`` in that of the
        states the iteration carries (float32 for a bfloat16 ``u0``, whose dtype is the
        chunks' compute dtype: ``ocformer.integration.solve_in_depth``).

        The fine propagator is this model's discretisation over each chunk, the coarse
        one the same equation under ``discretisation.coarse(...)`` (its terms posed for
        the coarse stepper)."""
        self._check_input(u0, key_mask)
        d = self.discretisation
        if d.depth_parallel is None:
            raise ValueError(
                "depth_iterates needs a depth-parallel discretisation: rediscretise(model, "
                "depth_parallel=ocformer.integration.Parareal(...))."
            )
        model = self._in_dtype(u0.dtype)
        coarse = eqx.tree_at(lambda m: m.discretisation, model, d.coarse())
        states = solve_in_depth(
            (model.terms(), model.time_stepper()),
            (coarse.terms(), coarse.time_stepper()),
            model.control,
            model.initial_state(u0),
            model.discretisation,
            key_mask=key_mask,
        )
        return states.astype(u0.dtype) if cast_back else states

    def trajectory(
        self,
        u0: State,
        key_mask: KeyMask | None = None,
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
        inner = inner_solver(stepper)
        if not isinstance(inner, AbstractSplittingSolver):
            raise ValueError(
                f"substeps=True needs a splitting scheme; {type(inner).__name__} has "
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
        u0: State,
        key_mask: KeyMask | None = None,
    ) -> State:
        """u(T) from the embedded input u0, in the dtype of u0."""
        sol = self.solve(u0, key_mask)
        assert sol.ys is not None
        return self.final_projection(sol.ys[-1])

    def final_projection(self, u_t: State) -> State:
        """The projection at t = T (the final LayerNorm), in the dtype of ``u_t``;
        ``u_t`` itself when the model has none."""
        if self.final_norm is None:
            return u_t
        final = self._in_dtype(u_t.dtype).final_norm
        assert final is not None  # the dtype cast keeps the structure
        return self.layer_norm(final, u_t)

    def layer(self, n: int) -> LayerParams:
        """The controls of layer n (their value on the n-th piece of the grid),
        0 <= n < num_layers (a Python or NumPy integer; a traced one is not checked)."""
        if isinstance(n, np.integer):
            n = int(n)
        if isinstance(n, bool | float | np.floating | np.bool_):  # a time, not a layer
            raise ValueError(f"layer takes a layer index 0..L-1, got {n!r}.")
        if isinstance(n, int) and not 0 <= n < self.num_layers:
            raise IndexError(f"layer {n} of a model of {self.num_layers} layers (0..L-1).")
        t0, t1 = self.control.interval
        dt = (t1 - t0) / self.num_layers
        return self.control(t0 + (n + 0.5) * dt)


def _per_example(one, u0, key_mask) -> diffrax.Solution:
    """``one(u0, key_mask)`` for a batch of inputs (``u0`` of shape ``(B, N, d)``), solved
    example by example: an implicit solver on a constant grid.

    The field does not couple the examples of a batch, so the Jacobian of every stage
    equation is block diagonal; diffrax's Newton iteration would build and factor it
    whole (B N d columns, one Jacobian-vector product each, and a factorisation whose
    cost grows as B^3), and the implicit-function gradient of each stage solve again.
    Vmapped, each example's are N d columns: on the smoke model (batch 8, 16 tokens,
    width 16) a Kvaerno 3 solve at 4 steps per layer is 16 times faster, 24 times with
    its gradient (``benchmarks/implicit.json``). The grid is the same for every
    example, so the solution is the batched one's: the states up to the Newton
    tolerances (each example stops iterating when its own update is small), the times,
    statistics and result those of any one example (a failed stage solve raises,
    ``ocformer.integration.solve``). Adaptive steps stay batched: their step sizes are
    chosen for the whole batch, as for the explicit solvers.
    """
    sol = eqx.filter_vmap(one, in_axes=(0, None if key_mask is None else 0))(u0, key_mask)
    assert sol.ys is not None  # every solve here saves states
    ys = jnp.moveaxis(sol.ys, 0, 1)  # (saved, B, N, d), as the batched solve's
    rest = jtu.tree_map(lambda x: x[0] if eqx.is_array(x) else x, eqx.tree_at(_ys, sol, 0))
    return eqx.tree_at(_ys, rest, ys)


def _ys(sol: diffrax.Solution):
    return sol.ys


_SAVE_STATE = diffrax.SubSaveAt(t1=True).fn  # diffrax's default: the state itself


def _states_only(saveat: diffrax.SaveAt | None) -> bool:
    """Whether ``saveat`` saves states alone, at times common to every example (what a
    per-example solve can stack into the batch's): no dense output, no function of
    the state (it would see one example), no nested saves, no solver state."""
    if saveat is None:
        return True
    subs = saveat.subs
    return (
        isinstance(subs, diffrax.SubSaveAt)
        and subs.fn is _SAVE_STATE
        and not (saveat.dense or saveat.solver_state or saveat.controller_state)
        and not saveat.made_jump
    )


def rediscretise(model, discretisation: Discretisation | None = None, **changes):
    """The same equation (controls, operators, formulation) under another discretisation.

    A cheap replace, not a rebuild: nothing grid-dependent is stored in the model, so
    the new grid's adjoint, ``max_steps`` and step-size controller are derived at the
    next solve. The new pair is checked against the rules.

    Args:
        model: a ``ContinuousTransformer``, or any module with a ``transformer`` field
            holding one (``SequenceModel``).
        discretisation: the new ``Discretisation``; or
        **changes: fields of the current one to change (``steps_per_layer=8``,
            ``stepper=Strang(sub_solver="midpoint")``, ``gradient=Direct()``, ...).

    Raises:
        ValueError: both or neither of ``discretisation`` and ``changes`` given, an
            unknown field, or a combination the rules refuse (``IncompatibleError``).
    """
    transformer = _transformer_of(model, "rediscretise")
    if (discretisation is None) == (not changes):
        raise ValueError(
            "rediscretise takes either a Discretisation or fields to change, e.g. "
            "rediscretise(model, steps_per_layer=8)."
        )
    if discretisation is None:
        discretisation = transformer.discretisation.replace(**changes)
    if not isinstance(discretisation, Discretisation):
        raise ValueError(
            "discretisation must be an ocformer.integration.Discretisation, got "
            f"{type(discretisation).__name__}."
        )
    new = eqx.tree_at(lambda m: m.discretisation, transformer, discretisation)
    new.check()
    return _with_transformer(model, new)


def _transformer_of(model, who: str) -> "ContinuousTransformer":
    """``model`` itself, or the ``ContinuousTransformer`` in its ``transformer`` field."""
    transformer = getattr(model, "transformer", model)
    if not isinstance(transformer, ContinuousTransformer):
        raise ValueError(
            f"{who} takes a ContinuousTransformer or a model with a `transformer` field "
            f"holding one, got {type(model).__name__}."
        )
    return transformer


def _with_transformer(model: _Model, new: "ContinuousTransformer") -> _Model:
    """``new`` in place of ``model``'s transformer (``model`` itself if it is one)."""
    if isinstance(model, ContinuousTransformer):
        return cast(_Model, new)
    return eqx.tree_at(lambda m: m.transformer, model, new)


def refine(model, steps_per_layer: int):
    """``model`` with ``steps_per_layer`` steps per layer (dt = 1/m), same stepper.

    With piecewise-constant controls the refined models converge, as m grows, to the
    ODE whose field is frozen on each layer; with smooth controls (``Basis``,
    ``PiecewiseLinear``) to the smooth non-autonomous ODE. The post-LN split equation
    has no such limit, and is refused (use the projected formulation).
    """
    return rediscretise(model, steps_per_layer=steps_per_layer)


def reformulate(
    model: _Model,
    *,
    formulation: Formulation | None = None,
    relaxation_eps: float | None = None,
    discretisation: Discretisation | None = None,
) -> _Model:
    """The same controls and operators posed in another formulation (``"split"``,
    ``"projected"`` or ``"relaxed"``), optionally with a new discretisation; unlike
    ``rediscretise`` this changes the equation, so the model is rebuilt and checked (with
    the same attention operator, e.g. CvT's convolutional one). ``model`` is a
    ``ContinuousTransformer`` or a model with a ``transformer`` field holding one
    (``SequenceModel``), and what is returned is of its kind."""
    t = _transformer_of(model, "reformulate")
    new = ContinuousTransformer(
        t.control,
        norm=t.norm,
        num_heads=t.attention.num_heads,
        causal=t.attention.causal,
        activation=t.feedforward.activation,
        ln_eps=t.layer_norm.eps,
        grid=t.attention.grid,
        final_norm=t.final_norm,
        formulation=t.formulation if formulation is None else formulation,
        relaxation_eps=t.relaxation_eps if relaxation_eps is None else relaxation_eps,
        discretisation=t.discretisation if discretisation is None else discretisation,
    )
    return _with_transformer(model, eqx.tree_at(lambda m: m.attention, new, t.attention))
