"""What is needed to reproduce a run: configuration, versions, revision, platform."""

import importlib.metadata
import os
import platform
import subprocess
import sys

import jax

_PACKAGES = (
    "ocformer",
    "jax",
    "jaxlib",
    "diffrax",
    "equinox",
    "optax",
    "orbax-checkpoint",
    "numpy",
    "tensorboardX",
)


def package_versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": sys.version.split()[0]}
    for name in _PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def git_revision() -> dict[str, str | bool | None]:
    """The revision of the source tree ocformer runs from; ``None`` outside git."""
    here = os.path.dirname(os.path.abspath(__file__))

    def git(*args):
        return subprocess.run(
            ["git", *args], cwd=here, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()

    try:
        revision = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return {"revision": None, "dirty": None}
    return {"revision": revision, "dirty": dirty}


def platform_info() -> dict:
    return {
        "machine": platform.platform(),
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "x64": bool(jax.config.read("jax_enable_x64")),
    }
