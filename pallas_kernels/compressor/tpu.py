"""Compressor emission, TPU (Mosaic).

Grid: (layer, slot row, step of `blocks_per_step` blocks). Scalar-prefetched: the layers of
the kind's stack, slot ids, lengths before the chunk, tokens appended and the page table.
Inputs stay in HBM (`pl.ANY`). For each block that completes, its slot rows are copied into
VMEM as runs of m rows (one half of a CSA row each): a run inside the chunk or inside the
tail ring is one copy, the one run that straddles the chunk start is copied row by row.
Pooling, RMSNorm and RoPE run on all blocks of the step at once ([blocks, slots, width]);
each entry (encoded in the kernel when the pool is packed, `formats.encode_tpu`) is then
copied to its page and row of the pool, which is aliased to the output
(in place when the caller donates it). Steps whose first block does not complete do nothing.

Layout:
  kv, gate        [n, B, T, in_width]           the chunk (gate biased), read
  tail kv, gate   [n_kind, max_slots, ring, in_width]   ring before the chunk, read
  pool            [n_kind, num_pages, P // m, S]        written row by row (S: width, or
                                                        the packed row's words)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import formats
from pallas_kernels.common import (
    lane_frequencies,
    rotate_lanes,
    swap_pairs_tpu,
    tpu_interpret,
)
from pallas_kernels.compressor.blocks import BlockSizes
from pallas_kernels.compressor.pooling import softmax_pool

# Packed pool formats this kernel encodes itself (`v4kv_jax.ops` routes the others to the
# reference).
WRITES_PACKED = ("fp8_latent", "fp4_index")


def _kernel(layers_ref, slot_ref, start_ref, n_new_ref, table_ref, norm_ref, freq_ref, kv_hbm,
            gate_hbm, ring_kv_hbm, ring_gate_hbm, pool_in_hbm, pool_hbm, ring_a, ring_z,
            chunk_a, chunk_z, out_buf, in_sem, out_sem, *, ratio: int, overlap: bool,
            blocks_per_step: int, max_pages: int, eps: float, entries: formats.Layout):
    del pool_in_hbm  # aliased to pool_hbm
    li, b, t = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    layer, slot = layers_ref[li], slot_ref[b]
    start = start_ref[b]
    end = start + n_new_ref[b]
    m, width = ratio, entries.width
    ring = 2 * m if overlap else m
    epp = pool_hbm.shape[2]
    block0 = jax.lax.div(start, m) + t * blocks_per_step

    def done(g):
        return (block0 + g + 1) * m <= end

    def copy_run(g, h, act):
        """Copies (act='start') or waits for (act='wait') run h of the slot rows of block
        block0 + g: m positions, columns of half h (CSA) or all of them (HCA)."""
        run = (block0 + g) * m - (m if overlap else 0) + h * m
        cols = pl.ds(h * width, width)

        def from_chunk(src_row, dst_row, rows):
            for src, dst in ((kv_hbm, chunk_a), (gate_hbm, chunk_z)):
                getattr(pltpu.make_async_copy(src.at[li, b, pl.ds(src_row, rows), cols],
                                              dst.at[g, pl.ds(dst_row, rows)], in_sem), act)()

        def from_ring(src_row, dst_row, rows):
            for src, dst in ((ring_kv_hbm, ring_a), (ring_gate_hbm, ring_z)):
                getattr(pltpu.make_async_copy(src.at[layer, slot, pl.ds(src_row, rows), cols],
                                              dst.at[g, pl.ds(dst_row, rows)], in_sem), act)()

        exists = run >= 0
        in_chunk = exists & (run >= start)
        in_ring = exists & (run + m <= start)

        @pl.when(in_chunk)
        def _():
            from_chunk(jnp.maximum(run - start, 0), h * m, m)

        @pl.when(in_ring)
        def _():
            from_ring(jax.lax.rem(jnp.maximum(run, 0), ring), h * m, m)

        @pl.when(exists & jnp.logical_not(in_chunk | in_ring))
        def _():
            def row(s, carry):
                pos = run + s

                @pl.when(pos < start)
                def _():
                    from_ring(jax.lax.rem(pos, ring), h * m + s, 1)

                @pl.when(pos >= start)
                def _():
                    from_chunk(pos - start, h * m + s, 1)

                return carry

            jax.lax.fori_loop(0, m, row, 0)

    def copy_runs(g, act):
        for h in range(2 if overlap else 1):
            copy_run(g, h, act)

    def each_done_block(fn):
        def one(g, carry):
            @pl.when(done(g))
            def _():
                fn(g)

            return carry

        jax.lax.fori_loop(0, blocks_per_step, one, 0)

    def entry_copy(g):
        block = block0 + g
        col = jax.lax.div(block, epp)
        page = table_ref[b * max_pages + jnp.minimum(col, max_pages - 1)]
        dst = pool_hbm.at[layer, jnp.maximum(page, 0), pl.ds(jax.lax.rem(block, epp), 1)]
        return (col < max_pages) & (page >= 0), pltpu.make_async_copy(
            out_buf.at[pl.ds(g, 1)], dst, out_sem)

    def write(g, act):
        present, copy = entry_copy(g)

        @pl.when(present)
        def _():
            getattr(copy, act)()

    @pl.when(done(0))
    def _():
        each_done_block(lambda g: copy_runs(g, "start"))
        each_done_block(lambda g: copy_runs(g, "wait"))
        shape = (blocks_per_step, ring_a.shape[1], 1)
        block = block0 + jax.lax.broadcasted_iota(jnp.int32, shape, 0)
        pos = block * m - (m if overlap else 0) + jax.lax.broadcasted_iota(jnp.int32, shape, 1)
        is_done = (block + 1) * m <= end
        old = pos < start
        a = jnp.where(old, ring_a[...].astype(jnp.float32), chunk_a[...].astype(jnp.float32))
        z = jnp.where(old, ring_z[...].astype(jnp.float32), chunk_z[...].astype(jnp.float32))
        x = softmax_pool(a, z, (pos >= 0) & is_done, is_done)
        y = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps)
        y = y * norm_ref[...]
        angle = (block[:, 0] * m).astype(jnp.float32) * freq_ref[...]
        rows = rotate_lanes(y, swap_pairs_tpu(y), angle)
        if entries.packed:
            out_buf[...] = formats.encode_tpu(entries, rows)
        else:
            out_buf[...] = rows.astype(out_buf.dtype)
        each_done_block(lambda g: write(g, "start"))
        each_done_block(lambda g: write(g, "wait"))


@functools.partial(jax.jit, static_argnames=("ratio", "overlap", "eps", "block_sizes",
                                             "interpret", "entry_format", "rope_dim"),
                   donate_argnames=("pool",))
def emit_entries(pool, page_rows, layers, tail_kv, tail_gate, slot_ids, kv, gate, start, n_new,
                 norm, inv_freq, *, ratio: int, overlap: bool, eps: float,
                 block_sizes: BlockSizes | None = None, interpret: bool = False,
                 entry_format: str = "float", rope_dim: int = 0):
    """Pools every block the chunk completes and writes its entry into the pool, in place.

    Args:
      pool: [n_kind, num_pages, P // m, S] (donated; aliased to the result).
      page_rows: i32[B, max_pages_per_seq] of the batch's slots.
      layers: i32[n] indices into the kind's stack.
      tail_kv, tail_gate: [n_kind, max_slots, ring, in_width], the rings before the chunk.
      slot_ids, start, n_new: i32[B] slot, length before the chunk, tokens appended.
      kv, gate: [n, B, T, in_width] the chunk (gate biased by ape), read as fp32.
      norm: f32[n, width]; inv_freq: f32[r // 2] RoPE frequencies (`rope.inv_frequencies`).
      ratio, overlap, eps: the compressor's m, overlap (CSA) and RMSNorm epsilon.
      entry_format: the pool's storage format: a float dtype name (entries rounded to the
        pool's dtype) or "fp8_latent" / "fp4_index" (uint32 rows encoded in the kernel bit
        for bit as `storage.encode_*` encodes the same fp32 entry; fp4_index rotates first);
        rope_dim: r, the RoPE dims fp8_latent keeps in bf16.

    Returns:
      The pool with the entries of completed blocks written (absent pages are skipped).
    """
    n, batch, tokens, _ = kv.shape
    width = norm.shape[-1]
    entries = formats.layout(entry_format, width, rope_dim, "tpu")
    formats.check_stored(entries, pool, "pool")
    lane_freq = lane_frequencies(inv_freq, width)
    slots = 2 * ratio if overlap else ratio
    blocks = -(-tokens // ratio)
    bs = (block_sizes or BlockSizes()).clamped(blocks, slots, width)
    per_step = bs.blocks_per_step
    steps = -(-blocks // per_step)
    kernel = functools.partial(_kernel, ratio=ratio, overlap=overlap, blocks_per_step=per_step,
                               max_pages=page_rows.shape[1], eps=eps, entries=entries)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    num_scalars = 5
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=num_scalars,
            grid=(n, batch, steps),
            in_specs=[pl.BlockSpec((None, 1, width), lambda li, b, t, *_: (li, 0, 0)),
                      pl.BlockSpec((1, width), lambda li, b, t, *_: (0, 0)),
                      any_spec, any_spec, any_spec, any_spec, any_spec],
            out_specs=any_spec,
            scratch_shapes=[pltpu.VMEM((per_step, slots, width), tail_kv.dtype),
                            pltpu.VMEM((per_step, slots, width), tail_gate.dtype),
                            pltpu.VMEM((per_step, slots, width), kv.dtype),
                            pltpu.VMEM((per_step, slots, width), gate.dtype),
                            pltpu.VMEM((per_step, pool.shape[-1]), pool.dtype),
                            pltpu.SemaphoreType.DMA(()),
                            pltpu.SemaphoreType.DMA(())],
        ),
        out_shape=jax.ShapeDtypeStruct(pool.shape, pool.dtype),
        input_output_aliases={num_scalars + 6: 0},
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel")),
        interpret=tpu_interpret(interpret),
        name="v4kv_compress_emit",
    )(layers.astype(jnp.int32), slot_ids.astype(jnp.int32), start.astype(jnp.int32),
      n_new.astype(jnp.int32), page_rows.astype(jnp.int32).reshape(-1),
      norm.astype(jnp.float32)[:, None, :], lane_freq, kv, gate, tail_kv, tail_gate, pool)
