"""What the vector field receives besides t and u."""

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from ..controls._control import AbstractControl


class DynamicsArgs(eqx.Module):
    """The ``args`` of the one ``diffeqsolve`` call.

    Args:
        control: theta(t), evaluated inside the vector field (once per step by the
            splitting solvers).
        key_mask: optional key-padding mask over tokens, True keeps a token.
        compute_dtype: the dtype the terms' vector fields compute in (their matrix
            products, attention and feed-forward maps); None: the state's own dtype.

    The state the solver carries may be wider than ``compute_dtype``: diffrax promotes
    it to the dtype of time (at least float32, ``ocformer.integration.time_dtype``), so
    under a bfloat16 policy the state (the residual stream) and its updates
    ``u + dt * f`` are float32 while each field casts its input down and computes in
    bfloat16. Without the cast the float32 state would promote every product with the
    bfloat16 controls back to float32.
    """

    control: AbstractControl
    key_mask: Bool[Array, "*batch N"] | None = None
    compute_dtype: jnp.dtype | None = eqx.field(default=None, static=True)

    def compute(self, u: Float[Array, "*batch N d"]) -> Float[Array, "*batch N d"]:
        """``u`` in ``compute_dtype`` (unchanged when that is None or already its dtype)."""
        if self.compute_dtype is None or u.dtype == self.compute_dtype:
            return u
        return u.astype(self.compute_dtype)
