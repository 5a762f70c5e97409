"""Inspection (host side): slots, a slot's decoded contents, bytes per token and per request,
the memory report."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from v4kv_jax import checks
from v4kv_jax.config import AttentionConfig, CacheConfig
from v4kv_jax.pools import storage
from v4kv_jax.pools.layout import compressor_specs
from v4kv_jax.pools.tree import (
    Cache,
    SlotStatus,
    codec,
    entries,
    on_host,
    online_tail,
    tail,
    window_ring,
)

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


def is_deleted(cache: Cache) -> bool:
    """True when an array of the cache was deleted: donated to a jitted program that failed
    after taking it over, so the cache is gone (host code that donates checks this)."""
    return any(x.is_deleted() for x in jax.tree.leaves(cache))


def inspect_slots(cache: Cache) -> list[SlotReport]:
    """What each non-free slot holds, derived from its length and page-table row."""
    model = cache.attn_config
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
class SlotContents:
    """One request's data in logical order (host numpy arrays, decoded to fp32 from whatever
    format they are stored in), independent of which pages and ring rows hold it.

    Attributes:
      length: tokens appended.
      window: [n_layers, min(length, W), hd], the window rows of positions
        length - min(length, W) .. length - 1, oldest first.
      entries: compressor name -> [n_kind_layers, length // m, width], entry i of every layer
        of that kind ("csa": C4 entries, "csa_index": indexer keys, "hca": C128 entries).
        fp4_index keys are given unrotated (the stored rotation undone).
      tail_kv, tail_gate: ring compressor name -> [n_kind_layers, rows, in_width], the tail
        rows still needed, oldest first (gate with the position bias added): the open block,
        and with overlap (CSA) the complete block before it.
      online: online compressor name ("hca" with hca_tail="online") -> {"max", "sum",
        "weighted"} of [n_kind_layers, rows, width]: rows is 1 while the open block holds
        tokens, 0 when it is empty (`OnlineTail`).
      tail_start: compressor name -> the position of the first tail token.
    """

    length: int
    window: np.ndarray
    entries: dict[str, np.ndarray]
    tail_kv: dict[str, np.ndarray]
    tail_gate: dict[str, np.ndarray]
    tail_start: dict[str, int]
    online: dict[str, dict[str, np.ndarray]] = dataclasses.field(default_factory=dict)


def read_slot(cache: Cache, slot: int) -> SlotContents:
    """What one slot holds, by entry index and position (for inspection and tests)."""
    S = cache.geometry.max_slots
    slot = checks.slot(slot, S)
    n = int(cache.state.lengths[slot])
    W = cache.attn_config.window
    positions = np.arange(max(0, n - W), n)
    window = np.asarray(codec(cache, "window").decode(window_ring(cache)[:, slot]))
    window = window[:, positions % W]
    table = np.asarray(cache.pages.page_table[slot])
    by_kind, tail_kv, tail_gate, tail_start, online = {}, {}, {}, {}, {}
    for spec in cache.specs:
        epp = cache.geometry.entries_per_page(spec.ratio)
        idx = np.arange(n // spec.ratio)
        pool = entries(cache, spec)
        rows = pool[:, jnp.asarray(table[idx // epp]), jnp.asarray(idx % epp)]
        by_kind[spec.name] = np.asarray(codec(cache, spec.name).decode_unrotated(rows))
        ring = tail(cache, spec)
        if online_tail(cache.geometry, spec):
            first = n // spec.ratio * spec.ratio
            held = slice(0, 1 if first < n else 0)
            online[spec.name] = {
                field: np.asarray(storage.decode(getattr(ring, field)[:, slot]))[:, None][:, held]
                for field in ("max", "sum", "weighted")}
        else:
            first = max(0, (n // spec.ratio - (1 if spec.overlap else 0)) * spec.ratio)
            rows = np.arange(first, n) % spec.ring
            tail_kv[spec.name] = np.asarray(storage.decode(ring.kv[:, slot]))[:, rows]
            tail_gate[spec.name] = np.asarray(storage.decode(ring.gate[:, slot]))[:, rows]
        tail_start[spec.name] = first
    return SlotContents(n, window, by_kind, tail_kv, tail_gate, tail_start, online)


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Bytes of the cache, separated the way the two pools differ.

    Attributes:
      classical_bytes_per_token: amortised Classical bytes one token costs, per layer kind
        (summed over the layers of that kind) and "total".
      state_bytes_per_request: fixed State bytes of one slot (window ring + tails + counters).
      page_bytes: Classical bytes of one page (all layers, all entry kinds).
      pages_total, pages_used, pages_free, pages_shared: page counts (shared = refcount > 1).
        The pool's arrays hold all pages_total pages from the start (`capacity_bytes`); a
        page is in use from when a request or the prefix index takes it off the free stack.
      allocated_bytes: pages_used * page_bytes, the bytes of the pages in use (not the
        pool's capacity).
      entry_bytes: bytes of the complete entries present in the used pages, each page
        counted once however many requests share it.
      state_bytes_total: State pool bytes for all slots (its capacity: every slot's State
        is held from the start).
      device_bytes_per_token: the part of classical_bytes_per_token["total"] that lives on
        the device (all of it, but the C4 entries with c4_tier="host").
      device_bytes, host_bytes: {"classical", "state"} bytes of each pool's arrays in device
        and in host memory (c4_tier="host": the C4 entries on the host).
      slots_total, slots_used: the slots of the State pool (max_slots) and those a request
        holds.
      request_tokens_max: the longest request a slot takes (max_pages_per_seq * P tokens).
      host_bytes_per_request: the host memory one request of request_tokens_max tokens fills
        (its C4 entries with c4_tier="host"; 0 otherwise): the slots_total requests the
        cache admits need slots_total times as much (`host_bytes_for_slots`), unless they
        share pages.
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
    device_bytes_per_token: float
    device_bytes: dict[str, int]
    host_bytes: dict[str, int]
    slots_total: int
    slots_used: int
    request_tokens_max: int
    host_bytes_per_request: int

    @property
    def allocation_overhead(self) -> float:
        """In-use / needed bytes (1.0 = no waste; partial last pages make it larger)."""
        return self.allocated_bytes / self.entry_bytes if self.entry_bytes else float("nan")

    @property
    def capacity_bytes(self) -> int:
        """The Classical pool's bytes: all pages_total pages, in use or free."""
        return self.pages_total * self.page_bytes

    @property
    def host_bytes_for_slots(self) -> int:
        """The host memory that slots_total requests of request_tokens_max tokens fill with
        their C4 entries when they share no page (c4_tier="host"; 0 otherwise)."""
        return self.slots_total * self.host_bytes_per_request

    def format(self) -> str:
        per_tok = ", ".join(f"{k} {v:.1f} B" for k, v in self.classical_bytes_per_token.items())
        if self.entry_bytes:
            waste = ", partly filled last pages" if self.allocated_bytes > self.entry_bytes else ""
            held = (f"holding {self.entry_bytes:,} B of entries "
                    f"(x{self.allocation_overhead:.3f}{waste})")
        else:
            held = "holding no complete entry yet"
        lines = [
            f"Classical bytes/token: {per_tok}",
            f"State bytes/request:   {self.state_bytes_per_request:,} B",
            f"Classical capacity:    {self.capacity_bytes:,} B, {self.pages_total} pages of "
            f"{self.page_bytes:,} B",
            f"Classical in use:      {self.pages_used} pages = {self.allocated_bytes:,} B "
            f"{held}; {self.pages_free} free, {self.pages_shared} shared",
            f"State capacity:        {self.state_bytes_total:,} B, {self.slots_total} slots "
            f"({self.slots_used} in use)",
        ]
        if self.host_bytes["classical"]:
            lines.append(
                f"Host capacity:         {self.host_bytes['classical']:,} B, the C4 entries of "
                f"all {self.pages_total} pages (device Classical "
                f"{self.device_bytes['classical']:,} B, {self.device_bytes_per_token:.1f} "
                "B/token)")
        if self.host_bytes_per_request:
            lines.append(
                f"Host need:             {self.slots_total} requests of up to "
                f"{self.request_tokens_max:,} tokens: {self.slots_total} x "
                f"{self.host_bytes_per_request:,} B = {self.host_bytes_for_slots:,} B of C4 "
                "entries (every slot at full length, no page shared)")
        return "\n".join(lines)


def total_report(reports: list[MemoryReport]) -> MemoryReport:
    """The report of several caches of one geometry together (the shards of a mesh): counts
    and bytes summed, per-token and per-page figures as they are."""
    first = reports[0]
    total = {f: sum(getattr(r, f) for r in reports) for f in (
        "pages_total", "pages_used", "pages_free", "pages_shared", "allocated_bytes",
        "entry_bytes", "state_bytes_total", "slots_total", "slots_used")}
    kinds = {f: {k: sum(getattr(r, f)[k] for r in reports) for k in getattr(first, f)}
             for f in ("device_bytes", "host_bytes")}
    return dataclasses.replace(first, **total, **kinds)


def _entry_rows(model: AttentionConfig, geometry: CacheConfig):
    """(spec, layers of its kind, stored bytes of one entry) per compressor with layers."""
    for spec in compressor_specs(model):
        n = len(model.layers_of(spec.kind))
        if n:
            yield spec, n, storage.codec(model, geometry, spec.name).row_bytes


def classical_bytes_per_token(model: AttentionConfig, geometry: CacheConfig
                              ) -> dict[str, float]:
    """Amortised Classical bytes per token in the geometry's formats, per layer kind (summed
    over its layers) + total: sum of entry bytes / ratio (V4-Flash in the release formats:
    CSA 21 x (584 + 68) / 4 = 3423, HCA 20 x 584 / 128 = 91.25, total 3514.25)."""
    per_token: dict[str, float] = {}
    for spec, n, one in _entry_rows(model, geometry):
        per_token[spec.kind.name] = per_token.get(spec.kind.name, 0.0) + n * one / spec.ratio
    per_token["total"] = sum(per_token.values())
    return per_token


def device_bytes_per_token(model: AttentionConfig, geometry: CacheConfig) -> float:
    """The amortised Classical bytes per token that live on the device: the total, less the
    C4 entries when they live on the host (V4-Flash release formats, c4_tier="host":
    3514.25 - 21 x 584 / 4 = 448.25)."""
    return sum(n * one / spec.ratio for spec, n, one in _entry_rows(model, geometry)
               if not on_host(geometry, spec))


def _bytes_by_memory(tree) -> tuple[int, int]:
    """(device bytes, host bytes) of a pytree's arrays."""
    device = host = 0
    for x in jax.tree.leaves(tree):
        if getattr(x.sharding, "memory_kind", None) in ("pinned_host", "unpinned_host"):
            host += x.nbytes
        else:
            device += x.nbytes
    return device, host


def host_bytes_per_request(model: AttentionConfig, geometry: CacheConfig) -> int:
    """The host memory one request of max_seq_len tokens fills: its C4 entries with
    c4_tier="host" (V4-Flash release formats, 1M tokens: 21 x 584 x 262,144 B = 3,066 MiB),
    0 with every entry on the device."""
    return sum(n * one * (geometry.max_seq_len // spec.ratio)
               for spec, n, one in _entry_rows(model, geometry) if on_host(geometry, spec))


def page_bytes(model: AttentionConfig, geometry: CacheConfig) -> int:
    """Classical bytes of one page: every layer's entries of P tokens, in the stored formats."""
    return sum(n * one * geometry.entries_per_page(spec.ratio)
               for spec, n, one in _entry_rows(model, geometry))


def state_bytes_per_request(model: AttentionConfig, geometry: CacheConfig) -> int:
    """Fixed State bytes of one slot: window ring, compressor tails (rings, or online
    accumulators of 3 x head_dim per HCA layer), the CSA layers' hot sets (hot_rows rows of
    a C4 entry and two i32 each), length and status."""
    window = storage.codec(model, geometry, "window")
    total = model.num_layers * model.window * window.row_bytes
    for spec in compressor_specs(model):
        n = len(model.layers_of(spec.kind))
        if online_tail(geometry, spec):
            total += 3 * n * storage.tail_codec(geometry, spec.width).row_bytes
        else:
            total += 2 * n * spec.ring * storage.tail_codec(geometry, spec.in_width).row_bytes
    if geometry.hot_set_rows(model):
        c4_row = storage.codec(model, geometry, "csa").row_bytes
        total += model.num_csa * geometry.hot_set_rows(model) * (c4_row + 8)
    return total + 8


def memory_report(cache: Cache) -> MemoryReport:
    model, geo = cache.attn_config, cache.geometry
    P = geo.page_tokens
    lengths = np.asarray(cache.state.lengths, dtype=np.int64)
    active = np.asarray(cache.state.status) != SlotStatus.FREE
    refcount = np.asarray(cache.pages.refcount)
    # Tokens each used page holds, each page once however many requests share it: a page in
    # no live page-table row is a full page held outside them (e.g. by a prefix index).
    held = np.where(refcount > 0, P, 0).astype(np.int64)
    in_rows = np.zeros(geo.num_pages, np.int64)
    table = np.asarray(cache.pages.page_table)
    for s in np.nonzero(active)[0]:
        for j, page in enumerate(table[s]):
            if page >= 0:
                in_rows[page] = max(in_rows[page], min(max(lengths[s] - j * P, 0), P))
    listed = np.zeros(geo.num_pages, bool)
    listed[table[active][table[active] >= 0]] = True
    tokens = np.where(listed, in_rows, held)
    entry_bytes = sum(int(n * one * np.sum(tokens // spec.ratio))
                      for spec, n, one in _entry_rows(model, geo))
    one_page = page_bytes(model, geo)
    used = int(np.sum(refcount > 0))
    classical, state = _bytes_by_memory(cache.classical), _bytes_by_memory(cache.state)
    return MemoryReport(
        classical_bytes_per_token=classical_bytes_per_token(model, geo),
        state_bytes_per_request=state_bytes_per_request(model, geo),
        page_bytes=one_page,
        pages_total=geo.num_pages,
        pages_used=used,
        pages_free=int(cache.pages.num_free),
        pages_shared=int(np.sum(refcount > 1)),
        allocated_bytes=used * one_page,
        entry_bytes=entry_bytes,
        state_bytes_total=int(sum(x.nbytes for x in jax.tree.leaves(cache.state))),
        device_bytes_per_token=device_bytes_per_token(model, geo),
        device_bytes=dict(zip(("classical", "state"), (classical[0], state[0]), strict=True)),
        host_bytes=dict(zip(("classical", "state"), (classical[1], state[1]), strict=True)),
        slots_total=geo.max_slots,
        slots_used=int(np.sum(active)),
        request_tokens_max=geo.max_seq_len,
        host_bytes_per_request=host_bytes_per_request(model, geo),
    )


def dense_cache_bytes_per_token(model: AttentionConfig, dtype: str = "float32") -> int:
    """Bytes per token of an uncompressed cache of the same layers (one K=V vector per layer)
    with rows in format `dtype` (a float format or "fp8_latent")."""
    rope = model.rope_dim if dtype == "fp8_latent" else 0
    return model.num_layers * storage.row_bytes(model.head_dim, dtype, rope)


__all__ = ["MemoryReport", "SlotContents", "SlotReport", "classical_bytes_per_token",
           "device_bytes_per_token", "host_bytes_per_request",
           "dense_cache_bytes_per_token", "inspect_slots", "is_deleted", "memory_report",
           "page_bytes", "read_slot", "state_bytes_per_request", "total_report"]
