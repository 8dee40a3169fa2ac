"""A trained model back from its work directory."""

import os

from ..config import Config
from ._build import restore_run
from ._init_from import architecture, with_architecture


def load_run(
    workdir: str | os.PathLike, step: int | None = None, *, task_path: str | None = None
) -> tuple[Config, object]:
    """The configuration and the trained model of a work directory.

    The model is built from the configuration that wrote the checkpoint (the newest
    committed one, or the one of ``step``; ``build(config).model`` fixes its structure
    and static parts) and takes its arrays from it. That configuration is recorded in
    each checkpoint, so a step trained before a resume with ``--allow-config-change``
    comes back with the discretisation it was trained in, not ``config.json``'s.

    Example: ``config, model = load_run("runs/smoke")``, then ``model(inputs)``.

    Args:
        workdir: an ocformer work directory.
        step: the checkpoint to load (default: the newest).
        task_path: where the run's dataset directory (``task.path``) is now, if it was
            moved; it must hold the files the run trained on (their SHA-256).

    Returns:
        ``(config, model)``: the resolved ``Config`` of that checkpoint (for a run
        that started from a checkpoint, with the architecture fields the model took
        from it) and the ``SequenceModel``.

    Raises:
        WorkdirError: not an ocformer work directory, no configuration, or no committed
            checkpoint (of ``step``).
        ConfigError: the stored configuration is not valid for this version of ocformer.
        ocformer.checkpointing.CheckpointError: a corrupted or mismatched checkpoint.
    """
    config, model, _ = load_run_at(workdir, step, task_path=task_path)
    return config, model


def load_run_at(
    workdir: str | os.PathLike, step: int | None = None, *, task_path: str | None = None
) -> tuple[Config, object, int]:
    """``load_run``'s configuration and model, and the step of the checkpoint they
    came from (read with them: a checkpoint committed meanwhile is not it)."""
    config, model, at_step, _ = restore_run(workdir, step, task_path=task_path)
    if config.model.init_from is not None:
        config = with_architecture(config, architecture(model))
    return config, model, at_step
