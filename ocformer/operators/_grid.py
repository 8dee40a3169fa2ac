"""Quadrature on the token and feature grids."""

import equinox as eqx


class Grid(eqx.Module):
    r"""Uniform quadrature on $\Omega_x$ (tokens) and $\Omega_y$ (features).

    Integrals become sums weighted by the spacings: $\int_{\Omega_y} f\,dy \approx h_y
    \sum_i f_i$ and $|\Omega_y| = N_y h_y$. A standard Transformer is the case
    ``h_x = h_y = 1``; $h_x$ cancels exactly from softmax attention.

    Args:
        h_x: token spacing, > 0.
        h_y: feature spacing, > 0.
    """

    h_x: float = eqx.field(default=1.0, static=True)
    h_y: float = eqx.field(default=1.0, static=True)

    def __check_init__(self):
        for name in ("h_x", "h_y"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(
                    f"Grid.{name} must be a positive number (a quadrature spacing), "
                    f"got {value!r}. Use 1.0 for a standard Transformer."
                )


def constant_in_x(b, ndim: int):
    """Extend a function of the features alone, b(y), to the (..., N, d) grid.

    Explicit (not implicit) broadcasting, so that strict rank promotion stays on.
    Scalars pass through.
    """
    if b is None or b.ndim == 0:
        return b
    return b.reshape((1,) * (ndim - b.ndim) + b.shape)
