"""Page tables, the device-side free stack and per-page refcounts.

Layout (all int32, -1 = no page):
  page_table  i32[max_slots, max_pages_per_seq]  ONE row per request, shared by every layer and
                                                  every entry kind.
  free_stack  i32[num_pages]                      free_stack[:num_free] are the free page ids;
                                                  pages are popped from the top.
  num_free    i32[]
  refcount    i32[num_pages]                      holders of each page: page-table rows, and
                                                  holders outside the table such as a prefix
                                                  index (`hold`, `take`); 0 = free.

Entry i of a kind with ratio m lives at page `page_table[slot, i // (P // m)]`, row
`i % (P // m)`; a page id names the same token range in every layer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from v4kv_jax import checks, programs
from v4kv_jax.pools.lanes import Lanes


@struct.dataclass
class PageState:
    page_table: jax.Array
    free_stack: jax.Array
    num_free: jax.Array
    refcount: jax.Array

    @classmethod
    def create(cls, num_pages: int, max_slots: int, max_pages_per_seq: int) -> PageState:
        return cls(
            page_table=jnp.full((max_slots, max_pages_per_seq), -1, jnp.int32),
            # Reversed so that the first pops hand out pages 0, 1, 2, ...
            free_stack=jnp.arange(num_pages - 1, -1, -1, dtype=jnp.int32),
            num_free=jnp.asarray(num_pages, jnp.int32),
            refcount=jnp.zeros((num_pages,), jnp.int32),
        )

    @property
    def num_pages(self) -> int:
        return self.refcount.shape[0]


def slot_rows(pages: PageState, slot_ids: jax.Array) -> jax.Array:
    """i32[B, max_pages_per_seq]: the page-table rows of `slot_ids`; all -1 (no page) for an
    id outside [0, max_slots), so such a row reads no entry."""
    S = pages.page_table.shape[0]
    inside = (slot_ids >= 0) & (slot_ids < S)
    rows = programs.lookup(pages.page_table, jnp.clip(slot_ids, 0, S - 1))
    return jnp.where(inside[:, None], rows, -1)


def pages_for(length: jax.Array, page_tokens: int) -> jax.Array:
    """Pages a sequence of `length` tokens occupies: ceil(length / P)."""
    return (length + page_tokens - 1) // page_tokens


def held_pages(page_table_rows: jax.Array) -> jax.Array:
    """i32[B]: pages a row holds (held pages form a prefix of the row)."""
    return jnp.sum(page_table_rows >= 0, axis=-1).astype(jnp.int32)


def allocate(pages: PageState, slot_ids: jax.Array, new_lengths: jax.Array,
             wants: jax.Array, page_tokens: int, max_new_pages: int
             ) -> tuple[PageState, jax.Array]:
    """Gives each slot the pages it needs to hold `new_lengths` tokens, all or nothing.

    Slots are served greedily in batch order; a slot whose pages do not fit in what is left is
    not granted and receives nothing, so it writes nothing (the caller flags it).

    Args:
      pages: the page state.
      slot_ids: i32[B] distinct slots.
      new_lengths: i32[B] lengths after the append.
      wants: bool[B], slots that append at all.
      page_tokens: P.
      max_new_pages: static bound on pages one slot can need in this call.

    Returns:
      (pages, granted bool[B]).
    """
    rows = programs.lookup(pages.page_table, slot_ids)
    held = held_pages(rows)
    need = jnp.where(wants, jnp.maximum(pages_for(new_lengths, page_tokens) - held, 0), 0)

    def serve(remaining, n):
        ok = n <= remaining
        taken = jnp.where(ok, n, 0)
        return remaining - taken, (ok, pages.num_free - remaining)

    remaining, (granted, offset) = jax.lax.scan(serve, pages.num_free, need)
    granted = granted & wants
    j = jnp.arange(max_new_pages, dtype=jnp.int32)
    takes = granted[:, None] & (j[None, :] < need[:, None])  # [B, max_new]
    stack_pos = pages.num_free - 1 - offset[:, None] - j[None, :]
    new_ids = jnp.where(takes, programs.lookup(pages.free_stack, jnp.clip(stack_pos, 0, None)),
                        -1)
    num_slots, max_pages = pages.page_table.shape
    row = jnp.where(takes, slot_ids[:, None], num_slots)  # out of bounds -> dropped
    col = jnp.where(takes, held[:, None] + j[None, :], max_pages)
    flat = jnp.where((row < num_slots) & (col < max_pages), row * max_pages + col, -1)
    page_table = programs.scatter(pages.page_table.reshape(-1), flat, new_ids,
                                  op="set").reshape(num_slots, max_pages)
    refcount = programs.scatter(pages.refcount, jnp.where(takes, new_ids, -1), 1, op="set")
    return pages.replace(page_table=page_table, num_free=remaining, refcount=refcount), granted


def attach(pages: PageState, slot: jax.Array, page_ids: jax.Array, n_pages: jax.Array
           ) -> tuple[PageState, jax.Array]:
    """Gives an empty page-table row the pages `page_ids[:n_pages]` (refcount + 1 each),
    all or nothing: the pages another request holds become a shared prefix of this one.

    Nothing changes (and `ok` is False) unless: `slot` is in [0, max_slots) and holds no
    page; 0 <= n_pages <= min(len(page_ids), max_pages_per_seq); the used ids are distinct,
    in [0, num_pages) and in use (refcount > 0). Later appends to the slot allocate after
    the held prefix (`allocate`), so the shared pages are never written through this row.

    Args:
      slot: i32[] the slot.
      page_ids: i32[k] page ids (entries past n_pages are ignored).
      n_pages: i32[] pages to attach.

    Returns:
      (pages, ok bool[]).
    """
    S, M = pages.page_table.shape
    N = pages.num_pages
    slot = jnp.asarray(slot, jnp.int32)
    ids = jnp.asarray(page_ids, jnp.int32).reshape(-1)
    n = jnp.asarray(n_pages, jnp.int32)
    k = ids.shape[0]
    j = jnp.arange(k, dtype=jnp.int32)
    used = j < n
    valid_id = (ids >= 0) & (ids < N)
    in_use = valid_id & (pages.refcount[jnp.clip(ids, 0, N - 1)] > 0)
    dup = jnp.any((ids[:, None] == ids[None, :]) & used[:, None] & used[None, :]
                  & (j[:, None] < j[None, :]))
    inside = (slot >= 0) & (slot < S)
    empty = held_pages(pages.page_table[jnp.clip(slot, 0, S - 1)][None])[0] == 0
    ok = (inside & empty & (n >= 0) & (n <= min(k, M)) & jnp.all(~used | in_use) & ~dup)
    take = used & ok
    page_table = pages.page_table.at[jnp.where(take, slot, S), jnp.where(take, j, M)].set(
        ids, mode="drop")
    refcount = pages.refcount.at[jnp.where(take, ids, N)].add(1, mode="drop")
    return pages.replace(page_table=page_table, refcount=refcount), ok


def release(pages: PageState, slot_mask: jax.Array) -> PageState:
    """Drops the page references of the slots in `slot_mask`; pages reaching 0 become free."""
    rows = jnp.where(slot_mask[:, None], pages.page_table, -1)
    pages = _decrement(pages, rows.reshape(-1))
    return pages.replace(page_table=jnp.where(slot_mask[:, None], -1, pages.page_table))


def _decrement(pages: PageState, page_ids: jax.Array) -> PageState:
    """One reference less per entry of `page_ids` (-1 entries ignored, a repeated id counts
    each time); pages reaching 0 go back on the free stack."""
    n = pages.num_pages
    dec = jnp.zeros((n,), jnp.int32).at[jnp.where(page_ids >= 0, page_ids, n)].add(
        1, mode="drop")
    refcount = pages.refcount - dec
    freed = (dec > 0) & (refcount == 0)
    rank = jnp.cumsum(freed.astype(jnp.int32)) - 1
    dest = jnp.where(freed, pages.num_free + rank, n)
    free_stack = pages.free_stack.at[dest].set(jnp.arange(n, dtype=jnp.int32), mode="drop")
    return pages.replace(
        free_stack=free_stack,
        num_free=pages.num_free + jnp.sum(freed, dtype=jnp.int32),
        refcount=refcount,
    )


def _held_ids_ok(pages: PageState, page_ids: jax.Array) -> jax.Array:
    """bool[]: every id of `page_ids` is -1 (ignored) or a distinct page in use."""
    N = pages.num_pages
    used = page_ids >= 0
    in_use = (page_ids < N) & (pages.refcount[jnp.clip(page_ids, 0, N - 1)] > 0)
    j = jnp.arange(page_ids.shape[0])
    dup = jnp.any((page_ids[:, None] == page_ids[None, :]) & used[:, None]
                  & (j[:, None] < j[None, :]))
    return jnp.all(~used | in_use) & ~dup


def hold(pages: PageState, page_ids: jax.Array) -> tuple[PageState, jax.Array]:
    """One more reference to each page of `page_ids`, for a holder outside the page table
    (e.g. a prefix index keeping the full pages of finished requests), all or nothing.

    Nothing changes (and `ok` is False) unless every id is -1 (ignored) or a distinct page
    in use (refcount > 0).

    Args:
      page_ids: i32[k].

    Returns:
      (pages, ok bool[]).
    """
    ids = jnp.asarray(page_ids, jnp.int32).reshape(-1)
    ok = _held_ids_ok(pages, ids)
    refcount = pages.refcount.at[jnp.where(ok & (ids >= 0), ids, pages.num_pages)].add(
        1, mode="drop")
    return pages.replace(refcount=refcount), ok


def drop(pages: PageState, page_ids: jax.Array) -> tuple[PageState, jax.Array]:
    """Gives back one reference to each page of `page_ids` taken with `hold` (or `take`);
    pages reaching 0 become free. All or nothing, with the rules of `hold`."""
    ids = jnp.asarray(page_ids, jnp.int32).reshape(-1)
    ok = _held_ids_ok(pages, ids)
    return _decrement(pages, jnp.where(ok, ids, -1)), ok


def take(pages: PageState, n_pages: jax.Array, size: int) -> tuple[PageState, jax.Array]:
    """Pops `n_pages` free pages for a holder outside the page table (refcount 1 each).

    Args:
      n_pages: i32[], 0 <= n_pages <= min(size, num_free); otherwise nothing is taken.
      size: static length of the returned ids.

    Returns:
      (pages, page_ids i32[size]): the taken pages first, -1 after them (all -1 when
      nothing was taken).
    """
    n = jnp.asarray(n_pages, jnp.int32)
    ok = (n >= 0) & (n <= min(size, pages.num_pages)) & (n <= pages.num_free)
    j = jnp.arange(size, dtype=jnp.int32)
    takes = ok & (j < n)
    ids = jnp.where(takes, pages.free_stack[jnp.clip(pages.num_free - 1 - j, 0, None)], -1)
    refcount = pages.refcount.at[jnp.where(takes, ids, pages.num_pages)].set(1, mode="drop")
    return pages.replace(num_free=pages.num_free - jnp.where(ok, n, 0), refcount=refcount), ids


def entry_pages(page_table_rows: jax.Array, entry_idx: jax.Array,
                entries_per_page: int) -> tuple[jax.Array, jax.Array]:
    """Page id and row of entries; -1 page where the entry or its page is absent.

    Args:
      page_table_rows: i32[B, max_pages_per_seq].
      entry_idx: i32[B, ...] entry indices (negative = none).
      entries_per_page: P // m.
    """
    max_pages = page_table_rows.shape[-1]
    col = entry_idx // entries_per_page
    in_range = (entry_idx >= 0) & (col < max_pages)
    flat = page_table_rows.reshape(page_table_rows.shape[0], -1)
    col_flat = jnp.clip(col, 0, max_pages - 1).reshape(entry_idx.shape[0], -1)
    page = jnp.take_along_axis(flat, col_flat, axis=1).reshape(entry_idx.shape)
    page = jnp.where(in_range, page, -1)
    return page, entry_idx % entries_per_page


def gather_pages(pool: Lanes, layer, page_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Rows of whole pages of one layer, as stored: ([B, n * P/m, sw], present
    bool[B, n * P/m]).

    pool: blocks [n_layers, num_pages] of P // m rows (`Lanes`); page_ids: i32[B, n] (-1 =
    absent: its rows are page 0's, marked not present, and must be masked by the caller with
    `where`).
    """
    batch, n = page_ids.shape
    epp = pool.map.records
    rows = pool.block_records((layer, jnp.clip(page_ids, 0, None)))
    present = jnp.repeat(page_ids >= 0, epp, axis=1)
    return rows.reshape(batch, n * epp, -1), present


def gather_entries(pool: Lanes, layer, page_rows: jax.Array, entry_idx: jax.Array
                   ) -> tuple[jax.Array, jax.Array]:
    """Stored rows of entries by index: ([B, ..., sw], present bool[B, ...]).

    pool: blocks [n_layers, num_pages] of P // m rows (`Lanes`); page_rows:
    i32[B, max_pages_per_seq]; entry_idx: i32[B, ...] (negative = none). Absent entries read
    page 0's rows and are marked not present (mask them with `where`).
    """
    page, row = entry_pages(page_rows, entry_idx, pool.map.records)
    present = (entry_idx >= 0) & (page >= 0)
    return pool.take((layer, jnp.clip(page, 0, None)), row), present


def prefix_sizes(capacity: int, smallest: int) -> list[int]:
    """Power-of-two prefix sizes from `smallest` up to `capacity` (the last is capacity): the
    static shapes a read picks from at run time (`prefix_bucket`)."""
    capacity = checks.integer("capacity", capacity, lo=1)
    sizes, size = [], max(1, checks.integer("smallest", smallest, lo=0))
    while size < capacity:
        sizes.append(size)
        size *= 2
    return sizes + [capacity]


def prefix_bucket(sizes: list[int], need: jax.Array) -> jax.Array:
    """i32[]: the index of the first of `sizes` (ascending, the last one covering everything)
    that is at least `need` (a traced count), for `lax.switch`."""
    if not sizes or list(sizes) != sorted(sizes):
        checks.fail("sizes", "a non-empty ascending list of prefix sizes", repr(sizes))
    return jnp.sum(jnp.asarray(sizes[:-1], jnp.int32) < need)


def padded_pages(max_pages: int, chunk_pages: int) -> int:
    """Page-table length rounded up to whole read chunks (chunk_pages clamped to max_pages)."""
    chunk_pages = min(chunk_pages, max_pages)
    return -(-max_pages // chunk_pages) * chunk_pages


def tail_chunk_pages(chunk_pages: int) -> int:
    """Pages per step of `fold_page_chunks`' second loop: the largest divisor of
    `chunk_pages` that is at most an eighth of it (at least 1)."""
    chunk_pages = checks.integer("chunk_pages", chunk_pages, lo=1)
    most = max(1, chunk_pages // 8)
    return max(d for d in range(1, most + 1) if chunk_pages % d == 0)


def fold_page_chunks(page_table_rows: jax.Array, num_entries: jax.Array, entries_per_page: int,
                     chunk_pages: int, body, init):
    """Folds `body` over the used pages of each row, in order: `chunk_pages` pages at a time,
    then the pages left over `tail_chunk_pages(chunk_pages)` at a time.

    Both trip counts are runtime values: ceil(max(num_entries) / entries per page) pages are
    read, rounded up to a whole last step of the second loop, so the cost follows the
    context actually used, not the page-table capacity, and at most a small step's worth of
    pages is read past it (not a whole chunk's). When one chunk covers the whole row, `body`
    runs once without a loop (it must mask entries past `num_entries`). Every step's pages
    lie inside the row rounded up to whole chunks (`padded_pages`).

    Args:
      page_table_rows: i32[B, max_pages_per_seq].
      num_entries: i32[B], entries each row needs read (entries past it may be skipped).
      entries_per_page: P // m of the kind being read.
      chunk_pages: pages per step of the first loop.
      body: (carry, page_ids i32[B, n], first_entry i32[]) -> carry, traced once per step
        size n (`chunk_pages`, and the second loop's when it differs).
      init: the initial carry.
    """
    batch, max_pages = page_table_rows.shape
    chunk_pages = min(chunk_pages, max_pages)
    padded = padded_pages(max_pages, chunk_pages)
    rows = jnp.pad(page_table_rows, ((0, 0), (0, padded - max_pages)), constant_values=-1)
    if padded == chunk_pages:
        return body(init, rows, jnp.int32(0))
    # Pages to read, never past the row (a slice past it would be moved back onto read pages).
    needed = jnp.minimum((jnp.max(num_entries) + entries_per_page - 1) // entries_per_page,
                         max_pages)

    def steps(carry, first_page, trips, size):
        def step(i, carry):
            page = first_page + i * size
            ids = jax.lax.dynamic_slice(rows, (0, page), (batch, size))
            return body(carry, ids, page * entries_per_page)

        return jax.lax.fori_loop(0, trips, step, carry)

    whole = needed // chunk_pages
    carry = steps(init, 0, whole, chunk_pages)
    tail = tail_chunk_pages(chunk_pages)
    if tail == chunk_pages:  # one page per step: the whole chunks are every needed page
        return carry
    # tail divides chunk_pages and fewer than chunk_pages pages are left: the last step ends
    # inside the padded row.
    return steps(carry, whole * chunk_pages, (needed - whole * chunk_pages + tail - 1) // tail,
                 tail)
