"""Flax NNX modules on top of the cache: `V4Attention`, a small `Decoder`, jitted generation."""

from v4kv_jax.nn.attention import (
    Compressor,
    Indexer,
    Projection,
    V4Attention,
    fused_columns,
)
from v4kv_jax.nn.generate import GenerationResult, Generator, ModelCache, forward, sample
from v4kv_jax.nn.model import MLP, Block, Decoder, LayerGroup, ModelConfig, layer_groups

__all__ = [
    "MLP", "Block", "Compressor", "Decoder", "GenerationResult", "Generator", "Indexer",
    "LayerGroup", "ModelCache", "ModelConfig", "Projection", "V4Attention", "forward",
    "fused_columns", "layer_groups", "sample",
]
