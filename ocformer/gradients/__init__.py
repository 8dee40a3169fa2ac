"""Gradient methods: discretise-then-optimise, optimise-then-discretise, direct."""

from ._methods import (
    GRADIENT_METHODS as GRADIENT_METHODS,
    AbstractGradientMethod as AbstractGradientMethod,
    Direct as Direct,
    DiscretiseThenOptimise as DiscretiseThenOptimise,
    OptimiseThenDiscretise as OptimiseThenDiscretise,
)
