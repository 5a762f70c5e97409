"""Writes of the cache's stored arrays that a TPU kernel makes in place (`put_records`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from v4kv_jax import checks, pools, programs
from v4kv_jax.config import Options
from v4kv_jax.config import options_or_default as _options
from v4kv_jax.ops.choice import record_writer, resolve


def put_records(stored, index: tuple, record, values, options: Options | None = None):
    """`stored.put(index, record, values)` where no two records share a block: a decode
    step's row of each (layer, slot) window ring or compressor tail. `stored` may be a tuple
    of arrays of the same blocks and records a block (a tail's kv and gate), `values` then a
    tuple of their rows: one write of all of them, the same tuple returned.

    On a TPU a kernel (`pallas_kernels.records`) copies each record's lane rows in, merges
    the record and copies them back, the planes aliased: XLA:TPU's scatter would bring every
    plane into VMEM and back around the write. Elsewhere, and with implementation
    "reference" or "pallas_gpu", `Lanes.put`. With `Options.interpret` the kernel runs in
    interpret mode where the TPU's would run ("pallas_tpu", or "auto" on a TPU). The
    results are the same bits either way.
    """
    options = _options(options)
    several = isinstance(stored, tuple)
    arrays = stored if several else (stored,)
    rows_of = tuple(values) if several else (values,)
    for a in arrays:
        if not isinstance(a, pools.Lanes):
            checks.fail("stored", "a pools.Lanes (or a tuple of them)", type(a).__name__,
                        TypeError)
    for a, v in zip(arrays, rows_of, strict=False):
        if np.shape(v)[-1:] != (a.map.words,):
            checks.fail("values", f"rows of {a.map.words} words [..., {a.map.words}]",
                        f"shape {np.shape(v)}")
    if len(rows_of) != len(arrays) or len({(a.lead, a.map.records) for a in arrays}) != 1:
        checks.fail("stored, values", "arrays of the same blocks and records a block, and one "
                    "array of rows each", f"blocks {[(a.lead, a.map.records) for a in arrays]} "
                    f"and {len(rows_of)} arrays of rows")

    def reference():
        out = tuple(a.put(index, record, v) for a, v in zip(arrays, rows_of, strict=True))
        return out if several else out[0]

    impl = options.implementation
    if impl in ("reference", "pallas_gpu") or (
            options.interpret and resolve(impl, interpret=True) != "pallas_tpu"):
        return reference()
    index = tuple(jnp.asarray(i, jnp.int32) for i in index)
    record = jnp.asarray(record, jnp.int32)
    shape = jnp.broadcast_shapes(*(i.shape for i in index), record.shape)
    # One array of every array's words: each array's parts shifted past the words before it.
    parts, words, first = [], [], 0
    for a, v in zip(arrays, rows_of, strict=True):
        w = a.map.words
        parts += [(f + first, n, slot, rows) for f, n, slot, rows in a.map.spec[1]]
        v = jnp.broadcast_to(jnp.asarray(v).astype(a.dtype), (*shape, w)).reshape(-1, w)
        words.append(jax.lax.bitcast_convert_type(v, jnp.uint32))
        first += w
    spec = (arrays[0].map.records, tuple(parts))

    def kernel(interpret: bool):
        lead = jnp.stack([jnp.broadcast_to(i, shape).reshape(-1) for i in index], axis=1)
        planes = record_writer()(
            tuple(x for a in arrays for x in a.planes), lead,
            jnp.broadcast_to(record, shape).reshape(-1), jnp.concatenate(words, axis=1),
            lanes_spec=spec, interpret=interpret)
        out, k = [], 0
        for a in arrays:
            out.append(pools.Lanes(tuple(planes[k:k + len(a.planes)]), a.map))
            k += len(a.planes)
        return tuple(out) if several else out[0]

    if options.interpret:
        return kernel(True)
    return programs.platform_dependent(tpu=lambda: kernel(False), default=reference)


__all__ = ["put_records"]
