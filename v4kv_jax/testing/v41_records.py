"""DeepSeek-V4.1's three storage records as numpy bytes, written from V41_SPEC.md section 7.

An independent codec for the tests: numpy only, no library code. Each record quantises one
row of any width that is a multiple of its block (the release widths in brackets):

    NVFP4 entry   (compressed main entries, V41_SPEC.md section 7a), width d, d % 16 == 0:
      bytes [0, d / 2)             e2m1 code of dim i in nibble i % 2 of byte i // 2 (even dim in
                                   the low nibble)
      bytes [d / 2, d / 2 + d/16)  e4m3fn scale of block b (dims 16 b .. 16 b + 15)
      d 512: 256 + 32 = 288 B = uint32[72]
    MXFP8 window  (SWA window rows, section 7b), width d, d % 32 == 0:
      bytes [0, d)                 e4m3fn code of dim i at byte i
      bytes [d, d + d / 32)        UE8M0 scale byte of block b (dims 32 b .. 32 b + 31)
      d 512: 512 + 16 = 528 B = uint32[132]
    MXFP4 key     (index keys and the fake quant of index queries, section 7c), d % 32 == 0:
      bytes [0, d / 2)             e2m1 codes, even dim in the low nibble
      bytes [d / 2, d / 2 + d/32)  UE8M0 scale byte of block b
      d 128: 64 + 4 = 68 B = uint32[17]

The word view (`to_words`) reads the bytes as little-endian uint32, byte j of word w at bits
[8 j, 8 j + 8), with zero bytes appended up to a multiple of 4 (no padding at the release
widths; a tiny MXFP8 row of 64 is 66 B -> uint32[17], an MXFP4 key of 32 is 17 B -> uint32[5]).

Arithmetic. Each block scale is computed in fp32 as the spec writes it (amax is taken of the
values as given, then rounded to fp32): NVFP4 s = e4m3(fp32(max(amax, 6 * 2^-9)) / 6) (the
[KCPU] division, V41_SPEC.md section 12 item 1), MXFP8 2^ceil_log2(fp32(max(amax, 1e-4)) *
fp32(1 / 448)), MXFP4 2^ceil_log2(fp32(max(amax, 6 * 2^-126)) * fp32(1 / 6)), the ceil_log2
read from the fp32 bits. The element quotients v / s are formed in float64 and rounded once
(round to nearest, ties to even; saturating at the format's maximum), so an fp32 input gives
the bytes of an fp32 implementation whenever s is a power of two (MXFP8, MXFP4), and for
NVFP4 except where v / s lies within an fp32 ulp of a rounding midpoint. The sign of a value
that rounds to zero is kept (negative zero, like the hardware conversions). Inputs must be
finite.
"""

from __future__ import annotations

import numpy as np

E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
E2M1_MAX = 6.0
E4M3_MAX = 448.0
NVFP4_BLOCK = 16
MX_BLOCK = 32


def _round_to_grid(a: np.ndarray, mantissa_bits: int, min_exponent: int) -> np.ndarray:
    """|a| (float64, >= 0) rounded to nearest, ties to even, on the grid of a binary float
    with `mantissa_bits` stored mantissa bits whose smallest normal is 2^min_exponent
    (subnormals below it, no upper bound)."""
    a = np.asarray(a, np.float64)
    _, exp = np.frexp(a)  # a = m 2^exp, m in [0.5, 1): floor(log2 a) = exp - 1
    quantum = np.ldexp(1.0, np.maximum(exp - 1, min_exponent) - mantissa_bits)
    return np.rint(a / quantum) * quantum  # rint rounds half to even; a / quantum is exact


def bf16_round(x) -> np.ndarray:
    """x rounded to bfloat16 (nearest, ties to even), as float64: the optional bf16 cast of
    the pooled latent (V41_SPEC.md section 3)."""
    x = np.asarray(x, np.float64)
    return np.copysign(_round_to_grid(np.abs(x), 7, -126), x)


def e2m1_encode(x) -> np.ndarray:
    """uint8 nibbles sign << 3 | code of x (already divided by its scale): the nearest of
    {0, .5, 1, 1.5, 2, 3, 4, 6}, ties to the even code, |x| >= 6 saturating to 6."""
    x = np.asarray(x, np.float64)
    a = np.minimum(np.abs(x), E2M1_MAX)
    hi = np.searchsorted(E2M1_VALUES, a, side="left")  # first value >= a
    lo = np.maximum(hi - 1, 0)
    below, above = a - E2M1_VALUES[lo], E2M1_VALUES[hi] - a
    code = np.where((above < below) | ((above == below) & (hi % 2 == 0)), hi, lo)
    return (code | (np.signbit(x).astype(np.int64) << 3)).astype(np.uint8)


def e2m1_decode(nibbles) -> np.ndarray:
    """float64 values of e2m1 nibbles (the low 4 bits of each byte)."""
    n = np.asarray(nibbles, np.uint8) & 0xF
    value = E2M1_VALUES[n & 7]
    return np.where(n & 8, -value, value)


def e4m3_encode(x) -> np.ndarray:
    """uint8 e4m3fn codes of x: bias 7, 3 mantissa bits, subnormals down to 2^-9, round to
    nearest even, |x| above 448 saturating to 448 (never the NaN codes 0x7F, 0xFF)."""
    x = np.asarray(x, np.float64)
    a = np.minimum(_round_to_grid(np.abs(x), 3, -6), E4M3_MAX)
    m, exp = np.frexp(a)
    normal = a >= 2.0**-6
    biased = np.where(normal, exp - 1 + 7, 0)
    mant = np.where(normal, m * 16 - 8, a * 2.0**9).astype(np.int64)
    return ((np.signbit(x).astype(np.int64) << 7) | (biased << 3) | mant).astype(np.uint8)


def e4m3_decode(codes) -> np.ndarray:
    """float64 values of e4m3fn codes (NaN for 0x7F and 0xFF)."""
    c = np.asarray(codes, np.uint8).astype(np.int64)
    biased, mant = (c >> 3) & 0xF, c & 7
    value = np.where(biased == 0, np.ldexp(mant.astype(np.float64), -9),
                     np.ldexp(1.0 + mant / 8.0, biased - 7))
    value = np.where((c & 0x7F) == 0x7F, np.nan, value)
    return np.where(c & 0x80, -value, value)


def ue8m0_encode(exponent) -> np.ndarray:
    """uint8 UE8M0 byte of the scale 2^exponent, exponent in [-127, 127]."""
    e = np.asarray(exponent, np.int64)
    if np.any((e < -127) | (e > 127)):
        raise ValueError(f"exponent={e.min()}..{e.max()} must lie in [-127, 127]")
    return (e + 127).astype(np.uint8)


def ue8m0_decode(byte) -> np.ndarray:
    """float64 scale 2^(byte - 127) of UE8M0 bytes."""
    return np.ldexp(1.0, np.asarray(byte, np.int64) - 127)


def pow2ceil_exponent(v) -> np.ndarray:
    """ceil(log2 v) of positive values, read from their fp32 bits: biased exponent - 127 +
    (mantissa != 0) (exact for normal fp32 values; v is rounded to fp32 first)."""
    bits = np.asarray(v, np.float32).view(np.uint32).astype(np.int64)
    return ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0)


def _blocks(x, block: int, name: str) -> np.ndarray:
    x = np.asarray(x, np.float64)
    if x.ndim == 0 or x.shape[-1] % block:
        raise ValueError(f"{name}: width={x.shape[-1:] or ()} must be a multiple of {block}")
    if not np.isfinite(x).all():
        raise ValueError(f"{name}: the values must be finite")
    return x.reshape(*x.shape[:-1], x.shape[-1] // block, block)


def _amax32(blocks: np.ndarray, floor: float) -> np.ndarray:
    """fp32 max(amax, floor) per block, [..., nb]."""
    return np.maximum(np.abs(blocks).max(axis=-1).astype(np.float32), np.float32(floor))


def _pack_nibbles(nibbles: np.ndarray) -> np.ndarray:
    return (nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)).astype(np.uint8)


def _unpack_nibbles(packed: np.ndarray) -> np.ndarray:
    out = np.empty((*packed.shape[:-1], 2 * packed.shape[-1]), np.uint8)
    out[..., 0::2], out[..., 1::2] = packed & 0xF, packed >> 4
    return out


def _width(record, bytes_per_block: int, block: int, name: str) -> int:
    n = np.asarray(record).shape[-1]
    if n % bytes_per_block:
        raise ValueError(f"{name}: record bytes={n} must be a multiple of {bytes_per_block}")
    return n // bytes_per_block * block


def nvfp4_bytes(width: int) -> int:
    """Bytes of an NVFP4 entry record of `width` values (288 at 512)."""
    return width // 2 + width // NVFP4_BLOCK


def mxfp8_bytes(width: int) -> int:
    """Bytes of an MXFP8 window record of `width` values (528 at 512)."""
    return width + width // MX_BLOCK


def mxfp4_bytes(width: int) -> int:
    """Bytes of an MXFP4 key record of `width` values (68 at 128)."""
    return width // 2 + width // MX_BLOCK


def encode_nvfp4(x) -> np.ndarray:
    """uint8[..., d / 2 + d / 16] NVFP4 entry records of x [..., d] (V41_SPEC.md section 7a)."""
    blocks = _blocks(x, NVFP4_BLOCK, "nvfp4")
    scale_codes = e4m3_encode(_amax32(blocks, 6 * 2.0**-9) / np.float32(6))
    scale = e4m3_decode(scale_codes)[..., None]
    nibbles = e2m1_encode(np.clip(blocks / scale, -E2M1_MAX, E2M1_MAX))
    codes = _pack_nibbles(nibbles.reshape(*blocks.shape[:-2], -1))
    return np.concatenate([codes, scale_codes], axis=-1)


def decode_nvfp4(record) -> np.ndarray:
    """float64[..., d] values of NVFP4 entry records uint8[..., d / 2 + d / 16]."""
    record = np.asarray(record, np.uint8)
    d = _width(record, 9, NVFP4_BLOCK, "nvfp4")
    values = e2m1_decode(_unpack_nibbles(record[..., : d // 2]))
    scale = e4m3_decode(record[..., d // 2:])
    return (values.reshape(*values.shape[:-1], -1, NVFP4_BLOCK) * scale[..., None]).reshape(
        values.shape)


def _mx_exponent(blocks: np.ndarray, floor: float, fmt_max: float) -> np.ndarray:
    """Block exponents e_b = ceil_log2(fp32 max(amax, floor) * fp32(1 / fmt_max))."""
    scaled = _amax32(blocks, floor) * np.float32(1.0 / fmt_max)
    return np.clip(pow2ceil_exponent(scaled), -127, 127)


def encode_mxfp8(x) -> np.ndarray:
    """uint8[..., d + d / 32] MXFP8 window records of x [..., d] (V41_SPEC.md section 7b)."""
    blocks = _blocks(x, MX_BLOCK, "mxfp8")
    e = _mx_exponent(blocks, 1e-4, E4M3_MAX)
    scaled = np.clip(np.ldexp(blocks, -e[..., None]), -E4M3_MAX, E4M3_MAX)
    codes = e4m3_encode(scaled).reshape(*blocks.shape[:-2], -1)
    return np.concatenate([codes, ue8m0_encode(e)], axis=-1)


def decode_mxfp8(record) -> np.ndarray:
    """float64[..., d] values of MXFP8 window records uint8[..., d + d / 32]."""
    record = np.asarray(record, np.uint8)
    d = _width(record, 33, MX_BLOCK, "mxfp8")
    values = e4m3_decode(record[..., :d]).reshape(*record.shape[:-1], -1, MX_BLOCK)
    return (values * ue8m0_decode(record[..., d:])[..., None]).reshape(*record.shape[:-1], d)


def encode_mxfp4(x) -> np.ndarray:
    """uint8[..., d / 2 + d / 32] MXFP4 key records of x [..., d] (V41_SPEC.md section 7c)."""
    blocks = _blocks(x, MX_BLOCK, "mxfp4")
    e = _mx_exponent(blocks, 6 * 2.0**-126, E2M1_MAX)
    scaled = np.clip(np.ldexp(blocks, -e[..., None]), -E2M1_MAX, E2M1_MAX)
    codes = _pack_nibbles(e2m1_encode(scaled).reshape(*blocks.shape[:-2], -1))
    return np.concatenate([codes, ue8m0_encode(e)], axis=-1)


def decode_mxfp4(record) -> np.ndarray:
    """float64[..., d] values of MXFP4 key records uint8[..., d / 2 + d / 32]."""
    record = np.asarray(record, np.uint8)
    d = _width(record, 17, MX_BLOCK, "mxfp4")
    values = e2m1_decode(_unpack_nibbles(record[..., : d // 2]))
    values = values.reshape(*record.shape[:-1], -1, MX_BLOCK)
    return (values * ue8m0_decode(record[..., d // 2:])[..., None]).reshape(
        *record.shape[:-1], d)


def fake_quant_nvfp4(x) -> np.ndarray:
    """decode_nvfp4(encode_nvfp4(x)): x as a stored compressed entry holds it."""
    return decode_nvfp4(encode_nvfp4(x))


def fake_quant_mxfp8(x) -> np.ndarray:
    """decode_mxfp8(encode_mxfp8(x)): x as a stored window row holds it."""
    return decode_mxfp8(encode_mxfp8(x))


def fake_quant_mxfp4(x) -> np.ndarray:
    """decode_mxfp4(encode_mxfp4(x)): x as a stored index key (or a quantised index query)."""
    return decode_mxfp4(encode_mxfp4(x))


def to_words(record) -> np.ndarray:
    """uint32[..., ceil(n / 4)] little-endian words of uint8[..., n] records (zero bytes
    appended up to a multiple of 4)."""
    record = np.asarray(record, np.uint8)
    pad = -record.shape[-1] % 4
    padded = np.concatenate([record, np.zeros((*record.shape[:-1], pad), np.uint8)], axis=-1)
    b = padded.reshape(*record.shape[:-1], -1, 4).astype(np.uint32)
    return b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)


def from_words(words, nbytes: int) -> np.ndarray:
    """uint8[..., nbytes] records of their little-endian uint32 words (the padding dropped)."""
    w = np.asarray(words, np.uint32)
    if w.shape[-1] != -(-nbytes // 4):
        raise ValueError(f"words: {w.shape[-1]} words, expected {-(-nbytes // 4)} for "
                         f"{nbytes=}")
    b = np.stack([(w >> (8 * j)) & 0xFF for j in range(4)], axis=-1).astype(np.uint8)
    return b.reshape(*w.shape[:-1], -1)[..., :nbytes]
