"""Indexer scores, TPU (Mosaic).

Grid: one program per slot. Scalar-prefetched: the CSA layer, query positions, sequence
lengths and the page table. Indexer keys stay in HBM (`pl.ANY`); the pages holding visible
keys are copied `pages_per_block` at a time into a double-buffered VMEM block, scored with
two matmuls (q . K per head, then the weighted sum of the ReLUs over heads), and each chunk
of scores is copied out to the score row in HBM while the next block is scored. Only the
used pages are visited; the rest of the row is left as it was (the caller masks it). Packed
keys (fp4_index) are decoded in VMEM into planes (`formats.decode_tpu`) against query planes
laid out the same way.

Layout read:
  index_keys  [n_csa, num_pages, P // m, S]   page copies (S: c, or the packed row's words)
Written:
  scores      f32[B, capacity]                 chunk copies
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import formats, tpu_pipeline
from pallas_kernels.common import (
    HIGHEST,
    MASK_VALUE,
    candidate_scores,
    cost_estimate,
    layer_index,
    nbytes,
    tpu_interpret,
    tpu_row_copy_problem,
)
from pallas_kernels.indexer.blocks import BlockSizes


def supported(model, geometry, spec=None) -> str | None:
    """Why this TPU kernel cannot run a config, or None: it copies whole pages of keys
    (P // m rows, a multiple of 32), which Mosaic does in every storage format."""
    del spec
    return tpu_row_copy_problem(geometry.page_tokens // model.csa_ratio,
                                index_dtype=geometry.index_dtype)


def _kernel(layer_ref, q_pos_ref, kv_end_ref, table_ref, q_ref, w_ref, keys_hbm, scores_hbm,
            buf, sems, out_buf, out_sems, *, keys: formats.Layout, pages_per_block: int,
            entries_per_page: int, max_pages: int, ratio: int):
    b = pl.program_id(0)
    layer = layer_ref[0]
    visible = jnp.minimum(jax.lax.div(q_pos_ref[b] + 1, ratio), jax.lax.div(kv_end_ref[b], ratio))
    num_pages = jax.lax.div(visible + entries_per_page - 1, entries_per_page)
    num_blocks = jax.lax.div(num_pages + pages_per_block - 1, pages_per_block)
    block_entries = pages_per_block * entries_per_page

    start, wait = tpu_pipeline.page_block_copies(
        table_ref, b, keys_hbm, layer, buf, sems, num_pages=num_pages,
        pages_per_block=pages_per_block, entries_per_page=entries_per_page, max_pages=max_pages)

    def score_copy(j, slot):
        dst = scores_hbm.at[pl.ds(b, 1), pl.ds(j * block_entries, block_entries)]
        return pltpu.make_async_copy(out_buf.at[slot], dst, out_sems.at[slot])

    q = [q_ref[j] for j in range(keys.n_planes)]
    heads, dim = q[0].shape[0], keys.width
    weights = w_ref[...].astype(jnp.float32) * heads**-0.5

    def body(j, slot, carry):
        dots = None
        for qj, kj in zip(q, formats.decode_tpu(keys, buf[slot]), strict=True):
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
                                             "index_format"))
def index_scores(index_q, index_weights, index_keys, layer, page_rows, q_pos, kv_end, *,
                 ratio: int, block_sizes: BlockSizes | None = None, interpret: bool = False,
                 index_format: str = "float"):
    """Indexer scores of one query per slot over its visible keys.

    Args:
      index_q: f32[B, nI, c] (RoPE applied per head; for fp4_index keys already rotated like
        them); index_weights: f32[B, nI] raw weights.
      index_keys: [n_csa, num_pages, P // m, S] as stored; layer: index in the CSA stack.
      page_rows: i32[B, max_pages_per_seq]; q_pos, kv_end: i32[B].
      ratio: m.
      index_format: storage format of the keys (a float dtype name, read as stored, or
        "fp4_index": uint32 rows of the rotated keys, decoded in the kernel; S is
        `formats.Layout.stored_width`).

    Returns:
      f32[B, capacity] (capacity >= max_pages_per_seq * P // m): scores of the visible keys,
      -inf for every other id.
    """
    batch, heads, dim = index_q.shape
    keys = formats.layout(index_format, dim, 0, "tpu")
    formats.check_stored(keys, index_keys, "index_keys")
    epp, max_pages = index_keys.shape[2], page_rows.shape[1]
    bs = (block_sizes or BlockSizes()).clamped(max_pages * epp)
    ppb = min(bs.pages_per_block(epp), max_pages)
    blocks = -(-max_pages // ppb)
    kernel = functools.partial(_kernel, keys=keys, pages_per_block=ppb, entries_per_page=epp,
                               max_pages=max_pages, ratio=ratio)
    scores = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(batch,),
            in_specs=[
                pl.BlockSpec((None, keys.n_planes, heads, keys.plane_width),
                             lambda b, *_: (b, 0, 0, 0)),
                pl.BlockSpec((None, 1, heads), lambda b, *_: (b, 0, 0)),
                pl.BlockSpec(memory_space=pl.ANY),
            ],
            out_specs=pl.BlockSpec(memory_space=pl.ANY),
            scratch_shapes=[pltpu.VMEM((2, ppb * epp, keys.stored_width), index_keys.dtype),
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
            bytes_accessed=batch * max_pages * epp * (nbytes(index_keys, 1) + 4)),
    )(layer_index(layer), q_pos.astype(jnp.int32), kv_end.astype(jnp.int32),
      page_rows.astype(jnp.int32).reshape(-1),
      jnp.moveaxis(formats.to_planes(keys, index_q.astype(jnp.float32)), -2, 1),
      index_weights.astype(jnp.float32).reshape(batch, 1, heads), index_keys)
    return candidate_scores(scores, q_pos, kv_end, ratio)
