"""Full pages that left the device pool: a host tier and a disk tier of the prefix cache.

A listed page (`prefix.PrefixIndex`) that only the index holds is cold. When the pool needs
room, the prefix cache moves its contents here instead of forgetting them (demotion): to the
host tier, a bounded LRU of numpy arrays, and from there, least recently used first, to the
disk tier, one checksummed file per page named by its chain digest (`<digest hex>.v4page`,
written once, whatever number of snapshots refer to it). A request whose prompt hits pages
here gets them back in fresh device pages before its first step (promotion).

A page's contents never change (a full page's compressed entries are final), and its digest
names every token before it, so a page found in any tier is the page: the tiers need no
bookkeeping between them, and a copy may be in two at once (a promoted page stays on host and
disk until it falls off them).

The disk tier is a `prefix_disk.SnapshotDirectory` with its own suffix in the snapshot
directory: every filesystem fault there is caught, warned about and costs a miss (the page's
tokens are recomputed); a truncated, corrupt or foreign file is named in a warning, deleted
and never used.
"""

from __future__ import annotations

import collections
import os

import jax
import numpy as np

from v4kv_jax import checks
from v4kv_jax.prefix.disk import SnapshotDirectory, pack, unpack

_FORMAT = b"V4KV-PAGE-2\n"  # 2: 16-bit rows as uint32 word pairs
SUFFIX = ".v4page"
TIERS = ("host", "disk")


def _nbytes(contents: dict) -> int:
    return int(sum(x.nbytes for x in contents.values()))


class PageTiers:
    """The host and disk tiers of full pages, by digest.

    Args:
      template: compressor name -> a `jax.ShapeDtypeStruct` (or array) [n_kind_layers,
        P // m, width] of one page's contents (as `pools.read_pages` gives them, one page).
      host_pages: the host tier's size in pages (>= 0; 0: pages go straight to disk).
      directory: the disk tier's folder (None: no disk tier), shared with the snapshot files.
      disk_bytes: the disk tier's bound in bytes (None: unbounded).
      directory_name: the argument name errors about `directory` use.

    Attributes:
      disk: the `SnapshotDirectory` of page files, or None.
      stats: pages_to_host, pages_to_disk (files written), pages_dropped (a page that fell
        off the last tier or could not be stored there).
    """

    def __init__(self, template: dict, *, host_pages: int,
                 directory: str | os.PathLike | None = None, disk_bytes: int | None = None,
                 directory_name: str = "directory"):
        self.host_pages = checks.integer("host_pages", host_pages, lo=0)
        self._template = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in template.items()}
        self._host: collections.OrderedDict[bytes, dict] = collections.OrderedDict()
        self._host_bytes = 0
        self.disk: SnapshotDirectory | None = None
        if directory is not None:
            self.disk = SnapshotDirectory(
                directory, max_files=None, max_bytes=disk_bytes, name=directory_name,
                suffix=SUFFIX, noun="page", fallback="its tokens are recomputed",
                announce=False)
        self.stats = dict.fromkeys(("pages_to_host", "pages_to_disk", "pages_dropped"), 0)

    # --- queries ----------------------------------------------------------------------------------

    def tier_of(self, digest: bytes) -> str | None:
        """The highest tier holding the page of `digest`, or None."""
        if digest in self._host:
            return "host"
        return "disk" if self.disk is not None and digest in self.disk else None

    def available(self, digests) -> int:
        """How many of `digests`, from the first, some tier holds."""
        n = 0
        for d in digests:
            if self.tier_of(d) is None:
                break
            n += 1
        return n

    @property
    def keeps_pages(self) -> bool:
        """Whether a page put here is kept (a host tier, or a writable disk tier)."""
        return bool(self.host_pages) or (self.disk is not None and self.disk.read_only is None)

    def count(self, tier: str) -> int:
        if tier == "host":
            return len(self._host)
        return 0 if self.disk is None else len(self.disk)

    def nbytes(self, tier: str) -> int:
        if tier == "host":
            return self._host_bytes
        return 0 if self.disk is None else self.disk.nbytes

    # --- put and get ------------------------------------------------------------------------------

    def put(self, digest: bytes, contents: dict) -> None:
        """Keeps a page that leaves the device: on the host tier, the least recently used
        ones moving to disk past `host_pages` (a page held already is only marked used)."""
        if digest in self._host:
            self._host.move_to_end(digest)
            return
        if not self.host_pages:
            if not self.store(digest, contents):
                self.stats["pages_dropped"] += 1
            return
        contents = {k: np.asarray(v) for k, v in contents.items()}
        self._host[digest] = contents
        self._host_bytes += _nbytes(contents)
        self.stats["pages_to_host"] += 1
        while len(self._host) > self.host_pages:
            old, old_contents = self._host.popitem(last=False)
            self._host_bytes -= _nbytes(old_contents)
            if not self.store(old, old_contents):
                self.stats["pages_dropped"] += 1

    def touch(self, digest: bytes) -> None:
        """Marks the page used now on the tier holding it."""
        if digest in self._host:
            self._host.move_to_end(digest)
        elif self.disk is not None:
            self.disk.touch(digest)

    def flush(self) -> int:
        """Writes every host-tier page that is not on disk yet (they stay on host); returns
        how many files were written."""
        return sum(self.store(d, c) for d, c in list(self._host.items())
                   if self.disk is not None and d not in self.disk)

    def store(self, digest: bytes, contents: dict) -> bool:
        """Writes the page's file unless the disk tier has it; True when it holds it
        afterwards (False: no disk tier, read-only, or the write failed, which is warned)."""
        if self.disk is None:
            return False
        if digest in self.disk:
            self.disk.touch(digest)
            return True
        if self.disk.read_only is not None:
            return False
        arrays = {name: np.asarray(x) for name, x in contents.items()}
        if self.disk.write(digest, pack(_FORMAT, {"key": digest.hex()}, arrays)):
            self.stats["pages_to_disk"] += 1
            return True
        return False

    def get(self, digest: bytes) -> dict | None:
        """The page's contents (numpy) from the highest tier holding it, marked used there;
        None when no tier does, or its file cannot be read or is bad (warned; the file is
        then forgotten, and deleted when it is bad)."""
        tier = self.tier_of(digest)
        if tier == "host":
            self._host.move_to_end(digest)
            return self._host[digest]
        if tier is None:
            return None
        raw = self.disk.read(digest)
        if raw is None:
            return None
        try:
            return self._decode(digest, raw)
        except (ValueError, KeyError, TypeError) as e:
            self.disk.discard(digest, str(e))
            return None

    def _decode(self, digest: bytes, raw: bytes) -> dict:
        header, arrays = unpack(_FORMAT, raw)
        if header.get("key") != digest.hex():
            raise ValueError(f"holds key {str(header.get('key'))[:12]}..., not its name's")
        if set(arrays) != set(self._template):
            raise ValueError(f"holds arrays {sorted(arrays)}, not {sorted(self._template)}")
        for name, want in self._template.items():
            x = arrays[name]
            if x.shape != want.shape or x.dtype != np.dtype(want.dtype):
                raise ValueError(f"{name} is {x.dtype}{list(x.shape)}, not "
                                 f"{np.dtype(want.dtype)}{list(want.shape)}")
        return arrays

    def clear(self, *, disk: bool = False) -> None:
        """Drops the host tier (and with `disk`, deletes the page files)."""
        self._host.clear()
        self._host_bytes = 0
        if disk and self.disk is not None:
            self.disk.clear()


__all__ = ["SUFFIX", "TIERS", "PageTiers"]
