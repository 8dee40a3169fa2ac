r"""Controls that vary within a layer: piecewise linear, and a polynomial basis in t.

Both give the continuous limit something to converge to: with piecewise-constant
controls the refined model converges to an ODE whose field jumps at every layer
boundary, with these it converges to a smooth (or Lipschitz) non-autonomous ODE.
"""

from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import Array, Float

from ._control import AbstractControl, _leading_sizes, piece
from ._params import LayerParams

BasisFamily = Literal["legendre", "chebyshev"]
BASIS_FAMILIES: tuple[str, ...] = ("legendre", "chebyshev")


def _single_leading_size(values, who: str, what: str) -> int:
    sizes = _leading_sizes(values)
    if len(sizes) != 1:
        raise ValueError(
            f"{who} needs every leaf of `{what}` to have the same leading axis; got "
            f"leading sizes {sorted(sizes)}."
        )
    (num,) = sizes
    return num


def _check_interval(who: str, t0: float, t1: float) -> None:
    if not t1 > t0:
        raise ValueError(f"{who} needs t1 > t0, got t0={t0}, t1={t1}.")


def _contract(weights: Float[Array, " K"], values: LayerParams) -> LayerParams:
    # sum_k w_k c_k for every leaf c of shape (K, ...).
    return jtu.tree_map(lambda c: jnp.tensordot(weights.astype(c.dtype), c, axes=1), values)


class PiecewiseLinear(AbstractControl):
    r"""Values at the $L+1$ nodes $t_n = t_0 + n\,(t_1 - t_0)/L$, linear in between:

    $$\theta(t) = (1 - \lambda)\,\theta_n + \lambda\,\theta_{n+1},\qquad
      \lambda = (t - t_n)/(t_{n+1} - t_n),\quad t \in [t_n, t_{n+1}].$$

    Continuous; $\dot\theta$ is piecewise constant and jumps at the interior nodes,
    which ``jump_ts`` reports so that an adaptive controller steps onto them (the
    vector field is only Lipschitz there).

    Args:
        values: ``LayerParams`` whose leaves have a leading axis of size L + 1.
        t0: start time (default 0).
        t1: end time (default L).
    """

    values: LayerParams
    t0: float = eqx.field(static=True)
    t1: float = eqx.field(static=True)

    def __init__(self, values: LayerParams, t0: float = 0.0, t1: float | None = None):
        num = _single_leading_size(values, "PiecewiseLinear", "values")
        if num < 2:
            raise ValueError(
                f"PiecewiseLinear needs at least 2 nodes (L + 1 with L >= 1), got {num}."
            )
        self.values = values
        self.t0 = float(t0)
        self.t1 = float(t0) + (num - 1) if t1 is None else float(t1)
        _check_interval("PiecewiseLinear", self.t0, self.t1)

    @property
    def num_layers(self) -> int:
        return _single_leading_size(self.values, "PiecewiseLinear", "values") - 1

    @property
    def interval(self) -> tuple[float, float]:
        return self.t0, self.t1

    @property
    def jump_ts(self) -> Float[np.ndarray, " jumps"] | None:
        n = self.num_layers
        if n == 1:
            return None
        # numpy, not jnp: the jumps are static (they shape the step grid), also under jit.
        return np.linspace(self.t0, self.t1, n + 1)[1:-1]

    def _locate(self, t):
        n = self.num_layers
        pos = jnp.asarray((t - self.t0) * (n / (self.t1 - self.t0)))
        # The piece as the grid's jumps say (see ``piece``); the weight from it.
        i = piece(t, self.jump_ts)
        return i, pos - i.astype(pos.dtype)

    def _node(self, i):
        return jtu.tree_map(
            lambda x: jax.lax.dynamic_index_in_dim(x, i, keepdims=False), self.values
        )

    def __call__(self, t) -> LayerParams:
        i, lam = self._locate(t)
        a, b = self._node(i), self._node(i + 1)
        return jtu.tree_map(lambda x, y: x + lam.astype(x.dtype) * (y - x), a, b)

    def derivative(self, t) -> LayerParams:
        i, _ = self._locate(t)
        a, b = self._node(i), self._node(i + 1)
        rate = self.num_layers / (self.t1 - self.t0)
        return jtu.tree_map(lambda x, y: rate * (y - x), a, b)


def basis_functions(tau: Float[Array, ""], num: int, family: BasisFamily) -> Float[Array, " K"]:
    r"""$(P_0(\tau), \dots, P_{K-1}(\tau))$ on $[-1, 1]$ by the three-term recurrence.

    Legendre: $(k+1) P_{k+1} = (2k+1)\tau P_k - k P_{k-1}$; Chebyshev (first kind):
    $T_{k+1} = 2\tau T_k - T_{k-1}$.
    """
    out = [jnp.ones_like(tau)]
    if num > 1:
        out.append(tau)
    for k in range(1, num - 1):
        if family == "legendre":
            out.append(((2 * k + 1) * tau * out[k] - k * out[k - 1]) / (k + 1))
        else:
            out.append(2 * tau * out[k] - out[k - 1])
    return jnp.stack(out)


class Basis(AbstractControl):
    r"""A polynomial basis in t: $\theta(t) = \sum_{k<K} c_k\,P_k(\tau(t))$,
    $\tau = 2 (t - t_0)/(t_1 - t_0) - 1$.

    $P_k$ are Legendre polynomials or Chebyshev polynomials of the first kind. The
    number K of coefficient sets is a property of the control, independent of how many
    steps the solver takes: refining the step grid refines the discretisation of one
    fixed smooth $\theta$. Smooth (no ``jump_ts``).

    Args:
        coefficients: ``LayerParams`` whose leaves have a leading axis of size K.
        t0, t1: the time interval.
        num_layers: the number of unit steps it stands for (default ``round(t1 - t0)``).
        family: ``"legendre"`` (default) or ``"chebyshev"``.
    """

    coefficients: LayerParams
    t0: float = eqx.field(static=True)
    t1: float = eqx.field(static=True)
    layers: int = eqx.field(static=True)
    family: BasisFamily = eqx.field(static=True)

    def __init__(
        self,
        coefficients: LayerParams,
        t0: float = 0.0,
        t1: float = 1.0,
        num_layers: int | None = None,
        family: BasisFamily = "legendre",
    ):
        _single_leading_size(coefficients, "Basis", "coefficients")
        if family not in BASIS_FAMILIES:
            raise ValueError(f"Basis family must be one of {BASIS_FAMILIES}, got {family!r}.")
        self.coefficients = coefficients
        self.t0 = float(t0)
        self.t1 = float(t1)
        _check_interval("Basis", self.t0, self.t1)
        self.layers = max(1, int(round(t1 - t0))) if num_layers is None else int(num_layers)
        self.family = family

    @property
    def num_basis(self) -> int:
        return _single_leading_size(self.coefficients, "Basis", "coefficients")

    @property
    def num_layers(self) -> int:
        return self.layers

    @property
    def interval(self) -> tuple[float, float]:
        return self.t0, self.t1

    @property
    def jump_ts(self) -> None:
        return None

    def _tau(self, t):
        return 2.0 * (jnp.asarray(t) - self.t0) / (self.t1 - self.t0) - 1.0

    def __call__(self, t) -> LayerParams:
        weights = basis_functions(self._tau(t), self.num_basis, self.family)
        return _contract(weights, self.coefficients)

    def derivative(self, t) -> LayerParams:
        tau = self._tau(t)
        # d/dtau of the recurrence (forward mode: exact, and as cheap as the values).
        _, dp = jax.jvp(
            lambda s: basis_functions(s, self.num_basis, self.family),
            (tau,),
            (jnp.ones_like(tau),),
        )
        return _contract(dp * (2.0 / (self.t1 - self.t0)), self.coefficients)
