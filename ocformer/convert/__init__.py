"""Conversion between standard Transformer layer stacks and the continuous model."""

from ._layers import LAYER_KEYS as LAYER_KEYS, from_layers as from_layers, to_layers as to_layers
