"""The default experiment: a character-level language model of Shakespeare.

Command (``make train`` runs exactly this after ``make setup data``):
    python -m ocformer.train --config experiments/shakespeare_char.py \
        --workdir runs/shakespeare_char

A pre-LN causal Transformer, 4 layers x 128 features, 4 heads, context 64, posed as the
Lie-splitting discretisation of the controlled equation with one step per layer
(exactly a GPT-style stack), trained with AdamW, warmup and cosine decay. Sized for a
2-core CPU: 7000 steps in the README's measured run took 437 s in the training command
(16.0 steps/s) and 8 min 22 s for ``make train`` end to end from a fresh clone, the
environment's set-up, the data step, compilation, evaluation and checkpoints included.

Expected result: validation loss 1.539 nats/char after 7000 steps (the README's
measured run; target <= 1.65), samples in runs/shakespeare_char/samples.txt that look
like verse with speaker names.
``get_config("short")`` is 1500 steps: validation loss 1.800 nats/char (1.79995 at
commit f3eea8f, on the idle 2-core machine: 90 s of training steps, 98 s wall with the
compilation cache warm and 110 s with it empty; benchmarks/README.md, end to end).
"""

from ocformer.config import (
    Config,
    ModelConfig,
    OptimiserConfig,
    TaskConfig,
    TrainConfig,
)

STEPS = {None: 7000, "short": 1500}


def get_config(arg: str | None = None) -> Config:
    if arg not in STEPS:
        raise ValueError(f"unknown argument {arg!r}; shakespeare_char.py takes 'short' or none")
    steps = STEPS[arg]
    return Config(
        model=ModelConfig(
            num_layers=4,
            width=128,
            num_heads=4,
            hidden=512,
            norm="pre",
            activation="gelu",
            ln_eps=1e-5,
            final_norm=True,
        ),
        optimiser=OptimiserConfig(
            name="adamw",
            learning_rate=2e-3,
            schedule="cosine",
            warmup_steps=100,
            end_lr_ratio=0.05,
            weight_decay=0.1,
            b1=0.9,
            b2=0.99,
            clip_norm=1.0,
        ),
        task=TaskConfig(
            name="shakespeare_char",
            seq_len=64,
            batch_size=12,
            eval_batch_size=64,
            eval_batches=8,
        ),
        train=TrainConfig(
            steps=steps,
            seed=0,
            eval_every=500,
            checkpoint_every=1000,
            log_every=10,
            sample_tokens=300,
            sample_prompt="\n",
        ),
    )
