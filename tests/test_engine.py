"""The token-aware engine (`v4kv_jax.serve.engine.Engine`): continuous batching with prefix sharing.

Every hit is held to a cold run of the same prompt (greedy tokens identical, logits within
1e-5), for each way the State at the hit is rebuilt. A cold run is the same engine with a salt
no page was written under, so it runs the same compiled program. The model has 3 layers (SWA,
CSA, HCA) and W = 64, so R = 3 * 63 + 1 = 190 tokens, 2 pages: a hit of 1 page with no
snapshot is recomputed, deeper ones replay 2 pages from the empty State.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import re
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import v4kv_jax as v4
from v4kv_jax import pools, programs
from v4kv_jax.nn import Decoder, ModelConfig
from v4kv_jax.prefix import cache as prefix_cache
from v4kv_jax.serve import engine as engine_module
from v4kv_jax.serve.engine import Engine
from v4kv_jax.serve.sampling import row_keys, sample, sample_stream, stream_key
from v4kv_jax.testing import synthetic

from conftest import GEOMETRY, lowerings
from test_sampling import np_logprobs, np_penalize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ATTENTION = v4.tiny(index_heads=16, window=64, compress_ratios=(0, 4, 16))
CONFIG = ModelConfig(ATTENTION, vocab_size=40, mlp_hidden=48)
DECODER = Decoder(CONFIG, rngs=nnx.Rngs(1), bias_scale=0.5)
P = GEOMETRY.page_tokens
CHUNK = 64
BASE = np.random.default_rng(5).integers(0, CONFIG.vocab_size, 700).tolist()
_salts = itertools.count()


def engine(model=DECODER, **kwargs) -> Engine:
    kwargs.setdefault("keep_logits", True)
    return Engine(model, GEOMETRY, prefill_chunk=CHUNK, **kwargs)


def cold(eng: Engine, prompt, max_new_tokens=4):
    (out,) = eng.generate([prompt], max_new_tokens, cache_salt=f"cold-{next(_salts)}")
    assert out.cached_tokens == 0 and out.restored_by == "none"
    return out


def assert_same(hit, want):
    assert hit.tokens == want.tokens
    assert hit.logits.shape == want.logits.shape
    np.testing.assert_allclose(hit.logits, want.logits, atol=1e-5, rtol=0)


def restore(out):
    return out.cached_tokens, out.replayed_tokens, out.restored_by, out.snapshot_tier


def test_replay_bound_of_the_test_model():
    assert engine().replay_pages == 2


# --- every way of restoring equals the cold run ------------------------------------------


@pytest.mark.parametrize("tier", ["device", "host", "disk"])
def test_snapshot_hit_from_each_tier(tier, tmp_path):
    sizes = {"device": {}, "host": {"device_snapshots": 0},
             "disk": {"device_snapshots": 0, "host_snapshots": 0, "snapshot_dir": tmp_path}}
    eng = engine(**sizes[tier])
    eng.generate([BASE[:450]], 2)  # snapshot at 384, its last full page boundary
    prompt = BASE[:400] + [1, 2, 3]  # diverges mid-page 3
    (hit,) = eng.generate([prompt], 4)
    assert restore(hit) == (384, 0, "snapshot", tier)
    assert_same(hit, cold(eng, prompt))


def test_replay_from_a_lower_snapshot():
    """Pages filled while decoding are listed too (a chat's next turn hits them); the
    snapshot is at the prompt's last boundary (256): 1 page is replayed up to 384."""
    eng = engine()
    (first,) = eng.generate([BASE[:300]], 90)
    conversation = BASE[:300] + first.tokens
    prompt = conversation[:384] + [7, 7]
    (hit,) = eng.generate([prompt], 4)
    assert restore(hit) == (384, 128, "snapshot+replay", "device")
    assert_same(hit, cold(eng, prompt))


def test_replay_from_empty_and_recompute_below_R():
    eng = engine(device_snapshots=0, host_snapshots=0)  # every snapshot dropped
    eng.generate([BASE[:450]], 2)
    prompt = BASE[:400] + [3]
    (hit,) = eng.generate([prompt], 4)
    assert restore(hit) == (384, 256, "replay", None)
    assert_same(hit, cold(eng, prompt))
    short = BASE[:200] + [3]  # 1 page listed, b = 128 < R = 256: recomputed
    (out,) = eng.generate([short], 4)
    assert restore(out) == (0, 0, "recompute", None)
    assert_same(out, cold(eng, short))
    report = eng.memory_report()
    assert report.stats["replayed_tokens"] == 256
    assert report.snapshots["device"] == (0, 0) and report.stats["snapshots_dropped"] >= 3


def test_hits_of_every_depth():
    eng = engine(snapshot_every_pages=1, device_snapshots=32)  # cold runs snapshot too
    eng.generate([BASE[:520]], 2)  # snapshots at 128, 256, 384, 512
    for pages in (1, 2, 3, 4):
        prompt = BASE[:pages * P + 17] + [pages]
        (hit,) = eng.generate([prompt], 3)
        assert restore(hit) == (pages * P, 0, "snapshot", "device")
        assert_same(hit, cold(eng, prompt, 3))
    # A prompt of whole pages: its last token is computed (for the first logits), so the
    # hit stops one page short.
    (hit,) = eng.generate([BASE[:512]], 3)
    assert restore(hit) == (384, 0, "snapshot", "device")
    assert_same(hit, cold(eng, BASE[:512], 3))


def test_hits_with_the_c4_entries_in_host_memory():
    """HiSparse with the prefix cache on: the shared pages' C4 entries live on the host, a
    hit starts with an empty hot set and equals the cold run and the all-on-device engine.
    One compilation serves every step (the step's carried arrays, penalty rows included,
    are placed as the cache is, which is committed throughout)."""
    geometry = dataclasses.replace(GEOMETRY, c4_tier="host")  # 2 x index_topk hot rows
    eng = Engine(DECODER, geometry, prefill_chunk=CHUNK, keep_logits=True)
    prompt = BASE[:400] + [1, 2, 3]
    with lowerings("_step") as made:
        eng.generate([BASE[:450]], 2)
        (hit,) = eng.generate([prompt], 4)
        assert restore(hit) == (384, 0, "snapshot", "device")
        assert_same(hit, cold(eng, prompt))
        eng.generate([BASE[:40]], 2, repetition_penalty=1.5)
        eng.generate([BASE[:40]], 2)
    assert len(made) == 1, made
    (on_device,) = engine().generate([prompt], 4)
    assert_same(hit, on_device)
    assert pools.csa_entries(eng.cache).c4.sharding.memory_kind == "pinned_host"
    assert eng.memory_report().cache.host_bytes["classical"] > 0


# --- the stale-state class, isolation, refcounts -----------------------------------------


def _shared_rows(eng, pages):
    ids = np.full((GEOMETRY.max_pages_per_seq,), -1, np.int32)
    ids[:len(pages)] = pages
    return {k: np.asarray(v).tobytes() for k, v in pools.read_pages(eng.cache, ids).items()}


def test_same_prefix_different_continuations_at_once_and_after():
    """B hits A's pages and snapshot while A still runs; between steps everything no live
    request or the index owns is NaN; the shared pages never change; then C hits after both
    finished. Each equals its cold run."""
    eng = engine()
    prompt_a, prompt_b, prompt_c = (BASE[:300] + [t] * 10 for t in (1, 2, 3))
    a = eng.add_request(prompt_a, 24)
    while eng.status(a) != "decode":
        eng.step()
    b = eng.add_request(prompt_b, 24)
    outputs, shared = {}, None
    while a in eng.in_flight or b in eng.in_flight:
        for out in eng.step():
            outputs[out.request_id] = out
        if shared is None and b in eng.in_flight and eng.status(b) != "waiting":
            report = eng.memory_report()
            assert report.pages_shared == 2 and report.pages_in_requests == 4  # 2 + 1 each
            table = np.asarray(eng.cache.pages.page_table)
            shared = [int(p) for p in table[eng.table.slot(b), :2]]
            assert shared == [int(p) for p in table[eng.table.slot(a), :2]]
            before = _shared_rows(eng, shared)
        if shared is not None:
            assert _shared_rows(eng, shared) == before
        held = list(eng.index.pages().values())
        eng.cache = synthetic.poison_unowned(eng.cache, held_pages=held)
    assert restore(outputs[a])[:3] == (0, 0, "none")
    assert restore(outputs[b]) == (256, 0, "snapshot", "device")
    (c,) = eng.generate([prompt_c], 24)
    assert restore(c) == (256, 0, "snapshot", "device")
    for out, prompt in ((outputs[a], prompt_a), (outputs[b], prompt_b), (c, prompt_c)):
        assert np.isfinite(out.logits).all()
        assert_same(out, cold(eng, prompt, 24))
    assert len({tuple(outputs[a].tokens), tuple(outputs[b].tokens), tuple(c.tokens)}) == 3
    # Everything released and the index cleared: every page is free again.
    eng.clear_prefix_cache()
    assert (np.asarray(eng.cache.pages.refcount) == 0).all()
    assert int(eng.cache.pages.num_free) == GEOMETRY.num_pages
    assert eng.memory_report().pages_indexed == 0


def test_eviction_never_frees_a_live_request_page():
    """Finished requests fill the pool with cached pages; a long request runs while others
    arrive, so the least recently used cached pages are evicted for them, never its own."""
    eng = engine()
    for i in range(4):  # 4 pages each, cached under their own salts: 16 of 24 pages
        eng.generate([BASE[i * 10:i * 10 + 520]], 1, cache_salt=f"fill-{i}")
    assert eng.memory_report().pages_cached_only == 16
    long_prompt = BASE[100:700]
    live = eng.add_request(long_prompt, 60)
    eng.step()
    others = [eng.add_request(BASE[50 + i:550 + i], 40) for i in range(3)]
    outputs, own = {}, None
    while eng.in_flight:
        if live in eng.in_flight and eng.status(live) != "waiting":
            table = np.asarray(eng.cache.pages.page_table)
            row = [int(p) for p in table[eng.table.slot(live)] if p >= 0]
            refcount = np.asarray(eng.cache.pages.refcount)
            assert (refcount[row] >= 1).all()
            full = eng.status(live) == "decode" and len(row) > 1
            if full and own is None:
                own = row[:-1]
                before = _shared_rows(eng, own)
            if own is not None:
                assert row[:len(own)] == own and _shared_rows(eng, own) == before
        for out in eng.step():
            outputs[out.request_id] = out
    assert eng.memory_report().stats["pages_evicted"] > 0
    assert len(outputs) == 4  # the fourth request waited for a slot
    assert_same(outputs[live], cold(eng, long_prompt, 60))
    assert_same(outputs[others[2]], cold(eng, BASE[52:552], 40))


def _snapshots_reach_kept_pages(eng) -> bool:
    """Every device and host snapshot's chain is listed or on the host or disk tier."""
    pc = eng.prefix_cache
    return all(d in pc.index or pc.cold.tier_of(d) is not None
               for tier in ("device", "host") for record in pc.snapshots.records(tier)
               for d in record.chain)


def test_clear_while_requests_run_lists_nothing_they_computed():
    """A clear is a barrier: a request holding hit pages and one mid-prefill run on, fill
    pages past it and finish, but list no page and take no snapshot; later requests with the
    same prompt recompute it, list it again and hit it, all equal to cold runs."""
    eng = engine(snapshot_every_pages=1)
    eng.generate([BASE[:300]], 2)  # pages 0-1 listed, snapshots at 128 and 256
    hit_prompt, new_prompt = BASE[:300] + [5], BASE[300:600]
    a = eng.add_request(hit_prompt, 100)  # 2 pages hit; fills page 2 (at 384) decoding
    b = eng.add_request(new_prompt, 40)  # no hit; 2 steps list its page 0
    eng.step()
    eng.step()
    assert eng.status(a) == "decode" and eng.status(b) == "prefill"
    assert len(eng.index) == 3 and eng.snapshots.count("device") == 3
    held = [int(p) for p in np.asarray(eng.cache.pages.page_table)[eng.table.slot(a), :2]]
    eng.clear_prefix_cache()
    assert len(eng.index) == 0 and eng.snapshots.count("device") == 0
    assert np.asarray(eng.cache.pages.refcount)[held].tolist() == [1, 1]  # a's own
    outputs = {}
    while eng.in_flight:
        outputs.update((o.request_id, o) for o in eng.step())
        assert len(eng.index) == 0, "a request running at the clear listed its pages"
        assert eng.snapshots.count("device") == eng.snapshots.count("host") == 0
    assert (np.asarray(eng.cache.pages.refcount) == 0).all()
    assert int(eng.cache.pages.num_free) == GEOMETRY.num_pages
    (again,) = eng.generate([new_prompt], 40)  # in a slot a or b held: lists again
    assert restore(again) == (0, 0, "none", None) and again.tokens == outputs[b].tokens
    assert len(eng.index) == 2 and eng.snapshots.count("device") == 2
    assert _snapshots_reach_kept_pages(eng)
    assert restore(outputs[a])[:3] == (256, 0, "snapshot")
    assert_same(outputs[a], cold(eng, hit_prompt, 100))
    assert_same(outputs[b], cold(eng, new_prompt, 40))
    prompt = new_prompt[:280] + [3]
    (hit,) = eng.generate([prompt], 4)
    assert restore(hit) == (256, 0, "snapshot", "device")
    assert_same(hit, cold(eng, prompt))


def test_eviction_drops_the_snapshots_of_pages_it_drops():
    """With no host or disk tier an evicted page is gone, and so is every snapshot whose
    chain holds it (it could never be restored: it would only hold memory)."""
    eng = engine(snapshot_every_pages=1, device_snapshots=32, host_pages=0)
    for i in range(4):  # 16 of 24 pages cached, 16 snapshots
        eng.generate([BASE[i * 10:i * 10 + 520]], 1, cache_salt=f"fill-{i}")
    assert eng.snapshots.count("device") == 16
    dropped = eng.memory_report().stats["snapshots_dropped"]
    outs = eng.generate([BASE[100:700], BASE[101:701]], 2)  # 10 pages: 2 evicted at least
    report = eng.memory_report()
    assert report.stats["pages_evicted"] >= 2
    assert report.stats["snapshots_dropped"] > dropped
    assert _snapshots_reach_kept_pages(eng)
    assert_same(outs[0], cold(eng, BASE[100:700], 2))


# --- the disk tier: restarts, bad files, other fingerprints ------------------------------


def test_a_new_engine_over_the_directory_hits(tmp_path):
    writer = engine(device_snapshots=0, host_snapshots=0, snapshot_dir=tmp_path)
    writer.generate([BASE[:450]], 2)
    # One snapshot file, its chain's three pages in one file each.
    assert sorted(n.split(".")[1] for n in os.listdir(tmp_path)) == ["v4page"] * 3 + ["v4snap"]
    reader = engine(snapshot_dir=tmp_path)  # another engine: its pool holds nothing
    prompt = BASE[:400] + [9]
    (hit,) = reader.generate([prompt], 4)
    assert restore(hit) == (384, 0, "snapshot", "disk")
    assert hit.cached_from == {"device": 0, "host": 0, "disk": 384}
    assert reader.memory_report().stats["pages_from_disk"] == 3
    assert_same(hit, cold(reader, prompt))
    # Other weights: a different fingerprint never hits (and never reads the file).
    other = engine(Decoder(CONFIG, rngs=nnx.Rngs(2), bias_scale=0.5), snapshot_dir=tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (out,) = other.generate([prompt], 4)
    assert restore(out) == (0, 0, "none", None)


_CHILD = """
import json, sys
import jax
jax.config.update("jax_default_matmul_precision", "highest")
sys.path.insert(0, {tests!r})
import test_engine as t
eng = t.engine(snapshot_dir={directory!r})
(hit,) = eng.generate([t.BASE[:400] + [9]], 4)
print(json.dumps(dict(restore=list(t.restore(hit)), tokens=hit.tokens,
                      logits=hit.logits.tolist())))
"""


def test_the_disk_tier_is_reused_by_another_process(tmp_path):
    writer = engine(device_snapshots=0, host_snapshots=0, snapshot_dir=tmp_path)
    writer.generate([BASE[:450]], 2)
    script = _CHILD.format(tests=os.path.join(ROOT, "tests"), directory=str(tmp_path))
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"}
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env=env, timeout=200, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    import json

    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["restore"] == [384, 0, "snapshot", "disk"]
    want = cold(writer, BASE[:400] + [9])
    assert got["tokens"] == want.tokens
    np.testing.assert_allclose(np.asarray(got["logits"], np.float32), want.logits, atol=1e-5,
                               rtol=0)


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_bad_snapshot_file_falls_back_to_replay(tmp_path, damage):
    eng = engine(device_snapshots=0, host_snapshots=0, snapshot_dir=tmp_path)
    eng.generate([BASE[:450]], 2)
    (name,) = [n for n in os.listdir(tmp_path) if n.endswith(".v4snap")]
    path = os.path.join(tmp_path, name)
    raw = open(path, "rb").read()
    raw = raw[:-100] + bytes([raw[-100] ^ 4]) + raw[-99:] if damage == "flip" else raw[:-7]
    open(path, "wb").write(raw)
    prompt = BASE[:400] + [4]
    with pytest.warns(RuntimeWarning, match=rf"snapshot file {re.escape(path)} is unusable"):
        (hit,) = eng.generate([prompt], 4)
    assert restore(hit) == (384, 256, "replay", None)
    assert not os.path.exists(path)
    assert_same(hit, cold(eng, prompt))


def test_other_configs_geometries_options_and_salts_never_share_keys():
    prompt = BASE[:300]
    base = engine()
    variants = [
        engine(Decoder(ModelConfig(ATTENTION, vocab_size=41, mlp_hidden=48), rngs=nnx.Rngs(1),
                       bias_scale=0.5)),
        engine(Decoder(ModelConfig(v4.tiny(index_heads=16, window=32,
                                           compress_ratios=(0, 4, 16)),
                                   vocab_size=40, mlp_hidden=48), rngs=nnx.Rngs(1),
                       bias_scale=0.5)),
        Engine(DECODER, v4.CacheConfig(num_pages=24, max_slots=3, max_pages_per_seq=6,
                                       entry_dtype="bfloat16"), prefill_chunk=CHUNK),
        Engine(DECODER, v4.CacheConfig(num_pages=24, max_slots=3, max_pages_per_seq=6,
                                       hca_tail="online"), prefill_chunk=CHUNK),
        engine(options=v4.Options(query_tile=32)),
        engine(Decoder(CONFIG, rngs=nnx.Rngs(1), bias_scale=0.25)),
    ]
    prints = {base.fingerprint} | {e.fingerprint for e in variants}
    assert len(prints) == 1 + len(variants)
    same = Engine(Decoder(CONFIG, rngs=nnx.Rngs(1), bias_scale=0.5), v4.CacheConfig(
        num_pages=8, max_slots=1, max_pages_per_seq=6), prefill_chunk=32)
    assert same.fingerprint == base.fingerprint  # pool size, slots and chunking do not matter
    (first,) = base.generate([prompt], 1, cache_salt="tenant-a")
    for salt in (None, "tenant-b", b"tenant-a"):
        (out,) = base.generate([prompt[:290]], 1, cache_salt=salt)
        assert out.cached_tokens == 0, salt
    (out,) = base.generate([prompt[:290]], 1, cache_salt="tenant-a")
    assert out.cached_tokens == 256


# --- scheduling, outputs, compilation ----------------------------------------------------


def test_one_program_serves_every_step_and_prompt_length():
    eng = engine(token_budget=100)
    eng.generate([BASE[:150]], 2)
    eng.generate([BASE[:140]], 2)  # a hit: attach, restore
    eng.clear_prefix_cache()
    counts = lambda: (engine_module.compiled_step_programs(),  # noqa: E731
                      *(f.traces for f in (prefix_cache._attach, prefix_cache._restore,
                                           prefix_cache._snapshot, prefix_cache._hold,
                                           prefix_cache._drop)))
    before = counts()
    prompts = [BASE[:n] for n in (1, 63, 64, 65, 129, 300)]
    outs = eng.generate(prompts, 5, temperature=0.7)
    outs += eng.generate([BASE[:130] + [1], BASE[:70]], 3)  # hits
    assert counts() == before
    assert [len(o.tokens) for o in outs] == [5] * 6 + [3] * 2
    assert outs[-2].cached_tokens == 128
    # The budget: at most 100 replay + prefill tokens a step, chunks not crossing a
    # multiple of the prefill chunk (so every page boundary ends a chunk).
    eng2 = engine(token_budget=100)
    ids = [eng2.add_request(BASE[:250], 1), eng2.add_request(BASE[1:251], 1)]
    lengths = []
    for _ in range(3):
        eng2.step()
        lengths.append([eng2.scheduler.requests[r].length for r in ids])
    assert lengths == [[64, 36], [128, 64], [192, 100]]


def test_warmup_compiles_every_program_and_compile_time_is_reported_apart():
    """A cold engine's first request compiles the step program: its seconds are the request's
    compile_time and the engine's compile_s, not its ttft. After warmup() (which changes no
    bit of the cache) requests, hits included, compile nothing and give the same bits."""
    fresh = Decoder(ModelConfig(v4.tiny(compress_ratios=(0,)), vocab_size=40, mlp_hidden=16),
                    rngs=nnx.Rngs(3))  # a model no other test compiles
    prompts = [BASE[:300], BASE[:290] + [1], BASE[40:100]]  # the second hits at 256
    first_engine = Engine(fresh, GEOMETRY, prefill_chunk=CHUNK)
    (first,) = first_engine.generate(prompts[:1], 2)
    m = first.metrics
    assert m.compile_time > 0 and first_engine.metrics()["compile_s"] >= m.compile_time
    assert m.ttft + m.compile_time <= m.finish_time - m.arrival_time

    traces = lambda: {n: p.traces for n, p in programs.PROGRAMS.items()}  # noqa: E731
    warm = Engine(fresh, GEOMETRY, prefill_chunk=CHUNK // 2, keep_logits=True)
    before, traced = jax.tree.map(np.asarray, warm.cache), traces()
    assert warm.warmup() > 0
    assert traces()["engine.step"] == traced["engine.step"] + 1  # a new chunk: a new program
    jax.tree.map(np.testing.assert_array_equal, before, jax.tree.map(np.asarray, warm.cache))
    compiled, traced = warm.metrics()["compile_s"], traces()
    assert compiled > 0
    warm.warmup()  # compiles nothing
    outs = warm.generate(prompts[:1], 3) + warm.generate(prompts[1:], 3, temperature=0.7)
    assert traces() == traced and warm.metrics()["compile_s"] == compiled
    assert [o.metrics.compile_time for o in outs] == [0.0] * 3
    assert outs[1].restored_by == "snapshot"
    unwarmed = Engine(fresh, GEOMETRY, prefill_chunk=CHUNK // 2, keep_logits=True)
    want = unwarmed.generate(prompts[:1], 3) + unwarmed.generate(prompts[1:], 3,
                                                                 temperature=0.7)
    for got, ref in zip(outs, want, strict=True):
        assert got.tokens == ref.tokens and got.restored_by == ref.restored_by
        np.testing.assert_array_equal(got.logits, ref.logits)


def test_eos_abort_status_and_outputs():
    eng = engine(keep_logits=False)
    want = cold(eng, BASE[:90], 6).tokens
    (out,) = eng.generate([BASE[:90]], 6, eos_id=want[2])
    end = want.index(want[2]) + 1
    assert out.tokens == want[:end] and out.finish_reason == "eos" and out.logits is None
    assert eng.step() == []
    r1 = eng.add_request(BASE[:200], 5)
    r2 = eng.add_request(BASE[:10], 2)
    assert eng.status(r1) == eng.status(r2) == "waiting"
    eng.step()
    assert eng.status(r1) == "prefill" and eng.status(r2) == "decode"
    aborted = eng.abort(r1)
    assert aborted.finish_reason == "aborted" and aborted.tokens == []
    assert eng.in_flight == [r2]
    # generate() shares steps with requests in flight; theirs come back from step().
    eng.generate([BASE[:20]], 2)
    done = []
    while eng.in_flight:
        done += eng.step()
    done += eng.step()
    assert [o.request_id for o in done] == [r2] and len(done[0].tokens) == 2
    assert (np.asarray(eng.cache.pages.page_table) == -1).all()  # no slot holds a page
    text = eng.memory_report().format()
    assert "Prefix cache:" in text and "Snapshots: device" in text


# --- errors ------------------------------------------------------------------------------


def test_bad_input_raises_naming_the_argument(tmp_path):
    eng = engine()
    V = CONFIG.vocab_size
    cases = [
        (dict(prompt_ids=[]), ValueError, r"prompt_ids: expected at least one token id; got an "
                                          r"empty sequence"),
        (dict(prompt_ids="abc"), TypeError, r"prompt_ids: expected a 1-D sequence"),
        (dict(prompt_ids=[1, 2.5]), TypeError, r"prompt_ids: expected integers; got \[1, 2.5\]"),
        (dict(prompt_ids=[[1, 2]]), ValueError, r"prompt_ids: expected a 1-D array"),
        (dict(prompt_ids=[1, V]), ValueError, rf"prompt_ids: expected token ids in \[0, {V}\) "
                                              rf"\(vocab_size\); got {V} at position 1"),
        (dict(prompt_ids=[-1]), ValueError, r"prompt_ids: expected token ids in \[0, 40\) "
                                            r"\(vocab_size\); got -1 at position 0"),
        (dict(prompt_ids=[1] * 800), ValueError, r"prompt_ids: expected at most 768 tokens "
                                                 r"\(max_seq_len\); got 800 tokens"),
        (dict(max_new_tokens=0), ValueError, r"max_new_tokens: expected an integer in \[1, "),
        (dict(max_new_tokens=2.0), TypeError, r"max_new_tokens: expected an integer; got 2.0"),
        (dict(max_new_tokens=800), ValueError, r"max_new_tokens: expected at most 766 for a "
                                               r"prompt of 3 tokens \(max_seq_len=768\); got "
                                               r"800"),
        (dict(temperature=-1.0), ValueError, r"temperature: expected a number in \[0.0, inf\]"),
        (dict(temperature="hot"), TypeError, r"temperature: expected a real number"),
        (dict(eos_id=V), ValueError, rf"eos_id: expected a token id in \[0, {V}\) "
                                     rf"\(vocab_size\); got {V}"),
        (dict(eos_id=-1), ValueError, r"eos_id: expected an integer in \[0, inf\]; got -1"),
        (dict(top_k=-1), ValueError, r"top_k: expected an integer in \[0, inf\]; got -1"),
        (dict(top_k=1.5), TypeError, r"top_k: expected an integer; got 1.5"),
        (dict(top_p=1.5), ValueError, r"top_p: expected a number in \(0.0, 1.0\]; got 1.5"),
        (dict(top_p=0.0), ValueError, r"top_p: expected a number in \(0.0, 1.0\]; got 0.0"),
        (dict(min_p=-0.1), ValueError, r"min_p: expected a number in \[0.0, 1.0\]; got -0.1"),
        (dict(seed=-1), ValueError, r"seed: expected an integer in \[0, 4294967295\]; got -1"),
        (dict(seed="s"), TypeError, r"seed: expected an integer; got 's'"),
        (dict(stop_token_ids=[1, V]), ValueError, rf"stop_token_ids\[1\]: expected a token id "
                                                  rf"in \[0, {V}\) \(vocab_size\); got {V}"),
        (dict(stop_token_ids=3), TypeError, r"stop_token_ids: expected a sequence of token ids; "
                                            r"got 3"),
        (dict(stop_token_ids=[1.0]), TypeError, r"stop_token_ids: expected integer token ids; "
                                                r"got 1.0 at position 0"),
        (dict(stop=[[1, 2], []]), ValueError, r"stop\[1\]: expected at least one token id; got "
                                              r"an empty sequence"),
        (dict(stop=[1, 2]), TypeError, r"stop\[0\]: expected a sequence of token ids; got 1"),
        (dict(stop=[[1, -2]]), ValueError, r"stop\[0\]: expected token ids >= 0; got -2 at "
                                           r"position 1"),
        (dict(stop=[[V]]), ValueError, rf"stop\[0\]\[0\]: expected a token id in \[0, {V}\)"),
        (dict(cache_salt=3), TypeError, r"cache_salt: expected None, a str or bytes; got int"),
    ]
    for change, error, message in cases:
        args = {"prompt_ids": [1, 2, 3], "max_new_tokens": 2, **change}
        with pytest.raises(error, match=message):
            eng.add_request(**args)
    assert eng.in_flight == []
    with pytest.raises(KeyError, match=r"request_id: expected a request in flight \(\[\]\); "
                                       r"got 7"):
        eng.abort(7)
    with pytest.raises(TypeError, match=r"request_id: expected an int returned by add_request"):
        eng.status("7")
    with pytest.raises(TypeError, match=r"prompts: expected a sequence of token-id sequences"):
        eng.generate("abc", 2)
    with pytest.raises(ValueError, match=r"prompts: expected at least one prompt"):
        eng.generate([], 2)
    with pytest.raises(ValueError, match=r"prompts\[1\]: expected token ids in \[0, 40\) "
                                         r"\(vocab_size\); got 99 at position 0"):
        eng.generate([[1], [99]], 2)
    with pytest.raises(ValueError, match=r"prompts\[3\]: expected at most 768 tokens"):
        eng.generate([[1], [2], [3], [4] * 769], 1)
    with pytest.raises(TypeError, match=r"stream: expected a bool; got 1"):
        eng.generate([[1]], 2, stream=1)
    assert eng.in_flight == []  # all or nothing
    small = Engine(DECODER, v4.CacheConfig(num_pages=2, max_slots=1, max_pages_per_seq=6),
                   prefill_chunk=CHUNK)
    with pytest.raises(ValueError, match=r"prompt_ids, max_new_tokens: the pool is too small "
                                         r"for this request: its 300 prompt tokens and 1 new "
                                         r"token\(s\) need 3 pages of 128 tokens, the whole "
                                         r"pool has num_pages=2"):
        small.add_request(BASE[:300], 1)
    with pytest.raises(ValueError, match=r"prompts\[0\], max_new_tokens: the pool is too "
                                         r"small"):
        small.generate([BASE[:300]], 1)

    def build(**kwargs):
        Engine(kwargs.pop("model", DECODER), kwargs.pop("geometry", GEOMETRY), **kwargs)

    for kwargs, error, message in [
        (dict(model="m"), TypeError, r"model.attn_config: expected the v4kv_jax "
                                     r"AttentionConfig of the model's cache; got no attribute "
                                     r"attn_config on str"),
        (dict(geometry=None), TypeError, r"geometry: expected a CacheConfig; got NoneType"),
        (dict(prefill_chunk=48), ValueError, r"prefill_chunk: expected a divisor of "
                                             r"page_tokens=128; got 48"),
        (dict(prefill_chunk=0), ValueError, r"prefill_chunk: expected an integer in \[1, "),
        (dict(token_budget=0), ValueError, r"token_budget: expected an integer in \[1, "),
        (dict(snapshot_every_pages=0), ValueError, r"snapshot_every_pages: expected an "
                                                   r"integer in \[1, "),
        (dict(snapshot_every_pages=1.0), TypeError, r"snapshot_every_pages: expected an "
                                                    r"integer; got 1.0"),
        (dict(device_snapshots=-1), ValueError, r"device_snapshots: expected an integer in "
                                                r"\[0, "),
        (dict(host_snapshots=None), TypeError, r"host_snapshots: expected an integer; got None"),
        (dict(disk_snapshots=-1), ValueError, r"disk_snapshots: expected an integer in \[0, "),
        (dict(snapshot_dir=5), TypeError, r"snapshot_dir: expected a path .*; got int"),
        (dict(snapshot_dir=__file__), ValueError, r"snapshot_dir: expected a directory"),
        (dict(keep_logits=1), TypeError, r"keep_logits: expected a bool; got 1"),
        (dict(seed="s"), TypeError, r"seed: expected an integer"),
        (dict(max_head_wait=-1), ValueError, r"max_head_wait: expected an integer in \[0, "),
        (dict(max_head_wait=None), TypeError, r"max_head_wait: expected an integer; got None"),
        (dict(options="fast"), TypeError, r"options: expected a v4kv_jax Options; got str"),
    ]:
        with pytest.raises(error, match=message):
            build(**kwargs)


def test_the_prefix_page_engine_block_runs_as_written():
    page = open(os.path.join(ROOT, "docs/prefix.md")).read()
    section = page.split("## Prefix sharing in the Engine\n", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```python\n(.*?)\n```", section, re.S)
    scope = {"model": DECODER, "geometry": GEOMETRY}
    exec(block, scope)  # noqa: S102 - the page's own code
    first, second, cold_run = scope["first"], scope["second"], scope["cold"]
    assert (second.cached_tokens, second.restored_by) == (256, "snapshot")
    assert first.finish_reason == "length" and cold_run.cached_tokens == 0
    np.testing.assert_array_equal(jax.device_get(scope["engine"].cache.pages.page_table), -1)


def test_a_request_the_pool_cannot_hold_yet_waits():
    """Admission reserves each running request's pages up to its full length: a request that
    does not fit stays queued (nothing changes) until pages are free. Checked on the
    admission alone (`Scheduler.admit`), without running a step of this geometry."""
    eng = Engine(DECODER, v4.CacheConfig(num_pages=6, max_slots=3, max_pages_per_seq=6),
                 prefill_chunk=CHUNK)
    a = eng.add_request(BASE[:400], 100)  # 4 pages at its full length
    b = eng.add_request(BASE[1:300], 50)  # 3 pages
    assert eng.scheduler.admit(eng.scheduler.requests[a])
    assert not eng.scheduler.admit(eng.scheduler.requests[b])
    assert eng.status(b) == "waiting" and int(eng.cache.pages.num_free) == 6
    eng.abort(a)
    assert eng.scheduler.admit(eng.scheduler.requests[b])


# --- serving options: sampling, stops, streaming, metrics, admission ----------------------


SAMPLED = dict(temperature=1.0, top_k=8, top_p=0.9, min_p=0.05, seed=1234)


def _run(eng: Engine, ids: list[int]) -> dict[int, v4.RequestOutput]:
    outs = {}
    while any(r in eng.in_flight for r in ids):
        outs.update((o.request_id, o) for o in eng.step())
    return outs


def test_a_seed_gives_the_same_tokens_alone_in_a_batch_and_after_others():
    eng = engine(keep_logits=False)
    prompt = BASE[:70]
    (alone,) = eng.generate([prompt], 6, **SAMPLED)
    ids = [eng.add_request(BASE[5:40], 6, temperature=0.8),
           eng.add_request(prompt, 6, **SAMPLED),
           eng.add_request(BASE[:130], 6, top_k=3),
           eng.add_request(prompt, 6, **SAMPLED)]  # four requests, three slots
    outs = _run(eng, ids)
    assert outs[ids[1]].tokens == outs[ids[3]].tokens == alone.tokens
    (later,) = eng.generate([prompt], 6, **SAMPLED)  # another request id, other work before
    assert later.tokens == alone.tokens and later.request_id != alone.request_id
    (other,) = eng.generate([prompt], 6, **dict(SAMPLED, seed=99))
    assert other.tokens != alone.tokens
    assert all(0 <= t < CONFIG.vocab_size for t in alone.tokens + other.tokens)
    (greedy,) = eng.generate([prompt], 6, top_k=1, temperature=1.0, seed=5)  # top_k=1: argmax
    assert greedy.tokens == cold(eng, prompt, 6).tokens


def test_stop_token_ids_and_stop_sequences_across_steps():
    eng = engine(keep_logits=False)
    prompt = BASE[:90]
    free = cold(eng, prompt, 12).tokens
    (out,) = eng.generate([prompt], 12, stop_token_ids=[free[4], 39 - free[4]])
    end = free.index(free[4]) + 1
    assert out.tokens == free[:end] and out.finish_reason == "stop"
    pair = free[5:7]  # drawn in two steps
    (out,) = eng.generate([prompt], 12, stop=[[99 % 40, 98 % 40, 97 % 40], pair])
    end = next(i + 2 for i in range(len(free) - 1) if free[i:i + 2] == pair)
    assert out.tokens == free[:end] and out.finish_reason == "stop"
    (out,) = eng.generate([prompt], 12, eos_id=free[2], stop_token_ids=[free[2]])
    assert out.finish_reason == "eos" and out.tokens[-1] == free[2]
    (out,) = eng.generate([prompt], 3, stop=[free[:12] + [0]])  # never completed
    assert out.tokens == free[:3] and out.finish_reason == "length"


def test_streamed_tokens_concatenate_to_the_outputs():
    eng = engine(keep_logits=False)
    prompts = [BASE[:150], BASE[3:10], BASE[20:90]]
    other = eng.add_request(BASE[:30], 3)  # in flight before: its output stays for step()
    stream = eng.generate(prompts, 5, stop_token_ids=[7], stream=True)
    got, finals, steps = {0: [], 1: [], 2: []}, {}, 0
    for events in stream:
        steps += 1
        for e in events:
            assert e.request_id in eng.in_flight or e.finished
            got[e.index] += e.new_tokens
            if e.finished:
                finals[e.index] = e.output
                assert e.finish_reason == e.output.finish_reason
    assert steps >= 5 and sorted(finals) == [0, 1, 2]
    for i, prompt in enumerate(prompts):
        assert got[i] == finals[i].tokens and finals[i].prompt_ids == prompt
        (want,) = eng.generate([prompt], 5, stop_token_ids=[7])
        assert want.tokens == got[i]
    assert [o.request_id for o in eng.step()] == [other]
    early = eng.generate(prompts, 5, stream=True)  # closed early: its requests leave
    next(early)
    early.close()
    assert eng.in_flight == []
    stream = eng.generate(prompts[1:], 5, stream=True)
    (first,) = next(stream)  # prompts[1] (7 tokens) drew its first token
    assert first.index == 0 and len(first.new_tokens) == 1
    eng.abort(first.request_id)  # the caller aborts it mid-stream: it leaves the stream
    rest = [e for events in stream for e in events]
    assert {e.index for e in rest} == {1} and rest[-1].finished


def test_request_metrics_and_engine_metrics():
    eng = engine(keep_logits=False)
    eng.generate([BASE[:300]], 2)  # pages to hit
    outs = eng.generate([BASE[:290] + [1], BASE[:5], BASE[40:100]], 4)
    aborted = eng.abort(eng.add_request(BASE[:20], 3))
    for out in outs + [aborted]:
        m = out.metrics
        assert m.generated_tokens == len(out.tokens)
        assert m.prompt_tokens == len(out.prompt_ids) == m.cached_tokens + m.recomputed_tokens
        assert (m.cached_tokens, m.replayed_tokens) == (out.cached_tokens, out.replayed_tokens)
        assert m.replayed_tokens <= m.cached_tokens
        assert m.finish_time >= m.arrival_time and m.queue_time >= 0
    for out in outs:
        m = out.metrics
        assert m.ttft >= m.queue_time >= 0 and m.tpot > 0 and m.tokens_per_second > 0
        assert m.arrival_time + m.ttft <= m.finish_time
    assert outs[0].metrics.cached_tokens == 256
    assert aborted.metrics.ttft is None and aborted.metrics.tpot is None
    assert aborted.metrics.tokens_per_second == 0.0
    stats = eng.metrics()
    assert stats["requests_finished"] == 5 and stats["tokens_generated"] == 2 + 12
    assert stats["mean_ttft"] > 0 and stats["mean_tpot"] > 0 and stats["mean_queue_time"] >= 0
    assert stats["cached_tokens"] == eng.memory_report().stats["cached_tokens"] == 256


def test_small_requests_pass_a_blocked_large_one_for_max_head_wait_steps():
    """Admission alone (`Scheduler.admit_queued`, once per step), on a pool of 6 pages: a large
    request waiting for pages lets small ones pass twice, then admission waits for it; it
    runs as soon as the pages are free, before the small one queued behind it."""
    geometry = v4.CacheConfig(num_pages=6, max_slots=3, max_pages_per_seq=6)
    eng = Engine(DECODER, geometry, prefill_chunk=CHUNK, max_head_wait=2)
    a = eng.add_request(BASE[:400], 100)  # 4 pages at its full length
    large = eng.add_request(BASE[1:300], 50)  # 3 pages: waits for a
    waiting = lambda r: eng.status(r) == "waiting"  # noqa: E731
    for step in range(2):
        small = eng.add_request(BASE[:20], 5)  # 1 page: fits
        eng.scheduler.admit_queued()
        assert not waiting(a) and waiting(large) and not waiting(small), step
        eng.abort(small)
    blocked = eng.add_request(BASE[:20], 5)
    eng.scheduler.admit_queued()  # the large one waited 2 steps: nothing passes it now
    assert waiting(large) and waiting(blocked)
    eng.abort(a)
    eng.scheduler.admit_queued()
    assert not waiting(large) and not waiting(blocked)
    strict = Engine(DECODER, geometry, prefill_chunk=CHUNK, max_head_wait=0)
    ids = [strict.add_request(BASE[:400], 100), strict.add_request(BASE[1:300], 50),
           strict.add_request(BASE[:20], 5)]
    strict.scheduler.admit_queued()
    assert [strict.status(r) == "waiting" for r in ids] == [False, True, True]
    assert engine().max_head_wait == 16


def test_the_serving_options_block_runs_as_written(caplog):
    page = open(os.path.join(ROOT, "docs/serving.md")).read()
    section = page.split("## Serving options\n", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```python\n(.*?)\n```", section, re.S)
    scope = {"model": DECODER, "geometry": GEOMETRY}
    with caplog.at_level(logging.INFO, logger="v4kv_jax"):
        exec(block, scope)  # noqa: S102 - the page's own code
    outs, engine = scope["outs"], scope["engine"]
    assert len(outs) == 2 and all(o.finish_reason in ("stop", "length") for o in outs)
    assert [len(o.logprobs) for o in outs] == [len(o.tokens) for o in outs]
    assert all(len(top) == 3 for o in outs for top in o.top_logprobs)
    assert [o.sample_index for o in scope["pair"]] == [0, 1]
    assert engine.metrics()["requests_finished"] == 5
    assert any(r.getMessage().startswith("compiling generator") for r in caplog.records)


def test_logprobs_penalties_and_n_samples_follow_the_numpy_rules():
    """Every token the engine draws is the numpy rule's (`test_sampling.np_penalize` on the
    token's own logits, `keep_logits`): greedy with penalties (which change the tokens of a
    prompt of few distinct tokens), and n sampled samples, each drawn with its own stream;
    the logprobs are log_softmax of those logits. The samples of a prompt are computed once
    (samples 1.. hit its full page, held by every sample at once), the streamed samples
    concatenate to their outputs, and none of it compiles a program after `warmup`."""
    eng = engine()
    eng.warmup()
    traced = {name: p.traces for name, p in programs.PROGRAMS.items()}
    prompt = ([3, 5, 7, 9] * 40)[:150]
    penalties = dict(repetition_penalty=1.8, presence_penalty=0.6, frequency_penalty=0.4)
    (plain,) = eng.generate([prompt], 8)
    (pen,) = eng.generate([prompt], 8, logprobs=5, **penalties)
    assert plain.logprobs is None and pen.tokens != plain.tokens
    for i, token in enumerate(pen.tokens):
        assert token == np.argmax(np_penalize(pen.logits[i], prompt, pen.tokens[:i], 1.8, 0.6,
                                              0.4))
        lp, top = np_logprobs(pen.logits[i], token, 5)
        np.testing.assert_allclose(pen.logprobs[i], lp, atol=1e-5)
        assert [t for t, _ in pen.top_logprobs[i]] == [t for t, _ in top]
        np.testing.assert_allclose([v for _, v in pen.top_logprobs[i]], [v for _, v in top],
                                   atol=1e-5)

    fresh = BASE[300:450]
    options = dict(temperature=1.0, top_k=12, seed=21, logprobs=0, **penalties)
    first = eng.add_request(fresh, 5, n=3, **options)
    shared = 0
    outs = {}
    while eng.in_flight:
        outs.update((o.request_id, o) for o in eng.step())
        shared = max(shared, eng.memory_report().pages_shared)
    assert sorted(outs) == [first, first + 1, first + 2] and shared >= 1
    samples = [outs[first + j] for j in range(3)]
    assert [o.sample_index for o in samples] == [0, 1, 2]
    assert [o.cached_tokens for o in samples] == [0, P, P]
    assert len({tuple(o.tokens) for o in samples}) == 3
    for j, out in enumerate(samples):
        key = sample_stream(stream_key(21), j)
        assert out.top_logprobs == [[]] * len(out.tokens)
        for i, token in enumerate(out.tokens):
            logits = np_penalize(out.logits[i], fresh, out.tokens[:i], 1.8, 0.6, 0.4)
            want = sample(jnp.asarray(logits, jnp.float32)[None], row_keys(key[None], i),
                          jnp.ones((1,), jnp.float32), jnp.full((1,), 12, jnp.int32))
            assert token == int(want[0]), (j, i)
            lp, _ = np_logprobs(out.logits[i], token, 0)
            np.testing.assert_allclose(out.logprobs[i], lp, atol=1e-5)

    streamed = {}
    for events in eng.generate([fresh, prompt], 4, n=2, stream=True,
                               **dict(options, logprobs=2)):
        for e in events:
            got = streamed.setdefault((e.index, e.sample_index), [[], [], []])
            got[0] += e.new_tokens
            got[1] += e.logprobs
            got[2] += e.top_logprobs
            if e.finished:
                got.append(e.output)
    assert sorted(streamed) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for tokens, logprobs, top, out in streamed.values():
        assert (tokens, logprobs, top) == (out.tokens, out.logprobs, out.top_logprobs)
    assert streamed[0, 0][0] == samples[0].tokens[:4]  # the seed's streams, sample by sample
    assert streamed[0, 1][0] == samples[1].tokens[:4]
    assert {name: p.traces for name, p in programs.PROGRAMS.items()} == traced


def test_bad_serving_options_name_the_argument():
    eng = engine()
    for kwargs, message in [
            (dict(n=0), r"n: expected an integer in \[1, inf\]; got 0"),
            (dict(logprobs=25), r"logprobs: expected an integer in \[0, 20\]; got 25"),
            (dict(repetition_penalty=-1.0),
             r"repetition_penalty: expected a number in \(0.0, inf\]; got -1.0")]:
        with pytest.raises(ValueError, match=message):
            eng.add_request(BASE[:5], 2, **kwargs)
        with pytest.raises(ValueError, match=message):
            eng.generate([BASE[:5]], 2, **kwargs)
    assert eng.in_flight == []
