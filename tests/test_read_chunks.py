"""Reads that need several loop steps: a geometry whose read chunks are one or two pages, so
the indexer's scores (CSA) and the dense C128 reads (HCA) fold over several chunks, each at
its own entry offset, checked against the brute-force oracle."""

from __future__ import annotations

import numpy as np
import pytest

import v4kv_jax as v4
from v4kv_jax.testing import oracle, synthetic

from conftest import MODEL, assert_matches_oracle, chunk_plan, new_cache, oracle_atol, run_chunks

# P = 128: 32 C4 entries / indexer keys and 8 C128 entries (m' = 16) per page. The indexer
# scores 64 keys (2 pages) per step, the HCA read takes 8 entries (1 page) per step; with 4
# pages per row the loops run 2 and 4 steps.
GEOMETRY = v4.CacheConfig(num_pages=8, max_slots=2, max_pages_per_seq=4)
OPTIONS = v4.Options(query_tile=16, index_read_entries=64, hca_read_entries=8)
LENGTHS = [400, 270]


def test_geometry_needs_several_read_chunks():
    assert OPTIONS.read_chunk_pages(GEOMETRY, OPTIONS.index_read_entries, MODEL.csa_ratio) == 2
    assert OPTIONS.read_chunk_pages(GEOMETRY, OPTIONS.hca_read_entries, MODEL.hca_ratio) == 1
    # Row 0 reaches its 4th page: C128 entries in 4 chunks, indexer keys in 2.
    assert max(LENGTHS) // MODEL.hca_ratio > 3 * GEOMETRY.entries_per_page(MODEL.hca_ratio)
    assert max(LENGTHS) // MODEL.csa_ratio > 2 * GEOMETRY.entries_per_page(MODEL.csa_ratio)


@pytest.fixture(scope="module")
def outputs():
    data = synthetic.SyntheticBatch.draw(MODEL, 2, max(LENGTHS), seed=21)
    _, out = run_chunks(new_cache(MODEL, GEOMETRY), data, chunk_plan(LENGTHS, [32, 29, 32]),
                        options=OPTIONS)
    return data, out


@pytest.mark.parametrize("layer", range(MODEL.num_layers),
                         ids=[f"{i}-{k.name}" for i, k in enumerate(MODEL.layer_kinds)])
def test_multi_chunk_reads_match_the_oracle(outputs, layer):
    data, out = outputs
    kind = MODEL.layer_kinds[layer]
    for b, L in enumerate(LENGTHS):
        want, margin = oracle.attention_outputs(MODEL, kind, data.history(layer, b), L)
        assert margin > 1e-5, "top-k cut too close to call; pick another seed"
        atol = oracle_atol(MODEL, kind, np.arange(L)[:, None, None], rotations=3)
        assert_matches_oracle(out[layer, b, :L], want, atol, err_msg=f"layer {layer} row {b}")


def test_multi_chunk_reads_never_read_unowned_memory(outputs):
    # Every storage row no request owns yet holds NaN: the loops' steps past a row's last
    # page (and its absent pages) read nothing, so the outputs keep their bits.
    data, clean = outputs
    cache = synthetic.poison_unowned(new_cache(MODEL, GEOMETRY), np.nan)
    _, out = run_chunks(cache, data, chunk_plan(LENGTHS, [32, 29, 32]), options=OPTIONS)
    for b, L in enumerate(LENGTHS):
        np.testing.assert_array_equal(np.asarray(out)[:, b, :L], np.asarray(clean)[:, b, :L])
