"""HiSparse: the C4 entries in host memory (`CacheConfig.c4_tier="host"`) and a hot set per
CSA layer and slot on the device (`hot_rows`): the CSA read fetches its picks into the hot
rows, least recently used out, and reads only those rows. Every stored array and every output
is the bits of the all-on-device run without a hot set, in prefill chunks and in decode, on
the reference and on the kernels, and an Engine's tokens and logits are those of an Engine
with every entry on the device, prefix hits from every tier included. The reference's bits
are held as users compile, at XLA's defaults (`xla_defaults`: one subprocess, sharing its
programs); the kernels' in interpret mode, which users do not run, and one program's runs
against each other, at the suite's flags (tests/conftest.py)."""

from __future__ import annotations

import dataclasses

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import v4kv_jax as v4
from v4kv_jax import pools, step
from v4kv_jax.nn import Decoder, ModelConfig
from v4kv_jax.ops import hot
from v4kv_jax.serve.engine import Engine
from v4kv_jax.testing import synthetic

from conftest import MODEL, OPTIONS, chunk_plan, lowerings, new_cache, positions, run_chunks

LENGTHS = [300, 211]
# Prefill chunks of 32 (two query tiles of 16), then decode steps, then a chunk again.
PLAN = chunk_plan(LENGTHS, [32, 29, 1, 1, 30, 1, 1, 1])
# index_topk = 8: 8 rows read one query at a time and evict on every step (C4 entries on the
# device); 24 rows read groups of 3 queries (16-query tiles end in a padded group), the C4
# entries in host memory.
HOT_ROWS = (8, 24)


def geometry(hot_rows: int) -> v4.CacheConfig:
    return v4.CacheConfig(num_pages=8, max_slots=3, max_pages_per_seq=4, hot_rows=hot_rows,
                          c4_tier="host" if hot_rows == 24 else "device")


@pytest.fixture(scope="module")
def data():
    return synthetic.SyntheticBatch.draw(MODEL, 2, max(LENGTHS), seed=5)


@pytest.fixture(scope="module")
def runs(data):
    return {h: run_chunks(new_cache(MODEL, geometry(h)), data, PLAN) for h in (0, *HOT_ROWS)}


def without_hot_set(cache):
    return cache.replace(state=cache.state.replace(hot=None))


def assert_same_bits(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.xla_defaults
@pytest.mark.parametrize("hot_rows", HOT_ROWS)
def test_reads_through_the_hot_set_equal_reads_from_the_pool(runs, hot_rows):
    cache0, out0 = runs[0]
    cache, out = runs[hot_rows]
    assert_same_bits(without_hot_set(cache), cache0)
    # A chunk is made resident a group of queries at a time, then read at once like the
    # pool: the same products of the same shapes, summed in the same order.
    assert out.tobytes() == out0.tobytes()
    assert pools.hot_set(cache0) is None
    # The C4 entries stay in their memory space through every donated step; the rest on
    # the device.
    kinds = {x.sharding.memory_kind for x in jax.tree.leaves(cache)}
    c4_kind = pools.csa_entries(cache).c4.sharding.memory_kind
    assert c4_kind == ("pinned_host" if cache.geometry.c4_tier == "host" else "device")
    assert kinds == {"device", c4_kind}
    # What a slot holds reads the same (`read_slot`) whichever memory holds its C4 entries.
    for slot in range(len(LENGTHS)):
        got, want = v4.read_slot(cache, slot), v4.read_slot(cache0, slot)
        assert got.length == want.length == LENGTHS[slot]
        for name, rows in want.entries.items():
            np.testing.assert_array_equal(got.entries[name], rows)


@pytest.mark.xla_defaults
@pytest.mark.parametrize("hot_rows", HOT_ROWS)
def test_every_held_row_is_a_copy_of_its_stored_entry(runs, hot_rows):
    cache, _ = runs[hot_rows]
    hs = pools.hot_set(cache)
    held, used = np.asarray(hs.held.records())[..., 0], np.asarray(hs.used.records())[..., 0]
    rows = np.asarray(hs.rows.records())
    c4 = np.asarray(pools.csa_entries(cache).c4.records())
    table = np.asarray(pools.page_table(cache))
    epp = cache.geometry.entries_per_page(MODEL.csa_ratio)
    assert held.shape == (MODEL.num_csa, 3, hot_rows)
    for layer in range(MODEL.num_csa):
        for slot, length in enumerate(LENGTHS):
            ids = held[layer, slot][held[layer, slot] > 0] - 1
            assert len(ids) == hot_rows  # long sequences: every row in use
            assert len(set(ids)) == len(ids) and (ids < length // MODEL.csa_ratio).all()
            want = c4[layer, table[slot, ids // epp], ids % epp]
            np.testing.assert_array_equal(rows[layer, slot][held[layer, slot] > 0], want)
            assert (used[layer, slot] <= length).all() and used[layer, slot].max() == length
        assert (held[layer, 2] == 0).all()  # the unused slot: nothing fetched


def test_a_group_reuses_held_rows_and_evicts_the_least_recently_used():
    # Four hot rows; entry e of the row's sequence is stored as the value 100 * page + row.
    epp = 4
    entries = (100 * jnp.arange(3)[:, None] + jnp.arange(epp)[None, :]).astype(jnp.float32)
    entries = pools.LaneMap(2, epp, jnp.float32).pack(
        jnp.broadcast_to(entries[None, :, :, None], (1, 3, epp, 2)))
    page_rows = jnp.array([[2, 0, 1, -1]], jnp.int32)  # entries 0-3 page 2, 4-7 page 0, ...
    ids = pools.LaneMap(1, 4, jnp.int32)
    state = pools.HotSet(rows=pools.LaneMap(2, 4, jnp.float32).zeros((1,)),
                         held=ids.pack(jnp.array([[0, 6, 3, 0]])[..., None]),
                         used=ids.pack(jnp.array([[0, 3, 7, 0]])[..., None]))

    def resident(picks, pos):
        return hot.resident(jnp.array(picks, jnp.int32), jnp.array(pos, jnp.int32), state,
                            entries, 0, page_rows)

    def held_used_rows(state):
        return hot.hot_ids(state.held), hot.hot_ids(state.used), state.rows.records()

    # Entry 2 is held (row 2); 9 is fetched into the first empty row; 13's page is absent.
    rows, state = resident([[[2, 9, 13]]], [[10]])
    held, used, stored = held_used_rows(state)
    np.testing.assert_array_equal(rows, [[[2, 0, -1]]])
    np.testing.assert_array_equal(held, [[10, 6, 3, 0]])
    np.testing.assert_array_equal(used, [[11, 3, 11, 0]])
    np.testing.assert_array_equal(stored[0, 0], [101, 101])  # entry 9: page 1, row 1
    # No hit: 7 takes the empty row 3, 8 evicts entry 5 (row 1, last used at clock 3).
    rows, state = resident([[[7, 8, -1]]], [[11]])
    held, used, stored = held_used_rows(state)
    np.testing.assert_array_equal(rows, [[[3, 1, -1]]])
    np.testing.assert_array_equal(held, [[10, 9, 3, 8]])
    np.testing.assert_array_equal(used, [[11, 12, 11, 12]])
    np.testing.assert_array_equal(stored[0, 1], [100, 100])  # entry 8: page 1, row 0
    np.testing.assert_array_equal(stored[0, 3], [3, 3])  # entry 7: page 0, row 3
    # Two queries picking the same new entries fetch each once, into one row each (8 is
    # held: its row is not evicted; 4 and 6 take the rows last used at clock 11).
    rows, state = resident([[[4, 6, -1], [6, 4, 8]]], [[12, 13]])
    held, used, stored = held_used_rows(state)
    np.testing.assert_array_equal(rows, [[[0, 2, -1], [2, 0, 1]]])
    np.testing.assert_array_equal(held, [[5, 9, 7, 8]])
    np.testing.assert_array_equal(used, [[14, 14, 14, 12]])
    np.testing.assert_array_equal(stored[0, :3, 0], [0, 100, 2])  # entries 4, 8, 6


def _assign_by_hand(picks, clock, held, used):
    """The rule `hot._assign` keeps, in plain Python: a pick of a held entry reads its row;
    the distinct missing entries, smallest id first, take the empty rows (lowest first),
    then the least recently used rows (lowest first on a tie) that no hit reads."""
    H = len(held)
    row_of = {int(h) - 1: r for r, h in enumerate(held) if h}
    kept = {row_of[p] for p in picks if p in row_of}
    free = sorted((r for r in range(H) if r not in kept),
                  key=lambda r: (-1 if held[r] == 0 else used[r], r))
    missing = sorted({int(p) for p in picks if p >= 0 and p not in row_of})
    dest_of = dict(zip(missing, free, strict=False))
    out = [row_of.get(int(p), dest_of.get(int(p), -1)) if p >= 0 else -1 for p in picks]
    held, used = list(held), list(used)
    for e, r in dest_of.items():
        held[r] = e + 1
    for r in set(out) - {-1}:
        used[r] = clock
    return out, sorted(dest_of), held, used


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(st.data())
def test_assign_keeps_hits_and_fills_free_then_least_recent_rows(draw):
    H = draw.draw(st.sampled_from([4, 8]))
    held_ids = draw.draw(st.lists(st.integers(0, 11), max_size=H, unique=True))
    rows = draw.draw(st.permutations(range(H)))[:len(held_ids)]
    held, used = np.zeros(H, np.int32), np.zeros(H, np.int32)
    held[rows] = np.asarray(held_ids, np.int32) + 1
    used[rows] = draw.draw(st.lists(st.integers(1, 5), min_size=len(rows),
                                    max_size=len(rows)))
    # A group of queries: at most H distinct picks, repeats and -1 padding among them.
    distinct = draw.draw(st.lists(st.integers(0, 11), min_size=1, max_size=H, unique=True))
    picks = draw.draw(st.lists(st.sampled_from(distinct + [-1]), min_size=1, max_size=2 * H))
    picks = np.asarray(picks + [-1] * (2 * H - len(picks)), np.int32)  # one shape per H
    out, fetch, dest, new_held, new_used = jax.jit(hot._assign)(picks, jnp.int32(9), held, used)
    want_out, want_fetch, want_held, want_used = _assign_by_hand(picks, 9, held, used)
    np.testing.assert_array_equal(out, want_out)
    np.testing.assert_array_equal(np.asarray(fetch)[np.asarray(fetch) >= 0], want_fetch)
    np.testing.assert_array_equal(new_held, want_held)
    np.testing.assert_array_equal(new_used, want_used)
    fetched = np.asarray(fetch) >= 0
    np.testing.assert_array_equal(np.asarray(new_held)[np.asarray(dest)[fetched]],
                                  np.asarray(fetch)[fetched] + 1)


def decode_once(cache, data, options, poison=False):
    """Prefill both rows to LENGTHS - 1 with the reference, then one decode step with
    `options`: (outputs, cache)."""
    cache, _ = run_chunks(cache, data, chunk_plan([n - 1 for n in LENGTHS], [32] * 10),
                          with_attention=True)
    if poison:
        cache = synthetic.poison_unowned(cache)
    start = np.array(LENGTHS) - 1
    cache, out = step.append_and_attend(
        cache, data.take(positions(start, 1)), data.stacked_queries(positions(start, 1)),
        data.weights, np.arange(2), np.ones(2, np.int32), options=options)
    return np.asarray(out), cache


@pytest.mark.parametrize("implementation", ["pallas_tpu", "pallas_gpu"])
def test_kernels_in_interpret_mode_read_the_hot_rows_bit_for_bit(data, implementation):
    options = v4.Options(implementation=implementation, interpret=True, query_tile=16)
    want, cache0 = decode_once(new_cache(MODEL, geometry(0)), data, options)
    # The C4 entries on the device: jax 0.10.2 cannot lower interpret-mode kernels (their
    # callbacks' effect tokens) in a program with host-memory outputs.
    got, cache = decode_once(new_cache(MODEL, geometry(8)), data, options, poison=True)
    np.testing.assert_array_equal(got, want)
    assert_same_bits(without_hot_set(synthetic.poison_unowned(cache)),
                     synthetic.poison_unowned(cache0))


def test_unowned_hot_rows_are_never_read(data):
    clean, _ = decode_once(new_cache(MODEL, geometry(24)), data, OPTIONS)
    poisoned, cache = decode_once(new_cache(MODEL, geometry(24)), data, OPTIONS, poison=True)
    np.testing.assert_array_equal(poisoned, clean)
    assert np.isnan(np.asarray(pools.hot_set(cache).rows.records())[:, 2]).all()  # not live


@pytest.mark.xla_defaults
def test_a_new_or_restored_sequence_starts_with_an_empty_hot_set(runs):
    cache, _ = runs[8]
    snapshot = pools.snapshot_state(cache, 1)
    restored = pools.restore_state(cache, 1, snapshot)
    held = np.asarray(hot.hot_ids(pools.hot_set(restored).held))
    assert (held[:, 1] == 0).all() and (held[:, 0] > 0).all()
    assert_same_bits(without_hot_set(restored), without_hot_set(cache))
    reset = v4.reset_slot(v4.release_slot(cache, 0), 0)
    assert (np.asarray(hot.hot_ids(pools.hot_set(reset).held))[:, 0] == 0).all()


@pytest.mark.xla_defaults
def test_the_memory_report_counts_the_hot_sets_and_the_host_tier(runs):
    cache = runs[24][0]
    report, without = pools.memory_report(cache), pools.memory_report(runs[0][0])
    assert report.state_bytes_total == 3 * report.state_bytes_per_request
    c4_row = pools.codec(cache, "csa").row_bytes
    assert report.state_logical_bytes_per_request - without.state_logical_bytes_per_request == (
        MODEL.num_csa * 24 * (c4_row + 8))
    # As stored: 24 rows of 32 words, four to a lane row, in 8 lane rows (6 rounded up to a
    # multiple of 8); held and used, 24 words each in one lane row.
    lanes = cache.layout.lanes
    assert (lanes["hot"].block_bytes, lanes["hot_ids"].block_bytes) == (8 * 512, 512)
    assert report.state_bytes_per_request - without.state_bytes_per_request == (
        MODEL.num_csa * (8 * 512 + 2 * 512))
    c4_bytes = pools.csa_entries(cache).c4.nbytes
    classical = sum(x.nbytes for x in jax.tree.leaves(cache.classical))
    assert report.host_bytes == {"classical": c4_bytes, "state": 0}
    assert report.device_bytes == {"classical": classical - c4_bytes,
                                   "state": report.state_bytes_total}
    assert without.host_bytes == {"classical": 0, "state": 0}
    per_token = report.stored_bytes_per_token
    assert report.device_bytes_per_token == per_token["total"] - (
        MODEL.num_csa * c4_row / MODEL.csa_ratio)  # C4 entries: 32 rows in 8 full lane rows
    # The host tier's capacity, and what the slots need at full length: 3 requests of 4 pages
    # of 128 tokens, 32 C4 entries a page in each CSA layer.
    per_request = MODEL.num_csa * 4 * 32 * c4_row
    assert report.host_bytes_per_request == per_request and without.host_bytes_per_request == 0
    assert report.host_bytes_for_slots == 3 * per_request
    text = report.format()
    assert (f"Host capacity:         {c4_bytes:,} B, the C4 entries of all 8 pages (device "
            f"Classical {classical - c4_bytes:,} B, ") in text
    assert (f"Host need:             3 requests of up to 512 tokens: 3 x {per_request:,} B = "
            f"{3 * per_request:,} B of C4 entries (every slot at full length, no page "
            "shared)") in text
    assert "Host" not in without.format()


@pytest.mark.xla_defaults
def test_pages_move_out_of_and_into_the_host_tier(runs):
    """read_pages / load_pages (the prefix cache's page moves) read and write the C4 rows
    where they live."""
    host, device = runs[24][0], runs[0][0]
    ids = np.array([0, 3, -1], np.int32)
    moved, want = pools.read_pages(host, ids), pools.read_pages(device, ids)
    assert_same_bits(moved, want)
    loaded, taken = pools.load_pages(host, moved, 2)
    loaded_device, taken_device = pools.load_pages(device, want, 2)
    np.testing.assert_array_equal(taken, taken_device)
    assert pools.csa_entries(loaded).c4.sharding.memory_kind == "pinned_host"
    assert_same_bits(pools.read_pages(loaded, taken), pools.read_pages(loaded_device, taken))


def _chat(geometry: v4.CacheConfig, snapshot_dir) -> list:
    """Four conversations of two turns through a pool of 6 pages (2 on the host tier, the
    rest on disk): the second turns hit snapshots from every tier and pages from the host
    and the disk."""
    attention = v4.tiny(index_heads=16, window=64, compress_ratios=(0, 4, 16))
    decoder = Decoder(ModelConfig(attention, vocab_size=40, mlp_hidden=48), rngs=nnx.Rngs(1),
                      bias_scale=0.5)
    eng = Engine(decoder, geometry, prefill_chunk=64, keep_logits=True, host_pages=2,
                 snapshot_dir=snapshot_dir, device_snapshots=1, host_snapshots=1)
    tokens = np.random.default_rng(5).integers(0, 40, 400).tolist()
    conversations = [tokens[40 * i:40 * i + 270] for i in range(4)]
    outputs = []
    for turn in range(2):
        for i, conversation in enumerate(conversations):
            (out,) = eng.generate([conversation], 4, cache_salt=f"conversation-{i}")
            outputs.append(out)
            conversation += out.tokens + [i, turn + 1]
    return outputs


@pytest.mark.xla_defaults
def test_an_engine_chat_with_hits_from_every_tier_gives_the_bits_of_the_device_engine(
        tmp_path):
    geometry = v4.CacheConfig(num_pages=6, max_slots=2, max_pages_per_seq=5)
    device = _chat(geometry, tmp_path / "device")
    host = _chat(dataclasses.replace(geometry, c4_tier="host"), tmp_path / "host")
    for a, b in zip(device, host, strict=True):
        assert (b.cached_tokens, b.restored_by, b.snapshot_tier, b.cached_from) == (
            a.cached_tokens, a.restored_by, a.snapshot_tier, a.cached_from)
        assert b.tokens == a.tokens and b.logits.tobytes() == a.logits.tobytes()
    hits = host[4:]
    assert {o.snapshot_tier for o in hits} == {"device", "host", "disk"}
    assert all(o.cached_tokens == 256 for o in hits)
    assert sum(o.cached_from["host"] for o in hits) and sum(o.cached_from["disk"] for o in hits)


def test_host_c4_entries_need_a_hot_set_of_two_top_k_by_default():
    host = v4.CacheConfig(num_pages=8, max_slots=1, max_pages_per_seq=4, c4_tier="host")
    assert pools.hot_set(v4.init_cache(MODEL, host)).held.records().shape == (
        MODEL.num_csa, 1, 16, 1)
    assert pools.hot_set(v4.init_cache(MODEL, geometry(0))) is None
    with pytest.raises(ValueError, match=r"hot_rows: expected a hot set \(None, or at least "
                                         r"the model's index_topk\) with c4_tier='host'"):
        v4.CacheConfig(num_pages=8, max_slots=1, max_pages_per_seq=4, c4_tier="host",
                       hot_rows=0)
    with pytest.raises(ValueError, match=r"c4_tier: expected one of"):
        v4.CacheConfig(num_pages=8, max_slots=1, max_pages_per_seq=4, c4_tier="disk")


def test_hot_rows_must_hold_a_whole_top_k():
    with pytest.raises(ValueError, match=r"hot_rows: expected 0 \(no hot set\) or at least "
                                         r"the model's index_topk=8; got 7"):
        v4.init_cache(MODEL, geometry(7))
    with pytest.raises(TypeError, match=r"hot_rows: expected an integer; got 8.0"):
        geometry(8.0)
    with pytest.raises(ValueError, match=r"hot_rows: expected an integer in \[0, inf\]; got -1"):
        geometry(-1)


@pytest.mark.parametrize("c4_tier", ["host", "device"])
def test_one_executable_serves_every_step_in_either_tier(c4_tier):
    # A model and geometry of this test only: its first step compiles here.
    model = v4.tiny(compress_ratios=(4,))
    cache = v4.init_cache(model, v4.CacheConfig(num_pages=2, max_slots=1, max_pages_per_seq=2,
                                                c4_tier=c4_tier))
    # Committed throughout with the C4 entries on the host (as the step returns it), else
    # not at all (as the step returns it then); no array weakly typed (a program returns
    # its arrays strongly typed: the next call would compile again).
    assert {x.committed for x in jax.tree.leaves(cache)} == {c4_tier == "host"}
    assert not any(x.weak_type for x in jax.tree.leaves(cache))
    cache = v4.reset_slot(cache, 0)
    # Zero vectors and weights: nothing to draw or compile but the step.
    vectors = v4.TokenVectors(
        window=np.zeros((model.num_layers, 1, 1, model.head_dim), np.float32),
        **{spec.name: v4.CompressorInput(*np.zeros(
            (2, len(model.layers_of(spec.kind)), 1, 1, spec.in_width), np.float32))
           for spec in cache.specs})
    weights = v4.CompressorWeights.init(model)
    compiled, traces = [], step._append_all_jit.traces
    for _ in range(3):
        with lowerings("_append_all") as made:
            cache = step.decode_step(cache, vectors, weights)
        compiled.append(len(made))
    assert compiled == [1, 0, 0]
    assert step._append_all_jit.traces == traces + 1
    np.testing.assert_array_equal(pools.lengths(cache), [3])
    assert {x.committed for x in jax.tree.leaves(cache)} == {c4_tier == "host"}
    # Poisoned, it keeps its placement (the programs it goes to compile once).
    poisoned = synthetic.poison_unowned(cache)
    assert {x.committed for x in jax.tree.leaves(poisoned)} == {c4_tier == "host"}
