"""Splitting schemes and refinement: what more steps per layer do to trained quality
and cost.

Command:
    python -m ocformer.sweep experiments/sweeps/splitting_depth.py \
        --workdir runs/sweeps/splitting_depth --parallel 2

Lie, Strang (midpoint sub-solver, second order) and parallel splitting x 1, 2, 4 steps
per layer x 2 seeds (18 runs) on the smoke copy task, 200 training steps each: the
model is trained under the discretisation it is evaluated with. Expected: cost (wall
time, solver steps) grows linearly with the steps per layer; the validation loss
changes far less than the cost. Not yet measured.
"""

from ocformer.sweeping import Sweep, axis, zipped


def get_sweep(arg: str | None = None) -> Sweep:
    del arg
    return Sweep(
        experiment="../smoke.py",
        overrides={"train.steps": 200, "train.eval_every": 50, "train.checkpoint_every": 100},
        axes=[
            zipped(
                "scheme",
                {
                    "discretisation.stepper": ["lie", "strang", "parallel"],
                    "discretisation.sub_solver": ["euler", "midpoint", "euler"],
                },
                labels=["lie", "strang-midpoint", "parallel"],
            ),
            axis("discretisation.steps_per_layer", [1, 2, 4], name="steps"),
        ],
        seeds=(0, 1),
        slurm={"time_min": 30, "cpus": 2},
    )
