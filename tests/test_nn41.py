"""The DeepSeek-V4.1 Flax layers (v4kv_jax/nn/attention41.py, nn/model41.py) and their
checkpoint names and loading (v4kv_jax/interop/names41.py, interop/checkpoint41.py).

The whole `Decoder41` over the tiny41() stack (every block type) against a float64 numpy
decoder whose attention is the oracle written from V41_SPEC.md (testing/v41_oracle.py): two
rows of 20 and 19 tokens in chunks of 8, 5, 1, 6 and 3, 8, 0, 8 (one T, one program). Then
the safetensors round trip (float32, bf16, fp8 and fp4 with their scales), the name table
against the modules (tiny41 and V4.1-Flash), and named errors.
"""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import v41_cases as cases
from flax import nnx

import v4kv_jax as v4
from v4kv_jax import interop, pools
from v4kv_jax.interop import checkpoint41, names41
from v4kv_jax.interop.safetensors_io import SafetensorsFile, save_tensors
from v4kv_jax.nn import Decoder41, ModelConfig41, V41Attention, model41
from v4kv_jax.pools import cache41
from v4kv_jax.testing import v41_oracle as oracle

CONFIG = v4.tiny41()
MODEL = ModelConfig41(CONFIG, vocab_size=48, mlp_hidden=24)
T = 8  # the one chunk length of the file: one program
# Logits of the fp32 model against the f64 one, 6 residual layers deep: the step's outputs
# are within 5e-5 of the oracle (tests/test_step41.py) on unit vectors; logits here are
# O(1) and the residual stream O(few). Measured max error 3e-6; 1e-4 leaves 30x.
ATOL = 1e-4
ROWS = [  # (tokens, chunk lengths n_new per call; 0: the row appends nothing)
    (np.random.default_rng(1).integers(0, MODEL.vocab_size, 20), (8, 5, 1, 6)),
    (np.random.default_rng(2).integers(0, MODEL.vocab_size, 19), (3, 8, 0, 8)),
]


def random_params41(config, layer: int, seed: int) -> dict[str, np.ndarray]:
    """A layer's params: projections N(0, 1 / in), norms in [0.7, 1.3], sink N(0, 1)."""
    rng = np.random.default_rng(seed)
    out = {}
    for path, shape in names41.expected_shapes41(config, layer).items():
        if len(shape) == 2:
            value = rng.normal(size=shape) * shape[1] ** -0.5
        elif path == "attn_sink":
            value = rng.normal(size=shape)
        else:
            value = rng.uniform(0.7, 1.3, shape)
        out[path] = value.astype(np.float32)
    return out


@pytest.fixture(scope="module")
def model():
    m = Decoder41(MODEL, rngs=nnx.Rngs(0))
    interop.load_into41(m, {i: random_params41(CONFIG, i, seed=10 + i)
                            for i in range(CONFIG.num_layers)})
    rng = np.random.default_rng(3)
    for block in m.layers:
        block.attn_norm[...] = jnp.asarray(rng.uniform(0.7, 1.3, CONFIG.hidden_size))
        block.ffn_norm[...] = jnp.asarray(rng.uniform(0.7, 1.3, CONFIG.hidden_size))
    m.norm[...] = jnp.asarray(rng.uniform(0.7, 1.3, CONFIG.hidden_size))
    return m


def _cache(config=CONFIG, slots=(0, 1)):
    geometry = cache41.cache_config41("float32", num_pages=8, max_slots=3, max_pages_per_seq=2)
    cache = cache41.init_cache41(config, geometry)
    for s in slots:
        cache = pools.reset_slot(cache, s)
    return cache


# ---- the float64 decoder ----

def _rms(x, w, eps=CONFIG.rms_eps):
    return oracle.rms_norm(x, w, eps)


def _layer_inputs(w: dict, h: np.ndarray) -> oracle.LayerInputs:
    """A layer's vectors from its input h [L, D] (nn/attention41.py's docstring), f64."""
    L, c = len(h), CONFIG
    qr = _rms(h @ w["wq_a"].T, w["q_norm"])
    x = oracle.LayerInputs(q=(qr @ w["wq_b"].T).reshape(L, c.num_heads, c.head_dim),
                           win=_rms(h @ w["wkv"].T, w["kv_norm"]), sink=w["attn_sink"])
    if "compressor.wkv" in w:
        x.a = h @ w["compressor.wkv"].T
        x.z = h @ w["compressor.wgate"].T if "compressor.wgate" in w else None
        x.norm_c, x.wk, x.k_norm = w["compressor.norm"], w["indexer.wk"], w["indexer.k_norm"]
    if "indexer.wq_b" in w:
        x.q_index = (qr @ w["indexer.wq_b"].T).reshape(L, c.index_heads, c.index_head_dim)
        x.w_index = h @ w["indexer.weights_proj"].T
    return x


def _output(w: dict, o: np.ndarray) -> np.ndarray:
    """wo_b concat_g(wo_a[g] o_g) of o [L, H, hd] (V41_SPEC.md section 5)."""
    g = CONFIG.o_groups
    grouped = o.reshape(len(o), g, -1)
    z = np.einsum("lgi,gri->lgr", grouped, w["wo_a"].reshape(g, CONFIG.o_lora_rank, -1))
    return z.reshape(len(o), -1) @ w["wo_b"].T


def reference_logits(model: Decoder41, tokens: np.ndarray) -> tuple[np.ndarray, object]:
    """f64 logits [L, V] of the whole decoder over one sequence, and the oracle's last run.

    Layer l's input depends on layer l - 1's output, so the oracle runs once per layer with
    the real vectors of layers 0..l (later layers hold placeholders: no layer reads a later
    one) and layer l's output is taken from that run."""
    f64 = lambda x: np.asarray(x, np.float64)  # noqa: E731
    stack = cases.stack_of(CONFIG)
    inputs = oracle.random_inputs(stack, len(tokens), seed=0)
    x = f64(model.embed[...])[tokens]
    for layer, block in enumerate(model.layers):
        w = {k: f64(v) for k, v in interop.attention_state41(model, layer=layer).items()}
        inputs[layer] = _layer_inputs(w, _rms(x, f64(block.attn_norm[...])))
        ref = oracle.run(stack, inputs)
        x = x + _output(w, ref.outputs[layer])
        h = _rms(x, f64(block.ffn_norm[...]))
        ffn = block.ffn
        gate, up = h @ f64(ffn.gate_proj[...]).T, h @ f64(ffn.up_proj[...]).T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ f64(ffn.down_proj[...]).T
    return _rms(x, f64(model.norm[...])) @ f64(model.head[...]).T, ref


def _run(model, cache, rows=ROWS, slots=(0, 1)):
    """Feeds each row's chunks to its slot, one `step` per chunk; logits per row [L, V]."""
    got = [[] for _ in rows]
    for i in range(len(rows[0][1])):
        tokens = np.full((len(rows), T), -1, np.int32)  # padding ids are never read
        n_new, starts = [], [sum(chunks[:i]) for _, chunks in rows]
        for b, (seq, chunks) in enumerate(rows):
            n = chunks[i]
            tokens[b, :n] = seq[starts[b]:starts[b] + n]
            n_new.append(n)
        cache, logits = model.step(tokens, cache, np.asarray(slots, np.int32),
                                   np.asarray(n_new, np.int32))
        for b, n in enumerate(n_new):
            got[b].append(np.asarray(logits[b, :n]))
    return cache, [np.concatenate(g) for g in got]


def test_decoder_equals_the_float64_decoder_over_the_oracle(model):
    before = model41._forward41.traces
    cache, got = _run(model, _cache())
    assert model41._forward41.traces - before <= 1  # one program for every chunk
    for b, (seq, _) in enumerate(ROWS):
        want, ref = reference_logits(model, seq)
        # Where the oracle's top-k or candidate cut is a near tie, fp32 may pick otherwise
        # and the outputs differ by design; these sequences have none (exact 0-ties, which
        # both sides break to the lower entry, aside).
        gaps = np.concatenate([m for m in ref.margins.values()])
        assert np.all((gaps == 0) | (gaps > 1e-4)), np.sort(gaps)[:5]
        np.testing.assert_allclose(got[b], want, rtol=0, atol=ATOL, err_msg=f"row {b}")
    assert np.asarray(pools.lengths(cache))[:2].tolist() == [20, 19]


def test_one_program_serves_every_chunking(model):
    model.step(np.zeros((2, T), np.int32), _cache(), np.asarray([0, 1], np.int32),
               np.asarray([T, 2], np.int32))  # compiled here or by an earlier test
    before = model41._forward41.traces
    chunkings = [(np.arange(20) % 48, (1, 1, 8, 8, 2)), (np.arange(19) % 48, (8, 0, 3, 7, 1))]
    cache, got = _run(model, _cache(), rows=chunkings)
    assert model41._forward41.traces == before
    want = [reference_logits(model, seq)[0] for seq, _ in chunkings]
    for b in range(2):
        np.testing.assert_allclose(got[b], want[b], rtol=0, atol=ATOL)


def test_a_token_outside_the_vocabulary(model):
    cache = _cache()
    tokens = np.zeros((2, T), np.int32)
    tokens[1, 2] = MODEL.vocab_size
    with pytest.raises(ValueError, match=r"tokens: expected token ids in \[0, 48\) "
                                         r"\(vocab_size\); got 48 at row 1, position 2"):
        model.step(tokens, cache, np.asarray([0, 1], np.int32), np.asarray([4, 4], np.int32))
    # Inside the program (where nothing can raise) the row appends nothing and its slot is
    # flagged REJECTED; the other row runs. Past a row's n_new an id is padding.
    graphdef, params = nnx.split(model)
    cache, _ = model41._forward41(graphdef, params, cache, jnp.asarray(tokens),
                                  jnp.asarray([0, 1], jnp.int32), jnp.asarray([4, 2], jnp.int32))
    assert np.asarray(pools.lengths(cache))[:2].tolist() == [4, 2]
    cache, _ = model41._forward41(graphdef, params, cache, jnp.asarray(tokens),
                                  jnp.asarray([0, 1], jnp.int32), jnp.asarray([1, 4], jnp.int32))
    assert np.asarray(pools.lengths(cache))[:2].tolist() == [5, 2]
    assert int(pools.status(cache)[1]) == v4.SlotStatus.REJECTED


def test_bad_calls_name_the_argument(model):
    cache, ids, n = _cache(), np.asarray([0, 1], np.int32), np.asarray([1, 1], np.int32)
    tokens = np.zeros((2, T), np.int32)
    with pytest.raises(TypeError, match="tokens: expected an array of integer dtype"):
        model.step(tokens.astype(np.float32), cache, ids, n)
    with pytest.raises(ValueError, match=r"tokens: expected token ids of shape \[B, T\]"):
        model.step(tokens[0], cache, ids, n)
    with pytest.raises(ValueError, match=r"slot_ids: expected shape \(2,\)"):
        model.step(tokens, cache, ids[:1], n)
    with pytest.raises(ValueError, match=r"n_new: expected counts in \[0, 8\]"):
        model.step(tokens, cache, ids, np.asarray([1, 9], np.int32))
    with pytest.raises(ValueError, match="slot_ids: expected ACTIVE slots"):
        model.step(tokens, _cache(slots=(0,)), ids, n)
    with pytest.raises(ValueError, match="cache: expected a cache built for the model's "
                                         "V41Config"):
        model.step(tokens, _cache(v4.tiny41(window=16)), ids, n)
    with pytest.raises(TypeError, match="cache: expected a Cache41"):
        model.step(tokens, object(), ids, n)
    attn = model.layers[2].attn
    with pytest.raises(ValueError, match=r"x: expected an array \[B, T, hidden_size=64\]"):
        attn.vectors(jnp.zeros((1, 2, 32)))
    with pytest.raises(ValueError, match=r"path: expected a param of layer 2 \(Reuse, ratio 2\)"):
        attn.weight("indexer.wq_b")
    with pytest.raises(TypeError, match="config: expected a ModelConfig41"):
        Decoder41(CONFIG, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"layer: expected an integer in \[0, 5\]"):
        V41Attention(CONFIG, 6, rngs=nnx.Rngs(0))


# ---- names and shapes ----

def test_the_name_table_is_the_modules_params():
    for config in (CONFIG, v4.flash41()):
        counts = {}
        for layer in range(config.num_layers):
            attn = nnx.eval_shape(lambda c=config, i=layer: V41Attention(c, i, rngs=nnx.Rngs(0)))
            table = names41.names_for41(config, layer)
            assert attn.paths() == tuple(sorted(n.path for n in table))
            shapes = names41.expected_shapes41(config, layer)
            assert {p: tuple(attn.weight(p).get_value().shape) for p in attn.paths()} == shapes
            for n in table:
                counts[n.official] = counts.get(n.official, 0) + 1
    # V4.1-Flash's counts (V41_SPEC.md section 6, [PLOW]): 4 kv sources, 3 of ratio 2, 8
    # index sources; every one of the 40 layers has the common eight.
    assert counts["compressor.wkv.weight"] == 4 and counts["compressor.wgate.weight"] == 3
    assert counts["indexer.wq_b.weight"] == 8 and counts["indexer.wk.weight"] == 4
    assert counts["wq_a.weight"] == counts["attn_sink"] == 40
    first = {n.path: n.official for n in names41.names_for41(v4.flash41(), 20)}
    assert first["attn_sink"] == "attn_sink" and first["indexer.k_norm"] == "indexer.k_norm.weight"
    assert names41.layer_prefix41(20) == "layers.20.attn."


# ---- safetensors ----

def test_round_trip_through_a_safetensors_file(tmp_path, model):
    per_layer = {i: random_params41(CONFIG, i, seed=i) for i in range(CONFIG.num_layers)}
    path = tmp_path / "attn.safetensors"
    interop.write_attention41(path, per_layer, CONFIG)
    f = SafetensorsFile(path)
    assert "layers.1.attn.compressor.wgate.weight" in f.names()
    assert "layers.3.attn.compressor.wgate.weight" not in f.names()  # ratio 1
    assert not any(n.startswith("layers.2.attn.indexer.") for n in f.names())  # Reuse
    loaded = interop.read_attention41(path, CONFIG)
    fresh = Decoder41(MODEL, rngs=nnx.Rngs(1))
    interop.load_into41(fresh, loaded)
    for layer, params in per_layer.items():
        state = interop.attention_state41(fresh, layer=layer)
        assert state.keys() == params.keys()
        for name, value in params.items():
            np.testing.assert_array_equal(state[name], value, err_msg=f"{layer} {name}")
    assert set(interop.read_attention41(path, CONFIG, layers=[5, 1])) == {1, 5}


def test_quantised_weights_load_as_weight_times_scale(tmp_path, monkeypatch):
    per_layer = {1: random_params41(CONFIG, 1, seed=5), 5: random_params41(CONFIG, 5, seed=6)}
    formats = {"wq_a": "fp8", "wo_b": "fp8", "wq_b": "fp4", "indexer.wq_b": "fp4",
               "wkv": "bfloat16", "kv_norm": "bfloat16"}
    path = tmp_path / "model-00001-of-00001.safetensors"
    checkpoint41.write_attention41(path, per_layer, CONFIG, formats=formats)
    f = SafetensorsFile(path)
    dtypes = {n: f.dtype(n) for n in f.names() if n.startswith("layers.1.")}
    assert dtypes["layers.1.attn.wq_a.weight"] == "F8_E4M3"
    assert f.shape("layers.1.attn.wq_a.scale") == (1, 2)  # [32 / 32, 64 / 32] blocks
    assert dtypes["layers.1.attn.wq_b.weight"] == "F4"
    assert f.shape("layers.1.attn.wq_b.scale") == (256, 1)  # one a row and 32 inputs
    assert dtypes["layers.1.attn.wkv.weight"] == dtypes["layers.1.attn.kv_norm.weight"] == "BF16"
    reads = []
    real = SafetensorsFile.read
    monkeypatch.setattr(SafetensorsFile, "read",
                        lambda self, n: reads.append(n) or real(self, n))
    loaded = interop.read_attention41(path, CONFIG, layers=[1, 5])
    assert all(n.startswith(("layers.1.attn.", "layers.5.attn.")) for n in reads)
    for layer, params in per_layer.items():
        for name, value in params.items():
            got = loaded[layer][name]
            stem = f"layers.{layer}.attn.{name}"
            if formats.get(name) in ("fp8", "fp4"):
                w = real(f, stem + ".weight").astype(np.float32)
                s = real(f, stem + ".scale").astype(np.float32)
                block = (32, 32) if formats[name] == "fp8" else (1, 32)
                s = np.repeat(np.repeat(s, block[0], 0), block[1], 1)
                np.testing.assert_array_equal(got, w * s[:w.shape[0], :w.shape[1]])
                step = s[:w.shape[0], :w.shape[1]]
                tol = (np.abs(value) / 16 + step * 2.0**-9 if formats[name] == "fp8"
                       else np.abs(value) / 3 + step / 4)  # e4m3 / e2m1 rounding
                assert np.all(np.abs(got - value) <= tol), name
            elif formats.get(name) == "bfloat16":
                np.testing.assert_array_equal(
                    got, value.astype(ml_dtypes.bfloat16).astype(np.float32))
            else:
                np.testing.assert_array_equal(got, value)


def test_dequantize_by_hand():
    # fp4: row 0 codes 0.5, -6, 3 (and 29 zeros) at scale 2^-1; row 1 all 1.5 at scale 4.
    w = np.zeros((2, 32), np.float32)
    w[0, :3], w[1] = [0.5, -6.0, 3.0], 1.5
    s = np.asarray([[0.5], [4.0]], np.float32).astype(ml_dtypes.float8_e8m0fnu)
    got = interop.dequantize41(w.astype(ml_dtypes.float4_e2m1fn), s, "w")
    np.testing.assert_array_equal(got[0, :4], [0.25, -3.0, 1.5, 0.0])
    np.testing.assert_array_equal(got[1], np.full(32, 6.0))
    # fp8 in 32 x 32 blocks (V4.1) and in 128 x 128 blocks (V4), told apart by the scale.
    w8 = np.full((40, 40), 2.0, np.float32).astype(ml_dtypes.float8_e4m3fn)
    s8 = np.asarray([[1.0, 2.0], [4.0, 8.0]], np.float32).astype(ml_dtypes.float8_e8m0fnu)
    got = interop.dequantize41(w8, s8, "w8")
    assert (got[0, 0], got[0, 39], got[39, 0], got[39, 39]) == (2.0, 4.0, 8.0, 16.0)
    got = interop.dequantize41(w8, s8[:1, :1], "w8")
    assert np.all(got == 2.0)
    with pytest.raises(interop.CheckpointError, match=r"w8: scale has shape \(2, 1\); a "
                                                      r"float8_e4m3fn weight \(40, 40\) needs "
                                                      r"\(2, 2\) \(32x32 blocks\) or \(1, 1\)"):
        interop.dequantize41(w8, s8[:, :1], "w8")


def test_loading_errors_name_the_tensor(tmp_path, model):
    params = random_params41(CONFIG, 5, seed=0)
    prefix = "layers.5.attn."
    tensors = {prefix + n.official: params[n.path] for n in names41.names_for41(CONFIG, 5)}
    ok = interop.attention_params41(tensors, CONFIG, 5, prefix)
    np.testing.assert_array_equal(ok["indexer.weights_proj"], params["indexer.weights_proj"])
    with pytest.raises(interop.CheckpointError, match=r"missing tensor\(s\) for layer 5 "
                                                      r"\(Reindex, ratio 1\): layers\.5\.attn\."
                                                      r"indexer\.wq_b\.weight"):
        interop.attention_params41({k: v for k, v in tensors.items()
                                    if "indexer.wq_b" not in k}, CONFIG, 5, prefix)
    with pytest.raises(interop.CheckpointError, match=r"layers\.5\.attn\.wkv\.weight has shape "
                                                      r"\(64, 63\); the config expects \(64, 64\)"):
        interop.attention_params41({**tensors, prefix + "wkv.weight": np.zeros((64, 63))},
                                   CONFIG, 5, prefix)
    with pytest.raises(interop.CheckpointError, match=r"unknown tensor\(s\) for layer 5 "
                                                      r"\(Reindex, ratio 1\): layers\.5\.attn\."
                                                      r"indexer\.wk\.weight \(only kv "
                                                      r"sources have it\)"):
        interop.attention_params41({**tensors, prefix + "indexer.wk.weight": np.zeros((32, 64))},
                                   CONFIG, 5, prefix)
    fp8 = {**tensors, prefix + "wq_a.weight": tensors[prefix + "wq_a.weight"].astype(
        ml_dtypes.float8_e4m3fn)}
    with pytest.raises(interop.CheckpointError, match=r"layers\.5\.attn\.wq_a\.weight: "
                                                      r"expected its block scale layers\.5\."
                                                      r"attn\.wq_a\.scale"):
        interop.attention_params41(fp8, CONFIG, 5, prefix)
    path = tmp_path / "part.safetensors"
    save_tensors(path, {k: v for k, v in tensors.items() if not k.endswith("attn_sink")})
    with pytest.raises(interop.CheckpointError, match=r"shards \['part\.safetensors'\]: missing "
                                                      r"tensor\(s\) for layer 5 .*attn_sink"):
        interop.read_attention41(path, CONFIG, layers=[5])
    with pytest.raises(interop.CheckpointError, match="no attention tensors for layer 0"):
        interop.read_attention41(path, CONFIG, layers=[0])
    with pytest.raises(ValueError, match=r"layers: expected layer indices in \[0, 6\)"):
        interop.read_attention41(path, CONFIG, layers=[6])
    with pytest.raises(interop.CheckpointError,
                       match=r"params for the layer \(layer 5, Reindex, ratio 1\) must be"):
        interop.load_attention41(model, {**params, "indexer.wk": np.zeros((32, 64))}, layer=5)
    with pytest.raises(interop.CheckpointError,
                       match=r"wo_a \(layer 5, Reindex, ratio 1\) has shape \(4, 4\)"):
        interop.load_attention41(model, {**params, "wo_a": np.zeros((4, 4))}, layer=5)
    with pytest.raises(ValueError, match=r"layer: expected a layer index in \[0, 6\)"):
        interop.load_attention41(model, params)
    with pytest.raises(ValueError, match=r"formats\['kv_norm'\]: expected float32 or bfloat16"):
        interop.write_attention41(path, {5: params}, CONFIG, formats={"kv_norm": "fp8"})
