"""HCA dense decode attention, GPU (Pallas lowered through Triton).

Grid: (slot, head block, split). A program folds the window ring (split 0 only) and its
share of the visible C128 entries, `entries_per_block` at a time: entry e sits at page
`page_rows[slot, e // (P/m')]`, row `e % (P/m')`, and each tile is gathered straight from
the pool as stored (packed rows decoded into planes in registers, `formats.decode_gpu`).
Programs write partial softmax states; XLA merges the splits with the sink and de-rotates.
Loops run to the slot's visible entries only, so the work follows the length.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import decode, formats, gpu_split_k
from pallas_kernels.common import (
    MIN_DOT,
    check_power_of_two,
    lane_frequencies,
    layer_index,
    power_of_two_problem,
)
from pallas_kernels.dense_attention.blocks import BlockSizes


def supported(model, geometry, spec=None) -> str | None:
    """Why this GPU kernel cannot run a config, or None: a key row and the window are Triton
    tensors."""
    del spec
    return power_of_two_problem(head_dim=model.head_dim, window=model.window)


# Triton keeps tiles in registers: 32 entries of hd = 512 per tile; 8 splits keep enough
# programs in flight for a few slots at long context.
DEFAULT_BLOCK_SIZES = BlockSizes(entries_per_block=32, heads_per_block=16, num_splits=8)


def _kernel(layers_ref, slot_ref, q_pos_ref, kv_end_ref, table_ref, *refs,
            groups: decode.KeyGroups, block: int, num_splits: int, entries_per_page: int,
            max_pages: int, ratio: int, window: int, window_block: int, scale: float):
    n = len(groups.layouts)
    q_refs, (window_ref, c128_ref), out_refs = refs[:n], refs[n:n + 2], refs[n + 2:]
    b, split = pl.program_id(0), pl.program_id(2)
    q = groups.load_queries(q_refs)
    q_pos, kv_end = q_pos_ref[b], kv_end_ref[b]
    state = gpu_split_k.first_state(split, groups, q, window_ref, layers_ref[0], slot_ref[b],
                                    q_pos, kv_end, window=window, window_block=window_block,
                                    scale=scale)

    visible = jnp.minimum((q_pos + 1) // ratio, kv_end // ratio)
    num_blocks = (visible + block - 1) // block
    per_split = (num_blocks + num_splits - 1) // num_splits
    first = split * per_split
    last = jnp.minimum(first + per_split, num_blocks)
    layer = layers_ref[1]
    g = groups.entries

    def body(j, state):
        entry = j * block + jnp.arange(block, dtype=jnp.int32)
        page = table_ref[b, jnp.minimum(entry // entries_per_page, max_pages - 1)]
        valid = (entry < visible) & (page >= 0)
        load = gpu_split_k.row_loader(c128_ref, (layer,),
                                      (jnp.maximum(page, 0), entry % entries_per_page))
        keys = formats.decode_gpu(groups.layouts[g], load)
        keys = [jnp.where(valid[:, None], k, 0.0) for k in keys]
        return decode.fold(state, q[g], keys, valid[None, :], scale, g)

    state = jax.lax.fori_loop(first, last, body, state)
    gpu_split_k.write_state(state, out_refs[:n], *out_refs[n:])


@functools.partial(jax.jit, static_argnames=("ratio", "block_sizes", "interpret", "num_warps",
                                             "num_stages", "entry_format", "window_format",
                                             "rope_dim"))
def dense_decode_attention(q, sink, window, window_layer, slot_ids, q_pos, kv_end, c128,
                           c128_layer, page_rows, inv_freq, *, ratio: int,
                           block_sizes: BlockSizes | None = None, interpret: bool = False,
                           num_warps: int = 4, num_stages: int = 2,
                           entry_format: str = "float", window_format: str = "float",
                           rope_dim: int = 0):
    """Same contract as `pallas_kernels.dense_attention.tpu.dense_decode_attention`."""
    batch, heads, dim = q.shape
    _, _, window_len, _ = window.shape
    lane_freq = lane_frequencies(inv_freq, dim)
    groups = decode.KeyGroups.of(formats.layout(window_format, dim, rope_dim, "gpu"),
                                 formats.layout(entry_format, dim, rope_dim, "gpu"))
    formats.check_stored(groups.layouts[groups.window], window, "window")
    formats.check_stored(groups.layouts[groups.entries], c128, "c128")
    epp, max_pages = c128.shape[2], page_rows.shape[1]
    bs = (block_sizes or DEFAULT_BLOCK_SIZES).clamped(max_pages * epp, heads)
    block, bh = max(bs.entries_per_block, MIN_DOT), max(bs.heads_per_block, MIN_DOT)
    check_power_of_two(head_dim=dim, window=window_len,
                       entries_per_block=block, heads_per_block=bh)
    splits = bs.num_splits
    layers = jnp.concatenate([layer_index(window_layer), layer_index(c128_layer)])

    scalars = (layers, slot_ids.astype(jnp.int32), q_pos.astype(jnp.int32),
               kv_end.astype(jnp.int32), page_rows.astype(jnp.int32))
    kernel = functools.partial(_kernel, groups=groups, block=block, num_splits=splits,
                               entries_per_page=epp, max_pages=max_pages, ratio=ratio,
                               window=window_len, window_block=min(block, window_len),
                               scale=dim**-0.5)
    return gpu_split_k.split_k_decode(
        kernel, scalars, groups, q, window, c128, sink, q_pos, lane_freq, heads_per_block=bh,
        num_splits=splits, num_warps=num_warps, num_stages=num_stages, interpret=interpret,
        name="v4kv_hca_dense_decode_attention_gpu")
