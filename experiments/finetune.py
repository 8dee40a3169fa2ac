"""Fine-tune a pretrained language model on your own corpus, in any discretisation.

Commands (a Hugging Face GPT-2 directory at ``gpt2/``, such as ``save_pretrained``
writes, and a corpus prepared with that checkpoint's own tokenizer):
    python -m ocformer.tasks.prepare text --input 'corpus/*.txt' --tokenizer gpt2/ \
        --out data/mine
    python -m ocformer.train --config experiments/finetune.py --workdir runs/ft \
        --set model.init_from=gpt2/ --set task.path=data/mine
    python -m ocformer.train --config experiments/finetune.py --workdir runs/ft_strang \
        --set model.init_from=gpt2/ --set task.path=data/mine \
        --set discretisation.stepper=strang --set discretisation.steps_per_layer=2
    python -m ocformer.export runs/ft --to gpt2-ft/   # the layer stack's discretisation only

The model section sets nothing but the dtype and the start: the checkpoint fixes the
architecture (docs/pretrained.md), and a field set otherwise is refused. Every discretisation field
stays free. The defaults (``model.init_from=gpt2``, ``task.path=data/mine``) are the
paths above, relative to the directory the run starts in. AdamW at a fine-tuning rate,
3e-5 after 100 warmup steps, cosine decay over 2000 steps of 8 windows of 256 tokens,
with its decay on the weight matrices only (``optimiser.weight_decay_on=matrices``).
No floor on the layer-norm gains (``objective.sigma_floor=none``): the checkpoint's
gains are trained as they are, negative ones included (under a floor, a start with a
gain below it is refused rather than clamped by the first update).

Expected: under the default discretisation (Lie, one step per layer) the model before
the first update is the checkpoint's, and its loss is that of ``transformers`` on the
same windows (``pytest tests/test_init_from.py -k reproduces`` checks it to 1e-12 in
float64), and ``python -m ocformer.evaluate --config experiments/finetune.py --set ...``
reports that start's loss under any discretisation without training. No
result is recorded here: the checkpoint and the corpus are the user's and neither
ships with the project.
"""

from ocformer.config import (
    Config,
    ModelConfig,
    ObjectiveConfig,
    OptimiserConfig,
    TaskConfig,
    TrainConfig,
)


def get_config(arg: str | None = None) -> Config:
    if arg is not None:
        raise ValueError(f"finetune.py takes no argument, got {arg!r}")
    return Config(
        model=ModelConfig(dtype="float32", init_from="gpt2"),
        optimiser=OptimiserConfig(
            name="adamw",
            learning_rate=3e-5,
            warmup_steps=100,
            weight_decay=0.1,
            weight_decay_on="matrices",
        ),
        objective=ObjectiveConfig(sigma_floor=None),
        task=TaskConfig(
            name="tokens",
            path="data/mine",
            seq_len=256,
            batch_size=8,
            eval_batch_size=8,
            eval_batches=20,
        ),
        train=TrainConfig(
            steps=2000,
            eval_every=250,
            checkpoint_every=250,
            log_every=10,
            sample_tokens=100,
        ),
    )
