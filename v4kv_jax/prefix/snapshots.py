"""Boundary snapshots of the State in three tiers.

  SnapshotStore   digest of the page before a boundary -> the State at that boundary
                  (`pools.StateSnapshot`): a bounded device tier, demoted by LRU to a bounded
                  host tier (numpy) and to a directory (one checksummed file per snapshot,
                  naming its chain, whose pages are files of `prefix.tiers`, so that another
                  process hits; `prefix.disk` catches every filesystem fault there)
"""

from __future__ import annotations

import collections
import dataclasses
import os
from collections.abc import Callable

import jax
import numpy as np

from v4kv_jax import checks
from v4kv_jax.pools import StateSnapshot
from v4kv_jax.prefix.disk import SnapshotDirectory, pack, unpack

_FORMAT = b"V4KV-SNAPSHOT-3\n"  # 3: the State as lane-dense planes (`pools.Lanes`)
TIERS = ("device", "host", "disk")


# --- boundary snapshots ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SnapshotRecord:
    """What a snapshot is of: the State after `length` tokens (a page boundary), keyed by the
    digest of the page before it; `chain` is the digests of every page up to it (the last one
    is `key`)."""

    key: bytes
    length: int
    chain: tuple[bytes, ...]


@dataclasses.dataclass
class LoadedSnapshot:
    """A snapshot found in a tier: the State (jax arrays from the device tier, numpy from the
    host and disk tiers)."""

    record: SnapshotRecord
    state: StateSnapshot
    tier: str


def _nbytes(snapshot: StateSnapshot) -> int:
    return int(sum(np.dtype(x.dtype).itemsize * int(np.prod(x.shape))
                   for x in jax.tree.leaves(snapshot)))


DISK_BYTES = 4 << 30  # the disk tier's default bound


class SnapshotStore:
    """Boundary snapshots in three tiers, each an LRU: device (up to `device_snapshots`), host
    numpy (up to `host_snapshots`), and files in a directory (`prefix_disk.SnapshotDirectory`:
    up to `disk_snapshots` files and `disk_bytes` bytes). A snapshot is put on the device
    tier; the least recently used one of a full tier moves down a tier (to disk only when
    `store_chain` puts its chain's pages on disk), and one falling off the last tier is dropped.
    `flush()` also writes every device and host snapshot to disk (they stay where they are),
    so another process over the directory hits them.

    A file holds a sha256 of its payload and its chain's digests; the pages' contents are
    files of the page tiers (`page_tiers.PageTiers`), one per page whatever number of
    snapshots refer to it. A file that is
    truncated, corrupt, of another format, or whose arrays do not fit the snapshot structure
    is reported with `warnings.warn` naming it, deleted (unless the directory is read-only),
    and never used. Filesystem faults are the directory's to catch: a snapshot that cannot be
    written stays off disk, one that cannot be read is a miss; neither raises.

    Args:
      template: a `StateSnapshot` of the cache (arrays or `jax.ShapeDtypeStruct`s): the
        structure, shapes and dtypes every snapshot must have.
      device_snapshots, host_snapshots: tier sizes (>= 0).
      directory: the disk tier's folder (made if missing; read-only if it cannot be written),
        or None for no disk tier. Files already there are found by name and checked when read.
      disk_snapshots: disk tier size in files (>= 0), or None for no bound on the count.
      disk_bytes: disk tier size in bytes (>= 0; default `DISK_BYTES`), or None for no bound.
      store_chain: record -> True when every page of the record's chain is on disk afterwards
        (written there when it was not), False when one could not be.
      directory_name: the argument name that errors about `directory` use.
    """

    def __init__(self, template: StateSnapshot, *, device_snapshots: int, host_snapshots: int,
                 directory: str | os.PathLike | None = None, disk_snapshots: int | None = None,
                 disk_bytes: int | None = DISK_BYTES,
                 store_chain: Callable[[SnapshotRecord], bool] | None = None,
                 directory_name: str = "directory"):
        self.device_snapshots = checks.integer("device_snapshots", device_snapshots, lo=0)
        self.host_snapshots = checks.integer("host_snapshots", host_snapshots, lo=0)
        if disk_snapshots is not None:
            disk_snapshots = checks.integer("disk_snapshots", disk_snapshots, lo=0)
        if disk_bytes is not None:
            disk_bytes = checks.integer("disk_bytes", disk_bytes, lo=0)
        self.disk: SnapshotDirectory | None = None
        if directory is not None:
            self.disk = SnapshotDirectory(directory, max_files=disk_snapshots,
                                          max_bytes=disk_bytes, name=directory_name)
        self._structure = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                                       template)
        self._store_chain = store_chain
        self._tiers: dict[str, collections.OrderedDict] = {
            t: collections.OrderedDict() for t in TIERS[:2]}
        self._bytes = {t: 0 for t in TIERS[:2]}
        self._dropped = 0

    @property
    def dropped(self) -> int:
        """Snapshots that fell off the last tier, could not be stored there, or were evicted
        from the disk tier."""
        return self._dropped + (0 if self.disk is None else self.disk.evicted)

    # --- queries ----------------------------------------------------------------------------------

    def tier_of(self, key: bytes) -> str | None:
        """The highest tier holding `key`, or None."""
        if key in self._tiers["device"]:
            return "device"
        if key in self._tiers["host"]:
            return "host"
        return "disk" if self.disk is not None and key in self.disk else None

    def count(self, tier: str) -> int:
        if tier == "disk":
            return 0 if self.disk is None else len(self.disk)
        return len(self._tiers[tier])

    def nbytes(self, tier: str) -> int:
        """Bytes the tier holds (disk: file sizes)."""
        if tier == "disk":
            return 0 if self.disk is None else self.disk.nbytes
        return self._bytes[tier]

    def records(self, tier: str) -> list[SnapshotRecord]:
        """What the device or host tier holds, least recently used first."""
        checks.one_of("tier", tier, TIERS[:2])
        return [record for record, _ in self._tiers[tier].values()]

    # --- put and get ------------------------------------------------------------------------------

    def put(self, record: SnapshotRecord, state: StateSnapshot) -> None:
        """Keeps `state` (the State after record.length tokens) on the device tier (or the
        first tier with room for one), demoting least recently used ones; a key held already
        is only marked used."""
        tier = self.tier_of(record.key)
        if tier == "disk":
            self.disk.touch(record.key)
        elif tier is not None:
            self._tiers[tier].move_to_end(record.key)
        else:
            self._insert("device", record, state)

    def get(self, key: bytes) -> LoadedSnapshot | None:
        """The snapshot of `key` from whichever tier holds it (marked used there), or None
        (also for a file that cannot be read or is bad, which is reported)."""
        tier = self.tier_of(key)
        if tier is None:
            return None
        if tier != "disk":
            self._tiers[tier].move_to_end(key)
            record, state = self._tiers[tier][key]
            return LoadedSnapshot(record, state, tier)
        raw = self.disk.read(key)
        if raw is None:
            return None
        try:
            return _decode(key, raw, self._structure)
        except (ValueError, KeyError, TypeError) as e:
            self.disk.discard(key, str(e))
            return None

    def flush(self) -> int:
        """Writes every device and host snapshot that is not on disk yet (least recently used
        first) to the disk tier, with its chain's pages; they also stay where they are.
        Returns how many were written (0 without a disk tier, or read-only; a snapshot whose
        pages left the pool, or whose write fails, is skipped: the latter warned)."""
        written = 0
        if self.disk is None or self.disk.read_only is not None:
            return 0
        for tier in ("host", "device"):
            for record, state in list(self._tiers[tier].values()):
                if record.key not in self.disk:
                    written += self._to_disk(record, state)
        return written

    def drop_where(self, stale: Callable[[SnapshotRecord], bool]) -> int:
        """Drops the device and host snapshots whose record is `stale` (e.g. a page of its
        chain is no longer kept anywhere, so it could never be restored); counted in
        `dropped`. Returns how many were dropped."""
        n = 0
        for tier in ("device", "host"):
            for key in [k for k, (record, _) in self._tiers[tier].items() if stale(record)]:
                _, state = self._tiers[tier].pop(key)
                self._bytes[tier] -= _nbytes(state)
                n += 1
        self._dropped += n
        return n

    def clear(self, *, disk: bool = False) -> None:
        """Drops the device and host tiers (and with `disk`, deletes the files)."""
        for tier in ("device", "host"):
            self._tiers[tier].clear()
            self._bytes[tier] = 0
        if disk and self.disk is not None:
            self.disk.clear()

    def _insert(self, tier: str, record: SnapshotRecord, state: StateSnapshot) -> None:
        if tier == "disk":
            if not self._to_disk(record, state):
                self._dropped += 1
            return
        limit = self.device_snapshots if tier == "device" else self.host_snapshots
        below = TIERS[TIERS.index(tier) + 1]
        if limit == 0:
            self._insert(below, record, state)
            return
        if tier == "host":
            state = jax.tree.map(np.asarray, state)
        self._tiers[tier][record.key] = (record, state)
        self._bytes[tier] += _nbytes(state)
        while len(self._tiers[tier]) > limit:
            _, (old_record, old_state) = self._tiers[tier].popitem(last=False)
            self._bytes[tier] -= _nbytes(old_state)
            self._insert(below, old_record, old_state)

    def _to_disk(self, record: SnapshotRecord, state: StateSnapshot) -> bool:
        """Stores the snapshot as a file; True when the disk tier holds it afterwards."""
        if self.disk is None or self._store_chain is None:
            return False
        if record.key in self.disk:
            self.disk.touch(record.key)
            return True
        if self.disk.read_only is not None or self.disk.max_files == 0:
            return False
        if not self._store_chain(record):  # no pages to restore it with
            return False
        return self.disk.write(record.key, _encode(record, state))


# --- the file format ------------------------------------------------------------------------------


def _encode(record: SnapshotRecord, state: StateSnapshot) -> bytes:
    arrays = {f"state{jax.tree_util.keystr(p)}": np.asarray(x)
              for p, x in jax.tree_util.tree_leaves_with_path(state)}
    return pack(_FORMAT, {"key": record.key.hex(), "length": record.length,
                          "chain": [d.hex() for d in record.chain]}, arrays)


def _decode(key: bytes, raw: bytes, structure) -> LoadedSnapshot:
    """Parses a snapshot file; ValueError (or KeyError / TypeError) when it is not one of
    `key` with `structure`'s arrays."""
    header, arrays = unpack(_FORMAT, raw)
    if header["key"] != key.hex():
        raise ValueError(f"holds key {header['key'][:12]}..., not its name's")
    leaves = []
    for p, want in jax.tree_util.tree_leaves_with_path(structure):
        x = arrays.pop(f"state{jax.tree_util.keystr(p)}")
        if x.shape != want.shape or x.dtype != np.dtype(want.dtype):
            raise ValueError(f"state{jax.tree_util.keystr(p)} is {x.dtype}{list(x.shape)}, "
                             f"not {np.dtype(want.dtype)}{list(want.shape)}")
        leaves.append(x)
    state = jax.tree.unflatten(jax.tree.structure(structure), leaves)
    chain = tuple(bytes.fromhex(d) for d in header["chain"])
    if not chain or chain[-1] != key or arrays:
        raise ValueError("its chain does not end at its key, or it holds other arrays")
    return LoadedSnapshot(SnapshotRecord(key, int(header["length"]), chain), state, "disk")


__all__ = ["DISK_BYTES", "TIERS", "LoadedSnapshot", "SnapshotRecord", "SnapshotStore"]
