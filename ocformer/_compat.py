"""The private names of other libraries that ocformer relies on, imported in this one
place.

Their libraries do not re-export them; if a release moves one, this module fails to
import with a message naming it, and ``tests/test_architecture.py`` says so before
anything else runs.
"""

import importlib
from typing import Any


def _private(module: str, name: str, what: str, package: str) -> Any:
    """``module.name``, or an ``ImportError`` naming it, what it is for and the fix."""
    try:
        return getattr(importlib.import_module(module), name)
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


def make_sbatch_string(**kwargs) -> str:
    """submitit's generator of the sbatch script it submits (its private
    ``_make_sbatch_string``): ocformer writes exactly the script submitit would, for job
    arrays and multi-node runs. Resolved on first use, so that ``import ocformer`` does
    not import submitit."""
    generator = _private(
        "submitit.slurm.slurm", "_make_sbatch_string", "the sbatch script generator", "submitit"
    )
    return generator(**kwargs)


__all__ = [
    "WrapTerm",
    "diffrax_loop",
    "jax_distributed_state",
    "make_sbatch_string",
    "use_stepsize_tol",
]
