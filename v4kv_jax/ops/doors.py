"""The ops with a kernel: each as its jnp reference or a Pallas kernel, as `Options` choose per
platform (`choice._dispatch`), taking what the reference takes (arrays as stored, RoPE
frequencies, page tables) and returning what it returns. `v4kv_jax.ops` re-exports them;
its read door (`ops.read`) calls the reads.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from v4kv_jax import pools
from v4kv_jax.config import AttentionConfig, CacheConfig, LayerKind, Options
from v4kv_jax.config import options_or_default as _options
from v4kv_jax.ops import attention, attention41, compressor, indexer
from v4kv_jax.ops.choice import _dispatch
from v4kv_jax.pools.layout import CacheLayout, CompressorSpec
from v4kv_jax.pools.layout import of as layout_of


def _read_formats(model: AttentionConfig, geometry: CacheConfig, window: pools.Lanes,
                  entries: pools.Lanes) -> dict:
    """Static format arguments of the decode attention kernels: they read the window ring and
    the entries as stored (words decoded in the kernel), where their lane maps say."""
    return dict(entry_format=geometry.entry_dtype, window_format=geometry.window_dtype,
                rope_dim=model.rope_dim, entry_lanes=entries.map.spec,
                window_lanes=window.map.spec)


# --- the ops with a kernel ---------------------------------------------------------------------


def _layout(model: AttentionConfig, geometry: CacheConfig,
            layout: CacheLayout | None) -> CacheLayout:
    """The `CacheLayout` a caller handed down (a cache's `cache.layout`), else the configs'."""
    return layout_of(model, geometry) if layout is None else layout


def emit_entries(spec: CompressorSpec, model: AttentionConfig, geometry: CacheConfig,
                 options: Options | None = None, *, layout: CacheLayout | None = None,
                 pool: jax.Array, page_rows: jax.Array, layers: jax.Array, tail_kv: jax.Array,
                 tail_gate: jax.Array, slot_ids: jax.Array, kv: jax.Array, gate: jax.Array,
                 start: jax.Array, n_new: jax.Array, norm: jax.Array) -> jax.Array:
    """Entries of every block the chunk completes, written into the pool (in place under
    donation). Arguments as `compressor.emit_entries`, and `layout`, what the configs fix
    (`cache.layout`; None: derived from them); returns the updated pool.

    The Pallas kernels alias the pool to their output and donate it: called outside jit,
    the `pool` passed in is consumed (use the returned one). A pool in host memory (C4
    entries with c4_tier="host") is written by the reference, which writes there.
    """
    fixed = _layout(model, geometry, layout)
    arrays = dict(pool=pool, page_rows=page_rows, layers=layers, tail_kv=tail_kv,
                  tail_gate=tail_gate, slot_ids=slot_ids, kv=kv, gate=gate, start=start,
                  n_new=n_new, norm=norm)
    def reference():
        return compressor.emit_entries(spec, fixed, **arrays)

    if spec.name in fixed.host:
        return reference()
    codec = fixed.rows[spec.name]

    def run_kernel(kernel, choice):
        planes = dict(arrays, pool=pool.planes, tail_kv=tail_kv.planes,
                      tail_gate=tail_gate.planes)
        out = kernel(*planes.values(), fixed.inv_freq[spec.kind], ratio=spec.ratio,
                     overlap=spec.overlap, eps=model.rms_eps, block_sizes=choice.block_sizes,
                     interpret=choice.interpret, entry_format=codec.fmt,
                     rope_dim=codec.rope_dim, tail_format=geometry.tail_dtype,
                     entry_lanes=pool.map.spec, tail_lanes=tail_kv.map.spec)
        return pools.Lanes(tuple(out), pool.map)

    return _dispatch("emit_entries", model, geometry, options, reference, run_kernel, spec)


def emit_entries_online(spec: CompressorSpec, model: AttentionConfig, geometry: CacheConfig,
                        options: Options | None = None, *,
                        layout: CacheLayout | None = None, pool: jax.Array | None,
                        page_rows: jax.Array, layers: jax.Array, tail: pools.OnlineTail,
                        slot_ids: jax.Array, kv: jax.Array, gate: jax.Array, start: jax.Array,
                        n_new: jax.Array, norm: jax.Array
                        ) -> tuple[jax.Array | None, pools.OnlineTail]:
    """The HCA compressor with hca_tail="online": folds the chunk into the online tails and
    writes the entry of every block it completes (`compressor.emit_entries_online`; layout
    and update rule in the `pools` docstring; `layout` as `emit_entries`). Returns (pool or
    None, `pools.OnlineTail`).

    The Pallas kernels alias the pool and the tails to their outputs and donate them: called
    outside jit, the arrays passed in are consumed (use the returned ones). They run one
    program per layer and row: there is nothing to tile, so no block sizes.
    """
    fixed = _layout(model, geometry, layout)

    def reference():
        return compressor.emit_entries_online(
            spec, fixed, pool=pool, page_rows=page_rows, layers=layers, tail=tail,
            slot_ids=slot_ids, kv=kv, gate=gate, start=start, n_new=n_new, norm=norm)

    def run_kernel(kernel, choice):
        codec = fixed.rows[spec.name]
        out, state = kernel(None if pool is None else pool.planes, page_rows, layers,
                            tail.max.planes, tail.sum.planes, tail.weighted.planes,
                            slot_ids, kv, gate, start, n_new, norm,
                            fixed.inv_freq[spec.kind], ratio=spec.ratio,
                            eps=model.rms_eps, interpret=choice.interpret,
                            entry_format=codec.fmt, rope_dim=codec.rope_dim,
                            tail_format=geometry.tail_dtype,
                            entry_lanes=fixed.lanes[spec.name].spec,
                            tail_lanes=tail.max.map.spec)
        tail_map = tail.max.map
        return (None if out is None else pools.Lanes(tuple(out), pool.map),
                pools.OnlineTail(*(pools.Lanes(tuple(x), tail_map) for x in state)))

    return _dispatch("emit_entries_online", model, geometry, options, reference, run_kernel,
                     spec)


def index_scores(model: AttentionConfig, geometry: CacheConfig, options: Options | None = None,
                 *, layout: CacheLayout | None = None, index_keys: jax.Array, layer,
                 page_rows: jax.Array, index_q: jax.Array, index_weights: jax.Array,
                 q_pos: jax.Array, kv_end: jax.Array) -> jax.Array:
    """f32[B, capacity]: indexer scores of one query per slot, -inf where not a candidate.

    Entries i < min((q_pos + 1) // m, kv_end // m) on present pages are candidates.
    Capacity is at least max_pages_per_seq * P // m.

    Args:
      index_keys: the indexer keys (`pools.Lanes` of blocks [n_csa, num_pages]); layer:
        index in the CSA stack.
      page_rows: i32[B, max_pages_per_seq].
      index_q: f32[B, nI, c] (RoPE per head); index_weights: f32[B, nI] raw head weights.
      q_pos, kv_end: i32[B].
      layout: as `emit_entries`.

    The query is prepared for the keys' format first (`indexer.prepare_index_query`: for
    fp4_index keys rotated and fake-quantised like them), for every implementation.
    """
    fixed = _layout(model, geometry, layout)
    index_q = indexer.prepare_index_query(geometry, index_q)
    def reference():
        return indexer.index_scores(
            model, geometry, _options(options), layout=fixed, index_keys=index_keys, layer=layer,
            page_rows=page_rows, index_q=index_q[:, None], index_weights=index_weights[:, None],
            q_pos=q_pos[:, None], kv_end=kv_end)[:, 0]

    def run_kernel(kernel, choice):
        """The kernel's scores at the reference's capacity, so that the platforms' branches
        agree: both pad past max_pages_per_seq pages (to their own blocks) with -inf."""
        scores = kernel(index_q, index_weights, index_keys.planes, layer, page_rows, q_pos,
                        kv_end, ratio=model.csa_ratio, block_sizes=choice.block_sizes,
                        interpret=choice.interpret, index_format=geometry.index_dtype,
                        index_lanes=index_keys.map.spec)
        width = indexer.score_capacity(model, geometry, _options(options), page_rows.shape[1])
        if scores.shape[1] >= width:
            return scores[:, :width]
        return jnp.pad(scores, ((0, 0), (0, width - scores.shape[1])),
                       constant_values=-jnp.inf)

    return _dispatch("index_scores", model, geometry, options, reference, run_kernel)


def index_topk(model: AttentionConfig, geometry: CacheConfig, options: Options | None = None,
               **kwargs) -> jax.Array:
    """i32[B, k]: the indexer's top-k picks of one query per slot (-1 = unused pick).

    Scores come from `index_scores` (arguments as there); the selection is the reference's
    `indexer.picks_from_scores` for every implementation.
    """
    scores = index_scores(model, geometry, options, **kwargs)
    return indexer.picks_from_scores(model, geometry, scores[:, None], kwargs["kv_end"])[:, 0]


def sparse_decode_attention(model: AttentionConfig, geometry: CacheConfig,
                            options: Options | None = None, *,
                            layout: CacheLayout | None = None, q: jax.Array, sink: jax.Array,
                            window: jax.Array, window_layer, slot_ids: jax.Array,
                            q_pos: jax.Array, kv_end: jax.Array, c4: jax.Array, c4_layer,
                            page_rows: jax.Array, picks: jax.Array) -> jax.Array:
    """CSA decode attention of one query per slot (`attention.sparse_decode_attention`;
    `layout` as `emit_entries`)."""
    inv_freq = _layout(model, geometry, layout).inv_freq[LayerKind.CSA]
    args = (q, sink, window, window_layer, slot_ids, q_pos, kv_end, c4, c4_layer, page_rows,
            picks)
    planes = (q, sink, window.planes, window_layer, slot_ids, q_pos, kv_end, c4.planes,
              c4_layer, page_rows, picks)
    return _dispatch(
        "sparse_decode_attention", model, geometry, options,
        lambda: attention.sparse_decode_attention(model, geometry, _options(options), *args),
        lambda kernel, choice: kernel(*planes, inv_freq,
                                      block_sizes=choice.block_sizes, interpret=choice.interpret,
                                      **_read_formats(model, geometry, window, c4)))


def dense_decode_attention(model: AttentionConfig, geometry: CacheConfig,
                           options: Options | None = None, *,
                           layout: CacheLayout | None = None, q: jax.Array, sink: jax.Array,
                           window: jax.Array, window_layer, slot_ids: jax.Array,
                           q_pos: jax.Array, kv_end: jax.Array, c128: jax.Array, c128_layer,
                           page_rows: jax.Array) -> jax.Array:
    """HCA decode attention of one query per slot (`attention.dense_decode_attention`;
    `layout` as `emit_entries`)."""
    inv_freq = _layout(model, geometry, layout).inv_freq[LayerKind.HCA]
    args = (q, sink, window, window_layer, slot_ids, q_pos, kv_end, c128, c128_layer, page_rows)
    planes = (q, sink, window.planes, window_layer, slot_ids, q_pos, kv_end, c128.planes,
              c128_layer, page_rows)
    return _dispatch(
        "dense_decode_attention", model, geometry, options,
        lambda: attention.dense_decode_attention(model, geometry, _options(options), *args),
        lambda kernel, choice: kernel(*planes, inv_freq,
                                      ratio=model.hca_ratio, block_sizes=choice.block_sizes,
                                      interpret=choice.interpret,
                                      **_read_formats(model, geometry, window, c128)))


def sparse_decode41(config, geometry: CacheConfig, options: Options | None = None, *,
                    window: pools.Lanes, layer, slot_ids: jax.Array, q_pos: jax.Array,
                    entries: pools.Lanes, ids: jax.Array, valid: jax.Array,
                    page_rows: jax.Array, q: jax.Array, sink: jax.Array,
                    reference=None) -> jax.Array:
    """DeepSeek-V4.1's decode read of a sparse layer, one query per row, before the inverse
    RoPE (`attention41.sparse_decode41`: arguments and result; `config` a `V41Config`).
    `reference`: a caller's own read of the same (a callable giving f32[B, H, hd]), run
    where the op's reference would (the V4.1 step passes its read, so that a platform
    without the kernel computes what it computes for any chunk)."""
    arrays = dict(window=window, layer=layer, slot_ids=slot_ids, q_pos=q_pos, entries=entries,
                  ids=ids, valid=valid, page_rows=page_rows, q=q, sink=sink)
    if reference is None:
        def reference():
            return attention41.sparse_decode41(config, geometry, **arrays)

    def run_kernel(kernel, choice):
        return kernel(q, sink, window.planes, layer, slot_ids, q_pos, entries.planes,
                      page_rows, ids, valid, block_sizes=choice.block_sizes,
                      interpret=choice.interpret, entry_format=geometry.entry_dtype,
                      window_format=geometry.window_dtype, entry_lanes=entries.map.spec,
                      window_lanes=window.map.spec)

    return _dispatch("sparse_decode41", config, geometry, options, reference, run_kernel)


def _window_decode_attention(model, geometry, options, fixed, common, reference):
    """An SWA layer's decode read: on a TPU the HCA read's kernel over no entries (the
    window alone, read in place), elsewhere `reference()` (the window gathered in position
    order, as a chunk reads it); "dense_decode_attention"'s choice decides."""

    def run_kernel(kernel, choice):
        if choice.implementation != "pallas_tpu":  # the GPU kernel reads entries
            return reference()
        window = common["window"]
        return kernel(common["q"], common["sink"], window.planes, common["window_layer"],
                      common["slot_ids"], common["q_pos"], common["kv_end"], None, 0, None,
                      fixed.inv_freq[LayerKind.SWA], ratio=model.hca_ratio,
                      block_sizes=choice.block_sizes, interpret=choice.interpret,
                      entry_format=geometry.entry_dtype, window_format=geometry.window_dtype,
                      rope_dim=model.rope_dim, window_lanes=window.map.spec)

    return _dispatch("dense_decode_attention", model, geometry, options, reference, run_kernel)


__all__ = ["dense_decode_attention", "emit_entries", "emit_entries_online", "index_scores",
           "index_topk", "sparse_decode41", "sparse_decode_attention"]
