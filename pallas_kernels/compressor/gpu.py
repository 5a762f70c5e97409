"""Compressor emission, GPU (Pallas lowered through Triton).

Grid: (layer, slot row, step of `blocks_per_step` blocks); steps whose first block does not
complete do nothing. A program gathers its slot rows straight from the chunk or the tail
ring ([blocks, slots, lanes] tiles: a ring row's words from the lanes its parts give them,
16-bit floats widened from their word's half, `formats.gpu_float_values`), pools them, and
after the RMSNorm (whose sum of squares spans all passes) rotates, encodes and stores each
pass with masked scatters into the pool's planes, aliased to the outputs (in place when
donated): a word is written at its own lane only (`formats.gpu_scatter`), so entries sharing
a lane row never touch each other's lanes.

Passes hold a row as planes of its dims (`formats.gpu_encoder_planes`: plane lane l holds dim
first + stride * l), each gathered with a strided column map, so that neither RoPE nor the
encoding needs a lane shuffle (which Triton does not expose in Pallas): float pools pool
`channels_per_step` dims a pass as two planes, the even and the odd dims, which are each
other's RoPE partners and together a 16-bit word's two halves; fp8_latent pools the
encoder's planes (byte j of the 16 code words of a scale block, then the even and odd RoPE
dims), encoded and stored lane by lane after the last pass; fp4_index keys pool float passes
and accumulate the Hadamard rotation into the 8 nibble planes with +-1 sums
(`formats.hadamard_planes`), encoded after the last pass. `emit_entries_online`
(hca_tail="online") is described at its wrapper.

Layout (`v4kv_jax.pools.lanes`):
  kv, gate        [n, B, T, in_width]                       the chunk (gate biased), read
  tail kv, gate   planes [n_kind, max_slots, rows, lanes]   ring before the chunk, read
  pool            planes [n_kind, num_pages, rows, lanes]   entries scattered word by word
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels import formats
from pallas_kernels.common import (
    check_power_of_two,
    lane_frequencies,
    power_of_two_problem,
    rounded,
    triton_compiler_params,
)
from pallas_kernels.compressor.blocks import BlockSizes
from pallas_kernels.compressor.pooling import online_step, softmax_pool


def supported(model, geometry, spec=None) -> str | None:
    """Why these GPU kernels cannot run a config, or None. They run every storage format
    (tail rows decoded and entries encoded in the kernel, words read and written where the
    lane maps put them), but the row widths and the tokens pooled into one entry (ratio, or
    2 * ratio with the overlap) are Triton tensor sizes (powers of two)."""
    del geometry, spec
    return power_of_two_problem(head_dim=model.head_dim, index_head_dim=model.index_head_dim,
                                csa_ratio=model.csa_ratio, hca_ratio=model.hca_ratio)


# Tiles of [blocks, slots, 32 channels] with blocks * slots <= 128 (4K values per gather).
DEFAULT_BLOCK_SIZES = BlockSizes(blocks_per_step=64, slot_rows_per_step=128, channels_per_step=32)


def _iota(shape, axis):
    return jax.lax.broadcasted_iota(jnp.int32, shape, axis)


def _store(lay: formats.Layout, planes, lead, record, segments, keep) -> None:
    """Scatters `formats.encode_gpu` segments of records `record` (i32[G, 1], or a scalar)
    of block `lead` where `keep` ([G, 1] or a scalar)."""
    for first, stride, words, n in segments:
        lane = _iota((1, words.shape[1]), 1)
        formats.gpu_scatter(lay, planes, lead, record, first + stride * lane, words,
                            keep & (lane < n), first, first + stride * (n - 1))


def _float_passes(width: int, channels: int):
    """Per pass of `channels` dims, its two planes: the even and the odd dims."""
    half = max(channels, 2) // 2
    return [((c0, 2, half), (c0 + 1, 2, half)) for c0 in range(0, width, 2 * half)]


def _rotate_pair(even, odd, angle):
    """RoPE of pair planes (dims 2 i, 2 i + 1), term by term as `common.rotate_lanes`:
    (x0 cos - x1 sin, x1 cos + x0 sin), each product rounded on its own as there; angle 0
    leaves a finite pair as it is."""
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    return (rounded(even * cos) + rounded(odd * -sin),
            rounded(odd * cos) + rounded(even * sin))


def _kernel(layers_ref, slot_ref, start_ref, n_new_ref, table_ref, norm_ref, freq_ref, kv_ref,
            gate_ref, *refs, ratio: int, overlap: bool, blocks_per_step: int, channels: int,
            tokens: int, max_pages: int, eps: float, entries: formats.Layout,
            tail: formats.Layout):
    nt, npool = len(tail.parts), len(entries.parts)
    ring_kv, ring_gate = refs[:nt], refs[nt:2 * nt]
    pool = refs[2 * nt + npool:]  # the pool's inputs (refs[2 nt:2 nt + npool]) are aliased
    li, b, t = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    m = ratio
    width = entries.width
    slots, ring = (2 * m, 2 * m) if overlap else (m, m)
    epp = entries.records
    start = start_ref[b]
    end = start + n_new_ref[b]
    block0 = start // m + t * blocks_per_step

    @pl.when((block0 + 1) * m <= end)
    def _():
        layer, slot = layers_ref[li], slot_ref[b]

        def slot_grid(shape):  # (position, block completes) of each slot row
            block = block0 + _iota(shape, 0)
            pos = block * m - (m if overlap else 0) + _iota(shape, 1)
            return pos, (block + 1) * m <= end

        rows_pos, rows_done = slot_grid((blocks_per_step, slots, 1))
        valid = (rows_pos >= 0) & rows_done
        block_done = (block0 + _iota((blocks_per_step, 1, 1), 0) + 1) * m <= end

        def pooled(first, stride, lanes):
            """f32[blocks, lanes]: the pooled dims first + stride * l."""
            shape = (blocks_per_step, slots, lanes)
            pos, _ = slot_grid(shape)
            old = pos < start
            ring_row = jnp.maximum(pos, 0) % ring
            chunk_row = jnp.clip(pos - start, 0, tokens - 1)
            half = jnp.where(_iota(shape, 1) >= m, width, 0) if overlap else 0
            col = half + first + stride * _iota(shape, 2)
            last = (width if overlap else 0) + first + stride * (lanes - 1)

            def read(chunk_ref, tail_planes):
                new = chunk_ref[li, b, chunk_row, col].astype(jnp.float32)
                held = formats.gpu_float_values(tail, tail_planes, (layer, slot), ring_row, col,
                                                first, last)
                return jnp.where(old, held, new)

            return softmax_pool(read(kv_ref, ring_kv), read(gate_ref, ring_gate), valid,
                                block_done)

        row_block = block0 + _iota((blocks_per_step, 1), 0)
        col = jax.lax.div(row_block, epp)
        page = table_ref[b, jnp.minimum(col, max_pages - 1)]
        keep = ((row_block + 1) * m <= end) & (col < max_pages) & (page >= 0)
        lead, record = (layer, jnp.maximum(page, 0)), jax.lax.rem(row_block, epp)
        angle_of = (row_block * m).astype(jnp.float32)

        def norm_of(first, stride, lanes):
            return norm_ref[li, first + stride * _iota((1, lanes), 1)]

        def rms(xs):
            sum_sq = sum(jnp.sum(jnp.square(x), axis=-1, keepdims=True) for x in xs)
            return jax.lax.rsqrt(sum_sq / width + eps)

        if entries.fmt == "fp8_latent":
            # Each plane of the encoder pooled straight from its dims; nothing to rotate but
            # the RoPE planes, whose pair partners are each other.
            planes = formats.gpu_encoder_planes(entries)
            xs = [pooled(*plane) for plane in planes]
            inv_rms = rms(xs)
            ys = [x * inv_rms * norm_of(*plane) for x, plane in zip(xs, planes, strict=True)]
            if entries.rope_dim:
                first, stride, lanes = planes[-2]
                angle = angle_of * freq_ref[0, first + stride * _iota((1, lanes), 1)]
                ys[-2:] = _rotate_pair(*ys[-2:], angle)
            _store(entries, pool, lead, record, formats.encode_gpu(entries, ys), keep)
            return

        passes = [(groups, [pooled(*g) for g in groups])
                  for groups in _float_passes(width, channels)]
        inv_rms = rms([x for _, xs in passes for x in xs])
        rotated = None
        for groups, xs in passes:
            even, odd = (x * inv_rms * norm_of(*g) for x, g in zip(xs, groups, strict=True))
            first, stride, lanes = groups[0]
            angle = angle_of * freq_ref[0, first + stride * _iota((1, lanes), 1)]
            ys = _rotate_pair(even, odd, angle)
            if entries.fmt == "fp4_index":
                part = [p + q for p, q in zip(
                    *(formats.hadamard_planes(entries, y, g[0], g[1])
                      for y, g in zip(ys, groups, strict=True)), strict=True)]
                rotated = part if rotated is None else [
                    r + p for r, p in zip(rotated, part, strict=True)]
            else:
                _store(entries, pool, lead, record, formats.encode_gpu(entries, ys, groups),
                       keep)
        if entries.fmt == "fp4_index":
            scaled = [r * np.float32(width ** -0.5) for r in rotated]
            _store(entries, pool, lead, record, formats.encode_gpu(entries, scaled), keep)


def _check_tail(tail_format: str) -> None:
    if tail_format not in formats.FLOATS:
        raise ValueError(f"tail_format: expected one of {formats.FLOATS} (tails are float "
                         f"rows); got {tail_format!r}")


@functools.partial(jax.jit, static_argnames=("ratio", "overlap", "eps", "block_sizes",
                                             "interpret", "num_warps", "num_stages",
                                             "entry_format", "rope_dim", "tail_format",
                                             "entry_lanes", "tail_lanes"),
                   donate_argnames=("pool",))
def emit_entries(pool, page_rows, layers, tail_kv, tail_gate, slot_ids, kv, gate, start, n_new,
                 norm, inv_freq, *, ratio: int, overlap: bool, eps: float,
                 block_sizes: BlockSizes | None = None, interpret: bool = False,
                 num_warps: int = 4, num_stages: int = 1, entry_format: str = "float32",
                 rope_dim: int = 0, tail_format: str = "float32", entry_lanes=(),
                 tail_lanes=()):
    """Same contract as `pallas_kernels.compressor.tpu.emit_entries` (`pool`, `tail_kv` and
    `tail_gate` tuples of planes; every format encoded in the kernel by
    `formats.encode_gpu`, bit for bit as `storage` encodes the same fp32 entry), and the
    Triton launch parameters `num_warps`, `num_stages`.

    Returns:
      The pool's planes (a tuple) with the entries of completed blocks written.
    """
    n, batch, tokens, in_width = kv.shape
    width = norm.shape[-1]
    _check_tail(tail_format)
    entries = formats.layout(entry_format, width, rope_dim, "gpu", entry_lanes)
    tail = formats.layout(tail_format, in_width, 0, "gpu", tail_lanes)
    pool, tail_kv, tail_gate = tuple(pool), tuple(tail_kv), tuple(tail_gate)
    formats.check_stored(entries, pool, "pool")
    formats.check_stored(tail, tail_kv, "tail_kv")
    formats.check_stored(tail, tail_gate, "tail_gate")
    lane_freq = lane_frequencies(inv_freq, width)
    slots = 2 * ratio if overlap else ratio
    blocks = -(-tokens // ratio)
    bs = (block_sizes or DEFAULT_BLOCK_SIZES).for_gpu(blocks, slots, width)
    check_power_of_two(width=width, slots=slots)
    steps = -(-blocks // bs.blocks_per_step)
    kernel = functools.partial(
        _kernel, ratio=ratio, overlap=overlap, blocks_per_step=bs.blocks_per_step,
        channels=bs.channels_per_step, tokens=tokens, max_pages=page_rows.shape[1], eps=eps,
        entries=entries, tail=tail)
    args = (layers.astype(jnp.int32), slot_ids.astype(jnp.int32), start.astype(jnp.int32),
            n_new.astype(jnp.int32), page_rows.astype(jnp.int32), norm.astype(jnp.float32),
            lane_freq, kv, gate, *tail_kv, *tail_gate, *pool)

    def whole(x):
        return pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)

    first = len(args) - len(pool)
    out = pl.pallas_call(
        kernel,
        grid=(n, batch, steps),
        in_specs=[whole(x) for x in args],
        out_specs=[whole(x) for x in pool],
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in pool],
        input_output_aliases={first + k: k for k in range(len(pool))},
        compiler_params=triton_compiler_params(num_warps, num_stages),
        interpret=interpret,
        name="v4kv_compress_emit_gpu",
    )(*args)
    return tuple(out)


def _online_groups(entries: formats.Layout) -> tuple[tuple[int, int, int], ...]:
    """Lane groups (first dim, stride, lanes) the online kernel holds a row in: the encoder's
    planes for fp8_latent, else the even and the odd dims (each the other's RoPE partner)."""
    if entries.fmt == "fp8_latent":
        return formats.gpu_encoder_planes(entries)
    return ((0, 2, entries.width // 2), (1, 2, entries.width // 2))


def _online_kernel(layers_ref, slot_ref, start_ref, n_new_ref, table_ref, norm_ref, freq_ref,
                   kv_ref, gate_ref, *refs, ratio: int, max_pages: int, eps: float,
                   entries: formats.Layout, tail: formats.Layout, with_pool: bool):
    nt, npool = len(tail.parts), len(entries.parts) if with_pool else 0
    n_io = 3 * nt + npool
    tails_in = [refs[k * nt:(k + 1) * nt] for k in range(3)]
    tails = [refs[n_io + k * nt:n_io + (k + 1) * nt] for k in range(3)]
    pool = refs[n_io + 3 * nt:]
    li, b = pl.program_id(0), pl.program_id(1)
    layer, slot = layers_ref[li], slot_ref[b]
    start, n_new = start_ref[b], n_new_ref[b]
    max_slots, m, width = tails[0][0].shape[1], ratio, entries.width
    groups = _online_groups(entries)

    def dims(group):
        first, stride, lanes = group
        return first + stride * _iota((1, lanes), 1)

    def last(group):
        first, stride, lanes = group
        return first + stride * (lanes - 1)

    read = jnp.clip(slot, 0, max_slots - 1)
    state = tuple([formats.gpu_float_values(tail, planes, (layer, read), 0, dims(g), g[0],
                                            last(g)) for g in groups]
                  for planes in tails_in)

    def write_entry(block, u, s):
        xs = [uu / ss for uu, ss in zip(u, s, strict=True)]
        sum_sq = sum(jnp.sum(jnp.square(x), axis=-1, keepdims=True) for x in xs)
        inv_rms = jax.lax.rsqrt(sum_sq / width + eps)
        ys = [x * inv_rms * norm_ref[li, dims(g)] for x, g in zip(xs, groups, strict=True)]
        if entries.fmt != "fp8_latent" or entries.rope_dim:
            even, odd = ys[-2:]
            freq = freq_ref[0, dims(groups[-2])]
            rotated = _rotate_pair(even, odd, (block * m).astype(jnp.float32) * freq)
            rotates = freq > 0  # the RoPE dims; the others stay as they are
            ys[-2:] = [jnp.where(rotates, r, y) for r, y in zip(rotated, (even, odd),
                                                                 strict=True)]
        col = jax.lax.div(block, entries.records)
        page = table_ref[b, jnp.minimum(col, max_pages - 1)]
        keep = (col < max_pages) & (page >= 0)
        if entries.fmt == "fp4_index":
            parts = [formats.hadamard_planes(entries, y, g[0], g[1])
                     for y, g in zip(ys, groups, strict=True)]
            segments = formats.encode_gpu(entries, [
                (p + q) * np.float32(width ** -0.5) for p, q in zip(*parts, strict=True)])
        else:
            segments = formats.encode_gpu(entries, ys, groups)
        _store(entries, pool, (layer, jnp.maximum(page, 0)), jax.lax.rem(block, entries.records),
               segments, keep)

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
        for planes, values in zip(tails, state, strict=True):
            _store(tail, planes, (layer, slot), 0, formats.encode_gpu(tail, values, groups),
                   True)


@functools.partial(jax.jit, static_argnames=("ratio", "eps", "interpret", "num_warps",
                                             "num_stages", "entry_format", "rope_dim",
                                             "tail_format", "entry_lanes", "tail_lanes"),
                   donate_argnames=("pool", "tail_max", "tail_sum", "tail_weighted"))
def emit_entries_online(pool, page_rows, layers, tail_max, tail_sum, tail_weighted, slot_ids,
                        kv, gate, start, n_new, norm, inv_freq, *, ratio: int, eps: float,
                        interpret: bool = False, num_warps: int = 4, num_stages: int = 1,
                        entry_format: str = "float32", rope_dim: int = 0,
                        tail_format: str = "float32", entry_lanes=(), tail_lanes=()):
    """Same contract as `pallas_kernels.compressor.tpu.emit_entries_online` (pool and tails
    tuples of planes), and the Triton launch parameters `num_warps`, `num_stages`.

    Grid: (layer, slot row). A program holds its row's tail in registers as lane groups
    (`_online_groups`, gathered with strided column maps from the lanes the tail's parts
    give them, 16-bit tails widened exactly), folds the chunk token by token and, at each
    block end, norms, rotates (pair partners sit in the other group), encodes and scatters
    the entry; then encodes the tail and scatters it back.

    Returns:
      (the pool's planes or None, (max, sum, weighted) planes after the chunk).
    """
    n, batch, _, width = kv.shape
    _check_tail(tail_format)
    entries = formats.layout(entry_format, width, rope_dim, "gpu", entry_lanes)
    tail = formats.layout(tail_format, width, 0, "gpu", tail_lanes)
    with_pool = pool is not None
    pool = tuple(pool) if with_pool else ()
    if with_pool:
        formats.check_stored(entries, pool, "pool")
    tails = (tuple(tail_max), tuple(tail_sum), tuple(tail_weighted))
    for name, planes in zip(("tail_max", "tail_sum", "tail_weighted"), tails, strict=True):
        formats.check_stored(tail, planes, name)
    check_power_of_two(width=width)
    kernel = functools.partial(_online_kernel, ratio=ratio, max_pages=page_rows.shape[1],
                               eps=eps, entries=entries, tail=tail, with_pool=with_pool)
    outputs = (*tails[0], *tails[1], *tails[2], *pool)
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
    k = len(tails[0])
    state = (tuple(result[:k]), tuple(result[k:2 * k]), tuple(result[2 * k:3 * k]))
    return (tuple(result[3 * k:]) if with_pool else None), state
