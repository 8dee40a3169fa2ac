"""Models: the continuous Transformer, its compatibility rules, embeddings and readouts,
and the roles of their parameters (which are weight matrices)."""

from ._cvt import with_conv_projections as with_conv_projections
from ._embedding import (
    AbstractEmbedding as AbstractEmbedding,
    AbstractReadout as AbstractReadout,
    PatchEmbedding as PatchEmbedding,
    Pooler as Pooler,
    Readout as Readout,
    TiedReadout as TiedReadout,
    TokenEmbedding as TokenEmbedding,
    TokenTypeEmbedding as TokenTypeEmbedding,
)
from ._matrices import (
    WEIGHT_DECAY_MASKS as WEIGHT_DECAY_MASKS,
    WEIGHT_DECAY_ON as WEIGHT_DECAY_ON,
    weight_matrices as weight_matrices,
)
from ._rules import (
    DEPTH_PARALLEL_ONLY as DEPTH_PARALLEL_ONLY,
    EXPLICIT_RELAXATION_LIMIT as EXPLICIT_RELAXATION_LIMIT,
    IMPLICIT_MIN_STEPS_PER_LAYER as IMPLICIT_MIN_STEPS_PER_LAYER,
    RULES as RULES,
    Choices as Choices,
    IncompatibleError as IncompatibleError,
    Refusal as Refusal,
    describe_stepper as describe_stepper,
    refusals as refusals,
)
from ._sequence import READOUTS as READOUTS, SequenceModel as SequenceModel
from ._transformer import (
    FORMULATIONS as FORMULATIONS,
    NORM_POSITIONS as NORM_POSITIONS,
    ContinuousTransformer as ContinuousTransformer,
    rediscretise as rediscretise,
    refine as refine,
    reformulate as reformulate,
)
