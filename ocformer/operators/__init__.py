"""Operators: right-hand sides of the continuous model. They hold no parameters."""

from ._activations import (
    ACTIVATIONS as ACTIVATIONS,
    Activation as Activation,
    activate as activate,
    project_positive_cone as project_positive_cone,
)
from ._attention import (
    ATTENTION_KERNELS as ATTENTION_KERNELS,
    Attention as Attention,
    AttentionKernel as AttentionKernel,
)
from ._conv_attention import ConvAttention as ConvAttention, local_transform as local_transform
from ._feedforward import FeedForward as FeedForward
from ._grid import Grid as Grid, constant_in_x as constant_in_x
from ._layernorm import (
    LayerNormProjection as LayerNormProjection,
    normalise as normalise,
    wide_dtype as wide_dtype,
)
