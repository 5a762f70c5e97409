"""Compressor emission, TPU (Mosaic).

Grid: (layer, slot row, step of `blocks_per_step` blocks). Scalar-prefetched: the layers of
the kind's stack, slot ids, lengths before the chunk, tokens appended and the page table.
Inputs stay in HBM (`pltpu.HBM`). For each block that completes, its slot rows (whole rows,
both CSA halves) are copied into VMEM one row per copy, each into its own leading index
([blocks, slots, 1, lanes]: Mosaic slices no tiled dimension there): from the chunk after
the chunk start, and from the tail ring before it, where each ring row is the lane row of
every plane that holds it (`formats.Part`), brought to natural order in VMEM
(`lanes.record`) unless the ring's rows are whole lane rows. Each slot then takes its half
(CSA). Pooling, RMSNorm and RoPE run on all blocks of the step at once ([blocks, slots,
width]); each entry is encoded in the kernel (`formats.encode_tpu`, one plane at a time) and
written to its page: a plane that keeps an entry per lane row gets the row copied, a plane
whose lane rows an entry shares with others is read, merged on the entry's slot and written
back (`lanes.written`), one entry after the other. The pool is aliased to the output (in
place when the caller donates it). Steps whose first block does not complete do nothing; the
steps of a row run in order (two steps may write entries that share a lane row).
`emit_entries_online` (hca_tail="online") is described at its wrapper.

Layout (`v4kv_jax.pools.lanes`):
  kv, gate        [n, B, T, in_width]                   the chunk (gate biased), read
  tail kv, gate   planes [n_kind, max_slots, rows, lanes]   ring before the chunk, read
  pool            planes [n_kind, num_pages, rows, lanes]   written entry by entry
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import formats, lanes
from pallas_kernels.common import (
    cost_estimate,
    in_hbm,
    lane_frequencies,
    nbytes,
    rotate_lanes,
    swap_pairs_tpu,
    tpu_interpret,
)
from pallas_kernels.compressor.blocks import BlockSizes
from pallas_kernels.compressor.pooling import online_step, softmax_pool


def supported(model, geometry, spec=None) -> str | None:
    """Why these TPU kernels cannot run a config, or None: they run every storage format
    (tail rows are decoded and entries encoded in the kernel)."""
    del model, geometry, spec
    return None


def _lanes_out(tail: formats.Layout) -> int:
    """Lanes of a ring row brought to natural order: its words rounded up to 128."""
    return -(-tail.stored_width // 128) * 128


def _write_entry(part: formats.Part, words, pool_hbm, tmp, sem, layer, page, entry):
    """Writes one entry's words for `part` ([1, lanes] at lanes [0, part.words)) into lane row
    entry // per_row of `page`: a copy when the entry has the row to itself, else a read,
    merge and write of the row it shares."""
    row = pool_hbm.at[layer, page, pl.ds(jax.lax.div(entry, part.per_row), 1)]

    def copy(src, dst):
        c = pltpu.make_async_copy(src, dst, sem)
        c.start()
        c.wait()

    if part.per_row == 1:
        tmp[...] = words.astype(tmp.dtype) if words.dtype == tmp.dtype else (
            jax.lax.bitcast_convert_type(words, tmp.dtype))
    else:
        copy(row, tmp)
        merged = lanes.written(part, tmp[...], words, jax.lax.rem(entry, part.per_row))
        tmp[...] = jax.lax.bitcast_convert_type(merged, tmp.dtype)
    copy(tmp, row)


def _kernel(layers_ref, slot_ref, start_ref, n_new_ref, table_ref, norm_ref, freq_ref, kv_hbm,
            gate_hbm, *refs, ratio: int, overlap: bool, blocks_per_step: int, max_pages: int,
            eps: float, entries: formats.Layout, tail: formats.Layout):
    nt, npool = len(tail.parts), len(entries.parts)
    ring_kv_hbm, ring_gate_hbm = refs[:nt], refs[nt:2 * nt]
    refs = refs[2 * nt + npool:]  # the pool's inputs are aliased to its outputs
    pool_hbm, refs = refs[:npool], refs[npool:]
    ring_a, ring_z, refs = refs[:nt], refs[nt:2 * nt], refs[2 * nt:]
    chunk_a, chunk_z, nat_a, nat_z = refs[:4]
    out_bufs, row_bufs = refs[4:4 + npool], refs[4 + npool:4 + 2 * npool]
    in_sem, out_sem = refs[4 + 2 * npool:]
    li, b, t = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    layer, slot = layers_ref[li], slot_ref[b]
    start = start_ref[b]
    end = start + n_new_ref[b]
    m, width = ratio, entries.width
    ring = 2 * m if overlap else m
    epp = entries.records
    block0 = jax.lax.div(start, m) + t * blocks_per_step
    natural = not (tail.whole and tail.fmt == "float32")

    def done(g):
        return (block0 + g + 1) * m <= end

    def position(g, s):
        return (block0 + g) * m - (m if overlap else 0) + s

    def copy_rows(g, act):
        """Copies (act='start') or waits for (act='wait') the slot rows of block
        block0 + g, one row per copy: slot s is position block * m - (m if overlap else 0)
        + s, from the tail ring before the chunk start (each plane's lane row holding ring
        row pos % ring), from the chunk after it. Rows land in their own leading index of
        the VMEM buffers, so no copy slices a tiled dimension there."""

        def row(s, carry):
            pos = position(g, s)

            @pl.when((pos >= 0) & (pos < start))
            def _():
                ring_row = jax.lax.rem(jnp.maximum(pos, 0), ring)
                for k, part in enumerate(tail.parts):
                    lane_row = pl.ds(jax.lax.div(ring_row, part.per_row), 1)
                    for src, dst in ((ring_kv_hbm[k], ring_a[k]), (ring_gate_hbm[k], ring_z[k])):
                        getattr(pltpu.make_async_copy(src.at[layer, slot, lane_row],
                                                      dst.at[g, s], in_sem), act)()

            @pl.when(pos >= start)
            def _():
                for src, dst in ((kv_hbm, chunk_a), (gate_hbm, chunk_z)):
                    getattr(pltpu.make_async_copy(src.at[li, b, pl.ds(pos - start, 1)],
                                                  dst.at[g, s], in_sem), act)()

            return carry

        jax.lax.fori_loop(0, chunk_a.shape[1], row, 0)

    def in_order(g):
        """The ring rows of block g brought to natural order (word w at lane w)."""

        def row(s, carry):
            pos = position(g, s)

            @pl.when((pos >= 0) & (pos < start))
            def _():
                ring_row = jax.lax.rem(jnp.maximum(pos, 0), ring)
                slots = [jax.lax.rem(ring_row, part.per_row) for part in tail.parts]
                for bufs, nat in ((ring_a, nat_a), (ring_z, nat_z)):
                    words = lanes.record(tail.parts, [buf[g, s] for buf in bufs], slots,
                                         _lanes_out(tail))
                    nat[g, s] = formats.decode_row_tpu(tail, words)

            return carry

        jax.lax.fori_loop(0, chunk_a.shape[1], row, 0)

    def each_done_block(fn):
        def one(g, carry):
            @pl.when(done(g))
            def _():
                fn(g)

            return carry

        jax.lax.fori_loop(0, blocks_per_step, one, 0)

    def write(g):
        block = block0 + g
        col = jax.lax.div(block, epp)
        page = table_ref[b * max_pages + jnp.minimum(col, max_pages - 1)]

        @pl.when((col < max_pages) & (page >= 0))
        def _():
            for part, out, pool, tmp in zip(entries.parts, out_bufs, pool_hbm, row_bufs,
                                            strict=True):
                _write_entry(part, out[g], pool, tmp, out_sem, layer, page,
                             jax.lax.rem(block, epp))

    @pl.when(done(0))
    def _():
        each_done_block(lambda g: copy_rows(g, "start"))
        each_done_block(lambda g: copy_rows(g, "wait"))
        if natural:
            each_done_block(in_order)
        ring_kv = nat_a if natural else ring_a[0]
        ring_gate = nat_z if natural else ring_z[0]
        shape = (blocks_per_step, chunk_a.shape[1], 1)
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

        a, z = rows_of(ring_kv, chunk_a), rows_of(ring_gate, chunk_z)
        x = softmax_pool(a, z, (pos >= 0) & is_done, is_done)
        y = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps)
        y = y * norm_ref[...]
        angle = (block[:, 0] * m).astype(jnp.float32) * freq_ref[...]
        rows = rotate_lanes(y, swap_pairs_tpu(y), angle)
        for part, out in zip(entries.parts, out_bufs, strict=True):
            words = formats.encode_tpu(entries, rows, part)
            out[...] = (words if words.dtype == out.dtype else
                        jax.lax.bitcast_convert_type(words, out.dtype))[:, None, :]
        each_done_block(write)


@functools.partial(jax.jit, static_argnames=("ratio", "overlap", "eps", "block_sizes",
                                             "interpret", "entry_format", "rope_dim",
                                             "tail_format", "entry_lanes", "tail_lanes"),
                   donate_argnames=("pool",))
def emit_entries(pool, page_rows, layers, tail_kv, tail_gate, slot_ids, kv, gate, start, n_new,
                 norm, inv_freq, *, ratio: int, overlap: bool, eps: float,
                 block_sizes: BlockSizes | None = None, interpret: bool = False,
                 entry_format: str = "float32", rope_dim: int = 0, tail_format: str = "float32",
                 entry_lanes=(), tail_lanes=()):
    """Pools every block the chunk completes and writes its entry into the pool, in place.

    Args:
      pool: the Classical array's planes, [n_kind, num_pages, rows, lanes] each (donated;
        aliased to the result).
      page_rows: i32[B, max_pages_per_seq] of the batch's slots.
      layers: i32[n] indices into the kind's stack.
      tail_kv, tail_gate: the rings' planes before the chunk, [n_kind, max_slots, rows,
        lanes] each: rows of in_width values in `tail_format` (a float format).
      slot_ids, start, n_new: i32[B] slot, length before the chunk, tokens appended.
      kv, gate: [n, B, T, in_width] the chunk (gate biased by ape), read as fp32.
      norm: f32[n, width]; inv_freq: f32[r // 2] RoPE frequencies (`rope.inv_frequencies`).
      ratio, overlap, eps: the compressor's m, overlap (CSA) and RMSNorm epsilon.
      entry_format: the pool's storage format ("float32", "bfloat16", "float16",
        "fp8_latent" or "fp4_index"), the words encoded in the kernel bit for bit as
        `storage` encodes the same fp32 entry (fp4_index rotates first); rope_dim: r, the
        RoPE dims fp8_latent keeps in bf16.
      entry_lanes, tail_lanes: where the pool's and the tails' rows live (static:
        `v4kv_jax.pools.lanes.LaneMap.spec`).

    Returns:
      The pool's planes with the entries of completed blocks written (absent pages are
      skipped).
    """
    n, batch, tokens, in_width = kv.shape
    width = norm.shape[-1]
    entries = formats.layout(entry_format, width, rope_dim, "tpu", entry_lanes)
    tail = formats.layout(tail_format, in_width, 0, "tpu", tail_lanes)
    pool = tuple(pool)
    formats.check_stored(entries, pool, "pool")
    formats.check_stored(tail, tail_kv, "tail_kv")
    formats.check_stored(tail, tail_gate, "tail_gate")
    lane_freq = lane_frequencies(inv_freq, width)
    slots = 2 * ratio if overlap else ratio
    blocks = -(-tokens // ratio)
    bs = (block_sizes or BlockSizes()).clamped(blocks, slots, width)
    per_step = bs.blocks_per_step
    steps = -(-blocks // per_step)
    kernel = functools.partial(_kernel, ratio=ratio, overlap=overlap, blocks_per_step=per_step,
                               max_pages=page_rows.shape[1], eps=eps, entries=entries,
                               tail=tail)
    any_spec = pl.BlockSpec(memory_space=pltpu.HBM)
    num_scalars = 5
    natural = (per_step, slots, 1, in_width)
    vmem = [*(pltpu.VMEM((per_step, slots, 1, x.shape[-1]), x.dtype) for x in tail_kv),
            *(pltpu.VMEM((per_step, slots, 1, x.shape[-1]), x.dtype) for x in tail_gate),
            pltpu.VMEM((per_step, slots, 1, in_width), kv.dtype),
            pltpu.VMEM((per_step, slots, 1, in_width), gate.dtype),
            pltpu.VMEM(natural, jnp.float32),
            pltpu.VMEM(natural, jnp.float32),
            *(pltpu.VMEM((per_step, 1, x.shape[-1]), x.dtype) for x in pool),
            *(pltpu.VMEM((1, x.shape[-1]), x.dtype) for x in pool),
            pltpu.SemaphoreType.DMA(()),
            pltpu.SemaphoreType.DMA(())]
    inputs = 2 + 2 * len(tail_kv)
    entry_bytes = sum(2 * nbytes(x, 1) for x in pool)  # a lane row read and written
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=num_scalars,
            grid=(n, batch, steps),
            in_specs=[pl.BlockSpec((None, 1, width), lambda li, b, t, *_: (li, 0, 0)),
                      pl.BlockSpec((1, width), lambda li, b, t, *_: (0, 0)),
                      *[any_spec] * (inputs + len(pool))],
            out_specs=[any_spec] * len(pool),
            scratch_shapes=vmem,
        ),
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in pool],
        input_output_aliases={num_scalars + 2 + inputs + k: k for k in range(len(pool))},
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=tpu_interpret(interpret),
        name="v4kv_compress_emit",
        cost_estimate=cost_estimate(
            flops=12 * n * batch * tokens * in_width,
            transcendentals=n * batch * tokens * in_width,
            bytes_accessed=2 * nbytes(kv) + n * batch * blocks * entry_bytes),
    )(layers.astype(jnp.int32), slot_ids.astype(jnp.int32), start.astype(jnp.int32),
      n_new.astype(jnp.int32), page_rows.astype(jnp.int32).reshape(-1),
      norm.astype(jnp.float32)[:, None, :], lane_freq, kv, gate, *in_hbm(tail_kv),
      *in_hbm(tail_gate), *in_hbm(pool))
    return tuple(out)


def _online_kernel(layers_ref, slot_ref, start_ref, n_new_ref, table_ref, norm_ref, freq_ref,
                   kv_ref, gate_ref, *refs, ratio: int, max_pages: int, eps: float,
                   entries: formats.Layout, tail: formats.Layout, with_pool: bool):
    nt, npool = len(tail.parts), len(entries.parts) if with_pool else 0
    n_io = 3 * nt + npool
    tails = [refs[n_io + k * nt:n_io + (k + 1) * nt] for k in range(3)]
    pool_hbm = refs[n_io + 3 * nt:2 * n_io]
    refs = refs[2 * n_io:]
    stage = [refs[k * nt:(k + 1) * nt] for k in range(3)]
    out_bufs, row_bufs = refs[3 * nt:3 * nt + npool], refs[3 * nt + npool:3 * nt + 2 * npool]
    sem = refs[-1]
    li, b = pl.program_id(0), pl.program_id(1)
    layer, slot = layers_ref[li], slot_ref[b]
    start, n_new = start_ref[b], n_new_ref[b]
    max_slots, m = tails[0][0].shape[1], ratio
    lanes_out = _lanes_out(tail)

    def copy(src, dst):
        c = pltpu.make_async_copy(src, dst, sem)
        c.start()
        c.wait()

    read = jnp.clip(slot, 0, max_slots - 1)
    state = []
    for planes, bufs in zip(tails, stage, strict=True):
        for src, dst in zip(planes, bufs, strict=True):
            copy(src.at[layer, read], dst)
        words = lanes.record(tail.parts, [x[...] for x in bufs], [0] * nt, lanes_out)
        state.append(formats.decode_row_tpu(tail, words))
    state = tuple(state)

    def write_entry(block, u, s):
        x = u / s
        y = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps)
        y = y * norm_ref[...]
        freq = freq_ref[...]
        rotated = rotate_lanes(y, swap_pairs_tpu(y), (block * m).astype(jnp.float32) * freq)
        row = jnp.where(freq > 0, rotated, y)  # the RoPE dims; the others stay as they are
        col = jax.lax.div(block, entries.records)
        page = table_ref[b * max_pages + jnp.minimum(col, max_pages - 1)]

        @pl.when((col < max_pages) & (page >= 0))
        def _():
            for part, out, pool, tmp in zip(entries.parts, out_bufs, pool_hbm, row_bufs,
                                            strict=True):
                words = formats.encode_tpu(entries, row, part)
                out[...] = (words if words.dtype == out.dtype else
                            jax.lax.bitcast_convert_type(words, out.dtype))
                _write_entry(part, out[...], pool, tmp, sem, layer, page,
                             jax.lax.rem(block, entries.records))

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
        for planes, bufs, value in zip(tails, stage, state, strict=True):
            for part, dst, buf in zip(tail.parts, planes, bufs, strict=True):
                words = formats.encode_tpu(tail, value, part)
                merged = lanes.written(part, buf[...], words, 0)
                buf[...] = jax.lax.bitcast_convert_type(merged, buf.dtype)
                copy(buf, dst.at[layer, slot])


@functools.partial(jax.jit, static_argnames=("ratio", "eps", "interpret", "entry_format",
                                             "rope_dim", "tail_format", "entry_lanes",
                                             "tail_lanes"),
                   donate_argnames=("pool", "tail_max", "tail_sum", "tail_weighted"))
def emit_entries_online(pool, page_rows, layers, tail_max, tail_sum, tail_weighted, slot_ids,
                        kv, gate, start, n_new, norm, inv_freq, *, ratio: int, eps: float,
                        interpret: bool = False, entry_format: str = "float32",
                        rope_dim: int = 0, tail_format: str = "float32", entry_lanes=(),
                        tail_lanes=()):
    """Folds a chunk into the online HCA tails and writes the entry of every block it
    completes, in place (`v4kv_jax.ops.compressor.emit_entries_online`; update rule in the
    `v4kv_jax.pools` docstring, each product rounded before its sum as there, so the tails
    are bit for bit the reference's).

    Grid: (layer, slot row). A program copies its row's tail (max, sum, weighted: the lane
    rows of each plane that hold it) into VMEM, folds its chunk token by token (kv and gate
    [T, width] blocks in VMEM) and at each block end norms, rotates and encodes the entry
    and writes it to its page (as `emit_entries` does); then writes the tail back.

    Args:
      pool: the C128 entries' planes, [n_hca, num_pages, rows, lanes] each (donated;
        aliased to the result), or None to update the tails only (a state-only replay).
      page_rows: i32[B, max_pages_per_seq] of the batch's slots.
      layers: i32[n] indices into the HCA stack.
      tail_max, tail_sum, tail_weighted: the tails' planes, [n_hca, max_slots, 1, lanes]
        each (a row of width values in `tail_format` per slot; donated; aliased).
      slot_ids: i32[B]; a row whose id is outside [0, max_slots) reads the clipped slot's
        tail and writes no tail; a row with n_new == 0 writes nothing.
      kv, gate: [n, B, T, width] the chunk (gate biased by ape), read as fp32.
      start, n_new: i32[B] length before the chunk and tokens appended.
      norm: f32[n, width]; inv_freq: f32[r // 2] RoPE frequencies.
      ratio, eps: m' and the RMSNorm epsilon.
      entry_format, rope_dim, tail_format, entry_lanes, tail_lanes: as `emit_entries`.

    Returns:
      (the pool's planes or None, (max, sum, weighted) planes after the chunk).
    """
    n, batch, tokens, width = kv.shape
    entries = formats.layout(entry_format, width, rope_dim, "tpu", entry_lanes)
    tail = formats.layout(tail_format, width, 0, "tpu", tail_lanes)
    with_pool = pool is not None
    pool = tuple(pool) if with_pool else ()
    if with_pool:
        formats.check_stored(entries, pool, "pool")
    tails = (tuple(tail_max), tuple(tail_sum), tuple(tail_weighted))
    for name, planes in zip(("tail_max", "tail_sum", "tail_weighted"), tails, strict=True):
        formats.check_stored(tail, planes, name)
    outputs = (*tails[0], *tails[1], *tails[2], *pool)
    any_spec = pl.BlockSpec(memory_space=pltpu.HBM)
    chunk = pl.BlockSpec((None, None, tokens, width), lambda li, b, *_: (li, b, 0, 0))
    num_scalars = 5
    kernel = functools.partial(_online_kernel, ratio=ratio, max_pages=page_rows.shape[1],
                               eps=eps, entries=entries, tail=tail, with_pool=with_pool)
    tail_row_bytes = sum(nbytes(x, 1) for x in tail_max)
    result = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=num_scalars,
            grid=(n, batch),
            in_specs=[pl.BlockSpec((None, 1, width), lambda li, b, *_: (li, 0, 0)),
                      pl.BlockSpec((1, width), lambda li, b, *_: (0, 0)), chunk, chunk,
                      *[any_spec] * len(outputs)],
            out_specs=[any_spec] * len(outputs),
            scratch_shapes=[*(pltpu.VMEM(x.shape[-2:], x.dtype) for x in outputs[:3 * len(
                                tail_max)]),
                            *(pltpu.VMEM((1, x.shape[-1]), x.dtype) for x in pool),
                            *(pltpu.VMEM((1, x.shape[-1]), x.dtype) for x in pool),
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
            bytes_accessed=2 * nbytes(kv) + 6 * n * batch * tail_row_bytes
            + (n * batch * (-(-tokens // ratio)) * sum(2 * nbytes(x, 1) for x in pool))),
    )(layers.astype(jnp.int32), slot_ids.astype(jnp.int32), start.astype(jnp.int32),
      n_new.astype(jnp.int32), page_rows.astype(jnp.int32).reshape(-1),
      norm.astype(jnp.float32)[:, None, :], lane_frequencies(inv_freq, width), kv, gate,
      *in_hbm(outputs))
    k = len(tail_max)
    state = (tuple(result[:k]), tuple(result[k:2 * k]), tuple(result[2 * k:3 * k]))
    return (tuple(result[3 * k:]) if with_pool else None), state
