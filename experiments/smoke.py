"""Smoke test: a tiny causal model learns the copy task for a few seconds.

Command:
    python -m ocformer.train --config experiments/smoke.py --workdir runs/smoke

Expected: validation loss 1.79 nats after 60 steps (1.94 at step 20 of those 60), from about 2.08
(ln 8, a uniform guess over 8 symbols); about 18 s of CPU time (with the compilation
cache off), most of it compilation. The tests run it with fewer steps and change its fields
with ``--set``; ``get_config("float64")`` gives the same run in double precision.
"""

from ocformer.config import (
    Config,
    ModelConfig,
    OptimiserConfig,
    TaskConfig,
    TrainConfig,
)


def get_config(arg: str | None = None) -> Config:
    if arg not in (None, "float64"):
        raise ValueError(f"unknown argument {arg!r}; smoke.py takes 'float64' or none")
    return Config(
        model=ModelConfig(
            num_layers=2,
            width=16,
            num_heads=2,
            hidden=32,
            norm="pre",
            activation="gelu",
            dtype="float64" if arg == "float64" else "float32",
        ),
        optimiser=OptimiserConfig(name="adamw", learning_rate=3e-3, warmup_steps=5),
        task=TaskConfig(name="copy", seq_len=16, vocab_size=8, batch_size=16, eval_batch_size=32),
        train=TrainConfig(steps=60, seed=0, eval_every=20, checkpoint_every=20, log_every=1),
    )
