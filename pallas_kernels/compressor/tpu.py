"""Compressor emission, TPU (Mosaic).

Grid: (layer, slot row, step of `blocks_per_step` blocks). Scalar-prefetched: the layers of
the kind's stack, slot ids, lengths before the chunk, tokens appended and the page table.
Inputs stay in HBM (`pltpu.HBM`). For each block that completes, its slot rows (whole rows,
both CSA halves) are copied into VMEM one row per copy, each into its own leading index
([blocks, slots, 1, in_width]: Mosaic slices no tiled dimension there), from the tail ring
before the chunk start and from the chunk after it; each slot then takes its half (CSA).
Pooling, RMSNorm and RoPE run on all blocks of the step at once ([blocks, slots, width]);
each entry (encoded in the kernel when the pool is packed, `formats.encode_tpu`) is then
copied to its page and row of the pool, which is aliased to the output
(in place when the caller donates it). Steps whose first block does not complete do nothing.
`emit_entries_online` (hca_tail="online") is described at its wrapper.

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
    cost_estimate,
    lane_frequencies,
    nbytes,
    rotate_lanes,
    swap_pairs_tpu,
    tpu_interpret,
    tpu_row_copy_problem,
)
from pallas_kernels.compressor.blocks import BlockSizes
from pallas_kernels.compressor.pooling import online_step, softmax_pool

# compressor name -> the geometry field of the format its entries are stored in
_STORED_AS = {"csa": "entry_dtype", "csa_index": "index_dtype", "hca": "entry_dtype"}


def supported(model, geometry, spec=None) -> str | None:
    """Why these TPU kernels cannot run a config (the compressor `spec`, or every one of the
    model's), or None. They copy tail rows and write entries one row at a time: 16-bit tails
    never run, 16-bit entries only where a page holds one entry (row 0 of every page)."""
    names = [spec.name] if spec is not None else list(_STORED_AS)
    for name in names:
        ratio = model.hca_ratio if name == "hca" else model.csa_ratio
        field = _STORED_AS[name]
        per_page = geometry.page_tokens // ratio
        problem = tpu_row_copy_problem(tail_dtype=geometry.tail_dtype) or (
            None if per_page == 1 else tpu_row_copy_problem(
                **{field: getattr(geometry, field)}))
        if problem is not None:
            return f"{name} compressor: {problem}"
    return None


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

    def copy_rows(g, act):
        """Copies (act='start') or waits for (act='wait') the slot rows of block
        block0 + g, one whole row (every column) per copy: slot s is position
        block * m - (m if overlap else 0) + s, from the tail ring before the chunk start,
        from the chunk after it. Rows land in their own leading index of the VMEM buffers,
        so no copy slices a tiled dimension there."""
        first = (block0 + g) * m - (m if overlap else 0)

        def row(s, carry):
            pos = first + s

            @pl.when((pos >= 0) & (pos < start))
            def _():
                ring_row = jax.lax.rem(jnp.maximum(pos, 0), ring)
                for src, dst in ((ring_kv_hbm, ring_a), (ring_gate_hbm, ring_z)):
                    getattr(pltpu.make_async_copy(src.at[layer, slot, pl.ds(ring_row, 1)],
                                                  dst.at[g, s], in_sem), act)()

            @pl.when(pos >= start)
            def _():
                for src, dst in ((kv_hbm, chunk_a), (gate_hbm, chunk_z)):
                    getattr(pltpu.make_async_copy(src.at[li, b, pl.ds(pos - start, 1)],
                                                  dst.at[g, s], in_sem), act)()

            return carry

        jax.lax.fori_loop(0, ring_a.shape[1], row, 0)

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
        return (col < max_pages) & (page >= 0), pltpu.make_async_copy(out_buf.at[g], dst,
                                                                      out_sem)

    def write(g, act):
        present, copy = entry_copy(g)

        @pl.when(present)
        def _():
            getattr(copy, act)()

    @pl.when(done(0))
    def _():
        each_done_block(lambda g: copy_rows(g, "start"))
        each_done_block(lambda g: copy_rows(g, "wait"))
        shape = (blocks_per_step, ring_a.shape[1], 1)
        block = block0 + jax.lax.broadcasted_iota(jnp.int32, shape, 0)
        pos = block * m - (m if overlap else 0) + jax.lax.broadcasted_iota(jnp.int32, shape, 1)
        is_done = (block + 1) * m <= end
        old = pos < start
        slot_half = jax.lax.broadcasted_iota(jnp.int32, shape, 1) < m

        def rows_of(ring_buf, chunk_buf):
            """[blocks, slots, width] fp32: each slot's row, its half (CSA) or all of it."""
            x = jnp.where(old, ring_buf[:, :, 0, :].astype(jnp.float32),
                          chunk_buf[:, :, 0, :].astype(jnp.float32))
            return jnp.where(slot_half, x[..., :width], x[..., width:]) if overlap else x

        a, z = rows_of(ring_a, chunk_a), rows_of(ring_z, chunk_z)
        x = softmax_pool(a, z, (pos >= 0) & is_done, is_done)
        y = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps)
        y = y * norm_ref[...]
        angle = (block[:, 0] * m).astype(jnp.float32) * freq_ref[...]
        rows = rotate_lanes(y, swap_pairs_tpu(y), angle)
        if entries.packed:
            out_buf[...] = formats.encode_tpu(entries, rows)[:, None, :]
        else:
            out_buf[...] = rows.astype(out_buf.dtype)[:, None, :]
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
    n, batch, tokens, in_width = kv.shape
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
    any_spec = pl.BlockSpec(memory_space=pltpu.HBM)
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
            scratch_shapes=[pltpu.VMEM((per_step, slots, 1, in_width), tail_kv.dtype),
                            pltpu.VMEM((per_step, slots, 1, in_width), tail_gate.dtype),
                            pltpu.VMEM((per_step, slots, 1, in_width), kv.dtype),
                            pltpu.VMEM((per_step, slots, 1, in_width), gate.dtype),
                            pltpu.VMEM((per_step, 1, pool.shape[-1]), pool.dtype),
                            pltpu.SemaphoreType.DMA(()),
                            pltpu.SemaphoreType.DMA(())],
        ),
        out_shape=jax.ShapeDtypeStruct(pool.shape, pool.dtype),
        input_output_aliases={num_scalars + 6: 0},
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel")),
        interpret=tpu_interpret(interpret),
        name="v4kv_compress_emit",
        cost_estimate=cost_estimate(
            flops=12 * n * batch * tokens * in_width,
            transcendentals=n * batch * tokens * in_width,
            bytes_accessed=2 * nbytes(kv) + n * batch * blocks * nbytes(pool, 1)),
    )(layers.astype(jnp.int32), slot_ids.astype(jnp.int32), start.astype(jnp.int32),
      n_new.astype(jnp.int32), page_rows.astype(jnp.int32).reshape(-1),
      norm.astype(jnp.float32)[:, None, :], lane_freq, kv, gate, tail_kv, tail_gate, pool)


def _online_kernel(layers_ref, slot_ref, start_ref, n_new_ref, table_ref, norm_ref, freq_ref,
                   kv_ref, gate_ref, *refs, ratio: int, max_pages: int, eps: float,
                   entries: formats.Layout, with_pool: bool):
    n_io = 4 if with_pool else 3
    tails_in, tails = refs[:3], refs[n_io:n_io + 3]
    pool_hbm = refs[2 * n_io - 1] if with_pool else None
    stage, out_buf, sem = refs[2 * n_io:2 * n_io + 3], refs[-2], refs[-1]
    li, b = pl.program_id(0), pl.program_id(1)
    layer, slot = layers_ref[li], slot_ref[b]
    start, n_new = start_ref[b], n_new_ref[b]
    max_slots, m = tails[0].shape[1], ratio

    def copy(src, dst):
        c = pltpu.make_async_copy(src, dst, sem)
        c.start()
        c.wait()

    read = jnp.clip(slot, 0, max_slots - 1)
    for src, dst in zip(tails_in, stage, strict=True):
        copy(src.at[layer, pl.ds(read, 1)], dst)
    state = tuple(x[...].astype(jnp.float32) for x in stage)

    def write_entry(block, u, s):
        x = u / s
        y = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps)
        y = y * norm_ref[...]
        freq = freq_ref[...]
        rotated = rotate_lanes(y, swap_pairs_tpu(y), (block * m).astype(jnp.float32) * freq)
        row = jnp.where(freq > 0, rotated, y)  # the RoPE dims; the others stay as they are
        out_buf[...] = formats.encode_tpu(entries, row) if entries.packed else row.astype(
            out_buf.dtype)
        col = jax.lax.div(block, pool_hbm.shape[2])
        page = table_ref[b * max_pages + jnp.minimum(col, max_pages - 1)]

        @pl.when((col < max_pages) & (page >= 0))
        def _():
            copy(out_buf, pool_hbm.at[layer, page, pl.ds(jax.lax.rem(block, pool_hbm.shape[2]),
                                                          1)])

    def token(i, state):
        pos = start + i
        offset = jax.lax.rem(pos, m)
        state = online_step(state, kv_ref[pl.ds(i, 1), :].astype(jnp.float32),
                            gate_ref[pl.ds(i, 1), :].astype(jnp.float32), offset == 0)
        if with_pool:
            @pl.when(offset == m - 1)
            def _():
                write_entry(jax.lax.div(pos, m), state[2], state[1])

        return state

    state = jax.lax.fori_loop(0, n_new, token, state)

    @pl.when((slot >= 0) & (slot < max_slots) & (n_new > 0))
    def _():
        for dst, buf, value in zip(tails, stage, state, strict=True):
            buf[...] = value.astype(buf.dtype)
            copy(buf, dst.at[layer, pl.ds(slot, 1)])


@functools.partial(jax.jit, static_argnames=("ratio", "eps", "interpret", "entry_format",
                                             "rope_dim"),
                   donate_argnames=("pool", "tail_max", "tail_sum", "tail_weighted"))
def emit_entries_online(pool, page_rows, layers, tail_max, tail_sum, tail_weighted, slot_ids,
                        kv, gate, start, n_new, norm, inv_freq, *, ratio: int, eps: float,
                        interpret: bool = False, entry_format: str = "float",
                        rope_dim: int = 0):
    """Folds a chunk into the online HCA tails and writes the entry of every block it
    completes, in place (`v4kv_jax.ops.compressor.emit_entries_online`; update rule in the
    `v4kv_jax.pools` docstring, each product rounded before its sum as there, so the tails
    are bit for bit the reference's).

    Grid: (layer, slot row). A program copies its row's tail (max, sum, weighted) into VMEM,
    folds its chunk token by token (kv and gate [T, width] blocks in VMEM) and at each block
    end norms, rotates and encodes the entry and copies it to its page and row; then copies
    the tail back.

    Args:
      pool: [n_hca, num_pages, P // m', S] (donated; aliased to the result), or None to
        update the tails only (a state-only replay).
      page_rows: i32[B, max_pages_per_seq] of the batch's slots.
      layers: i32[n] indices into the HCA stack.
      tail_max, tail_sum, tail_weighted: [n_hca, max_slots, width] (donated; aliased).
      slot_ids: i32[B]; a row whose id is outside [0, max_slots) reads the clipped slot's
        tail and writes no tail; a row with n_new == 0 writes nothing.
      kv, gate: [n, B, T, width] the chunk (gate biased by ape), read as fp32.
      start, n_new: i32[B] length before the chunk and tokens appended.
      norm: f32[n, width]; inv_freq: f32[r // 2] RoPE frequencies.
      ratio, eps: m' and the RMSNorm epsilon.
      entry_format, rope_dim: the pool's storage format, as in `emit_entries`.

    Returns:
      (the pool or None, (max, sum, weighted) after the chunk).
    """
    n, batch, tokens, width = kv.shape
    entries = formats.layout(entry_format, width, rope_dim, "tpu")
    with_pool = pool is not None
    if with_pool:
        formats.check_stored(entries, pool, "pool")
    outputs = (tail_max, tail_sum, tail_weighted) + ((pool,) if with_pool else ())
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    chunk = pl.BlockSpec((None, None, tokens, width), lambda li, b, *_: (li, b, 0, 0))
    num_scalars = 5
    kernel = functools.partial(_online_kernel, ratio=ratio, max_pages=page_rows.shape[1],
                               eps=eps, entries=entries, with_pool=with_pool)
    stored = entries.stored_width
    result = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=num_scalars,
            grid=(n, batch),
            in_specs=[pl.BlockSpec((None, 1, width), lambda li, b, *_: (li, 0, 0)),
                      pl.BlockSpec((1, width), lambda li, b, *_: (0, 0)), chunk, chunk,
                      *[any_spec] * len(outputs)],
            out_specs=[any_spec] * len(outputs),
            scratch_shapes=[*[pltpu.VMEM((1, width), x.dtype) for x in outputs[:3]],
                            pltpu.VMEM((1, stored), pool.dtype if with_pool else jnp.float32),
                            pltpu.SemaphoreType.DMA(())],
        ),
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in outputs],
        input_output_aliases={num_scalars + 4 + k: k for k in range(len(outputs))},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=tpu_interpret(interpret),
        name="v4kv_compress_online",
        cost_estimate=cost_estimate(
            flops=12 * n * batch * tokens * width,
            transcendentals=2 * n * batch * tokens * width,
            bytes_accessed=2 * nbytes(kv) + 6 * n * batch * nbytes(tail_max, 1)),
    )(layers.astype(jnp.int32), slot_ids.astype(jnp.int32), start.astype(jnp.int32),
      n_new.astype(jnp.int32), page_rows.astype(jnp.int32).reshape(-1),
      norm.astype(jnp.float32)[:, None, :], lane_frequencies(inv_freq, width), kv, gate,
      *outputs)
    return (result[3] if with_pool else None), tuple(result[:3])
