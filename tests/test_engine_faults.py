"""The Engine under faults: a failing disk never corrupts or loses a request.

Every filesystem call of the disk tier is made to fail (`faults.FaultyDirectory`: open,
create, read, write with a full disk, fsync, close, rename, remove, utime, listing, a
read-only filesystem; and one real kernel failure, RLIMIT_FSIZE) while requests run, and
every host-side point of a step is made to raise. After every step, raised or not, each
running request's host length must equal its device length, and every request's tokens and
logits must equal a cold run's (greedy tokens identical, logits within 1e-5), as in
tests/test_engine.py.
"""

from __future__ import annotations

import errno
import functools
import os
import re
import resource
import signal
import subprocess
import sys
import time
import warnings

import jax
import numpy as np
import pytest

from v4kv_jax import pools, prefix
from v4kv_jax.pools.paging import pages_for
from v4kv_jax.prefix import cache as prefix_cache
from v4kv_jax.prefix import disk as prefix_disk
from v4kv_jax.serve.engine import EngineError
from v4kv_jax.serve.manager import SlotTable

from faults import FaultyDirectory
from test_engine import BASE, ROOT, P, assert_same, engine

# The workload: A writes a snapshot at 384 while E decodes; then B hits A's prefix (snapshot
# or replay) while C prefills and writes its own snapshot at 128 (with disk_snapshots=1,
# evicting A's file), so every disk operation happens inside steps with other requests.
FIRST = {"A": (BASE[:450], 2), "E": (BASE[600:620], 12)}
SECOND = {"B": (BASE[:400] + [1, 2, 3], 4), "C": (BASE[100:300] + [5], 3),
          "X": (BASE[50:306], 1)}  # X: its prompt ends on a page boundary and it then ends


@functools.cache
def _cold_engine():
    return engine()


def cold(prompt, max_new_tokens):
    (out,) = _cold_engine().generate([prompt], max_new_tokens)
    return out


class Injected(RuntimeError):
    """The fault the tests inject at host-side points."""


def check_host_matches_device(eng) -> None:
    lengths = np.asarray(pools.lengths(eng.cache))
    table = np.asarray(eng.cache.pages.page_table)
    for req in eng.scheduler.requests.values():
        if req.slot is None:
            continue
        assert lengths[req.slot] == req.length, (req.id, lengths[req.slot], req.length)
        assert int(np.sum(table[req.slot] >= 0)) == pages_for(req.length, P), req.id
    for slot in range(eng.geometry.max_slots):  # a slot no request holds is free
        if slot not in eng.table.slots.values():
            assert lengths[slot] == 0 and (table[slot] == -1).all(), slot


def run(eng, requests: dict, *, tolerate=()) -> tuple[dict, list]:
    """Adds `requests` (name -> (prompt, max_new_tokens)) and steps until all finish, checking
    the host against the device after every step; returns name -> output and the exceptions
    of `tolerate` types the steps raised."""
    ids = {eng.add_request(p, n): name for name, (p, n) in requests.items()}
    outputs, raised = {}, []
    for _ in range(200):
        if len(outputs) == len(ids):
            break
        try:
            finished = eng.step()
        except tolerate as e:
            raised.append(e)
            finished = []
        check_host_matches_device(eng)
        for out in finished:
            name = ids.get(out.request_id)
            if name is not None:
                assert name not in outputs, f"{name} returned twice"
                outputs[name] = out
    assert len(outputs) == len(ids), f"unfinished: {set(ids.values()) - set(outputs)}"
    return outputs, raised


def assert_all_cold(outputs: dict) -> None:
    for name, out in outputs.items():
        prompt, n = {**FIRST, **SECOND}[name]
        assert out.finish_reason == "length", name
        assert_same(out, cold(prompt, n))


def workload(eng, *, tolerate=()) -> tuple[dict, list]:
    first, raised = run(eng, FIRST, tolerate=tolerate)
    second, more = run(eng, SECOND, tolerate=tolerate)
    outputs = {**first, **second}
    assert_all_cold(outputs)
    return outputs, raised + more


def disk_engine(directory, **kwargs):
    kwargs = {"device_snapshots": 0, "host_snapshots": 0, "disk_snapshots": 1, **kwargs}
    return engine(snapshot_dir=directory, **kwargs)


def files_of(directory, suffix: str) -> list[str]:
    """The names of the directory's snapshot (".v4snap") or page (".v4page") files."""
    return sorted(n for n in os.listdir(directory) if n.endswith(suffix))


def messages(record) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, RuntimeWarning)]


def test_the_workload_writes_reads_and_evicts_files(tmp_path):
    """Without faults: A's snapshot is written, B hits it from disk, C's evicts it."""
    eng = disk_engine(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        outputs, _ = workload(eng)
    assert (outputs["B"].restored_by, outputs["B"].snapshot_tier) == ("snapshot", "disk")
    assert len(files_of(tmp_path, ".v4snap")) == 1
    assert eng.memory_report().stats["disk_errors"] == 0


# --- every filesystem fault ------------------------------------------------------------------

FS_FAULTS = {
    "create once (a directory briefly not writable)": ("create", errno.EACCES, 1),
    "create always": ("create", errno.EACCES, None),
    "full disk": ("write", errno.ENOSPC, None),
    "fsync": ("fsync", errno.EIO, None),
    "close": ("close", errno.EIO, None),
    "rename": ("replace", errno.EXDEV, None),
    "open for reading": ("open", errno.EIO, None),
    "read": ("read", errno.EIO, None),
    "utime": ("utime", errno.EROFS, None),
    "remove (eviction)": ("remove", errno.EACCES, None),
}


@pytest.mark.parametrize("fault", list(FS_FAULTS))
def test_a_filesystem_fault_never_fails_a_step_or_changes_a_request(tmp_path, monkeypatch,
                                                                    fault):
    op, code, times = FS_FAULTS[fault]
    eng = disk_engine(tmp_path)
    faults = FaultyDirectory(monkeypatch, tmp_path)
    if fault == "full disk":
        faults.disk_full(free_bytes=1000)  # part of the first file, then ENOSPC
    else:
        faults.arm(op, code, times)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        outputs, _ = workload(eng)
    assert faults.failures[op] >= 1, f"the {op} fault never fired"
    said = messages(record)
    name = errno.errorcode[code]
    assert any(str(tmp_path) in m and name in m for m in said), said
    report = eng.memory_report()
    assert report.stats["disk_errors"] >= 1 and "filesystem errors caught" in report.format()
    leftovers = [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]
    assert leftovers == [] or op == "remove", leftovers
    # Every file the engine lists is on disk (one it could not delete or read is no longer
    # listed), within the bound.
    on_disk = {bytes.fromhex(n.split(".")[0]) for n in os.listdir(tmp_path)
               if n.endswith(".v4snap")}
    assert set(eng.snapshots.disk.keys()) <= on_disk and eng.snapshots.count("disk") <= 1
    if times == 1:  # a fault that passes: the next file is written
        faults.disarm()
        (again,) = eng.generate([BASE[200:520] + [9]], 2)
        assert_same(again, cold(BASE[200:520] + [9], 2))
        assert eng.snapshots.count("disk") == 1


def test_a_real_write_failure_from_the_kernel(tmp_path):
    """RLIMIT_FSIZE: the kernel fails every write past 1 KiB with EFBIG (no simulation)."""
    eng = disk_engine(tmp_path)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1024, hard))
    try:
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            first, _ = run(eng, FIRST)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)
    assert any("EFBIG" in m and "not written" in m for m in messages(record)), messages(record)
    assert os.listdir(tmp_path) == []
    second, _ = run(eng, SECOND)
    assert_all_cold({**first, **second})
    assert second["B"].restored_by == "replay"  # no snapshot reached the disk


def test_a_read_only_directory_is_a_read_only_tier(tmp_path, monkeypatch):
    writer = engine(snapshot_dir=tmp_path)
    writer.generate([BASE[:450]], 2)
    writer.generate([BASE[100:400]], 2)
    assert writer.flush() >= 2 and writer.snapshots.count("disk") == 2 and writer.flush() == 0
    files = sorted(os.listdir(tmp_path))
    bad = os.path.join(tmp_path, files_of(tmp_path, ".v4snap")[0])
    raw = open(bad, "rb").read()
    open(bad, "wb").write(raw[:-50] + bytes([raw[-50] ^ 2]) + raw[-49:])
    os.mkdir(os.path.join(tmp_path, "ab" * 32 + ".v4snap"))  # a directory named like a file
    FaultyDirectory(monkeypatch, tmp_path).read_only()
    with pytest.warns(RuntimeWarning, match=r"snapshot directory .* is read-only \(EROFS"):
        reader = engine(snapshot_dir=tmp_path)
    assert reader.snapshots.count("disk") == 2
    prompts = (BASE[:400] + [7], BASE[100:390] + [7], BASE[300:500])
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        outs = [reader.generate([p], 4)[0] for p in prompts]
    for out, p in zip(outs, prompts, strict=True):
        assert_same(out, cold(p, 4))
    said = messages(record)
    assert [o.snapshot_tier for o in outs] == [None, "disk", None] or \
        [o.snapshot_tier for o in outs] == ["disk", None, None]
    assert any("is unusable" in m and "not deleted" in m and "read-only" in m for m in said)
    assert sorted(os.listdir(tmp_path)) == sorted(files + ["ab" * 32 + ".v4snap"])
    assert reader.flush() == 0 and reader.memory_report().stats["disk_errors"] == 0
    assert "read-only: EROFS" in reader.memory_report().format()


def test_a_listing_fault_at_start_is_warned_and_costs_only_hits(tmp_path, monkeypatch):
    with engine(snapshot_dir=tmp_path) as writer:
        writer.generate([BASE[:450]], 2)
    FaultyDirectory(monkeypatch, tmp_path).arm("scandir", errno.EACCES)
    with pytest.warns(RuntimeWarning, match=rf"{re.escape(str(tmp_path))} cannot be listed "
                                            r"\(EACCES"):
        reader = engine(snapshot_dir=tmp_path)
    (out,) = reader.generate([BASE[:400] + [7]], 4)
    assert out.cached_tokens == 0
    assert_same(out, cold(BASE[:400] + [7], 4))


# --- a fault at every host-side point of a step ----------------------------------------------

POINTS = {
    "admit a slot": (SlotTable, "admit"),
    "hold listed pages": (prefix_cache, "_hold"),
    "take a snapshot": (prefix_cache, "_snapshot"),
    "read chain pages for a file": (prefix_cache, "_read_pages"),
    "attach a hit": (prefix_cache, "_attach"),
    "restore a State": (prefix_cache, "_restore"),
    "store a snapshot": (prefix.SnapshotStore, "put"),
    "list a page": (prefix.PrefixIndex, "add"),
    "release a finished slot": (SlotTable, "release"),
}


def _fail_once(monkeypatch, owner, name, *, on_call=1, before=None):
    real = getattr(owner, name)
    calls = {"n": 0}

    def wrapper(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == on_call:
            if before is not None:
                before(*args)
            raise Injected(f"injected into {name}")
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, wrapper)
    return calls


@pytest.mark.parametrize("point", list(POINTS))
def test_a_fault_at_any_host_side_point_leaves_every_request_exact(tmp_path, monkeypatch,
                                                                   point):
    """The step raises; every request's host state still matches the device, finished
    outputs come back from a later step() exactly once, and every request equals a cold
    run. Faults injected after the device program ran raise after every request's progress
    was recorded."""
    eng = disk_engine(tmp_path, device_snapshots=1)  # the device tier and the disk tier
    owner, name = POINTS[point]
    calls = _fail_once(monkeypatch, owner, name)
    outputs, raised = workload(eng, tolerate=Injected)
    assert calls["n"] >= 1 and len(raised) == 1, (calls, raised)
    # The engine goes on afterwards: a later request hitting the same prefix is exact.
    (again,) = eng.generate([BASE[:400] + [1, 2, 3]], 4)
    assert_same(again, cold(BASE[:400] + [1, 2, 3], 4))
    assert eng.scheduler.unreleased == [] and len(eng.table) == 0


def test_a_lost_cache_stops_the_engine_with_its_outputs_and_lost_requests(tmp_path,
                                                                          monkeypatch):
    """A failure inside a device program after it took the cache over (simulated: the
    cache's buffers deleted, then an error) leaves no cache to go on with: the step raises
    EngineError carrying the request that finished in that step and naming the ones lost;
    every later call raises it too; close() still works."""
    eng = engine(snapshot_dir=tmp_path)

    def lose(cache, *args):
        for x in jax.tree.leaves(cache):
            x.delete()

    x = eng.add_request(SECOND["X"][0], 1)  # ends in the step that lists its second page
    e = eng.add_request(*FIRST["E"])
    _fail_once(monkeypatch, prefix_cache, "_hold", on_call=2, before=lose)
    with pytest.raises(EngineError, match=r"its cache was lost \(Injected: injected into "
                                          r"_hold\)") as info:
        for _ in range(10):
            eng.step()
    assert [o.request_id for o in info.value.finished] == [x] and info.value.lost == [e]
    assert_same(info.value.finished[0], cold(*SECOND["X"]))
    for call in (eng.step, eng.flush, lambda: eng.add_request([1], 1), lambda: eng.abort(e)):
        with pytest.raises(EngineError, match=r"lost: \[1\]"):
            call()
    assert eng.close() == [] and os.listdir(tmp_path) == []
    with pytest.raises(RuntimeError, match=r"Engine: closed"):
        eng.step()


# --- restarts, bounds, paths -----------------------------------------------------------------


def test_close_writes_what_a_restart_needs_with_default_tiers(tmp_path):
    with engine(snapshot_dir=tmp_path) as eng:
        eng.generate([BASE[:450]], 2)
        assert os.listdir(tmp_path) == []  # default tiers: the snapshot is on device
        report = eng.memory_report()
        assert report.snapshots["device"][0] == 1
        pending = eng.add_request(BASE[:20], 5)
        with pytest.warns(RuntimeWarning, match=rf"requests \[{pending}\] were in flight"):
            (aborted,) = eng.close()
    # The snapshot and the three pages of its chain.
    assert aborted.finish_reason == "aborted" and len(files_of(tmp_path, ".v4snap")) == 1
    assert len(files_of(tmp_path, ".v4page")) == 3
    with pytest.raises(RuntimeError, match=r"Engine: closed"):
        eng.generate([BASE[:10]], 1)
    restarted = engine(snapshot_dir=tmp_path)
    (hit,) = restarted.generate([BASE[:400] + [9]], 4)
    assert (hit.cached_tokens, hit.restored_by, hit.snapshot_tier) == (384, "snapshot", "disk")
    assert_same(hit, cold(BASE[:400] + [9], 4))
    line = restarted.memory_report().format().splitlines()[-1]
    size = os.path.getsize(os.path.join(tmp_path, files_of(tmp_path, ".v4snap")[0]))
    pages = sum(os.path.getsize(os.path.join(tmp_path, n))
                for n in files_of(tmp_path, ".v4page"))
    assert line == (f"Snapshot directory {tmp_path}: 1 files, {size:,} B (at most "
                    f"{prefix.DISK_BYTES:,} B); 0 filesystem errors caught; page files: 3, "
                    f"{pages:,} B, 0 filesystem errors caught")


def test_the_disk_tier_is_bounded_in_bytes_by_default(tmp_path):
    assert engine(snapshot_dir=tmp_path).snapshots.disk.max_bytes == 4 << 30
    eng = disk_engine(tmp_path, disk_snapshots=None)
    eng.generate([BASE[:450]], 2)
    (name,) = files_of(tmp_path, ".v4snap")
    size = os.path.getsize(os.path.join(tmp_path, name))
    small = disk_engine(tmp_path, disk_snapshots=None, disk_bytes=size + 10)
    small.generate([BASE[100:400]], 2)  # its file evicts the older one
    assert len(files_of(tmp_path, ".v4snap")) <= 1 and name not in os.listdir(tmp_path)
    tiny = disk_engine(tmp_path, disk_snapshots=None, disk_bytes=100)
    with pytest.warns(RuntimeWarning, match=r"not written: .* more than max_bytes=100"):
        tiny.generate([BASE[300:600]], 2)
    assert tiny.memory_report().stats["snapshots_dropped"] >= 1
    with pytest.raises(ValueError, match=r"disk_bytes: expected an integer in \[0, inf\]"):
        engine(snapshot_dir=tmp_path, disk_bytes=-1)
    with pytest.raises(TypeError, match=r"max_bytes: expected an integer; got 1.5"):
        prefix_disk.SnapshotDirectory(tmp_path, max_files=None, max_bytes=1.5)
    with pytest.raises(ValueError, match=r"max_files: expected an integer in \[0, inf\]"):
        prefix_disk.SnapshotDirectory(tmp_path, max_files=-1, max_bytes=None)


def test_a_path_that_cannot_be_a_directory_is_an_error_at_engine(tmp_path, monkeypatch):
    afile = tmp_path / "file"
    afile.write_text("x")
    cases = [
        ("", r"snapshot_dir: expected a directory \(or a path to create one at\); got '' "
             r"\(an empty path\)"),
        (afile / "sub", rf"snapshot_dir: expected a directory .*; got '{re.escape(str(afile))}"
                        r"/sub', where none can be made \(ENOTDIR"),
        (afile, r"snapshot_dir: expected a directory .*which is a file"),
    ]
    for path, message in cases:
        with pytest.raises(ValueError, match=message):
            engine(snapshot_dir=path)
    locked = tmp_path / "locked"
    locked.mkdir()
    FaultyDirectory(monkeypatch, locked).arm("mkdir", errno.EACCES)
    with pytest.raises(ValueError, match=r"snapshot_dir: expected a directory .*/locked/new', "
                                         r"where none can be made \(EACCES"):
        engine(snapshot_dir=locked / "new")


_DYING_WRITER = """
import os, sys
from v4kv_jax.prefix.disk import SnapshotDirectory
directory = SnapshotDirectory(sys.argv[1], max_files=None, max_bytes=None)
os.fsync = lambda fd: os._exit(9)  # the process dies with the file half done
directory.write(bytes.fromhex(sys.argv[2]), open(sys.argv[3], "rb").read())
"""


def test_a_writer_that_dies_mid_file_leaves_nothing_a_reader_uses(tmp_path):
    files, spare = tmp_path / "files", tmp_path / "spare"
    with engine(snapshot_dir=files) as writer:
        writer.generate([BASE[:450]], 2)
    (name,) = files_of(files, ".v4snap")
    pages = files_of(files, ".v4page")
    os.rename(files / name, spare)
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"}
    died = subprocess.run([sys.executable, "-c", _DYING_WRITER, str(files), name.split(".")[0],
                           str(spare)], env=env, timeout=120, check=False)
    assert died.returncode == 9
    (tmp,) = sorted(set(os.listdir(files)) - set(pages))
    assert tmp.startswith(".") and tmp.endswith(".tmp")
    reader = engine(snapshot_dir=files)
    assert reader.snapshots.count("disk") == 0
    assert sorted(os.listdir(files)) == sorted([tmp] + pages)  # young: kept
    (out,) = reader.generate([BASE[:400] + [9]], 4)
    # No snapshot: the page files hit, and the State is replayed from the empty one.
    assert (out.cached_tokens, out.restored_by, out.cached_from["disk"]) == (384, "replay", 384)
    assert_same(out, cold(BASE[:400] + [9], 4))
    old = time.time() - prefix_disk.STALE_SECONDS - 60
    os.utime(files / tmp, (old, old))
    engine(snapshot_dir=files)
    assert sorted(os.listdir(files)) == pages  # a dead writer's file, an hour old: deleted
