"""Sweeps: a base experiment trained over the product of axes of config fields and
seeds, every point through ``python -m ocformer.train``, with results tables and plots.
The command line is ``python -m ocformer.sweep``."""

from ._driver import plan as plan, run_sweep as run_sweep
from ._points import (
    Evaluation as Evaluation,
    Point as Point,
    config_hash as config_hash,
    resolve_points as resolve_points,
)
from ._results import METRICS as METRICS, plain_log_xaxis as plain_log_xaxis, report as report
from ._run import (
    SweepInterrupted as SweepInterrupted,
    run_local as run_local,
    run_point as run_point,
)
from ._slurm import (
    PointJob as PointJob,
    SlurmOptions as SlurmOptions,
    job_script as job_script,
    slurm_options as slurm_options,
)
from ._spec import (
    Axis as Axis,
    Sweep as Sweep,
    SweepError as SweepError,
    axis as axis,
    load_sweep as load_sweep,
    zipped as zipped,
)
