"""The Cache pytree: the Classical and State pools, their typed fields, the accessors (the
only code that reaches pool storage by field name) and `init_cache`. See `v4kv_jax.pools`."""

from __future__ import annotations

import enum

import jax
import jax.numpy as jnp
from flax import struct

from v4kv_jax import paging, storage
from v4kv_jax.config import AttentionConfig, CacheConfig
from v4kv_jax.layout import CompressorSpec, compressor_specs


class SlotStatus(enum.IntEnum):
    """What a slot is doing. A flagged slot (OUT_OF_PAGES, OVER_CAPACITY, REJECTED) keeps its
    data, appends nothing until `clear_flags`, and its flag stays until then.

    Ordered so that a flag outranks ACTIVE (`max` of two statuses keeps the flag).
    """

    FREE = 0
    ACTIVE = 1
    OUT_OF_PAGES = 2  # an append needed pages the free stack did not have; nothing was written
    OVER_CAPACITY = 3  # an append would pass max_pages_per_seq * page_tokens; nothing written
    REJECTED = 4  # a call broke a rule for this slot (named twice, n_new outside [0, T], a
    #              token id outside the vocabulary); that row wrote nothing


_ENTRY_FIELD = {"csa": "c4", "csa_index": "index_keys", "hca": "c128"}
COMPRESSORS = tuple(_ENTRY_FIELD)  # the compressor names the accessors take


def _compressor(name: str) -> str:
    """`name` if it names a compressor, else a ValueError naming the argument."""
    if name not in _ENTRY_FIELD:
        raise ValueError(f"name: expected one of {COMPRESSORS}; got {name!r}")
    return name


@struct.dataclass
class ClassicalPool:
    """Complete entries, paged ([n_kind_layers, num_pages, P // m, stored width], as stored):
    c4 the CSA layers' C4 entries, index_keys their indexer keys, c128 the HCA layers' C128
    entries."""

    c4: jax.Array
    index_keys: jax.Array
    c128: jax.Array


@struct.dataclass
class Tail:
    """A compressor's raw tail ring: kv and gate [n_kind, max_slots, ring, in_width]
    (position p at row p % ring; gate with the position bias added)."""

    kv: jax.Array
    gate: jax.Array


@struct.dataclass
class OnlineTail:
    """The HCA compressor's open block as an online softmax (module docstring):
    max, sum, weighted [n_hca, max_slots, head_dim], in `tail_dtype`."""

    max: jax.Array
    sum: jax.Array
    weighted: jax.Array


@struct.dataclass
class StatePool:
    """What changes every step, per slot: lengths and status i32[max_slots], the window rings
    [n_layers, max_slots, W, stored width], and each compressor's open block: the CSA main
    and indexer compressors' raw `Tail` rings, the HCA compressor's `Tail` ring or, with
    hca_tail="online", its `OnlineTail`."""

    lengths: jax.Array
    status: jax.Array
    window: jax.Array
    csa: Tail
    csa_index: Tail
    hca: Tail | OnlineTail


@struct.dataclass
class Cache:
    classical: ClassicalPool
    pages: paging.PageState
    state: StatePool
    attn_config: AttentionConfig = struct.field(pytree_node=False)
    geometry: CacheConfig = struct.field(pytree_node=False)

    @property
    def specs(self) -> tuple[CompressorSpec, ...]:
        return compressor_specs(self.attn_config)


# --- accessors: the only code that reaches pool storage by field name ----------------------


def entries(cache: Cache, name: str) -> jax.Array:
    """The Classical array of compressor `name` ("csa" C4 entries, "csa_index" indexer keys,
    "hca" C128 entries): [n_kind_layers, num_pages, P // m, width], as stored."""
    return getattr(cache.classical, _ENTRY_FIELD[_compressor(name)])


def with_entries(cache: Cache, name: str, value: jax.Array) -> Cache:
    field = _ENTRY_FIELD[_compressor(name)]
    return cache.replace(classical=cache.classical.replace(**{field: value}))


def window_ring(cache: Cache) -> jax.Array:
    """The window rings [n_layers, max_slots, W, hd], as stored (position p at row p % W)."""
    return cache.state.window


def with_window_ring(cache: Cache, value: jax.Array) -> Cache:
    return cache.replace(state=cache.state.replace(window=value))


def tail(cache: Cache, name: str) -> Tail | OnlineTail:
    """The tails of compressor `name`, as stored: a `Tail` ring, kv and gate
    [n_kind_layers, max_slots, ring, in_width] (position p at row p % ring; gate with the
    position bias added), or for "hca" with hca_tail="online" an `OnlineTail`."""
    return getattr(cache.state, _compressor(name))


def with_tail(cache: Cache, name: str, value: Tail | OnlineTail) -> Cache:
    return cache.replace(state=cache.state.replace(**{_compressor(name): value}))


def online_tail(geometry: CacheConfig, name: str) -> bool:
    """Whether compressor `name` keeps an `OnlineTail` (the HCA compressor with
    hca_tail="online") rather than a raw `Tail` ring."""
    return name == "hca" and geometry.hca_tail == "online"


def codec(cache: Cache, name: str) -> storage.RowCodec:
    """The row format of a stored array: "csa", "csa_index", "hca" entries or "window"."""
    return storage.codec(cache.attn_config, cache.geometry, name)


def lengths(cache: Cache) -> jax.Array:
    """i32[max_slots]: tokens appended per slot."""
    return cache.state.lengths


def status(cache: Cache) -> jax.Array:
    """i32[max_slots]: `SlotStatus` per slot."""
    return cache.state.status


def with_slots(cache: Cache, *, lengths=None, status=None) -> Cache:
    """The cache with new per-slot lengths and / or statuses."""
    fields = {k: v for k, v in (("lengths", lengths), ("status", status)) if v is not None}
    return cache.replace(state=cache.state.replace(**fields))


def page_state(cache: Cache) -> paging.PageState:
    """The page tables, refcounts and free stack of the Classical pool (`paging.PageState`)."""
    return cache.pages


def with_page_state(cache: Cache, pages: paging.PageState) -> Cache:
    return cache.replace(pages=pages)


def page_table(cache: Cache) -> jax.Array:
    """i32[max_slots, max_pages_per_seq]: each slot's pages in order (-1: none)."""
    return cache.pages.page_table


def page_rows(cache: Cache, slot_ids: jax.Array) -> jax.Array:
    """i32[B, max_pages_per_seq]: the page-table rows of `slot_ids`; all -1 (no page) for an
    id outside [0, max_slots) (`paging.slot_rows`)."""
    return paging.slot_rows(cache.pages, slot_ids)


def refcounts(cache: Cache) -> jax.Array:
    """i32[num_pages]: holders of each page (slots, and prefix caches through `hold_pages`)."""
    return cache.pages.refcount


def free_pages(cache: Cache) -> jax.Array:
    """i32[]: pages on the free stack."""
    return cache.pages.num_free


def init_cache(model: AttentionConfig, geometry: CacheConfig) -> Cache:
    """An empty cache: every slot free, every page free, all storage zero."""
    geometry.check_against(model)
    P, S = geometry.page_tokens, geometry.max_slots
    stored, tails = {}, {}
    for spec in compressor_specs(model):
        n = len(model.layers_of(spec.kind))
        rows = storage.codec(model, geometry, spec.name)
        stored[_ENTRY_FIELD[spec.name]] = jnp.zeros(
            (n, geometry.num_pages, P // spec.ratio, rows.stored_width), rows.dtype)
        tail_dt = storage.tail_codec(geometry, spec.in_width).dtype
        if online_tail(geometry, spec.name):
            tails[spec.name] = OnlineTail(*(jnp.zeros((n, S, spec.width), tail_dt)
                                            for _ in range(3)))
        else:
            tails[spec.name] = Tail(
                kv=jnp.zeros((n, S, spec.ring, spec.in_width), tail_dt),
                gate=jnp.zeros((n, S, spec.ring, spec.in_width), tail_dt),
            )
    window = storage.codec(model, geometry, "window")
    return Cache(
        classical=ClassicalPool(**stored),
        pages=paging.PageState.create(geometry.num_pages, S, geometry.max_pages_per_seq),
        state=StatePool(
            lengths=jnp.zeros((S,), jnp.int32),
            status=jnp.full((S,), SlotStatus.FREE, jnp.int32),
            window=jnp.zeros((model.num_layers, S, model.window, window.stored_width),
                             window.dtype),
            **tails,
        ),
        attn_config=model,
        geometry=geometry,
    )


__all__ = ["COMPRESSORS", "Cache", "ClassicalPool", "OnlineTail", "SlotStatus", "StatePool",
           "Tail", "codec",
           "entries", "free_pages", "init_cache", "lengths", "online_tail", "page_rows",
           "page_state", "page_table", "refcounts", "status", "tail", "window_ring",
           "with_entries", "with_page_state", "with_slots", "with_tail", "with_window_ring"]
