"""How far a trained Transformer is from its continuous limit.

Command:
    python -m ocformer.sweep experiments/sweeps/continuum_limit.py \
        --workdir runs/sweeps/continuum_limit --parallel 2

The smoke model trained once (200 steps) at one step per layer with Lie splitting,
exactly a Transformer, with piecewise-constant controls and with controls piecewise
linear in t, 2 seeds each (4 trainings); every trained model is then evaluated, without
training again, at 1, 2, 4, 8 and 16 steps per layer under Lie and under Strang
(midpoint sub-solver). Expected: with piecewise-constant controls the validation loss
moves away from the trained value as the step count grows (the network is its own
discretisation, not a solution of the equation); with smooth controls it changes less
and settles as the steps per layer grow, towards the continuous limit. Not yet measured.
"""

from ocformer.sweeping import Sweep, axis, zipped


def get_sweep(arg: str | None = None) -> Sweep:
    del arg
    return Sweep(
        experiment="../smoke.py",
        overrides={
            "train.steps": 200,
            "train.eval_every": 50,
            "train.checkpoint_every": 100,
            "discretisation.stepper": "lie",
            "discretisation.steps_per_layer": 1,
        },
        axes=[
            axis(
                "controls.kind",
                ["piecewise_constant", "piecewise_linear"],
                name="controls",
                labels=["constant", "linear"],
            )
        ],
        seeds=(0, 1),
        evaluate=[
            zipped(
                "eval_scheme",
                {
                    "discretisation.stepper": ["lie", "strang"],
                    "discretisation.sub_solver": ["euler", "midpoint"],
                },
                labels=["lie", "strang-midpoint"],
            ),
            axis("discretisation.steps_per_layer", [1, 2, 4, 8, 16], name="eval_steps"),
        ],
        slurm={"time_min": 30, "cpus": 2},
    )
