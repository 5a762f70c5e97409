"""HCA dense decode attention, GPU (Pallas lowered through Triton).

Grid: (slot, head block, split). A program folds the window ring (split 0 only) and its
share of the visible C128 entries, `entries_per_block` at a time: entry e sits at page
`page_rows[slot, e // (P/m')]`, record `e % (P/m')` of the page, and each tile is gathered
straight from the pool's planes as stored (a record's words from the lanes its parts give
them, `formats.gpu_loader`; decoded into planes in registers, `formats.decode_gpu`).
Programs write partial softmax states; XLA merges the splits with the sink and de-rotates.
Loops run to the slot's visible entries only, so the work follows the length.

Layout read (`v4kv_jax.pools.lanes`):
  window  planes [n_layers, max_slots, rows, lanes]   ring rows gathered per tile
  c128    planes [n_hca, num_pages, rows, lanes]      visible entries gathered per tile
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
    """Why this GPU kernel cannot run a config, or None: it reads every storage format (words
    gathered where the lane maps put them, decoded in registers), but a key row and the
    window are Triton tensors (powers of two)."""
    del geometry, spec
    return power_of_two_problem(head_dim=model.head_dim, window=model.window)


# Triton keeps tiles in registers: 32 entries of hd = 512 per tile; 8 splits keep enough
# programs in flight for a few slots at long context.
DEFAULT_BLOCK_SIZES = BlockSizes(entries_per_block=32, heads_per_block=16, num_splits=8)


def _kernel(layers_ref, slot_ref, q_pos_ref, kv_end_ref, table_ref, *refs,
            groups: decode.KeyGroups, block: int, num_splits: int, entries_per_page: int,
            max_pages: int, ratio: int, window: int, window_block: int, scale: float):
    n = len(groups.layouts)
    entry_lay = groups.entries_layout
    nw, ne = len(groups.window_layout.parts), len(entry_lay.parts)
    q_refs, window_refs = refs[:n], refs[n:n + nw]
    c128_refs, out_refs = refs[n + nw:n + nw + ne], refs[n + nw + ne:]
    b, split = pl.program_id(0), pl.program_id(2)
    q = groups.load_queries(q_refs)
    q_pos, kv_end = q_pos_ref[b], kv_end_ref[b]
    state = gpu_split_k.first_state(split, groups, q, window_refs, layers_ref[0], slot_ref[b],
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
        load = formats.gpu_loader(entry_lay, c128_refs, (layer, jnp.maximum(page, 0)),
                                  entry % entries_per_page)
        keys = formats.decode_gpu(entry_lay, load)
        keys = [jnp.where(valid[:, None], k, 0.0) for k in keys]
        return decode.fold(state, q[g], keys, valid[None, :], scale, g)

    state = jax.lax.fori_loop(first, last, body, state)
    gpu_split_k.write_state(state, out_refs[:n], *out_refs[n:])


@functools.partial(jax.jit, static_argnames=("ratio", "block_sizes", "interpret", "num_warps",
                                             "num_stages", "entry_format", "window_format",
                                             "rope_dim", "entry_lanes", "window_lanes"))
def dense_decode_attention(q, sink, window, window_layer, slot_ids, q_pos, kv_end, c128,
                           c128_layer, page_rows, inv_freq, *, ratio: int,
                           block_sizes: BlockSizes | None = None, interpret: bool = False,
                           num_warps: int = 4, num_stages: int = 2,
                           entry_format: str = "float32", window_format: str = "float32",
                           rope_dim: int = 0, entry_lanes=(), window_lanes=()):
    """Same contract as `pallas_kernels.dense_attention.tpu.dense_decode_attention`
    (`window` and `c128` tuples of planes, their lane maps in `window_lanes` and
    `entry_lanes`), and the Triton launch parameters `num_warps`, `num_stages`."""
    batch, heads, dim = q.shape
    window, c128 = tuple(window), tuple(c128)
    lane_freq = lane_frequencies(inv_freq, dim)
    groups = decode.KeyGroups.of(
        formats.layout(window_format, dim, rope_dim, "gpu", window_lanes),
        formats.layout(entry_format, dim, rope_dim, "gpu", entry_lanes))
    window_lay, entry_lay = groups.window_layout, groups.entries_layout
    formats.check_stored(window_lay, window, "window")
    formats.check_stored(entry_lay, c128, "c128")
    window_len = formats.records_of(window_lay, window)
    epp, max_pages = formats.records_of(entry_lay, c128), page_rows.shape[1]
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
