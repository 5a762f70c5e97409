"""The one host lifecycle (`v4kv_jax.serve.manager`): subset calls, batch buckets that compile once,
the same flag -> error mapping for the manager and the Generator, traces per Generator."""

from __future__ import annotations

import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import v4kv_jax as v4
from v4kv_jax import pools, step
from v4kv_jax.nn import Decoder, ModelConfig
from v4kv_jax.serve import Generator, clock
from v4kv_jax.serve.manager import (
    CacheManager,
    PoolExhaustedError,
    SlotFlaggedError,
    SlotTable,
    batch_buckets,
    bucket_size,
)
from v4kv_jax.testing import synthetic

from conftest import CHUNK, GEOMETRY, MODEL, positions

REQUESTS = ["a", "b", "c", "d"]
DATA = synthetic.SyntheticBatch.draw(MODEL, 4, 120, seed=11)
PROMPTS = [40, 27, 33, 9]  # tokens prefilled into request i from DATA row i
# Four slots, so that the bucket of 4 rows serves batches of 3 and 4.
FOUR = v4.CacheConfig(num_pages=24, max_slots=4, max_pages_per_seq=6)

# Flags: one SWA layer compiles in about a second; two pages for three slots run out.
SWA = v4.tiny(compress_ratios=(0,))
TIGHT = v4.CacheConfig(num_pages=2, max_slots=3, max_pages_per_seq=1)


def _programs() -> int:
    """Programs compiled so far by the core's jitted prefill and prefill-with-attention."""
    return step._append_all_jit.traces + step._append_attend_all_jit.traces


def _prefilled(geometry=GEOMETRY) -> CacheManager:
    """A manager holding PROMPTS[i] tokens of DATA row i in REQUESTS[i], one per slot."""
    mgr = CacheManager(MODEL, geometry, DATA.weights)
    requests = REQUESTS[:geometry.max_slots]
    for r in requests:
        mgr.admit(r)
    rows = list(range(len(requests)))
    prompts = np.asarray(PROMPTS[:len(requests)])
    for start in (0, CHUNK):
        pos = positions(np.full(len(requests), start), CHUNK)
        mgr.prefill(requests, DATA.take(pos, rows), np.clip(prompts - start, 0, CHUNK),
                    queries=DATA.stacked_queries(pos, rows))
    return mgr


def _decode(mgr: CacheManager, requests) -> np.ndarray:
    rows = [REQUESTS.index(r) for r in requests]
    pos = np.asarray([mgr.lengths()[r] for r in requests])
    return np.asarray(mgr.decode(DATA.take(pos, rows), requests=requests,
                                 queries=DATA.stacked_queries(pos, rows)))


def test_buckets():
    assert batch_buckets(1) == (1,)
    assert batch_buckets(3) == (1, 2, 3)
    assert batch_buckets(4) == (1, 2, 4)
    assert batch_buckets(6) == (1, 2, 4, 6)
    assert [bucket_size(n, 6) for n in range(1, 7)] == [1, 2, 4, 4, 6, 6]


def _ulps(x, ref) -> float:
    """max |x - ref| in units of the fp32 spacing at ref's largest magnitude."""
    if ref.size == 0:
        return 0.0
    return float(np.abs(x - ref).max() / np.spacing(np.float32(np.abs(ref).max())))


def _assert_same_state(got: CacheManager, want: CacheManager, requests, entry_ulps=0.0):
    for r in requests:
        a, b = got.read(r), want.read(r)
        assert a.length == b.length
        np.testing.assert_array_equal(a.window, b.window)
        for name in a.entries:
            assert _ulps(a.entries[name], b.entries[name]) <= entry_ulps, (r, name)
            np.testing.assert_array_equal(a.tail_kv[name], b.tail_kv[name])
            np.testing.assert_array_equal(a.tail_gate[name], b.tail_gate[name])


def test_subset_decode_equals_full_decode_for_the_named_requests():
    full, part = _prefilled(), _prefilled()  # requests a, b, c in slots 0, 1, 2
    want = _decode(full, ["a", "b", "c"])  # [L, 3, 1, H, hd]
    got = _decode(part, ["c", "a"])  # 2 rows, in the order named
    assert got.shape == (MODEL.num_layers, 2, 1, MODEL.num_heads, MODEL.head_dim)
    # Batches of 3 and 2 run different programs (buckets 3 and 2), which XLA vectorises
    # differently: the chunking bound of docs/guarantees.md holds (outputs
    # within 16 ulp, entries within 8), the rest of the state is bit for bit.
    assert _ulps(got[:, 0], want[:, 2]) <= 16
    assert _ulps(got[:, 1], want[:, 0]) <= 16
    assert part.lengths() == {"a": 41, "b": 27, "c": 34}
    _assert_same_state(part, full, ["a", "c"], entry_ulps=8)
    _assert_same_state(part, _prefilled(), ["b"])  # not named: untouched
    got = _decode(part, ["b"])
    assert _ulps(got[:, 0], want[:, 1]) <= 16
    assert part.lengths() == full.lengths()


def test_padding_rows_change_nothing():
    full, part = _prefilled(FOUR), _prefilled(FOUR)
    want = _decode(full, REQUESTS)
    got = _decode(part, ["d", "b", "c"])  # the bucket of 4: one padding row (slot id -1)
    for i, r in enumerate(["d", "b", "c"]):  # the same program: bit for bit
        np.testing.assert_array_equal(got[:, i], want[:, REQUESTS.index(r)])
    _assert_same_state(part, full, ["b", "c", "d"])
    assert part.lengths() == {"a": 40, "b": 28, "c": 34, "d": 10}


def test_decode_takes_one_row_per_named_request():
    mgr = _prefilled()
    with pytest.raises(ValueError, match=r"vectors.window: expected shape \(5, 2, 1, 32\); "
                                         r"got shape \(5, 3, 1, 32\)"):
        # the old convention: a row for every slot
        mgr.decode(DATA.take(np.zeros(3, int), [0, 1, 2]), requests=["a", "b"])
    with pytest.raises(ValueError, match=r"queries.q: expected shape \(5, 1, 1, 4, 32\)"):
        mgr.decode(DATA.take(np.zeros(1, int), [0]), requests=["a"],
                   queries=DATA.stacked_queries(np.zeros(2, int), [0, 1]))
    with pytest.raises(KeyError, match="request 'e' is not admitted"):
        mgr.decode(DATA.take(np.zeros(1, int), [0]), requests=["e"])
    with pytest.raises(ValueError, match=r"requests: expected at least one admitted request"):
        mgr.decode(DATA.take(np.zeros(1, int), [0]), requests=[])
    assert mgr.lengths() == {"a": 40, "b": 27, "c": 33}


def test_prefill_batches_of_a_bucket_compile_once():
    mgr = _prefilled(FOUR)  # 4 rows: the bucket of 4, T = CHUNK, with attention
    before = _programs()
    for requests in (["d", "a", "c"], ["b", "c", "a", "d"], ["a", "b", "c"]):
        rows = [REQUESTS.index(r) for r in requests]
        start = np.asarray([mgr.lengths()[r] for r in requests])
        pos = positions(start, CHUNK)
        out = mgr.prefill(requests, DATA.take(pos, rows), np.full(len(requests), 5),
                          queries=DATA.stacked_queries(pos, rows))
        assert out.shape[1] == len(requests)
    assert _programs() == before  # batches of 3 and 4 ran the program of the bucket of 4
    for requests in (["a", "b", "c"], ["b", "d", "c", "a"]):  # and so did decodes of 3 and 4
        _decode(mgr, requests)
    assert _programs() - before <= 1
    assert mgr.lengths() == {"a": 57, "b": 39, "c": 50, "d": 20}


def test_flags_map_to_the_same_errors_for_manager_and_generator():
    tokens = [[1] * 10] * 3
    gen = Generator(Decoder(ModelConfig(SWA, vocab_size=48, mlp_hidden=0), rngs=nnx.Rngs(0)),
                    TIGHT, max_prompt_len=16, max_new_tokens=2, prefill_chunk=16)
    with pytest.raises(PoolExhaustedError) as gen_err:
        gen.generate(tokens)  # prompts 0 and 1 take the two pages; prompt 2 gets none
    assert gen_err.value.flags == {2: "OUT_OF_PAGES"}
    assert [(s.request, s.pages_needed) for s in gen_err.value.shortfalls] == [(2, 1)]

    # The manager's requests 0, 1, 2 in the same state: 2 flagged by a traced call outside the
    # manager (an eager `step.prefill` would raise instead of flagging).
    data = synthetic.SyntheticBatch.draw(SWA, 3, 16, seed=0)
    mgr = CacheManager(SWA, TIGHT, data.weights)
    for r in range(3):
        mgr.admit(r)
    mgr.prefill([0, 1], data.take(positions([0, 0], 16), [0, 1]), [10, 10])
    mgr.cache = jax.jit(step.prefill)(mgr.cache, data.take(positions([0], 16), [2]),
                                      data.weights, jnp.asarray([mgr.slots[2]]),
                                      jnp.asarray([10]))
    before = jax.tree.map(np.asarray, mgr.cache)
    with pytest.raises(PoolExhaustedError) as mgr_err:
        mgr.prefill([2], data.take(positions([0], 16), [2]), [10])
    assert str(mgr_err.value).replace("request", "prompt") == str(gen_err.value)
    assert str(gen_err.value).startswith(
        "prompts [2] could not append (['OUT_OF_PAGES']): Classical pool exhausted: prompt 2 "
        "needs 1 page(s) (1 in all); 0 page(s) free.")
    # Nothing was appended; the reported flag was cleared, so the manager's own checks
    # guard the next call (the pool is still full: all or nothing, before the call).
    after = jax.tree.map(np.asarray, mgr.cache)
    np.testing.assert_array_equal(pools.lengths(before), pools.lengths(after))
    np.testing.assert_array_equal(before.pages.page_table, after.pages.page_table)
    assert mgr.inspect()[2].status == "ACTIVE"
    with pytest.raises(PoolExhaustedError, match=r"^Classical pool exhausted: request 2 needs "
                                                 r"1 page\(s\).*Nothing was appended"):
        mgr.prefill([2], data.take(positions([0], 16), [2]), [10])
    mgr.release(0)
    mgr.prefill([2], data.take(positions([0], 16), [2]), [10])
    assert mgr.lengths() == {1: 10, 2: 10}

    # The generator released its prompts before the next batch; it runs the same program.
    assert gen.generate([[3, 4, 5]]).tokens.shape == (1, 2)
    assert gen.traces == 1


def test_other_flags_name_the_request_and_the_cause():
    table = SlotTable(3)
    cache = v4.init_cache(SWA, TIGHT)
    for r in ("x", "y", "z"):
        cache, _ = table.admit(cache, r)
    assert table.flag_error(cache, ["x", "y"], {"x": 1, "y": 1}) is None
    status = pools.status(cache).at[0].set(v4.SlotStatus.OVER_CAPACITY)
    cache = pools.with_slots(cache, status=status.at[1].set(v4.SlotStatus.REJECTED))
    err = table.flag_error(cache, ["x", "y", "z"], {"x": 1, "y": 1, "z": 1}, noun="prompt")
    assert isinstance(err, SlotFlaggedError)
    assert err.flags == {"x": "OVER_CAPACITY", "y": "REJECTED"}
    assert str(err).startswith("prompts ['x', 'y'] could not append (['OVER_CAPACITY', "
                               "'REJECTED']): prompt 'x' would pass the maximum sequence length")
    assert "prompt 'y' was in a row that broke a rule" in str(err)


def test_slot_table_admission_and_release():
    table = SlotTable(2)
    cache = v4.init_cache(SWA, v4.CacheConfig(num_pages=2, max_slots=2, max_pages_per_seq=1))
    cache, s = table.admit(cache, "p")
    cache, t = table.admit(cache, "q")
    assert (s, t) == (0, 1) and table.slots == {"p": 0, "q": 1}
    with pytest.raises(RuntimeError, match=r"no free slot for request 'r': all max_slots=2"):
        table.admit(cache, "r")
    with pytest.raises(TypeError, match=r"request: expected a hashable request id"):
        table.admit(cache, ["p"])
    cache = table.release(cache, "p")
    cache, s = table.admit(cache, "r")
    assert s == 0 and list(table) == ["q", "r"]
    with pytest.raises(TypeError, match="requests: expected a sequence of admitted requests"):
        table.requests("qr")
    with pytest.raises(ValueError, match="requests: expected distinct requests"):
        table.requests(["q", "q"])
    cache = table.release_all(cache)
    assert len(table) == 0
    assert (np.asarray(pools.status(cache)) == v4.SlotStatus.FREE).all()


def test_traces_are_counted_per_generator():
    decoder = Decoder(ModelConfig(SWA, vocab_size=48, mlp_hidden=0), rngs=nnx.Rngs(1))
    geometry = v4.CacheConfig(num_pages=6, max_slots=2, max_pages_per_seq=1)
    first = Generator(decoder, geometry, max_prompt_len=8, max_new_tokens=3, prefill_chunk=8)
    second = Generator(decoder, geometry, max_prompt_len=8, max_new_tokens=3, prefill_chunk=8)
    gc.collect()  # generators of earlier tests that are gone no longer count
    total = Generator.compiled_programs()
    for prompts in ([[1, 2]], [[5] * 8, [7]], [[3]]):
        first.generate(prompts, temperature=0.5)
    assert (first.traces, second.traces) == (1, 0)
    assert Generator.compiled_programs() == total + 1
    second.generate([[1, 2]])
    assert (first.traces, second.traces) == (1, 1)
    assert Generator.compiled_programs() == total + 2
    del first
    gc.collect()  # the sum covers the generators alive now
    assert Generator.compiled_programs() == total + 1


def test_generator_warmup_compiles_what_generate_runs_and_changes_nothing():
    decoder = Decoder(ModelConfig(SWA, vocab_size=48, mlp_hidden=0), rngs=nnx.Rngs(2))
    geometry = v4.CacheConfig(num_pages=6, max_slots=2, max_pages_per_seq=1)
    warm, cold = (Generator(decoder, geometry, max_prompt_len=8, max_new_tokens=3,
                            prefill_chunk=8) for _ in range(2))
    before = jax.tree.map(np.asarray, warm.cache)
    assert warm.warmup() > 0 and warm.traces == 1
    jax.tree.map(np.testing.assert_array_equal, before, jax.tree.map(np.asarray, warm.cache))
    compiled = clock.compile_seconds()
    warm.warmup()  # the second call compiles nothing
    calls = [([[1, 2], [5] * 8], {"temperature": 0.5}), ([[3]], {"seed": 4, "eos_id": 7})]
    outs = [warm.generate(prompts, **options) for prompts, options in calls]
    assert warm.traces == 1 and clock.compile_seconds() == compiled
    for out, (prompts, options) in zip(outs, calls, strict=True):
        np.testing.assert_array_equal(out.tokens, cold.generate(prompts, **options).tokens)
