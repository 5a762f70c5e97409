"""The lightning indexer of CSA layers: scores over indexer keys and top-k (SPEC section 5).

  I[t, i] = sum_h w[t, h] * ReLU(qi[t, h] . K[i]),   w = (W_iw x_t) * c^-0.5 * nI^-0.5

Only entries i < (t + 1) // m are candidates. The top min(k, #valid) are kept; unused picks
are -1 (`finish_topk`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_HIGHEST = jax.lax.Precision.HIGHEST


def index_scores(index_q: jax.Array, index_weights: jax.Array, keys: jax.Array) -> jax.Array:
    """Scores of every query against every key.

    Args:
      index_q: f32[B, T, nI, c], RoPE already applied per head.
      index_weights: f32[B, T, nI], the raw head weights W_iw x_t (scaled here).
      keys: [B, E, c] indexer keys.

    Returns:
      f32[B, T, E].
    """
    n_heads, dim = index_q.shape[-2:]
    if index_q.shape[1] == 1:
        # One query per slot (decode): heads last, so the dot, the ReLU and the weighted head
        # sum run as one fused pass over the keys on XLA:CPU (2.9x faster at 32k keys).
        dots = jnp.einsum("bec,bnc->ben", keys.astype(jnp.float32),
                          index_q[:, 0].astype(jnp.float32), precision=_HIGHEST)
        weights = index_weights[:, 0].astype(jnp.float32) * (n_heads**-0.5 * dim**-0.5)
        return jnp.sum(jax.nn.relu(dots) * weights[:, None, :], axis=-1)[:, None]
    dots = jnp.einsum("btnc,bec->btne", index_q.astype(jnp.float32),
                      keys.astype(jnp.float32), precision=_HIGHEST)
    scores = jax.nn.relu(dots) * dim**-0.5
    weights = index_weights.astype(jnp.float32) * n_heads**-0.5
    return jnp.einsum("btne,btn->bte", scores, weights, precision=_HIGHEST)


def finish_topk(best: tuple[jax.Array, jax.Array]) -> jax.Array:
    """i32[B, T, k] picks from `lax.top_k` output (scores, indices) over scores where invalid
    entries are -inf: -1 where fewer than k entries were valid."""
    scores, idx = best
    return jnp.where(scores > -jnp.inf, idx, -1)
