"""Integration: the discretisation as a value, the time grid, the gradient methods,
and the one ``diffeqsolve`` call where terms, time stepper and adjoint meet."""

from ._depth import (
    COSTATES as COSTATES,
    DEPTH_AXIS as DEPTH_AXIS,
    DEPTH_PARALLEL as DEPTH_PARALLEL,
    MGRIT as MGRIT,
    RELAXATIONS as RELAXATIONS,
    AbstractDepthParallel as AbstractDepthParallel,
    Parareal as Parareal,
    Recursion as Recursion,
    chunk_controls as chunk_controls,
)
from ._discretisation import (
    STEPSIZES as STEPSIZES,
    Discretisation as Discretisation,
    StepSize as StepSize,
)
from ._gradients import (
    CONSTANT_STEP_METHODS as CONSTANT_STEP_METHODS,
    GRADIENT_METHODS as GRADIENT_METHODS,
    AbstractGradientMethod as AbstractGradientMethod,
    Direct as Direct,
    DiscretiseThenOptimise as DiscretiseThenOptimise,
    OptimiseThenDiscretise as OptimiseThenDiscretise,
    StoredDots as StoredDots,
    StoredProjections as StoredProjections,
    StoredResiduals as StoredResiduals,
)
from ._grid import (
    ADAPTIVE_STEPS_PER_LAYER as ADAPTIVE_STEPS_PER_LAYER,
    MAX_STEPS_PER_LAYER as MAX_STEPS_PER_LAYER,
    BackwardGrid as BackwardGrid,
    StepOverJumps as StepOverJumps,
    adaptive_controller as adaptive_controller,
    adaptive_max_steps as adaptive_max_steps,
    constant_controller as constant_controller,
    grid_points as grid_points,
    jump_flags as jump_flags,
    jumps_stepped_over as jumps_stepped_over,
    time_dtype as time_dtype,
    time_grid as time_grid,
)
from ._solve import (
    bind_solver as bind_solver,
    solve as solve,
    solve_in_depth as solve_in_depth,
)
