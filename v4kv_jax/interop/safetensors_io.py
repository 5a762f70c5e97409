"""Reading tensors from safetensors files, one tensor at a time, in every dtype V4 ships.

The format is an 8-byte little-endian header length, a JSON header
(`name -> {"dtype", "shape", "data_offsets": [begin, end]}`, plus `__metadata__`) and the raw
little-endian data. This reader memory-maps the file and copies out only the tensors asked
for, so loading the attention weights of a shard never reads its MoE experts. bf16 and the
fp8 formats of the official checkpoint (e4m3 weights, e8m0 scales) come back as `ml_dtypes`
arrays, which numpy-only readers cannot produce. "F4" (e2m1, two values a byte, the even
element in the low nibble, as torch's `float4_e2m1fn_x2` saves: the header's shape counts
values, not bytes; DeepSeek-V4.1's fp4 weights) comes back unpacked as `float4_e2m1fn`, one
value an element, in the header's shape.
"""

from __future__ import annotations

import json
import math
import os
import struct

import ml_dtypes
import numpy as np

from v4kv_jax import checks

_DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
    "I64": np.dtype(np.int64), "I32": np.dtype(np.int32), "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
# Dtypes of fewer than 8 bits: code -> (the unpacked numpy dtype, values a byte).
_PACKED = {"F4": (np.dtype(ml_dtypes.float4_e2m1fn), 2)}


class SafetensorsFile:
    """The header of one .safetensors file, and on-demand reads of its tensors.

    The whole header is checked when the file is opened: a truncated or corrupt file raises a
    `ValueError` naming the file and what is wrong (a header length past the end of the file,
    a header that is not a JSON object of tensor entries, a tensor whose byte range runs past
    the end or does not match its shape and dtype). A dtype this reader does not support is
    reported when that tensor is read, so the other tensors of the file stay readable.

    Args:
      path: the file.
    """

    def __init__(self, path: str | os.PathLike):
        if not isinstance(path, (str, os.PathLike)):
            checks.fail("path", "a str or os.PathLike naming a .safetensors file", path,
                        TypeError)
        self.path = os.fspath(path)
        size = os.path.getsize(self.path)
        with open(self.path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                self._fail("file size", "at least 8 bytes (the header length)",
                           f"{size} bytes")
            (n,) = struct.unpack("<Q", raw)
            if n > size - 8:
                self._fail("header length", f"at most {size - 8}, the bytes after the 8-byte "
                           "length field (a truncated file, or not a safetensors file)", n)
            text = f.read(n)
        try:
            header = json.loads(text.decode("utf-8"))
        except UnicodeDecodeError as err:
            self._fail("header", "UTF-8 JSON", f"undecodable bytes ({err.reason} at byte "
                       f"{8 + err.start}); not a safetensors file, or a corrupt one")
        except json.JSONDecodeError as err:
            self._fail("header", "a JSON object", f"invalid JSON ({err.msg} at byte "
                       f"{8 + err.pos} of the file)")
        if not isinstance(header, dict):
            self._fail("header", "a JSON object of tensor entries",
                       f"a JSON {type(header).__name__}")
        metadata = header.pop("__metadata__", None)
        if metadata is not None and not isinstance(metadata, dict):
            self._fail("__metadata__", "a JSON object", metadata)
        self.metadata = metadata or {}
        self._data_start = 8 + n
        data_bytes = size - self._data_start
        for name, entry in header.items():
            _check_entry(self._fail, name, entry, data_bytes)
        self._header = header

    def _fail(self, what: str, expected: str, got) -> None:
        checks.fail(f"{self.path}: {what}", expected, got)

    def names(self) -> list[str]:
        return list(self._header)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entry(name)["shape"])

    def dtype(self, name: str) -> str:
        """The safetensors dtype code, e.g. "F32", "BF16", "F8_E4M3"."""
        return self._entry(name)["dtype"]

    def read(self, name: str) -> np.ndarray:
        """A copy of tensor `name` as a numpy array of its stored dtype."""
        entry = self._entry(name)
        code = entry["dtype"]
        if code not in _DTYPES and code not in _PACKED:
            self._fail(f"tensor {name!r} dtype", f"one of the dtypes this reader supports "
                       f"{sorted([*_DTYPES, *_PACKED])}", code)
        dtype = _DTYPES[code] if code in _DTYPES else _PACKED[code][0]
        begin, end = entry["data_offsets"]
        shape = tuple(entry["shape"])
        if math.prod(shape) == 0:
            return np.zeros(shape, dtype)
        mm = np.memmap(self.path, dtype=np.uint8, mode="r", offset=self._data_start + begin,
                       shape=(end - begin,))
        if code in _PACKED:  # the even value in the low nibble
            nibbles = np.stack([mm & 0xF, mm >> 4], axis=-1).reshape(-1)
            return nibbles[:math.prod(shape)].view(dtype).reshape(shape)
        return np.array(mm.view(dtype.newbyteorder("<")).reshape(shape), dtype=dtype)

    def _entry(self, name: str) -> dict:
        if not isinstance(name, str):
            checks.fail("name", "a tensor name (str)", name, TypeError)
        try:
            return self._header[name]
        except KeyError:
            raise KeyError(f"{self.path}: no tensor named {name!r} (the file holds "
                           f"{len(self._header)} tensors)") from None


def _check_entry(fail, name: str, entry, data_bytes: int) -> None:
    """Checks one header entry: its keys and types, a byte range inside the data section,
    and (for a supported dtype) a byte count equal to the shape's."""
    where = f"tensor {name!r}"
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= set(entry):
        fail(where, "an entry with dtype, shape and data_offsets", entry)
    code, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(code, str):
        fail(f"{where} dtype", "a dtype code (str)", code)
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        fail(f"{where} shape", "a list of non-negative integers", shape)
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(map(_is_count, offsets))
            or offsets[0] > offsets[1]):
        fail(f"{where} data_offsets", "[begin, end] with 0 <= begin <= end", offsets)
    if offsets[1] > data_bytes:
        fail(f"{where} data_offsets", f"a byte range within the {data_bytes} data bytes after "
             "the header (is the file truncated?)", offsets)
    if code in _DTYPES or code in _PACKED:
        count = math.prod(shape)
        need = (count * _DTYPES[code].itemsize if code in _DTYPES
                else -(-count // _PACKED[code][1]))
        if offsets[1] - offsets[0] != need:
            fail(f"{where} byte count", f"{need} bytes (shape {tuple(shape)} of {code})",
                 f"{offsets[1] - offsets[0]} bytes (data_offsets {offsets})")


def save_tensors(path: str | os.PathLike, tensors: dict[str, np.ndarray]) -> None:
    """Writes `tensors` to a .safetensors file in their own dtypes (every dtype `read`
    returns, `float4_e2m1fn` packed as "F4"), so the reader reads them back bit for bit
    (the `safetensors` package's numpy writer takes none of the ml_dtypes ones)."""
    if not isinstance(path, (str, os.PathLike)):
        checks.fail("path", "a str or os.PathLike", path, TypeError)
    codes = {dtype: code for code, dtype in _DTYPES.items()}
    codes.update({dtype: code for code, (dtype, _) in _PACKED.items()})
    header, blobs, offset = {}, [], 0
    for name, value in sorted(tensors.items()):
        if not isinstance(name, str):
            checks.fail("tensors", "a mapping of str names to arrays", repr(name), TypeError)
        array = np.ascontiguousarray(value)
        if array.dtype not in codes:
            checks.fail(f"tensors[{name!r}]", f"an array of one of the dtypes "
                        f"{sorted(map(str, codes))}", f"dtype {array.dtype}", TypeError)
        code = codes[array.dtype]
        if code in _PACKED:  # two values a byte, the even one in the low nibble
            nibbles = array.reshape(-1).view(np.uint8) & 0xF
            nibbles = np.concatenate([nibbles, np.zeros(nibbles.size % 2, np.uint8)])
            blob = (nibbles[0::2] | (nibbles[1::2] << 4)).tobytes()
        else:
            blob = array.astype(array.dtype.newbyteorder("<")).tobytes()
        header[name] = {"dtype": code, "shape": list(array.shape),
                        "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(os.fspath(path), "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for blob in blobs:
            f.write(blob)


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def shard_files(location: str | os.PathLike | list) -> list[str]:
    """The .safetensors files of a checkpoint: a list of files, one file, or a directory
    (every *.safetensors in it, sorted)."""
    if isinstance(location, (list, tuple)):
        if not location:
            checks.fail("location", "a .safetensors file, a non-empty list of them or a "
                        "directory", location)
        for i, p in enumerate(location):
            if not isinstance(p, (str, os.PathLike)):
                checks.fail(f"location[{i}]", "a path (str or os.PathLike)", p, TypeError)
        return [os.fspath(p) for p in location]
    if not isinstance(location, (str, os.PathLike)):
        checks.fail("location", "a .safetensors file, a list of them or a directory (str or "
                    "os.PathLike)", location, TypeError)
    location = os.fspath(location)
    if os.path.isdir(location):
        files = sorted(os.path.join(location, f) for f in os.listdir(location)
                       if f.endswith(".safetensors"))
        if not files:
            raise FileNotFoundError(f"location: expected a directory holding .safetensors "
                                    f"files; got {location} (none in it)")
        return files
    if not os.path.exists(location):
        raise FileNotFoundError(f"location: expected an existing file or directory; got "
                                f"{location} (no such file or directory)")
    return [location]
