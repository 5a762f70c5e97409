"""A stateful property test of the request lifecycle on a small, often exhausted pool.

Random interleavings of admit / prefill (random chunk sizes) / decode (random subsets) /
release, with exhaustion and over-capacity calls and slot and page reuse, through the
manager. After every operation:
  * page accounting: free + used = total, the free stack holds exactly the free pages, each
    refcount equals the number of page-table entries naming the page, each live request
    holds ceil(length / P) pages;
  * every live request's outputs and state equal its solo run (window and tails bit for bit,
    entries and outputs within the chunking bound of `test_chunking_bound.py`);
  * no operation changed a request it did not name (bit for bit), and a failed call changed
    nothing at all;
and every row no live request owns is then poisoned with NaN, so a stray read shows up.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import v4kv_jax as v4
from v4kv_jax import step
from v4kv_jax.serve.manager import CacheManager, PoolExhaustedError
from v4kv_jax.testing import synthetic

from conftest import MODEL, hypothesis_examples, positions

ROWS, MAX_LEN, CHUNK = 4, 384, 32
GEOMETRY = v4.CacheConfig(num_pages=6, max_slots=3, max_pages_per_seq=3)
DATA = synthetic.SyntheticBatch.draw(MODEL, ROWS, MAX_LEN, seed=21)
OPERATIONS = {"count": 0}


@functools.cache
def solo():
    """Each data row run alone in one call: (outputs [n_layers, ROWS, MAX_LEN, H, hd],
    [SlotContents per row])."""
    geo = v4.CacheConfig(num_pages=ROWS * 3, max_slots=ROWS, max_pages_per_seq=3)
    cache = v4.init_cache(MODEL, geo)
    for s in range(ROWS):
        cache = v4.reset_slot(cache, s)
    cache, out = step.append_and_attend(cache, DATA.span(0, MAX_LEN), DATA.stacked_queries(
        positions(np.zeros(ROWS, int), MAX_LEN)), DATA.weights, np.arange(ROWS),
        np.full(ROWS, MAX_LEN))
    return np.asarray(out), [v4.read_slot(cache, s) for s in range(ROWS)]


def _ulps(x, ref) -> float:
    if ref.size == 0:
        return 0.0
    return float(np.abs(x - ref).max() / np.spacing(np.float32(np.abs(ref).max())))


def _snapshot(cache):
    return jax.tree.map(np.asarray, cache)


def _assert_tree_equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)


class LifecycleMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.mgr = CacheManager(MODEL, GEOMETRY, DATA.weights)
        self.rows: dict[str, int] = {}
        self.admitted = 0
        self._read = (None, {})  # (the cache read, what its requests' slots held)

    # --- helpers ---------------------------------------------------------------------------

    def _contents(self):
        """request -> `read_slot` of its slot, read once per cache the manager holds."""
        if self._read[0] is not self.mgr.cache:
            self._read = (self.mgr.cache, {r: v4.read_slot(self.mgr.cache, s)
                                           for r, s in self.mgr.slots.items()})
        return self._read[1]

    def _check_outputs(self, request, out, start, n):
        want = solo()[0][:, self.rows[request], start:start + n]
        assert _ulps(out, want) <= 16, (request, start, n)

    def _check_untouched(self, before, named):
        after = self._contents()
        for r, old in before.items():
            if r in named or r not in after:
                continue
            new = after[r]
            assert new.length == old.length
            np.testing.assert_array_equal(new.window, old.window)
            for name in old.entries:
                np.testing.assert_array_equal(new.entries[name], old.entries[name])
                np.testing.assert_array_equal(new.tail_kv[name], old.tail_kv[name])
                np.testing.assert_array_equal(new.tail_gate[name], old.tail_gate[name])
        for r in named:  # a request that advanced keeps its complete entries bit for bit
            old, new = before[r], after[r]
            for name in old.entries:
                np.testing.assert_array_equal(new.entries[name][:, :old.entries[name].shape[1]],
                                              old.entries[name])

    def _fits(self, appended: dict[str, int]) -> bool:
        """Whether a call appending these counts fits the pool and every maximum length."""
        P = GEOMETRY.page_tokens
        lengths = self.mgr.lengths()
        if any(lengths[r] + n > GEOMETRY.max_seq_len for r, n in appended.items()):
            return False
        need = sum(-(-(lengths[r] + n) // P) - -(-lengths[r] // P) for r, n in appended.items())
        return need <= int(self.mgr.cache.pages.num_free)

    def _attempt(self, call):
        """Runs a call that may be refused; a refused call must change nothing."""
        before = _snapshot(self.mgr.cache)
        try:
            return call(), True
        except (PoolExhaustedError, ValueError):
            _assert_tree_equal(before, self.mgr.cache)
            return None, False

    # --- rules -----------------------------------------------------------------------------

    @rule(row=st.integers(0, ROWS - 1))
    def admit(self, row):
        OPERATIONS["count"] += 1
        request = f"r{self.admitted}"
        if len(self.mgr.slots) == GEOMETRY.max_slots:
            with pytest.raises(RuntimeError, match="no free slot"):
                self.mgr.admit(request)
            return
        self.admitted += 1
        self.mgr.admit(request)
        self.rows[request] = row

    @precondition(lambda self: self.mgr.slots)
    @rule(data=st.data())
    def prefill(self, data):
        OPERATIONS["count"] += 1
        request = data.draw(st.sampled_from(sorted(self.mgr.slots)))
        n = data.draw(st.integers(1, CHUNK))
        start = self.mgr.lengths()[request]
        row = self.rows[request]
        pos = positions([start], CHUNK)
        before = self._contents()
        fits = self._fits({request: n})
        out, ok = self._attempt(lambda: self.mgr.prefill(
            [request], DATA.take(pos, [row]), [n], queries=DATA.stacked_queries(pos, [row])))
        assert ok == fits
        if not ok:
            return
        assert self.mgr.lengths()[request] == start + n
        self._check_outputs(request, np.asarray(out)[:, 0, :n], start, n)
        self._check_untouched(before, {request})

    @precondition(lambda self: self.mgr.slots)
    @rule(data=st.data())
    def decode(self, data):
        OPERATIONS["count"] += 1
        requests = data.draw(st.lists(st.sampled_from(sorted(self.mgr.slots)), min_size=1,
                                      unique=True))
        lengths = self.mgr.lengths()
        rows = [self.rows[r] for r in requests]  # one row per named request, in their order
        pos = np.asarray([lengths[r] for r in requests])
        before = self._contents()
        fits = self._fits(dict.fromkeys(requests, 1))
        out, ok = self._attempt(lambda: self.mgr.decode(
            DATA.take(pos, rows), requests=requests, queries=DATA.stacked_queries(pos, rows)))
        assert ok == fits
        if not ok:
            return
        for i, r in enumerate(requests):
            assert self.mgr.lengths()[r] == lengths[r] + 1
            self._check_outputs(r, np.asarray(out)[:, i], lengths[r], 1)
        self._check_untouched(before, set(requests))

    @precondition(lambda self: self.mgr.slots)
    @rule(data=st.data())
    def release(self, data):
        OPERATIONS["count"] += 1
        request = data.draw(st.sampled_from(sorted(self.mgr.slots)))
        before = self._contents()
        self.mgr.release(request)
        del self.rows[request]
        self._check_untouched(before, set())

    # --- invariants ------------------------------------------------------------------------

    @invariant()
    def poison_what_nobody_owns(self):
        """NaN in every row no live request owns: the next operations must not read it.
        The poisoned cache keeps the requests' contents read before: the next rule's
        `_check_untouched` holds the poisoning to them as well."""
        contents = self._contents()
        self.mgr.cache = synthetic.poison_unowned(self.mgr.cache)
        self._read = (self.mgr.cache, contents)

    @invariant()
    def pages_are_accounted_for(self):
        pages = self.mgr.cache.pages
        table = np.asarray(pages.page_table)
        refcount = np.asarray(pages.refcount)
        num_free = int(pages.num_free)
        total = GEOMETRY.num_pages
        assert num_free + int(np.sum(refcount > 0)) == total
        free = np.sort(np.asarray(pages.free_stack)[:num_free])
        np.testing.assert_array_equal(free, np.flatnonzero(refcount == 0))
        named = np.bincount(table[table >= 0], minlength=total)
        np.testing.assert_array_equal(refcount, named)
        lengths = self.mgr.lengths()
        for r, s in self.mgr.slots.items():
            held = table[s][table[s] >= 0]
            assert held.size == -(-lengths[r] // GEOMETRY.page_tokens)
            assert (table[s][:held.size] >= 0).all()  # held pages are a prefix of the row
        free_slots = set(range(GEOMETRY.max_slots)) - set(self.mgr.slots.values())
        assert all((table[s] < 0).all() for s in free_slots)

    @invariant()
    def every_request_holds_its_solo_state(self):
        _, solo_states = solo()
        for r, got in self._contents().items():
            want = solo_states[self.rows[r]]
            n = got.length
            W = MODEL.window
            np.testing.assert_array_equal(got.window, want.window[:, :0] if n == 0 else
                                          np.asarray(DATA.window[:, self.rows[r],
                                                                 max(0, n - W):n]))
            for name, entries in got.entries.items():
                assert _ulps(entries, want.entries[name][:, :entries.shape[1]]) <= 8, name
                first = got.tail_start[name]
                kv, _ = DATA.compressors[name]
                np.testing.assert_array_equal(got.tail_kv[name],
                                              kv[:, self.rows[r], first:n])


def test_random_lifecycles_keep_every_request_isolated_and_exact():
    OPERATIONS["count"] = 0
    run_state_machine_as_test(LifecycleMachine, settings=settings(
        max_examples=hypothesis_examples(10), stateful_step_count=30, deadline=None,
        suppress_health_check=[HealthCheck.too_slow], derandomize=True))
    assert OPERATIONS["count"] >= 200, OPERATIONS
