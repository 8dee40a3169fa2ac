"""Array aliases with named dimensions, used in public signatures.

Dimension names:
    batch  leading batch axes (zero or more)
    N      tokens (the discretised Omega_x)
    d      model features (the discretised Omega_y)
    dff    hidden features of the feed-forward maps
    L      layers (pieces of a piecewise-constant control)
"""

from typing import TypeAlias

from jaxtyping import Array, Bool, Float, Int, PyTree, Shaped

State: TypeAlias = Float[Array, "*batch N d"]
"""The state u(x, y, t) at one time: tokens by features, optional leading batch axes."""

KeyMask: TypeAlias = Bool[Array, "*batch N"]
"""Key-padding mask over tokens: True keeps the token as a key."""

Kernel: TypeAlias = Float[Array, "din dout"]
Bias: TypeAlias = Float[Array, " dout"]
Scalar: TypeAlias = Float[Array, ""]
Time: TypeAlias = float | Float[Array, ""]
Tokens: TypeAlias = Int[Array, "*batch N"]

__all__ = [
    "Array",
    "Bias",
    "Bool",
    "Float",
    "Int",
    "Kernel",
    "KeyMask",
    "PyTree",
    "Scalar",
    "Shaped",
    "State",
    "Time",
    "Tokens",
]
