r"""Pointwise sub-steps of the feed-forward part.

ReLU is the Euclidean projection onto the positive cone $S_2 = \{u \ge 0\}$, that is
the resolvent of $\partial I_{S_2}$ for every step size. GELU is *not* a projection
(it is not idempotent and moves points of $S_2$); it enters the scheme as a plain
pointwise nonlinear sub-step, and the continuous model then has no indicator term.
"""

from typing import Literal, TypeAlias, get_args

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

Activation: TypeAlias = Literal["relu", "gelu", "gelu_tanh"]
ACTIVATIONS: tuple[str, ...] = get_args(Activation)


def project_positive_cone(v: Float[Array, "..."]) -> Float[Array, "..."]:
    r"""$P_{S_2}(v) = \max(v, 0)$: the nearest point of $\{u \ge 0\}$ (ReLU)."""
    return jnp.maximum(v, 0)


def activate(v: Float[Array, "..."], activation: Activation) -> Float[Array, "..."]:
    """Apply the hidden pointwise sub-step by name.

    ``"gelu"`` is the exact (erf) GELU; ``"gelu_tanh"`` is the tanh approximation used
    by GPT-2.
    """
    if activation == "relu":
        return project_positive_cone(v)
    if activation == "gelu":
        return jax.nn.gelu(v, approximate=False)
    if activation == "gelu_tanh":
        return jax.nn.gelu(v, approximate=True)
    raise ValueError(f"Unknown activation {activation!r}; expected one of {ACTIVATIONS}.")


def check_activation(activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(
            f"activation must be one of {ACTIVATIONS}, got {activation!r}. ReLU is the "
            "projection onto the positive cone; the GELUs are pointwise sub-steps."
        )
