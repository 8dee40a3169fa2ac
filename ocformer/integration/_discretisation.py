"""The discretisation of the controlled equation, as one value."""

import dataclasses
import math
from typing import Literal, get_args

import diffrax
import equinox as eqx
import numpy as np

from ..splitting import AbstractSplittingSolver, Lie, is_imex
from ._depth import AbstractDepthParallel
from ._gradients import AbstractGradientMethod, DiscretiseThenOptimise
from ._grid import check_steps_per_layer

StepSize = Literal["constant", "pid"]
STEPSIZES: tuple[str, ...] = get_args(StepSize)


def _steps_one_term(solver: diffrax.AbstractSolver) -> bool:
    """An ODE solver: its terms are one ``diffrax.AbstractTerm`` (not an SDE's drift
    and diffusion, nor a partitioned pair)."""
    structure = solver.term_structure
    return isinstance(structure, type) and issubclass(structure, diffrax.AbstractTerm)


class Discretisation(eqx.Module):
    r"""How the equation is solved, kept apart from what the equation is.

    As diffrax keeps ``terms`` apart from ``solver``, ``stepsize_controller`` and
    ``adjoint``, a ``ContinuousTransformer`` holds the equation (operators, controls,
    norm position, formulation) and one ``Discretisation``. Re-discretising a trained
    model replaces this value (``ocformer.models.rediscretise``); everything that
    depends on the grid (the adjoint's checkpoints or backward grid, ``max_steps``,
    the step-size controller) is derived from it at solve time, never stored.

    ``Discretisation()`` (the Lie scheme, one step per layer, discretise-then-optimise)
    is the standard Transformer.

    Args:
        stepper: the time stepper: a splitting scheme (``ocformer.splitting.Lie``,
            ``Strang``, ``Parallel``, ``Hybrid``; its ``sub_solver`` steps the smooth
            terms) or a diffrax solver (``diffrax.Tsit5()``, ...) for the smooth
            formulations.
        steps_per_layer: steps per layer m (dt = 1/m); with ``stepsize="pid"`` the grid
            from which ``max_steps`` is derived.
        stepsize: ``"constant"`` (the grid, stepping over the controls' jumps where a
            solver would read them) or ``"pid"`` (a PID controller with ``rtol``/``atol``
            that stops at the jumps when ``jump_ts``).
        rtol, atol: tolerances of the PID controller and of the Newton iterations of
            implicit solvers.
        jump_ts: tell the PID controller where piecewise-constant controls jump.
        gradient: the gradient method (``DiscretiseThenOptimise()`` by default).
        depth_parallel: None (the serial solve), or how the layer grid is solved in
            parallel chunks (``ocformer.integration.Parareal(...)``): the discretisation
            above is then the fine propagator over each chunk.
    """

    stepper: diffrax.AbstractSolver
    gradient: AbstractGradientMethod
    depth_parallel: AbstractDepthParallel | None
    steps_per_layer: int = eqx.field(static=True)
    stepsize: StepSize = eqx.field(static=True)
    rtol: float = eqx.field(static=True)
    atol: float = eqx.field(static=True)
    jump_ts: bool = eqx.field(static=True)

    def __init__(
        self,
        stepper: diffrax.AbstractSolver | None = None,
        *,
        steps_per_layer: int = 1,
        stepsize: StepSize = "constant",
        rtol: float = 1e-6,
        atol: float = 1e-8,
        jump_ts: bool = True,
        gradient: AbstractGradientMethod | None = None,
        depth_parallel: AbstractDepthParallel | None = None,
    ):
        self.stepper = Lie() if stepper is None else stepper
        self.gradient = DiscretiseThenOptimise() if gradient is None else gradient
        self.depth_parallel = depth_parallel
        # A NumPy or JAX integer as the int it is (the field is static: hashed); checked
        # before it is stored (a JAX array in a static field is warned of).
        self.steps_per_layer = check_steps_per_layer(steps_per_layer)
        self.stepsize = stepsize
        # NumPy scalars as Python numbers (the fields are static: hashed and compared).
        self.rtol = float(rtol) if isinstance(rtol, np.floating | np.integer) else rtol
        self.atol = float(atol) if isinstance(atol, np.floating | np.integer) else atol
        self.jump_ts = jump_ts

    def __check_init__(self):
        if not isinstance(self.stepper, diffrax.AbstractSolver):
            raise ValueError(
                "Discretisation.stepper must be a splitting scheme (ocformer.splitting) or "
                f"a diffrax solver, got {type(self.stepper).__name__}. Names become "
                "objects in ocformer.config (e.g. discretisation.stepper=strang)."
            )
        if not isinstance(self.stepper, AbstractSplittingSolver) and isinstance(
            self.stepper.term_structure, tuple
        ):
            raise ValueError(
                f"Discretisation.stepper {type(self.stepper).__name__} solves a "
                f"partitioned system (terms {self.stepper.term_structure}); the "
                "Transformer's equation is one vector field (an ODE solver, or for the "
                "relaxed formulation an IMEX solver such as KenCarp3)."
            )
        if not (
            isinstance(self.stepper, AbstractSplittingSolver)  # (its terms: once bound)
            or is_imex(self.stepper)
            or _steps_one_term(self.stepper)
        ):
            raise ValueError(
                f"Discretisation.stepper {type(self.stepper).__name__} is a stochastic "
                "(SDE) solver: it takes a drift and a diffusion term driven by a Brownian "
                "motion, and the Transformer's equation is a deterministic ODE. Use an ODE "
                "solver (ocformer.splitting.SOLVERS: heun, tsit5, ...) or a splitting scheme."
            )
        if not isinstance(self.gradient, AbstractGradientMethod):
            raise ValueError(
                "Discretisation.gradient must be a gradient method (ocformer.integration."
                f"DiscretiseThenOptimise(), ...), got {type(self.gradient).__name__}."
            )
        if self.depth_parallel is not None and not isinstance(
            self.depth_parallel, AbstractDepthParallel
        ):
            raise ValueError(
                "Discretisation.depth_parallel must be None or a depth-parallel solve "
                f"(ocformer.integration.Parareal(), ...), got {type(self.depth_parallel).__name__}."
            )
        check_steps_per_layer(self.steps_per_layer)
        if not isinstance(self.jump_ts, bool):
            raise ValueError(f"Discretisation.jump_ts must be True or False, got {self.jump_ts!r}.")
        if self.stepsize not in STEPSIZES:
            raise ValueError(
                f"stepsize must be one of {', '.join(map(repr, STEPSIZES))}, got {self.stepsize!r}."
            )
        for name in ("rtol", "atol"):
            value = getattr(self, name)
            if isinstance(value, bool) or not (
                isinstance(value, int | float) and math.isfinite(value) and value > 0
            ):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}.")

    @property
    def is_splitting(self) -> bool:
        return isinstance(self.stepper, AbstractSplittingSolver)

    @property
    def is_adaptive(self) -> bool:
        return self.stepsize == "pid"

    def replace(self, **changes) -> "Discretisation":
        """This discretisation with some fields changed (validated like a new one)."""
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise ValueError(
                f"Discretisation has no field {', '.join(unknown)}; fields: "
                f"{', '.join(f.name for f in dataclasses.fields(self))}."
            )
        return dataclasses.replace(self, **changes)

    def coarse(self, steps_per_layer: int = 1) -> "Discretisation":
        """The coarse propagator's discretisation of a depth-parallel solve: its coarse
        stepper with ``steps_per_layer`` constant steps per piece of the coarse
        control, differentiated by backpropagation through the scheme."""
        if self.depth_parallel is None:
            raise ValueError("coarse() needs a depth-parallel discretisation (depth_parallel=...).")
        return Discretisation(
            self.depth_parallel.coarse_stepper,
            steps_per_layer=steps_per_layer,
            rtol=self.rtol,
            atol=self.atol,
        )

    def refine(self, steps_per_layer: int) -> "Discretisation":
        """The same discretisation with ``steps_per_layer`` steps per layer."""
        return self.replace(steps_per_layer=steps_per_layer)
