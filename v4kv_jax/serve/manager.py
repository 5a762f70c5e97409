"""The host lifecycle: requests in slots, checked calls into the jitted steps, clear errors.

The device never raises; it flags a slot (`SlotStatus`) and writes nothing for it. This
module is the one place that turns those flags into exceptions naming the request, and the
one place that keeps which request holds which slot. Every host object is a `SlotCache`:

  SlotTable     request -> slot; admission into the lowest free slot, release, the checks
                of a call's request list, and `flag_error` (a slot's flag -> exception);
                `slot_tables` makes the tables of every shard of a geometry and mesh (the
                one place tables are made, for every host object)
  SlotCache     the base: one cache, its SlotTable, the options; lengths, inspection and
                the memory report
  CacheManager  a SlotCache, vectors in: one checked call per prefill chunk or decode step,
                all or nothing
  nn.Generator, engine.Engine   SlotCaches of a model (`nn.ModelCache`), token ids in

A call names any subset of the admitted requests; its batch is padded to a bucket size
(`batch_buckets`: powers of two below `max_slots`, and `max_slots`) with padding rows of slot
id -1 that append and read nothing, so one compiled program serves every batch size of a
bucket.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Iterable, Iterator, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from v4kv_jax import checks, pools, programs, step
from v4kv_jax import mesh as meshes
from v4kv_jax.config import AttentionConfig, CacheConfig, Options, options_or_default
from v4kv_jax.pools import Cache, SlotStatus
from v4kv_jax.pools.paging import pages_for
from v4kv_jax.vectors import CompressorWeights, Queries, TokenVectors

_reset_slot = programs.program("slots.reset", pools.reset_slot, donate=("cache",))
_release_slot = programs.program("slots.release", pools.release_slot, donate=("cache",))


# --- errors ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PageShortfall:
    request: Hashable
    pages_needed: int


_FLAG_HINTS = {
    SlotStatus.OUT_OF_PAGES: "needs pages the free stack does not have (release requests or "
                             "grow num_pages)",
    SlotStatus.OVER_CAPACITY: "would pass the maximum sequence length (release it)",
    SlotStatus.REJECTED: "was in a row that broke a rule (its slot named twice, n_new outside "
                         "[0, T], or a token id outside the vocabulary)",
}


def _could_not_append(noun: str, flags: Mapping[Hashable, str]) -> str:
    return f"{noun}s {list(flags)} could not append ({list(flags.values())}): "


class PoolExhaustedError(RuntimeError):
    """The Classical pool has too few free pages for a call.

    Raised in two ways, both naming each request that needs pages and how many
    (`shortfalls`):

    * before a `CacheManager` call (`flags` is empty): the check runs for the whole batch and
      NOTHING was appended: no request of the call advanced, no output was computed, every
      state is unchanged. Release requests (or grow `num_pages`), then repeat the same call.
    * from the device flag OUT_OF_PAGES (`flags` maps each flagged request to its flag): the
      flagged requests appended nothing from the flagged step on; the others went on.
    """

    def __init__(self, shortfalls: Sequence[PageShortfall], pages_free: int, *,
                 flags: Mapping[Hashable, str] | None = None, noun: str = "request"):
        self.shortfalls = list(shortfalls)
        self.pages_free = pages_free
        self.flags = dict(flags or {})
        needed = sum(s.pages_needed for s in self.shortfalls)
        parts = ", ".join(f"{noun} {s.request!r} needs {s.pages_needed} page(s)"
                          for s in self.shortfalls)
        text = (f"Classical pool exhausted: {parts} ({needed} in all); {pages_free} page(s) "
                "free.")
        if self.flags:
            super().__init__(_could_not_append(noun, self.flags) + text + " The flagged "
                             f"{noun}s appended nothing from that step on; free pages "
                             "(release) or grow num_pages.")
        else:
            super().__init__(text + " Nothing was appended for any request of this call.")


class SlotFlaggedError(RuntimeError):
    """The device flagged requests (OVER_CAPACITY, REJECTED, or several kinds of flags
    together): each appended nothing from the flagged step on. `flags` maps each flagged
    request to its `SlotStatus` name."""

    def __init__(self, flags: Mapping[Hashable, str], *, noun: str = "request"):
        self.flags = dict(flags)
        reasons = "; ".join(f"{noun} {r!r} {_FLAG_HINTS[SlotStatus[f]]}"
                            for r, f in self.flags.items())
        super().__init__(_could_not_append(noun, self.flags) + reasons + ".")


# --- batch buckets ----------------------------------------------------------------------------


def batch_buckets(max_slots: int) -> tuple[int, ...]:
    """The batch sizes calls are padded to: powers of two below `max_slots`, and `max_slots`."""
    sizes, n = [], 1
    while n < max_slots:
        sizes.append(n)
        n *= 2
    return (*sizes, max_slots)


def bucket_size(batch: int, max_slots: int) -> int:
    """The smallest bucket (`batch_buckets`) that holds `batch` rows."""
    return next(size for size in batch_buckets(max_slots) if size >= batch)


def _pad_tree(tree, rows: int):
    """Every array of `tree`, [lead, B, ...], zero-padded to [lead, rows, ...]."""

    def pad(x):
        return jnp.pad(x, [(0, 0), (0, rows - x.shape[1])] + [(0, 0)] * (x.ndim - 2))

    return jax.tree.map(pad, tree)


_pad_batch = programs.program("batch.pad", _pad_tree, static=("rows",))


# --- the slot table ---------------------------------------------------------------------------


class SlotTable:
    """Which request holds which slot of a cache with `max_slots` slots.

    Requests are any hashable values. The table changes a cache only through jitted
    `pools.reset_slot` / `pools.release_slot` (the cache donated): `admit` and `release` take
    the cache and return the new one.
    """

    def __init__(self, max_slots: int):
        self.max_slots = checks.integer("max_slots", max_slots, lo=1)
        self._slots: dict[Hashable, int] = {}

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, request: Hashable) -> bool:
        return request in self._slots

    def __iter__(self) -> Iterator[Hashable]:
        return iter(list(self._slots))

    @property
    def slots(self) -> dict[Hashable, int]:
        """request -> slot, in admission order (a copy)."""
        return dict(self._slots)

    def slot(self, request: Hashable) -> int:
        try:
            return self._slots[request]
        except (KeyError, TypeError):
            raise KeyError(f"request {request!r} is not admitted; admitted: "
                           f"{list(self._slots)}") from None

    def requests(self, requests: Iterable[Hashable] | None = None) -> list[Hashable]:
        """A call's requests as a list (default: every admitted one, in admission order).

        Raises TypeError unless a sequence, ValueError for none or a repeated request,
        KeyError for a request that is not admitted.
        """
        if requests is None:
            requests = list(self._slots)
        elif isinstance(requests, (str, bytes)) or not hasattr(requests, "__iter__"):
            checks.fail("requests", "a sequence of admitted requests", requests, TypeError)
        requests = list(requests)
        if not requests:
            checks.fail("requests", "at least one admitted request", requests)
        if len(set(requests)) != len(requests):
            checks.fail("requests", "distinct requests (one row each)", requests)
        for r in requests:
            self.slot(r)
        return requests

    def admit(self, cache: Cache, request: Hashable) -> tuple[Cache, int]:
        """Starts `request` in the lowest free slot with an empty state: (cache, slot)."""
        if not isinstance(request, Hashable):
            checks.fail("request", "a hashable request id", request, TypeError)
        if request in self._slots:
            raise ValueError(f"request {request!r} is already admitted (slot "
                             f"{self._slots[request]})")
        used = set(self._slots.values())
        free = [s for s in range(self.max_slots) if s not in used]
        if not free:
            raise RuntimeError(f"no free slot for request {request!r}: all "
                               f"max_slots={self.max_slots} slots are in use")
        cache = _reset_slot(cache, jnp.int32(free[0]))
        self._slots[request] = free[0]
        return cache, free[0]

    def release(self, cache: Cache, request: Hashable) -> Cache:
        """Ends `request`: its pages go back to the free stack when no one else holds them."""
        cache = _release_slot(cache, jnp.int32(self.slot(request)))
        del self._slots[request]
        return cache

    def warmup(self, cache: Cache) -> Cache:
        """Runs the programs of `admit` and `release` once on no slot (id -1, which changes
        nothing), so that both are compiled before a request needs them; returns the cache."""
        none = jnp.int32(-1)
        return _release_slot(_reset_slot(cache, none), none)

    def release_all(self, cache: Cache) -> Cache:
        for request in self:
            cache = self.release(cache, request)
        return cache

    def flags(self, cache: Cache, requests: Iterable[Hashable]) -> dict[Hashable, str]:
        """request -> `SlotStatus` name, for each of `requests` whose slot is flagged."""
        status = np.asarray(pools.status(cache))
        return {r: SlotStatus(int(status[self.slot(r)])).name for r in requests
                if status[self.slot(r)] not in (SlotStatus.ACTIVE, SlotStatus.FREE)}

    def flag_error(self, cache: Cache, requests: Iterable[Hashable],
                   wanted: Mapping[Hashable, int], *, noun: str = "request"
                   ) -> PoolExhaustedError | SlotFlaggedError | None:
        """The exception for the flags of `requests` in `cache`, or None when none is flagged.

        Only OUT_OF_PAGES flags: `PoolExhaustedError` with each flagged request's shortfall
        (pages for the length it `wanted` to reach, less the pages it holds; at least 1, the
        page the flagged step did not get). Any other flag: `SlotFlaggedError`. Both start
        "{noun}s [...] could not append ([flags]): ", e.g. "prompts [2] could not append
        (['OUT_OF_PAGES']): " for the Generator (noun "prompt").
        """
        flags = self.flags(cache, requests)
        if not flags:
            return None
        if set(flags.values()) != {SlotStatus.OUT_OF_PAGES.name}:
            return SlotFlaggedError(flags, noun=noun)
        table = np.asarray(pools.page_table(cache))
        P = cache.geometry.page_tokens
        shortfalls = [
            PageShortfall(r, max(1, int(pages_for(wanted[r], P))
                                 - int(np.sum(table[self.slot(r)] >= 0))))
            for r in flags]
        return PoolExhaustedError(shortfalls, int(pools.free_pages(cache)), flags=flags,
                                  noun=noun)


def slot_tables(geometry: CacheConfig, mesh: meshes.Mesh | None = None
                ) -> dict[int, SlotTable]:
    """shard index -> a new `SlotTable` of `geometry.max_slots` slots, for each shard of
    `mesh` this process holds (the shards `mesh.split` gives); {0: table} without a mesh.
    Every host object (`SlotCache`, the Generator, the Engine) takes its tables here."""
    mine = [0] if mesh is None else [i for i, device in enumerate(meshes.shard_devices(mesh))
                                     if device.process_index == jax.process_index()]
    return {i: SlotTable(geometry.max_slots) for i in mine}


# --- the manager ------------------------------------------------------------------------------


class SlotCache:
    """One cache and the requests in its slots: the base of every host object (the
    CacheManager, the Generator, the Engine).

    Args:
      model: attention geometry.
      geometry: cache geometry.
      options: how the ops run (`Options`), passed to every call; default `Options()`.
    """

    def __init__(self, model: AttentionConfig, geometry: CacheConfig,
                 options: Options | None = None):
        if not isinstance(model, AttentionConfig):
            checks.fail("model", "an AttentionConfig", type(model).__name__, TypeError)
        if not isinstance(geometry, CacheConfig):
            checks.fail("geometry", "a CacheConfig", type(geometry).__name__, TypeError)
        self.options = options_or_default(options)
        self._init_pools(model, geometry)

    def _init_pools(self, model: AttentionConfig, geometry: CacheConfig) -> None:
        """Makes `cache` and `table` (a subclass may hold them otherwise)."""
        self.cache = pools.init_cache(model, geometry)
        (self.table,) = slot_tables(geometry).values()

    @property
    def attn_config(self) -> AttentionConfig:
        return self.cache.attn_config

    @property
    def geometry(self) -> CacheConfig:
        return self.cache.geometry

    @property
    def slots(self) -> dict[Hashable, int]:
        """request -> slot of every admitted request, in admission order."""
        return self.table.slots

    def lengths(self) -> dict[Hashable, int]:
        """request -> tokens its slot holds."""
        lengths = np.asarray(pools.lengths(self.cache))
        return {r: int(lengths[s]) for r, s in self.slots.items()}

    def inspect(self) -> dict[Hashable, pools.SlotReport]:
        """request -> `pools.SlotReport` of its slot."""
        by_slot = {rep.slot: rep for rep in pools.inspect_slots(self.cache)}
        return {r: by_slot[s] for r, s in self.slots.items()}

    def memory_report(self) -> pools.MemoryReport:
        return pools.memory_report(self.cache)


class CacheManager(SlotCache):
    """Admits requests into slots and runs prefill / decode on the shared cache.

    Every call names the requests it appends to, any subset of the admitted ones, with one
    row of vectors per named request in that order. The batch is padded to a bucket size
    (`batch_buckets`), so each bucket compiles once per chunk length.

    Args:
      model: attention geometry.
      geometry: cache geometry.
      weights: the compressor params of every layer (ape and norm per layer).
      options: how the ops run (`Options`), passed to every call; default `Options()`.
    """

    def __init__(self, model: AttentionConfig, geometry: CacheConfig,
                 weights: CompressorWeights, *, options: Options | None = None):
        super().__init__(model, geometry, options)
        step.check_weights(self.cache, weights)
        self.weights = weights

    # --- lifecycle ---------------------------------------------------------------------------

    def admit(self, request: Hashable) -> int:
        """Starts `request` in a free slot with an empty state; returns the slot."""
        self.cache, slot = self.table.admit(self.cache, request)
        return slot

    def release(self, request: Hashable) -> None:
        """Ends `request`: its pages go back to the free stack when no one else holds them."""
        self.cache = self.table.release(self.cache, request)

    # --- steps -------------------------------------------------------------------------------

    def prefill(self, requests: Sequence[Hashable], vectors: TokenVectors, n_new,
                queries: Queries | None = None):
        """Appends chunk rows to `requests` (row b to requests[b], n_new[b] tokens).

        Args:
          requests: distinct admitted requests, B of them.
          vectors: `TokenVectors` with [.., B, T, ..] arrays.
          n_new: i32[B] tokens of each row to append (the rest of the row is padding).
          queries: optional `Queries` stacked over layers, [.., B, T, ..].

        Returns:
          With `queries`, the attention outputs f32[n_layers, B, T, H, hd]; else None.

        Raises (before anything is appended): TypeError / ValueError naming the argument,
        KeyError for a request that is not admitted, ValueError for a request that would pass
        the maximum length, `PoolExhaustedError` when the pool cannot hold every request's
        new tokens, and the `SlotTable.flag_error` of a request whose slot is flagged (the
        flag is then cleared: the slot's data never changed, and these checks guard the next
        call).
        """
        requests = self.table.requests(requests)
        n_new = checks.int_array("n_new", n_new, ndim=1, lo=0)
        if n_new.shape != (len(requests),):
            checks.fail("n_new", f"{len(requests)} counts (one per request)",
                        f"{n_new.shape[0]} counts")
        tokens = self._check_inputs(vectors, queries, len(requests))
        if n_new.size and n_new.max() > tokens:
            checks.fail("n_new", f"counts in [0, {tokens}] (the chunk length)", n_new)
        return self._append(requests, vectors, queries, n_new)

    def decode(self, vectors: TokenVectors, requests: Sequence[Hashable] | None = None,
               queries: Queries | None = None):
        """Appends one token to each of `requests` (default: every admitted request, in
        admission order).

        `vectors` (and `queries`) hold one row per named request, in their order:
        [.., len(requests), 1, ..]. All or nothing, as `prefill`. With `queries`, returns
        f32[n_layers, len(requests), 1, H, hd].
        """
        requests = self.table.requests(requests)
        self._check_inputs(vectors, queries, len(requests), tokens=1)
        return self._append(requests, vectors, queries, np.ones(len(requests), np.int32))

    def _append(self, requests: list[Hashable], vectors: TokenVectors,
                queries: Queries | None, n_new: np.ndarray):
        """Checks room and flags, runs one padded call, cuts the outputs back to the rows."""
        lengths = self.lengths()
        wanted = {r: lengths[r] + int(n) for r, n in zip(requests, n_new, strict=True)}
        self._raise_flags(requests, wanted)
        self._check_room(wanted)
        batch = len(requests)
        size = bucket_size(batch, self.geometry.max_slots)
        slot_ids = np.full((size,), -1, np.int32)
        slot_ids[:batch] = [self.table.slot(r) for r in requests]
        counts = np.zeros((size,), np.int32)
        counts[:batch] = n_new
        if size != batch:
            vectors = _pad_batch(vectors, size)
            if queries is not None:
                queries = _pad_batch(queries.replace(sink=None), size).replace(
                    sink=queries.sink)
        if queries is None:
            self.cache = step.prefill(self.cache, vectors, self.weights, slot_ids, counts,
                                      options=self.options)
            out = None
        else:
            self.cache, out = step.append_and_attend(self.cache, vectors, queries, self.weights,
                                                     slot_ids, counts, options=self.options)
            if size != batch:
                out = out[:, :batch]
        self._raise_flags(requests, wanted)
        return out

    # --- reports -----------------------------------------------------------------------------

    def read(self, request: Hashable) -> pools.SlotContents:
        """What `request` holds, by entry index and position (`pools.read_slot`)."""
        return pools.read_slot(self.cache, self.table.slot(request))

    # --- checks ------------------------------------------------------------------------------

    def _check_inputs(self, vectors: TokenVectors, queries: Queries | None, batch: int,
                      tokens: int | None = None) -> int:
        """Checks vectors (and queries) for `batch` rows of one chunk; returns its length T."""
        length = step.chunk_length(vectors)
        tokens = length if tokens is None else tokens
        step.check_vectors(self.cache, vectors, batch, tokens)
        if queries is not None:
            if not isinstance(queries, Queries):
                checks.fail("queries", "a v4kv_jax Queries", type(queries).__name__,
                            TypeError)
            step.check_queries(self.cache, None, queries, batch, tokens)
        return tokens

    def _raise_flags(self, requests: list[Hashable], wanted: Mapping[Hashable, int]) -> None:
        """Raises the `SlotTable.flag_error` of `requests`, clearing their flags first: a
        flagged slot's data never changed, and the manager's checks guard the next call.

        Before a call, a flag comes from a call made outside the manager; after one, it
        would be a bug in these checks (they ran first)."""
        error = self.table.flag_error(self.cache, requests, wanted)
        if error is not None:
            self.cache = pools.clear_flags(self.cache, [self.table.slot(r) for r in error.flags])
            raise error

    def _check_room(self, wanted: Mapping[Hashable, int]) -> None:
        """Raises before a call that would pass a request's maximum length, or that needs
        more pages than are free (then nothing of the call is appended)."""
        lengths = self.lengths()
        limit = self.geometry.max_seq_len
        for r, end in wanted.items():
            if end > limit:
                raise ValueError(
                    f"request {r!r}: length {lengths[r]} + {end - lengths[r]} new tokens "
                    f"exceeds the maximum sequence length {limit} (max_pages_per_seq="
                    f"{self.geometry.max_pages_per_seq} x page_tokens="
                    f"{self.geometry.page_tokens})")
        held = np.sum(np.asarray(pools.page_table(self.cache)) >= 0, axis=1)
        P = self.geometry.page_tokens
        shortfalls = [PageShortfall(r, need) for r, end in wanted.items()
                      if (need := int(pages_for(end, P) - held[self.table.slot(r)])) > 0]
        free = int(pools.free_pages(self.cache))
        if sum(s.pages_needed for s in shortfalls) > free:
            raise PoolExhaustedError(shortfalls, free)
