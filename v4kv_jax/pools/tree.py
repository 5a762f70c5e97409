"""The Cache pytree: the Classical and State pools, their typed fields, the accessors (the
only code that reaches pool storage by field name) and `init_cache`. See `v4kv_jax.pools`."""

from __future__ import annotations

import enum

import jax
import jax.numpy as jnp
from flax import struct

from v4kv_jax import programs
from v4kv_jax.config import AttentionConfig, CacheConfig
from v4kv_jax.pools import layout, paging, storage
from v4kv_jax.pools.lanes import Lanes
from v4kv_jax.pools.layout import CacheLayout, CompressorSpec


class SlotStatus(enum.IntEnum):
    """What a slot is doing. A flagged slot (OUT_OF_PAGES, OVER_CAPACITY, REJECTED) keeps its
    data, appends nothing until `clear_flags`, and its flag stays until then (or until
    `release_slot` ends it: the one way on for OVER_CAPACITY).

    Ordered so that a flag outranks ACTIVE (`max` of two statuses keeps the flag).
    """

    FREE = 0
    ACTIVE = 1
    OUT_OF_PAGES = 2  # an append needed pages the free stack did not have; nothing was written
    OVER_CAPACITY = 3  # an append would pass max_pages_per_seq * page_tokens; nothing written
    REJECTED = 4  # a call broke a rule for this slot (named twice, n_new outside [0, T], a
    #              token id outside the vocabulary); that row wrote nothing


@struct.dataclass
class CSAEntries:
    """The CSA layers' Classical store: c4 their C4 entries and index_keys their indexer
    keys, `Lanes` of blocks [n_csa, num_pages] (a block: a page's P // m rows of one
    layer), as stored."""

    c4: Lanes
    index_keys: Lanes


@struct.dataclass
class HCAEntries:
    """The HCA layers' Classical store: c128 their C128 entries, `Lanes` of blocks
    [n_hca, num_pages] (P // m' rows each), as stored."""

    c128: Lanes


@struct.dataclass
class ClassicalPool:
    """Complete, immutable entries, paged: one typed store per compressed layer kind."""

    csa: CSAEntries
    hca: HCAEntries


@struct.dataclass
class Tail:
    """A compressor's raw tail ring: kv and gate, `Lanes` of blocks [n_kind, max_slots]
    (a block: the ring's rows of in_width, position p at row p % ring; gate with the
    position bias added)."""

    kv: Lanes
    gate: Lanes


@struct.dataclass
class OnlineTail:
    """The HCA compressor's open block as an online softmax (module docstring): max, sum,
    weighted, `Lanes` of blocks [n_hca, max_slots] (one row of head_dim each), in
    `tail_dtype`."""

    max: Lanes
    sum: Lanes
    weighted: Lanes


@struct.dataclass
class CSATails:
    """The CSA layers' open blocks: main the entry compressor's raw ring, index the indexer
    compressor's."""

    main: Tail
    index: Tail


@struct.dataclass
class HotSet:
    """HiSparse's device hot set (`CacheConfig.hot_rows` = H > 0; `v4kv_jax.ops.hot`): per CSA
    layer and slot, H rows holding C4 entries the indexer picked, `Lanes` of blocks
    [n_csa, max_slots] (H rows each): rows, as stored; held, the entry id + 1 a row holds
    (0: none), and used, 1 + the last query position that picked it (int32 rows of one
    word)."""

    rows: Lanes
    held: Lanes
    used: Lanes


@struct.dataclass
class StatePool:
    """What changes every step, per slot: lengths and status i32[max_slots], the window rings
    (`Lanes` of blocks [n_layers, max_slots], W rows each), and each compressor's open block:
    the CSA main and indexer compressors' raw `Tail` rings (`CSATails`), the HCA compressor's
    `Tail` ring or, with hca_tail="online", its `OnlineTail`; with hot_rows > 0 the CSA
    layers' `HotSet`."""

    lengths: jax.Array
    status: jax.Array
    window: Lanes
    csa: CSATails
    hca: Tail | OnlineTail
    hot: HotSet | None = None


@struct.dataclass
class Cache:
    """The two pools (`v4kv_jax.pools`). Static: the two configs and `layout`, what they fix
    (`layout.CacheLayout`: the compressors, row codecs, RoPE tables, page geometry), derived
    once (`layout.of`) and carried here so that the code a cache passes through reads it
    rather than deriving it again."""

    classical: ClassicalPool
    pages: paging.PageState
    state: StatePool
    attn_config: AttentionConfig = struct.field(pytree_node=False)
    geometry: CacheConfig = struct.field(pytree_node=False)
    layout: CacheLayout | None = struct.field(pytree_node=False, default=None)

    def __post_init__(self):
        if self.layout is None:
            object.__setattr__(self, "layout", layout.of(self.attn_config, self.geometry))

    @property
    def specs(self) -> tuple[CompressorSpec, ...]:
        return self.layout.specs


# --- accessors: the only code that reaches pool storage by field name ----------------------


# Where each compressor's arrays live: (store, field) of its entries and (store, field) of
# its tails (field None: the store's tail is the whole field).
_ENTRIES = {"csa": ("csa", "c4"), "csa_index": ("csa", "index_keys"), "hca": ("hca", "c128")}
_TAILS = {"csa": ("csa", "main"), "csa_index": ("csa", "index"), "hca": ("hca", None)}


def _spec(spec: CompressorSpec) -> str:
    """The name of compressor `spec`, or a TypeError naming the argument."""
    if not isinstance(spec, CompressorSpec):
        raise TypeError(
            f"spec: expected a layout.CompressorSpec (one of cache.specs); got {spec!r} "
            "(one kind's arrays: pools.csa_entries, hca_entries, csa_tails, hca_tail)")
    return spec.name


def csa_entries(cache: Cache) -> CSAEntries:
    """The CSA layers' C4 entries and indexer keys, as stored."""
    return cache.classical.csa


def hca_entries(cache: Cache) -> HCAEntries:
    """The HCA layers' C128 entries, as stored."""
    return cache.classical.hca


def csa_tails(cache: Cache) -> CSATails:
    """The CSA layers' main and indexer compressor rings, as stored."""
    return cache.state.csa


def hca_tail(cache: Cache) -> Tail | OnlineTail:
    """The HCA layers' open blocks: a raw `Tail` ring, or an `OnlineTail` (hca_tail="online")."""
    return cache.state.hca


def hot_set(cache: Cache) -> HotSet | None:
    """The CSA layers' hot sets (`HotSet`), or None when `CacheConfig.hot_rows` is 0."""
    return cache.state.hot


def with_hot_set(cache: Cache, value: HotSet) -> Cache:
    return cache.replace(state=cache.state.replace(hot=value))


def hot_rows(cache: Cache, layer, slot_ids: jax.Array) -> HotSet:
    """The hot sets of CSA layer `layer` (its index in the CSA stack) for the rows
    `slot_ids` i32[B]: a `HotSet` of [B, H, ...] (ids outside [0, max_slots): slot 0's,
    never written back by `with_hot_rows`)."""
    read = jnp.clip(slot_ids, 0, cache.geometry.max_slots - 1)
    return jax.tree.map(lambda x: x[layer, read], cache.state.hot)


def with_hot_rows(cache: Cache, layer, slot_ids: jax.Array, value: HotSet) -> Cache:
    """Writes `hot_rows`' [B, H, ...] back; rows of ids outside [0, max_slots) are dropped."""
    S = cache.geometry.max_slots
    dest = jnp.where((slot_ids >= 0) & (slot_ids < S), slot_ids, S)
    return with_hot_set(cache, jax.tree.map(
        lambda stored, x: stored.at[layer, dest].set(x, mode="drop"), cache.state.hot, value))


def on_host(geometry: CacheConfig, spec: CompressorSpec) -> bool:
    """Whether compressor `spec`'s entries live in host memory (the C4 entries with
    c4_tier="host"); every other array lives on the device."""
    return layout.entries_on_host(geometry, _spec(spec))


def _placed(fixed: CacheLayout, spec: CompressorSpec, value: Lanes) -> Lanes:
    """`value` in the memory space of compressor `spec`'s entries."""
    on_host = _spec(spec) in fixed.host
    return jax.device_put(value, jax.memory.Space.Host) if on_host else value


def entries(cache: Cache, spec: CompressorSpec) -> Lanes:
    """The Classical array of compressor `spec` (one of `cache.specs`): C4 entries, indexer
    keys or C128 entries, `Lanes` of blocks [n_kind_layers, num_pages] (P // m rows each),
    as stored."""
    store, field = _ENTRIES[_spec(spec)]
    return getattr(getattr(cache.classical, store), field)


def with_entries(cache: Cache, spec: CompressorSpec, value: Lanes) -> Cache:
    return with_entries_unplaced(cache, spec, _placed(cache.layout, spec, value))


def with_entries_unplaced(cache: Cache, spec: CompressorSpec, value: Lanes) -> Cache:
    """`with_entries` without putting `value` in the entries' memory space (a value already
    placed there, or shape structs)."""
    store, field = _ENTRIES[_spec(spec)]
    kind = getattr(cache.classical, store).replace(**{field: value})
    return cache.replace(classical=cache.classical.replace(**{store: kind}))


def window_ring(cache: Cache) -> Lanes:
    """The window rings, `Lanes` of blocks [n_layers, max_slots] (W rows each, position p at
    row p % W), as stored."""
    return cache.state.window


def with_window_ring(cache: Cache, value: Lanes) -> Cache:
    return cache.replace(state=cache.state.replace(window=value))


def tail(cache: Cache, spec: CompressorSpec) -> Tail | OnlineTail:
    """The tails of compressor `spec`, as stored: a `Tail` ring, kv and gate `Lanes` of
    blocks [n_kind_layers, max_slots] (ring rows of in_width, position p at row p % ring;
    gate with the position bias added), or for the HCA compressor with hca_tail="online" an
    `OnlineTail`."""
    store, field = _TAILS[_spec(spec)]
    held = getattr(cache.state, store)
    return held if field is None else getattr(held, field)


def with_tail(cache: Cache, spec: CompressorSpec, value: Tail | OnlineTail) -> Cache:
    store, field = _TAILS[_spec(spec)]
    if field is not None:
        value = getattr(cache.state, store).replace(**{field: value})
    return cache.replace(state=cache.state.replace(**{store: value}))


def online_tail(geometry: CacheConfig, spec: CompressorSpec) -> bool:
    """Whether compressor `spec` keeps an `OnlineTail` (the HCA compressor with
    hca_tail="online") rather than a raw `Tail` ring."""
    return layout.keeps_online_tail(geometry, _spec(spec))


def codec(cache: Cache, name: str) -> storage.RowCodec:
    """The row format of a stored array: "csa", "csa_index", "hca" entries or "window"."""
    return cache.layout.codec(name)


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


STACKED = "stacked"  # `shard_axes`: the shards' values stacked on a new leading axis


def shard_axes(cache: Cache) -> Cache:
    """For each array of `cache`, the axis along which the caches of a data mesh's shards lie
    end to end in the mesh's global cache (`v4kv_jax.mesh`): the slot axis of the State and
    the page table, the page axis of the Classical stores, the free stack and the refcounts;
    `STACKED` for the free-page count (a scalar per shard). A Cache-shaped tree of those."""
    return cache.replace(
        classical=jax.tree.map(lambda _: 1, cache.classical),
        pages=cache.pages.replace(page_table=0, free_stack=0, refcount=0, num_free=STACKED),
        state=jax.tree.map(lambda _: 1, cache.state).replace(lengths=0, status=0))


def _empty_hot_set(fixed: CacheLayout) -> HotSet | None:
    if "hot" not in fixed.lanes:
        return None
    lead = (fixed.model.num_csa, fixed.geometry.max_slots)
    ids = fixed.lanes["hot_ids"]
    return HotSet(rows=fixed.lanes["hot"].zeros(lead), held=ids.zeros(lead),
                  used=ids.zeros(lead))


def init_cache(model: AttentionConfig, geometry: CacheConfig) -> Cache:
    """An empty cache: every slot free, every page free, all storage zero."""
    geometry.check_against(model)
    fixed = layout.of(model, geometry)
    S = geometry.max_slots
    stored, tails = {}, {}
    for spec in fixed.specs:
        n = len(fixed.layers[spec.kind])
        stored[spec.name] = _placed(fixed, spec,
                                    fixed.lanes[spec.name].zeros((n, geometry.num_pages)))
        tail = fixed.lanes[f"tail:{spec.name}"]
        if spec.name in fixed.online:
            tails[spec.name] = OnlineTail(*(tail.zeros((n, S)) for _ in range(3)))
        else:
            tails[spec.name] = Tail(kv=tail.zeros((n, S)), gate=tail.zeros((n, S)))
    # Committed throughout if the C4 entries are on the host, as every program returns it.
    return programs.committed_together(Cache(
        classical=ClassicalPool(
            csa=CSAEntries(c4=stored["csa"], index_keys=stored["csa_index"]),
            hca=HCAEntries(c128=stored["hca"])),
        pages=paging.PageState.create(geometry.num_pages, S, geometry.max_pages_per_seq),
        state=StatePool(
            lengths=jnp.zeros((S,), jnp.int32),
            status=jnp.full((S,), int(SlotStatus.FREE), jnp.int32),  # not weakly typed
            window=fixed.lanes["window"].zeros((model.num_layers, S)),
            csa=CSATails(main=tails["csa"], index=tails["csa_index"]),
            hca=tails["hca"],
            hot=_empty_hot_set(fixed),
        ),
        attn_config=model,
        geometry=geometry,
        layout=fixed,
    ))


__all__ = ["CSAEntries", "CSATails", "Cache", "ClassicalPool", "HCAEntries", "HotSet",
           "OnlineTail", "STACKED", "SlotStatus", "StatePool", "Tail", "codec",
           "csa_entries", "csa_tails", "entries", "free_pages", "hca_entries",
           "hca_tail", "hot_rows", "hot_set", "init_cache", "lengths", "on_host",
           "online_tail", "page_rows", "page_state", "page_table", "refcounts",
           "shard_axes", "status", "tail", "window_ring", "with_entries",
           "with_hot_rows", "with_hot_set", "with_page_state", "with_slots",
           "with_tail", "with_window_ring"]
