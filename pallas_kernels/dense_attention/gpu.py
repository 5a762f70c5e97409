"""HCA dense decode attention, GPU (Pallas lowered through Triton).

Grid: (slot, head block, split). A program folds the window ring (split 0 only) and its
share of the visible C128 entries, `entries_per_block` at a time: entry e sits at page
`page_rows[slot, e // (P/m')]`, row `e % (P/m')`, and each tile is one gathered load.
Programs write partial softmax states; XLA merges the splits with the sink and de-rotates.
Loops run to the slot's visible entries only, so the work follows the length.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import decode
from pallas_kernels.common import (
    MASK_VALUE,
    MIN_DOT,
    check_power_of_two,
    lane_frequencies,
    layer_index,
)
from pallas_kernels.dense_attention.blocks import BlockSizes
from pallas_kernels.gpu_split_k import split_k_decode

# Triton keeps tiles in registers: 32 entries of hd = 512 per tile; 8 splits keep enough
# programs in flight for a few slots at long context.
DEFAULT_BLOCK_SIZES = BlockSizes(entries_per_block=32, heads_per_block=16, num_splits=8)


def _kernel(layers_ref, slot_ref, q_pos_ref, kv_end_ref, table_ref, q_ref, window_ref, c128_ref,
            acc_ref, m_ref, l_ref, *, block: int, num_splits: int, entries_per_page: int,
            max_pages: int, ratio: int, window: int, window_block: int, scale: float):
    b, split = pl.program_id(0), pl.program_id(2)
    q = q_ref[...].astype(jnp.float32)
    heads = q.shape[0]
    q_pos, kv_end = q_pos_ref[b], kv_end_ref[b]
    state = (jnp.full((heads, 1), MASK_VALUE, jnp.float32), jnp.zeros((heads, 1), jnp.float32),
             jnp.zeros(q.shape, jnp.float32))

    def fold_window(state):
        for first in range(0, window, window_block):  # tiles of the ring, not all W rows
            ring = window_ref[layers_ref[0], slot_ref[b], pl.ds(first, window_block), :]
            state = decode.fold_window(state, q, ring, q_pos, kv_end, window, scale, first)
        return state

    state = jax.lax.cond(split == 0, fold_window, lambda s: s, state)

    visible = jnp.minimum((q_pos + 1) // ratio, kv_end // ratio)
    num_blocks = (visible + block - 1) // block
    per_split = (num_blocks + num_splits - 1) // num_splits
    first = split * per_split
    last = jnp.minimum(first + per_split, num_blocks)
    layer = layers_ref[1]

    def body(j, state):
        entry = j * block + jnp.arange(block, dtype=jnp.int32)
        page = table_ref[b, jnp.minimum(entry // entries_per_page, max_pages - 1)]
        valid = (entry < visible) & (page >= 0)
        keys = c128_ref[layer, jnp.maximum(page, 0), entry % entries_per_page, :]
        keys = jnp.where(valid[:, None], keys.astype(jnp.float32), 0.0)
        return decode.fold(state, q, keys, valid[None, :], scale)

    m, denom, acc = jax.lax.fori_loop(first, last, body, state)
    acc_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = denom


@functools.partial(jax.jit, static_argnames=("ratio", "block_sizes", "interpret", "num_warps",
                                             "num_stages"))
def dense_decode_attention(q, sink, window, window_layer, slot_ids, q_pos, kv_end, c128,
                           c128_layer, page_rows, inv_freq, *, ratio: int,
                           block_sizes: BlockSizes | None = None, interpret: bool = False,
                           num_warps: int = 4, num_stages: int = 2):
    """Same contract as `pallas_kernels.dense_attention.tpu.dense_decode_attention`."""
    batch, heads, dim = q.shape
    _, _, window_len, _ = window.shape
    lane_freq = lane_frequencies(inv_freq, dim)
    epp, max_pages = c128.shape[2], page_rows.shape[1]
    bs = (block_sizes or DEFAULT_BLOCK_SIZES).clamped(max_pages * epp, heads)
    block, bh = max(bs.entries_per_block, MIN_DOT), max(bs.heads_per_block, MIN_DOT)
    check_power_of_two(head_dim=dim, window=window_len,
                       entries_per_block=block, heads_per_block=bh)
    padded_heads = -(-heads // bh) * bh
    q = jnp.pad(q.astype(jnp.float32), ((0, 0), (0, padded_heads - heads), (0, 0)))
    splits = bs.num_splits
    layers = jnp.concatenate([layer_index(window_layer), layer_index(c128_layer)])

    scalars = (layers, slot_ids.astype(jnp.int32), q_pos.astype(jnp.int32),
               kv_end.astype(jnp.int32), page_rows.astype(jnp.int32))
    kernel = functools.partial(_kernel, block=block, num_splits=splits, entries_per_page=epp,
                               max_pages=max_pages, ratio=ratio, window=window_len,
                               window_block=min(block, window_len), scale=dim**-0.5)
    return split_k_decode(kernel, scalars, q, window, c128, sink, q_pos, lane_freq,
                          heads=heads, heads_per_block=bh, num_splits=splits,
                          num_warps=num_warps, num_stages=num_stages, interpret=interpret,
                          name="v4kv_hca_dense_decode_attention_gpu")
