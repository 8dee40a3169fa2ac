"""The private diffrax names ocformer relies on, imported in this one place.

diffrax does not re-export them; if a release moves one, this module fails to import
with a message naming it, and ``tests/test_architecture.py`` says so before anything
else runs.
"""

try:
    # The wrapper diffeqsolve puts around each term to handle the direction of time.
    from diffrax._term import WrapTerm
except ImportError as e:  # pragma: no cover - exercised only by a diffrax that moved it
    raise ImportError(
        "ocformer needs diffrax._term.WrapTerm (the term wrapper of diffeqsolve); this "
        f"diffrax does not have it there ({e}). Install a diffrax in the range that "
        "pyproject.toml allows."
    ) from e

try:
    # The marker diffrax's implicit solvers use for "tolerances from the controller".
    from diffrax._root_finder import use_stepsize_tol
except ImportError as e:  # pragma: no cover
    raise ImportError(
        "ocformer needs diffrax._root_finder.use_stepsize_tol (the root-finder tolerance "
        f"marker of implicit solvers); this diffrax does not have it there ({e}). "
        "Install a diffrax in the range that pyproject.toml allows."
    ) from e

__all__ = ["WrapTerm", "use_stepsize_tol"]
