r"""Evaluate a trained run on its task's validation split, under its own discretisation
or another one.

The controls $\theta(t)$ are what training produced; the discretisation (time stepper,
steps per layer, step-size control, gradient method) is a choice made at evaluation
time. Re-discretising a trained model keeps every array of the problem (embedding,
controls, readout) and rebuilds everything else from the changed configuration.
"""

import dataclasses
import math
import re
import time
from collections.abc import Sequence

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._counts import whole_number
from ..config import (
    Config,
    ConfigError,
    apply_overrides,
    check_keys,
    parse_override,
    to_dict,
    validate,
)
from ..integration import jumps_stepped_over
from ..models import DEPTH_PARALLEL_ONLY, rediscretise
from ..splitting import ProjectedSolver, inner_solver
from ..training import (
    NonFiniteEvaluation,
    SolverFailure,
    build,
    build_discretisation,
    check_memory,
    enable_x64_for_run,
    fallback_iterations,
    load_run_at,
    make_eval_step,
    validation_metrics,
    warn_of_tokenizer_mismatch,
    with_precision,
)

GRADIENT_FIELD = "discretisation.gradient"
# Fields that an evaluation resets to their defaults when the changed discretisation
# refuses them and the overrides do not set them: the gradient method acts on training
# only (evaluation takes no gradient), and MGRIT's relaxation, the fields of a
# depth-parallel solve (its chunks, iterations, coarse stepper and steps, costate) and
# the devices its chunks were split over (mesh.depth) belong to the solve an override
# of depth_parallel replaced.
FOLLOWING_FIELDS: tuple[str, ...] = (
    GRADIENT_FIELD,
    "discretisation.relaxation",
    "discretisation.sub_solver",
    *(f"discretisation.{name}" for name in DEPTH_PARALLEL_ONLY),
    "mesh.depth",
)
# The config section that describes how the equation is discretised (with the
# validation set, all that may change between training and evaluation).
DISCRETISATION_SECTIONS: tuple[str, ...] = ("discretisation",)


DEPTH_SOLVE_FIELD = "discretisation.depth_parallel"
# Besides those, evaluate_run takes where the run's dataset directory is now, when it
# was moved (it must hold the same files).
MOVED_FIELD = "task.path"
# The fields outside the discretisation that choose the validation set: which windows a
# run is measured on, not what it learned (runs of different train.seed compare on one
# set when each is evaluated with the same task.eval_seed).
VALIDATION_SET_FIELDS: tuple[str, ...] = (
    "task.eval_seed",
    "task.eval_batches",
    "task.eval_batch_size",
)


def check_evaluation_field(key: str) -> None:
    """Refuse an evaluation-time change of anything but the discretisation and the
    validation set (``VALIDATION_SET_FIELDS``).

    Raises:
        ConfigError: ``key`` is neither.
    """
    if key.split(".", 1)[0] not in DISCRETISATION_SECTIONS and key not in VALIDATION_SET_FIELDS:
        allowed = ", ".join(f"{s}.*" for s in DISCRETISATION_SECTIONS)
        windows = ", ".join(VALIDATION_SET_FIELDS)
        defaults = to_dict(Config())
        for section in DISCRETISATION_SECTIONS:
            if key in defaults[section]:  # a field of the section, given without it
                raise ConfigError(key, f"give the field with its section: {section}.{key}")
        check_keys(key)  # an unknown section or field, with the nearest one
        raise ConfigError(
            key,
            f"evaluation may change only the discretisation ({allowed}) and the "
            f"validation set ({windows}); {key} changes the trained problem itself. Train a "
            "new run to change it.",
        )


def _for_evaluation(error: ConfigError) -> ConfigError:
    """``error`` with a word on the remedies it names that an evaluation cannot take
    (a field of the trained run, such as ``model.precision``), if it names any."""
    message = str(error).removeprefix(f"{error.field}: ").rstrip(".")
    fields = {f"{s}.{k}" for s, section in to_dict(Config()).items() for k in section}
    named = {
        f
        for f in re.findall(r"\b[a-z_]+\.[a-z_0-9]+\b", message)
        if f in fields
        and f.split(".")[0] not in DISCRETISATION_SECTIONS
        and f not in (*VALIDATION_SET_FIELDS, *FOLLOWING_FIELDS, MOVED_FIELD)
    }
    if not named:
        return error
    verb = "belongs" if len(named) == 1 else "belong"
    return ConfigError(
        error.field,
        f"{message}. ({', '.join(sorted(named))} {verb} to the trained run, which an "
        "evaluation does not change: of these remedies, take one in the discretisation.)",
    )


def evaluation_config(config: Config, overrides: Sequence[str]) -> Config:
    """The validated configuration that evaluates a run of ``config`` under its
    discretisation changed by ``overrides``. The fields that act on training only, or
    only on a solve the overrides replace, give way to their defaults when the new
    discretisation does not take them, unless ``overrides`` set them:
    ``FOLLOWING_FIELDS`` (a trained optimise-then-discretise or sub-solver under a
    splitting scheme; an MGRIT FCF-relaxation, or the chunks, iterations, coarse
    stepper and steps, parallel costate or depth devices of a depth-parallel run,
    under the serial solve). The training fields are those of gradient training
    without depth-parallel checks: how the run was trained does not restrict how it is
    evaluated.

    Raises:
        ConfigError: an invalid override or combination.
    """
    # How the run was trained acts on its training only: the bias checks and fallback of
    # a depth-parallel run, and MSA's rules (a fixed grid, a serial solve), which would
    # refuse an evaluation under PID steps or a depth-parallel solve. Evaluation takes
    # no training step, so it judges the discretisation as gradient training would.
    idle = dataclasses.replace(
        config.train, method="gradient", depth_bias_every=0, depth_fallback="none",
        depth_fallback_cosine=None, depth_fallback_patience=0,
    )  # fmt: skip
    changed = apply_overrides(dataclasses.replace(config, train=idle), list(overrides))
    given = {o.split("=", 1)[0].strip() for o in overrides}
    while True:
        try:
            return validate(changed)
        except ConfigError as e:
            if e.field not in FOLLOWING_FIELDS or e.field in given:
                raise _for_evaluation(e) from None
            given.add(e.field)  # reset once: a refusal after it is the override's
            section, name = e.field.split(".", 1)
            default = getattr(getattr(Config(), section), name)
            fields = dataclasses.replace(getattr(changed, section), **{name: default})
            changed = dataclasses.replace(changed, **{section: fields})


def discretisation_of(config: Config) -> dict:
    """The discretisation fields of ``config``, by dotted name."""
    data = to_dict(config)
    return {f"{s}.{k}": v for s in DISCRETISATION_SECTIONS for k, v in data[s].items()}


def _time_stepper(model):
    # The stepper the model's solve hands to diffeqsolve (a splitting scheme or a
    # diffrax solver, possibly wrapped by the projected formulation).
    return model.transformer.time_stepper()


def evaluations_per_step(stepper) -> tuple[int, bool] | None:
    """(vector-field evaluations per step, first-same-as-last) of an explicit diffrax
    Runge-Kutta solver, from its Butcher tableau (a first-same-as-last one wrapped in
    the projected formulation's ``ProjectedSolver`` evaluates every stage of every
    step, as a solver that is not); ``None`` for anything else: an
    implicit solver's evaluations depend on its root finder's iterations (several per
    implicit stage, and its Jacobians), and splitting schemes evaluate sub-flows, not
    the full vector field."""
    inner = inner_solver(stepper)
    if isinstance(inner, diffrax.Euler):
        return 1, False
    if not isinstance(inner, diffrax.AbstractRungeKutta):
        return None
    tableau = inner.tableau
    # An IMEX pair (KenCarp) is a MultiButcherTableau; Kvaerno's stages are implicit.
    if not isinstance(tableau, diffrax.ButcherTableau) or tableau.implicit:
        return None
    # Under the projected formulation every step evaluates its first stage afresh.
    return tableau.num_stages, bool(tableau.fsal) and not isinstance(stepper, ProjectedSolver)


def count_evaluations(stepper, num_steps: int, jumps: int = 0) -> int | None:
    """The vector-field evaluations (NFE) of ``num_steps`` steps of ``stepper``: stages
    per step, one fewer after the first step for first-same-as-last solvers, which
    evaluate their first stage again after each of the ``jumps`` of the control the
    solve steps over (``ocformer.integration.jumps_stepped_over``); ``None`` where
    ``evaluations_per_step`` is."""
    # Python, NumPy or concrete JAX integers (diffrax's statistics are arrays).
    steps, jumped = whole_number(num_steps), whole_number(jumps)
    if steps is None or jumped is None or min(steps, jumped) < 0:
        raise ValueError(
            f"num_steps and jumps must be whole numbers >= 0, got {num_steps!r} and {jumps!r}."
        )
    num_steps, jumps = steps, jumped
    per_step = evaluations_per_step(stepper)
    if per_step is None:
        return None
    stages, fsal = per_step
    if fsal and num_steps:
        return 1 + num_steps * (stages - 1) + jumps
    return num_steps * stages


@eqx.filter_jit
def _solve_stats(model, inputs, key_mask):
    sol = model.transformer.solve(model.initial_state(inputs), key_mask)
    return {k: v for k, v in sol.stats.items() if k != "max_steps"}


def solver_stats(model, batch: dict) -> dict:
    """diffrax's statistics of one forward solve of ``model`` on ``batch``: steps taken,
    accepted and rejected, and the vector-field evaluations (NFE) they cost.

    ``nfe`` is counted from the steps and an explicit solver's tableau (stages per step;
    one fewer after the first step for first-same-as-last solvers, and one more after
    each jump of the control stepped over, where they evaluate their first stage again;
    under the projected formulation they evaluate it at every step).
    It is exact on the constant-step grid; under the PID controller a step rejected
    right after a jump evaluates that stage once more, which diffrax's statistics do not
    show, so ``nfe`` may be low by at most ``rejected_steps`` there. ``None`` for
    implicit solvers, whose count depends on their root finder's iterations, and for
    splitting schemes, whose steps evaluate sub-flows rather than the whole vector
    field. Every count is ``None`` for a depth-parallel solve, which is many chunk
    solves (fine and coarse, in each iteration) rather than one.
    """
    stats = {
        k: int(v)
        for k, v in _solve_stats(model, jnp.asarray(batch["inputs"]), batch.get("key_mask")).items()
    }
    if not stats:  # a depth-parallel solve reports none
        return dict.fromkeys(("solver_steps", "accepted_steps", "rejected_steps", "nfe"))
    t = model.transformer
    stepper = _time_stepper(model)
    jumps = jumps_stepped_over(stepper, t.control, t.discretisation)
    return {
        "solver_steps": stats["num_steps"],
        "accepted_steps": stats["num_accepted_steps"],
        "rejected_steps": stats["num_rejected_steps"],
        "nfe": count_evaluations(stepper, stats["num_steps"], jumps),
    }


def _check_model_fits(model, built) -> None:
    """``model``'s embedding and readout have the arrays of the model ``config`` builds
    (its vocabulary, context, width and classes), so that its task's batches fit it.

    Raises:
        ValueError: naming the first array whose shape differs.
    """
    for part in ("embedding", "head"):
        mine, theirs = getattr(model, part, None), getattr(built, part, None)
        if (mine is None) != (theirs is None):
            raise ValueError(
                f"the model {'has no' if mine is None else 'has a'} {part}, but the "
                f"configuration's model {'has one' if mine is None else 'has none'}: "
                "evaluate the model with the configuration it was built from."
            )
        if mine is None:
            continue
        leaves = jax.tree_util.tree_leaves_with_path(eqx.filter(mine, eqx.is_array))
        expected = jax.tree_util.tree_leaves_with_path(eqx.filter(theirs, eqx.is_array))
        have = {jax.tree_util.keystr(p) for p, _ in leaves}
        want = {jax.tree_util.keystr(p) for p, _ in expected}
        if have != want:  # another kind of embedding or head (a class token, a bias, ...)
            differ = sorted(have ^ want)[0]
            raise ValueError(
                f"the model does not fit the configuration: {part}{differ} is "
                f"{'only in the model' if differ in have else 'missing from the model'} "
                f"({type(mine).__name__} against the configuration's "
                f"{type(theirs).__name__}); evaluate the model with the configuration it "
                "was built from."
            )
        for (path, a), (_, b) in zip(leaves, expected, strict=True):
            if a.shape != b.shape:
                name = f"{part}{jax.tree_util.keystr(path)}"
                raise ValueError(
                    f"the model does not fit the configuration: {name} has shape "
                    f"{a.shape}, the configuration's model {b.shape} (the vocabulary, context, "
                    "width or classes differ); evaluate the model with the configuration it was "
                    "built from."
                )


def evaluate(config: Config, model, task=None) -> dict:
    """Validation metrics of ``model`` on the validation split of ``config``'s task.

    Args:
        config: the run's configuration (its task, objective and discretisation).
        model: the model to evaluate, of the shapes ``config`` builds.
        task: the task already built for ``config`` (None: built here), so that a
            caller evaluating several models loads its data once.

    Returns:
        ``val_loss`` (the task loss), ``val_objective``, the task's other metrics as
        ``val_<name>`` (``val_accuracy``), the solver statistics of one forward solve
        (``solver_steps``, ``accepted_steps``, ``rejected_steps``, ``nfe``) and
        ``eval_time_s``.

    Raises:
        SolverFailure: a diffrax solve failed (step ``0`` stands for evaluation).
        NonFiniteEvaluation: the validation loss is NaN or Inf.
    """
    started = time.perf_counter()
    exp = build(config, task, record_source=False)  # its objective and task; model given
    _check_model_fits(model, exp.model)
    task = exp.task
    tc = config.task
    batches = [
        {k: jnp.asarray(v) for k, v in b.items()}
        for b in task.eval_batches(tc.eval_batch_size, tc.eval_batches, config.eval_seed)
    ]
    step = make_eval_step(with_precision(exp.objective, config))  # as training evaluates
    try:
        records = [{k: float(v) for k, v in step(model, b).items()} for b in batches]
        stats = solver_stats(model, batches[0])
    except eqx.EquinoxRuntimeError as e:
        raise SolverFailure.from_error(0, e, where="in the evaluation") from None
    out = validation_metrics(records)
    if not math.isfinite(out["val_loss"]):
        fill = np.iinfo(np.int32).max  # what a failed solve's counts hold under EQX_ON_ERROR=nan
        raise NonFiniteEvaluation(any(v == fill for v in stats.values() if v is not None))
    out.update(stats)
    out["eval_time_s"] = time.perf_counter() - started
    return out


def evaluate_start(config: Config) -> dict:
    """Evaluate the model a run of ``config`` starts from, before its first update: the
    source of ``model.init_from`` posed in ``config``'s discretisation (a pretrained
    checkpoint's loss under Strang at two steps per layer, say), or the seeded
    initialisation. Nothing is trained or written.

    Returns:
        ``evaluate``'s metrics plus ``step`` (0) and ``discretisation`` (every
        discretisation field used).

    Raises:
        ConfigError: an invalid configuration or start.
        SolverFailure, NonFiniteEvaluation: as ``evaluate``.
    """
    validate(config)
    check_memory(config, parts=("validation set",))
    exp = build(config, record_source=False)
    warn_of_tokenizer_mismatch(config, exp.task)
    metrics = evaluate(config, exp.model, exp.task)
    return {"step": 0, "discretisation": discretisation_of(config), **metrics}


def evaluate_run(workdir: str, overrides: Sequence[str] = (), step: int | None = None) -> dict:
    """Evaluate the trained run in ``workdir`` under its discretisation changed by
    ``overrides`` (``"section.field=value"``: discretisation fields, those of the
    validation set, ``VALIDATION_SET_FIELDS``, and ``task.path`` for a moved dataset). A trained
    gradient method, depth-parallel costate or MGRIT relaxation that the new
    discretisation does not take is replaced by its default (``evaluation_config``),
    unless ``overrides`` set it.

    Without an override of its depth-parallel solve, a run whose depth fallback
    (``train.depth_fallback``) fired by the checkpoint's step is evaluated as it then
    trained: under the serial solve, or the raised iterations.

    Returns:
        ``evaluate``'s metrics plus ``workdir``, ``step`` (of the checkpoint),
        ``overrides``, ``depth_fallback_iterations`` (the iterations its fallback
        left, 0 for serial; None when none fired or the overrides set the solve) and
        ``discretisation`` (every discretisation field used).

    Raises:
        ConfigError: an override of another field, or an invalid one.
        ocformer.training.WorkdirError: not a run directory, or no checkpoint.
        ocformer.checkpointing.CheckpointError: a corrupted checkpoint.
        SolverFailure: a solve failed under the new discretisation.
        NonFiniteEvaluation: the validation loss is NaN or Inf under it.
        ValueError: ``step`` is not a whole number.
    """
    if isinstance(overrides, str):  # iterated, it would be one override per character
        raise ConfigError(
            "overrides",
            f"a list of 'section.field=value' strings, got the string {overrides!r}: give "
            f"[{overrides!r}]",
        )
    # task.path may name where the run's dataset was moved (the same files).
    moved = [o for o in overrides if o.split("=", 1)[0].strip() == MOVED_FIELD]
    changes = [o for o in overrides if o not in moved]
    for text in changes:
        check_evaluation_field(text.split("=", 1)[0].strip())
    task_path = None
    for text in moved:
        task_path = parse_override(text)[1]
        if not task_path:  # none, or an empty path
            raise ConfigError(
                MOVED_FIELD,
                f"{text!r} names no directory; give where the run's dataset was moved: "
                f"--set {MOVED_FIELD}=DIR",
            )
    enable_x64_for_run(workdir)  # before its model is built, as in ocformer.train
    config, trained, at_step = load_run_at(workdir, step, task_path=task_path)
    # As trained: the solve a depth fallback left (the configured one is the run's
    # start), unless the overrides choose the depth-parallel solve or one of its fields.
    fell_back = None
    solve_fields = {DEPTH_SOLVE_FIELD, *FOLLOWING_FIELDS} - {GRADIENT_FIELD}
    solve_given = solve_fields & {o.split("=", 1)[0].strip() for o in changes}
    if config.discretisation.depth_parallel is not None and not solve_given:
        fell_back = fallback_iterations(workdir, at_step)
        if fell_back is not None:
            changes = [
                *changes,
                f"{DEPTH_SOLVE_FIELD}=none"
                if fell_back == 0
                else f"discretisation.iterations={fell_back}",
            ]
    new_config = evaluation_config(config, changes)
    check_memory(new_config, parts=("validation set",))
    # A replace of the discretisation value: the trained arrays are untouched, and the
    # grid-dependent parts are derived from the new value at the next solve.
    model = rediscretise(trained, build_discretisation(new_config))
    metrics = evaluate(new_config, model)
    return {
        "workdir": workdir,
        "step": at_step,
        "overrides": list(overrides),
        "depth_fallback_iterations": fell_back,
        "discretisation": discretisation_of(new_config),
        **metrics,
    }
