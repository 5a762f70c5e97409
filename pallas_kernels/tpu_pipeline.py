"""Pieces shared by the TPU kernels: double-buffered HBM -> VMEM copy pipelines, and the
block specs and output of the two decode attention kernels.

A kernel reads its operand in blocks: block j is a batch of async copies (whole pages, or
single rows) into buffer slot j % 2. `double_buffered` starts block j + 1 before it waits
for block j, so one block is always in flight while the current one is computed on.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import lanes


def block_copies(copy, valid, count: int, on_skip=None, on_copy=None):
    """(start, wait): issue / await the copies of block j into buffer slot `slot`.

    Args:
      copy: copy(j, i, slot) -> the async copy descriptor(s) of item i of block j (one, or
        a list: one per plane of a stored array).
      valid: valid(j, i) -> bool, whether item i of block j is copied.
      count: items per block.
      on_skip: on_skip(j, i, slot), run by `start` for each item that is not copied.
      on_copy: on_copy(j, i, slot), run by `start` for each item that is copied.
    """

    def each(j, slot, action, skip=None, copied=None):
        def one(i, carry):
            ok = valid(j, i)

            @pl.when(ok)
            def _():
                copies = copy(j, i, slot)
                for c in copies if isinstance(copies, (list, tuple)) else (copies,):
                    action(c)
                if copied is not None:
                    copied(j, i, slot)

            if skip is not None:
                @pl.when(jnp.logical_not(ok))
                def _():
                    skip(j, i, slot)

            return carry

        jax.lax.fori_loop(0, count, one, 0)

    def start(j, slot):
        each(j, slot, lambda c: c.start(), on_skip, on_copy)

    def wait(j, slot):
        each(j, slot, lambda c: c.wait())

    return start, wait


def page_block_copies(table_ref, row, planes, layer, bufs, sems, *, num_pages,
                      pages_per_block: int, max_pages: int):
    """(start, wait) for whole pages: block j holds pages j * pages_per_block + i (i <
    pages_per_block) of page-table row `row`; each plane of the stored array (`planes`, HBM
    refs [n_layers, num_pages, rows, lanes]) copies page `page`'s lane rows to rows
    i * rows.. of its buffer (`bufs`, [2, pages_per_block * rows, lanes] each). Pages at or
    past `num_pages`, and absent pages (-1), are not copied (their buffer rows keep stale
    data: the caller masks them).

    Args:
      table_ref: the flattened page table (scalar prefetch), i32[B * max_pages].
      num_pages: pages of the row to read (traced).
    """

    def page_copy(j, i, slot):
        page = jnp.maximum(table_ref[row * max_pages + j * pages_per_block + i], 0)
        copies = []
        for hbm, buf in zip(planes, bufs, strict=True):
            rows = hbm.shape[-2]
            dst = buf.at[slot, pl.ds(i * rows, rows)]
            copies.append(pltpu.make_async_copy(hbm.at[layer, page], dst, sems.at[slot]))
        return copies

    def copied(j, i):
        col = j * pages_per_block + i
        return (col < num_pages) & (table_ref[row * max_pages + jnp.minimum(col, max_pages - 1)]
                                    >= 0)

    return block_copies(page_copy, copied, pages_per_block)


def double_buffered(num_blocks, start, wait, body, init):
    """fori_loop of body(j, slot, carry) over j < num_blocks (traced), block j's copies
    landed in buffer `slot` and block j + 1's in flight."""

    @pl.when(num_blocks > 0)
    def _():
        start(0, 0)

    def step(j, carry):
        slot = jax.lax.rem(j, 2)

        @pl.when(j + 1 < num_blocks)
        def _():
            start(j + 1, 1 - slot)

        wait(j, slot)
        return body(j, slot, carry)

    return jax.lax.fori_loop(0, num_blocks, step, init)



def per_row(shape):
    """BlockSpec of row b of a [B, *shape] array for the program of slot b."""
    return pl.BlockSpec((None, *shape), lambda b, *_: (b,) + (0,) * len(shape))


def query_window_specs(groups, heads: int, dim: int, window) -> list:
    """In-specs of (the query f32[B, H, hd], each group's lane table [n_planes, pw], the lane
    frequencies [1, hd], sink [H, 1], the window rings' planes [n_layers, max_slots, rows,
    lanes]) for a decode attention kernel whose first prefetched scalars are (layers, q_pos,
    kv_end, slot_ids): each ring block is (layers[0], slot)."""
    return [
        per_row((heads, dim)),
        *(whole((lay.n_planes, lay.plane_width)) for lay in groups.layouts),
        whole((1, dim)),
        whole((heads, 1)),
        *(pl.BlockSpec((None, None, *x.shape[-2:]),
                       lambda b, layers, qp, ke, slots, *_: (layers[0], slots[b], 0, 0))
          for x in window),
    ]


def query_window_inputs(groups, q, lane_freq, sink) -> list:
    """The arrays `query_window_specs` describes, up to the window."""
    return [q.astype(jnp.float32), *groups.lane_tables(), lane_freq,
            sink.astype(jnp.float32).reshape(-1, 1)]


def whole(shape):
    """BlockSpec of a whole small array, the same block for every program."""
    return pl.BlockSpec(shape, lambda b, *_: (0,) * len(shape))


def window_rows(lay, refs, window: int):
    """The window ring's rows as `formats.decode_tpu` takes them: (per part, [W, lanes]
    int32 words, one lane row per ring row; per part, its slots or None), from the ring
    blocks' VMEM refs."""
    tiles = [lanes.expand(ref[...], part, window) for ref, part in zip(refs, lay.parts,
                                                                       strict=True)]
    return tiles, [lanes.slots(part, window, window) for part in lay.parts]


def output_spec(heads: int, dim: int):
    """Out-spec and shape of the output in natural order, de-rotated, f32[B, H, hd]."""
    return per_row((heads, dim))


def output_shape(batch: int, heads: int, dim: int):
    return jax.ShapeDtypeStruct((batch, heads, dim), jnp.float32)


def write_output(o_ref, groups, state, table_refs, q_pos, lane_freq_ref) -> None:
    """Normalises the softmax, puts it in natural order and de-rotates it by -q_pos."""
    o_ref[...] = groups.natural_output(state, table_refs, o_ref.shape[-1], q_pos,
                                       lane_freq_ref[...])
