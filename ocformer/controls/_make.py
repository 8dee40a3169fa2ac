"""One entry point that builds any kind of control from per-layer values."""

from typing import Literal, get_args

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from .._counts import whole_number
from ._control import AbstractControl, Constant, PiecewiseConstant, _leading_sizes
from ._init import init_stacked_params
from ._params import LayerParams
from ._smooth import Basis, BasisFamily, PiecewiseLinear, basis_functions

ControlKind = Literal["piecewise_constant", "piecewise_linear", "basis", "constant"]
CONTROL_KINDS: tuple[str, ...] = get_args(ControlKind)


def _is_key(x) -> bool:
    if not hasattr(x, "dtype"):
        return False
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return True
    # A raw uint32 key from jax.random.PRNGKey.
    return x.dtype == jnp.uint32 and x.shape == (2,)


def make_control(
    kind: ControlKind,
    values_or_key,
    *,
    num_layers: int | None = None,
    width: int | None = None,
    hidden: int | None = None,
    num_basis: int = 4,
    family: BasisFamily = "legendre",
    t0: float = 0.0,
    t1: float | None = None,
    **init_kwargs,
) -> AbstractControl:
    r"""Build a control of any kind from stacked per-layer values (or a random key).

    The per-layer values $\theta_0, \dots, \theta_{L-1}$ (one ``LayerParams`` with a
    leading layer axis, as ``init_stacked_params`` returns) become:

    - ``"piecewise_constant"``: $\theta(t) = \theta_n$ on layer n (the standard model).
    - ``"piecewise_linear"``: node values at the $L+1$ layer boundaries; the end nodes
      are the first and last layers, each interior node the mean of its two
      neighbouring layers.
    - ``"basis"``: the ``num_basis`` coefficient sets of a Legendre/Chebyshev expansion
      fitted by least squares to $\theta_n$ at the layer midpoints (exact when
      ``num_basis == L``; requires ``num_basis <= L``).
    - ``"constant"``: weight tying with the first layer's values.

    Args:
        kind: one of ``CONTROL_KINDS``.
        values_or_key: ``LayerParams`` with a leading axis of size L, or a
            ``jax.random`` key, in which case ``init_stacked_params(key, num_layers,
            width, hidden, **init_kwargs)`` supplies the values.
        num_layers, width, hidden: needed with a key.
        num_basis: K, for ``"basis"``.
        family: ``"legendre"`` or ``"chebyshev"``, for ``"basis"``.
        t0, t1: the time interval (default ``[0, L]``: unit steps).
        **init_kwargs: passed to ``init_stacked_params`` with a key.

    Raises:
        ValueError: unknown kind, missing sizes with a key, or ``num_basis > L``.
    """
    if kind not in CONTROL_KINDS:
        raise ValueError(f"Unknown control kind {kind!r}; expected one of {CONTROL_KINDS}.")
    if _is_key(values_or_key):
        if num_layers is None or width is None or hidden is None:
            raise ValueError(
                "make_control with a random key needs num_layers, width and hidden "
                f"(got {num_layers}, {width}, {hidden})."
            )
        values = init_stacked_params(values_or_key, num_layers, width, hidden, **init_kwargs)
    else:
        if init_kwargs:
            raise ValueError(
                f"Initialisation options {sorted(init_kwargs)} apply only when a key is "
                "given; with explicit values, set them on the values."
            )
        values = values_or_key
    if not isinstance(values, LayerParams):
        raise ValueError(
            "values_or_key must be LayerParams with a leading layer axis or a jax.random "
            f"key, got {type(values).__name__}."
        )
    sizes = _leading_sizes(values)
    if len(sizes) != 1:
        raise ValueError(f"All leaves need the same leading (layer) axis; got {sorted(sizes)}.")
    (L,) = sizes
    if num_layers is not None and num_layers != L:
        raise ValueError(f"num_layers={num_layers} but the values have {L} layers.")
    t1 = float(t0) + L if t1 is None else float(t1)
    if kind == "piecewise_constant":
        return PiecewiseConstant(values, t0, t1)
    if kind == "constant":
        return Constant(jtu.tree_map(lambda x: x[0], values), t0, t1, num_layers=L)
    if kind == "piecewise_linear":

        def nodes(x):
            inner = 0.5 * (x[:-1] + x[1:])
            return jnp.concatenate([x[:1], inner, x[-1:]], axis=0)

        return PiecewiseLinear(jtu.tree_map(nodes, values), t0, t1)
    if not 1 <= (whole_number(num_basis) or 0) <= L:  # not a bool
        raise ValueError(
            f"num_basis={num_basis!r} must be an integer in [1, L={L}] to fit the per-layer "
            "values by least squares; pass a smaller num_basis or more layers."
        )
    num_basis = int(num_basis)
    mids = (np.arange(L) + 0.5) / L * 2.0 - 1.0  # layer midpoints in tau
    design = np.stack(
        [np.asarray(basis_functions(jnp.asarray(m), num_basis, family)) for m in mids]
    )
    pinv = jnp.asarray(np.linalg.pinv(design))  # (K, L)

    def fit(x):
        return jnp.tensordot(pinv.astype(x.dtype), x, axes=1)

    return Basis(jtu.tree_map(fit, values), t0, t1, num_layers=L, family=family)
