"""The private names of other libraries that ocformer relies on, imported in this one
place.

Their libraries do not re-export them; if a release moves one, this module fails to
import with a message naming it, and ``tests/test_architecture.py`` says so before
anything else runs.
"""

import importlib
import os
import shlex
import sys
from collections.abc import Mapping
from typing import Any


def _private(module: str, name: str, what: str, package: str) -> Any:
    """``module.name`` (``name`` may be dotted: an attribute of a class), or an
    ``ImportError`` naming it, what it is for and the fix."""
    try:
        value = importlib.import_module(module)
        for part in name.split("."):
            value = getattr(value, part)
        return value
    except (ImportError, AttributeError) as e:  # pragma: no cover - a library that moved it
        raise ImportError(
            f"ocformer needs {module}.{name} ({what}); this {package} does not have it "
            f"there ({e}). Install a {package} in the range that pyproject.toml allows."
        ) from e


# The wrapper diffeqsolve puts around each term to handle the direction of time.
WrapTerm = _private("diffrax._term", "WrapTerm", "the term wrapper of diffeqsolve", "diffrax")

# The marker diffrax's implicit solvers use for "tolerances from the controller".
use_stepsize_tol = _private(
    "diffrax._root_finder",
    "use_stepsize_tol",
    "the root-finder tolerance marker of implicit solvers",
    "diffrax",
)

# diffeqsolve's step loop, which an adjoint runs with the while loops of its choice (as
# diffrax's own adjoints do through ``AbstractAdjoint._loop``).
diffrax_loop = _private("diffrax._integrate", "loop", "the step loop of diffeqsolve", "diffrax")

# The state of jax.distributed, whose coordinator client holds the key-value store that
# the processes of a run use to agree on their count before the first collective.
jax_distributed_state = _private(
    "jax._src.distributed", "global_state", "the state of jax.distributed", "jax"
)


# submitit's entry point of a submitted job, which its job script runs.
_SUBMITIT_ENTRY = "submitit.core._submit"


def sbatch_script(
    folder: str, parameters: Mapping[str, Any], *, array_size: int | None = None
) -> str:
    """The sbatch script that submitit's SLURM executor submits for a job of
    ``parameters`` whose files go to ``folder``.

    ``parameters`` are what ``submitit.AutoExecutor.update_parameters`` takes: the
    generic names (``name``, ``timeout_min``, ``nodes``, ``tasks_per_node``,
    ``cpus_per_task``, ``gpus_per_node``) and ``slurm_``-prefixed ones; ``None`` is
    unset, as there. ``array_size`` calls make it one job array (``map_array``).
    submitit has no public way to see the script without submitting it, so this
    uses what it uses: its generator ``_make_sbatch_string``, its SLURM executor's
    renaming of the generic names, and the command of its job entry point. Resolved on
    first use, so that ``import ocformer`` does not import submitit.
    """
    generator = _private(
        "submitit.slurm.slurm", "_make_sbatch_string", "the sbatch script generator", "submitit"
    )
    renames = _private(
        "submitit.slurm.slurm",
        "SlurmExecutor._equivalence_dict",
        "the SLURM names of submitit's generic parameters",
        "submitit",
    )()
    _private(_SUBMITIT_ENTRY, "submitit_main", "the entry point of a submitted job", "submitit")
    given = {k: v for k, v in parameters.items() if v is not None}
    sbatch = {renames.get(k, k): v for k, v in given.items() if not k.startswith("slurm_")}
    sbatch.update({k.removeprefix("slurm_"): v for k, v in given.items() if k.startswith("slurm_")})
    folder = os.path.abspath(folder)
    command = " ".join(
        [shlex.quote(sys.executable), f"-u -m {_SUBMITIT_ENTRY}", shlex.quote(folder)]
    )
    return generator(command=command, folder=folder, map_count=array_size, **sbatch)


__all__ = [
    "WrapTerm",
    "diffrax_loop",
    "jax_distributed_state",
    "sbatch_script",
    "use_stepsize_tol",
]
