"""Request lifecycle: admission, release, exhaustion, slot reuse, clear errors."""

import jax
import numpy as np
import pytest

import v4kv_jax as v4
from v4kv_jax import pools
from v4kv_jax.serve.manager import CacheManager, PoolExhaustedError
from v4kv_jax.testing import synthetic

from conftest import CHUNK, MODEL, positions


def _manager(num_pages=24, max_slots=3, max_pages_per_seq=6, seed=0):
    geo = v4.CacheConfig(num_pages=num_pages, max_slots=max_slots,
                         max_pages_per_seq=max_pages_per_seq)
    weights = synthetic.SyntheticBatch.draw(MODEL, 1, 1, seed=seed).weights
    return CacheManager(MODEL, geo, weights)


def _feed(mgr, data, request, row, start, stop, with_attention=False):
    """Prefill positions [start, stop) of data row `row` into `request`, CHUNK at a time."""
    outs = []
    for a in range(start, stop, CHUNK):
        n = min(CHUNK, stop - a)
        pos = positions([a], CHUNK)
        q = data.stacked_queries(pos, [row]) if with_attention else None
        out = mgr.prefill([request], data.take(pos, [row]), [n], queries=q)
        if with_attention:
            outs.append(np.asarray(out)[:, 0, :n])
    return np.concatenate(outs, axis=1) if with_attention else None


def test_exhaustion_raises_and_leaves_other_requests_bit_identical():
    mgr = _manager(num_pages=3, max_slots=2)
    data = synthetic.SyntheticBatch.draw(MODEL, 2, 260, seed=1)
    mgr.admit("a")
    mgr.admit("b")
    _feed(mgr, data, "a", 0, 0, 200)  # 2 pages
    _feed(mgr, data, "b", 1, 0, 100)  # 1 page: the pool is now full
    before = jax.tree.map(np.asarray, mgr.cache)
    with pytest.raises(PoolExhaustedError) as err:
        _feed(mgr, data, "b", 1, 100, 130)  # crosses into a second page
    msg = str(err.value)
    assert "request 'b' needs 1 page(s)" in msg and "0 page(s) free" in msg
    assert err.value.shortfalls[0].request == "b"
    after = jax.tree.map(np.asarray, mgr.cache)
    for x, y in zip(jax.tree.leaves(before.classical), jax.tree.leaves(after.classical),
                    strict=True):
        np.testing.assert_array_equal(x, y)  # nobody's entries moved, bit for bit
    np.testing.assert_array_equal(pools.window_ring(before).records(),
                                  pools.window_ring(after).records())
    np.testing.assert_array_equal(before.pages.page_table, after.pages.page_table)
    assert mgr.lengths() == {"a": 200, "b": 100}
    # Releasing "a" frees its pages; the same call for "b" now succeeds.
    mgr.release("a")
    _feed(mgr, data, "b", 1, 100, 130)
    assert mgr.lengths() == {"b": 130}


def test_exhaustion_in_a_batched_decode_appends_nothing_for_any_request():
    mgr = _manager(num_pages=2, max_slots=2)
    data = synthetic.SyntheticBatch.draw(MODEL, 2, 260, seed=2)
    mgr.admit("a")
    mgr.admit("b")
    _feed(mgr, data, "a", 0, 0, 127)
    _feed(mgr, data, "b", 1, 0, 128)
    before = jax.tree.map(np.asarray, mgr.cache)
    # Next token: "a" stays in its page, "b" needs a new one and none is left. The call is
    # all or nothing: "a" does not advance either, so repeating it never appends twice.
    with pytest.raises(PoolExhaustedError, match="request 'b' needs 1 page.*Nothing was "
                                                 "appended for any request"):
        mgr.decode(data.take(np.asarray([127, 128])), queries=data.stacked_queries(
            np.asarray([127, 128])))
    assert mgr.lengths() == {"a": 127, "b": 128}
    for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(mgr.cache), strict=True):
        np.testing.assert_array_equal(x, y)
    # Without "b" the same step goes through, once (one row: "a"'s).
    out = mgr.decode(data.take(np.asarray([127]), [0]), requests=["a"],
                     queries=data.stacked_queries(np.asarray([127]), [0]))
    assert np.asarray(out).shape[1] == 1
    assert mgr.lengths() == {"a": 128, "b": 128}
    assert np.isfinite(np.asarray(out)[:, 0]).all()


def test_call_arguments_are_checked_before_anything_runs():
    mgr = _manager()
    mgr.admit("a")
    data = synthetic.SyntheticBatch.draw(MODEL, 2, 40, seed=0)
    pos = positions([0, 0], CHUNK)
    with pytest.raises(ValueError, match=r"n_new: expected 1 counts \(one per request\); "
                                         r"got 2 counts"):
        mgr.prefill(["a"], data.take(pos[:1], [0]), [3, 4])
    with pytest.raises(ValueError, match=r"requests: expected distinct requests"):
        mgr.prefill(["a", "a"], data.take(pos, [0, 1]), [3, 4])
    with pytest.raises(ValueError, match=r"n_new: expected values >= 0; got \[-1\]"):
        mgr.prefill(["a"], data.take(pos[:1], [0]), [-1])
    with pytest.raises(TypeError, match=r"n_new: expected integers; got \[1.5\]"):
        mgr.prefill(["a"], data.take(pos[:1], [0]), [1.5])
    assert mgr.lengths() == {"a": 0}


def test_reused_slot_gives_the_same_result_as_a_fresh_pool():
    data = synthetic.SyntheticBatch.draw(MODEL, 2, 300, seed=3)
    used = _manager()
    used.admit("long")
    _feed(used, data, "long", 0, 0, 300)
    used.release("long")
    slot = used.admit("short")
    assert slot == 0
    out_reused = _feed(used, data, "short", 1, 0, 2, with_attention=True)
    fresh = _manager()
    fresh.admit("short")
    out_fresh = _feed(fresh, data, "short", 1, 0, 2, with_attention=True)
    np.testing.assert_array_equal(out_reused, out_fresh)
    for name in ("window",):
        np.testing.assert_array_equal(getattr(used.cache.state, name)[:, 0].records(),
                                      getattr(fresh.cache.state, name)[:, 0].records())
    for s in used.cache.specs:
        np.testing.assert_array_equal(pools.tail(used.cache, s).kv[:, 0].records(),
                                      pools.tail(fresh.cache, s).kv[:, 0].records())
    assert used.memory_report().pages_used == 1


def test_lifecycle_errors_are_clear():
    mgr = _manager(max_slots=1, max_pages_per_seq=1)
    mgr.admit("x")
    with pytest.raises(ValueError, match="request 'x' is already admitted"):
        mgr.admit("x")
    with pytest.raises(RuntimeError, match="no free slot for request 'y'"):
        mgr.admit("y")
    with pytest.raises(KeyError, match="request 'z' is not admitted"):
        mgr.release("z")
    data = synthetic.SyntheticBatch.draw(MODEL, 1, 200, seed=0)
    _feed(mgr, data, "x", 0, 0, 128)
    with pytest.raises(ValueError, match="length 128 \\+ 1 new tokens exceeds the maximum "
                                         "sequence length 128"):
        _feed(mgr, data, "x", 0, 128, 129)


def test_memory_report_counts_entries_and_pages():
    mgr = _manager()
    data = synthetic.SyntheticBatch.draw(MODEL, 1, 200, seed=0)
    mgr.admit("r")
    _feed(mgr, data, "r", 0, 0, 200)
    rep = mgr.memory_report()
    # tiny: 2 CSA layers x (32 + 16) floats / 4 tokens; 2 HCA layers x 32 floats / 16 tokens.
    assert rep.classical_bytes_per_token == {"CSA": 2 * 48 * 4 / 4, "HCA": 2 * 32 * 4 / 16,
                                             "total": 96.0 + 16.0}
    assert (rep.pages_used, rep.pages_free) == (2, 22)
    assert rep.page_bytes == 128 * 112
    assert rep.entry_bytes == 2 * 48 * 4 * 50 + 2 * 32 * 4 * 12
    assert rep.allocated_bytes == 2 * 128 * 112
    assert rep.capacity_bytes == 24 * 128 * 112 and (rep.slots_total, rep.slots_used) == (3, 1)
    # The pool's capacity apart from the pages in use and what they hold.
    text = rep.format()
    assert "Classical bytes/token" in text
    assert "Classical capacity:    344,064 B, 24 pages of 14,336 B" in text
    assert ("Classical in use:      2 pages = 28,672 B holding 22,272 B of entries (x1.287, "
            "lane padding and partly filled last pages); 22 free, 0 shared") in text
    assert f"State capacity:        {3 * rep.state_bytes_per_request:,} B, 3 slots (1 in use)" in (
        text)
    assert "allocated" not in text and "Host" not in text and rep.host_bytes_per_request == 0
    inspect = mgr.inspect()["r"]
    assert (inspect.length, inspect.c4_entries, inspect.c128_entries) == (200, 50, 12)
