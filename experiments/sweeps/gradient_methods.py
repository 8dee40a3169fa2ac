"""Gradient methods on one smooth formulation: loss, time per step and peak memory.

Command:
    python -m ocformer.sweep experiments/sweeps/gradient_methods.py \
        --workdir runs/sweeps/gradient_methods --parallel 2

The pre-LN smoke model solved with Heun at 2 steps per layer, trained for 200 steps
with discretise-then-optimise (backpropagation through the solver, one checkpoint per
step), optimise-then-discretise (the continuous adjoint solved backward) and direct
differentiation, 2 seeds each (6 runs). Expected: discretise-then-optimise and direct
train alike (the same exact gradient); optimise-then-discretise differs by the adjoint's
discretisation error at 2 steps per layer; steps/s and peak RSS show what each costs.
Not yet measured.
"""

from ocformer.sweeping import Sweep, axis


def get_sweep(arg: str | None = None) -> Sweep:
    del arg
    return Sweep(
        experiment="../smoke.py",
        overrides={
            "train.steps": 200,
            "train.eval_every": 50,
            "train.checkpoint_every": 100,
            "discretisation.stepper": "heun",
            "discretisation.steps_per_layer": 2,
        },
        axes=[
            axis(
                "discretisation.gradient",
                ["discretise_then_optimise", "optimise_then_discretise", "direct"],
                name="gradient",
                labels=["DtO", "OtD", "direct"],
            )
        ],
        seeds=(0, 1),
        slurm={"time_min": 30, "cpus": 2},
    )
