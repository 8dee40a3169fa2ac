"""Dynamics: the terms of the split equation and the one diffeqsolve call."""

from ._args import DynamicsArgs as DynamicsArgs
from ._solve import solve as solve, time_grid as time_grid
from ._terms import (
    SUB_SOLVERS as SUB_SOLVERS,
    AbstractExplicitTerm as AbstractExplicitTerm,
    AbstractSplitTerm as AbstractSplitTerm,
    AttentionTerm as AttentionTerm,
    AveragedFeedForwardTerm as AveragedFeedForwardTerm,
    FeedForwardTerm as FeedForwardTerm,
    ProjectionTerm as ProjectionTerm,
    sum_fields as sum_fields,
)
