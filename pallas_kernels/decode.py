"""Pieces shared by the decode attention kernels (CSA sparse and HCA dense), both backends.

One query per slot at position `q_pos` reads the window ring of its layer and compressed
entries; `kv_end` is the number of tokens in the sequence (keys at or past it never exist).
The ring row r holds the newest position p < kv_end with p % W == r, so the window needs no
reordering: a row is visible iff its position is >= 0 and within (q_pos - W, q_pos].

The online softmax starts from the sink (max = sink, sum = exp(sink - sink) = 1, acc = 0),
exactly as the reference does, and every fold masks with a finite value.

Keys come in planes (`pallas_kernels.formats`): the window and the entries may be stored in
different formats, so each distinct layout is a *group* with its own query planes and its
own accumulator planes, all sharing one running max and sum. `KeyGroups` lays the query out
per group and sums the groups' outputs back in natural order: on a GPU in XLA around the
kernel (`queries`, `output`, then `derotate`); on a TPU inside it (`plane_queries`,
`natural_output`): each plane is the query times a 0/1 matrix built from the layout's lane
table, and the output the planes times its transpose, at full precision (every value exact:
a product with 1, sums with 0), so XLA moves no lane of a query or an output around a TPU
kernel (XLA:TPU counts a lane permutation of a few KiB as megabytes of traffic).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import formats
from pallas_kernels.common import HIGHEST, MASK_VALUE, rotate_lanes, swap_pairs_tpu


@dataclasses.dataclass(frozen=True)
class KeyGroups:
    """The layouts of the window and of the entries, and their query groups (static).

    Attributes:
      layouts: one `formats.Layout` per group: the window and the entries share one when
        their planes hold the same dims at the same lanes (one set of query planes and of
        accumulators), else a group each.
      window, entries: the group of the window ring and of the compressed entries.
      window_layout, entries_layout: how each is stored (what decodes it).
    """

    layouts: tuple[formats.Layout, ...]
    window: int
    entries: int
    window_layout: formats.Layout
    entries_layout: formats.Layout

    @classmethod
    def of(cls, window: formats.Layout, entries: formats.Layout) -> KeyGroups:
        shared = window.n_planes == entries.n_planes and np.array_equal(
            window.lane_dims(), entries.lane_dims())
        layouts = (window,) if shared else (window, entries)
        return cls(layouts, 0, 0 if shared else 1, window, entries)

    def queries(self, q: jax.Array) -> list[jax.Array]:
        """f32[B, H, hd] -> per group f32[B, n_planes, H, plane_width]."""
        return [jnp.moveaxis(formats.to_planes(lay, q.astype(jnp.float32)), -2, 1)
                for lay in self.layouts]

    def output(self, outs, q_pos: jax.Array, lane_freq: jax.Array) -> jax.Array:
        """Per group [B, n_planes, H, plane_width] normalised outputs -> f32[B, H, hd],
        summed over groups and de-rotated by -q_pos."""
        out = None
        for lay, o in zip(self.layouts, outs, strict=True):
            natural = formats.from_planes(lay, jnp.moveaxis(o, 1, -2))
            out = natural if out is None else out + natural
        return derotate(out, q_pos, lane_freq)

    def load_queries(self, refs) -> list[list[jax.Array]]:
        """Inside a kernel: the query planes of each group from refs [n_planes, h, pw]."""
        return [[ref[j] for j in range(lay.n_planes)]
                for ref, lay in zip(refs, self.layouts, strict=True)]

    def lane_tables(self) -> list[jax.Array]:
        """Per group, i32[n_planes, plane_width]: the natural dim each plane lane holds, -1
        for none (the inputs of `plane_queries` and `natural_output` in a TPU kernel)."""
        return [jnp.asarray(lay.lane_dims(), jnp.int32) for lay in self.layouts]

    def plane_queries(self, q: jax.Array, table_refs) -> list[list[jax.Array]]:
        """Inside a TPU kernel: the query planes of each group (`plane_queries`)."""
        return [plane_queries(q, ref, lay.n_planes)
                for ref, lay in zip(table_refs, self.layouts, strict=True)]

    def natural_output(self, state, table_refs, width: int, q_pos, lane_freq) -> jax.Array:
        """Inside a TPU kernel: the normalised output f32[h, hd] of an online-softmax state in
        natural order, summed over groups and de-rotated by -q_pos (lane_freq f32[1, hd])."""
        _, denom, accs = state
        out = None
        for ref, planes in zip(table_refs, accs, strict=True):
            natural = None
            for j, plane in enumerate(planes):
                part = jax.lax.dot_general(
                    plane / denom, _plane_matrix(ref[j:j + 1, :], width),
                    (((1,), (1,)), ((), ())), precision=HIGHEST,
                    preferred_element_type=jnp.float32)
                natural = part if natural is None else natural + part
            out = natural if out is None else out + natural
        angle = q_pos.astype(jnp.float32) * lane_freq
        return rotate_lanes(out, swap_pairs_tpu(out), angle, inverse=True)

    def zero_accs(self, heads: int):
        return tuple(tuple(jnp.zeros((heads, lay.plane_width), jnp.float32)
                           for _ in range(lay.n_planes)) for lay in self.layouts)


def plane_queries(q: jax.Array, table_ref, n_planes: int) -> list[jax.Array]:
    """Inside a TPU kernel: a layout's query planes (f32[h, pw] each) from the query in
    natural order f32[h, d] (`formats.to_planes`' values: 0 on lanes holding no dim), given
    its lane table (`Layout.lane_dims()`, i32[n_planes, pw])."""
    width = q.shape[-1]
    return [jnp.dot(q, _plane_matrix(table_ref[j:j + 1, :], width), precision=HIGHEST,
                    preferred_element_type=jnp.float32) for j in range(n_planes)]


def _plane_matrix(dims: jax.Array, width: int) -> jax.Array:
    """f32[width, pw]: 1 where lane l of a plane holds dim d (dims: i32[1, pw], -1 for
    none), else 0."""
    dim = jax.lax.broadcasted_iota(jnp.int32, (width, dims.shape[1]), 0)
    return jnp.where(dim == dims, 1.0, 0.0).astype(jnp.float32)


def swap_pairs(x: jax.Array) -> jax.Array:
    """x with lanes 2i and 2i + 1 exchanged (XLA, outside kernels)."""
    return x.reshape(*x.shape[:-1], -1, 2)[..., ::-1].reshape(x.shape)


def derotate(out: jax.Array, q_pos: jax.Array, lane_freq: jax.Array) -> jax.Array:
    """De-rotates f32[B, H, d] by -q_pos (XLA epilogue of the kernels)."""
    angle = q_pos.astype(jnp.float32)[:, None, None] * lane_freq[None]
    return rotate_lanes(out, swap_pairs(out), angle, inverse=True)


def ring_positions(kv_end, shape, axis: int, window: int, first_row: int = 0) -> jax.Array:
    """i32[shape]: the position held by ring rows first_row, first_row + 1, ... (along
    `axis`), given kv_end."""
    row = first_row + jax.lax.broadcasted_iota(jnp.int32, shape, axis)
    # kv_end - 1 - row + window >= 0, so the remainder is taken of a non-negative number.
    return kv_end - 1 - jax.lax.rem(kv_end - 1 - row + window, window)


def window_visible(q_pos, kv_end, shape, axis: int, window: int, first_row: int = 0
                   ) -> jax.Array:
    pos = ring_positions(kv_end, shape, axis, window, first_row)
    return (pos >= 0) & (pos <= q_pos) & (pos > q_pos - window)


def fold(state, q, keys, visible: jax.Array, scale: float, group: int = 0):
    """Folds keys (= values) of one group into the running (max, sum, accumulators).

    Args:
      state: (max f32[h, 1], sum f32[h, 1], accs): accs per group, per plane f32[h, pw].
      q: the group's query planes f32[h, pw]; keys: its key planes f32[k, pw], finite (rows
        that are not visible must be finite too).
      visible: bool[1, k].
    """
    m, denom, accs = state
    logits = None
    for qj, kj in zip(q, keys, strict=True):
        part = jax.lax.dot_general(qj, kj, (((1,), (1,)), ((), ())), precision=HIGHEST,
                                   preferred_element_type=jnp.float32)
        logits = part if logits is None else logits + part
    logits = jnp.where(visible, logits * scale, MASK_VALUE)
    m_new = jnp.maximum(m, jnp.max(logits, axis=1, keepdims=True))
    correction = jnp.exp(m - m_new)
    p = jnp.where(visible, jnp.exp(logits - m_new), 0.0)
    denom_new = denom * correction + jnp.sum(p, axis=1, keepdims=True)
    new_accs = []
    for g, planes in enumerate(accs):
        if g == group:
            planes = tuple(a * correction + jnp.dot(p, kj, precision=HIGHEST,
                                                    preferred_element_type=jnp.float32)
                           for a, kj in zip(planes, keys, strict=True))
        else:
            planes = tuple(a * correction for a in planes)
        new_accs.append(planes)
    return m_new, denom_new, tuple(new_accs)


def fold_window(state, q, ring, q_pos, kv_end, window: int, scale: float, first_row: int = 0,
                group: int = 0):
    """Folds ring rows first_row.. (`ring`: planes f32[r, pw] as decoded) into the online
    softmax; rows that are not visible are zeroed first (a ring row may hold anything before
    it is written)."""
    rows = ring[0].shape[0]
    visible_rows = window_visible(q_pos, kv_end, (rows, 1), 0, window, first_row)
    visible_lanes = window_visible(q_pos, kv_end, (1, rows), 1, window, first_row)
    ring = [jnp.where(visible_rows, plane, 0.0) for plane in ring]
    return fold(state, q, ring, visible_lanes, scale, group)


def sink_state(groups: KeyGroups, sink: jax.Array):
    """The online-softmax state before any key: (max = sink, sum = 1, accs = 0); sink
    f32[h, 1]."""
    heads = sink.shape[0]
    return (sink.astype(jnp.float32), jnp.ones((heads, 1), jnp.float32),
            groups.zero_accs(heads))


def combine_partials(accs, m: jax.Array, denom: jax.Array, sink: jax.Array) -> list[jax.Array]:
    """Merges split-K partial softmax states and the sink (GPU kernels, in XLA).

    Args:
      accs: per group f32[B, S, n_planes, H, pw] unnormalised partial outputs; m, denom:
        f32[B, S, H] their max and sum (an empty split has m = MASK_VALUE, denom = 0,
        acc = 0).
      sink: f32[H].

    Returns:
      Per group f32[B, n_planes, H, pw], normalised.
    """
    sink = sink.astype(jnp.float32)
    top = jnp.maximum(jnp.max(m, axis=1), sink[None, :])  # [B, H]
    scale = jnp.exp(m - top[:, None, :])  # [B, S, H]
    total = jnp.sum(scale * denom, axis=1) + jnp.exp(sink[None, :] - top)
    weights = scale[:, :, None, :, None]
    return [jnp.sum(weights * acc, axis=1) / total[:, None, :, None] for acc in accs]
