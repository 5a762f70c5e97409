"""HCA dense decode attention, TPU (Mosaic).

Grid: one program per slot. Scalar-prefetched: the layer indices, query positions, sequence
lengths, slot ids (they pick the window ring block) and the page table. The C128 pool stays
in HBM (`pl.ANY`); the pages holding the visible entries are copied `pages_per_block` at a
time into a double-buffered VMEM block (the next block in flight while the current one is
folded), so the work follows the slot's length, not the page-table capacity. The held pages
of a row are a prefix of it (`v4kv_jax.paging`), so entry i < visible lies on a held page.

Layout read:
  window  [n_layers, max_slots, W, hd]      block (layer, slot) through the index map
  c128    [n_hca, num_pages, P // m', hd]   page copies
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import decode, tpu_pipeline
from pallas_kernels.common import (
    lane_frequencies,
    layer_index,
    tpu_interpret,
)
from pallas_kernels.dense_attention.blocks import BlockSizes


def _kernel(layers_ref, q_pos_ref, kv_end_ref, slot_ref, table_ref, q_ref, sink_ref, freq_ref,
            window_ref, c128_hbm, o_ref, buf, sems, *, pages_per_block: int,
            entries_per_page: int, max_pages: int, ratio: int, window: int, scale: float):
    del slot_ref  # consumed by the window block's index map
    b = pl.program_id(0)
    layer = layers_ref[1]
    q_pos, kv_end = q_pos_ref[b], kv_end_ref[b]
    visible = jnp.minimum(jax.lax.div(q_pos + 1, ratio), jax.lax.div(kv_end, ratio))
    num_pages = jax.lax.div(visible + entries_per_page - 1, entries_per_page)
    num_blocks = jax.lax.div(num_pages + pages_per_block - 1, pages_per_block)

    start, wait = tpu_pipeline.page_block_copies(
        table_ref, b, c128_hbm, layer, buf, sems, num_pages=num_pages,
        pages_per_block=pages_per_block, entries_per_page=entries_per_page, max_pages=max_pages)

    q = q_ref[...].astype(jnp.float32)
    state = decode.fold_window(decode.sink_state(q, sink_ref[...]), q, window_ref[...], q_pos,
                               kv_end, window, scale)
    block_entries = pages_per_block * entries_per_page

    def body(j, slot, state):
        first = j * block_entries
        rows = first + jax.lax.broadcasted_iota(jnp.int32, (block_entries, 1), 0) < visible
        lanes = first + jax.lax.broadcasted_iota(jnp.int32, (1, block_entries), 1) < visible
        keys = jnp.where(rows, buf[slot].astype(jnp.float32), 0.0)
        return decode.fold(state, q, keys, lanes, scale)

    _, denom, acc = tpu_pipeline.double_buffered(num_blocks, start, wait, body, state)
    tpu_pipeline.write_output(o_ref, denom, acc, q_pos, freq_ref)


@functools.partial(jax.jit, static_argnames=("ratio", "block_sizes", "interpret"))
def dense_decode_attention(q, sink, window, window_layer, slot_ids, q_pos, kv_end, c128,
                           c128_layer, page_rows, inv_freq, *, ratio: int,
                           block_sizes: BlockSizes | None = None, interpret: bool = False):
    """One decode query per slot over its window and every visible C128 entry.

    Args:
      q: f32[B, H, hd] queries (RoPE applied). sink: f32[H].
      window: [n_layers, max_slots, W, hd] the window rings; window_layer: global layer.
      slot_ids, q_pos, kv_end: i32[B] slot, query position and sequence length per row.
      c128: [n_hca, num_pages, P // m', hd]; c128_layer: index in the HCA stack.
      page_rows: i32[B, max_pages_per_seq].
      inv_freq: f32[r // 2], the RoPE frequencies of the layer kind (`rope.inv_frequencies`).
      ratio: m'. Entries i < min((q_pos + 1) // m', kv_end // m') are read.

    Returns:
      f32[B, H, hd], de-rotated by -q_pos.
    """
    batch, heads, dim = q.shape
    _, _, window_len, _ = window.shape
    lane_freq = lane_frequencies(inv_freq, dim)
    epp, max_pages = c128.shape[2], page_rows.shape[1]
    bs = (block_sizes or BlockSizes()).clamped(max_pages * epp, heads)
    ppb = min(bs.pages_per_block(epp), max_pages)
    layers = jnp.concatenate([layer_index(window_layer), layer_index(c128_layer)])

    kernel = functools.partial(
        _kernel, pages_per_block=ppb, entries_per_page=epp, max_pages=max_pages, ratio=ratio,
        window=window_len, scale=dim**-0.5)
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5,
            grid=(batch,),
            in_specs=[
                *tpu_pipeline.query_window_specs(heads, dim, window_len),
                pl.BlockSpec(memory_space=pl.ANY),
            ],
            out_specs=tpu_pipeline.per_row((heads, dim)),
            scratch_shapes=[pltpu.VMEM((2, ppb * epp, dim), c128.dtype),
                            pltpu.SemaphoreType.DMA((2,))],
        ),
        out_shape=jax.ShapeDtypeStruct((batch, heads, dim), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=tpu_interpret(interpret),
        name="v4kv_hca_dense_decode_attention",
    )(layers, q_pos.astype(jnp.int32), kv_end.astype(jnp.int32), slot_ids.astype(jnp.int32),
      page_rows.astype(jnp.int32).reshape(-1), q.astype(jnp.float32),
      sink.astype(jnp.float32).reshape(heads, 1), lane_freq, window, c128)
