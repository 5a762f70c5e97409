"""CSA sparse decode attention kernels against the reference (`attention.attend` with picks)."""

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

from pallas_kernels.sparse_attention import BlockSizes
from v4kv_jax import ops, pools, rope
from v4kv_jax.config import LayerKind
from v4kv_jax.testing import synthetic


@pytest.fixture(scope="module", params=CASES, ids=CASE_IDS)
def case(request):
    page_tokens, dtype, heads = request.param
    model, cache = model_for(heads), shared_cache(page_tokens, dtype)
    lengths = lengths_for(page_tokens)
    batch = len(lengths)
    layer = model.layers_of(LayerKind.CSA)[1]
    kind_layer = model.kind_index(layer)
    q_pos, kv_end = decode_positions(lengths)
    queries = synthetic.SyntheticBatch.draw(model, batch, 1, seed=heads).queries(
        layer, np.zeros((batch, 1), int))
    rows = cache.pages.page_table[:batch]
    picks = ops.index_topk(model, cache.geometry, index_keys=pools.csa_entries(cache).index_keys,
                           layer=kind_layer, page_rows=rows, index_q=queries.index_q[:, 0],
                           index_weights=queries.index_weights[:, 0], q_pos=q_pos,
                           kv_end=kv_end, options=REFERENCE)
    # Holes before valid picks: every -1 must be skipped, not only a trailing run.
    picks = picks.at[:, 1::5].set(-1)
    assert int(jnp.sum(picks >= 0)) > 100

    def run(**kw):
        return np.asarray(ops.sparse_decode_attention(
            model, cache.geometry, q=queries.q[:, 0], sink=queries.sink,
            window=pools.window_ring(cache), window_layer=layer, slot_ids=jnp.arange(batch),
            q_pos=q_pos, kv_end=kv_end, c4=pools.csa_entries(cache).c4, c4_layer=kind_layer,
            page_rows=rows, picks=picks, **kw))

    return types.SimpleNamespace(run=run, dtype=dtype, want=run(options=REFERENCE))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_sparse_decode_attention_matches_reference(case, implementation):
    # 16 picks per block: 48 picks span three blocks (double buffering, GPU splits).
    got = case.run(options=kernel_options(implementation, "sparse_decode_attention",
                                          BlockSizes(picks_per_block=16, num_splits=2)))
    assert np.isfinite(got).all()
    assert np.abs(case.want[0]).max() == 0.0  # length 0: nothing visible, the sink alone
    assert_close(got, case.want, case.dtype)


@pytest.fixture(scope="module")
def packed_case():
    """fp8_latent C4 entries and window (the release formats) with 16 heads."""
    model = packed_model(16)
    cache, packed, decoded = packed_cache()
    lengths = lengths_for(PACKED_PAGE_TOKENS)
    batch = len(lengths)
    layer = model.layers_of(LayerKind.CSA)[1]
    kind_layer = model.kind_index(layer)
    q_pos, kv_end = decode_positions(lengths)
    queries = synthetic.SyntheticBatch.draw(model, batch, 1, seed=5).queries(
        layer, np.zeros((batch, 1), int))
    rows = cache.pages.page_table[:batch]
    picks = ops.index_topk(model, cache.geometry, index_keys=pools.csa_entries(cache).index_keys,
                           layer=kind_layer, page_rows=rows, index_q=queries.index_q[:, 0],
                           index_weights=queries.index_weights[:, 0], q_pos=q_pos,
                           kv_end=kv_end, options=REFERENCE)
    args = dict(q=queries.q[:, 0], sink=queries.sink, window_layer=layer,
                slot_ids=jnp.arange(batch), q_pos=q_pos, kv_end=kv_end, c4_layer=kind_layer,
                page_rows=rows, picks=picks.at[:, 1::5].set(-1))
    want = ops.sparse_decode_attention(model, cache.geometry, window=decoded["window"],
                                       c4=decoded["csa"], options=REFERENCE, **args)
    return types.SimpleNamespace(model=model, args=args, packed=packed, want=np.asarray(want))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_sparse_decode_attention_reads_fp8_latent(packed_case, implementation):
    kernel = kernel_function("sparse_attention", implementation, "sparse_decode_attention")
    c = packed_case
    window, c4 = c.packed["window"], c.packed["csa"]
    got = kernel(**c.args, window=window.planes, c4=c4.planes,
                 inv_freq=rope.inv_frequencies(c.model, LayerKind.CSA),
                 block_sizes=BlockSizes(picks_per_block=16, num_splits=2),
                 interpret=INTERPRET, entry_format="fp8_latent", window_format="fp8_latent",
                 rope_dim=c.model.rope_dim, entry_lanes=c4.map.spec,
                 window_lanes=window.map.spec)
    got = np.asarray(got)
    assert np.isfinite(got).all()
    assert_close(got, c.want, "float32")
