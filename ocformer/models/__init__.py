"""Models: the continuous Transformer, embeddings and readouts."""

from ._transformer import ContinuousTransformer as ContinuousTransformer
