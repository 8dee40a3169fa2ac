"""Controls theta(t): every trainable parameter is a function of time."""

from ._control import (
    AbstractControl as AbstractControl,
    Constant as Constant,
    PiecewiseConstant as PiecewiseConstant,
    stack_layers as stack_layers,
    unstack_layers as unstack_layers,
)
from ._conv import ConvAttentionParams as ConvAttentionParams
from ._init import (
    NORM_AFFINES as NORM_AFFINES,
    NormAffine as NormAffine,
    init_layer_params as init_layer_params,
    init_stacked_params as init_stacked_params,
)
from ._make import CONTROL_KINDS as CONTROL_KINDS, make_control as make_control
from ._params import (
    AttentionParams as AttentionParams,
    FeedForwardParams as FeedForwardParams,
    LayerParams as LayerParams,
    NormParams as NormParams,
)
from ._smooth import (
    BASIS_FAMILIES as BASIS_FAMILIES,
    Basis as Basis,
    PiecewiseLinear as PiecewiseLinear,
    basis_functions as basis_functions,
)
