"""Checkpoint names, converters, safetensors loading (files written here), config mapping."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
from flax import nnx

import v4kv_jax as v4
from v4kv_jax import interop
from v4kv_jax.config import LayerKind
from v4kv_jax.interop import checkpoint, names
from v4kv_jax.interop.safetensors_io import SafetensorsFile
from v4kv_jax.nn import Decoder, ModelConfig, V4Attention, fused_columns

safetensors_numpy = pytest.importorskip("safetensors.numpy")

MODEL = v4.tiny(index_heads=16)
KINDS = list(LayerKind)


def random_params(config, kind, seed=0):
    rng = np.random.default_rng(seed)
    return {path: rng.standard_normal(shape).astype(np.float32)
            for path, shape in names.expected_shapes(config, kind).items()}


def test_table_covers_every_module_param():
    for kind in KINDS:
        module = V4Attention(MODEL, kind, rngs=nnx.Rngs(0))
        flat = {".".join(str(k) for k in path): v[...]
                for path, v in nnx.to_flat_state(nnx.state(module, nnx.Param))}
        columns = fused_columns(MODEL, kind)
        expected = names.expected_shapes(MODEL, kind)
        stored = {"x_proj", "qr_proj", "out_a_proj", "out_b_proj"}
        assert set(flat) == (set(expected) - set(columns) - {"o_a_proj", "o_b_proj"}) | stored
        # Every fused weight is exactly its projections' columns, back to back.
        for fused in ("x_proj", "qr_proj"):
            spans = sorted((start, n) for f, start, n in columns.values() if f == fused)
            assert [s for s, _ in spans] == list(np.cumsum([0] + [n for _, n in spans[:-1]]))
            assert sum(n for _, n in spans) == flat[fused].shape[1]
        for path, (fused, _, n) in columns.items():
            assert expected[path] == (n, flat[fused].shape[0]), path
        state = interop.attention_state(module)
        assert {k: v.shape for k, v in state.items()} == names.expected_shapes(MODEL, kind)


@pytest.mark.parametrize("layout", names.LAYOUTS)
@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_round_trip_through_checkpoint_names(layout, kind):
    params = random_params(MODEL, kind)
    tensors = interop.checkpoint_tensors(params, kind, layout, prefix="p.")
    back = interop.attention_params(tensors, MODEL, kind, layout, prefix="p.")
    assert back.keys() == params.keys()
    for k in params:
        np.testing.assert_array_equal(back[k], params[k])
    module = V4Attention(MODEL, kind, rngs=nnx.Rngs(1))
    interop.load_attention(module, back)
    for k, v in interop.attention_state(module).items():
        np.testing.assert_array_equal(v, params[k])


def test_official_and_transformers_names_of_a_csa_layer():
    tensors = interop.checkpoint_tensors(random_params(MODEL, LayerKind.CSA), LayerKind.CSA,
                                         interop.OFFICIAL, "layers.2.attn.")
    assert {"layers.2.attn.wq_a.weight", "layers.2.attn.attn_sink",
            "layers.2.attn.compressor.ape", "layers.2.attn.compressor.norm.weight",
            "layers.2.attn.indexer.weights_proj.weight", "layers.2.attn.indexer.wq_b.weight",
            "layers.2.attn.indexer.compressor.wgate.weight"} <= set(tensors)
    hf = interop.checkpoint_tensors(random_params(MODEL, LayerKind.CSA), LayerKind.CSA,
                                    interop.TRANSFORMERS)
    assert {"sinks", "compressor.position_bias", "compressor.indexer.position_bias",
            "compressor.indexer.scorer.weights_proj.weight", "o_a_proj.weight"} <= set(hf)


def test_errors_name_the_tensor():
    good = interop.checkpoint_tensors(random_params(MODEL, LayerKind.HCA), LayerKind.HCA,
                                      interop.OFFICIAL, "layers.2.attn.")
    bad = dict(good, **{"layers.2.attn.wq_x.weight": np.zeros(3)})
    with pytest.raises(interop.CheckpointError, match=r"unknown .*layers\.2\.attn\.wq_x\.weight"):
        interop.attention_params(bad, MODEL, LayerKind.HCA, "official", "layers.2.attn.")
    # An indexer tensor in an HCA layer: the message says where it belongs.
    bad = dict(good, **{"layers.2.attn.indexer.wq_b.weight": np.zeros(3)})
    with pytest.raises(interop.CheckpointError,
                       match=r"indexer\.wq_b\.weight \(exists only in CSA"):
        interop.attention_params(bad, MODEL, LayerKind.HCA, "official", "layers.2.attn.")
    missing = {k: v for k, v in good.items() if not k.endswith("compressor.ape")}
    with pytest.raises(interop.CheckpointError,
                       match=r"missing .*layers\.2\.attn\.compressor\.ape"):
        interop.attention_params(missing, MODEL, LayerKind.HCA, "official", "layers.2.attn.")
    wrong = dict(good, **{"layers.2.attn.wkv.weight": np.zeros((32, 63), np.float32)})
    with pytest.raises(interop.CheckpointError,
                       match=r"layers\.2\.attn\.wkv\.weight has shape \(32, 63\); the config "
                             r"expects \(32, 64\)"):
        interop.attention_params(wrong, MODEL, LayerKind.HCA, "official", "layers.2.attn.")
    with pytest.raises(ValueError, match=r"layout: expected one of \('transformers', "
                                         r"'official'\); got 'hf'"):
        interop.attention_params(good, MODEL, LayerKind.HCA, "hf")


def test_block_scaled_fp8_weights_are_dequantized():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((200, 300)).astype(ml_dtypes.float8_e4m3fn)
    scale = (2.0 ** rng.integers(-3, 3, (2, 3))).astype(ml_dtypes.float8_e8m0fnu)
    got = interop.dequantize(w, scale, "w")
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got[:128, :128], w[:128, :128].astype(np.float32)
                                  * float(scale[0, 0]))
    np.testing.assert_array_equal(got[128:, 256:], w[128:, 256:].astype(np.float32)
                                  * float(scale[1, 2]))
    with pytest.raises(interop.CheckpointError, match=r"w: scale has shape \(2, 2\)"):
        interop.dequantize(w, scale[:, :2], "w")


def _write_official_checkpoint(tmp_path, config, per_layer, fp8_layer=None):
    """Two shards: attention tensors of even layers + unrelated tensors in the first, odd
    layers in the second; layer `fp8_layer`'s projections stored as fp8 with block scales."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    shards = [{}, {}]
    for layer, params in per_layer.items():
        tensors = interop.checkpoint_tensors(params, config.layer_kinds[layer], "official",
                                             f"layers.{layer}.attn.")
        shard = shards[layer % 2]
        for name, value in tensors.items():
            t = torch.from_numpy(np.ascontiguousarray(value))
            if layer == fp8_layer and name.endswith("wq_a.weight"):
                shard[name] = t.to(torch.float8_e4m3fn)
                o, i = value.shape
                shard[name[:-len(".weight")] + ".scale"] = torch.full(
                    (-(-o // 128), -(-i // 128)), 0.5).to(torch.float8_e8m0fnu)
            elif layer == fp8_layer and name == f"layers.{layer}.attn.wkv.weight":
                shard[name] = t.to(torch.bfloat16)
            else:
                shard[name] = t
    shards[0]["embed.weight"] = torch.zeros(4, config.hidden_size)
    shards[0]["layers.0.ffn.experts.0.w1.weight"] = torch.zeros(2, 2, dtype=torch.int8)
    shards[1]["mtp.0.attn.wq_a.weight"] = torch.zeros(2, 2)
    paths = []
    for i, shard in enumerate(shards):
        path = tmp_path / f"model-0000{i + 1}-of-00002.safetensors"
        save_file(shard, str(path))
        paths.append(path)
    return paths


def test_safetensors_reader_dtypes(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    x = torch.randn(5, 7)
    save_file({"f32": x, "bf16": x.to(torch.bfloat16), "f8": x.to(torch.float8_e4m3fn),
               "i64": torch.arange(3), "empty": torch.zeros(0, 2)}, str(tmp_path / "a.safetensors"))
    f = SafetensorsFile(tmp_path / "a.safetensors")
    np.testing.assert_array_equal(f.read("f32"), x.numpy())
    np.testing.assert_array_equal(f.read("bf16").astype(np.float32),
                                  x.to(torch.bfloat16).float().numpy())
    np.testing.assert_array_equal(f.read("f8").astype(np.float32),
                                  x.to(torch.float8_e4m3fn).float().numpy())
    assert f.read("i64").tolist() == [0, 1, 2] and f.read("empty").shape == (0, 2)
    assert (f.dtype("bf16"), f.shape("f8")) == ("BF16", (5, 7))
    with pytest.raises(KeyError, match="no tensor named 'nope'"):
        f.read("nope")


def test_read_attention_from_official_shards(tmp_path, monkeypatch):
    config = MODEL
    per_layer = {i: random_params(config, k, seed=i) for i, k in enumerate(config.layer_kinds)}
    paths = _write_official_checkpoint(tmp_path, config, per_layer, fp8_layer=1)
    reads = []
    real_read = SafetensorsFile.read

    def spy(self, name):
        reads.append((self.path, name))
        return real_read(self, name)

    monkeypatch.setattr(SafetensorsFile, "read", spy)
    assert checkpoint.detect_layout(map(str, paths)) == "official"
    loaded = interop.read_attention(tmp_path, config)
    # Only attention tensors of the model's layers were read, one shard after the other.
    assert all(".attn." in n and n.startswith("layers.") for _, n in reads)
    files = [p for p, _ in reads]
    assert files == sorted(files)
    assert set(loaded) == set(range(config.num_layers))
    for layer, params in loaded.items():
        for path, value in params.items():
            want = per_layer[layer][path]
            if layer == 1 and path == "q_a_proj":
                want = want.astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * 0.5
            elif layer == 1 and path == "kv_proj":
                want = want.astype(ml_dtypes.bfloat16).astype(np.float32)
            np.testing.assert_array_equal(value, want, err_msg=f"layer {layer} {path}")
    model = Decoder(ModelConfig(config, vocab_size=8), rngs=nnx.Rngs(0))
    interop.load_into(model, loaded)
    np.testing.assert_array_equal(interop.attention_state(model, layer=3)["indexer.weights_proj"],
                                  per_layer[3]["indexer.weights_proj"])
    # Two layers only: the others are not read at all.
    reads.clear()
    assert set(interop.read_attention(paths, config, layers=[0, 2])) == {0, 2}
    assert {int(n.split(".")[1]) for _, n in reads} == {0, 2}


def test_read_attention_from_transformers_layout_and_errors(tmp_path):
    config = MODEL
    per_layer = {i: random_params(config, k, seed=i) for i, k in enumerate(config.layer_kinds)}
    path = tmp_path / "model.safetensors"
    checkpoint.write_attention(path, per_layer, config, "transformers")
    loaded = interop.read_attention(path, config)
    np.testing.assert_array_equal(loaded[4]["compressor.ape"], per_layer[4]["compressor.ape"])
    assert checkpoint.detect_layout([str(path)]) == "transformers"

    del per_layer[3]["indexer.compressor.norm"]
    broken = tmp_path / "broken.safetensors"
    tensors = {}
    for layer, params in per_layer.items():
        kind = config.layer_kinds[layer]
        table = {p.path: p for p in names.names_for(kind)}
        tensors.update({names.layer_prefix("transformers", layer) + table[k].transformers: v
                        for k, v in params.items()})
    safetensors_numpy.save_file(tensors, str(broken))
    with pytest.raises(interop.CheckpointError,
                       match=r"layer 3 \(CSA, shards \['broken.safetensors'\]\): missing .*"
                             r"model\.layers\.3\.self_attn\.compressor\.indexer\.kv_norm\.weight"):
        interop.read_attention(broken, config)
    with pytest.raises(interop.CheckpointError, match="no attention tensors for layer 5"):
        interop.read_attention(path, v4.tiny(index_heads=16,
                                             compress_ratios=(0, 4, 16, 4, 16, 0)))


def test_config_from_an_official_config_json():
    official = {
        "hidden_size": 4096, "num_attention_heads": 64, "num_key_value_heads": 1,
        "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1024, "o_groups": 8,
        "o_lora_rank": 1024, "sliding_window": 128, "num_hidden_layers": 43,
        "compress_ratios": [0, 0] + [4 if i % 2 == 0 else 128 for i in range(2, 43)] + [0],
        "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512, "rope_theta": 10000,
        "compress_rope_theta": 160000, "rms_norm_eps": 1e-6,
        "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                         "beta_fast": 32, "beta_slow": 1},
    }
    assert interop.attention_config_from_hf(json.loads(json.dumps(official))) == v4.flash()
    with pytest.raises(ValueError, match=r"num_key_value_heads: expected 1 \(V4 attention has "
                                         r"one KV head\); got 8"):
        interop.attention_config_from_hf(dict(official, num_key_value_heads=8))


def test_config_round_trips_through_transformers():
    pytest.importorskip("transformers")
    from transformers import DeepseekV4Config

    for config in (MODEL, v4.flash(), v4.pro()):
        hf = DeepseekV4Config(**interop.transformers_config_kwargs(config))
        assert interop.attention_config_from_hf(hf.to_dict()) == config
