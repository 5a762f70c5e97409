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
  float formats (float32, bfloat16, float16): the row as it is.

Planes
------
A word holds 4 (fp8) or 8 (fp4) dims that are neighbours in the natural order, and spreading
them back over lanes is a relayout neither Mosaic nor Triton does cheaply. The kernels do not
spread them: a decoded tile is a list of `Layout.n_planes` planes [rows, plane_width], plane
j lane w holding natural dim `Layout.lane_dims()[j, w]` (-1: a lane that holds 0). A dot
product over the dims is the sum over planes of the planes' dot products, so the ops hand the
kernels queries already laid out in planes (`to_planes`, a gather in XLA) and put the
kernels' outputs back in natural order (`from_planes`). Float formats are one plane, the row.

  TPU (`decode_tpu`): a plane is as wide as the stored row (S lanes, the tile as copied into
  VMEM); plane j takes byte / nibble j of each code word, fp8 planes 0 and 1 also the low /
  high bf16 halves of the RoPE words; per-lane scales come from masked lane reductions.
  GPU (`decode_gpu`): a plane is a power of two wide (Triton); each is one gathered load of
  the words its lanes need: fp8 planes hold 128 lanes for V4 (112 code words + 16 of the 64
  RoPE dims each, so the 4 planes are exactly the 512 dims), fp4 planes c / 8 lanes.

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

from pallas_kernels.common import MIN_DOT, next_power_of_two

PACKED = ("fp8_latent", "fp4_index")
FP8_BLOCK, FP8_MAX = 64, 448.0
FP4_BLOCK, FP4_MAX = 32, 6.0
FP8_AMAX_FLOOR = np.float32(1e-4)
FP4_AMAX_FLOOR = np.float32(6 * 2.0 ** -126)
_F32 = jnp.float32
_HIGH_HALF = np.int32(-65536)  # 0xFFFF0000


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a kernel sees rows of one stored format (static).

    Attributes:
      fmt: "fp8_latent", "fp4_index" or "float" (any plain float dtype).
      width: values per row (hd, or c for indexer keys).
      rope_dim: the last rope_dim dims are RoPE dims (fp8_latent stores them in bf16).
      backend: "tpu" or "gpu" (the plane shapes differ, see the module docstring).
    """

    fmt: str
    width: int
    rope_dim: int
    backend: str

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
        elif self.fmt != "float":
            raise ValueError(f"fmt={self.fmt!r}: expected 'float', 'fp8_latent' or 'fp4_index'")
        if self.backend not in ("tpu", "gpu"):
            raise ValueError(f"backend={self.backend!r}: expected 'tpu' or 'gpu'")

    @property
    def packed(self) -> bool:
        return self.fmt != "float"

    @property
    def nope(self) -> int:
        return self.width - self.rope_dim

    @property
    def code_words(self) -> int:
        """Words of codes at the start of a row."""
        return self.nope // 4 if self.fmt == "fp8_latent" else self.width // 8

    @property
    def blocks(self) -> int:
        """Scale blocks per row."""
        return self.nope // FP8_BLOCK if self.fmt == "fp8_latent" else self.width // FP4_BLOCK

    @property
    def scale_word(self) -> int:
        """Index of the first word of scale bytes."""
        extra = self.rope_dim // 2 if self.fmt == "fp8_latent" else 0
        return self.code_words + extra

    @property
    def stored_width(self) -> int:
        """Last dim of a stored row (words for packed formats)."""
        if not self.packed:
            return self.width
        return self.scale_word + _ceil_div(self.blocks, 4)

    @property
    def per_word(self) -> int:
        return {"fp8_latent": 4, "fp4_index": 8}.get(self.fmt, 1)

    @property
    def n_planes(self) -> int:
        return self.per_word

    @property
    def words_per_block(self) -> int:
        return (FP8_BLOCK if self.fmt == "fp8_latent" else FP4_BLOCK) // self.per_word

    @property
    def plane_width(self) -> int:
        if not self.packed:
            return self.width
        if self.backend == "tpu":
            return self.stored_width
        if self.fmt == "fp8_latent":  # code lanes, then a quarter of the RoPE dims
            return max(MIN_DOT, next_power_of_two(self.code_words + _ceil_div(self.rope_dim, 4)))
        return max(MIN_DOT, self.code_words)

    @property
    def rope_lanes(self) -> int:
        """GPU fp8: RoPE dims held by each plane after its code lanes."""
        return self.plane_width - self.code_words

    def lane_dims(self) -> np.ndarray:
        """i32[n_planes, plane_width]: the natural dim each plane lane holds, -1 for none."""
        dims = np.full((self.n_planes, self.plane_width), -1, np.int32)
        if not self.packed:
            dims[0] = np.arange(self.width)
            return dims
        w = np.arange(self.code_words)
        for j in range(self.n_planes):
            dims[j, :self.code_words] = self.per_word * w + j
        if self.fmt == "fp8_latent" and self.rope_dim:
            half = self.rope_dim // 2
            if self.backend == "tpu":
                lanes = self.code_words + np.arange(half)
                dims[0, lanes] = self.nope + 2 * np.arange(half)
                dims[1, lanes] = self.nope + 2 * np.arange(half) + 1
            else:
                for j in range(self.n_planes):
                    rope = j * self.rope_lanes + np.arange(self.rope_lanes)
                    keep = rope < self.rope_dim
                    dims[j, self.code_words + np.arange(self.rope_lanes)[keep]] = (
                        self.nope + rope[keep])
        return dims


@functools.cache
def layout(fmt: str, width: int, rope_dim: int, backend: str) -> Layout:
    """The `Layout` of a storage format name as the cache geometry spells it (every plain float
    dtype name is "float")."""
    return Layout(fmt if fmt in PACKED else "float", width, rope_dim, backend)


def check_stored(lay: Layout, array, name: str) -> None:
    """Raises ValueError naming `name` if its rows do not have the layout's stored width."""
    if array.shape[-1] != lay.stored_width:
        raise ValueError(f"{name}: rows of {lay.fmt} with width {lay.width} (rope_dim "
                         f"{lay.rope_dim}) are {lay.stored_width} wide; got last dim "
                         f"{array.shape[-1]}")
    if lay.packed and jnp.dtype(array.dtype) != jnp.dtype(jnp.uint32):
        raise ValueError(f"{name}: {lay.fmt} rows are uint32 words; got {array.dtype}")


# --- XLA side: queries into planes, outputs back ------------------------------------------

def to_planes(lay: Layout, x: jax.Array) -> jax.Array:
    """[..., width] -> [..., n_planes, plane_width] (0 on lanes that hold no dim)."""
    dims = lay.lane_dims()
    planes = jnp.take(x, np.maximum(dims, 0), axis=-1)
    return jnp.where(dims >= 0, planes, jnp.zeros((), x.dtype))


def from_planes(lay: Layout, y: jax.Array) -> jax.Array:
    """[..., n_planes, plane_width] -> [..., width]: the inverse of `to_planes`."""
    dims = lay.lane_dims().reshape(-1)
    where = np.zeros(lay.width, np.int32)
    where[dims[dims >= 0]] = np.flatnonzero(dims >= 0)
    return jnp.take(y.reshape(*y.shape[:-2], -1), where, axis=-1)


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

def _in(lane, lo: int, hi: int):
    return (lane >= lo) & (lane < hi)


def code_values(lay: Layout, words: jax.Array, j: int) -> jax.Array:
    """f32 values (before their block scale) of the codes of plane j: byte j (fp8_latent) or
    nibble j (fp4_index) of every word."""
    if lay.fmt == "fp8_latent":
        return e4m3_value((words >> 8 * j) & 0xFF)
    return e2m1_value((words >> 4 * j) & 15)


def decode_tpu(lay: Layout, tile: jax.Array) -> list[jax.Array]:
    """Planes (f32[n, plane_width] each) of a tile of stored rows [n, stored_width] as loaded."""
    if not lay.packed:
        return [tile.astype(_F32)]
    words = _as_i32(tile)
    lane = lax.broadcasted_iota(jnp.int32, words.shape, 1)
    scale = jnp.zeros(words.shape, _F32)
    for b in range(lay.blocks):  # the block's byte, on every lane of the row
        shift, col = 8 * (b % 4), lay.scale_word + b // 4
        byte = jnp.max(jnp.where(lane == col, ((words >> shift) & 0xFF).astype(_F32), 0.0),
                       axis=1, keepdims=True)
        lanes = _in(lane, b * lay.words_per_block, (b + 1) * lay.words_per_block)
        scale = jnp.where(lanes, scale_value(byte.astype(jnp.int32)), scale)
    codes = lane < lay.code_words
    planes = []
    for j in range(lay.n_planes):
        plane = jnp.where(codes, code_values(lay, words, j) * scale, 0.0)
        if lay.fmt == "fp8_latent" and j < 2 and lay.rope_dim:
            rope = _in(lane, lay.code_words, lay.code_words + lay.rope_dim // 2)
            plane = jnp.where(rope, bf16_low(words) if j == 0 else bf16_high(words), plane)
        planes.append(plane)
    return planes


def decode_gpu(lay: Layout, load) -> list[jax.Array]:
    """Planes (f32[n, plane_width] each) of rows read with `load`.

    Args:
      load: load(cols) -> the rows' words at columns `cols` (i32[1, plane_width], in range)
        as [n, plane_width] (one gathered load); load(None) -> the whole rows as stored (float
        formats only).
    """
    if not lay.packed:
        return [load(None).astype(_F32)]
    lane = lax.broadcasted_iota(jnp.int32, (1, lay.plane_width), 1)
    codes = lane < lay.code_words
    words = _as_i32(load(jnp.minimum(lane, lay.code_words - 1)))
    block = jnp.minimum(lane // lay.words_per_block, lay.blocks - 1)
    scale_words = _as_i32(load(lay.scale_word + block // 4))
    scale = scale_value((scale_words >> 8 * (block % 4)) & 0xFF)
    planes = []
    for j in range(lay.n_planes):
        plane = jnp.where(codes, code_values(lay, words, j) * scale, 0.0)
        if lay.fmt == "fp8_latent" and lay.rope_dim:
            rope = j * lay.rope_lanes + lane - lay.code_words  # RoPE dim held by the lane
            inside = (~codes) & (rope < lay.rope_dim)
            col = lay.code_words + jnp.clip(rope // 2, 0, lay.rope_dim // 2 - 1)
            rope_words = _as_i32(load(col))
            value = jnp.where(rope % 2 == 0, bf16_low(rope_words), bf16_high(rope_words))
            plane = jnp.where(inside, value, plane)
        planes.append(plane)
    return planes


__all__ = ["PACKED", "Layout", "check_stored", "decode_gpu", "decode_tpu", "from_planes",
           "layout", "to_planes"]


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


def _or_scale_bytes(words: jax.Array, lay: Layout, scale_bytes) -> jax.Array:
    lane = lax.broadcasted_iota(jnp.int32, words.shape, 1)
    for b, byte in enumerate(scale_bytes):
        words = words | jnp.where(lane == lay.scale_word + b // 4, byte << 8 * (b % 4), 0)
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


def encode_tpu(lay: Layout, x: jax.Array) -> jax.Array:
    """uint32 rows [G, stored_width] of f32 rows x [G, width] in natural order, exactly as
    `storage.encode_fp8_latent` / `storage.encode_fp4_key` (which rotates first)."""
    if not lay.packed:
        raise ValueError(f"encode_tpu: {lay.fmt} rows are stored as they are")
    g, width, stored = x.shape[0], lay.width, lay.stored_width
    dim = lax.broadcasted_iota(jnp.int32, (width, stored), 0)
    word = lax.broadcasted_iota(jnp.int32, (width, stored), 1)
    lane = lax.broadcasted_iota(jnp.int32, (g, width), 1)
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
            return select.astype(_F32)

        words = _pack_bytes(sources, (low, high), stored)
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
            inside = word < lay.code_words
            low = inside & (dim == 8 * word + 2 * k)
            high = inside & (dim == 8 * word + 2 * k + 1)
            return jnp.where(low, 1.0, jnp.where(high, 16.0, 0.0)).astype(_F32)

        words = _pack_bytes(sources, (codes,), stored)
    words = _or_scale_bytes(words, lay, [byte for _, byte, _ in blocks])
    return lax.bitcast_convert_type(words, jnp.uint32)


# --- encoders (compressor kernels, GPU) -----------------------------------------------------
# Triton has no lane shuffles, so the GPU compressor pools each word's dims straight into
# planes (its gathers take any column map) and packs planes lane by lane: no relayout.

def gpu_encoder_planes(lay: Layout) -> tuple[tuple[int, int, int], ...]:
    """The planes `encode_gpu` takes, as (first dim, stride, lanes): plane lane l holds
    natural dim first + stride * l (every lane count a power of two).

    fp8_latent: per scale block b and byte j, the 16 dims 64 b + j + 4 l of code words
    16 b + l; then the even and the odd RoPE dims (low / high halves of the RoPE words).
    fp4_index: per nibble j the c / 8 dims j + 8 l of the ROTATED key (`hadamard_planes`).
    """
    if lay.fmt == "fp8_latent":
        wpb = lay.words_per_block
        planes = [(FP8_BLOCK * b + j, 4, wpb) for b in range(lay.blocks) for j in range(4)]
        if lay.rope_dim:
            planes += [(lay.nope + k, 2, lay.rope_dim // 2) for k in range(2)]
        return tuple(planes)
    if lay.fmt == "fp4_index":
        return tuple((j, 8, lay.code_words) for j in range(8))
    raise ValueError(f"gpu_encoder_planes: {lay.fmt} rows are stored as they are")


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


def encode_gpu(lay: Layout, planes) -> list[tuple[int, jax.Array, int]]:
    """Stored words of f32 rows given as the planes of `gpu_encoder_planes`, exactly as
    `storage.encode_fp8_latent` / `storage.encode_fp4_key(rotated=True)` encode those rows.

    Returns:
      (first word, int32 words [G, L], n): words first .. first + n - 1 of the rows are
      lanes [0, n) of the words (L, a power of two, may exceed n).
    """
    lanes_of = gpu_encoder_planes(lay)
    if len(planes) != len(lanes_of):
        raise ValueError(f"encode_gpu: {lay.fmt} takes {len(lanes_of)} planes; got "
                         f"{len(planes)}")
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
            out.append((wpb * b, words, wpb))
            scale_bytes.append(byte)
        if lay.rope_dim:
            even, odd = planes[4 * lay.blocks:]
            out.append((lay.code_words, bf16_bits(even) | (bf16_bits(odd) << 16),
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
        out.append((0, functools.reduce(jnp.bitwise_or, [c << 4 * j for j, c in
                                                         enumerate(codes)]),
                    lay.code_words))
    n_scale = _ceil_div(lay.blocks, 4)
    lane = lax.broadcasted_iota(jnp.int32, (1, next_power_of_two(n_scale)), 1)
    words = functools.reduce(jnp.bitwise_or, [
        jnp.where(lane == b // 4, byte << 8 * (b % 4), 0) for b, byte in enumerate(scale_bytes)])
    out.append((lay.scale_word, words, n_scale))
    return out
