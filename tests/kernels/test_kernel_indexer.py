"""Indexer score kernels (and the top-k after them) against the reference."""

from __future__ import annotations

import types

import numpy as np
import pytest
from kernel_cases import (
    CASE_IDS,
    CASES,
    IMPLEMENTATIONS,
    INTERPRET,
    PACKED_PAGE_TOKENS,
    REFERENCE,
    assert_close,
    decode_positions,
    kernel_function,
    kernel_options,
    lengths_for,
    model_for,
    packed_cache,
    packed_model,
    shared_cache,
)

from pallas_kernels.indexer import BlockSizes
from v4kv_jax import ops, pools
from v4kv_jax.config import LayerKind
from v4kv_jax.testing import synthetic


@pytest.fixture(scope="module", params=CASES, ids=CASE_IDS)
def case(request):
    page_tokens, dtype, heads = request.param
    model, cache = model_for(4, index_heads=heads), shared_cache(page_tokens, dtype)
    lengths = lengths_for(page_tokens)
    batch = len(lengths)
    layer = model.layers_of(LayerKind.CSA)[1]
    q_pos, kv_end = decode_positions(lengths)
    queries = synthetic.SyntheticBatch.draw(model, batch, 1, seed=heads + 2).queries(
        layer, np.zeros((batch, 1), int))
    args = (model, cache.geometry)
    arrays = dict(index_keys=pools.csa_entries(cache).index_keys, layer=model.kind_index(layer),
                  page_rows=cache.pages.page_table[:batch], index_q=queries.index_q[:, 0],
                  index_weights=queries.index_weights[:, 0], q_pos=q_pos, kv_end=kv_end)
    return types.SimpleNamespace(
        args=args, arrays=arrays, model=model, lengths=lengths,
        visible=np.minimum(q_pos + 1, kv_end) // 4,
        scores=np.asarray(ops.index_scores(*args, **arrays, options=REFERENCE)),
        picks=np.asarray(ops.index_topk(*args, **arrays, options=REFERENCE)))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_index_scores_and_picks_match_reference(case, implementation):
    kernel = dict(options=kernel_options(implementation, "index_scores",
                                         BlockSizes(entries_per_block=64)))
    got = np.asarray(ops.index_scores(*case.args, **case.arrays, **kernel))
    want = case.scores
    width = min(want.shape[1], got.shape[1])
    assert np.isneginf(want[:, width:]).all() and np.isneginf(got[:, width:]).all()
    want, got = want[:, :width], got[:, :width]
    candidates = np.isfinite(want)
    np.testing.assert_array_equal(candidates.sum(1), case.visible)
    np.testing.assert_array_equal(np.isfinite(got), candidates)
    assert_close(got[candidates], want[candidates], "float32")

    picks = np.asarray(ops.index_topk(*case.args, **case.arrays, **kernel))
    k, compared = case.model.index_topk, 0
    for b, row in enumerate(want):
        top = np.sort(row[candidates[b]])[::-1]
        # ReLU ties make several top-k sets correct; compare where the cut is clear.
        if len(top) > k and top[k - 1] - top[k] < 1e-4:
            continue
        assert set(picks[b]) == set(case.picks[b]), f"row {b} (length {case.lengths[b]})"
        compared += 1
    assert compared >= len(want) - 1


@pytest.fixture(scope="module")
def packed_case():
    """fp4_index keys; the query is taken as already rotated (ops prepares it)."""
    model = packed_model(4, index_heads=16)
    cache, packed, decoded = packed_cache()
    lengths = lengths_for(PACKED_PAGE_TOKENS)
    batch = len(lengths)
    layer = model.layers_of(LayerKind.CSA)[1]
    q_pos, kv_end = decode_positions(lengths)
    queries = synthetic.SyntheticBatch.draw(model, batch, 1, seed=7).queries(
        layer, np.zeros((batch, 1), int))
    args = dict(layer=model.kind_index(layer), page_rows=cache.pages.page_table[:batch],
                index_q=queries.index_q[:, 0], index_weights=queries.index_weights[:, 0],
                q_pos=q_pos, kv_end=kv_end)
    want = ops.index_scores(model, cache.geometry, index_keys=decoded["csa_index"],
                            options=REFERENCE, **args)
    return types.SimpleNamespace(model=model, args=args, packed=packed, want=np.asarray(want),
                                 visible=np.minimum(q_pos + 1, kv_end) // 4)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_index_scores_read_fp4_index(packed_case, implementation):
    c = packed_case
    kernel = kernel_function("indexer", implementation, "index_scores")
    keys = c.packed["csa_index"]
    got = np.asarray(kernel(c.args["index_q"], c.args["index_weights"], keys.planes,
                            c.args["layer"], c.args["page_rows"], c.args["q_pos"],
                            c.args["kv_end"], ratio=c.model.csa_ratio,
                            block_sizes=BlockSizes(entries_per_block=64), interpret=INTERPRET,
                            index_format="fp4_index", index_lanes=keys.map.spec))
    width = min(c.want.shape[1], got.shape[1])
    want, got = c.want[:, :width], got[:, :width]
    candidates = np.isfinite(want)
    np.testing.assert_array_equal(candidates.sum(1), c.visible)
    np.testing.assert_array_equal(np.isfinite(got), candidates)
    assert_close(got[candidates], want[candidates], "float32")
