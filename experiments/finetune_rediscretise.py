"""Re-discretise a trained Transformer and fine-tune it.

Start from the default experiment's trained run (``make train``: Lie splitting, one
step per layer, i.e. a GPT-style stack), pose the same controls under another
discretisation and fine-tune for a few hundred steps:

    python -m ocformer.train --config experiments/finetune_rediscretise.py:strang2 \
        --workdir runs/finetune_strang2

Arguments (the discretisation of the fine-tuning run; none: strang2):
    lie      the original one (Lie, m = 1): the baseline, continued training
    strang2  Strang splitting at two steps per layer
    heun2    the smooth pre-LN equation solved by Heun's method (Runge-Kutta, order 2)
             at two steps per layer

The validation loss before fine-tuning is that of the trained controls under the new
discretisation (``python -m ocformer.evaluate runs/shakespeare_char --set
discretisation.stepper=strang --set discretisation.steps_per_layer=2``); docs/data.md
reports it next to the loss after ``STEPS`` steps of each run. The source is
``runs/shakespeare_char``; ``--set model.init_from=DIR`` starts from another run.

Expected: every re-discretised run starts above the trained run's validation loss (the
controls were fitted to the Lie grid) and recovers most of the gap within the 500
steps; the measured numbers are in docs/data.md.
"""

import dataclasses
import os

from ocformer.config import (
    Config,
    DiscretisationConfig,
    OptimiserConfig,
    TrainConfig,
    load_experiment,
)

STEPS = 500
DISCRETISATIONS = {
    "lie": DiscretisationConfig(stepper="lie", steps_per_layer=1),
    "strang2": DiscretisationConfig(stepper="strang", steps_per_layer=2),
    "heun2": DiscretisationConfig(stepper="heun", steps_per_layer=2),
}


def get_config(arg: str | None = None) -> Config:
    arg = arg or "strang2"
    if arg not in DISCRETISATIONS:
        raise ValueError(
            f"finetune_rediscretise.py takes one of {sorted(DISCRETISATIONS)}, got {arg!r}"
        )
    here = os.path.dirname(os.path.abspath(__file__))
    base = load_experiment(os.path.join(here, "shakespeare_char.py"))
    return dataclasses.replace(
        base,
        model=dataclasses.replace(base.model, init_from="runs/shakespeare_char"),
        discretisation=DISCRETISATIONS[arg],
        optimiser=OptimiserConfig(
            name="adamw", learning_rate=3e-4, schedule="constant", weight_decay=0.1, clip_norm=1.0
        ),
        train=TrainConfig(
            steps=STEPS,
            seed=1,
            eval_every=100,
            checkpoint_every=STEPS,
            log_every=10,
            sample_tokens=200,
        ),
    )
