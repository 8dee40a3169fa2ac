"""From a validated ``Config`` to the objects of a run: task, model, objective,
constraints, gradient method and optimiser."""

import dataclasses
from typing import Any, cast

import jax
import jax.numpy as jnp
import jax.random as jr
import optax

from .. import controls
from ..config import Config, ConfigError, stepper_object
from ..controls import NormParams
from ..integration import GRADIENT_METHODS, Discretisation
from ..models import (
    ContinuousTransformer,
    IncompatibleError,
    PatchEmbedding,
    Readout,
    SequenceModel,
    TokenEmbedding,
    with_conv_projections,
)
from ..objective import Constraints, Objective
from ..tasks import make_task
from ._optimiser import make_optimiser


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
    """

    config: Config
    task: Any
    model: Any
    objective: Any
    constraints: Any
    optimiser: optax.GradientTransformation
    schedule: optax.Schedule


def _task_kwargs(config: Config) -> dict:
    t = config.task
    per_task = {
        "shakespeare_char": {"seq_len": t.seq_len, "data_dir": t.data_dir, "fallback": t.fallback},
        "stdlib_char": {"seq_len": t.seq_len},
        "digits": {"patch_size": t.patch_size},
        "copy": {"seq_len": t.seq_len, "vocab_size": t.vocab_size},
        "sort": {"seq_len": t.seq_len, "vocab_size": t.vocab_size},
        "tokens": {"path": t.path, "seq_len": t.seq_len},
    }
    return per_task[t.name]


def build_task(config: Config):
    """The task of ``config``; a task's own refusal becomes a ``ConfigError``."""
    try:
        return make_task(config.task.name, **_task_kwargs(config))
    except FileNotFoundError:
        raise  # DataNotFoundError: reported as such, with its fix
    except ValueError as e:
        raise ConfigError(f"task ({config.task.name})", str(e)) from None


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
        raise ConfigError(e.field, str(e).split(": ", 1)[1]) from None


def build_model(config: Config, task, key):
    """Embedding, transformer and readout for ``task``."""
    m = config.model
    dtype = _dtype(config)
    k_embed, k_control, k_read = jr.split(key, 3)
    if task.kind == "lm":
        embedding = TokenEmbedding(task.vocab_size, task.seq_len, m.width, key=k_embed, dtype=dtype)
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
    return SequenceModel(embedding, transformer, readout)


def build(config: Config, task=None) -> Experiment:
    """Build the run's objects from a validated ``config``.

    The random initialisation depends on ``train.seed`` only.

    Raises:
        ConfigError: a combination that the library refuses.
        ocformer.tasks.DataNotFoundError: the task's data is not on disk.
    """
    task = build_task(config) if task is None else task
    if config.train.sample_tokens and not (
        task.kind == "lm" and callable(getattr(task, "encode", None))
    ):
        raise ConfigError(
            "train.sample_tokens",
            f"task {config.task.name!r} is not a text language model, so it has nothing "
            "to sample; set train.sample_tokens=0",
        )
    model = build_model(config, task, jr.key(config.train.seed))
    o = config.objective
    objective = Objective(
        control_smoothness=o.control_smoothness,
        control_size=o.control_size,
        kinetic_energy=o.kinetic_energy,
    )
    constraints = Constraints(
        sigma_floor=o.sigma_floor, kernel_norm=cast(Any, o.kernel_norm), kernel_bound=o.kernel_bound
    )
    optimiser, schedule = make_optimiser(config.optimiser, config.train.steps)
    return Experiment(config, task, model, objective, constraints, optimiser, schedule)
