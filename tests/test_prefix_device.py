"""Prefix sharing, device side: `pools.attach_prefix` (a fresh slot takes another request's
full pages), `pools.snapshot_state` / `restore_state` (a request's State in and out), and the
state-only replay (`step.replay`, `nn.Decoder.replay`) that rebuilds the State at a page
boundary from ANY starting State with R = n_layers * (W - 1) + 1 tokens, rounded up to a page.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import v4kv_jax as v4
from v4kv_jax import append, pools, step
from v4kv_jax.nn import Decoder, ModelConfig
from v4kv_jax.pools import paging
from v4kv_jax.testing import synthetic

from conftest import GEOMETRY, MODEL, OPTIONS, new_cache, positions, run_chunks

# Replay against the request that wrote the State is another program with the same bits:
# the file runs as users compile, at XLA's defaults (tests/xla_defaults.py), in one
# subprocess that shares its programs.
pytestmark = pytest.mark.xla_defaults

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
P = GEOMETRY.page_tokens
BOUNDARY = 2 * P  # b: two full pages
# Receptive field of the window over the layers, rounded up to a page (tiny: 5 * 15 + 1 = 76
# -> 128): the replay starts at BOUNDARY - REPLAY.
R = MODEL.num_layers * (MODEL.window - 1) + 1
REPLAY = -(-R // P) * P
assert REPLAY <= BOUNDARY


def state_rows(cache, slot):
    """The raw State rows of one slot (every ring row) and its length, as numpy."""
    snap = v4.snapshot_state(cache, slot)
    return jax.tree.map(np.asarray, snap)


def assert_same_state(cache_a, slot_a, cache_b, slot_b):
    a, b = state_rows(cache_a, slot_a), state_rows(cache_b, slot_b)
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b),
                            strict=True):
        np.testing.assert_array_equal(x, y, err_msg=jax.tree_util.keystr(path))
        assert x.tobytes() == y.tobytes(), jax.tree_util.keystr(path)  # bit for bit (NaN, -0)


def poisoned(cache, slot, value=np.nan):
    """`slot` with every State row set to `value` (its length kept)."""
    snap = v4.snapshot_state(cache, slot)
    bad = snap.replace(window=jax.tree.map(lambda x: jnp.full_like(x, value), snap.window),
                       tails=jax.tree.map(lambda x: jnp.full_like(x, value), snap.tails))
    return v4.restore_state(cache, slot, bad)


def classical(cache):
    return {s.name: np.asarray(pools.entries(cache, s).records()).copy() for s in cache.specs}


@pytest.fixture(scope="module")
def data():
    return synthetic.SyntheticBatch.draw(MODEL, batch=2, tokens=BOUNDARY + 8, seed=3)


@pytest.fixture(scope="module")
def prefilled(data):
    """Slot 0 holds row 0's first BOUNDARY tokens (slots 1 and 2 fresh)."""
    plan = [[32]] * (BOUNDARY // 32)
    cache, _ = run_chunks(new_cache(), data, plan, rows=[0], slot_ids=[0],
                          with_attention=False)
    return cache


def _copy(cache):
    return jax.tree.map(jnp.copy, cache)


def test_attach_shares_the_full_pages(prefilled):
    cache = _copy(prefilled)
    row0 = np.asarray(cache.pages.page_table[0])
    free = int(cache.pages.num_free)
    before = v4.memory_report(cache)
    cache = v4.attach_prefix(cache, 1, row0, 2)
    table, refcount = np.asarray(cache.pages.page_table), np.asarray(cache.pages.refcount)
    np.testing.assert_array_equal(table[1, :2], row0[:2])
    assert (table[1, 2:] == -1).all()
    assert refcount[row0[:2]].tolist() == [2, 2]
    assert int(cache.pages.num_free) == free  # one physical copy: no page taken
    assert int(pools.lengths(cache)[1]) == BOUNDARY
    report = v4.memory_report(cache)
    assert report.pages_shared == 2
    # Shared pages hold their entries once: nothing more is stored, nothing counted twice.
    assert (report.entry_bytes, report.allocated_bytes) == (before.entry_bytes,
                                                           before.allocated_bytes)
    # The attached slot reads the same entries as the owner, by index.
    a, b = v4.read_slot(cache, 0), v4.read_slot(cache, 1)
    for name in a.entries:
        np.testing.assert_array_equal(a.entries[name], b.entries[name])


@pytest.mark.parametrize("start_state", ["zeros", "other_request", "nan"])
def test_replay_rebuilds_the_boundary_state(prefilled, data, start_state):
    cache = _copy(prefilled)
    if start_state == "other_request":  # slot 2 holds another request; its State moves over
        cache, _ = run_chunks(cache, data, [[32]] * 3, rows=[1], slot_ids=[2],
                              with_attention=False)
        other = v4.snapshot_state(cache, 2)
    cache = v4.attach_prefix(cache, 1, cache.pages.page_table[0], BOUNDARY // P)
    if start_state == "other_request":
        cache = v4.restore_state(cache, 1, other.replace(length=jnp.int32(BOUNDARY)))
    elif start_state == "nan":
        cache = poisoned(cache, 1)
    before = classical(cache)
    pages_before = jax.tree.map(np.asarray, cache.pages)
    start = BOUNDARY - REPLAY
    for first in range(start, BOUNDARY, 32):
        cache = step.replay(cache, data.take(positions([first], 32), [0]), data.weights, [1],
                            [first], [32], options=OPTIONS)
    assert_same_state(cache, 0, cache, 1)
    # Nothing but the State changed: no entry written, no page taken, no length advanced.
    for name, x in classical(cache).items():
        assert x.tobytes() == before[name].tobytes(), name
    for x, y in zip(jax.tree.leaves(pages_before), jax.tree.leaves(cache.pages), strict=True):
        np.testing.assert_array_equal(x, np.asarray(y))
    assert int(pools.lengths(cache)[1]) == BOUNDARY


def test_continuing_past_the_boundary(prefilled, data):
    """Slots 1 (replayed) and 2 (restored from a snapshot) attach slot 0's pages; all three
    decode the same tokens bit for bit alike, each in a new page of its own, and the shared
    pages never change; releasing all three frees every page."""
    cache = _copy(prefilled)
    shared = np.asarray(cache.pages.page_table[0, :2])
    snap = v4.snapshot_state(cache, 0)
    for slot in (1, 2):
        cache = v4.attach_prefix(cache, slot, cache.pages.page_table[0], 2)
        cache = poisoned(cache, slot)
    cache = step.replay(cache, data.take(positions([BOUNDARY - REPLAY], REPLAY), [0]),
                        data.weights, [1], [BOUNDARY - REPLAY], [REPLAY], options=OPTIONS)
    cache = v4.restore_state(cache, 2, snap)
    assert_same_state(cache, 0, cache, 1)
    assert_same_state(cache, 0, cache, 2)
    assert np.asarray(cache.pages.refcount)[shared].tolist() == [3, 3]

    def shared_rows(cache):
        return {k: v[:, shared] for k, v in classical(cache).items()}

    before = shared_rows(cache)
    rows = [0, 0, 0]
    outs = []
    for t in range(BOUNDARY, BOUNDARY + 5):  # C4 entry 64 completes at 259
        pos = np.full((3, 1), t)
        cache, o = step.append_and_attend(cache, data.take(pos, rows),
                                          data.stacked_queries(pos, rows), data.weights,
                                          [0, 1, 2], [1, 1, 1], options=OPTIONS)
        outs.append(np.asarray(o))
    outs = np.stack(outs)
    assert outs[:, :, 0].tobytes() == outs[:, :, 1].tobytes() == outs[:, :, 2].tobytes()
    assert np.isfinite(outs).all()
    for s in (1, 2):
        assert_same_state(cache, 0, cache, s)
    table = np.asarray(cache.pages.page_table)
    own = table[:, 2]
    assert (own >= 0).all() and len(set(own.tolist()) | set(shared.tolist())) == 5
    assert (table[:, 3:] == -1).all()
    refcount = np.asarray(cache.pages.refcount)
    assert refcount[shared].tolist() == [3, 3] and refcount[own].tolist() == [1, 1, 1]
    after = shared_rows(cache)
    for name in before:
        assert after[name].tobytes() == before[name].tobytes(), name
    c = {s.name: np.asarray(pools.entries(cache, s).records()) for s in cache.specs}
    for name, x in c.items():  # the new entries of each slot's own page agree too
        np.testing.assert_array_equal(x[:, own[0]], x[:, own[1]], err_msg=name)
        np.testing.assert_array_equal(x[:, own[0]], x[:, own[2]], err_msg=name)

    cache = v4.release_slot(cache, 0)
    assert np.asarray(cache.pages.refcount)[shared].tolist() == [2, 2]
    for s in (1, 2):
        cache = v4.release_slot(cache, s)
    assert (np.asarray(cache.pages.refcount) == 0).all()
    assert int(cache.pages.num_free) == GEOMETRY.num_pages
    assert sorted(np.asarray(cache.pages.free_stack).tolist()) == list(range(GEOMETRY.num_pages))


def test_snapshot_restore_round_trip(data):
    """A snapshot at any length (mid-page, mid-block) restored into a poisoned slot gives back
    the State bit for bit, and the slot decodes exactly like one that never left."""
    n = 150
    plan = [[32]] * 4 + [[22]]  # one-row calls and three-row decodes: shapes compiled above
    cache = new_cache(slots=[0, 1])
    for slot in (0, 1):
        cache, _ = run_chunks(cache, data, plan, rows=[0], slot_ids=[slot], with_attention=False)
    snap = v4.snapshot_state(cache, 1)
    assert int(snap.length) == n
    cache = poisoned(cache, 1)
    assert np.isnan(np.asarray(pools.window_ring(cache)[:, 1].records())).all()
    cache = v4.restore_state(cache, 1, snap)
    assert_same_state(cache, 0, cache, 1)
    for t in range(n, n + 3):
        pos = np.full((3, 1), t)
        cache, o = step.append_and_attend(cache, data.take(pos, [0, 0, 0]),
                                          data.stacked_queries(pos, [0, 0, 0]), data.weights,
                                          [0, 1, -1], [1, 1, 0], options=OPTIONS)
        o = np.asarray(o)
        assert o[:, 0].tobytes() == o[:, 1].tobytes()
    assert_same_state(cache, 0, cache, 1)
    # jit: snapshot and restore run inside a caller's program too.
    moved = jax.jit(lambda c: v4.restore_state(c, 1, v4.snapshot_state(c, 0)))(poisoned(cache, 1))
    assert_same_state(moved, 0, moved, 1)


def test_the_prefix_page_block_runs_as_written(prefilled, data):
    page = open(os.path.join(ROOT, "docs/prefix.md")).read()
    section = page.split("## Prefix sharing on the device\n", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```python\n(.*?)\n```", section, re.S)
    cache, _ = run_chunks(_copy(prefilled), data, [[32]], rows=[0], slot_ids=[0],
                          with_attention=False)  # slot 0 past the boundary, as on the page
    cache = v4.release_slot(v4.release_slot(cache, 1), 2)  # only slot 0 admitted, as there
    one_row = dataclasses.replace(  # the page's data holds one sequence: row 0
        data, window=data.window[:, :1], q=data.q[:, :1], index_q=data.index_q[:, :1],
        index_weights=data.index_weights[:, :1],
        compressors={k: (kv[:, :1], g[:, :1]) for k, (kv, g) in data.compressors.items()})
    scope = {"v4": v4, "cache": cache, "data": one_row}
    exec(block, scope)  # noqa: S102 - the page's own code
    cache = scope["cache"]
    for slot in (1, 2):
        got = v4.read_slot(cache, slot)
        assert got.length == BOUNDARY
        np.testing.assert_array_equal(got.window, data.window[:, 0, BOUNDARY - MODEL.window:
                                                              BOUNDARY])
    assert_same_state(cache, 1, cache, 2)


# --- the model: layer l's input depends on the window of layer l - 1 -------------------------

CONFIG = ModelConfig(MODEL, vocab_size=40, mlp_hidden=48)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def _model_call(graphdef, params, cache, tokens, slot_ids, n_new):
    return nnx.merge(graphdef, params)(tokens, cache, slot_ids, n_new, options=OPTIONS)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def _model_replay(graphdef, params, cache, tokens, slot_ids, start, n_new):
    return nnx.merge(graphdef, params).replay(tokens, cache, slot_ids, start, n_new,
                                              options=OPTIONS)


@pytest.fixture(scope="module")
def decoder_run():
    """Slot 0 holds BOUNDARY tokens run through the model (prefill chunks of P)."""
    graphdef, params = nnx.split(Decoder(CONFIG, rngs=nnx.Rngs(1), bias_scale=0.5))
    tokens = np.random.default_rng(7).integers(0, CONFIG.vocab_size, BOUNDARY + 4)
    tokens = tokens.astype(np.int32)
    cache = new_cache()
    for first in range(0, BOUNDARY, P):
        cache, _ = _model_call(graphdef, params, cache, jnp.asarray(tokens[None, first:first + P]),
                               jnp.asarray([0]), jnp.asarray([P]))
    return graphdef, params, tokens, cache


@pytest.mark.parametrize("start_state", ["zeros", "nan"])
def test_model_replay_rebuilds_the_boundary_state(decoder_run, start_state):
    graphdef, params, tokens, cache = decoder_run
    cache = v4.attach_prefix(_copy(cache), 1, cache.pages.page_table[0], BOUNDARY // P)
    if start_state == "nan":
        cache = poisoned(cache, 1)
    before = classical(cache)
    first = BOUNDARY - REPLAY
    cache = _model_replay(graphdef, params, cache, jnp.asarray(tokens[None, first:BOUNDARY]),
                          jnp.asarray([1]), jnp.asarray([first]), jnp.asarray([REPLAY]))
    # Same chunk shape as the prefill's last chunk: the State is bit for bit the owner's.
    assert_same_state(cache, 0, cache, 1)
    for name, x in classical(cache).items():
        assert x.tobytes() == before[name].tobytes(), name
    # Then both decode the same tokens alike.
    for t in range(BOUNDARY, BOUNDARY + 4):
        tok = jnp.asarray(np.full((2, 1), tokens[t], np.int32))
        cache, logits = _model_call(graphdef, params, cache, tok, jnp.asarray([0, 1]),
                                    jnp.asarray([1, 1]))
        logits = np.asarray(logits)
        assert np.isfinite(logits).all()
        assert logits[0].tobytes() == logits[1].tobytes(), t
    assert_same_state(cache, 0, cache, 1)


def test_model_replay_shorter_than_the_receptive_field_is_not_enough(decoder_run):
    """The test above has teeth: from a NaN State, replaying only W tokens leaves the deeper
    layers' windows unrebuilt (their inputs read the poisoned window of the layer below)."""
    graphdef, params, tokens, cache = decoder_run
    cache = poisoned(v4.attach_prefix(_copy(cache), 1, cache.pages.page_table[0], 2), 1)
    first, n = BOUNDARY - MODEL.window, MODEL.window
    padded = np.zeros((1, REPLAY), np.int32)
    padded[0, :n] = tokens[first:BOUNDARY]
    cache = _model_replay(graphdef, params, cache, jnp.asarray(padded), jnp.asarray([1]),
                          jnp.asarray([first]), jnp.asarray([n]))
    ring = np.asarray(pools.window_ring(cache)[:, 1].records())
    assert np.isfinite(ring[0]).all()  # layer 0's kv depends on its own token only
    assert np.isnan(ring[1:]).any()


# --- errors and jit ------------------------------------------------------------------------


def test_attach_errors(prefilled):
    cache = _copy(prefilled)
    row0 = np.asarray(cache.pages.page_table[0])
    with pytest.raises(ValueError, match=r"slot: expected a fresh slot .*slot 0 ACTIVE with "
                                         r"length 256 and 2 page\(s\)"):
        v4.attach_prefix(cache, 0, row0, 2)
    with pytest.raises(ValueError, match=r"slot: expected an integer in \[0, 2\]; got 3"):
        v4.attach_prefix(cache, 3, row0, 2)
    with pytest.raises(ValueError, match=r"n_pages: expected an integer in \[0, 6\]; got 7"):
        v4.attach_prefix(cache, 1, np.arange(8), 7)
    with pytest.raises(ValueError, match=r"page_ids: expected pages in use .*page 5 with "
                                         r"refcount 0"):
        v4.attach_prefix(cache, 1, np.asarray([0, 5]), 2)
    with pytest.raises(ValueError, match=r"page_ids: expected distinct page ids"):
        v4.attach_prefix(cache, 1, np.asarray([0, 0]), 2)
    with pytest.raises(ValueError, match=r"page_ids: expected page ids in \[0, 24\)"):
        v4.attach_prefix(cache, 1, np.asarray([0, 99]), 2)
    with pytest.raises(TypeError, match=r"page_ids: expected an array of integer dtype"):
        v4.attach_prefix(cache, 1, np.asarray([0.0, 1.0]), 2)
    with pytest.raises(ValueError, match=r"page_ids: expected full pages in prefix order .*got "
                                         r"page_ids\[0\] = 1, page 1 of slot 0 of length 256"):
        v4.attach_prefix(cache, 1, row0[::-1][-2:], 2)
    # Slot 2 with 8 tokens: its page 0 is partly filled, never attachable.
    partial, _ = run_chunks(_copy(cache), synthetic.SyntheticBatch.draw(MODEL, 1, 8, seed=0),
                            [[8]], rows=[0], slot_ids=[2], chunk=8, with_attention=False)
    with pytest.raises(ValueError, match=r"page_ids: expected full pages .*page 0 of slot 2 "
                                         r"of length 8"):
        v4.attach_prefix(partial, 1, partial.pages.page_table[2], 1)

    # Inside jit a broken call changes nothing; a valid one attaches.
    attach = jax.jit(v4.attach_prefix)
    for args in ((0, row0, 2), (3, row0, 2), (1, np.asarray([0, 5], np.int32), 2),
                 (1, np.asarray([0, 0], np.int32), 2), (1, row0, 7), (1, row0, -1),
                 (1, row0[1::-1].copy(), 2)):
        got = attach(cache, *args)
        for x, y in zip(jax.tree.leaves(cache), jax.tree.leaves(got), strict=True):
            np.testing.assert_array_equal(x, y, err_msg=str(args))
    got = attach(cache, 1, row0, 1)
    assert np.asarray(got.pages.page_table[1]).tolist() == [int(row0[0])] + [-1] * 5
    assert int(pools.lengths(got)[1]) == P


def test_snapshot_and_replay_errors(prefilled, data):
    cache = _copy(prefilled)
    snap = v4.snapshot_state(cache, 0)
    with pytest.raises(ValueError, match=r"slot: expected a slot holding a request .*slot 1 "):
        v4.restore_state(v4.release_slot(_copy(cache), 1), 1, snap)
    with pytest.raises(ValueError, match=r"snapshot.length: expected a length the slot's 0 "
                                         r"page\(s\) hold \(in \[0, 0\]\); got 256 for slot 1"):
        v4.restore_state(cache, 1, snap)
    with pytest.raises(ValueError, match=r"snapshot.window.planes\[0\]: expected shape"):
        v4.restore_state(cache, 0, snap.replace(window=snap.window[:, :2]))
    other = v4.snapshot_state(v4.reset_slot(v4.init_cache(dataclasses.replace(MODEL, window=8),
                                                          GEOMETRY),
                                            0), 0)
    with pytest.raises(ValueError, match=r"snapshot.window: expected rows laid out as this "
                                         r"cache lays them out"):
        v4.restore_state(cache, 0, snap.replace(window=other.window))
    with pytest.raises(TypeError, match=r"snapshot.tails.csa.kv.planes\[0\]: expected dtype "
                                        r"float32"):
        v4.restore_state(cache, 0, snap.replace(tails={
            **snap.tails, "csa": snap.tails["csa"].replace(kv=jax.tree.map(
                lambda x: x.astype(jnp.bfloat16), snap.tails["csa"].kv))}))
    with pytest.raises(TypeError, match=r"snapshot.tails.csa.kv: expected a pools.Lanes"):
        v4.restore_state(cache, 0, snap.replace(tails={
            **snap.tails, "csa": snap.tails["csa"].replace(kv=snap.tails["csa"].kv.records())}))
    with pytest.raises(TypeError, match=r"snapshot: expected a pools.StateSnapshot"):
        v4.restore_state(cache, 0, {"window": snap.window})
    with pytest.raises(ValueError, match=r"slot: expected a slot holding a request .*FREE"):
        v4.snapshot_state(v4.release_slot(_copy(cache), 2), 2)
    # jit: a length the slot's pages do not hold changes nothing.
    got = jax.jit(v4.restore_state)(cache, 1, snap)
    for x, y in zip(jax.tree.leaves(cache), jax.tree.leaves(got), strict=True):
        np.testing.assert_array_equal(x, y)

    vectors = data.take(positions([0], 32), [0])
    with pytest.raises(ValueError, match=r"start: expected 0 <= start and start \+ n_new <= "
                                         r"the slot's length .*start 240, n_new 32 at row 0 "
                                         r"for slot 0 of length 256"):
        step.replay(_copy(cache), vectors, data.weights, [0], [240], [32])
    with pytest.raises(ValueError, match=r"slot_ids: expected ACTIVE slots"):
        step.replay(v4.release_slot(_copy(cache), 1), vectors, data.weights, [1], [0], [32])
    with pytest.raises(ValueError, match=r"start: expected shape \(1,\)"):
        step.replay(_copy(cache), vectors, data.weights, [0], [0, 1], [32])
    # jit: a broken row replays nothing.
    window = np.asarray(pools.window_ring(cache).records())
    plan = jax.jit(lambda c: append.replay_plan(
        c, jnp.asarray([0, 1]), jnp.asarray([240, 0]), jnp.asarray([32, 32]), 32))(cache)
    assert np.asarray(plan.n_new).tolist() == [0, 0]  # past the length; slot 1 holds nothing
    assert plan.state_only
    got = step.replay(_copy(cache), data.take(positions([224], 32), [0]), data.weights, [0],
                      [224], [32])
    assert int(pools.lengths(got)[0]) == BOUNDARY
    assert np.asarray(pools.window_ring(got).records()).tobytes() == window.tobytes()
    assert paging.held_pages(got.pages.page_table[:1]).tolist() == [2]
