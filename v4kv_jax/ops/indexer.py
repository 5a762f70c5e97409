"""Reference of the lightning indexer of CSA layers (kernels: `pallas_kernels/indexer/`).

  I[t, i] = sum_h w[t, h] * ReLU(qi[t, h] . K[i]),   w = (W_iw x_t) * c^-0.5 * nI^-0.5

Only entries i < (t + 1) // m that were written are candidates (`layout.visible_entries`).
The top min(k, #candidates) are kept; unused picks are -1.

Keys are read in their stored format (`CacheConfig.index_dtype`). With "fp4_index" a stored
key is hadamard(K) quantised to e2m1, and the query is prepared the same way
(`prepare_index_query`: hadamard(qi) per head, then the same fp4 fake-quantisation, as the
official reference does to its indexer query), so qi . K becomes the dot product of two
rotated, quantised vectors (the rotation is orthonormal). Callers prepare the query once
(`ops.index_scores` does, before choosing the reference or a kernel); `index_scores` here
takes it prepared.

  prepare_index_query  the query in the keys' basis and numerics
  key_scores     the score math for given keys
  index_scores   scores of every entry id of a paged row, -inf where not a candidate
  topk_of_scores the picks of a score row
  index_topk     index_scores, then topk_of_scores
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from v4kv_jax import programs
from v4kv_jax.config import AttentionConfig, CacheConfig, Options
from v4kv_jax.pools import paging, storage
from v4kv_jax.pools.layout import CacheLayout, visible_entries
from v4kv_jax.pools.layout import of as layout_of

_HIGHEST = jax.lax.Precision.HIGHEST


def prepare_index_query(geometry: CacheConfig, index_q: jax.Array) -> jax.Array:
    """f32 index_q [..., nI, c] prepared for keys stored in `geometry.index_dtype`.

    Float formats: the query as it is (widened to fp32). "fp4_index": per head,
    decode_fp4_key(encode_fp4_key(hadamard(qi), rotated=True)) -- rotated into the stored
    keys' basis, then fake-quantised in fp4 (e2m1, blocks of 32, ue8m0 scales) as the official
    reference quantises its indexer query; the rotation runs in fp32 (the reference rounds
    its activations to bf16 first; the cache does not add that rounding).
    """
    index_q = jnp.asarray(index_q, jnp.float32)
    if geometry.index_dtype != "fp4_index":
        return index_q
    return storage.fake_quantise_fp4_key(storage.hadamard(index_q))


def key_scores(index_q: jax.Array, index_weights: jax.Array, keys: jax.Array) -> jax.Array:
    """Scores of every query against every key.

    Args:
      index_q: f32[B, T, nI, c], RoPE already applied per head.
      index_weights: f32[B, T, nI], the raw head weights W_iw x_t (scaled here).
      keys: f32[B, E, c] indexer keys (decoded).

    Returns:
      f32[B, T, E].
    """
    n_heads, dim = index_q.shape[-2:]
    if index_q.shape[1] == 1:
        # One query per slot (decode): heads last, and the weighted head sum a second product
        # rather than a reduction over the 8-wide minor axis, which XLA:CPU does not
        # vectorise (4,096 keys of 4 rows: 0.19 instead of 0.34 ms).
        dots = jnp.einsum("bec,bnc->ben", keys.astype(jnp.float32),
                          index_q[:, 0].astype(jnp.float32), precision=_HIGHEST)
        weights = index_weights[:, 0].astype(jnp.float32) * (n_heads**-0.5 * dim**-0.5)
        return jnp.einsum("ben,bn->be", jax.nn.relu(dots), weights,
                          precision=_HIGHEST)[:, None]
    dots = jnp.einsum("btnc,bec->btne", index_q.astype(jnp.float32),
                      keys.astype(jnp.float32), precision=_HIGHEST)
    scores = jax.nn.relu(dots) * dim**-0.5
    weights = index_weights.astype(jnp.float32) * n_heads**-0.5
    return jnp.einsum("btne,btn->bte", scores, weights, precision=_HIGHEST)


def score_capacity(model: AttentionConfig, geometry: CacheConfig, options: Options,
                   max_pages: int) -> int:
    """Entries per row of `index_scores`' result: a page-table row of `max_pages` pages,
    rounded up to whole read chunks."""
    m = model.csa_ratio
    chunk_pages = options.read_chunk_pages(geometry, options.index_read_entries, m)
    return paging.padded_pages(max_pages, chunk_pages) * geometry.entries_per_page(m)


def _scored_chunks(model: AttentionConfig, geometry: CacheConfig, options: Options,
                   index_keys, layer, page_rows, index_q, index_weights, q_pos, kv_end,
                   layout: CacheLayout | None, merge, init):
    """Folds `merge(carry, scores f32[B, T, n], first entry id)` over the used pages' keys,
    a read chunk at a time; scores are -inf where an entry is not a candidate."""
    fixed = layout_of(model, geometry) if layout is None else layout
    m = model.csa_ratio
    epp = fixed.entries_per_page["csa_index"]
    chunk_pages = options.read_chunk_pages(geometry, options.index_read_entries, m)
    visible = visible_entries(q_pos, kv_end, m)
    codec = fixed.rows["csa_index"]

    def body(carry, page_ids, first):
        keys, present = paging.gather_pages(index_keys, layer, page_ids)
        idx = first + jnp.arange(keys.shape[1], dtype=jnp.int32)
        # Keys of absent pages may hold anything (NaN included); `where` drops their scores.
        scores = key_scores(index_q, index_weights, codec.decode(keys))
        ok = (idx[None, None, :] < visible[..., None]) & present[:, None, :]
        return merge(carry, jnp.where(ok, scores, -jnp.inf), first)

    return paging.fold_page_chunks(page_rows, kv_end // m, epp, chunk_pages, body, init)


def index_scores(model: AttentionConfig, geometry: CacheConfig, options: Options, *,
                 index_keys: jax.Array, layer, page_rows: jax.Array, index_q: jax.Array,
                 index_weights: jax.Array, q_pos: jax.Array, kv_end: jax.Array,
                 layout: CacheLayout | None = None) -> jax.Array:
    """f32[B, T, capacity]: indexer score of every entry id, -inf where not a candidate.

    Scores of the used pages are written chunk by chunk into the row (the loop runs over used
    pages only); capacity is the page-table length rounded up to whole read chunks.

    Args:
      index_keys: the Classical pool's indexer keys (`pools.Lanes` of blocks
        [n_csa, num_pages]), as stored.
      layer: index into the CSA stack (may be traced).
      page_rows: i32[B, max_pages_per_seq] page-table rows of the batch.
      index_q: f32[B, T, nI, c], prepared (`prepare_index_query`); index_weights:
        f32[B, T, nI].
      q_pos: i32[B, T] query positions; kv_end: i32[B] tokens appended (entries beyond are
        never read).
      layout: what the configs fix (`cache.layout`: the keys' row codec, entries per page);
        None: derived from them.
    """
    batch, tokens = q_pos.shape
    capacity = score_capacity(model, geometry, options, page_rows.shape[1])

    def write(buf, scores, first):
        return jax.lax.dynamic_update_slice_in_dim(buf, scores, first, axis=2)

    return _scored_chunks(model, geometry, options, index_keys, layer, page_rows, index_q,
                          index_weights, q_pos, kv_end, layout, write,
                          jnp.full((batch, tokens, capacity), -jnp.inf, jnp.float32))


def _no_best(batch: int, tokens: int, k: int) -> tuple[jax.Array, jax.Array]:
    """The best k before any score: (-inf scores, -1 ids)."""
    return (jnp.full((batch, tokens, k), -jnp.inf, jnp.float32),
            jnp.full((batch, tokens, k), -1, jnp.int32))


def _merge_best(best: tuple[jax.Array, jax.Array], scores: jax.Array, first
                ) -> tuple[jax.Array, jax.Array]:
    """The best k (scores, ids) of `best` and `scores` f32[B, T, n] of ids first..first+n-1
    (later ids than best's), as `lax.top_k` over k + n picks them: the earlier of equal
    scores kept, so ties go to the lower id."""
    k = best[0].shape[-1]
    both = jnp.concatenate([best[0], scores], axis=-1)
    ids = jnp.concatenate([best[1], jnp.broadcast_to(
        first + jnp.arange(scores.shape[-1], dtype=jnp.int32), scores.shape)], axis=-1)
    return programs.platform_dependent(both, ids, tpu=functools.partial(_top_sorted, k=k),
                                       default=functools.partial(_top_gathered, k=k))


def _top_gathered(scores: jax.Array, ids: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """The best k of (scores, ids) by `lax.top_k` and a gather of the ids at its indices."""
    top, at = jax.lax.top_k(scores, k)
    return top, jnp.take_along_axis(ids, at, axis=-1)


def _top_sorted(scores: jax.Array, ids: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """`_top_gathered` as one stable sort that carries the ids along (a TPU's: XLA:TPU
    charges the gather of the ids ~9 MiB a merge; a CPU's top_k is 3-10x faster than the
    sort). The key orders as `lax.top_k` does: descending in IEEE total order (+0 above -0,
    a NaN by its sign), ties in place."""
    bits = jax.lax.bitcast_convert_type(scores, jnp.int32)
    key, top_ids = jax.lax.sort((~_total_order(bits), ids), dimension=-1, is_stable=True,
                                num_keys=1)
    # The scores back from their keys (`_total_order` is its own inverse): two operands
    # sorted, not three (a prefill chunk sorts T x (k + read chunk) of each).
    top = jax.lax.bitcast_convert_type(_total_order(~key[..., :k]), jnp.float32)
    return top, top_ids[..., :k]


def _total_order(bits: jax.Array) -> jax.Array:
    """i32 f32-bits -> i32 whose signed order is the floats' IEEE total order (-NaN < -inf
    < ... < -0 < +0 < ... < +inf < +NaN), and back: the map is its own inverse."""
    return jnp.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def running_topk(model: AttentionConfig, geometry: CacheConfig, options: Options, *,
                 index_keys: jax.Array, layer, page_rows: jax.Array, index_q: jax.Array,
                 index_weights: jax.Array, q_pos: jax.Array, kv_end: jax.Array,
                 layout: CacheLayout | None = None) -> jax.Array:
    """i32[B, T, k]: `index_topk`'s picks, equal to it element for element, without a score
    row per query: each read chunk's scores are merged into the best k so far (a top k of
    k + chunk), so a chunk of T queries holds [B, T, k + chunk] scores at 128k as at 4k.
    Equal because chunks come in entry order and the merge keeps the earlier of equal
    scores: the best so far (lower ids, ties already in id order) stay ahead of a chunk's.
    Arguments as `index_scores`."""
    batch, tokens = q_pos.shape
    k = model.index_topk
    best = _scored_chunks(model, geometry, options, index_keys, layer, page_rows, index_q,
                          index_weights, q_pos, kv_end, layout, _merge_best,
                          _no_best(batch, tokens, k))
    picks = finish_topk(best)
    # `topk_of_scores` picks every candidate of a prefix of at most k entries in id order
    # (no selection): the same picks, placed at their ids. There every candidate is picked,
    # so entry id j < k is picked exactly where its score is not -inf: visible to the query
    # and on a page of the row (the mask of `_scored_chunks`), computed here without the
    # picks (a scatter of B x T x k picks, which XLA:TPU compiles as a sort of them).
    m = model.csa_ratio
    epp = geometry.entries_per_page(m)
    sizes = paging.prefix_sizes(score_capacity(model, geometry, options, page_rows.shape[1]),
                                epp)
    size = jnp.asarray(sizes, jnp.int32)[paging.prefix_bucket(sizes, jnp.max(kv_end // m))]
    ids = jnp.arange(k, dtype=jnp.int32)
    pages = ids // epp
    on_page = (pages < page_rows.shape[1]) & (
        page_rows[:, jnp.minimum(pages, page_rows.shape[1] - 1)] >= 0)
    held = (ids < visible_entries(q_pos, kv_end, m)[..., None]) & on_page[:, None, :]
    return jnp.where(size <= k, jnp.where(held, ids, -1), picks)


def topk_of_scores(scores: jax.Array, num_entries: jax.Array, k: int, smallest: int
                   ) -> jax.Array:
    """i32[B, T, k]: the top-k entry ids of a score row (-inf = not a candidate, -1 = unused).

    The selection follows the context, not the capacity: it runs over the shortest
    power-of-two prefix (from `smallest` up) that holds every entry id below
    max(num_entries). A prefix of at most k ids is picked whole, in id order (no selection);
    a longer one chunk by chunk, each chunk's scores merged into the best k so far (a top k
    of k + chunk scores, in a loop over the prefix's chunks), equal element for element to
    one `lax.top_k` over the prefix: chunks come in id order and the merge keeps the earlier
    of equal scores (`running_topk`). XLA:TPU compiles a top-k as a sort, and a sort takes
    seconds to compile: one sort of k + chunk scores, whatever the capacity, instead of one
    per prefix size.

    Args:
      scores: f32[B, T, capacity].
      num_entries: i32[B], entries written per row (ids at or past it are -inf).
      k: picks per query.
      smallest: the smallest prefix (one page of entries).
    """
    B, T, C = scores.shape
    sizes = paging.prefix_sizes(C, smallest)
    size = jnp.asarray(sizes, jnp.int32)[paging.prefix_bucket(sizes, jnp.max(num_entries))]
    # A prefix of at most k ids: every candidate, in id order.
    few = min(k, C)
    pad = ((0, 0), (0, 0), (0, k - few))
    whole = (jnp.pad(scores[..., :few], pad, constant_values=-jnp.inf),
             jnp.pad(jnp.broadcast_to(jnp.arange(few, dtype=jnp.int32), (B, T, few)), pad,
                     constant_values=-1))
    # A longer one: chunks of at least k ids (whole pages), merged into the best k.
    chunk = min(C, -(-max(k, smallest) // smallest) * smallest)
    padded = jnp.pad(scores, ((0, 0), (0, 0), (0, -C % chunk)), constant_values=-jnp.inf)

    def merge(i, best):
        first = i * chunk
        return _merge_best(best, jax.lax.dynamic_slice_in_dim(padded, first, chunk, axis=2),
                           first)

    merged = jax.lax.fori_loop(0, jnp.where(size <= k, 0, -(-size // chunk)), merge,
                               _no_best(B, T, k))
    best = jax.tree.map(lambda a, b: jnp.where(size <= k, a, b), whole, merged)
    return finish_topk(best)


def finish_topk(best: tuple[jax.Array, jax.Array]) -> jax.Array:
    """i32[B, T, k] picks from `lax.top_k` output (scores, indices) over scores where invalid
    entries are -inf: -1 where fewer than k entries were valid."""
    scores, idx = best
    return jnp.where(scores > -jnp.inf, idx, -1)


def picks_from_scores(model: AttentionConfig, geometry: CacheConfig, scores: jax.Array,
                      kv_end: jax.Array) -> jax.Array:
    """i32[B, T, k]: the top-k picks of `index_scores` output (-1 = unused pick)."""
    return topk_of_scores(scores, kv_end // model.csa_ratio, model.index_topk,
                          geometry.entries_per_page(model.csa_ratio))


def index_topk(model: AttentionConfig, geometry: CacheConfig, options: Options, **arrays
               ) -> jax.Array:
    """i32[B, T, k]: the indexer's picks for each query; arguments as `index_scores`."""
    scores = index_scores(model, geometry, options, **arrays)
    return picks_from_scores(model, geometry, scores, arrays["kv_end"])


__all__ = ["finish_topk", "index_scores", "index_topk", "key_scores", "picks_from_scores",
           "prepare_index_query", "running_topk", "score_capacity", "topk_of_scores"]
