"""Flax NNX modules on top of the cache: `V4Attention` (one attention layer, its compressors
and indexer) and a small `Decoder` of such layers. The serving loops that run a `Decoder`
(`Generator`, `Engine`) are in `v4kv_jax.serve`."""

from v4kv_jax.nn.attention import (
    Compressor,
    Indexer,
    Projection,
    V4Attention,
    fused_columns,
)
from v4kv_jax.nn.model import MLP, Block, Decoder, LayerGroup, ModelConfig, layer_groups

__all__ = [
    "MLP", "Block", "Compressor", "Decoder", "Indexer", "LayerGroup", "ModelConfig",
    "Projection", "V4Attention", "fused_columns", "layer_groups",
]
