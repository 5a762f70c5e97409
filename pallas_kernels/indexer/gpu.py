"""Indexer scores, GPU (Pallas lowered through Triton).

Grid: (slot, block of keys). A program whose block starts past the slot's visible keys does
nothing (its part of the row is left as it was); the others gather their keys through the
page table: key e is record e % (P/m) of block (layer, page_rows[slot, e // (P/m)]) of the
keys' planes, its words read from the lanes its parts give them (`formats.gpu_loader`) and
decoded into planes in registers (`formats.decode_gpu`); they are scored with a matmul per
plane and a weighted sum of the ReLUs over the heads. Indexer heads are padded to a power of
two, at least 16 (zero queries and weights add nothing), for Triton.

Layout read (`v4kv_jax.pools.lanes`):
  index_keys  planes [n_csa, num_pages, rows, lanes]   keys gathered per block
Written:
  scores      f32[B, capacity]                         one block of keys per program
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import formats
from pallas_kernels.common import (
    HIGHEST,
    MASK_VALUE,
    MIN_DOT,
    candidate_scores,
    check_power_of_two,
    layer_index,
    next_power_of_two,
    power_of_two_problem,
    triton_compiler_params,
)
from pallas_kernels.indexer.blocks import BlockSizes


def supported(model, geometry, spec=None) -> str | None:
    """Why this GPU kernel cannot run a config, or None: it reads every storage format (words
    gathered where the lane map puts them, decoded in registers), but a key row is a Triton
    tensor (a power of two)."""
    del geometry, spec
    return power_of_two_problem(index_head_dim=model.index_head_dim)


# One program scores 128 keys: a [nI, 128] score tile stays in registers.
DEFAULT_BLOCK_SIZES = BlockSizes(entries_per_block=128)


def _kernel(layer_ref, q_pos_ref, kv_end_ref, table_ref, q_ref, w_ref, *refs,
            keys: formats.Layout, block: int, entries_per_page: int, max_pages: int, ratio: int,
            heads: int):
    keys_refs, scores_ref = refs[:-1], refs[-1]
    b, j = pl.program_id(0), pl.program_id(1)
    visible = jnp.minimum((q_pos_ref[b] + 1) // ratio, kv_end_ref[b] // ratio)

    @pl.when(j * block < visible)
    def _():
        entry = j * block + jnp.arange(block, dtype=jnp.int32)
        page = table_ref[b, jnp.minimum(entry // entries_per_page, max_pages - 1)]
        valid = (entry < visible) & (page >= 0)
        load = formats.gpu_loader(keys, keys_refs, (layer_ref[0], jnp.maximum(page, 0)),
                                  entry % entries_per_page)
        dots = None
        for plane, kj in enumerate(formats.decode_gpu(keys, load)):
            part = jax.lax.dot_general(q_ref[plane], kj, (((1,), (1,)), ((), ())),
                                       precision=HIGHEST, preferred_element_type=jnp.float32)
            dots = part if dots is None else dots + part
        relu = jnp.maximum(dots, 0.0) * keys.width ** -0.5
        weights = w_ref[...].astype(jnp.float32) * heads**-0.5
        scores = jnp.sum(weights * relu, axis=0)
        scores_ref[...] = jnp.where(valid, scores, MASK_VALUE)


@functools.partial(jax.jit, static_argnames=("ratio", "block_sizes", "interpret", "num_warps",
                                             "num_stages", "index_format", "index_lanes"))
def index_scores(index_q, index_weights, index_keys, layer, page_rows, q_pos, kv_end, *,
                 ratio: int, block_sizes: BlockSizes | None = None, interpret: bool = False,
                 num_warps: int = 4, num_stages: int = 2, index_format: str = "float32",
                 index_lanes=()):
    """Same contract as `pallas_kernels.indexer.tpu.index_scores` (`index_keys` a tuple of
    planes, their lane map in `index_lanes`), and the Triton launch parameters `num_warps`,
    `num_stages`."""
    batch, heads, dim = index_q.shape
    index_keys = tuple(index_keys)
    keys = formats.layout(index_format, dim, 0, "gpu", index_lanes)
    formats.check_stored(keys, index_keys, "index_keys")
    epp, max_pages = formats.records_of(keys, index_keys), page_rows.shape[1]
    bs = (block_sizes or DEFAULT_BLOCK_SIZES).clamped(max_pages * epp)
    block = max(bs.entries_per_block, MIN_DOT)
    padded_heads = max(MIN_DOT, next_power_of_two(heads))
    check_power_of_two(index_head_dim=dim, entries_per_block=block,
                       index_heads_padded=padded_heads)
    q = jnp.pad(index_q.astype(jnp.float32), ((0, 0), (0, padded_heads - heads), (0, 0)))
    q = jnp.moveaxis(formats.to_planes(keys, q), -2, 1)  # [B, n_planes, heads, plane_width]
    w = jnp.pad(index_weights.astype(jnp.float32), ((0, 0), (0, padded_heads - heads)))
    blocks = -(-(max_pages * epp) // block)

    def whole(x):
        return pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)

    scalars = (layer_index(layer), q_pos.astype(jnp.int32), kv_end.astype(jnp.int32),
               page_rows.astype(jnp.int32))
    kernel = functools.partial(_kernel, keys=keys, block=block, entries_per_page=epp,
                               max_pages=max_pages, ratio=ratio, heads=heads)
    scores = pl.pallas_call(
        kernel,
        grid=(batch, blocks),
        in_specs=[*(whole(x) for x in scalars),
                  pl.BlockSpec((None, keys.n_planes, padded_heads, keys.plane_width),
                               lambda b, j: (b, 0, 0, 0)),
                  pl.BlockSpec((None, padded_heads, 1), lambda b, j: (b, 0, 0)),
                  *(whole(x) for x in index_keys)],
        out_specs=pl.BlockSpec((None, block), lambda b, j: (b, j)),
        out_shape=jax.ShapeDtypeStruct((batch, blocks * block), jnp.float32),
        compiler_params=triton_compiler_params(num_warps, num_stages),
        interpret=interpret,
        name="v4kv_indexer_scores_gpu",
    )(*scalars, q, w[..., None], *index_keys)
    return candidate_scores(scores, q_pos, kv_end, ratio)
