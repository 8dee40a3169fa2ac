"""ocformer: Transformers as controlled integro-differential equations, in JAX.

A Transformer is the operator-splitting discretisation of
u_t = A(u) + dI_S1(u) + F(u) + dI_S2(u) (Tai, Liu, Li, Chan, arXiv 2510.03989);
ocformer poses that equation in diffrax, with every parameter a control theta(t).
"""

from . import (
    analysis as analysis,
    checkpointing as checkpointing,
    config as config,
    controls as controls,
    convert as convert,
    dynamics as dynamics,
    gradients as gradients,
    models as models,
    objective as objective,
    operators as operators,
    splitting as splitting,
    tasks as tasks,
    training as training,
)

__version__ = "0.1.0"
