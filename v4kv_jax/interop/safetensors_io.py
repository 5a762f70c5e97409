"""Reading tensors from safetensors files, one tensor at a time, in every dtype V4 ships.

The format is an 8-byte little-endian header length, a JSON header
(`name -> {"dtype", "shape", "data_offsets": [begin, end]}`, plus `__metadata__`) and the raw
little-endian data. This reader memory-maps the file and copies out only the tensors asked
for, so loading the attention weights of a shard never reads its MoE experts. bf16 and the
fp8 formats of the official checkpoint (e4m3 weights, e8m0 scales) come back as `ml_dtypes`
arrays, which numpy-only readers cannot produce.
"""

from __future__ import annotations

import json
import os
import struct

import ml_dtypes
import numpy as np

_DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
    "I64": np.dtype(np.int64), "I32": np.dtype(np.int32), "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}


class SafetensorsFile:
    """The header of one .safetensors file, and on-demand reads of its tensors.

    Args:
      path: the file.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        with open(self.path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise ValueError(f"{self.path}: not a safetensors file (shorter than 8 bytes)")
            (n,) = struct.unpack("<Q", raw)
            size = os.path.getsize(self.path)
            if n > size - 8:
                raise ValueError(f"{self.path}: header length {n} exceeds the file size {size}")
            header = json.loads(f.read(n))
        self.metadata = header.pop("__metadata__", None) or {}
        self._header = header
        self._data_start = 8 + n

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
        if code not in _DTYPES:
            raise ValueError(f"{self.path}: tensor {name!r} has dtype {code}, which this reader "
                             f"does not support ({sorted(_DTYPES)})")
        dtype = _DTYPES[code]
        begin, end = entry["data_offsets"]
        shape = tuple(entry["shape"])
        count = int(np.prod(shape, dtype=np.int64))
        if end - begin != count * dtype.itemsize:
            raise ValueError(f"{self.path}: tensor {name!r} holds {end - begin} bytes; its shape "
                             f"{shape} and dtype {code} need {count * dtype.itemsize}")
        if count == 0:
            return np.zeros(shape, dtype)
        mm = np.memmap(self.path, dtype=np.uint8, mode="r", offset=self._data_start + begin,
                       shape=(end - begin,))
        return np.array(mm.view(dtype.newbyteorder("<")).reshape(shape), dtype=dtype)

    def _entry(self, name: str) -> dict:
        try:
            return self._header[name]
        except KeyError:
            raise KeyError(f"{self.path}: no tensor named {name!r}") from None


def shard_files(location: str | os.PathLike | list) -> list[str]:
    """The .safetensors files of a checkpoint: a list of files, one file, or a directory
    (every *.safetensors in it, sorted)."""
    if isinstance(location, (list, tuple)):
        return [os.fspath(p) for p in location]
    location = os.fspath(location)
    if os.path.isdir(location):
        files = sorted(os.path.join(location, f) for f in os.listdir(location)
                       if f.endswith(".safetensors"))
        if not files:
            raise FileNotFoundError(f"no .safetensors files in {location}")
        return files
    if not os.path.exists(location):
        raise FileNotFoundError(location)
    return [location]
