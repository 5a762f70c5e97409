"""HCA dense decode attention, TPU (Mosaic).

Grid: one program per slot. Scalar-prefetched: the layer indices, query positions, sequence
lengths, slot ids (they pick the window ring blocks) and the page table. The C128 pool stays
in HBM (`pltpu.HBM`: XLA never moves it to VMEM around the kernel, as it may with `pl.ANY`);
the pages holding the visible entries are copied `pages_per_block` at a time, each plane's
lane rows as stored (`formats.Part`), into double-buffered VMEM blocks
(the next block in flight while the current one is decoded and folded), so the work follows
the slot's length, not the page-table capacity. The held pages of a row are a prefix of it
(`v4kv_jax.pools.paging`), so entry i < visible lies on a held page. The query is laid
out in planes, and the output put back in natural order and de-rotated, inside the kernel
(`decode.KeyGroups.plane_queries`, `natural_output`).

Layout read (`v4kv_jax.pools.lanes`):
  window  planes [n_layers, max_slots, rows, lanes]   block (layer, slot) through the index map
  c128    planes [n_hca, num_pages, rows, lanes]      page copies
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import decode, formats, lanes, tpu_pipeline
from pallas_kernels.common import (
    cost_estimate,
    in_hbm,
    lane_frequencies,
    layer_index,
    nbytes,
    tpu_interpret,
)
from pallas_kernels.dense_attention.blocks import BlockSizes


def supported(model, geometry, spec=None) -> str | None:
    """Why this TPU kernel cannot run a config, or None: it runs every storage format (whole
    pages of 32-bit lane rows are copied)."""
    del model, geometry, spec
    return None


def _kernel(layers_ref, q_pos_ref, kv_end_ref, slot_ref, table_ref, *refs,
            groups: decode.KeyGroups, pages_per_block: int, entries_per_page: int,
            max_pages: int, ratio: int, window: int, scale: float, entries: bool):
    del slot_ref  # consumed by the window blocks' index maps
    n = len(groups.layouts)
    window_lay, entry_lay = groups.window_layout, groups.entries_layout
    nw, ne = len(window_lay.parts), len(entry_lay.parts) if entries else 0
    q_ref, table_refs, (freq_ref, sink_ref) = refs[0], refs[1:1 + n], refs[1 + n:3 + n]
    refs = refs[3 + n:]
    window_refs, c128_hbm = refs[:nw], refs[nw:nw + ne]
    refs = refs[nw + ne:]
    o_ref, bufs, sems = refs[0], refs[1:1 + ne], refs[1 + ne]
    b = pl.program_id(0)
    layer = layers_ref[1]
    q_pos, kv_end = q_pos_ref[b], kv_end_ref[b]
    visible = jnp.minimum(jax.lax.div(q_pos + 1, ratio), jax.lax.div(kv_end, ratio))
    num_pages = jax.lax.div(visible + entries_per_page - 1, entries_per_page)
    num_blocks = jax.lax.div(num_pages + pages_per_block - 1, pages_per_block)

    start, wait = tpu_pipeline.page_block_copies(
        table_ref, b, c128_hbm, layer, bufs, sems, num_pages=num_pages,
        pages_per_block=pages_per_block, max_pages=max_pages)

    q = groups.plane_queries(q_ref[...], table_refs)
    gw, ge = groups.window, groups.entries
    ring = formats.decode_tpu(window_lay, *tpu_pipeline.window_rows(window_lay, window_refs,
                                                                    window))
    state = decode.fold_window(decode.sink_state(groups, sink_ref[...]), q[gw], ring, q_pos,
                               kv_end, window, scale, group=gw)
    if not entries:  # a window-only read (an SWA layer)
        tpu_pipeline.write_output(o_ref, groups, state, table_refs, q_pos, freq_ref)
        return
    block_entries = pages_per_block * entries_per_page
    tiles_slots = [lanes.slots(part, block_entries, entries_per_page)
                   for part in entry_lay.parts]

    def body(j, slot, state):
        first = j * block_entries
        rows = first + jax.lax.broadcasted_iota(jnp.int32, (block_entries, 1), 0) < visible
        cols = first + jax.lax.broadcasted_iota(jnp.int32, (1, block_entries), 1) < visible
        tiles = [lanes.expand(buf[slot], part, entries_per_page)
                 for buf, part in zip(bufs, entry_lay.parts, strict=True)]
        keys = [jnp.where(rows, k, 0.0)
                for k in formats.decode_tpu(entry_lay, tiles, tiles_slots)]
        return decode.fold(state, q[ge], keys, cols, scale, ge)

    state = tpu_pipeline.double_buffered(num_blocks, start, wait, body, state)
    tpu_pipeline.write_output(o_ref, groups, state, table_refs, q_pos, freq_ref)


@functools.partial(jax.jit, static_argnames=("ratio", "block_sizes", "interpret",
                                             "entry_format", "window_format", "rope_dim",
                                             "entry_lanes", "window_lanes"))
def dense_decode_attention(q, sink, window, window_layer, slot_ids, q_pos, kv_end, c128,
                           c128_layer, page_rows, inv_freq, *, ratio: int,
                           block_sizes: BlockSizes | None = None, interpret: bool = False,
                           entry_format: str = "float32", window_format: str = "float32",
                           rope_dim: int = 0, entry_lanes=(), window_lanes=()):
    """One decode query per slot over its window and every visible C128 entry (c128 None:
    over its window alone, an SWA layer's read).

    Args:
      q: f32[B, H, hd] queries (RoPE applied). sink: f32[H].
      window: the window rings' planes as stored, [n_layers, max_slots, rows, lanes] each;
        window_layer: global layer.
      slot_ids, q_pos, kv_end: i32[B] slot, query position and sequence length per row.
      c128: the C128 entries' planes as stored, [n_hca, num_pages, rows, lanes] each;
        c128_layer: index in the HCA stack.
      page_rows: i32[B, max_pages_per_seq].
      inv_freq: f32[r // 2], the RoPE frequencies of the layer kind (`rope.inv_frequencies`).
      ratio: m'. Entries i < min((q_pos + 1) // m', kv_end // m') are read.
      entry_format, window_format, rope_dim, entry_lanes, window_lanes: as
        `sparse_decode_attention`.

    Returns:
      f32[B, H, hd], de-rotated by -q_pos.
    """
    batch, heads, dim = q.shape
    lane_freq = lane_frequencies(inv_freq, dim)
    window_lay = formats.layout(window_format, dim, rope_dim, "tpu", window_lanes)
    entries = c128 is not None
    if not entries:  # the window alone: no page is read
        c128, c128_layer, page_rows = (), 0, jnp.full((batch, 1), -1, jnp.int32)
    groups = decode.KeyGroups.of(window_lay, formats.layout(
        entry_format, dim, rope_dim, "tpu", entry_lanes) if entries else window_lay)
    entry_lay = groups.entries_layout
    window_len, epp = window_lay.records, entry_lay.records
    formats.check_stored(window_lay, window, "window")
    if entries:
        formats.check_stored(entry_lay, c128, "c128")
    max_pages = page_rows.shape[1] if entries else 0
    bs = (block_sizes or BlockSizes()).clamped(max(max_pages, 1) * epp, heads)
    ppb = max(1, min(bs.pages_per_block(epp), max_pages))
    layers = jnp.concatenate([layer_index(window_layer), layer_index(c128_layer)])
    page_bytes = sum(nbytes(x, 2) for x in c128)

    kernel = functools.partial(
        _kernel, groups=groups, pages_per_block=ppb, entries_per_page=epp, max_pages=max_pages,
        ratio=ratio, window=window_len, scale=dim**-0.5, entries=entries)
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5,
            grid=(batch,),
            in_specs=[
                *tpu_pipeline.query_window_specs(groups, heads, dim, window),
                *[pl.BlockSpec(memory_space=pltpu.HBM)] * len(c128),
            ],
            out_specs=tpu_pipeline.output_spec(heads, dim),
            scratch_shapes=[*(pltpu.VMEM((2, ppb * x.shape[-2], x.shape[-1]), x.dtype)
                              for x in c128),
                            pltpu.SemaphoreType.DMA((2,))],
        ),
        out_shape=tpu_pipeline.output_shape(batch, heads, dim),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=tpu_interpret(interpret),
        name="v4kv_hca_dense_decode_attention" if entries else "v4kv_swa_decode_attention",
        cost_estimate=cost_estimate(
            flops=4 * batch * heads * dim * (max_pages * epp + window_len),
            transcendentals=batch * heads * (max_pages * epp + window_len),
            bytes_accessed=batch * (max_pages * page_bytes + sum(nbytes(x, 2) for x in window)
                                    + 2 * heads * dim * 4)),
    )(layers, q_pos.astype(jnp.int32), kv_end.astype(jnp.int32), slot_ids.astype(jnp.int32),
      page_rows.astype(jnp.int32).reshape(-1),
      *tpu_pipeline.query_window_inputs(groups, q, lane_freq, sink), *in_hbm(window),
      *in_hbm(c128))
