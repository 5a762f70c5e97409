"""v4kv_jax: the DeepSeek-V4 KV cache (Classical + State pools) and attention in JAX."""

from v4kv_jax.attention import Queries, output_projection
from v4kv_jax.compressor import CompressorInput, CompressorParams, CompressorWeights
from v4kv_jax.config import AttentionConfig, CacheConfig, LayerKind, flash, pro, tiny
from v4kv_jax.pools import (
    Cache,
    MemoryReport,
    SlotStatus,
    clear_flags,
    init_cache,
    inspect_slots,
    memory_report,
    read_slot,
    release_slot,
    reset_slot,
)
from v4kv_jax.step import (
    AppendPlan,
    LayerParams,
    LayerRef,
    LayerVectors,
    TokenVectors,
    begin_append,
    decode_attention,
    decode_step,
    end_append,
    layer_step,
    prefill,
)

__all__ = [
    "AppendPlan", "AttentionConfig", "Cache", "CacheConfig", "CompressorInput", "CompressorParams",
    "CompressorWeights", "LayerKind", "LayerParams", "LayerRef", "LayerVectors", "MemoryReport",
    "Queries", "SlotStatus", "TokenVectors", "begin_append", "clear_flags", "decode_attention",
    "decode_step", "end_append", "flash", "init_cache", "inspect_slots", "layer_step",
    "memory_report", "output_projection", "prefill", "pro", "read_slot", "release_slot",
    "reset_slot", "tiny",
]
