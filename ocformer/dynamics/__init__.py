"""Terms: the right-hand side of the controlled equation, one term per operator, and
the smooth fields of its post-LN limits (projected dynamics, Moreau-Yosida relaxation)."""

from ._args import DynamicsArgs as DynamicsArgs
from ._constrained import (
    ProjectedField as ProjectedField,
    RelaxationField as RelaxationField,
    RelaxedField as RelaxedField,
    SumField as SumField,
    TangentTerm as TangentTerm,
    constraint_residual as constraint_residual,
    project_onto_set as project_onto_set,
    tangent_projection as tangent_projection,
)
from ._terms import (
    SUB_SOLVER_ORDER as SUB_SOLVER_ORDER,
    SUB_SOLVERS as SUB_SOLVERS,
    AbstractExplicitTerm as AbstractExplicitTerm,
    AbstractSplitTerm as AbstractSplitTerm,
    AttentionTerm as AttentionTerm,
    AveragedFeedForwardTerm as AveragedFeedForwardTerm,
    FeedForwardTerm as FeedForwardTerm,
    ProjectionTerm as ProjectionTerm,
    SubSolver as SubSolver,
    sum_fields as sum_fields,
)
