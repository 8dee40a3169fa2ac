"""Controls theta(t): all trainable parameters, as functions of time."""

import abc

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import Array, Float

from ._params import LayerParams


def piece(t, jump_ts: np.ndarray | None) -> Array:
    """The number of the jumps ``jump_ts`` (None: none) at or before ``t``: the piece of
    the layer grid that holds ``t``, from 0.

    The jumps are compared in ``t``'s own dtype, not located by arithmetic on ``t``:
    a point of the time grid on a jump is that jump's time in the same dtype
    (``ocformer.integration.time_grid``), so it is the first time of the next piece
    and the float just below it the last of the previous one, whatever the rounding.
    (A float32 ``linspace`` grid of 24 layers x 5 steps has its first jump at 1.0000001;
    a step stopped just below it, at 1.0, was read by ``floor((t - t0) * L / T)`` as
    the next layer.)
    """
    t = jnp.asarray(t)
    if not jnp.issubdtype(t.dtype, jnp.floating):
        t = t.astype(jnp.result_type(float))
    jumps = jnp.asarray(np.zeros(0) if jump_ts is None else jump_ts, t.dtype)
    jumps = jumps.reshape((1,) * t.ndim + jumps.shape)
    return jnp.sum(t[..., None] >= jumps, axis=-1, dtype=jnp.int32)


def _leading_sizes(tree) -> set[int]:
    return {x.shape[0] for x in jtu.tree_leaves(tree) if hasattr(x, "shape")}


class AbstractControl(eqx.Module):
    r"""A control $\theta : [t_0, t_1] \to$ ``LayerParams``.

    The vector field evaluates it at $t$; splitting solvers evaluate it once per step.
    Subclasses say where they are discontinuous (``jump_ts``) so that adaptive step-size
    controllers can be told to stop there.
    """

    @abc.abstractmethod
    def __call__(self, t) -> LayerParams:
        """The controls at time t."""

    @abc.abstractmethod
    def derivative(self, t) -> LayerParams:
        r"""$\dot\theta(t)$, with the structure of ``self(t)``.

        Used by the control-smoothness cost $\int |\dot\theta|^2$ and by the
        $\dot\sigma$ terms of the projected dynamics. Piecewise-constant controls
        return zeros (the jumps sit on step boundaries and are not part of the flow).
        """

    @property
    @abc.abstractmethod
    def interval(self) -> tuple[float, float]:
        """The time interval [t0, t1] on which the control is defined."""

    @property
    @abc.abstractmethod
    def jump_ts(self) -> Float[np.ndarray, " jumps"] | None:
        """Interior times where theta(t) jumps, or None if it is continuous."""

    @property
    @abc.abstractmethod
    def num_layers(self) -> int:
        """The number of layers of the Transformer this control came from (or is meant
        to be compared with): the number of unit steps of the standard discretisation."""


class PiecewiseConstant(AbstractControl):
    r"""One parameter set per layer: $\theta(t) = \theta_n$ for $t \in [t_n, t_{n+1})$.

    The standard Transformer's controls. ``values`` holds every leaf with a leading axis
    of length L (the layers); the pieces split $[t_0, t_1]$ into L equal intervals.

    Args:
        values: ``LayerParams`` whose leaves have a leading axis of size L.
        t0: start time (default 0).
        t1: end time (default L: unit steps, the standard Transformer).
    """

    values: LayerParams
    t0: float = eqx.field(static=True)
    t1: float = eqx.field(static=True)

    def __init__(self, values: LayerParams, t0: float = 0.0, t1: float | None = None):
        sizes = _leading_sizes(values)
        if len(sizes) != 1:
            raise ValueError(
                "PiecewiseConstant needs every leaf of `values` to have the same leading "
                f"(layer) axis; got leading sizes {sorted(sizes)}."
            )
        (num,) = sizes
        self.values = values
        self.t0 = float(t0)
        self.t1 = float(t0) + num if t1 is None else float(t1)

    def __check_init__(self):
        if not self.t1 > self.t0:
            raise ValueError(f"PiecewiseConstant needs t1 > t0, got t0={self.t0}, t1={self.t1}.")

    @property
    def num_layers(self) -> int:
        (num,) = _leading_sizes(self.values)
        return num

    @property
    def interval(self) -> tuple[float, float]:
        return self.t0, self.t1

    @property
    def jump_ts(self) -> Float[np.ndarray, " jumps"]:
        n = self.num_layers
        # numpy, not jnp: the jumps are static (they shape the step grid), also under jit.
        return np.linspace(self.t0, self.t1, n + 1)[1:-1]

    def index(self, t) -> Array:
        """The piece that holds t (t in [t_n, t_{n+1}) gives n; clipped at the ends),
        by ``piece``."""
        return piece(t, self.jump_ts)

    def __call__(self, t) -> LayerParams:
        i = self.index(t)
        return jtu.tree_map(
            lambda x: jax.lax.dynamic_index_in_dim(x, i, keepdims=False), self.values
        )

    def derivative(self, t) -> LayerParams:
        return jtu.tree_map(jnp.zeros_like, self(t))


class Constant(AbstractControl):
    r"""Weight tying: $\theta(t) = \theta$ for all t (a Universal-Transformer-style loop).

    Args:
        value: the one parameter set (``LayerParams`` without a layer axis).
        t0, t1: the time interval.
        num_layers: the number of unit steps it stands for (default t1 - t0).
    """

    value: LayerParams
    t0: float = eqx.field(static=True)
    t1: float = eqx.field(static=True)
    layers: int = eqx.field(static=True)

    def __init__(self, value: LayerParams, t0: float = 0.0, t1: float = 1.0, num_layers=None):
        self.value = value
        self.t0 = float(t0)
        self.t1 = float(t1)
        self.layers = int(round(t1 - t0)) if num_layers is None else int(num_layers)

    @property
    def num_layers(self) -> int:
        return self.layers

    @property
    def interval(self) -> tuple[float, float]:
        return self.t0, self.t1

    @property
    def jump_ts(self) -> None:
        return None

    def __call__(self, t) -> LayerParams:
        del t
        return self.value

    def derivative(self, t) -> LayerParams:
        del t
        return jtu.tree_map(jnp.zeros_like, self.value)


def stack_layers(layers: list[LayerParams]) -> LayerParams:
    """Stack per-layer parameter sets along a new leading (layer) axis."""
    if not layers:
        raise ValueError("stack_layers needs at least one layer.")
    return jtu.tree_map(lambda *xs: jnp.stack(xs), *layers)


def unstack_layers(values: LayerParams) -> list[LayerParams]:
    """The inverse of ``stack_layers``."""
    (num,) = _leading_sizes(values)
    return [jtu.tree_map(lambda x, i=i: x[i], values) for i in range(num)]
