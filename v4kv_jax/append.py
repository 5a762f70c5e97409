"""The write side: who appends what, and the writes into the two pools.

  begin_append   check the rows, take the pages the new tokens need (all or nothing per
                 slot), flag slots that cannot append; returns an `AppendPlan`
  replay_plan    a state-only plan: tokens already in a slot's pages (e.g. a shared prefix)
                 are appended again to rebuild the State only (window ring and tails); no
                 page, entry or length changes
  write_window   window ring writes (position p at row p % W)
  append_compressor
                 tail ring writes and the emission (`ops.emit_entries`) of every block the
                 chunk completes, into its page and row
  append_layers  both, for every layer
  end_append     advance the lengths

One mechanism serves decode (T = 1) and prefill (any T, any start length, any chunking).
What the configs fix (row codecs, compressor specs, RoPE tables, page geometry) is read from
the `layout.CacheLayout` the cache carries (`cache.layout`) and handed to the ops.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from v4kv_jax import checks, ops, pools
from v4kv_jax.config import Options
from v4kv_jax.ops import compressor as comp
from v4kv_jax.pools import Cache, SlotStatus, paging
from v4kv_jax.pools.layout import CompressorSpec
from v4kv_jax.vectors import CompressorInput, CompressorParams, CompressorWeights, TokenVectors


@struct.dataclass
class AppendPlan:
    """Who appends how much in one step.

    Attributes:
      slot_ids: i32[B], the row's slot, or max_slots for a row that neither reads nor writes
        any slot (its slot id was outside [0, max_slots), or the row broke a rule).
      start: i32[B], the slot's length before the append (0 for such rows).
      n_new: i32[B], tokens granted (0 for a row that appends nothing).
      state_only: (static) a replay (`replay_plan`): the writes touch the window rings and
        the compressor tails only, never the Classical pool, and `end_append` leaves the
        lengths as they are; attention reads the entries already in the slot's pages.
    """

    slot_ids: jax.Array
    start: jax.Array
    n_new: jax.Array
    state_only: bool = struct.field(pytree_node=False, default=False)

    @property
    def end(self) -> jax.Array:
        return self.start + self.n_new

    def positions(self, tokens: int) -> jax.Array:
        """i32[B, T]: the absolute positions of the chunk's tokens (RoPE positions)."""
        return self.start[:, None] + jnp.arange(tokens, dtype=jnp.int32)[None, :]


def read_slots(cache: Cache, slot_ids: jax.Array) -> jax.Array:
    """Slot ids clipped into [0, max_slots) for reads of per-slot State rows; callers mask
    what a clipped row reads by its length (0 for rows that read nothing)."""
    return jnp.clip(slot_ids, 0, cache.geometry.max_slots - 1)


def check_rows(cache: Cache, slot_ids, n_new, tokens: int) -> None:
    """Concrete checks of one call's rows: distinct slots in range (or -1 for a padding row,
    which must append nothing), n_new in [0, tokens], and every slot that appends is ACTIVE."""
    checks.alive("cache", cache)
    S = cache.geometry.max_slots
    ids = checks.slot_ids(slot_ids, S, padding=True)
    n = checks.int_array("n_new", n_new, ndim=1)
    if n.shape != ids.shape:
        checks.fail("n_new", f"shape {ids.shape} (one count per slot id)", f"shape {n.shape}")
    if n.size and (n.min() < 0 or n.max() > tokens):
        checks.fail("n_new", f"counts in [0, {tokens}] (the chunk length)", n)
    status = np.asarray(pools.status(cache))
    for row, (slot, count) in enumerate(zip(ids.tolist(), n.tolist(), strict=True)):
        if slot < 0:
            if count:
                checks.fail("n_new", "0 for a padding row (slot id -1)",
                            f"{count} at row {row}")
            continue
        st = SlotStatus(int(status[slot]))
        if count > 0 and st != SlotStatus.ACTIVE:
            checks.fail("slot_ids", f"ACTIVE slots for rows that append ({REMEDIES[st]})",
                        f"slot {slot} {st.name}")


# What to do with a slot that is not ACTIVE, by its status: the remedy each message names.
REMEDIES = {
    SlotStatus.FREE: "reset_slot it first",
    SlotStatus.OUT_OF_PAGES: "it ran out of pages: free pages (v4.release_slot other slots, "
                             "pools.drop_pages held ones) or grow num_pages, then "
                             "pools.clear_flags it",
    SlotStatus.OVER_CAPACITY: "an append would have passed max_seq_len: end the sequence "
                              "with v4.release_slot (after pools.clear_flags it can append "
                              "only what still fits)",
    SlotStatus.REJECTED: "a call broke a rule for it: fix the call, then pools.clear_flags it",
}


def check_room(cache: Cache, slot_ids, n_new, *, name: str = "n_new") -> None:
    """Concrete check that every appending row fits, where the device would drop its tokens:
    a row that would pass `max_seq_len` (the device flags it OVER_CAPACITY) or whose new
    pages the free stack cannot give, rows served in batch order as `paging.allocate` does
    (OUT_OF_PAGES), raises ValueError naming `name` and the remedy. Rows must have passed
    `check_rows`."""
    geo = cache.geometry
    lengths = np.asarray(pools.lengths(cache))
    held = np.sum(np.asarray(pools.page_table(cache)) >= 0, axis=1)
    free = remaining = int(pools.free_pages(cache))
    short = []
    for row, (slot, count) in enumerate(zip(np.asarray(slot_ids).tolist(),
                                            np.asarray(n_new).tolist(), strict=True)):
        if slot < 0 or count <= 0:
            continue
        length = int(lengths[slot])
        if length + count > geo.max_seq_len:
            checks.fail(name, f"at most {geo.max_seq_len - length} new tokens for slot {slot} "
                        f"(length {length}, max_seq_len={geo.max_seq_len}; more would flag "
                        "it OVER_CAPACITY and drop them: append fewer, or end the sequence "
                        "with v4.release_slot)",
                        f"{count} at row {row}")
        need = max(0, -(-(length + count) // geo.page_tokens) - int(held[slot]))
        if need <= remaining:
            remaining -= need
        else:
            short.append(f"slot {slot} needs {need}")
    if short:
        checks.fail(name, f"appends whose new pages fit the {free} free page(s) (else the "
                    "device flags the slots OUT_OF_PAGES and drops their tokens: free pages "
                    "with v4.release_slot or pools.drop_pages, or grow num_pages)",
                    f"{list(np.asarray(n_new).tolist())}: {', '.join(short)} after the rows "
                    "before it")


def _repeated(slot_ids: jax.Array) -> jax.Array:
    """bool[B]: rows naming a slot an earlier row of the call already named."""
    row = jnp.arange(slot_ids.shape[0])
    return jnp.any((slot_ids[:, None] == slot_ids[None, :]) & (row[None, :] < row[:, None]),
                   axis=1)


def begin_append(cache: Cache, slot_ids, n_new, tokens: int, *, reject=None
                 ) -> tuple[Cache, AppendPlan]:
    """Takes the pages `n_new` more tokens need in each slot; flags slots that cannot append.

    Device-side rules (they hold inside a caller's jit, where nothing can raise):
      * a row whose slot id is outside [0, max_slots) (e.g. -1 for batch padding) appends
        nothing and reads nothing (its attention output is zeros);
      * a row naming a slot an earlier row of the call already named, a row with n_new
        outside [0, tokens], and a row marked in `reject` append and read nothing, and their
        slot is flagged REJECTED (unless FREE);
      * a slot that is not ACTIVE (FREE or flagged) appends nothing;
      * a slot whose pages do not fit appends nothing and is flagged OUT_OF_PAGES (free
        pages, then `pools.clear_flags` makes it ACTIVE), one that would pass `max_seq_len`
        OVER_CAPACITY (`pools.release_slot` ends the sequence; after `clear_flags` it
        appends only what still fits).
    Called with concrete arguments these rules raise ValueError instead, before anything is
    written (`check_rows`, `check_room`), naming the remedy (`REMEDIES`).

    Args:
      cache: the cache.
      slot_ids: i32[B], distinct slots.
      n_new: i32[B], tokens each slot appends (0 <= n_new <= tokens).
      tokens: T, the static chunk length (>= 1).
      reject: optional bool[B], rows the caller found invalid (e.g. token ids outside the
        vocabulary).
    """
    checks.alive("cache", cache)
    geo = cache.geometry
    S = geo.max_slots
    tokens = checks.integer("tokens", tokens, lo=1)
    if checks.concrete(slot_ids, n_new, cache):
        check_rows(cache, slot_ids, n_new, tokens)
        check_room(cache, slot_ids, n_new)
    slot_ids = jnp.asarray(slot_ids, jnp.int32)
    n_new = jnp.asarray(n_new, jnp.int32)
    in_range = (slot_ids >= 0) & (slot_ids < S)
    broken = _repeated(slot_ids) | (n_new < 0) | (n_new > tokens)
    if reject is not None:
        broken = broken | jnp.asarray(reject, bool)
    ok = in_range & ~broken
    ids = jnp.where(ok, slot_ids, S)
    read = jnp.clip(ids, 0, S - 1)
    status = jnp.where(ok, pools.status(cache)[read], SlotStatus.FREE)
    start = jnp.where(ok, pools.lengths(cache)[read], 0)
    wants = (n_new > 0) & (status == SlotStatus.ACTIVE)
    over = start + n_new > geo.max_seq_len
    max_new_pages = -(-tokens // geo.page_tokens) + 1
    pages, granted = paging.allocate(pools.page_state(cache), ids, start + n_new, wants & ~over,
                                     geo.page_tokens, max_new_pages)
    flag = jnp.where(over, SlotStatus.OVER_CAPACITY, SlotStatus.OUT_OF_PAGES)
    new_status = pools.status(cache).at[ids].max(jnp.where(wants & ~granted, flag, status),
                                                mode="drop")
    # A broken row flags the slot it named, unless that slot is FREE (nothing to protect).
    named = jnp.where(in_range & broken, slot_ids, S)
    current = new_status[jnp.clip(named, 0, S - 1)]
    new_status = new_status.at[named].max(
        jnp.where(current != SlotStatus.FREE, SlotStatus.REJECTED, SlotStatus.FREE), mode="drop")
    plan = AppendPlan(slot_ids=ids, start=start, n_new=jnp.where(granted, n_new, 0))
    return pools.with_slots(pools.with_page_state(cache, pages), status=new_status), plan


def check_replay(cache: Cache, slot_ids, start, n_new, tokens: int) -> None:
    """Concrete checks of a replay's rows: those of `check_rows`, and a start per row with
    0 <= start and start + n_new <= the slot's length (a replay rewrites tokens the slot
    already holds)."""
    check_rows(cache, slot_ids, n_new, tokens)
    ids = np.asarray(slot_ids)
    first = checks.int_array("start", start, ndim=1)
    if first.shape != ids.shape:
        checks.fail("start", f"shape {ids.shape} (one start per slot id)", f"shape {first.shape}")
    lengths = np.asarray(pools.lengths(cache))
    for row, (slot, s, n) in enumerate(zip(ids.tolist(), first.tolist(),
                                            np.asarray(n_new).tolist(), strict=True)):
        if slot < 0 or n == 0:
            continue
        if s < 0 or s + n > lengths[slot]:
            checks.fail("start", "0 <= start and start + n_new <= the slot's length (a replay "
                        "rewrites tokens already appended)",
                        f"start {s}, n_new {n} at row {row} for slot {slot} of length "
                        f"{int(lengths[slot])}")


def replay_plan(cache: Cache, slot_ids, start, n_new, tokens: int) -> AppendPlan:
    """A state-only plan (`AppendPlan.state_only`): positions [start, start + n_new) of each
    slot, tokens the slot already holds (its length and pages stay as they are).

    Running the layers with it (`append_layers`, `step.layer_step`, a model's layers)
    rewrites the window rings and compressor tails of those positions from the given
    vectors and writes no entry; attention reads the entries already in the slot's pages
    (for a prefix attached with `pools.attach_prefix`, the shared ones). This is how a slot
    that took shared pages rebuilds the State at their boundary (see `step.replay`).

    Device-side rules: a row whose slot id is outside [0, max_slots), that names a slot an
    earlier row named, whose slot is not ACTIVE, or with n_new outside [0, tokens], start < 0
    or start + n_new past the slot's length writes and reads nothing (no slot is flagged: a
    replay changes no status). Called with concrete arguments, broken rows raise ValueError
    (`check_replay`) instead.

    Args:
      cache: the cache.
      slot_ids: i32[B], distinct slots (-1: a padding row with n_new 0).
      start: i32[B], the first replayed position of each row.
      n_new: i32[B], tokens each row replays (0 <= n_new <= tokens).
      tokens: T, the static chunk length (>= 1).
    """
    S = cache.geometry.max_slots
    tokens = checks.integer("tokens", tokens, lo=1)
    if checks.concrete(slot_ids, start, n_new):
        check_replay(cache, slot_ids, start, n_new, tokens)
    slot_ids = jnp.asarray(slot_ids, jnp.int32)
    start = jnp.asarray(start, jnp.int32)
    n_new = jnp.asarray(n_new, jnp.int32)
    in_range = (slot_ids >= 0) & (slot_ids < S)
    read = jnp.clip(slot_ids, 0, S - 1)
    ok = (in_range & ~_repeated(slot_ids) & (pools.status(cache)[read] == SlotStatus.ACTIVE)
          & (n_new >= 0) & (n_new <= tokens) & (start >= 0)
          & (start + n_new <= pools.lengths(cache)[read]))
    return AppendPlan(slot_ids=jnp.where(ok, slot_ids, S), start=jnp.where(ok, start, 0),
                      n_new=jnp.where(ok, n_new, 0), state_only=True)


def end_append(cache: Cache, plan: AppendPlan) -> Cache:
    """Advances the lengths of the slots that appended (a replay's plan changes nothing)."""
    checks.alive("cache", cache)
    if plan.state_only:
        return cache
    lengths = pools.lengths(cache).at[plan.slot_ids].add(plan.n_new, mode="drop")
    return pools.with_slots(cache, lengths=lengths)


def after(x: jax.Array, dep) -> jax.Array:
    """x, bit for bit, data-dependent on `dep` through a term that is always +0 (NaN included;
    x - (+0) keeps even -0) and that XLA cannot fold.

    XLA:CPU puts an in-place write of a buffer after an earlier read of it only when the
    written values depend on the read; otherwise (an optimization barrier does not help) it
    copies the whole buffer, every step. Pass the read's result (an array, or a pytree of
    them) as `dep`.
    """
    d = jax.tree.leaves(dep)[0].ravel()[0]
    if not jnp.issubdtype(d.dtype, jnp.floating):
        # An integer always equals itself, and XLA folds the term away: compare the word's
        # bits as a float instead (any bits, a NaN's included, give +0).
        d = (jax.lax.bitcast_convert_type(d, jnp.float32) if d.dtype.itemsize == 4
             else d.astype(jnp.float32))
    return x - ((d != d) & (d == d)).astype(x.dtype)


def write_window(cache: Cache, plan: AppendPlan, layers: jax.Array, window: jax.Array,
                 options: Options | None = None) -> Cache:
    """window: [n, B, T, hd] for global layers `layers` i32[n], encoded in the ring's format
    (`CacheConfig.window_dtype`)."""
    W = cache.attn_config.window
    tokens = window.shape[2]
    j = jnp.arange(tokens, dtype=jnp.int32)[None, :]
    n = plan.n_new[:, None]
    keep = (j < n) & (j >= n - W)  # each ring row written at most once
    row = jnp.where(keep, (plan.start[:, None] + j) % W, W)
    (ring,) = _put_rows((pools.window_ring(cache),),
                        (layers[:, None, None], plan.slot_ids[None, :, None]), row[None],
                        (cache.layout.rows["window"].encode(window),), options)
    return pools.with_window_ring(cache, ring)


def _put_rows(stored: tuple, index: tuple, record: jax.Array, values: tuple,
              options: Options | None) -> tuple:
    """`put` of each array of `stored` with its rows: a chunk of one token per row writes one
    record per (layer, slot) block (`ops.put_records`, in place on a TPU)."""
    if record.shape[-1] == 1:
        return ops.put_records(stored, index, record, values, options)
    return tuple(a.put(index, record, v) for a, v in zip(stored, values, strict=True))


def append_compressor(cache: Cache, plan: AppendPlan, spec: CompressorSpec,
                      layers: jax.Array, inputs: CompressorInput, params: CompressorParams,
                      options: Options | None = None) -> Cache:
    """Tail writes and entry emission of one compressor for the layers `layers` (kind stack
    indices i32[n]); inputs [n, B, T, w], params ape [n, m, w] and norm [n, width].

    With a state-only plan (`replay_plan`) only the tails are written: no entry is emitted.
    The HCA compressor with hca_tail="online" folds the chunk into its `pools.OnlineTail`
    (`ops.emit_entries_online`) instead of writing ring rows."""
    model, geo, fixed = cache.attn_config, cache.geometry, cache.layout
    tokens = inputs.kv.shape[2]
    positions = plan.positions(tokens)
    kv = inputs.kv.astype(jnp.float32)
    gate = jax.vmap(lambda g, ape: comp.biased_gate(spec, g, ape, positions))(inputs.gate,
                                                                              params.ape)
    tail = pools.tail(cache, spec)
    if spec.name in fixed.online:
        pool, tail = ops.emit_entries_online(
            spec, model, geo, options, layout=fixed,
            pool=None if plan.state_only else pools.entries(cache, spec),
            page_rows=pools.page_rows(cache, plan.slot_ids), layers=layers, tail=tail,
            slot_ids=plan.slot_ids, kv=kv, gate=gate, start=plan.start, n_new=plan.n_new,
            norm=params.norm)
        if pool is not None:
            cache = pools.with_entries(cache, spec, pool)
        return pools.with_tail(cache, spec, tail)
    if not plan.state_only:
        pool = ops.emit_entries(
            spec, model, geo, options, layout=fixed, pool=pools.entries(cache, spec),
            page_rows=pools.page_rows(cache, plan.slot_ids), layers=layers, tail_kv=tail.kv,
            tail_gate=tail.gate, slot_ids=read_slots(cache, plan.slot_ids), kv=kv, gate=gate,
            start=plan.start, n_new=plan.n_new, norm=params.norm)
        cache = pools.with_entries(cache, spec, pool)
        # The emission read the tails: the writes below must come after it.
        kv, gate = after(kv, pool), after(gate, pool)

    ring_row = comp.tail_writes(spec, plan.start, plan.n_new, tokens)
    block = (layers[:, None, None], plan.slot_ids[None, :, None])
    rows = fixed.tail_rows[spec.name]
    new_kv, new_gate = _put_rows((tail.kv, tail.gate), block, ring_row[None],
                                 (rows.encode(kv), rows.encode(gate)), options)
    new_tail = tail.replace(kv=new_kv, gate=new_gate)
    return pools.with_tail(cache, spec, new_tail)


def append_layers(cache: Cache, plan: AppendPlan, vectors: TokenVectors,
                  weights: CompressorWeights, options: Options | None = None) -> Cache:
    """Appends the planned tokens to every layer."""
    fixed = cache.layout
    cache = write_window(cache, plan, jnp.arange(fixed.model.num_layers, dtype=jnp.int32),
                         vectors.window, options)
    for spec in fixed.specs:
        n = len(fixed.layers[spec.kind])
        if n:
            cache = append_compressor(cache, plan, spec, jnp.arange(n, dtype=jnp.int32),
                                      vectors.compressor(spec.name),
                                      getattr(weights, spec.name), options)
    return cache


def __getattr__(name: str):
    if name == "page_rows":
        raise AttributeError("v4kv_jax.append.page_rows moved: use "
                             "v4kv_jax.pools.page_rows(cache, slot_ids)")
    raise AttributeError(f"module 'v4kv_jax.append' has no attribute {name!r}")


__all__ = ["AppendPlan", "after", "append_compressor", "append_layers", "begin_append",
           "check_replay", "check_rows", "end_append", "read_slots", "replay_plan",
           "write_window"]
