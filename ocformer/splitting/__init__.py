"""Splitting schemes: diffrax solvers whose steps compose operator sub-flows."""

from ._base import AbstractSplittingSolver as AbstractSplittingSolver, Lie as Lie
