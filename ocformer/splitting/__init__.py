"""Splitting schemes: diffrax solvers whose steps compose operator sub-flows."""

from ._base import AbstractSplittingSolver as AbstractSplittingSolver, Lie as Lie
from ._schemes import (
    SCHEMES as SCHEMES,
    Hybrid as Hybrid,
    Parallel as Parallel,
    Strang as Strang,
    default_groups as default_groups,
)
