"""diffrax solvers on the pre-LN equation: validation loss against vector-field
evaluations (NFE).

Command:
    python -m ocformer.sweep experiments/sweeps/solvers.py \
        --workdir runs/sweeps/solvers --parallel 2

The pre-LN smoke model (a smooth right-hand side) trained for 200 steps with Euler,
Heun, midpoint and Tsit5 at constant steps, and Tsit5 with a PID controller (rtol 1e-3,
told the layer jumps), each at 1, 2 and 4 (initial) steps per layer (15 runs). The NFE
column is one forward solve of the trained model on a validation batch. Expected:
NFE = steps x stages (Tsit5: 1 + 5 x steps, first-same-as-last); at equal NFE the
higher-order solvers are not better after training, because the trained network is
adapted to its own discretisation. Not yet measured.
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
            "discretisation.rtol": 1e-3,
            "discretisation.atol": 1e-6,
        },
        axes=[
            zipped(
                "solver",
                {
                    "discretisation.stepper": ["euler", "heun", "midpoint", "tsit5", "tsit5"],
                    "discretisation.stepsize": ["constant"] * 4 + ["pid"],
                },
                labels=["euler", "heun", "midpoint", "tsit5", "tsit5-pid"],
            ),
            axis("discretisation.steps_per_layer", [1, 2, 4], name="steps"),
        ],
        seeds=(0,),
        slurm={"time_min": 30, "cpus": 2},
    )
