"""The two pools as one pytree, `Cache`.

Classical pool (complete, immutable entries; paged; shared by all requests):
  c4          [n_csa, num_pages, P // m,  head_dim]         CSA entries
  index_keys  [n_csa, num_pages, P // m,  index_head_dim]   CSA indexer keys
  c128        [n_hca, num_pages, P // m', head_dim]         HCA entries
  pages       page tables, free stack, refcounts (see `paging`)

State pool (per request slot; changes every step):
  lengths     i32[max_slots]   tokens appended so far
  status      i32[max_slots]   `SlotStatus`
  window      [n_layers, max_slots, W, head_dim]   ring: position p sits at row p % W
  csa, csa_index, hca          compressor tails, `Tail` of [n, max_slots, ring, in_width]

The model and cache configs are static fields, so a jitted function taking a `Cache`
compiles once per geometry and never per length.
"""

from __future__ import annotations

import dataclasses
import enum

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from v4kv_jax import paging
from v4kv_jax.compressor import CompressorSpec, compressor_specs
from v4kv_jax.config import AttentionConfig, CacheConfig, LayerKind, itemsize


class SlotStatus(enum.IntEnum):
    FREE = 0
    ACTIVE = 1
    OUT_OF_PAGES = 2  # an append needed pages the free stack did not have; nothing was written
    OVER_CAPACITY = 3  # an append would pass max_pages_per_seq * page_tokens; nothing written


_ENTRY_FIELD = {"csa": "c4", "csa_index": "index_keys", "hca": "c128"}


@struct.dataclass
class ClassicalPool:
    c4: jax.Array
    index_keys: jax.Array
    c128: jax.Array

    def entries(self, compressor: str) -> jax.Array:
        return getattr(self, _ENTRY_FIELD[compressor])

    def with_entries(self, compressor: str, value: jax.Array) -> ClassicalPool:
        return self.replace(**{_ENTRY_FIELD[compressor]: value})


@struct.dataclass
class Tail:
    kv: jax.Array
    gate: jax.Array


@struct.dataclass
class StatePool:
    lengths: jax.Array
    status: jax.Array
    window: jax.Array
    csa: Tail
    csa_index: Tail
    hca: Tail

    def tail(self, compressor: str) -> Tail:
        return getattr(self, compressor)


@struct.dataclass
class Cache:
    classical: ClassicalPool
    pages: paging.PageState
    state: StatePool
    model: AttentionConfig = struct.field(pytree_node=False)
    geometry: CacheConfig = struct.field(pytree_node=False)

    @property
    def specs(self) -> tuple[CompressorSpec, ...]:
        return compressor_specs(self.model)


def init_cache(model: AttentionConfig, geometry: CacheConfig) -> Cache:
    """An empty cache: every slot free, every page free, all storage zero."""
    geometry.check_against(model)
    P, S = geometry.page_tokens, geometry.max_slots
    entry_dt, tail_dt = geometry.dtype("entry"), geometry.dtype("tail")
    entries, tails = {}, {}
    for spec in compressor_specs(model):
        n = len(model.layers_of(spec.kind))
        entries[_ENTRY_FIELD[spec.name]] = jnp.zeros(
            (n, geometry.num_pages, P // spec.ratio, spec.width), entry_dt)
        tails[spec.name] = Tail(
            kv=jnp.zeros((n, S, spec.ring, spec.in_width), tail_dt),
            gate=jnp.zeros((n, S, spec.ring, spec.in_width), tail_dt),
        )
    return Cache(
        classical=ClassicalPool(**entries),
        pages=paging.PageState.create(geometry.num_pages, S, geometry.max_pages_per_seq),
        state=StatePool(
            lengths=jnp.zeros((S,), jnp.int32),
            status=jnp.full((S,), SlotStatus.FREE, jnp.int32),
            window=jnp.zeros((model.num_layers, S, model.window, model.head_dim),
                             geometry.dtype("window")),
            **tails,
        ),
        model=model,
        geometry=geometry,
    )


def reset_slot(cache: Cache, slot: jax.Array) -> Cache:
    """Starts a new, empty sequence in `slot`: length 0, ACTIVE, window and tails zeroed.

    The slot must hold no pages (release it first).
    """
    state = cache.state

    def clear(x):
        return x.at[:, slot].set(0)

    state = state.replace(
        lengths=state.lengths.at[slot].set(0),
        status=state.status.at[slot].set(SlotStatus.ACTIVE),
        window=clear(state.window),
        **{s.name: jax.tree.map(clear, state.tail(s.name)) for s in cache.specs},
    )
    return cache.replace(state=state)


def release_slot(cache: Cache, slot: jax.Array) -> Cache:
    """Ends the sequence in `slot`: its pages lose one reference each, the slot becomes FREE."""
    mask = jnp.arange(cache.geometry.max_slots) == slot
    state = cache.state.replace(
        lengths=jnp.where(mask, 0, cache.state.lengths),
        status=jnp.where(mask, SlotStatus.FREE, cache.state.status),
    )
    return cache.replace(pages=paging.release(cache.pages, mask), state=state)


# --- inspection and memory report (host side) ------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SlotReport:
    slot: int
    status: str
    length: int
    c4_entries: int  # per CSA layer (also the number of indexer keys)
    c128_entries: int  # per HCA layer
    csa_tail: int  # tokens of the open C4 block
    hca_tail: int  # tokens of the open C128 block
    window: tuple[int, int] | None  # first and last position held for the next query
    pages: tuple[int, ...]


def inspect_slots(cache: Cache) -> list[SlotReport]:
    """What each non-free slot holds, derived from its length and page-table row."""
    model = cache.model
    lengths = np.asarray(cache.state.lengths)
    status = np.asarray(cache.state.status)
    table = np.asarray(cache.pages.page_table)
    reports = []
    for slot in range(lengths.shape[0]):
        if status[slot] == SlotStatus.FREE:
            continue
        n = int(lengths[slot])
        reports.append(SlotReport(
            slot=slot,
            status=SlotStatus(int(status[slot])).name,
            length=n,
            c4_entries=n // model.csa_ratio if model.num_csa else 0,
            c128_entries=n // model.hca_ratio if model.num_hca else 0,
            csa_tail=n % model.csa_ratio,
            hca_tail=n % model.hca_ratio,
            window=(max(0, n - model.window), n - 1) if n else None,
            pages=tuple(int(p) for p in table[slot] if p >= 0),
        ))
    return reports


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Bytes of the cache, separated the way the two pools differ.

    Attributes:
      classical_bytes_per_token: amortised Classical bytes one token costs, per layer kind
        (summed over the layers of that kind) and "total".
      state_bytes_per_request: fixed State bytes of one slot (window ring + tails + counters).
      page_bytes: Classical bytes of one page (all layers, all entry kinds).
      pages_total, pages_used, pages_free, pages_shared: page counts (shared = refcount > 1).
      allocated_bytes: pages_used * page_bytes.
      entry_bytes: bytes of the complete entries actually present in the used pages.
      state_bytes_total: State pool bytes for all slots.
    """

    classical_bytes_per_token: dict[str, float]
    state_bytes_per_request: int
    page_bytes: int
    pages_total: int
    pages_used: int
    pages_free: int
    pages_shared: int
    allocated_bytes: int
    entry_bytes: int
    state_bytes_total: int

    @property
    def allocation_overhead(self) -> float:
        """Allocated / needed bytes (1.0 = no waste; partial last pages make it larger)."""
        return self.allocated_bytes / self.entry_bytes if self.entry_bytes else float("nan")

    def format(self) -> str:
        per_tok = ", ".join(f"{k} {v:.1f} B" for k, v in self.classical_bytes_per_token.items())
        return "\n".join([
            f"Classical bytes/token: {per_tok}",
            f"State bytes/request:   {self.state_bytes_per_request:,} B",
            f"Pages: {self.pages_used} used, {self.pages_free} free, {self.pages_shared} shared "
            f"of {self.pages_total} ({self.page_bytes:,} B each)",
            f"Classical allocated:   {self.allocated_bytes:,} B for {self.entry_bytes:,} B of "
            f"entries (x{self.allocation_overhead:.3f})",
            f"State pool total:      {self.state_bytes_total:,} B",
        ])


def classical_bytes_per_token(model: AttentionConfig, entry_dtype: str) -> dict[str, float]:
    """Amortised Classical bytes per token, per layer kind (summed over its layers) + total."""
    per_token: dict[str, float] = {}
    for spec in compressor_specs(model):
        n = len(model.layers_of(spec.kind))
        if n:
            per_token[spec.kind.name] = per_token.get(spec.kind.name, 0.0) + (
                n * spec.width * itemsize(entry_dtype) / spec.ratio)
    per_token["total"] = sum(per_token.values())
    return per_token


def state_bytes_per_request(model: AttentionConfig, geometry: CacheConfig) -> int:
    """Fixed State bytes of one slot: window ring, compressor tails, length and status."""
    total = model.num_layers * model.window * model.head_dim * itemsize(geometry.window_dtype)
    for spec in compressor_specs(model):
        n = len(model.layers_of(spec.kind))
        total += 2 * n * spec.ring * spec.in_width * itemsize(geometry.tail_dtype)
    return total + 8


def memory_report(cache: Cache) -> MemoryReport:
    model, geo = cache.model, cache.geometry
    per_token = classical_bytes_per_token(model, geo.entry_dtype)
    page_bytes = int(per_token["total"] * geo.page_tokens)
    lengths = np.asarray(cache.state.lengths, dtype=np.int64)
    active = np.asarray(cache.state.status) != SlotStatus.FREE
    entry_bytes = 0
    for spec in cache.specs:
        n = len(model.layers_of(spec.kind))
        one = spec.width * itemsize(geo.entry_dtype)
        entry_bytes += int(n * one * np.sum((lengths // spec.ratio)[active]))
    refcount = np.asarray(cache.pages.refcount)
    used = int(np.sum(refcount > 0))
    return MemoryReport(
        classical_bytes_per_token=per_token,
        state_bytes_per_request=state_bytes_per_request(model, geo),
        page_bytes=page_bytes,
        pages_total=geo.num_pages,
        pages_used=used,
        pages_free=int(cache.pages.num_free),
        pages_shared=int(np.sum(refcount > 1)),
        allocated_bytes=used * page_bytes,
        entry_bytes=entry_bytes,
        state_bytes_total=int(sum(x.nbytes for x in jax.tree.leaves(cache.state))),
    )


def dense_cache_bytes_per_token(model: AttentionConfig, dtype: str = "float32") -> int:
    """Bytes per token of an uncompressed cache of the same layers (one K=V vector per layer)."""
    return model.num_layers * model.head_dim * itemsize(dtype)


__all__ = [
    "Cache", "ClassicalPool", "LayerKind", "MemoryReport", "SlotReport", "SlotStatus",
    "StatePool", "Tail", "classical_bytes_per_token", "dense_cache_bytes_per_token",
    "init_cache", "inspect_slots", "memory_report", "release_slot", "reset_slot",
    "state_bytes_per_request",
]
