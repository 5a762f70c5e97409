"""CSA sparse decode attention, TPU (Mosaic).

Grid: one program per slot. Scalar-prefetched: the layer indices, query positions, sequence
lengths, slot ids (they pick the window ring blocks), the page table and the top-k picks.
The C4 pool stays in HBM (`pltpu.HBM`); each valid pick copies, for every plane of the pool
(`formats.Part`), the one lane row that holds the pick into a double-buffered VMEM batch of
`picks_per_block` rows, the next batch in flight while the current one is decoded into
planes (`formats.decode_tpu`, each row's slot moved to slot 0) and folded into the online
softmax. A -1 pick, or one whose page is absent, copies nothing: its rows are zeroed and it is
marked unseen (the picks of a batch that were copied are known in the kernel, so no gather in
XLA has to weed out absent pages first). Batches past the last valid pick are never visited.
The query is laid out in planes, and the output put back in natural order and de-rotated,
inside the kernel (`decode.KeyGroups.plane_queries`, `natural_output`).

Layout read (`v4kv_jax.pools.lanes`):
  window  planes [n_layers, max_slots, rows, lanes]   block (layer, slot) through the index map
  c4      planes [n_csa, num_pages, rows, lanes]      one lane row per pick and plane
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import decode, formats, tpu_pipeline
from pallas_kernels.common import (
    cost_estimate,
    in_hbm,
    lane_frequencies,
    layer_index,
    nbytes,
    tpu_interpret,
)
from pallas_kernels.sparse_attention.blocks import BlockSizes


def supported(model, geometry, spec=None) -> str | None:
    """Why this TPU kernel cannot run a config, or None: it runs every storage format (every
    plane a row lives in is 32-bit words, copied a lane row at a time)."""
    del model, geometry, spec
    return None


def _kernel(layers_ref, q_pos_ref, kv_end_ref, slot_ref, table_ref, picks_ref, blocks_ref,
            *refs, groups: decode.KeyGroups, block: int, padded_topk: int,
            entries_per_page: int, max_pages: int, window: int, scale: float):
    del slot_ref  # consumed by the window blocks' index maps
    n = len(groups.layouts)
    window_lay, entry_lay = groups.window_layout, groups.entries_layout
    nw, ne = len(window_lay.parts), len(entry_lay.parts)
    q_ref, table_refs, (freq_ref, sink_ref) = refs[0], refs[1:1 + n], refs[1 + n:3 + n]
    refs = refs[3 + n:]
    window_refs, c4_hbm = refs[:nw], refs[nw:nw + ne]
    refs = refs[nw + ne:]
    o_ref, bufs, (marks, pick_slots, sems) = refs[0], refs[1:1 + ne], refs[1 + ne:]
    b = pl.program_id(0)
    layer = layers_ref[1]
    q_pos, kv_end = q_pos_ref[b], kv_end_ref[b]

    def row_copy(j, i, slot):
        pick = jnp.maximum(picks_ref[b * padded_topk + j * block + i], 0)
        page = jnp.maximum(table_ref[b * max_pages + jax.lax.div(pick, entries_per_page)], 0)
        entry = jax.lax.rem(pick, entries_per_page)
        return [pltpu.make_async_copy(
            hbm.at[layer, page, pl.ds(jax.lax.div(entry, part.per_row), 1)],
            buf.at[slot, pl.ds(i, 1)], sems.at[slot])
            for part, hbm, buf in zip(entry_lay.parts, c4_hbm, bufs, strict=True)]

    def valid(j, i):
        """The pick exists and its page is present (an absent page's pick counts as none)."""
        pick = picks_ref[b * padded_topk + j * block + i]
        col = jax.lax.div(jnp.maximum(pick, 0), entries_per_page)
        page = table_ref[b * max_pages + jnp.minimum(col, max_pages - 1)]
        return (pick >= 0) & (col < max_pages) & (page >= 0)

    def mark(value):
        def set_row(j, i, slot):
            marks[slot, pl.ds(i, 1), :] = jnp.full((1, marks.shape[-1]), value, marks.dtype)
            # Lane k: the pick's slot in its lane row of part k (0 for a pick that is none).
            entry = jax.lax.rem(jnp.maximum(picks_ref[b * padded_topk + j * block + i], 0),
                                entries_per_page)
            lane = jax.lax.broadcasted_iota(jnp.int32, (1, pick_slots.shape[-1]), 1)
            row = jnp.zeros((1, pick_slots.shape[-1]), jnp.int32)
            for k, part in enumerate(entry_lay.parts):
                row = jnp.where(lane == k, jax.lax.rem(entry, part.per_row) * int(value), row)
            pick_slots[slot, pl.ds(i, 1), :] = row
        return set_row

    def zero_row(j, i, slot):  # a pick that is none copies nothing; its rows must be finite
        for buf in bufs:
            buf[slot, pl.ds(i, 1), :] = jnp.zeros((1, buf.shape[-1]), buf.dtype)
        mark(0)(j, i, slot)

    start, wait = tpu_pipeline.block_copies(row_copy, valid, block, on_skip=zero_row,
                                            on_copy=mark(1))

    q = groups.plane_queries(q_ref[...], table_refs)
    gw, ge = groups.window, groups.entries
    ring = formats.decode_tpu(window_lay, *tpu_pipeline.window_rows(window_lay, window_refs,
                                                                    window))
    state = decode.fold_window(decode.sink_state(groups, sink_ref[...]), q[gw], ring, q_pos,
                               kv_end, window, scale, group=gw)

    def body(j, slot, state):
        # Which rows were copied, as a lane vector: the marks' rows summed by a matmul.
        ones = jnp.ones((1, marks.shape[-1]), jnp.float32)
        visible = jax.lax.dot_general(ones, marks[slot], (((1,), (1,)), ((), ())),
                                      preferred_element_type=jnp.float32) > 0
        slots = [None if part.per_row == 1 else pick_slots[slot][:, k:k + 1]
                 for k, part in enumerate(entry_lay.parts)]
        keys = formats.decode_tpu(entry_lay, [buf[slot] for buf in bufs], slots)
        return decode.fold(state, q[ge], keys, visible, scale, ge)

    state = tpu_pipeline.double_buffered(blocks_ref[b], start, wait, body, state)
    tpu_pipeline.write_output(o_ref, groups, state, table_refs, q_pos, freq_ref)


@functools.partial(jax.jit, static_argnames=("block_sizes", "interpret", "entry_format",
                                             "window_format", "rope_dim", "entry_lanes",
                                             "window_lanes", "name"))
def sparse_decode_attention(q, sink, window, window_layer, slot_ids, q_pos, kv_end, c4,
                            c4_layer, page_rows, picks, inv_freq, *,
                            block_sizes: BlockSizes | None = None, interpret: bool = False,
                            entry_format: str = "float32", window_format: str = "float32",
                            rope_dim: int = 0, entry_lanes=(), window_lanes=(),
                            name: str = "v4kv_csa_sparse_decode_attention"):
    """One decode query per slot over its window and its top-k C4 entries.

    Args:
      q: f32[B, H, hd] queries (RoPE applied). sink: f32[H].
      window: the window rings' planes as stored, [n_layers, max_slots, rows, lanes] each;
        window_layer: global layer.
      slot_ids, q_pos, kv_end: i32[B] slot, query position and sequence length per row.
      c4: the C4 entries' planes as stored, [n_csa, num_pages, rows, lanes] each; c4_layer:
        index in the CSA stack.
      page_rows: i32[B, max_pages_per_seq]; picks: i32[B, k] entry ids, -1 = none (a pick whose
        page is absent counts as none).
      inv_freq: f32[r // 2], the RoPE frequencies of the layer kind (`rope.inv_frequencies`).
      entry_format, window_format: storage formats of c4 and of the window ("float32",
        "bfloat16", "float16", "fp8_latent", or V4.1's "nvfp4" / "mxfp8": words decoded
        in the kernel); rope_dim: r, the RoPE dims of fp8_latent rows.
      entry_lanes, window_lanes: where the rows of c4 and of the window live (static:
        `v4kv_jax.pools.lanes.LaneMap.spec`).
      name: the pallas_call's name.

    Returns:
      f32[B, H, hd], de-rotated by -q_pos.
    """
    batch, heads, dim = q.shape
    lane_freq = lane_frequencies(inv_freq, dim)
    groups = decode.KeyGroups.of(
        formats.layout(window_format, dim, rope_dim, "tpu", window_lanes),
        formats.layout(entry_format, dim, rope_dim, "tpu", entry_lanes))
    entry_lay, window_lay = groups.entries_layout, groups.window_layout
    window_len, epp = window_lay.records, entry_lay.records
    formats.check_stored(window_lay, window, "window")
    formats.check_stored(entry_lay, c4, "c4")
    picks = jnp.where(picks >= 0, picks, -1)
    topk, max_pages = picks.shape[1], page_rows.shape[1]
    bs = (block_sizes or BlockSizes()).clamped(topk, heads)
    block = max(8, bs.picks_per_block)
    padded = -(-topk // block) * block
    picks = jnp.pad(picks.astype(jnp.int32), ((0, 0), (0, padded - topk)), constant_values=-1)
    last = jnp.max(jnp.where(picks >= 0, jnp.arange(padded, dtype=jnp.int32) + 1, 0), axis=1)
    blocks = (last + block - 1) // block
    layers = jnp.concatenate([layer_index(window_layer), layer_index(c4_layer)])
    row_bytes = sum(nbytes(x, 1) for x in c4)

    kernel = functools.partial(
        _kernel, groups=groups, block=block, padded_topk=padded, entries_per_page=epp,
        max_pages=max_pages, window=window_len, scale=dim**-0.5)
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=7,
            grid=(batch,),
            in_specs=[
                *tpu_pipeline.query_window_specs(groups, heads, dim, window),
                *[pl.BlockSpec(memory_space=pltpu.HBM)] * len(c4),
            ],
            out_specs=tpu_pipeline.output_spec(heads, dim),
            scratch_shapes=[*(pltpu.VMEM((2, block, x.shape[-1]), x.dtype) for x in c4),
                            pltpu.VMEM((2, block, 128), jnp.float32),
                            pltpu.VMEM((2, block, 128), jnp.int32),
                            pltpu.SemaphoreType.DMA((2,))],
        ),
        out_shape=tpu_pipeline.output_shape(batch, heads, dim),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=tpu_interpret(interpret),
        name=name,
        cost_estimate=cost_estimate(
            flops=4 * batch * heads * dim * (topk + window_len),
            transcendentals=batch * heads * (topk + window_len),
            bytes_accessed=batch * (topk * row_bytes + sum(nbytes(x, 2) for x in window)
                                    + 2 * heads * dim * 4)),
    )(layers, q_pos.astype(jnp.int32), kv_end.astype(jnp.int32), slot_ids.astype(jnp.int32),
      page_rows.astype(jnp.int32).reshape(-1), picks.reshape(-1), blocks,
      *tpu_pipeline.query_window_inputs(groups, q, lane_freq, sink), *in_hbm(window),
      *in_hbm(c4))


def sparse_decode41(q, sink, window, window_layer, slot_ids, q_pos, entries, page_rows, ids,
                    valid, *, block_sizes: BlockSizes | None = None, interpret: bool = False,
                    entry_format: str = "float32", window_format: str = "float32",
                    entry_lanes=(), window_lanes=()):
    """DeepSeek-V4.1's decode read (`v4kv_jax.ops.attention41.sparse_decode41`): the V4 read
    above on V4.1's stores. The ring holds the query's own row (kv_end = q_pos + 1); the
    kv source's entries are one stack of pages (a leading dim of 1 added); the output stays
    rotated (zero RoPE frequencies: the caller applies V4.1's inverse RoPE).

    Args:
      q: f32[B, H, hd] queries (RoPE applied); sink: f32[H].
      window: the window rings' planes [num_layers, max_slots, rows, lanes] each;
        window_layer: the layer.
      slot_ids, q_pos: i32[B] slot and query position per row.
      entries: the kv source's entries' planes [num_pages, rows, lanes] each.
      page_rows: i32[B, max_pages_per_seq]; ids: i32[B, K] entry ids; valid: bool[B, K].
      entry_format, window_format: "float32", "bfloat16", "float16", "nvfp4" (entries) or
        "mxfp8" (window); entry_lanes, window_lanes: their `LaneMap.spec`.

    Returns:
      f32[B, H, hd], not de-rotated.
    """
    return sparse_decode_attention(
        q, sink, window, window_layer, slot_ids, q_pos, q_pos + 1,
        tuple(x[None] for x in entries), 0, page_rows, jnp.where(valid, ids, -1),
        jnp.zeros((1,), jnp.float32), block_sizes=block_sizes, interpret=interpret,
        entry_format=entry_format, window_format=window_format, entry_lanes=entry_lanes,
        window_lanes=window_lanes, name="v4kv_sparse_decode41")
