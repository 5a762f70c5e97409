"""Indexer scores, TPU (Mosaic).

Grid: one program per slot. Scalar-prefetched: the CSA layer, query positions, sequence
lengths and the page table. Indexer keys stay in HBM (`pltpu.HBM`); the pages holding visible
keys are copied `pages_per_block` at a time, each plane's lane rows as stored
(`formats.Part`), into double-buffered VMEM blocks, decoded (`formats.decode_tpu`: a lane
row per key, its slot masked) and scored with two matmuls (q . K per head, then the weighted
sum of the ReLUs over heads), and each chunk of scores is copied out to the score row in HBM
while the next block is scored. Only the used pages are visited; the rest of the row is left
as it was (the caller masks it).

Layout read (`v4kv_jax.pools.lanes`):
  index_keys  planes [n_csa, num_pages, rows, lanes]   page copies
Written:
  scores      f32[B, capacity]                         chunk copies
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import decode, formats, lanes, tpu_pipeline
from pallas_kernels.common import (
    HIGHEST,
    MASK_VALUE,
    candidate_scores,
    cost_estimate,
    in_hbm,
    layer_index,
    nbytes,
    tpu_interpret,
)
from pallas_kernels.indexer.blocks import BlockSizes


def supported(model, geometry, spec=None) -> str | None:
    """Why this TPU kernel cannot run a config, or None: it runs every storage format (whole
    pages of 32-bit lane rows are copied)."""
    del model, geometry, spec
    return None


def _kernel(layer_ref, q_pos_ref, kv_end_ref, table_ref, q_ref, lanes_ref, w_ref, *refs,
            keys: formats.Layout, pages_per_block: int, entries_per_page: int, max_pages: int,
            ratio: int):
    n = len(keys.parts)
    keys_hbm, (scores_hbm,) = refs[:n], refs[n:n + 1]
    bufs, (sems, out_buf, out_sems) = refs[n + 1:2 * n + 1], refs[2 * n + 1:]
    b = pl.program_id(0)
    layer = layer_ref[0]
    visible = jnp.minimum(jax.lax.div(q_pos_ref[b] + 1, ratio), jax.lax.div(kv_end_ref[b], ratio))
    num_pages = jax.lax.div(visible + entries_per_page - 1, entries_per_page)
    num_blocks = jax.lax.div(num_pages + pages_per_block - 1, pages_per_block)
    block_entries = pages_per_block * entries_per_page

    start, wait = tpu_pipeline.page_block_copies(
        table_ref, b, keys_hbm, layer, bufs, sems, num_pages=num_pages,
        pages_per_block=pages_per_block, max_pages=max_pages)

    def score_copy(j, slot):
        dst = scores_hbm.at[pl.ds(b, 1), pl.ds(j * block_entries, block_entries)]
        return pltpu.make_async_copy(out_buf.at[slot], dst, out_sems.at[slot])

    # The query's planes, from the query in natural order (`decode.plane_queries`).
    q = decode.plane_queries(q_ref[...], lanes_ref, keys.n_planes)
    heads, dim = q[0].shape[0], keys.width
    weights = w_ref[...].astype(jnp.float32) * heads**-0.5
    slots = [lanes.slots(part, block_entries, entries_per_page) for part in keys.parts]

    def body(j, slot, carry):
        tiles = [lanes.expand(buf[slot], part, entries_per_page)
                 for buf, part in zip(bufs, keys.parts, strict=True)]
        dots = None
        for qj, kj in zip(q, formats.decode_tpu(keys, tiles, slots), strict=True):
            part = jax.lax.dot_general(qj, kj, (((1,), (1,)), ((), ())), precision=HIGHEST,
                                       preferred_element_type=jnp.float32)
            dots = part if dots is None else dots + part
        relu = jnp.maximum(dots, 0.0) * dim**-0.5
        scores = jnp.dot(weights, relu, precision=HIGHEST, preferred_element_type=jnp.float32)
        entry = j * block_entries + jax.lax.broadcasted_iota(jnp.int32, scores.shape, 1)

        @pl.when(j >= 2)
        def _():
            score_copy(j - 2, slot).wait()

        out_buf[slot] = jnp.where(entry < visible, scores, MASK_VALUE)
        score_copy(j, slot).start()
        return carry

    tpu_pipeline.double_buffered(num_blocks, start, wait, body, 0)

    def drain(back):
        @pl.when(num_blocks >= back)
        def _():
            j = num_blocks - back
            score_copy(j, jax.lax.rem(j, 2)).wait()

    drain(1)
    drain(2)


@functools.partial(jax.jit, static_argnames=("ratio", "block_sizes", "interpret",
                                             "index_format", "index_lanes"))
def index_scores(index_q, index_weights, index_keys, layer, page_rows, q_pos, kv_end, *,
                 ratio: int, block_sizes: BlockSizes | None = None, interpret: bool = False,
                 index_format: str = "float32", index_lanes=()):
    """Indexer scores of one query per slot over its visible keys.

    Args:
      index_q: f32[B, nI, c] (RoPE applied per head; for fp4_index keys already rotated like
        them); index_weights: f32[B, nI] raw weights.
      index_keys: the indexer keys' planes as stored, [n_csa, num_pages, rows, lanes] each;
        layer: index in the CSA stack.
      page_rows: i32[B, max_pages_per_seq]; q_pos, kv_end: i32[B].
      ratio: m.
      index_format: storage format of the keys ("float32", "bfloat16", "float16" or
        "fp4_index": words of the rotated keys, decoded in the kernel); index_lanes: where
        the keys live (static: `v4kv_jax.pools.lanes.LaneMap.spec`).

    Returns:
      f32[B, capacity] (capacity >= max_pages_per_seq * P // m): scores of the visible keys,
      -inf for every other id.
    """
    batch, heads, dim = index_q.shape
    keys = formats.layout(index_format, dim, 0, "tpu", index_lanes)
    formats.check_stored(keys, index_keys, "index_keys")
    epp, max_pages = keys.records, page_rows.shape[1]
    bs = (block_sizes or BlockSizes()).clamped(max_pages * epp)
    ppb = min(bs.pages_per_block(epp), max_pages)
    blocks = -(-max_pages // ppb)
    kernel = functools.partial(_kernel, keys=keys, pages_per_block=ppb, entries_per_page=epp,
                               max_pages=max_pages, ratio=ratio)
    page_bytes = sum(nbytes(x, 2) for x in index_keys)
    scores = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(batch,),
            in_specs=[
                tpu_pipeline.per_row((heads, dim)),
                tpu_pipeline.whole((keys.n_planes, keys.plane_width)),
                pl.BlockSpec((None, 1, heads), lambda b, *_: (b, 0, 0)),
                *[pl.BlockSpec(memory_space=pltpu.HBM)] * len(index_keys),
            ],
            out_specs=pl.BlockSpec(memory_space=pl.ANY),
            scratch_shapes=[*(pltpu.VMEM((2, ppb * x.shape[-2], x.shape[-1]), x.dtype)
                              for x in index_keys),
                            pltpu.SemaphoreType.DMA((2,)),
                            pltpu.VMEM((2, 1, ppb * epp), jnp.float32),
                            pltpu.SemaphoreType.DMA((2,))],
        ),
        out_shape=jax.ShapeDtypeStruct((batch, blocks * ppb * epp), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=tpu_interpret(interpret),
        name="v4kv_indexer_scores",
        cost_estimate=cost_estimate(
            flops=2 * batch * heads * dim * max_pages * epp,
            bytes_accessed=batch * max_pages * (page_bytes + epp * 4)),
    )(layer_index(layer), q_pos.astype(jnp.int32), kv_end.astype(jnp.int32),
      page_rows.astype(jnp.int32).reshape(-1),
      index_q.astype(jnp.float32), jnp.asarray(keys.lane_dims(), jnp.int32),
      index_weights.astype(jnp.float32).reshape(batch, 1, heads), *in_hbm(index_keys))
    return candidate_scores(scores, q_pos, kv_end, ratio)
