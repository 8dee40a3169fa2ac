"""ocformer: Transformers as controlled integro-differential equations, in JAX.

A Transformer is the operator-splitting discretisation of
u_t = A(u) + dI_S1(u) + F(u) + dI_S2(u) (Tai, Liu, Li, Chan, arXiv 2510.03989);
ocformer poses that equation in diffrax, with every parameter a control theta(t), and
keeps the equation (``ContinuousTransformer``) apart from its numerics
(``Discretisation``).
"""

import importlib as _importlib
from importlib.metadata import PackageNotFoundError as _PackageNotFoundError, version as _version

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


def __getattr__(name: str):
    # `ocformer.train` is the command-line module, callable as the library's train
    # function. It is imported on first use rather than here, so that
    # `python -m ocformer.train` does not find it already imported (runpy warns).
    if name == "train":
        return _importlib.import_module(".train", __name__)
    raise AttributeError(f"module 'ocformer' has no attribute {name!r}")


try:
    __version__ = _version("ocformer")
except _PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0+unknown"
