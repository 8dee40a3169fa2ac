"""Dynamics: the terms of the split equation, its smooth formulations, and the one
diffeqsolve call."""

from ._args import DynamicsArgs as DynamicsArgs
from ._constrained import (
    ProjectedField as ProjectedField,
    ProjectedSolver as ProjectedSolver,
    RelaxationField as RelaxationField,
    RelaxedField as RelaxedField,
    SumField as SumField,
    TangentTerm as TangentTerm,
    constraint_residual as constraint_residual,
    project_onto_set as project_onto_set,
    tangent_projection as tangent_projection,
)
from ._solve import (
    ADAPTIVE_STEPS_PER_LAYER as ADAPTIVE_STEPS_PER_LAYER,
    adaptive_controller as adaptive_controller,
    adaptive_max_steps as adaptive_max_steps,
    bind_solver as bind_solver,
    solve as solve,
    time_grid as time_grid,
)
from ._solvers import (
    SOLVERS as SOLVERS,
    is_imex as is_imex,
    is_implicit as is_implicit,
    solver_by_name as solver_by_name,
    with_root_tolerances as with_root_tolerances,
)
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
