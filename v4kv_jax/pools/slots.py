"""The slot lifecycle: start a sequence in a free slot, end it, clear its flags."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from v4kv_jax import checks
from v4kv_jax.pools import paging
from v4kv_jax.pools.tree import (
    Cache,
    SlotStatus,
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
    (a V4.1 cache's open rows) zeroed. Takes a `Cache` or a `Cache41`, as do `release_slot`
    and `clear_flags`.

    Called with a concrete slot, a slot outside [0, max_slots) or one that is not FREE raises
    ValueError. Inside a caller's jit nothing is checked: an out-of-range id changes nothing,
    and a slot that still holds pages first gives them back (as `release_slot`), so none is
    lost.
    """
    checks.alive("cache", cache)
    _check_slot(cache, slot, free=True)
    mask = _slot_mask(cache, slot)
    cache = cache.replace(pages=paging.release(cache.pages, mask))
    state = cache.state

    def clear(x):
        return jnp.where(mask.reshape(1, -1, *([1] * (x.ndim - 2))), jnp.zeros((), x.dtype), x)

    # Every per-slot store (the window rings, the tails or open rows, the hot set): blocks
    # [n, max_slots], the slot the second leading dim.
    stores = {f.name: jax.tree.map(clear, getattr(state, f.name))
              for f in dataclasses.fields(state) if f.name not in ("lengths", "status")}
    state = state.replace(
        lengths=jnp.where(mask, 0, state.lengths),
        status=jnp.where(mask, SlotStatus.ACTIVE, state.status),
        **stores,
    )
    return cache.replace(state=state)


def release_slot(cache: Cache, slot) -> Cache:
    """Ends the sequence in `slot`: its pages lose one reference each, the slot becomes FREE.

    Releasing a FREE slot changes nothing. A concrete slot outside [0, max_slots) raises
    ValueError; inside a caller's jit it changes nothing.
    """
    checks.alive("cache", cache)
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
    checks.alive("cache", cache)
    S = cache.geometry.max_slots
    if checks.concrete(slots):
        checks.slot_ids(np.atleast_1d(np.asarray(slots)), S, name="slots")
    ids = jnp.atleast_1d(jnp.asarray(slots, jnp.int32))
    mask = jnp.zeros((S,), bool).at[jnp.where(ids >= 0, ids, S)].set(True, mode="drop")
    status = cache.state.status
    flagged = mask & (status != SlotStatus.FREE)
    return cache.replace(state=cache.state.replace(
        status=jnp.where(flagged, SlotStatus.ACTIVE, status)))


__all__ = ["clear_flags", "release_slot", "reset_slot"]
