"""Smoke sweep: the smoke experiment at two depths, evaluated at a finer step.

Command:
    python -m ocformer.sweep experiments/sweeps/smoke.py --workdir runs/sweeps/smoke

Two points (num_layers 1 and 2, seed 0) of 4 training steps each, then each trained
model evaluated again with 2 steps per layer. Expected: results.csv with 4 rows (2
trained, 2 re-evaluated), every status ``done``, validation loss about 2.3-2.4 nats
(2.386 and 2.310 for 1 and 2 layers at seed 0: 4 steps leave it above ln 8 = 2.08, the
uniform guess), about a minute on 2 CPU cores, mostly
process start-up and compilation; running the command again runs nothing.
"""

from ocformer.sweeping import Sweep, axis

# The one discretisation field this sweep touches.
STEPS_PER_LAYER = "discretisation.steps_per_layer"


def get_sweep(arg: str | None = None) -> Sweep:
    if arg is not None:
        raise ValueError(f"unknown argument {arg!r}; smoke.py takes none")
    return Sweep(
        experiment="../smoke.py",
        overrides={
            "train.steps": 4,
            "train.eval_every": 2,
            "train.checkpoint_every": 2,
            "task.eval_batches": 1,
            "task.eval_batch_size": 8,
        },
        axes=[axis("model.num_layers", [1, 2], name="layers")],
        seeds=(0,),
        evaluate=[axis(STEPS_PER_LAYER, [2], name="eval_steps")],
        slurm={"time_min": 10, "cpus": 2},
    )
