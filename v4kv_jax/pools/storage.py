"""How a row is stored: the one codec of the cache.

Every write of a stored row (compressor emission into the Classical pool, window and tail
writes into the State pool) goes through `RowCodec.encode`, every read through
`RowCodec.decode`; the Pallas kernels widen what they load the same way. Every stored row is
a run of 32-bit words, so that a TPU stores every pool in whole 32-bit lanes (`lanes`: where
a row lives). Plain float formats: "float32" rows are [..., width] float32; "bfloat16" and
"float16" rows are [..., ceil(width / 2)] uint32 words, value 2 i in the low half of word i
and value 2 i + 1 in its high half (the 16-bit pattern of the value rounded to nearest even;
an odd width leaves a zero high half). `row_bytes(width, fmt)` bytes a row.

Every stored array of the cache has one `RowCodec` (format, width, RoPE dims), given by
`codec(model, geometry, name)` for the Classical pools and the window ring ("csa" C4 entries
and "hca" C128 entries in `entry_dtype`, "csa_index" indexer keys in `index_dtype`,
"window" in `window_dtype`); the compressor tails are float formats (`tail_dtype`). Its
`encode` is the one write path and its `decode` the one read path of the jnp reference.

Packed formats (the official release's numerics)
-------------------------------------------------
A packed row is [..., stored_width(width, fmt, rope_dim)] of uint32 words (32-bit lanes, so a
TPU pool never holds a byte array; a pool may further view a page of rows as 128-wide lanes).
Bytes are numbered inside a word little-endian: byte j of word w is `(w >> 8 j) & 0xFF`, so a
bitcast of the words to uint8 on a little-endian host is the byte stream below.

"fp8_latent" (entries and window): `encode_fp8_latent(x f32[..., hd], r)`, hd - r = nope dims
(a multiple of 64), r RoPE dims (the LAST r dims, r even), nb = (hd - r) / 64 blocks:

    bytes [0, nope)              e4m3fn code of nope dim i at byte i
    bytes [nope, nope + 2 r)     bf16 bits of RoPE dim j at bytes nope + 2 j (low byte first)
    bytes [nope + 2 r, + nb)     ue8m0 scale byte of block b (biased exponent: 2^(byte - 127))
    then zero bytes up to a multiple of 4
    hd 512, r 64: 448 + 128 + 7 + 1 pad = 584 B = uint32[..., 146]
                  (words [0, 112) codes, [112, 144) RoPE dims, [144, 146) scales + pad)

"fp4_index" (indexer keys): `encode_fp4_key(k f32[..., c])`, c a power of two >= 32,
nb = c / 32 blocks, of the ROTATED key y = hadamard(k):

    bytes [0, c / 2)             e2m1 code of dim i in nibble i % 2 of byte i // 2 (even dims in
                                 the low nibble): word w holds dims 8 w .. 8 w + 7, dim 8 w + j
                                 at bits [4 j, 4 j + 4)
    bytes [c / 2, c / 2 + nb)    ue8m0 scale byte of block b
    then zero bytes up to a multiple of 4
    c 128: 64 + 4 = 68 B = uint32[..., 17]

Quantisation (my reading of SPEC section 8 / issue 11 and the official reference's
fake-quantisation, `act_quant` with power-of-two scales):
- per block of B values (64 for e4m3, 32 for e2m1) with format maximum M (448, 6):
  amax = max |x| over the block's finite values, then amax = max(amax, floor), floor = fp32
  1e-4 for fp8 (`act_quant`) and 6 * 2^-126 for fp4. NOTE: issue 11 says 1e-4 for fp4 too;
  several independent re-implementations of the official `fp4_act_quant` (indexer keys and
  queries) floor at 6 * 2^-126 (an all-zero block gets scale byte 1), so that is used here
  (`FP4_AMAX_FLOOR`, one constant to change). The two differ only for blocks with
  amax <= 6 * 2^-16 (about 9.2e-5).
  scale = 2^ceil(log2(amax * fp32(1 / M))), computed like the reference's "fast" path from the
  fp32 bits of amax * fp32(1 / M): biased exponent + (mantissa != 0). The multiplication by the
  rounded reciprocal (not a division) is my reading of the reference's
  `fast_round_scale(amax, fp8_max_inv)`; at amax = M 2^k it still gives exactly 2^k.
- q = round-to-nearest-even(clip(x / scale, -M, M)) in e4m3fn / e2m1 (x / scale is exact, the
  scale being a power of two); dequantised value = q * scale in fp32 (exact). Negative zero
  stays negative zero. The RoPE dims of fp8_latent are plain bf16 (round to nearest even).
- scale >= amax / M (up to the fp32 rounding of the product), so the clip acts on non-finite
  values (and would on a value within an ulp of M 2^k, giving M). NaN / inf, stated choices
  (the reference does not define them): fp8_latent: NaN -> the e4m3fn NaN code 0x7F
  (whatever its sign) and decodes to NaN, +-inf saturates to +-448 * scale, neither affects
  the block's scale; NaN in a RoPE dim -> bf16 0x7FC0, +-inf stays +-inf.
  fp4_index (no NaN / inf in e2m1): a block whose rotated values hold a NaN or inf stores the
  e8m0 NaN scale 0xFF and zero codes, so the whole block decodes to NaN (the rotation spreads a
  single non-finite key value over all c dims anyway).
- `hadamard(x)`: x @ H_c with H_c the Sylvester Hadamard matrix (H_1 = [1], H_2n =
  [[H_n, H_n], [H_n, -H_n]], symmetric) scaled by c^-0.5 (orthonormal), in fp32 (a +-1 matmul
  at HIGHEST precision, then the scale). The indexer query is rotated the same way
  (`hadamard(q)` per head), so q . k = hadamard(q) . hadamard(k) up to fp32 rounding, and
  scores against the decoded (rotated) keys are the reference's. The official kernel's
  summation order (a butterfly) may differ from this matmul's in the last fp32 bit, which can
  flip an e2m1 rounding decision at an exact tie. Not done here (for the wiring to decide): the
  official reference runs the rotation on bf16 activations (its output rounded to bf16 before
  the fp4 step) and, by the same re-implementations, also fake-quantises the rotated indexer
  QUERY in fp4 (here: `decode_fp4_key(encode_fp4_key(hadamard(q), rotated=True), c)`).
- Scale bytes the encoder writes lie in [105, 247] (fp8: 1e-4 floor to fp32 max) and
  [1, 253] or 0xFF (fp4); decoding accepts every byte, 0xFF as NaN. XLA on CPU flushes fp32
  subnormals to zero: scale byte 0 (2^-127) decodes to 0, and fp4 blocks with amax below
  about 2^-117 (scales near 2^-126) can lose their smallest values to zero. fp8: a block
  with amax > 224 * 2^120 gets scale 2^120 (byte 247); its values >= 248 * 2^120 round to
  q = 256 and decode to inf (q * scale overflows fp32).

DeepSeek-V4.1's records "nvfp4" (compressed entries), "mxfp8" (window rows) and "mxfp4" (index
keys), V41_SPEC.md section 7: packed formats of any width a multiple of their block, every dim
quantised, no rotation; their bytes, arithmetic and NaN / inf rules are `records41`'s
docstring. Here they are dispatched like the others; no `CacheConfig` field accepts them yet.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from v4kv_jax import checks
from v4kv_jax.config import STORAGE_FORMATS, AttentionConfig, CacheConfig
from v4kv_jax.pools import lanes, records41

PACKED_FORMATS = ("fp8_latent", "fp4_index") + records41.RECORD_FORMATS
FORMATS = STORAGE_FORMATS + PACKED_FORMATS

FP8_BLOCK, FP8_MAX = 64, 448.0
FP4_BLOCK, FP4_MAX = 32, 6.0
AMAX_FLOOR = np.float32(1e-4)  # fp8 blocks
FP4_AMAX_FLOOR = np.float32(6 * 2.0 ** -126)  # fp4 blocks (see the module docstring)
_FP8_NAN = 0x7F
_BF16_NAN = 0x7FC0
_E8M0_NAN = 0xFF
# e2m1 magnitudes by code (sign in bit 3) and the rounding thresholds between codes k - 1 and k.
_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
_E2M1_CUTS = (_E2M1[1:] + _E2M1[:-1]) / 2
_E2M1_EVEN = np.arange(1, 8) % 2 == 0


HALF_FORMATS = ("bfloat16", "float16")  # two values to a stored word


def dtype(fmt: str) -> jnp.dtype:
    """The array dtype rows of format `fmt` are stored in: float32 for "float32", uint32
    words for every other format (16-bit values in pairs, packed formats)."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt: expected one of {FORMATS}; got {fmt!r}")
    return jnp.dtype(jnp.float32 if fmt == "float32" else jnp.uint32)


def encode_halves(x: jax.Array, fmt: str) -> jax.Array:
    """uint32 words [..., ceil(width / 2)] of f32 [..., width] rounded to `fmt` ("bfloat16"
    or "float16"): value 2 i in the low half of word i, 2 i + 1 in the high half."""
    bits = lax.bitcast_convert_type(jnp.asarray(x).astype(fmt), jnp.uint16)
    return _pack(_pad_even(bits), 16)


def decode_halves(words: jax.Array, width: int, fmt: str) -> jax.Array:
    """f32 [..., width] of `encode_halves` words (widened exactly)."""
    halves = lax.bitcast_convert_type(words, jnp.dtype(fmt))
    return halves.reshape(*words.shape[:-1], -1)[..., :width].astype(jnp.float32)


def _pad_even(x: jax.Array) -> jax.Array:
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, x.shape[-1] % 2)]) if x.shape[-1] % 2 else x


def _words(nbytes: int) -> int:
    return -(-nbytes // 4)


def _check_fp8(width: int, rope_dim: int) -> tuple[int, int]:
    nope = width - rope_dim
    if rope_dim < 0 or rope_dim % 2 or nope <= 0 or nope % FP8_BLOCK:
        raise ValueError(f"fp8_latent: needs an even rope_dim >= 0 and width - rope_dim a "
                         f"positive multiple of {FP8_BLOCK}; got width {width}, rope_dim "
                         f"{rope_dim}")
    return nope, nope // FP8_BLOCK


def _check_fp4(width: int) -> int:
    if width < FP4_BLOCK or width & (width - 1):
        raise ValueError(f"fp4_index: needs a power-of-two width >= {FP4_BLOCK}; got {width}")
    return width // FP4_BLOCK


def stored_width(width: int, fmt: str, rope_dim: int = 0) -> int:
    """Last-dim length of a stored row of `width` values (`rope_dim` only for fp8_latent)."""
    if fmt == "fp8_latent":
        nope, nb = _check_fp8(width, rope_dim)
        return nope // 4 + rope_dim // 2 + _words(nb)
    if fmt == "fp4_index":
        return width // 8 + _words(_check_fp4(width))
    if fmt in records41.RECORD_FORMATS:
        return records41.record_words(width, fmt)
    dtype(fmt)
    return -(-width // 2) if fmt in HALF_FORMATS else width


def row_bytes(width: int, fmt: str, rope_dim: int = 0) -> int:
    """Bytes of one stored row of `width` values, padding included (fp8_latent 512 / 64: 584;
    fp4_index 128: 68; nvfp4 512: 288, mxfp8 512: 528, mxfp4 128: 68)."""
    return stored_width(width, fmt, rope_dim) * int(np.dtype(dtype(fmt)).itemsize)


# --- bytes <-> words --------------------------------------------------------------------------

def _pack(parts: jax.Array, bits: int) -> jax.Array:
    """uint32 [..., n * 32 / bits] of `bits`-bit fields -> uint32 [..., n] (field j at bits j)."""
    per = 32 // bits
    parts = parts.astype(jnp.uint32).reshape(*parts.shape[:-1], -1, per)
    shifts = jnp.arange(per, dtype=jnp.uint32) * bits
    return jnp.sum(parts << shifts, axis=-1, dtype=jnp.uint32)


def _fields(words: jax.Array, dtype) -> jax.Array:
    """Inverse of `_pack` for `dtype` = uint4 / uint8 / uint16 fields: uint32 [..., n] ->
    uint32 [..., n * 32 / bits], field j of word w being (w >> bits j) & (2^bits - 1).

    A `lax.bitcast_convert_type` to the narrower dtype: XLA defines a narrowing bitcast-convert
    by exactly these shifts (its CPU and GPU compilers expand it so, `BitcastDtypesExpander`),
    whatever the host's byte order, and fuses them into the consumer with constant shift
    amounts; `tests/test_formats.py` pins the order."""
    fields = lax.bitcast_convert_type(words, dtype)
    return fields.reshape(*words.shape[:-1], -1).astype(jnp.uint32)


def _scale_bytes(x: jax.Array, block: int, fmax: float, floor: np.float32) -> jax.Array:
    """ue8m0 byte (uint32) of each block of the last axis: 2^ceil(log2(amax * fp32(1 / fmax)))."""
    mag = jnp.where(jnp.isfinite(x), jnp.abs(x), 0.0)
    amax = jnp.max(mag.reshape(*x.shape[:-1], -1, block), axis=-1)
    amax = jnp.maximum(amax, floor)
    bits = lax.bitcast_convert_type(amax * np.float32(1.0 / fmax), jnp.uint32)
    return ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).astype(jnp.uint32)


def _scale_values(scale_bytes: jax.Array) -> jax.Array:
    """f32 2^(byte - 127) of ue8m0 bytes; 0xFF (the e8m0 NaN) -> NaN, 0 -> 2^-127."""
    value = lax.bitcast_convert_type(scale_bytes << 23, jnp.float32)
    value = jnp.where(scale_bytes == 0, np.float32(2.0 ** -127), value)
    return jnp.where(scale_bytes == _E8M0_NAN, np.float32(np.nan), value)


def _pad_bytes(b: jax.Array) -> jax.Array:
    pad = -b.shape[-1] % 4
    return jnp.pad(b, [(0, 0)] * (b.ndim - 1) + [(0, pad)]) if pad else b


def _per_block(scales: jax.Array, block: int) -> jax.Array:
    return jnp.repeat(scales, block, axis=-1)


def _f32(bits: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(bits, jnp.float32)


def _block_scaled(q: jax.Array, scale_words: jax.Array, block: int) -> jax.Array:
    """q f32 [..., nb * block] times the ue8m0 scale of its block (the scale bytes are the
    leading nb bytes of `scale_words`), as f32 [..., nb, block] (exact: q * 2^k)."""
    nb = q.shape[-1] // block
    scales = _scale_values(_fields(scale_words, jnp.uint8)[..., :nb])
    return q.reshape(*q.shape[:-1], nb, block) * scales[..., None]


def _e4m3_values(codes: jax.Array) -> jax.Array:
    """f32 values of e4m3fn codes (uint32 0..255), bit for bit XLA's float8_e4m3fn -> f32
    conversion (sign kept on zeros, codes 0x7F / 0xFF NaN), in vectorisable integer steps:
    a normal code (exponent field e >= 1) is the fp32 with bits (code & 0x7F) << 20 re-biased
    by 120 << 23; a subnormal one (e = 0, mantissa m) is m * 2^-9, an exact fp32 product (no
    fp32 subnormal appears, so flushing them does not matter); then the sign bit."""
    mag = codes & 0x7F
    normal = _f32((mag << 20) + (120 << 23))
    value = jnp.where(mag < 8, (mag & 7).astype(jnp.float32) * np.float32(2.0 ** -9), normal)
    value = jnp.where(mag == _FP8_NAN, np.float32(np.nan), value)
    return _f32(lax.bitcast_convert_type(value, jnp.uint32) | ((codes & 0x80) << 24))


def _e2m1_values(codes: jax.Array) -> jax.Array:
    """f32 values of e2m1 codes (uint32 0..15; sign in bit 3), by integer steps (no table
    gather): magnitude code k >= 2 (exponent field >= 1) is the fp32 with bits
    (k << 22) + (126 << 23), i.e. (1 + m / 2) 2^(e - 1); k = 1 is 0.5 (126 << 23), k = 0 zero."""
    mag = codes & 7
    bits = jnp.where(mag < 2, mag * np.uint32(126 << 23), (mag << 22) + (126 << 23))
    return _f32(bits | ((codes & 8) << 28))


# --- fp8 latent -------------------------------------------------------------------------------

def encode_fp8_latent(x: jax.Array, rope_dim: int) -> jax.Array:
    """Pack f32 [..., hd] (the last `rope_dim` dims are RoPE dims) into uint32 fp8_latent rows."""
    x = jnp.asarray(x, jnp.float32)
    nope, nb = _check_fp8(x.shape[-1], rope_dim)
    main, rope = x[..., :nope], x[..., nope:]
    sbytes = _scale_bytes(main, FP8_BLOCK, FP8_MAX, AMAX_FLOOR)
    q = jnp.clip(main / _per_block(_scale_values(sbytes), FP8_BLOCK), -FP8_MAX, FP8_MAX)
    codes = lax.bitcast_convert_type(q.astype(jnp.float8_e4m3fn), jnp.uint8)
    codes = jnp.where(jnp.isnan(main), jnp.uint8(_FP8_NAN), codes)
    half = lax.bitcast_convert_type(rope.astype(jnp.bfloat16), jnp.uint16)
    half = jnp.where(jnp.isnan(rope), jnp.uint16(_BF16_NAN), half)
    parts = [_pack(codes, 8)]
    if rope_dim:
        parts.append(_pack(half, 16))
    parts.append(_pack(_pad_bytes(sbytes), 8))
    return jnp.concatenate(parts, axis=-1)


def decode_fp8_latent(packed: jax.Array, head_dim: int, rope_dim: int) -> jax.Array:
    """f32 [..., head_dim] of uint32 fp8_latent rows."""
    nope, nb = _check_fp8(head_dim, rope_dim)
    if packed.shape[-1] != stored_width(head_dim, "fp8_latent", rope_dim):
        raise ValueError(f"fp8_latent: rows of {head_dim} / {rope_dim} are "
                         f"{stored_width(head_dim, 'fp8_latent', rope_dim)} words; got "
                         f"{packed.shape[-1]}")
    n_codes, n_rope, lead = nope // 4, rope_dim // 2, packed.shape[:-1]
    q = _e4m3_values(_fields(packed[..., :n_codes], jnp.uint8))
    main = _block_scaled(q, packed[..., n_codes + n_rope:], FP8_BLOCK)
    if not rope_dim:
        return main.reshape(*lead, head_dim)
    # bf16 pairs of the RoPE words (the low half first), widened exactly.
    rope = lax.bitcast_convert_type(packed[..., n_codes:n_codes + n_rope], jnp.bfloat16)
    rope = rope.astype(jnp.float32)
    # Joined along a middle axis of g-wide groups: XLA:CPU vectorises that concatenation, while
    # one along the last axis makes the fused decode a scalar loop (several times slower).
    g = math.gcd(nope, rope_dim)
    return jnp.concatenate([main.reshape(*lead, nope // g, g), rope.reshape(*lead, -1, g)],
                           axis=-2).reshape(*lead, head_dim)


# --- fp4 indexer keys -------------------------------------------------------------------------

def _sylvester(c: int) -> np.ndarray:
    """The +-1 Sylvester Hadamard matrix of size c (symmetric)."""
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < c:
        h = np.block([[h, h], [h, -h]])
    return h


def hadamard(x: jax.Array) -> jax.Array:
    """x @ (H_c / sqrt(c)) over the last axis (Sylvester order, orthonormal), in fp32: the
    products with +-1 are exact, the sum is an fp32 matmul at HIGHEST precision, then * c^-0.5."""
    x = jnp.asarray(x, jnp.float32)
    c = x.shape[-1]
    if c < 1 or c & (c - 1):
        raise ValueError(f"hadamard: needs a power-of-two last dim; got {c}")
    y = jnp.matmul(x, jnp.asarray(_sylvester(c)), precision=lax.Precision.HIGHEST)
    return y * np.float32(c ** -0.5)


def _e2m1_codes(y: jax.Array) -> jax.Array:
    """4-bit e2m1 codes (uint32) of y already clipped to [-6, 6]: round to nearest, ties to the
    even code (code k passes its lower cut strictly when k is odd, at equality when even)."""
    mag = jnp.abs(y)[..., None]
    passed = jnp.where(_E2M1_EVEN, mag >= _E2M1_CUTS, mag > _E2M1_CUTS)
    code = jnp.sum(passed, axis=-1, dtype=jnp.uint32)
    return code | (jnp.signbit(y).astype(jnp.uint32) << 3)


def encode_fp4_key(k: jax.Array, rotated: bool = False) -> jax.Array:
    """Rotate f32 [..., c] by `hadamard` and pack into uint32 fp4_index rows (`rotated=True`:
    `k` is already rotated, pack it as it is)."""
    y = jnp.asarray(k, jnp.float32) if rotated else hadamard(k)
    nb = _check_fp4(y.shape[-1])
    bad = jnp.any(~jnp.isfinite(y).reshape(*y.shape[:-1], nb, FP4_BLOCK), axis=-1)
    sbytes = _scale_bytes(y, FP4_BLOCK, FP4_MAX, FP4_AMAX_FLOOR)
    sbytes = jnp.where(bad, jnp.uint32(_E8M0_NAN), sbytes)
    q = jnp.clip(y / _per_block(_scale_values(sbytes), FP4_BLOCK), -FP4_MAX, FP4_MAX)
    codes = jnp.where(_per_block(bad, FP4_BLOCK), jnp.uint32(0), _e2m1_codes(q))
    return jnp.concatenate([_pack(codes, 4), _pack(_pad_bytes(sbytes), 8)], axis=-1)


def fake_quantise_fp4_key(y: jax.Array) -> jax.Array:
    """decode_fp4_key(encode_fp4_key(y, rotated=True), c), bit for bit, for f32 [..., c]
    already rotated, without packing the codes into words and out again (the indexer's
    query is quantised so every step: on a TPU the nibble shuffles cost more than the
    arithmetic)."""
    y = jnp.asarray(y, jnp.float32)
    nb = _check_fp4(y.shape[-1])
    bad = jnp.any(~jnp.isfinite(y).reshape(*y.shape[:-1], nb, FP4_BLOCK), axis=-1)
    sbytes = _scale_bytes(y, FP4_BLOCK, FP4_MAX, FP4_AMAX_FLOOR)
    sbytes = jnp.where(bad, jnp.uint32(_E8M0_NAN), sbytes)
    scales = _scale_values(sbytes)
    q = jnp.clip(y / _per_block(scales, FP4_BLOCK), -FP4_MAX, FP4_MAX)
    codes = jnp.where(_per_block(bad, FP4_BLOCK), jnp.uint32(0), _e2m1_codes(q))
    scaled = (_e2m1_values(codes & 7).reshape(*y.shape[:-1], nb, FP4_BLOCK)
              * scales[..., None])
    bits = lax.bitcast_convert_type(scaled.reshape(codes.shape), jnp.uint32)
    return _f32(bits | ((codes & 8) << 28))


def decode_fp4_key(packed: jax.Array, width: int) -> jax.Array:
    """f32 [..., width] ROTATED dequantised keys (compare with `hadamard(q)`) of fp4_index rows."""
    _check_fp4(width)
    if packed.shape[-1] != stored_width(width, "fp4_index"):
        raise ValueError(f"fp4_index: rows of {width} are {stored_width(width, 'fp4_index')} "
                         f"words; got {packed.shape[-1]}")
    codes = _fields(packed[..., :width // 8], jnp.uint4)
    # |q| * scale, then the sign bit: the bits of q * scale (a scale is positive or NaN; zeros
    # and flushed products keep q's sign). Ending on an integer step keeps the scaling in this
    # fusion on XLA:CPU instead of in the consumer's dot fusion, where it slowed the indexer.
    scaled = _block_scaled(_e2m1_values(codes & 7), packed[..., width // 8:], FP4_BLOCK)
    bits = lax.bitcast_convert_type(scaled.reshape(codes.shape), jnp.uint32)
    return _f32(bits | ((codes & 8) << 28))


# --- one stored array's rows -------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class RowCodec:
    """How rows of `width` values are stored in format `fmt` (`rope_dim`: the last RoPE dims,
    used by fp8_latent only). Hashable, so it can be a static argument.

    `encode(f32 [..., width]) -> stored [..., stored_width]` and `decode(stored) -> f32
    [..., width]`. For "fp4_index" `decode` gives the ROTATED key, hadamard(k) dequantised
    (what the indexer scores against a query prepared the same way); `decode_unrotated`
    turns it back (`hadamard` is its own inverse) for inspection.
    """

    fmt: str
    width: int
    rope_dim: int = 0

    def __post_init__(self):
        stored_width(self.width, self.fmt, self.rope_dim)  # raises for an impossible row

    @property
    def packed(self) -> bool:
        return self.fmt in PACKED_FORMATS

    @property
    def stored_width(self) -> int:
        return stored_width(self.width, self.fmt, self.rope_dim)

    @property
    def dtype(self) -> jnp.dtype:
        return dtype(self.fmt)

    @property
    def row_bytes(self) -> int:
        return row_bytes(self.width, self.fmt, self.rope_dim)

    def lanes(self, records: int) -> lanes.LaneMap:
        """Where blocks of `records` rows of this format live (`lanes.LaneMap`)."""
        return lanes.LaneMap(self.stored_width, records, self.dtype)

    def encode(self, values: jax.Array) -> jax.Array:
        """Stored rows of `values` [..., width] (any float dtype)."""
        if self.fmt == "fp8_latent":
            return encode_fp8_latent(values, self.rope_dim)
        if self.fmt == "fp4_index":
            return encode_fp4_key(values)
        if self.fmt in records41.RECORD_FORMATS:
            return records41.encode(values, self.fmt)
        if self.fmt in HALF_FORMATS:
            return encode_halves(values, self.fmt)
        return jnp.asarray(values).astype(self.dtype)

    def decode(self, stored: jax.Array) -> jax.Array:
        """f32 [..., width] of stored rows (fp4_index: the rotated key)."""
        if self.fmt == "fp8_latent":
            return decode_fp8_latent(stored, self.width, self.rope_dim)
        if self.fmt == "fp4_index":
            return decode_fp4_key(stored, self.width)
        if self.fmt in records41.RECORD_FORMATS:
            return records41.decode(stored, self.width, self.fmt)
        if self.fmt in HALF_FORMATS:
            return decode_halves(stored, self.width, self.fmt)
        return stored.astype(jnp.float32)

    def decode_unrotated(self, stored: jax.Array) -> jax.Array:
        """f32 [..., width] in the basis the values were written in (fp4_index: the rotation
        undone; otherwise `decode`)."""
        values = self.decode(stored)
        return hadamard(values) if self.fmt == "fp4_index" else values

    def filled(self, value: float) -> jax.Array:
        """One stored row whose every value decodes to `value` (NaN: all words 0xFFFFFFFF in
        a word format, which decode to NaN in every dim); used to poison unowned rows."""
        if self.dtype == jnp.uint32 and np.isnan(value):
            return jnp.full((self.stored_width,), 0xFFFFFFFF, jnp.uint32)
        return self.encode(jnp.full((self.width,), value, jnp.float32))


# The field of `CacheConfig` that sets each stored array's format.
FORMAT_FIELDS = {"csa": "entry_dtype", "hca": "entry_dtype", "csa_index": "index_dtype",
                 "window": "window_dtype"}


def codec(model: AttentionConfig, geometry: CacheConfig, name: str) -> RowCodec:
    """The `RowCodec` of a stored array: "csa" (C4 entries), "hca" (C128 entries),
    "csa_index" (indexer keys) or "window" (the window ring).

    Raises ValueError naming the `CacheConfig` field when the model's widths do not fit the
    format (fp8_latent: head_dim - rope_dim a positive multiple of 64; fp4_index: a
    power-of-two index_head_dim >= 32)."""
    checks.one_of("name", name, tuple(FORMAT_FIELDS))
    field = FORMAT_FIELDS[name]
    fmt = getattr(geometry, field)
    width = model.index_head_dim if name == "csa_index" else model.head_dim
    try:
        return RowCodec(fmt, width, model.rope_dim if fmt == "fp8_latent" else 0)
    except ValueError as err:
        what = (f"index_head_dim={model.index_head_dim}" if name == "csa_index"
                else f"head_dim={model.head_dim} and rope_dim={model.rope_dim}")
        checks.fail(field, f"a format that rows of {what} fit ({err})", repr(fmt))


def tail_codec(geometry: CacheConfig, width: int) -> RowCodec:
    """The `RowCodec` of compressor tail rows of `width` values (a float format)."""
    return RowCodec(geometry.tail_dtype, width)


__all__ = ["AMAX_FLOOR", "FORMATS", "FORMAT_FIELDS", "FP4_AMAX_FLOOR", "FP4_BLOCK", "FP4_MAX",
           "FP8_BLOCK", "FP8_MAX", "HALF_FORMATS", "PACKED_FORMATS", "RowCodec", "codec",
           "decode_fp4_key", "decode_fp8_latent", "decode_halves", "dtype", "encode_fp4_key",
           "encode_fp8_latent", "encode_halves", "fake_quantise_fp4_key", "hadamard",
           "row_bytes", "stored_width", "tail_codec"]
