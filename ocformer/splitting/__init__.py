"""Time steppers: splitting schemes as diffrax solvers, the projected-dynamics stepper,
and the diffrax solvers by name."""

from ._base import AbstractSplittingSolver as AbstractSplittingSolver, Lie as Lie
from ._projected import (
    ProjectedSolver as ProjectedSolver,
    inner_solver as inner_solver,
    with_bounded_stages as with_bounded_stages,
    with_inner_solver as with_inner_solver,
)
from ._schemes import (
    SCHEMES as SCHEMES,
    Hybrid as Hybrid,
    Parallel as Parallel,
    Strang as Strang,
    default_groups as default_groups,
)
from ._solvers import (
    SOLVERS as SOLVERS,
    is_imex as is_imex,
    is_implicit as is_implicit,
    solver_by_name as solver_by_name,
    with_root_tolerances as with_root_tolerances,
)
