"""Validation of a ``Config``: types, ranges, choices, and combinations that cannot work.

Every error names the dotted field, the value received and what is allowed. Allowed
names are the schema's choices, which come from the library's registries (tasks,
formulations, schemes, solvers, gradient methods, ...), and combinations are judged by
the library's own rule table (``ocformer.models.RULES``), the one model construction
uses. Validation traces and allocates nothing.
"""

import dataclasses
import difflib
import math
import types
import typing
from typing import Any, cast

import diffrax

from ..dynamics import SubSolver
from ..models import DEPTH_PARALLEL_ONLY, Choices, describe_stepper, refusals
from ..objective import msa_refusals, ternary_refusals
from ..splitting import SCHEMES, SOLVERS
from ..tasks import TASKS
from ._explicit import is_set
from ._schema import (
    SECTIONS,
    Config,
    DiscretisationConfig,
    TaskConfig,
    TrainConfig,
    field_value,
)


class ConfigError(ValueError):
    """A configuration that cannot run. ``field`` is the dotted path of the culprit.

    The command line reports it and exits with code 2.
    """

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"{field}: {message}" if field else message)


# The largest integer a field takes unless it states its own bound: steps, sizes and
# counts become int32 arrays (the schedule's step, the data's indices).
INT32_MAX = 2**31 - 1


def field_types(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def section_class(name: str) -> type:
    return type(getattr(Config(), name))


def _allowed_fields(section: str) -> list[str]:
    return [f"{section}.{f.name}" for f in dataclasses.fields(section_class(section))]


def check_keys(dotted: str) -> dataclasses.Field | None:
    """Check that ``dotted`` names a section or a field; suggest the nearest if not."""
    parts = dotted.split(".")
    if not dotted or len(parts) > 2 or not all(parts):
        raise ConfigError(
            dotted,
            f"malformed key {dotted!r}; keys are 'section.field' with section one of "
            f"{', '.join(SECTIONS)}",
        )
    section = parts[0]
    if section not in SECTIONS:
        near = difflib.get_close_matches(section, SECTIONS, n=1)
        hint = f"; did you mean {near[0]}?" if near else ";"
        raise ConfigError(
            dotted,
            f"unknown section {section}{hint} allowed: {', '.join(SECTIONS)}",
        )
    if len(parts) == 1:
        return None
    fields = {f.name: f for f in dataclasses.fields(section_class(section))}
    if parts[1] not in fields:
        allowed = _allowed_fields(section)
        near = difflib.get_close_matches(dotted, allowed, n=1)
        hint = f"; did you mean {near[0]}?" if near else ";"
        raise ConfigError(dotted, f"unknown field {dotted}{hint} allowed: {', '.join(allowed)}")
    return fields[parts[1]]


def _type_name(tp) -> str:
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _is_instance(value, tp) -> bool:
    origin = typing.get_origin(tp)
    if origin in (types.UnionType, typing.Union):
        return any(_is_instance(value, a) for a in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, tuple):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_is_instance(v, args[0]) for v in value)
        return len(args) == len(value) and all(map(_is_instance, value, args))
    if tp is float:
        # An integer is a fine float; a bool is not a number here.
        return isinstance(value, int | float) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, tp)


def _check_field(path: str, f: dataclasses.Field, tp, value) -> None:
    if not _is_instance(value, tp):
        raise ConfigError(
            path,
            f"expected {_type_name(tp)}, got {value!r} ({type(value).__name__})",
        )
    numbers = value if isinstance(value, tuple) else (value,)
    if any(isinstance(v, float) and not math.isfinite(v) for v in numbers):
        raise ConfigError(path, f"must be a finite number, got {value!r}")
    meta = f.metadata
    choices = meta.get("choices")
    if choices is not None and value not in choices:
        names = [c for c in choices if isinstance(c, str)]
        near = difflib.get_close_matches(value, names, n=1) if isinstance(value, str) else []
        hint = f"did you mean {near[0]!r}? " if near else ""
        raise ConfigError(
            path,
            f"got {value!r}; {hint}allowed: "
            # None as --set spells it (and a config file writes it).
            + ", ".join("none (None)" if c is None else repr(c) for c in choices),
        )
    if (
        meta.get("le") is None
        and meta.get("lt") is None
        and any(
            isinstance(v, int) and not isinstance(v, bool) and abs(v) > INT32_MAX for v in numbers
        )
    ):
        low = next((meta[k] + (k == "gt") for k in ("ge", "gt") if meta.get(k) is not None), None)
        low = -INT32_MAX if low is None else low
        raise ConfigError(
            path,
            f"must lie in [{low}, {INT32_MAX}] (it is held as a 32-bit integer), got {value!r}",
        )
    if value is None or isinstance(value, str | bool | tuple):
        return
    tests = {
        "ge": (">=", lambda lim: value >= lim),
        "gt": (">", lambda lim: value > lim),
        "le": ("<=", lambda lim: value <= lim),
        "lt": ("<", lambda lim: value < lim),
    }
    for key, (sign, holds) in tests.items():
        limit = meta.get(key)
        if limit is not None and not holds(limit):
            raise ConfigError(path, f"must be {sign} {limit}, got {value!r}")


def stepper_object(name: str, sub_solver: str = "euler") -> diffrax.AbstractSolver:
    """The time stepper object of a ``discretisation.stepper`` name: a splitting scheme
    with its sub-solver, or a diffrax solver. Names become objects here and in
    ``ocformer.training.build``, nowhere else."""
    if name in SCHEMES:
        return SCHEMES[name](sub_solver=cast(SubSolver, sub_solver))
    return SOLVERS[name]()


def choices(c: Config) -> Choices:
    """The configuration's equation and discretisation as the rules' plain values."""
    d, m = c.discretisation, c.model
    sub_solver = d.sub_solver if d.stepper in SCHEMES else "euler"
    coarse = describe_stepper(stepper_object(d.coarse_stepper))
    return dataclasses.replace(
        Choices(
            **describe_stepper(stepper_object(d.stepper, sub_solver)),
            depth_parallel=d.depth_parallel,
            relaxation=d.relaxation,
            depth_costate=d.depth_costate,
            coarse_stepper=coarse["stepper"],
            coarse_stepper_kind=coarse["stepper_kind"],
            coarse_error_estimate=coarse["error_estimate"],
            coarse_steps=d.coarse_steps,
            iterations=d.iterations,
            chunks=d.chunks,
            steps_per_layer=d.steps_per_layer,
            stepsize=d.stepsize,
            jump_ts=d.jump_ts,
            gradient=d.gradient,
            norm=m.norm,
            formulation=m.formulation,
            relaxation_eps=m.relaxation_eps,
            controls=c.controls.kind,
            scalar_norm=c.controls.norm_affine == "scalar",
            num_layers=m.num_layers,
        ),
        sub_solver=d.sub_solver,
    )


def validate(config: Config) -> Config:
    """Check every field of ``config`` and the combinations; return it unchanged.

    Raises:
        ConfigError: naming the dotted field, the value and what is allowed.
    """
    if not isinstance(config, Config):
        raise ConfigError("", f"expected an ocformer.config.Config, got {type(config).__name__}")
    for section in SECTIONS:
        value = getattr(config, section)
        cls = section_class(section)
        if type(value) is not cls:
            raise ConfigError(section, f"expected {cls.__name__}, got {type(value).__name__}")
        hints = field_types(cls)
        for f in dataclasses.fields(cls):
            _check_field(f"{section}.{f.name}", f, hints[f.name], getattr(value, f.name))
    _check_combinations(config)
    return config


# The fields a start (``model.init_from``) fixes: the source model's architecture
# (``ocformer.training``'s ``architecture`` gives their values).
START_FIELDS = (
    "model.num_layers",
    "model.width",
    "model.num_heads",
    "model.hidden",
    "model.norm",
    "model.activation",
    "model.ln_eps",
    "model.final_norm",
    "model.readout",
    "model.attention",
    "controls.kind",
    "controls.norm_affine",
)


def _from_start(c: Config) -> bool:
    """Whether the checks that read architecture fields wait for the run's start: with
    ``model.init_from`` the source model fixes those fields (one left unset takes its
    value, one set otherwise is a conflict, reported as such), so the combinations are
    checked once the source is read, with its values filled in (``ocformer.training``)."""
    if c.model.init_from is None:
        return False
    return not all(is_set(getattr(c, f.split(".")[0]), f.split(".")[1]) for f in START_FIELDS)


def _check_combinations(c: Config) -> None:
    m = c.model
    if m.width % m.num_heads and not _from_start(c):
        raise ConfigError(
            "model.num_heads",
            f"num_heads={m.num_heads} must divide model.width={m.width}; choose a "
            f"divisor of {m.width}",
        )
    _check_mesh(c)
    _check_precision(c)
    _check_profile(c)
    _check_weight_decay(c)
    if c.task.name == "tokens" and not c.task.path:
        raise ConfigError(
            "task.path",
            "task.name=tokens reads a dataset directory: set task.path=DIR, a directory "
            "written by `python -m ocformer.tasks.prepare text --input FILE --tokenizer "
            "char --out DIR`",
        )
    if m.init_from is not None and not m.init_from.strip():
        raise ConfigError(
            "model.init_from",
            "is empty (it would name the current directory); give the path of a Hugging "
            "Face checkpoint directory or an ocformer work directory, or none",
        )
    if c.task.path and c.task.name != "tokens":
        raise ConfigError(
            "task.path",
            f"only task.name=tokens reads a dataset directory; task.name={c.task.name} "
            "would ignore it: add --set task.name=tokens, or drop task.path",
        )
    _check_task_options(c)
    # With model.init_from the source fixes the readout, and a source that does not fit
    # the task is refused as such once it is read.
    if m.readout == "tied" and m.init_from is None and TASKS[c.task.name].make.kind != "lm":
        raise ConfigError(
            "model.readout",
            f"a tied readout reads logits from the token embedding, and task.name="
            f"{c.task.name} is a classification task with patch embeddings; use "
            "model.readout=linear",
        )
    if m.attention == "conv" and m.conv_kernel % 2 == 0:
        raise ConfigError(
            "model.conv_kernel",
            f"{m.conv_kernel} has no centre cell: the kernel side must be odd (1, 3, 5, ...)",
        )
    found = [] if _from_start(c) else refusals(choices(c))
    if found:
        raise ConfigError(found[0].field, found[0].message)
    _check_depth_objective(c)
    _check_depth_training(c)
    if c.train.method == "msa":
        _check_msa(c)
    _check_ternary(c)
    o = c.objective
    if c.controls.kind == "basis":
        if c.controls.basis_size > m.num_layers and not _from_start(c):
            raise ConfigError(
                "controls.basis_size",
                f"basis_size={c.controls.basis_size} coefficient sets are fitted to the "
                f"model.num_layers={m.num_layers} initial layers by least squares, so it "
                f"must be <= {m.num_layers}; lower controls.basis_size or add layers",
            )
        if o.sigma_floor is not None or o.kernel_norm is not None:
            raise ConfigError(
                "objective.sigma_floor",
                "constraints are enforced by projecting the stored control values, and a "
                "basis control stores expansion coefficients (clipping them neither "
                "bounds theta(t) nor projects it); set objective.sigma_floor=none and no "
                "kernel bound, or use controls.kind=piecewise_constant|piecewise_linear",
            )
    if (o.kernel_norm is None) != (o.kernel_bound is None):
        raise ConfigError(
            "objective.kernel_bound",
            "objective.kernel_norm and objective.kernel_bound go together (got "
            f"kernel_norm={o.kernel_norm!r}, kernel_bound={o.kernel_bound!r})",
        )


def unread_task_options(task: str) -> list[str]:
    """The options of some task (``ocformer.tasks.TASKS``) that task ``task`` does not
    read."""
    read = set(TASKS[task].options)
    every = dict.fromkeys(o for spec in TASKS.values() for o in spec.options)
    return [name for name in every if name not in read]


def _check_task_options(c: Config) -> None:
    """A task option set for a task that does not read it is refused: the run would
    train on something else than asked (``task.vocab_size`` under ``task.name=tokens``,
    whose vocabulary is its manifest's, say). ``task.path`` has its own message above."""
    for name in unread_task_options(c.task.name):
        if name == "path" or not is_set(c.task, name):
            continue
        readers = [t for t, spec in TASKS.items() if name in spec.options]
        raise ConfigError(
            f"task.{name}",
            f"is {getattr(c.task, name)!r}, but task.name={c.task.name} does not read it "
            f"(only {', '.join(readers)} {'does' if len(readers) == 1 else 'do'}"
            f"{_instead(c.task.name, name)}); drop task.{name}",
        )


def _instead(task: str, name: str) -> str:
    """What stands for option ``name`` under ``task``, where something does."""
    if task == "tokens" and name == "vocab_size":
        return "; the vocabulary size of task.name=tokens is its dataset manifest's"
    if task == "tokens" and name == "data_dir":
        return "; task.name=tokens reads the dataset directory task.path"
    return ""


def _check_msa(c: Config) -> None:
    o = c.objective
    found = msa_refusals(
        choices(c), control_smoothness=o.control_smoothness, kinetic_energy=o.kinetic_energy
    )
    if found:
        raise ConfigError(found[0].field, found[0].message)
    if c.model.precision not in (None, c.model.dtype):
        raise ConfigError(
            "model.precision",
            f"train.method=msa computes in the parameters' dtype ({c.model.dtype}); "
            f"model.precision={c.model.precision} is a policy of gradient training. Leave "
            "model.precision unset, or use train.method=gradient",
        )


def _check_ternary(c: Config) -> None:
    o = c.objective
    if not o.ternary:
        if o.ternary_sparsity > 0:
            raise ConfigError(
                "objective.ternary_sparsity",
                f"{o.ternary_sparsity} weights |W|_0 in the ternary projection, but the "
                "kernels are real; set objective.ternary=true, or ternary_sparsity=0",
            )
        return
    found = ternary_refusals(choices(c), kernel_norm=o.kernel_norm)
    if found:
        raise ConfigError(found[0].field, found[0].message)


def _check_precision(c: Config) -> None:
    m, d = c.model, c.discretisation
    if m.precision == "float64" and m.dtype != "float64":
        raise ConfigError(
            "model.precision",
            f"float64 compute on {m.dtype} parameters would round every gradient back to "
            f"{m.dtype}; set model.dtype=float64 too, or model.precision={m.dtype}",
        )
    if m.precision == "bfloat16":
        ch = choices(c)
        steppers = [("stepper", d.stepper, ch.stepper_kind)]
        if d.depth_parallel is not None:
            steppers.append(("coarse_stepper", d.coarse_stepper, ch.coarse_stepper_kind))
        for field, name, kind in steppers:
            if kind in ("implicit", "imex"):
                raise ConfigError(
                    "model.precision",
                    f"model.precision=bfloat16 with the {kind} solver {name} "
                    f"(discretisation.{field}): its Newton iterations would compute the "
                    "stage equations' residuals in bfloat16 (resolution 7.8e-3), which "
                    "cannot meet their tolerance, and every solve would fail. Use "
                    "model.precision=float32 (or leave it unset) with implicit solvers, or "
                    "an explicit solver or splitting scheme in bfloat16",
                )


def unread_fields(c: Config) -> dict[str, str]:
    """The fields set away from their defaults that the run of ``c`` never reads, each
    with why (a momentum under adam, a sampling temperature with nothing sampled, an MSA
    option under gradient training, ...). Accepted, since a sweep's axis may set them on
    every point; the training command warns of them."""
    m, o, t = c.model, c.optimiser, c.train
    msa = t.method == "msa"
    gradient = not msa
    rules = [
        # The optimiser section under train.method=msa is not listed: it is kept so that
        # one experiment file serves both methods (a sweep's method axis, the ste arm of
        # experiments/digits_ternary.py).
        ("optimiser.momentum", gradient and o.name != "sgd",
         f"only sgd has a momentum, not {o.name}"),
        ("optimiser.b1", gradient and o.name == "sgd", "sgd has no betas"),
        ("optimiser.b2", gradient and o.name == "sgd", "sgd has no betas"),
        ("optimiser.end_lr_ratio", gradient and o.schedule == "constant",
         "the constant schedule keeps its peak rate"),
        ("model.relaxation_eps", m.formulation != "relaxed",
         f"it is the relaxed formulation's, and model.formulation={m.formulation}"),
        ("model.conv_kernel", m.attention != "conv", "model.attention=dot has no kernels"),
        ("model.conv_init_scale", m.attention != "conv", "model.attention=dot has no kernels"),
        ("controls.basis_size", c.controls.kind != "basis",
         f"controls.kind={c.controls.kind} has no basis"),
        ("train.sample_prompt", t.sample_tokens == 0, "train.sample_tokens=0 samples nothing"),
        ("train.sample_temperature", t.sample_tokens == 0,
         "train.sample_tokens=0 samples nothing"),
        *((f"train.{f.name}", not msa, "train.method=gradient runs no MSA iteration")
          for f in dataclasses.fields(TrainConfig) if f.name.startswith("msa_")),
        *((f"train.{name}", msa and not c.objective.ternary,
           "objective.ternary is off") for name in ("msa_ternary_step", "msa_ternary_memory")),
    ]  # fmt: skip
    default, out = Config(), {}
    for f, unread, why in rules:  # the first rule that holds gives the reason
        if unread and f not in out and field_value(c, f) != field_value(default, f):
            out[f] = why
    return out


def _check_weight_decay(c: Config) -> None:
    o = c.optimiser
    # Only adamw decays weights: with adam or sgd a decay, or the choice of what to
    # decay, would be silently ignored. A weight decay of 0 with "matrices" is accepted
    # (a sweep over the decay may include 0). Under train.method=msa the optimiser
    # section is unused and is checked as for gradient training, so that one file
    # serves both methods.
    if o.weight_decay > 0 and o.name != "adamw":
        raise ConfigError(
            "optimiser.weight_decay",
            f"weight_decay={o.weight_decay:g} is adamw's decoupled weight decay, and "
            f"optimiser.name={o.name} applies none: the run would train without it. Set "
            "optimiser.name=adamw, or optimiser.weight_decay=0",
        )
    if o.weight_decay_on != "all" and o.name != "adamw":
        raise ConfigError(
            "optimiser.weight_decay_on",
            f"weight_decay_on={o.weight_decay_on} chooses the parameters of adamw's "
            f"decoupled weight decay, and optimiser.name={o.name} applies no weight "
            "decay; set optimiser.name=adamw, or optimiser.weight_decay_on=all",
        )


def _profile_range(text: str) -> tuple[int, int] | None:
    """``(A, B)`` of a ``train.profile_steps`` value ``"A:B"``, or None if malformed."""
    parts = text.split(":")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        return None
    return int(parts[0]), int(parts[1])


def _check_profile(c: Config) -> None:
    text, steps = c.train.profile_steps, c.train.steps
    if text is None:
        return
    span = _profile_range(text)
    if span is None:
        raise ConfigError(
            "train.profile_steps",
            f"got {text!r}; give two step counts A:B (the trace covers steps A+1 to B), "
            "e.g. train.profile_steps=10:15",
        )
    if not span[0] < span[1] <= steps:
        raise ConfigError(
            "train.profile_steps",
            f"got {text!r}; A:B needs A < B <= train.steps={steps} (the trace covers "
            "steps A+1 to B), e.g. train.profile_steps=10:15",
        )


def _check_mesh(c: Config) -> None:
    """Sizes of 0 and two "the rest"s. Whether the sizes divide the batch, the heads and
    the hidden width is checked at start (``ocformer.distributed.mesh_shape``), after
    whether there are that many devices: on one device, ``mesh.data=3`` is refused for
    the device count, not for the batch size."""
    mesh = c.mesh
    for name in ("data", "model"):
        if getattr(mesh, name) == 0:
            raise ConfigError(
                f"mesh.{name}", "got 0; give a number of devices >= 1, or -1 for the rest"
            )
    _check_depth(c)
    if mesh.data == -1 and mesh.model == -1:
        raise ConfigError(
            "mesh.model",
            "mesh.data and mesh.model are both -1 ('the rest'); fix one of them, e.g. mesh.model=1",
        )


def _check_depth(c: Config) -> None:
    """``mesh.depth``: devices over which the chunks of a depth-parallel solve are split,
    so it must divide the layers and the chunks, and needs a depth-parallel solve."""
    depth, d, layers = c.mesh.depth, c.discretisation, c.model.num_layers
    if depth == 1:
        return
    if d.depth_parallel is None:
        raise ConfigError(
            "mesh.depth",
            f"mesh.depth={depth} splits the chunks of a depth-parallel solve over devices, "
            "but discretisation.depth_parallel is none; set discretisation.depth_parallel="
            "parareal, or mesh.depth=1",
        )
    if _from_start(c):
        return
    if layers % depth:
        raise ConfigError(
            "mesh.depth",
            f"mesh.depth={depth} devices must divide model.num_layers={layers} (each "
            "device sweeps the same number of whole chunks of layers); choose a divisor "
            "of the layer count",
        )
    chunks = layers if d.chunks is None else d.chunks
    if chunks % depth:
        raise ConfigError(
            "mesh.depth",
            f"mesh.depth={depth} devices must divide the {chunks} chunks "
            "(discretisation.chunks; each device sweeps the same number of them); choose "
            "a divisor of the chunk count",
        )


def _check_depth_objective(c: Config) -> None:
    if c.discretisation.depth_parallel is not None and c.objective.kinetic_energy:
        raise ConfigError(
            "objective.kinetic_energy",
            "the kinetic energy needs the states of every step, and a depth-parallel solve "
            "(discretisation.depth_parallel) gives u(T) only; set objective."
            "kinetic_energy=0, or discretisation.depth_parallel=none",
        )


def _check_depth_training(c: Config) -> None:
    """The bias checks and the fallback rule of ``train`` act on a depth-parallel solve,
    and the fallback needs one of its two conditions."""
    t, solve = c.train, c.discretisation.depth_parallel
    if solve is None:
        for name, value, off in (
            ("depth_bias_every", t.depth_bias_every, 0),
            ("depth_fallback", t.depth_fallback, "none"),
            ("depth_fallback_cosine", t.depth_fallback_cosine, None),
            ("depth_fallback_patience", t.depth_fallback_patience, 0),
        ):
            if value != off:
                raise ConfigError(
                    f"train.{name}",
                    f"train.{name}={value} acts on a depth-parallel solve, but "
                    "discretisation.depth_parallel is none; set discretisation.depth_parallel"
                    f"=parareal (or mgrit), or train.{name}={'none' if off is None else off}",
                )
        return
    if t.depth_bias_every and t.method == "msa":
        raise ConfigError(
            "train.depth_bias_every",
            "the bias checks compare gradients, and train.method=msa takes no gradient "
            "step; set train.depth_bias_every=0, or train.method=gradient",
        )
    if t.depth_fallback_cosine is not None and not t.depth_bias_every:
        raise ConfigError(
            "train.depth_fallback_cosine",
            "the cosine condition is tested at the bias checks, and train.depth_bias_every"
            "=0 makes none; set train.depth_bias_every=N, or train.depth_fallback_cosine="
            "none",
        )
    if t.depth_fallback == "none" and (
        t.depth_fallback_cosine is not None or t.depth_fallback_patience
    ):
        raise ConfigError(
            "train.depth_fallback",
            "train.depth_fallback_cosine or train.depth_fallback_patience is set, but "
            "train.depth_fallback=none does nothing when they fire; set train."
            "depth_fallback=serial (or raise_iterations)",
        )
    fires = t.depth_fallback_cosine is not None or t.depth_fallback_patience
    if t.depth_fallback != "none" and not fires:
        raise ConfigError(
            "train.depth_fallback",
            f"train.depth_fallback={t.depth_fallback} has no condition to fire on; set "
            "train.depth_fallback_cosine=C (with train.depth_bias_every=N) or train."
            "depth_fallback_patience=P, or train.depth_fallback=none",
        )


def as_recorded(data: dict) -> dict:
    """A configuration recorded by a run (``config.json``, a checkpoint's marker), read
    with the meaning it had when that run trained: a field that version accepted and
    ignored, and that this version refuses instead, is set back to its default.
    Those are the depth-parallel fields (``ocformer.models.DEPTH_PARALLEL_ONLY``), and
    the depth fallback's conditions (``train.depth_fallback_cosine``, ``_patience``),
    under ``discretisation.depth_parallel`` none: the serial solve never read them; the
    options of other tasks than the run's (``task.vocab_size`` under ``tokens``); and
    ``optimise_then_discretise`` on the relaxed formulation, read as the default
    gradient method (the forward solve is the same; its gradients were wrong); and a
    weight decay under ``optimiser.name`` adam or sgd, which decay nothing.
    A new configuration is never read this way: there they are refused."""
    if not isinstance(data, dict):
        return data
    task = data.get("task")
    if isinstance(task, dict) and task.get("name") in TASKS:
        defaults = {f.name: f.default for f in dataclasses.fields(TaskConfig)}
        unread = unread_task_options(task["name"])
        reset = {k: defaults[k] for k in unread if k in task and k != "path"}
        data = {**data, "task": {**task, **reset}}
    optimiser = data.get("optimiser")
    if isinstance(optimiser, dict) and optimiser.get("name") in ("adam", "sgd"):
        # A weight decay their update never read (refused since).
        data = {**data, "optimiser": {**optimiser, "weight_decay": 0.0}}
    disc = data.get("discretisation")
    model = data.get("model")
    if (
        isinstance(disc, dict)
        and isinstance(model, dict)
        and model.get("formulation") == "relaxed"
        and disc.get("gradient") == "optimise_then_discretise"
    ):
        # Refused since (its gradients were wrong); the forward solve, which reading a
        # run needs, does not depend on the gradient method.
        default = DiscretisationConfig().gradient
        data = {**data, "discretisation": {**disc, "gradient": default}}
        disc = data["discretisation"]
    if not isinstance(disc, dict) or disc.get("depth_parallel") is not None:
        return data
    defaults = {f.name: f.default for f in dataclasses.fields(DiscretisationConfig)}
    reset = {k: defaults[k] for k in DEPTH_PARALLEL_ONLY if k in disc and k in defaults}
    data = {**data, "discretisation": {**disc, **reset}}
    train = data.get("train")
    if isinstance(train, dict):  # the fallback's conditions, which the serial solve ignored
        defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
        unread = ("depth_fallback_cosine", "depth_fallback_patience")
        data = {**data, "train": {**train, **{k: defaults[k] for k in unread if k in train}}}
    return data


def from_dict(data: dict) -> Config:
    """The inverse of ``to_dict`` (unknown keys raise ``ConfigError``)."""
    if not isinstance(data, dict):
        raise ConfigError("", f"a configuration must be a mapping, got {type(data).__name__}")
    sections = {}
    for name, value in data.items():
        check_keys(name)
        cls = section_class(name)
        if not isinstance(value, dict):
            raise ConfigError(name, f"must be a mapping of fields, got {type(value).__name__}")
        for key in value:
            check_keys(f"{name}.{key}")
        sections[name] = cls(**value)
    return Config(**sections)
