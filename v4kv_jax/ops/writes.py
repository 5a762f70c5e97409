"""Writes of the cache's stored arrays that a TPU kernel makes in place (`put_records`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from v4kv_jax import pools, programs
from v4kv_jax.config import Options
from v4kv_jax.config import options_or_default as _options
from v4kv_jax.ops.choice import record_writer, resolve


def put_records(stored: pools.Lanes, index: tuple, record, values: jax.Array,
                options: Options | None = None) -> pools.Lanes:
    """`stored.put(index, record, values)` where no two records share a block: a decode
    step's row of each (layer, slot) window ring or compressor tail.

    On a TPU a kernel (`pallas_kernels.records`) copies each record's lane rows in, merges
    the record and copies them back, the planes aliased: XLA:TPU's scatter would bring every
    plane into VMEM and back around the write. Elsewhere, and with implementation
    "reference" or "pallas_gpu", `Lanes.put`. With `Options.interpret` the kernel runs in
    interpret mode where the TPU's would run ("pallas_tpu", or "auto" on a TPU). The
    results are the same bits either way.
    """
    options = _options(options)
    impl = options.implementation
    if impl in ("reference", "pallas_gpu") or (
            options.interpret and resolve(impl, interpret=True) != "pallas_tpu"):
        return stored.put(index, record, values)
    index = tuple(jnp.asarray(i, jnp.int32) for i in index)
    record = jnp.asarray(record, jnp.int32)
    shape = jnp.broadcast_shapes(*(i.shape for i in index), record.shape)
    words = stored.map.words

    def kernel(interpret: bool) -> pools.Lanes:
        lead = jnp.stack([jnp.broadcast_to(i, shape).reshape(-1) for i in index], axis=1)
        rows = jnp.broadcast_to(jnp.asarray(values), (*shape, words)).reshape(-1, words)
        planes = record_writer()(stored.planes, lead, jnp.broadcast_to(record, shape).reshape(-1),
                                 rows.astype(stored.dtype), lanes_spec=stored.map.spec,
                                 interpret=interpret)
        return pools.Lanes(tuple(planes), stored.map)

    if options.interpret:
        return kernel(True)
    return programs.platform_dependent(tpu=lambda: kernel(False),
                                       default=lambda: stored.put(index, record, values))


__all__ = ["put_records"]
