"""The split-K launch shared by the GPU decode attention kernels (CSA sparse, HCA dense).

Grid (slot, head block, split): every program reads the scalars and the planes of the window
and entry arrays whole (Triton indexes them itself: a record's words are gathered from the
lanes its parts give them, `formats.gpu_loader`), its head block of query planes, and writes
the partial softmax state (accumulator planes, max, sum) of its split. XLA then merges the
splits with the sink (`decode.combine_partials`), puts the planes back in natural order and
de-rotates the output by -q_pos (a lane-pair exchange has no Triton equivalent in Pallas).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import decode, formats
from pallas_kernels.common import MASK_VALUE, triton_compiler_params


def fold_window(state, groups: decode.KeyGroups, q, window_refs, layer, slot, q_pos, kv_end,
                *, window: int, window_block: int, scale: float):
    """Folds the whole ring of (layer, slot) (`window_refs`: the ring's planes),
    `window_block` rows at a time (tiles of the ring, not all W rows), decoded in the window
    group's layout."""
    g = groups.window
    for first in range(0, window, window_block):
        rows = first + jnp.arange(window_block, dtype=jnp.int32)
        load = formats.gpu_loader(groups.window_layout, window_refs, (layer, slot), rows)
        ring = formats.decode_gpu(groups.window_layout, load)
        state = decode.fold_window(state, q[g], ring, q_pos, kv_end, window, scale, first, g)
    return state


def empty_state(groups: decode.KeyGroups, heads: int):
    """The partial state of a split before any key (no sink: XLA adds it when merging)."""
    return (jnp.full((heads, 1), MASK_VALUE, jnp.float32), jnp.zeros((heads, 1), jnp.float32),
            groups.zero_accs(heads))


def first_state(split, groups: decode.KeyGroups, q, window_refs, layer, slot, q_pos, kv_end,
                *, window: int, window_block: int, scale: float):
    """The state a split starts from: the whole window folded in by split 0, nothing by the
    others (each key is counted once across the splits)."""
    state = empty_state(groups, q[0][0].shape[0])
    return jax.lax.cond(
        split == 0,
        lambda s: fold_window(s, groups, q, window_refs, layer, slot, q_pos, kv_end,
                              window=window, window_block=window_block, scale=scale),
        lambda s: s, state)


def write_state(state, acc_refs, m_ref, l_ref) -> None:
    m, denom, accs = state
    for ref, planes in zip(acc_refs, accs, strict=True):
        for j, plane in enumerate(planes):
            ref[j] = plane
    m_ref[...] = m
    l_ref[...] = denom


def split_k_decode(kernel, scalars, groups: decode.KeyGroups, q, window, entries, sink, q_pos,
                   lane_freq, *, heads_per_block: int, num_splits: int, num_warps: int,
                   num_stages: int, interpret: bool, name: str) -> jax.Array:
    """Runs `kernel` over (slot, head block, split) and finishes its partial states.

    Args:
      kernel: refs (*scalars, *query planes per group, *window planes, *entry planes,
        *accumulator planes per group, max, sum).
      scalars: i32 arrays passed whole.
      groups: the key layouts; q: f32[B, H, hd] queries.
      window, entries: the planes of the window rings and of the kind's Classical array, as
        stored (tuples of arrays, one per part).
      sink: f32[H]; q_pos: i32[B]; lane_freq: f32[1, hd].

    Returns:
      f32[B, H, hd], normalised and de-rotated.
    """
    batch, heads, _ = q.shape
    bh = heads_per_block
    padded_heads = -(-heads // bh) * bh
    queries = [jnp.pad(x, ((0, 0), (0, 0), (0, padded_heads - heads), (0, 0)))
               for x in groups.queries(q)]

    def whole(x):
        return pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)

    def planes_of(lay):
        return pl.BlockSpec((None, lay.n_planes, bh, lay.plane_width),
                            lambda b, h, s: (b, 0, h, 0))

    def partial_planes(lay):
        return pl.BlockSpec((None, None, lay.n_planes, bh, lay.plane_width),
                            lambda b, h, s: (b, s, 0, h, 0))

    def partial(width):
        return pl.BlockSpec((None, None, bh, width), lambda b, h, s: (b, s, h, 0))

    f32 = jnp.float32
    outs = pl.pallas_call(
        kernel,
        grid=(batch, padded_heads // bh, num_splits),
        in_specs=[*(whole(x) for x in scalars), *(planes_of(lay) for lay in groups.layouts),
                  *(whole(x) for x in window), *(whole(x) for x in entries)],
        out_specs=[*(partial_planes(lay) for lay in groups.layouts), partial(1), partial(1)],
        out_shape=[*(jax.ShapeDtypeStruct(
            (batch, num_splits, lay.n_planes, padded_heads, lay.plane_width), f32)
            for lay in groups.layouts),
            *(jax.ShapeDtypeStruct((batch, num_splits, padded_heads, 1), f32),) * 2],
        compiler_params=triton_compiler_params(num_warps, num_stages),
        interpret=interpret,
        name=name,
    )(*scalars, *queries, *window, *entries)
    *accs, m, denom = outs
    merged = decode.combine_partials([a[:, :, :, :heads] for a in accs], m[:, :, :heads, 0],
                                     denom[:, :, :heads, 0], sink)
    return groups.output(merged, q_pos, lane_freq)
