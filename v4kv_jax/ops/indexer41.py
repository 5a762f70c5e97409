"""Reference of DeepSeek-V4.1's two-level selection (V41_SPEC.md sections 4.2-4.4).

An index source scores every entry of its kv source a query at position t can see (entry j
is visible iff j < n_t = (t + 1) // r):

  I_t,j = sum_h w_t,h ReLU(qI_t,h . K_j),   w = raw weight * c^-0.5 * nI^-0.5

The candidate source keeps, per query, the best `candidate_topk_blocks` blocks of
`candidate_block_size` entries (a block scores the max over its entries; the newest entry's
block is always kept) and the index sources after it score only entries in those blocks.
Every index source then picks its top `index_topk` (all visible entries when n_t <= topk:
the short-context shortcut, before any candidate mask), dropping picks whose score is
-inf. Ties go to the lower entry id (`lax.top_k`), as in the float64 oracle.

Shapes are fixed: a query's scores span every entry of its slot's page-table row (E =
max_pages_per_seq * P // r), masked with `where` by visibility, so padding and pages past the
length (NaN-poisoned or another request's) never reach a pick.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def visible_entries(positions: jax.Array, ratio: int) -> jax.Array:
    """n_t = (t + 1) // r: the entries closed at query position t."""
    return (positions + 1) // ratio


def index_scores(q_index: jax.Array, w_index: jax.Array, keys: jax.Array,
                 n_visible: jax.Array) -> jax.Array:
    """f32[B, T, E]: I_t,j for visible entries, -inf elsewhere; the heads summed one at a time
    (memory B x T x E, not x nI).

    Args:
      q_index: f32[B, T, nI, c], the rotated (and, in the release formats, MXFP4-rounded)
        index queries.
      w_index: f32[B, T, nI], the weights with both scales applied.
      keys: f32[B, E, c], the decoded index keys of each row's pages, in entry order.
      n_visible: i32[B, T], n_t per query.
    """
    batch, tokens = q_index.shape[:2]

    def head(total, x):
        q, w = x
        dots = jnp.einsum("btc,bec->bte", q, keys, precision=jax.lax.Precision.HIGHEST)
        return total + w[..., None] * jnp.maximum(dots, 0.0), None

    zero = jnp.zeros((batch, tokens, keys.shape[1]), jnp.float32)
    scores, _ = jax.lax.scan(head, zero, (jnp.moveaxis(q_index, 2, 0),
                                          jnp.moveaxis(w_index, 2, 0)))
    j = jnp.arange(keys.shape[1], dtype=jnp.int32)
    return jnp.where(j < n_visible[..., None], scores, -jnp.inf)


def candidate_blocks(scores: jax.Array, n_visible: jax.Array, block_size: int,
                     topk_blocks: int) -> jax.Array:
    """i32[B, T, KB]: each query's candidate blocks (section 4.4), KB = min(topk_blocks,
    blocks), in rank order; a block not kept (its best score -inf) is `blocks`.

    Args:
      scores: f32[B, T, E] of the candidate source (`index_scores`: -inf past n_t).
      n_visible: i32[B, T].
      block_size, topk_blocks: the config's candidate_block_size and candidate_topk_blocks.
    """
    batch, tokens, width = scores.shape
    blocks = -(-width // block_size)
    padded = jnp.pad(scores, ((0, 0), (0, 0), (0, blocks * block_size - width)),
                     constant_values=-jnp.inf)
    best = padded.reshape(batch, tokens, blocks, block_size).max(axis=-1)
    b = jnp.arange(blocks, dtype=jnp.int32)
    newest = (n_visible - 1) // block_size
    best = jnp.where((b == newest[..., None]) & (n_visible[..., None] > 0), jnp.inf, best)
    value, ids = jax.lax.top_k(best, min(topk_blocks, blocks))
    return jnp.where(value > -jnp.inf, ids, blocks)


def candidate_mask(block_ids: jax.Array, n_visible: jax.Array, width: int, block_size: int
                   ) -> jax.Array:
    """bool[B, T, E]: the visible entries of the blocks `block_ids` (`candidate_blocks`)."""
    batch, tokens = block_ids.shape[:2]
    blocks = -(-width // block_size)
    kept = jnp.zeros((batch, tokens, blocks + 1), bool)
    kept = jax.vmap(jax.vmap(lambda k, i: k.at[i].set(True)))(kept, block_ids)[..., :blocks]
    j = jnp.arange(width, dtype=jnp.int32)
    return kept[..., j // block_size] & (j < n_visible[..., None])


def select(scores: jax.Array, n_visible: jax.Array, topk: int) -> tuple[jax.Array, jax.Array]:
    """The picks of each query: (ids i32[B, T, K], valid bool[B, T, K]), K = min(topk, E),
    ascending with the invalid ones last (their ids are E: read nothing).

    All visible entries where n_t <= topk; else the top-k of `scores` (masked already:
    -inf where invisible or outside the candidates), picks of score -inf dropped.
    """
    width = scores.shape[-1]
    k = min(topk, width)
    value, ids = jax.lax.top_k(scores, k)
    valid = value > -jnp.inf
    rank = jnp.arange(k, dtype=jnp.int32)
    short = (n_visible <= topk)[..., None]
    valid = jnp.where(short, rank < n_visible[..., None], valid)
    ids = jnp.where(short, rank, ids)
    ids = jnp.sort(jnp.where(valid, ids, width), axis=-1)
    return ids, ids < width


def weights_scale(index_heads: int, index_head_dim: int) -> np.float32:
    """index_head_dim^-0.5 * index_heads^-0.5, the scale of the raw index weights."""
    return np.float32(index_head_dim ** -0.5 * index_heads ** -0.5)


__all__ = ["candidate_blocks", "candidate_mask", "index_scores", "select", "visible_entries",
           "weights_scale"]
