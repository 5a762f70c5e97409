"""Bad input to every public entry point of `v4kv_jax.interop` raises an error that names the
argument (or the file and tensor), what was expected and what was given."""

from __future__ import annotations

import json
import re
import struct

import numpy as np
import pytest

import v4kv_jax as v4
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
