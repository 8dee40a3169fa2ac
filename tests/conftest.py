"""Test-wide settings: float64 available, strict rank promotion, warnings as errors
(pyproject), and shape checking of annotated public functions where practical."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_enable_x64", True)
jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture
def rng():
    import numpy as np

    return np.random.default_rng(0)
