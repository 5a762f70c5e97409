"""The Engine's prefix cache: which full pages stay listed, which boundary snapshots are kept
on which tier, and how a new request's hit is planned and entered.

`PrefixCache` joins the host-side pieces of `prefix.index` (the page index), `prefix.snapshots`
(the snapshot tiers) and `prefix.tiers` (the host and disk tiers of full pages) to the device cache
through the pool transfers (`pools.hold_pages`, `drop_pages`, `read_pages`, `load_pages`,
`attach_prefix`, `snapshot_state`, `restore_state`). It never schedules: the Engine decides
which request runs and calls it to

  plan     find a request's hit (the longest chain of its prompt's full pages listed on the
           device or kept on the host or disk tier) and how its State is rebuilt at the hit
           boundary b (`RESTORES`), making room by LRU eviction of pages only the index
           holds (each moved to the host tier, then to disk, before it leaves the pool);
           None when the pool cannot hold the request now
  enter    promote the hit's pages from the host and disk tiers into fresh pages, attach
           the hit's pages to the request's slot and restore its State (or set the replay
           that rebuilds it)
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

from v4kv_jax import pools, programs
from v4kv_jax.config import CacheConfig
from v4kv_jax.pools import Cache
from v4kv_jax.pools.paging import pages_for
from v4kv_jax.prefix import tiers as page_tiers
from v4kv_jax.prefix.index import PrefixIndex, chain_digests
from v4kv_jax.prefix.snapshots import LoadedSnapshot, SnapshotRecord, SnapshotStore

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
    cached_from: dict[str, int]


@dataclasses.dataclass(frozen=True)
class Plan:
    """An admission: hit depth in pages, how the State is rebuilt (`RESTORES`), the
    snapshot used with its depth in pages (None: none), and the hit's last pages that come
    from the host and disk tiers (read already)."""

    depth: int
    restored_by: str
    loaded: LoadedSnapshot | None
    snapshot_depth: int | None
    promoted: tuple[tuple[str, dict], ...] = ()  # (tier, contents) of the pages promoted


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
      host_pages: the host tier's size in pages (`page_tiers.PageTiers`; its disk tier is
        `snapshot_dir`, bounded by `disk_bytes` apart from the snapshot files).

    Attributes:
      index: the `prefix.PrefixIndex` of listed pages.
      snapshots: the `prefix.SnapshotStore`.
      cold: the `page_tiers.PageTiers` (the host and disk tiers of pages).
      stats: pages_evicted (pages that left the device), pages_from_host, pages_from_disk
        (promoted), snapshots_taken.
    """

    def __init__(self, holder: CacheHolder, *, replay_pages: int,
                 snapshot_every_pages: int | None, device_snapshots: int, host_snapshots: int,
                 host_pages: int, snapshot_dir: str | os.PathLike | None,
                 disk_snapshots: int | None, disk_bytes: int | None):
        self._holder = holder
        self.geometry: CacheConfig = holder.cache.geometry
        self.replay_pages = replay_pages
        self.snapshot_every_pages = snapshot_every_pages
        self.index = PrefixIndex()
        one = jax.eval_shape(lambda c: pools.read_pages(c, jnp.zeros((1,), jnp.int32)),
                             holder.cache)
        self._page_template = {k: jax.ShapeDtypeStruct(v.shape[:1] + v.shape[2:], v.dtype)
                               for k, v in one.items()}
        self.snapshots = SnapshotStore(
            jax.eval_shape(lambda c: pools.snapshot_state(c, 0), holder.cache),
            device_snapshots=device_snapshots, host_snapshots=host_snapshots,
            directory=snapshot_dir, disk_snapshots=disk_snapshots, disk_bytes=disk_bytes,
            store_chain=self._store_chain, directory_name="snapshot_dir")
        self.cold = page_tiers.PageTiers(
            self._page_template, host_pages=host_pages, directory=snapshot_dir,
            disk_bytes=disk_bytes, directory_name="snapshot_dir")
        self.stats = dict.fromkeys(("pages_evicted", "pages_from_host", "pages_from_disk",
                                    "snapshots_taken"), 0)
        # Slots whose request was running at the last `clear`: they list and snapshot nothing
        # until a new request enters the slot.
        self._cleared_slots: set[int] = set()

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
        return chain_digests(prompt[:(len(prompt) - 1) // P * P], P, namespace)

    def warmup(self) -> None:
        """Runs every pool transfer once on nothing (slot and page ids -1, no pages), as the
        calls below make them, so that each is compiled before a request needs it; the
        cache's contents do not change."""
        M, none = self.geometry.max_pages_per_seq, jnp.int32(-1)
        self._cache = _hold(self._cache, self._padded([]))
        self._cache = _drop(self._cache, self._padded([]))
        self._cache = _attach(self._cache, none, self._padded([], M), jnp.int32(0))
        self._cache = _restore(self._cache, none, _snapshot(self._cache, none))
        _read_pages(self._cache, self._padded([], M))
        contents = {name: jnp.zeros((want.shape[0], M) + want.shape[1:], want.dtype)
                    for name, want in self._page_template.items()}
        self._cache, _ = _load_pages(self._cache, contents, jnp.int32(0))

    # --- admission --------------------------------------------------------------------------------

    def hit_pages(self, digests: list[bytes]) -> int:
        """How many full pages of `digests` a request would find on some tier now (nothing
        is marked used): what places a request on the shard that holds its prefix."""
        device = len(self.index.match(digests, touch=False))
        return device + self.cold.available(digests[device:])

    def plan(self, digests: list[bytes], pages_needed: int, reserved: int) -> Plan | None:
        """How a request whose prompt has `digests` is admitted: the hit and how its State is
        rebuilt, with the pages it needs made free by eviction and the hit's pages that are
        on the host or disk tier read for promotion. `pages_needed`: the pages the request
        holds at its full length; `reserved`: pages the running requests still need. None
        when the pool cannot hold it now (nothing but evictions changed)."""
        promote = True
        while True:  # each pass either plans or forgets a page or snapshot that failed
            device = len(self.index.match(digests))
            listed = device + (self.cold.available(digests[device:]) if promote else 0)
            snap_depth = None
            for j in range(listed, 0, -1):
                if self.snapshots.tier_of(digests[j - 1]) is not None:
                    snap_depth = j
                    break
            depth, restored_by = listed, "none"
            if snap_depth == listed:
                restored_by = "snapshot"
            elif snap_depth is not None and (listed - snap_depth <= self.replay_pages
                                             or listed < self.replay_pages):
                restored_by = "snapshot+replay"
            elif listed >= self.replay_pages:
                snap_depth, restored_by = None, "replay" if listed else "none"
            else:
                snap_depth, depth, restored_by = None, 0, "recompute" if listed else "none"
            shared = min(depth, device)
            need = reserved + pages_needed - shared
            keep = frozenset(digests[:shared])
            refcount = np.asarray(pools.refcounts(self._cache))
            free = int(pools.free_pages(self._cache))
            if free + self.index.evictable(refcount, keep) < need:
                if depth > device and promote:
                    promote = False
                    continue
                return None
            promoted = []  # read before evicting: demotions may push them down a tier
            for d in digests[shared:depth]:
                tier, contents = self.cold.tier_of(d), self.cold.get(d)
                if contents is None:
                    break
                promoted.append((tier, contents))
            if len(promoted) < depth - shared:
                continue  # a page file that could not be read or was bad: forgotten
            if free < need:
                self._evict(need - free, keep)
            loaded = None
            if snap_depth is not None:
                loaded = self.snapshots.get(digests[snap_depth - 1])
                if loaded is None:
                    continue  # the same for a snapshot file
            return Plan(depth, restored_by, loaded, snap_depth, tuple(promoted))

    def enter(self, req: Entry, digests: list[bytes], plan: Plan) -> None:
        """Promotes the hit's pages from the host and disk tiers into fresh pages, attaches
        the hit's pages to the request's slot and rebuilds its State, or sets the replay that
        does."""
        P = self.geometry.page_tokens
        self._cleared_slots.discard(req.slot)
        if plan.promoted:
            self._promote(digests[:plan.depth], plan.promoted)
        pages = self.index.match(digests[:plan.depth])
        if plan.depth:
            self._cache = _attach(self._cache, jnp.int32(req.slot),
                                  self._padded(pages, self.geometry.max_pages_per_seq),
                                  jnp.int32(plan.depth))
        b = plan.depth * P
        req.length = req.cached = b
        req.digests = list(digests[:plan.depth])
        req.restored_by = plan.restored_by
        tiers = [tier for tier, _ in plan.promoted]
        req.cached_from = {t: P * tiers.count(t) for t in page_tiers.TIERS}
        req.cached_from["device"] = b - P * len(tiers)
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

    def _promote(self, digests: list[bytes], promoted: tuple) -> None:
        """Writes the promoted pages (the last len(promoted) of `digests`) into fresh pages
        and lists them."""
        M = self.geometry.max_pages_per_seq
        first = len(digests) - len(promoted)
        contents = {}
        for name, want in self._page_template.items():
            padded = np.zeros((want.shape[0], M) + want.shape[1:], want.dtype)
            for j, (_, page) in enumerate(promoted):
                padded[:, j] = page[name]
            contents[name] = jnp.asarray(padded)
        self._cache, ids = _load_pages(self._cache, contents, jnp.int32(len(promoted)))
        ids = np.asarray(ids)
        for j in range(first, len(digests)):
            self.index.add(digests[j], digests[j - 1] if j else None, int(ids[j - first]))
        for tier, _ in promoted:
            self.stats[f"pages_from_{tier}"] += 1

    # --- after a step -----------------------------------------------------------------------------

    def record(self, req: Entry, table: np.ndarray, *, prompt_end: bool) -> None:
        """Lists the request's new full pages (`table`: the page table after the step) and
        snapshots its State at a boundary the policy asks for. `prompt_end`: the step ran a
        prefill chunk of the request (the last full page of its prompt may end there). A
        request that was running at a `clear` lists and snapshots nothing."""
        if req.slot in self._cleared_slots:
            return
        self._list_pages(req, table)
        self._maybe_snapshot(req, prompt_end=prompt_end)

    def _list_pages(self, req: Entry, table: np.ndarray) -> None:
        """Lists the request's full pages in the index (a reference each for the index, taken
        before a page is listed, and given back if listing it fails)."""
        P = self.geometry.page_tokens
        full = req.length // P
        if full <= len(req.digests) and all(d in self.index for d in req.digests):
            return
        req.digests += chain_digests(req.tokens[:full * P], P, req.namespace,
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
        record = SnapshotRecord(req.digests[k - 1], b, tuple(req.digests[:k]))
        if self.snapshots.tier_of(record.key) is None:
            self.stats["snapshots_taken"] += 1
        self.snapshots.put(record, _snapshot(self._cache, jnp.int32(req.slot)))

    def _read(self, page_ids: Sequence[int]) -> list[dict]:
        """The contents (numpy, per page) of pool pages, read max_pages_per_seq at a time."""
        M = self.geometry.max_pages_per_seq
        out = []
        for at in range(0, len(page_ids), M):
            part = page_ids[at:at + M]
            read = _read_pages(self._cache, self._padded(part, M))
            read = {k: np.asarray(v) for k, v in read.items()}
            out += [{k: v[:, j] for k, v in read.items()} for j in range(len(part))]
        return out

    def _device_contents(self, digests: Sequence[bytes]) -> list[dict]:
        """The contents (numpy, per page) of listed pages, read from the pool."""
        return self._read([self.index.page(d) for d in digests])

    def _store_chain(self, record: SnapshotRecord) -> bool:
        """Puts every page of a snapshot's chain on disk (the files missing there, from the
        pool or the host tier); False when one is in no tier or cannot be written."""
        disk = self.cold.disk
        if disk is None:
            return False
        missing = [d for d in record.chain if d not in disk]
        on_device = [d for d in missing if d in self.index]
        contents = dict(zip(on_device, self._device_contents(on_device), strict=True))
        for d in missing:
            page = contents[d] if d in contents else self.cold.get(d)
            if page is None or not self.cold.store(d, page):
                return False
        for d in record.chain:
            self.cold.touch(d)
        return all(d in disk for d in record.chain)  # none trimmed by the later ones

    # --- eviction, clearing, flushing -------------------------------------------------------------

    def _evict(self, n_pages: int, keep: frozenset) -> None:
        """Frees pages by dropping the index's least recently used links, each page moved to
        the host or disk tier first (demotion) unless a tier holds it already."""
        refcount = np.asarray(pools.refcounts(self._cache))
        dropped = self.index.evict(n_pages, refcount, keep)
        if not dropped:
            return
        self.stats["pages_evicted"] += sum(1 for _, p in dropped if refcount[p] == 1)
        if self.cold.keeps_pages:
            for d, _ in dropped:
                self.cold.touch(d)
            new = [(d, p) for d, p in dropped if self.cold.tier_of(d) is None]
            for (d, _), page in zip(new, self._read([p for _, p in new]), strict=True):
                self.cold.put(d, page)
        self._cache = _drop(self._cache, self._padded([p for _, p in dropped]))
        self._drop_stale_snapshots()

    def _kept(self, digest: bytes) -> bool:
        """Whether the page of `digest` is listed on the device or kept on the host or disk
        tier (a hit could reach it)."""
        return digest in self.index or self.cold.tier_of(digest) is not None

    def _drop_stale_snapshots(self) -> int:
        """Drops the device and host snapshots with a page of their chain kept nowhere: no
        hit reaches their boundary any more, they would only hold memory."""
        return self.snapshots.drop_where(
            lambda record: not all(self._kept(d) for d in record.chain))

    def clear(self, *, running: Sequence[int], disk: bool = False) -> None:
        """Drops every listed page (the index's references), the host tier's pages and the
        device and host snapshots (with `disk`, the page and snapshot files too).

        A clear is a barrier: nothing computed before it is listed or snapshotted after it.
        The requests in the `running` slots keep their pages (their own references) and run
        to the end, but list no page and take no snapshot any more, not even of pages they
        fill later (those depend on the State computed before the clear); their pages are
        freed when they finish. A request entered into such a slot afterwards lists as
        usual. Without `disk`, the files already on disk stay (a later hit may use them)."""
        pages = self.index.clear()
        if pages:
            self._cache = _drop(self._cache, self._padded(pages))
        self.cold.clear(disk=disk)
        self.snapshots.clear(disk=disk)
        self._cleared_slots.update(int(s) for s in running)

    def flush(self) -> int:
        """Writes every device and host snapshot (`SnapshotStore.flush`) and every listed
        page of the pool and the host tier that is not on disk yet to the disk tier; returns
        how many files were written."""
        before = self.cold.stats["pages_to_disk"]
        written = self.snapshots.flush()
        disk = self.cold.disk
        if disk is None or disk.read_only is not None:
            return written
        listed = [d for d in self.index.pages() if d not in disk]
        for d, page in zip(listed, self._device_contents(listed), strict=True):
            self.cold.store(d, page)
        self.cold.flush()
        return written + self.cold.stats["pages_to_disk"] - before

    def reserved_pages(self, running: Sequence) -> int:
        """Pages the running requests (each with `total_pages` and `length`) still need to
        reach their full length."""
        P = self.geometry.page_tokens
        return sum(r.total_pages - pages_for(r.length, P) for r in running)


__all__ = ["RESTORES", "CacheHolder", "Entry", "Plan", "PrefixCache"]
