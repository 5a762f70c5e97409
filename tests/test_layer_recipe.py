"""One V4Attention layer on its own (`V4Attention.step`): docs/model.md's recipe runs as
written, the helper computes what the Decoder's layers compute, and bad calls name the argument."""

from __future__ import annotations

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import v4kv_jax as v4
from v4kv_jax import interop
from v4kv_jax.config import LayerKind
from v4kv_jax.nn import Decoder, ModelConfig, V4Attention
from v4kv_jax.ops.compressor import rms_norm
from v4kv_jax.serve import forward

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = v4.tiny(index_heads=16)  # SWA, then (CSA, HCA) x 2; enough indexer heads for no ties
GEOMETRY = v4.CacheConfig(num_pages=24, max_slots=2, max_pages_per_seq=2)
# (T, n_new per row): prefill into empty and filled slots, then decode steps; two shapes.
CHUNKS = [(40, [40, 25]), (40, [12, 40]), (1, [1, 1]), (1, [0, 1])]


def _recipe_blocks() -> list[str]:
    page = open(os.path.join(ROOT, "docs/model.md")).read()
    section = page.split("## One layer on its own\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)\n```", section, re.S)


def test_the_model_page_recipe_runs_as_written():
    blocks = _recipe_blocks()
    assert len(blocks) == 2
    scope: dict = {}
    exec(blocks[0], scope)  # noqa: S102 - the page's own code
    config, D = scope["config"], scope["config"].hidden_size
    assert scope["y"].shape == (1, 200, D) and scope["y_next"].shape == (1, 1, D)
    assert np.isfinite(np.asarray(scope["y_next"])).all()
    np.testing.assert_array_equal(scope["cache"].state.lengths[:1], [201])
    exec(blocks[1], scope)  # noqa: S102
    assert scope["y"].shape == (1, 200, D)
    np.testing.assert_array_equal(scope["cache"].state.lengths, [201, 200])
    # The second block's module holds layer 1 of the scanned Decoder: its output is what a
    # module built from the same weights computes in a fresh cache.
    want = V4Attention(config, LayerKind.CSA, rngs=nnx.Rngs(5))
    interop.load_attention(want, interop.attention_state(scope["model"], layer=1))
    cache = v4.reset_slot(v4.init_cache(config, scope["cache"].geometry), 0)
    _, y = want.step(scope["x"], cache, slot_ids=[0], n_new=[200], layer=1)
    np.testing.assert_array_equal(y, scope["y"])


def _tokens(seed: int, T: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 48, (2, T)).astype(np.int32)


@pytest.mark.parametrize("scan_layers", [True, False], ids=["scan", "unrolled"])
def test_step_chain_equals_the_decoder(scan_layers):
    """x -> x + layer.step(RMSNorm(x)) through every layer, each layer in a cache of its own,
    over prefill chunks and decode steps, gives the Decoder's logits. Unrolled, the layers are
    the Decoder's own modules; scanned, modules of their own holding each layer's weights."""
    model = Decoder(ModelConfig(MODEL, vocab_size=48), rngs=nnx.Rngs(0), bias_scale=0.5,
                    scan_layers=scan_layers)
    rng = np.random.default_rng(1)
    for layer in range(MODEL.num_layers):  # norm weights away from 1, so that each one counts
        interop.set_norms(model, layer=layer,
                          attn_norm=1 + 0.3 * rng.standard_normal(MODEL.hidden_size))
    layers, norms = [], []
    for layer in range(MODEL.num_layers):
        block, r = model.block_of(layer)
        assert (r is None) == (not scan_layers)
        if r is None:
            attn, norm = block.attn, block.attn_norm[...]
        else:
            attn = V4Attention(MODEL, MODEL.layer_kinds[layer], rngs=nnx.Rngs(9))
            interop.load_attention(attn, interop.attention_state(model, layer=layer))
            norm = block.attn_norm[...][r]
        layers.append(nnx.split(attn))
        norms.append(norm)

    @jax.jit
    def chain(states, caches, x, n_new):
        caches = list(caches)
        for layer, ((graphdef, _), state) in enumerate(zip(layers, states, strict=True)):
            attn = nnx.merge(graphdef, state)
            caches[layer], y = attn.step(rms_norm(x, norms[layer], MODEL.rms_eps),
                                         caches[layer], slot_ids=jnp.arange(2), n_new=n_new,
                                         layer=layer)
            x = x + y
        return caches, model.logits(rms_norm(x, model.norm[...], MODEL.rms_eps))

    def fresh():
        return v4.reset_slot(v4.reset_slot(v4.init_cache(MODEL, GEOMETRY), 0), 1)

    graphdef, params = nnx.split(model)
    states = [state for _, state in layers]
    model_cache, layer_caches = fresh(), [fresh() for _ in layers]
    for seed, (T, n_new) in enumerate(CHUNKS):
        tokens = _tokens(seed, T)
        model_cache, want = forward(graphdef, params, model_cache, jnp.asarray(tokens),
                                    jnp.arange(2), jnp.asarray(n_new))
        x = model.embed[...][tokens].astype(jnp.float32)
        layer_caches, got = chain(states, layer_caches, x, jnp.asarray(n_new))
        for b, n in enumerate(n_new):  # rows past n_new are padding
            np.testing.assert_allclose(got[b, :n], want[b, :n], rtol=1e-5,
                                       atol=1e-5 * float(np.abs(want).max()),
                                       err_msg=f"chunk {seed} row {b}")
    for layer, cache in enumerate(layer_caches):  # each layer's own cache: the model's state
        np.testing.assert_array_equal(cache.state.lengths, model_cache.state.lengths)
        np.testing.assert_allclose(cache.state.window[layer].records(),
                                   model_cache.state.window[layer].records(),
                                   rtol=1e-5, atol=1e-5)


def test_step_under_jit_equals_eager():
    attn = V4Attention(MODEL, LayerKind.HCA, rngs=nnx.Rngs(0), bias_scale=0.5)
    graphdef, params = nnx.split(attn)

    @jax.jit
    def run(params, cache, x, slot_ids, n_new):
        return nnx.merge(graphdef, params).step(x, cache, slot_ids=slot_ids, n_new=n_new,
                                                layer=4)

    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 40, MODEL.hidden_size)),
                    jnp.float32)
    cache = v4.reset_slot(v4.reset_slot(v4.init_cache(MODEL, GEOMETRY), 0), 1)
    eager_cache, eager = attn.step(x, cache, slot_ids=[1, 0], n_new=[40, 17], layer=4)
    jit_cache, jitted = run(params, cache, x, jnp.asarray([1, 0]), jnp.asarray([40, 17]))
    np.testing.assert_allclose(jitted, eager, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(jit_cache.state.lengths, [17, 40])
    np.testing.assert_array_equal(eager_cache.state.lengths, [17, 40])


def test_step_errors_name_the_argument():
    attn = V4Attention(MODEL, LayerKind.CSA, rngs=nnx.Rngs(0))
    cache = v4.reset_slot(v4.init_cache(MODEL, GEOMETRY), 0)
    x = jnp.zeros((1, 4, MODEL.hidden_size))
    with pytest.raises(ValueError, match=r"layer: expected a CSA layer like the module \(the "
                                         r"cache's CSA layers: \[1, 3\]\); got 2, a HCA layer"):
        attn.step(x, cache, slot_ids=[0], n_new=[4], layer=2)
    with pytest.raises(ValueError, match=r"layer: expected an integer in \[0, 4\]; got 5"):
        attn.step(x, cache, slot_ids=[0], n_new=[4], layer=5)
    with pytest.raises(TypeError, match="layer: expected an integer; got 1.0"):
        attn.step(x, cache, slot_ids=[0], n_new=[4], layer=1.0)
    other = v4.init_cache(v4.tiny(), GEOMETRY)
    with pytest.raises(ValueError, match="cache: expected a cache built for the module's "
                                         "attention config; got a cache of another"):
        attn.step(x, other, slot_ids=[0], n_new=[4], layer=1)
    with pytest.raises(TypeError, match="cache: expected a v4kv_jax Cache; got dict"):
        attn.step(x, {}, slot_ids=[0], n_new=[4], layer=1)
    with pytest.raises(ValueError, match=r"x has shape \(1, 4, 3\); expected \[B, T, "
                                         r"hidden_size=64\]"):
        attn.step(jnp.zeros((1, 4, 3)), cache, slot_ids=[0], n_new=[4], layer=1)
    with pytest.raises(ValueError, match=r"n_new: expected shape \(1,\) \(one per row of x\); "
                                         r"got shape \(2,\)"):
        attn.step(x, cache, slot_ids=[0], n_new=[4, 4], layer=1)
    with pytest.raises(ValueError, match=r"slot_ids: expected ACTIVE slots for rows that "
                                         r"append \(reset_slot it first\); got slot 1 FREE"):
        attn.step(x, cache, slot_ids=[1], n_new=[4], layer=1)
    with pytest.raises(TypeError, match="takes 3 positional arguments"):
        attn.step(x, cache, [0], [4], 1)
