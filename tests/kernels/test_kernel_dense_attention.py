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

from pallas_kernels.dense_attention import BlockSizes
from v4kv_jax import ops, pools, rope
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
            q_pos=q_pos, kv_end=kv_end, c128=pools.hca_entries(cache).c128,
            c128_layer=model.kind_index(layer), page_rows=cache.pages.page_table[:batch],
            **kw))

    return types.SimpleNamespace(run=run, dtype=dtype, want=run(options=REFERENCE))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_dense_decode_attention_matches_reference(case, implementation):
    # 16 entries per block: the 3001-token row folds 12 blocks (TPU: 1-2 pages each).
    got = case.run(options=kernel_options(implementation, "dense_decode_attention",
                                          BlockSizes(entries_per_block=16, num_splits=3)))
    assert np.isfinite(got).all()
    assert_close(got, case.want, case.dtype)


@pytest.fixture(scope="module")
def packed_case():
    """fp8_latent C128 entries with an fp32 window ring: the window and the entries are two
    layouts in one softmax (two accumulator groups)."""
    model = packed_model(4)
    cache, packed, decoded = packed_cache()
    lengths = lengths_for(PACKED_PAGE_TOKENS)
    batch = len(lengths)
    layer = model.layers_of(LayerKind.HCA)[1]
    q_pos, kv_end = decode_positions(lengths)
    queries = synthetic.SyntheticBatch.draw(model, batch, 1, seed=6).queries(
        layer, np.zeros((batch, 1), int))
    args = dict(q=queries.q[:, 0], sink=queries.sink, window=pools.window_ring(cache),
                window_layer=layer, slot_ids=jnp.arange(batch), q_pos=q_pos, kv_end=kv_end,
                c128_layer=model.kind_index(layer), page_rows=cache.pages.page_table[:batch])
    want = ops.dense_decode_attention(model, cache.geometry, c128=decoded["hca"],
                                      options=REFERENCE, **args)
    return types.SimpleNamespace(model=model, args=args, packed=packed, want=np.asarray(want))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_dense_decode_attention_reads_fp8_latent_entries(packed_case, implementation):
    c = packed_case
    kernel = kernel_function("dense_attention", implementation, "dense_decode_attention")
    window, c128 = c.args["window"], c.packed["hca"]
    args = dict(c.args, window=window.planes)
    got = np.asarray(kernel(**args, c128=c128.planes,
                            inv_freq=rope.inv_frequencies(c.model, LayerKind.HCA),
                            ratio=c.model.hca_ratio,
                            block_sizes=BlockSizes(entries_per_block=16, num_splits=3),
                            interpret=INTERPRET, entry_format="fp8_latent",
                            window_format="float32", rope_dim=c.model.rope_dim,
                            entry_lanes=c128.map.spec, window_lanes=window.map.spec))
    assert np.isfinite(got).all()
    assert_close(got, c.want, "float32")
