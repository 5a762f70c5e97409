"""The data shards of an Engine: one `Shard` per device of its mesh (one without a mesh), each
with its own cache, slot table and prefix cache; `Shards`, this process's shards, with what
the Engine reads and does across them.

Slot s of shard i is row i * max_slots + s of a step's batch and of the global cache
(`v4kv_jax.mesh`); a shard's cache, slot ids and page ids are its own. Under
`jax.distributed` every process holds the shards of its own devices (`Shards.owners`: the
process of each shard) and the processes exchange what the others need (`mesh.exchange`):
the flags of a step, the memory reports.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Sequence

import numpy as np

from v4kv_jax import mesh as meshes
from v4kv_jax import pools, prefix
from v4kv_jax.config import AttentionConfig, CacheConfig
from v4kv_jax.pools import Cache
from v4kv_jax.prefix import tiers as page_tiers
from v4kv_jax.prefix.cache import PrefixCache
from v4kv_jax.serve.manager import PoolExhaustedError, SlotFlaggedError, SlotTable, slot_tables
from v4kv_jax.serve.request import EngineReport, Request


class Shard:
    """One data shard of an Engine: the cache on its device, its slot table and its prefix
    cache (listed pages, snapshots, host and disk tiers of its own).

    Attributes:
      index: the shard's place on the mesh (0 without one).
      cache: the shard's cache (slot and page ids local to it).
      table: its `SlotTable`.
      prefix_cache: its `PrefixCache`.
    """

    def __init__(self, index: int, cache: Cache, table: SlotTable):
        self.index, self.cache, self.table = index, cache, table
        self.prefix_cache: PrefixCache

    def __repr__(self) -> str:
        return f"Shard({self.index}, {len(self.table)} requests)"


class Shards(Sequence[Shard]):
    """This process's shards of `geometry` over `mesh` (None: one shard, index 0), in index
    order: indexing and iterating give `Shard`s (their prefix caches are set by the Engine).

    Attributes:
      mesh: the mesh, or None.
      owners: the process holding each shard of the mesh, by shard index (every process's).
    """

    def __init__(self, model: AttentionConfig, geometry: CacheConfig,
                 mesh: meshes.Mesh | None):
        self.mesh = mesh
        caches = ({0: pools.init_cache(model, geometry)} if mesh is None else
                  meshes.split(meshes.init_cache(model, geometry, mesh), mesh))
        tables = slot_tables(geometry, mesh)
        self._shards = [Shard(i, cache, tables[i]) for i, cache in caches.items()]
        self._by_index = {s.index: s for s in self._shards}
        self.owners = [0] if mesh is None else [meshes.owner(mesh, i) for i in range(mesh.size)]

    def __getitem__(self, i):
        return self._shards[i]

    def __len__(self) -> int:
        return len(self._shards)

    def __repr__(self) -> str:
        return f"Shards({self._shards})"

    def open_prefix_caches(self, snapshot_dir: str | os.PathLike | None, **options) -> None:
        """Gives every shard its `PrefixCache` of `options`; with several shards, shard i
        keeps its files in `snapshot_dir`/shard-i."""
        several = self.mesh is not None and self.mesh.size > 1
        for shard in self._shards:
            shard.prefix_cache = PrefixCache(
                shard, snapshot_dir=(os.path.join(snapshot_dir, f"shard-{shard.index}")
                                     if several and snapshot_dir is not None else snapshot_dir),
                **options)

    def holds(self, index: int) -> bool:
        """Whether shard `index` is this process's."""
        return index in self._by_index

    def shard(self, index: int) -> Shard:
        """This process's shard `index`."""
        return self._by_index[index]

    @property
    def count(self) -> int:
        """Shards of the whole mesh (every process's)."""
        return len(self.owners)

    @property
    def geometry(self) -> CacheConfig:
        """The geometry of one shard."""
        return self._shards[0].cache.geometry

    def row(self, req: Request) -> int:
        """A running request's row in a step's batch and in `cache` (its slot's)."""
        return req.shard * self.geometry.max_slots + req.slot

    @property
    def cache(self) -> Cache:
        """The cache; with a mesh, the global view of the shards' caches. Setting it replaces
        every shard's."""
        if self.mesh is None:
            return self._shards[0].cache
        return meshes.assemble({s.index: s.cache for s in self._shards}, self.mesh)

    @cache.setter
    def cache(self, cache: Cache) -> None:
        self.set_caches({0: cache} if self.mesh is None else meshes.split(cache, self.mesh))

    def set_caches(self, caches: dict[int, Cache]) -> None:
        """Gives each shard of `caches` (shard index -> cache) its new cache."""
        for i, cache in caches.items():
            self._by_index[i].cache = cache

    def lost(self) -> bool:
        """Whether a shard's cache was deleted (donated to a program that failed)."""
        return any(pools.is_deleted(s.cache) for s in self._shards)

    def only(self, what: str) -> Shard:
        """The one shard, for the Engine's attribute `what`; AttributeError with several."""
        if len(self._shards) != 1:
            raise AttributeError(f"Engine.{what}: the engine runs {len(self._shards)} shards, "
                                 f"each with its own; use engine.shards[i].{what}")
        return self._shards[0]

    def release(self, req: Request) -> None:
        """Gives a request's slot (and the pages only it holds) back; the shard's owner
        releases it, the other processes only forget where it ran."""
        if req.slot is not None:
            if self.holds(req.shard):
                shard = self._by_index[req.shard]
                shard.cache = shard.table.release(shard.cache, req.id)
            req.slot = req.shard = None

    def commit(self, caches: dict[int, Cache], running: Iterable[Request]
               ) -> tuple[dict[int, str], PoolExhaustedError | SlotFlaggedError | None]:
        """Gives each shard its cache after a step (shard index -> cache) and reads the
        slots the step flagged: (request id -> flag, every process's; the error of the first
        flagged shard, or None)."""
        running = list(running)
        error, flags = None, {}
        for i, cache in caches.items():
            mine = [r for r in running if r.shard == i]
            found = self._by_index[i].table.flag_error(cache, [r.id for r in mine],
                                                       {r.id: r.length + 1 for r in mine})
            if found is not None:
                error = error or found
                flags.update(found.flags)
        self.set_caches(caches)
        if self.mesh is not None and meshes.any_process(bool(flags)):  # every process's
            flags = {k: v for every in meshes.exchange(flags) for k, v in every.items()}
            error = error or SlotFlaggedError(flags)
        return flags, error

    def record(self, advanced: Iterable[tuple[Request, str]],
               tables: dict[int, np.ndarray]) -> None:
        """After a step, each request that appended tokens (with the phase it ran) lists its
        full pages and snapshots its State in its shard's prefix cache (`tables`: shard index
        -> page table after the step); the shard's owner does it."""
        for req, phase in advanced:
            if self.holds(req.shard):
                self._by_index[req.shard].prefix_cache.record(
                    req, tables[req.shard], prompt_end=phase == "prefill")

    def warmup(self) -> None:
        """Runs every shard's slot and pool-transfer programs once on nothing (compiling
        them; the caches do not change)."""
        for shard in self._shards:
            shard.cache = shard.table.warmup(shard.cache)
            shard.prefix_cache.warmup()

    # --- reports ----------------------------------------------------------------------------------

    def report(self, stats: dict[str, int]) -> EngineReport:
        """The memory report with the engine's admission `stats`; with several shards the
        totals, and each shard's report in `shards`. With several processes every process
        must call it (the shards' reports are exchanged)."""
        reports = [self._report(s, stats) for s in self._shards]
        if self.mesh is not None:
            reports = [r for every in meshes.exchange(reports) for r in every]
        if len(reports) == 1:
            return reports[0]
        first = reports[0]

        def tiers(field):
            return {t: tuple(sum(getattr(r, field)[t][k] for r in reports) for k in (0, 1))
                    for t in getattr(first, field)}

        dirs = [r.snapshot_dir for r in reports if r.snapshot_dir]
        return dataclasses.replace(
            first, cache=pools.total_report([r.cache for r in reports]),
            **{f: sum(getattr(r, f) for r in reports) for f in (
                "pages_in_requests", "pages_shared", "pages_indexed", "pages_cached_only")},
            snapshots=tiers("snapshots"), cold_pages=tiers("cold_pages"),
            stats={k: (v if k in stats else sum(r.stats[k] for r in reports))
                   for k, v in first.stats.items()},
            snapshot_dir="; ".join(f"shard {r_i}: {d}" for r_i, d in enumerate(dirs)) or None,
            shards=tuple(reports))

    def _report(self, shard: Shard, stats: dict[str, int]) -> EngineReport:
        table = np.asarray(pools.page_table(shard.cache))
        holders = np.bincount(table[table >= 0], minlength=self.geometry.num_pages)
        pc = shard.prefix_cache
        listed = set(pc.index.pages().values())
        disk, page_disk = pc.snapshots.disk, pc.cold.disk
        return EngineReport(
            cache=pools.memory_report(shard.cache),
            pages_in_requests=int(np.sum(holders > 0)),
            pages_shared=int(np.sum(holders > 1)),
            pages_indexed=len(listed),
            pages_cached_only=sum(1 for p in listed if holders[p] == 0),
            snapshots={t: (pc.snapshots.count(t), pc.snapshots.nbytes(t)) for t in prefix.TIERS},
            cold_pages={t: (pc.cold.count(t), pc.cold.nbytes(t)) for t in page_tiers.TIERS},
            stats={**stats, **pc.stats, **pc.cold.stats,
                   "snapshots_dropped": pc.snapshots.dropped,
                   "disk_errors": 0 if disk is None else disk.errors + page_disk.errors},
            snapshot_dir=None if disk is None else (
                f"{disk.describe()}; page files: {len(page_disk)}, {page_disk.nbytes:,} B, "
                f"{page_disk.errors} filesystem errors caught"),
        )


__all__ = ["Shard", "Shards"]
