"""Layer norm as the projection onto a mean/variance constraint set."""

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from ..controls._params import NormParams
from ._grid import constant_in_x


def normalise(
    v: Float[Array, "*batch N d"], eps: float = 0.0, *, check: bool = True
) -> Float[Array, "*batch N d"]:
    r"""Projection onto $S_1(0, 1)$ per token: $(v - \bar v)/\sqrt{\mathrm{var}(v) + \epsilon}$.

    With ``eps = 0`` a token of zero variance has no nearest point in $S_1$; that is
    an error (raised at run time through ``eqx.error_if``), never a silent NaN.

    The mean and variance are computed in float32 or wider (a bfloat16 mean of many
    features loses most of its digits, as flax's LayerNorm avoids too); the result
    is in the dtype of ``v``.
    """
    return _normalise(v.astype(wide_dtype(v.dtype)), eps, check).astype(v.dtype)


def wide_dtype(dtype) -> jnp.dtype:
    """float32 for half-precision ``dtype``, ``dtype`` itself otherwise: where the
    statistics of a mixed-precision model are computed.

    numpy's promotion, which for floating dtypes is jax's standard one and does not
    depend on ``jax_numpy_dtype_promotion`` (jnp's refuses two different dtypes under
    ``"strict"``)."""
    return np.promote_types(dtype, np.float32)


def _normalise(v, eps: float, check: bool):
    mean = jnp.mean(v, axis=-1, keepdims=True)
    centred = v - mean
    var = jnp.mean(jnp.square(centred), axis=-1, keepdims=True)
    if eps == 0.0 and check:
        var = eqx.error_if(
            var,
            var <= 0,
            "Layer-norm projection with eps=0 met a token whose features are all "
            "equal (zero variance): the set S1 has no nearest point to it. Use "
            "ln_eps > 0, or give the tokens non-constant features.",
        )
    return centred * (1.0 / jnp.sqrt(var + eps))


class LayerNormProjection(eqx.Module):
    r"""The resolvent of $\partial I_{S_1(\sigma_1, \sigma_2)}$: the projection $P_{S_1}$.

    $$S_1(\sigma_1, \sigma_2) = \{u : \tfrac{1}{|\Omega_y|}\int u(x, y)\,dy = \sigma_1,\;
      \tfrac{1}{|\Omega_y|}\int (u - \sigma_1)^2\,dy = \sigma_2^2 \ \forall x\},$$
    $$P_{S_1}(v) = \sigma_2 \frac{v - \bar v}{\sqrt{\mathrm{var}(v)}} + \sigma_1.$$

    Backward Euler on the indicator gives $P_{S_1}$ for every step size (term II of
    Tai, Liu, Li, Chan, arXiv 2510.03989). With per-feature ``scale``/``bias`` this is
    the projection onto $S_1(0, 1)$ followed by an explicit affine sub-step; with
    ``eps > 0`` it is the regularised projection of a standard LayerNorm. Means and
    variances are quadrature averages, so $h_y$ cancels and is not needed.

    Args:
        eps: the regulariser epsilon >= 0 of a standard LayerNorm.
    """

    eps: float = eqx.field(default=0.0, static=True)

    def __check_init__(self):
        if not (isinstance(self.eps, (int, float)) and self.eps >= 0):
            raise ValueError(f"LayerNormProjection.eps must be a number >= 0, got {self.eps!r}.")

    def __call__(
        self,
        p: NormParams,
        v: Float[Array, "*batch N d"],
        eps_scale: float = 1.0,
    ) -> Float[Array, "*batch N d"]:
        """Project ``v`` onto the set given by ``p``.

        ``eps_scale`` multiplies eps: the closing projection after the paper's
        averaging step uses eps/4 (``eps_scale = 0.25``), because it sees (a + b)/2
        where a standard layer sees a + b, and var((a+b)/2) = var(a+b)/4.
        """
        # Normalised and scaled in float32 or wider, rounded to v's dtype once.
        wide = wide_dtype(v.dtype)
        n = _normalise(v.astype(wide), self.eps * eps_scale, True)
        scale, bias = (constant_in_x(x, n.ndim).astype(wide) for x in (p.scale, p.bias))
        return (n * scale + bias).astype(v.dtype)
