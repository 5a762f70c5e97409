"""Host side: requests in slots, checked calls into the jitted steps, clear errors, reports.

The device never raises; it flags a slot (`SlotStatus`) and writes nothing for it. This
object turns those flags into exceptions that name the request, and checks what it can
before a call (unknown requests, full slots, lengths past the configured maximum).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from v4kv_jax import checks, pools, step
from v4kv_jax.attention import Queries
from v4kv_jax.compressor import CompressorWeights
from v4kv_jax.config import AttentionConfig, CacheConfig
from v4kv_jax.paging import pages_for
from v4kv_jax.pools import SlotStatus

_reset_slot = jax.jit(pools.reset_slot, donate_argnums=0)
_release_slot = jax.jit(pools.release_slot, donate_argnums=0)


@dataclasses.dataclass(frozen=True)
class PageShortfall:
    request: Hashable
    pages_needed: int


class PoolExhaustedError(RuntimeError):
    """The Classical pool has too few free pages for a call; NOTHING was appended.

    The check runs before the call, for the whole batch: no request of the call advanced,
    no output was computed, every state is unchanged. Release requests (or grow
    `num_pages`), then repeat the same call. `shortfalls` lists each request of the call that
    needs new pages and how many.
    """

    def __init__(self, shortfalls: Sequence[PageShortfall], pages_free: int):
        self.shortfalls = list(shortfalls)
        self.pages_free = pages_free
        needed = sum(s.pages_needed for s in self.shortfalls)
        parts = ", ".join(f"request {s.request!r} needs {s.pages_needed} page(s)"
                          for s in self.shortfalls)
        super().__init__(f"Classical pool exhausted: {parts} ({needed} in all); {pages_free} "
                         "page(s) free. Nothing was appended for any request of this call.")


class CacheManager:
    """Admits requests into slots and runs prefill / decode on the shared cache.

    Args:
      model: attention geometry.
      geometry: cache geometry.
      weights: the compressor params of every layer (ape and norm per layer).
    """

    def __init__(self, model: AttentionConfig, geometry: CacheConfig,
                 weights: CompressorWeights):
        self.cache = pools.init_cache(model, geometry)
        self.weights = weights
        self.slots: dict[Hashable, int] = {}

    @property
    def model(self) -> AttentionConfig:
        return self.cache.model

    @property
    def geometry(self) -> CacheConfig:
        return self.cache.geometry

    # --- lifecycle ---------------------------------------------------------------------------

    def admit(self, request: Hashable) -> int:
        """Starts `request` in a free slot with an empty state; returns the slot."""
        if request in self.slots:
            raise ValueError(f"request {request!r} is already admitted (slot "
                             f"{self.slots[request]})")
        used = set(self.slots.values())
        free = [s for s in range(self.geometry.max_slots) if s not in used]
        if not free:
            raise RuntimeError(f"no free slot for request {request!r}: all "
                               f"max_slots={self.geometry.max_slots} slots are in use")
        slot = free[0]
        self.cache = _reset_slot(self.cache, jnp.int32(slot))
        self.slots[request] = slot
        return slot

    def release(self, request: Hashable) -> None:
        """Ends `request`: its pages go back to the free stack when no one else holds them."""
        slot = self._slot(request)
        self.cache = _release_slot(self.cache, jnp.int32(slot))
        del self.slots[request]

    def lengths(self) -> dict[Hashable, int]:
        lengths = np.asarray(self.cache.state.lengths)
        return {r: int(lengths[s]) for r, s in self.slots.items()}

    # --- steps -------------------------------------------------------------------------------

    def prefill(self, requests: Sequence[Hashable], vectors: step.TokenVectors, n_new,
                queries: Queries | None = None):
        """Appends chunk rows to `requests` (row b to requests[b], n_new[b] tokens).

        All or nothing: if the pool cannot hold every request's new tokens, or a request would
        pass the maximum length, it raises before anything is appended.

        With `queries` (stacked over layers) it also returns the attention outputs
        f32[n_layers, B, T, H, hd]; without, it only fills the cache.
        """
        requests = self._requests(requests)
        slots = np.asarray([self._slot(r) for r in requests], np.int32)
        n_new = checks.int_array("n_new", n_new, ndim=1, lo=0)
        if n_new.shape != (len(requests),):
            checks.fail("n_new", f"{len(requests)} counts (one per request)",
                        f"{n_new.shape[0]} counts")
        self._check_room(dict(zip(requests, n_new.tolist(), strict=True)))
        if queries is None:
            self.cache = step.prefill(self.cache, vectors, self.weights, slots, n_new)
            out = None
        else:
            self.cache, out = step.forward(self.cache, vectors, queries, self.weights, slots,
                                           n_new)
        self._check_appended(requests)
        return out

    def decode(self, vectors: step.TokenVectors, requests: Sequence[Hashable] | None = None,
               queries: Queries | None = None):
        """Appends one token to each of `requests` (default: all admitted).

        `vectors` (and `queries`) cover every slot, [.., max_slots, 1, ..]; rows of slots not
        decoding are ignored. All or nothing, as `prefill`. With `queries`, returns
        f32[n_layers, max_slots, 1, H, hd].
        """
        requests = self._requests(list(self.slots) if requests is None else requests)
        S = self.geometry.max_slots
        n_new = np.zeros((S,), np.int32)
        for r in requests:
            n_new[self._slot(r)] = 1
        self._check_room({r: 1 for r in requests})
        if queries is None:
            self.cache = step.decode_step(self.cache, vectors, self.weights, n_new > 0)
            out = None
        else:
            self.cache, out = step.forward(self.cache, vectors, queries, self.weights,
                                           np.arange(S, dtype=np.int32), n_new)
        self._check_appended(requests)
        return out

    # --- reports -----------------------------------------------------------------------------

    def inspect(self) -> dict[Hashable, pools.SlotReport]:
        by_slot = {rep.slot: rep for rep in pools.inspect_slots(self.cache)}
        return {r: by_slot[s] for r, s in self.slots.items()}

    def memory_report(self) -> pools.MemoryReport:
        return pools.memory_report(self.cache)

    # --- checks ------------------------------------------------------------------------------

    def _slot(self, request: Hashable) -> int:
        try:
            return self.slots[request]
        except KeyError:
            raise KeyError(f"request {request!r} is not admitted; admitted: "
                           f"{list(self.slots)}") from None

    def _requests(self, requests) -> list[Hashable]:
        if isinstance(requests, (str, bytes)) or not hasattr(requests, "__iter__"):
            checks.fail("requests", "a sequence of admitted requests", requests, TypeError)
        requests = list(requests)
        if len(set(requests)) != len(requests):
            checks.fail("requests", "distinct requests (one row each)", requests)
        return requests

    def _check_room(self, appended: dict[Hashable, int]) -> None:
        """Raises before a call that would pass a request's maximum length, or that needs
        more pages than are free (then nothing of the call is appended)."""
        lengths = self.lengths()
        limit = self.geometry.max_seq_len
        for r, n in appended.items():
            if lengths[r] + n > limit:
                raise ValueError(
                    f"request {r!r}: length {lengths[r]} + {n} new tokens exceeds the maximum "
                    f"sequence length {limit} (max_pages_per_seq="
                    f"{self.geometry.max_pages_per_seq} x page_tokens="
                    f"{self.geometry.page_tokens})")
        held = np.sum(np.asarray(self.cache.pages.page_table) >= 0, axis=1)
        P = self.geometry.page_tokens
        shortfalls = [PageShortfall(r, need) for r, n in appended.items()
                      if (need := int(pages_for(lengths[r] + n, P) - held[self.slots[r]])) > 0]
        free = int(self.cache.pages.num_free)
        if sum(s.pages_needed for s in shortfalls) > free:
            raise PoolExhaustedError(shortfalls, free)

    def _check_appended(self, requests) -> None:
        """After a call: every request's slot is still ACTIVE (`_check_room` ran first, so a
        flag here is a bug; it is reported, and cleared so the request can go on)."""
        status = np.asarray(self.cache.state.status)
        flagged = {r: SlotStatus(int(status[self.slots[r]])).name for r in requests
                   if status[self.slots[r]] != SlotStatus.ACTIVE}
        if flagged:
            self.cache = pools.clear_flags(self.cache, [self.slots[r] for r in flagged])
            raise RuntimeError(f"requests were flagged by the device although the host checks "
                               f"passed: {flagged}")
