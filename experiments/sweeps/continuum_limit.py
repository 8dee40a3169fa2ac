"""How far a trained Transformer is from its continuous limit.

Command:
    python -m ocformer.sweep experiments/sweeps/continuum_limit.py \
        --workdir runs/sweeps/continuum_limit --parallel 2

The smoke model trained once (200 steps) at one step per layer with Lie splitting,
exactly a Transformer, with piecewise-constant controls and with controls piecewise
linear in t, 2 seeds each (4 trainings); every trained model is then evaluated, without
training again, at 1, 2, 4, 8 and 16 steps per layer under Lie and under Strang
(midpoint sub-solver).

Measured (commit 160d726, 2 CPU cores, 3.5 minutes): validation loss, mean over 2 seeds.
Piecewise-constant controls: 0.561 as trained; Lie 0.887 / 1.145 / 1.277 / 1.342 at 2 /
4 / 8 / 16 steps per layer; Strang 1.356 / 1.400 / 1.405 / 1.407 / 1.407 at 1 to 16.
Piecewise-linear controls: 0.584 as trained; Lie 0.777 / 0.931 / 1.018 / 1.064; Strang
1.035 / 1.089 / 1.105 / 1.109 / 1.110. Both discretisations converge to one limit per
model (Strang, second order, settles by 4 steps per layer); the trained Transformer sits
0.85 from its continuous limit with piecewise-constant controls and 0.53 with
controls linear in t.

The piecewise-linear rows past one step per layer depend on a direction training does
not see. The splitting schemes read the controls at step midpoints, so at one step per
layer only the node averages (theta_n + theta_{n+1}) / 2 enter: moving node n of every
control by (-1)^n changes the logits of the freshly initialised float64 smoke model by
1.6e-15 under Lie at m = 1 (1.8e-15 under Strang at m = 1) and by 3.7 at m = 2 and 4
(experiments/README.md has the snippet that measured it, commit 26038f3). The refined
evaluations and the limit 1.110 depend on that alternating part of the nodes, which the
loss at one step per layer leaves undetermined.
"""

from ocformer.sweeping import Sweep, axis, zipped


def get_sweep(arg: str | None = None) -> Sweep:
    if arg is not None:
        raise ValueError(f"unknown argument {arg!r}; continuum_limit.py takes none")
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
