"""DeepSeek-V4.1's decode read of a sparse layer (V41_SPEC.md section 5), the jnp reference of
the `sparse_decode41` kernels (`ops.sparse_decode41` chooses).

One query per row at position t (the decode step, T = 1) attends in one softmax over

  window  the layer's ring rows of positions t - W + 1 .. t (the step has written row t
          already), those at a position >= 0
  picks   the entries `ids` of a kv source where `valid`: entry i on page
          page_rows[b, i // E], record i % E (E records a page)

with the sink in the denominator (unscaled), logits scaled by hd^-0.5, V = K. Rows come as
stored (`pools.Lanes`) and are decoded by their codecs (`pools.cache41.codec41`). The output
is before the inverse RoPE (the step applies it).

Layout read:
  window   Lanes of blocks [num_layers, max_slots], W records a block
  entries  Lanes of blocks [num_pages], E records a block
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from v4kv_jax.config import CacheConfig
from v4kv_jax.config41 import V41Config
from v4kv_jax.pools.cache41 import codec41
from v4kv_jax.pools.lanes import Lanes


def attend(q: jax.Array, sink: jax.Array, key_sets) -> jax.Array:
    """o [B, T, H, hd] of one softmax over every (keys, ok) of `key_sets` (keys [B, K, hd]
    shared by the chunk or [B, T, K, hd] per query; ok bool [B, T, K]) with the sink in the
    denominator; V = K; q f32[B, T, H, hd] (rotated). The step's read (`step41.layer41`)."""
    scale = np.float32(q.shape[-1] ** -0.5)
    logits = []
    for keys, ok in key_sets:
        spec = "bthd,bkd->bthk" if keys.ndim == 3 else "bthd,btkd->bthk"
        x = jnp.einsum(spec, q, keys, precision=jax.lax.Precision.HIGHEST) * scale
        logits.append(jnp.where(ok[:, :, None, :], x, -jnp.inf))
    s = sink.astype(jnp.float32)[None, None, :]
    top = jnp.maximum(jnp.max(jnp.stack([x.max(-1) for x in logits]), axis=0), s)
    total = jnp.exp(s - top)
    out = 0.0
    for (keys, ok), x in zip(key_sets, logits, strict=True):
        p = jnp.where(ok[:, :, None, :], jnp.exp(x - top[..., None]), 0.0)
        total = total + p.sum(-1)
        spec = "bthk,bkd->bthd" if keys.ndim == 3 else "bthk,btkd->bthd"
        out = out + jnp.einsum(spec, p, keys, precision=jax.lax.Precision.HIGHEST)
    return out / total[..., None]


def attend41(q: jax.Array, sink: jax.Array, key_sets) -> jax.Array:
    """`attend` of one query a row: q f32[B, H, hd], key_sets of (keys f32[B, K, hd], ok
    bool[B, K]); o f32[B, H, hd]."""
    return attend(q[:, None], sink, [(k, ok[:, None]) for k, ok in key_sets])[:, 0]


def window_keys(config: V41Config, geometry: CacheConfig, window: Lanes, layer, slot_ids,
                q_pos) -> tuple[jax.Array, jax.Array]:
    """(keys f32[B, W, hd], ok bool[B, W]): the ring rows of positions q_pos - W + 1 .. q_pos
    of `layer` and each row's slot; a key at a negative position is 0, not ok."""
    W = window.map.records
    positions = q_pos[:, None] - W + 1 + jnp.arange(W, dtype=jnp.int32)[None, :]
    rows = window.take((jnp.full_like(slot_ids, layer)[:, None], slot_ids[:, None]),
                       positions % W)
    ok = positions >= 0
    keys = codec41(config, geometry, "window").decode(rows)
    return jnp.where(ok[..., None], keys, 0.0), ok


def picked_keys(config: V41Config, geometry: CacheConfig, entries: Lanes, page_rows, ids,
                valid) -> jax.Array:
    """f32[B, K, hd]: the entries `ids` (i32[B, K]) where `valid`, else 0."""
    per_page = entries.map.records
    col = jnp.clip(ids // per_page, 0, page_rows.shape[1] - 1)
    page = jnp.take_along_axis(page_rows, col, axis=1)
    keys = codec41(config, geometry, "entries").decode(entries.take((page,), ids % per_page))
    return jnp.where(valid[..., None], keys, 0.0)


def sparse_decode41(config: V41Config, geometry: CacheConfig, *, window: Lanes, layer,
                    slot_ids: jax.Array, q_pos: jax.Array, entries: Lanes, ids: jax.Array,
                    valid: jax.Array, page_rows: jax.Array, q: jax.Array,
                    sink: jax.Array) -> jax.Array:
    """f32[B, H, hd]: the decode read of one query per row, before the inverse RoPE.

    Args:
      window: the window rings (`pools.cache41.window41`); layer: the layer (its ring).
      slot_ids: i32[B] each row's slot; q_pos: i32[B] each row's query position t.
      entries: the kv source's entries (`pools.cache41.source_store`).
      ids: i32[B, K] picked entry ids; valid: bool[B, K] which picks count.
      page_rows: i32[B, max_pages_per_seq] the rows' page-table rows.
      q: f32[B, H, hd] queries (RoPE at t applied); sink: f32[H].
    """
    keys = window_keys(config, geometry, window, layer, slot_ids, q_pos)
    picked = picked_keys(config, geometry, entries, page_rows, ids, valid)
    return attend41(q.astype(jnp.float32), sink, [keys, (picked, valid)])


__all__ = ["attend", "attend41", "picked_keys", "sparse_decode41", "window_keys"]
