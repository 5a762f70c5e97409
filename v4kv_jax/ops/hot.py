"""HiSparse's hot set: which device rows hold which C4 entries of a slot.

With `CacheConfig.hot_rows` = H > 0, every CSA layer keeps, per slot, H device rows holding
C4 entries its indexer picked (`pools.HotSet`). A CSA read goes: indexer top-k -> `resident`
(the picks a slot's hot rows do not hold are fetched into rows that are empty or least
recently used, and every pick is renamed to the hot row holding it) -> the sparse read of the
hot rows. The rows are exact copies of the stored entries and the sparse read sees them in
the indexer's order, so outputs are the bits of a read from the pool.

A group of queries is made resident at once when its picks fit: G = H // index_topk
queries pick at most G * k <= H distinct entries, so no pick of the group evicts another
(`group_size`). A prefill chunk is made resident G queries at a time, in position order,
each query's picked rows copied out as its group holds them (`resident_chunk`); the chunk
is then read at once, by the operations of a read from the pool on the same shapes, so that
XLA sums every product in the same order (a read G queries at a time is a product of other
shapes, which XLA:CPU may sum in another order: outputs then differ in the last bits).

Rows are reused least recently used first, the clock being 1 + the position of the last
query that picked the row (`used`; 0: never). `held` is the entry id + 1 (0: empty), so a
slot whose State is cleared (reset, restore) starts with an empty hot set.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from v4kv_jax import pools
from v4kv_jax.config import AttentionConfig, CacheConfig
from v4kv_jax.pools import HotSet, paging

_NONE = jnp.iinfo(jnp.int32).max  # sorts after every entry id
FETCH_ROWS = 16  # rows per row that one copy from the host tier moves


def group_size(model: AttentionConfig, geometry: CacheConfig) -> int:
    """Queries whose picks are made resident at once: hot rows // index_topk (>= 1)."""
    return geometry.hot_set_rows(model) // model.index_topk


def _assign(picks: jax.Array, clock: jax.Array, held: jax.Array, used: jax.Array):
    """One row: picks i32[N] (-1: none; at most H distinct) -> (hot row of each pick
    i32[N] (-1: none), entries to fetch i32[N] (-1: none), their hot rows i32[N] (H: none),
    new held, new used)."""
    H, N = held.shape[0], picks.shape[0]
    valid = picks >= 0
    match = (held[None, :] == picks[:, None] + 1) & valid[:, None]
    hit = match.any(axis=1)
    hit_row = jnp.argmax(match, axis=1).astype(jnp.int32)
    kept = jnp.zeros((H,), bool).at[jnp.where(hit, hit_row, H)].set(True, mode="drop")
    miss = valid & ~hit
    # Distinct missing entries, in id order; each gets the next free or least recent row.
    key = jnp.where(miss, picks, _NONE)
    order = jnp.argsort(key, stable=True)
    sorted_key = key[order]
    first = (sorted_key != _NONE) & (sorted_key != jnp.concatenate(
        [jnp.full((1,), -1, jnp.int32), sorted_key[:-1]]))
    rank = jnp.cumsum(first) - 1
    free_first = jnp.argsort(jnp.where(kept, _NONE, jnp.where(held == 0, -1, used)),
                             stable=True).astype(jnp.int32)
    row_sorted = free_first[jnp.clip(rank, 0, H - 1)]
    row_of_miss = jnp.zeros((N,), jnp.int32).at[order].set(row_sorted)
    out = jnp.where(hit, hit_row, jnp.where(miss, row_of_miss, -1))
    fetch = jnp.full((N,), -1, jnp.int32).at[jnp.where(first, rank, N)].set(sorted_key,
                                                                            mode="drop")
    dest = jnp.where(fetch >= 0, free_first[jnp.arange(N) % H], H)
    held = held.at[dest].set(fetch + 1, mode="drop")
    touched = jnp.zeros((H,), bool).at[jnp.where(out >= 0, out, H)].set(True, mode="drop")
    return out, fetch, dest, held, jnp.where(touched, clock, used)


def resident(picks: jax.Array, q_pos: jax.Array, hot: HotSet, entries: jax.Array, layer,
             page_rows: jax.Array, *, host: bool = False) -> tuple[jax.Array, HotSet]:
    """Makes a group's picks resident in the hot rows: (hot row of each pick i32[B, G, k]
    (-1: none), the new `HotSet`).

    Args:
      picks: i32[B, G, k] the indexer's picks of G queries per row (at most H distinct).
      q_pos: i32[B, G] their positions (the LRU clock).
      hot: the layer's hot sets of the batch's rows (`pools.hot_rows`): blocks [B].
      entries, layer, page_rows: the C4 entries (blocks [n_csa, num_pages]), the layer's
        index in them and the rows' page-table rows, where misses are fetched from.
      host: the entries live in host memory (c4_tier="host"): only the misses' rows are
        gathered there and copied to the device (`pools.take_rows`).

    A pick whose page is absent reads nothing, as in a read from the pool.
    """
    batch, groups, k = picks.shape
    page, _ = paging.entry_pages(page_rows, picks, entries.map.records)
    flat = jnp.where(page >= 0, picks, -1).reshape(batch, groups * k)
    clock = jnp.max(q_pos, axis=1) + 1
    out, fetch, dest, held, used = jax.vmap(_assign)(flat, clock, hot_ids(hot.held),
                                                     hot_ids(hot.used))
    fetched = _fetch(entries, layer, page_rows, fetch, host)
    rows = hot.rows.put((jnp.arange(batch)[:, None],), dest, fetched)
    return out.reshape(batch, groups, k), HotSet(rows, hot.held.map.pack(held[..., None]),
                                                 hot.used.map.pack(used[..., None]))


def hot_ids(stored: pools.Lanes) -> jax.Array:
    """i32[B, H] of a hot set's held or used words (blocks [B] of H one-word rows)."""
    return stored.records()[..., 0]


def _fetch(entries: jax.Array, layer, page_rows: jax.Array, fetch: jax.Array, host: bool
           ) -> jax.Array:
    """Rows [B, N, sw] of the entries `fetch` i32[B, N] (-1: none, after the ones to fetch).
    From the device pool: one gather. From host memory: FETCH_ROWS rows per row at a time,
    as many times as the row with the most misses needs, so the bytes that cross follow the
    misses."""
    epp = entries.map.records
    if not host:
        page, row = paging.entry_pages(page_rows, fetch, epp)
        return pools.take_rows(entries, layer, page, row, host=False)
    batch, n = fetch.shape
    blocks = -(-n // FETCH_ROWS)
    fetch = jnp.pad(fetch, ((0, 0), (0, blocks * FETCH_ROWS - n)), constant_values=-1)
    needed = -(-jnp.max(jnp.sum(fetch >= 0, axis=1)) // FETCH_ROWS)

    def block(i, out):
        ids = jax.lax.dynamic_slice_in_dim(fetch, i * FETCH_ROWS, FETCH_ROWS, axis=1)
        page, row = paging.entry_pages(page_rows, ids, epp)
        rows = pools.take_rows(entries, layer, page, row, host=True)
        return jax.lax.dynamic_update_slice_in_dim(out, rows, i * FETCH_ROWS, axis=1)

    out = jnp.zeros((batch, blocks * FETCH_ROWS, entries.map.words), entries.dtype)
    return jax.lax.fori_loop(0, needed, block, out)[:, :n]


def resident_chunk(picks: jax.Array, q_pos: jax.Array, kv_end: jax.Array, hot: HotSet,
                   group: int, make_resident
                   ) -> tuple[jax.Array, jax.Array, jax.Array, HotSet]:
    """A chunk's picks made resident `group` queries at a time, in position order, and each
    query's picked rows copied out while its group holds them: (entries, blocks
    [1, B * T * k] of one row, page_rows i32[B, T * k], ids i32[B, T, k], the new
    `HotSet`).

    The three are a pool of one entry per page that a sparse read of the whole chunk reads
    with `ids` where it would read the pool with `picks`: the same rows in the same columns,
    absent (page -1) where the pool has no page, and -1 exactly where `picks` is, so the
    read reads the same prefix of the picks' columns.

    Args:
      picks: i32[B, T, k] the indexer's picks of the chunk's queries; q_pos: i32[B, T] their
        positions; kv_end: i32[B] (a query at or past it, padding, makes nothing resident
        and reads no entry).
      hot: the rows' hot sets (blocks [B]); group: queries made resident at once.
      make_resident: (picks i32[B, group, k], q_pos i32[B, group], hot sets) -> (the hot
        rows of the picks, the `ops.Stored` they are read from, with the new hot sets):
        `ops.make_resident`, the one place picks are made readable.
    """
    batch, tokens, k = picks.shape
    wanted = jnp.where((q_pos < kv_end[:, None])[..., None], picks, -1)
    n = -(-tokens // group)
    pad = n * group - tokens

    def grouped(x, fill):
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2), mode="edge"
                    ) if fill is None else jnp.pad(
                        x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
        return x.reshape(batch, n, group, *x.shape[2:]).swapaxes(0, 1)

    def one_group(hot, args):
        pos, picked = args
        rows, read_from = make_resident(picked, pos, hot)
        return read_from.hot, paging.gather_entries(read_from.entries, read_from.layer,
                                                    read_from.page_rows, rows)

    hot, (keys, present) = jax.lax.scan(one_group, hot, (grouped(q_pos, None),
                                                         grouped(wanted, -1)))
    keys = keys.swapaxes(0, 1).reshape(batch, n * group, k, -1)[:, :tokens]
    present = present.swapaxes(0, 1).reshape(batch, n * group, k)[:, :tokens]
    column = jnp.arange(tokens * k, dtype=jnp.int32)
    pool_rows = jnp.where(present.reshape(batch, -1),
                          jnp.arange(batch, dtype=jnp.int32)[:, None] * (tokens * k) + column,
                          -1)
    picked = jnp.where(picks >= 0, column.reshape(tokens, k), -1)
    one_row = pools.LaneMap(keys.shape[-1], 1, keys.dtype)
    return one_row.pack(keys.reshape(1, batch * tokens * k, 1, -1)), pool_rows, picked, hot


def as_pages(hot: HotSet) -> tuple[pools.Lanes, jax.Array]:
    """The hot rows as a pool a sparse read takes: (entries, blocks [1, B] of H rows: one
    page per row, page_rows i32[B, 1]): hot row h of row b is entry h of page b."""
    batch = hot.rows.lead[0]
    return hot.rows[None], jnp.arange(batch, dtype=jnp.int32)[:, None]


__all__ = ["as_pages", "group_size", "hot_ids", "resident", "resident_chunk"]
