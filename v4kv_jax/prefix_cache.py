"""The Engine's prefix cache: which full pages stay listed, which boundary snapshots are kept
on which tier, and how a new request's hit is planned and entered.

`PrefixCache` joins the host-side pieces of `v4kv_jax.prefix` (the page index, the snapshot
tiers) to the device cache through the pool transfers (`pools.hold_pages`, `drop_pages`,
`read_pages`, `load_pages`, `attach_prefix`, `snapshot_state`, `restore_state`). It never
schedules: the Engine decides which request runs and calls it to

  plan     find a request's hit (the longest listed chain of its prompt's full pages, or a
           deeper disk snapshot that brings its pages) and how its State is rebuilt at the
           hit boundary b (`RESTORES`), making room by LRU eviction of pages only the index
           holds; None when the pool cannot hold the request now
  enter    load a disk snapshot's pages, attach the hit's pages to the request's slot and
           restore its State (or set the replay that rebuilds it)
  record   after a step: list the request's new full pages, snapshot its State at the
           boundaries the policy asks for (the last full page of every prompt, every
           `snapshot_every_pages`)

The rebuild at b, in order of preference:
  1. a snapshot at b (device, host or disk tier) is restored;
  2. else a snapshot at s < b, restored, then tokens [s, b) replayed, when b - s <= R;
  3. else the R tokens before b are replayed from the empty State, R = num_layers * (W - 1)
     + 1 rounded up to whole pages (exact from any State: tests/test_prefix_device.py);
  4. else (b < R, no snapshot below b): no hit, the prompt is recomputed.

The device cache belongs to the caller: the prefix cache reads `holder.cache` and replaces it
with the result of each device program it runs (the cache is donated to them).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np

from v4kv_jax import pools, prefix, programs
from v4kv_jax.config import CacheConfig
from v4kv_jax.paging import pages_for
from v4kv_jax.pools import Cache

RESTORES = ("none", "snapshot", "snapshot+replay", "replay", "recompute")

_attach = programs.program("transfers.attach", pools.attach_prefix, donate=("cache",))
_restore = programs.program("transfers.restore", pools.restore_state, donate=("cache",))
_snapshot = programs.program("transfers.snapshot", pools.snapshot_state)
_hold = programs.program("transfers.hold", pools.hold_pages, donate=("cache",))
_drop = programs.program("transfers.drop", pools.drop_pages, donate=("cache",))
_read_pages = programs.program("transfers.read_pages", pools.read_pages)
_load_pages = programs.program("transfers.load_pages", pools.load_pages, donate=("cache",))


class CacheHolder(Protocol):
    cache: Cache


class Entry(Protocol):
    """What the prefix cache reads and sets of a request (the Engine's request record)."""

    prompt: np.ndarray
    tokens: list[int]
    namespace: bytes
    slot: int | None
    length: int
    digests: list[bytes]
    cached: int
    replay_at: int
    replay_end: int
    replayed: int
    restored_by: str
    snapshot_tier: str | None


@dataclasses.dataclass(frozen=True)
class Plan:
    """An admission: hit depth in pages, how the State is rebuilt (`RESTORES`), and the
    snapshot used with its depth in pages (None: none)."""

    depth: int
    restored_by: str
    loaded: prefix.LoadedSnapshot | None
    snapshot_depth: int | None


class PrefixCache:
    """Listed pages, snapshot tiers and hit planning for one device cache.

    Args:
      holder: the object whose `cache` attribute is the device cache (the Engine).
      replay_pages: R in pages (see the module docstring).
      snapshot_every_pages: also snapshot every this many pages (None: only at the last full
        page of every prompt).
      device_snapshots, host_snapshots, snapshot_dir, disk_snapshots, disk_bytes: the
        snapshot tiers (`prefix.SnapshotStore`; errors about the directory name
        `snapshot_dir`).

    Attributes:
      index: the `prefix.PrefixIndex` of listed pages.
      snapshots: the `prefix.SnapshotStore`.
      stats: pages_evicted, pages_loaded (from disk), snapshots_taken.
    """

    def __init__(self, holder: CacheHolder, *, replay_pages: int,
                 snapshot_every_pages: int | None, device_snapshots: int, host_snapshots: int,
                 snapshot_dir: str | os.PathLike | None, disk_snapshots: int | None,
                 disk_bytes: int | None):
        self._holder = holder
        self.geometry: CacheConfig = holder.cache.geometry
        self.replay_pages = replay_pages
        self.snapshot_every_pages = snapshot_every_pages
        self.index = prefix.PrefixIndex()
        self.snapshots = prefix.SnapshotStore(
            jax.eval_shape(lambda c: pools.snapshot_state(c, 0), holder.cache),
            device_snapshots=device_snapshots, host_snapshots=host_snapshots,
            directory=snapshot_dir, disk_snapshots=disk_snapshots, disk_bytes=disk_bytes,
            page_contents=self._chain_contents, directory_name="snapshot_dir")
        self.stats = dict.fromkeys(("pages_evicted", "pages_loaded", "snapshots_taken"), 0)

    @property
    def _cache(self) -> Cache:
        return self._holder.cache

    @_cache.setter
    def _cache(self, cache: Cache) -> None:
        self._holder.cache = cache

    def _padded(self, page_ids: Sequence[int], size: int | None = None) -> jax.Array:
        ids = np.full((size or self.geometry.num_pages,), -1, np.int32)
        ids[:len(page_ids)] = page_ids
        return jnp.asarray(ids)

    def prompt_digests(self, prompt: np.ndarray, namespace: bytes) -> list[bytes]:
        """The digests a prompt can hit: its full pages, the last token left out (it is always
        computed, for the first logits)."""
        P = self.geometry.page_tokens
        return prefix.chain_digests(prompt[:(len(prompt) - 1) // P * P], P, namespace)

    # --- admission --------------------------------------------------------------------------------

    def plan(self, digests: list[bytes], pages_needed: int, reserved: int, *,
             disk: bool = True) -> Plan | None:
        """How a request whose prompt has `digests` is admitted: the hit and how its State is
        rebuilt, with the pages it needs made free by eviction. `pages_needed`: the pages
        the request holds at its full length; `reserved`: pages the running requests still
        need. None when the pool cannot hold it now (nothing changed). `disk`: a disk
        snapshot deeper than the index's chain may bring its pages."""
        memory = len(self.index.match(digests))
        snap_depth = None
        for j in range(len(digests), 0, -1):
            tier = self.snapshots.tier_of(digests[j - 1])
            if tier is not None and (j <= memory or (disk and tier == "disk")):
                snap_depth = j
                break
        depth, restored_by = memory, "none"
        if snap_depth is not None and snap_depth >= memory:
            depth, restored_by = snap_depth, "snapshot"
        elif snap_depth is not None and (memory - snap_depth <= self.replay_pages
                                         or memory < self.replay_pages):
            restored_by = "snapshot+replay"
        elif memory >= self.replay_pages:
            snap_depth, restored_by = None, "replay" if memory else "none"
        else:
            snap_depth, depth, restored_by = None, 0, "recompute" if memory else "none"
        loaded_pages = depth - memory
        need = reserved + pages_needed - depth + loaded_pages
        keep = frozenset(digests[:min(depth, memory)])
        refcount = np.asarray(pools.refcounts(self._cache))
        free = int(pools.free_pages(self._cache))
        if free + self.index.evictable(refcount, keep) < need:
            return self.plan(digests, pages_needed, reserved, disk=False) if loaded_pages \
                else None
        if free < need:
            self._evict(need - free, keep)
        if snap_depth is None:
            return Plan(depth, restored_by, None, None)
        loaded = self.snapshots.get(digests[snap_depth - 1])
        if loaded is None:  # a file that could not be read or was bad: plan without it
            return self.plan(digests, pages_needed, reserved, disk=disk)
        return Plan(depth, restored_by, loaded, snap_depth)

    def enter(self, req: Entry, digests: list[bytes], plan: Plan) -> None:
        """Attaches the hit's pages to the request's slot (loading a disk snapshot's pages
        first) and rebuilds its State, or sets the replay that does."""
        P = self.geometry.page_tokens
        if plan.loaded is not None and plan.loaded.pages is not None:
            memory = len(self.index.match(digests[:plan.depth]))
            if memory < plan.depth:
                self._load(digests, memory, plan.loaded)
        pages = self.index.match(digests[:plan.depth])
        if plan.depth:
            self._cache = _attach(self._cache, jnp.int32(req.slot),
                                  self._padded(pages, self.geometry.max_pages_per_seq),
                                  jnp.int32(plan.depth))
        b = plan.depth * P
        req.length = req.cached = b
        req.digests = list(digests[:plan.depth])
        req.restored_by = plan.restored_by
        if plan.loaded is not None:
            state = plan.loaded.state
            if plan.snapshot_depth != plan.depth:
                state = state.replace(length=np.int32(b))
            self._cache = _restore(self._cache, jnp.int32(req.slot), state)
            req.snapshot_tier = plan.loaded.tier
            req.replay_at, req.replay_end = plan.snapshot_depth * P, b
        elif plan.depth:
            req.replay_at, req.replay_end = b - self.replay_pages * P, b
        req.replayed = req.replay_end - req.replay_at

    def _load(self, digests: list[bytes], memory: int, loaded: prefix.LoadedSnapshot) -> None:
        """Writes a disk snapshot's pages past the index's chain into fresh pages, listed."""
        depth = len(loaded.record.chain)
        M = self.geometry.max_pages_per_seq
        contents = {}
        for name, x in loaded.pages.items():
            padded = np.zeros((x.shape[0], M) + x.shape[2:], x.dtype)
            padded[:, :depth - memory] = x[:, memory:depth]
            contents[name] = jnp.asarray(padded)
        self._cache, ids = _load_pages(self._cache, contents, jnp.int32(depth - memory))
        ids = np.asarray(ids)
        for j in range(memory, depth):
            self.index.add(digests[j], digests[j - 1] if j else None, int(ids[j - memory]))
        self.stats["pages_loaded"] += depth - memory

    # --- after a step -----------------------------------------------------------------------------

    def record(self, req: Entry, table: np.ndarray, *, prompt_end: bool) -> None:
        """Lists the request's new full pages (`table`: the page table after the step) and
        snapshots its State at a boundary the policy asks for. `prompt_end`: the step ran a
        prefill chunk of the request (the last full page of its prompt may end there)."""
        self._list_pages(req, table)
        self._maybe_snapshot(req, prompt_end=prompt_end)

    def _list_pages(self, req: Entry, table: np.ndarray) -> None:
        """Lists the request's full pages in the index (a reference each for the index, taken
        before a page is listed, and given back if listing it fails)."""
        P = self.geometry.page_tokens
        full = req.length // P
        if full <= len(req.digests) and all(d in self.index for d in req.digests):
            return
        req.digests += prefix.chain_digests(req.tokens[:full * P], P, req.namespace,
                                            first=len(req.digests),
                                            previous=req.digests[-1] if req.digests else b"")
        new = [int(table[req.slot, j]) for j in range(full) if req.digests[j] not in self.index]
        if new:
            self._cache = _hold(self._cache, self._padded(new))
        try:
            for j, digest in enumerate(req.digests[:full]):
                self.index.add(digest, req.digests[j - 1] if j else None,
                               int(table[req.slot, j]))
        except BaseException:
            listed = set(self.index.pages().values())
            unlisted = [p for p in new if p not in listed]
            if unlisted and not pools.is_deleted(self._cache):
                self._cache = _drop(self._cache, self._padded(unlisted))
            raise

    def _maybe_snapshot(self, req: Entry, *, prompt_end: bool) -> None:
        P = self.geometry.page_tokens
        b = req.length
        if b % P or not b:
            return
        k = b // P
        last_of_prompt = prompt_end and k == len(req.prompt) // P
        every = self.snapshot_every_pages is not None and k % self.snapshot_every_pages == 0
        if not (last_of_prompt or every):
            return
        record = prefix.SnapshotRecord(req.digests[k - 1], b, tuple(req.digests[:k]))
        if self.snapshots.tier_of(record.key) is None:
            self.stats["snapshots_taken"] += 1
        self.snapshots.put(record, _snapshot(self._cache, jnp.int32(req.slot)))

    def _chain_contents(self, record: prefix.SnapshotRecord) -> dict | None:
        """The Classical contents of a snapshot's chain pages, while the index lists them."""
        if not all(d in self.index for d in record.chain):
            return None
        pages = [self.index.page(d) for d in record.chain]
        contents = _read_pages(self._cache, self._padded(pages, self.geometry.max_pages_per_seq))
        return {k: np.asarray(v)[:, :len(record.chain)] for k, v in contents.items()}

    # --- eviction, clearing, flushing -------------------------------------------------------------

    def _evict(self, n_pages: int, keep: frozenset) -> None:
        refcount = np.asarray(pools.refcounts(self._cache))
        dropped = self.index.evict(n_pages, refcount, keep)
        if dropped:
            self.stats["pages_evicted"] += sum(1 for p in dropped if refcount[p] == 1)
            self._cache = _drop(self._cache, self._padded(dropped))

    def clear(self, *, disk: bool = False) -> None:
        """Drops every listed page (the index's references) and the device and host
        snapshots (with `disk`, the snapshot files too). Pages live requests hold stay."""
        pages = self.index.clear()
        if pages:
            self._cache = _drop(self._cache, self._padded(pages))
        self.snapshots.clear(disk=disk)

    def flush(self) -> int:
        """Writes every device and host snapshot to the disk tier (`SnapshotStore.flush`)."""
        return self.snapshots.flush()

    def reserved_pages(self, running: Sequence) -> int:
        """Pages the running requests (each with `total_pages` and `length`) still need to
        reach their full length."""
        P = self.geometry.page_tokens
        return sum(r.total_pages - pages_for(r.length, P) for r in running)


__all__ = ["RESTORES", "CacheHolder", "Entry", "Plan", "PrefixCache"]
