"""A checkpoint's tensor names matched against what its configuration implies.

Names are accepted with and without the base-model prefix (``transformer.``, ``bert.``,
``vit.``): checkpoints published on the Hub and those written by ``transformers`` differ
there. Every missing or unexpected tensor, every shape that disagrees with
``config.json`` and the dtype asked for are checked here, before anything is read, so a
bad directory raises ``ValueError`` and nothing is half-loaded.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np

from ._directory import Found
from ._family import Family

# Buffers some checkpoints carry that are not parameters: GPT-2's causal-mask tables and
# the position-id ranges of BERT-style embeddings. They are recomputed, never read.
_BUFFERS = re.compile(r"(^|\.)(position_ids|attn\.bias|attn\.masked_bias)$")


def _canonical(name: str, prefix: str) -> str:
    if name.startswith(prefix):
        name = name[len(prefix) :]
    # Older BERT checkpoints name LayerNorm parameters gamma and beta.
    name = re.sub(r"LayerNorm\.gamma$", "LayerNorm.weight", name)
    return re.sub(r"LayerNorm\.beta$", "LayerNorm.bias", name)


def match_names(
    found: Found, family: Family, config: dict, ignore: tuple[str, ...]
) -> tuple[dict[str, str], frozenset[str]]:
    """Canonical name -> name in the files, and the heads present.

    Args:
        found: every tensor of the checkpoint (``tensor_shapes``).
        family: the checkpoint's family, which says what ``config`` implies.
        config: the checkpoint's ``config.json``.
        ignore: name prefixes of tensors to leave out.

    Raises:
        ValueError: a parameter spelt twice (with and without the prefix), missing or
            unexpected tensors (all named, with the supported heads), or a tensor whose
            shape disagrees with ``config``.
    """
    required, heads = family.shapes(config)
    names: dict[str, str] = {}
    for name in found:
        if _BUFFERS.search(name) or name.startswith(ignore):
            continue
        canonical = _canonical(name, family.prefix)
        if canonical in names:
            raise ValueError(
                f"Tensors {names[canonical]!r} and {name!r} are the same parameter spelt "
                "twice (with and without the base-model prefix)."
            )
        names[canonical] = name
    present = frozenset(h for h, group in heads.items() if set(group) & set(names))
    expected = dict(required)
    for h in present:
        expected |= heads[h]
    missing = sorted(set(expected) - set(names))
    extra = sorted(set(names) - set(expected))
    model_type = config["model_type"]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing tensors {missing}")
        if extra:
            parts.append(f"unexpected tensors {[names[k] for k in extra]}")
        raise ValueError(
            f"The {model_type} checkpoint does not match its config.json: "
            f"{'; '.join(parts)}. Supported heads for {model_type}: "
            f"{sorted(heads) or 'none'}; leave other heads out by name prefix with "
            "from_pretrained(path, ignore=('cls.',)) (for example)."
        )
    for canonical, shape in expected.items():
        got = found[names[canonical]][0]
        if got != shape:
            raise ValueError(
                f"Tensor {names[canonical]!r} has shape {got}, but config.json implies {shape}."
            )
    return names, present


def target_dtype(dtype, found: Found, names: dict[str, str]) -> np.dtype:
    """The model's dtype: ``dtype``, or for None the checkpoint's parameters' (float64
    if all are, else float32).

    Raises:
        ValueError: ``dtype`` is not floating, or is float64 without 64-bit JAX.
    """
    if dtype is None:
        # The dtype of the parameters (not of buffers such as GPT-2's mask tables).
        stored = {found[name][2] for name in names.values()}
        dtype = np.float64 if stored == {"F64"} else np.float32
    dtype = np.dtype(dtype)
    # jnp's test: NumPy's own does not count bfloat16 (an ml_dtypes type) as floating.
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"dtype must be a floating dtype, got {dtype}.")
    if dtype == np.float64 and not jax.config.read("jax_enable_x64"):
        raise ValueError(
            "dtype=float64 needs 64-bit JAX: jax.config.update('jax_enable_x64', True) "
            "before loading (or dtype=numpy.float32)."
        )
    return dtype
