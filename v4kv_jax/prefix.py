"""Prefix sharing, host side and model-free: the keys of full pages, the index that finds them,
and the boundary snapshots of the State in three tiers.

  chain_digests   the key of each full page of a token sequence: a hash chain over its
                  P-token blocks, in a namespace of the engine's fingerprint (attention
                  config, cache geometry, weights, ...) and the request's cache salt
  PrefixIndex     digest -> the pool page holding those tokens' entries; the longest chain
                  of a sequence's digests is a hit (per page, any length); LRU eviction of
                  the pages only the index holds, with every deeper link that hangs on them
  SnapshotStore   digest of the page before a boundary -> the State at that boundary
                  (`pools.StateSnapshot`): a bounded device tier, demoted by LRU to a bounded
                  host tier (numpy) and to a directory (one checksummed file per snapshot,
                  naming its chain, whose pages are files of `page_tiers`, so that another
                  process hits; `prefix_disk` catches every filesystem fault there)

A digest names a whole prefix: equal digests mean equal token ids in every block before it,
under the same fingerprint and salt (sha256; Python's hash() is never used).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import os
from collections.abc import Callable, Sequence

import jax
import numpy as np

from v4kv_jax import checks
from v4kv_jax.pools import StateSnapshot
from v4kv_jax.prefix_disk import SnapshotDirectory, pack, unpack

_FORMAT = b"V4KV-SNAPSHOT-2\n"
TIERS = ("device", "host", "disk")


# --- keys -----------------------------------------------------------------------------------------


def fingerprint(*parts: bytes | str) -> bytes:
    """sha256 of `parts` (each length-prefixed, so no two part lists collide)."""
    h = hashlib.sha256(b"v4kv-prefix-fingerprint-1")
    for part in parts:
        data = part.encode() if isinstance(part, str) else bytes(part)
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.digest()


def tree_digest(tree) -> bytes:
    """sha256 of every array of a pytree: its path, dtype, shape and bytes (e.g. the weights
    of a model, hashed once)."""
    h = hashlib.sha256(b"v4kv-tree-1")
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        x = np.asarray(leaf)
        h.update(f"{jax.tree_util.keystr(path)}|{x.dtype}|{x.shape}|".encode())
        h.update(np.ascontiguousarray(x).tobytes())
    return h.digest()


def salt_namespace(engine_fingerprint: bytes, cache_salt: str | bytes | None) -> bytes:
    """The namespace of one request's keys: the engine's fingerprint and its cache salt (None,
    a str and bytes of the same text are three different salts)."""
    if cache_salt is None:
        tag = b"\x00"
    elif isinstance(cache_salt, str):
        tag = b"\x01" + cache_salt.encode()
    elif isinstance(cache_salt, bytes):
        tag = b"\x02" + cache_salt
    else:
        checks.fail("cache_salt", "None, a str or bytes", type(cache_salt).__name__, TypeError)
    return fingerprint(engine_fingerprint, tag)


def chain_digests(tokens, page_tokens: int, namespace: bytes, *, first: int = 0,
                  previous: bytes = b"") -> list[bytes]:
    """The digests of the full pages first, first + 1, ... of `tokens` (a hash chain: digest j
    covers every token of pages 0..j). `previous` is the digest of page first - 1 (b"" for
    first = 0); tokens past the last full page are not hashed."""
    ids = np.asarray(tokens, np.int64)
    out = []
    for j in range(first, len(ids) // page_tokens):
        block = ids[j * page_tokens:(j + 1) * page_tokens].astype("<i4")
        previous = hashlib.sha256(namespace + previous + block.tobytes()).digest()
        out.append(previous)
    return out


# --- the index ------------------------------------------------------------------------------------


@dataclasses.dataclass
class IndexEntry:
    page: int
    parent: bytes | None
    depth: int  # the page's position in its sequence (0 = the first page)
    last_used: int
    children: set[bytes] = dataclasses.field(default_factory=set)


class PrefixIndex:
    """digest -> the page that holds those tokens' entries, for full pages only.

    The index holds one pool reference per page it lists (the caller takes it with
    `pools.hold_pages` when `add` returns True, and gives back the pages `evict` and `clear`
    return). Every listed page's parent is listed, so each listed page is reachable by a
    lookup from the first page of its sequence.
    """

    def __init__(self):
        self._entries: dict[bytes, IndexEntry] = {}
        self._clock = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._entries

    def page(self, digest: bytes) -> int:
        return self._entries[digest].page

    def pages(self) -> dict[bytes, int]:
        """digest -> page of every listed page."""
        return {d: e.page for d, e in self._entries.items()}

    def _touch(self, digest: bytes) -> None:
        self._clock += 1
        self._entries[digest].last_used = self._clock

    def match(self, digests: Sequence[bytes], *, touch: bool = True) -> list[int]:
        """The pages of the longest prefix of `digests` that the index lists (any length,
        none included); marks them used now unless `touch` is False."""
        pages = []
        for d in digests:
            if d not in self._entries:
                break
            if touch:
                self._touch(d)
            pages.append(self._entries[d].page)
        return pages

    def add(self, digest: bytes, parent: bytes | None, page: int) -> bool:
        """Lists `page` as the page of `digest` (a full page whose previous page is `parent`,
        None for a first page); True when it is new (take a reference for the index), False
        when the digest was listed already (then only its use is recorded)."""
        if digest in self._entries:
            self._touch(digest)
            return False
        if parent is not None and parent not in self._entries:
            raise ValueError(f"parent {parent.hex()[:12]} of {digest.hex()[:12]} is not "
                             "listed: a page is listed only after the page before it")
        depth = 0 if parent is None else self._entries[parent].depth + 1
        self._entries[digest] = IndexEntry(page, parent, depth, 0)
        if parent is not None:
            self._entries[parent].children.add(digest)
        self._touch(digest)
        return True

    def _remove(self, digest: bytes) -> list[tuple[bytes, int]]:
        """Drops `digest` and every deeper link hanging on it; returns their (digest, page)."""
        entry = self._entries.pop(digest)
        if entry.parent is not None and entry.parent in self._entries:
            self._entries[entry.parent].children.discard(digest)
        dropped = [(digest, entry.page)]
        for child in list(entry.children):
            dropped += self._remove(child)
        return dropped

    def evictable(self, refcount: np.ndarray, keep: frozenset = frozenset()) -> int:
        """Pages that `evict` could free: listed pages no one but the index holds, outside
        `keep`."""
        return sum(1 for d, e in self._entries.items() if refcount[e.page] == 1 and d not in keep)

    def evict(self, n_pages: int, refcount: np.ndarray, keep: frozenset = frozenset()
              ) -> list[tuple[bytes, int]]:
        """Drops least-recently-used links whose page no one but the index holds (refcount
        1) until `n_pages` pages would be freed or none is left: the deepest links first (a
        link with no deeper link listed), so what stays is still each chain's prefix; a link
        whose deeper links are all held elsewhere goes with them (they lose only the index's
        reference). Links in `keep` (and so their ancestors' chains) stay. Returns every
        dropped link's (digest, page) (give the index's references back: a page a live
        request holds stays)."""
        dropped, freed = [], 0
        while freed < n_pages:
            idle = [(e.last_used, d) for d, e in self._entries.items()
                    if refcount[e.page] == 1 and d not in keep]
            if not idle:
                break
            leaves = [x for x in idle if not self._entries[x[1]].children]
            links = self._remove(min(leaves or idle)[1])
            freed += sum(1 for _, p in links if refcount[p] == 1)
            dropped += links
        return dropped

    def clear(self) -> list[int]:
        """Drops every link; returns their pages."""
        pages = [e.page for e in self._entries.values()]
        self._entries.clear()
        return pages


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


__all__ = ["DISK_BYTES", "TIERS", "IndexEntry", "LoadedSnapshot", "PrefixIndex",
           "SnapshotRecord", "SnapshotStore", "chain_digests", "fingerprint", "salt_namespace",
           "tree_digest"]
