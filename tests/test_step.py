"""decode_step / prefill / layer attention: block edges, streaming equivalences, the oracle."""

from __future__ import annotations

import functools
import re

import chex
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import v4kv_jax as v4
from v4kv_jax import append, ops, pools, programs, step
from v4kv_jax.config import LayerKind
from v4kv_jax.ops import attention, indexer
from v4kv_jax.pools import paging
from v4kv_jax.testing import oracle, synthetic

from conftest import (
    CHUNK,
    GEOMETRY,
    MODEL,
    OPTIONS,
    assert_matches_oracle,
    chunk_plan,
    hypothesis_examples,
    new_cache,
    oracle_atol,
    run_chunks,
)

# The SPEC's own numbers: W = 128, m = 4, m' = 128.
SPEC_MODEL = v4.tiny(window=128, hca_ratio=128, compress_ratios=(0, 4, 128), index_topk=64)
SPEC_GEOMETRY = v4.CacheConfig(num_pages=8, max_slots=1, max_pages_per_seq=4)


def logical_entries(cache, name: str, kind_layer: int, slot: int, count: int) -> np.ndarray:
    """Entries 0..count-1 of a slot, read through its page-table row."""
    spec = next(s for s in cache.specs if s.name == name)
    epp = cache.geometry.entries_per_page(spec.ratio)
    table = np.asarray(cache.pages.page_table[slot])
    pool = np.asarray(pools.entries(cache, spec)[kind_layer].records())
    i = np.arange(count)
    return pool[table[i // epp], i % epp]


@pytest.fixture(scope="module")
def spec_example():
    data = synthetic.SyntheticBatch.draw(SPEC_MODEL, 1, 140, seed=3)
    cache = new_cache(SPEC_MODEL, SPEC_GEOMETRY)
    cache, _ = run_chunks(cache, data, chunk_plan([130], [CHUNK]), with_attention=False)
    return data, cache


def test_l130_worked_example(spec_example):
    data, cache = spec_example
    (rep,) = v4.inspect_slots(cache)
    assert rep.length == 130
    assert (rep.c4_entries, rep.c128_entries) == (32, 1)
    assert (rep.csa_tail, rep.hca_tail) == (2, 2)
    assert rep.window == (2, 129)
    assert rep.pages == (0, 1)
    inv = oracle.inv_frequencies(SPEC_MODEL, LayerKind.CSA)
    h = data.history(1, 0)
    for name, kv, gate, ape, norm in (("csa", h.kv, h.gate, h.ape, h.norm),
                                      ("csa_index", h.index_kv, h.index_gate, h.index_ape,
                                       h.index_norm)):
        want = oracle.compress(kv, gate, ape, norm, 4, True, inv, 1e-6, 130)
        assert want.shape[0] == 32
        got = logical_entries(cache, name, 0, 0, 33)
        atol = oracle_atol(SPEC_MODEL, LayerKind.CSA, 4 * np.arange(32)[:, None])
        assert_matches_oracle(got[:32], want, atol, err_msg=name)
        assert not got[32].any(), "entry 32 (block 128..131) must not exist yet"
    h = data.history(2, 0)
    want = oracle.compress(h.kv, h.gate, h.ape, h.norm, 128, False, inv, 1e-6, 130)
    assert_matches_oracle(logical_entries(cache, "hca", 0, 0, 1), want,
                          oracle_atol(SPEC_MODEL, LayerKind.HCA, 0), err_msg="hca")
    # The window ring holds positions 2..129, each at row p % 128.
    ring = np.asarray(pools.window_ring(cache)[:, 0].records())
    for p in range(2, 130):
        np.testing.assert_array_equal(ring[:, p % 128], data.window[:, 0, p])
    # CSA tail: first halves of 124..127 and the open block 128, 129 at rows p % 8.
    tail = np.asarray(cache.state.csa.main.kv[0, 0].records())
    for p in range(124, 130):
        np.testing.assert_array_equal(tail[p % 8], data.compressors["csa"][0][0, 0, p])
    hca_tail = np.asarray(cache.state.hca.kv[0, 0].records())
    for p in (128, 129):
        np.testing.assert_array_equal(hca_tail[p % 128], data.compressors["hca"][0][0, 0, p])


def test_token_131_completes_entry_32_at_rope_position_128(spec_example):
    data, cache = spec_example
    cache = jax.tree.map(jnp.copy, cache)
    for p in (130, 131):
        cache = step.prefill(cache, data.span(p, p + 1), data.weights, [0], [1])
        got = logical_entries(cache, "csa", 0, 0, 33)[32]
        assert got.any() == (p == 131), f"entry 32 after position {p}"
    h = data.history(1, 0)
    inv = oracle.inv_frequencies(SPEC_MODEL, LayerKind.CSA)
    want = oracle.compress(h.kv, h.gate, h.ape, h.norm, 4, True, inv, 1e-6, 132)[32]
    assert_matches_oracle(got, want, oracle_atol(SPEC_MODEL, LayerKind.CSA, 128))


def test_visibility_at_block_edges(spec_example):
    data, cache = spec_example
    q_pos = jnp.asarray([[2, 3, 126, 127]])
    queries = data.queries(1, np.asarray(q_pos))
    picks = indexer.index_topk(SPEC_MODEL, SPEC_GEOMETRY, v4.Options(),
                               index_keys=pools.csa_entries(cache).index_keys, layer=0,
                               page_rows=cache.pages.page_table[:1], index_q=queries.index_q,
                               index_weights=queries.index_weights, q_pos=q_pos,
                               kv_end=jnp.asarray([130]))
    sets = [sorted(int(i) for i in row if i >= 0) for row in np.asarray(picks)[0]]
    assert sets == [[], [0], list(range(31)), list(range(32))]
    # HCA: t = 126 sees no C128 entry, t = 127 sees entry 0.
    hca_q = data.queries(2, np.asarray(q_pos)).replace(sink=jnp.asarray(data.sinks[2]))
    ring = pools.window_ring(cache)[2, :1]

    def out(c128):
        return np.asarray(attention.attend(
            SPEC_MODEL, SPEC_GEOMETRY, v4.Options(), LayerKind.HCA, layer=0, entries=c128,
            page_rows=cache.pages.page_table[:1], q=hca_q.q, sink=hca_q.sink, q_pos=q_pos,
            kv_end=jnp.asarray([130]),
            window_keys=attention.ordered_window(ring.records(), jnp.asarray([130])),
            window_base=jnp.asarray([2])))

    c128 = pools.hca_entries(cache).c128
    changed = c128.put((0, 0), 0, c128.take((0, 0), 0) * -3.0)
    a, b = out(c128), out(changed)
    np.testing.assert_array_equal(a[0, :3], b[0, :3])
    assert np.abs(a[0, 3] - b[0, 3]).max() > 1e-3


# --- streaming equivalences -------------------------------------------------------------------


def _state_arrays(cache, slot: int) -> dict[str, np.ndarray]:
    return {
        "window": np.asarray(pools.window_ring(cache)[:, slot].records()),
        **{f"{s.name}.kv": np.asarray(pools.tail(cache, s).kv[:, slot].records())
           for s in cache.specs},
        **{f"{s.name}.gate": np.asarray(pools.tail(cache, s).gate[:, slot].records())
           for s in cache.specs},
    }


def _logical(cache, slot: int, length: int) -> dict[str, np.ndarray]:
    out = {}
    for s in cache.specs:
        n = len(cache.attn_config.layers_of(s.kind))
        out[s.name] = np.stack([logical_entries(cache, s.name, k, slot, length // s.ratio)
                                for k in range(n)])
    return out


@settings(max_examples=hypothesis_examples(50), deadline=None)
@given(length=st.integers(1, 150), sizes=st.lists(st.integers(1, CHUNK), min_size=1, max_size=4),
       seed=st.integers(0, 1000))
def test_decode_equals_prefill_equals_any_chunking(length, sizes, seed):
    data = synthetic.SyntheticBatch.draw(MODEL, 1, length, seed=seed)
    chunked, out_chunked = run_chunks(new_cache(slots=[0]), data, chunk_plan([length], sizes))
    decoded, out_decoded = run_chunks(new_cache(slots=[0]), data, [[1]] * length, chunk=1)
    widest, _ = run_chunks(new_cache(slots=[0]), data, chunk_plan([length], [CHUNK]),
                           with_attention=False)
    for other in (decoded, widest):
        # Integer state exactly; entries, tails and window within 1e-6.
        chex.assert_trees_all_equal((chunked.pages, chunked.state.lengths, chunked.state.status),
                                    (other.pages, other.state.lengths, other.state.status))
        chex.assert_trees_all_close(_state_arrays(chunked, 0), _state_arrays(other, 0),
                                    atol=1e-6, rtol=0)
        chex.assert_trees_all_close(_logical(chunked, 0, length), _logical(other, 0, length),
                                    atol=1e-6, rtol=0)
    # Outputs: the stated chunking bound, 16 ulp of the largest output magnitude
    # (docs/guarantees.md; tests/test_chunking_bound.py).
    bound = 16 * np.spacing(np.float32(np.abs(out_decoded).max()))
    np.testing.assert_allclose(out_chunked, out_decoded, atol=bound, rtol=0)


@settings(max_examples=hypothesis_examples(50), deadline=None)
@given(lengths=st.lists(st.integers(0, 190), min_size=3, max_size=3),
       sizes=st.lists(st.integers(0, CHUNK), min_size=3, max_size=9), seed=st.integers(0, 99))
def test_stored_state_follows_lengths(lengths, sizes, seed):
    """What is stored after any ragged chunking, from the SPEC and the token data alone: the
    pages, the window ring, the tails of SPEC section 4 and exactly the emitted entries."""
    data = synthetic.SyntheticBatch.draw(MODEL, 3, max(lengths) + 1, seed=seed)
    lengths = np.asarray(lengths)
    plan, done = [], np.zeros(3, np.int64)
    i = 0
    while (done < lengths).any():
        n = np.minimum([sizes[(i + b) % len(sizes)] or 1 for b in range(3)], lengths - done)
        plan.append(n)
        done += n
        i += 1
    cache, _ = run_chunks(new_cache(), data, plan, with_attention=False)
    P, W = GEOMETRY.page_tokens, MODEL.window
    np.testing.assert_array_equal(cache.state.lengths, lengths)
    table = np.asarray(cache.pages.page_table)
    held = [row[row >= 0] for row in table]
    # One page per P-token span a position of the row falls in: pages k * P .. k * P + P - 1.
    assert [len(h) for h in held] == [len(range(0, L, P)) for L in lengths]
    held_ids = np.concatenate(held)
    assert len(set(held_ids.tolist())) == len(held_ids)
    assert int(cache.pages.num_free) == GEOMETRY.num_pages - len(held_ids)
    ring = np.asarray(pools.window_ring(cache).records())
    for s, L in enumerate(lengths):
        for p in range(max(0, L - W), L):
            np.testing.assert_array_equal(ring[:, s, p % W], data.window[:, s, p])
        for spec in cache.specs:
            m, tail = spec.ratio, jax.tree.map(np.asarray, pools.tail(cache, spec).replace(
                kv=pools.tail(cache, spec).kv.records(),
                gate=pools.tail(cache, spec).gate.records()))
            kv, gate = data.compressors[spec.name]
            params = getattr(data.weights, spec.name)
            ape, norm = np.asarray(params.ape), np.asarray(params.norm)
            # Tails: the open block's tokens; with overlap also the last complete block's.
            first = (L // m - 1) * m if spec.overlap else L // m * m
            for p in range(max(0, first), L):
                np.testing.assert_array_equal(tail.kv[:, s, p % spec.ring], kv[:, s, p])
                np.testing.assert_allclose(tail.gate[:, s, p % spec.ring],
                                           gate[:, s, p] + ape[:, p % m], rtol=1e-6)
            # Entries: one per token that completed a block, (p + 1) % m == 0 (SPEC section 3).
            n = sum((p + 1) % m == 0 for p in range(L))
            if not held[s].size:
                continue
            got = logical_entries(cache, spec.name, 0, s, n + 1)
            want = oracle.compress(kv[0, s], gate[0, s], ape[0], norm[0], m, spec.overlap,
                                   oracle.inv_frequencies(MODEL, spec.kind), MODEL.rms_eps, L)
            assert_matches_oracle(got[:n], want,
                                  oracle_atol(MODEL, spec.kind, m * np.arange(n)[:, None]),
                                  err_msg=f"{spec.name} slot {s}")
            if n < len(held[s]) * GEOMETRY.entries_per_page(m):
                assert not got[n].any(), f"{spec.name}: entry {n} written early"


def test_a_page_is_taken_by_the_first_token_it_holds():
    # P = 128: a slot holds no page at 0 tokens, one at 1..128, two at 129..256.
    data = synthetic.SyntheticBatch.draw(MODEL, 3, 131, seed=1)
    plan = chunk_plan([127, 128, 0], [CHUNK])
    for extra, want in ((0, [1, 1, 0]), (1, [1, 2, 1]), (2, [2, 2, 1])):
        cache, _ = run_chunks(new_cache(), data, plan + [[1, 1, 1]] * extra,
                              with_attention=False)
        np.testing.assert_array_equal(cache.state.lengths, [127 + extra, 128 + extra, extra])
        assert [len(r.pages) for r in v4.inspect_slots(cache)] == want, f"{extra} more"
        assert int(cache.pages.num_free) == GEOMETRY.num_pages - sum(want)


@settings(max_examples=hypothesis_examples(30), deadline=None)
@given(lengths=st.lists(st.integers(1, 120), min_size=3, max_size=3),
       sizes=st.lists(st.integers(1, CHUNK), min_size=1, max_size=3), seed=st.integers(0, 99))
def test_ragged_batch_equals_each_request_alone(lengths, sizes, seed):
    data = synthetic.SyntheticBatch.draw(MODEL, 3, max(lengths), seed=seed)
    plan = chunk_plan(lengths, sizes)
    batched, out = run_chunks(new_cache(), data, plan)
    for b, L in enumerate(lengths):
        alone_plan = [[n[b]] for n in plan if n[b]]
        cache, out_alone = run_chunks(new_cache(), data, alone_plan, rows=[b], slot_ids=[0])
        np.testing.assert_allclose(out[:, b, :L], out_alone[:, 0, :L], rtol=2e-6, atol=1e-6)
        for name, a in _logical(batched, b, L).items():
            np.testing.assert_allclose(a, _logical(cache, 0, L)[name], atol=1e-6)


def test_matches_brute_force_oracle_for_all_layer_kinds():
    lengths = [181, 96, 33]
    data = synthetic.SyntheticBatch.draw(MODEL, 3, 181, seed=11)
    _, out = run_chunks(new_cache(), data, chunk_plan(lengths, [7, 32, 1, 19]))
    for layer, kind in enumerate(MODEL.layer_kinds):
        for b, L in enumerate(lengths):
            want, margin = oracle.attention_outputs(MODEL, kind, data.history(layer, b), L)
            assert margin > 1e-5, "top-k cut too close to call; pick another seed"
            atol = oracle_atol(MODEL, kind, np.arange(L)[:, None, None], rotations=3)
            assert_matches_oracle(out[layer, b, :L], want, atol,
                                  err_msg=f"layer {layer} ({kind.name}) row {b}")


def test_decode_attention_after_decode_step_equals_layer_step():
    data = synthetic.SyntheticBatch.draw(MODEL, 3, 60, seed=5)
    lengths = np.asarray([59, 20, 0])
    cache, _ = run_chunks(new_cache(), data, chunk_plan(lengths, [CHUNK]), with_attention=False)
    vectors = data.take(lengths)
    via_forward, out = step.append_and_attend(jax.tree.map(jnp.copy, cache), vectors,
                                    data.stacked_queries(lengths), data.weights, np.arange(3),
                                    np.ones(3, np.int32))
    # The layers unrolled (one after the other, outputs stacked once) run the same step.
    unrolled, out_unrolled = step.append_and_attend(
        jax.tree.map(jnp.copy, cache), vectors, data.stacked_queries(lengths), data.weights,
        np.arange(3), np.ones(3, np.int32), options=v4.Options(unroll_layers=True))
    np.testing.assert_allclose(out_unrolled, out, atol=1e-6)
    chex.assert_trees_all_close(unrolled, via_forward, atol=1e-6)
    cache = v4.decode_step(cache, vectors, data.weights)
    np.testing.assert_array_equal(cache.state.lengths, via_forward.state.lengths)
    for layer, kind in enumerate(MODEL.layer_kinds):
        o = v4.decode_attention(cache, v4.LayerRef.of(cache, layer),
                                data.queries(layer, lengths[:, None]), jnp.arange(3))
        np.testing.assert_allclose(o, out[layer], atol=1e-6)
        # Both paths share the decode attention: the oracle is the independent check.
        for b, t in enumerate(lengths):
            want, _ = oracle.attention_outputs(MODEL, kind, data.history(layer, b), t + 1)
            assert_matches_oracle(o[b, 0], want[t],
                                  oracle_atol(MODEL, kind, t, rotations=3),
                                  err_msg=f"layer {layer} ({kind.name}) row {b}")


# --- fixed shapes -----------------------------------------------------------------------------


def test_300_decode_steps_across_page_edges_compile_once():
    """Every step of a 320-token run (3 pages) reuses one trace of the decode update and one
    of the update + attention, whatever the lengths; the public entry points agree."""
    geometry = v4.CacheConfig(num_pages=5, max_slots=2, max_pages_per_seq=3)
    data = synthetic.SyntheticBatch.draw(MODEL, 2, 320, seed=0)
    def compiled(name, fn):  # as the library compiles its steps (programs), traces checked
        return programs.program(name, chex.assert_max_traces(fn, n=1), donate=("cache",),
                                static=("options",), register=False)

    update = compiled("update", step._append_all)
    update_attend = compiled("update_attend", step._append_attend_all)
    options = v4.Options()
    cache = new_cache(MODEL, geometry)
    slots, one = jnp.arange(2), jnp.ones(2, jnp.int32)
    for p in range(320):
        if p % 2:
            cache = update(cache, data.take(np.full(2, p)), data.weights, slots, one,
                           options=options)
        else:
            cache, _ = update_attend(cache, data.take(np.full(2, p)),
                                     data.stacked_queries([p, p]), data.weights, slots, one,
                                     options=options)
    assert (update.traces, update_attend.traces) == (1, 1)
    assert int(cache.state.lengths[0]) == 320
    assert len(v4.inspect_slots(cache)[0].pages) == 3
    # The jitted public entry points: one compilation each across 100 more page-crossing steps.
    before = (step._append_all_jit.traces, step._append_attend_all_jit.traces)
    cache = new_cache(MODEL, geometry)
    for p in range(100, 260, 2):
        cache = v4.decode_step(cache, data.take(np.full(2, p)), data.weights)
        cache, _ = step.append_and_attend(cache, data.take(np.full(2, p + 1)),
                                          data.stacked_queries([p + 1, p + 1]), data.weights,
                                          slots, one)
    after = (step._append_all_jit.traces, step._append_attend_all_jit.traces)
    assert after[0] - before[0] <= 1 and after[1] - before[1] <= 1


def _csa_chunk_after_prefill(tokens: int):
    """(data, lengths, cache, positions [2, tokens], CSA layer): two rows prefilled to 70
    and 33 tokens, and the positions of their next `tokens` tokens."""
    data = synthetic.SyntheticBatch.draw(MODEL, 2, 120, seed=9)
    lengths = np.asarray([70, 33])
    cache, _ = run_chunks(new_cache(), data, chunk_plan(lengths, [CHUNK]), rows=[0, 1],
                          with_attention=False)
    pos = lengths[:, None] + np.arange(tokens)[None, :]
    return data, lengths, cache, pos, MODEL.layers_of(LayerKind.CSA)[0]


@pytest.mark.parametrize("tokens", [CHUNK, 1])
def test_every_csa_read_takes_its_entries_through_make_resident(tokens, monkeypatch):
    """Prefill tiles and decode alike: the sparse read reads the ids `ops.make_resident`
    returns (here: none resident, so the CSA layer sees its window only), and `with_picks`
    still returns the indexer's picks."""
    data, lengths, cache, pos, layer = _csa_chunk_after_prefill(tokens)
    inputs = _one_layer(data, layer, pos, [0, 1])

    def run(cache):  # eager: the Python of the read runs on every call
        cache, plan = append.begin_append(cache, jnp.arange(2), jnp.full(2, tokens, jnp.int32),
                                          tokens)
        _, out, picks = step.layer_step(cache, plan, v4.LayerRef.of_config(MODEL, layer),
                                        *inputs, options=OPTIONS, with_picks=True)
        return np.asarray(out), np.asarray(picks)

    want_out, want_picks = run(jax.tree.map(jnp.copy, cache))
    calls = []

    def nothing_resident(geometry, picks, q_pos, stored):
        calls.append(picks.shape)
        return jnp.full_like(picks, -1), stored

    monkeypatch.setattr(ops, "make_resident", nothing_resident)
    got_out, got_picks = run(jax.tree.map(jnp.copy, cache))
    assert calls and all(shape[-1] == MODEL.index_topk for shape in calls)
    np.testing.assert_array_equal(got_picks, want_picks)
    assert (want_picks >= 0).any() and not np.allclose(got_out, want_out)
    # With no entry readable the layer reads its window alone (the reference, no pick).
    window_only = attention.attend(
        MODEL, GEOMETRY, OPTIONS, LayerKind.CSA, layer=MODEL.kind_index(layer),
        entries=pools.csa_entries(cache).c4, picks=jnp.full((2, tokens, MODEL.index_topk), -1),
        page_rows=pools.page_rows(cache, jnp.arange(2)), q=inputs[1].q, sink=inputs[1].sink,
        q_pos=jnp.asarray(pos, jnp.int32), kv_end=jnp.asarray(lengths + tokens, jnp.int32),
        window_keys=jnp.concatenate([attention.ordered_window(
            pools.window_ring(cache)[layer, :2].records(), jnp.asarray(lengths, jnp.int32)),
            pools.codec(cache, "window").encode(inputs[0].window)], axis=1),
        window_base=jnp.asarray(lengths - MODEL.window, jnp.int32))
    np.testing.assert_allclose(got_out, np.asarray(window_only), rtol=1e-5, atol=1e-6)


def _float_shapes(jaxpr) -> list[tuple[int, ...]]:
    shapes = []
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            aval = var.aval
            if hasattr(aval, "dtype") and jnp.issubdtype(aval.dtype, jnp.floating):
                shapes.append(tuple(aval.shape))
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            shapes += _float_shapes(sub)
    return shapes


@pytest.mark.parametrize("layer", [1, 2])
def test_step_cost_follows_context_not_capacity(layer):
    """Reads loop over used pages only, a chunk at a time: at 16x the capacity the attention
    program holds no bigger array, except one 4-byte score per entry (the indexer's top-k
    row, whose top-k runs on a length-sized prefix)."""
    data = synthetic.SyntheticBatch.draw(MODEL, 2, 1, seed=0)

    def shapes(max_pages):
        geometry = v4.CacheConfig(num_pages=8, max_slots=2, max_pages_per_seq=max_pages)
        cache = v4.init_cache(MODEL, geometry)
        ref = v4.LayerRef.of(cache, layer)
        return _float_shapes(jax.make_jaxpr(lambda c: v4.decode_attention(
            c, ref, data.queries(layer, np.zeros((2, 1), int)), jnp.arange(2)))(cache).jaxpr)

    base = max(int(np.prod(s)) for s in shapes(128))  # capacity = one read chunk
    grown = [s for s in shapes(2048) if int(np.prod(s)) > base]
    assert all(len(s) == 3 and s[:2] == (2, 1) for s in grown), grown
    if MODEL.layer_kinds[layer] == LayerKind.HCA:
        assert not grown


def test_read_loop_trip_count_follows_length():
    def trips(max_pages, length):
        rows = jnp.asarray(np.arange(max_pages)[None], jnp.int32)
        return int(paging.fold_page_chunks(rows, jnp.asarray([length // 4]), 32, 2,
                                           lambda n, ids, first: n + 1, jnp.int32(0)))

    assert trips(8, 300) == trips(512, 300) == 2
    assert trips(512, 5000) == 20
    assert trips(512, 0) == 0


def test_vector_shape_errors_name_the_field():
    cache = new_cache()
    data = synthetic.SyntheticBatch.draw(MODEL, 3, 4, seed=0)
    vectors = data.span(0, 1)
    bad = vectors.replace(window=vectors.window[:, :, :, :-1])
    with pytest.raises(ValueError, match=r"vectors.window: expected shape \(5, 3, 1, 32\); got"):
        v4.decode_step(cache, bad, data.weights)
    with pytest.raises(ValueError, match=r"slot_ids: expected slot ids in \[0, 3\).*got \[0, 7\]"):
        v4.prefill(cache, data.take(np.zeros((2, 1), int), [0, 1]), data.weights,
                   [0, 7], [1, 1])
    with pytest.raises(ValueError, match=r"n_new: expected counts in \[0, 1\].*; got \[2, 1\]"):
        v4.prefill(cache, data.take(np.zeros((2, 1), int), [0, 1]), data.weights,
                   [0, 1], [2, 1])


def test_write_ordering_dependency_keeps_values_bit_for_bit():
    x = jnp.asarray([-0.0, 0.0, jnp.nan, jnp.inf, -jnp.inf, 1.5, -3e-38], jnp.float32)
    nan_bits = np.asarray([jnp.nan], np.float32).view(np.uint32)
    for dep in (jnp.asarray([jnp.nan]), jnp.asarray([[2.0, 1.0]]), jnp.asarray([-jnp.inf]),
                jnp.asarray(nan_bits), jnp.asarray([7], jnp.int32), jnp.asarray([3], jnp.int8)):
        got = append.after(x, dep)
        np.testing.assert_array_equal(np.asarray(got).view(np.int32), np.asarray(x).view(np.int32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.uint32, jnp.int32, jnp.int8])
def test_write_ordering_dependency_survives_the_compiler(dtype):
    """The compiled program still reads the dependency (the words of a packed pool are
    uint32: an integer compared with itself is folded away unless its bits are a float)."""
    text = jax.jit(append.after).lower(jnp.zeros(4), jnp.zeros(3, dtype)).compile().as_text()
    entry = text[text.index("ENTRY"):]
    dep = re.search(r"%([\w.\-]+) = \S+ parameter\(1\)", entry).group(1)
    assert re.search(rf"\(.*%{re.escape(dep)}\b", entry.split("parameter(1)", 1)[1]), entry


def _one_layer(data, layer: int, pos, rows):
    """LayerVectors, Queries and LayerParams of one layer at positions pos [B, T]."""
    vec, k, kind = data.take(pos, rows), MODEL.kind_index(layer), MODEL.layer_kinds[layer]
    names = {LayerKind.CSA: ("csa", "csa_index"), LayerKind.HCA: ("hca", None)}[kind]

    def pick(tree):
        return None if tree is None else jax.tree.map(lambda x: x[k], tree)

    vectors = v4.LayerVectors(window=vec.window[layer],
                              compressor=pick(getattr(vec, names[0])),
                              index_compressor=pick(names[1] and getattr(vec, names[1])))
    params = v4.LayerParams(pick(getattr(data.weights, names[0])),
                            pick(names[1] and getattr(data.weights, names[1])))
    return vectors, data.queries(layer, pos, rows), params


@functools.partial(jax.jit, static_argnames="layer")
def _layer_with_picks(cache, vectors, queries, params, n_new, layer):
    cache, plan = append.begin_append(cache, jnp.arange(2), n_new, vectors.window.shape[1])
    cache, out, picks = step.layer_step(cache, plan, v4.LayerRef.of_config(MODEL, layer),
                                        vectors, queries, params, with_picks=True)
    return append.end_append(cache, plan), out, picks


@pytest.mark.parametrize("tokens", [CHUNK, 1])
def test_layer_step_returns_the_indexers_picks(tokens):
    """with_picks: the CSA picks of every query (prefill tiles and decode) are the oracle's
    top-k sets wherever the cut has a margin; HCA layers have none."""
    data, lengths, cache, pos, layer = _csa_chunk_after_prefill(tokens)
    _, _, picks = _layer_with_picks(cache, *_one_layer(data, layer, pos, [0, 1]),
                                    jnp.full(2, tokens, jnp.int32), layer)
    assert picks.shape == (2, tokens, MODEL.index_topk)
    inv_freq = oracle.inv_frequencies(MODEL, LayerKind.CSA)
    compared = 0
    for b in range(2):
        h = data.history(layer, b)
        end = int(pos[b, -1]) + 1
        keys = oracle.compress(h.index_kv, h.index_gate, h.index_ape, h.index_norm,
                               MODEL.csa_ratio, True, inv_freq, MODEL.rms_eps, end)
        for j, t in enumerate(pos[b]):
            want, margin = oracle.topk_picks(MODEL, h, int(t), keys)
            if margin < 1e-4:
                continue
            got = sorted(int(i) for i in np.asarray(picks[b, j]) if i >= 0)
            assert got == sorted(want), (b, int(t))
            compared += 1
    assert compared >= tokens
    hca = MODEL.layers_of(LayerKind.HCA)[0]
    _, _, none = _layer_with_picks(cache, *_one_layer(data, hca, pos, [0, 1]),
                                   jnp.full(2, tokens, jnp.int32), hca)
    assert none is None
