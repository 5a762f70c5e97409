"""HCA dense decode attention kernels against the reference (`attention.attend`)."""

from __future__ import annotations

import types

import jax.numpy as jnp
import numpy as np
import pytest
from kernel_cases import (
    CASE_IDS,
    CASES,
    IMPLEMENTATIONS,
    INTERPRET,
    assert_close,
    decode_positions,
    lengths_for,
    model_for,
    shared_cache,
)

from pallas_kernels.dense_attention import BlockSizes
from v4kv_jax import ops, pools
from v4kv_jax.config import LayerKind
from v4kv_jax.testing import synthetic


@pytest.fixture(scope="module", params=CASES, ids=CASE_IDS)
def case(request):
    page_tokens, dtype, heads = request.param
    model, cache = model_for(heads), shared_cache(page_tokens, dtype)
    lengths = lengths_for(page_tokens)
    batch = len(lengths)
    layer = model.layers_of(LayerKind.HCA)[1]
    q_pos, kv_end = decode_positions(lengths)
    queries = synthetic.SyntheticBatch.draw(model, batch, 1, seed=heads + 1).queries(
        layer, np.zeros((batch, 1), int))

    def run(**kw):
        return np.asarray(ops.dense_decode_attention(
            model, cache.geometry, q=queries.q[:, 0], sink=queries.sink,
            window=pools.window_ring(cache), window_layer=layer, slot_ids=jnp.arange(batch),
            q_pos=q_pos, kv_end=kv_end, c128=pools.entries(cache, "hca"),
            c128_layer=model.kind_index(layer), page_rows=cache.pages.page_table[:batch],
            **kw))

    return types.SimpleNamespace(run=run, dtype=dtype, want=run(implementation="reference"))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_dense_decode_attention_matches_reference(case, implementation):
    # 16 entries per block: the 3001-token row folds 12 blocks (TPU: 1-2 pages each).
    got = case.run(implementation=implementation, interpret=INTERPRET,
                   block_sizes=BlockSizes(entries_per_block=16, num_splits=3))
    assert np.isfinite(got).all()
    assert_close(got, case.want, case.dtype)
