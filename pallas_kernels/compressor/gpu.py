"""Compressor emission, GPU (Pallas lowered through Triton).

Grid: (layer, slot row, step of `blocks_per_step` blocks); steps whose first block does not
complete do nothing. A program gathers its slot rows straight from the chunk or the tail
ring ([blocks, slots, channels] tiles, `channels_per_step` channels per pass), pools them,
and after the RMSNorm (whose sum of squares spans all passes) rotates and stores each pass
with a masked scatter into the pool, aliased to the output (in place when donated).

RoPE needs the partner lane of each pair; pooling and the norm act per channel, so the
partner values are pooled from a second gather of the pair-exchanged columns (served from
cache) instead of a lane shuffle, which Triton does not expose in Pallas.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from pallas_kernels import formats
from pallas_kernels.common import (
    check_power_of_two,
    lane_frequencies,
    rotate_lanes,
    triton_compiler_params,
)
from pallas_kernels.compressor.blocks import BlockSizes
from pallas_kernels.compressor.pooling import softmax_pool

# Packed pool formats this kernel encodes itself: none yet (`v4kv_jax.ops` routes emission
# into packed pools to the reference).
WRITES_PACKED = ()

# Tiles of [blocks, slots, 32 channels] with blocks * slots <= 128 (4K values per gather).
DEFAULT_BLOCK_SIZES = BlockSizes(blocks_per_step=64, slot_rows_per_step=128, channels_per_step=32)


def _kernel(layers_ref, slot_ref, start_ref, n_new_ref, table_ref, norm_ref, freq_ref, kv_ref,
            gate_ref, ring_kv_ref, ring_gate_ref, pool_in_ref, pool_ref, *, ratio: int,
            overlap: bool, blocks_per_step: int, channels: int, tokens: int, max_pages: int,
            eps: float):
    del pool_in_ref  # aliased to pool_ref
    li, b, t = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    m = ratio
    width = pool_ref.shape[-1]
    slots, ring = (2 * m, 2 * m) if overlap else (m, m)
    epp = pool_ref.shape[2]
    start = start_ref[b]
    end = start + n_new_ref[b]
    block0 = start // m + t * blocks_per_step

    @pl.when((block0 + 1) * m <= end)
    def _():
        layer, slot = layers_ref[li], slot_ref[b]
        shape = (blocks_per_step, slots, channels)

        def iota(shape, axis):
            return jax.lax.broadcasted_iota(jnp.int32, shape, axis)

        def slot_grid(shape):  # (position, block completes) of each slot row
            block = block0 + iota(shape, 0)
            pos = block * m - (m if overlap else 0) + iota(shape, 1)
            return pos, (block + 1) * m <= end

        pos, _ = slot_grid(shape)
        rows_pos, rows_done = slot_grid((blocks_per_step, slots, 1))
        valid = (rows_pos >= 0) & rows_done
        block_done = (block0 + iota((blocks_per_step, 1, 1), 0) + 1) * m <= end
        old = pos < start
        ring_row = jnp.maximum(pos, 0) % ring
        chunk_row = jnp.clip(pos - start, 0, tokens - 1)
        half = jnp.where(iota(shape, 1) >= m, width, 0) if overlap else 0

        def pooled(c0, swap):
            lane = c0 + iota(shape, 2)
            col = half + (lane ^ 1 if swap else lane)

            def read(chunk_ref, tail_ref):
                new = chunk_ref[li, b, chunk_row, col].astype(jnp.float32)
                return jnp.where(old, tail_ref[layer, slot, ring_row, col].astype(jnp.float32),
                                 new)

            return softmax_pool(read(kv_ref, ring_kv_ref), read(gate_ref, ring_gate_ref), valid,
                                block_done)

        parts, sum_sq = [], 0.0
        for c0 in range(0, width, channels):
            x = pooled(c0, swap=False)
            parts.append((c0, x, pooled(c0, swap=True)))
            sum_sq = sum_sq + jnp.sum(jnp.square(x), axis=-1, keepdims=True)
        inv_rms = jax.lax.rsqrt(sum_sq / width + eps)

        row_block = block0 + iota((blocks_per_step, 1), 0)
        col = jax.lax.div(row_block, epp)
        page = table_ref[b, jnp.minimum(col, max_pages - 1)]
        row = jax.lax.rem(row_block, epp)
        keep = ((row_block + 1) * m <= end) & (col < max_pages) & (page >= 0)
        for c0, x, x_swapped in parts:
            lanes = c0 + iota((1, channels), 1)
            y = x * inv_rms * norm_ref[li, lanes]
            y_swapped = x_swapped * inv_rms * norm_ref[li, lanes ^ 1]
            angle = (row_block * m).astype(jnp.float32) * freq_ref[0, lanes]
            entry = rotate_lanes(y, y_swapped, angle).astype(pool_ref.dtype)
            target = pool_ref.at[layer, jnp.broadcast_to(jnp.maximum(page, 0), entry.shape),
                                 jnp.broadcast_to(row, entry.shape),
                                 jnp.broadcast_to(lanes, entry.shape)]
            pl_triton.store(target, entry, mask=jnp.broadcast_to(keep, entry.shape))


@functools.partial(jax.jit, static_argnames=("ratio", "overlap", "eps", "block_sizes",
                                             "interpret", "num_warps", "num_stages",
                                             "entry_format", "rope_dim"),
                   donate_argnames=("pool",))
def emit_entries(pool, page_rows, layers, tail_kv, tail_gate, slot_ids, kv, gate, start, n_new,
                 norm, inv_freq, *, ratio: int, overlap: bool, eps: float,
                 block_sizes: BlockSizes | None = None, interpret: bool = False,
                 num_warps: int = 4, num_stages: int = 1, entry_format: str = "float",
                 rope_dim: int = 0):
    """Same contract as `pallas_kernels.compressor.tpu.emit_entries`, for float pools only
    (`WRITES_PACKED`)."""
    if entry_format in formats.PACKED:
        raise ValueError(f"entry_format={entry_format!r}: the GPU compressor kernel writes "
                         f"float pools only")
    del rope_dim
    n, batch, tokens, _ = kv.shape
    width = pool.shape[-1]
    lane_freq = lane_frequencies(inv_freq, width)
    slots = 2 * ratio if overlap else ratio
    blocks = -(-tokens // ratio)
    bs = (block_sizes or DEFAULT_BLOCK_SIZES).for_gpu(blocks, slots, width)
    check_power_of_two(width=width, slots=slots)
    steps = -(-blocks // bs.blocks_per_step)
    kernel = functools.partial(
        _kernel, ratio=ratio, overlap=overlap, blocks_per_step=bs.blocks_per_step,
        channels=bs.channels_per_step, tokens=tokens, max_pages=page_rows.shape[1], eps=eps)
    args = (layers.astype(jnp.int32), slot_ids.astype(jnp.int32), start.astype(jnp.int32),
            n_new.astype(jnp.int32), page_rows.astype(jnp.int32), norm.astype(jnp.float32),
            lane_freq, kv, gate, tail_kv, tail_gate, pool)

    def whole(x):
        return pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)

    return pl.pallas_call(
        kernel,
        grid=(n, batch, steps),
        in_specs=[whole(x) for x in args],
        out_specs=whole(pool),
        out_shape=jax.ShapeDtypeStruct(pool.shape, pool.dtype),
        input_output_aliases={len(args) - 1: 0},
        compiler_params=triton_compiler_params(num_warps, num_stages),
        interpret=interpret,
        name="v4kv_compress_emit_gpu",
    )(*args)
