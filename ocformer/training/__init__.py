"""Training: the loop, its compiled steps, the work directory, and the named outcomes of a
run."""

from ._build import (
    Experiment as Experiment,
    build as build,
    build_discretisation as build_discretisation,
    build_model as build_model,
    build_task as build_task,
)
from ._depth_fallback import (
    DepthFallback as DepthFallback,
    fallback_iterations as fallback_iterations,
)
from ._errors import (
    ConfigChanged as ConfigChanged,
    ExitCode as ExitCode,
    NonFiniteError as NonFiniteError,
    NonFiniteEvaluation as NonFiniteEvaluation,
    Preempted as Preempted,
    SolverFailure as SolverFailure,
    TrainingError as TrainingError,
    WorkdirError as WorkdirError,
)
from ._init_from import (
    enable_x64_for_config as enable_x64_for_config,
    enable_x64_for_run as enable_x64_for_run,
    parse_source as parse_source,
    run_needs_x64 as run_needs_x64,
    start_needs_x64 as start_needs_x64,
    tokenizer_mismatch as tokenizer_mismatch,
    warn_of_tokenizer_mismatch as warn_of_tokenizer_mismatch,
)
from ._load_run import load_run as load_run, load_run_at as load_run_at
from ._lock import LOCK_FILE as LOCK_FILE, DirectoryLock as DirectoryLock
from ._loop import train as train, with_precision as with_precision
from ._metrics import MetricsLog as MetricsLog
from ._optimiser import (
    make_optimiser as make_optimiser,
    make_schedule as make_schedule,
    under_standard_promotion as under_standard_promotion,
)
from ._preempt import (
    exit_at_once as exit_at_once,
    exit_on_second_interrupt as exit_on_second_interrupt,
)
from ._run_info import git_revision as git_revision, package_versions as package_versions
from ._rundir import (
    RUN_MARKER as RUN_MARKER,
    RunDirectory as RunDirectory,
    check_memory as check_memory,
    run_record as run_record,
)
from ._step import (
    COMPILE_CACHE_ENV as COMPILE_CACHE_ENV,
    enable_compile_cache as enable_compile_cache,
    gradient_bias as gradient_bias,
    make_bias_step as make_bias_step,
    make_eval_step as make_eval_step,
    make_msa_step as make_msa_step,
    make_train_step as make_train_step,
    validation_metrics as validation_metrics,
)
