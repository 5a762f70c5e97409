"""Prefix sharing, host side without a model: the keys (`prefix.chain_digests`), the index and
its LRU eviction, the snapshot tiers and their files, and the pool helpers the index holds
pages with (`pools.hold_pages` / `drop_pages`, `read_pages` / `load_pages`)."""

from __future__ import annotations

import os
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import v4kv_jax as v4
from v4kv_jax import pools, prefix

from conftest import GEOMETRY, MODEL, new_cache

P = 128
FP = prefix.fingerprint("engine A")


# --- keys --------------------------------------------------------------------------------


def test_chain_digests_name_whole_prefixes():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 1000, 3 * P + 5)
    ns = prefix.salt_namespace(FP, None)
    d = prefix.chain_digests(tokens, P, ns)
    assert len(d) == 3 and all(len(x) == 32 for x in d)  # full pages only
    # The same first pages give the same digests; a change in page 0 changes every digest.
    other = tokens.copy()
    other[2 * P + 7] += 1
    assert prefix.chain_digests(other, P, ns)[:2] == d[:2]
    assert prefix.chain_digests(other, P, ns)[2] != d[2]
    changed = tokens.copy()
    changed[3] += 1
    assert not set(prefix.chain_digests(changed, P, ns)) & set(d)
    # Incremental = all at once.
    assert d[:1] + prefix.chain_digests(tokens, P, ns, first=1, previous=d[0]) == d
    # Salts and fingerprints are namespaces: None, "" and b"" differ, as do fingerprints.
    keys = {prefix.chain_digests(tokens, P, prefix.salt_namespace(fp, salt))[0]
            for fp in (FP, prefix.fingerprint("engine B"))
            for salt in (None, "", b"", "tenant", b"tenant")}
    assert len(keys) == 10
    # A page granularity is part of the key: 2 x 128 tokens never name one 256-token page.
    assert prefix.chain_digests(tokens, 2 * P, ns)[0] not in d
    with pytest.raises(TypeError, match=r"cache_salt: expected None, a str or bytes; got int"):
        prefix.salt_namespace(FP, 7)


def test_fingerprint_parts_are_length_prefixed():
    assert prefix.fingerprint("ab", "c") != prefix.fingerprint("a", "bc")
    tree = {"w": np.ones((2, 3), np.float32)}
    assert prefix.tree_digest(tree) == prefix.tree_digest({"w": jnp.ones((2, 3))})
    assert prefix.tree_digest(tree) != prefix.tree_digest({"w": np.ones((3, 2), np.float32)})
    bumped = {"w": np.ones((2, 3), np.float32)}
    bumped["w"][1, 2] = np.nextafter(np.float32(1), np.float32(2))
    assert prefix.tree_digest(tree) != prefix.tree_digest(bumped)


# --- the index ---------------------------------------------------------------------------


def _chain(n, tag):
    return [bytes([tag, j]) * 16 for j in range(n)]


def test_index_longest_chain_and_lru_eviction():
    index = prefix.PrefixIndex()
    a, b = _chain(3, 1), _chain(2, 2)
    for j, d in enumerate(a):
        assert index.add(d, a[j - 1] if j else None, page=j)
    for j, d in enumerate(b):
        index.add(d, b[j - 1] if j else None, page=10 + j)
    assert not index.add(a[0], None, page=99)  # listed already: kept as it was
    assert index.page(a[0]) == 0
    with pytest.raises(ValueError, match="is not listed"):
        index.add(_chain(5, 3)[4], _chain(5, 3)[3], page=5)
    assert index.match(a[:2] + [b"x" * 32] + a[2:]) == [0, 1]  # per page, up to a miss
    assert index.match(b + [b"y" * 32]) == [10, 11]
    refcount = np.zeros(16, np.int32)
    refcount[[0, 1, 2, 10, 11]] = 1
    refcount[1] = 2  # a live request holds page 1 (so it holds page 0 as well, see below)
    refcount[0] = 2
    assert index.evictable(refcount) == 3
    # LRU: chain a was used before chain b, but pages 0 and 1 are held: a[2] goes first.
    assert index.evict(1, refcount) == [(a[2], 2)]
    assert index.evict(1, refcount, keep=frozenset(b)) == []
    assert index.evict(2, refcount) == [(b[1], 11), (b[0], 10)]  # deepest first
    assert len(index) == 2 and sorted(index.clear()) == [0, 1] and len(index) == 0


def test_evicting_a_parent_drops_children_held_by_a_live_request():
    """A page listed under a chain whose earlier page is another (evictable) copy loses only
    the index's reference when that parent is evicted: its holder keeps it."""
    index = prefix.PrefixIndex()
    a = _chain(2, 1)
    index.add(a[0], None, page=4)
    index.add(a[1], a[0], page=7)
    refcount = np.zeros(8, np.int32)
    refcount[4], refcount[7] = 1, 2
    assert sorted(p for _, p in index.evict(1, refcount)) == [4, 7]
    assert len(index) == 0


# --- snapshot tiers ----------------------------------------------------------------------


def _snapshot(value):
    cache = new_cache()
    snap = v4.snapshot_state(cache, 0)
    return jax.tree.map(lambda x: jnp.full_like(x, value), snap)


def _store(tmp_path, store_chain, **sizes):
    template = jax.eval_shape(lambda c: v4.snapshot_state(c, 0), new_cache())
    return prefix.SnapshotStore(template, directory=tmp_path, store_chain=store_chain, **sizes)


def _record(tag, pages=2):
    chain = tuple(_chain(pages, tag))
    return prefix.SnapshotRecord(chain[-1], pages * P, chain)


def _chain_on_disk(record):
    """A store_chain whose chains are always on disk (their pages are not this test's)."""
    return True


def test_tiers_demote_by_lru_and_files_round_trip(tmp_path):
    store = _store(tmp_path, _chain_on_disk, device_snapshots=1, host_snapshots=1, disk_snapshots=2)
    records = [_record(t) for t in range(1, 6)]
    for r in records[:3]:
        store.put(r, _snapshot(r.chain[0][0]))
    assert [store.tier_of(r.key) for r in records[:3]] == ["disk", "host", "device"]
    assert all(isinstance(x, np.ndarray)  # host: numpy
               for x in jax.tree.leaves(store.get(records[1].key).state.window))
    store.put(records[1], _snapshot(0))  # held: only marked used
    assert store.count("host") == 1 and store.nbytes("device") == store.nbytes("host") > 0
    loaded = store.get(records[0].key)
    assert loaded.tier == "disk" and loaded.record == records[0]
    assert all((x == 1).all() for x in jax.tree.leaves(loaded.state.window))
    assert int(loaded.state.length) == 1
    for r in records[3:]:
        store.put(r, _snapshot(r.chain[0][0]))
    # Disk holds 2: records[0] (read before records[1] and [2] were written) fell off.
    assert [store.tier_of(r.key) for r in records] == [None, "disk", "disk", "host", "device"]
    assert store.count("disk") == 2 and store.dropped == 1
    names = sorted(os.listdir(tmp_path))
    assert all(n.endswith(".v4snap") for n in names) and len(names) == 2
    # A new store over the directory finds the files (another process, the same way).
    again = _store(tmp_path, _chain_on_disk, device_snapshots=1, host_snapshots=1)
    assert sorted(r.key for r in records if again.tier_of(r.key) == "disk") == sorted(
        bytes.fromhex(n.split(".")[0]) for n in names)


def test_drop_where_drops_device_and_host_snapshots_and_counts_them(tmp_path):
    store = _store(tmp_path, _chain_on_disk, device_snapshots=2, host_snapshots=2)
    records = [_record(t) for t in range(1, 5)]
    for r in records:
        store.put(r, _snapshot(r.chain[0][0]))
    assert store.records("host") == records[:2] and store.records("device") == records[2:]
    gone = {records[1].chain[0], records[2].chain[1]}  # one page of a host and a device chain
    assert store.drop_where(lambda r: bool(gone & set(r.chain))) == 2
    assert store.records("host") == [records[0]] and store.records("device") == [records[3]]
    assert store.dropped == 2 and store.nbytes("host") == store.nbytes("device") > 0
    assert store.drop_where(lambda r: False) == 0
    with pytest.raises(ValueError, match=r"tier: expected one of \('device', 'host'\); got "
                                         r"'disk'"):
        store.records("disk")


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty", "other_key"])
def test_a_bad_file_is_reported_deleted_and_never_used(tmp_path, damage):
    store = _store(tmp_path, _chain_on_disk, device_snapshots=0, host_snapshots=0)
    r, other = _record(1), _record(2)
    store.put(r, _snapshot(1.0))
    store.put(other, _snapshot(2.0))
    path = os.path.join(tmp_path, r.key.hex() + ".v4snap")
    raw = open(path, "rb").read()
    if damage == "flip":
        raw = raw[:-40] + bytes([raw[-40] ^ 1]) + raw[-39:]
    elif damage == "truncate":
        raw = raw[:len(raw) // 2]
    elif damage == "empty":
        raw = b""
    else:  # a valid file under another snapshot's name
        raw = open(os.path.join(tmp_path, other.key.hex() + ".v4snap"), "rb").read()
    open(path, "wb").write(raw)
    with pytest.warns(RuntimeWarning, match=rf"snapshot file {re.escape(path)} is unusable"):
        assert store.get(r.key) is None
    assert not os.path.exists(path) and store.tier_of(r.key) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert store.get(other.key).record == other


def test_store_argument_checks(tmp_path):
    template = jax.eval_shape(lambda c: v4.snapshot_state(c, 0), new_cache())
    with pytest.raises(ValueError, match=r"device_snapshots: expected an integer in \[0, inf\]; "
                                         r"got -1"):
        prefix.SnapshotStore(template, device_snapshots=-1, host_snapshots=0)
    with pytest.raises(TypeError, match=r"host_snapshots: expected an integer; got 1.5"):
        prefix.SnapshotStore(template, device_snapshots=1, host_snapshots=1.5)
    with pytest.raises(ValueError, match=r"disk_snapshots: expected an integer in \[0, inf\]"):
        prefix.SnapshotStore(template, device_snapshots=1, host_snapshots=1, disk_snapshots=-2)
    with pytest.raises(TypeError, match=r"directory: expected a path .*; got int"):
        prefix.SnapshotStore(template, device_snapshots=1, host_snapshots=1, directory=3)
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ValueError, match=r"directory: expected a directory .*which is a file"):
        prefix.SnapshotStore(template, device_snapshots=1, host_snapshots=1, directory=f)


# --- pool helpers ------------------------------------------------------------------------


def test_hold_drop_read_load_pages():
    cache = new_cache(slots=[0])
    rng = np.random.default_rng(1)
    contents = {s.name: rng.standard_normal(
        (len(MODEL.layers_of(s.kind)), 3, P // s.ratio, s.width)).astype(np.float32)
        for s in cache.specs}
    cache, ids = pools.load_pages(cache, contents, 2)
    ids = np.asarray(ids)
    assert ids.tolist()[2] == -1 and len(set(ids[:2].tolist())) == 2
    refcount = np.asarray(cache.pages.refcount)
    assert refcount[ids[:2]].tolist() == [1, 1]
    assert int(cache.pages.num_free) == GEOMETRY.num_pages - 2
    back = pools.read_pages(cache, ids)
    for name, x in contents.items():
        np.testing.assert_array_equal(np.asarray(back[name])[:, :2], x[:, :2])
        assert (np.asarray(back[name])[:, 2] == 0).all()  # the -1 id reads zeros
    # A slot attaches held pages as a prefix; the holder's reference keeps them after it.
    cache = pools.attach_prefix(cache, 0, ids, 2)
    cache = pools.hold_pages(cache, np.asarray([ids[0], -1]))
    assert np.asarray(cache.pages.refcount)[ids[:2]].tolist() == [3, 2]
    cache = pools.release_slot(cache, 0)
    cache = pools.drop_pages(cache, ids)
    assert np.asarray(cache.pages.refcount)[ids[:2]].tolist() == [1, 0]
    cache = pools.drop_pages(cache, ids[:1])
    assert (np.asarray(cache.pages.refcount) == 0).all()
    assert int(cache.pages.num_free) == GEOMETRY.num_pages
    assert sorted(np.asarray(cache.pages.free_stack).tolist()) == list(range(GEOMETRY.num_pages))
    # Inside jit a broken call changes nothing.
    bad = jax.jit(pools.drop_pages)(cache, jnp.asarray([0, 1], jnp.int32))
    for x, y in zip(jax.tree.leaves(cache), jax.tree.leaves(bad), strict=True):
        np.testing.assert_array_equal(x, y)
    taken = jax.jit(pools.load_pages)(cache, contents, jnp.int32(GEOMETRY.num_pages + 1))
    assert (np.asarray(taken[1]) == -1).all()
    assert int(taken[0].pages.num_free) == GEOMETRY.num_pages


def test_pool_helper_errors():
    cache = new_cache(slots=[0])
    with pytest.raises(ValueError, match=r"page_ids: expected pages in use \(refcount > 0\); "
                                         r"got page 3 with refcount 0"):
        pools.hold_pages(cache, [3])
    with pytest.raises(ValueError, match=r"page_ids: expected page ids in \[0, 24\) .*or -1"):
        pools.drop_pages(cache, [24])
    cache, ids = pools.load_pages(cache, pools.read_pages(cache, [0, 1]), 2)
    with pytest.raises(ValueError, match=r"page_ids: expected distinct page ids"):
        pools.hold_pages(cache, np.asarray([ids[0], ids[0]]))
    with pytest.raises(TypeError, match=r"page_ids: expected integers"):
        pools.drop_pages(cache, [0.5])
    with pytest.raises(ValueError, match=r"page_ids: expected values >= -1"):
        pools.read_pages(cache, [-2])
    contents = pools.read_pages(cache, [0])
    with pytest.raises(ValueError, match=r"n_pages: expected an integer in \[0, 1\]; got 2"):
        pools.load_pages(cache, contents, 2)
    with pytest.raises(TypeError, match=r"contents: expected a dict of the compressors"):
        pools.load_pages(cache, {"csa": contents["csa"]}, 1)
    with pytest.raises(TypeError, match=r"contents\['csa'\]: expected dtype float32"):
        pools.load_pages(cache, {**contents, "csa": contents["csa"].astype(jnp.bfloat16)}, 1)
    with pytest.raises(ValueError, match=r"contents\['hca'\]: expected shape"):
        pools.load_pages(cache, {**contents, "hca": contents["hca"][:, :, :1]}, 1)
