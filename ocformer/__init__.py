"""ocformer: Transformers as controlled integro-differential equations, in JAX.

A Transformer is the operator-splitting discretisation of
u_t = A(u) + dI_S1(u) + F(u) + dI_S2(u) (Tai, Liu, Li, Chan, arXiv 2510.03989);
ocformer poses that equation in diffrax, with every parameter a control theta(t), and
keeps the equation (``ContinuousTransformer``) apart from its numerics
(``Discretisation``).
"""

import importlib as _importlib
import pkgutil as _pkgutil
from importlib.metadata import PackageNotFoundError as _PackageNotFoundError, version as _version
from typing import TYPE_CHECKING as _TYPE_CHECKING

# The public names, each imported from its module on first use: importing the package
# alone imports no JAX, so that a command line (`python -m ocformer.train`) can take
# charge of Ctrl-C before JAX loads (see ocformer.train).
_EXPORTS = {
    "Config": ".config",
    "from_layers": ".convert",
    "to_layers": ".convert",
    "Direct": ".integration",
    "Discretisation": ".integration",
    "DiscretiseThenOptimise": ".integration",
    "OptimiseThenDiscretise": ".integration",
    "StoredDots": ".integration",
    "StoredProjections": ".integration",
    "StoredResiduals": ".integration",
    "ContinuousTransformer": ".models",
    "SequenceModel": ".models",
    "rediscretise": ".models",
    "refine": ".models",
    "Hybrid": ".splitting",
    "Lie": ".splitting",
    "Parallel": ".splitting",
    "Strang": ".splitting",
}

if _TYPE_CHECKING:
    from . import train as train
    from .config import Config as Config
    from .convert import from_layers as from_layers, to_layers as to_layers
    from .integration import (
        Direct as Direct,
        Discretisation as Discretisation,
        DiscretiseThenOptimise as DiscretiseThenOptimise,
        OptimiseThenDiscretise as OptimiseThenDiscretise,
        StoredDots as StoredDots,
        StoredProjections as StoredProjections,
        StoredResiduals as StoredResiduals,
    )
    from .models import (
        ContinuousTransformer as ContinuousTransformer,
        SequenceModel as SequenceModel,
        rediscretise as rediscretise,
        refine as refine,
    )
    from .splitting import Hybrid as Hybrid, Lie as Lie, Parallel as Parallel, Strang as Strang


__all__ = [
    "Config",
    "from_layers",
    "to_layers",
    "Direct",
    "Discretisation",
    "DiscretiseThenOptimise",
    "OptimiseThenDiscretise",
    "StoredDots",
    "StoredProjections",
    "StoredResiduals",
    "ContinuousTransformer",
    "SequenceModel",
    "rediscretise",
    "refine",
    "Hybrid",
    "Lie",
    "Parallel",
    "Strang",
    "train",
]


def __getattr__(name: str):
    # `ocformer.train` is the command-line module, callable as the library's train
    # function. It is imported on first use rather than here, so that
    # `python -m ocformer.train` does not find it already imported (runpy warns).
    if name == "train":
        return _importlib.import_module(".train", __name__)
    if name in _EXPORTS:
        value = getattr(_importlib.import_module(_EXPORTS[name], __name__), name)
        globals()[name] = value  # the next look-up finds it without this function
        return value
    if not name.startswith("_") and name in _submodules():  # `ocformer.models`, ...
        return _importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'ocformer' has no attribute {name!r}")


def _submodules() -> set[str]:
    return {m.name for m in _pkgutil.iter_modules(__path__)}


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__, *(m for m in _submodules() if not m.startswith("_"))})


try:
    __version__ = _version("ocformer")
except _PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0+unknown"
