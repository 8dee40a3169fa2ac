"""From a validated ``Config`` to the objects of a run: task, model, objective,
constraints, gradient method and optimiser."""

import dataclasses
import functools
import json
import math
import os
import sys
from typing import Any, cast

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
from jax.sharding import Mesh

from .. import controls
from .._counts import whole_number
from ..checkpointing import (
    CheckpointError,
    CheckpointManager,
    ChecksumMismatch,
    CorruptedCheckpoint,
)
from ..config import Config, ConfigError, as_recorded, from_dict, stepper_object, validate
from ..config._explicit import with_field
from ..controls import NormParams
from ..integration import DEPTH_AXIS, DEPTH_PARALLEL, GRADIENT_METHODS, Discretisation
from ..models import (
    ContinuousTransformer,
    IncompatibleError,
    PatchEmbedding,
    Readout,
    SequenceModel,
    TokenEmbedding,
    rediscretise,
    with_conv_projections,
)
from ..objective import MSA, Constraints, Objective, Ternary
from ..tasks import TASKS, AbstractTextTask, dataset_identity, make_task
from . import _init_from
from ._errors import WorkdirError
from ._optimiser import make_optimiser, under_standard_promotion
from ._rundir import (
    RELATIVE_PATHS,
    RUN_MARKER,
    dataset_change,
    dataset_missing,
    run_record,
    wrote_with_current_dataset,
)


@dataclasses.dataclass(frozen=True)
class Experiment:
    """Everything a training loop needs, built from one configuration.

    Attributes:
        config: the validated configuration.
        task: the ``ocformer.tasks.AbstractTask``.
        model: the initial ``SequenceModel`` (its transformer holds the discretisation,
            gradient method included).
        objective: the ``ocformer.objective.Objective`` (terminal + running costs).
        constraints: the ``ocformer.objective.Constraints`` projected after each update.
        optimiser: the optax transformation.
        schedule: learning rate by step.
        init_from: where the model started (``model.init_from``): the source's path and
            kind, the step of a work directory's checkpoint and the SHA-256 of its
            weight files; None for a fresh initialisation (or with ``build``'s
            ``record_source=False``).
        method: the ``ocformer.objective.MSA`` of ``train.method=msa``, or None for
            gradient training by ``optimiser``.
    """

    config: Config
    task: Any
    model: Any
    objective: Any
    constraints: Any
    optimiser: optax.GradientTransformation
    schedule: optax.Schedule
    init_from: dict | None = None
    method: MSA | None = None

    def init_state(self, model):
        """The state the training step carries: the optimiser's, or MSA's."""
        if self.method is not None:
            return self.method.init(model, self.objective)
        return self.optimiser.init(eqx.filter(model, eqx.is_inexact_array))


def _task_kwargs(config: Config) -> dict:
    """The ``task`` fields that the registry says task ``task.name`` is built from."""
    fields = dataclasses.asdict(config.task)
    return {option: fields[option] for option in TASKS[config.task.name].options}


def build_task(config: Config):
    """The task of ``config``; a task's own refusal becomes a ``ConfigError``."""
    try:
        return make_task(config.task.name, **_task_kwargs(config))
    except FileNotFoundError:
        raise  # DataNotFoundError: reported as such, with its fix
    except ValueError as e:
        # A task's refusal that starts with one of its fields is that field's.
        text = str(e)
        name, _, rest = text.partition(" ")
        if name in {f.name for f in dataclasses.fields(config.task)}:
            raise ConfigError(
                f"task.{name}", f"{rest.rstrip('.')} (the {config.task.name} task)"
            ) from None
        raise ConfigError(f"task ({config.task.name})", text) from None


def _dtype(config: Config):
    if config.model.dtype == "float64" and not jax.config.read("jax_enable_x64"):
        raise ConfigError(
            "model.dtype",
            "float64 needs 64-bit JAX: set JAX_ENABLE_X64=1 (the command line does this "
            "for you) or jax.config.update('jax_enable_x64', True)",
        )
    return jnp.dtype(config.model.dtype)


def build_discretisation(config: Config) -> Discretisation:
    """The ``Discretisation`` of ``config.discretisation``, field for field."""
    d = config.discretisation
    return Discretisation(
        stepper_object(d.stepper, d.sub_solver),
        steps_per_layer=d.steps_per_layer,
        stepsize=cast(Any, d.stepsize),
        rtol=d.rtol,
        atol=d.atol,
        jump_ts=d.jump_ts,
        gradient=GRADIENT_METHODS[d.gradient](),
        depth_parallel=None
        if d.depth_parallel is None
        else DEPTH_PARALLEL[d.depth_parallel](
            stepper_object(d.coarse_stepper),
            coarse_steps=d.coarse_steps,
            iterations=d.iterations,
            chunks=d.chunks,
            relaxation=cast(Any, d.relaxation),
            costate=cast(Any, d.depth_costate),
        ),
    )


def build_transformer(config: Config, key, *, causal: bool):
    """The ``ContinuousTransformer`` of ``config`` with freshly initialised controls."""
    m, c = config.model, config.controls
    dtype = _dtype(config)
    control = controls.make_control(
        cast(Any, c.kind),
        key,
        num_layers=m.num_layers,
        width=m.width,
        hidden=m.hidden,
        num_basis=c.basis_size,
        norm_affine=c.norm_affine,
        init_scale=c.init_scale,
        dtype=dtype,
    )
    final = None
    if m.final_norm:
        shape = (m.width,) if c.norm_affine == "feature" else ()
        final = NormParams(scale=jnp.ones(shape, dtype), bias=jnp.zeros(shape, dtype))
    try:
        return ContinuousTransformer(
            control,
            norm=cast(Any, m.norm),
            num_heads=m.num_heads,
            causal=causal,
            activation=cast(Any, m.activation),
            ln_eps=m.ln_eps,
            final_norm=final,
            formulation=cast(Any, m.formulation),
            relaxation_eps=m.relaxation_eps,
            discretisation=build_discretisation(config),
            attention_kernel=m.attention_kernel,
        )
    except IncompatibleError as e:  # validation runs the same rules; kept for direct use
        raise ConfigError(e.field, e.message) from None


def build_model(config: Config, task, key):
    """Embedding, transformer and readout for ``task``: freshly initialised, or the
    model of ``model.init_from`` (see ``start_model``)."""
    if config.model.init_from is not None:
        return start_model(config, task)[0]
    m = config.model
    dtype = _dtype(config)
    k_embed, k_control, k_read = jr.split(key, 3)
    if task.kind == "lm":
        # A tied readout's logits u(T) E^T start at unit scale with E ~ N(0, 1/d).
        std = 1 / math.sqrt(m.width) if m.readout == "tied" else 1.0
        embedding = TokenEmbedding(
            task.vocab_size, task.seq_len, m.width, key=k_embed, dtype=dtype, init_std=std
        )
        if m.readout == "tied":
            readout = None
        else:
            readout = Readout(m.width, task.vocab_size, key=k_read, pooling="none", dtype=dtype)
    else:
        example = task.batch("train", 0, 1, config.train.seed)["inputs"]
        embedding = PatchEmbedding(
            example.shape[1:], config.task.patch_size, m.width, key=k_embed, dtype=dtype
        )
        readout = Readout(m.width, task.num_classes, key=k_read, pooling="cls", dtype=dtype)
    transformer = build_transformer(config, k_control, causal=task.kind == "lm")
    if m.attention == "conv":
        if not isinstance(embedding, PatchEmbedding):
            raise ConfigError(
                "model.attention",
                f"convolutional projections act on a 2-D grid of tokens, and task "
                f"{config.task.name!r} has a sequence; use model.attention=dot, or an "
                "image task (task.name=digits)",
            )
        height, width_px = embedding.input_shape[:2]
        p = embedding.patch_size
        transformer = with_conv_projections(
            transformer,
            token_grid=(height // p, width_px // p),
            kernel_size=m.conv_kernel,
            num_prefix=1,  # the class token
            key=jr.fold_in(k_control, 1),
            init_scale=m.conv_init_scale,
        )
    return SequenceModel(embedding, transformer, readout, tied=readout is None)


def start_model(config: Config, task, *, record: bool = True) -> tuple[SequenceModel, dict | None]:
    """The model of ``model.init_from`` for ``task``, in the run's discretisation, and
    the record of where it came from (None without ``record``: the SHA-256 of the
    source's weight files, which a large source takes a while to hash, is needed only
    where the model starts a run).

    The source (a Hugging Face checkpoint directory or an ocformer work directory,
    ``PATH@STEP`` for one of its checkpoints) fixes the architecture; a field of the
    configuration set to another value is refused, as is a task the model cannot run.
    The formulation, the discretisation, the dtype and the attention kernel are the
    run's.

    Raises:
        ConfigError: on ``model.init_from`` or the field that conflicts (with both
            values), before anything is written.
    """
    spec = config.model.init_from
    assert spec is not None
    source = _init_from.parse_source(spec)
    if source.kind == "checkpoint":
        model = _init_from.read_checkpoint(source, _dtype(config))
        files, step = _init_from.checkpoint_files(source), None
    else:
        try:
            recorded, model, step, checkpoint = restore_run(source.path, source.step)
        except WorkdirError as e:
            raise ConfigError("model.init_from", str(e)) from None
        except ConfigError as e:  # the source's configuration, not this run's
            if e.field == "model.init_from":  # the source's own start is gone or changed
                why = (
                    f"the run in {source.path} started from another checkpoint, which "
                    f"rebuilding it reads: {e}"
                )
            elif e.field == "model.dtype":  # a float64 source of a run in another dtype
                why = (
                    f"the run in {source.path} is float64, and rebuilding it needs 64-bit "
                    "JAX: set JAX_ENABLE_X64=1 or jax.config.update('jax_enable_x64', True) "
                    "(ocformer.train, ocformer.evaluate and ocformer.export do this for you)"
                )
            else:
                why = (
                    f"{source.path}/config.json cannot be rebuilt by this version of ocformer: {e}"
                )
            raise ConfigError("model.init_from", why) from None
        files = [
            os.path.join(root, name) for root, _, names in os.walk(checkpoint) for name in names
        ]
        unfinished = source.step is None and step < recorded.train.steps
        if record and unfinished and jax.process_index() == 0:
            # The newest checkpoint of a run that is not done (still training, or stopped).
            print(
                f"ocformer: warning: model.init_from={spec}: the run there is at step {step} "
                f"of its {recorded.train.steps} (still training, or stopped before its end); "
                f"starting from step {step}. Give {source.path}@{step} to start from that "
                "step knowingly, or let the run finish first",
                file=sys.stderr,
                flush=True,
            )
    _init_from.check_architecture(config, source, _init_from.architecture(model))
    _init_from.check_task(config, task, model, source)
    model = _init_from.adapt(model, config, build_discretisation(config))
    return model, _init_from.record(source, step, files, model) if record else None


def restore_run(
    workdir: str | os.PathLike, step: int | None = None, *, task_path: str | None = None
) -> tuple[Config, SequenceModel, int, str]:
    """The configuration and model of an ocformer work directory at a committed
    checkpoint (the newest, or ``step``), that step, and the checkpoint's directory.
    The configuration is the one that wrote that checkpoint (recorded in it): after a
    resume with ``--allow-config-change`` an earlier checkpoint's differs from
    ``config.json``, which is the newest.

    ``task_path`` is where the run's dataset directory is now, when it was moved: it
    must hold the files the run recorded (their SHA-256), and the configuration reads
    it. A checkpoint whose recorded ``task.path`` holds no dataset any more (or any
    checkpoint, when ``task_path`` is given) reads the run's place too (``config.json``'s,
    after a resume that gave the moved place), when the start that wrote it read the
    files the run records now (``wrote_with_current_dataset``).

    Raises:
        WorkdirError: not an ocformer work directory, no configuration, or no committed
            checkpoint (of ``step``).
        ConfigError: the stored configuration is not valid for this version of ocformer.
        ocformer.checkpointing.CheckpointError: a corrupted or mismatched checkpoint.
        ValueError: ``step`` is not a whole number (``"10"`` for ``10``).
    """
    if step is not None and whole_number(step) is None:
        raise ValueError(f"step must be a whole number or None, got {step!r}.")
    path = os.path.abspath(os.fspath(workdir))
    if not os.path.exists(path):
        raise WorkdirError(f"{path} does not exist: give the work directory of a training run")
    if not os.path.isdir(path):
        raise WorkdirError(
            f"{path} is a file, not a directory: give the work directory of a training run"
        )
    if not os.path.isfile(os.path.join(path, RUN_MARKER)):
        raise WorkdirError(f"{path} is not an ocformer work directory (no {RUN_MARKER})")
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            recorded = json.load(f)
        config = validate(from_dict(as_recorded(recorded)))
    except ConfigError as e:  # parsed, but not a configuration (edited by hand, say)
        said = str(e).removeprefix(f"{e.field}: ") if e.field else str(e)
        raise ConfigError(
            e.field,
            f"{said} (read from {path}/config.json, which is not a configuration this "
            "version of ocformer accepts: restore the file the run wrote)",
        ) from None
    except (OSError, json.JSONDecodeError) as e:
        # Missing: rerunning the run's command writes it again; damaged: delete it first.
        fix = "delete it, and " if not isinstance(e, FileNotFoundError) else ""
        raise WorkdirError(
            f"{path}/config.json cannot be read ({e}). Restore it; or {fix}rerun the run's "
            "`python -m ocformer.train` command, which writes it again from the "
            "configuration its newest checkpoint records"
        ) from None
    config = _anchored(config, path)
    if task_path is not None:
        if config.task.name != "tokens":
            raise ConfigError(
                "task.path",
                f"{path} was trained on task {config.task.name!r}, which reads no dataset "
                "directory: drop task.path",
            )
        if not isinstance(run_record(path, "dataset"), dict):
            raise WorkdirError(
                f"{path}/run.json records no dataset files (SHA-256), so a moved dataset "
                f"cannot be checked against them: put the dataset back at {config.task.path}"
            )
        config = _reading(config, os.path.abspath(os.path.expanduser(task_path)))
    if (changed := dataset_change(path, config)) is not None:
        again = "it was prepared again since" if task_path is None else "it is another dataset"
        raise WorkdirError(
            f"{path} was trained on other data than the dataset directory at task.path "
            f"{config.task.path} holds now (SHA-256 prefixes then: {changed[0]}; now: "
            f"{changed[1]}): {again}. Put back the dataset the run trained on to load "
            "the run"
        )
    if (missing := dataset_missing(path, config)) is not None:
        raise WorkdirError(missing)
    built: dict[str, Any] = {}

    def template_for(checkpoints: CheckpointManager, chosen: int):
        # The configuration that wrote the checkpoint: a run resumed with
        # --allow-config-change (another discretisation, say) holds checkpoints of
        # both, and config.json is only the newest's.
        trained = _anchored(_checkpoint_config(checkpoints, chosen, config), path)
        if (
            trained.task.name == "tokens"
            and trained.task.path != config.task.path
            and (
                task_path is not None
                or trained.task.path is None
                or dataset_identity(trained.task.path) is None
            )
            # the files its path held then are those checked above
            and wrote_with_current_dataset(path, chosen)
        ):
            trained = _reading(trained, config.task.path)  # the dataset moved
        if built.get("config") != trained:
            # The model is a template: the checkpoint replaces its parameters.
            built["config"] = trained
            built["exp"] = build_from_own_checkpoint(trained, path)
        exp = built["exp"]
        # The checkpoint's arrays in the order training writes them: the model's, the
        # optimiser state, the random key, the step and the skipped-update count.
        return (
            eqx.filter(exp.model, eqx.is_array),
            exp.init_state(exp.model),
            np.asarray(jr.key_data(jr.key(0))),
            np.asarray(0, np.int64),
            np.asarray(0, np.int64),
        )

    with CheckpointManager(os.path.join(path, "checkpoints")) as checkpoints:
        tree, chosen = _restore_despite_rotation(checkpoints, step, template_for, path)
        directory = checkpoints.path(chosen)
    model = eqx.combine(jax.tree.map(jnp.asarray, tree[0]), built["exp"].model)
    return built["config"], model, chosen, directory


def _reading(config: Config, task_path: str | None) -> Config:
    """``config`` reading its dataset directory at ``task_path``."""
    return dataclasses.replace(config, task=with_field(config.task, "path", task_path))


def _anchored(config: Config, workdir: str) -> Config:
    """``config`` with its relative paths (a dataset, a corpus directory, a start) made
    absolute against the directory the run was started in (``run.json``'s ``cwd``):
    a reader of the run (evaluate, export, load_run) may run anywhere."""
    cwd = run_record(workdir, "cwd")
    if not isinstance(cwd, str):
        return config
    for section, name in RELATIVE_PATHS:
        value = getattr(getattr(config, section), name)
        if isinstance(value, str) and not os.path.isabs(value):
            part = with_field(getattr(config, section), name, os.path.join(cwd, value))
            config = dataclasses.replace(config, **{section: part})
    return config


def _checkpoint_config(checkpoints: CheckpointManager, step: int, stored: Config) -> Config:
    """The configuration recorded in checkpoint ``step``'s commit marker (``stored``, the
    run's config.json, for a checkpoint that records none).

    Raises:
        CheckpointError: the marker cannot be read.
        ConfigError: the recorded configuration is not valid for this version.
    """
    recorded = checkpoints.read_marker(step).get("metadata", {}).get("config")
    if recorded is None:
        return stored
    try:
        return validate(from_dict(as_recorded(recorded)))
    except ConfigError as e:
        raise ConfigError(
            e.field,
            f"the configuration recorded in checkpoint {checkpoints.path(step)} is not "
            f"valid for this version of ocformer: {e}",
        ) from None


# How often a reader picks the newest checkpoint again after the running training
# rotated the one it was reading away.
ROTATION_RETRIES = 5


def _restore_despite_rotation(checkpoints: CheckpointManager, step, template_for, path: str):
    """``(tree, step)`` of checkpoint ``step`` (None: the newest; its template from
    ``template_for(checkpoints, step)``), read while a training
    run may be writing new checkpoints and deleting old ones: a checkpoint that
    disappears while it is read was rotated away, not corrupted, so the newest is picked
    again (or, for an explicit ``step``, the user is told it is gone)."""
    for _ in range(ROTATION_RETRIES):
        steps = checkpoints.steps()
        chosen = steps[-1] if step is None and steps else step
        if chosen not in steps:
            raise WorkdirError(
                f"{path} has no committed checkpoint"
                + ("" if step is None else f" of step {step}")
                + (f"; committed steps: {steps}" if steps else "")
            )
        try:
            return checkpoints.restore(chosen, template_for(checkpoints, chosen)), chosen
        except CheckpointError as e:
            if chosen in checkpoints.steps() and os.path.isdir(checkpoints.path(chosen)):
                # Still there: damaged, as the error says; a reader may take another (not
                # where the reading failed and the checkpoint is sound).
                earlier = [s for s in checkpoints.steps() if s < chosen]
                if earlier and isinstance(e, CorruptedCheckpoint | ChecksumMismatch):
                    e.args = (
                        f"{e} Its earlier committed steps are {earlier}: read one with "
                        "--step (ocformer.evaluate, ocformer.export) or "
                        "load_run(workdir, step).",
                    )
                raise
            if step is not None:
                raise WorkdirError(
                    f"the checkpoint of step {step} in {path} was deleted while it was "
                    "read: the run is still training and keeps only its newest "
                    f"checkpoints; choose one of {checkpoints.steps()}"
                ) from None
    raise WorkdirError(
        f"{path}: the newest checkpoint was deleted while it was read "
        f"{ROTATION_RETRIES} times in a row (the run is checkpointing very often); try again"
    )


def _check_prompt(prompt: str, task: AbstractTextTask) -> None:
    """Refuse a sampling prompt the task cannot encode, before the run starts rather than
    at its first evaluation."""
    try:
        tokens = task.encode(prompt)
    except ValueError as e:
        raise ConfigError(
            "train.sample_prompt",
            f"{prompt!r} cannot be encoded: {str(e).rstrip('.')}; or set train.sample_tokens=0",
        ) from None
    if len(tokens) == 0:
        raise ConfigError(
            "train.sample_prompt",
            f"{prompt!r} encodes to no symbols, and sampling starts from at least one: give "
            f"a prompt such as {_prompt_that_encodes(task)}, or set train.sample_tokens=0",
        )


def _prompt_that_encodes(task: AbstractTextTask) -> str:
    """A prompt the task encodes to at least one symbol: the first word of its training
    text that does (a tokenizer that drops whitespace encodes '\\n' to nothing)."""
    try:
        text = task.decode(task.batch("train", 0, 1, 0)["inputs"][0][:16])
    except (ValueError, IndexError):  # a suggestion only: the refusal stands without it
        text = ""
    for word in [*text.split(), "\n", "The"]:
        try:
            if len(task.encode(word)):
                return repr(word)
        except ValueError:
            continue
    return "a word of the corpus"


def build_from_own_checkpoint(config: Config, workdir: str, **kwargs) -> Experiment:
    """``build(config, record_source=False, **kwargs)`` for the run in ``workdir``, whose
    parameters come from its own checkpoint: the source of ``model.init_from`` gives the
    model only its structure and is not hashed again.

    Raises:
        ConfigError: as ``build``; a missing or changed source says why it is still read.
    """
    try:
        exp = build(config, record_source=False, **kwargs)
    except ConfigError as e:
        if e.field != "model.init_from":
            raise
        raise ConfigError(
            e.field,
            f"{str(e).removeprefix(e.field + ': ').rstrip('.')}. {workdir} takes its "
            "parameters from its own checkpoint, but a run that started from "
            "model.init_from reads the source again for the model's structure: put the "
            "source back at that path",
        ) from None
    _check_source_unchanged(config, workdir, exp.model)
    return exp


def _check_source_unchanged(config: Config, workdir: str, model: SequenceModel) -> None:
    """Refuse a source of ``model.init_from`` whose architecture is no longer the one
    the run in ``workdir`` recorded when it started (``run.json``): a configuration
    edited since (another layer-norm epsilon or activation, which change no array's
    shape) would rebuild the trained run as another function, silently.

    Raises:
        ConfigError: naming each field with its value then and now.
    """
    spec = config.model.init_from
    started = run_record(workdir, "init_from")
    if spec is None or not isinstance(started, dict):
        return
    recorded, path = started.get("architecture"), started.get("path")
    source = _init_from.parse_source(spec).path
    if not isinstance(recorded, dict) or not isinstance(path, str):
        return
    if os.path.realpath(path) != os.path.realpath(source):
        return  # another source than the one recorded (a resume that changed it)
    now = {f"{s}.{n}": v for (s, n), v in _init_from.architecture(model).items()}
    changed = {k: (v, now[k]) for k, v in recorded.items() if k in now and now[k] != v}
    if changed:
        listed = "; ".join(f"{k} was {a!r}, is {b!r}" for k, (a, b) in changed.items())
        raise ConfigError(
            "model.init_from",
            f"{source} has changed since the run in {workdir} started from it: {listed}. "
            "The run takes its parameters from its own checkpoint but its structure from "
            "the source, so it would be rebuilt as another model; put back the source "
            "the run started from",
        )


def build(
    config: Config, task=None, mesh: Mesh | None = None, *, record_source: bool = True
) -> Experiment:
    """Build the run's objects from a validated ``config``.

    The random initialisation depends on ``train.seed`` only. With ``model.init_from``
    the model is the source's, and ``Experiment.init_from`` records the source
    (``record_source=False``: None, the source's files not hashed, for a model whose
    parameters a checkpoint replaces). With a ``mesh`` whose
    ``depth`` axis has several devices (the run's ``Layout``), the model's
    depth-parallel solve splits its chunks over that axis.

    Raises:
        ConfigError: a combination that the library refuses.
        ocformer.tasks.DataNotFoundError: the task's data is not on disk.
    """
    task = build_task(config) if task is None else task
    if config.train.sample_tokens:
        if not isinstance(task, AbstractTextTask):
            raise ConfigError(
                "train.sample_tokens",
                f"task {config.task.name!r} is not a text language model, so it has "
                "nothing to sample; set train.sample_tokens=0",
            )
        _check_prompt(config.train.sample_prompt, task)
    if config.model.init_from is None:
        model, init_from = build_model(config, task, jr.key(config.train.seed)), None
    else:
        model, init_from = start_model(config, task, record=record_source)
    method = model.transformer.discretisation.depth_parallel
    if mesh is not None and method is not None and mesh.shape.get(DEPTH_AXIS, 1) > 1:
        model = rediscretise(model, depth_parallel=dataclasses.replace(method, mesh=mesh))
    o = config.objective
    objective = Objective(
        control_smoothness=o.control_smoothness,
        control_size=o.control_size,
        kinetic_energy=o.kinetic_energy,
        ternary=Ternary(o.ternary_sparsity) if o.ternary else None,
    )
    constraints = Constraints(
        sigma_floor=o.sigma_floor, kernel_norm=cast(Any, o.kernel_norm), kernel_bound=o.kernel_bound
    )
    optimiser, schedule = make_optimiser(config.optimiser, config.train.steps)
    method = build_method(config)
    return Experiment(
        config, task, model, objective, constraints, optimiser, schedule, init_from, method
    )


@functools.cache
def _inner_optimiser(name: str, learning_rate: float) -> optax.GradientTransformation:
    # Cached, so that equal configurations share one MSA value and its compiled step.
    if name == "adam":
        return under_standard_promotion(optax.adam(learning_rate))
    return optax.sgd(learning_rate)


def build_method(config: Config) -> MSA | None:
    """The ``MSA`` of ``train.method=msa`` (None: gradient training)."""
    t = config.train
    if t.method == "gradient":
        return None
    return MSA(
        _inner_optimiser(t.msa_inner_optimiser, t.msa_inner_learning_rate),
        inner_steps=t.msa_inner_steps,
        rho=t.msa_rho,
        rho_growth=t.msa_rho_growth,
        ternary_step=t.msa_ternary_step,
        ternary_memory=t.msa_ternary_memory,
    )
