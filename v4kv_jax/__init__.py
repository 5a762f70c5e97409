"""v4kv_jax: the DeepSeek-V4 KV cache (Classical + State pools) and attention in JAX."""

from v4kv_jax.append import AppendPlan, begin_append, end_append, replay_plan
from v4kv_jax.checks import DonatedCacheError
from v4kv_jax.config import AttentionConfig, CacheConfig, LayerKind, Options, flash, pro, tiny
from v4kv_jax.config41 import V41Config, flash41, tiny41
from v4kv_jax.ops.attention import output_projection
from v4kv_jax.plan import LayerPlan
from v4kv_jax.pools import (
    Cache,
    MemoryReport,
    SlotStatus,
    StateSnapshot,
    attach_prefix,
    clear_flags,
    drop_pages,
    hold_pages,
    init_cache,
    inspect_slots,
    load_pages,
    memory_report,
    read_pages,
    read_slot,
    release_slot,
    reset_slot,
    restore_state,
    snapshot_state,
)
from v4kv_jax.pools.cache41 import Cache41, cache_config41, init_cache41
from v4kv_jax.programs import compile_cache
from v4kv_jax.serve import (
    Completion,
    Engine,
    EngineError,
    EngineReport,
    GenerationResult,
    Generator,
    RequestMetrics,
    RequestOutput,
    SamplingParams,
    StreamOutput,
)
from v4kv_jax.step import (
    append_and_attend,
    decode_attention,
    decode_step,
    layer_step,
    layers_step,
    prefill,
    replay,
)
from v4kv_jax.step41 import LayerVectors41, LayerWeights41, Step41, decode_step41, prefill41
from v4kv_jax.vectors import (
    CompressorInput,
    CompressorParams,
    CompressorWeights,
    LayerParams,
    LayerRef,
    LayerVectors,
    Queries,
    TokenVectors,
)

__all__ = [
    "AppendPlan", "AttentionConfig", "Cache", "Cache41", "CacheConfig", "Completion",
    "CompressorInput", "CompressorParams", "CompressorWeights", "DonatedCacheError", "Engine",
    "EngineError", "EngineReport", "GenerationResult", "Generator", "LayerKind", "LayerParams",
    "LayerPlan", "LayerRef", "LayerVectors", "LayerVectors41", "LayerWeights41", "MemoryReport",
    "Options", "Queries", "RequestMetrics", "RequestOutput", "SamplingParams", "SlotStatus",
    "StateSnapshot", "Step41", "StreamOutput", "TokenVectors", "V41Config", "append_and_attend",
    "attach_prefix", "begin_append", "cache_config41", "clear_flags", "compile_cache",
    "decode_attention", "decode_step", "decode_step41", "drop_pages", "end_append", "flash",
    "flash41", "hold_pages", "init_cache", "init_cache41", "inspect_slots", "layer_step",
    "layers_step", "load_pages", "memory_report", "output_projection", "prefill", "prefill41",
    "pro", "read_pages", "read_slot", "release_slot", "replay", "replay_plan", "reset_slot",
    "restore_state", "snapshot_state", "tiny", "tiny41",
]
