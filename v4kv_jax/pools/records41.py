"""DeepSeek-V4.1's three storage records as rows of 32-bit words (V41_SPEC.md section 7).

The packed formats "nvfp4", "mxfp8" and "mxfp4" of `storage` (`storage.RowCodec` dispatches
here): encode f32 [..., d] -> uint32 [..., record_words(d, fmt)] and decode back, in jnp
(jit-able, fixed shapes, no loop over elements). Any width d that is a multiple of the
format's block; no Hadamard rotation and no bf16 RoPE tail (every dim is quantised). Bytes
are numbered inside a word little-endian (byte j of word w is `(w >> 8 j) & 0xFF`) and a
record is followed by zero bytes up to a whole word:

"nvfp4" (compressed main entries, section 7a), d % 16 == 0, nb = d / 16 blocks:

    bytes [0, d / 2)             e2m1 code of dim i in nibble i % 2 of byte i // 2 (even dim in
                                 the low nibble; word w holds dims 8 w .. 8 w + 7)
    bytes [d / 2, d / 2 + nb)    e4m3fn scale of block b (dims 16 b .. 16 b + 15)
    d 512: 256 + 32 = 288 B = uint32[72]; d 64: 36 B = uint32[9]

"mxfp8" (SWA window rows, section 7b), d % 32 == 0, nb = d / 32:

    bytes [0, d)                 e4m3fn code of dim i at byte i
    bytes [d, d + nb)            UE8M0 scale byte of block b (2^(byte - 127), dims 32 b ..)
    d 512: 512 + 16 = 528 B = uint32[132]; d 64: 66 B + 2 zero bytes = uint32[17]

"mxfp4" (index keys, section 7c), d % 32 == 0, nb = d / 32:

    bytes [0, d / 2)             e2m1 codes, even dim in the low nibble
    bytes [d / 2, d / 2 + nb)    UE8M0 scale byte of block b
    d 128: 64 + 4 = 68 B = uint32[17]; d 32: 17 B + 3 zero bytes = uint32[5]

The code bytes fill whole words in every format, so the scale bytes start a word.

Quantisation of a block (V41_SPEC.md section 7; amax = max |v| over the block, in fp32):
- nvfp4: s = e4m3(min(fp32(max(amax, 6 * 2^-9)) / 6, 448)), the fp32 quotient correctly
  rounded (computed with integers: XLA turns a division by a constant into a product with
  its rounded reciprocal, which differs in the last bit); e4m3 rounds to nearest even, with
  subnormals. code = e2m1(clip(v / s, -6, 6)), nearest, ties to the even code.
- mxfp8: e = ceil_log2(fp32(max(amax, 1e-4)) * fp32(1 / 448)) from the fp32 bits (exponent
  - 127 + (mantissa != 0)), code = e4m3(clip(v * 2^-e, -448, 448)), byte e + 127.
- mxfp4: e = clip(ceil_log2(fp32(max(amax, 6 * 2^-126)) * fp32(1 / 6)), -127, 127),
  code = e2m1(clip(v * 2^-e, -6, 6)), byte e + 127.
- A value that rounds to zero keeps its sign (the code's sign bit; -0.0 too).
The e2m1 rounding of v / s is decided without dividing: |v| is compared with the seven
midpoints between e2m1 values times the scale, as fp32 bit patterns (integer order is value
order for non-negative floats). For nvfp4 the products are exact normal fp32 numbers; for
mxfp4 they are built from bits (subnormal ones by a shift), so the codes of every finite fp32
input are those of the real quotient, subnormal inputs included, whether or not the platform
flushes fp32 subnormals (XLA on CPU does). mxfp8 forms v * 2^-e in fp32: exact, except
below 2^-126 where every value rounds to the e4m3 code 0 anyway, so its codes too are those
of the real quotient for every finite input.

Decoding builds the fp32 bits of code * 2^e (mxfp8, mxfp4) with integer steps, subnormal
results included (not flushed), and forms e2m1 * e4m3 (nvfp4) as an fp32 product that is
exact and normal (at least 2^-10, at most 2688). So a decoded row is the float32 rounding of
the record's value: the value itself, except an mxfp8 block of scale 2^120 (amax above
1.75 * 2^127), whose values of at least 248 * 2^120 are stored as 256 * 2^120 = 2^128 and
decode to +-inf. Values above 6 * 448 = 2688 saturate in nvfp4 (the scale's maximum).

NaN / inf (V41_SPEC.md does not define them; stated choices):
- mxfp8 (a NaN code per value, like "fp8_latent"): NaN -> the e4m3fn NaN code 0x7F (whatever
  its sign), decoding to NaN; +-inf saturates to +-448 * 2^e; neither enters the block's amax.
- nvfp4 and mxfp4 (e2m1 has no NaN, like "fp4_index"): a block holding a NaN or an inf stores
  the NaN of its scale format (e4m3fn 0x7F, UE8M0 0xFF) and zero codes, so all its values
  decode to NaN. A NaN is never stored as a finite value.
- Decoding accepts every byte: e4m3fn 0x7F / 0xFF (codes and nvfp4 scales) and the UE8M0
  byte 0xFF are NaN. A row of 0xFFFFFFFF words (`storage.RowCodec.filled(nan)`) decodes to
  NaN in every dim of every format.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

RECORD_FORMATS = ("nvfp4", "mxfp8", "mxfp4")
BLOCKS = {"nvfp4": 16, "mxfp8": 32, "mxfp4": 32}
AMAX_FLOORS = {"nvfp4": np.float32(6 * 2.0 ** -9), "mxfp8": np.float32(1e-4),
               "mxfp4": np.float32(6 * 2.0 ** -126)}
E4M3_MAX, E2M1_MAX = 448.0, 6.0

_U32 = jnp.uint32
_ABS, _INF_BITS, _NAN_BITS = np.uint32(0x7FFFFFFF), np.uint32(0x7F800000), np.uint32(0x7FC00000)
_E4M3_NAN, _UE8M0_NAN = 0x7F, 0xFF
# Midpoints between consecutive e2m1 magnitudes (code k - 1 and k, k = 1..7); code k is
# reached at equality when k is even (ties to the even code).
_E2M1_CUTS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
_E2M1_CUT_BITS = _E2M1_CUTS.view(np.uint32)
_EVEN = np.arange(1, 8) % 2 == 0


def _check(width: int, fmt: str) -> int:
    """Blocks of a row of `width` values (ValueError unless a positive multiple of the block)."""
    if fmt not in RECORD_FORMATS:
        raise ValueError(f"fmt: expected one of {RECORD_FORMATS}; got {fmt!r}")
    block = BLOCKS[fmt]
    if width <= 0 or width % block:
        raise ValueError(f"{fmt}: needs a width that is a positive multiple of {block}; got "
                         f"{width}")
    return width // block


def code_bytes(width: int, fmt: str) -> int:
    """Bytes of a record's codes (`width` / 2 for the e2m1 formats, `width` for mxfp8)."""
    _check(width, fmt)
    return width if fmt == "mxfp8" else width // 2


def record_bytes(width: int, fmt: str) -> int:
    """Bytes of one record, codes and scales, before the padding to a whole word (288 for
    nvfp4 at 512, 528 for mxfp8 at 512, 68 for mxfp4 at 128)."""
    return code_bytes(width, fmt) + _check(width, fmt)


def record_words(width: int, fmt: str) -> int:
    """uint32 words of one stored record (72, 132, 17 at the release widths)."""
    return -(-record_bytes(width, fmt) // 4)


# --- bits and words ---------------------------------------------------------------------------

def _bits(x: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(x, _U32)


def _f32(bits: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(bits, jnp.float32)


def _pack(fields: jax.Array, bits: int) -> jax.Array:
    """uint32 [..., n * 32 / bits] of `bits`-wide fields -> uint32 [..., n], field j of each
    group at bits [bits j, bits (j + 1)) (zero fields appended up to a whole word)."""
    per = 32 // bits
    pad = -fields.shape[-1] % per
    if pad:
        fields = jnp.pad(fields, [(0, 0)] * (fields.ndim - 1) + [(0, pad)])
    fields = fields.astype(_U32).reshape(*fields.shape[:-1], -1, per)
    shifts = np.arange(per, dtype=np.uint32) * np.uint32(bits)
    return jnp.sum(fields << shifts, axis=-1, dtype=_U32)


def _unpack(words: jax.Array, bits: int) -> jax.Array:
    """Inverse of `_pack`: uint32 [..., n] -> uint32 [..., n * 32 / bits]."""
    per = 32 // bits
    shifts = np.arange(per, dtype=np.uint32) * np.uint32(bits)
    fields = (words[..., None] >> shifts) & np.uint32((1 << bits) - 1)
    return fields.reshape(*words.shape[:-1], -1)


def _ldexp_bits(mag: jax.Array, e: jax.Array) -> jax.Array:
    """fp32 bits of m * 2^e for the bits `mag` of m >= 0, zero or a normal fp32, and int32
    exponents e: a normal result by adding e to the exponent field, a subnormal one by
    shifting the significand (exact when no set bit is shifted out, as for every e2m1 and
    e4m3 value times 2^e, e >= -127), above the fp32 range inf. Nothing is flushed."""
    field = (mag >> 23).astype(jnp.int32)
    n = field + e  # the result's biased exponent
    normal = (mag.astype(jnp.int32) + (e << 23)).astype(_U32)
    shift = jnp.clip(1 - n, 0, 31).astype(_U32)
    sub = ((mag & np.uint32(0x7FFFFF)) | np.uint32(0x800000)) >> shift
    out = jnp.where(n >= 255, _INF_BITS, jnp.where(n >= 1, normal, sub))
    return jnp.where(mag == 0, np.uint32(0), out)


def _ceil_log2(v: jax.Array) -> jax.Array:
    """int32 ceil(log2 v) of positive normal fp32 v, from its bits."""
    b = _bits(v)
    return (((b >> 23) & np.uint32(0xFF)).astype(jnp.int32) - 127
            + ((b & np.uint32(0x7FFFFF)) != 0).astype(jnp.int32))


def _div6(amax_bits: jax.Array) -> jax.Array:
    """fp32 amax / 6, correctly rounded (nearest; a quotient by 3 is never a tie), for the
    bits of a positive normal fp32 amax whose quotient is normal: the 24-bit significand m,
    shifted left by 2 (m < 3 * 2^22) or 1 so that m 2^k / 3 lies in [2^23, 2^24), divided by
    3 with integers and rounded up when the remainder is 2."""
    field = amax_bits >> 23
    m = (amax_bits & np.uint32(0x7FFFFF)) | np.uint32(0x800000)
    k = jnp.where(m < np.uint32(3 << 22), np.uint32(2), np.uint32(1))
    num = m << k
    q = num // np.uint32(3)
    q = q + (num - q * np.uint32(3) == 2).astype(_U32)
    return _f32(((field - 1 - k) << 23) + (q - np.uint32(0x800000)))


def _e4m3_code(a: jax.Array) -> jax.Array:
    """uint32 e4m3fn codes (0 .. 0x7E) of fp32 a in [0, 448]: nearest, ties to even, with
    subnormals (XLA's float8_e4m3fn conversion)."""
    return lax.bitcast_convert_type(a.astype(jnp.float8_e4m3fn), jnp.uint8).astype(_U32)


def _e4m3_magnitude(mag: jax.Array) -> jax.Array:
    """fp32 bits of e4m3fn magnitudes (code & 0x7F, not the NaN 0x7F): exponent field >= 1
    re-biased by 120 (bits (mag << 20) + (120 << 23)), a subnormal m * 2^-9 an exact normal
    fp32 product."""
    normal = (mag << 20) + np.uint32(120 << 23)
    sub = _bits((mag & np.uint32(7)).astype(jnp.float32) * np.float32(2.0 ** -9))
    return jnp.where(mag < 8, sub, normal)


def _e2m1_magnitude(mag: jax.Array) -> jax.Array:
    """fp32 bits of e2m1 magnitudes (code & 7): k >= 2 is (k << 22) + (126 << 23), i.e.
    (1 + m / 2) 2^(e - 1); k = 1 is 0.5, k = 0 zero."""
    return jnp.where(mag < 2, mag * np.uint32(126 << 23), (mag << 22) + np.uint32(126 << 23))


def _e2m1_codes(abs_bits: jax.Array, cut_bits: jax.Array) -> jax.Array:
    """e2m1 magnitude codes (uint32 0..7) of |v| / scale for |v| bits [..., nb, B] against the
    bits of the block's seven midpoints times its scale [..., nb, 7] (>= 6: code 7)."""
    a, c = abs_bits[..., None], cut_bits[..., None, :]
    passed = jnp.where(_EVEN, a >= c, a > c)
    return jnp.sum(passed, axis=-1, dtype=_U32)


def _blocks(x: jax.Array, fmt: str):
    """(sign bits, |x| bits as [..., nb, block], non-finite flags of the same shape)."""
    x = jnp.asarray(x, jnp.float32)
    nb = _check(x.shape[-1], fmt)
    bits = _bits(x).reshape(*x.shape[:-1], nb, BLOCKS[fmt])
    abs_bits = bits & _ABS
    return bits >> 31, abs_bits, abs_bits >= _INF_BITS


def _amax_bits(abs_bits: jax.Array, use: jax.Array, fmt: str) -> jax.Array:
    """Bits of fp32 max(amax, floor) per block, amax over the values where `use` (integer
    order: no flushing of subnormal magnitudes matters)."""
    amax = jnp.max(jnp.where(use, abs_bits, np.uint32(0)), axis=-1)
    return jnp.maximum(amax, AMAX_FLOORS[fmt].view(np.uint32))


def _record(codes: jax.Array, scale_bytes: jax.Array, code_bits: int) -> jax.Array:
    """Words of a record: codes [..., nb, block] (`code_bits` wide), then the scale bytes."""
    codes = codes.reshape(*codes.shape[:-2], -1)
    return jnp.concatenate([_pack(codes, code_bits), _pack(scale_bytes, 8)], axis=-1)


def _split(words: jax.Array, width: int, fmt: str):
    """(code fields [..., width], scale bytes [..., nb]) of stored records."""
    nb = _check(width, fmt)
    words = jnp.asarray(words)
    if words.dtype != _U32 or words.shape[-1] != record_words(width, fmt):
        raise ValueError(f"{fmt}: records of {width} values are uint32[..., "
                         f"{record_words(width, fmt)}]; got {words.dtype}{list(words.shape)}")
    code_words = code_bytes(width, fmt) // 4
    codes = _unpack(words[..., :code_words], 8 if fmt == "mxfp8" else 4)
    return codes, _unpack(words[..., code_words:], 8)[..., :nb]


# --- the three records -------------------------------------------------------------------------

def encode_nvfp4(x: jax.Array) -> jax.Array:
    """uint32 [..., record_words(d, "nvfp4")] nvfp4 records of f32 [..., d], d % 16 == 0."""
    sign, abs_bits, bad = _blocks(x, "nvfp4")
    amax = _amax_bits(abs_bits, True, "nvfp4")
    scale_codes = _e4m3_code(jnp.minimum(_div6(amax), np.float32(E4M3_MAX)))
    scale = _f32(_e4m3_magnitude(scale_codes))  # positive, >= 2^-9
    cuts = _bits(scale[..., None] * _E2M1_CUTS)  # exact: <= 7 significant bits, normal
    codes = _e2m1_codes(abs_bits, cuts) | (sign << 3)
    block_bad = jnp.any(bad, axis=-1)
    codes = jnp.where(block_bad[..., None], np.uint32(0), codes)
    scale_codes = jnp.where(block_bad, np.uint32(_E4M3_NAN), scale_codes)
    return _record(codes, scale_codes, 4)


def decode_nvfp4(words: jax.Array, width: int) -> jax.Array:
    """f32 [..., width] of nvfp4 records (e2m1 value * e4m3fn scale, an exact fp32 product)."""
    codes, scale_codes = _split(words, width, "nvfp4")
    values = _f32(_e2m1_magnitude(codes & np.uint32(7)) | ((codes & np.uint32(8)) << 28))
    mag = scale_codes & np.uint32(0x7F)
    scale = _f32(jnp.where(mag == _E4M3_NAN, _NAN_BITS, _e4m3_magnitude(mag))
                 | ((scale_codes & np.uint32(0x80)) << 24))
    lead = codes.shape[:-1]
    values = values.reshape(*lead, -1, BLOCKS["nvfp4"]) * scale[..., None]
    return values.reshape(*lead, width)


def encode_mxfp8(x: jax.Array) -> jax.Array:
    """uint32 [..., record_words(d, "mxfp8")] mxfp8 records of f32 [..., d], d % 32 == 0."""
    sign, abs_bits, bad = _blocks(x, "mxfp8")
    amax = _f32(_amax_bits(abs_bits, ~bad, "mxfp8"))
    e = _ceil_log2(amax * np.float32(1.0 / E4M3_MAX))  # [-22, 120]: 2^-e is a normal fp32
    inv = _f32(((127 - e) << 23).astype(_U32))[..., None]
    codes = _e4m3_code(jnp.minimum(_f32(abs_bits) * inv, np.float32(E4M3_MAX)))  # inf -> 448
    codes = jnp.where(abs_bits > _INF_BITS, np.uint32(_E4M3_NAN), codes | (sign << 7))
    return _record(codes, (e + 127).astype(_U32), 8)


def decode_mxfp8(words: jax.Array, width: int) -> jax.Array:
    """f32 [..., width] of mxfp8 records (the bits of e4m3 * 2^(byte - 127), unflushed)."""
    codes, scale_bytes = _split(words, width, "mxfp8")
    lead, block = codes.shape[:-1], BLOCKS["mxfp8"]
    codes = codes.reshape(*lead, -1, block)
    mag = codes & np.uint32(0x7F)
    e = scale_bytes.astype(jnp.int32)[..., None] - 127
    bits = _ldexp_bits(_e4m3_magnitude(mag), e) | ((codes & np.uint32(0x80)) << 24)
    nan = (mag == _E4M3_NAN) | (scale_bytes == _UE8M0_NAN)[..., None]
    return _f32(jnp.where(nan, _NAN_BITS, bits)).reshape(*lead, width)


def encode_mxfp4(x: jax.Array) -> jax.Array:
    """uint32 [..., record_words(d, "mxfp4")] mxfp4 records of f32 [..., d], d % 32 == 0."""
    sign, abs_bits, bad = _blocks(x, "mxfp4")
    amax = _f32(_amax_bits(abs_bits, True, "mxfp4"))
    e = jnp.clip(_ceil_log2(amax * np.float32(1.0 / E2M1_MAX)), -127, 127)
    cuts = _ldexp_bits(jnp.asarray(_E2M1_CUT_BITS), e[..., None])  # exact, maybe subnormal
    codes = _e2m1_codes(abs_bits, cuts) | (sign << 3)
    block_bad = jnp.any(bad, axis=-1)
    codes = jnp.where(block_bad[..., None], np.uint32(0), codes)
    scale_bytes = jnp.where(block_bad, np.uint32(_UE8M0_NAN), (e + 127).astype(_U32))
    return _record(codes, scale_bytes, 4)


def decode_mxfp4(words: jax.Array, width: int) -> jax.Array:
    """f32 [..., width] of mxfp4 records (the bits of e2m1 * 2^(byte - 127), unflushed)."""
    codes, scale_bytes = _split(words, width, "mxfp4")
    lead, block = codes.shape[:-1], BLOCKS["mxfp4"]
    codes = codes.reshape(*lead, -1, block)
    e = scale_bytes.astype(jnp.int32)[..., None] - 127
    bits = _ldexp_bits(_e2m1_magnitude(codes & np.uint32(7)), e) | ((codes & np.uint32(8)) << 28)
    nan = jnp.broadcast_to((scale_bytes == _UE8M0_NAN)[..., None], bits.shape)
    return _f32(jnp.where(nan, _NAN_BITS, bits)).reshape(*lead, width)


_ENCODERS = {"nvfp4": encode_nvfp4, "mxfp8": encode_mxfp8, "mxfp4": encode_mxfp4}
_DECODERS = {"nvfp4": decode_nvfp4, "mxfp8": decode_mxfp8, "mxfp4": decode_mxfp4}


def encode(x: jax.Array, fmt: str) -> jax.Array:
    """uint32 [..., record_words(d, fmt)] records of f32 [..., d] in format `fmt`."""
    _check(jnp.shape(x)[-1], fmt)
    return _ENCODERS[fmt](x)


def decode(words: jax.Array, width: int, fmt: str) -> jax.Array:
    """f32 [..., width] of uint32 records in format `fmt`."""
    _check(width, fmt)
    return _DECODERS[fmt](words, width)


__all__ = ["AMAX_FLOORS", "BLOCKS", "E2M1_MAX", "E4M3_MAX", "RECORD_FORMATS", "code_bytes",
           "decode", "decode_mxfp4", "decode_mxfp8", "decode_nvfp4", "encode", "encode_mxfp4",
           "encode_mxfp8", "encode_nvfp4", "record_bytes", "record_words"]
