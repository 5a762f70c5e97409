"""No request reads or writes another's data: poison tests.

Every storage row that no live request owns (free pages, rows past a request's entries in a
partly filled page, FREE slots, window rows before a slot has W tokens, tail rows outside the
open block) is filled with NaN, then with 1e30, after EVERY operation; outputs and the owned
state of every live request must be bit-identical to a run without poison. A read masked by
multiplying instead of `where` (0 * NaN = NaN), or a read of another request's rows, shows up.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import v4kv_jax as v4
from v4kv_jax import pools, step
from v4kv_jax.nn import Decoder, ModelConfig
from v4kv_jax.serve import Generator, forward
from v4kv_jax.serve.manager import CacheManager
from v4kv_jax.testing import synthetic

from conftest import GEOMETRY, MODEL, OPTIONS, positions

POISONS = {"none": None, "nan": float("nan"), "huge": 1e30}


def _poisoner(value):
    # `poison_unowned` keeps the cache's placement, so the clean run and the poisoned run
    # call one compiled program each and differ by the poison alone.
    if value is None:
        return lambda cache: cache
    return lambda cache: synthetic.poison_unowned(cache, value)


def owned_state(cache) -> dict[str, np.ndarray]:
    """Every storage array with the rows no live request owns zeroed, plus the bookkeeping."""
    masks = synthetic.owned_masks(cache)
    out = {
        "window": np.where(masks["window"], np.asarray(pools.window_ring(cache).records()), 0),
        "lengths": np.asarray(cache.state.lengths),
        "status": np.asarray(cache.state.status),
        "page_table": np.asarray(cache.pages.page_table),
        "refcount": np.asarray(cache.pages.refcount),
    }
    for spec in cache.specs:
        tail = pools.tail(cache, spec)  # a ring (kv, gate) or an online tail
        for field in dataclasses.fields(tail):
            out[f"{spec.name}.{field.name}"] = np.where(
                masks[f"{spec.name}_tail"], np.asarray(getattr(tail, field.name).records()), 0)
        out[f"{spec.name}.entries"] = np.where(masks[f"{spec.name}_entries"],
                                               np.asarray(pools.entries(cache, spec).records()),
                                               0)
    return out


def core_scenario(poison, options=OPTIONS, rounds=(4, 3, 2), model=MODEL, geometry=GEOMETRY):
    """Two requests prefill ragged chunks, one is released and its slot and pages go to a
    third request, then all decode. Returns every call's outputs and the final owned state."""
    data = synthetic.SyntheticBatch.draw(model, 3, 300, seed=1)
    done = np.zeros(3, np.int64)
    outs = []
    cache = poison(v4.init_cache(model, geometry))

    def call(cache, rows, slots, counts, chunk):
        pos = positions(done[rows], chunk)
        cache, o = step.append_and_attend(cache, data.take(pos, rows),
                                          data.stacked_queries(pos, rows), data.weights, slots,
                                          counts, options=options)
        done[rows] += counts
        outs.append(np.asarray(o))
        return poison(cache)

    for s in (0, 1):
        cache = poison(v4.reset_slot(cache, s))
    for _ in range(rounds[0]):
        cache = call(cache, np.array([0, 1]), np.array([0, 1]), np.array([32, 21]), 32)
    cache = poison(v4.release_slot(cache, 0))
    cache = poison(v4.reset_slot(cache, 0))
    for _ in range(rounds[1]):
        cache = call(cache, np.array([2, 1]), np.array([0, 1]), np.array([29, 32]), 32)
    for _ in range(rounds[2]):
        cache = call(cache, np.array([2, 1]), np.array([0, 1]), np.array([1, 1]), 1)
    return outs, owned_state(cache)


def assert_runs_identical(clean, poisoned):
    outs_a, state_a = clean
    outs_b, state_b = poisoned
    assert len(outs_a) == len(outs_b)
    for i, (a, b) in enumerate(zip(outs_a, outs_b, strict=True)):
        assert not np.isnan(b).any(), f"call {i}: NaN reached an output"
        np.testing.assert_array_equal(a, b, err_msg=f"call {i}")
    for name in state_a:
        np.testing.assert_array_equal(state_a[name], state_b[name], err_msg=name)


@pytest.fixture(scope="module")
def clean_reference_run():
    return core_scenario(_poisoner(None))


@pytest.mark.parametrize("poison", ["nan", "huge"])
def test_reference_prefill_and_decode_never_read_unowned_rows(clean_reference_run, poison):
    assert_runs_identical(clean_reference_run, core_scenario(_poisoner(POISONS[poison])))


def test_poison_reaches_every_unowned_row():
    cache = v4.reset_slot(v4.init_cache(MODEL, GEOMETRY), 0)
    data = synthetic.SyntheticBatch.draw(MODEL, 1, 40, seed=0)
    cache = v4.prefill(cache, data.span(0, 32), data.weights, [0], [30])
    cache = synthetic.poison_unowned(cache)
    # 30 tokens: window rows 0..29 of 16 are all owned; 7 C4 entries, 1 C128 entry (m' = 16).
    assert not np.isnan(np.asarray(pools.window_ring(cache)[:, 0].records())).any()
    assert np.isnan(np.asarray(pools.window_ring(cache)[:, 1:].records())).all()
    page = int(cache.pages.page_table[0, 0])
    c4 = np.asarray(pools.csa_entries(cache).c4[:, page].records())
    assert not np.isnan(c4[:, :7]).any() and np.isnan(c4[:, 7:]).all()
    c128 = np.asarray(pools.hca_entries(cache).c128[:, page].records())
    assert not np.isnan(c128[:, :1]).any() and np.isnan(c128[:, 1:]).all()
    others = np.delete(np.arange(GEOMETRY.num_pages), page)
    assert np.isnan(np.asarray(pools.csa_entries(cache).c4[:, others].records())).all()
    # HCA tail ring (16 rows): positions 16..29 are the open block, rows 30 % 16.. are stale.
    hca = np.asarray(cache.state.hca.kv[:, 0].records())
    open_rows = np.arange(16, 30) % 16
    assert not np.isnan(hca[:, open_rows]).any()
    assert np.isnan(np.delete(hca, open_rows, axis=1)).all()


@pytest.mark.parametrize("implementation", ["pallas_tpu", "pallas_gpu"])
def test_kernels_in_interpret_mode_never_read_unowned_rows(implementation):
    options = v4.Options(implementation=implementation, interpret=True, query_tile=16)
    rounds = (1, 2, 1)
    clean = core_scenario(_poisoner(None), options, rounds)
    assert_runs_identical(clean, core_scenario(_poisoner(POISONS["nan"]), options, rounds))


def test_reference_and_kernels_agree_on_the_poisoned_scenario():
    """The kernel scenario above is the reference's too (so it exercises real values)."""
    rounds = (1, 2, 1)
    ref_outs, _ = core_scenario(_poisoner(None), OPTIONS, rounds)
    options = v4.Options(implementation="pallas_gpu", interpret=True, query_tile=16)
    gpu_outs, _ = core_scenario(_poisoner(POISONS["nan"]), options, rounds)
    for a, b in zip(ref_outs, gpu_outs, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


# --- nn.forward, the Generator and the manager --------------------------------------------------

VOCAB = 48


@pytest.fixture(scope="module")
def decoder():
    return Decoder(ModelConfig(MODEL, vocab_size=VOCAB, mlp_hidden=32), rngs=nnx.Rngs(7),
                   bias_scale=0.3)


def nn_scenario(decoder, poison):
    graphdef, params = nnx.split(decoder)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, VOCAB, (3, 200))
    done = np.zeros(3, np.int64)
    outs = []

    def call(cache, rows, slots, counts, chunk):
        t = np.stack([np.pad(tokens[r, done[r]:done[r] + chunk],
                             (0, max(0, done[r] + chunk - tokens.shape[1]))) for r in rows])
        cache, logits = forward(graphdef, params, cache, jnp.asarray(t, jnp.int32),
                                jnp.asarray(slots), jnp.asarray(counts))
        done[rows] += counts
        outs.append(np.asarray(logits))
        return poison(cache)

    cache = poison(v4.init_cache(MODEL, GEOMETRY))
    for s in (0, 1):
        cache = poison(v4.reset_slot(cache, s))
    for _ in range(3):
        cache = call(cache, np.array([0, 1]), np.array([0, 1]), np.array([32, 19]), 32)
    cache = poison(v4.reset_slot(v4.release_slot(cache, 0), 0))
    cache = call(cache, np.array([2, 1]), np.array([0, 1]), np.array([32, 32]), 32)
    for _ in range(2):
        cache = call(cache, np.array([2, 1]), np.array([0, 1]), np.array([1, 1]), 1)
    return outs, owned_state(cache)


@pytest.mark.parametrize("poison", ["nan", "huge"])
def test_nn_forward_never_reads_unowned_rows(decoder, poison):
    clean = nn_scenario(decoder, _poisoner(None))
    assert_runs_identical(clean, nn_scenario(decoder, _poisoner(POISONS[poison])))


def test_generator_output_does_not_depend_on_what_its_cache_held(decoder):
    prompts = [[5, 6, 7] * 30, [1, 2], [9] * 40]
    used = Generator(decoder, GEOMETRY, max_prompt_len=100, max_new_tokens=6, prefill_chunk=32)
    want = used.generate(prompts[1:])  # its cache fresh: it held nothing before
    used.generate(prompts)  # fills pages and every slot's window and tails
    for value in (float("nan"), 1e30):
        # Every row the last call wrote is stale for the next call (it starts every slot
        # afresh): poison all of them, keeping the page bookkeeping the next call releases.
        status = used.cache.state.status
        stale = used.cache.replace(state=used.cache.state.replace(status=jnp.zeros_like(status)))
        poisoned = synthetic.poison_unowned(stale, value)
        assert np.isnan(np.asarray(pools.csa_entries(poisoned).c4.records())).all() == np.isnan(
            value)
        used.cache = poisoned.replace(state=poisoned.state.replace(status=status))
        got = used.generate(prompts[1:])
        np.testing.assert_array_equal(got.tokens, want.tokens)


def test_manager_calls_never_read_unowned_rows():
    data = synthetic.SyntheticBatch.draw(MODEL, 3, 200, seed=4)

    def run(poison):
        mgr = CacheManager(MODEL, GEOMETRY, data.weights)
        outs, done = [], np.zeros(3, np.int64)

        def prefill(requests, rows, counts):
            pos = positions(done[rows], 32)
            outs.append(np.asarray(mgr.prefill(requests, data.take(pos, rows), counts,
                                               queries=data.stacked_queries(pos, rows))))
            done[rows] += counts
            mgr.cache = poison(mgr.cache)

        for r in ("a", "b"):
            mgr.admit(r)
        prefill(["a", "b"], [0, 1], [32, 20])
        prefill(["a", "b"], [0, 1], [32, 32])
        mgr.release("a")
        mgr.cache = poison(mgr.cache)
        mgr.admit("c")
        prefill(["c", "b"], [2, 1], [30, 3])
        rows = np.asarray([2, 1])  # one row per named request, in their order
        pos = done[rows]
        outs.append(np.asarray(mgr.decode(data.take(pos, rows), requests=["c", "b"],
                                          queries=data.stacked_queries(pos, rows))))
        return outs, owned_state(mgr.cache)

    clean = run(_poisoner(None))
    assert_runs_identical(clean, run(_poisoner(POISONS["nan"])))
