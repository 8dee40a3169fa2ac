"""Test-wide settings: XLA's fast CPU compilation, float64 available, strict rank and
dtype promotion (also in every process the run starts), warnings as errors
(pyproject), one persistent compilation cache shared by every process of the run, and
the order in which tests are handed to the workers, and submitit imported before any
test captures output. Array shapes in public signatures
are documented by the jaxtyping aliases of ``ocformer._custom_types``; they are not
checked at run time."""

import os
import pathlib
import re


def _jaxlib_version() -> tuple[int, ...]:
    """jaxlib's version, read without importing jax (which reads ``XLA_FLAGS``)."""
    from importlib.metadata import version

    return tuple(int(p) for p in re.findall(r"\d+", version("jaxlib"))[:2])


# The suite is bound by XLA's CPU compiler: most tests compile programs that they then
# run for a few steps. These flags cut the compile time of the smoke experiment's float64
# training step from 6.7-7.1 s to 2.1-3.4 s on the 2-core machine (load about 2.5), for a
# step of about the same speed (2.7 against 3.1 ms) and the same loss to 12 digits.
# Optimisation level 0 would compile faster still, but it rounds differently in two
# programs that must agree bitwise (the stored gradient's forward, PID step sequences);
# level 1 does not. Benchmarks and `make train` compile with XLA's defaults.
# (XLA aborts on a flag it does not know, and jaxlib 0.11 has no fusion-emitter flag.)
_FAST_COMPILE = (
    "--xla_backend_optimization_level=1",
    "--xla_llvm_disable_expensive_passes=true",
) + (("--xla_cpu_use_fusion_emitters=false",) if _jaxlib_version() < (0, 11) else ())
_flags = os.environ.get("XLA_FLAGS", "").split()
if not any(f.startswith("--xla_force_host_platform_device_count") for f in _flags):
    _flags.append("--xla_force_host_platform_device_count=1")
_given = {f.split("=")[0] for f in _flags}  # a flag set by the caller is kept as given
_flags += [f for f in _FAST_COMPILE if f.split("=")[0] not in _given]
os.environ["XLA_FLAGS"] = " ".join(_flags)
# One persistent compilation cache for the whole run: the xdist workers, the command-line
# runs they start and the notebook kernels inherit these variables, so a program that
# several processes compile (a training step, an evaluation) is compiled once.
_CACHE = pathlib.Path(__file__).resolve().parents[1] / ".cache" / "jax-tests"
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(_CACHE))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
# Strict dtype promotion: two dtypes meet only through an explicit cast, so a float32
# time on a float64 state, or a bfloat16 field on a float32 state, fails instead of
# silently widening. The variable carries it to the command-line runs and notebook
# kernels; jax reads it at import.
os.environ["JAX_NUMPY_DTYPE_PROMOTION"] = "strict"

import jax  # noqa: E402
import pytest  # noqa: E402

# submitit configures its logger's handlers with the sys.stdout and sys.stderr of the
# moment it is first imported. ocformer imports it only when a job is submitted, which
# in a test would be under capsys, whose streams are closed after that test: imported
# here, it logs to the session's streams instead.
import submitit  # noqa: E402, F401

jax.config.update("jax_enable_x64", True)
jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_numpy_dtype_promotion", "strict")


@pytest.fixture
def rng():
    import numpy as np

    return np.random.default_rng(0)


def pytest_collection_modifyitems(config, items):
    """Longest tests first, so that the two workers finish together: the notebook runs
    (the longest, minutes each), then the other tests marked slow, then the rest, each
    group in collection order. xdist hands tests out in this order."""
    del config

    def rank(item):
        if item.get_closest_marker("slow") is None:
            return 2
        return 0 if item.path.name == "test_notebooks.py" else 1

    items.sort(key=rank)
