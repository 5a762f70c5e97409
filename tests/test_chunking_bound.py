"""Chunked prefill against token-by-token decode: what is exact and what is bounded.

The window ring, the compressor tails, lengths and page tables are bit-identical for every
chunking. A compressed entry is pooled by the same operations on both paths, but XLA
vectorises the softmax's `exp` differently for one block (decode) than for many (a chunk), so
entries may differ in their last bits: the stated bound is 8 ulp of the largest entry
magnitude (measured: at most 3), and attention outputs 16 ulp of the largest output
magnitude (measured: at most 4). Measured and held as users compile, at XLA's defaults
(tests/xla_defaults.py; at the suite's faster flags: 3.5 and 4).
"""

from __future__ import annotations

import numpy as np
import pytest

import v4kv_jax as v4
from v4kv_jax.testing import synthetic

from conftest import MODEL, chunk_plan, new_cache, run_chunks

pytestmark = pytest.mark.xla_defaults  # other programs, their bits and bounds as users compile

ENTRY_ULPS, OUTPUT_ULPS = 8, 16
LENGTHS = [300, 171]


def _ulps(x, ref) -> float:
    x, ref = np.asarray(x), np.asarray(ref)
    return float(np.abs(x - ref).max() / np.spacing(np.float32(np.abs(ref).max())))


@pytest.fixture(scope="module")
def decoded():
    data = synthetic.SyntheticBatch.draw(MODEL, 2, 300, seed=11)
    cache, out = run_chunks(new_cache(), data, chunk_plan(LENGTHS, [1]), chunk=1)
    return data, cache, out


def _assert_within_bound(cache, ref):
    for slot in range(len(LENGTHS)):
        got, want = v4.read_slot(cache, slot), v4.read_slot(ref, slot)
        assert got.length == want.length == LENGTHS[slot]
        np.testing.assert_array_equal(got.window, want.window)
        for spec in cache.specs:
            np.testing.assert_array_equal(got.tail_kv[spec.name], want.tail_kv[spec.name])
            np.testing.assert_array_equal(got.tail_gate[spec.name], want.tail_gate[spec.name])
            assert got.entries[spec.name].shape[1] == LENGTHS[slot] // spec.ratio
            assert _ulps(got.entries[spec.name], want.entries[spec.name]) <= ENTRY_ULPS


@pytest.mark.parametrize("sizes", [[32], [5, 32, 17], [31, 1]])
def test_chunked_prefill_state_and_outputs_within_the_stated_bound(decoded, sizes):
    data, ref, ref_out = decoded
    cache, out = run_chunks(new_cache(), data, chunk_plan(LENGTHS, sizes))
    _assert_within_bound(cache, ref)
    assert _ulps(out, ref_out) <= OUTPUT_ULPS


def test_one_long_chunk_within_the_stated_bound(decoded):
    data, ref, _ = decoded
    cache = new_cache()
    n = np.asarray(LENGTHS)
    cache = v4.prefill(cache, data.span(0, 300), data.weights, [0, 1], n)
    _assert_within_bound(cache, ref)
