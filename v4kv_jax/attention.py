"""Reference attention: one softmax over the window and the compressed entries, with a sink.

For a query at position t (SPEC section 6), with scale hd^-0.5 on every key:
  window      kv_j for max(0, t - W + 1) <= j <= t
  SWA         nothing else
  CSA         C4 entries picked by the lightning indexer (top-k, -1 picks skipped)
  HCA         every C128 entry i < (t + 1) // m'
The per-head sink adds exp(sink_h) to the denominator only. V = K, so the output's last r dims
are rotated back by -t. Everything is one online softmax (running max, sum, weighted sum)
started from the sink, so the window and the entry chunks fold into it in any order.

Shapes: q f32[B, T, H, hd]; window keys [B, Wk, hd] at positions base + 0 .. Wk - 1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from v4kv_jax import indexer, paging, rope
from v4kv_jax.config import AttentionConfig, CacheConfig, LayerKind

_HIGHEST = jax.lax.Precision.HIGHEST


@struct.dataclass
class Queries:
    """Query-side vectors of one layer for T query tokens.

    Attributes:
      q: f32[B, T, H, hd], per-head RMSNorm and RoPE applied.
      sink: f32[H], per-head sink logits.
      index_q: f32[B, T, nI, c], indexer queries with RoPE per head (CSA layers only).
      index_weights: f32[B, T, nI], raw head weights W_iw x_t (CSA layers only).
    """

    q: jax.Array
    sink: jax.Array
    index_q: jax.Array | None = None
    index_weights: jax.Array | None = None


@struct.dataclass
class _Softmax:
    max: jax.Array  # [B, T, H]
    denom: jax.Array  # [B, T, H]
    acc: jax.Array  # [B, T, H, hd]


def _softmax_init(sink: jax.Array, q: jax.Array) -> _Softmax:
    lead = q.shape[:-1]
    return _Softmax(
        max=jnp.broadcast_to(sink.astype(jnp.float32), lead),
        denom=jnp.ones(lead, jnp.float32),
        acc=jnp.zeros(q.shape, jnp.float32),
    )


def _softmax_fold(state: _Softmax, q: jax.Array, keys: jax.Array, visible: jax.Array
                  ) -> _Softmax:
    """Folds keys (= values) into the running softmax.

    keys are [B, K, hd] shared by all queries or [B, T, K, hd] per query; visible is
    bool[B, T, K]. A key no query may see can hold anything (another request's rows, NaN):
    it is replaced by zeros with `where` before any arithmetic, since 0 * NaN is NaN.
    """
    seen = visible.any(axis=1) if keys.ndim == 3 else visible
    keys = jnp.where(seen[..., None], keys.astype(jnp.float32), 0.0)
    scale = q.shape[-1] ** -0.5
    if keys.ndim == 3:
        logits = jnp.einsum("bthd,bkd->bthk", q, keys, precision=_HIGHEST)
    else:
        logits = jnp.einsum("bthd,btkd->bthk", q, keys, precision=_HIGHEST)
    visible = visible[:, :, None, :]
    logits = jnp.where(visible, logits * scale, -jnp.inf)
    new_max = jnp.maximum(state.max, jnp.max(logits, axis=-1))
    correction = jnp.exp(state.max - new_max)
    p = jnp.where(visible, jnp.exp(logits - new_max[..., None]), 0.0)
    if keys.ndim == 3:
        weighted = jnp.einsum("bthk,bkd->bthd", p, keys, precision=_HIGHEST)
    else:
        weighted = jnp.einsum("bthk,btkd->bthd", p, keys, precision=_HIGHEST)
    return _Softmax(
        max=new_max,
        denom=state.denom * correction + jnp.sum(p, axis=-1),
        acc=state.acc * correction[..., None] + weighted,
    )


def _fold_key_sets(state: _Softmax, q: jax.Array, key_sets) -> _Softmax:
    """Folds (keys, visible) sets into the softmax; with T = 1 they are joined into one."""
    if q.shape[1] == 1 and len(key_sets) > 1:
        per_slot = [k[:, 0] if k.ndim == 4 else k for k, _ in key_sets]
        key_sets = [(jnp.concatenate(per_slot, axis=1),
                     jnp.concatenate([v for _, v in key_sets], axis=2))]
    for keys, visible in key_sets:
        state = _softmax_fold(state, q, keys, visible)
    return state


def _gather_pages(pool: jax.Array, layer, page_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Entries of whole pages: ([B, n * epp, d], page present bool[B, n * epp])."""
    batch, n = page_ids.shape
    epp, dim = pool.shape[2], pool.shape[3]
    entries = pool[layer, jnp.clip(page_ids, 0, None)].reshape(batch, n * epp, dim)
    present = jnp.repeat(page_ids >= 0, epp, axis=1)
    return entries, present


def _visible_entries(q_pos: jax.Array, kv_end: jax.Array, ratio: int) -> jax.Array:
    """i32[B, T]: entries query t may read, min((t+1) // m, entries written so far)."""
    return jnp.minimum((q_pos + 1) // ratio, (kv_end // ratio)[:, None])


def _bucket_sizes(capacity: int, smallest: int) -> list[int]:
    """Power-of-two prefix sizes from `smallest` up to `capacity` (the last is capacity)."""
    sizes, size = [], max(1, smallest)
    while size < capacity:
        sizes.append(size)
        size *= 2
    return sizes + [capacity]


def score_visible_keys(model: AttentionConfig, geometry: CacheConfig, index_keys: jax.Array,
                       layer, page_rows: jax.Array, queries: Queries, q_pos: jax.Array,
                       kv_end: jax.Array) -> jax.Array:
    """f32[B, T, capacity]: indexer score of every entry id, -inf where not a candidate.

    Scores of the used pages are written chunk by chunk into the row (the loop runs over used
    pages only); capacity is the page-table length rounded up to whole read chunks.

    Args:
      index_keys: the Classical pool's indexer keys [n_csa, pages, P // m, c].
      layer: index into the CSA stack (may be traced).
      page_rows: i32[B, max_pages_per_seq] page-table rows of the batch.
      q_pos: i32[B, T] query positions; kv_end: i32[B] tokens appended (entries beyond are
        never read).
    """
    m = model.csa_ratio
    epp = geometry.entries_per_page(m)
    chunk_pages = geometry.read_chunk_pages(geometry.index_read_entries, m)
    batch, tokens = q_pos.shape
    visible = _visible_entries(q_pos, kv_end, m)
    capacity = paging.padded_pages(page_rows.shape[1], chunk_pages) * epp

    def body(buf, page_ids, first):
        keys, present = _gather_pages(index_keys, layer, page_ids)
        idx = first + jnp.arange(keys.shape[1], dtype=jnp.int32)
        # Keys of absent pages may hold anything (NaN included); `where` drops their scores.
        scores = indexer.index_scores(queries.index_q, queries.index_weights, keys)
        ok = (idx[None, None, :] < visible[..., None]) & present[:, None, :]
        scores = jnp.where(ok, scores, -jnp.inf)
        return jax.lax.dynamic_update_slice_in_dim(buf, scores, first, axis=2)

    return paging.fold_page_chunks(
        page_rows, kv_end // m, epp, chunk_pages, body,
        jnp.full((batch, tokens, capacity), -jnp.inf, jnp.float32))


def topk_of_scores(scores: jax.Array, num_entries: jax.Array, k: int, smallest: int
                   ) -> jax.Array:
    """i32[B, T, k]: the top-k entry ids of a score row (-inf = not a candidate, -1 = unused).

    One `lax.top_k` runs over the shortest power-of-two prefix (from `smallest` up) that holds
    every entry id below max(num_entries), chosen at run time by `lax.switch`, so the
    selection follows the context, not the capacity.

    Args:
      scores: f32[B, T, capacity].
      num_entries: i32[B], entries written per row (ids at or past it are -inf).
      k: picks per query.
      smallest: the smallest prefix (one page of entries).
    """
    sizes = _bucket_sizes(scores.shape[-1], smallest)

    def top_of(size):
        def run(s):
            if size <= k:  # every valid entry is picked; no selection needed
                pad = ((0, 0), (0, 0), (0, k - size))
                idx = jnp.broadcast_to(jnp.arange(size, dtype=jnp.int32), s[..., :size].shape)
                return (jnp.pad(s[..., :size], pad, constant_values=-jnp.inf),
                        jnp.pad(idx, pad, constant_values=-1))
            return tuple(jax.lax.top_k(s[..., :size], k))
        return run

    need = jnp.max(num_entries)
    bucket = jnp.sum(jnp.asarray(sizes[:-1], jnp.int32) < need)
    best = jax.lax.switch(bucket, [top_of(size) for size in sizes], scores)
    return indexer.finish_topk(best)


def select_topk(model: AttentionConfig, geometry: CacheConfig, index_keys: jax.Array, layer,
                page_rows: jax.Array, queries: Queries, q_pos: jax.Array, kv_end: jax.Array
                ) -> jax.Array:
    """i32[B, T, k]: the lightning indexer's picks for each query (-1 = unused pick).

    `score_visible_keys` then `topk_of_scores`; arguments as in `score_visible_keys`.
    """
    scores = score_visible_keys(model, geometry, index_keys, layer, page_rows, queries, q_pos,
                                kv_end)
    return topk_of_scores(scores, kv_end // model.csa_ratio, model.index_topk,
                          geometry.entries_per_page(model.csa_ratio))


def attend(model: AttentionConfig, geometry: CacheConfig, kind: LayerKind, layer,
           entries: jax.Array | None, index_keys: jax.Array | None, page_rows: jax.Array,
           queries: Queries, q_pos: jax.Array, kv_end: jax.Array, window_keys: jax.Array,
           window_base: jax.Array, picks: jax.Array | None = None) -> jax.Array:
    """Attention output of one layer before the output projection, de-rotated.

    Args:
      model, geometry: static configs.
      kind: the layer's kind (static).
      layer: index into the stack of that kind (may be traced); unused for SWA.
      entries: the kind's Classical array (C4 for CSA, C128 for HCA), None for SWA.
      index_keys: the indexer keys (CSA only).
      page_rows: i32[B, max_pages_per_seq].
      queries: the layer's `Queries` for T tokens.
      q_pos: i32[B, T] query positions.
      kv_end: i32[B], tokens in the sequence including this chunk; keys at or past it are
        never read (padded queries stay finite).
      window_keys: [B, Wk, hd], key i at position window_base + i.
      window_base: i32[B].
      picks: CSA only: i32[B, T, k] entries already chosen by the indexer (-1 = none);
        None runs `select_topk`.

    Returns:
      f32[B, T, H, hd].
    """
    q = queries.q.astype(jnp.float32)
    key_pos = window_base[:, None] + jnp.arange(window_keys.shape[1], dtype=jnp.int32)
    readable = (key_pos >= 0) & (key_pos < kv_end[:, None])
    visible = ((key_pos[:, None, :] <= q_pos[..., None])
               & (key_pos[:, None, :] > q_pos[..., None] - model.window)
               & readable[:, None, :])
    # Key sets ([B, K, hd] per slot or [B, T, K, hd] per query, visible [B, T, K]) folded into
    # one softmax. With one query per slot they are joined first: one pair of dots per layer.
    state = _softmax_init(queries.sink, q)
    key_sets = [(window_keys, visible)]

    if kind == LayerKind.HCA:
        m = model.hca_ratio
        epp = geometry.entries_per_page(m)
        seen = _visible_entries(q_pos, kv_end, m)
        chunk_pages = geometry.read_chunk_pages(geometry.hca_read_entries, m)

        def chunk(page_ids, first):
            ent, present = _gather_pages(entries, layer, page_ids)
            idx = first + jnp.arange(ent.shape[1], dtype=jnp.int32)
            return ent, (idx[None, None, :] < seen[..., None]) & present[:, None, :]

        if page_rows.shape[1] <= chunk_pages:  # one read covers every page: no loop
            key_sets.append(chunk(page_rows, 0))
        else:
            state = _fold_key_sets(state, q, key_sets)
            key_sets = []
            state = paging.fold_page_chunks(
                page_rows, kv_end // m, epp, chunk_pages,
                lambda state, ids, first: _softmax_fold(state, q, *chunk(ids, first)), state)
    elif kind == LayerKind.CSA:
        if picks is None:
            picks = select_topk(model, geometry, index_keys, layer, page_rows, queries, q_pos,
                                kv_end)
        page, row = paging.entry_pages(page_rows, picks, geometry.entries_per_page(
            model.csa_ratio))
        ok = (picks >= 0) & (page >= 0)
        ent = entries[layer, jnp.clip(page, 0, None), row]
        key_sets.append((ent, ok))

    state = _fold_key_sets(state, q, key_sets)
    out = state.acc / state.denom[..., None]
    return rope.rotate(out, q_pos[..., None], rope.inv_frequencies(model, kind), inverse=True)


def output_projection(o: jax.Array, w_oa: jax.Array, w_ob: jax.Array, groups: int) -> jax.Array:
    """Grouped output projection (SPEC section 6).

    Args:
      o: [..., H, hd] attention output.
      w_oa: [g * R, H * hd / g], group j uses rows j*R .. (j+1)*R - 1.
      w_ob: [D, g * R].
    """
    lead = o.shape[:-2]
    grouped = o.reshape(*lead, groups, -1)
    w = w_oa.reshape(groups, -1, grouped.shape[-1])
    y = jnp.einsum("...gi,gri->...gr", grouped, w, precision=_HIGHEST).reshape(*lead, -1)
    return jnp.einsum("...r,dr->...d", y, w_ob, precision=_HIGHEST)
