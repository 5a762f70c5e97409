"""Bad input to every public entry point of `v4kv_jax.interop` raises an error that names the
argument (or the file and tensor), what was expected and what was given."""

from __future__ import annotations

import json
import re
import struct

import ml_dtypes
import numpy as np
import pytest

import v4kv_jax as v4
from v4kv_jax import interop
from v4kv_jax.config import LayerKind
from v4kv_jax.interop import names
from v4kv_jax.interop.safetensors_io import SafetensorsFile, shard_files

MODEL = v4.tiny(index_heads=16)


def random_params(config, kind, seed=0):
    rng = np.random.default_rng(seed)
    return {path: rng.standard_normal(shape).astype(np.float32)
            for path, shape in names.expected_shapes(config, kind).items()}


def write_raw(path, header, data=b"", *, header_bytes=None, length=None):
    """A .safetensors file written byte by byte, so that it can be broken on purpose."""
    raw = json.dumps(header).encode() if header_bytes is None else header_bytes
    n = len(raw) if length is None else length
    path.write_bytes(struct.pack("<Q", n) + raw + data)
    return path


def f32_file(path, values=(1.0, 2.0, 3.0)):
    data = np.asarray(values, np.float32).tobytes()
    header = {"x": {"dtype": "F32", "shape": [len(values)], "data_offsets": [0, len(data)]}}
    return write_raw(path, header, data)


# --- safetensors files -----------------------------------------------------------------------


def test_a_well_formed_raw_file_reads_back(tmp_path):
    f = SafetensorsFile(f32_file(tmp_path / "ok.safetensors"))
    assert f.read("x").tolist() == [1.0, 2.0, 3.0]


def test_truncated_data_names_the_file_and_the_tensor(tmp_path):
    path = f32_file(tmp_path / "cut.safetensors")
    path.write_bytes(path.read_bytes()[:-4])
    with pytest.raises(ValueError, match=re.escape(
            f"{path}: tensor 'x' data_offsets: expected a byte range within the 8 data bytes "
            "after the header (is the file truncated?); got [0, 12]")):
        SafetensorsFile(path)


def test_header_length_past_the_end(tmp_path):
    path = write_raw(tmp_path / "h.safetensors", {}, length=1000)
    with pytest.raises(ValueError, match=re.escape(f"{path}: header length: expected at most 2")
                       + r".*got 1000"):
        SafetensorsFile(path)
    short = tmp_path / "short.safetensors"
    short.write_bytes(b"\x01\x02")
    with pytest.raises(ValueError, match=re.escape(f"{short}: file size: expected at least 8 "
                                                   "bytes (the header length); got 2 bytes")):
        SafetensorsFile(short)


@pytest.mark.parametrize("raw, got", [
    (b"\xff\xfe{}", "undecodable bytes"),
    (b'{"x": ', "invalid JSON"),
    (b"", "invalid JSON"),
])
def test_header_not_json(tmp_path, raw, got):
    path = write_raw(tmp_path / "j.safetensors", None, header_bytes=raw)
    with pytest.raises(ValueError, match=re.escape(f"{path}: header: expected ") + ".*" + got):
        SafetensorsFile(path)


def test_header_of_the_wrong_structure(tmp_path):
    path = write_raw(tmp_path / "l.safetensors", [1, 2])
    with pytest.raises(ValueError, match="header: expected a JSON object of tensor entries; "
                                         "got a JSON list"):
        SafetensorsFile(path)
    path = write_raw(tmp_path / "m.safetensors", {"__metadata__": [1]})
    with pytest.raises(ValueError, match=r"__metadata__: expected a JSON object; got \[1\]"):
        SafetensorsFile(path)
    path = write_raw(tmp_path / "e.safetensors", {"x": {"dtype": "F32"}})
    with pytest.raises(ValueError, match="tensor 'x': expected an entry with dtype, shape and "
                                         "data_offsets"):
        SafetensorsFile(path)
    path = write_raw(tmp_path / "s.safetensors",
                     {"x": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 0]}})
    with pytest.raises(ValueError, match=r"tensor 'x' shape: expected a list of non-negative "
                                         r"integers; got \[-1\]"):
        SafetensorsFile(path)
    path = write_raw(tmp_path / "o.safetensors",
                     {"x": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}}, b"\0" * 4)
    with pytest.raises(ValueError, match=r"tensor 'x' data_offsets: expected \[begin, end\] "
                                         r"with 0 <= begin <= end; got \[4, 0\]"):
        SafetensorsFile(path)


def test_byte_count_that_does_not_match_the_shape(tmp_path):
    path = write_raw(tmp_path / "b.safetensors",
                     {"x": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 8]}}, b"\0" * 8)
    with pytest.raises(ValueError, match=re.escape(
            f"{path}: tensor 'x' byte count: expected 12 bytes (shape (2, 3) of BF16); got 8 "
            "bytes (data_offsets [0, 8])")):
        SafetensorsFile(path)


def test_unsupported_dtype_is_reported_when_that_tensor_is_read(tmp_path):
    data = np.arange(3, dtype=np.float32).tobytes()
    path = write_raw(tmp_path / "d.safetensors", {
        "x": {"dtype": "F32", "shape": [3], "data_offsets": [0, 12]},
        "c": {"dtype": "C64", "shape": [1], "data_offsets": [12, 20]},
    }, data + b"\0" * 8)
    f = SafetensorsFile(path)
    assert f.read("x").tolist() == [0.0, 1.0, 2.0]
    with pytest.raises(ValueError, match=re.escape(f"{path}: tensor 'c' dtype: expected one of "
                                                   "the dtypes this reader supports [")
                       + r".*got C64"):
        f.read("c")


def test_wrong_argument_types_of_the_reader(tmp_path):
    with pytest.raises(TypeError, match="path: expected a str or os.PathLike"):
        SafetensorsFile(3)
    f = SafetensorsFile(f32_file(tmp_path / "ok.safetensors"))
    with pytest.raises(TypeError, match="name: expected a tensor name"):
        f.read(0)
    with pytest.raises(KeyError, match="no tensor named 'y'"):
        f.shape("y")


def test_shard_files_errors(tmp_path):
    with pytest.raises(ValueError, match=r"location: expected .*non-empty list.*; got \[\]"):
        shard_files([])
    with pytest.raises(TypeError, match=r"location\[1\]: expected a path"):
        shard_files(["a.safetensors", 7])
    with pytest.raises(TypeError, match="location: expected a .safetensors file"):
        shard_files(7)
    with pytest.raises(FileNotFoundError, match="none in it"):
        shard_files(tmp_path)
    with pytest.raises(FileNotFoundError, match="no such file or directory"):
        shard_files(tmp_path / "nope.safetensors")


# --- fp8 weights and their block scales ------------------------------------------------------

ST_CODES = {"float32": "F32", "bfloat16": "BF16", "float8_e4m3fn": "F8_E4M3",
            "float8_e8m0fnu": "F8_E8M0"}


def write_tensors(path, tensors):
    """A .safetensors file of numpy / ml_dtypes arrays (no safetensors package needed)."""
    header, chunks, offset = {}, [], 0
    for name, value in tensors.items():
        raw = np.ascontiguousarray(value).tobytes()
        header[name] = {"dtype": ST_CODES[value.dtype.name], "shape": list(value.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        chunks.append(raw)
        offset += len(raw)
    return write_raw(path, header, b"".join(chunks))


def official_layer(layer=1, kind=LayerKind.CSA):
    return interop.checkpoint_tensors(random_params(MODEL, kind, seed=layer), kind,
                                      "official", f"layers.{layer}.attn.")


def test_fp8_weight_without_its_scale_is_an_error():
    tensors = official_layer()
    name = "layers.1.attn.wq_a.weight"
    tensors[name] = tensors[name].astype(ml_dtypes.float8_e4m3fn)
    with pytest.raises(interop.CheckpointError, match=re.escape(
            f"{name}: expected its block scale layers.1.attn.wq_a.scale or "
            "layers.1.attn.wq_a.weight_scale_inv next to a float8_e4m3fn weight (without it "
            "the weight would load unscaled); got no scale tensor")):
        interop.attention_params(tensors, MODEL, LayerKind.CSA, "official", "layers.1.attn.")
    # With its scale the same tensors load.
    tensors["layers.1.attn.wq_a.scale"] = np.ones((1, 1), ml_dtypes.float8_e8m0fnu)
    got = interop.attention_params(tensors, MODEL, LayerKind.CSA, "official", "layers.1.attn.")
    assert got["q_a_proj"].dtype == np.float32


def test_fp8_tensor_that_carries_no_scale_is_an_error():
    tensors = official_layer()
    tensors["layers.1.attn.attn_sink"] = tensors["layers.1.attn.attn_sink"].astype(
        ml_dtypes.float8_e5m2)
    with pytest.raises(interop.CheckpointError, match=r"layers\.1\.attn\.attn_sink: expected a "
                       r"bf16 / fp16 / fp32 tensor .*; got dtype float8_e5m2"):
        interop.attention_params(tensors, MODEL, LayerKind.CSA, "official", "layers.1.attn.")


def test_fp8_weight_without_scale_in_a_checkpoint_file(tmp_path):
    per_layer = {i: random_params(MODEL, k, seed=i) for i, k in enumerate(MODEL.layer_kinds)}
    tensors = {}
    for layer, params in per_layer.items():
        tensors.update(interop.checkpoint_tensors(params, MODEL.layer_kinds[layer], "official",
                                                  f"layers.{layer}.attn."))
    tensors["layers.2.attn.compressor.wkv.weight"] = tensors[
        "layers.2.attn.compressor.wkv.weight"].astype(ml_dtypes.float8_e4m3fn)
    write_tensors(tmp_path / "model.safetensors", tensors)
    with pytest.raises(interop.CheckpointError, match=re.escape(
            "layer 2 (HCA, shards ['model.safetensors']): layers.2.attn.compressor.wkv.weight: "
            "expected its block scale layers.2.attn.compressor.wkv.scale")):
        interop.read_attention(tmp_path, MODEL)
    assert set(interop.read_attention(tmp_path, MODEL, layers=[0, 1])) == {0, 1}


def test_dequantize_errors():
    w = np.ones((4, 4), ml_dtypes.float8_e4m3fn)
    nan = np.full((1, 1), np.nan, np.float32)
    with pytest.raises(interop.CheckpointError, match=r"w \(scale\): expected finite block "
                                                      r"scales; got nan at block \(0, 0\)"):
        interop.dequantize(w, nan, "w")
    with pytest.raises(interop.CheckpointError, match=r"w \(scale\): expected a floating-point "
                                                      "array; got dtype int32"):
        interop.dequantize(w, np.ones((1, 1), np.int32), "w")
    with pytest.raises(ValueError, match=r"block: expected two positive ints .*; got \(0, 128\)"):
        interop.dequantize(w, np.ones((1, 1), np.float32), "w", block=(0, 128))
    with pytest.raises(TypeError, match="name: expected the weight's name"):
        interop.dequantize(w, np.ones((1, 1), np.float32), None)


# --- converters and names --------------------------------------------------------------------


def test_attention_params_argument_errors():
    tensors = official_layer()
    args = (MODEL, LayerKind.CSA, "official", "layers.1.attn.")
    with pytest.raises(TypeError, match="tensors: expected a mapping of name -> array; got list"):
        interop.attention_params(list(tensors.items()), *args)
    with pytest.raises(TypeError, match="config: expected an AttentionConfig; got dict"):
        interop.attention_params(tensors, {}, *args[1:])
    with pytest.raises(ValueError, match=r"kind: expected a LayerKind \(SWA=0, CSA=1, HCA=2\); "
                                         "got 5"):
        interop.attention_params(tensors, MODEL, 5, "official", "layers.1.attn.")
    with pytest.raises(ValueError, match="kind: expected a LayerKind .*; got 'CSA'"):
        interop.attention_params(tensors, MODEL, "CSA", "official", "layers.1.attn.")
    with pytest.raises(TypeError, match="prefix: expected a str; got 1"):
        interop.attention_params(tensors, MODEL, LayerKind.CSA, "official", 1)
    bad = dict(tensors, **{"layers.1.attn.wkv.weight": np.zeros((32, 64), np.int32)})
    with pytest.raises(interop.CheckpointError, match=r"layers\.1\.attn\.wkv\.weight: expected "
                                                      "a floating-point array; got dtype int32"):
        interop.attention_params(bad, *args)
    bad = dict(tensors, **{"layers.1.attn.wkv.weight": "weights"})
    with pytest.raises(interop.CheckpointError, match=r"wkv\.weight: expected a floating-point "
                                                      r"array; got dtype <U7"):
        interop.attention_params(bad, *args)


def test_checkpoint_tensors_errors():
    params = random_params(MODEL, LayerKind.HCA)
    with pytest.raises(ValueError, match=r"layout: expected one of \('transformers', "
                                         r"'official'\); got 'hf'"):
        interop.checkpoint_tensors(params, LayerKind.HCA, "hf")
    with pytest.raises(interop.CheckpointError, match=r"unknown V4Attention path\(s\) for a HCA "
                                                      r"layer: \['indexer\.q_b_proj'\]"):
        interop.checkpoint_tensors(dict(params, **{"indexer.q_b_proj": np.zeros(1)}),
                                   LayerKind.HCA, "official")
    wrong = dict(params, kv_proj=np.zeros((32, 65), np.float32))
    assert interop.checkpoint_tensors(wrong, LayerKind.HCA, "official")  # no config: no shapes
    with pytest.raises(interop.CheckpointError, match=r"kv_proj has shape \(32, 65\); expected "
                                                      r"\(32, 64\)"):
        interop.checkpoint_tensors(wrong, LayerKind.HCA, "official", config=MODEL)
    with pytest.raises(interop.CheckpointError, match="sinks: expected a floating-point array; "
                                                      "got dtype bool"):
        interop.checkpoint_tensors(dict(params, sinks=np.zeros(4, bool)), LayerKind.HCA,
                                   "official")


def test_module_level_converters_errors():
    from flax import nnx

    from v4kv_jax.nn import V4Attention

    with pytest.raises(TypeError, match=r"module: expected a v4kv_jax\.nn\.V4Attention .*; "
                                        "got dict"):
        interop.attention_state({})
    with pytest.raises(TypeError, match="module: expected a v4kv_jax.nn.V4Attention"):
        interop.load_attention(object(), {})
    module = V4Attention(MODEL, LayerKind.SWA, rngs=nnx.Rngs(0))
    params = random_params(MODEL, LayerKind.SWA)
    with pytest.raises(TypeError, match="params: expected a mapping of name -> array; got list"):
        interop.load_attention(module, list(params))
    with pytest.raises(interop.CheckpointError, match=r"q_a_norm has shape \(31,\); expected "
                                                      r"\(32,\)"):
        interop.load_attention(module, dict(params, q_a_norm=np.ones(31, np.float32)))
    with pytest.raises(interop.CheckpointError, match="q_a_norm: expected a floating-point "
                                                      "array; got dtype int64"):
        interop.load_attention(module, dict(params, q_a_norm=np.ones(32, np.int64)))


def test_decoder_layer_access_errors():
    from flax import nnx

    from v4kv_jax.nn import Decoder, ModelConfig, V4Attention

    model = Decoder(ModelConfig(MODEL, vocab_size=8), rngs=nnx.Rngs(0))
    params = random_params(MODEL, LayerKind.CSA, seed=1)
    interop.load_attention(model, params, layer=3)
    got = interop.attention_state(model, layer=3)
    assert set(got) == set(params)
    for path, value in params.items():
        np.testing.assert_array_equal(got[path], value, err_msg=path)
    with pytest.raises(ValueError, match=r"layer: expected a layer index in \[0, 5\) \(module "
                                         r"is a Decoder\); got None"):
        interop.attention_state(model)
    with pytest.raises(ValueError, match=r"layer: expected a layer index in \[0, 5\)"):
        interop.load_attention(model, params)
    with pytest.raises(TypeError, match=r"module: expected a v4kv_jax\.nn\.Decoder \(layer= "
                                        r"picks one of its layers\); got V4Attention"):
        interop.attention_state(V4Attention(MODEL, LayerKind.CSA, rngs=nnx.Rngs(0)), layer=1)
    with pytest.raises(TypeError, match=r"model: expected a v4kv_jax\.nn\.Decoder"):
        interop.set_norms({}, layer=0, attn_norm=np.ones(MODEL.hidden_size))
    with pytest.raises(ValueError, match=r"layer=5 must be in \[0, 5\)"):
        interop.attention_state(model, layer=5)
    with pytest.raises(TypeError, match="layer: expected an integer; got 1.5"):
        interop.load_attention(model, params, layer=1.5)
    with pytest.raises(interop.CheckpointError, match=r"params for a HCA layer \(layer 2\) "
                                                      "must be exactly"):
        interop.load_attention(model, params, layer=2)
    with pytest.raises(ValueError, match=r"norm weight of layer 0 has shape \(3,\); expected "
                                         r"\(64,\)"):
        interop.set_norms(model, layer=0, attn_norm=np.ones(3))
    with pytest.raises(ValueError, match="layer 4 has no MLP"):
        interop.set_norms(model, layer=4, mlp_norm=np.ones(MODEL.hidden_size))
    with pytest.raises(TypeError, match="positional argument"):
        interop.set_norms(model, 0, np.ones(MODEL.hidden_size))


def test_names_errors():
    with pytest.raises(TypeError, match="config: expected an AttentionConfig; got NoneType"):
        names.expected_shapes(None, LayerKind.CSA)
    with pytest.raises(ValueError, match=r"kind: expected a LayerKind .*; got 1\.0"):
        names.expected_shapes(MODEL, 1.0)
    with pytest.raises(ValueError, match="kind: expected a LayerKind .*; got 7"):
        names.names_for(7)
    assert names.names_for(1) == names.names_for(LayerKind.CSA)
    with pytest.raises(ValueError, match="layout: expected one of .*; got 'hf'"):
        names.TABLE[0].name("hf")
    with pytest.raises(ValueError, match="layout: expected one of .*; got 'hf'"):
        interop.layer_prefix("hf", 0)
    with pytest.raises(ValueError, match=r"layer: expected an integer in \[0, inf\]; got -1"):
        interop.layer_prefix("official", -1)
    with pytest.raises(TypeError, match=r"layer: expected an integer; got '3' \(str\)"):
        interop.layer_prefix("official", "3")


# --- whole checkpoints -----------------------------------------------------------------------


def write_checkpoint(tmp_path, layout="official"):
    per_layer = {i: random_params(MODEL, k, seed=i) for i, k in enumerate(MODEL.layer_kinds)}
    path = tmp_path / "model.safetensors"
    tensors = {}
    for layer, params in per_layer.items():
        tensors.update(interop.checkpoint_tensors(params, MODEL.layer_kinds[layer], layout,
                                                  names.layer_prefix(layout, layer)))
    write_tensors(path, tensors)
    return path, per_layer


def test_read_attention_argument_errors(tmp_path):
    path, _ = write_checkpoint(tmp_path)
    with pytest.raises(ValueError, match=r"layers: expected layer indices in \[0, 5\) \(the "
                                         r"config's 5 layers\); got \[5, 9\]"):
        interop.read_attention(path, MODEL, layers=[0, 5, 9])
    with pytest.raises(ValueError, match=r"layers: expected at least one layer index .*; "
                                         r"got \[\]"):
        interop.read_attention(path, MODEL, layers=[])
    with pytest.raises(TypeError, match=r"layers: expected an integer; got '1' \(str\)"):
        interop.read_attention(path, MODEL, layers=["1"])
    with pytest.raises(TypeError, match="layers: expected an iterable of layer indices; got 3"):
        interop.read_attention(path, MODEL, layers=3)
    with pytest.raises(TypeError, match="config: expected an AttentionConfig; got dict"):
        interop.read_attention(path, {"hidden_size": 64})
    with pytest.raises(ValueError, match="layout: expected one of .*; got 'hf'"):
        interop.read_attention(path, MODEL, layout="hf")
    with pytest.raises(FileNotFoundError, match="no such file or directory"):
        interop.read_attention(tmp_path / "nope", MODEL)


def test_detect_layout_arguments(tmp_path):
    write_checkpoint(tmp_path, "transformers")
    assert interop.detect_layout(tmp_path) == "transformers"
    assert interop.detect_layout(str(tmp_path / "model.safetensors")) == "transformers"
    with pytest.raises(TypeError, match="files: expected .safetensors paths .*; got int"):
        interop.detect_layout(5)
    with pytest.raises(ValueError, match=r"location: expected .*; got \[\]"):
        interop.detect_layout([])
    with pytest.raises(TypeError, match="file: expected a SafetensorsFile; got str"):
        interop.checkpoint.attention_names("model.safetensors", "official")


def test_load_into_and_write_attention_errors(tmp_path):
    from flax import nnx

    from v4kv_jax.nn import Decoder, ModelConfig

    params = {i: random_params(MODEL, k, seed=i) for i, k in enumerate(MODEL.layer_kinds)}
    model = Decoder(ModelConfig(MODEL, vocab_size=8), rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match=r"model: expected a v4kv_jax\.nn\.Decoder; got dict"):
        interop.load_into({}, params)
    with pytest.raises(TypeError, match="per_layer: expected a mapping .*; got list"):
        interop.load_into(model, [params[0]])
    with pytest.raises(ValueError, match=r"per_layer key: expected an integer in \[0, 4\]; "
                                         "got 5"):
        interop.load_into(model, {5: params[0]})
    with pytest.raises(TypeError, match=r"per_layer\[0\]: expected a mapping .*; got list"):
        interop.load_into(model, {0: [1]})
    out = tmp_path / "out.safetensors"
    bad = {**params, 2: {**params[2], "compressor.ape": np.zeros((3, 32), np.float32)}}
    with pytest.raises(interop.CheckpointError, match=r"per_layer\[2\]: compressor\.ape has "
                                                      r"shape \(3, 32\); expected \(16, 32\)"):
        interop.write_attention(out, bad, MODEL, "official")
    with pytest.raises(ValueError, match="layout: expected one of .*; got 'hf'"):
        interop.write_attention(out, params, MODEL, "hf")
    with pytest.raises(TypeError, match="path: expected a str or os.PathLike; got 1"):
        interop.write_attention(1, params, MODEL, "official")
    assert not out.exists()


# --- config.json mapping ---------------------------------------------------------------------

OFFICIAL_JSON = {
    "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32,
    "qk_rope_head_dim": 8, "q_lora_rank": 32, "o_groups": 2, "o_lora_rank": 16,
    "sliding_window": 16, "num_hidden_layers": 5, "compress_ratios": [0, 4, 16, 4, 16, 0],
    "index_n_heads": 16, "index_head_dim": 16, "index_topk": 8, "rope_theta": 10000,
    "compress_rope_theta": 160000, "rms_norm_eps": 1e-6,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                     "beta_fast": 32, "beta_slow": 1},
}
HF_JSON = {k: v for k, v in OFFICIAL_JSON.items() if k not in ("compress_ratios", "rope_scaling")}
HF_JSON.update(
    layer_types=["sliding_attention", "compressed_sparse_attention",
                 "heavily_compressed_attention", "compressed_sparse_attention",
                 "heavily_compressed_attention"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    rope_parameters={"main": {"rope_type": "default", "rope_theta": 10000},
                     "compress": {"rope_type": "yarn", "factor": 16, "rope_theta": 160000,
                                  "original_max_position_embeddings": 65536,
                                  "beta_fast": 32, "beta_slow": 1, "attention_factor": 1.0}})


def from_json(base, **changes):
    d = {k: v for k, v in base.items() if k not in changes or changes[k] is not ...}
    d.update({k: v for k, v in changes.items() if v is not ...})
    return interop.attention_config_from_hf(d)


def test_both_config_forms_map_to_the_same_config():
    assert from_json(OFFICIAL_JSON) == MODEL
    assert from_json(HF_JSON) == MODEL
    # Without the MTP entry, and with the thetas only in the nested rope parameters.
    assert from_json(OFFICIAL_JSON, compress_ratios=[0, 4, 16, 4, 16]) == MODEL
    nested = HF_JSON["rope_parameters"]
    thetas = {"main": dict(nested["main"], rope_theta=5000),
              "compress": dict(nested["compress"], rope_theta=7000)}
    assert from_json(HF_JSON, rope_theta=..., compress_rope_theta=..., rope_parameters=thetas
                     ) == v4.tiny(index_heads=16, rope_theta=5000.0, compress_rope_theta=7000.0)


@pytest.mark.parametrize("length", [4, 7])
def test_compress_ratios_of_the_wrong_length(length):
    ratios = ([0, 4, 16, 4, 16, 0, 0])[:length]
    with pytest.raises(ValueError, match=re.escape(
            "compress_ratios: expected num_hidden_layers=5 entries, or 6 with the trailing MTP "
            f"entry of the official checkpoint; got {length} entries")):
        from_json(OFFICIAL_JSON, compress_ratios=ratios)


def test_layer_lists_that_disagree():
    with pytest.raises(ValueError, match=r"layer_types: expected one entry per layer "
                                         r"\(num_hidden_layers=4\); got 5 entries"):
        from_json(HF_JSON, num_hidden_layers=4)
    with pytest.raises(ValueError, match=r"num_hidden_layers: expected an integer >= 1 next to "
                                         r"compress_ratios .*; got no such entry"):
        from_json(OFFICIAL_JSON, num_hidden_layers=...)
    with pytest.raises(ValueError, match=r"compress_ratios: expected the ratios layer_types "
                                         r"gives \(\[0, 4, 16, 4, 16\]\); "
                                         r"got \[0, 4, 16, 16, 16\]"):
        from_json(HF_JSON, compress_ratios=[0, 4, 16, 16, 16, 0])
    with pytest.raises(ValueError,
                       match=r"layer_types: expected values in .*; got 'full_attention'"):
        from_json(HF_JSON, layer_types=["full_attention"] * 5)
    with pytest.raises(ValueError, match=r"compress_ratios: expected at most two distinct "
                                         r"non-zero ratios .*; got \[4, 8, 16\]"):
        from_json(OFFICIAL_JSON, compress_ratios=[0, 4, 16, 8, 16])
    with pytest.raises(ValueError, match=r"compress_ratios\[1\]: expected an integer in \[0, "
                                         r"inf\]; got -4"):
        from_json(OFFICIAL_JSON, compress_ratios=[0, -4, 16, 4, 16])
    with pytest.raises(ValueError, match="config: expected layer_types .* or compress_ratios "
                                         ".*; got neither"):
        from_json(HF_JSON, layer_types=...)
    with pytest.raises(ValueError, match=r"compress_rates: expected keys .*; got \['csa'\]"):
        from_json(HF_JSON, compress_rates={"csa": 4})


@pytest.mark.parametrize("rope, where, got", [
    ({"type": "linear", "factor": 2.0}, "rope_scaling type", "'linear'"),
    ({"rope_type": "llama3", "factor": 8.0}, "rope_scaling rope_type", "'llama3'"),
])
def test_unsupported_rope_scaling(rope, where, got):
    with pytest.raises(ValueError, match=re.escape(
            f"{where}: expected one of ('default', 'yarn') (the RoPE scalings V4 attention "
            f"supports); got {got}")):
        from_json(OFFICIAL_JSON, rope_scaling=rope)


def test_rope_parameters_errors():
    nested = HF_JSON["rope_parameters"]
    with pytest.raises(ValueError, match=r"rope_parameters\['main'\] rope_type: expected "
                                         r"'default' .*; got 'yarn'"):
        from_json(HF_JSON, rope_parameters=dict(nested, main={"rope_type": "yarn"}))
    with pytest.raises(ValueError, match=r"rope_parameters\['compress'\] rope_type: expected "
                                         r"one of .*; got 'dynamic'"):
        from_json(HF_JSON, rope_parameters=dict(nested, compress={"rope_type": "dynamic"}))
    with pytest.raises(ValueError, match=r"rope_scaling: expected a 'factor' entry .*; got none "
                                         r"among its keys \['type'\]"):
        from_json(OFFICIAL_JSON, rope_scaling={"type": "yarn"})
    with pytest.raises(ValueError, match=r"rope_scaling factor: expected a YaRN factor >= 1; "
                                         r"got 0\.5"):
        from_json(OFFICIAL_JSON, rope_scaling={"type": "yarn", "factor": 0.5})
    with pytest.raises(ValueError, match=r"rope_scaling attention_factor: expected 1\.0 .*; "
                                         r"got 1\.2"):
        from_json(OFFICIAL_JSON, rope_scaling={"type": "yarn", "factor": 4,
                                               "attention_factor": 1.2})
    with pytest.raises(ValueError, match=r"rope_theta: expected the same value as "
                                         r"rope_parameters\['main'\] rope_theta=10000\.0; "
                                         r"got 5000\.0"):
        from_json(HF_JSON, rope_theta=5000)
    with pytest.raises(TypeError, match="rope_scaling: expected a JSON object"):
        from_json(OFFICIAL_JSON, rope_scaling="yarn")


def test_sliding_window_and_other_fields():
    with pytest.raises(ValueError, match="sliding_window: expected a positive integer: every V4 "
                                         "layer attends through a sliding window; got None"):
        from_json(OFFICIAL_JSON, sliding_window=None)
    with pytest.raises(ValueError, match=r"sliding_window: expected an integer in \[1, inf\]; "
                                         r"got 0"):
        from_json(OFFICIAL_JSON, sliding_window=0)
    with pytest.raises(ValueError, match=r"config: expected a 'o_groups' entry .*; got none "
                                         r"among its keys \["):
        from_json(OFFICIAL_JSON, o_groups=...)
    with pytest.raises(TypeError, match=r"hidden_size: expected an integer >= 1; got 64\.5 "
                                        r"\(float\)"):
        from_json(OFFICIAL_JSON, hidden_size=64.5)
    with pytest.raises(TypeError, match=r"index_topk: expected an integer >= 1; got '8' \(str\)"):
        from_json(OFFICIAL_JSON, index_topk="8")
    with pytest.raises(ValueError, match=r"rms_norm_eps: expected a number in \(0\.0, inf\]; "
                                         r"got -1e-06"):
        from_json(OFFICIAL_JSON, rms_norm_eps=-1e-6)
    with pytest.raises(ValueError, match=r"partial_rotary_factor: expected a whole number of "
                                         r"rope dims out of head_dim=32; got 0\.1 "):
        from_json(OFFICIAL_JSON, qk_rope_head_dim=..., partial_rotary_factor=0.1)
    with pytest.raises(ValueError, match=r"qk_rope_head_dim: expected head_dim x "
                                         r"partial_rotary_factor = 16; got 8"):
        from_json(OFFICIAL_JSON, partial_rotary_factor=0.5)
    with pytest.raises(TypeError, match="d: expected a config.json dict .*; got str"):
        interop.attention_config_from_hf("config.json")
    with pytest.raises(TypeError, match=r"overrides: expected AttentionConfig fields .*; "
                                        r"got \['windw'\]"):
        interop.attention_config_from_hf(OFFICIAL_JSON, windw=8)
    with pytest.raises(TypeError, match="config: expected an AttentionConfig; got dict"):
        interop.transformers_config_kwargs(OFFICIAL_JSON)


# --- transformers side by side ---------------------------------------------------------------


def test_torch_reference_argument_errors():
    pytest.importorskip("transformers")
    from v4kv_jax.interop.torch_reference import TransformersAttention

    with pytest.raises(TypeError, match="config: expected an AttentionConfig; got dict"):
        TransformersAttention({})
    with pytest.raises(ValueError, match=r"residual: expected True for a config of several "
                                         r"layers .*; got False with 5 layers"):
        TransformersAttention(MODEL, residual=False)
    ref = TransformersAttention(MODEL)
    with pytest.raises(ValueError, match=r"layer: expected an integer in \[0, 4\]; got 5"):
        ref.state_dict(5)
    with pytest.raises(ValueError, match=r"layer: expected an integer in \[0, 4\]; got -1"):
        ref.attention_params(-1)
    with pytest.raises(TypeError, match=r"seed: expected an integer; got 0\.5 \(float\)"):
        ref.randomize(seed=0.5)
    params = random_params(MODEL, LayerKind.SWA)
    with pytest.raises(interop.CheckpointError, match=r"q_a_proj has shape \(32, 63\); "
                                                      r"expected \(32, 64\)"):
        ref.load(0, dict(params, q_a_proj=np.zeros((32, 63), np.float32)))
    with pytest.raises(ValueError, match=r"norm: expected shape \(64\); got shape \(63,\)"):
        ref.load(0, params, norm=np.ones(63, np.float32))
    x = np.zeros((1, 4, 63), np.float32)
    with pytest.raises(ValueError, match=r"x: expected shape \(\*, \*, 64\); got shape "
                                         r"\(1, 4, 63\)"):
        ref.forward(x, ref.new_cache(), 0)
    x = np.zeros((1, 4, 64), np.float32)
    with pytest.raises(ValueError, match=r"start: expected an integer in \[0, inf\]; got -2"):
        ref.forward(x, ref.new_cache(), -2)
    with pytest.raises(ValueError, match=r"chunks: expected an integer in \[1, inf\]; got 0"):
        ref.run_chunks(x, [2, 0, 2])
    with pytest.raises(ValueError, match=r"chunks: expected sizes summing to at most x's 4 "
                                         r"positions; got \[3, 3\] \(sum 6\)"):
        ref.run_chunks(x, [3, 3])


def test_small_converter_helpers_errors():
    from flax import nnx

    from v4kv_jax.interop import convert
    from v4kv_jax.nn import V4Attention

    module = V4Attention(MODEL, LayerKind.SWA, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"path: expected a param path of the V4Attention \(it "
                                         r"has no 'indexer\.q_b_proj'\); got 'indexer\.q_b_proj'"):
        convert.param_at(module, "indexer.q_b_proj")
    with pytest.raises(TypeError, match="path: expected a dot-separated param path"):
        convert.param_at(module, 3)
    with pytest.raises(TypeError, match="weight_name: expected a tensor name"):
        convert.scale_name(None, {})
    with pytest.raises(TypeError, match="tensors: expected a mapping"):
        convert.scale_name("w.weight", ["w.scale"])
    assert convert.scale_name("w.weight", {"w.scale": 1}) == "w.scale"
