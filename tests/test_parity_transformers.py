"""Parity with transformers 5.23.0 `DeepseekV4Attention` (CPU, fp32), same weights and inputs.

Weights are random in transformers' layer (ape and sinks non-zero: transformers would leave
them empty), converted with `interop.attention_params`, loaded into `V4Attention`. Every
output position is compared, for one-shot prefill, prefill + single-token decodes and
irregular chunked prefill, over lengths that cross several C128 blocks.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

pytest.importorskip("torch")
pytest.importorskip("transformers")

import v4kv_jax as v4  # noqa: E402
from v4kv_jax import append, interop, rope  # noqa: E402
from v4kv_jax.config import LayerKind  # noqa: E402
from v4kv_jax.interop import convert  # noqa: E402
from v4kv_jax.interop.torch_reference import TransformersAttention  # noqa: E402
from v4kv_jax.nn import Decoder, ModelConfig, V4Attention  # noqa: E402
from v4kv_jax.vectors import LayerRef

# m' = 16 so that 150 tokens cross 9 C128 blocks; 16 indexer heads keep ReLU ties away; top-k 8
# of up to 37 C4 entries, so the indexer really selects.
BASE = v4.tiny(index_heads=16, hca_ratio=16, window=16)
GEOMETRY = v4.CacheConfig(num_pages=8, max_slots=2, max_pages_per_seq=3)
TOL = 1e-5
LENGTH = 150
CHUNK = 32  # the one padded chunk shape of the chunked runs (n_new varies)
IRREGULAR = [7, 32, 1, 19, 5, 30, 13, 2, 29, 12]  # sums to 150


def one_layer_config(kind: LayerKind, **overrides) -> v4.AttentionConfig:
    ratio = {LayerKind.SWA: 0, LayerKind.CSA: BASE.csa_ratio, LayerKind.HCA: BASE.hca_ratio}
    return dataclasses.replace(BASE, compress_ratios=(ratio[kind],), **overrides)


@functools.partial(jax.jit, static_argnames=("graphdef", "kind"), donate_argnames=("cache",))
def _layer_chunk(graphdef, params, cache, x, n_new, kind):
    module = nnx.merge(graphdef, params)
    cache, plan = append.begin_append(cache, jnp.arange(x.shape[0]), n_new, x.shape[1])
    cache, y = module(x, cache, plan, LayerRef(jnp.int32(0), jnp.int32(0), kind))
    return append.end_append(cache, plan), y


def run_v4(module: V4Attention, x: np.ndarray, chunks, pad_to: int | None = None) -> np.ndarray:
    """Feeds x [B, L, D] through the module chunk by chunk; chunks are padded to `pad_to`."""
    graphdef, params = nnx.split(module)
    cache = v4.init_cache(module.config, GEOMETRY)
    for s in range(x.shape[0]):
        cache = v4.reset_slot(cache, s)
    outs, done = [], 0
    for n in chunks:
        width = pad_to or n
        xs = np.zeros((x.shape[0], width, x.shape[2]), np.float32)
        xs[:, :n] = x[:, done:done + n]
        cache, y = _layer_chunk(graphdef, params, cache, jnp.asarray(xs),
                                jnp.full((x.shape[0],), n, jnp.int32), module.kind)
        outs.append(np.asarray(y)[:, :n])
        done += n
    return np.concatenate(outs, axis=1)


@pytest.fixture(scope="module", params=list(LayerKind), ids=lambda k: k.name)
def pair(request):
    """(kind, transformers layer, V4Attention with the same weights, inputs x [2, L, D])."""
    kind = request.param
    config = one_layer_config(kind)
    ref = TransformersAttention(config, residual=False)
    ref.randomize(seed=int(kind) + 1)
    module = V4Attention(config, kind, rngs=nnx.Rngs(0))
    convert.load_attention(module, ref.attention_params(0))
    x = np.random.default_rng(int(kind)).standard_normal((2, LENGTH, config.hidden_size))
    return kind, ref, module, x.astype(np.float32)


def test_rope_tables_match(pair):
    kind, ref, module, _ = pair
    table = "main" if kind == LayerKind.SWA else "compress"
    want = getattr(ref.rotary, f"{table}_inv_freq").numpy()
    np.testing.assert_array_equal(rope.inv_frequencies(module.config, kind), want)


def test_one_shot_prefill(pair):
    _, ref, module, x = pair
    want = ref.run_chunks(x, [LENGTH])
    got = run_v4(module, x, [LENGTH])
    np.testing.assert_allclose(got, want, rtol=0, atol=TOL)


def test_prefill_then_single_token_decodes(pair):
    _, ref, module, x = pair
    chunks = [LENGTH - 7] + [1] * 7  # the decodes complete C4 entries and a C128 block
    want = ref.run_chunks(x, chunks)
    got = run_v4(module, x, chunks)
    np.testing.assert_allclose(got, want, rtol=0, atol=TOL)


def test_irregular_chunked_prefill(pair):
    _, ref, module, x = pair
    want = ref.run_chunks(x, IRREGULAR)
    got = run_v4(module, x, IRREGULAR, pad_to=CHUNK)
    np.testing.assert_allclose(got, want, rtol=0, atol=TOL)
    one_shot = ref.run_chunks(x, [LENGTH])
    np.testing.assert_allclose(want, one_shot, rtol=0, atol=TOL)


def test_hca_at_the_real_ratio_128():
    """m' = 128, W = 128: 300 tokens cross two C128 blocks, chunked and decoded."""
    config = v4.tiny(index_heads=16, hca_ratio=128, window=128, compress_ratios=(128,))
    ref = TransformersAttention(config, residual=False)
    ref.randomize(seed=7)
    module = V4Attention(config, LayerKind.HCA, rngs=nnx.Rngs(0))
    convert.load_attention(module, ref.attention_params(0))
    x = np.random.default_rng(7).standard_normal((2, 300, config.hidden_size)).astype(np.float32)
    chunks = [100, 100, 55, 1] + [1] * 44
    want = ref.run_chunks(x, chunks)
    got = run_v4(module, x, chunks, pad_to=100)
    np.testing.assert_allclose(got, want, rtol=0, atol=TOL)


@pytest.mark.parametrize("scan_layers", [True, False], ids=["scan", "unrolled"])
def test_attention_stack_matches_transformers(scan_layers):
    """The Decoder's attention-only stack (x -> x + attn(RMSNorm(x)) per layer, scanned over
    layer groups or unrolled) against the same stack of transformers layers, chunked."""
    config = v4.tiny(index_heads=16, hca_ratio=16, window=16,
                     compress_ratios=(0, 4, 16, 4, 16, 4))
    ref = TransformersAttention(config, residual=True)
    ref.randomize(seed=3)
    model = Decoder(ModelConfig(config, vocab_size=8), rngs=nnx.Rngs(0),
                    scan_layers=scan_layers)
    for layer in range(config.num_layers):
        interop.load_attention(model, ref.attention_params(layer), layer=layer)
        interop.set_norms(model, layer=layer, attn_norm=ref.norm_weight(layer))
    x = np.random.default_rng(3).standard_normal((2, 90, config.hidden_size)).astype(np.float32)
    chunks = [40, 17, 32, 1]
    want = ref.run_chunks(x, chunks)
    graphdef, params = nnx.split(model)

    @jax.jit
    def stack(params, cache, x, n_new):
        model = nnx.merge(graphdef, params)
        cache, plan = append.begin_append(cache, jnp.arange(2), n_new, x.shape[1])
        cache, y = model.layers(x, cache, plan)
        return append.end_append(cache, plan), y

    cache = v4.init_cache(config, GEOMETRY)
    cache = v4.reset_slot(v4.reset_slot(cache, 0), 1)
    got, done = [], 0
    for n in chunks:
        xs = np.zeros((2, 40, config.hidden_size), np.float32)
        xs[:, :n] = x[:, done:done + n]
        cache, y = stack(params, cache, jnp.asarray(xs), jnp.full((2,), n, jnp.int32))
        got.append(np.asarray(y)[:, :n])
        done += n
    np.testing.assert_allclose(np.concatenate(got, axis=1), want, rtol=0, atol=TOL)
