"""ocformer: Transformers as controlled integro-differential equations, in JAX.

A Transformer is the operator-splitting discretisation of
u_t = A(u) + dI_S1(u) + F(u) + dI_S2(u) (Tai, Liu, Li, Chan, arXiv 2510.03989);
ocformer poses that equation in diffrax, with every parameter a control theta(t).
"""

from . import controls as controls
from . import convert as convert
from . import dynamics as dynamics
from . import models as models
from . import operators as operators
from . import splitting as splitting

__version__ = "0.1.0"
