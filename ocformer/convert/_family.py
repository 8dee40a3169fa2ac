"""What a Hugging Face model family (``model_type``) supplies to the conversion, and the
helpers the families share: reading ``config.json`` values with errors that name the
key, and moving torch-layout arrays into and out of ocformer's modules.

Each family (``_gpt2``, ``_bert``, ``_vit``) is one ``Family`` value; ``_pretrained``
holds the table of them. What is the same for every family lives apart: the directory on
disk in ``_directory``, matching and checking tensor names in ``_matching``.
"""

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import equinox as eqx
import jax.numpy as jnp
import numpy as np

from ..controls import NormParams
from ..models import SequenceModel
from ..operators import Activation

Shapes = dict[str, tuple[int, ...]]

# Hugging Face activation names -> the feed-forward sub-step. "gelu" is the exact (erf)
# GELU; "gelu_new" and "gelu_pytorch_tanh" are its tanh approximation (GPT-2).
ACTIVATIONS: dict[str, Activation] = {
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "relu": "relu",
}


@dataclasses.dataclass(frozen=True)
class Family:
    """What one ``model_type`` needs.

    Attributes:
        prefix: the base model's tensor prefix, optional in a checkpoint.
        base_architecture: the ``transformers`` class of the base model (no head),
            whose checkpoints name tensors without ``prefix``.
        shapes: config -> (required tensors, {head name: its tensors}), canonical names
            (without the prefix); a head is present with all its tensors or absent.
        build: (config, tensors, heads present) -> the model's pieces.
        export: (model, config) -> (canonical tensors, config updates); the updates
            name the ``architectures`` written.
    """

    prefix: str
    base_architecture: str
    shapes: Callable[[dict], tuple[Shapes, dict[str, Shapes]]]
    build: Callable[[dict, Mapping[str, np.ndarray], frozenset[str]], dict]
    export: Callable[[SequenceModel, dict], tuple[dict[str, np.ndarray], dict]]


# ---------------------------------------------------------------------------------------
# Reading config.json.


def read_value(config: dict, key: str, default=None, *, required: bool = False):
    if key not in config or config[key] is None:
        if required:
            raise ValueError(f"config.json has no {key!r}, which a {config['model_type']} needs.")
        return default
    return config[key]


def read_int(config: dict, key: str, default=None) -> int:
    """A positive integer; required when there is no default."""
    value = read_value(config, key, default, required=default is None)
    if type(value) is not int or value < 1:  # JSON's true is no size
        raise ValueError(f"config.json: {key} must be a positive integer, got {value!r}.")
    return value


def require(config: dict, options: dict[str, tuple[tuple, Any]]) -> None:
    """Refuse the option values the continuous model would not reproduce, all of them
    in one message. ``options``: each key's allowed values and its default."""
    wrong = [
        f"{key}={config.get(key, default)!r} (supported: {list(allowed)})"
        for key, (allowed, default) in options.items()
        if config.get(key, default) not in allowed
    ]
    if wrong:
        raise ValueError(
            f"config.json: {'; '.join(wrong)} {'is' if len(wrong) == 1 else 'are'} not "
            f"supported for {config['model_type']}; the continuous model would not "
            f"reproduce {'it' if len(wrong) == 1 else 'them'}."
        )


def read_activation(config: dict, key: str, default: str) -> Activation:
    """The activation ``config[key]`` names; ``default`` (the ``transformers``
    configuration class's) when the key is absent, as ``transformers`` reads it."""
    name = config.get(key, default)
    if name not in ACTIVATIONS:
        raise ValueError(
            f"config.json: {key}={name!r} is not supported; supported activations: "
            f"{sorted(ACTIVATIONS)} ('gelu' is the exact erf GELU, 'gelu_new' its tanh "
            "approximation)."
        )
    return ACTIVATIONS[name]


def read_eps(config: dict, key: str, default: float) -> float:
    """The LayerNorm epsilon ``config[key]``; ``default`` (the ``transformers``
    configuration class's) when the key is absent, as ``transformers`` reads it."""
    eps = config.get(key, default)
    if not (isinstance(eps, (int, float)) and eps >= 0):
        raise ValueError(f"config.json: {key} must be a number >= 0, got {eps!r}.")
    return float(eps)


def read_heads(config: dict, key: str, d: int) -> int:
    heads = read_int(config, key)
    if d % heads:
        raise ValueError(f"config.json: {key}={heads} does not divide the width {d}.")
    return heads


# ---------------------------------------------------------------------------------------
# Arrays.


def linear(w: np.ndarray) -> np.ndarray:
    """A torch ``Linear`` weight (out, in) as a kernel acting on the right (in, out), and
    back: the transpose."""
    return np.ascontiguousarray(w.T)


def norm_dict(t: Mapping[str, np.ndarray], name: str) -> dict:
    """The LayerNorm ``name`` of the tensors ``t`` as ``from_layers``' ``final_norm``."""
    return {"scale": t[f"{name}.weight"], "bias": t[f"{name}.bias"]}


def norm_arrays(p: NormParams, name: str) -> dict[str, np.ndarray]:
    """A LayerNorm's parameters as the tensors of the LayerNorm ``name``."""
    return {f"{name}.weight": np.asarray(p.scale), f"{name}.bias": np.asarray(p.bias)}


# The checkpoint formats' name of each activation ours has one for (the inverse of
# ACTIVATIONS; the exact erf GELU is "gelu").
ACTIVATION_NAMES: dict[str, str] = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu"}


def built_activation(model: SequenceModel, family: str, specific) -> str:
    """The checkpoint format's name of the activation of ``model``, a model built from
    an ocformer configuration that is to be written as ``family``: refuse it unless it
    has that family's architecture, ``specific`` (``(what it must have, whether it has
    it)`` pairs) and what every family here has: pre-LN layers, the final LayerNorm and
    a named activation.

    Raises:
        ValueError: naming everything it lacks.
    """
    t = model.transformer
    activation = t.feedforward.activation
    checks = [
        *specific,
        ("pre-LN layers (model.norm=pre)", t.norm == "pre"),
        ("the final LayerNorm (model.final_norm=true)", t.final_norm is not None),
        (f"one of the activations {sorted(ACTIVATION_NAMES)} (model.activation)",
         activation in ACTIVATION_NAMES),
    ]  # fmt: skip
    missing = [what for what, ok in checks if not ok]
    if missing:
        raise ValueError(
            f"This model came from no checkpoint, so it is written as {family}, whose "
            f"architecture it must have; it lacks {'; '.join(missing)}."
        )
    return ACTIVATION_NAMES[activation]


def per_feature(tensors: dict[str, np.ndarray], norms: tuple[str, ...], d: int) -> None:
    """Write the LayerNorm gains and biases of ``tensors`` whose module name (the part
    before ``.weight``/``.bias``) ends in one of ``norms`` with one entry per feature, in
    place: a built model's may be one number each (``controls.norm_affine=scalar``), and
    the checkpoint formats hold ``d``, the same number d times."""
    for name, value in tensors.items():
        if name.rsplit(".", 1)[0].split(".")[-1] in norms:
            tensors[name] = np.broadcast_to(value, (d,)).copy()


def replace_arrays(module, where, arrays, dtype):
    """``module`` with the arrays at ``where`` replaced by ``arrays`` in ``dtype``."""
    return eqx.tree_at(where, module, tuple(jnp.asarray(a, dtype) for a in arrays))
