"""Array aliases with named dimensions, used in public signatures.

Dimension names:
    batch  leading batch axes (zero or more)
    N      tokens (the discretised Omega_x)
    d      model features (the discretised Omega_y)
"""

from typing import TypeAlias

from jaxtyping import Array, Bool, Float

State: TypeAlias = Float[Array, "*batch N d"]
"""The state u(x, y, t) at one time: tokens by features, optional leading batch axes."""

KeyMask: TypeAlias = Bool[Array, "*batch N"]
"""Key-padding mask over tokens: True keeps the token as a key."""

__all__ = ["KeyMask", "State"]
