"""The compatibility rules of the equation and its discretisation, in one table.

Time stepper x formulation x norm position x controls x step-size control x gradient
method: which combinations can be solved (and differentiated), and why the others
cannot. The rules are plain functions over plain values (``Choices``), so that config
validation (over names, before anything is built) and model construction (over
objects) call the very same code. Each refusal names the config field it is about and
says what to use instead.
"""

import dataclasses
from collections.abc import Callable
from typing import Literal

import diffrax
import numpy as np

from ..integration import CONSTANT_STEP_METHODS
from ..splitting import SCHEMES, SOLVERS, AbstractSplittingSolver, is_imex, is_implicit

StepperKind = Literal["splitting", "explicit", "implicit", "imex"]

EXPLICIT_RELAXATION_LIMIT: float = 2.0
"""An explicit solver on the relaxed formulation needs step <= this * relaxation_eps
with constant steps (the real stability interval of explicit Euler, [-2, 0], for the
normal rate -1/eps; higher-order explicit Runge-Kutta methods have intervals of about
2 to 3.5, so this is the bound that holds for all of them)."""

IMPLICIT_MIN_STEPS_PER_LAYER: int = 4
r"""A fully implicit solver (implicit_euler, kvaerno3/4/5) with constant steps needs at
least this many steps per layer.

Each stage solves $z = y + \gamma\,\delta t\, f(z)$, a contraction only while
$\gamma\,\delta t\,\mathrm{Lip}(f) < 1$. The attention and feed-forward fields have
Lipschitz constants of order one per layer, so at $\delta t = 1$ the stage equation can
be singular: on the third layer of the projected study model
(``ocformer.analysis.study_model``) the smallest singular value of
$I - \delta t\,\partial f/\partial u$ is 0.017 for implicit Euler, and full Newton from
$y$ wanders for 40 iterations with residuals between 3 and 900. Tighter root-finder
tolerances or more Newton iterations do not help a stage equation without a nearby
root.

Measured on the study models: at one step per layer implicit_euler, kvaerno4 and
kvaerno5 stop with "maximum number of steps was reached in the nonlinear solver" on the
pre-LN and relaxed (eps = 1e-2) formulations, and implicit_euler and kvaerno4 on the
projected one (at rtol 1e-6 and 1e-10 alike); at two steps, implicit_euler on the
projected and relaxed formulations and kvaerno4 on the relaxed one. The solves that do
finish there are outside the asymptotic range (pre-LN, error at 1, 2, 4 steps per
layer: kvaerno3 4.2, 0.38, 0.025; kvaerno4 failed, 1.1, 0.017). From four steps all of
them converge, at their orders on pre-LN and projected.

Adaptive steps are not limited: a failed stage solve is a rejected step there, and the
controller shrinks it (projected study model, kvaerno4 and kvaerno5 from one step per
layer at rtol 1e-6: errors 9e-8 and 8e-7). IMEX solvers (kencarp3/4/5) solve only for
the relaxation, which is dissipative, and are not limited either."""

PROJECTED_SPLITTINGS: tuple[str, ...] = ("lie", "strang")


@dataclasses.dataclass(frozen=True)
class Choices:
    """One combination, in plain values (names and numbers).

    Attributes:
        stepper: the time stepper's name (``"lie"``, ``"strang"``, ``"tsit5"``, ...).
        stepper_kind: ``"splitting"``, ``"explicit"``, ``"implicit"`` or ``"imex"``.
        error_estimate: whether the stepper gives an error estimate (adaptive steps).
        stages_past_end: whether the stepper evaluates a stage past its step's end (a
            Runge-Kutta abscissa above 1: kvaerno4, kvaerno5).
        sub_solver: the explicit sub-solver of a splitting scheme.
        steps_per_layer, stepsize, jump_ts: the grid and step-size control.
        gradient: the gradient method's name.
        norm, formulation, relaxation_eps: the equation.
        controls: the time dependence of theta (``"piecewise_constant"``, ...).
        scalar_norm: whether the layer-norm controls are the paper's scalar sigma1,
            sigma2 (a set to project onto) rather than per-feature gains.
        num_layers: the number of layers (pieces of the time grid).
        depth_parallel: the depth-parallel solve's name (``"parareal"``, ``"mgrit"``),
            or None.
        relaxation: MGRIT's relaxation, ``"F"`` or ``"FCF"`` (parareal: ``"F"``).
        depth_costate: how its gradient is found, ``"reverse"`` or ``"parallel"``.
        coarse_stepper, coarse_stepper_kind, coarse_error_estimate: its coarse time
            stepper, described as ``stepper`` is.
        coarse_steps: steps of the coarse grid over each chunk.
        iterations: its iterations K.
        chunks: the number of chunks (None: one per layer).
    """

    stepper: str
    stepper_kind: StepperKind
    error_estimate: bool
    stages_past_end: bool = False
    sub_solver: str = "euler"
    steps_per_layer: int = 1
    stepsize: str = "constant"
    jump_ts: bool = True
    gradient: str = "discretise_then_optimise"
    norm: str = "post"
    formulation: str = "split"
    relaxation_eps: float = 1e-2
    controls: str = "piecewise_constant"
    scalar_norm: bool = False
    num_layers: int = 1
    depth_parallel: str | None = None
    relaxation: str = "F"
    depth_costate: str = "reverse"
    coarse_stepper: str = "lie"
    coarse_stepper_kind: StepperKind = "splitting"
    coarse_error_estimate: bool = False
    coarse_steps: int = 1
    iterations: int = 1
    chunks: int | None = None


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Choices)}

DEPTH_PARALLEL_ONLY: dict[str, str] = {
    "coarse_stepper": "is the coarse time stepper of a depth-parallel solve",
    "coarse_steps": "counts the coarse steps over each chunk of a depth-parallel solve",
    "iterations": "counts the iterations K of a depth-parallel solve",
    "depth_costate": "solves the costate of a depth-parallel solve",
    "chunks": "cuts the layer grid into the chunks of a depth-parallel solve",
}
"""The fields of ``Choices`` that only a depth-parallel solve reads, with what each
does there. Without one (``depth_parallel`` None) a field set away from its default is
refused, not ignored: a run that forgot ``depth_parallel`` would otherwise train the
serial solve without a word. (``relaxation`` is MGRIT's alone and has its own rule.)"""

_SERIAL = {
    name: _DEFAULTS[name]
    for name in (*DEPTH_PARALLEL_ONLY, "relaxation", "coarse_stepper_kind", "coarse_error_estimate")
}
"""The depth-parallel fields of a serial combination: their defaults."""


@dataclasses.dataclass(frozen=True)
class Refusal:
    """Why a combination cannot run: the config field at fault and the message."""

    field: str
    message: str


class IncompatibleError(ValueError):
    """A combination refused by a rule. ``field`` is the config field at fault and
    ``message`` the rule's explanation (the error's text is ``"field: message"``)."""

    def __init__(self, refusal: Refusal):
        self.field = refusal.field
        self.message = refusal.message
        super().__init__(f"{refusal.field}: {refusal.message}")


def _smooth_limit_of_post(c: Choices) -> Refusal | None:
    if c.formulation != "split" and c.norm != "post":
        return Refusal(
            "model.formulation",
            f"formulation={c.formulation!r} is a smooth limit of post-LN; with norm='pre' "
            "the equation is already a smooth ODE: use formulation='split', which takes "
            "any diffrax solver",
        )
    return None


def _sets_need_scalar_norm(c: Choices) -> Refusal | None:
    if c.formulation != "split" and not c.scalar_norm:
        return Refusal(
            "controls.norm_affine",
            f"formulation={c.formulation!r} projects onto the set S1(sigma1, sigma2), which "
            "needs the paper's scalar layer-norm controls; a per-feature gain and bias is "
            "an affine sub-step, not a constraint set. Use controls.norm_affine=scalar "
            "(norm_affine='scalar' when building controls), or formulation='split'",
        )
    return None


def _post_split_needs_splitting(c: Choices) -> Refusal | None:
    if c.norm == "post" and c.formulation == "split" and c.stepper_kind != "splitting":
        return Refusal(
            "discretisation.stepper",
            f"{c.stepper} steps a pointwise vector field, but the post-LN split equation "
            "has projection (indicator) terms with none. Use a splitting scheme (lie, "
            "strang, ...), or model.formulation=projected|relaxed for a smooth limit",
        )
    return None


def _post_split_has_no_refinement(c: Choices) -> Refusal | None:
    if (
        c.norm == "post"
        and c.formulation == "split"
        and c.stepper_kind == "splitting"
        and c.steps_per_layer > 1
    ):
        return Refusal(
            "discretisation.steps_per_layer",
            f"steps_per_layer={c.steps_per_layer}: the post-LN split equation has no "
            "continuous limit to refine towards (its averaged feed-forward step does not "
            "tend to the identity as dt -> 0, so refinements do not converge). Use "
            "steps_per_layer=1 (the Transformer), or model.formulation=projected with "
            "controls.norm_affine=scalar, whose refinements converge at the stepper's order",
        )
    return None


def _imex_needs_relaxation(c: Choices) -> Refusal | None:
    if c.stepper_kind == "imex" and c.formulation != "relaxed":
        return Refusal(
            "discretisation.stepper",
            f"{c.stepper} is IMEX (explicit part + implicit part) but "
            f"formulation={c.formulation!r} has no stiff part to treat implicitly. Use an "
            "explicit or Kvaerno solver, or model.formulation=relaxed",
        )
    return None


def _relaxation_not_split(c: Choices) -> Refusal | None:
    if c.stepper_kind == "splitting" and c.formulation == "relaxed":
        return Refusal(
            "discretisation.stepper",
            f"{c.stepper} with formulation='relaxed': a splitting scheme would step the "
            "stiff relaxation term explicitly. Use an implicit (kvaerno3/4/5) or IMEX "
            "(kencarp3/4/5) solver",
        )
    return None


def _projected_splittings(c: Choices) -> Refusal | None:
    if (
        c.stepper_kind == "splitting"
        and c.formulation == "projected"
        and c.stepper not in PROJECTED_SPLITTINGS
    ):
        return Refusal(
            "discretisation.stepper",
            f"{c.stepper} with formulation='projected': only "
            f"{', '.join(PROJECTED_SPLITTINGS)} are supported there (a parallel group would "
            "average the projection that moves the state with S1 against the tangent "
            "flows). Use lie, strang, or a diffrax solver",
        )
    return None


def _sub_solver_of_splittings(c: Choices) -> Refusal | None:
    if c.stepper_kind != "splitting" and c.sub_solver != "euler":
        return Refusal(
            "discretisation.sub_solver",
            f"sub_solver={c.sub_solver!r} steps the smooth terms inside a splitting step, "
            f"but {c.stepper} is not a splitting scheme and has no sub-flows. Leave "
            "sub_solver=euler, or use a splitting stepper",
        )
    return None


def _adaptive_needs_error_estimate(c: Choices) -> Refusal | None:
    if c.stepsize == "pid" and not c.error_estimate:
        return Refusal(
            "discretisation.stepsize",
            f"an adaptive (pid) controller needs an error estimate, which {c.stepper} does "
            "not give (splitting schemes and Euler do not). Use stepsize=constant, or an "
            "embedded Runge-Kutta or implicit solver (e.g. tsit5, heun, kvaerno5)",
        )
    return None


def _adaptive_needs_jumps(c: Choices) -> Refusal | None:
    if (
        c.stepsize == "pid"
        and not c.jump_ts
        and c.controls == "piecewise_constant"
        and c.num_layers > 1
    ):
        return Refusal(
            "discretisation.jump_ts",
            "an adaptive (pid) controller with piecewise-constant controls must be told "
            "where they jump (jump_ts=true), or it steps across the discontinuities, "
            "rejecting steps until it finds them",
        )
    return None


def _explicit_relaxation_stability(c: Choices) -> Refusal | None:
    if (
        c.formulation == "relaxed"
        and c.stepper_kind == "explicit"
        and c.stepsize == "constant"
        and 1.0 / c.steps_per_layer > EXPLICIT_RELAXATION_LIMIT * c.relaxation_eps
    ):
        needed = int(1.0 / (EXPLICIT_RELAXATION_LIMIT * c.relaxation_eps)) + 1
        return Refusal(
            "discretisation.steps_per_layer",
            f"explicit {c.stepper} on the relaxed formulation with step "
            f"{1.0 / c.steps_per_layer:g} > {EXPLICIT_RELAXATION_LIMIT:g} * relaxation_eps "
            f"({c.relaxation_eps:g}) is unstable for the stiff relaxation. Use at least "
            f"{needed} steps_per_layer, or an implicit (kvaerno) or IMEX (kencarp) solver",
        )
    return None


def _stages_within_each_layer(c: Choices) -> Refusal | None:
    if c.stages_past_end and c.controls == "piecewise_constant":
        return Refusal(
            "discretisation.stepper",
            f"{c.stepper} evaluates a stage past the end of its step (an abscissa above "
            "1), so in the last step of each layer it reads the next layer's controls, "
            "which the grid's stepping over the layer boundaries cannot prevent: the "
            "solve is of other controls than the model's, and the solver loses its "
            "order (measured: the end of layer 0 depends on layer 1's controls). Use "
            "kvaerno3, an IMEX solver (kencarp3/4/5) on the relaxed formulation, or "
            "continuous controls (controls.kind=basis)",
        )
    return None


def _implicit_needs_small_steps(c: Choices) -> Refusal | None:
    if (
        c.stepper_kind == "implicit"
        and c.stepsize == "constant"
        and c.steps_per_layer < IMPLICIT_MIN_STEPS_PER_LAYER
    ):
        dt = 1.0 / c.steps_per_layer
        return Refusal(
            "discretisation.steps_per_layer",
            f"steps_per_layer={c.steps_per_layer} with the implicit solver {c.stepper}: "
            f"each stage solves z = y + gamma * dt * f(z) with dt = {dt:g}, which the "
            "attention and feed-forward fields (Lipschitz constants of order one per "
            "layer) can make singular, and the nonlinear solver then stops at its "
            "maximum number of steps or finds a spurious root. Use steps_per_layer >= "
            f"{IMPLICIT_MIN_STEPS_PER_LAYER}, stepsize=pid with kvaerno3/4/5 (a failed "
            "stage solve is then a rejected step), an explicit solver (tsit5, heun) on "
            "the pre-LN and projected formulations, or an IMEX solver (kencarp3/4/5) on "
            "the relaxed one",
        )
    return None


def _otd_needs_smooth_single_term(c: Choices) -> Refusal | None:
    if c.gradient != "optimise_then_discretise" or c.stepper_kind != "splitting":
        return None
    if c.norm == "pre":
        why = (
            "pre-LN is a smooth ODE, but a splitting scheme steps it term by term and the "
            "adjoint splitting (sub-flows transposed in reverse order) is not implemented. "
            "Use a diffrax solver (e.g. discretisation.stepper=heun) for the continuous "
            "adjoint"
        )
    elif c.formulation == "projected":
        why = (
            "the projected dynamics stepped by a splitting scheme has no continuous "
            "adjoint implemented (the adjoint splitting). Use a diffrax solver (e.g. "
            "discretisation.stepper=heun), which takes the projected field as one term"
        )
    else:
        why = (
            "the post-LN split equation has projection sub-flows (indicator terms), "
            "which have no continuous adjoint. Use model.formulation=projected with a "
            "diffrax solver for the continuous adjoint of its smooth limit"
        )
    return Refusal(
        "discretisation.gradient",
        f"optimise_then_discretise with the splitting scheme {c.stepper}: {why}; or use "
        "gradient=discretise_then_optimise, the exact gradient of this scheme",
    )


def _otd_projected_needs_continuous_controls(c: Choices) -> Refusal | None:
    if (
        c.gradient == "optimise_then_discretise"
        and c.formulation == "projected"
        and c.controls == "piecewise_constant"
    ):
        return Refusal(
            "discretisation.gradient",
            "optimise_then_discretise on the projected formulation needs continuous "
            "controls: with piecewise-constant controls sigma jumps at every layer "
            "boundary, the state jumps with it (the projection onto the new S1), and the "
            "continuous adjoint of the tangent field cannot see those jumps, so its "
            "gradient does not converge (measured relative gap to the exact gradient "
            "0.876 -> 0.803 from 2 to 8 steps per layer). Use controls.kind="
            "piecewise_linear or basis (gap 0.384 -> 0.0993), or "
            "gradient=discretise_then_optimise",
        )
    return None


def _otd_relaxed_is_unstable(c: Choices) -> Refusal | None:
    if c.gradient == "optimise_then_discretise" and c.formulation == "relaxed":
        return Refusal(
            "discretisation.gradient",
            "optimise_then_discretise on the relaxed formulation solves the state backward "
            "in time through the stiff contraction -(u - P(u))/eps, which backward is an "
            "expansion of rate 1/eps: the errors of the backward state grow like "
            "exp(T/eps), and the gradient is wrong by orders of magnitude (relative gap to "
            "the exact gradient at eps=0.1: 6.6e3, 2.5e11, 1.1e21 with heun at 8, 16, 32 "
            "steps per layer, docs/training_math.md), growing as the grid is refined; an "
            "IMEX stepper's two terms cannot be taken backward at all. Use "
            "gradient=discretise_then_optimise (or a stored method), the exact gradient "
            "of the scheme",
        )
    return None


def _stored_needs_constant_steps(c: Choices) -> Refusal | None:
    if c.gradient in CONSTANT_STEP_METHODS and c.stepsize != "constant":
        return Refusal(
            "discretisation.gradient",
            f"gradient={c.gradient!r} keeps the residuals of every step of a constant-step "
            "grid, scanned over its known step count; with stepsize="
            f"{c.stepsize!r} the number of steps is not known before the solve. Use "
            "discretisation.stepsize=constant, or gradient=discretise_then_optimise "
            "(checkpointed, any step-size control)",
        )
    return None


def _depth_needs_piecewise_constant(c: Choices) -> Refusal | None:
    if c.depth_parallel is not None and c.controls != "piecewise_constant":
        return Refusal(
            "controls.kind",
            f"depth_parallel={c.depth_parallel!r} cuts the layers of piecewise-constant "
            f"controls into chunks; controls.kind={c.controls!r} has no layers to cut. Use "
            "controls.kind=piecewise_constant, or depth_parallel=none",
        )
    return None


def _relaxation_is_mgrit(c: Choices) -> Refusal | None:
    if c.relaxation != "F" and c.depth_parallel != "mgrit":
        return Refusal(
            "discretisation.relaxation",
            f"relaxation={c.relaxation!r} is a relaxation of two-level MGRIT, but "
            f"depth_parallel={c.depth_parallel!r} (parareal is MGRIT with F-relaxation); "
            "set discretisation.depth_parallel=mgrit, or relaxation=F",
        )
    return None


def _depth_fields_need_depth_parallel(c: Choices) -> Refusal | None:
    if c.depth_parallel is not None:
        return None
    for name, what in DEPTH_PARALLEL_ONLY.items():
        value, default = getattr(c, name), _DEFAULTS[name]
        if value != default:
            return Refusal(
                f"discretisation.{name}",
                f"{name}={value!r} {what}, but depth_parallel is none and the serial solve "
                "ignores it; set discretisation.depth_parallel=parareal or mgrit, or drop "
                f"{name} (default {'none' if default is None else default})",
            )
    return None


def _depth_chunks_divide_layers(c: Choices) -> Refusal | None:
    if c.depth_parallel is not None and c.chunks is not None and c.num_layers % c.chunks:
        return Refusal(
            "discretisation.chunks",
            f"chunks={c.chunks} must divide model.num_layers={c.num_layers} (each chunk is "
            "a whole number of layers); choose a divisor of the layer count",
        )
    return None


def _layers_per_chunk(c: Choices) -> int:
    return c.num_layers // (c.num_layers if c.chunks is None else c.chunks)


def _depth_coarse_steps_fit(c: Choices) -> Refusal | None:
    if c.depth_parallel is None or (c.chunks is not None and c.num_layers % c.chunks):
        return None
    per_chunk = _layers_per_chunk(c)
    if per_chunk % c.coarse_steps and c.coarse_steps % per_chunk:
        return Refusal(
            "discretisation.coarse_steps",
            f"coarse_steps={c.coarse_steps} must divide the {per_chunk} layers of a chunk "
            f"or be a multiple of them (each coarse step covers whole layers, or each "
            "layer whole coarse steps); choose a divisor or a multiple",
        )
    return None


_COARSE_FIELDS = {
    "discretisation.stepper": "discretisation.coarse_stepper",
    "discretisation.steps_per_layer": "discretisation.coarse_steps",
    "discretisation.sub_solver": "discretisation.coarse_stepper",
    "discretisation.gradient": "discretisation.coarse_stepper",
    "discretisation.stepsize": "discretisation.coarse_stepper",
}


def coarse_choices(c: Choices) -> Choices:
    """The coarse propagator of a depth-parallel solve as a serial combination of its
    own: the same equation with the coarse stepper (euler sub-solver), constant steps,
    backpropagation through it, and its steps per layer (1 when a coarse step covers
    several layers)."""
    return dataclasses.replace(
        c,
        stepper=c.coarse_stepper,
        stepper_kind=c.coarse_stepper_kind,
        error_estimate=c.coarse_error_estimate,
        sub_solver="euler",
        steps_per_layer=max(1, c.coarse_steps // _layers_per_chunk(c)),
        stepsize="constant",
        gradient="discretise_then_optimise",
        depth_parallel=None,
        **_SERIAL,
    )


def _depth_coarse_stepper(c: Choices) -> Refusal | None:
    if c.depth_parallel is None or (c.chunks is not None and c.num_layers % c.chunks):
        return None
    for rule in RULES:
        found = rule(coarse_choices(c))
        if found is not None:
            return Refusal(
                _COARSE_FIELDS.get(found.field, found.field),
                f"as the coarse stepper of depth_parallel={c.depth_parallel!r}: {found.message}",
            )
    return None


RULES: tuple[Callable[[Choices], Refusal | None], ...] = (
    _depth_needs_piecewise_constant,
    _relaxation_is_mgrit,
    _depth_fields_need_depth_parallel,
    _depth_chunks_divide_layers,
    _depth_coarse_steps_fit,
    _depth_coarse_stepper,
    _smooth_limit_of_post,
    _sets_need_scalar_norm,
    _post_split_needs_splitting,
    _imex_needs_relaxation,
    _relaxation_not_split,
    _projected_splittings,
    _sub_solver_of_splittings,
    _post_split_has_no_refinement,
    _adaptive_needs_error_estimate,
    _adaptive_needs_jumps,
    _explicit_relaxation_stability,
    _implicit_needs_small_steps,
    _stages_within_each_layer,
    _otd_needs_smooth_single_term,
    _otd_projected_needs_continuous_controls,
    _otd_relaxed_is_unstable,
    _stored_needs_constant_steps,
)
"""Every rule, in the order they are checked (the first refusal is reported)."""


def refusals(choices: Choices) -> list[Refusal]:
    """Every rule that refuses ``choices`` (empty: the combination runs)."""
    return [r for rule in RULES if (r := rule(choices)) is not None]


def check(choices: Choices) -> None:
    """Raise ``IncompatibleError`` for the first rule that refuses ``choices``."""
    found = refusals(choices)
    if found:
        raise IncompatibleError(found[0])


def describe_stepper(stepper) -> dict:
    """The plain values of ``Choices`` that describe a time stepper object: its name,
    kind, whether it has an error estimate, and its sub-solver."""
    if isinstance(stepper, AbstractSplittingSolver):
        names = [n for n, cls in SCHEMES.items() if type(stepper) is cls]
        return dict(
            stepper=names[0] if names else type(stepper).__name__,
            stepper_kind="splitting",
            error_estimate=False,
            sub_solver=stepper.sub_solver,
        )
    names = [n for n, factory in SOLVERS.items() if factory is type(stepper)]
    kind = "imex" if is_imex(stepper) else "implicit" if is_implicit(stepper) else "explicit"
    tableau = getattr(stepper, "tableau", None)
    tableaus = getattr(tableau, "tableaus", (tableau,) if tableau is not None else ())
    return dict(
        stepper=names[0] if names else type(stepper).__name__,
        stepper_kind=kind,
        error_estimate=isinstance(stepper, diffrax.AbstractAdaptiveSolver),
        stages_past_end=any(np.size(t.c) and float(np.max(t.c)) > 1 for t in tableaus),
    )
