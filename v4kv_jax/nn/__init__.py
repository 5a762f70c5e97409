"""Flax NNX modules on top of the cache: `V4Attention` (one attention layer, its compressors
and indexer) and a small `Decoder` of such layers; for DeepSeek-V4.1, `V41Attention` (one
layer, its weights by the layer plan) and `Decoder41`. The serving loops that run a `Decoder`
(`Generator`, `Engine`) are in `v4kv_jax.serve`."""

from v4kv_jax.nn.attention import (
    Compressor,
    Indexer,
    Projection,
    V4Attention,
    fused_columns,
)
from v4kv_jax.nn.attention41 import Compressor41, Indexer41, V41Attention, param_shapes41
from v4kv_jax.nn.model import MLP, Block, Decoder, LayerGroup, ModelConfig, layer_groups
from v4kv_jax.nn.model41 import Block41, Decoder41, ModelConfig41

__all__ = [
    "MLP", "Block", "Block41", "Compressor", "Compressor41", "Decoder", "Decoder41", "Indexer",
    "Indexer41", "LayerGroup", "ModelConfig", "ModelConfig41", "Projection", "V41Attention",
    "V4Attention", "fused_columns", "layer_groups", "param_shapes41",
]
