"""Records written into a stored array's planes in HBM, in place, TPU (Mosaic).

A decode step writes one record per (layer, slot) block of the window rings and the
compressor tails. XLA:TPU writes such a scatter into a plane ([layers, slots, rows, lanes])
by bringing the whole plane into VMEM and back around it, every layer. This kernel moves
only the lane rows the records sit in: each is copied into VMEM by DMA, the record's words
merged into its slot (`lanes.written`: the records sharing the lane row, and the slot's
padding, keep theirs) and copied back. A lane row a record has to itself, every lane of it
the record's, is written without the read. The planes are aliased to the outputs.

No two records of one call may share a lane row (one record per block); a record whose lane
row is -1 is not written. Records go `chunk` at a time: every read of a chunk is in flight
at once, then every write.

Layout (`v4kv_jax.pools.lanes`):
  planes   [*lead, rows, lanes] per part      written in place
  lead     i32[N * n_lead]                    each record's block (its lead indices)
  rows     i32[parts * N]                     each record's lane row per part (-1: skip)
  slots    i32[parts * N]                     its slot in that lane row
  values   [N, 1, lanes] per part             the part's words at lanes [0, words)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import formats, lanes
from pallas_kernels.common import cost_estimate, in_hbm, tpu_interpret

# VMEM a chunk's buffers take at most (values and lane rows, padded to 8-row tiles).
_CHUNK_VMEM = 4 * 2**20


def _whole(part: formats.Part) -> bool:
    """Whether a record has its lane row to itself and fills it: written without a read."""
    return part.per_row == 1 and part.words == part.lanes


def _kernel(lead_ref, rows_ref, slots_ref, *refs, parts, n_lead: int, chunk: int,
            total: int):
    n = len(parts)
    values, refs = refs[:n], refs[2 * n:]  # the planes' inputs are aliased to the outputs
    planes, bufs, (read_sem, write_sem) = refs[:n], refs[n:2 * n], refs[2 * n:]
    base = pl.program_id(0) * chunk

    def copy(i, k, to_hbm):
        r = base + i
        index = tuple(lead_ref[r * n_lead + j] for j in range(n_lead))
        hbm = planes[k].at[(*index, pl.ds(rows_ref[k * total + r], 1))]
        if to_hbm:
            return pltpu.make_async_copy(bufs[k].at[i], hbm, write_sem)
        return pltpu.make_async_copy(hbm, bufs[k].at[i], read_sem)

    def each(action, to_hbm, which):
        def one(i, carry):
            for k in which:
                @pl.when(rows_ref[k * total + base + i] >= 0)
                def _(k=k):
                    action(copy(i, k, to_hbm))
            return carry

        jax.lax.fori_loop(0, chunk, one, 0)

    shared = [k for k, p in enumerate(parts) if not _whole(p)]
    each(lambda c: c.start(), False, shared)
    each(lambda c: c.wait(), False, shared)

    def merge(i, carry):
        for k, part in enumerate(parts):
            new = values[k][i]
            if not _whole(part):
                merged = lanes.written(part, bufs[k][i], new,
                                       slots_ref[k * total + base + i])
                new = merged if merged.dtype == new.dtype else (
                    jax.lax.bitcast_convert_type(merged, new.dtype))
            bufs[k][i] = new
        return carry

    jax.lax.fori_loop(0, chunk, merge, 0)
    everything = list(range(n))
    each(lambda c: c.start(), True, everything)
    each(lambda c: c.wait(), True, everything)


def write_records(planes, lead, record, values, *, lanes_spec, interpret: bool = False):
    """Writes record `record[i]` of block `lead[i]` for every i, in place.

    Args:
      planes: the stored array's planes, [*lead dims, rows, lanes] each (one per part of
        `lanes_spec`).
      lead: i32[N, n_lead] each record's block; a record whose block is out of range is not
        written.
      record: i32[N] the record within its block (outside [0, records): not written). No
        two records written may share a lane row.
      values: [N, w] the records' words (the planes' 32-bit dtype, or its bits).
      lanes_spec: the array's `LaneMap.spec`: (records a block, its parts' (first, words,
        slot, rows)).
      interpret: run in interpret mode (CPU tests).

    Returns:
      The planes, the records written.
    """
    records, parts = lanes_spec[0], formats.parts_of(lanes_spec[1])
    planes = tuple(planes)
    if len(planes) != len(parts) or any(
            x.shape[-2:] != (p.rows, p.lanes) or x.dtype.itemsize != 4
            for p, x in zip(parts, planes, strict=False)):
        raise ValueError("write_records: planes: expected 32-bit planes [..., rows, lanes] "
                         f"{[(p.rows, p.lanes) for p in parts]}; got "
                         f"{[(tuple(x.shape), str(x.dtype)) for x in planes]}")
    n_lead = planes[0].ndim - 2
    count = record.shape[0]
    if lead.shape != (count, n_lead) or values.shape[0] != count:
        raise ValueError(f"write_records: expected lead [{count}, {n_lead}] and values "
                         f"[{count}, w]; got {lead.shape} and {values.shape}")
    dims = jnp.asarray(planes[0].shape[:n_lead], jnp.int32)
    lead, record = lead.astype(jnp.int32), record.astype(jnp.int32)
    inside = jnp.all((lead >= 0) & (lead < dims), axis=1) & (record >= 0) & (record < records)
    row_bytes = sum(8 * p.lanes * x.dtype.itemsize for p, x in zip(parts, planes, strict=True))
    chunk = max(8, min(128, _CHUNK_VMEM // (2 * row_bytes)))
    chunk = min(chunk, -(-count // 8) * 8)
    total = -(-count // chunk) * chunk
    pad = total - count
    rows = jnp.stack([jnp.where(inside, record // p.per_row, -1) for p in parts])
    slots = jnp.stack([record % p.per_row for p in parts])
    rows, slots = (jnp.pad(x, ((0, 0), (0, pad)), constant_values=-1) for x in (rows, slots))
    lead = jnp.pad(jnp.where(inside[:, None], lead, 0), ((0, pad), (0, 0)))
    words = []
    for p, x in zip(parts, planes, strict=True):
        w = values[:, p.first:p.first + p.words]
        w = w if w.dtype == x.dtype else jax.lax.bitcast_convert_type(w, x.dtype)
        words.append(jnp.pad(w, ((0, pad), (0, p.lanes - p.words)))[:, None, :])
    kernel = functools.partial(_kernel, parts=parts, n_lead=n_lead, chunk=chunk, total=total)
    hbm = pl.BlockSpec(memory_space=pltpu.HBM)
    moved = sum((1 if _whole(p) else 2) * p.lanes * x.dtype.itemsize
                for p, x in zip(parts, planes, strict=True))
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(total // chunk,),
            in_specs=[*(pl.BlockSpec((chunk, 1, p.lanes), lambda g, *_: (g, 0, 0))
                        for p in parts), *[hbm] * len(parts)],
            out_specs=[hbm] * len(parts),
            scratch_shapes=[*(pltpu.VMEM((chunk, 1, p.lanes), x.dtype)
                              for p, x in zip(parts, planes, strict=True)),
                            pltpu.SemaphoreType.DMA(()), pltpu.SemaphoreType.DMA(())],
        ),
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in planes],
        input_output_aliases={3 + len(parts) + k: k for k in range(len(parts))},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=tpu_interpret(interpret),
        name="v4kv_write_records",
        cost_estimate=cost_estimate(flops=0, bytes_accessed=total * moved + sum(
            w.size * w.dtype.itemsize for w in words)),
    )(lead.reshape(-1), rows.reshape(-1), slots.reshape(-1), *words, *in_hbm(planes))
    return tuple(out)


__all__ = ["write_records"]
