"""The default experiment on byte-level BPE tokens instead of characters.

Commands (the corpus is prepared once from the file ``make data`` writes):
    python -m ocformer.tasks.prepare text --input .data/shakespeare.txt \
        --tokenizer bpe:1024 --out .data/shakespeare_bpe1024
    python -m ocformer.train --config experiments/shakespeare_bpe.py \
        --workdir runs/shakespeare_bpe
    python -m ocformer.train --config experiments/shakespeare_bpe.py:short \
        --workdir runs/shakespeare_bpe_short      # the 1500 steps of shakespeare_char:short

The model, optimiser and budget of ``shakespeare_char.py`` (4 layers x 128 features,
context 64 tokens, 7000 AdamW steps of 12 windows), so the two runs differ only in the
tokenizer. A 1024-symbol BPE token covers several characters, so the context spans more
text and the embedding and readout are larger. docs/data.md reports the validation loss in
nats per token and converted to bits per character next to the character-level run.

Expected: validation loss 3.385 nats per token after the 7000 steps (2.07 bits per
character, against 2.22 for the character model; 1500 steps: 3.924, 2.40 bits); the
measured runs are in docs/data.md.
"""

import dataclasses
import os

from ocformer.config import Config, TaskConfig, load_experiment

DATASET = ".data/shakespeare_bpe1024"


def get_config(arg: str | None = None) -> Config:
    if arg not in (None, "short"):
        raise ValueError(f"unknown argument {arg!r}; shakespeare_bpe.py takes 'short' or none")
    here = os.path.dirname(os.path.abspath(__file__))
    char = load_experiment(os.path.join(here, "shakespeare_char.py") + (f":{arg}" if arg else ""))
    task = TaskConfig(
        name="tokens",
        path=DATASET,
        seq_len=char.task.seq_len,
        batch_size=char.task.batch_size,
        eval_batch_size=char.task.eval_batch_size,
        eval_batches=char.task.eval_batches,
    )
    return dataclasses.replace(char, task=task)
