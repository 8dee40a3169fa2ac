"""Checkpoints: orbax saves committed by an atomically written marker."""

from ._atomic import (
    atomic_write_bytes as atomic_write_bytes,
    atomic_write_text as atomic_write_text,
    output_problem as output_problem,
    remove_stale_temporaries as remove_stale_temporaries,
)
from ._manager import (
    MARKER as MARKER,
    CheckpointError as CheckpointError,
    CheckpointManager as CheckpointManager,
    CheckpointMismatch as CheckpointMismatch,
    ChecksumMismatch as ChecksumMismatch,
    CorruptedCheckpoint as CorruptedCheckpoint,
    DiskFullError as DiskFullError,
    NonFiniteCheckpointError as NonFiniteCheckpointError,
)
