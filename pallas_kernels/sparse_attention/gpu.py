"""CSA sparse decode attention, GPU (Pallas lowered through Triton).

Grid: (slot, head block, split). A program folds the window ring (split 0 only) and its
share of the top-k picks, `picks_per_block` at a time: the picks' pages come from the page
table row and each tile of C4 rows is gathered straight from the pool's planes as stored
(entry e of a page from the lanes its parts give it, `formats.gpu_loader`; words decoded
into planes in registers, `formats.decode_gpu`). Programs write partial softmax states
(accumulator planes, max, sum); XLA merges the splits with the sink, puts the planes back in
natural order and de-rotates the output (a lane-pair exchange has no Triton equivalent in
Pallas).

Layout read (`v4kv_jax.pools.lanes`):
  window  planes [n_layers, max_slots, rows, lanes]   ring rows gathered per tile
  c4      planes [n_csa, num_pages, rows, lanes]      picked entries gathered per tile

Triton tensors have power-of-two shapes, and its matmul at least 16 rows and columns: heads
and picks are padded (zero queries, -1 picks) up to the block sizes.
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
    present_picks,
)
from pallas_kernels.sparse_attention.blocks import BlockSizes


def supported(model, geometry, spec=None) -> str | None:
    """Why this GPU kernel cannot run a config, or None: it reads V4's storage formats
    (words gathered where the lane maps put them, decoded in registers), not V4.1's nvfp4
    entries or mxfp8 window, and a key row and the window are Triton tensors (powers of
    two)."""
    del spec
    for field in ("entry_dtype", "window_dtype"):
        fmt = getattr(geometry, field)
        if fmt in formats.RECORDS41:
            return f"{field}={fmt!r} is decoded by the TPU kernel only"
    return power_of_two_problem(head_dim=model.head_dim, window=model.window)


# Triton keeps tiles in registers: 32 rows of hd = 512 per tile; 4 splits of the k picks.
DEFAULT_BLOCK_SIZES = BlockSizes(picks_per_block=32, heads_per_block=16, num_splits=4)


def _kernel(layers_ref, slot_ref, q_pos_ref, kv_end_ref, blocks_ref, table_ref, picks_ref, *refs,
            groups: decode.KeyGroups, block: int, num_splits: int, entries_per_page: int,
            window: int, window_block: int, scale: float):
    n = len(groups.layouts)
    entry_lay = groups.entries_layout
    nw, ne = len(groups.window_layout.parts), len(entry_lay.parts)
    q_refs, window_refs = refs[:n], refs[n:n + nw]
    c4_refs, out_refs = refs[n + nw:n + nw + ne], refs[n + nw + ne:]
    b, split = pl.program_id(0), pl.program_id(2)
    q = groups.load_queries(q_refs)
    q_pos, kv_end = q_pos_ref[b], kv_end_ref[b]
    state = gpu_split_k.first_state(split, groups, q, window_refs, layers_ref[0], slot_ref[b],
                                    q_pos, kv_end, window=window, window_block=window_block,
                                    scale=scale)

    num_blocks = blocks_ref[b]
    per_split = (num_blocks + num_splits - 1) // num_splits
    first = split * per_split
    last = jnp.minimum(first + per_split, num_blocks)
    layer = layers_ref[1]
    g = groups.entries

    def body(j, state):
        picks = picks_ref[b, pl.ds(j * block, block)]
        valid = picks >= 0
        pick = jnp.maximum(picks, 0)
        page = jnp.maximum(table_ref[b, pick // entries_per_page], 0)
        load = formats.gpu_loader(entry_lay, c4_refs, (layer, page), pick % entries_per_page)
        keys = formats.decode_gpu(entry_lay, load)
        keys = [jnp.where(valid[:, None], k, 0.0) for k in keys]
        return decode.fold(state, q[g], keys, valid[None, :], scale, g)

    state = jax.lax.fori_loop(first, last, body, state)
    gpu_split_k.write_state(state, out_refs[:n], *out_refs[n:])


@functools.partial(jax.jit, static_argnames=("block_sizes", "interpret", "num_warps",
                                             "num_stages", "entry_format", "window_format",
                                             "rope_dim", "entry_lanes", "window_lanes"))
def sparse_decode_attention(q, sink, window, window_layer, slot_ids, q_pos, kv_end, c4,
                            c4_layer, page_rows, picks, inv_freq, *,
                            block_sizes: BlockSizes | None = None, interpret: bool = False,
                            num_warps: int = 4, num_stages: int = 2,
                            entry_format: str = "float32", window_format: str = "float32",
                            rope_dim: int = 0, entry_lanes=(), window_lanes=()):
    """Same contract as `pallas_kernels.sparse_attention.tpu.sparse_decode_attention`
    (`window` and `c4` tuples of planes, their lane maps in `window_lanes` and
    `entry_lanes`), and the Triton launch parameters `num_warps`, `num_stages`."""
    batch, heads, dim = q.shape
    window, c4 = tuple(window), tuple(c4)
    lane_freq = lane_frequencies(inv_freq, dim)
    groups = decode.KeyGroups.of(
        formats.layout(window_format, dim, rope_dim, "gpu", window_lanes),
        formats.layout(entry_format, dim, rope_dim, "gpu", entry_lanes))
    window_lay, entry_lay = groups.window_layout, groups.entries_layout
    formats.check_stored(window_lay, window, "window")
    formats.check_stored(entry_lay, c4, "c4")
    window_len, epp = formats.records_of(window_lay, window), formats.records_of(entry_lay, c4)
    picks = present_picks(page_rows, picks, epp)
    topk = picks.shape[1]
    bs = (block_sizes or DEFAULT_BLOCK_SIZES).clamped(topk, heads)
    block, bh = max(bs.picks_per_block, MIN_DOT), max(bs.heads_per_block, MIN_DOT)
    check_power_of_two(head_dim=dim, window=window_len,
                       picks_per_block=block, heads_per_block=bh)
    padded = -(-topk // block) * block
    picks = jnp.pad(picks.astype(jnp.int32), ((0, 0), (0, padded - topk)), constant_values=-1)
    last = jnp.max(jnp.where(picks >= 0, jnp.arange(padded, dtype=jnp.int32) + 1, 0), axis=1)
    blocks = (last + block - 1) // block
    splits = bs.num_splits
    layers = jnp.concatenate([layer_index(window_layer), layer_index(c4_layer)])

    scalars = (layers, slot_ids.astype(jnp.int32), q_pos.astype(jnp.int32),
               kv_end.astype(jnp.int32), blocks, page_rows.astype(jnp.int32), picks)
    kernel = functools.partial(_kernel, groups=groups, block=block, num_splits=splits,
                               entries_per_page=epp, window=window_len,
                               window_block=min(block, window_len), scale=dim**-0.5)
    return gpu_split_k.split_k_decode(
        kernel, scalars, groups, q, window, c4, sink, q_pos, lane_freq, heads_per_block=bh,
        num_splits=splits, num_warps=num_warps, num_stages=num_stages, interpret=interpret,
        name="v4kv_csa_sparse_decode_attention_gpu")


def sparse_decode41(q, sink, window, window_layer, slot_ids, q_pos, entries, page_rows, ids,
                    valid, *, block_sizes: BlockSizes | None = None, interpret: bool = False,
                    entry_format: str = "float32", window_format: str = "float32",
                    entry_lanes=(), window_lanes=()):
    """Same contract as `pallas_kernels.sparse_attention.tpu.sparse_decode41` (float rows
    only, see `supported`)."""
    return sparse_decode_attention(
        q, sink, window, window_layer, slot_ids, q_pos, q_pos + 1,
        tuple(x[None] for x in entries), 0, page_rows, jnp.where(valid, ids, -1),
        jnp.zeros((1,), jnp.float32), block_sizes=block_sizes, interpret=interpret,
        entry_format=entry_format, window_format=window_format, entry_lanes=entry_lanes,
        window_lanes=window_lanes)
