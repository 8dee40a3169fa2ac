"""Metrics: one JSON object per line in ``metrics.jsonl``, mirrored to TensorBoard."""

import json
import math
import os
import re

from ..checkpointing import atomic_write_text


def _plain(value):
    value = float(value) if not isinstance(value, int | str | bool) else value
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)  # JSON has no NaN/Inf; keep it readable and parseable
    return value


class MetricsLog:
    """Append-only metrics file that a resumed run rewinds to its checkpoint.

    Each line is written and flushed whole, so a killed process leaves at most one
    partial last line; ``rewind`` drops it and every line after the restored step, and
    replaces the file atomically.
    """

    def __init__(self, path: str):
        self.path = path

    def read(self) -> list[dict]:
        if not os.path.exists(self.path):
            return []
        out = []
        with open(self.path, encoding="utf-8") as f:
            for line in f:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue  # a line torn by a kill
                if isinstance(record, dict) and isinstance(record.get("step"), int):
                    out.append(record)
        return out

    def rewind(self, step: int) -> int:
        """Keep the records of steps <= ``step``; returns how many were dropped."""
        records = self.read()
        kept = [r for r in records if r["step"] <= step]
        if os.path.exists(self.path):
            atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in kept))
        return len(records) - len(kept)

    def append(self, record: dict) -> None:
        line = json.dumps({k: _plain(v) for k, v in record.items()})
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line + "\n")
            f.flush()


def rewind_samples(path: str, step: int) -> None:
    """Drop the text samples a killed run wrote after ``step`` (its last checkpoint), so
    that a resumed run does not repeat them. Samples are blocks headed
    ``=== step N ===``."""
    if not os.path.exists(path):
        return
    with open(path, encoding="utf-8") as f:
        text = f.read()
    blocks = re.split(r"(?m)^(?==== step \d+ ===$)", text)

    def block_step(block: str) -> int:
        match = re.match(r"=== step (\d+) ===", block)
        return int(match.group(1)) if match else 0  # text before the first header

    kept = [b for b in blocks if b and block_step(b) <= step]
    if len(kept) != len([b for b in blocks if b]):
        atomic_write_text(path, "".join(kept))


class TensorBoard:
    """Scalars to ``<workdir>/tb``. ``purge_step`` hides events a killed run logged after
    its last checkpoint, so curves do not fold back on resume."""

    def __init__(self, logdir: str, purge_step: int | None):
        from tensorboardX import SummaryWriter

        self.writer = SummaryWriter(logdir, purge_step=purge_step)

    def scalars(self, step: int, record: dict) -> None:
        for key, value in record.items():
            if key == "step" or isinstance(value, str | bool):
                continue
            self.writer.add_scalar(key, float(value), step)

    def text(self, step: int, tag: str, text: str) -> None:
        self.writer.add_text(tag, text, step)

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()
