"""Where a stored record lives: the lane map of every stored array of the cache.

A TPU keeps an array in the row-major layout every Pallas kernel and the reference take only
when its minor dimension is a multiple of the 128 lanes of a tile and its second-minor is 1,
2, 4 or a multiple of 8 (`../shared/TPU_LAYOUT.md`; otherwise XLA:TPU permutes the dims to
save padding, and every program that takes the array relayouts it in and out). A record of
the cache (a C4 entry, an indexer key, a window row, a tail row, a hot-set row) is a run of
32-bit words (`storage.RowCodec.stored_width`: 146 for an fp8_latent entry of 512 values,
17 for an fp4_index key of 128), so records do not go into arrays of their own width.

Records come in *blocks*: the entries of one page of one layer, the window ring of one slot
of one layer, a slot's tail ring, a slot's hot rows. A `LaneMap` says where each word of
each record of a block lives. The block is cut by words into *parts*; part p holds words
[first, first + words) of every record, in an array of its own (a *plane*,
[*lead, rows, lanes], `lead` the array's leading dims: layer, page or slot):

  wide part    the first 128 * (w // 128) words of a record of w >= 128 words: one record
               per lane row, record e in row e (lanes = those words)
  narrow parts the w mod 128 words left, cut into runs held in slots of a power of two
               s <= 128 lanes, k = 128 / s slots to a lane row: record e in row e // k,
               lanes (e % k) s .. (e % k) s + words - 1 (the slot's other lanes are
               padding: never read)

and rows = `lane_rows(lane rows the part's rows fill)`: 1, 2, 4 or a multiple of 8. The
cut of the narrow words is the one with the fewest lane rows (then the fewest parts), so
the bytes of a block as stored are close to the records' own:

  block (V4-Flash widths, release formats)   parts (slot: rows)      B / record   logical
  C4 entries, 32 a page (146 words)          128: 32, 16: 4, 2: 1    592          584
  indexer keys, 32 a page (17 words)         16: 4, 1: 1             80           68
  C128 entry, 1 a page (146 words)           128: 1, 32: 1           1024         584
  window ring, 128 rows (146 words)          128: 128, 16: 16, 2: 2  584          584

A plane's last two dims then follow the rule whatever the leading dims are, so no program
copies a pool, and no layout needs declaring. The byte format of a record is the codec's
(`storage`); this module only says where the record sits. `Lanes` is a stored array: its
planes and its map.

Reading and writing (the jnp reference; the kernels do the same on the planes in VMEM):
`Lanes.take` gathers records by block index and record id (each part one slice of its slot,
never a reshape of a plane: on a TPU a reshape of a plane is a relayout), `Lanes.put`
writes them (a slot shared with other records is written on its own lanes only),
`Lanes.records` gives whole blocks as [*lead, E, w] rows.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from v4kv_jax import programs

LANES = 128  # lanes of a TPU tile: the minor dim of every plane is a multiple of this
SLOTS = tuple(1 << i for i in range(8))  # slot widths a narrow part may take (1 .. 128)


def lane_rows(n: int) -> int:
    """Lane rows of a plane that needs `n` (>= 1): the least of 1, 2, 4 or a multiple of 8
    that holds them (the second-minor dims XLA:TPU keeps row-major)."""
    n = int(n)
    if n < 1:
        raise ValueError(f"n: expected at least 1 lane row; got {n}")
    return 1 << (n - 1).bit_length() if n <= 4 else -(-n // 8) * 8


@dataclasses.dataclass(frozen=True)
class Part:
    """Words [first, first + words) of every record of a block, in one plane.

    Attributes:
      first, words: the record words the part holds.
      slot: lanes a record takes in a row: a power of two <= 128 (narrow: 128 // slot
        records share a row), or the part's width, a multiple of 128 (wide: a row each).
      rows: lane rows of a block (`lane_rows`).
    """

    first: int
    words: int
    slot: int
    rows: int

    @property
    def lanes(self) -> int:
        """The plane's minor dim."""
        return max(self.slot, LANES)

    @property
    def per_row(self) -> int:
        """Records sharing a lane row (1 for a wide part)."""
        return self.lanes // self.slot

    def row(self, record):
        """The lane row of record(s) `record` (ints or an int array)."""
        return record // self.per_row

    def lane(self, record):
        """The first lane of record(s) `record` in its row."""
        return (record % self.per_row) * self.slot


def _narrow_cut(words: int, records: int) -> tuple[int, ...]:
    """Slot widths (in record order) holding `words` (< 128) words of each of `records`
    records in the fewest lane rows, then the fewest parts, then the narrowest slots (larger
    slots first on a tie)."""

    @functools.cache
    def best(left: int) -> tuple[int, int, int, tuple[int, ...]]:
        if left <= 0:
            return 0, 0, 0, ()
        options = []
        for slot in reversed(SLOTS):
            rows, parts, lanes, cut = best(left - slot)
            options.append((rows + lane_rows(-(-records // (LANES // slot))), parts + 1,
                            lanes + slot, (slot, *cut)))
        return min(options, key=lambda o: o[:3])

    return best(words)[3]


@dataclasses.dataclass(frozen=True)
class LaneMap:
    """Where the words of a block of `records` records of `words` words each live (module
    docstring). Hashable: a static value under jit.

    Attributes:
      words: words per record (w).
      records: records per block (E).
      dtype: the dtype of every plane (32-bit: float32, uint32 or int32).
      parts: the parts, in record order (derived).
    """

    words: int
    records: int
    dtype: np.dtype
    parts: tuple[Part, ...] = dataclasses.field(init=False, compare=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "dtype", np.dtype(self.dtype))
        if self.dtype.itemsize != 4:
            raise ValueError(f"dtype: expected a 32-bit dtype (planes hold words); got "
                             f"{self.dtype}")
        for name in ("words", "records"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name}: expected a positive int; got "
                                 f"{getattr(self, name)!r}")
        parts, first = [], 0
        wide = LANES * (self.words // LANES)
        if wide:
            parts.append(Part(0, wide, wide, lane_rows(self.records)))
            first = wide
        for slot in _narrow_cut(self.words - wide, self.records):
            n = min(slot, self.words - first)
            parts.append(Part(first, n, slot,
                              lane_rows(-(-self.records // (LANES // slot)))))
            first += n
        object.__setattr__(self, "parts", tuple(parts))

    @property
    def spec(self) -> tuple[int, tuple[tuple[int, int, int, int], ...]]:
        """(records, (first, words, slot, rows) per part): the static description the
        kernels take (`pallas_kernels.formats.layout`)."""
        return self.records, tuple((p.first, p.words, p.slot, p.rows) for p in self.parts)

    def shapes(self, lead: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
        """The plane shapes of an array of blocks with leading dims `lead`."""
        return tuple((*lead, p.rows, p.lanes) for p in self.parts)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block as stored (every plane's rows)."""
        return sum(p.rows * p.lanes for p in self.parts) * self.dtype.itemsize

    @property
    def record_bytes(self) -> int:
        """Bytes of one record's own words (the logical bytes)."""
        return self.words * self.dtype.itemsize

    @property
    def overhead(self) -> float:
        """Bytes of a block as stored over its records' own bytes (1.0: no padding)."""
        return self.block_bytes / (self.records * self.record_bytes)

    def zeros(self, lead: tuple[int, ...]) -> Lanes:
        """An array of blocks with leading dims `lead`, every word 0."""
        return Lanes(tuple(jnp.zeros(s, self.dtype) for s in self.shapes(lead)), self)

    def pack(self, rows: jax.Array, pad=0) -> Lanes:
        """Whole blocks from rows [*lead, E, w] (for tests, transfers and tools; a program's
        write goes through `Lanes.put`), the padding lanes and rows set to `pad` (a value
        of the planes' dtype)."""
        rows = jnp.asarray(rows)
        if rows.shape[-2:] != (self.records, self.words):
            raise ValueError(f"rows: expected [..., {self.records}, {self.words}]; got shape "
                             f"{rows.shape}")
        rows = rows.astype(self.dtype)
        lead = rows.shape[:-2]
        planes = []
        for p in self.parts:
            x = rows[..., p.first:p.first + p.words]
            x = jnp.pad(x, [(0, 0)] * len(lead) + [(0, p.rows * p.per_row - self.records),
                                                   (0, p.slot - p.words)],
                        constant_values=jnp.asarray(pad, self.dtype))
            planes.append(x.reshape(*lead, p.rows, p.lanes))
        return Lanes(tuple(planes), self)

    def unpack(self, planes) -> jax.Array:
        """Rows [*lead, E, w] of whole blocks (`pack`'s inverse)."""
        pieces = []
        for p, x in zip(self.parts, planes, strict=True):
            lead = x.shape[:-2]
            x = x.reshape(*lead, p.rows * p.per_row, p.slot)
            pieces.append(x[..., :self.records, :p.words])
        return pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces, axis=-1)


def _blocks(plane: jax.Array, index):
    """plane[index], read so that XLA:TPU gathers from the plane as it is laid out: a leading
    scalar index (a layer) is taken first by a dynamic slice, and a block of one lane row is
    gathered as that row (its rows dim indexed, not sliced). Otherwise XLA:TPU relayouts a
    whole plane of one-row blocks to 8-row tiles before gathering from it."""
    index = index if isinstance(index, tuple) else (index,)
    first = index[0]
    if len(index) > 1 and not isinstance(first, (int, np.integer)) and getattr(
            first, "ndim", None) == 0:
        first = jnp.asarray(first, jnp.int32)
        first = jnp.where(first < 0, first + plane.shape[0], first)

        def on_tpu(plane, first, rest):
            return _blocks(jax.lax.dynamic_index_in_dim(plane, first, 0, keepdims=False),
                           rest)

        def elsewhere(plane, first, rest):  # a CPU copies a dynamic slice: one gather
            return plane[(first, *rest)]

        if not all(isinstance(i, (int, np.integer, jax.Array, np.ndarray)) for i in index[1:]):
            return on_tpu(plane, first, index[1:])
        return programs.platform_dependent(plane, first, index[1:], tpu=on_tpu,
                                          default=elsewhere)
    gathered = any(getattr(i, "ndim", 0) > 0 for i in index)
    if (plane.shape[-2] == 1 and gathered and len(index) == plane.ndim - 2
            and not any(isinstance(i, slice) or i is None or i is Ellipsis for i in index)):
        return plane[(*index, 0)][..., None, :]
    return plane[index]


def _view(plane: jax.Array, part: Part) -> jax.Array:
    """The plane of `part` as records: [*lead, rows * per_row, slot]."""
    return plane.reshape(*plane.shape[:-2], part.rows * part.per_row, part.slot)


def _slices(plane: jax.Array, index: tuple, row: jax.Array, lane: jax.Array, size: int
            ) -> jax.Array:
    """plane[*index, row, lane:lane + size] for index arrays broadcast together: [..., size].
    One gather of `size`-lane slices (no reshape of the plane)."""
    idx = jnp.broadcast_arrays(*index, row, lane)
    starts = jnp.stack([jnp.asarray(i, jnp.int32) for i in idx], axis=-1)
    dnums = jax.lax.GatherDimensionNumbers(
        offset_dims=(starts.ndim - 1,), collapsed_slice_dims=tuple(range(plane.ndim - 1)),
        start_index_map=tuple(range(plane.ndim)))
    return jax.lax.gather(plane, starts, dnums, (1,) * (plane.ndim - 1) + (size,),
                          mode=jax.lax.GatherScatterMode.CLIP)


def _put_slices(plane: jax.Array, index: tuple, row: jax.Array, lane: jax.Array,
                values: jax.Array) -> jax.Array:
    """plane with values [..., size] written at [*index, row, lane:lane + size]; a slice
    whose leading index is out of bounds is dropped (pass an out-of-range index to skip)."""
    size = values.shape[-1]
    idx = jnp.broadcast_arrays(*index, row, lane)
    shape = idx[0].shape
    starts = jnp.stack([jnp.asarray(i, jnp.int32) for i in idx], axis=-1)
    values = jnp.broadcast_to(values, (*shape, size)).astype(plane.dtype)
    dnums = jax.lax.ScatterDimensionNumbers(
        update_window_dims=(len(shape),), inserted_window_dims=tuple(range(plane.ndim - 1)),
        scatter_dims_to_operand_dims=tuple(range(plane.ndim)))
    return jax.lax.scatter(plane, starts, values, dnums,
                           mode=jax.lax.GatherScatterMode.FILL_OR_DROP)


@struct.dataclass
class Lanes:
    """A stored array of the cache: the planes of its blocks ([*lead, rows, lanes] each, one
    per part of `map`) and its `LaneMap`. A pytree whose leaves are the planes."""

    planes: tuple[jax.Array, ...]
    map: LaneMap = struct.field(pytree_node=False)

    @property
    def lead(self) -> tuple[int, ...]:
        """The leading dims (layer, page or slot ...) shared by every plane."""
        return tuple(self.planes[0].shape[:-2])

    @property
    def dtype(self) -> np.dtype:
        return self.map.dtype

    @property
    def sharding(self):
        """Where the planes live (one placement for all of them)."""
        return self.planes[0].sharding

    @property
    def nbytes(self) -> int:
        """Bytes as stored (every plane)."""
        return sum(int(x.size) * x.dtype.itemsize for x in self.planes)

    def __getitem__(self, index) -> Lanes:
        """The blocks at `index` of the leading dims (basic or advanced indexing that never
        reaches the last two dims)."""
        return jax.tree.map(lambda x: _blocks(x, index), self)

    def records(self) -> jax.Array:
        """Rows [*lead, E, w] of every block."""
        return self.map.unpack(self.planes)

    def block_records(self, index: tuple) -> jax.Array:
        """Rows [..., E, w] of the blocks at `index` (a tuple of ints or int arrays over the
        leading dims, broadcast together; clipped like `take`).

        Blocks of several records gather their planes whole (contiguous lane rows) and
        unpack them; a block of one record (a C128 entry) off a TPU reads its own slot of
        each part only, not the lane rows it shares with padding."""
        index = tuple(jnp.asarray(i, jnp.int32) for i in index)
        if len(index) != len(self.lead):
            raise ValueError(f"index: expected {len(self.lead)} indices (one per leading "
                             f"dim); got {len(index)}")

        def whole(planes, index):
            return Lanes(planes, self.map)[index].records()

        def one_record(planes, index):
            pieces = [_view(x, p)[(*index, 0)][..., None, :p.words]
                      for p, x in zip(self.map.parts, planes, strict=True)]
            return pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces, axis=-1)

        if self.map.records > 1:
            return whole(self.planes, index)
        return programs.platform_dependent(self.planes, index, tpu=whole, default=one_record)

    def locate(self, record) -> tuple[tuple[jax.Array, jax.Array], ...]:
        """Per part, (lane row, first lane) of record(s) `record` (an int array); a record
        outside [0, E) gets a row past the plane (a write there is dropped)."""
        record = jnp.asarray(record, jnp.int32)
        inside = (record >= 0) & (record < self.map.records)
        return tuple((jnp.where(inside, p.row(record), p.rows), p.lane(record))
                     for p in self.map.parts)

    def take(self, index: tuple, record, at=None) -> jax.Array:
        """Records [..., w]: record `record` of block `index` (a tuple of index arrays over
        the leading dims, broadcast with `record`; `at`: its `locate`, if computed already).
        Out-of-range indices are clipped (mask what they read). `record` may be None when
        `at` is given.

        On a TPU each part is one gather of its words at their lane row and first lane, from
        the plane as it is laid out; elsewhere, from the plane viewed as records (a reshape
        of its last two dims, free in a row-major layout), whose gather needs no lane
        offset and runs several times faster on a CPU."""
        at = self.locate(record) if at is None else at
        index = tuple(jnp.asarray(i, jnp.int32) for i in index)

        def on_tpu(planes, index, record, at):
            return [_slices(x, index, row, lane, p.words)  # a row past the plane: clipped
                    for p, x, (row, lane) in zip(self.map.parts, planes, at, strict=True)]

        def elsewhere(planes, index, record, at):
            del at
            rec = jnp.clip(record, 0, self.map.records - 1)
            return [_view(x, p)[(*index, rec)][..., :p.words]
                    for p, x in zip(self.map.parts, planes, strict=True)]

        if record is None:  # located only (`at`): the lane gather, on any platform
            pieces = on_tpu(self.planes, index, None, at)
        else:
            pieces = programs.platform_dependent(self.planes, index,
                                                jnp.asarray(record, jnp.int32), at,
                                                tpu=on_tpu, default=elsewhere)
        return pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces, axis=-1)

    def put(self, index: tuple, record, values: jax.Array, at=None) -> Lanes:
        """The array with `values` [..., w] written as record `record` of block `index`
        (broadcast together; `at`: its `locate`, if computed already); a write whose block
        index or record is out of range (e.g. a page -1 mapped past the pool, a record id E
        for "not kept") is dropped. Each part writes its record's own lanes only: the lanes
        of the records sharing its row, and its slot's padding lanes, keep what they held
        (readers never read padding lanes)."""
        at = self.locate(record) if at is None else at
        values = jnp.asarray(values)
        index = tuple(jnp.asarray(i, jnp.int32) for i in index)

        def on_tpu(planes, index, record, values, at):
            return tuple(_put_slices(x, index, row, lane, values[..., p.first:p.first + p.words])
                         for p, x, (row, lane) in zip(self.map.parts, planes, at, strict=True))

        def elsewhere(planes, index, record, values, at):  # as `take`: the records view
            del at
            # Out of range (negative included) goes past the end: dropped.
            index = tuple(jnp.where((i >= 0) & (i < n), i, n)
                          for i, n in zip(index, self.lead, strict=True))
            out = []
            for p, x in zip(self.map.parts, planes, strict=True):
                view = _view(x, p)
                rec = jnp.where((record >= 0) & (record < self.map.records), record,
                                view.shape[-2])
                view = view.at[(*index, rec, slice(0, p.words))].set(
                    values[..., p.first:p.first + p.words].astype(x.dtype), mode="drop")
                out.append(view.reshape(x.shape))
            return tuple(out)

        if record is None:  # located only (`at`): the lane scatter, on any platform
            planes = on_tpu(self.planes, index, None, values, at)
        else:
            planes = programs.platform_dependent(self.planes, index,
                                                jnp.asarray(record, jnp.int32), values, at,
                                                tpu=on_tpu, default=elsewhere)
        return Lanes(tuple(planes), self.map)

    def put_blocks(self, index, blocks: Lanes) -> Lanes:
        """The array with whole blocks written at `index` of the leading dims (mode drop)."""
        return jax.tree.map(lambda x, v: x.at[index].set(v, mode="drop"), self, blocks)


__all__ = ["LANES", "LaneMap", "Lanes", "Part", "lane_rows"]
