"""Named outcomes of a training run and the exit codes of the command line."""

import enum


class ExitCode(enum.IntEnum):
    """Exit codes of ``python -m ocformer.train``.

    - ``OK`` (0): finished (or already finished: nothing left to do).
    - ``FAILURE`` (1): an unexpected error (a bug; the traceback is printed).
    - ``USAGE`` (2): bad configuration or input (config field, experiment file,
      ``--set`` syntax, missing data, corrupted or mismatched checkpoint); nothing was
      traced.
    - ``SOLVER_FAILURE`` (3): a diffrax solve failed (``SolverFailure``).
    - ``NON_FINITE`` (4): NaN/Inf with ``train.on_nonfinite="abort"``
      (``NonFiniteError``).
    - ``PREEMPTED`` (143 = 128 + SIGTERM): stopped by SIGTERM; a checkpoint of the
      last finished step was written unless the grace period ran out first.
    """

    OK = 0
    FAILURE = 1
    USAGE = 2
    SOLVER_FAILURE = 3
    NON_FINITE = 4
    PREEMPTED = 143


class TrainingError(RuntimeError):
    """A training run that stopped at ``step`` (the 1-based update that failed)."""

    exit_code = ExitCode.FAILURE

    def __init__(self, step: int, message: str):
        self.step = step
        super().__init__(message)


class SolverFailure(TrainingError):
    """A diffrax solve failed inside training step ``step`` (max steps reached, step size
    too small, ...). ``solver_message`` is diffrax's own message."""

    exit_code = ExitCode.SOLVER_FAILURE

    def __init__(self, step: int, solver_message: str):
        self.solver_message = solver_message
        super().__init__(
            step,
            f"the ODE solve failed at training step {step}: {solver_message.strip()} "
            "Loosen solver.rtol/solver.atol, use solver.stepsize=constant, or give the "
            "solver more steps (scheme.steps_per_layer).",
        )


class NonFiniteError(TrainingError):
    """NaN or Inf in ``source`` ("loss", "gradients" or "parameters") at step ``step``
    with ``train.on_nonfinite="abort"``. No checkpoint holding it is ever written."""

    exit_code = ExitCode.NON_FINITE

    def __init__(self, step: int, source: str):
        self.source = source
        super().__init__(
            step,
            f"non-finite {source} at training step {step} (NaN or Inf); aborting. The "
            "last checkpoint is finite. Lower optimiser.learning_rate, enable "
            "optimiser.clip_norm, or set train.on_nonfinite=skip to skip such updates.",
        )


class Preempted(TrainingError):
    """SIGTERM received; the run stopped after step ``step``. ``checkpoint`` is the path
    written (None if the grace period ran out first)."""

    exit_code = ExitCode.PREEMPTED

    def __init__(self, step: int, checkpoint: str | None):
        self.checkpoint = checkpoint
        where = f"checkpoint {checkpoint}" if checkpoint else "no new checkpoint"
        super().__init__(
            step,
            f"preempted (SIGTERM) after step {step}; wrote {where}. Re-run the same "
            "command to resume.",
        )
