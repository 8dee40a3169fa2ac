"""Metrics: one JSON object per line in ``metrics.jsonl``, mirrored to TensorBoard."""

import contextlib
import json
import math
import os
import re
import sys
import time

from ..checkpointing import atomic_write_text


def _plain(value):
    value = float(value) if not isinstance(value, int | str | bool) else value
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)  # JSON has no NaN/Inf; keep it readable and parseable
    return value


# What ``_plain`` writes for the non-finite floats, which ``MetricsLog.read`` reads back.
_NON_FINITE = {repr(x): x for x in (math.nan, math.inf, -math.inf)}


def _unplain(record: dict) -> dict:
    return {k: _NON_FINITE.get(v, v) if isinstance(v, str) else v for k, v in record.items()}


class MetricsLog:
    """Append-only metrics file that a resumed run repairs and rewinds to its checkpoint.

    Each line is written and flushed whole, so a killed process leaves at most one
    partial last line; ``repair`` drops it and every line after the restored step, and
    replaces the file atomically.
    """

    def __init__(self, path: str):
        self.path = path

    def read(self) -> list[dict]:
        """The whole records, non-finite values (written ``"nan"``, ``"inf"``) as
        floats again: a resumed run compares its earlier validation losses."""
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
                    out.append(_unplain(record))
        return out

    def repair(self, step: int) -> list[str]:
        """Make the file describe exactly the steps <= ``step`` that it logged.

        Drops a partial last line (a line without its newline that is not a whole
        record: the write a kill interrupted), lines that are not records, and the
        records of steps after ``step`` (logged after the restored checkpoint, which
        the resumed run logs again). Kept lines are kept byte for byte, each ending in a
        newline; the file is replaced atomically, and only if something was dropped or
        the last line had no newline.

        Returns:
            One warning per kind of line dropped (empty if the file was intact).
        """
        if not os.path.exists(self.path):
            return []
        with open(self.path, "rb") as f:
            data = f.read()
        lines = data.split(b"\n")
        tail = lines.pop()  # b"" when the file ends with a newline
        kept, torn, later = [], 0, 0
        for line in lines + ([tail] if tail else []):
            record = _record(line)
            if record is None:
                torn += 1
            elif record["step"] > step:
                later += 1
            else:
                kept.append(line)
        warnings = []
        if tail and _record(tail) is None:
            torn -= 1
            warnings.append(
                f"{self.path}: dropped a partial last line ({len(tail)} bytes) left by an "
                "interrupted write"
            )
        if torn:
            warnings.append(f"{self.path}: dropped {torn} line(s) that are not metric records")
        if later:
            since = f"step {step}, the restored checkpoint" if step else "the start (no checkpoint)"
            warnings.append(
                f"{self.path}: rewound to {since}: dropped {later} record(s) of later "
                "steps, which this run computes again"
            )
        # A whole last record without its newline (the kill came between the two) is
        # kept, and given its newline: the next record must not be glued onto it.
        if warnings or tail:
            text = b"".join(line + b"\n" for line in kept).decode("utf-8")
            atomic_write_text(self.path, text)
        return warnings

    def append(self, record: dict) -> None:
        line = json.dumps({k: _plain(v) for k, v in record.items()})
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line + "\n")
            f.flush()


def _record(line: bytes) -> dict | None:
    try:
        record = json.loads(line)
    except ValueError:
        return None
    if isinstance(record, dict) and isinstance(record.get("step"), int):
        return record
    return None


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


def _tensorboardx():
    """tensorboardX's event writer, summaries and protocol buffers, imported without
    PyTorch: ``(EventsWriter, summary module, event_pb2)``.

    tensorboardX imports ``torch`` when it is installed, only to accept its tensors;
    ocformer logs Python floats and text. Where PyTorch is installed (the benchmarks'
    extra) that import would lengthen every run's start (benchmarks/README.md, end to
    end), so unless ``torch`` or tensorboardX is imported already, ``torch`` is hidden
    while tensorboardX loads."""
    hide = "tensorboardX" not in sys.modules and "torch" not in sys.modules
    if hide:
        sys.modules["torch"] = None  # type: ignore[assignment]  # makes `import torch` fail
    try:
        from tensorboardX import summary
        from tensorboardX.event_file_writer import EventsWriter
        from tensorboardX.proto import event_pb2
    finally:
        if hide:
            del sys.modules["torch"]
    return EventsWriter, summary, event_pb2


class TensorBoard:
    """Scalars and text to ``<workdir>/tb``, written by this thread: a write that fails
    (a full disk) raises here, where the run can report it, instead of stopping a
    writer thread whose queue then blocks the run (tensorboardX's ``SummaryWriter``).
    ``purge_step`` hides events a killed run logged after its last checkpoint, so
    curves do not fold back on resume."""

    # Seconds between flushes (each one an fsync): TensorBoard shows a live run's
    # curves within this, and a loop of short steps does not wait on the disk.
    FLUSH_EVERY_S = 10.0

    def __init__(self, logdir: str, purge_step: int | None):
        writer, self._summary, self._pb = _tensorboardx()
        os.makedirs(logdir, exist_ok=True)
        # The file is named by the second it was opened in; a second writer within the
        # same second (a quick resume) would truncate the first's file without a suffix.
        suffix = f".{os.getpid()}-{time.monotonic_ns()}"
        self._writer = writer(os.path.join(logdir, "events"), filename_suffix=suffix)
        self._flushed = time.monotonic()
        if purge_step is not None:
            start = self._pb.SessionLog(status=self._pb.SessionLog.START)
            self._event(self._pb.Event(step=purge_step, file_version="brain.Event:2"))
            self._event(self._pb.Event(step=purge_step, session_log=start))
            self._flush()

    def _event(self, event) -> None:
        event.wall_time = time.time()
        self._writer.write_event(event)

    def _flush(self, due: bool = True) -> None:
        if due or time.monotonic() - self._flushed >= self.FLUSH_EVERY_S:
            self._writer.flush()
            self._flushed = time.monotonic()

    def scalars(self, step: int, record: dict) -> None:
        for key, value in record.items():
            if key == "step" or isinstance(value, str | bool):
                continue
            # The Summary itself: tensorboardX's scalar() logs a warning for each NaN
            # (a run that skips non-finite updates logs them on purpose).
            value = self._summary.Summary.Value(tag=key, simple_value=float(value))
            self._event(self._pb.Event(summary=self._summary.Summary(value=[value]), step=step))
        self._flush(due=False)

    def text(self, step: int, tag: str, text: str) -> None:
        self._event(self._pb.Event(summary=self._summary.text(tag, text), step=step))
        self._flush(due=False)

    def close(self) -> None:
        """Flush and close the file; closed even when the flush fails (a full disk),
        whose error is raised after."""
        try:
            self._writer.flush()
        finally:
            with contextlib.suppress(OSError):  # the flush's error is the one to raise
                self._writer.close()
