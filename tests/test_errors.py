"""Bad input at the core, nn and manager entry points: a clear error when values are concrete,
the device-side rule (nothing written, slot flagged, nothing read) inside a caller's jit."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import v4kv_jax as v4
from v4kv_jax import append, ops, pools, programs, step
from v4kv_jax.config import LayerKind
from v4kv_jax.nn import Decoder, ModelConfig
from v4kv_jax.pools import SlotStatus
from v4kv_jax.serve import Generator, forward
from v4kv_jax.serve.manager import CacheManager
from v4kv_jax.testing import synthetic

from conftest import GEOMETRY, MODEL

VOCAB = 40
DATA = synthetic.SyntheticBatch.draw(MODEL, 3, 64, seed=5)


def _cache(slots=(0, 1)):
    cache = v4.init_cache(MODEL, GEOMETRY)
    for s in slots:
        cache = v4.reset_slot(cache, s)
    return cache


def _snapshot(cache):
    return jax.tree.map(np.asarray, cache)


def _assert_same(a, b, skip=()):
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b),
                            strict=True):
        if any(name in jax.tree_util.keystr(path) for name in skip):
            continue
        np.testing.assert_array_equal(x, y, err_msg=jax.tree_util.keystr(path))


@pytest.fixture(scope="module")
def decoder():
    return Decoder(ModelConfig(MODEL, vocab_size=VOCAB), rngs=nnx.Rngs(3), bias_scale=0.3)


# --- core: concrete arguments raise ---------------------------------------------------------


def test_core_rows_are_checked():
    cache = _cache()
    vec = DATA.take(np.zeros((2, 4), int), [0, 1])
    q = DATA.stacked_queries(np.zeros((2, 4), int), [0, 1])
    w = DATA.weights
    cases = [
        (([-1, 0], [1, 1]), r"n_new: expected 0 for a padding row \(slot id -1\); got 1 at row 0"),
        (([-2, 0], [0, 1]), r"slot_ids: expected slot ids in \[0, 3\) .*or -1 for a padding row"),
        (([0, 3], [1, 1]), r"slot_ids: expected slot ids in \[0, 3\).*got \[0, 3\]"),
        (([1, 1], [1, 1]), r"slot_ids: expected distinct slot ids .*got \[1, 1\]"),
        (([0, 1], [5, 1]), r"n_new: expected counts in \[0, 4\] .*got \[5, 1\]"),
        (([0, 1], [-1, 1]), r"n_new: expected counts in \[0, 4\].*got \[-1, 1\]"),
        (([0, 2], [1, 1]), r"slot_ids: expected ACTIVE slots .*reset_slot it first.*slot 2 FREE"),
        (([0, 1], [1]), r"n_new: expected shape \(2,\) .*got shape \(1,\)"),
    ]
    for (slots, n_new), message in cases:
        with pytest.raises(ValueError, match=message):
            step.append_and_attend(cache, vec, q, w, slots, n_new)
        with pytest.raises(ValueError, match=message):
            v4.prefill(cache, vec, w, slots, n_new)
    with pytest.raises(TypeError, match=r"n_new: expected integers; got \[1.0, 2.0\]"):
        v4.prefill(cache, vec, w, [0, 1], [1.0, 2.0])
    with pytest.raises(ValueError, match=r"slot_ids: expected distinct"):
        append.begin_append(cache, jnp.asarray([0, 0]), jnp.asarray([1, 1]), tokens=1)


def test_zero_length_chunk_and_missing_or_misshapen_inputs():
    cache = _cache()
    w = DATA.weights
    empty = DATA.take(np.zeros((1, 0), int), [0])
    with pytest.raises(ValueError, match=r"vectors: expected a chunk of at least one token "
                                         r"\(T >= 1\); got T=0"):
        v4.prefill(cache, empty, w, [0], [0])
    with pytest.raises(ValueError, match=r"tokens: expected an integer in \[1, inf\]; got 0"):
        append.begin_append(cache, jnp.asarray([0]), jnp.asarray([0]), tokens=0)
    vec = DATA.take(np.zeros((1, 2), int), [0])
    q = DATA.stacked_queries(np.zeros((1, 2), int), [0])
    with pytest.raises(ValueError, match=r"queries.index_q: expected an array of shape"):
        step.append_and_attend(cache, vec, q.replace(index_q=None), w, [0], [2])
    with pytest.raises(ValueError, match=r"queries.q: expected shape \(5, 1, 2, 4, 32\); got "
                                         r"shape \(5, 1, 2, 3, 32\)"):
        step.append_and_attend(cache, vec, q.replace(q=q.q[:, :, :, :3]), w, [0], [2])
    with pytest.raises(ValueError, match=r"queries.sink: expected shape \(5, 4\)"):
        step.append_and_attend(cache, vec, q.replace(sink=q.sink[:, :2]), w, [0], [2])
    bad_ape = w.replace(hca=w.hca.replace(ape=w.hca.ape[:, :-1]))
    with pytest.raises(ValueError, match=r"weights.hca.ape: expected shape \(2, 16, 32\); got "
                                         r"shape \(2, 15, 32\)"):
        v4.prefill(cache, vec, bad_ape, [0], [2])
    with pytest.raises(TypeError, match=r"vectors.window: expected an array of floating dtype"):
        v4.prefill(cache, vec.replace(window=vec.window.astype(jnp.int32)), w, [0], [2])


def test_layer_ref_and_decode_attention_check_their_arguments():
    cache = _cache()
    with pytest.raises(ValueError, match=r"layer: expected an integer in \[0, 4\]; got 99"):
        v4.LayerRef.of(cache, 99)
    ref = v4.LayerRef.of(cache, 2)
    queries = DATA.queries(2, np.zeros((1, 1), int), [0])
    with pytest.raises(ValueError, match=r"slot_ids: expected values <= 2; got \[3\]"):
        v4.decode_attention(cache, ref, queries, [3])
    with pytest.raises(ValueError, match=r"queries.q: expected shape \(1, 1, 4, 32\)"):
        v4.decode_attention(cache, ref, queries.replace(q=queries.q[..., :8]), [0])
    csa = v4.LayerRef.of(cache, 1)
    csa_q = DATA.queries(1, np.zeros((1, 1), int), [0]).replace(index_weights=None)
    with pytest.raises(ValueError, match=r"queries.index_weights: expected an array"):
        v4.decode_attention(cache, csa, csa_q, [0])


def test_slot_lifecycle_errors():
    cache = _cache(slots=(0,))
    with pytest.raises(ValueError, match=r"slot: expected an integer in \[0, 2\]; got 3"):
        v4.reset_slot(cache, 3)
    with pytest.raises(ValueError, match=r"slot: expected an integer in \[0, 2\]; got -1"):
        v4.release_slot(cache, -1)
    with pytest.raises(ValueError, match=r"slot: expected a FREE slot \(release_slot it first\); "
                                         r"got slot 0 ACTIVE with length 0 and 0 page\(s\)"):
        v4.reset_slot(cache, 0)
    with pytest.raises(ValueError, match=r"slots: expected slot ids in \[0, 3\)"):
        v4.clear_flags(cache, [3])


def test_an_eager_append_that_would_drop_tokens_raises_and_a_traced_one_flags():
    """Slot 0 at max_seq_len and no page free: an eager call raises before anything runs,
    naming the remedy; the same call inside a caller's jit flags the slots (nothing
    written), and the next eager call names each flag's own remedy."""
    geometry = v4.CacheConfig(num_pages=2, max_slots=2, max_pages_per_seq=2)  # 256 tokens
    cache = v4.reset_slot(v4.init_cache(MODEL, geometry), 0)
    for start in range(0, 256, 32):  # padded to two rows: one program for every call
        cache = v4.prefill(cache, DATA.take(np.full((2, 32), start) + np.arange(32), [0, 1]),
                           DATA.weights, [0, -1], [32, 0])
    cache = v4.reset_slot(cache, 1)
    assert int(pools.free_pages(cache)) == 0
    vec = DATA.take(np.full((2, 32), 256), [0, 1])
    before = _snapshot(cache)
    with pytest.raises(ValueError, match=r"n_new: expected at most 0 new tokens for slot 0 "
                                         r"\(length 256, max_seq_len=256; more would flag it "
                                         r"OVER_CAPACITY and drop them: .*v4.release_slot.*\); "
                                         r"got 1 at row 0"):
        v4.prefill(cache, vec, DATA.weights, [0, -1], [1, 0])
    with pytest.raises(ValueError, match=r"n_new: expected appends whose new pages fit the 0 "
                                         r"free page\(s\) .*OUT_OF_PAGES.*v4.release_slot.*; "
                                         r"got \[0, 1\]: slot 1 needs 1"):
        v4.prefill(cache, vec, DATA.weights, [0, 1], [0, 1])
    _assert_same(before, cache)  # nothing ran: the cache was not even donated

    cache = jax.jit(v4.prefill)(cache, vec, DATA.weights, jnp.asarray([0, 1]),
                                jnp.asarray([1, 1]))
    np.testing.assert_array_equal(cache.state.status, [SlotStatus.OVER_CAPACITY,
                                                       SlotStatus.OUT_OF_PAGES])
    _assert_same(before, cache, skip=("status",))
    with pytest.raises(ValueError, match=r"slot_ids: expected ACTIVE slots for rows that append "
                                         r"\(an append would have passed max_seq_len: end "
                                         r"the sequence with v4.release_slot \(after "
                                         r"pools.clear_flags it can append only what still "
                                         r"fits\)\); got slot 0 OVER_CAPACITY"):
        v4.prefill(cache, vec, DATA.weights, [0, -1], [1, 0])
    with pytest.raises(ValueError, match=r"slot_ids: expected ACTIVE slots for rows that append "
                                         r"\(it ran out of pages: free pages .*then "
                                         r"pools.clear_flags it\); got slot 1 OUT_OF_PAGES"):
        v4.prefill(cache, vec, DATA.weights, [1, -1], [1, 0])
    # The remedies: slot 0 released gives its pages back, slot 1 cleared appends.
    cache = v4.clear_flags(v4.release_slot(cache, 0), [1])
    cache = v4.prefill(cache, vec, DATA.weights, [1, -1], [1, 0])
    np.testing.assert_array_equal(cache.state.status, [SlotStatus.FREE, SlotStatus.ACTIVE])
    assert int(cache.state.lengths[1]) == 1 and int(pools.free_pages(cache)) == 1


def test_a_donated_cache_passed_again_is_a_named_error(decoder):
    """Every entry point that takes a cache (eager calls, programs, the nn forward, reports)
    names a cache a call donated, and says to use the returned one."""
    graphdef, params = nnx.split(decoder)
    cache = _cache(slots=(0,))
    vec = DATA.take(np.zeros((2, 32), int) + np.arange(32), [0, 1])
    new = v4.prefill(cache, vec, DATA.weights, [0, -1], [4, 0])
    calls = {
        "prefill": lambda: v4.prefill(cache, vec, DATA.weights, [0, -1], [4, 0]),
        "decode_step": lambda: v4.decode_step(cache, vec, DATA.weights),
        "release_slot": lambda: v4.release_slot(cache, 0),
        "clear_flags": lambda: v4.clear_flags(cache, [0]),
        "inspect_slots": lambda: v4.inspect_slots(cache),
        "hold_pages": lambda: v4.hold_pages(cache, [0]),
        "forward": lambda: forward(graphdef, params, cache, jnp.zeros((2, 4), jnp.int32),
                                   jnp.asarray([0, -1]), jnp.asarray([4, 0])),
        "slots.reset": lambda: programs.PROGRAMS["slots.reset"](cache, jnp.int32(1)),
    }
    message = (r"cache: expected a Cache whose arrays are alive; got one that an earlier call "
               r"donated \(array .* is deleted\): use what that call returned instead, e.g. "
               r"cache = v4.prefill\(cache, ...\)")
    for name, call in calls.items():
        try:
            call()
        except v4.DonatedCacheError as e:
            assert re.match(message, str(e)), (name, str(e))
        else:
            raise AssertionError(f"{name}: no DonatedCacheError")
    assert int(new.state.lengths[0]) == 4


def test_reset_inside_jit_gives_back_the_pages_of_an_occupied_slot():
    cache = _cache(slots=(0,))
    cache = v4.prefill(cache, DATA.take(np.zeros((1, 32), int), [0]), DATA.weights, [0], [32])
    assert int(cache.pages.num_free) == GEOMETRY.num_pages - 1
    cache = jax.jit(pools.reset_slot)(cache, jnp.int32(0))
    assert int(cache.pages.num_free) == GEOMETRY.num_pages
    assert int(cache.pages.refcount.sum()) == 0
    assert int(cache.state.lengths[0]) == 0
    # Out-of-range ids inside jit change nothing.
    before = _snapshot(cache)
    cache = jax.jit(pools.reset_slot)(cache, jnp.int32(-1))
    cache = jax.jit(pools.release_slot)(cache, jnp.int32(GEOMETRY.max_slots))
    _assert_same(before, cache)


# --- core inside jit: the device-side rules ---------------------------------------------------


@jax.jit
def _jit_forward(cache, vectors, queries, weights, slot_ids, n_new):
    cache, plan = append.begin_append(cache, slot_ids, n_new, vectors.window.shape[2])
    cache, out = step.layers_step(cache, plan, vectors, queries, DATA.weights)
    return append.end_append(cache, plan), out


def test_bad_rows_inside_jit_write_nothing_read_nothing_and_flag_their_slot():
    base = _cache(slots=(0, 1))
    pos = np.arange(8)[None] + np.zeros((3, 1), int)
    base, _ = _jit_forward(base, DATA.take(pos), DATA.stacked_queries(pos), DATA.weights,
                           jnp.asarray([0, 1, 2]), jnp.asarray([8, 8, 0]))
    pos2 = pos + 8
    vec2, q2 = DATA.take(pos2), DATA.stacked_queries(pos2)
    # Reference: only slot 0 appends, 5 tokens (same batch shape, so the same reductions).
    good, good_out = _jit_forward(jax.tree.map(jnp.copy, base), vec2, q2, DATA.weights,
                                  jnp.asarray([0, 1, 2]), jnp.asarray([5, 0, 0]))
    # (slot ids, n_new, flags set, rows that read nothing: their outputs are zeros)
    for slots, n_new, flagged, silent in [
        ([0, -1, 1], [5, 3, 0], {}, [1]),                      # -1: a padding row
        ([0, 3, 1], [5, 3, 0], {}, [1]),                       # max_slots
        ([0, 0, 1], [5, 3, 0], {0: SlotStatus.REJECTED}, [1]),  # slot 0 named twice
        ([0, 1, 2], [5, 9, 0], {1: SlotStatus.REJECTED}, [1, 2]),  # n_new > T; slot 2 FREE
        ([0, 1, 2], [5, 0, 4], {}, [2]),                       # FREE slot: appends nothing
    ]:
        cache, out = _jit_forward(jax.tree.map(jnp.copy, base), vec2, q2, DATA.weights,
                                  jnp.asarray(slots), jnp.asarray(n_new))
        expected = np.asarray(base.state.status).copy()
        for s, f in flagged.items():
            expected[s] = f
        np.testing.assert_array_equal(cache.state.status, expected, err_msg=str(slots))
        # Slot 0's row is as if alone; every other slot and page is unchanged.
        np.testing.assert_array_equal(np.asarray(out)[:, 0], np.asarray(good_out)[:, 0])
        _assert_same(_snapshot(good), cache, skip=("status",))
        for b in range(1, 3):  # rows of slot 1 (ACTIVE, n_new 0) read its 8 tokens
            assert np.asarray(out)[:, b].any() == (b not in silent), (slots, b)


def test_decoder_inside_jit_rejects_rows_with_token_ids_outside_the_vocabulary(decoder):
    graphdef, params = nnx.split(decoder)
    run = jax.jit(lambda p, c, t, s, n: nnx.merge(graphdef, p)(t, c, s, n))
    cache = _cache(slots=(0, 1))
    tokens = jnp.asarray([[1, 2, 3], [4, VOCAB, 5]])
    cache, _ = run(params, cache, tokens, jnp.asarray([0, 1]), jnp.asarray([3, 3]))
    np.testing.assert_array_equal(cache.state.lengths[:2], [3, 0])
    np.testing.assert_array_equal(cache.state.status[:2], [SlotStatus.ACTIVE,
                                                           SlotStatus.REJECTED])
    # Ids past n_new are padding and may be anything.
    cache = v4.clear_flags(cache, [1])
    cache, _ = run(params, cache, jnp.asarray([[1, 2, 3], [4, 5, -7]]), jnp.asarray([0, 1]),
                   jnp.asarray([1, 2]))
    np.testing.assert_array_equal(cache.state.lengths[:2], [4, 2])


# --- nn and Generator -------------------------------------------------------------------------


def test_nn_forward_checks_slots_lengths_and_token_ids(decoder):
    graphdef, params = nnx.split(decoder)
    cache = _cache(slots=(0, 1))
    tokens = jnp.zeros((2, 4), jnp.int32)
    cases = [
        ((tokens, [-1, 0], [1, 1]), ValueError, r"n_new: expected 0 for a padding row"),
        ((tokens, [0, 3], [1, 1]), ValueError, r"slot_ids: expected slot ids in \[0, 3\)"),
        ((tokens, [1, 1], [1, 1]), ValueError, r"slot_ids: expected distinct"),
        ((tokens, [0, 1], [5, 1]), ValueError, r"n_new: expected counts in \[0, 4\]"),
        ((tokens.at[1, 2].set(VOCAB), [0, 1], [4, 4]), ValueError,
         r"tokens: expected token ids in \[0, 40\) \(vocab_size\); got 40 at row 1, position 2"),
        ((tokens.at[0, 0].set(-3), [0, 1], [4, 4]), ValueError, r"got -3 at row 0"),
        ((tokens.astype(jnp.float32), [0, 1], [1, 1]), TypeError,
         r"tokens: expected an array of integer dtype; got dtype float32"),
        ((tokens[:, :0], [0, 1], [0, 0]), ValueError, r"tokens: expected .*T >= 1"),
        ((tokens, [0], [1]), ValueError, r"slot_ids: expected shape \(2,\)"),
    ]
    for (t, s, n), error, message in cases:
        with pytest.raises(error, match=message):
            forward(graphdef, params, cache, t, jnp.asarray(s), jnp.asarray(n))
    np.testing.assert_array_equal(cache.state.lengths, [0, 0, 0])  # nothing ran


def test_generator_checks_its_settings_and_prompts(decoder):
    gen = Generator(decoder, GEOMETRY, max_prompt_len=16, max_new_tokens=2, prefill_chunk=8)
    cases = [
        (dict(temperature=-0.5), ValueError, r"temperature: expected a number in \[0.0, inf\]; "
                                             r"got -0.5"),
        (dict(temperature=float("nan")), ValueError, r"temperature: expected a finite number"),
        (dict(temperature="hot"), TypeError, r"temperature: expected a real number; got 'hot'"),
        (dict(seed=1.5), TypeError, r"seed: expected an integer; got 1.5"),
        (dict(eos_id=VOCAB), ValueError, r"eos_id: expected a token id in \[0, 40\) "
                                         r"\(vocab_size\); got 40"),
        (dict(top_p=1.5), ValueError, r"top_p: expected a number in \(0.0, 1.0\]; got 1.5"),
        (dict(max_new_tokens=3), ValueError, r"max_new_tokens: expected an integer in \[1, 2\]; "
                                             r"got 3"),
        (dict(eos_id=1, stop_token_ids=list(range(16))), ValueError, r"stop_token_ids: expected "
                                                                    r"at most 16 ids with eos_id"),
    ]
    for kwargs, error, message in cases:
        with pytest.raises(error, match=message):
            gen.generate([[1, 2]], **kwargs)
    with pytest.raises(TypeError, match=r"prompts\[0\]: expected integers; got \[1.5, 2.0\]"):
        gen.generate([[1.5, 2.0]])
    with pytest.raises(TypeError, match=r"prompts\[1\]: expected an array of integer dtype"):
        gen.generate([[1], np.asarray([2.0])])
    with pytest.raises(ValueError, match=r"prompts\[0\]: expected token ids in \[0, 40\) "
                                         r"\(vocab_size\); got -1 at position 0"):
        gen.generate([[-1]])
    with pytest.raises(ValueError, match=r"prompts\[1\]: expected token ids in \[0, 40\) "
                                         r"\(vocab_size\); got 40 at position 2"):
        gen.generate([[1], [2, 3, 40]])
    with pytest.raises(TypeError, match=r"prompts: expected a sequence of token-id sequences"):
        gen.generate("hello")
    with pytest.raises(ValueError, match=r"max_new_tokens: expected an integer in \[1, inf\]"):
        Generator(decoder, GEOMETRY, max_prompt_len=16, max_new_tokens=0)
    with pytest.raises(TypeError, match=r"model.attn_config: expected the v4kv_jax "
                                        r"AttentionConfig"):
        Generator(object(), GEOMETRY, max_prompt_len=16, max_new_tokens=2)


def test_padding_rows_with_slot_minus_one_are_accepted_and_inert():
    cache = _cache(slots=(0,))
    pos = np.zeros((2, 4), int) + np.arange(4)
    vec, q = DATA.take(pos, [0, 1]), DATA.stacked_queries(pos, [0, 1])
    before = _snapshot(cache)
    cache, out = step.append_and_attend(cache, vec, q, DATA.weights, [0, -1], [4, 0])
    assert int(cache.state.lengths[0]) == 4
    assert not np.asarray(out)[:, 1].any()
    _assert_same(pools.window_ring(before)[:, 1:].records(),
                 np.asarray(pools.window_ring(cache)[:, 1:].records()))


def test_decode_attention_all_checks_slots_and_queries():
    cache = _cache()
    q = DATA.stacked_queries(np.zeros((1, 1), int), [0])
    with pytest.raises(ValueError, match=r"slot_ids: expected values <= 2; got \[3\]"):
        step.decode_attention_all(cache, q, [3])
    with pytest.raises(ValueError, match=r"queries.q: expected shape \(5, 1, 1, 4, 32\)"):
        step.decode_attention_all(cache, q.replace(q=q.q[..., :8]), [0])


def test_pool_accessors_and_host_objects_name_their_bad_arguments():
    cache = v4.init_cache(MODEL, GEOMETRY)
    for accessor in (pools.entries, pools.tail):
        with pytest.raises(TypeError, match=r"spec: expected a layout.CompressorSpec \(one of "
                                            r"cache.specs\); got 'csa' \(one kind's arrays: "
                                            r"pools.csa_entries"):
            accessor(cache, "csa")
    with pytest.raises(TypeError, match=r"spec: expected a layout.CompressorSpec .*; got "
                                        r"'window'"):
        pools.with_entries(cache, "window", pools.window_ring(cache))
    with pytest.raises(TypeError, match=r"geometry: expected a CacheConfig; got dict"):
        CacheManager(MODEL, {}, synthetic.SyntheticBatch.draw(MODEL, 1, 1).weights)
    with pytest.raises(TypeError, match=r"model: expected an AttentionConfig; got str"):
        CacheManager("tiny", GEOMETRY, synthetic.SyntheticBatch.draw(MODEL, 1, 1).weights)


def test_the_read_door_names_its_bad_arguments():
    cache = v4.init_cache(MODEL, GEOMETRY)
    data = synthetic.SyntheticBatch.draw(MODEL, 2, 1, seed=0)
    layer = MODEL.layers_of(LayerKind.CSA)[0]
    queries = data.queries(layer, np.zeros((2, 1), int))
    ends = jnp.ones(2, jnp.int32)
    window = ops.WindowKeys(pools.window_ring(cache)[layer, :2], ends)
    stored = ops.Stored(jnp.int32(0), pools.page_rows(cache, jnp.arange(2)),
                        pools.csa_entries(cache).c4, pools.csa_entries(cache).index_keys)

    def read(kind=LayerKind.CSA, q=queries, **kw):
        args = dict(q_pos=ends[:, None] - 1, kv_end=ends, window=window, stored=stored) | kw
        return ops.read(kind, MODEL, GEOMETRY, None, q, **args)

    assert read()[0].shape == (2, 1, MODEL.num_heads, MODEL.head_dim)
    with pytest.raises(TypeError, match=r"kind: expected a LayerKind; got 'csa'"):
        read("csa")
    with pytest.raises(ValueError, match=r"q_pos: expected shape \(2, 1\); got shape \(2,\)"):
        read(q_pos=ends)
    with pytest.raises(ValueError, match=r"window.ring: expected blocks \[2\]; got blocks "
                                         r"\[3\]"):
        read(window=window.replace(ring=pools.window_ring(cache)[layer]))
    with pytest.raises(TypeError, match=r"window.ring: expected a pools.Lanes"):
        read(window=window.replace(ring=pools.window_ring(cache)[layer, :2].records()))
    with pytest.raises(ValueError, match=r"stored.index_keys: expected the stored array of a "
                                         r"CSA layer; got None"):
        read(stored=stored.replace(index_keys=None))
    with pytest.raises(ValueError, match=r"queries.index_q / queries.index_weights: expected "
                                         r"the indexer queries of a CSA layer"):
        read(q=queries.replace(index_q=None))
