"""Moving pages and State in and out of a cache: attach a shared prefix, hold and drop page
references, read and load page contents, snapshot and restore a slot's State. The host and
disk tiers grow here."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.experimental.compute_on import compute_on

from v4kv_jax import checks
from v4kv_jax.pools import paging
from v4kv_jax.pools.lanes import Lanes
from v4kv_jax.pools.slots import _slot_mask
from v4kv_jax.pools.tree import (
    Cache,
    SlotStatus,
    entries,
    hot_set,
    on_host,
    tail,
    window_ring,
    with_entries,
    with_hot_set,
    with_slots,
    with_tail,
    with_window_ring,
)

# --- prefix sharing: attach shared pages, move a request's State in and out -----------------


def attach_prefix(cache: Cache, slot, page_ids, n_pages) -> Cache:
    """A fresh slot takes the full pages `page_ids[:n_pages]` of another request as its
    prefix: its page-table row gets them (refcount + 1 each, one physical copy) and its
    length becomes n_pages * page_tokens.

    Only whole pages are attachable (a full page is immutable; a partly filled one is never
    shared): every slot holding page_ids[j] must hold it as its page j, with all of its
    tokens. Appends past the prefix take new pages of the slot's own. The slot's State
    (window ring, tails) is NOT valid after this call: restore a snapshot taken at the
    boundary (`restore_state`) or rebuild it with `step.replay` / `nn.Decoder.replay` before
    the slot decodes.

    Args:
      cache: the cache.
      slot: the slot, fresh from `reset_slot` (ACTIVE, length 0, no pages).
      page_ids: i32[k] page ids in use (refcount > 0), distinct, full, in prefix order: e.g.
        a row of another slot's page table; entries past n_pages are ignored.
      n_pages: pages to attach, 0 <= n_pages <= min(k, max_pages_per_seq).

    Called with concrete arguments, a broken rule raises ValueError (TypeError for a wrong
    type); inside a caller's jit a call that breaks one changes nothing.
    """
    checks.alive("cache", cache)
    geo = cache.geometry
    S, M = geo.max_slots, geo.max_pages_per_seq
    if checks.concrete(slot, page_ids, n_pages, cache.state.status, cache.pages.refcount):
        s = checks.slot(slot, S)
        st = SlotStatus(int(cache.state.status[s]))
        length = int(cache.state.lengths[s])
        held = int(np.sum(np.asarray(cache.pages.page_table[s]) >= 0))
        if st != SlotStatus.ACTIVE or length or held:
            checks.fail("slot", "a fresh slot (ACTIVE, length 0, no pages: reset_slot it "
                        "first)", f"slot {s} {st.name} with length {length} and {held} page(s)")
        ids = checks.int_array("page_ids", page_ids, ndim=1)
        if isinstance(n_pages, (np.ndarray, jax.Array)):
            checks.shape("n_pages", n_pages, ())
            checks.dtype_kind("n_pages", n_pages, "integer")
            n_pages = int(n_pages)
        n = checks.integer("n_pages", n_pages, lo=0, hi=min(ids.shape[0], M))
        used = ids[:n]
        if used.size and (used.min() < 0 or used.max() >= geo.num_pages):
            checks.fail("page_ids", f"page ids in [0, {geo.num_pages}) (num_pages)", used)
        if len(set(used.tolist())) != used.size:
            checks.fail("page_ids", "distinct page ids", used)
        refcount = np.asarray(cache.pages.refcount)
        free = [p for p in used.tolist() if refcount[p] <= 0]
        if free:
            checks.fail("page_ids", "pages in use (refcount > 0: full pages another request "
                        "holds)", f"page {free[0]} with refcount {int(refcount[free[0]])}")
        table, lengths = np.asarray(cache.pages.page_table), np.asarray(cache.state.lengths)
        for j, p in enumerate(used.tolist()):
            for holder, col in zip(*np.nonzero(table == p), strict=True):
                if col != j or lengths[holder] < (j + 1) * geo.page_tokens:
                    checks.fail("page_ids", "full pages in prefix order (page_ids[j] is page j "
                                f"of every slot holding it, which holds all its "
                                f"{geo.page_tokens} tokens)",
                                f"page_ids[{j}] = {p}, page {col} of slot {holder} of length "
                                f"{int(lengths[holder])}")
    slot = jnp.asarray(slot, jnp.int32)
    read = jnp.clip(slot, 0, S - 1)
    fresh = ((cache.state.status[read] == SlotStatus.ACTIVE) & (cache.state.lengths[read] == 0))
    n = jnp.asarray(n_pages, jnp.int32)
    ids = jnp.asarray(page_ids, jnp.int32).reshape(-1)
    # Every holder of page_ids[j] holds it as its page j, with all of its tokens.
    j = jnp.arange(ids.shape[0], dtype=jnp.int32)
    held_at = cache.pages.page_table[None] == ids[:, None, None]  # [k, S, M]
    col = jnp.arange(M, dtype=jnp.int32)[None, None, :]
    full = (col == j[:, None, None]) & (
        cache.state.lengths[None, :, None] >= (j[:, None, None] + 1) * geo.page_tokens)
    full = jnp.all(~held_at | full, axis=(1, 2)) | (j >= n)
    # A call that breaks a rule names a slot out of range, so that nothing changes.
    pages, ok = paging.attach(cache.pages, jnp.where(fresh & jnp.all(full), slot, S), ids, n)
    mask = _slot_mask(cache, slot) & ok
    return with_slots(cache.replace(pages=pages),
                      lengths=jnp.where(mask, n * geo.page_tokens, cache.state.lengths))


def _check_held_ids(cache: Cache, page_ids, name: str = "page_ids") -> np.ndarray | None:
    """Concrete checks of ids of pages in use (-1 ignored): returns them, or None under jit."""
    if not checks.concrete(page_ids, cache.pages.refcount):
        return None
    ids = checks.int_array(name, page_ids, ndim=1)
    N = cache.geometry.num_pages
    used = ids[ids >= 0]
    if (ids < -1).any() or (used >= N).any():
        checks.fail(name, f"page ids in [0, {N}) (num_pages) or -1 (none)", ids)
    if len(set(used.tolist())) != used.size:
        checks.fail(name, "distinct page ids", ids)
    refcount = np.asarray(cache.pages.refcount)
    free = [p for p in used.tolist() if refcount[p] <= 0]
    if free:
        checks.fail(name, "pages in use (refcount > 0)", f"page {free[0]} with refcount 0")
    return ids


def hold_pages(cache: Cache, page_ids) -> Cache:
    """One more reference to each page in use of `page_ids` (-1 entries ignored), for a
    holder outside the page tables: a prefix index keeps the full pages of finished requests
    this way, so that `release_slot` does not free them. Give each back with `drop_pages`.

    Called with concrete arguments, an id out of range, repeated, or of a free page raises
    ValueError (TypeError for a wrong type); inside a caller's jit such a call changes
    nothing.
    """
    checks.alive("cache", cache)
    _check_held_ids(cache, page_ids)
    pages, _ = paging.hold(cache.pages, jnp.asarray(page_ids, jnp.int32))
    return cache.replace(pages=pages)


def drop_pages(cache: Cache, page_ids) -> Cache:
    """Gives back one reference to each page of `page_ids` (-1 entries ignored) taken with
    `hold_pages` or `load_pages`; a page no one holds any more goes back on the free stack.
    Checks as `hold_pages`. Dropping a reference the caller does not hold takes another
    holder's: the caller keeps its own count.
    """
    checks.alive("cache", cache)
    _check_held_ids(cache, page_ids)
    pages, _ = paging.drop(cache.pages, jnp.asarray(page_ids, jnp.int32))
    return cache.replace(pages=pages)


# --- rows of a stored array, in its memory space ------------------------------------------


def _on_host(*xs) -> list[jax.Array]:
    """int32 index arrays (or values), broadcast together and placed in host memory."""
    return [jax.device_put(x, jax.memory.Space.Host) for x in jnp.broadcast_arrays(*xs)]


def take_rows(stored: Lanes, layer, page, row, *, host: bool) -> jax.Array:
    """Device rows [..., sw]: row `row` of page `page` of layer `layer` of a Classical array
    (indices broadcast together; an absent page reads its layer's first page: mask it). With
    `host`, `stored` lives in host memory: the rows are gathered there and only they come to
    the device."""
    page = jnp.clip(page, 0, None)
    if not host:
        return stored.take((layer, page), row)
    layer, page, at = _located(stored, layer, page, row)
    rows = compute_on("device_host")(lambda x, i, p, a: x.take((i, p), None, a))(
        stored, layer, page, at)
    return jax.device_put(rows, jax.memory.Space.Device)


def _located(stored: Lanes, layer, page, row):
    """(layer, page, `Lanes.locate` of row), broadcast together and placed in host memory:
    the index arithmetic runs on the device, the gather or scatter in host memory."""
    layer, page, row = jnp.broadcast_arrays(*(jnp.asarray(x, jnp.int32)
                                              for x in (layer, page, row)))
    at = stored.locate(row)
    return jax.device_put((layer, page, at), jax.memory.Space.Host)


def put_rows(stored: Lanes, layer, page, row, values: jax.Array, *, host: bool) -> Lanes:
    """`stored` with values [..., sw] written as row `row` of page `page` of layer `layer`
    (indices broadcast together; rows of an absent page (< 0) are dropped). With `host`,
    `stored` lives in host memory: the values go there and are written there, in place."""
    page = jnp.where(page >= 0, page, stored.lead[1])
    if not host:
        return stored.put((layer, page), row, values)
    layer, page, at = _located(stored, layer, page, row)
    values = jax.device_put(jnp.broadcast_to(values, (*layer.shape, values.shape[-1])),
                            jax.memory.Space.Host)
    return compute_on("device_host")(
        lambda x, v, i, p, a: x.put((i, p), None, v, a))(stored, values, layer, page, at)


def read_pages(cache: Cache, page_ids) -> dict[str, jax.Array]:
    """The Classical rows of whole pages, as stored: compressor name -> [n_kind_layers, k,
    P // m, sw] for page_ids i32[k] (rows of a -1 id are zeros). With `load_pages`, this
    moves full pages out of the pool and back (e.g. to disk and into another process).

    Called with concrete ids, an id outside [-1, num_pages) raises ValueError.
    """
    checks.alive("cache", cache)
    N = cache.geometry.num_pages
    if checks.concrete(page_ids):
        checks.int_array("page_ids", page_ids, ndim=1, lo=-1, hi=N - 1)
    ids = jnp.asarray(page_ids, jnp.int32).reshape(-1)
    present = (ids >= 0)[None, :, None, None]
    out = {}
    for spec in cache.specs:
        stored = entries(cache, spec)
        if on_host(cache.geometry, spec):
            index = _on_host(jnp.clip(ids, 0, None))[0]
            blocks = compute_on("device_host")(lambda x, i: x[:, i].records())(stored, index)
            rows = jax.device_put(blocks, jax.memory.Space.Device)
        else:
            rows = stored[:, jnp.clip(ids, 0, None)].records()
        out[spec.name] = jnp.where(present, rows, jnp.zeros((), rows.dtype))
    return out


def load_pages(cache: Cache, contents: dict, n_pages) -> tuple[Cache, jax.Array]:
    """Takes `n_pages` free pages for a holder outside the page tables (refcount 1 each: give
    them back with `drop_pages`) and writes the first n_pages pages of `contents` into them.

    Args:
      contents: compressor name -> [n_kind_layers, k, P // m, sw] of the cache's dtype, as
        `read_pages` returns them.
      n_pages: 0 <= n_pages <= min(k, free pages).

    Returns:
      (cache, page_ids i32[k]): the pages taken, -1 past n_pages. Called with concrete
      arguments, a broken rule raises ValueError (TypeError for a wrong type or dtype);
      inside a caller's jit a call that breaks one takes nothing (all ids -1).
    """
    checks.alive("cache", cache)
    want = jax.eval_shape(lambda c: read_pages(c, jnp.zeros((1,), jnp.int32)), cache)
    if not isinstance(contents, dict) or set(contents) != set(want):
        checks.fail("contents", f"a dict of the compressors {sorted(want)}",
                    sorted(contents) if isinstance(contents, dict) else type(contents).__name__,
                    TypeError)
    k = None
    for name, w in want.items():
        x = contents[name]
        if np.ndim(x) != 4:
            checks.fail(f"contents[{name!r}]", f"an array [n_layers, k, {w.shape[2]}, "
                        f"{w.shape[3]}]", f"shape {np.shape(x)}")
        k = x.shape[1] if k is None else k
        checks.shape(f"contents[{name!r}]", x, (w.shape[0], k, w.shape[2], w.shape[3]))
        if np.dtype(x.dtype) != np.dtype(w.dtype):
            checks.fail(f"contents[{name!r}]", f"dtype {np.dtype(w.dtype)} (the cache's)",
                        f"dtype {np.dtype(x.dtype)}", TypeError)
    k = k or 0
    if checks.concrete(n_pages, cache.pages.num_free):
        if isinstance(n_pages, (np.ndarray, jax.Array)):
            checks.shape("n_pages", n_pages, ())
            checks.dtype_kind("n_pages", n_pages, "integer")
            n_pages = int(n_pages)
        checks.integer("n_pages", n_pages, lo=0, hi=min(k, int(cache.pages.num_free)))
    pages, ids = paging.take(cache.pages, n_pages, k)
    cache = cache.replace(pages=pages)
    dest = jnp.where(ids >= 0, ids, cache.geometry.num_pages)
    for spec in cache.specs:
        stored = entries(cache, spec)
        blocks = stored.map.pack(jnp.asarray(contents[spec.name]))
        if on_host(cache.geometry, spec):
            blocks, index = jax.device_put((blocks, dest), jax.memory.Space.Host)
            stored = compute_on("device_host")(
                lambda x, b, i: x.put_blocks((slice(None), i), b))(stored, blocks, index)
        else:
            stored = stored.put_blocks((slice(None), dest), blocks)
        cache = with_entries(cache, spec, stored)
    return cache, ids


@struct.dataclass
class StateSnapshot:
    """One request's State, out of its slot (as stored): enough to resume it in a slot that
    holds the same pages (`restore_state`).

    Attributes:
      window: the window ring as stored, `Lanes` of blocks [n_layers] (position p at row
        p % W).
      tails: compressor name -> `Tail` of blocks [n_kind_layers] (ring rows of in_width), or
        `OnlineTail` of blocks [n_hca] (hca_tail="online").
      length: i32[], tokens appended.
    """

    window: Lanes
    tails: dict
    length: jax.Array


def snapshot_state(cache: Cache, slot) -> StateSnapshot:
    """The State of `slot` (window ring, every compressor's tails, length), bit for bit.

    A concrete slot outside [0, max_slots) or FREE raises ValueError; inside a caller's jit
    an id outside [0, max_slots) gives zeros and length 0.
    """
    checks.alive("cache", cache)
    S = cache.geometry.max_slots
    if checks.concrete(slot, cache.state.status):
        s = checks.slot(slot, S)
        if int(cache.state.status[s]) == SlotStatus.FREE:
            checks.fail("slot", "a slot holding a request (not FREE)", f"slot {s} FREE")
    slot = jnp.asarray(slot, jnp.int32)
    inside = (slot >= 0) & (slot < S)
    read = jnp.clip(slot, 0, S - 1)

    def take(x):
        return jnp.where(inside, x[:, read], jnp.zeros((), x.dtype))

    return StateSnapshot(
        window=jax.tree.map(take, window_ring(cache)),
        tails={spec.name: jax.tree.map(take, tail(cache, spec)) for spec in cache.specs},
        length=jnp.where(inside, cache.state.lengths[read], 0),
    )


def restore_state(cache: Cache, slot, snapshot: StateSnapshot) -> Cache:
    """Puts a `snapshot_state` back into `slot`: window ring and tails bit for bit, length
    from the snapshot (status and pages unchanged).

    The slot must hold a request (not FREE) and exactly the pages the snapshot's length
    needs (ceil(length / page_tokens)): e.g. the same request's slot, or one that took the
    request's full pages with `attach_prefix` when the snapshot was taken at a page boundary.
    Called with concrete arguments, a broken rule or a snapshot of another geometry raises
    ValueError (TypeError for a wrong type or dtype); inside a caller's jit a call that
    breaks a rule on values changes nothing.
    """
    checks.alive("cache", cache)
    geo = cache.geometry
    S, P = geo.max_slots, geo.page_tokens
    if not isinstance(snapshot, StateSnapshot):
        checks.fail("snapshot", "a pools.StateSnapshot", type(snapshot).__name__, TypeError)
    # What a snapshot of this cache looks like (shapes and dtypes only; nothing is computed).
    want = jax.eval_shape(lambda c: snapshot_state(c, 0), cache)
    if set(snapshot.tails) != set(want.tails):
        checks.fail("snapshot.tails", f"the compressors {sorted(want.tails)}",
                    sorted(snapshot.tails))
    stored = [("snapshot.window", snapshot.window, want.window)]
    for k in want.tails:
        for field in dataclasses.fields(want.tails[k]):
            stored.append((f"snapshot.tails.{k}.{field.name}",
                           getattr(snapshot.tails[k], field.name, None),
                           getattr(want.tails[k], field.name)))
    for name, got, w in stored:
        if not isinstance(got, Lanes):
            checks.fail(name, "a pools.Lanes (as snapshot_state gives it)", type(got).__name__,
                        TypeError)
        if got.map != w.map:
            checks.fail(name, f"rows laid out as this cache lays them out ({w.map})",
                        f"{got.map} (a snapshot of another geometry or model)")
    for path, w in jax.tree_util.tree_leaves_with_path(want):
        name = "snapshot" + "".join(
            f"[{k.idx}]" if hasattr(k, "idx") else
            f".{getattr(k, 'name', getattr(k, 'key', k))}" for k in path)
        x = _at_path(snapshot, path)
        checks.shape(name, x, w.shape)
        if np.dtype(x.dtype) != np.dtype(w.dtype) and name != "snapshot.length":
            checks.fail(name, f"dtype {np.dtype(w.dtype)} (the cache's)",
                        f"dtype {np.dtype(x.dtype)}", TypeError)
    checks.shape("snapshot.length", snapshot.length, ())
    checks.dtype_kind("snapshot.length", snapshot.length, "integer")
    if checks.concrete(slot, snapshot.length, cache.state.status, cache.pages.page_table):
        s = checks.slot(slot, S)
        st = SlotStatus(int(cache.state.status[s]))
        if st == SlotStatus.FREE:
            checks.fail("slot", "a slot holding a request (not FREE: reset_slot it first)",
                        f"slot {s} FREE")
        held = int(np.sum(np.asarray(cache.pages.page_table[s]) >= 0))
        length = int(snapshot.length)
        if length < 0 or -(-length // P) != held:
            lo, hi = max(0, (held - 1) * P + 1) if held else 0, held * P
            checks.fail("snapshot.length", f"a length the slot's {held} page(s) hold "
                        f"(in [{lo}, {hi}])", f"{length} for slot {s}")
    slot = jnp.asarray(slot, jnp.int32)
    read = jnp.clip(slot, 0, S - 1)
    length = jnp.asarray(snapshot.length, jnp.int32)
    held = paging.held_pages(cache.pages.page_table[read][None])[0]
    ok = ((slot >= 0) & (slot < S) & (cache.state.status[read] != SlotStatus.FREE)
          & (length >= 0) & (paging.pages_for(length, P) == held))
    dest = jnp.where(ok, slot, S)

    def put(stored, value):
        return stored.at[:, dest].set(value, mode="drop")

    cache = with_window_ring(cache, jax.tree.map(put, window_ring(cache), snapshot.window))
    for spec in cache.specs:
        cache = with_tail(cache, spec, jax.tree.map(put, tail(cache, spec),
                                                    snapshot.tails[spec.name]))
    if hot_set(cache) is not None:  # the slot's hot rows start empty (`v4kv_jax.ops.hot`)
        cache = with_hot_set(cache, jax.tree.map(
            lambda x: put(x, jnp.zeros((), x.dtype)), hot_set(cache)))
    return with_slots(cache, lengths=cache.state.lengths.at[dest].set(length, mode="drop"))


def _at_path(tree, path):
    """The leaf of `tree` at a `jax.tree_util` key path."""
    for k in path:
        if hasattr(k, "idx"):
            tree = tree[k.idx]
        else:
            tree = tree[k.key] if hasattr(k, "key") else getattr(tree, k.name)
    return tree


__all__ = ["StateSnapshot", "attach_prefix", "drop_pages", "hold_pages", "load_pages",
           "put_rows", "read_pages", "restore_state", "snapshot_state", "take_rows"]
