"""The V4.1 step (v4kv_jax/step41.py) and its pools (v4kv_jax/pools/cache41.py) against the
float64 oracle written from V41_SPEC.md (v4kv_jax/testing/v41_oracle.py): section 11's T1
(every block type), T2 (Reuse after Reindex, the candidate mask biting), T3 (chunkings with
odd starts, prefill then decode, n_t = 0 queries, the window wrapping) and T4 (the release
records, against the oracle with the same fake quantisation).

Outputs, stored entries and keys within 5e-5 of the oracle; picks equal to the oracle's
selections wherever its margin at the cut exceeds fp32's rounding of the scores. Every unused
and freed word of the pools is NaN, and a padding row's vectors are NaN, so a read of
another request's or of unowned memory shows. One program serves every length.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import v41_cases as cases

import v4kv_jax as v4
from v4kv_jax import plan, pools, step41
from v4kv_jax.pools import cache41
from v4kv_jax.testing import v41_oracle as oracle

ATOL = 5e-5  # as tests/test_compressor41.py: RoPE at p <= 66 in fp32 against f64
MARGIN = 1e-4  # selections compared where the oracle's cut exceeds fp32 score noise
TOKENS = 16  # one chunk length (one program) for the whole file
T1 = v4.tiny41()
T2 = v4.V41Config(**{**{f: getattr(T1, f) for f in ("hidden_size", "num_heads", "head_dim",
                                                     "rope_dim", "q_lora_rank", "o_groups",
                                                     "o_lora_rank", "index_heads",
                                                     "index_head_dim",
                                                     "yarn_original_max_position")},
                     "window": 16, "compress_ratios": (0, 2, 2, 2, 1, 1, 1, 1),
                     "kv_source_layers": (1, 4), "index_source_layers": (1, 4, 6),
                     "candidate_source_layer": 4, "candidate_topk_blocks": 3,
                     "candidate_block_size": 4, "index_topk": 6})


def _poisoned(cache: cache41.Cache41) -> cache41.Cache41:
    """Every stored word NaN (a float cache): the Classical pool, the rings, the open rows."""
    nan = lambda x: jnp.full_like(x, jnp.nan)  # noqa: E731
    return cache.replace(classical=jax.tree.map(nan, cache.classical),
                         state=cache.state.replace(window=jax.tree.map(nan, cache.state.window),
                                                   open=jax.tree.map(nan, cache.state.open)))


def _cache(config, formats="float32", slots=3):
    geometry = cache41.cache_config41(formats, num_pages=8, max_slots=slots,
                                      max_pages_per_seq=2)
    cache = cache41.init_cache41(config, geometry)
    return _poisoned(cache) if formats == "float32" else cache


def _run(cache, config, inputs, slot, chunks, *, other=None, start=0, options=None):
    """Feeds positions start.. of `inputs` in `chunks` (lengths) to `slot`, beside a padding
    row (-1, NaN vectors) or `other` = (slot, inputs, start) fed the same chunk lengths;
    returns the cache, the outputs per layer [n, H, hd] and the picks per index source."""
    outs = [[] for _ in inputs]
    picks = {i: [] for i in config.index_source_layers}
    lo = start
    for n in chunks:
        hi = lo + n
        vec, w = cases.chunk(config, inputs, lo, hi, TOKENS)
        if other is None:
            side, ids, n_new = jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), vec), -1, 0
        else:
            first = other[2] + lo - start
            side, _ = cases.chunk(config, other[1], first, first + n, TOKENS)
            ids, n_new = other[0], n
        vec = [jax.tree.map(lambda a, b: jnp.concatenate([a, b]), s, v)
               for s, v in zip(side, vec, strict=True)]
        cache, out = step41.prefill41(cache, vec, w, [ids, slot], [n_new, n], options=options)
        for layer, o in enumerate(out.outputs):
            outs[layer].append(np.asarray(o[1, :n]))
            assert not np.any(np.asarray(o[1, n:])), "padding tokens give zeros"
        for i, (ids_, valid) in zip(config.index_source_layers, out.picks, strict=True):
            for t in range(n):
                picks[i].append(np.asarray(ids_[1, t])[np.asarray(valid[1, t])])
        lo = hi
    return cache, [np.concatenate(o) for o in outs], picks


def _comparable(config, ref, layer: int) -> np.ndarray:
    """bool[L]: the queries whose picks in `layer` are defined beyond fp32's rounding (the
    oracle's score margin at its cuts over MARGIN; every query of a window-only layer)."""
    p = plan.of(config)[layer]
    return ref.margins[p.picks] > MARGIN if p.read == "sparse" else np.ones(
        len(ref.outputs[layer]), bool)


def _check(config, ref, outs, picks, *, rope_atol: float = ATOL) -> None:
    """Outputs within ATOL of the oracle (the RoPE dims within `rope_atol`) and picks equal
    to its selections, wherever its margins exceed MARGIN (at least 80 % of them)."""
    nope = config.head_dim - config.rope_dim
    for layer, (got, want) in enumerate(zip(outs, ref.outputs, strict=True)):
        rows = _comparable(config, ref, layer)
        assert rows.mean() >= 0.8, (layer, rows.mean())
        np.testing.assert_allclose(got[rows, :, :nope], want[rows, :, :nope], rtol=0,
                                   atol=ATOL, err_msg=f"layer {layer}")
        np.testing.assert_allclose(got[rows, :, nope:], want[rows, :, nope:], rtol=0,
                                   atol=rope_atol, err_msg=f"layer {layer}")
    for i in config.index_source_layers:
        for t, got in enumerate(picks[i]):
            if ref.margins[i][t] > MARGIN:
                np.testing.assert_array_equal(got, ref.selections[i][t], err_msg=f"{i} t={t}")


def _stored(cache, config, ref, slot, length) -> None:
    for s in config.kv_source_layers:
        entries, keys = cache41.stored_entries(cache, s, slot, length)
        np.testing.assert_allclose(entries, ref.entries[s], rtol=0, atol=ATOL)
        np.testing.assert_allclose(keys, ref.keys[s], rtol=0, atol=ATOL)


# Queries in tiles of 5, index keys read a page at a time (several loop steps a tile).
SMALL_READS = v4.Options(query_tile=5, index_read_entries=64)


@pytest.mark.parametrize("config, length, chunks, options", [
    (T1, 40, (16, 16, 8), SMALL_READS),  # T1: every block type
    (T1, 67, (5, 3, 16, 1, 1, 1, 13, 16, 11), None),  # T3: odd starts, decode between
    (T2, 67, (16, 16, 16, 16, 3), SMALL_READS),  # T2: the candidate mask bites once n_t > 12
])
def test_step_equals_the_oracle(config, length, chunks, options):
    stack = cases.stack_of(config)
    inputs = oracle.random_inputs(stack, length, seed=length)
    ref = oracle.run(stack, inputs)
    cache = pools.reset_slot(_cache(config), 1)
    cache, outs, picks = _run(cache, config, inputs, 1, chunks, options=options)
    _check(config, ref, outs, picks)
    _stored(cache, config, ref, 1, length)
    assert int(cache.state.lengths[1]) == length


@pytest.mark.parametrize("length", [1, 2, 3, 7, 8, 9])
def test_short_sequences_token_by_token_and_in_one_chunk(length):
    """T3's short lengths: n_t = 0 queries (no entry closed: window only), the ratio-2 open
    row across calls; token by token through `decode_step41` equals one chunk."""
    stack = cases.stack_of(T1)
    inputs = oracle.random_inputs(stack, length, seed=100 + length)
    ref = oracle.run(stack, inputs)
    cache = pools.reset_slot(_cache(T1), 1)
    _, outs, picks = _run(cache, T1, inputs, 1, (length,))
    _check(T1, ref, outs, picks)
    cache = pools.reset_slot(_cache(T1, slots=2), 1)
    steps = []
    for t in range(length):
        vec, w = cases.chunk(T1, inputs, t, t + 1)
        vec = [jax.tree.map(lambda x: jnp.concatenate([jnp.full_like(x, jnp.nan), x]), v)
               for v in vec]
        cache, out = step41.decode_step41(cache, vec, w)
        steps.append([np.asarray(o[1, 0]) for o in out.outputs])
    for layer in range(len(outs)):
        np.testing.assert_allclose(np.stack([s[layer] for s in steps]), ref.outputs[layer],
                                   rtol=0, atol=ATOL)


def test_release_records_equal_the_oracle_with_the_same_fake_quantisation():
    """T4: NVFP4 entries, MXFP4 keys (and the index query), MXFP8 window rows."""
    stack = cases.stack_of(T1)
    inputs = oracle.random_inputs(stack, 40, seed=4)
    ref = oracle.run(stack, inputs, quantize=True)
    cache = pools.reset_slot(_cache(T1, "release"), 1)
    cache, outs, picks = _run(cache, T1, inputs, 1, (16, 9, 15))
    _check(T1, ref, outs, picks)
    _stored(cache, T1, ref, 1, 40)


def test_requests_never_read_each_other():
    """Two sequences side by side give each the outputs it gets beside a padding row, bit for
    bit, in a pool whose every other word is NaN; after the second is released and its pages
    are poisoned and taken by a new sequence, the first goes on as alone."""
    stack = cases.stack_of(T1)
    a, b, c = (oracle.random_inputs(stack, 46, seed=s) for s in (7, 8, 9))
    alone = pools.reset_slot(_cache(T1), 1)
    _, want, _ = _run(alone, T1, a, 1, (16, 14, 16))
    both = pools.reset_slot(pools.reset_slot(_cache(T1), 1), 2)
    both, first, _ = _run(both, T1, a, 1, (16, 14), other=(2, b, 0))
    both = _poisoned_free(pools.release_slot(both, 2))
    assert int(both.pages.num_free) == 8 - 1  # 30 tokens of slot 1: one page of 128
    both = pools.reset_slot(both, 0)
    both, then, _ = _run(both, T1, a, 1, (16,), other=(0, c, 0), start=30)
    for x, y, z in zip(first, then, want, strict=True):
        np.testing.assert_array_equal(np.concatenate([x, y]), z)


def _poisoned_free(cache):
    """NaN in every page on the free stack."""
    free = np.asarray(cache.pages.free_stack)[: int(cache.pages.num_free)]
    pages = jnp.asarray(free)

    def poison(lanes):
        return jax.tree.map(lambda x: x.at[pages].set(jnp.nan), lanes)

    return cache.replace(classical=jax.tree.map(poison, cache.classical,
                                                is_leaf=lambda x: isinstance(x, pools.Lanes)))


def test_one_program_serves_every_length_and_start():
    before = step41._step_jit.traces
    stack = cases.stack_of(T1)
    inputs = oracle.random_inputs(stack, 20, seed=3)
    cache = pools.reset_slot(_cache(T1), 1)
    _run(cache, T1, inputs, 1, (3, 16, 1))
    assert step41._step_jit.traces - before <= 1


def test_bad_calls_name_the_argument():
    cache = pools.reset_slot(_cache(T1), 1)
    stack = cases.stack_of(T1)
    vec, w = cases.chunk(T1, oracle.random_inputs(stack, 4, seed=0), 0, 4)
    with pytest.raises(ValueError, match=r"vectors\[1\]\.a: expected an array of shape"):
        step41.prefill41(cache, [*vec[:1], vec[1].replace(a=None), *vec[2:]], w, [1], [4])
    with pytest.raises(ValueError, match=r"vectors\[0\]\.win: expected shape \(1, 4, 64\)"):
        step41.prefill41(cache, [vec[0].replace(win=vec[0].win[..., :3]), *vec[1:]], w, [1], [4])
    with pytest.raises(TypeError, match="vectors: expected a sequence of 6 LayerVectors41"):
        step41.prefill41(cache, vec[:5], w, [1], [4])
    with pytest.raises(TypeError, match="cache: expected a Cache41"):
        step41.prefill41(object(), vec, w, [1], [4])
    with pytest.raises(ValueError, match="slot_ids: expected ACTIVE slots"):
        step41.prefill41(cache, vec, w, [0], [4])
    with pytest.raises(ValueError, match=r"n_new: expected counts in \[0, 4\]"):
        step41.prefill41(cache, vec, w, [1], [5])
    with pytest.raises(ValueError, match="entry_dtype: expected one of"):
        cache41.init_cache41(T1, v4.CacheConfig(num_pages=2, max_slots=1, max_pages_per_seq=1,
                                                entry_dtype="fp8_latent"))
    with pytest.raises(ValueError, match="entry_dtype: expected a V4 format"):
        pools.init_cache(v4.tiny(), v4.CacheConfig(num_pages=2, max_slots=1,
                                                   max_pages_per_seq=1, entry_dtype="nvfp4"))
    with pytest.raises(ValueError, match="layer: expected a kv source"):
        cache41.stored_entries(cache, 2, 1, 4)


def test_pools_hold_only_the_sources_in_lane_rows():
    """Entries and keys for the kv sources only (64 a page at ratio 2, 128 at ratio 1), the
    window of every layer, open rows for the ratio-2 sources; every plane row-major on a TPU
    (its minor dim a multiple of 128 lanes)."""
    cache = cache41.init_cache41(T1, cache41.cache_config41("release", num_pages=4,
                                                            max_slots=2, max_pages_per_seq=2))
    assert [e.map.records for e in cache.classical.entries] == [64, 128]
    assert [k.map.records for k in cache.classical.keys] == [64, 128]
    assert cache.state.window.lead == (6, 2) and cache.state.open.lead == (1, 2)
    for leaf in jax.tree.leaves(cache.classical) + jax.tree.leaves(cache.state.window):
        assert leaf.shape[-1] % 128 == 0
    # 64 values: 32 B of e2m1 + 4 e4m3 scales; 32 key values: 16 B + 1 UE8M0 scale, in whole
    # words (at V4.1-Flash's widths 288 and 68 B: whole words already).
    assert (cache.codec("entries").row_bytes, cache.codec("keys").row_bytes) == (36, 20)


def _slot_state(cache, slot: int, length: int) -> list[np.ndarray]:
    """What a slot holds, as stored words: every source's entries and keys of its first
    `length` tokens, its window rings and open rows."""
    config = cache.config
    out = []
    for s in config.kv_source_layers:
        per_page = cache.geometry.page_tokens // config.compress_ratios[s]
        j = np.arange(length // config.compress_ratios[s])
        page = np.asarray(cache.pages.page_table[slot])[j // per_page]
        for name in ("entries", "keys"):
            out.append(np.asarray(cache41.source_store(cache, name, s).take((page,),
                                                                         j % per_page)))
    out.append(np.asarray(cache41.window41(cache).records()[:, slot]))
    out.append(np.asarray(cache41.open_rows(cache).records()[:, slot]))
    return [x.view(np.uint32) for x in out]


@pytest.mark.xla_defaults  # two programs (decode and a chunk): their bits as users compile
def test_prefill_leaves_the_state_token_by_token_decode_leaves_bit_for_bit():
    """Entries, index keys, window rings and the ratio-2 open row of a sequence fed in
    chunks with odd starts equal, word for word, those of the same tokens fed one by one
    through `decode_step41` (the compressors are chunk-invariant; the window rows are each
    token's own). float32 storage: a release record is a function of these values."""
    formats = "float32"
    stack = cases.stack_of(T1)
    inputs = oracle.random_inputs(stack, 21, seed=21)
    chunked = pools.reset_slot(_cache(T1, formats), 1)
    chunked, _, _ = _run(chunked, T1, inputs, 1, (5, 16))
    stepped = pools.reset_slot(_cache(T1, formats, slots=2), 1)
    for t in range(21):
        vec, w = cases.chunk(T1, inputs, t, t + 1)
        vec = [jax.tree.map(lambda x: jnp.concatenate([jnp.full_like(x, jnp.nan), x]), v)
               for v in vec]
        stepped, _ = step41.decode_step41(stepped, vec, w)
    for a, b in zip(_slot_state(chunked, 1, 21), _slot_state(stepped, 1, 21), strict=True):
        np.testing.assert_array_equal(a, b)


def test_the_flash_plan_at_tiny_widths_equals_the_oracle():
    """T6: V4.1-Flash's 40 backbone layers (sources 2, 8, 14, 20, index sources to 36,
    candidates from 20), window 8, the tiny widths, 80 tokens in chunks: every layer's
    outputs, the four sources' entries and keys."""
    config = v4.flash41(**{f: getattr(T1, f) for f in (
        "hidden_size", "num_heads", "head_dim", "rope_dim", "q_lora_rank", "o_groups",
        "o_lora_rank", "index_heads", "index_head_dim", "yarn_original_max_position")},
        window=8, candidate_topk_blocks=4, candidate_block_size=2, index_topk=6)
    stack = cases.stack_of(config)
    inputs = oracle.random_inputs(stack, 80, seed=6)
    ref = oracle.run(stack, inputs)
    cache = pools.reset_slot(_cache(config), 1)
    cache, outs, picks = _run(cache, config, inputs, 1, (16,) * 5)
    _check(config, ref, outs, picks)
    _stored(cache, config, ref, 1, 80)


def test_real_widths_with_the_candidate_cut():
    """T5: V4.1-Flash's widths (hd 512, rope 64, 32 index heads of 128, top-512, candidate
    blocks of 8) in three ratio-1 layers (a kv source that is the candidate source, a Reuse
    layer, a Reindex layer with candidates), 1100 tokens: 72 candidate blocks of 138 kept.

    float32 storage: the RoPE angle is one fp32 product p * f_i, as the official code forms
    it, so at positions up to 1100 a rotated value is within |v| 1100 2^-24 (|v| < 6 here:
    4e-4) of the float64 oracle's, its RoPE dims held to that; the other dims to 5e-5. (In
    the release records such a difference flips a code now and then: T4 holds them at short
    lengths.) The records at these widths are 528 / 288 / 68 B."""
    config = v4.flash41(hidden_size=256, num_heads=8, o_groups=8, q_lora_rank=64,
                        o_lora_rank=16, compress_ratios=(1, 1, 1), kv_source_layers=(0,),
                        index_source_layers=(0, 2), candidate_source_layer=0,
                        candidate_topk_blocks=72)
    stack = cases.stack_of(config)
    inputs = oracle.random_inputs(stack, 1100, seed=5)
    ref = oracle.run(stack, inputs)
    geometry = cache41.cache_config41("float32", num_pages=9, max_slots=1, max_pages_per_seq=9)
    cache = pools.reset_slot(cache41.init_cache41(config, geometry), 0)
    outs, picks = [[] for _ in inputs], {i: [] for i in config.index_source_layers}
    for lo in range(0, 1100, 100):
        vec, w = cases.chunk(config, inputs, lo, lo + 100)
        cache, out = step41.prefill41(cache, vec, w, [0], [100])
        for layer, o in enumerate(out.outputs):
            outs[layer].append(np.asarray(o[0]))
        for i, (ids, valid) in zip(config.index_source_layers, out.picks, strict=True):
            picks[i] += [np.asarray(ids[0, t])[np.asarray(valid[0, t])] for t in range(100)]
    _check(config, ref, [np.concatenate(o) for o in outs], picks, rope_atol=4e-4)
    assert ref.margins[2][600:].max() < np.inf  # the candidate cut was made
    release = cache41.cache_config41("release", num_pages=1, max_slots=1, max_pages_per_seq=1)
    assert [cache41.codec41(config, release, n).row_bytes
            for n in ("window", "entries", "keys")] == [528, 288, 68]
