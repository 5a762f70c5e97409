"""Pieces shared by the decode attention kernels (CSA sparse and HCA dense), both backends.

One query per slot at position `q_pos` reads the window ring of its layer and compressed
entries; `kv_end` is the number of tokens in the sequence (keys at or past it never exist).
The ring row r holds the newest position p < kv_end with p % W == r, so the window needs no
reordering: a row is visible iff its position is >= 0 and within (q_pos - W, q_pos].

The online softmax starts from the sink (max = sink, sum = exp(sink - sink) = 1, acc = 0),
exactly as the reference does, and every fold masks with a finite value.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.common import HIGHEST, MASK_VALUE


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


def fold(state, q: jax.Array, keys: jax.Array, visible: jax.Array, scale: float):
    """Folds keys (= values) into the running (max, sum, acc).

    Args:
      state: (max f32[h, 1], sum f32[h, 1], acc f32[h, d]).
      q: f32[h, d]; keys: f32[k, d], finite (rows that are not visible must be finite too).
      visible: bool[1, k].
    """
    m, denom, acc = state
    logits = jax.lax.dot_general(q, keys, (((1,), (1,)), ((), ())), precision=HIGHEST,
                                 preferred_element_type=jnp.float32) * scale
    logits = jnp.where(visible, logits, MASK_VALUE)
    m_new = jnp.maximum(m, jnp.max(logits, axis=1, keepdims=True))
    correction = jnp.exp(m - m_new)
    p = jnp.where(visible, jnp.exp(logits - m_new), 0.0)
    denom_new = denom * correction + jnp.sum(p, axis=1, keepdims=True)
    acc_new = acc * correction + jnp.dot(p, keys, precision=HIGHEST,
                                         preferred_element_type=jnp.float32)
    return m_new, denom_new, acc_new


def fold_window(state, q: jax.Array, ring: jax.Array, q_pos, kv_end, window: int, scale: float,
                first_row: int = 0):
    """Folds ring rows first_row.. (`ring` f32[r, d], as read) into the online softmax; rows
    that are not visible are zeroed first (a ring row may hold anything before it is
    written)."""
    rows = ring.shape[0]
    visible_rows = window_visible(q_pos, kv_end, (rows, 1), 0, window, first_row)
    visible_lanes = window_visible(q_pos, kv_end, (1, rows), 1, window, first_row)
    return fold(state, q, jnp.where(visible_rows, ring.astype(jnp.float32), 0.0), visible_lanes,
                scale)


def sink_state(q: jax.Array, sink: jax.Array):
    """The online-softmax state before any key: (max = sink, sum = 1, acc = 0); sink f32[h, 1]."""
    return (sink.astype(jnp.float32), jnp.ones((q.shape[0], 1), jnp.float32),
            jnp.zeros(q.shape, jnp.float32))


def combine_partials(acc: jax.Array, m: jax.Array, denom: jax.Array, sink: jax.Array
                     ) -> jax.Array:
    """Merges split-K partial softmax states and the sink (GPU kernels, in XLA).

    Args:
      acc: f32[B, S, H, d] unnormalised partial outputs; m, denom: f32[B, S, H] their max
        and sum (an empty split has m = MASK_VALUE, denom = 0, acc = 0).
      sink: f32[H].

    Returns:
      f32[B, H, d], normalised (not yet de-rotated).
    """
    sink = sink.astype(jnp.float32)
    top = jnp.maximum(jnp.max(m, axis=1), sink[None, :])  # [B, H]
    scale = jnp.exp(m - top[:, None, :])  # [B, S, H]
    total = jnp.sum(scale * denom, axis=1) + jnp.exp(sink[None, :] - top)
    return jnp.sum(scale[..., None] * acc, axis=1) / total[..., None]
