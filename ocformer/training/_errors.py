"""Named outcomes of a training run and the exit codes of the command line."""

import enum
import os

from ..distributed import PEER_LOST
from ..integration import ADAPTIVE_STEPS_PER_LAYER


class ExitCode(enum.IntEnum):
    """Exit codes of ``python -m ocformer.train``.

    - ``OK`` (0): finished (or already finished: nothing left to do).
    - ``FAILURE`` (1): an unexpected error (a bug; the traceback is printed).
    - ``USAGE`` (2): bad configuration or input (config field, experiment file or its
      argument, ``--set`` syntax, missing data, a work directory that is not usable or
      not ocformer's, a changed configuration on resume, a corrupted or mismatched
      checkpoint); nothing in the work directory was changed.
    - ``SOLVER_FAILURE`` (3): a diffrax solve failed (``SolverFailure``).
    - ``NON_FINITE`` (4): NaN/Inf with ``train.on_nonfinite="abort"``
      (``NonFiniteError``).
    - ``PEER_LOST`` (5): in a run of several processes, a collective failed because
      another process ended; the newest committed checkpoint is the resume point.
    - ``PREEMPTED`` (143 = 128 + SIGTERM): stopped by SIGTERM; a checkpoint of the
      last finished step was written unless the grace period ran out first.
    """

    OK = 0
    FAILURE = 1
    USAGE = 2
    SOLVER_FAILURE = 3
    NON_FINITE = 4
    PEER_LOST = PEER_LOST
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

    def __init__(self, step: int, solver_message: str, where: str | None = None):
        self.solver_message = solver_message
        where = f"at training step {step}" if where is None else where
        if "nonlinear solve" in solver_message.lower():
            # An implicit solver's stage equation z = y + gamma dt f(z): on a constant
            # grid its failure ends the solve (``ocformer.integration.solve``).
            advice = (
                "An implicit solver's stage equation z = y + gamma * dt * f(z) found no "
                "root within its tolerances: either the field's Lipschitz constant times dt "
                "is too large for it (give it more steps, discretisation.steps_per_layer; "
                "use discretisation.stepsize=pid, with discretisation.jump_ts=true for "
                "piecewise-constant controls, where a failed stage solve is a rejected, "
                "smaller step; or an explicit solver where the formulation takes one), or "
                "its Newton tolerances (discretisation.rtol/atol) cannot be met in the "
                "compute dtype (a stiff relaxation in float32: use model.dtype=float64)."
            )
        else:
            advice = (
                "Loosen discretisation.rtol/atol (a tolerance below the dtype's "
                "resolution, 1.2e-7 in float32, cannot be met), use "
                "discretisation.stepsize=constant, or give the solver more steps (an "
                f"adaptive solve may take {ADAPTIVE_STEPS_PER_LAYER} x "
                "discretisation.steps_per_layer per layer)."
            )
        super().__init__(step, f"the ODE solve failed {where}: {solver_message.strip()} {advice}")

    @classmethod
    def from_error(cls, step: int, error: Exception, where: str | None = None) -> "SolverFailure":
        """The failure of ``step`` from the ``equinox.EquinoxRuntimeError`` that a failed
        solve raises: diffrax's own message, without equinox's notes after it. ``where``
        says where the solve ran (default: ``"at training step {step}"``)."""
        text = str(error)
        marker = "EquinoxRuntimeError: "
        if marker in text:  # the message of a runtime error re-raised by JAX
            text = text.split(marker, 1)[1]
        text = text.split("\n---", 1)[0].strip()
        # diffrax's and optimistix's advice names their own arguments, which ocformer
        # derives from the grid (the advice of the message above names what sets it).
        for advice in (" Try increasing `max_steps`.", ", or you may need to increase `max_steps`"):
            text = text.replace(advice, "")
        return cls(step, text.strip(), where)


class NonFiniteEvaluation(TrainingError):
    """An evaluation whose validation loss is NaN or Inf (``ocformer.evaluate``, the
    evaluations of a sweep): a model that diverges under the new discretisation, or a
    failed solve under ``EQX_ON_ERROR=nan``, which turns the failure into NaN.
    ``solve_failed``: the solver's statistics say its solve failed."""

    exit_code = ExitCode.NON_FINITE

    def __init__(self, solve_failed: bool):
        self.solve_failed = solve_failed
        if solve_failed:
            why = (
                "its solve failed (its step counts are the failure's fill values): with "
                "EQX_ON_ERROR=nan, as sweeps run, a failed solve returns NaN; evaluate "
                "without it for the solver's message and what to change (an adaptive "
                "solve: loosen discretisation.rtol/atol or use "
                "discretisation.stepsize=constant; an implicit solver's stage equations: "
                "more discretisation.steps_per_layer)"
            )
        else:
            why = (
                "the trained model diverges under this discretisation (try more "
                "discretisation.steps_per_layer or another stepper), or its parameters "
                "give a non-finite loss under any (a start that diverges, or a run that "
                "diverged in training, whose metrics.jsonl shows the losses it logged)"
            )
        super().__init__(0, f"the validation loss is not finite (NaN or Inf): {why}.")


class NonFiniteError(TrainingError):
    """NaN or Inf in ``source`` (an entry of ``FINITE_SOURCES``: "loss", "gradients",
    "parameters" or "optimiser state") at step ``step`` with
    ``train.on_nonfinite="abort"``. No checkpoint holding it is ever written;
    ``checkpoint`` is the newest committed one (the resume point), None if there is
    none yet; ``clip_norm`` the run's gradient clipping, if any (the advice names it)."""

    exit_code = ExitCode.NON_FINITE

    def __init__(
        self, step: int, source: str, checkpoint: str | None = None, clip_norm: float | None = None
    ):
        self.source = source
        self.checkpoint = checkpoint
        if checkpoint is None:
            where = "No checkpoint has been written yet: a re-run starts from step 0."
        else:
            where = f"The last checkpoint, {checkpoint}, is finite and is the resume point."
        # Under EQX_ON_ERROR=nan a failed solve is a NaN loss, not a SolverFailure.
        solve = (
            " With EQX_ON_ERROR=nan (set in this process) a failed solve is NaN too: run "
            "without it to see whether the solver failed, and why."
            if os.environ.get("EQX_ON_ERROR") == "nan"
            else ""
        )
        clip = (
            "enable optimiser.clip_norm"
            if clip_norm is None
            else f"lower optimiser.clip_norm (now {clip_norm:g})"
        )
        super().__init__(
            step,
            f"non-finite {source} at training step {step} (NaN or Inf); aborting. {where} "
            f"Lower optimiser.learning_rate, {clip}, or set "
            f"train.on_nonfinite=skip to skip such updates.{solve}",
        )


class Preempted(TrainingError):
    """SIGTERM (or SLURM's SIGUSR2) received; the run stopped after step ``step``.
    ``checkpoint`` is the path written (None if the grace period ran out first)."""

    exit_code = ExitCode.PREEMPTED

    def __init__(self, step: int, checkpoint: str | None):
        self.checkpoint = checkpoint
        where = f"checkpoint {checkpoint}" if checkpoint else "no new checkpoint"
        super().__init__(
            step,
            f"stopped by SIGTERM or SIGUSR2 after step {step}; wrote {where}. Re-run the same "
            "command to resume.",
        )


class WorkdirError(ValueError):
    """A work directory that cannot be used: an empty path, a file, a directory that is
    not writable, or one holding files that ocformer did not write. Nothing in it is
    changed. The command line exits with ``ExitCode.USAGE``."""

    exit_code = ExitCode.USAGE


# The entry of ``ConfigChanged.changes`` for a dataset directory that holds other data
# than the run recorded (it was prepared again at the same ``task.path``).
DATASET_CHANGE = "task.path dataset"


class ConfigChanged(WorkdirError):
    """Resuming a work directory with a configuration other than the one it holds.

    ``changes`` maps each dotted field to ``(stored, new)``. Nothing is changed unless
    the change is allowed (``allow_config_change=True``, ``--allow-config-change``)."""

    def __init__(self, workdir: str, changes: dict[str, tuple]):
        self.changes = changes
        listed = "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in changes.items())
        if DATASET_CHANGE in changes:
            listed += (
                " (the dataset directory at task.path holds other files than the run "
                "trained on: prepared again since the run started, or another dataset; "
                "SHA-256 prefixes of its files then and now; put back the one the run "
                "trained on)"
            )
        super().__init__(
            f"work directory {workdir} holds a run of another configuration; changed "
            f"fields: {listed}. Resuming would mix two runs in one history. Use a new "
            "--workdir, restore those fields, or pass --allow-config-change (in Python, "
            "allow_config_change=True) to continue this run with the new values (the "
            "change is recorded in the directory's config_history.jsonl)."
        )
