"""How a row is stored: the one codec of the cache.

Every write of a stored row (compressor emission into the Classical pool, window and tail
writes into the State pool) goes through `encode`, every read through `decode`; the Pallas
kernels widen what they load the same way. Formats today are plain floating dtypes
("float32", "bfloat16", "float16": `encode` rounds to the dtype, `decode` widens to fp32);
packed formats add their layout and scales here and nowhere else.

Layout of a stored row of `width` values in format `fmt`: [..., width] of `dtype(fmt)`,
`row_bytes(width, fmt)` bytes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from v4kv_jax.config import STORAGE_FORMATS


def dtype(fmt: str) -> jnp.dtype:
    """The array dtype rows of format `fmt` are stored in."""
    if fmt not in STORAGE_FORMATS:
        raise ValueError(f"fmt: expected one of {STORAGE_FORMATS}; got {fmt!r}")
    return jnp.dtype(fmt)


def encode(values: jax.Array, stored: jax.Array) -> jax.Array:
    """`values` (any float dtype, [..., width]) in the format of the array `stored`."""
    return values.astype(stored.dtype)


def decode(stored: jax.Array) -> jax.Array:
    """f32 values of stored rows."""
    return stored.astype(jnp.float32)


def row_bytes(width: int, fmt: str) -> int:
    """Bytes of one stored row of `width` values."""
    return width * int(np.dtype(dtype(fmt)).itemsize)


__all__ = ["decode", "dtype", "encode", "row_bytes"]
