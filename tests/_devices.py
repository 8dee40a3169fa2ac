"""The XLA flags of a test subprocess with forced CPU devices."""

import os


def xla_flags(devices: int) -> str:
    """The test run's XLA flags (conftest's compile settings) with ``devices`` forced
    CPU devices."""
    kept = [
        f
        for f in os.environ.get("XLA_FLAGS", "").split()
        if not f.startswith("--xla_force_host_platform_device_count")
    ]
    return " ".join([*kept, f"--xla_force_host_platform_device_count={devices}"])
