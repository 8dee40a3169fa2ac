"""Conversion between standard Transformers (layer stacks, Hugging Face checkpoints)
and the continuous model."""

from ._directory import check_destination as check_destination
from ._layers import LAYER_KEYS as LAYER_KEYS, from_layers as from_layers, to_layers as to_layers
from ._pretrained import (
    SUPPORTED_MODEL_TYPES as SUPPORTED_MODEL_TYPES,
    export_config as export_config,
    from_pretrained as from_pretrained,
    to_pretrained as to_pretrained,
)
