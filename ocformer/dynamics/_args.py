"""What the vector field receives besides t and u."""

import equinox as eqx
from jaxtyping import Array, Bool

from ..controls._control import AbstractControl


class DynamicsArgs(eqx.Module):
    """The ``args`` of the one ``diffeqsolve`` call.

    Args:
        control: theta(t), evaluated inside the vector field (once per step by the
            splitting solvers).
        key_mask: optional key-padding mask over tokens, True keeps a token.
    """

    control: AbstractControl
    key_mask: Bool[Array, "*batch N"] | None = None
