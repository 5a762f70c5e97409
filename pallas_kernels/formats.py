"""Stored row formats inside the kernels: packed rows are decoded in registers, never widened
into a full-precision copy of a pool.

The byte layouts are those of `v4kv_jax.pools.storage` (its docstring is the truth; kernels import
nothing from v4kv_jax, so the decoders and encoders here are written again with integer ops
only: shifts, masks, fp32 bit patterns built by hand and `bitcast_convert_type` from int32,
no fp8 / fp4 dtypes, so they lower on Mosaic TPU and Triton GPU alike):

  "fp8_latent"  hd = nope + r: e4m3 codes of the nope dims in blocks of 64 (4 codes a word,
                dim 4 w + j in byte j of word w), the r RoPE dims as bf16 (dims nope + 2 i and
                nope + 2 i + 1 in the low and high half of word nope / 4 + i), then one ue8m0
                scale byte per block; S = nope / 4 + r / 2 + ceil(nb / 4) words.
  "fp4_index"   c dims of the Hadamard-rotated key: e2m1 nibbles (dim 8 w + j in bits 4 j of
                word w), then one ue8m0 scale byte per block of 32; S = c / 8 + ceil(nb / 4).
  "nvfp4"       V4.1's entries (`v4kv_jax.pools.records41`): e2m1 nibbles of every dim as
                "fp4_index" holds them, then one e4m3 scale byte per block of 16;
                S = width / 8 + width / 64.
  "mxfp8"       V4.1's window rows: e4m3 codes of every dim as "fp8_latent" holds its nope
                dims, then one ue8m0 scale byte per block of 32; S = width / 4 + width / 128.
                The kernels read these two (`decode_tpu`); none writes them.
  "float32"     the row as it is, one value a word.
  "bfloat16", "float16"
                two values a word: value 2 i in the low half of word i, 2 i + 1 in the high
                half; S = ceil(width / 2).

Parts
-----
A pool is not stored as [..., rows, S] but lane-dense (`v4kv_jax.pools.lanes`): each *part*
of a row (words [first, first + words)) lives in a plane of its own, rows of `lanes` lanes
(a multiple of 128) that hold lanes // slot rows each, a row's part in a slot of `slot`
lanes. `Layout.parts` says where; the default, one part of the whole row in `stored_width`
lanes, is a row handed to a kernel as it is. A kernel copies a part's lane rows as they are
and never moves a word across lanes: `decode_tpu` takes each part's tile with the slot each
of its rows holds ([n, 1]) and masks every other lane, and the query planes hold the query
once in every slot (`to_planes`), so a dot product with a tile row sees only its slot;
`from_planes` sums an output dim over the slots that hold it. A GPU kernel gathers instead:
record e's words come from each part's plane at lane row e // per_row, lanes (e % per_row)
* slot + word - first (`gpu_gather`, one gathered load per part a run of words touches),
and are written back the same way, word by word (`gpu_scatter`).

Planes
------
A word holds 4 (fp8) or 8 (fp4) dims that are neighbours in the natural order, and spreading
them back over lanes is a relayout neither Mosaic nor Triton does cheaply. The kernels do not
spread them: a decoded tile is a list of `Layout.n_planes` planes [rows, plane_width], plane
j lane w holding natural dim `Layout.lane_dims()[j, w]` (-1: a lane that holds 0). A dot
product over the dims is the sum over planes of the planes' dot products, so the ops hand the
kernels queries already laid out in planes (`to_planes`, a gather in XLA) and put the
kernels' outputs back in natural order (`from_planes`). "float32" rows are one plane, the
row; 16-bit float rows two, the low and the high halves of the words.

  TPU (`decode_tpu`): a plane is as wide as the parts' lanes side by side (S lanes for the
  default part, the tile as copied into VMEM); plane j takes byte / nibble j of each code
  word, fp8 planes 0 and 1 also the low / high bf16 halves of the RoPE words (and of 16-bit
  float words); per-lane scales come from masked lane reductions.
  GPU (`decode_gpu`): a plane is a power of two wide (Triton); each is gathered from the
  words its lanes need, wherever the parts hold them (`gpu_loader`): fp8 planes hold 128
  lanes for V4 (112 code words + 16 of the 64 RoPE dims each, so the 4 planes are exactly
  the 512 dims), fp4 planes c / 8 lanes, 16-bit float planes the S words (lane w of plane j:
  dim 2 w + j), "float32" the row.

Decoded values are bit for bit those of `storage.decode_*` (the tests check it), NaN codes
decode to NaN, scale byte 0xFF to NaN and 0 to 2^-127 (flushed to 0 where the backend
flushes subnormals, as XLA on CPU does).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.common import MIN_DOT, next_power_of_two

# V4.1's records (`v4kv_jax.pools.records41`), read by the kernels (not written): codes of every
# dim in blocks, no RoPE tail; "nvfp4" e2m1 nibbles with e4m3 block scales, "mxfp8" e4m3
# bytes with ue8m0 block scales.
RECORDS41 = ("nvfp4", "mxfp8")
PACKED = ("fp8_latent", "fp4_index") + RECORDS41
# Dims per scale block, and which formats hold e4m3 codes (a byte a dim; else e2m1 nibbles).
BLOCK = {"fp8_latent": 64, "fp4_index": 32, "nvfp4": 16, "mxfp8": 32}
E4M3_CODES = ("fp8_latent", "mxfp8")
FP8_BLOCK, FP8_MAX = 64, 448.0
FP4_BLOCK, FP4_MAX = 32, 6.0
FP8_AMAX_FLOOR = np.float32(1e-4)
FP4_AMAX_FLOOR = np.float32(6 * 2.0 ** -126)
_F32 = jnp.float32
_HIGH_HALF = np.int32(-65536)  # 0xFFFF0000


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


HALVES = ("bfloat16", "float16")
FLOATS = ("float32",) + HALVES


@dataclasses.dataclass(frozen=True)
class Part:
    """Words [first, first + words) of every row, in a plane of lane rows of `lanes` lanes,
    a row's words in a slot of `slot` lanes (lanes // slot rows to a lane row; a row of
    the lane map's block e sits in lane row e // per_row, slot e % per_row), `rows` lane
    rows a block (`v4kv_jax.pools.lanes.Part`)."""

    first: int
    words: int
    slot: int
    lanes: int
    rows: int = 1

    def __post_init__(self):
        if self.words < 1 or self.slot < self.words or self.lanes % self.slot:
            raise ValueError(f"Part: expected 1 <= words <= slot and lanes a multiple of slot; "
                             f"got {self}")

    @property
    def per_row(self) -> int:
        return self.lanes // self.slot


def parts_of(spec) -> tuple[Part, ...]:
    """Parts from (first, words, slot, rows) tuples (a plane's lanes: max(slot, 128))."""
    return tuple(Part(f, w, s, max(s, 128), r) for f, w, s, r in spec)


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a kernel sees rows of one stored format (static).

    Attributes:
      fmt: "fp8_latent", "fp4_index", "float32", "bfloat16" or "float16".
      width: values per row (hd, or c for indexer keys).
      rope_dim: the last rope_dim dims are RoPE dims (fp8_latent stores them in bf16).
      backend: "tpu" or "gpu" (the plane shapes differ, see the module docstring).
      parts: where the words of a row live (`Part`s in word order; () is one part of the
        whole row, stored_width lanes wide, a row to a lane row).
      records: rows of a block of the stored array (a page's entries, a ring's rows).
    """

    fmt: str
    width: int
    rope_dim: int
    backend: str
    parts: tuple[Part, ...] = ()
    records: int = 1

    def __post_init__(self):
        if self.fmt == "fp8_latent":
            nope = self.width - self.rope_dim
            if self.rope_dim < 0 or self.rope_dim % 2 or nope <= 0 or nope % FP8_BLOCK:
                raise ValueError(f"fp8_latent needs an even rope_dim and width - rope_dim a "
                                 f"positive multiple of {FP8_BLOCK}; got width={self.width}, "
                                 f"rope_dim={self.rope_dim}")
        elif self.fmt == "fp4_index":
            if self.width < FP4_BLOCK or self.width & (self.width - 1):
                raise ValueError(f"fp4_index needs a power-of-two width >= {FP4_BLOCK}; got "
                                 f"width={self.width}")
        elif self.fmt in RECORDS41:
            if self.rope_dim or self.width <= 0 or self.width % BLOCK[self.fmt]:
                raise ValueError(f"{self.fmt} needs a width that is a positive multiple of "
                                 f"{BLOCK[self.fmt]} and no rope_dim; got width={self.width}, "
                                 f"rope_dim={self.rope_dim}")
        elif self.fmt not in FLOATS:
            raise ValueError(f"fmt={self.fmt!r}: expected one of {FLOATS + PACKED}")
        if self.backend not in ("tpu", "gpu"):
            raise ValueError(f"backend={self.backend!r}: expected 'tpu' or 'gpu'")
        if not self.parts:
            whole = self.stored_width
            object.__setattr__(self, "parts", (Part(0, whole, whole, whole),))
        covered = [(p.first, p.first + p.words) for p in self.parts]
        if [c for span in covered for c in span] != sorted(
                [0] + [c for _, e in covered[:-1] for c in (e, e)] + [self.stored_width]):
            raise ValueError(f"parts: expected consecutive runs of the {self.stored_width} "
                             f"words of a row; got {self.parts}")

    @property
    def packed(self) -> bool:
        return self.fmt in PACKED

    @property
    def halves(self) -> bool:
        """Two 16-bit float values a word."""
        return self.fmt in HALVES

    @property
    def whole(self) -> bool:
        """One part, a row to a lane row (a row as it is handed to a kernel)."""
        return len(self.parts) == 1 and self.parts[0].per_row == 1 and (
            self.parts[0].lanes == self.stored_width)

    @property
    def nope(self) -> int:
        return self.width - self.rope_dim

    @property
    def coded(self) -> int:
        """Dims held as codes: fp8_latent's nope dims (its RoPE dims follow in bf16), every
        dim of the other packed formats (an fp4_index key's RoPE dims included)."""
        return self.nope if self.fmt == "fp8_latent" else self.width

    @property
    def code_words(self) -> int:
        """Words of codes at the start of a row."""
        return self.coded // self.per_word

    @property
    def blocks(self) -> int:
        """Scale blocks per row."""
        return self.coded // BLOCK[self.fmt]

    @property
    def scale_word(self) -> int:
        """Index of the first word of scale bytes."""
        extra = self.rope_dim // 2 if self.fmt == "fp8_latent" else 0
        return self.code_words + extra

    @property
    def stored_width(self) -> int:
        """Words of a stored row."""
        if self.halves:
            return _ceil_div(self.width, 2)
        if not self.packed:
            return self.width
        return self.scale_word + _ceil_div(self.blocks, 4)

    @property
    def per_word(self) -> int:
        return {"fp8_latent": 4, "fp4_index": 8, "nvfp4": 8, "mxfp8": 4, "bfloat16": 2,
                "float16": 2}.get(self.fmt, 1)

    @property
    def n_planes(self) -> int:
        return self.per_word

    @property
    def words_per_block(self) -> int:
        return BLOCK[self.fmt] // self.per_word

    @property
    def plane_width(self) -> int:
        if self.backend == "tpu":
            return sum(p.lanes for p in self.parts)
        if self.fmt == "float32":
            return self.width
        if self.halves:
            return max(MIN_DOT, next_power_of_two(self.stored_width))
        if self.fmt == "fp8_latent":  # code lanes, then a quarter of the RoPE dims
            return max(MIN_DOT, next_power_of_two(self.code_words + _ceil_div(self.rope_dim, 4)))
        return max(MIN_DOT, self.code_words)

    @property
    def rope_lanes(self) -> int:
        """GPU fp8: RoPE dims held by each plane after its code lanes."""
        return self.plane_width - self.code_words

    def word_dims(self) -> np.ndarray:
        """i32[n_planes, stored_width]: the natural dim plane j takes from each word of a
        row, -1 for none (a scale word, padding)."""
        dims = np.full((self.n_planes, self.stored_width), -1, np.int32)
        if self.fmt == "float32":
            dims[0] = np.arange(self.width)
            return dims
        if self.halves:
            for j in range(2):
                d = 2 * np.arange(self.stored_width) + j
                dims[j] = np.where(d < self.width, d, -1)
            return dims
        w = np.arange(self.code_words)
        for j in range(self.n_planes):
            dims[j, :self.code_words] = self.per_word * w + j
        if self.fmt == "fp8_latent" and self.rope_dim:
            half = self.rope_dim // 2
            lanes = self.code_words + np.arange(half)
            dims[0, lanes] = self.nope + 2 * np.arange(half)
            dims[1, lanes] = self.nope + 2 * np.arange(half) + 1
        return dims

    def part_words(self, part: Part) -> np.ndarray:
        """i32[part.lanes]: the row word each lane of a part's lane row holds once the row's
        slot is moved to slot 0 (`decode_tpu`), -1 for the other lanes."""
        lane = np.arange(part.lanes)
        return np.where(lane < part.words, part.first + lane, -1)

    def lane_dims(self) -> np.ndarray:
        """i32[n_planes, plane_width]: the natural dim each plane lane holds, -1 for none."""
        if self.backend == "tpu":
            words = self.word_dims()
            out = []
            for part in self.parts:
                word = self.part_words(part)
                out.append(np.where(word >= 0, words[:, np.maximum(word, 0)], -1))
            return np.concatenate(out, axis=1).astype(np.int32)
        dims = np.full((self.n_planes, self.plane_width), -1, np.int32)
        if self.fmt == "float32":
            dims[0] = np.arange(self.width)
            return dims
        if self.halves:
            return np.pad(self.word_dims(), ((0, 0), (0, self.plane_width - self.stored_width)),
                          constant_values=-1)
        w = np.arange(self.code_words)
        for j in range(self.n_planes):
            dims[j, :self.code_words] = self.per_word * w + j
        if self.fmt == "fp8_latent" and self.rope_dim:
            for j in range(self.n_planes):
                rope = j * self.rope_lanes + np.arange(self.rope_lanes)
                keep = rope < self.rope_dim
                dims[j, self.code_words + np.arange(self.rope_lanes)[keep]] = (
                    self.nope + rope[keep])
        return dims


@functools.cache
def layout(fmt: str, width: int, rope_dim: int, backend: str, lanes=()) -> Layout:
    """The `Layout` of a storage format name as the cache geometry spells it, its rows where
    `lanes` says: (records a block, ((first, words, slot, rows) per plane)) as
    `v4kv_jax.pools.lanes.LaneMap.spec` gives it; (): whole rows."""
    if not lanes:
        return Layout(fmt, width, rope_dim, backend)
    records, parts = lanes
    return Layout(fmt, width, rope_dim, backend, parts_of(parts), records)


def check_stored(lay: Layout, planes, name: str) -> None:
    """Raises ValueError naming `name` unless `planes` (one array per part, [..., rows,
    lanes]; or one array of whole rows [..., stored_width]) are the layout's."""
    planes = tuple(planes) if isinstance(planes, (tuple, list)) else (planes,)
    if len(planes) != len(lay.parts):
        raise ValueError(f"{name}: rows of {lay.fmt} (width {lay.width}) in {len(lay.parts)} "
                         f"plane(s); got {len(planes)}")
    want = jnp.dtype(jnp.float32 if lay.fmt == "float32" else jnp.uint32)
    for k, (part, x) in enumerate(zip(lay.parts, planes, strict=True)):
        if x.shape[-1] != part.lanes or (not lay.whole and x.shape[-2] != part.rows):
            raise ValueError(f"{name}: plane {k} of {lay.fmt} rows (width {lay.width}, "
                             f"rope_dim {lay.rope_dim}) is [..., {part.rows}, {part.lanes}]; "
                             f"got shape {tuple(x.shape)}")
        if jnp.dtype(x.dtype) != want:
            raise ValueError(f"{name}: {lay.fmt} rows are {want} words; got {x.dtype}")


# --- XLA side: queries into planes, outputs back ------------------------------------------

@functools.cache
def _runs(lay: Layout) -> tuple[tuple[tuple[int, int, int, int], ...], ...]:
    """Per plane, the lanes as runs (first lane, count, first dim, dim stride): lanes
    l .. l + count - 1 hold dims d, d + stride, ...; a run of first dim -1 holds none."""
    out = []
    for row in lay.lane_dims():
        runs, lane = [], 0
        while lane < len(row):
            d = int(row[lane])
            if d < 0:
                end = lane
                while end < len(row) and row[end] < 0:
                    end += 1
                runs.append((lane, end - lane, -1, 0))
            else:
                stride = int(row[lane + 1]) - d if lane + 1 < len(row) and row[lane + 1] > d \
                    else 1
                end = lane + 1
                while end < len(row) and row[end] == d + stride * (end - lane):
                    end += 1
                runs.append((lane, end - lane, d, stride))
            lane = end
        out.append(tuple(runs))
    return tuple(out)


@functools.cache
def _interleaves(lay: Layout):
    """How `from_planes` rebuilds the natural order from the runs: dim ranges in order, each
    (first dim, [(plane, first lane, count)] of the runs whose lanes, interleaved, are its
    dims), or None when the runs do not tile the dims that way (then a gather is used)."""
    held = {}
    for j, runs in enumerate(_runs(lay)):
        for lane, count, d, stride in runs:
            if d >= 0:
                held.setdefault((stride, count, d - d % stride), []).append((d, j, lane))
    groups = []
    for (stride, count, base), members in held.items():
        members.sort()
        if [d for d, _, _ in members] != [base + t for t in range(stride)]:
            return None
        groups.append((base, stride * count, [(j, lane, count) for _, j, lane in members]))
    groups.sort()
    if [g[0] for g in groups] != list(np.cumsum([0] + [g[1] for g in groups])[:-1]) or (
            sum(g[1] for g in groups) != lay.width):
        return None
    return tuple((base, tuple(parts)) for base, _, parts in groups)


def to_planes(lay: Layout, x: jax.Array) -> jax.Array:
    """[..., width] -> [..., n_planes, plane_width] (0 on lanes that hold no dim): strided
    slices of x and zeros, put side by side (no gather: XLA fuses them into one copy)."""
    planes = []
    for runs in _runs(lay):
        pieces = []
        for _, count, d, stride in runs:
            if d < 0:
                pieces.append(jnp.zeros((*x.shape[:-1], count), x.dtype))
            else:
                pieces.append(x[..., d:d + stride * (count - 1) + 1:stride])
        planes.append(pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces, axis=-1))
    return jnp.stack(planes, axis=-2)


def from_planes(lay: Layout, y: jax.Array) -> jax.Array:
    """[..., n_planes, plane_width] -> [..., width]: `to_planes`' inverse (each dim from the
    lane that holds it): runs of lanes interleaved back into natural order (no gather),
    or a gather where the lanes do not interleave."""
    groups = _interleaves(lay)
    if groups is None:
        dims = lay.lane_dims().reshape(-1)
        held = np.flatnonzero(dims >= 0)
        where = np.zeros(lay.width, np.int32)
        where[dims[held]] = held
        return jnp.take(y.reshape(*y.shape[:-2], -1), where, axis=-1)
    pieces = []
    for _, members in groups:
        runs = [y[..., j, lane:lane + count] for j, lane, count in members]
        if len(runs) == 1:
            pieces.append(runs[0])
        else:
            pieces.append(jnp.stack(runs, axis=-1).reshape(*y.shape[:-2], -1))
    return pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces, axis=-1)


# --- scalar codecs (int32 in, f32 out and back) -----------------------------------------

def _as_i32(words: jax.Array) -> jax.Array:
    if words.dtype == jnp.int32:
        return words
    return lax.bitcast_convert_type(words, jnp.int32)


def _f32(bits: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(bits, _F32)


def _bits(x: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(x, jnp.int32)


def scale_value(byte: jax.Array) -> jax.Array:
    """f32 2^(byte - 127) of ue8m0 bytes (int32); 0xFF -> NaN, 0 -> 2^-127."""
    value = jnp.where(byte == 0, np.float32(2.0 ** -127), _f32(byte << 23))
    return jnp.where(byte == 0xFF, np.float32(np.nan), value)


def e4m3_value(code: jax.Array) -> jax.Array:
    """f32 of e4m3fn codes (int32 in [0, 256)); 0x7F / 0xFF -> NaN, 0x80 -> -0.0."""
    e, m = (code >> 3) & 15, code & 7
    normal = _f32(((e + 120) << 23) | (m << 20))
    mag = jnp.where(e == 0, m.astype(_F32) * np.float32(2.0 ** -9), normal)
    mag = jnp.where((code & 0x7F) == 0x7F, np.float32(np.nan), mag)
    return jnp.where((code & 0x80) != 0, -mag, mag)


def e2m1_value(code: jax.Array) -> jax.Array:
    """f32 of e2m1 codes (int32 in [0, 16)): +-{0, 0.5, 1, 1.5, 2, 3, 4, 6}."""
    e, m = (code >> 1) & 3, code & 1
    bits = jnp.where(e == 0, m * 0x3F000000, ((e + 126) << 23) | (m << 22))
    return _f32(bits | ((code & 8) << 28))


def bf16_low(words: jax.Array) -> jax.Array:
    return _f32(words << 16)


def bf16_high(words: jax.Array) -> jax.Array:
    return _f32(words & _HIGH_HALF)


def f16_value(bits: jax.Array) -> jax.Array:
    """f32 of IEEE half-precision bit patterns (int32 in [0, 65536)), exactly: normal values
    re-biased, subnormals m * 2^-24, inf and NaN kept."""
    sign, e, m = (bits >> 15) & 1, (bits >> 10) & 31, bits & 1023
    normal = _f32(((e + 112) << 23) | (m << 13))
    special = _f32((255 << 23) | (m << 13))
    mag = jnp.where(e == 0, m.astype(_F32) * np.float32(2.0 ** -24),
                    jnp.where(e == 31, special, normal))
    return jnp.where(sign == 1, -mag, mag)


def half_value(fmt: str, words: jax.Array, j: int) -> jax.Array:
    """f32 of the low (j = 0) or high (j = 1) 16-bit value of words (int32) in `fmt`."""
    if fmt == "bfloat16":
        return bf16_low(words) if j == 0 else bf16_high(words)
    return f16_value((words >> 16 * j) & 0xFFFF)


def _round_int(y: jax.Array) -> jax.Array:
    """Round-half-to-even of f32 y >= 0 (small) to int32, with exact ops only."""
    floor = y.astype(jnp.int32)  # truncation: y >= 0
    frac = y - floor.astype(_F32)
    up = (frac > 0.5) | ((frac == 0.5) & ((floor & 1) == 1))
    return floor + up.astype(jnp.int32)


def e4m3_code(x: jax.Array) -> jax.Array:
    """e4m3fn codes (int32) of f32 x already divided by its scale: clipped to +-448, rounded
    to nearest even, NaN -> 0x7F, the sign of zero kept (as XLA's f32 -> e4m3fn convert)."""
    nan = jnp.isnan(x)
    sign = (_bits(x) >> 31) & 1
    mag = jnp.minimum(jnp.abs(jnp.where(nan, 0.0, x)), np.float32(FP8_MAX))
    bits = _bits(mag)
    rounded = bits + 0x7FFFF + ((bits >> 20) & 1)  # round the mantissa to 3 bits
    normal = ((((rounded >> 23) & 0xFF) - 120) << 3) | ((rounded >> 20) & 7)
    sub = _round_int(mag * np.float32(2.0 ** 9))  # below 2^-6: steps of 2^-9, 8 = 2^-6
    code = jnp.where(mag < np.float32(2.0 ** -6), sub, normal) | (sign << 7)
    return jnp.where(nan, 0x7F, code)


_E2M1_CUTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def e2m1_code(x: jax.Array) -> jax.Array:
    """e2m1 codes (int32) of finite f32 x in [-6, 6]: nearest, ties to the even code."""
    mag = jnp.abs(x)
    code = jnp.zeros(x.shape, jnp.int32)
    for k, cut in enumerate(_E2M1_CUTS, start=1):
        passed = mag >= cut if k % 2 == 0 else mag > cut
        code = code + passed.astype(jnp.int32)
    return code | (((_bits(x) >> 31) & 1) << 3)


def bf16_bits(x: jax.Array) -> jax.Array:
    """bf16 bits (int32 in [0, 65536)) of f32 x: nearest even, NaN -> 0x7FC0."""
    bits = _bits(x)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF
    return jnp.where(jnp.isnan(x), 0x7FC0, rounded)


def scale_byte(amax: jax.Array, fmax: float, floor) -> jax.Array:
    """ue8m0 byte (int32) 2^ceil(log2(max(amax, floor) * fp32(1 / fmax))) of block maxima."""
    bits = _bits(jnp.maximum(amax, floor) * np.float32(1.0 / fmax))
    return ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).astype(jnp.int32)


# --- decoders --------------------------------------------------------------------------------

def _no_records41(lay: Layout, name: str) -> None:
    if lay.fmt in RECORDS41:
        raise ValueError(f"{name}: {lay.fmt} rows are read by the TPU kernels only "
                         f"(decode_tpu)")


def _in(lane, lo: int, hi: int):
    return (lane >= lo) & (lane < hi)


def code_values(lay: Layout, words: jax.Array, j: int) -> jax.Array:
    """f32 values (before their block scale) of the codes of plane j: byte j (fp8_latent,
    mxfp8) or nibble j (fp4_index, nvfp4) of every word."""
    if lay.fmt in E4M3_CODES:
        return e4m3_value((words >> 8 * j) & 0xFF)
    return e2m1_value((words >> 4 * j) & 15)


def _log2(n: int) -> int:
    if n & (n - 1):
        raise ValueError(f"expected a power of two; got {n}")
    return n.bit_length() - 1


def _in_slot_zero(part: Part, words: jax.Array, slot) -> jax.Array:
    """Lane rows [n, lanes] (int32) with each row's slot `slot` (i32[n, 1], None: slot 0)
    moved to slot 0 and every other lane 0: the slot is kept, the others zeroed, then the row
    added to itself rotated by slot, 2 slots, 4 slots ... (integer adds of zeros: exact;
    whichever way `pltpu.roll` turns, the sums cover every rotation). A row's words then sit
    at the same lanes whatever slot held them, so a dot product sums them in the same order
    (a hot row reads bit for bit like the pool row it copies)."""
    if part.per_row == 1:
        return words
    lane = lax.broadcasted_iota(jnp.int32, words.shape, 1)
    own = lax.shift_right_logical(lane, _log2(part.slot)) == (0 if slot is None else slot)
    x = jnp.where(own, words, 0)
    for t in range(_log2(part.per_row)):
        x = x + pltpu.roll(x, part.slot << t, 1)
    return x


def _scale_bytes_of(lay: Layout, words) -> list[jax.Array]:
    """Per scale block b, the scale byte (ue8m0; nvfp4: e4m3) of each row (f32 [n, 1], an
    integer): byte b % 4 of the row's word scale_word + b // 4, wherever its part (moved to
    slot 0) holds it."""
    out = []
    for b in range(lay.blocks):
        col = lay.scale_word + b // 4
        k = next(i for i, p in enumerate(lay.parts) if p.first <= col < p.first + p.words)
        w = words[k]
        lane = lax.broadcasted_iota(jnp.int32, w.shape, 1)
        field = ((w >> 8 * (b % 4)) & 0xFF).astype(_F32)
        out.append(jnp.max(jnp.where(lane == col - lay.parts[k].first, field, 0.0), axis=1,
                           keepdims=True))
    return out


def decode_tpu(lay: Layout, tiles, slots=None) -> list[jax.Array]:
    """Planes (f32[n, plane_width] each) of n rows given as the lane rows that hold them.

    Args:
      tiles: per part of `lay`, the lane rows [n, part.lanes] (as loaded: words, or float32)
        holding row i's part in lane row i; one array for a layout of whole rows.
      slots: per part, i32[n, 1] the slot of row i in its lane row (None: slot 0 of each).

    Each part's row is first moved to slot 0 of its lane row (`_in_slot_zero`); lanes that
    hold no word of the row (other slots, padding, scale words) are 0 in every plane,
    whatever the lane rows hold there.
    """
    tiles = tuple(tiles) if isinstance(tiles, (tuple, list)) else (tiles,)
    slots = (None,) * len(tiles) if slots is None else tuple(slots)
    words = [_in_slot_zero(part, _as_i32(t), slot) if lay.fmt != "float32" or part.per_row > 1
             else t for part, t, slot in zip(lay.parts, tiles, slots, strict=True)]
    per_part = []
    if lay.packed:
        scale_of = e4m3_value if lay.fmt == "nvfp4" else scale_value
        scales = [scale_of(b.astype(jnp.int32)) for b in _scale_bytes_of(lay, words)]
    for part, w in zip(lay.parts, words, strict=True):
        lane = lax.broadcasted_iota(jnp.int32, w.shape, 1)
        valid, word = lane < part.words, part.first + lane
        if lay.fmt == "float32":
            value = w if w.dtype == _F32 else _f32(w)
            per_part.append([jnp.where(valid, value, 0.0)])
            continue
        if lay.halves:
            low, high = (half_value(lay.fmt, w, j) for j in range(2))
            per_part.append([jnp.where(valid, low, 0.0), jnp.where(valid, high, 0.0)])
            continue
        codes = valid & (word < lay.code_words)
        block = lax.shift_right_logical(word, _log2(lay.words_per_block))
        scale = jnp.zeros(w.shape, _F32)
        blocks = range(part.first // lay.words_per_block,
                       -(-min(part.first + part.words, lay.code_words) // lay.words_per_block))
        for b in blocks:
            scale = jnp.where(block == b, scales[b], scale)
        planes = []
        for j in range(lay.n_planes):
            plane = jnp.where(codes, code_values(lay, w, j) * scale, 0.0)
            if lay.fmt == "fp8_latent" and j < 2 and lay.rope_dim:
                rope = valid & (word >= lay.code_words) & (
                    word < lay.code_words + lay.rope_dim // 2)
                plane = jnp.where(rope, bf16_low(w) if j == 0 else bf16_high(w), plane)
            planes.append(plane)
        per_part.append(planes)
    if len(per_part) == 1:
        return per_part[0]
    return [jnp.concatenate([p[j] for p in per_part], axis=1) for j in range(lay.n_planes)]


def decode_row_tpu(lay: Layout, words: jax.Array) -> jax.Array:
    """f32 [G, width] in natural order of float rows given as their words in order ([G, n],
    word w at lane w, n >= stored_width; int32 or float32): "float32" as they are, 16-bit
    floats widened and spread to dims 2 w, 2 w + 1 by a 0/1 matmul at full precision (every
    value exact: a product with 1, sums with 0)."""
    if lay.fmt == "float32":
        value = words if words.dtype == _F32 else _f32(words)
        return value[:, :lay.width]
    if not lay.halves:
        raise ValueError(f"decode_row_tpu: {lay.fmt} rows are decoded into planes")
    words = _as_i32(words)
    n = words.shape[1]
    src = lax.broadcasted_iota(jnp.int32, (n, lay.width), 0)
    dim = lax.broadcasted_iota(jnp.int32, (n, lay.width), 1)
    out = None
    for j in range(2):
        spread = jnp.dot(half_value(lay.fmt, words, j), (dim == 2 * src + j).astype(_F32),
                         precision=lax.Precision.HIGHEST, preferred_element_type=_F32)
        out = spread if out is None else out + spread
    return out


# --- GPU side: a row's words where its parts hold them ----------------------------------------
# Triton gathers and scatters at any address, so a GPU kernel reads a record's words from the
# lanes its parts give them (`Part`: lane row e // per_row, lanes (e % per_row) * slot + ..)
# with one gathered load per part that a run of words touches, and writes them back the same
# way with masked stores; nothing is relayouted, and no lane of another record is touched.

def gpu_locate(part: Part, record):
    """(lane row, first lane) of record(s) `record` (int32 >= 0, or an int) in a part's
    plane: shifts, per_row and slot being powers of two."""
    if part.per_row == 1:
        return record, 0
    return record >> _log2(part.per_row), (record & (part.per_row - 1)) << _log2(part.slot)


def _touched(lay: Layout, lo: int, hi: int) -> list[tuple[int, Part]]:
    """(index, part) of the parts holding some of words [lo, hi] of a row."""
    if not 0 <= lo <= hi < lay.stored_width:
        raise ValueError(f"words [{lo}, {hi}]: expected a run inside the {lay.stored_width} "
                         f"words of a {lay.fmt} row")
    return [(k, p) for k, p in enumerate(lay.parts) if p.first <= hi and lo < p.first + p.words]


def _index(lead, row, lane, shape) -> tuple:
    """A gather / scatter index: every array broadcast to `shape`, scalars left as they are."""
    return tuple(i if jnp.ndim(i) == 0 else jnp.broadcast_to(i, shape)
                 for i in (*lead, row, lane))


def gpu_gather(lay: Layout, planes, lead, record, words, lo: int, hi: int) -> jax.Array:
    """Words `words` of record(s) `record` of block `lead` of a stored array, as stored
    (uint32, or float32 for "float32" rows).

    Args:
      planes: the array's planes (refs inside a kernel, or arrays), one per part of `lay`.
      lead: indices of the block (ints, scalars or arrays), one per leading dim.
      record: the record in its block (int32 >= 0, an int or an array).
      words: i32 row words, each in [lo, hi] (static bounds: only the parts holding some of
        them are read, one gathered load each, the words selected per lane).

    Returns:
      [shape]: lead, record and words broadcast together.
    """
    shape = jnp.broadcast_shapes(jnp.shape(record), jnp.shape(words),
                                 *(jnp.shape(i) for i in lead))
    out = None
    for k, part in _touched(lay, lo, hi):
        row, base = gpu_locate(part, record)
        at = words - part.first
        if not part.first <= lo <= hi < part.first + part.words:
            at = jnp.clip(at, 0, part.words - 1)  # a word of another part: read, not kept
        x = planes[k][_index(lead, row, base + at, shape)]
        out = x if out is None else jnp.where(words >= part.first, x, out)
    return out


def gpu_scatter(lay: Layout, planes, lead, record, words, values, mask, lo: int,
                hi: int) -> None:
    """Writes `values` (int32 words, bitcast to the planes' dtype) as words `words` of
    record(s) `record` of block `lead` where `mask` (all broadcast to values' shape; words
    in [lo, hi], static): one masked store per part holding some of them, at the word's
    own lane (another record sharing the lane row, and the slot's padding, keep theirs).

    A masked-off lane addresses one lane past its plane's last: never a lane another lane
    of the store writes (interpret mode writes back what a masked lane read, so two lanes
    sharing an address could undo a write).
    """
    from jax.experimental.pallas import triton as pl_triton

    shape = values.shape
    for k, part in _touched(lay, lo, hi):
        row, base = gpu_locate(part, record)
        inside = mask & (words >= part.first) & (words < part.first + part.words)
        lane = jnp.where(inside, base + words - part.first, part.lanes)
        ref = planes[k]
        out = values if values.dtype == ref.dtype else lax.bitcast_convert_type(values,
                                                                                ref.dtype)
        pl_triton.store(ref.at[_index(lead, row, lane, shape)], out,
                        mask=jnp.broadcast_to(inside, shape))


def records_of(lay: Layout, planes) -> int:
    """Records a block of the stored array holds: the lane map's, or for a layout of whole
    rows (no lane map: one array [..., rows, stored_width]) its rows."""
    return planes[0].shape[-2] if lay.whole and lay.records == 1 else lay.records


def gpu_loader(lay: Layout, planes, lead, record):
    """`load` of `decode_gpu` for n records: `record` i32[n] of blocks `lead` (ints,
    scalars or i32[n] each) of the planes; load(cols, lo, hi) gathers [n, L] words."""

    def column(x):
        return x[:, None] if jnp.ndim(x) == 1 else x

    lead, record = tuple(column(i) for i in lead), column(record)
    return lambda cols, lo, hi: gpu_gather(lay, planes, lead, record, cols, lo, hi)


def gpu_float_values(lay: Layout, planes, lead, record, dims, lo: int, hi: int) -> jax.Array:
    """f32 values of natural dims `dims` (i32, each in [lo, hi], static) of float rows
    ("float32" words as they are, 16-bit floats from the low or high half of word
    dim // 2), exactly; arguments as `gpu_gather`."""
    if lay.fmt == "float32":
        return gpu_gather(lay, planes, lead, record, dims, lo, hi)
    if not lay.halves:
        raise ValueError(f"gpu_float_values: {lay.fmt} rows are decoded into planes")
    words = _as_i32(gpu_gather(lay, planes, lead, record, dims >> 1, lo // 2, hi // 2))
    return jnp.where((dims & 1) == 1, half_value(lay.fmt, words, 1),
                     half_value(lay.fmt, words, 0))


def decode_gpu(lay: Layout, load) -> list[jax.Array]:
    """Planes (f32[n, plane_width] each) of rows read with `load`.

    Args:
      load: load(cols, lo, hi) -> the rows' words at row words `cols` (i32[1, plane_width],
        each in [lo, hi], static bounds) as [n, plane_width] (one gathered load per part
        the bounds touch: `gpu_loader`).

    Lanes that hold no dim (`Layout.lane_dims` -1) are 0 in every plane.
    """
    _no_records41(lay, "decode_gpu")
    lane = lax.broadcasted_iota(jnp.int32, (1, lay.plane_width), 1)
    if lay.fmt == "float32":
        return [load(lane, 0, lay.width - 1).astype(_F32)]
    if lay.halves:
        last = lay.stored_width - 1
        words = _as_i32(load(jnp.minimum(lane, last), 0, last))
        return [jnp.where(2 * lane + j < lay.width, half_value(lay.fmt, words, j), 0.0)
                for j in range(2)]
    codes = lane < lay.code_words
    words = _as_i32(load(jnp.minimum(lane, lay.code_words - 1), 0, lay.code_words - 1))
    block = jnp.minimum(lane // lay.words_per_block, lay.blocks - 1)
    scale_words = _as_i32(load(lay.scale_word + block // 4, lay.scale_word,
                               lay.scale_word + (lay.blocks - 1) // 4))
    scale = scale_value((scale_words >> 8 * (block % 4)) & 0xFF)
    planes = []
    for j in range(lay.n_planes):
        plane = jnp.where(codes, code_values(lay, words, j) * scale, 0.0)
        if lay.fmt == "fp8_latent" and lay.rope_dim:
            rope = j * lay.rope_lanes + lane - lay.code_words  # RoPE dim held by the lane
            inside = (~codes) & (rope < lay.rope_dim)
            half = lay.rope_dim // 2
            col = lay.code_words + jnp.clip(rope // 2, 0, half - 1)
            rope_words = _as_i32(load(col, lay.code_words, lay.code_words + half - 1))
            value = jnp.where(rope % 2 == 0, bf16_low(rope_words), bf16_high(rope_words))
            plane = jnp.where(inside, value, plane)
        planes.append(plane)
    return planes


__all__ = ["PACKED", "Layout", "check_stored", "decode_gpu", "decode_tpu", "encode_gpu",
           "from_planes", "gpu_encoder_planes", "gpu_float_values", "gpu_gather", "gpu_loader",
           "gpu_scatter", "layout", "to_planes"]


# --- encoders (compressor kernels, TPU) -----------------------------------------------------

def _parity(x: jax.Array) -> jax.Array:
    """Parity of the set bits of non-negative int32 values below 2^16."""
    for shift in (8, 4, 2, 1):
        x = x ^ (x >> shift)
    return x & 1


def _pack_bytes(sources, fields, stored: int) -> jax.Array:
    """int32 words [G, stored]: byte k of word w = sum_f fields[f] @ sources(k, f), where the
    fields hold integers in [0, 256) (as f32) and each 0/1 or small-integer selection matrix
    [width, stored] makes every product and sum exact (no lane relayout, one matmul each)."""
    words = None
    for k in range(4):
        byte = None
        for f, field in enumerate(fields):
            select = sources(k, f)
            if select is None:
                continue
            part = jnp.dot(field, select, precision=lax.Precision.HIGHEST,
                           preferred_element_type=_F32)
            byte = part if byte is None else byte + part
        shifted = byte.astype(jnp.int32) << 8 * k
        words = shifted if words is None else words | shifted
    return words


def _or_scale_bytes(words: jax.Array, lay: Layout, scale_bytes, first: int = 0,
                    count: int | None = None) -> jax.Array:
    """Words [G, n] of row words first .. with the scale bytes set (those in the range)."""
    lane = lax.broadcasted_iota(jnp.int32, words.shape, 1)
    count = words.shape[1] if count is None else count
    for b, byte in enumerate(scale_bytes):
        at = lay.scale_word + b // 4 - first
        if 0 <= at < count:
            words = words | jnp.where(lane == at, byte << 8 * (b % 4), 0)
    return words


def _block_scales(lane, values, finite, count: int, size: int, fmax: float, floor):
    """Per block of `size` lanes: the ue8m0 byte [G, 1] (int32) of its finite maximum, and
    whether it holds a non-finite value [G, 1]."""
    out = []
    for b in range(count):
        inside = (lane >= b * size) & (lane < (b + 1) * size)
        amax = jnp.max(jnp.where(inside & finite, jnp.abs(values), 0.0), axis=1, keepdims=True)
        bad = jnp.max(jnp.where(inside & ~finite, 1.0, 0.0), axis=1, keepdims=True) > 0
        out.append((inside, scale_byte(amax, fmax, floor), bad))
    return out


def f16_bits(x: jax.Array) -> jax.Array:
    """IEEE half-precision bits (int32 in [0, 65536)) of f32 x: nearest even, overflow to
    inf, NaN -> 0x7E00, the sign of zero kept (as XLA's f32 -> f16 convert)."""
    nan = jnp.isnan(x)
    sign = (_bits(x) >> 31) & 1
    mag = jnp.abs(jnp.where(nan, 0.0, x))
    bits = _bits(mag)
    rounded = bits + 0xFFF + ((bits >> 13) & 1)  # round the mantissa to 10 bits
    normal = ((((rounded >> 23) & 0xFF) - 112) << 10) | ((rounded >> 13) & 1023)
    sub = _round_int(mag * np.float32(2.0 ** 24))  # below 2^-14: steps of 2^-24
    code = jnp.where(mag < np.float32(2.0 ** -14), sub, normal)
    code = jnp.where(mag >= np.float32(65520.0), 0x7C00, code) | (sign << 15)
    return jnp.where(nan, 0x7E00, code)


def encode_tpu(lay: Layout, x: jax.Array, part: Part | None = None) -> jax.Array:
    """Stored words of f32 rows x [G, width] in natural order, exactly as `storage` encodes
    them (`encode_fp8_latent`, `encode_fp4_key` which rotates first, 16-bit floats rounded
    to nearest even; float32 rows as they are): [G, stored_width], or with `part` the part's
    words at lanes [0, part.words) of [G, part.lanes] (0 on the other lanes). uint32, or
    float32 for "float32" rows."""
    _no_records41(lay, "encode_tpu")
    g, width = x.shape[0], lay.width
    first, count = (0, lay.stored_width) if part is None else (part.first, part.words)
    cols = lay.stored_width if part is None else part.lanes
    if lay.fmt == "float32" and first == 0 and count == width == cols:
        return x.astype(_F32)
    dim = lax.broadcasted_iota(jnp.int32, (width, cols), 0)
    col = lax.broadcasted_iota(jnp.int32, (width, cols), 1)
    word, live = col + first, col < count
    lane = lax.broadcasted_iota(jnp.int32, (g, width), 1)
    blocks = []
    if lay.fmt == "float32":
        bits = _bits(x)
        fields = tuple(((bits >> 8 * k) & 0xFF).astype(_F32) for k in range(4))

        def sources(k, f):  # byte k of word w: byte k of dim w
            return (live & (dim == word)).astype(_F32) if f == k else None

        words = _pack_bytes(sources, fields, cols)
        return _f32(words)
    if lay.halves:
        half = bf16_bits(x) if lay.fmt == "bfloat16" else f16_bits(x)
        fields = ((half & 0xFF).astype(_F32), ((half >> 8) & 0xFF).astype(_F32))

        def sources(k, f):  # byte k of word w: byte k % 2 of dim 2 w + k // 2
            if f != k % 2:
                return None
            return (live & (dim == 2 * word + k // 2)).astype(_F32)

        return lax.bitcast_convert_type(_pack_bytes(sources, fields, cols), jnp.uint32)
    if lay.fmt == "fp4_index":
        i = lax.broadcasted_iota(jnp.int32, (width, width), 0)
        j = lax.broadcasted_iota(jnp.int32, (width, width), 1)
        sylvester = jnp.where(_parity(i & j) == 1, -1.0, 1.0).astype(_F32)
        x = jnp.dot(x, sylvester, precision=lax.Precision.HIGHEST,
                    preferred_element_type=_F32) * np.float32(width ** -0.5)
    finite = jnp.isfinite(x)
    if lay.fmt == "fp8_latent":
        blocks = _block_scales(lane, x, finite, lay.blocks, FP8_BLOCK, FP8_MAX, FP8_AMAX_FLOOR)
        scale = jnp.ones(x.shape, _F32)
        for inside, byte, _ in blocks:
            scale = jnp.where(inside, scale_value(byte), scale)
        nope = lane < lay.nope
        rope = bf16_bits(x)
        low = jnp.where(nope, e4m3_code(x / scale), rope & 0xFF).astype(_F32)
        high = jnp.where(nope, 0, (rope >> 8) & 0xFF).astype(_F32)
        cw, half = lay.code_words, lay.rope_dim // 2

        def sources(k, f):
            rope_word = (word >= cw) & (word < cw + half)
            rope_dim = lay.nope + 2 * (word - cw) + k // 2
            if f == 0:
                select = (word < cw) & (dim == 4 * word + k)
                if k % 2 == 0:
                    select = select | (rope_word & (dim == rope_dim))
            elif k % 2 == 1 and half:
                select = rope_word & (dim == rope_dim)
            else:
                return None
            return (live & select).astype(_F32)

        words = _pack_bytes(sources, (low, high), cols)
    else:
        blocks = _block_scales(lane, x, finite, lay.blocks, FP4_BLOCK, FP4_MAX, FP4_AMAX_FLOOR)
        # `bad` as 0 / 1 floats: Mosaic cannot lay out a select between boolean vectors.
        scale, bad = jnp.ones(x.shape, _F32), jnp.zeros(x.shape, _F32)
        for b, (inside, byte, block_bad) in enumerate(blocks):
            byte = jnp.where(block_bad, 0xFF, byte)
            blocks[b] = (inside, byte, block_bad)
            scale = jnp.where(inside, scale_value(byte), scale)
            bad = jnp.where(inside, jnp.where(block_bad, 1.0, 0.0), bad)
        bad = bad > 0
        q = jnp.clip(jnp.where(bad, 0.0, x / scale), -FP4_MAX, FP4_MAX)
        codes = jnp.where(bad, 0, e2m1_code(q)).astype(_F32)

        def sources(k, f):  # byte k of word w: dims 8 w + 2 k (low nibble), 8 w + 2 k + 1
            inside = live & (word < lay.code_words)
            low = inside & (dim == 8 * word + 2 * k)
            high = inside & (dim == 8 * word + 2 * k + 1)
            return jnp.where(low, 1.0, jnp.where(high, 16.0, 0.0)).astype(_F32)

        words = _pack_bytes(sources, (codes,), cols)
    words = _or_scale_bytes(words, lay, [byte for _, byte, _ in blocks], first, count)
    return lax.bitcast_convert_type(words, jnp.uint32)


# --- encoders (compressor kernels, GPU) -----------------------------------------------------
# Triton has no lane shuffles, so the GPU compressor pools each word's dims straight into
# planes (its gathers take any column map) and packs planes lane by lane: no relayout. The
# words come out as *segments*, (first word, stride, int32 words [G, L], n): lane l < n holds
# row word first + stride * l (L, a power of two, may exceed n), which `gpu_scatter` writes.

def gpu_encoder_planes(lay: Layout) -> tuple[tuple[int, int, int], ...]:
    """The planes `encode_gpu` takes, as (first dim, stride, lanes): plane lane l holds
    natural dim first + stride * l (every lane count a power of two).

    fp8_latent: per scale block b and byte j, the 16 dims 64 b + j + 4 l of code words
    16 b + l; then the even and the odd RoPE dims (low / high halves of the RoPE words).
    fp4_index: per nibble j the c / 8 dims j + 8 l of the ROTATED key (`hadamard_planes`).
    float formats: the even and the odd dims (each other's RoPE partners; a 16-bit word
    holds one of each).
    """
    _no_records41(lay, "gpu_encoder_planes")
    if lay.fmt == "fp8_latent":
        wpb = lay.words_per_block
        planes = [(FP8_BLOCK * b + j, 4, wpb) for b in range(lay.blocks) for j in range(4)]
        if lay.rope_dim:
            planes += [(lay.nope + k, 2, lay.rope_dim // 2) for k in range(2)]
        return tuple(planes)
    if lay.fmt == "fp4_index":
        return tuple((j, 8, lay.code_words) for j in range(8))
    if lay.width % 2:
        raise ValueError(f"gpu_encoder_planes: {lay.fmt} rows of odd width {lay.width} have "
                         "no even / odd planes of one lane count")
    return ((0, 2, lay.width // 2), (1, 2, lay.width // 2))


def hadamard_planes(lay: Layout, x: jax.Array, first_dim: int, stride: int = 1
                    ) -> list[jax.Array]:
    """Part of the unscaled Hadamard rotation of fp4_index keys from a run of their dims:
    x f32[G, L] holds dims first_dim + stride * l; plane j f32[G, c / 8] lane w gets
    sum_l x[:, l] * H[first_dim + stride * l, 8 w + j] (H the +-1 Sylvester matrix). Summed
    over runs covering every dim once and scaled by c^-0.5: the planes of
    `storage.hadamard(key)` (up to the order of the fp32 sums)."""
    shape = (1, x.shape[1], lay.code_words)
    dim = first_dim + stride * lax.broadcasted_iota(jnp.int32, shape, 1)
    word = lax.broadcasted_iota(jnp.int32, shape, 2)
    wide = jnp.broadcast_to(x[:, :, None], (x.shape[0], *shape[1:]))
    return [jnp.sum(jnp.where(_parity(dim & (8 * word + j)) == 1, -wide, wide), axis=1)
            for j in range(8)]


def _float_segments(lay: Layout, planes, groups) -> list[tuple[int, int, jax.Array, int]]:
    """Segments of float rows given as planes of natural dims `groups` ((first dim, stride,
    lanes) each): "float32" a segment per plane (the values' bits); 16-bit floats a segment
    per pair of consecutive planes (even dims, then the odd dims after them: word d // 2 of
    an even dim d holds d in its low half, d + 1 in its high half), rounded to nearest even
    as XLA's converts round."""
    if lay.fmt == "float32":
        return [(first, stride, _bits(p), lanes)
                for (first, stride, lanes), p in zip(groups, planes, strict=True)]
    if len(groups) % 2:
        raise ValueError(f"encode_gpu: {lay.fmt} words hold pairs of dims; got {len(groups)} "
                         "planes")
    bits = bf16_bits if lay.fmt == "bfloat16" else f16_bits
    out = []
    for k in range(0, len(groups), 2):
        (first, stride, lanes), odd = groups[k], groups[k + 1]
        if first % 2 or stride % 2 or odd != (first + 1, stride, lanes):
            raise ValueError(f"encode_gpu: {lay.fmt} planes pair even dims with the odd dims "
                             f"after them; got {groups[k]} and {odd}")
        words = bits(planes[k]) | (bits(planes[k + 1]) << 16)
        out.append((first // 2, stride // 2, words, lanes))
    return out


def encode_gpu(lay: Layout, planes, groups=None) -> list[tuple[int, int, jax.Array, int]]:
    """Stored words of f32 rows given as planes, exactly as `storage` encodes those rows
    (`encode_fp8_latent`, `encode_fp4_key(rotated=True)`, 16-bit floats rounded to nearest
    even, "float32" values as they are).

    Args:
      planes: f32[G, lanes] per plane of `groups`.
      groups: (first dim, stride, lanes) per plane; default `gpu_encoder_planes(lay)`, the
        only planes of a packed format. Float rows may be given by any planes of their dims
        (16-bit floats: pairs of even and odd dims, `_float_segments`), e.g. a run of a row.

    Returns:
      Segments (first word, stride, int32 words [G, L], n): lane l < n of the words is row
      word first + stride * l (L, a power of two, may exceed n).
    """
    _no_records41(lay, "encode_gpu")
    lanes_of = gpu_encoder_planes(lay) if groups is None else tuple(groups)
    if len(planes) != len(lanes_of):
        raise ValueError(f"encode_gpu: {lay.fmt} takes {len(lanes_of)} planes; got "
                         f"{len(planes)}")
    if not lay.packed:
        return _float_segments(lay, planes, lanes_of)
    if lanes_of != gpu_encoder_planes(lay):
        raise ValueError(f"encode_gpu: {lay.fmt} rows are encoded from the planes of "
                         f"gpu_encoder_planes; got {lanes_of}")
    out, scale_bytes = [], []
    if lay.fmt == "fp8_latent":
        wpb = lay.words_per_block
        for b in range(lay.blocks):
            block = planes[4 * b:4 * b + 4]
            amax = functools.reduce(jnp.maximum, [
                jnp.max(jnp.where(jnp.isfinite(p), jnp.abs(p), 0.0), axis=1, keepdims=True)
                for p in block])
            byte = scale_byte(amax, FP8_MAX, FP8_AMAX_FLOOR)
            scale = scale_value(byte)
            words = functools.reduce(jnp.bitwise_or, [
                e4m3_code(p / scale) << 8 * j for j, p in enumerate(block)])
            out.append((wpb * b, 1, words, wpb))
            scale_bytes.append(byte)
        if lay.rope_dim:
            even, odd = planes[4 * lay.blocks:]
            out.append((lay.code_words, 1, bf16_bits(even) | (bf16_bits(odd) << 16),
                        lay.rope_dim // 2))
    else:
        lane = lax.broadcasted_iota(jnp.int32, (1, lay.code_words), 1)
        scale = jnp.ones((1, lay.code_words), _F32)
        bad = jnp.zeros((1, lay.code_words), jnp.bool_)
        for b in range(lay.blocks):
            inside = lane // lay.words_per_block == b
            amax = functools.reduce(jnp.maximum, [
                jnp.max(jnp.where(inside & jnp.isfinite(p), jnp.abs(p), 0.0), axis=1,
                        keepdims=True) for p in planes])
            block_bad = functools.reduce(jnp.maximum, [
                jnp.max(jnp.where(inside & ~jnp.isfinite(p), 1.0, 0.0), axis=1, keepdims=True)
                for p in planes]) > 0
            byte = jnp.where(block_bad, 0xFF, scale_byte(amax, FP4_MAX, FP4_AMAX_FLOOR))
            scale = jnp.where(inside, scale_value(byte), scale)
            bad = jnp.where(inside, block_bad, bad)
            scale_bytes.append(byte)
        codes = [jnp.where(bad, 0, e2m1_code(jnp.clip(jnp.where(bad, 0.0, p / scale),
                                                      -FP4_MAX, FP4_MAX))) for p in planes]
        out.append((0, 1, functools.reduce(jnp.bitwise_or, [c << 4 * j for j, c in
                                                            enumerate(codes)]),
                    lay.code_words))
    n_scale = _ceil_div(lay.blocks, 4)
    lane = lax.broadcasted_iota(jnp.int32, (1, next_power_of_two(n_scale)), 1)
    words = functools.reduce(jnp.bitwise_or, [
        jnp.where(lane == b // 4, byte << 8 * (b % 4), 0) for b, byte in enumerate(scale_bytes)])
    out.append((lay.scale_word, 1, words, n_scale))
    return out
