"""SLURM job arrays through submitit: one array task per point.

Each task runs ``run_point`` (the same ``python -m ocformer.train`` and
``python -m ocformer.evaluate`` processes as the local launcher). When SLURM signals a
timeout or preemption, submitit calls ``PointJob.checkpoint``: the training process
gets SIGTERM, writes a checkpoint and exits, and the task is requeued with the same
point, whose training resumes from that checkpoint. submitit is imported when a job is
submitted or requeued, not with ``ocformer``.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..distributed import SlurmJob, slurm_job
from ._results import record_submission
from ._run import run_point, stop_children
from ._spec import SweepError

if TYPE_CHECKING:
    from submitit.helpers import DelayedSubmission

SLURM_OPTIONS: tuple[str, ...] = (
    "partition",
    "time_min",
    "cpus",
    "gpus",
    "nodes",
    "array_parallelism",
)
"""The SLURM options a sweep file (``Sweep(slurm=...)``) or the flags may set."""


@dataclasses.dataclass(frozen=True)
class SlurmOptions:
    """Resources of each array task.

    Attributes:
        partition: the SLURM partition (None: the cluster's default).
        time_min: wall-clock limit of a task, minutes; a task that reaches it is
            requeued and resumes from its checkpoint.
        cpus: CPUs per task.
        gpus: GPUs per node.
        nodes: nodes per task.
        array_parallelism: at most this many tasks of the array run at once.
    """

    partition: str | None = None
    time_min: int = 60
    cpus: int = 2
    gpus: int = 0
    nodes: int = 1
    array_parallelism: int = 16

    def job(self, sweep_dir: str) -> SlurmJob:
        """The job array of a sweep in ``sweep_dir`` (submitit's files in ``DIR/slurm``)."""
        return slurm_job(
            os.path.join(sweep_dir, "slurm"),
            name="ocformer-sweep",
            time_min=self.time_min,
            cpus_per_task=self.cpus,
            nodes=self.nodes,
            gpus_per_node=self.gpus,
            partition=self.partition,
            array_parallelism=self.array_parallelism,
        )


def slurm_options(defaults: Mapping[str, Any], flags: Mapping[str, Any]) -> SlurmOptions:
    """The sweep file's ``slurm`` options with the flags that were given on top.

    Raises:
        SweepError: an unknown option or a value of the wrong type.
    """
    merged = {**defaults, **{k: v for k, v in flags.items() if v is not None}}
    unknown = sorted(set(merged) - set(SLURM_OPTIONS))
    if unknown:
        raise SweepError(
            "slurm", f"unknown option(s) {', '.join(unknown)}; allowed: {', '.join(SLURM_OPTIONS)}"
        )
    for key, value in merged.items():
        # Named as it was given: a flag (--time-min) or the sweep file's slurm option.
        where = f"--{key.replace('_', '-')}" if flags.get(key) is not None else f"slurm.{key}"
        if key == "partition":
            if value is not None and not (isinstance(value, str) and value.strip()):
                raise SweepError(
                    where,
                    f"expected a partition's name (leave it out for the default), got {value!r}",
                )
            continue
        least = 0 if key == "gpus" else 1  # a task of no node, CPU or minute cannot run
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= least):
            raise SweepError(where, f"expected an integer >= {least}, got {value!r}")
    return SlurmOptions(**merged)


class PointJob:
    """One array task: run (or resume) a sweep point. submitit requeues a task whose
    callable has a ``checkpoint`` method (as its ``helpers.Checkpointable`` has)."""

    def __init__(self, sweep_dir: str):
        self.sweep_dir = sweep_dir

    def __call__(self, point: dict) -> dict:
        return run_point(self.sweep_dir, point)

    def checkpoint(self, *args: Any, **kwargs: Any) -> DelayedSubmission:
        # Let the training process checkpoint before the task is requeued; the new task
        # resumes from that checkpoint (the same point: submitit passes the call's
        # arguments back in).
        from submitit.helpers import DelayedSubmission

        stop_children()
        return DelayedSubmission(self, *args, **kwargs)


def require_slurm() -> None:
    """Raises ``SweepError`` unless SLURM's ``sbatch`` and ``srun`` are on the path
    (submitit needs both: ``srun`` is its job script's command)."""
    missing = [c for c in ("sbatch", "srun") if shutil.which(c) is None]
    if missing:
        raise SweepError(
            "--launcher slurm",
            f"no SLURM on this machine ({' and '.join(missing)} not found); run from a "
            "SLURM login node, or use --launcher local, or --dry-run to see the job script",
        )


def executor_for(sweep_dir: str, options: SlurmOptions):
    """A submitit SLURM executor writing its files under ``DIR/slurm``.

    Raises:
        SweepError: SLURM is not available here.
    """
    require_slurm()
    return options.job(sweep_dir).executor()


def submit(sweep_dir: str, points: Sequence[dict], executor) -> list:
    """Submit ``points`` as one job array of ``executor`` (SLURM, or submitit's local
    executor in tests), noted in ``DIR/slurm/submitted.json``; returns the jobs."""
    jobs = executor.map_array(PointJob(sweep_dir), list(points))
    if jobs:
        record_submission(sweep_dir, jobs[0].job_id.split("_")[0], [p["name"] for p in points])
    return jobs


def queued(job_ids: Sequence[str]) -> set[str] | None:
    """Those of the array jobs ``job_ids`` that SLURM still holds (queued or running),
    by ``squeue``; None where that cannot be told (no ``squeue``, or it failed)."""
    if not job_ids or shutil.which("squeue") is None:
        return None
    try:
        done = subprocess.run(
            ["squeue", "--noheader", "--format=%F", f"--jobs={','.join(sorted(job_ids))}"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    if done.returncode != 0:  # an id SLURM no longer knows is an error to some versions
        return set() if "Invalid job id" in done.stderr else None
    return {line.strip() for line in done.stdout.splitlines() if line.strip()} & set(job_ids)


def job_script(sweep_dir: str, num_points: int, options: SlurmOptions) -> str:
    """The sbatch script ``--launcher slurm`` submits for ``num_points`` points."""
    return options.job(sweep_dir).script(array_size=num_points)
