"""DeepSeek-V4.1's decode read (`ops.sparse_decode41`): the TPU kernel in interpret mode against
the jnp reference (`ops.attention41.sparse_decode41`), at tiny41's and V4.1-Flash's widths, in
float32 and the release records (nvfp4 entries, mxfp8 window); and the whole V4.1 decode step
with the kernel against the step's own reference path.

Every stored row no query may read is NaN (unpicked entries, pages of no row, ring rows of
negative positions, other slots' and layers' rings); picks that are not valid point at NaN
rows, at absent pages, or are -1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import v41_cases
from kernel_cases import INTERPRET, REFERENCE, assert_close, kernel_options

import v4kv_jax as v4
from pallas_kernels.sparse_attention import BlockSizes
from v4kv_jax import ops, plan, pools, step41
from v4kv_jax.pools import cache41
from v4kv_jax.testing import v41_oracle

OP = "sparse_decode41"
LAYERS, LAYER, SLOTS, PAGES, MAX_PAGES, PER_PAGE = 3, 1, 4, 9, 3, 64


def _stored(codec, values, poisoned):
    """Rows as stored: `values` [..., hd] encoded, NaN rows where `poisoned`."""
    rows = codec.encode(jnp.asarray(values))
    return jnp.where(jnp.asarray(poisoned)[..., None], codec.filled(np.nan), rows)


def _case(config, formats: str, topk: int, seed: int = 0):
    """(geometry, the op's arguments): rows of slots 2, 0, 3, 1 at positions 0, 5, W + 3,
    2 W + 100; about a third of the picks invalid."""
    rng = np.random.default_rng(seed)
    geometry = cache41.cache_config41(formats, num_pages=PAGES, max_slots=SLOTS,
                                      max_pages_per_seq=MAX_PAGES)
    hd, H, W = config.head_dim, config.num_heads, config.window
    slot_ids = np.array([2, 0, 3, 1], np.int32)
    q_pos = np.array([0, 5, W + 3, 2 * W + 100], np.int32)
    B = len(slot_ids)
    # The window: ring row r of the read (layer, slot) holds position q_pos - ((q_pos - r) % W).
    ring_pos = q_pos[:, None] - (q_pos[:, None] - np.arange(W)[None, :]) % W
    ring_nan = np.ones((LAYERS, SLOTS, W), bool)
    ring_nan[LAYER, slot_ids] = ring_pos < 0
    wcodec = cache41.codec41(config, geometry, "window")
    wrows = _stored(wcodec, rng.standard_normal((LAYERS, SLOTS, W, hd)).astype(np.float32) * 2,
                    ring_nan)
    window = wcodec.lanes(W).pack(wrows, pad=_pad(wcodec))
    # The entries: pages [8, 2, 5], [1, 4, -1], [0, -1, -1], [3, 7, 6]; page 5 absent.
    page_rows = np.array([[8, 2, 5], [1, 4, -1], [0, -1, -1], [3, 7, 6]], np.int32)
    ids = np.zeros((B, topk), np.int32)
    valid = np.zeros((B, topk), bool)
    picked = np.zeros((PAGES, PER_PAGE), bool)
    for b in range(B):
        pages = [c for c in range(MAX_PAGES) if page_rows[b, c] >= 0]
        pool = np.concatenate([c * PER_PAGE + np.arange(PER_PAGE) for c in pages])
        chosen = np.sort(rng.choice(pool, topk, replace=False))
        ok = rng.random(topk) < 0.65
        ok[0] = b != 0  # row 0 (position 0) reads its window row alone
        for i, c in zip(chosen[ok], chosen[ok] // PER_PAGE, strict=True):
            picked[page_rows[b, c], i % PER_PAGE] = True
        # Invalid picks: an entry nobody picks (NaN), -1, or one past the row's pages.
        bad = np.where(rng.random(topk) < 0.5, -1, MAX_PAGES * PER_PAGE + 3)
        ids[b] = np.where(ok, chosen, np.where(rng.random(topk) < 0.5, chosen, bad))
        valid[b] = ok
    ecodec = cache41.codec41(config, geometry, "entries")
    erows = _stored(ecodec, rng.standard_normal((PAGES, PER_PAGE, hd)).astype(np.float32),
                    ~picked)
    entries = ecodec.lanes(PER_PAGE).pack(erows, pad=_pad(ecodec))
    args = dict(window=window, layer=LAYER, slot_ids=jnp.asarray(slot_ids),
                q_pos=jnp.asarray(q_pos), entries=entries, ids=jnp.asarray(ids),
                valid=jnp.asarray(valid), page_rows=jnp.asarray(page_rows),
                q=jnp.asarray(rng.standard_normal((B, H, hd)).astype(np.float32)),
                sink=jnp.asarray(rng.standard_normal(H).astype(np.float32)))
    return geometry, args


def _pad(codec):
    return np.float32(np.nan) if codec.dtype == jnp.float32 else np.uint32(0xFFFFFFFF)


def _read(config, geometry, args, options):
    return np.asarray(jax.jit(lambda a: ops.sparse_decode41(config, geometry, options, **a))(
        args))


TINY, FLASH = v4.tiny41(), v4.flash41()


@pytest.mark.parametrize("formats", ["float32", "release"])
@pytest.mark.parametrize("config,topk", [(TINY, 24), (FLASH, 20)], ids=["tiny41", "flash41"])
def test_kernel_equals_the_reference(config, topk, formats):
    geometry, args = _case(config, formats, topk)
    want = _read(config, geometry, args, REFERENCE)
    assert np.isfinite(want).all()
    # 8 picks a block: the picks span several double-buffered blocks.
    got = _read(config, geometry, args,
                kernel_options("pallas_tpu", OP, BlockSizes(picks_per_block=8)))
    assert np.isfinite(got).all()
    assert_close(got, want, "float32")


def test_gpu_kernel_reads_float_rows():
    """The GPU kernel (float rows only: `supported`) in interpret mode, tiny41's widths."""
    geometry, args = _case(TINY, "float32", 24, seed=1)
    want = _read(TINY, geometry, args, REFERENCE)
    got = _read(TINY, geometry, args,
                kernel_options("pallas_gpu", OP, BlockSizes(picks_per_block=8, num_splits=2)))
    assert_close(got, want, "float32")


def test_the_reference_is_the_window_and_the_picks_by_hand():
    """The read of one row by hand: its window rows of positions >= 0 and its valid picks,
    decoded, in one softmax with the sink in the denominator."""
    config = TINY
    geometry, args = _case(config, "release", 24, seed=3)
    got = _read(config, geometry, args, REFERENCE)
    W, hd = config.window, config.head_dim
    wcodec = cache41.codec41(config, geometry, "window")
    ecodec = cache41.codec41(config, geometry, "entries")
    rings = np.asarray(wcodec.decode(args["window"].map.unpack(args["window"].planes)))
    pages = np.asarray(ecodec.decode(args["entries"].map.unpack(args["entries"].planes)))
    for b in range(len(args["slot_ids"])):
        t, slot = int(args["q_pos"][b]), int(args["slot_ids"][b])
        keys = [rings[LAYER, slot, p % W] for p in range(max(0, t - W + 1), t + 1)]
        for i, ok in zip(np.asarray(args["ids"][b]), np.asarray(args["valid"][b]), strict=True):
            if ok:
                keys.append(pages[int(args["page_rows"][b, i // PER_PAGE]), i % PER_PAGE])
        keys = np.stack(keys).astype(np.float64)
        logits = np.asarray(args["q"][b], np.float64) @ keys.T * hd ** -0.5
        sink = np.asarray(args["sink"], np.float64)
        top = np.maximum(logits.max(-1), sink)
        p = np.exp(logits - top[:, None])
        want = p @ keys / (p.sum(-1) + np.exp(sink - top))[:, None]
        np.testing.assert_allclose(got[b], want, rtol=1e-5, atol=1e-5)


def test_auto_runs_the_kernel_on_tpu_and_the_reference_elsewhere():
    geometry = cache41.cache_config41("release", num_pages=8, max_slots=2, max_pages_per_seq=2)
    auto = v4.Options()
    assert ops.choose(OP, FLASH, geometry, auto, backend="cpu").implementation == "reference"
    assert ops.choose(OP, FLASH, geometry, auto, backend="tpu").implementation == "pallas_tpu"
    gpu = ops.choose(OP, FLASH, geometry, auto, backend="gpu")
    assert gpu.implementation == "reference"
    assert "entry_dtype='nvfp4' is decoded by the TPU kernel only" in gpu.why
    assert ops.supported(OP, "pallas_tpu", FLASH, geometry) is None


def test_the_decode_step_with_the_kernel_equals_the_reference_step(monkeypatch):
    """tiny41's every layer: a prefill of 13 tokens, then decode steps; the sparse layers'
    decode reads run the kernel (interpret mode), and every output and pick equals the
    reference step's, in the release records. Slot 0 is a padding row (NaN vectors); every
    unwritten word is NaN (all-ones words: NaN in every record)."""
    config, length, first = TINY, 15, 13
    calls = []
    kernel_fn = ops.kernel_module(OP, "pallas_tpu").sparse_decode41
    monkeypatch.setattr(ops.kernel_module(OP, "pallas_tpu"), OP,
                        lambda *a, **k: calls.append(1) or kernel_fn(*a, **k))
    stack = v41_cases.stack_of(config)
    inputs = v41_oracle.random_inputs(stack, length, seed=41)
    kernel = v4.Options(implementation="pallas_tpu", interpret=INTERPRET)
    results = []
    for options in (REFERENCE, kernel):
        geometry = cache41.cache_config41("release", num_pages=8, max_slots=2,
                                          max_pages_per_seq=2)
        cache = cache41.init_cache41(config, geometry)
        cache = cache.replace(classical=jax.tree.map(_nan, cache.classical),
                              state=cache.state.replace(
                                  window=jax.tree.map(_nan, cache.state.window),
                                  open=jax.tree.map(_nan, cache.state.open)))
        cache = pools.reset_slot(cache, 1)
        vec, w = v41_cases.chunk(config, inputs, 0, first)
        cache, _ = step41.prefill41(cache, _beside_padding(vec), w, [-1, 1], [0, first],
                                    options=options)
        steps = []
        for t in range(first, length):
            vec, w = v41_cases.chunk(config, inputs, t, t + 1)
            cache, out = step41.decode_step41(cache, _beside_padding(vec), w, options=options)
            steps.append(out)
        results.append(steps)
    assert len(calls) == sum(p.read == "sparse" for p in plan.of(config))  # traced once
    for ref, got in zip(*results, strict=True):
        for a, b in zip(ref.outputs, got.outputs, strict=True):
            assert np.isfinite(np.asarray(b)).all()
            assert_close(b, a, "float32")
        for (ia, va), (ib, vb) in zip(ref.picks, got.picks, strict=True):
            np.testing.assert_array_equal(np.asarray(va), np.asarray(vb))
            np.testing.assert_array_equal(np.where(va, ia, -1), np.where(vb, ib, -1))


def _nan(x):
    """x's words all NaN (float) or all ones (records: NaN in every format)."""
    fill = jnp.nan if jnp.issubdtype(x.dtype, jnp.floating) else 0xFFFFFFFF
    return jnp.full_like(x, fill)


def _beside_padding(vectors):
    """Row 1 the given vectors, row 0 NaN (a row that appends nothing)."""
    return [jax.tree.map(lambda x: jnp.concatenate([jnp.full_like(x, jnp.nan), x]), v)
            for v in vectors]
