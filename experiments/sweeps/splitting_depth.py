"""Splitting schemes and refinement: what more steps per layer do to trained quality
and cost.

Command:
    python -m ocformer.sweep experiments/sweeps/splitting_depth.py \
        --workdir runs/sweeps/splitting_depth --parallel 2

Lie, Strang (midpoint sub-solver, second order) and parallel splitting x 1, 2, 4 steps
per layer x 2 seeds (18 runs) on the smoke copy task, 200 training steps each: the
model is trained under the discretisation it is evaluated with.

Measured (commit 160d726, 2 CPU cores, 5 minutes): validation loss, mean +- std over 2
seeds, at 1 / 2 / 4 steps per layer: Lie 0.561 / 0.759 / 0.834, Strang 0.925 / 0.897 /
0.892, parallel 0.467 / 0.669 / 0.787 (std 0.08-0.20); training steps/s Lie 167 / 136 /
86, Strang 86 / 75 / 56, parallel 150 / 136 / 103 (two trainings at a time on the two
cores). Refinement costs time and, at 200 training steps, makes the trained model
worse for Lie and parallel splitting; Strang changes little with refinement and is the
worst at one step per layer.

At 1000 training steps (the same points with ``--set train.steps=1000``, commit
26038f3; experiments/README.md has the command) Lie at 1 and at 4 steps per layer both
solve the copy task: validation accuracy 1.000, validation loss 0.00034 / 0.00037
(seeds 0 / 1) at one step per layer against 0.00047 / 0.00047 at four.
"""

from ocformer.sweeping import Sweep, axis, zipped


def get_sweep(arg: str | None = None) -> Sweep:
    if arg is not None:
        raise ValueError(f"unknown argument {arg!r}; splitting_depth.py takes none")
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
