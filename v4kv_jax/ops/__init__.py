"""The only door to an op: the read of a layer, and each op of the hot path as its jnp
reference or a Pallas kernel.

The read door: `read(kind, ...)` computes one layer's attention for a chunk of any length
(decode, T = 1, and prefill tiles alike), from arrays the caller hands it (`WindowKeys`,
`Stored`, `Queries`); it never sees a `Cache`. Per layer kind:

  CSA   indexer scores -> top-k -> `make_resident` (the one place where picked entries are
        brought where the read finds them; a no-op while every entry lives on the device)
        -> sparse read of the window and the picks
  HCA   dense read of the window and every visible C128 entry
  SWA   the window only (on a TPU the dense read's kernel over no entries)

The ops with a kernel:

  op                       reference (v4kv_jax)              kernels (pallas_kernels)
  emit_entries             compressor.emit_entries           compressor/{tpu,gpu}.py
  emit_entries_online      compressor.emit_entries_online    compressor/{tpu,gpu}.py
  index_scores             indexer.index_scores              indexer/{tpu,gpu}.py
  sparse_decode_attention  attention.sparse_decode_attention sparse_attention/{tpu,gpu}.py
  dense_decode_attention   attention.dense_decode_attention  dense_attention/{tpu,gpu}.py
  sparse_decode41          attention41.sparse_decode41       sparse_attention/{tpu,gpu}.py
                           (DeepSeek-V4.1's decode read; the GPU kernel reads float rows)

The kernels read one query per slot; a chunk of several queries runs the reference. Nothing
else in the library calls a kernel or chooses an implementation.

`Options` is the only switch: `implementation` ("reference", "pallas_tpu", "pallas_gpu" or
"auto"), `interpret` and per-op `block_sizes`. `choose` turns it into a `Choice` per op:
"auto" runs the reference on CPU; on TPU and GPU it runs, per op, the faster of the
reference and the kernel as measured on that platform (`measured.json`, where the H200 says
the reference for the three read ops, and the user's own rows, which `v4kv check` records
and which also say the reference where a kernel disagreed with it), else the platform's
kernel (logged once per op where no row backs it). Each kernel module says
which configs it runs (`supported(model, geometry)` returns why not, or None): "auto" then
falls back to the reference; a forced implementation raises, naming the reason. Forcing a
Pallas implementation on a backend that cannot run it raises `KernelUnavailableError`,
unless `Options.interpret`, which runs the kernel in Pallas interpret mode on any backend.
Kernels take what the reference takes (arrays as stored, RoPE frequencies, page tables) and
return what it returns; their own conventions stay inside their wrappers.

The choice is static (`Options` is hashable), so a jitted step traces once per option set
and never branches at run time.
"""

from __future__ import annotations

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
from flax import struct

from v4kv_jax import checks, pools, programs
from v4kv_jax.config import (
    IMPLEMENTATIONS,
    KERNEL_OPS,
    AttentionConfig,
    CacheConfig,
    LayerKind,
    Options,
)
from v4kv_jax.config import options_or_default as _options
from v4kv_jax.ops import attention, indexer
from v4kv_jax.ops import hot as hot_set
from v4kv_jax.ops.choice import (
    MEASURED_PATH,
    PLATFORMS,
    Choice,
    KernelUnavailableError,
    choices,
    choose,
    kernel_module,
    measured,
    resolve,
    supported,
    unchecked,
)
from v4kv_jax.ops.doors import (
    _layout,
    _window_decode_attention,
    dense_decode_attention,
    emit_entries,
    emit_entries_online,
    index_scores,
    index_topk,
    sparse_decode41,
    sparse_decode_attention,
)
from v4kv_jax.ops.writes import put_records
from v4kv_jax.pools.layout import CacheLayout
from v4kv_jax.vectors import Queries

# --- the read door -----------------------------------------------------------------------------


@struct.dataclass
class WindowKeys:
    """The window keys a chunk's queries read, as stored (`CacheConfig.window_dtype`).

    Attributes:
      ring: each row's window ring, `pools.Lanes` of blocks [B] (W rows of sw(hd), position
        p at row p % W), holding every position in [end - W, end) that is >= 0; or, with
        `layer` and `slots`, the window rings of the cache (blocks [n_layers, max_slots]),
        row b's ring being block (layer, slots[b]) (the decode kernels read it there: no
        copy of the rows' rings is gathered first).
      end: i32[B], the first position the ring does not hold.
      chunk: [B, T, sw(hd)] the rows of positions end .. end + T - 1 (a prefill chunk's own
        keys, encoded), or None: the ring holds every key the queries may see.
      layer: the global layer (i32[]) of the rings, with `slots` i32[B] (in range).
    """

    ring: pools.Lanes
    end: jax.Array
    chunk: jax.Array | None = None
    layer: jax.Array | None = None
    slots: jax.Array | None = None

    def records(self) -> jax.Array:
        """The rows' rings as rows [B, ring, sw]."""
        if self.layer is None:
            return self.ring.records()
        return self.ring.block_records((self.layer, self.slots))

    def ordered(self) -> jax.Array:
        """The rows' rings ordered by position, [B, W, sw]: row e holds position end - W + e
        (`attention.ordered_rings`)."""
        if self.layer is None:
            index = (jnp.arange(self.end.shape[0], dtype=jnp.int32),)
            return programs.platform_dependent(
                tpu=lambda: attention.ordered_window(self.records(), self.end),
                default=lambda: attention.ordered_rings(self.ring, index, self.end))
        return attention.ordered_rings(self.ring, (self.layer, self.slots), self.end)


@struct.dataclass
class Stored:
    """What a layer reads of the Classical pool, as stored.

    Attributes:
      layer: index of the layer in its kind's stack (may be traced).
      page_rows: i32[B, max_pages_per_seq], the rows' page-table rows (-1: no page).
      entries: the kind's entries of every layer (`pools.Lanes`: C4 blocks [n_csa,
        num_pages] for CSA, C128 [n_hca, num_pages] for HCA; None for SWA).
      index_keys: CSA only: the indexer keys (blocks [n_csa, num_pages]).
      hot: CSA only, with a hot set (`CacheConfig.hot_set_rows` > 0): the layer's hot sets
        of the rows (`pools.hot_rows`, blocks [B]); the sparse read reads only them.
        Required when the C4 entries live in host memory (c4_tier="host").
    """

    layer: jax.Array
    page_rows: jax.Array
    entries: pools.Lanes | None = None
    index_keys: pools.Lanes | None = None
    hot: pools.HotSet | None = None


def make_resident(geometry: CacheConfig, picks: jax.Array, q_pos: jax.Array, stored: Stored
                  ) -> tuple[jax.Array, Stored]:
    """The one place where a CSA layer's picked entries are made readable before the sparse
    read: (the ids the sparse read uses, the `Stored` it reads them from).

    Without a hot set both pass through unchanged. With one (`stored.hot`; from host memory
    when `geometry.c4_tier` is "host"), the picks
    i32[B, G, k] of G queries at positions q_pos i32[B, G] (at most hot_rows distinct) are
    copied into the rows' hot rows where not there yet (`hot.resident`), and the read gets
    the hot rows as its pool, the picks renamed to the rows holding them, and the new hot
    sets in `Stored.hot`. `read` returns the indexer's picks, never the renamed ids."""
    if stored.hot is None:
        return picks, stored
    rows, hot = hot_set.resident(picks, q_pos, stored.hot, stored.entries, stored.layer,
                                 stored.page_rows, host=geometry.c4_tier == "host")
    entries, page_rows = hot_set.as_pages(hot)
    return rows, stored.replace(layer=jnp.zeros((), jnp.int32), page_rows=page_rows,
                                entries=entries, hot=hot)


def read(kind: LayerKind, model: AttentionConfig, geometry: CacheConfig,
         options: Options | None, queries: Queries, *, q_pos: jax.Array, kv_end: jax.Array,
         window: WindowKeys, stored: Stored, layout: CacheLayout | None = None
         ) -> tuple[jax.Array, jax.Array | None]:
    """One layer's attention for a chunk of queries: the only read of a layer.

    Args:
      kind: the layer's kind (static).
      model, geometry, options: static configs.
      queries: `Queries` [B, T, ...] of the layer (CSA: index_q and index_weights too).
      q_pos: i32[B, T] query positions.
      kv_end: i32[B], tokens in the sequence including this chunk; keys at or past it are
        never read (padded queries stay finite).
      window: the window keys (`WindowKeys`).
      stored: the layer's stored entries (`Stored`).
      layout: what the configs fix (`cache.layout`; None: derived from them).

    Returns:
      (f32[B, T, H, hd] de-rotated, the CSA picks i32[B, T, k] or None, the rows' new hot
      sets (`pools.HotSet` [B, H, ...]) of a CSA layer with a hot set, else None). One query
      per row whose ring holds every key (decode) runs the kernels `options` choose; a
      longer chunk runs the reference, `options.query_tile` queries at a time.
    """
    options = _options(options)
    fixed = _layout(model, geometry, layout)
    _check_read(kind, model, geometry, queries, q_pos, kv_end, window, stored)
    if queries.q.shape[1] == 1 and window.chunk is None:
        return _read_decode(kind, model, geometry, options, fixed, queries, q_pos[:, 0],
                            kv_end, window, stored)
    return _read_tiles(kind, model, geometry, options, fixed, queries, q_pos, kv_end, window,
                       stored)


def _check_lanes(name: str, x, lead: tuple, records: int | None) -> None:
    """Raises naming `name` unless x is a `pools.Lanes` with leading dims `lead` (and
    `records` rows a block, unless None)."""
    if not isinstance(x, pools.Lanes):
        checks.fail(name, "a pools.Lanes (a stored array of the cache)", type(x).__name__,
                    TypeError)
    if x.lead != tuple(lead):
        checks.fail(name, f"blocks {list(lead)}", f"blocks {list(x.lead)}")
    if records is not None and x.map.records != records:
        checks.fail(name, f"blocks of {records} rows", f"blocks of {x.map.records} rows")


def _check_read(kind, model, geometry, queries, q_pos, kv_end, window, stored) -> None:
    """Static checks of `read`'s arguments (they run inside jit too), naming the argument."""
    if not isinstance(kind, LayerKind):
        checks.fail("kind", "a LayerKind", repr(kind), TypeError)
    if np.ndim(queries.q) != 4:
        checks.fail("queries.q", "an array [B, T, H, hd]", f"shape {np.shape(queries.q)}")
    batch, tokens = queries.q.shape[:2]
    checks.shape("q_pos", q_pos, (batch, tokens))
    checks.shape("kv_end", kv_end, (batch,))
    if window.layer is None:
        _check_lanes("window.ring", window.ring, (batch,), model.window)
    else:
        _check_lanes("window.ring", window.ring, (model.num_layers, geometry.max_slots),
                     model.window)
        checks.shape("window.slots", window.slots, (batch,))
    checks.shape("window.end", window.end, (batch,))
    if window.chunk is not None:
        checks.shape("window.chunk", window.chunk, (batch, tokens, window.ring.map.words))
    checks.shape("stored.page_rows", stored.page_rows, (batch, None))
    needed = {LayerKind.CSA: ("entries", "index_keys"), LayerKind.HCA: ("entries",),
              LayerKind.SWA: ()}[kind]
    for field in needed:
        if getattr(stored, field) is None:
            checks.fail(f"stored.{field}", f"the stored array of a {kind.name} layer", None)
    if kind == LayerKind.CSA and geometry.c4_tier == "host" and stored.hot is None:
        checks.fail("stored.hot", "the rows' hot sets: C4 entries in host memory are read "
                    "through them", None)
    if stored.hot is not None:
        if kind != LayerKind.CSA:
            checks.fail("stored.hot", f"None for a {kind.name} layer (hot sets are CSA's)",
                        "a HotSet")
        _check_lanes("stored.hot.rows", stored.hot.rows, (batch,), None)
        if stored.hot.rows.map.words != stored.entries.map.words:
            checks.fail("stored.hot.rows", f"rows of {stored.entries.map.words} words (the C4 "
                        "entries')", f"rows of {stored.hot.rows.map.words} words")
    if kind == LayerKind.CSA and (queries.index_q is None or queries.index_weights is None):
        checks.fail("queries.index_q / queries.index_weights", "the indexer queries of a CSA "
                    "layer", None)


def _read_decode(kind, model, geometry, options, fixed, queries, q_pos, kv_end, window,
                 stored):
    """One query per row: the ops with kernels. The rows' rings are handed to them as a
    ring of one layer whose slot b is row b."""
    if window.layer is None:  # the rows' rings as a ring stack of one layer
        ring, ring_layer, ring_slots = (window.ring[None], 0,
                                        jnp.arange(q_pos.shape[0], dtype=jnp.int32))
    else:
        ring, ring_layer, ring_slots = window.ring, window.layer, window.slots
    common = dict(q=queries.q[:, 0], sink=queries.sink, window=ring, window_layer=ring_layer,
                  slot_ids=ring_slots, q_pos=q_pos, kv_end=kv_end)
    if kind == LayerKind.SWA:
        out = _window_decode_attention(model, geometry, options, fixed, common, lambda: (
            _read_tiles(kind, model, geometry, options, fixed, queries, q_pos[:, None],
                        kv_end, window, stored)[0][:, 0]))
        return out[:, None], None, None
    if kind == LayerKind.HCA:
        out = dense_decode_attention(model, geometry, options, layout=fixed,
                                     c128=stored.entries,
                                     c128_layer=stored.layer, page_rows=stored.page_rows,
                                     **common)
        return out[:, None], None, None
    picks = index_topk(model, geometry, options, layout=fixed, index_keys=stored.index_keys,
                       layer=stored.layer, page_rows=stored.page_rows,
                       index_q=queries.index_q[:, 0], index_weights=queries.index_weights[:, 0],
                       q_pos=q_pos, kv_end=kv_end)
    rows, stored = make_resident(geometry, picks[:, None], q_pos[:, None], stored)
    out = sparse_decode_attention(model, geometry, options, layout=fixed, c4=stored.entries,
                                  c4_layer=stored.layer, page_rows=stored.page_rows,
                                  picks=rows[:, 0], **common)
    return out[:, None], picks[:, None], stored.hot


def _read_chunk(kind, model, geometry, options, fixed, queries, q_pos, kv_end, keys, base,
                stored):
    """The reference read of a chunk whose window keys are `keys` [B, K, sw] at positions
    base .. base + K - 1: (out, picks, hot rows). With a hot set, the CSA queries are made
    resident `hot.group_size` at a time, in position order, and read at once."""

    def attend(q, pos, picks, stored):
        return attention.attend(model, geometry, options, kind, layer=stored.layer,
                                entries=stored.entries, page_rows=stored.page_rows, q=q,
                                sink=queries.sink, q_pos=pos, kv_end=kv_end, window_keys=keys,
                                window_base=base, picks=picks,
                                one_query=queries.q.shape[1] == 1)

    if kind != LayerKind.CSA:
        return attend(queries.q, q_pos, None, stored), None, None
    picks = indexer.running_topk(model, geometry, options, layout=fixed,
                                 index_keys=stored.index_keys,
                                 layer=stored.layer, page_rows=stored.page_rows,
                                 index_q=indexer.prepare_index_query(geometry, queries.index_q),
                                 index_weights=queries.index_weights, q_pos=q_pos,
                                 kv_end=kv_end)
    if stored.hot is None:
        rows, stored = make_resident(geometry, picks, q_pos, stored)
        return attend(queries.q, q_pos, rows, stored), picks, None

    # Made resident `group_size` queries at a time, then read at once: the pool read's bits.
    entries, page_rows, ids, hot = hot_set.resident_chunk(
        picks, q_pos, kv_end, stored.hot, hot_set.group_size(model, geometry),
        lambda picked, pos, hot: make_resident(geometry, picked, pos, stored.replace(hot=hot)))
    read_from = stored.replace(layer=jnp.zeros((), jnp.int32), page_rows=page_rows,
                               entries=entries, hot=hot)
    return attend(queries.q, q_pos, ids, read_from), picks, hot


def _grouped(size: int, arrays, fills):
    """[B, T, ...] arrays as [T / size, B, size, ...] (T padded up with `fills`; None: the
    last value repeated)."""
    tokens = arrays[0].shape[1]
    n = -(-tokens // size)
    out = []
    for x, fill in zip(arrays, fills, strict=True):
        widths = [(0, 0), (0, n * size - tokens)] + [(0, 0)] * (x.ndim - 2)
        x = (jnp.pad(x, widths, mode="edge") if fill is None
             else jnp.pad(x, widths, constant_values=fill))
        out.append(x.reshape(x.shape[0], n, size, *x.shape[2:]).swapaxes(0, 1))
    return out


def _ungrouped(x: jax.Array, tokens: int) -> jax.Array:
    """`_grouped`'s inverse: [n, B, size, ...] -> [B, tokens, ...]."""
    return x.swapaxes(0, 1).reshape(x.shape[1], -1, *x.shape[3:])[:, :tokens]


def _read_tiles(kind, model, geometry, options, fixed, queries, q_pos, kv_end, window,
                stored):
    """A chunk of queries, `options.query_tile` at a time (bounds memory, not results): each
    tile reads the W keys before its first query and its own."""
    W = model.window
    keys = window.ordered()
    if window.chunk is not None:
        keys = jnp.concatenate([keys, window.chunk], axis=1)
    base = window.end - W
    tokens = queries.q.shape[1]
    tile = min(options.query_tile, tokens)
    n_tiles = -(-tokens // tile)
    if n_tiles == 1:
        return _read_chunk(kind, model, geometry, options, fixed, queries, q_pos, kv_end, keys,
                           base, stored)

    pad = n_tiles * tile - tokens
    keys = jnp.pad(keys, ((0, 0), (0, pad), (0, 0)))
    tiled_q = jax.tree.map(lambda x: _grouped(tile, [x], [0.0])[0], queries.replace(sink=None))
    (q_pos_t,) = _grouped(tile, [q_pos], [None])

    def one_tile(hot, args):
        i, q_tile, pos_tile = args
        tile_keys = jax.lax.dynamic_slice_in_dim(keys, i * tile, W + tile, axis=1)
        out, picks, hot = _read_chunk(kind, model, geometry, options, fixed,
                                      q_tile.replace(sink=queries.sink), pos_tile, kv_end,
                                      tile_keys, base + i * tile, stored.replace(hot=hot))
        return hot, (out, picks)

    hot, (out, picks) = jax.lax.scan(one_tile, stored.hot,
                                     (jnp.arange(n_tiles), tiled_q, q_pos_t))
    return (_ungrouped(out, tokens), None if picks is None else _ungrouped(picks, tokens),
            hot)


# Names this module had, and where their job is done now.
_MOVED = {
    "decode_attention": "ops.read (one layer's attention for any chunk, from arrays) or "
                        "v4kv_jax.decode_attention (a layer read from a Cache)",
    "selected": "ops.choose(op, model, geometry, options)",
    "gpu_support_problem": "ops.supported(op, 'pallas_gpu', model, geometry)",
}


def __getattr__(name: str):
    if name in _MOVED:
        raise AttributeError(f"v4kv_jax.ops.{name} was removed: use {_MOVED[name]}")
    raise AttributeError(f"module 'v4kv_jax.ops' has no attribute {name!r}")


__all__ = [
    "IMPLEMENTATIONS", "KERNEL_OPS", "MEASURED_PATH", "PLATFORMS", "Choice",
    "KernelUnavailableError", "Stored", "WindowKeys", "choices", "choose",
    "dense_decode_attention", "emit_entries", "emit_entries_online", "index_scores",
    "index_topk", "kernel_module", "make_resident", "measured", "put_records", "read", "resolve",
    "sparse_decode41", "sparse_decode_attention", "supported", "unchecked",
]
