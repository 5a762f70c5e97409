"""The two pools of a DeepSeek-V4.1 stack (V41_SPEC.md sections 3, 8; `v4kv_jax.plan`).

The Classical pool holds, for each kv source layer only, its compressed entries and their
index keys, in the same pages of `page_tokens` tokens (P // r records of each a page: 64 for
a ratio-2 source at P = 128, 128 for a ratio-1 source) under one page table: a page of a
sequence holds the entries of every source for the same P tokens, so prefix sharing and
offload move one page id for all of them. Layers that read another layer's entries (Reuse,
Reindex) read their source's pages; they store nothing.

The State pool holds, per slot, the length and status (as V4's, so the slot lifecycle and
the page allocation are one code for both families: `pools.reset_slot`, `release_slot`,
`clear_flags`, `append.begin_append`), each backbone layer's window ring (W rows, position p
at row p % W, after RoPE, in the window format) and each ratio-2 source's open row (the
a and z of token 2j while the length is odd; fp32). A ratio-1 source has no state.

Every stored array is a `Lanes` (`pools.lanes`): its blocks' records in lane rows of 128
words, so a TPU keeps it row-major (no relayout between programs). The formats are the
`CacheConfig` fields: entries "nvfp4" (288 B at hd 512) or a float format, index keys
"mxfp4" (68 B at 128), the window "mxfp8" (528 B at 512) or a float format
(`FORMAT_SETS41`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from v4kv_jax import checks, plan, programs
from v4kv_jax.config import STORAGE_FORMATS, CacheConfig
from v4kv_jax.config41 import V41Config
from v4kv_jax.pools import paging, storage
from v4kv_jax.pools.lanes import Lanes
from v4kv_jax.pools.tree import SlotStatus

# Named sets of storage fields for a V4.1 cache (`cache_config41`): "release" the official
# records (NVFP4 entries, MXFP4 index keys, MXFP8 window rows), or one float format for all.
FORMAT_SETS41 = {
    "release": dict(entry_dtype="nvfp4", index_dtype="mxfp4", window_dtype="mxfp8"),
    **{name: dict(entry_dtype=name, index_dtype=name, window_dtype=name)
       for name in STORAGE_FORMATS},
}
# The formats a V4.1 cache accepts, per `CacheConfig` field.
FORMATS41 = {"entry_dtype": STORAGE_FORMATS + ("nvfp4",),
             "index_dtype": STORAGE_FORMATS + ("mxfp4",),
             "window_dtype": STORAGE_FORMATS + ("mxfp8",)}


@struct.dataclass
class Classical41:
    """Per kv source (in `Cache41.sources` order), `Lanes` of blocks [num_pages]: entries
    (P // r records of head_dim values) and keys (P // r records of index_head_dim)."""

    entries: tuple[Lanes, ...]
    keys: tuple[Lanes, ...]


@struct.dataclass
class State41:
    """Per slot: lengths and status i32[max_slots] (`SlotStatus`), the window rings (`Lanes`
    of blocks [num_layers, max_slots], W records each) and the ratio-2 sources' open rows
    (`Lanes` of blocks [num_pair_sources, max_slots], one record of 2 head_dim fp32 words: a
    then z; None without a ratio-2 source)."""

    lengths: jax.Array
    status: jax.Array
    window: Lanes
    open: Lanes | None = None


@struct.dataclass
class Cache41:
    """A V4.1 stack's two pools. Static: the model config and the cache geometry."""

    classical: Classical41
    pages: paging.PageState
    state: State41
    config: V41Config = struct.field(pytree_node=False)
    geometry: CacheConfig = struct.field(pytree_node=False)

    @property
    def sources(self) -> tuple[int, ...]:
        """The kv source layers, the order of `Classical41`'s stores."""
        return self.config.kv_source_layers

    @property
    def pair_sources(self) -> tuple[int, ...]:
        """The ratio-2 kv sources, the order of `State41.open`'s blocks."""
        return tuple(s for s in self.sources if self.config.compress_ratios[s] == 2)

    def codec(self, name: str) -> storage.RowCodec:
        """The row format of "entries", "keys" or "window"."""
        return codec41(self.config, self.geometry, name)


_FIELDS = {"entries": "entry_dtype", "keys": "index_dtype", "window": "window_dtype"}


def codec41(config: V41Config, geometry: CacheConfig, name: str) -> storage.RowCodec:
    """The `RowCodec` of a V4.1 store: "entries", "keys" or "window"."""
    checks.one_of("name", name, tuple(_FIELDS))
    field = _FIELDS[name]
    fmt = getattr(geometry, field)
    width = config.index_head_dim if name == "keys" else config.head_dim
    try:
        return storage.RowCodec(fmt, width)
    except ValueError as err:
        checks.fail(field, f"a format that rows of {width} values fit ({err})", repr(fmt))


def cache_config41(formats: str = "float32", **fields) -> CacheConfig:
    """A `CacheConfig` storing a V4.1 stack in the named set of formats (`FORMAT_SETS41`);
    `fields` are the geometry (num_pages, max_slots, max_pages_per_seq, ...)."""
    checks.one_of("formats", formats, tuple(FORMAT_SETS41))
    return CacheConfig(**{**FORMAT_SETS41[formats], **fields})


def check_geometry41(config: V41Config, geometry: CacheConfig) -> None:
    """Raises ValueError naming the field when `geometry` cannot store `config`'s stack."""
    if not isinstance(config, V41Config):
        checks.fail("config", "a V41Config", type(config).__name__, TypeError)
    if not isinstance(geometry, CacheConfig):
        checks.fail("geometry", "a CacheConfig", type(geometry).__name__, TypeError)
    for field, allowed in FORMATS41.items():
        checks.one_of(field, getattr(geometry, field), allowed)
    for name in _FIELDS:
        codec41(config, geometry, name)
    if geometry.hot_rows or geometry.c4_tier != "device":
        checks.fail("c4_tier", "'device' with no hot set for a V4.1 stack (HiSparse for "
                    "V4.1 is not built yet)", f"{geometry.c4_tier!r}, hot_rows="
                    f"{geometry.hot_rows}")


def init_cache41(config: V41Config, geometry: CacheConfig) -> Cache41:
    """An empty V4.1 cache: every slot FREE, every page free, all storage zero."""
    check_geometry41(config, geometry)
    S, P = geometry.max_slots, geometry.page_tokens
    sources = config.kv_source_layers
    ratios = [config.compress_ratios[s] for s in sources]
    entries = tuple(codec41(config, geometry, "entries").lanes(P // r).zeros(
        (geometry.num_pages,)) for r in ratios)
    keys = tuple(codec41(config, geometry, "keys").lanes(P // r).zeros(
        (geometry.num_pages,)) for r in ratios)
    pairs = sum(r == 2 for r in ratios)
    open_rows = (storage.RowCodec("float32", 2 * config.head_dim).lanes(1).zeros((pairs, S))
                 if pairs else None)
    window = codec41(config, geometry, "window").lanes(config.window).zeros(
        (len(config.compress_ratios), S))
    return programs.committed_together(Cache41(
        classical=Classical41(entries=entries, keys=keys),
        pages=paging.PageState.create(geometry.num_pages, S, geometry.max_pages_per_seq),
        state=State41(lengths=jnp.zeros((S,), jnp.int32),
                      status=jnp.full((S,), int(SlotStatus.FREE), jnp.int32),
                      window=window, open=open_rows),
        config=config, geometry=geometry))


def source_index(cache: Cache41, layer: int) -> int:
    """The position of kv source `layer` in `Classical41`'s tuples."""
    return cache.sources.index(layer)


# --- accessors: the only code that reaches a Cache41's storage by field name ---------------


def source_store(cache: Cache41, name: str, layer: int) -> Lanes:
    """Kv source `layer`'s "entries" or "keys" (`Lanes` of blocks [num_pages])."""
    checks.one_of("name", name, ("entries", "keys"))
    return getattr(cache.classical, name)[source_index(cache, layer)]


def with_source_store(cache: Cache41, name: str, layer: int, value: Lanes) -> Cache41:
    stores = list(getattr(cache.classical, name))
    stores[source_index(cache, layer)] = value
    return cache.replace(classical=cache.classical.replace(**{name: tuple(stores)}))


def window41(cache: Cache41) -> Lanes:
    """The window rings, `Lanes` of blocks [num_layers, max_slots]."""
    return cache.state.window


def with_window41(cache: Cache41, value: Lanes) -> Cache41:
    return cache.replace(state=cache.state.replace(window=value))


def open_rows(cache: Cache41) -> Lanes:
    """The ratio-2 sources' open rows, `Lanes` of blocks [num_pair_sources, max_slots]."""
    return cache.state.open


def with_open_rows(cache: Cache41, value: Lanes) -> Cache41:
    return cache.replace(state=cache.state.replace(open=value))


def stored_entries(cache: Cache41, layer: int, slot: int, length: int) -> tuple[jax.Array,
                                                                                 jax.Array]:
    """(entries f32[n, hd], keys f32[n, c]) of kv source `layer` for the first `length`
    tokens of `slot`, decoded (n = length // r; inspection and tests)."""
    p = plan.of(cache.config)[layer]
    if not p.writes_entries:
        checks.fail("layer", f"a kv source of {list(cache.sources)}", layer)
    i, r = source_index(cache, layer), p.ratio
    n = length // r
    per_page = cache.geometry.page_tokens // r
    j = jnp.arange(n)
    page = cache.pages.page_table[slot][j // per_page]
    got = [cache.codec(name).decode(store[i].take((page,), j % per_page))
           for name, store in (("entries", cache.classical.entries),
                               ("keys", cache.classical.keys))]
    return got[0], got[1]


__all__ = ["FORMATS41", "FORMAT_SETS41", "Cache41", "Classical41", "State41",
           "cache_config41", "check_geometry41", "codec41", "init_cache41", "open_rows",
           "source_index", "source_store", "stored_entries", "window41", "with_open_rows",
           "with_source_store", "with_window41"]
