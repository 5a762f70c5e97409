"""Lane rows of the cache's stored arrays inside the TPU kernels.

A stored array is a tuple of planes, one per `formats.Part` ([..., rows, lanes] blocks:
`v4kv_jax.pools.lanes`). A kernel copies a block's lane rows (or, for one record, the lane
row that holds it) by DMA exactly as they are stored; nothing is relayouted in HBM. In VMEM
a part's lane rows are turned into one lane row per record (`expand`) with the record's
slot (`slots`), which `formats.decode_tpu` masks. The expansion is a 0/1 matmul on the bytes
of the words (each product and sum exact in any matmul precision: a byte is exact in
bfloat16); a lane row that holds one record is used as it is. Records are written back with
`place`: a record's words rolled to its slot and merged into the lane row it shares.

Integer division of vectors is not something every Mosaic version lowers, so the row and
slot of record r of a block come from float arithmetic on small integers (exact).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.formats import Part

_F32 = jnp.float32
# The byte matmuls are exact at the chip's own bf16 precision, which Mosaic requires of bf16
# operands on some generations: stated, so a caller's default matmul precision is not used.
_BYTES = lax.Precision.DEFAULT


def _div(x: jax.Array, d: int) -> jax.Array:
    """x // d for non-negative int32 x < 2^23 (exact: (x + 0.5) / d is never within
    rounding of an integer)."""
    if d == 1:
        return x
    return jnp.floor((x.astype(_F32) + 0.5) / float(d)).astype(jnp.int32)


def record_of(n: int, records: int, axis: int = 0) -> tuple[jax.Array, jax.Array]:
    """(block, record) of rows 0 .. n - 1 of `records`-record blocks laid end to end:
    i32[n, 1] each (axis 0) or i32[1, n] (axis 1)."""
    shape = (n, 1) if axis == 0 else (1, n)
    r = lax.broadcasted_iota(jnp.int32, shape, axis)
    block = _div(r, records)
    return block, r - block * records


def slots(part: Part, n: int, records: int) -> jax.Array | None:
    """i32[n, 1]: the slot of each record of blocks of `records` records (None: a part of
    one record a lane row, slot 0)."""
    if part.per_row == 1:
        return None
    _, e = record_of(n, records)
    return e & (part.per_row - 1)


def _as_words(x: jax.Array) -> jax.Array:
    return x if x.dtype == jnp.int32 else lax.bitcast_convert_type(x, jnp.int32)


def _byte_product(words: jax.Array, select: jax.Array, words_first: bool) -> jax.Array:
    """int32 words moved by the 0/1 matrix `select` (words @ select, or select @ words):
    one matmul per byte of the words, each exact, the bytes joined again."""
    out = None
    for k in range(4):
        byte = ((words >> 8 * k) & 0xFF).astype(jnp.bfloat16)
        lhs, rhs = (byte, select) if words_first else (select, byte)
        moved = jnp.dot(lhs, rhs, precision=_BYTES, preferred_element_type=_F32)
        moved = moved.astype(jnp.int32) << 8 * k
        out = moved if out is None else out | moved
    return out


def expand(tile: jax.Array, part: Part, records: int) -> jax.Array:
    """[blocks * records, lanes] int32: for blocks of `part.rows` lane rows laid end to end
    in `tile` ([blocks * part.rows, lanes], as copied), row (i, e) is the lane row holding
    record e of block i (row i * part.rows + e // per_row), for every record e < records."""
    words = _as_words(tile)
    blocks = tile.shape[0] // part.rows
    if part.per_row == 1 and part.rows == records:
        return words
    n = blocks * records
    if words.shape[0] == 1:
        return jnp.broadcast_to(words, (n, words.shape[1]))
    block, e = record_of(n, records)
    source = block * part.rows + lax.shift_right_logical(e, part.per_row.bit_length() - 1)
    column = lax.broadcasted_iota(jnp.int32, (n, words.shape[0]), 1)
    return _byte_product(words, (column == source).astype(jnp.bfloat16), words_first=False)


def shift_lanes(x: jax.Array, by) -> jax.Array:
    """x [1, n] (n a power of two) with lane l moved to lane (l + by) mod n (`by` a traced
    int32 in [0, n)), whichever way `pltpu.roll` turns: the lane ids rolled with the data
    tell which of the two rotations put each lane where it belongs."""
    n = x.shape[-1]
    if n & (n - 1):
        raise ValueError(f"shift_lanes: expected a power-of-two lane count; got {n}")
    lane = lax.broadcasted_iota(jnp.int32, x.shape, 1)
    came = pltpu.roll(lane, by, 1)
    right = came == ((lane - by) & (n - 1))
    return jnp.where(right, pltpu.roll(x, by, 1), pltpu.roll(x, (n - by) & (n - 1), 1))


def _moved(words: jax.Array, first: int, count: int, lanes: int) -> jax.Array:
    """[1, lanes] int32: lanes [0, count) of words [1, n] moved to lanes [first, first +
    count), 0 elsewhere: a 0/1 matmul on the bytes (exact)."""
    src = lax.broadcasted_iota(jnp.int32, (words.shape[1], lanes), 0)
    dst = lax.broadcasted_iota(jnp.int32, (words.shape[1], lanes), 1)
    select = ((dst == src + first) & (src < count)).astype(jnp.bfloat16)
    return _byte_product(words, select, words_first=True)


def part_words(words: jax.Array, part: Part) -> jax.Array:
    """[1, part.lanes] int32: the part's words (words [first, first + count) of a record in
    order, `words` [1, n]) at lanes [0, part.words)."""
    words = _as_words(words)
    if part.first == 0 and words.shape[1] == part.lanes:
        return words
    return _moved(words, -part.first, part.first + part.words, part.lanes)


def record(parts, rows, slots, lanes: int) -> jax.Array:
    """[1, lanes] int32: one record's words in order (word w at lane w), from the lane rows
    that hold it (`rows`, [1, part.lanes] per part, as loaded) and its slot in each (traced
    int32 scalars)."""
    rows = [_as_words(r) for r in rows]
    if len(parts) == 1 and parts[0].first == 0 and parts[0].lanes == lanes and (
            parts[0].per_row == 1):
        return rows[0]
    out = None
    for part, row, slot in zip(parts, rows, slots, strict=True):
        if part.per_row > 1:
            row = shift_lanes(row, (part.lanes - slot * part.slot) & (part.lanes - 1))
        moved = _moved(row, part.first, part.words, lanes)
        out = moved if out is None else out | moved
    return out


def written(part: Part, old: jax.Array, words: jax.Array, slot) -> jax.Array:
    """The lane row `old` ([1, part.lanes]) holding a record's words for `part` (`words`
    [1, part.lanes]: the part's words at lanes [0, part.words), as `formats.encode_tpu`
    gives them) in its slot `slot` (traced int32): the other records sharing the row, and
    the slot's padding, keep theirs."""
    words, old = _as_words(words), _as_words(old)
    if part.per_row == 1:
        first, mine = 0, words
    else:
        first = slot * part.slot
        mine = shift_lanes(words, first)
    lane = lax.broadcasted_iota(jnp.int32, old.shape, 1)
    inside = (lane >= first) & (lane < first + part.words)
    return jnp.where(inside, mine, old)


__all__ = ["expand", "part_words", "record", "record_of", "shift_lanes", "slots", "written"]
