"""CSA sparse decode attention, TPU (Mosaic).

Grid: one program per slot. Scalar-prefetched: the layer indices, query positions, sequence
lengths, slot ids (they pick the window ring block), the page table and the top-k picks. The
C4 pool stays in HBM (`pl.ANY`); each valid pick is one row copy `c4[layer, page, row]` into
a double-buffered VMEM batch of `picks_per_block` rows, the next batch in flight while the
current one is decoded (packed rows: into planes, `formats.decode_tpu`) and folded into the
online softmax. -1 picks copy nothing (their row is zeroed), and batches past the last valid
pick are never visited. Outputs are written as planes; XLA puts them in natural order and
de-rotates.

Layout read:
  window  [n_layers, max_slots, W, S]   block (layer, slot) through the index map
  c4      [n_csa, num_pages, P // m, S] row copies (S: hd, or the packed row's words)
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
    lane_frequencies,
    layer_index,
    nbytes,
    present_picks,
    tpu_interpret,
    tpu_row_copy_problem,
)
from pallas_kernels.sparse_attention.blocks import BlockSizes


def supported(model, geometry, spec=None) -> str | None:
    """Why this TPU kernel cannot run a config, or None: it copies each picked C4 entry as
    one row, which Mosaic cannot do for 16-bit entries."""
    del model, spec
    return tpu_row_copy_problem(entry_dtype=geometry.entry_dtype)


def _kernel(layers_ref, q_pos_ref, kv_end_ref, slot_ref, table_ref, picks_ref, blocks_ref,
            *refs, groups: decode.KeyGroups, block: int, padded_topk: int,
            entries_per_page: int, max_pages: int, window: int, scale: float):
    del slot_ref  # consumed by the window block's index map
    n = len(groups.layouts)
    q_refs, (sink_ref, window_ref, pick_rows_ref, c4_hbm) = refs[:n], refs[n:n + 4]
    o_refs, (buf, sems) = refs[n + 4:2 * n + 4], refs[2 * n + 4:]
    b = pl.program_id(0)
    layer = layers_ref[1]
    q_pos, kv_end = q_pos_ref[b], kv_end_ref[b]

    def row_copy(j, i, slot):
        pick = jnp.maximum(picks_ref[b * padded_topk + j * block + i], 0)
        page = jnp.maximum(table_ref[b * max_pages + jax.lax.div(pick, entries_per_page)], 0)
        src = c4_hbm.at[layer, page, pl.ds(jax.lax.rem(pick, entries_per_page), 1)]
        return pltpu.make_async_copy(src, buf.at[slot, pl.ds(i, 1)], sems.at[slot])

    def valid(j, i):
        return picks_ref[b * padded_topk + j * block + i] >= 0

    def zero_row(j, i, slot):  # -1 picks copy nothing; their row must still be finite
        buf[slot, pl.ds(i, 1), :] = jnp.zeros((1, buf.shape[-1]), buf.dtype)

    start, wait = tpu_pipeline.block_copies(row_copy, valid, block, on_skip=zero_row)

    q = groups.load_queries(q_refs)
    gw, ge = groups.window, groups.entries
    ring = formats.decode_tpu(groups.layouts[gw], window_ref[...])
    state = decode.fold_window(decode.sink_state(groups, sink_ref[...]), q[gw], ring, q_pos,
                               kv_end, window, scale, group=gw)

    def body(j, slot, state):
        visible = pick_rows_ref[pl.ds(j, 1), :] >= 0
        keys = formats.decode_tpu(groups.layouts[ge], buf[slot])
        return decode.fold(state, q[ge], keys, visible, scale, ge)

    state = tpu_pipeline.double_buffered(blocks_ref[b], start, wait, body, state)
    tpu_pipeline.write_output(o_refs, state)


@functools.partial(jax.jit, static_argnames=("block_sizes", "interpret", "entry_format",
                                             "window_format", "rope_dim"))
def sparse_decode_attention(q, sink, window, window_layer, slot_ids, q_pos, kv_end, c4,
                            c4_layer, page_rows, picks, inv_freq, *,
                            block_sizes: BlockSizes | None = None, interpret: bool = False,
                            entry_format: str = "float", window_format: str = "float",
                            rope_dim: int = 0):
    """One decode query per slot over its window and its top-k C4 entries.

    Args:
      q: f32[B, H, hd] queries (RoPE applied). sink: f32[H].
      window: [n_layers, max_slots, W, S] the window rings as stored; window_layer: global
        layer.
      slot_ids, q_pos, kv_end: i32[B] slot, query position and sequence length per row.
      c4: [n_csa, num_pages, P // m, S] as stored; c4_layer: index in the CSA stack.
      page_rows: i32[B, max_pages_per_seq]; picks: i32[B, k] entry ids, -1 = none (a pick whose
        page is absent counts as none).
      inv_freq: f32[r // 2], the RoPE frequencies of the layer kind (`rope.inv_frequencies`).
      entry_format, window_format: storage formats of c4 and of the window (a float dtype
        name, read as stored, or "fp8_latent": uint32 rows decoded in the kernel; S is
        `formats.Layout.stored_width`); rope_dim: r, the RoPE dims of fp8_latent rows.

    Returns:
      f32[B, H, hd], de-rotated by -q_pos.
    """
    batch, heads, dim = q.shape
    _, _, window_len, window_width = window.shape
    lane_freq = lane_frequencies(inv_freq, dim)
    groups = decode.KeyGroups.of(formats.layout(window_format, dim, rope_dim, "tpu"),
                                 formats.layout(entry_format, dim, rope_dim, "tpu"))
    formats.check_stored(groups.layouts[groups.window], window, "window")
    formats.check_stored(groups.layouts[groups.entries], c4, "c4")
    picks = present_picks(page_rows, picks, c4.shape[2])
    topk, epp, max_pages = picks.shape[1], c4.shape[2], page_rows.shape[1]
    bs = (block_sizes or BlockSizes()).clamped(topk, heads)
    block = bs.picks_per_block
    padded = -(-topk // block) * block
    picks = jnp.pad(picks.astype(jnp.int32), ((0, 0), (0, padded - topk)), constant_values=-1)
    last = jnp.max(jnp.where(picks >= 0, jnp.arange(padded, dtype=jnp.int32) + 1, 0), axis=1)
    blocks = (last + block - 1) // block
    layers = jnp.concatenate([layer_index(window_layer), layer_index(c4_layer)])

    kernel = functools.partial(
        _kernel, groups=groups, block=block, padded_topk=padded, entries_per_page=epp,
        max_pages=max_pages, window=window_len, scale=dim**-0.5)
    outs = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=7,
            grid=(batch,),
            in_specs=[
                *tpu_pipeline.query_window_specs(groups, heads, window_len, window_width),
                tpu_pipeline.per_row((padded // block, block)),
                pl.BlockSpec(memory_space=pl.ANY),
            ],
            out_specs=tpu_pipeline.output_specs(groups, heads),
            scratch_shapes=[pltpu.VMEM((2, block, c4.shape[-1]), c4.dtype),
                            pltpu.SemaphoreType.DMA((2,))],
        ),
        out_shape=tpu_pipeline.output_shapes(groups, batch, heads),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=tpu_interpret(interpret),
        name="v4kv_csa_sparse_decode_attention",
        cost_estimate=cost_estimate(
            flops=4 * batch * heads * dim * (topk + window_len),
            transcendentals=batch * heads * (topk + window_len),
            bytes_accessed=batch * (topk * nbytes(c4, 1) + nbytes(window, 2)
                                    + 2 * heads * dim * 4)),
    )(layers, q_pos.astype(jnp.int32), kv_end.astype(jnp.int32), slot_ids.astype(jnp.int32),
      page_rows.astype(jnp.int32).reshape(-1), picks.reshape(-1), blocks,
      *groups.queries(q), sink.astype(jnp.float32).reshape(heads, 1), window,
      picks.reshape(batch, padded // block, block), c4)
    return groups.output(outs, q_pos, lane_freq)
