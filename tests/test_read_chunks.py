"""Reads that need several loop steps: a geometry whose read chunks are one or two pages, so
the indexer's scores (CSA) and the dense C128 reads (HCA) fold over several chunks, each at
its own entry offset, checked against the brute-force oracle."""

from __future__ import annotations

import jax.numpy as jnp
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


@pytest.mark.parametrize("valid", [1, 3, 5, MODEL.index_topk])
def test_sparse_read_takes_only_the_used_prefix_of_the_picks(valid):
    # The read gathers the shortest multiple of k / 4 picks holding every valid pick. The
    # same picks with their -1s first force the whole read: both give the same output, and
    # a valid pick in the last column is never dropped.
    model, geometry = MODEL, v4.CacheConfig(num_pages=8, max_slots=2, max_pages_per_seq=4)
    lengths = [200, 131]
    cache = synthetic.random_cache(model, geometry, lengths, seed=valid, fill_unused=np.nan)
    layer = model.layers_of(v4.LayerKind.CSA)[0]
    queries = synthetic.SyntheticBatch.draw(model, 2, 1, seed=3).queries(
        layer, np.zeros((2, 1), int))
    rng = np.random.default_rng(valid)
    k = model.index_topk
    ids = np.stack([rng.permutation(L // model.csa_ratio)[:valid] for L in lengths])
    first = np.full((2, k), -1, np.int32)
    first[:, :valid] = ids
    last = np.full((2, k), -1, np.int32)
    last[:, k - valid:] = ids
    kv_end = jnp.asarray(lengths, jnp.int32)

    def read(picks):
        return np.asarray(v4.ops.sparse_decode_attention(
            model, geometry, v4.Options(implementation="reference"), q=queries.q[:, 0],
            sink=queries.sink, window=v4.pools.window_ring(cache), window_layer=layer,
            slot_ids=jnp.arange(2), q_pos=kv_end - 1, kv_end=kv_end,
            c4=v4.pools.csa_entries(cache).c4, c4_layer=model.kind_index(layer),
            page_rows=cache.pages.page_table[:2], picks=jnp.asarray(picks)))

    got, full = read(first), read(last)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, full, rtol=0, atol=1e-6)
    # Without its picks the output differs: the picks were read.
    assert np.abs(read(np.full((2, k), -1, np.int32)) - full).max() > 1e-3


@pytest.mark.parametrize("k, lengths, ties", [
    (8, [400, 270], False),   # k below a page's entries: a selection at every size
    (64, [200, 131], False),  # at most k entries: every candidate, in id order
    (64, [400, 130], True),   # past k, scores drawn from 3 values: ties decided by id
])
def test_a_chunks_running_top_k_equals_the_whole_rows(k, lengths, ties):
    # A chunk's picks merge each read chunk's scores into the best k so far (no score row of
    # the context per query); they equal the one-shot top-k of the whole row, element for
    # element, whatever the ties and however few the candidates.
    import jax

    from v4kv_jax.ops import indexer

    model = v4.tiny(index_topk=k)
    cache = synthetic.random_cache(model, GEOMETRY, lengths, seed=k, fill_unused=np.nan)
    rng = np.random.default_rng(k)
    tokens = 5
    q_pos = jnp.asarray(np.asarray(lengths)[:, None] - tokens + np.arange(tokens), jnp.int32)
    shape = (2, tokens, model.index_heads, model.index_head_dim)
    index_q = rng.integers(0, 3, shape) if ties else rng.standard_normal(shape)
    index_q = jnp.asarray(index_q, jnp.float32)
    weights = jnp.asarray(np.abs(rng.standard_normal(shape[:3])) + (0 if ties else 0.1),
                          jnp.float32)
    keys = v4.pools.csa_entries(cache).index_keys
    if ties:
        weights = jnp.ones_like(weights)
        stored = keys.records()  # NaN where no request owns the row: kept
        small = rng.integers(0, 3, stored.shape).astype(np.float32)
        keys = keys.map.pack(jnp.where(jnp.isnan(stored), stored, small))
    args = dict(index_keys=keys, layer=0,
                page_rows=cache.pages.page_table[:2], index_q=index_q, index_weights=weights,
                q_pos=q_pos, kv_end=jnp.asarray(lengths, jnp.int32))

    def picks(fn):
        return np.asarray(jax.jit(lambda a: fn(model, GEOMETRY, OPTIONS, **a))(args))

    whole, running = picks(indexer.index_topk), picks(indexer.running_topk)
    np.testing.assert_array_equal(running, whole)
    # Both merge chunk by chunk; numpy's stable sort of the whole prefix says what they must.
    row_scores = picks(indexer.index_scores)
    np.testing.assert_array_equal(whole, np_picks(
        row_scores, np.asarray(lengths) // model.csa_ratio, k,
        GEOMETRY.entries_per_page(model.csa_ratio)))
    scores = -np.sort(-row_scores, axis=-1)
    if ties:  # equal scores across the k-th pick: the cut is decided by id
        assert (scores[..., k - 1] == scores[..., k]).any()
    if k == 64 and not ties:  # fewer candidates than k: -1s among the picks
        assert (whole == -1).any() and not np.isfinite(scores[..., k - 1]).all()


@pytest.mark.parametrize("seed", range(3))
def test_the_tpus_sorted_top_k_is_lax_top_k_with_signed_zeros_and_nans(seed):
    # On a TPU the indexer's merge is a stable sort on an integer key of the scores' bits
    # that carries the ids (no gather); elsewhere `lax.top_k` and a gather. Both pick and
    # order alike: +0 above -0, NaN by its sign, ties to the earlier id.
    from v4kv_jax.ops import indexer

    rng = np.random.default_rng(seed)
    values = np.asarray([0.0, -0.0, 1.0, -1.0, 2.5, -np.inf, np.inf, np.nan, -np.nan],
                        np.float32)
    scores = jnp.asarray(rng.choice(values, (3, 2, 256)))
    ids = jnp.asarray(rng.permutation(3 * 2 * 256).reshape(3, 2, 256), jnp.int32)
    want = indexer._top_gathered(scores, ids, 32)
    got = indexer._top_sorted(scores, ids, 32)
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    np.testing.assert_array_equal(np.asarray(got[0]).view(np.int32),
                                  np.asarray(want[0]).view(np.int32))


def np_picks(scores: np.ndarray, num_entries: np.ndarray, k: int, smallest: int) -> np.ndarray:
    """The indexer's picks by hand: over the shortest prefix of `smallest` * 2^j ids (or the
    row) holding every written entry, every candidate in id order if it has at most k ids,
    else the k best, ties to the lower id (a stable sort); -1 where none."""
    C = scores.shape[-1]
    size = smallest
    while size < min(C, int(num_entries.max())):
        size *= 2
    size = min(size, C)
    out = np.full(scores.shape[:-1] + (k,), -1, np.int64)
    for at in np.ndindex(*scores.shape[:-1]):
        row = scores[at][:size]
        order = np.arange(size) if size <= k else np.argsort(-row, kind="stable")[:k]
        ids = [i for i in order if row[i] > -np.inf]
        out[at][:len(ids)] = ids
    return out
