"""Models: the continuous Transformer, embeddings and readouts."""

from ._cvt import with_conv_projections as with_conv_projections
from ._embedding import (
    AbstractEmbedding as AbstractEmbedding,
    PatchEmbedding as PatchEmbedding,
    Readout as Readout,
    TokenEmbedding as TokenEmbedding,
)
from ._pretrained import (
    AbstractHead as AbstractHead,
    ClassTokenHead as ClassTokenHead,
    Pooler as Pooler,
    PretrainedModel as PretrainedModel,
    TiedHead as TiedHead,
    TokenTypeEmbedding as TokenTypeEmbedding,
)
from ._sequence import SequenceModel as SequenceModel
from ._transformer import (
    FORMULATIONS as FORMULATIONS,
    ContinuousTransformer as ContinuousTransformer,
    refine as refine,
    with_scheme as with_scheme,
)
