"""Gradient methods on one smooth formulation: loss, time per step and peak memory.

Command:
    python -m ocformer.sweep experiments/sweeps/gradient_methods.py \
        --workdir runs/sweeps/gradient_methods --parallel 2

The pre-LN smoke model solved with Heun at 2 steps per layer, trained for 200 steps
with discretise-then-optimise (backpropagation through the solver, one checkpoint per
step), optimise-then-discretise (the continuous adjoint solved backward) and direct
differentiation, 2 seeds each (6 runs).

Measured (commit 160d726, 2 CPU cores, 2 minutes): validation loss 0.9095 +- 0.155 for
discretise-then-optimise and for direct (the same exact gradient: identical losses),
0.9201 +- 0.157 for optimise-then-discretise (the adjoint's discretisation error at 2
steps per layer); training steps/s 92, 95 and 62 (two trainings at a time on the two
cores). Peak RSS of the training process (900, 916 and 1038 MB) is dominated by the
runtime; benchmarks/README.md has the compiled memory per method against depth.
"""

from ocformer.sweeping import Sweep, axis


def get_sweep(arg: str | None = None) -> Sweep:
    if arg is not None:
        raise ValueError(f"unknown argument {arg!r}; gradient_methods.py takes none")
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
