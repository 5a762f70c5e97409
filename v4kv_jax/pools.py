"""The two pools as one pytree, `Cache`.

Classical pool (complete, immutable entries; paged; shared by all requests):
  c4          [n_csa, num_pages, P // m,  sw(head_dim)]         CSA entries
  index_keys  [n_csa, num_pages, P // m,  sw(index_head_dim)]   CSA indexer keys
  c128        [n_hca, num_pages, P // m', sw(head_dim)]         HCA entries
  pages       page tables, free stack, refcounts (see `paging`)

State pool (per request slot; changes every step):
  lengths     i32[max_slots]   tokens appended so far
  status      i32[max_slots]   `SlotStatus`
  window      [n_layers, max_slots, W, sw(head_dim)]   ring: position p sits at row p % W
  csa, csa_index               compressor tails, `Tail` of [n, max_slots, ring, in_width]
  hca                          `Tail` as above (hca_tail="ring"), or `OnlineTail` of
                               [n_hca, max_slots, head_dim] (hca_tail="online")

Row formats: sw(width) is the stored width of a row (`storage.stored_width`): the width
itself in a float format (float32 / bfloat16 / float16 arrays), 146 uint32 words for an
fp8_latent row of 512 values with 64 RoPE dims, 17 for an fp4_index key of 128 values. C4
and C128 entries are in `CacheConfig.entry_dtype`, indexer keys in `index_dtype`, the window
in `window_dtype` (one `storage.RowCodec` each: `storage.codec`), tails in `tail_dtype`.
Rows are stored exactly as `RowCodec.encode` returns them; every reader decodes with
`RowCodec.decode`.

The online HCA tail (`OnlineTail`, hca_tail="online")
------------------------------------------------------
Per HCA layer and slot, three fp32 vectors of head_dim (stored in `tail_dtype`) describe the
open C128 block, positions i m' .. L - 1 of a slot of length L (i = L // m'), as an online
softmax over its tokens, channel by channel (z_t = gate_t + ape[t mod m'], a_t = kv_t):

  max       M     = max over the block's tokens so far of z_t
  sum       S     = sum of exp(z_t - M)
  weighted  U     = sum of exp(z_t - M) * a_t

Tokens are folded in position order, one at a time; the token at position t with block
offset o = t mod m' does, in fp32:

  o == 0 (a block starts; the previous block is forgotten):
      M <- z_t;  S <- 1;  U <- a_t
  o > 0:
      M' = max(M, z_t);  c = exp(M - M');  e = exp(z_t - M')
      S <- (S * c) + e;  U <- (U * c) + (e * a_t);  M <- M'

Each product is rounded to fp32 before the sum (no FMA contraction; the reference forces it,
see `compressor.online_fold`), so decode and prefill give the same bits. The compressor
kernels (`pallas_kernels.compressor`, `emit_entries_online`) use the same expressions and
rounding, so in interpret mode their tails are the reference's bit for bit (tested);
compiled, a backend's exp may differ from XLA's by an ulp, and a kernel that contracted
would differ by about an ulp per token, well within the 1e-6 of the entries.
The token at o == m' - 1 completes the block: its entry is RoPE_{i m'}(RMSNorm_w(U / S)),
the softmax pooling of the block (within 1e-6 of the raw ring's, fp32). Every chunking of
the tokens (decode, prefill, any chunk boundaries) runs the same fold per block in the same
order, so tails and entries do not depend on it. The tail is meaningful iff L mod m' != 0;
with L mod m' == 0 (an empty open block, e.g. a fresh slot or a page boundary) it holds
stale values that the next token, at o == 0, replaces without reading. 3 x 512 x 4 B = 6 KiB
per HCA layer instead of the ring's m' x 2 x 512 x 4 B (512 KiB for m' = 128).

The model and cache configs are static fields, so a jitted function taking a `Cache`
compiles once per geometry and never per length.
"""

from __future__ import annotations

import dataclasses
import enum

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from v4kv_jax import checks, paging, storage
from v4kv_jax.config import AttentionConfig, CacheConfig, LayerKind
from v4kv_jax.layout import CompressorSpec, compressor_specs


class SlotStatus(enum.IntEnum):
    """What a slot is doing. A flagged slot (OUT_OF_PAGES, OVER_CAPACITY, REJECTED) keeps its
    data, appends nothing until `clear_flags`, and its flag stays until then.

    Ordered so that a flag outranks ACTIVE (`max` of two statuses keeps the flag).
    """

    FREE = 0
    ACTIVE = 1
    OUT_OF_PAGES = 2  # an append needed pages the free stack did not have; nothing was written
    OVER_CAPACITY = 3  # an append would pass max_pages_per_seq * page_tokens; nothing written
    REJECTED = 4  # a call broke a rule for this slot (named twice, n_new outside [0, T], a
    #              token id outside the vocabulary); that row wrote nothing


_ENTRY_FIELD = {"csa": "c4", "csa_index": "index_keys", "hca": "c128"}


@struct.dataclass
class ClassicalPool:
    c4: jax.Array
    index_keys: jax.Array
    c128: jax.Array


@struct.dataclass
class Tail:
    """A compressor's raw tail ring: kv and gate [n_kind, max_slots, ring, in_width]
    (position p at row p % ring; gate with the position bias added)."""

    kv: jax.Array
    gate: jax.Array


@struct.dataclass
class OnlineTail:
    """The HCA compressor's open block as an online softmax (module docstring):
    max, sum, weighted [n_hca, max_slots, head_dim], in `tail_dtype`."""

    max: jax.Array
    sum: jax.Array
    weighted: jax.Array


@struct.dataclass
class StatePool:
    lengths: jax.Array
    status: jax.Array
    window: jax.Array
    csa: Tail
    csa_index: Tail
    hca: Tail


@struct.dataclass
class Cache:
    classical: ClassicalPool
    pages: paging.PageState
    state: StatePool
    attn_config: AttentionConfig = struct.field(pytree_node=False)
    geometry: CacheConfig = struct.field(pytree_node=False)

    @property
    def specs(self) -> tuple[CompressorSpec, ...]:
        return compressor_specs(self.attn_config)


# --- accessors: the only code that reaches pool storage by field name ----------------------


def entries(cache: Cache, name: str) -> jax.Array:
    """The Classical array of compressor `name` ("csa" C4 entries, "csa_index" indexer keys,
    "hca" C128 entries): [n_kind_layers, num_pages, P // m, width], as stored."""
    return getattr(cache.classical, _ENTRY_FIELD[name])


def with_entries(cache: Cache, name: str, value: jax.Array) -> Cache:
    return cache.replace(classical=cache.classical.replace(**{_ENTRY_FIELD[name]: value}))


def window_ring(cache: Cache) -> jax.Array:
    """The window rings [n_layers, max_slots, W, hd], as stored (position p at row p % W)."""
    return cache.state.window


def with_window_ring(cache: Cache, value: jax.Array) -> Cache:
    return cache.replace(state=cache.state.replace(window=value))


def tail(cache: Cache, name: str) -> Tail | OnlineTail:
    """The tails of compressor `name`, as stored: a `Tail` ring, kv and gate
    [n_kind_layers, max_slots, ring, in_width] (position p at row p % ring; gate with the
    position bias added), or for "hca" with hca_tail="online" an `OnlineTail`."""
    return getattr(cache.state, name)


def with_tail(cache: Cache, name: str, value: Tail | OnlineTail) -> Cache:
    return cache.replace(state=cache.state.replace(**{name: value}))


def online_tail(geometry: CacheConfig, name: str) -> bool:
    """Whether compressor `name` keeps an `OnlineTail` (the HCA compressor with
    hca_tail="online") rather than a raw `Tail` ring."""
    return name == "hca" and geometry.hca_tail == "online"


def codec(cache: Cache, name: str) -> storage.RowCodec:
    """The row format of a stored array: "csa", "csa_index", "hca" entries or "window"."""
    return storage.codec(cache.attn_config, cache.geometry, name)


def lengths(cache: Cache) -> jax.Array:
    """i32[max_slots]: tokens appended per slot."""
    return cache.state.lengths


def status(cache: Cache) -> jax.Array:
    """i32[max_slots]: `SlotStatus` per slot."""
    return cache.state.status


def with_slots(cache: Cache, *, lengths=None, status=None) -> Cache:
    """The cache with new per-slot lengths and / or statuses."""
    fields = {k: v for k, v in (("lengths", lengths), ("status", status)) if v is not None}
    return cache.replace(state=cache.state.replace(**fields))


def init_cache(model: AttentionConfig, geometry: CacheConfig) -> Cache:
    """An empty cache: every slot free, every page free, all storage zero."""
    geometry.check_against(model)
    P, S = geometry.page_tokens, geometry.max_slots
    stored, tails = {}, {}
    for spec in compressor_specs(model):
        n = len(model.layers_of(spec.kind))
        rows = storage.codec(model, geometry, spec.name)
        stored[_ENTRY_FIELD[spec.name]] = jnp.zeros(
            (n, geometry.num_pages, P // spec.ratio, rows.stored_width), rows.dtype)
        tail_dt = storage.tail_codec(geometry, spec.in_width).dtype
        if online_tail(geometry, spec.name):
            tails[spec.name] = OnlineTail(*(jnp.zeros((n, S, spec.width), tail_dt)
                                            for _ in range(3)))
        else:
            tails[spec.name] = Tail(
                kv=jnp.zeros((n, S, spec.ring, spec.in_width), tail_dt),
                gate=jnp.zeros((n, S, spec.ring, spec.in_width), tail_dt),
            )
    window = storage.codec(model, geometry, "window")
    return Cache(
        classical=ClassicalPool(**stored),
        pages=paging.PageState.create(geometry.num_pages, S, geometry.max_pages_per_seq),
        state=StatePool(
            lengths=jnp.zeros((S,), jnp.int32),
            status=jnp.full((S,), SlotStatus.FREE, jnp.int32),
            window=jnp.zeros((model.num_layers, S, model.window, window.stored_width),
                             window.dtype),
            **tails,
        ),
        attn_config=model,
        geometry=geometry,
    )


def _slot_mask(cache: Cache, slot) -> jax.Array:
    """bool[max_slots]: the one slot `slot` (all False for an id outside [0, max_slots))."""
    return jnp.arange(cache.geometry.max_slots) == jnp.asarray(slot, jnp.int32)


def _check_slot(cache: Cache, slot, *, free: bool | None = None) -> None:
    """Host-side checks of a concrete slot id (and that it is FREE / not FREE)."""
    if not checks.concrete(slot, cache.state.status):
        return
    s = checks.slot(slot, cache.geometry.max_slots)
    status = SlotStatus(int(cache.state.status[s]))
    if free is True and status != SlotStatus.FREE:
        held = int(np.sum(np.asarray(cache.pages.page_table[s]) >= 0))
        checks.fail("slot", "a FREE slot (release_slot it first)",
                    f"slot {s} {status.name} with length {int(cache.state.lengths[s])} "
                    f"and {held} page(s)")


def reset_slot(cache: Cache, slot) -> Cache:
    """Starts a new, empty sequence in a FREE `slot`: length 0, ACTIVE, window and tails
    zeroed.

    Called with a concrete slot, a slot outside [0, max_slots) or one that is not FREE raises
    ValueError. Inside a caller's jit nothing is checked: an out-of-range id changes nothing,
    and a slot that still holds pages first gives them back (as `release_slot`), so none is
    lost.
    """
    _check_slot(cache, slot, free=True)
    mask = _slot_mask(cache, slot)
    cache = cache.replace(pages=paging.release(cache.pages, mask))
    state = cache.state

    def clear(x):
        return jnp.where(mask.reshape(1, -1, *([1] * (x.ndim - 2))), jnp.zeros((), x.dtype), x)

    state = state.replace(
        lengths=jnp.where(mask, 0, state.lengths),
        status=jnp.where(mask, SlotStatus.ACTIVE, state.status),
        window=clear(state.window),
        **{s.name: jax.tree.map(clear, tail(cache, s.name)) for s in cache.specs},
    )
    return cache.replace(state=state)


def release_slot(cache: Cache, slot) -> Cache:
    """Ends the sequence in `slot`: its pages lose one reference each, the slot becomes FREE.

    Releasing a FREE slot changes nothing. A concrete slot outside [0, max_slots) raises
    ValueError; inside a caller's jit it changes nothing.
    """
    _check_slot(cache, slot)
    mask = _slot_mask(cache, slot)
    state = cache.state.replace(
        lengths=jnp.where(mask, 0, cache.state.lengths),
        status=jnp.where(mask, SlotStatus.FREE, cache.state.status),
    )
    return cache.replace(pages=paging.release(cache.pages, mask), state=state)


def clear_flags(cache: Cache, slots) -> Cache:
    """Makes flagged slots ACTIVE again, so that they append (their data never changed).

    OUT_OF_PAGES: free pages first (release other slots) or the next append flags it again.
    OVER_CAPACITY: the slot is at its maximum length; release it instead. REJECTED: fix the
    call that broke a rule. ACTIVE and FREE slots are left as they are.

    Args:
      slots: i32[n] slot ids (concrete ids outside [0, max_slots) raise ValueError; inside a
        caller's jit they change nothing).
    """
    S = cache.geometry.max_slots
    if checks.concrete(slots):
        checks.slot_ids(np.atleast_1d(np.asarray(slots)), S, name="slots")
    ids = jnp.atleast_1d(jnp.asarray(slots, jnp.int32))
    mask = jnp.zeros((S,), bool).at[jnp.where(ids >= 0, ids, S)].set(True, mode="drop")
    status = cache.state.status
    flagged = mask & (status != SlotStatus.FREE)
    return cache.replace(state=cache.state.replace(
        status=jnp.where(flagged, SlotStatus.ACTIVE, status)))


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
    _check_held_ids(cache, page_ids)
    pages, _ = paging.hold(cache.pages, jnp.asarray(page_ids, jnp.int32))
    return cache.replace(pages=pages)


def drop_pages(cache: Cache, page_ids) -> Cache:
    """Gives back one reference to each page of `page_ids` (-1 entries ignored) taken with
    `hold_pages` or `load_pages`; a page no one holds any more goes back on the free stack.
    Checks as `hold_pages`. Dropping a reference the caller does not hold takes another
    holder's: the caller keeps its own count.
    """
    _check_held_ids(cache, page_ids)
    pages, _ = paging.drop(cache.pages, jnp.asarray(page_ids, jnp.int32))
    return cache.replace(pages=pages)


def read_pages(cache: Cache, page_ids) -> dict[str, jax.Array]:
    """The Classical rows of whole pages, as stored: compressor name -> [n_kind_layers, k,
    P // m, width] for page_ids i32[k] (rows of a -1 id are zeros). With `load_pages`, this
    moves full pages out of the pool and back (e.g. to disk and into another process).

    Called with concrete ids, an id outside [-1, num_pages) raises ValueError.
    """
    N = cache.geometry.num_pages
    if checks.concrete(page_ids):
        checks.int_array("page_ids", page_ids, ndim=1, lo=-1, hi=N - 1)
    ids = jnp.asarray(page_ids, jnp.int32).reshape(-1)
    present = (ids >= 0)[None, :, None, None]
    return {spec.name: jnp.where(present, entries(cache, spec.name)[:, jnp.clip(ids, 0, N - 1)],
                                 jnp.zeros((), entries(cache, spec.name).dtype))
            for spec in cache.specs}


def load_pages(cache: Cache, contents: dict, n_pages) -> tuple[Cache, jax.Array]:
    """Takes `n_pages` free pages for a holder outside the page tables (refcount 1 each: give
    them back with `drop_pages`) and writes the first n_pages pages of `contents` into them.

    Args:
      contents: compressor name -> [n_kind_layers, k, P // m, width] of the cache's dtype, as
        `read_pages` returns them.
      n_pages: 0 <= n_pages <= min(k, free pages).

    Returns:
      (cache, page_ids i32[k]): the pages taken, -1 past n_pages. Called with concrete
      arguments, a broken rule raises ValueError (TypeError for a wrong type or dtype);
      inside a caller's jit a call that breaks one takes nothing (all ids -1).
    """
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
        stored = entries(cache, spec.name)
        cache = with_entries(cache, spec.name, stored.at[:, dest].set(
            jnp.asarray(contents[spec.name]), mode="drop"))
    return cache, ids


@struct.dataclass
class StateSnapshot:
    """One request's State, out of its slot (as stored): enough to resume it in a slot that
    holds the same pages (`restore_state`).

    Attributes:
      window: [n_layers, W, sw(hd)], the window ring as stored (position p at row p % W).
      tails: compressor name -> `Tail` of [n_kind_layers, ring, in_width], or `OnlineTail`
        of [n_hca, head_dim] (hca_tail="online").
      length: i32[], tokens appended.
    """

    window: jax.Array
    tails: dict
    length: jax.Array


def snapshot_state(cache: Cache, slot) -> StateSnapshot:
    """The State of `slot` (window ring, every compressor's tails, length), bit for bit.

    A concrete slot outside [0, max_slots) or FREE raises ValueError; inside a caller's jit
    an id outside [0, max_slots) gives zeros and length 0.
    """
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
        window=take(window_ring(cache)),
        tails={spec.name: jax.tree.map(take, tail(cache, spec.name)) for spec in cache.specs},
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
    geo = cache.geometry
    S, P = geo.max_slots, geo.page_tokens
    if not isinstance(snapshot, StateSnapshot):
        checks.fail("snapshot", "a pools.StateSnapshot", type(snapshot).__name__, TypeError)
    # What a snapshot of this cache looks like (shapes and dtypes only; nothing is computed).
    want = jax.eval_shape(lambda c: snapshot_state(c, 0), cache)
    if set(snapshot.tails) != set(want.tails):
        checks.fail("snapshot.tails", f"the compressors {sorted(want.tails)}",
                    sorted(snapshot.tails))
    for path, w in jax.tree_util.tree_leaves_with_path(want):
        name = "snapshot" + "".join(
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

    cache = with_window_ring(cache, put(window_ring(cache), snapshot.window))
    for spec in cache.specs:
        cache = with_tail(cache, spec.name, jax.tree.map(put, tail(cache, spec.name),
                                                          snapshot.tails[spec.name]))
    return with_slots(cache, lengths=cache.state.lengths.at[dest].set(length, mode="drop"))


def _at_path(tree, path):
    """The leaf of `tree` at a `jax.tree_util` key path."""
    for k in path:
        tree = tree[k.key] if hasattr(k, "key") else getattr(tree, k.name)
    return tree


# --- inspection and memory report (host side) ------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SlotReport:
    slot: int
    status: str
    length: int
    c4_entries: int  # per CSA layer (also the number of indexer keys)
    c128_entries: int  # per HCA layer
    csa_tail: int  # tokens of the open C4 block
    hca_tail: int  # tokens of the open C128 block
    window: tuple[int, int] | None  # first and last position held for the next query
    pages: tuple[int, ...]


def is_deleted(cache: Cache) -> bool:
    """True when an array of the cache was deleted: donated to a jitted program that failed
    after taking it over, so the cache is gone (host code that donates checks this)."""
    return any(x.is_deleted() for x in jax.tree.leaves(cache))


def inspect_slots(cache: Cache) -> list[SlotReport]:
    """What each non-free slot holds, derived from its length and page-table row."""
    model = cache.attn_config
    lengths = np.asarray(cache.state.lengths)
    status = np.asarray(cache.state.status)
    table = np.asarray(cache.pages.page_table)
    reports = []
    for slot in range(lengths.shape[0]):
        if status[slot] == SlotStatus.FREE:
            continue
        n = int(lengths[slot])
        reports.append(SlotReport(
            slot=slot,
            status=SlotStatus(int(status[slot])).name,
            length=n,
            c4_entries=n // model.csa_ratio if model.num_csa else 0,
            c128_entries=n // model.hca_ratio if model.num_hca else 0,
            csa_tail=n % model.csa_ratio,
            hca_tail=n % model.hca_ratio,
            window=(max(0, n - model.window), n - 1) if n else None,
            pages=tuple(int(p) for p in table[slot] if p >= 0),
        ))
    return reports


@dataclasses.dataclass(frozen=True)
class SlotContents:
    """One request's data in logical order (host numpy arrays, decoded to fp32 from whatever
    format they are stored in), independent of which pages and ring rows hold it.

    Attributes:
      length: tokens appended.
      window: [n_layers, min(length, W), hd], the window rows of positions
        length - min(length, W) .. length - 1, oldest first.
      entries: compressor name -> [n_kind_layers, length // m, width], entry i of every layer
        of that kind ("csa": C4 entries, "csa_index": indexer keys, "hca": C128 entries).
        fp4_index keys are given unrotated (the stored rotation undone).
      tail_kv, tail_gate: ring compressor name -> [n_kind_layers, rows, in_width], the tail
        rows still needed, oldest first (gate with the position bias added): the open block,
        and with overlap (CSA) the complete block before it.
      online: online compressor name ("hca" with hca_tail="online") -> {"max", "sum",
        "weighted"} of [n_kind_layers, rows, width]: rows is 1 while the open block holds
        tokens, 0 when it is empty (`OnlineTail`).
      tail_start: compressor name -> the position of the first tail token.
    """

    length: int
    window: np.ndarray
    entries: dict[str, np.ndarray]
    tail_kv: dict[str, np.ndarray]
    tail_gate: dict[str, np.ndarray]
    tail_start: dict[str, int]
    online: dict[str, dict[str, np.ndarray]] = dataclasses.field(default_factory=dict)


def read_slot(cache: Cache, slot: int) -> SlotContents:
    """What one slot holds, by entry index and position (for inspection and tests)."""
    S = cache.geometry.max_slots
    slot = checks.slot(slot, S)
    n = int(cache.state.lengths[slot])
    W = cache.attn_config.window
    positions = np.arange(max(0, n - W), n)
    window = np.asarray(codec(cache, "window").decode(window_ring(cache)[:, slot]))
    window = window[:, positions % W]
    table = np.asarray(cache.pages.page_table[slot])
    by_kind, tail_kv, tail_gate, tail_start, online = {}, {}, {}, {}, {}
    for spec in cache.specs:
        epp = cache.geometry.entries_per_page(spec.ratio)
        idx = np.arange(n // spec.ratio)
        pool = entries(cache, spec.name)
        rows = pool[:, jnp.asarray(table[idx // epp]), jnp.asarray(idx % epp)]
        by_kind[spec.name] = np.asarray(codec(cache, spec.name).decode_unrotated(rows))
        ring = tail(cache, spec.name)
        if online_tail(cache.geometry, spec.name):
            first = n // spec.ratio * spec.ratio
            held = slice(0, 1 if first < n else 0)
            online[spec.name] = {
                field: np.asarray(storage.decode(getattr(ring, field)[:, slot]))[:, None][:, held]
                for field in ("max", "sum", "weighted")}
        else:
            first = max(0, (n // spec.ratio - (1 if spec.overlap else 0)) * spec.ratio)
            rows = np.arange(first, n) % spec.ring
            tail_kv[spec.name] = np.asarray(storage.decode(ring.kv[:, slot]))[:, rows]
            tail_gate[spec.name] = np.asarray(storage.decode(ring.gate[:, slot]))[:, rows]
        tail_start[spec.name] = first
    return SlotContents(n, window, by_kind, tail_kv, tail_gate, tail_start, online)


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Bytes of the cache, separated the way the two pools differ.

    Attributes:
      classical_bytes_per_token: amortised Classical bytes one token costs, per layer kind
        (summed over the layers of that kind) and "total".
      state_bytes_per_request: fixed State bytes of one slot (window ring + tails + counters).
      page_bytes: Classical bytes of one page (all layers, all entry kinds).
      pages_total, pages_used, pages_free, pages_shared: page counts (shared = refcount > 1).
      allocated_bytes: pages_used * page_bytes.
      entry_bytes: bytes of the complete entries present in the used pages, each page
        counted once however many requests share it.
      state_bytes_total: State pool bytes for all slots.
    """

    classical_bytes_per_token: dict[str, float]
    state_bytes_per_request: int
    page_bytes: int
    pages_total: int
    pages_used: int
    pages_free: int
    pages_shared: int
    allocated_bytes: int
    entry_bytes: int
    state_bytes_total: int

    @property
    def allocation_overhead(self) -> float:
        """Allocated / needed bytes (1.0 = no waste; partial last pages make it larger)."""
        return self.allocated_bytes / self.entry_bytes if self.entry_bytes else float("nan")

    def format(self) -> str:
        per_tok = ", ".join(f"{k} {v:.1f} B" for k, v in self.classical_bytes_per_token.items())
        return "\n".join([
            f"Classical bytes/token: {per_tok}",
            f"State bytes/request:   {self.state_bytes_per_request:,} B",
            f"Pages: {self.pages_used} used, {self.pages_free} free, {self.pages_shared} shared "
            f"of {self.pages_total} ({self.page_bytes:,} B each)",
            f"Classical allocated:   {self.allocated_bytes:,} B for {self.entry_bytes:,} B of "
            + (f"entries (x{self.allocation_overhead:.3f})" if self.entry_bytes else "entries"),
            f"State pool total:      {self.state_bytes_total:,} B",
        ])


def _entry_rows(model: AttentionConfig, geometry: CacheConfig):
    """(spec, layers of its kind, stored bytes of one entry) per compressor with layers."""
    for spec in compressor_specs(model):
        n = len(model.layers_of(spec.kind))
        if n:
            yield spec, n, storage.codec(model, geometry, spec.name).row_bytes


def classical_bytes_per_token(model: AttentionConfig, geometry: CacheConfig
                              ) -> dict[str, float]:
    """Amortised Classical bytes per token in the geometry's formats, per layer kind (summed
    over its layers) + total: sum of entry bytes / ratio (V4-Flash in the release formats:
    CSA 21 x (584 + 68) / 4 = 3423, HCA 20 x 584 / 128 = 91.25, total 3514.25)."""
    per_token: dict[str, float] = {}
    for spec, n, one in _entry_rows(model, geometry):
        per_token[spec.kind.name] = per_token.get(spec.kind.name, 0.0) + n * one / spec.ratio
    per_token["total"] = sum(per_token.values())
    return per_token


def page_bytes(model: AttentionConfig, geometry: CacheConfig) -> int:
    """Classical bytes of one page: every layer's entries of P tokens, in the stored formats."""
    return sum(n * one * geometry.entries_per_page(spec.ratio)
               for spec, n, one in _entry_rows(model, geometry))


def state_bytes_per_request(model: AttentionConfig, geometry: CacheConfig) -> int:
    """Fixed State bytes of one slot: window ring, compressor tails (rings, or online
    accumulators of 3 x head_dim per HCA layer), length and status."""
    window = storage.codec(model, geometry, "window")
    total = model.num_layers * model.window * window.row_bytes
    for spec in compressor_specs(model):
        n = len(model.layers_of(spec.kind))
        if online_tail(geometry, spec.name):
            total += 3 * n * storage.tail_codec(geometry, spec.width).row_bytes
        else:
            total += 2 * n * spec.ring * storage.tail_codec(geometry, spec.in_width).row_bytes
    return total + 8


def memory_report(cache: Cache) -> MemoryReport:
    model, geo = cache.attn_config, cache.geometry
    P = geo.page_tokens
    lengths = np.asarray(cache.state.lengths, dtype=np.int64)
    active = np.asarray(cache.state.status) != SlotStatus.FREE
    refcount = np.asarray(cache.pages.refcount)
    # Tokens each used page holds, each page once however many requests share it: a page in
    # no live page-table row is a full page held outside them (e.g. by a prefix index).
    held = np.where(refcount > 0, P, 0).astype(np.int64)
    in_rows = np.zeros(geo.num_pages, np.int64)
    table = np.asarray(cache.pages.page_table)
    for s in np.nonzero(active)[0]:
        for j, page in enumerate(table[s]):
            if page >= 0:
                in_rows[page] = max(in_rows[page], min(max(lengths[s] - j * P, 0), P))
    listed = np.zeros(geo.num_pages, bool)
    listed[table[active][table[active] >= 0]] = True
    tokens = np.where(listed, in_rows, held)
    entry_bytes = sum(int(n * one * np.sum(tokens // spec.ratio))
                      for spec, n, one in _entry_rows(model, geo))
    one_page = page_bytes(model, geo)
    used = int(np.sum(refcount > 0))
    return MemoryReport(
        classical_bytes_per_token=classical_bytes_per_token(model, geo),
        state_bytes_per_request=state_bytes_per_request(model, geo),
        page_bytes=one_page,
        pages_total=geo.num_pages,
        pages_used=used,
        pages_free=int(cache.pages.num_free),
        pages_shared=int(np.sum(refcount > 1)),
        allocated_bytes=used * one_page,
        entry_bytes=entry_bytes,
        state_bytes_total=int(sum(x.nbytes for x in jax.tree.leaves(cache.state))),
    )


def dense_cache_bytes_per_token(model: AttentionConfig, dtype: str = "float32") -> int:
    """Bytes per token of an uncompressed cache of the same layers (one K=V vector per layer)
    with rows in format `dtype` (a float format or "fp8_latent")."""
    rope = model.rope_dim if dtype == "fp8_latent" else 0
    return model.num_layers * storage.row_bytes(model.head_dim, dtype, rope)


__all__ = [
    "Cache", "ClassicalPool", "LayerKind", "MemoryReport", "OnlineTail", "SlotContents",
    "SlotReport", "SlotStatus", "StatePool", "StateSnapshot", "Tail", "attach_prefix",
    "classical_bytes_per_token", "clear_flags", "codec", "dense_cache_bytes_per_token",
    "drop_pages", "hold_pages", "init_cache", "inspect_slots", "is_deleted", "load_pages",
    "memory_report",
    "online_tail", "page_bytes", "read_pages", "read_slot", "release_slot", "reset_slot",
    "restore_state", "snapshot_state",
    "state_bytes_per_request",
]
