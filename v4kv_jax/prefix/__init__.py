"""Prefix sharing: what lets a request start from another's full pages and State.

  index       the keys of full pages (hash chains over token blocks) and `PrefixIndex`,
              digest -> the pool page holding those tokens' entries
  snapshots   `SnapshotStore`: the State at page boundaries, in a device, a host and a
              disk tier
  tiers       `PageTiers`: full pages that left the pool, on the host and on disk
  disk        `SnapshotDirectory`: the directory both disk tiers share, where every
              filesystem fault is a warning and a miss
  cache       `PrefixCache`: the policy over all of them that the Engine calls (plan a hit,
              enter it, record a request's new pages and boundaries)

Everything here is host-side bookkeeping except `cache`, which moves pages and States in and
out of the device pool through the pool transfers (`v4kv_jax.pools`).
"""

from v4kv_jax.prefix.cache import RESTORES, PrefixCache
from v4kv_jax.prefix.disk import SnapshotDirectory
from v4kv_jax.prefix.index import (
    PrefixIndex,
    chain_digests,
    fingerprint,
    salt_namespace,
    tree_digest,
)
from v4kv_jax.prefix.snapshots import (
    DISK_BYTES,
    TIERS,
    LoadedSnapshot,
    SnapshotRecord,
    SnapshotStore,
)
from v4kv_jax.prefix.tiers import PageTiers

__all__ = [
    "DISK_BYTES", "RESTORES", "TIERS", "LoadedSnapshot", "PageTiers", "PrefixCache",
    "PrefixIndex", "SnapshotDirectory", "SnapshotRecord", "SnapshotStore", "chain_digests",
    "fingerprint", "salt_namespace", "tree_digest",
]
