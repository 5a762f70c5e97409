"""The TPU kernel that writes one record per block of a stored array in place
(`pallas_kernels.records`, `ops.put_records`), in interpret mode, bit for bit against
`Lanes.put`: the arrays a decode step writes (window rings, raw tails, fp32 and packed
rows, wide and narrow parts), NaN-poisoned planes whose other words must keep their bits,
records and blocks out of range (not written), and a block count that is not a multiple of
the kernel's chunk."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import v4kv_jax as v4
from v4kv_jax import ops
from v4kv_jax.pools.lanes import LaneMap

# (words, records a block, dtype): a V4-Flash window ring (146 words), the tests' fp8
# ring (49), a raw CSA tail (256 fp32: wide part), an fp4 key page (17: narrow parts), one
# record a block (9 words in a 16-lane slot).
ARRAYS = [(146, 128, np.uint32), (49, 128, np.uint32), (256, 8, np.float32),
          (17, 32, np.uint32), (9, 1, np.uint32)]


def _stored(words, records, dtype, rng, lead=(3, 5)):
    bits = rng.integers(0, 1 << 32, (*lead, records, words), dtype=np.uint32)
    bits[..., ::3, :] = np.float32(np.nan).view(np.uint32)  # poisoned: kept bit for bit
    return LaneMap(words, records, dtype).pack(jnp.asarray(bits.view(dtype)),
                                               pad=np.float32(np.nan).view(np.uint32))


def _bits(lanes):
    return [np.asarray(x).view(np.uint32) for x in lanes.planes]


@pytest.mark.parametrize("words, records, dtype", ARRAYS)
def test_records_written_in_place_are_lanes_put(words, records, dtype):
    rng = np.random.default_rng(words * records)
    stored = _stored(words, records, dtype, rng)
    # Every (layer, slot) block once, in an order of the caller's; one slot -1 (a padding
    # row), one record past the block, one layer past the stack: none of them written.
    layers = np.array([2, 0, 1])
    slots = np.array([4, -1, 0, 3, 1])
    index = (jnp.asarray(layers[:, None]), jnp.asarray(slots[None, :]))
    record = rng.integers(0, records, (3, 5)).astype(np.int32)
    record[0, 2] = records
    values = jnp.asarray(rng.integers(0, 1 << 32, (3, 5, words), dtype=np.uint32).view(dtype))
    want = stored.put(index, jnp.asarray(record), values)
    options = v4.Options(implementation="pallas_tpu", interpret=True)
    got = jax.jit(lambda s, i, r, v: ops.put_records(s, i, r, v, options))(
        stored, index, jnp.asarray(record), values)
    for a, b in zip(_bits(got), _bits(want), strict=True):
        np.testing.assert_array_equal(a, b)
    assert any((a != b).any() for a, b in zip(_bits(got), _bits(stored), strict=True))
    # A layer index past the stack writes nothing.
    same = jax.jit(lambda s, r, v: ops.put_records(
        s, (jnp.int32(3), jnp.arange(5, dtype=jnp.int32)), r, v, options))(
            stored, jnp.asarray(record[0]), values[0])
    for a, b in zip(_bits(same), _bits(stored), strict=True):
        np.testing.assert_array_equal(a, b)


def test_more_blocks_than_a_chunk_and_the_reference_switch():
    rng = np.random.default_rng(7)
    stored = _stored(49, 128, np.uint32, rng, lead=(43, 4))
    index = (jnp.arange(43, dtype=jnp.int32)[:, None], jnp.arange(4, dtype=jnp.int32)[None])
    record = jnp.asarray(rng.integers(0, 128, (43, 4)), jnp.int32)
    values = jnp.asarray(rng.integers(0, 1 << 32, (43, 4, 49), dtype=np.uint32))
    want = _bits(stored.put(index, record, values))
    for options in (v4.Options(implementation="pallas_tpu", interpret=True),
                    v4.Options(implementation="reference"), v4.Options()):
        got = jax.jit(lambda s, r, v, o=options: ops.put_records(s, index, r, v, o))(
            stored, record, values)
        for a, b in zip(_bits(got), want, strict=True):
            np.testing.assert_array_equal(a, b)


def test_arrays_of_the_same_blocks_are_written_in_one_call():
    """A raw tail's kv and gate (same blocks, same records) in one write, as two puts."""
    rng = np.random.default_rng(3)
    kv, gate = (_stored(32, 8, np.float32, rng) for _ in range(2))
    index = (jnp.asarray([[1], [0]]), jnp.asarray([[2, -1, 4]]))
    record = jnp.asarray(rng.integers(0, 8, (2, 3)), jnp.int32)
    rows = tuple(jnp.asarray(rng.standard_normal((2, 3, 32)), jnp.float32) for _ in range(2))
    options = v4.Options(implementation="pallas_tpu", interpret=True)
    got = jax.jit(lambda a, b, r, v: ops.put_records((a, b), index, r, v, options))(
        kv, gate, record, rows)
    for lanes, old, new in zip(got, (kv, gate), rows, strict=True):
        for a, b in zip(_bits(lanes), _bits(old.put(index, record, new)), strict=True):
            np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match=r"stored, values: expected arrays of the same blocks"):
        ops.put_records((kv, _stored(32, 16, np.float32, rng)), index, record, rows, options)
    with pytest.raises(TypeError, match=r"stored: expected a pools.Lanes"):
        ops.put_records(np.zeros((2, 3)), index, record, rows[0], options)
    with pytest.raises(ValueError, match=r"values: expected rows of 32 words"):
        ops.put_records(kv, index, record, rows[0][..., :8], options)
