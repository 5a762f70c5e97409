"""The memory of a DeepSeek-V4.1 cache (V41_SPEC.md sections 6 and 8): bytes per token, per
page and per request from the geometry alone, and the `MemoryReport` of a live `Cache41`.

Two measures, as for V4 (`pools.report`): *logical* bytes are the records' own
(`LaneMap.record_bytes`: a row in whole 32-bit words, e.g. an NVFP4 entry of 512 values
288 B); bytes *as stored* are the pools' arrays as they are: each block of records (a page's
entries of one source, a slot's window ring of one layer) in lane rows of 128 words
(`LaneMap.block_bytes`), the layout a TPU keeps them in, padding included (`laid_out41` has
the TPU compiler confirm it for a chip).

Classical pool: only the kv sources store anything, P // r entries and as many index keys a
page of P tokens, so a token costs the sum over the sources of (entry + key) / r. V4.1-Flash
in the release records (NVFP4 entries 288 B, MXFP4 keys 68 B): three ratio-2 sources and one
ratio-1 source, 2.5 x 356 = 890 B logical. As stored, pages of 128 tokens: a ratio-2 page's
64 entries of 72 words fill 36 lane rows exactly (their first 64 words two to a row, the
last 8 sixteen to a row); its 64 keys of 17 words take 9 (16 words eight to a row, the last
word of all 64 in one half-filled row: 72 B a key); a ratio-1 page's 128 entries and keys
fill theirs exactly: 3 x (288 + 72) / 2 + 356 = 896 B a token (x1.007).

State pool, per slot: each layer's window ring (W rows; 128 x 528 B MXFP8 x 40 layers for
V4.1-Flash), each ratio-2 source's open row (2 x head_dim fp32, one lane-row block of 1,024
words at head_dim 512), length and status (8 B): 2,715,656 B for V4.1-Flash, which pads
nothing as stored.
"""

from __future__ import annotations

import numpy as np

from v4kv_jax import checks
from v4kv_jax.config import CacheConfig
from v4kv_jax.config41 import V41Config
from v4kv_jax.pools import storage
from v4kv_jax.pools.cache41 import Cache41, check_geometry41, codec41, init_cache41
from v4kv_jax.pools.lanes import LaneMap
from v4kv_jax.pools.report import LaidOut, MemoryReport, laid_out_of, page_tokens_held, pool_counts

# Per slot: the length and the status, one int32 each.
COUNTER_BYTES = 8


def source_maps41(config: V41Config, geometry: CacheConfig) -> list[tuple[int, int, LaneMap,
                                                                          LaneMap]]:
    """(layer, ratio, entries' map, keys' map) of each kv source: the `LaneMap` of the block
    one page holds (P // r records of each)."""
    check_geometry41(config, geometry)
    P = geometry.page_tokens
    entries, keys = codec41(config, geometry, "entries"), codec41(config, geometry, "keys")
    maps = []
    for s in config.kv_source_layers:
        r = config.compress_ratios[s]
        maps.append((s, r, entries.lanes(P // r), keys.lanes(P // r)))
    return maps


def state_maps41(config: V41Config, geometry: CacheConfig) -> dict[str, tuple[int, LaneMap]]:
    """The State of one slot as {"window": (layers, map of a ring of W rows), "open": (ratio-2
    sources, map of one open row of 2 x head_dim fp32)}, as `init_cache41` stores it."""
    check_geometry41(config, geometry)
    pairs = sum(config.compress_ratios[s] == 2 for s in config.kv_source_layers)
    return {"window": (config.num_layers,
                       codec41(config, geometry, "window").lanes(config.window)),
            "open": (pairs, storage.RowCodec("float32", 2 * config.head_dim).lanes(1))}


def classical_bytes_per_token41(config: V41Config, geometry: CacheConfig) -> dict[str, float]:
    """Amortised logical Classical bytes per token, per kv source ("layer 2", ...) and "total":
    (entry + index key) / r (V4.1-Flash, release records: 178 for each ratio-2 source, 356 for
    the ratio-1 source, total 890)."""
    per_token = {f"layer {s}": (e.record_bytes + k.record_bytes) / r
                 for s, r, e, k in source_maps41(config, geometry)}
    per_token["total"] = sum(per_token.values())
    return per_token


def stored_bytes_per_token41(config: V41Config, geometry: CacheConfig) -> dict[str, float]:
    """Amortised Classical bytes per token as stored: each source's page blocks over the P
    tokens of a page (V4.1-Flash, release records, pages of 128: 180 for each ratio-2 source,
    356 for the ratio-1 source, total 896)."""
    P = geometry.page_tokens
    per_token = {f"layer {s}": (e.block_bytes + k.block_bytes) / P
                 for s, _, e, k in source_maps41(config, geometry)}
    per_token["total"] = sum(per_token.values())
    return per_token


def page_bytes41(config: V41Config, geometry: CacheConfig) -> int:
    """Classical bytes of one page as stored: every kv source's entries and keys of P tokens
    (V4.1-Flash, release records, P = 128: 114,688)."""
    return sum(e.block_bytes + k.block_bytes for _, _, e, k in source_maps41(config, geometry))


def page_logical_bytes41(config: V41Config, geometry: CacheConfig) -> int:
    """The records' own bytes of one page (V4.1-Flash, release, P = 128: 113,920)."""
    return sum(e.records * e.record_bytes + k.records * k.record_bytes
               for _, _, e, k in source_maps41(config, geometry))


def entry_bytes41(config: V41Config, geometry: CacheConfig, tokens: int) -> int:
    """Logical bytes of the complete entries and keys of one sequence of `tokens` tokens:
    floor(tokens / r) of each per kv source (`testing.v41_oracle.global_bytes` in the release
    records)."""
    tokens = checks.integer("tokens", tokens, lo=0)
    return sum(tokens // r * (e.record_bytes + k.record_bytes)
               for _, r, e, k in source_maps41(config, geometry))


def state_bytes_per_request41(config: V41Config, geometry: CacheConfig) -> int:
    """State bytes of one slot as stored: the window rings, the open rows, length and status
    (V4.1-Flash, release records: 40 x 67,584 + 3 x 4,096 + 8 = 2,715,656)."""
    return sum(n * m.block_bytes for n, m in state_maps41(config, geometry).values()
               ) + COUNTER_BYTES


def state_logical_bytes_per_request41(config: V41Config, geometry: CacheConfig) -> int:
    """The rows' own bytes of one slot's State (as `state_bytes_per_request41`, no padding)."""
    return sum(n * m.records * m.record_bytes for n, m in state_maps41(config, geometry).values()
               ) + COUNTER_BYTES


def laid_out41(config: V41Config, geometry: CacheConfig, target: str = "v5e") -> LaidOut:
    """The arrays of a V4.1 cache of `geometry` as the TPU compiler lays them out on one chip
    of `target` (`pools.laid_out`; nothing is allocated, libtpu needed)."""
    check_geometry41(config, geometry)
    return laid_out_of(lambda: init_cache41(config, geometry), target)


def memory_report41(cache: Cache41, target: str | None = None) -> MemoryReport:
    """The `MemoryReport` of a V4.1 cache (`pools.memory_report` gives it too):
    classical_bytes_per_token and stored_bytes_per_token per kv source ("layer 2", ...) and
    "total"; entry_bytes the complete entries and keys the used pages hold; every array on
    the device (no host tier: host_bytes 0). With `target`, the compiler's figures for the
    cache on one chip of it (`laid_out41`)."""
    if not isinstance(cache, Cache41):
        checks.fail("cache", "a Cache41", type(cache).__name__, TypeError)
    checks.alive("cache", cache)
    config, geo = cache.config, cache.geometry
    tokens = page_tokens_held(cache)
    entry_bytes = sum(int(np.sum(tokens // r)) * (e.record_bytes + k.record_bytes)
                      for _, r, e, k in source_maps41(config, geo))
    stored = stored_bytes_per_token41(config, geo)
    one_page = page_bytes41(config, geo)
    return MemoryReport(
        classical_bytes_per_token=classical_bytes_per_token41(config, geo),
        state_bytes_per_request=state_bytes_per_request41(config, geo),
        page_bytes=one_page,
        entry_bytes=entry_bytes,
        device_bytes_per_token=stored["total"],
        host_bytes_per_request=0,
        stored_bytes_per_token=stored,
        page_logical_bytes=page_logical_bytes41(config, geo),
        state_logical_bytes_per_request=state_logical_bytes_per_request41(config, geo),
        laid_out=None if target is None else laid_out41(config, geo, target),
        **pool_counts(cache, one_page),
    )


__all__ = ["classical_bytes_per_token41", "entry_bytes41", "laid_out41", "memory_report41",
           "page_bytes41", "page_logical_bytes41", "source_maps41", "state_bytes_per_request41",
           "state_logical_bytes_per_request41", "state_maps41", "stored_bytes_per_token41"]
