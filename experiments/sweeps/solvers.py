"""diffrax solvers on the pre-LN equation: validation loss against vector-field
evaluations (NFE).

Command:
    python -m ocformer.sweep experiments/sweeps/solvers.py \
        --workdir runs/sweeps/solvers --parallel 2

The pre-LN smoke model (a smooth right-hand side) trained for 200 steps with Euler,
Heun, midpoint and Tsit5 at constant steps, and Tsit5 with a PID controller (rtol 1e-3,
told the layer jumps; steps_per_layer sets its first step), each at 1, 2 and 4 steps
per layer (15 runs, one seed). The NFE column is one forward solve of the trained model
on a validation batch: steps x stages, Tsit5 1 + 6 x steps (first same as last) plus
one after the layer jump (where it evaluates its first stage again).

Measured (commit b673e72, 2 CPU cores, about 5 minutes): validation loss after 200
steps, Euler 0.343 / 0.470 / 0.585 at NFE 2 / 4 / 8; Heun 0.824 / 0.755 / 0.737 (NFE
4 / 8 / 16); midpoint 0.672 / 0.725 / 0.732; Tsit5 0.758 / 0.733 / 0.733 (NFE 14 / 26 /
50); Tsit5 + PID 0.733 at NFE 38-44 (one rejected step). Once the solve is accurate,
every solver trains to the same 0.733 (training the equation itself); the cheapest and
least accurate discretisation, Euler at one step per layer, trains best on this task and
budget. Euler steps the sum of the fields: at one step per layer it is the
parallel-block Transformer (the ``parallel`` splitting scheme), not the standard pre-LN
Transformer, which is Lie at one step per layer.
"""

from ocformer.sweeping import Sweep, axis, zipped


def get_sweep(arg: str | None = None) -> Sweep:
    if arg is not None:
        raise ValueError(f"unknown argument {arg!r}; solvers.py takes none")
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
