"""RoPE against transformers 5.23.0 (CPU, fp32): frequency tables, rotations, cached entries.

The tables are built the way `DeepseekV4RotaryEmbedding` builds them (see `v4kv_jax.rope`);
the one step that can differ is the fp32 power, where torch runs Sleef's `powf` on its SIMD
blocks and the C library's `powf` elsewhere. The tests say which pairs must be bit for bit
equal and bound the others; the V4-Flash and V4-Pro tables must be equal everywhere.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import v4kv_jax as v4  # noqa: E402
from v4kv_jax import append, pools, rope  # noqa: E402
from v4kv_jax.config import LayerKind  # noqa: E402
from v4kv_jax.interop import convert  # noqa: E402
from v4kv_jax.interop.torch_reference import (  # noqa: E402
    TransformersAttention,
    transformers_config,
)
from v4kv_jax.nn import V4Attention  # noqa: E402
from v4kv_jax.vectors import LayerRef  # noqa: E402

THETAS = (1000.0, 2718.0, 10000.0, 54321.0, 160000.0, 500000.0, 1e6, 3.3e6, 1e7)
ROPE_DIMS = (8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
# (factor, original_max_position, beta_fast, beta_slow); the last one makes lo == hi == 0.
YARNS = ((16.0, 65536, 32.0, 1.0), (4.0, 4096, 32.0, 1.0), (40.0, 8192, 16.0, 2.0),
         (2.0, 64, 64.0, 32.0))


def reference_tables(config: v4.AttentionConfig) -> dict[LayerKind, np.ndarray]:
    """transformers' `main` / `compress` inverse frequencies for each layer kind."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as m

    longest = int(config.yarn_factor * config.yarn_original_max_position)
    rotary = m.DeepseekV4RotaryEmbedding(
        transformers_config(config, max_position_embeddings=longest))
    main, compress = rotary.main_inv_freq.numpy(), rotary.compress_inv_freq.numpy()
    return {LayerKind.SWA: main, LayerKind.CSA: compress, LayerKind.HCA: compress}


def torch_powers(theta: float, rope_dim: int) -> np.ndarray:
    """The power as transformers writes it: python float ** (f32 arange / r)."""
    return (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float) / rope_dim)).numpy()


def sleef_pairs(pairs: int) -> int:
    """How many leading pairs torch's CPU pow may compute with Sleef: it runs whole blocks of
    two SIMD registers through Sleef and the rest through the C library's `powf`."""
    block = {"AVX512": 32, "AVX2": 16, "DEFAULT": None}.get(
        torch.backends.cpu.get_cpu_capability(), 1)
    return 0 if block is None else pairs // block * block


def ulps(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Distance in ulps between positive fp32 arrays."""
    return np.abs(a.view(np.int32).astype(np.int64) - b.view(np.int32).astype(np.int64))


@pytest.mark.parametrize("preset", [v4.flash, v4.pro], ids=["flash", "pro"])
def test_v4_tables_equal_transformers_bit_for_bit(preset):
    config = preset()
    want = reference_tables(config)
    for kind in LayerKind:
        np.testing.assert_array_equal(rope.inv_frequencies(config, kind), want[kind],
                                      err_msg=kind.name)


def test_tables_over_thetas_dims_and_yarn_factors():
    """Powers equal torch's outside its Sleef blocks, within 1 ulp inside; every pair whose
    power equals torch's has a bit-for-bit equal frequency, the others are within 4e-7
    relative (a 1-ulp power moves a frequency by 1 to 4 ulp; 3.0e-7 is the most measured)."""
    pairs = off_pairs = 0
    for i, (theta, r, yarn) in enumerate(
            (t, r, y) for t in THETAS for r in ROPE_DIMS for y in YARNS):
        s, original, fast, slow = yarn
        config = v4.tiny(rope_dim=r, head_dim=2 * r, index_head_dim=r, rope_theta=theta,
                         compress_rope_theta=THETAS[(i + 3) % len(THETAS)], yarn_factor=s,
                         yarn_original_max_position=original, yarn_beta_fast=fast,
                         yarn_beta_slow=slow)
        want = reference_tables(config)
        for kind in (LayerKind.SWA, LayerKind.CSA):
            case = f"{kind.name} theta={config.rope_base(kind)} {r=} {yarn=}"
            ours = rope._theta_powers(config.rope_base(kind), r)  # the one non-IEEE step
            theirs = torch_powers(config.rope_base(kind), r)
            exact_from = sleef_pairs(r // 2)
            np.testing.assert_array_equal(ours[exact_from:], theirs[exact_from:], err_msg=case)
            assert ulps(ours, theirs).max() <= 1, case
            got = rope.inv_frequencies(config, kind)
            same = ours == theirs
            np.testing.assert_array_equal(got[same], want[kind][same], err_msg=case)
            np.testing.assert_allclose(got, want[kind], rtol=4e-7, err_msg=case)
            pairs += r // 2
            off_pairs += int(np.sum(got != want[kind]))
    # Sleef's powf is not correctly rounded, but it rarely disagrees with the C library's.
    assert off_pairs <= 0.03 * pairs, (off_pairs, pairs)


@pytest.mark.parametrize("kind", [LayerKind.SWA, LayerKind.CSA], ids=lambda k: k.name)
def test_rotations_equal_transformers_far_from_position_zero(kind):
    """Angles p * f equal transformers' bit for bit, so the rotated values agree to an ulp of
    cos and sin at any position (a 1-ulp frequency error would give p * |x| * 6e-8)."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as m

    config = v4.flash()
    positions = np.asarray([0, 1, 77, 600, 4095, 65535, 100_000, 1_000_000, 16_000_000])
    x = np.random.default_rng(0).standard_normal((1, 2, len(positions), 96)).astype(np.float32)
    rotary = m.DeepseekV4RotaryEmbedding(transformers_config(config))
    xt = torch.from_numpy(x)
    cos, sin = rotary(xt, torch.from_numpy(positions)[None],
                      layer_type="main" if kind == LayerKind.SWA else "compress")
    want = m.apply_rotary_pos_emb(xt, cos, sin).numpy()
    got = np.asarray(rope.rotate(jnp.asarray(x), jnp.asarray(positions, jnp.int32),
                                 rope.inv_frequencies(config, kind)))
    np.testing.assert_array_equal(got[..., :32], x[..., :32])
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


# --- cached entries and the window ring after 643 tokens, at the real RoPE dim 64 --------------

CACHE_MODEL = v4.tiny(rope_dim=64, head_dim=128, index_head_dim=64, index_heads=16,
                      hca_ratio=16, window=16)
CACHE_GEOMETRY = v4.CacheConfig(num_pages=6, max_slots=1, max_pages_per_seq=6)
CHUNKS = (160, 160, 160, 97, 63, 3)  # each padded to 160 tokens: one compiled shape
LENGTH = sum(CHUNKS)
# Entries are RMS-normed (|v_i| about 1, some components 4 to 5): fp32 noise of the
# projections, the pooling, the norm and one rotation. The former tables (numpy's array power:
# 2 SWA and 6 CSA frequencies 1-2 ulp off) gave 3e-5 to 6.5e-5. Compressed entries also get
# 1e-6 relative: a layer's fused [D, 1160] projection sums each product in another order than
# separate [D, 256] ones (closer to float64 at 4+ rows: 1.1e-6 against 3.8e-6 on random
# weights), which put one component of 4.46 of 20,480 at 3.3e-6 from transformers (7 ulp).
CACHE_TOL = 3e-6
ENTRY_RTOL = 1e-6


@functools.partial(jax.jit, static_argnames=("graphdef", "kind"), donate_argnames=("cache",))
def _append(graphdef, params, cache, x, n_new, kind):
    module = nnx.merge(graphdef, params)
    cache, plan = append.begin_append(cache, jnp.arange(x.shape[0]), n_new, x.shape[1])
    cache, y = module(x, cache, plan, LayerRef(jnp.int32(0), jnp.int32(0), kind))
    return append.end_append(cache, plan), y


def logical_entries(cache, name: str, count: int) -> np.ndarray:
    """Entries 0 .. count-1 of slot 0 in the first layer of their kind, via its page table."""
    spec = next(s for s in cache.specs if s.name == name)
    per_page = cache.geometry.entries_per_page(spec.ratio)
    table = np.asarray(cache.pages.page_table[0])
    pool = np.asarray(pools.entries(cache, spec)[0].records())
    i = np.arange(count)
    return pool[table[i // per_page], i % per_page]


@pytest.fixture(scope="module", params=list(LayerKind), ids=lambda k: k.name)
def both_caches(request):
    """(kind, v4kv cache, transformers' cache layer, v4kv outputs, transformers' outputs)."""
    kind = request.param
    ratio = {LayerKind.SWA: 0, LayerKind.CSA: CACHE_MODEL.csa_ratio,
             LayerKind.HCA: CACHE_MODEL.hca_ratio}[kind]
    config = dataclasses.replace(CACHE_MODEL, compress_ratios=(ratio,))
    ref = TransformersAttention(config, residual=False)
    ref.randomize(seed=int(kind) + 11)
    x = np.random.default_rng(int(kind)).standard_normal((1, LENGTH, config.hidden_size))
    x = x.astype(np.float32)
    hf_cache, want, done = ref.new_cache(), [], 0
    for n in CHUNKS:
        want.append(ref.forward(x[:, done:done + n], hf_cache, done))
        done += n

    module = V4Attention(config, kind, rngs=nnx.Rngs(0))
    convert.load_attention(module, ref.attention_params(0))
    graphdef, params = nnx.split(module)
    cache = v4.reset_slot(v4.init_cache(config, CACHE_GEOMETRY), 0)
    got, done = [], 0
    for n in CHUNKS:
        xs = np.zeros((1, CHUNKS[0], config.hidden_size), np.float32)
        xs[:, :n] = x[:, done:done + n]
        cache, y = _append(graphdef, params, cache, jnp.asarray(xs), jnp.full((1,), n, jnp.int32),
                           kind)
        got.append(np.asarray(y)[:, :n])
        done += n
    return (kind, cache, hf_cache.layers[0], np.concatenate(got, axis=1),
            np.concatenate(want, axis=1))


def test_window_ring_rows_equal_transformers(both_caches):
    _, cache, hf_layer, _, _ = both_caches
    w = CACHE_MODEL.window
    positions = np.arange(LENGTH - w + 1, LENGTH)  # transformers keeps the last W - 1 tokens
    ring = np.asarray(pools.window_ring(cache)[0, 0].records())[positions % w]
    assert positions[0] > 600
    np.testing.assert_allclose(ring, hf_layer.keys[0, 0].numpy(), rtol=0, atol=CACHE_TOL)


def test_compressed_entries_equal_transformers(both_caches):
    kind, cache, hf_layer, _, _ = both_caches
    if kind == LayerKind.SWA:
        pytest.skip("SWA layers have no compressed entries")
    names = {"csa": "compressor", "csa_index": "indexer"} if kind == LayerKind.CSA else {
        "hca": "compressor"}
    report = v4.inspect_slots(cache)[0]
    count = report.c4_entries if kind == LayerKind.CSA else report.c128_entries
    for ours, theirs in names.items():
        want = hf_layer.compressed_kv[theirs][0].numpy()
        assert count == len(want)
        assert (len(want) - 1) * CACHE_MODEL.ratio(kind) > 600  # the last entry sits past 600
        got = logical_entries(cache, ours, len(want))
        np.testing.assert_allclose(got, want, rtol=ENTRY_RTOL, atol=CACHE_TOL, err_msg=ours)


def test_layer_outputs_equal_transformers(both_caches):
    _, _, _, got, want = both_caches
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
