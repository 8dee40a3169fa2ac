"""A trained model back from its work directory."""

import json
import os

import equinox as eqx
import jax
import jax.numpy as jnp

from ..checkpointing import CheckpointManager
from ..config import Config, from_dict, validate
from ._build import build
from ._errors import WorkdirError
from ._loop import _initial_tree
from ._rundir import RUN_MARKER


def load_run(workdir: str | os.PathLike, step: int | None = None) -> tuple[Config, object]:
    """The configuration and the trained model of a work directory.

    The model is built from the stored configuration (``build(config).model``, which
    fixes its structure and static parts) and takes its arrays from the newest committed
    checkpoint, or from the one of ``step``.

    Example: ``config, model = load_run("runs/smoke")``, then ``model(inputs)``.

    Args:
        workdir: an ocformer work directory.
        step: the checkpoint to load (default: the newest).

    Returns:
        ``(config, model)``: the resolved ``Config`` and the ``SequenceModel``.

    Raises:
        WorkdirError: not an ocformer work directory, no configuration, or no committed
            checkpoint (of ``step``).
        ConfigError: the stored configuration is not valid for this version of ocformer.
        ocformer.checkpointing.CheckpointError: a corrupted or mismatched checkpoint.
    """
    path = os.path.abspath(os.fspath(workdir))
    if not os.path.isfile(os.path.join(path, RUN_MARKER)):
        raise WorkdirError(f"{path} is not an ocformer work directory (no {RUN_MARKER})")
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            config = validate(from_dict(json.load(f)))
    except (OSError, json.JSONDecodeError) as e:
        raise WorkdirError(f"{path}/config.json cannot be read ({e})") from None
    with CheckpointManager(os.path.join(path, "checkpoints")) as checkpoints:
        steps = checkpoints.steps()
        chosen = steps[-1] if step is None and steps else step
        if chosen not in steps:
            raise WorkdirError(
                f"{path} has no committed checkpoint"
                + ("" if step is None else f" of step {step}")
                + (f"; committed steps: {steps}" if steps else "")
            )
        exp = build(config)
        tree = checkpoints.restore(chosen, _initial_tree(exp))
    model = eqx.combine(jax.tree.map(jnp.asarray, tree.params), exp.model)
    return config, model
