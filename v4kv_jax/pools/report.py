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
from v4kv_jax.pools.cache41 import Cache41
from v4kv_jax.pools.layout import compressor_specs
from v4kv_jax.pools.layout import of as layout_of
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
from v4kv_jax.pools.tree import init_cache as tree_init_cache
from v4kv_jax.pools.tree import with_entries_unplaced as tree_with_entries_unplaced

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
    checks.alive("cache", cache)
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


def _in_device_memory(tree):
    """`tree` with every array held in host memory (C4 entries of `c4_tier="host"`) copied to
    device memory, where an eager gather with device indices can read it."""
    def move(x):
        kind = getattr(x.sharding, "memory_kind", None)
        return x if kind in (None, "device") else jax.device_put(
            x, x.sharding.with_memory_kind("device"))
    return jax.tree.map(move, tree)


def read_slot(cache: Cache, slot: int) -> SlotContents:
    """What one slot holds, by entry index and position (for inspection and tests; C4
    entries held in host memory are copied to the device to be read)."""
    checks.alive("cache", cache)
    S = cache.geometry.max_slots
    slot = checks.slot(slot, S)
    n = int(cache.state.lengths[slot])
    W = cache.attn_config.window
    positions = np.arange(max(0, n - W), n)
    window = np.asarray(codec(cache, "window").decode(window_ring(cache)[:, slot].records()))
    window = window[:, positions % W]
    table = np.asarray(cache.pages.page_table[slot])
    by_kind, tail_kv, tail_gate, tail_start, online = {}, {}, {}, {}, {}
    for spec in cache.specs:
        epp = cache.geometry.entries_per_page(spec.ratio)
        idx = np.arange(n // spec.ratio)
        pool = _in_device_memory(entries(cache, spec))
        layers = jnp.arange(pool.lead[0])[:, None]
        rows = pool.take((layers, jnp.asarray(table[idx // epp])[None]),
                         jnp.asarray(idx % epp)[None])
        by_kind[spec.name] = np.asarray(codec(cache, spec.name).decode_unrotated(rows))
        ring = tail(cache, spec)
        tail_rows = cache.layout.tail_rows[spec.name]
        if online_tail(cache.geometry, spec):
            first = n // spec.ratio * spec.ratio
            held = slice(0, 1 if first < n else 0)
            online[spec.name] = {
                field: np.asarray(tail_rows.decode(getattr(ring, field)[:, slot].records()))
                [:, held] for field in ("max", "sum", "weighted")}
        else:
            first = max(0, (n // spec.ratio - (1 if spec.overlap else 0)) * spec.ratio)
            rows = np.arange(first, n) % spec.ring
            tail_kv[spec.name] = np.asarray(tail_rows.decode(ring.kv[:, slot].records()))[:, rows]
            tail_gate[spec.name] = np.asarray(
                tail_rows.decode(ring.gate[:, slot].records()))[:, rows]
        tail_start[spec.name] = first
    return SlotContents(n, window, by_kind, tail_kv, tail_gate, tail_start, online)


@dataclasses.dataclass(frozen=True)
class LaidOut:
    """The cache's arrays as a TPU compiler lays them out (`laid_out`): the compiler's own
    figures for a chip (XLA:TPU through libtpu, nothing allocated or run).

    Attributes:
      target: the chip ("v5e", or a topology name).
      argument_bytes: the cache's bytes in the chip's HBM (host-memory arrays apart), as
        the compiler lays them out (`memory_analysis().argument_size_in_bytes`, which
        leaves out host-memory arguments).
      host_bytes: the bytes of the arrays in host memory (c4_tier="host").
      stored_bytes: the same arrays' own bytes (every plane's elements), device part.
      not_row_major: the arrays whose default layout on the chip is not row-major (a
        program that hands them to a Pallas kernel would copy them), by pytree path; the
        lane-dense pools have none (a small page table may have one: only XLA reads it).
      error: the compiler's refusal (the cache does not fit the chip's HBM), with
        argument_bytes 0, or None.
    """

    target: str
    argument_bytes: int
    host_bytes: int
    stored_bytes: int
    not_row_major: tuple[str, ...]
    error: str | None = None

    @property
    def padding(self) -> float:
        """Laid-out over stored bytes on the device (1.0: the chip pads nothing)."""
        return self.argument_bytes / self.stored_bytes if self.stored_bytes else 1.0


def _row_major(fmt) -> bool:
    layout = getattr(fmt, "layout", fmt)
    order = tuple(getattr(layout, "major_to_minor", ()))
    return order == tuple(range(len(order)))


def laid_out(model: AttentionConfig, geometry: CacheConfig, target: str = "v5e") -> LaidOut:
    """The arrays of a cache of `geometry` as the TPU compiler lays them out on one chip of
    `target` (a generation of `targets.GENERATIONS`, or a topology name such as "v6e:1x1"):
    a program that takes the cache is compiled for that chip (nothing is allocated; libtpu
    needed, `pip install "jax[tpu]"`)."""
    fixed = layout_of(model, geometry)

    def place(shapes):
        for spec in fixed.specs:
            if spec.name in fixed.host:  # placed in the chip's host memory, as on a TPU host
                on_host_memory = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
                    x.shape, x.dtype, sharding=x.sharding.with_memory_kind("pinned_host")),
                    entries(shapes, spec))
                shapes = tree_with_entries_unplaced(shapes, spec, on_host_memory)
        return shapes

    return laid_out_of(lambda: tree_init_cache(model, geometry), target, place)


def laid_out_of(init, target: str = "v5e", place=None) -> LaidOut:
    """`laid_out` of the cache `init()` returns (either family's; nothing is allocated):
    `place` maps its abstract arrays on the chip to those moved to its host memory."""
    from v4kv_jax import programs, targets

    topology = targets.GENERATIONS.get(target, target)
    device = targets.tpu_devices(topology)[0]
    shapes = targets.abstract(jax.eval_shape(init), device)
    if place is not None:
        shapes = place(shapes)
    device_bytes, host = _bytes_by_memory(shapes)
    # A program that takes the cache and reads one element of each device array: the
    # arguments are laid out as any program's are, and it needs no memory of its own.
    read = [len(x.shape) > 0 and not _in_host_memory(x) for x in jax.tree.leaves(shapes)]

    def touch(cache):
        return [x[(0,) * x.ndim] for x, r in zip(jax.tree.leaves(cache), read, strict=True)
                if r]

    try:
        program = programs.program("laid_out", touch, register=False, keep_unused=True)
        compiled = program.trace(shapes).lower().compile()
    except jax.errors.JaxRuntimeError as e:  # the compiler's verdict: it does not fit
        return LaidOut(target, 0, host, device_bytes, (), str(e).split("\n")[0])
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(shapes)]
    formats = jax.tree.leaves(compiled.input_formats[0][0])
    leaves = jax.tree.leaves(shapes)
    bad = tuple(path for path, fmt, x in zip(paths, formats, leaves, strict=True)
                if len(x.shape) > 1 and not _row_major(fmt))
    # The compiler's argument bytes are the device's (host-memory arguments apart).
    return LaidOut(target, int(compiled.memory_analysis().argument_size_in_bytes), host,
                   device_bytes, bad)


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Bytes of the cache, separated the way the two pools differ. "Stored" bytes are the
    pools' arrays as they are (`pools.lanes`: rows in lane-dense planes, the bytes a device
    holds, padding included); "logical" bytes are the rows' own bytes (`storage`).

    Attributes:
      classical_bytes_per_token: amortised logical Classical bytes one token costs, per
        layer kind (summed over the layers of that kind) and "total".
      stored_bytes_per_token: the same as stored.
      state_bytes_per_request: fixed State bytes of one slot, as stored (window ring +
        tails + counters); state_logical_bytes_per_request the rows' own.
      page_bytes: Classical bytes of one page as stored (all layers, all entry kinds);
        page_logical_bytes the rows' own.
      pages_total, pages_used, pages_free, pages_shared: page counts (shared = refcount > 1).
        The pool's arrays hold all pages_total pages from the start (`capacity_bytes`); a
        page is in use from when a request or the prefix index takes it off the free stack.
      allocated_bytes: pages_used * page_bytes, the bytes of the pages in use (not the
        pool's capacity).
      entry_bytes: logical bytes of the complete entries present in the used pages, each
        page counted once however many requests share it.
      state_bytes_total: State pool bytes for all slots (its capacity: every slot's State
        is held from the start).
      device_bytes_per_token: the part of stored_bytes_per_token["total"] that lives on the
        device (all of it, but the C4 entries with c4_tier="host").
      device_bytes, host_bytes: {"classical", "state"} bytes of each pool's arrays in device
        and in host memory (c4_tier="host": the C4 entries on the host).
      slots_total, slots_used: the slots of the State pool (max_slots) and those a request
        holds.
      request_tokens_max: the longest request a slot takes (max_pages_per_seq * P tokens).
      host_bytes_per_request: the host memory one request of request_tokens_max tokens fills
        (its C4 entries with c4_tier="host"; 0 otherwise): the slots_total requests the
        cache admits need slots_total times as much (`host_bytes_for_slots`), unless they
        share pages.
      laid_out: with a target chip (`memory_report(cache, target=...)`), the compiler's
        figures for the cache on it (`LaidOut`), else None.
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
    stored_bytes_per_token: dict[str, float] = dataclasses.field(default_factory=dict)
    page_logical_bytes: int = 0
    state_logical_bytes_per_request: int = 0
    laid_out: LaidOut | None = None

    @property
    def allocation_overhead(self) -> float:
        """In-use / needed bytes (1.0 = no waste; lane padding and partial last pages make
        it larger)."""
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
        stored = self.stored_bytes_per_token.get("total", 0.0)
        logical = self.classical_bytes_per_token.get("total", 0.0)
        if self.entry_bytes:
            waste = (", lane padding and partly filled last pages"
                     if self.allocated_bytes > self.entry_bytes else "")
            held = (f"holding {self.entry_bytes:,} B of entries "
                    f"(x{self.allocation_overhead:.3f}{waste})")
        else:
            held = "holding no complete entry yet"
        lines = [
            f"Classical bytes/token: {per_tok}; as stored {stored:.1f} B "
            f"(x{stored / logical if logical else 1.0:.3f})",
            f"State bytes/request:   {self.state_bytes_per_request:,} B as stored "
            f"({self.state_logical_bytes_per_request:,} B of rows)",
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
        if self.laid_out is not None:
            lines.append(format_laid_out(self.laid_out))
        return "\n".join(lines)


def format_laid_out(lo: LaidOut) -> str:
    """One line: the compiler's figures for the cache on a chip."""
    if lo.error is not None:
        return (f"On a {lo.target} chip:        does not fit ({lo.stored_bytes:,} B of "
                f"cache): {lo.error}")
    layouts = ("every array row-major (no copy into a kernel)" if not lo.not_row_major
               else f"not row-major: {', '.join(lo.not_row_major)}")
    return (f"On a {lo.target} chip:        {lo.argument_bytes:,} B in HBM as the TPU compiler "
            f"lays it out (x{lo.padding:.3f} of the stored bytes); {layouts}")


def total_report(reports: list[MemoryReport]) -> MemoryReport:
    """The report of several caches of one geometry together (the shards of a mesh): counts
    and bytes summed, per-token and per-page figures as they are."""
    first = reports[0]
    total = {f: sum(getattr(r, f) for r in reports) for f in (
        "pages_total", "pages_used", "pages_free", "pages_shared", "allocated_bytes",
        "entry_bytes", "state_bytes_total", "slots_total", "slots_used")}
    kinds = {f: {k: sum(getattr(r, f)[k] for r in reports) for k in getattr(first, f)}
             for f in ("device_bytes", "host_bytes")}
    return dataclasses.replace(first, **total, **kinds, laid_out=None)


def _entry_rows(model: AttentionConfig, geometry: CacheConfig):
    """(spec, layers of its kind, logical bytes of one entry, stored bytes of one page of one
    layer) per compressor with layers."""
    fixed = layout_of(model, geometry)
    for spec in fixed.specs:
        n = len(fixed.layers[spec.kind])
        if n:
            yield spec, n, fixed.rows[spec.name].row_bytes, fixed.lanes[spec.name].block_bytes


def classical_bytes_per_token(model: AttentionConfig, geometry: CacheConfig
                              ) -> dict[str, float]:
    """Amortised logical Classical bytes per token in the geometry's formats, per layer kind
    (summed over its layers) + total: sum of entry bytes / ratio (V4-Flash in the release
    formats: CSA 21 x (584 + 68) / 4 = 3423, HCA 20 x 584 / 128 = 91.25, total 3514.25)."""
    per_token: dict[str, float] = {}
    for spec, n, one, _ in _entry_rows(model, geometry):
        per_token[spec.kind.name] = per_token.get(spec.kind.name, 0.0) + n * one / spec.ratio
    per_token["total"] = sum(per_token.values())
    return per_token


def stored_bytes_per_token(model: AttentionConfig, geometry: CacheConfig) -> dict[str, float]:
    """Amortised Classical bytes per token as stored (`pools.lanes`: a page's planes over its
    P tokens), per layer kind and total (V4-Flash, release formats, pages of 128: CSA
    21 x (592 + 80) / 4 = 3528, HCA 20 x 1024 / 128 = 160, total 3688: x1.049 of the
    logical 3514.25)."""
    per_token: dict[str, float] = {}
    for spec, n, _, block in _entry_rows(model, geometry):
        per_token[spec.kind.name] = (per_token.get(spec.kind.name, 0.0)
                                     + n * block / geometry.page_tokens)
    per_token["total"] = sum(per_token.values())
    return per_token


def device_bytes_per_token(model: AttentionConfig, geometry: CacheConfig) -> float:
    """The amortised Classical bytes per token as stored that live on the device: the total,
    less the C4 entries when they live on the host."""
    return sum(n * block / geometry.page_tokens for spec, n, _, block in
               _entry_rows(model, geometry) if not on_host(geometry, spec))


def _in_host_memory(x) -> bool:
    sharding = getattr(x, "sharding", None)
    return getattr(sharding, "memory_kind", None) in ("pinned_host", "unpinned_host")


def _bytes_by_memory(tree) -> tuple[int, int]:
    """(device bytes, host bytes) of a pytree's arrays (or shape structs)."""
    device = host = 0
    for x in jax.tree.leaves(tree):
        nbytes = int(np.prod(x.shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize
        if _in_host_memory(x):
            host += nbytes
        else:
            device += nbytes
    return device, host


def host_bytes_per_request(model: AttentionConfig, geometry: CacheConfig) -> int:
    """The host memory one request of max_seq_len tokens fills, as stored: its C4 entries'
    pages with c4_tier="host", 0 with every entry on the device."""
    return sum(n * block * geometry.max_pages_per_seq
               for spec, n, _, block in _entry_rows(model, geometry) if on_host(geometry, spec))


def page_bytes(model: AttentionConfig, geometry: CacheConfig) -> int:
    """Classical bytes of one page as stored: every layer's entries of P tokens."""
    return sum(n * block for _, n, _, block in _entry_rows(model, geometry))


def page_logical_bytes(model: AttentionConfig, geometry: CacheConfig) -> int:
    """The rows' own bytes of one page: every layer's P // m entries of each kind."""
    return sum(n * one * geometry.entries_per_page(spec.ratio)
               for spec, n, one, _ in _entry_rows(model, geometry))


def state_bytes_per_request(model: AttentionConfig, geometry: CacheConfig) -> int:
    """Fixed State bytes of one slot as stored: window ring, compressor tails (rings, or
    online accumulators of 3 x head_dim per HCA layer), the CSA layers' hot sets, length and
    status (`pools.lanes`: each block's planes)."""
    fixed = layout_of(model, geometry)
    total = model.num_layers * fixed.lanes["window"].block_bytes
    for spec in fixed.specs:
        n = len(fixed.layers[spec.kind])
        per = 3 if spec.name in fixed.online else 2
        total += per * n * fixed.lanes[f"tail:{spec.name}"].block_bytes
    if "hot" in fixed.lanes:
        total += model.num_csa * (fixed.lanes["hot"].block_bytes
                                  + 2 * fixed.lanes["hot_ids"].block_bytes)
    return total + 8


def state_logical_bytes_per_request(model: AttentionConfig, geometry: CacheConfig) -> int:
    """The rows' own bytes of one slot's State (as `state_bytes_per_request`, no padding)."""
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


def memory_report(cache: Cache | Cache41, target: str | None = None) -> MemoryReport:
    """The cache's `MemoryReport`; with `target` (a TPU generation such as "v5e", or a
    topology name) also the compiler's figures for the cache on one chip of it
    (`laid_out`). A `Cache41`'s: `report41.memory_report41`."""
    if isinstance(cache, Cache41):
        from v4kv_jax.pools.report41 import memory_report41

        return memory_report41(cache, target)
    checks.alive("cache", cache)
    model, geo = cache.attn_config, cache.geometry
    tokens = page_tokens_held(cache)
    entry_bytes = sum(int(n * one * np.sum(tokens // spec.ratio))
                      for spec, n, one, _ in _entry_rows(model, geo))
    one_page = page_bytes(model, geo)
    return MemoryReport(
        classical_bytes_per_token=classical_bytes_per_token(model, geo),
        state_bytes_per_request=state_bytes_per_request(model, geo),
        page_bytes=one_page,
        entry_bytes=entry_bytes,
        device_bytes_per_token=device_bytes_per_token(model, geo),
        host_bytes_per_request=host_bytes_per_request(model, geo),
        stored_bytes_per_token=stored_bytes_per_token(model, geo),
        page_logical_bytes=page_logical_bytes(model, geo),
        state_logical_bytes_per_request=state_logical_bytes_per_request(model, geo),
        laid_out=None if target is None else laid_out(model, geo, target),
        **pool_counts(cache, one_page),
    )


def page_tokens_held(cache) -> np.ndarray:
    """int64[num_pages]: the tokens each page in use holds (a `Cache`'s or a `Cache41`'s),
    each page once however many requests share it; a page in no live page-table row is a
    full page held outside them (e.g. by a prefix index); a free page 0."""
    P, pages = cache.geometry.page_tokens, cache.geometry.num_pages
    lengths = np.asarray(cache.state.lengths, dtype=np.int64)
    active = np.asarray(cache.state.status) != SlotStatus.FREE
    refcount = np.asarray(cache.pages.refcount)
    held = np.where(refcount > 0, P, 0).astype(np.int64)
    in_rows = np.zeros(pages, np.int64)
    table = np.asarray(cache.pages.page_table)
    for s in np.nonzero(active)[0]:
        for j, page in enumerate(table[s]):
            if page >= 0:
                in_rows[page] = max(in_rows[page], min(max(lengths[s] - j * P, 0), P))
    listed = np.zeros(pages, bool)
    listed[table[active][table[active] >= 0]] = True
    return np.where(listed, in_rows, held)


def pool_counts(cache, page_bytes: int) -> dict:
    """The `MemoryReport` fields counted from a live cache (a `Cache`'s or a `Cache41`'s):
    pages, slots, the bytes in use and of each pool's arrays by memory."""
    geo = cache.geometry
    refcount = np.asarray(cache.pages.refcount)
    used = int(np.sum(refcount > 0))
    classical, state = _bytes_by_memory(cache.classical), _bytes_by_memory(cache.state)
    return dict(
        pages_total=geo.num_pages, pages_used=used, pages_free=int(cache.pages.num_free),
        pages_shared=int(np.sum(refcount > 1)), allocated_bytes=used * page_bytes,
        state_bytes_total=int(sum(x.nbytes for x in jax.tree.leaves(cache.state))),
        device_bytes=dict(zip(("classical", "state"), (classical[0], state[0]), strict=True)),
        host_bytes=dict(zip(("classical", "state"), (classical[1], state[1]), strict=True)),
        slots_total=geo.max_slots,
        slots_used=int(np.sum(np.asarray(cache.state.status) != SlotStatus.FREE)),
        request_tokens_max=geo.max_seq_len)


def dense_cache_bytes_per_token(model: AttentionConfig, dtype: str = "float32") -> int:
    """Bytes per token of an uncompressed cache of the same layers (one K=V vector per layer)
    with rows in format `dtype` (a float format or "fp8_latent")."""
    rope = model.rope_dim if dtype == "fp8_latent" else 0
    return model.num_layers * storage.row_bytes(model.head_dim, dtype, rope)


__all__ = ["LaidOut", "MemoryReport", "SlotContents", "SlotReport",
           "classical_bytes_per_token", "dense_cache_bytes_per_token", "device_bytes_per_token",
           "format_laid_out", "host_bytes_per_request", "inspect_slots", "is_deleted",
           "laid_out", "memory_report", "page_bytes", "page_logical_bytes", "read_slot",
           "state_bytes_per_request", "state_logical_bytes_per_request",
           "stored_bytes_per_token", "total_report"]
