"""A CvT-style Transformer on scikit-learn's 8x8 digits: convolutional Q/K/V projections.

Command (the CvT model, built in code on top of this file's configuration):
    python experiments/digits_cvt.py

The configuration below is the ViT of experiments/digits_vit.py (2x2 patches: a 4 x 4
token grid plus a class token; pre-LN, 4 layers x 64 features, 4 heads). The script
builds it with ``ocformer.training.build``, then gives every layer CvT's convolutional
projections (``ocformer.models.with_conv_projections``: 3 x 3 depthwise kernels over the
token grid, controls of t like every other parameter, starting at the unit kernel plus
noise) and trains it with the library's compiled step for ``train.steps`` steps.
``python -m ocformer.train --config experiments/digits_cvt.py --workdir runs/x`` trains
only the plain-attention counterpart: the configuration has no field for convolutional
projections yet.

Expected: validation accuracy 0.9865 (293 of the 297 held-out images), validation
loss 0.049, after 1500 steps (0.9933 at step 500); measured in 426 s on a 2-core CPU
shared with other jobs, at commit 1b32e27.
"""

import argparse
import time

import equinox as eqx
import jax.numpy as jnp
import jax.random as jr
import numpy as np

from ocformer.config import Config, ModelConfig, OptimiserConfig, TaskConfig, TrainConfig
from ocformer.models import with_conv_projections
from ocformer.training import build, make_eval_step, make_train_step

KERNEL_SIZE = 3
KERNEL_NOISE = 0.5


def get_config(arg: str | None = None) -> Config:
    del arg
    return Config(
        model=ModelConfig(
            num_layers=4, width=64, num_heads=4, hidden=128, norm="pre", activation="gelu"
        ),
        optimiser=OptimiserConfig(
            name="adamw", learning_rate=2e-3, warmup_steps=100, weight_decay=0.05
        ),
        task=TaskConfig(
            name="digits", patch_size=2, batch_size=64, eval_batch_size=99, eval_batches=3
        ),
        train=TrainConfig(steps=1500, seed=0, eval_every=250, checkpoint_every=500, log_every=10),
    )


def build_cvt(config: Config):
    """The experiment of ``config`` with convolutional projections in every layer."""
    exp = build(config)
    side = 8 // config.task.patch_size
    transformer = with_conv_projections(
        exp.model.transformer,
        token_grid=(side, side),
        kernel_size=KERNEL_SIZE,
        key=jr.key(config.train.seed + 1),
        init_scale=KERNEL_NOISE,
    )
    return exp, exp.model.with_transformer(transformer)


def evaluate(exp, evaluate_step, model) -> dict:
    t, seed = exp.config.task, exp.config.train.seed
    batches = exp.task.eval_batches(t.eval_batch_size, t.eval_batches, seed)
    recs = [evaluate_step(model, {k: jnp.asarray(v) for k, v in b.items()}) for b in batches]
    return {k: float(np.mean([float(r[k]) for r in recs])) for k in recs[0]}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None, help="override train.steps")
    args = parser.parse_args(argv)
    config = get_config()
    steps = config.train.steps if args.steps is None else args.steps
    exp, model = build_cvt(config)
    opt_state = exp.optimiser.init(eqx.filter(model, eqx.is_inexact_array))
    step = make_train_step(exp.objective, exp.constraints, exp.optimiser, skip_nonfinite=False)
    evaluate_step = make_eval_step(exp.objective)
    started = time.perf_counter()
    result: dict = {}
    for n in range(steps):
        batch = exp.task.batch("train", n, config.task.batch_size, config.train.seed)
        model, opt_state, metrics, finite = step(
            model, opt_state, {k: jnp.asarray(v) for k, v in batch.items()}
        )
        if not np.asarray(finite).all():
            raise RuntimeError(f"non-finite loss, gradient or parameters at step {n + 1}")
        if (n + 1) % config.train.eval_every == 0 or n + 1 == steps:
            val = evaluate(exp, evaluate_step, model)
            result = {
                "step": n + 1,
                "loss": float(metrics["loss"]),
                "val_loss": val["task_loss"],
                "val_accuracy": val["accuracy"],
                "wall_time_s": time.perf_counter() - started,
            }
            print(" ".join(f"{k}={v:.4g}" for k, v in result.items()), flush=True)
    return result


if __name__ == "__main__":
    main()
