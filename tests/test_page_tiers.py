"""Cold pages: listed pages leave the device pool for the host tier, then the disk tier, and
come back on a hit (`v4kv_jax.prefix.tiers`, through the Engine's prefix cache).

Every request is held to a cold run (tests/test_engine.py); between steps everything no live
request or the index owns is NaN, and every page's refcount equals its holders (page tables
and the index).
"""

from __future__ import annotations

import errno
import os
import re
import warnings

import numpy as np
import pytest

from v4kv_jax import prefix
from v4kv_jax.prefix import tiers as page_tiers
from v4kv_jax.testing import synthetic

from faults import FaultyDirectory
from test_engine import BASE, P, assert_same, cold, engine

# Eight conversations of 4 full pages each (5 held while they run) through a pool of 24: the
# first ones' pages must leave the device for the later ones.
PROMPTS = [BASE[i * 20:i * 20 + 520] for i in range(8)]


def check_refcounts(eng) -> None:
    table = np.asarray(eng.cache.pages.page_table)
    want = np.bincount(table[table >= 0], minlength=eng.geometry.num_pages)
    for page in eng.index.pages().values():
        want[page] += 1
    np.testing.assert_array_equal(np.asarray(eng.cache.pages.refcount), want)
    assert int(eng.cache.pages.num_free) == int(np.sum(want == 0))


def generate(eng, prompt, salt, max_new_tokens=1):
    """One request, stepped by hand: after every step the pool's unowned rows are NaN."""
    rid = eng.add_request(prompt, max_new_tokens, cache_salt=salt)
    while True:
        outputs = {o.request_id: o for o in eng.step()}
        check_refcounts(eng)
        eng.cache = synthetic.poison_unowned(eng.cache, held_pages=list(eng.index.pages().values()))
        if rid in outputs:
            return outputs[rid]


def converse(eng, n=8):
    for i in range(n):
        generate(eng, PROMPTS[i], f"conversation-{i}")


def digests(eng, prompt, salt):
    return eng.prefix_cache.prompt_digests(np.asarray(prompt), prefix.salt_namespace(
        eng.fingerprint, salt))


def test_cold_pages_go_down_the_tiers_and_come_back_exact(tmp_path):
    eng = engine(host_pages=4, snapshot_dir=tmp_path, device_snapshots=0, host_snapshots=0,
                 disk_snapshots=0)  # no snapshots: a hit's State is replayed
    converse(eng)
    report = eng.memory_report()
    stats = report.stats
    assert report.cold_pages["host"][0] == 4 and report.cold_pages["disk"][0] >= 4
    assert stats["pages_evicted"] >= 8 and stats["pages_to_disk"] >= 4
    assert stats["pages_dropped"] == 0 and "Cold pages: host 4" in report.format()
    tiers = [[eng.prefix_cache.cold.tier_of(d) if d not in eng.index else "device"
              for d in digests(eng, prompt, f"conversation-{i}")]
             for i, prompt in enumerate(PROMPTS)]
    assert tiers[0] == ["disk"] * 4  # the least recently used conversation went furthest
    assert tiers[-1] == ["device"] * 4
    # Those on the host first (a hit makes room by demoting others, which may push them on).
    order = sorted(range(len(PROMPTS)), key=lambda i: ("host" not in tiers[i], i))
    assert "host" in tiers[order[0]]
    for i in order:  # each exact, from whichever tiers its pages are on
        prompt = PROMPTS[i] + [7]
        out = generate(eng, prompt, f"conversation-{i}", 3)
        assert out.cached_tokens == 4 * P and out.restored_by == "replay"
        assert sum(out.cached_from.values()) == 4 * P
        if i == order[0]:
            assert out.cached_from["host"] == P * tiers[i].count("host")
        assert_same(out, cold(eng, prompt, 3))
    stats = eng.memory_report().stats
    assert stats["pages_from_disk"] >= 4 and stats["pages_from_host"] >= 1
    assert len([n for n in os.listdir(tmp_path) if n.endswith(page_tiers.SUFFIX)]) == \
        stats["pages_to_disk"]  # a page is written once
    eng.clear_prefix_cache(disk=True)
    assert os.listdir(tmp_path) == [] and int(eng.cache.pages.num_free) == 24


def test_without_a_disk_tier_pages_fall_off_the_host_tier(tmp_path):
    eng = engine(host_pages=2)
    converse(eng, 7)
    stats = eng.memory_report().stats
    assert stats["pages_to_host"] >= 4 and stats["pages_dropped"] >= 2
    out = generate(eng, PROMPTS[0] + [5], "conversation-0", 2)
    assert out.cached_tokens == 0  # its first page fell off: nothing to hit
    assert_same(out, cold(eng, PROMPTS[0] + [5], 2))


def test_snapshots_share_the_page_files_of_their_chain(tmp_path):
    eng = engine(snapshot_every_pages=1, device_snapshots=0, host_snapshots=0,
                 snapshot_dir=tmp_path)
    eng.generate([PROMPTS[0]], 1)
    names = os.listdir(tmp_path)
    # Snapshots at pages 1 to 4, each naming its chain: 4 page files, not 1 + 2 + 3 + 4.
    assert sorted(n.split(".")[1] for n in names) == ["v4page"] * 4 + ["v4snap"] * 4


@pytest.mark.parametrize("damage", ["corrupt", "missing", "another page's"])
def test_a_bad_or_missing_page_file_costs_its_pages_never_wrong_data(tmp_path, damage):
    """A page file that cannot be read, is corrupt, or is a valid file of another page under
    this page's name (copied in a shared directory) is refused: the page is recomputed."""
    eng = engine(host_pages=0, snapshot_dir=tmp_path, device_snapshots=0, host_snapshots=0,
                 disk_snapshots=0)
    converse(eng, 7)
    chain = digests(eng, PROMPTS[0], "conversation-0")
    assert [eng.prefix_cache.cold.tier_of(d) for d in chain] == ["disk"] * 4
    bad = 0 if damage == "missing" else 2
    path = os.path.join(tmp_path, chain[bad].hex() + page_tiers.SUFFIX)
    if damage == "corrupt":
        raw = open(path, "rb").read()
        open(path, "wb").write(raw[:-9] + bytes([raw[-9] ^ 1]) + raw[-8:])
        said = rf"page file {re.escape(path)} is unusable \(checksum mismatch"
    elif damage == "another page's":  # the next page's file, intact, under this one's name
        other = open(os.path.join(tmp_path, chain[bad + 1].hex() + page_tiers.SUFFIX),
                     "rb").read()
        assert other != open(path, "rb").read()
        open(path, "wb").write(other)
        said = (rf"page file {re.escape(path)} is unusable \(holds key "
                rf"{chain[bad + 1].hex()[:12]}\.\.\., not its name's\)")
    else:
        os.remove(path)
        said = rf"page file {re.escape(path)} could not be read \(ENOENT"
    prompt = PROMPTS[0] + [3]
    with pytest.warns(RuntimeWarning, match=said):
        out = generate(eng, prompt, "conversation-0", 3)
    # The pages before the bad one hit (2 pages: replayed), or none (recomputed).
    assert out.cached_tokens == (0 if damage == "missing" else 2 * P)
    assert_same(out, cold(eng, prompt, 3))
    assert not os.path.exists(path) and eng.prefix_cache.cold.tier_of(chain[bad]) is None


@pytest.mark.parametrize("fault", ["full disk", "read-only"])
def test_a_disk_that_takes_no_page_loses_only_hits(tmp_path, monkeypatch, fault):
    faults = FaultyDirectory(monkeypatch, tmp_path)
    if fault == "read-only":
        faults.read_only()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        eng = engine(host_pages=0, snapshot_dir=tmp_path)
        if fault == "full disk":
            faults.arm("write", errno.ENOSPC)
        converse(eng, 7)
        out = generate(eng, PROMPTS[0] + [2], "conversation-0", 3)
        want = cold(eng, PROMPTS[0] + [2], 3)
    said = [str(w.message) for w in record]
    if fault == "full disk":
        assert any("page file" in m and "ENOSPC" in m for m in said), said
        assert eng.memory_report().stats["pages_dropped"] >= 4
    else:
        assert any("is read-only" in m for m in said), said
    assert eng.prefix_cache.cold.count("disk") == 0 and out.cached_tokens == 0
    assert_same(out, want)
    assert [n for n in os.listdir(tmp_path) if not n.startswith(".")] == []


def test_host_pages_is_checked_by_name():
    with pytest.raises(ValueError, match=r"host_pages: expected an integer in \[0, inf\]; "
                                         r"got -1"):
        engine(host_pages=-1)
    with pytest.raises(TypeError, match=r"host_pages: expected an integer; got '4'"):
        engine(host_pages="4")
