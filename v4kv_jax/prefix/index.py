"""The keys of full pages and the index that finds them.

  chain_digests   the key of each full page of a token sequence: a hash chain over its
                  P-token blocks, in a namespace of the engine's fingerprint (attention
                  config, cache geometry, weights, ...) and the request's cache salt
  PrefixIndex     digest -> the pool page holding those tokens' entries; the longest chain
                  of a sequence's digests is a hit (per page, any length); LRU eviction of
                  the pages only the index holds, with every deeper link that hangs on them

A digest names a whole prefix: equal digests mean equal token ids in every block before it,
under the same fingerprint and salt (sha256; Python's hash() is never used).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence

import jax
import numpy as np

from v4kv_jax import checks

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


