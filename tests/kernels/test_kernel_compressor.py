"""Compressor kernels against `compressor.emit_entries`: the same rows written, nothing else
touched (NaN pages stay NaN), written values within tolerance."""

from __future__ import annotations

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_cases import (
    IMPLEMENTATIONS,
    INTERPRET,
    LONG,
    PACKED_PAGE_TOKENS,
    REFERENCE,
    STORED_TOLERANCE,
    kernel_options,
    model_for,
    packed_model,
    random_cache,
)

import v4kv_jax as v4
from pallas_kernels.compressor import BlockSizes
from v4kv_jax import ops, pools
from v4kv_jax.pools import storage
from v4kv_jax.pools.layout import compressor_specs
from v4kv_jax.testing import synthetic

CASES = [(128, "float32", "prefill"), (256, "bfloat16", "prefill"), (128, "bfloat16", "decode"),
         (256, "float32", "decode")]



def _changed(after, before):
    """Where 32-bit stored words differ, bit for bit."""
    return np.asarray(after).view(np.uint32) != np.asarray(before).view(np.uint32)


def _rows(stored):
    """The rows of a stored array (`pools.Lanes`) as numpy, [..., E, sw]."""
    return np.asarray(stored.records())


@pytest.fixture(scope="module", params=CASES, ids=[f"P{p}-{d}-{m}" for p, d, m in CASES])
def case(request):
    page_tokens, dtype, mode = request.param
    model = model_for(4)
    rng = np.random.default_rng(page_tokens)
    if mode == "decode":  # start + 1 completes a C4 block; 15, 127, ... a C128 block too
        starts = np.asarray([3, 15, 127, page_tokens - 1, 2 * page_tokens - 1, LONG + 2, 0, 5])
        tokens, n_new = 1, np.ones(8, np.int64)
    else:
        starts = np.asarray([0, 1, 3, 4, 127, 128, 129, page_tokens - 1, page_tokens,
                             page_tokens + 1, LONG])
        tokens = 37
        n_new = np.concatenate([np.full(4, tokens), rng.integers(0, tokens + 1, 7)])
    cache = random_cache(model, page_tokens, dtype, starts + n_new, seed=3)
    batch = len(starts)
    order = rng.permutation(batch)  # row r appends to slot order[r]: rows != slots
    common = dict(rows=cache.pages.page_table[order], slot_ids=jnp.asarray(order, jnp.int32),
                  start=jnp.asarray(starts[order], jnp.int32),
                  n_new=jnp.asarray(n_new[order], jnp.int32))
    specs = []
    for spec in compressor_specs(model):
        n = len(model.layers_of(spec.kind))
        kv, gate = (jnp.asarray(rng.standard_normal((n, batch, tokens, spec.in_width)),
                                jnp.float32) for _ in range(2))
        inputs = dict(
            spec=spec, pool=pools.entries(cache, spec), tail=pools.tail(cache, spec),
            layers=jnp.arange(n, dtype=jnp.int32)[::-1],  # stack order != kernel order
            kv=kv, gate=gate,
            norm=jnp.asarray(1 + 0.1 * rng.standard_normal((n, spec.width)), jnp.float32))
        specs.append(inputs)

    def emit(x, **kw):
        return _rows(ops.emit_entries(
            x["spec"], model, cache.geometry, pool=jax.tree.map(jnp.copy, x["pool"]),
            page_rows=common["rows"], layers=x["layers"], tail_kv=x["tail"].kv,
            tail_gate=x["tail"].gate, slot_ids=common["slot_ids"], kv=x["kv"], gate=x["gate"],
            start=common["start"], n_new=common["n_new"], norm=x["norm"], **kw))

    want = [emit(x, options=REFERENCE) for x in specs]
    return types.SimpleNamespace(specs=specs, emit=emit, want=want, dtype=dtype, mode=mode,
                                 codecs={s.name: storage.codec(model, cache.geometry, s.name)
                                         for s in compressor_specs(model)})


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_emitted_entries_match_reference(case, implementation):
    written = 0
    for x, want in zip(case.specs, case.want, strict=True):
        name = x["spec"].name
        got = case.emit(x, options=kernel_options(
            implementation, "emit_entries", BlockSizes(blocks_per_step=4, channels_per_step=8)))
        before = _rows(x["pool"])
        rows = _changed(want, before).any(-1)
        np.testing.assert_array_equal(_changed(got, before).any(-1), rows,
                                      err_msg=f"{name}: rows written")
        np.testing.assert_array_equal(got[~rows].view(np.uint32), before[~rows].view(np.uint32),
                                      err_msg=name)
        rtol, atol = STORED_TOLERANCE[case.dtype]
        codec = case.codecs[name]
        np.testing.assert_allclose(_decoded(got[rows], codec), _decoded(want[rows], codec),
                                   rtol=rtol, atol=atol, err_msg=name)
        written += int(rows.sum())
    assert written >= (8 if case.mode == "decode" else 100)


def _decoded(pool, codec):
    return np.asarray(codec.decode(jnp.asarray(pool)))


@pytest.fixture(scope="module")
def packed_case():
    """Prefill into fp8_latent C4 / C128 pools and fp4_index indexer keys (raw HCA ring)."""
    model = packed_model(4)
    rng = np.random.default_rng(5)
    starts = np.asarray([0, 3, 127, 129, LONG])
    tokens = 37
    n_new = np.asarray([tokens, tokens, 20, 1, tokens])
    lengths = starts + n_new
    need = -(-lengths // PACKED_PAGE_TOKENS)
    geometry = v4.CacheConfig(
        num_pages=int(need.sum()) + 2, max_slots=len(lengths) + 1,
        max_pages_per_seq=int(need.max()) + 1, page_tokens=PACKED_PAGE_TOKENS,
        entry_dtype="fp8_latent", index_dtype="fp4_index", window_dtype="float32",
        tail_dtype="float32", hca_tail="ring")
    cache = synthetic.random_cache(model, geometry, lengths, seed=3, fill_unused=float("nan"))
    batch = len(starts)
    common = dict(page_rows=cache.pages.page_table[:batch], slot_ids=jnp.arange(batch),
                  start=jnp.asarray(starts, jnp.int32), n_new=jnp.asarray(n_new, jnp.int32))
    runs = []
    for spec in compressor_specs(model):
        n = len(model.layers_of(spec.kind))
        kv, gate = (jnp.asarray(rng.standard_normal((n, batch, tokens, spec.in_width)),
                                jnp.float32) for _ in range(2))
        tail = pools.tail(cache, spec)
        x = dict(pool=pools.entries(cache, spec), layers=jnp.arange(n, dtype=jnp.int32),
                 tail_kv=tail.kv, tail_gate=tail.gate, kv=kv, gate=gate,
                 norm=jnp.asarray(1 + 0.1 * rng.standard_normal((n, spec.width)), jnp.float32))
        runs.append((spec, x))

    def emit(spec, x, **kw):
        pool = jax.tree.map(jnp.copy, x["pool"])
        return _rows(ops.emit_entries(spec, model, geometry, **{**x, **common, "pool": pool},
                                      **kw))

    want = [emit(spec, x, options=REFERENCE) for spec, x in runs]
    return types.SimpleNamespace(model=model, geometry=geometry, runs=runs, emit=emit,
                                 want=want)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_emitted_entries_are_encoded_like_the_reference(packed_case, implementation):
    """The kernel encodes its fp32 entry exactly as `storage` does (tests/kernels/
    test_kernel_formats.py checks the encoder bit for bit), but its fp32 entry may differ from
    the reference's in the last bits (pooling and norm sums in another order), so a code may
    round the other way: words are mostly identical, decoded values within one fp8 / fp4 step
    of the block's scale."""
    c = packed_case
    for (spec, x), want in zip(c.runs, c.want, strict=True):
        codec = storage.codec(c.model, c.geometry, spec.name)
        got = c.emit(spec, x, options=kernel_options(implementation, "emit_entries",
                                                      BlockSizes(blocks_per_step=4)))
        before = _rows(x["pool"])
        rows = (want != before).any(-1)
        assert rows.sum() >= 10, spec.name
        np.testing.assert_array_equal((got != before).any(-1), rows, err_msg=spec.name)
        assert (got[rows] == want[rows]).mean() > 0.98, spec.name
        got_values, want_values = _decoded(got[rows], codec), _decoded(want[rows], codec)
        step = 2.0 ** -3 if spec.name != "csa_index" else 0.5  # e4m3 / e2m1 relative step
        bound = step * np.abs(want_values) + 1e-6 * np.abs(want_values).max()
        assert (np.abs(got_values - want_values) <= bound).all(), spec.name


# The online kernels' entry formats: fp8_latent for both; float32 for the GPU kernel too, whose
# float path holds rows in other lane groups (the TPU kernel differs only by its encoder).
ONLINE_CASES = [(i, "fp8_latent") for i in IMPLEMENTATIONS] + [
    (i, "float32") for i in IMPLEMENTATIONS if i == "pallas_gpu"]


@functools.cache
def _online_case(fmt: str):
    """hca_tail="online" with C128 entries in `fmt`: a chunked prefill (two chunks of 37)
    then a decode step; one row has an out-of-range slot id (reads the clipped slot, writes no
    tail), rows append nothing in some steps. The reference's pool and tails after each step."""
    model = packed_model(4)
    spec = next(s for s in compressor_specs(model) if s.name == "hca")
    m, n = spec.ratio, len(model.layers_of(spec.kind))
    starts = np.asarray([0, 3, m - 1, m + 2, 2 * m - 2])
    steps = [(37, np.asarray([37, 20, 1, 37, 0])), (37, np.asarray([37, 37, 12, 0, 5])),
             (1, np.asarray([1, 1, 1, 1, 0]))]
    lengths = starts + sum(n_new for _, n_new in steps)
    need = -(-lengths // PACKED_PAGE_TOKENS)
    geometry = v4.CacheConfig(
        num_pages=int(need.sum()) + 2, max_slots=len(lengths),
        max_pages_per_seq=int(need.max()) + 1, page_tokens=PACKED_PAGE_TOKENS,
        entry_dtype=fmt, index_dtype="fp4_index", window_dtype="float32",
        tail_dtype="float32", hca_tail="online")
    cache = synthetic.random_cache(model, geometry, lengths, seed=3, fill_unused=float("nan"))
    rng = np.random.default_rng(9)
    layers = jnp.arange(n, dtype=jnp.int32)[::-1]  # stack order != kernel order
    norm = jnp.asarray(1 + 0.1 * rng.standard_normal((n, spec.width)), jnp.float32)
    inputs = [(jnp.asarray(n_new, jnp.int32),
               *(jnp.asarray(rng.standard_normal((n, 5, tokens, spec.width)), jnp.float32)
                 for _ in range(2))) for tokens, n_new in steps]

    def run(implementation, pool, tail, steps=None):
        """(pool, tails after each step) of the first `steps` steps (all by default; pool
        None: state only)."""
        start, tails = jnp.asarray(starts, jnp.int32), []
        emit = jax.jit(functools.partial(ops.emit_entries_online, spec, model, geometry,
                                         kernel_options(implementation)))
        for n_new, kv, gate in inputs[:steps]:
            pool, tail = emit(pool=pool, page_rows=cache.pages.page_table[:5], layers=layers,
                              tail=tail, slot_ids=jnp.asarray([0, 1, 2, 3, 5]), kv=kv,
                              gate=gate, start=start, n_new=n_new, norm=norm)
            start = start + n_new
            tails.append(tail)
        return pool, tails

    before = pools.hca_entries(cache).c128
    tail = pools.hca_tail(cache)
    want_pool, want_tails = run("reference", before, tail)
    return types.SimpleNamespace(run=run, before=before, tail=tail, want_pool=_rows(want_pool),
                                 want_tails=want_tails,
                                 codec=storage.codec(model, geometry, "hca"), fmt=fmt)


def _assert_same_tail(got, want):
    """Bit for bit in interpret mode; compiled on a device its exp may differ by an ulp."""
    for field in ("max", "sum", "weighted"):
        got_x, want_x = _rows(getattr(got, field)), _rows(getattr(want, field))
        if INTERPRET:
            np.testing.assert_array_equal(got_x, want_x, err_msg=field)
        else:
            np.testing.assert_allclose(got_x, want_x, rtol=1e-5, atol=1e-6, err_msg=field)


@pytest.mark.parametrize("implementation,fmt", ONLINE_CASES,
                         ids=[f"{i}-{f}" for i, f in ONLINE_CASES])
def test_online_tail_kernel_matches_reference(implementation, fmt):
    """Tails bit for bit the reference's after every step (same fp32 expressions, products
    rounded before the sums); entries as in the emission tests (fp8: as the packed one); a
    state-only replay (pool None) of the prefill gives the same tails."""
    c = _online_case(fmt)
    got_pool, got_tails = c.run(implementation, c.before, c.tail)
    for got, want in zip(got_tails, c.want_tails, strict=True):
        _assert_same_tail(got, want)
    got_pool, want_pool, before = _rows(got_pool), c.want_pool, _rows(c.before)
    rows = _changed(want_pool, before).any(-1)
    assert rows.sum() >= 10
    np.testing.assert_array_equal(_changed(got_pool, before).any(-1), rows)
    if c.fmt == "float32":
        np.testing.assert_allclose(got_pool[rows], want_pool[rows], rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(got_pool[~rows], before[~rows])
    else:
        assert (got_pool[rows] == want_pool[rows]).mean() > 0.98
        got_values, want_values = (_decoded(x[rows], c.codec) for x in (got_pool, want_pool))
        bound = 2.0 ** -3 * np.abs(want_values) + 1e-6 * np.abs(want_values).max()
        assert (np.abs(got_values - want_values) <= bound).all()
    _, replayed = c.run(implementation, None, c.tail, steps=2)
    _assert_same_tail(replayed[-1], c.want_tails[1])
