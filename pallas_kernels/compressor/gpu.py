"""Compressor emission, GPU (Pallas lowered through Triton).

Grid: (layer, slot row, step of `blocks_per_step` blocks); steps whose first block does not
complete do nothing. A program gathers its slot rows straight from the chunk or the tail
ring ([blocks, slots, channels] tiles, `channels_per_step` channels per pass), pools them,
and after the RMSNorm (whose sum of squares spans all passes) rotates and stores each pass
with a masked scatter into the pool, aliased to the output (in place when donated).

RoPE needs the partner lane of each pair; pooling and the norm act per channel, so the
partner values are pooled from a second gather of the pair-exchanged columns (served from
cache) instead of a lane shuffle, which Triton does not expose in Pallas.

Packed pools (`formats.encode_gpu`): an fp8_latent word holds 4 neighbouring dims, so the
passes are the encoder's planes instead (one gather per plane with a strided column map:
byte j of the 16 code words of a scale block, then the even and odd RoPE dims, each the
other's rotation partner); planes are encoded and stored lane by lane, never relayouted.
fp4_index keys pool contiguous passes as float pools do and accumulate the Hadamard rotation
into the 8 nibble planes with +-1 sums (`formats.hadamard_planes`), encoded after the last
pass. `emit_entries_online` (hca_tail="online") is described at its wrapper.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from pallas_kernels import formats
from pallas_kernels.common import (
    check_power_of_two,
    lane_frequencies,
    power_of_two_problem,
    rotate_lanes,
    triton_compiler_params,
)
from pallas_kernels.compressor.blocks import BlockSizes
from pallas_kernels.compressor.pooling import online_step, softmax_pool


def supported(model, geometry, spec=None) -> str | None:
    """Why these GPU kernels cannot run a config, or None. The row widths and the tokens
    pooled into one entry (ratio, or 2 * ratio with the overlap) are Triton tensor sizes."""
    del spec
    return power_of_two_problem(head_dim=model.head_dim, index_head_dim=model.index_head_dim,
                                csa_ratio=model.csa_ratio, hca_ratio=model.hca_ratio)


# Tiles of [blocks, slots, 32 channels] with blocks * slots <= 128 (4K values per gather).
DEFAULT_BLOCK_SIZES = BlockSizes(blocks_per_step=64, slot_rows_per_step=128, channels_per_step=32)


def _kernel(layers_ref, slot_ref, start_ref, n_new_ref, table_ref, norm_ref, freq_ref, kv_ref,
            gate_ref, ring_kv_ref, ring_gate_ref, pool_in_ref, pool_ref, *, ratio: int,
            overlap: bool, blocks_per_step: int, channels: int, tokens: int, max_pages: int,
            eps: float, entries: formats.Layout):
    del pool_in_ref  # aliased to pool_ref
    li, b, t = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    m = ratio
    width = entries.width
    slots, ring = (2 * m, 2 * m) if overlap else (m, m)
    epp = pool_ref.shape[2]
    start = start_ref[b]
    end = start + n_new_ref[b]
    block0 = start // m + t * blocks_per_step

    @pl.when((block0 + 1) * m <= end)
    def _():
        layer, slot = layers_ref[li], slot_ref[b]

        def iota(shape, axis):
            return jax.lax.broadcasted_iota(jnp.int32, shape, axis)

        def slot_grid(shape):  # (position, block completes) of each slot row
            block = block0 + iota(shape, 0)
            pos = block * m - (m if overlap else 0) + iota(shape, 1)
            return pos, (block + 1) * m <= end

        rows_pos, rows_done = slot_grid((blocks_per_step, slots, 1))
        valid = (rows_pos >= 0) & rows_done
        block_done = (block0 + iota((blocks_per_step, 1, 1), 0) + 1) * m <= end

        def pooled(first, stride, lanes, swap=False):
            """f32[blocks, lanes]: the pooled dims first + stride * l (their pair partners
            with swap)."""
            shape = (blocks_per_step, slots, lanes)
            pos, _ = slot_grid(shape)
            old = pos < start
            ring_row = jnp.maximum(pos, 0) % ring
            chunk_row = jnp.clip(pos - start, 0, tokens - 1)
            half = jnp.where(iota(shape, 1) >= m, width, 0) if overlap else 0
            dim = first + stride * iota(shape, 2)
            col = half + (dim ^ 1 if swap else dim)

            def read(chunk_ref, tail_ref):
                new = chunk_ref[li, b, chunk_row, col].astype(jnp.float32)
                return jnp.where(old, tail_ref[layer, slot, ring_row, col].astype(jnp.float32),
                                 new)

            return softmax_pool(read(kv_ref, ring_kv_ref), read(gate_ref, ring_gate_ref), valid,
                                block_done)

        row_block = block0 + iota((blocks_per_step, 1), 0)
        col = jax.lax.div(row_block, epp)
        page = table_ref[b, jnp.minimum(col, max_pages - 1)]
        row = jax.lax.rem(row_block, epp)
        keep = ((row_block + 1) * m <= end) & (col < max_pages) & (page >= 0)
        angle_of = (row_block * m).astype(jnp.float32)

        def store(first, values, n):
            """Writes values [blocks, L] to columns first .. first + n - 1 of the rows."""
            lanes = iota((1, values.shape[1]), 1)
            cols = jnp.broadcast_to(first + jnp.minimum(lanes, n - 1), values.shape)
            target = pool_ref.at[layer, jnp.broadcast_to(jnp.maximum(page, 0), values.shape),
                                 jnp.broadcast_to(row, values.shape), cols]
            pl_triton.store(target, values, mask=keep & (lanes < n))

        def norm_of(first, stride, lanes):
            return norm_ref[li, first + stride * iota((1, lanes), 1)]

        if entries.fmt == "fp8_latent":
            # Each plane of the encoder pooled straight from its dims; nothing to rotate but
            # the RoPE planes, whose pair partners are each other.
            planes = formats.gpu_encoder_planes(entries)
            xs = [pooled(*plane) for plane in planes]
            sum_sq = sum(jnp.sum(jnp.square(x), axis=-1, keepdims=True) for x in xs)
            inv_rms = jax.lax.rsqrt(sum_sq / width + eps)
            ys = [x * inv_rms * norm_of(*plane) for x, plane in zip(xs, planes, strict=True)]
            if entries.rope_dim:
                even, odd = ys[-2:]
                angle = angle_of * freq_ref[0, planes[-2][0] + 2 * iota((1, even.shape[1]), 1)]
                cos, sin = jnp.cos(angle), jnp.sin(angle)
                ys[-2:] = [even * cos - odd * sin, even * sin + odd * cos]
            for first, words, n in formats.encode_gpu(entries, ys):
                store(first, jax.lax.bitcast_convert_type(words, pool_ref.dtype), n)
            return

        parts, sum_sq = [], 0.0
        for c0 in range(0, width, channels):
            x = pooled(c0, 1, channels)
            parts.append((c0, x, pooled(c0, 1, channels, swap=True)))
            sum_sq = sum_sq + jnp.sum(jnp.square(x), axis=-1, keepdims=True)
        inv_rms = jax.lax.rsqrt(sum_sq / width + eps)
        rotated = None
        for c0, x, x_swapped in parts:
            lanes = c0 + iota((1, channels), 1)
            y = x * inv_rms * norm_ref[li, lanes]
            y_swapped = x_swapped * inv_rms * norm_ref[li, lanes ^ 1]
            entry = rotate_lanes(y, y_swapped, angle_of * freq_ref[0, lanes])
            if entries.fmt == "fp4_index":
                part = formats.hadamard_planes(entries, entry, c0)
                rotated = part if rotated is None else [
                    r + p for r, p in zip(rotated, part, strict=True)]
            else:
                store(c0, entry.astype(pool_ref.dtype), channels)
        if entries.fmt == "fp4_index":
            scaled = [r * np.float32(width ** -0.5) for r in rotated]
            for first, words, n in formats.encode_gpu(entries, scaled):
                store(first, jax.lax.bitcast_convert_type(words, pool_ref.dtype), n)


@functools.partial(jax.jit, static_argnames=("ratio", "overlap", "eps", "block_sizes",
                                             "interpret", "num_warps", "num_stages",
                                             "entry_format", "rope_dim"),
                   donate_argnames=("pool",))
def emit_entries(pool, page_rows, layers, tail_kv, tail_gate, slot_ids, kv, gate, start, n_new,
                 norm, inv_freq, *, ratio: int, overlap: bool, eps: float,
                 block_sizes: BlockSizes | None = None, interpret: bool = False,
                 num_warps: int = 4, num_stages: int = 1, entry_format: str = "float",
                 rope_dim: int = 0):
    """Same contract as `pallas_kernels.compressor.tpu.emit_entries` (packed pools encoded
    in the kernel by `formats.encode_gpu`, bit for bit as `storage` encodes the same fp32
    entry)."""
    n, batch, tokens, _ = kv.shape
    width = norm.shape[-1]
    entries = formats.layout(entry_format, width, rope_dim, "gpu")
    formats.check_stored(entries, pool, "pool")
    lane_freq = lane_frequencies(inv_freq, width)
    slots = 2 * ratio if overlap else ratio
    blocks = -(-tokens // ratio)
    bs = (block_sizes or DEFAULT_BLOCK_SIZES).for_gpu(blocks, slots, width)
    check_power_of_two(width=width, slots=slots)
    steps = -(-blocks // bs.blocks_per_step)
    kernel = functools.partial(
        _kernel, ratio=ratio, overlap=overlap, blocks_per_step=bs.blocks_per_step,
        channels=bs.channels_per_step, tokens=tokens, max_pages=page_rows.shape[1], eps=eps,
        entries=entries)
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


def _online_groups(entries: formats.Layout) -> tuple[tuple[int, int, int], ...]:
    """Lane groups (first dim, stride, lanes) the online kernel holds a row in: the encoder's
    planes for fp8_latent, else the even and the odd dims (each the other's RoPE partner)."""
    if entries.fmt == "fp8_latent":
        return formats.gpu_encoder_planes(entries)
    return ((0, 2, entries.width // 2), (1, 2, entries.width // 2))


def _online_kernel(layers_ref, slot_ref, start_ref, n_new_ref, table_ref, norm_ref, freq_ref,
                   kv_ref, gate_ref, *refs, ratio: int, max_pages: int, eps: float,
                   entries: formats.Layout, with_pool: bool):
    n_io = 4 if with_pool else 3
    tails_in, tails = refs[:3], refs[n_io:n_io + 3]
    pool_ref = refs[-1] if with_pool else None
    li, b = pl.program_id(0), pl.program_id(1)
    layer, slot = layers_ref[li], slot_ref[b]
    start, n_new = start_ref[b], n_new_ref[b]
    max_slots, m, width = tails[0].shape[1], ratio, entries.width
    groups = _online_groups(entries)

    def dims(group):
        first, stride, lanes = group
        return first + stride * jax.lax.broadcasted_iota(jnp.int32, (1, lanes), 1)

    read = jnp.clip(slot, 0, max_slots - 1)
    state = tuple([ref[layer, read, dims(g)].astype(jnp.float32) for g in groups]
                  for ref in tails_in)

    def write_entry(block, u, s):
        xs = [uu / ss for uu, ss in zip(u, s, strict=True)]
        sum_sq = sum(jnp.sum(jnp.square(x), axis=-1, keepdims=True) for x in xs)
        inv_rms = jax.lax.rsqrt(sum_sq / width + eps)
        ys = [x * inv_rms * norm_ref[li, dims(g)] for x, g in zip(xs, groups, strict=True)]
        if entries.fmt != "fp8_latent" or entries.rope_dim:
            even, odd = ys[-2:]
            freq = freq_ref[0, dims(groups[-2])]
            angle = (block * m).astype(jnp.float32) * freq
            cos, sin = jnp.cos(angle), jnp.sin(angle)
            rotates = freq > 0  # the RoPE dims; the others stay as they are
            ys[-2:] = [jnp.where(rotates, even * cos - odd * sin, even),
                       jnp.where(rotates, even * sin + odd * cos, odd)]
        col = jax.lax.div(block, pool_ref.shape[2])
        page = table_ref[b, jnp.minimum(col, max_pages - 1)]
        keep = (col < max_pages) & (page >= 0)
        row = jax.lax.rem(block, pool_ref.shape[2])

        def store(cols, values, mask):
            target = pool_ref.at[layer, jnp.maximum(page, 0), row, cols]
            pl_triton.store(target, values, mask=jnp.broadcast_to(mask & keep, values.shape))

        if entries.fmt == "fp8_latent":
            segments = formats.encode_gpu(entries, ys)
        elif entries.fmt == "fp4_index":
            parts = [formats.hadamard_planes(entries, y, g[0], g[1])
                     for y, g in zip(ys, groups, strict=True)]
            segments = formats.encode_gpu(entries, [
                (p + q) * np.float32(width ** -0.5) for p, q in zip(*parts, strict=True)])
        else:
            for y, g in zip(ys, groups, strict=True):
                store(dims(g)[0], y[0].astype(pool_ref.dtype), True)
            return
        for first, words, n in segments:
            lanes = jax.lax.broadcasted_iota(jnp.int32, (words.shape[1],), 0)
            store(first + jnp.minimum(lanes, n - 1),
                  jax.lax.bitcast_convert_type(words[0], pool_ref.dtype), lanes < n)

    def token(i, state):
        pos = start + i
        offset = jax.lax.rem(pos, m)
        a = [kv_ref[li, b, i, dims(g)].astype(jnp.float32) for g in groups]
        z = [gate_ref[li, b, i, dims(g)].astype(jnp.float32) for g in groups]
        per_group = [online_step(group, aa, zz, offset == 0) for *group, aa, zz in
                     zip(*state, a, z, strict=True)]
        state = tuple([new[k] for new in per_group] for k in range(3))
        if with_pool:
            @pl.when(offset == m - 1)
            def _():
                write_entry(jax.lax.div(pos, m), state[2], state[1])

        return state

    state = jax.lax.fori_loop(0, n_new, token, state)

    @pl.when((slot >= 0) & (slot < max_slots) & (n_new > 0))
    def _():
        for ref, values in zip(tails, state, strict=True):
            for g, v in zip(groups, values, strict=True):
                pl_triton.store(ref.at[layer, slot, dims(g)[0]], v[0].astype(ref.dtype))


@functools.partial(jax.jit, static_argnames=("ratio", "eps", "interpret", "num_warps",
                                             "num_stages", "entry_format", "rope_dim"),
                   donate_argnames=("pool", "tail_max", "tail_sum", "tail_weighted"))
def emit_entries_online(pool, page_rows, layers, tail_max, tail_sum, tail_weighted, slot_ids,
                        kv, gate, start, n_new, norm, inv_freq, *, ratio: int, eps: float,
                        interpret: bool = False, num_warps: int = 4, num_stages: int = 1,
                        entry_format: str = "float", rope_dim: int = 0):
    """Same contract as `pallas_kernels.compressor.tpu.emit_entries_online`.

    Grid: (layer, slot row). A program holds its row's tail in registers as lane groups
    (`_online_groups`, gathered with strided column maps), folds the chunk token by token
    and, at each block end, norms, rotates (pair partners sit in the other group), encodes
    and scatters the entry; then scatters the tail back.
    """
    n, batch, _, width = kv.shape
    entries = formats.layout(entry_format, width, rope_dim, "gpu")
    with_pool = pool is not None
    if with_pool:
        formats.check_stored(entries, pool, "pool")
    check_power_of_two(width=width)
    kernel = functools.partial(_online_kernel, ratio=ratio, max_pages=page_rows.shape[1],
                               eps=eps, entries=entries, with_pool=with_pool)
    outputs = (tail_max, tail_sum, tail_weighted) + ((pool,) if with_pool else ())
    args = (layers.astype(jnp.int32), slot_ids.astype(jnp.int32), start.astype(jnp.int32),
            n_new.astype(jnp.int32), page_rows.astype(jnp.int32), norm.astype(jnp.float32),
            lane_frequencies(inv_freq, width), kv, gate, *outputs)

    def whole(x):
        return pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)

    first = len(args) - len(outputs)
    result = pl.pallas_call(
        kernel,
        grid=(n, batch),
        in_specs=[whole(x) for x in args],
        out_specs=[whole(x) for x in outputs],
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in outputs],
        input_output_aliases={first + k: k for k in range(len(outputs))},
        compiler_params=triton_compiler_params(num_warps, num_stages),
        interpret=interpret,
        name="v4kv_compress_online_gpu",
    )(*args)
    return (result[3] if with_pool else None), tuple(result[:3])
