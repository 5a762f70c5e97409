"""The V4.1 record codec (v4kv_jax/testing/v41_records.py) against V41_SPEC.md section 7:
hand-computed bytes of the three records and their primitives.
"""

from __future__ import annotations

import numpy as np
import pytest

from v4kv_jax.testing import v41_records as R

# The grid value of e2m1 codes 0..7 is |v| in {0, .5, 1, 1.5, 2, 3, 4, 6}; `G` holds each of
# them once, the seven rounding midpoints and a negative (-1 -> 0x8 | 2 = 0xA, -6 -> 0xF):
G = np.array([0, 0.5, -1, 1.5, 2, 3, 4, 6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -6])
# their nibbles: 0.25 -> 0 (ties to even code 0), 0.75 -> 2 (1.0), 1.25 -> 2, 1.75 -> 4 (2.0),
# 2.5 -> 4, 3.5 -> 6 (4.0), 5 -> 6
G_NIBBLES = [0x0, 0x1, 0xA, 0x3, 0x4, 0x5, 0x6, 0x7, 0x0, 0x2, 0x2, 0x4, 0x4, 0x6, 0x6, 0xF]
# packed two a byte, the even element in the low nibble: (0, 1) -> 0x10, (A, 3) -> 0x3A, ...
G_BYTES = [0x10, 0x3A, 0x54, 0x76, 0x20, 0x42, 0x64, 0xF6]


# ---- codec primitives ----

def test_e2m1_rounds_to_nearest_with_ties_to_the_even_code_and_saturates():
    x = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0, 1e9, 0.2, 0.3, 5.01])
    want = [0, 1, 1, 2, 2, 4, 4, 6, 6, 6, 0, 0.5, 6]
    np.testing.assert_array_equal(R.e2m1_decode(R.e2m1_encode(x)), want)
    np.testing.assert_array_equal(R.e2m1_decode(R.e2m1_encode(-x)), np.negative(want))
    np.testing.assert_array_equal(R.e2m1_encode(G), G_NIBBLES)
    # the sign of a value that rounds to zero is kept: -0.1 -> 0x8, +0.1 -> 0x0
    np.testing.assert_array_equal(R.e2m1_encode([-0.1, 0.1, -0.0]), [0x8, 0x0, 0x8])


def test_e4m3_codes_by_hand():
    # 1.0 = 2^0: biased exponent 7 -> 0x38; 1.0625 ties between 1.0 and 1.125 -> even 1.0;
    # 1.1875 ties between 1.125 (m 1) and 1.25 (m 2) -> 1.25 = 0x3A; 448 = 1.75 * 2^8 = 0x7E
    # (the largest); 500 saturates to 448; -2 = 0x80 | 8 << 3 = 0xC0; 2^-6 is the smallest
    # normal 0x08; below it subnormals m * 2^-9: 3 * 2^-9 = 0x03; 2^-10 ties between 0 and
    # 2^-9 -> 0; 1.5 * 2^-9 ties between 1 and 2 quanta -> 2 = 0x02.
    x = [1.0, 1.0625, 1.1875, 448.0, 500.0, -2.0, 2**-6, 3 * 2**-9, 2**-10, 1.5 * 2**-9]
    want = [0x38, 0x38, 0x3A, 0x7E, 0x7E, 0xC0, 0x08, 0x03, 0x00, 0x02]
    np.testing.assert_array_equal(R.e4m3_encode(x), want)
    np.testing.assert_array_equal(R.e4m3_decode(want), [1, 1, 1.25, 448, 448, -2, 2**-6,
                                                        3 * 2**-9, 0, 2**-8])
    assert np.isnan(R.e4m3_decode([0x7F, 0xFF])).all()


def test_the_primitives_agree_with_ml_dtypes():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(0)
    x = (rng.normal(size=20000) * np.exp(rng.uniform(-18, 6, 20000))).astype(np.float32)
    x = x[np.abs(x) <= 448]
    want = x.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    np.testing.assert_array_equal(R.e4m3_encode(x), want)
    codes = np.arange(256, dtype=np.uint8)
    np.testing.assert_array_equal(R.e4m3_decode(codes),
                                  codes.view(ml_dtypes.float8_e4m3fn).astype(np.float64))
    y = rng.uniform(-6, 6, 20000).astype(np.float32)
    np.testing.assert_array_equal(R.e2m1_decode(R.e2m1_encode(y)),
                                  y.astype(ml_dtypes.float4_e2m1fn).astype(np.float64))
    np.testing.assert_array_equal(R.bf16_round(x), x.astype(ml_dtypes.bfloat16).astype(float))


def test_ue8m0_and_pow2ceil_from_fp32_bits():
    np.testing.assert_array_equal(R.ue8m0_decode([127, 0, 254, 119]),
                                  [1.0, 2.0**-127, 2.0**127, 2.0**-8])
    np.testing.assert_array_equal(R.ue8m0_encode([-127, 0, 127]), [0, 127, 254])
    with pytest.raises(ValueError, match="exponent"):
        R.ue8m0_encode([128])
    # 1 -> 0; the next fp32 above 1 -> 1; 0.75 -> 0; 0.5 -> -1; 448 = 1.75 * 2^8 -> 9;
    # 2^-126 (the smallest normal) -> -126
    v = np.array([1.0, np.nextafter(np.float32(1), np.float32(2)), 0.75, 0.5, 448, 2.0**-126],
                 np.float32)
    np.testing.assert_array_equal(R.pow2ceil_exponent(v), [0, 1, 0, -1, 9, -126])


# ---- the three records ----

def test_nvfp4_record_bytes_by_hand():
    # Three blocks of 16. Block 0 = 2 G: amax 12, s = e4m3(12 / 6) = 2.0 = 0x40, codes of G.
    # Block 1 = 0: amax floored at 6 * 2^-9, s = 2^-9 = 0x01 (a subnormal e4m3), codes 0.
    # Block 2 = 3 * 2^-9 G: s = e4m3(3 * 2^-9) = 0x03 (subnormal), codes of G again.
    x = np.concatenate([2 * G, np.zeros(16), 3 * 2.0**-9 * G])
    want = G_BYTES + [0] * 8 + G_BYTES + [0x40, 0x01, 0x03]
    rec = R.encode_nvfp4(x)
    np.testing.assert_array_equal(rec, want)
    np.testing.assert_array_equal(R.decode_nvfp4(rec)[:16], 2 * R.e2m1_decode(G_NIBBLES))
    np.testing.assert_array_equal(R.decode_nvfp4(rec)[16:32], 0)
    np.testing.assert_array_equal(R.decode_nvfp4(rec)[32:],
                                  3 * 2.0**-9 * R.e2m1_decode(G_NIBBLES))
    # A rounded scale: amax 7 -> 7 / 6 = 1.1667 -> e4m3 1.125 (0x39); 7 / 1.125 = 6.2
    # saturates to code 7 (6.75 decoded); 0.28125 / 1.125 = 0.25 ties to 0; 0.84375 / 1.125 =
    # 0.75 ties to code 2 (1.125 decoded).
    y = np.zeros(16)
    y[:4] = [7.0, -0.28125, 0.84375, 0.0]
    rec = R.encode_nvfp4(y)
    np.testing.assert_array_equal(rec, [0x87, 0x02] + [0] * 6 + [0x39])
    np.testing.assert_array_equal(R.decode_nvfp4(rec)[:4], [6.75, -0.0, 1.125, 0.0])


def test_mxfp8_record_bytes_by_hand():
    # Block 0, amax 1: e = ceil_log2(fp32(1) * fp32(1/448)) = -8 (2^-9 < 1/448 <= 2^-8), byte
    # 119 = 0x77; 1 * 2^8 = 256 = 2^8 -> 0x78; 0.5 -> 128 -> 0x70; -1 -> 0xF8; 3 * 2^-17 ->
    # 3 * 2^-9 -> 0x03 (subnormal); 2^-20 -> 2^-12, under half the smallest subnormal -> 0.
    # Block 1, amax 448: 448 * fp32(1/448) rounds to exactly 1 -> e = 0, byte 0x7F, 448 ->
    # 0x7E. Block 2 = 0: amax floored at fp32(1e-4); 1e-4 / 448 = 2.2e-7 in (2^-23, 2^-22]
    # -> e = -22, byte 105 = 0x69.
    x = np.zeros(96)
    x[:5] = [1.0, 0.5, -1.0, 3 * 2.0**-17, 2.0**-20]
    x[32] = 448.0
    rec = R.encode_mxfp8(x)
    want = np.zeros(99, np.uint8)
    want[:5] = [0x78, 0x70, 0xF8, 0x03, 0x00]
    want[32] = 0x7E
    want[96:] = [0x77, 0x7F, 0x69]
    np.testing.assert_array_equal(rec, want)
    np.testing.assert_array_equal(R.decode_mxfp8(rec), np.where(x == 2.0**-20, 0.0, x))


def test_mxfp4_record_bytes_and_words_by_hand():
    # One block of 32 = (G, G reversed): amax 6, fp32(6) * fp32(1/6) rounds to exactly 1 ->
    # e = 0, byte 127 = 0x7F, codes as they are. G reversed starts -6, 5, 3.5, 2.5: nibbles
    # F 6 6 4 4 2 2 0 7 6 5 4 3 A 1 0 -> bytes 0x6F 0x46 0x24 0x02 0x67 0x45 0xA3 0x01.
    x = np.concatenate([G, G[::-1]])
    tail = [0x6F, 0x46, 0x24, 0x02, 0x67, 0x45, 0xA3, 0x01]
    rec = R.encode_mxfp4(x)
    np.testing.assert_array_equal(rec, G_BYTES + tail + [0x7F])
    # 17 bytes -> 5 little-endian words, the last padded with zero bytes
    words = R.to_words(rec)
    np.testing.assert_array_equal(words, [0x76543A10, 0xF6644220, 0x0224466F, 0x01A34567,
                                          0x0000007F])
    np.testing.assert_array_equal(R.from_words(words, 17), rec)
    # amax 7: 7 * fp32(1/6) = 1.17 -> e = 1, scale 2, 7 / 2 = 3.5 ties to 4 (code 6);
    # an all-zero block floors at 6 * 2^-126 -> e = -126, byte 1.
    y = np.zeros(64)
    y[0] = 7.0
    rec = R.encode_mxfp4(y)
    assert rec[0] == 0x06 and not rec[1:32].any() and list(rec[32:]) == [128, 1]


def test_release_record_sizes_and_word_views():
    rng = np.random.default_rng(1)
    for encode, width, nbytes, nwords in ((R.encode_nvfp4, 512, 288, 72),
                                          (R.encode_mxfp8, 512, 528, 132),
                                          (R.encode_mxfp4, 128, 68, 17)):
        rec = encode(rng.normal(size=(3, width)))
        assert rec.shape == (3, nbytes) and rec.dtype == np.uint8
        words = R.to_words(rec)
        assert words.shape == (3, nwords) and words.dtype == np.uint32
        np.testing.assert_array_equal(words, rec.view("<u4"))  # no padding at these widths
    assert (R.nvfp4_bytes(512), R.mxfp8_bytes(512), R.mxfp4_bytes(128)) == (288, 528, 68)
    assert (R.nvfp4_bytes(64), R.mxfp8_bytes(64), R.mxfp4_bytes(32)) == (36, 66, 17)
    with pytest.raises(ValueError, match="multiple of 32"):
        R.encode_mxfp8(np.zeros(48))


def test_a_decoded_vector_encodes_to_the_same_values():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(400, 64)) * np.exp(rng.uniform(-3, 3, (400, 1)))
    for fq in (R.fake_quant_nvfp4, R.fake_quant_mxfp8, R.fake_quant_mxfp4):
        once = fq(x)
        np.testing.assert_array_equal(fq(once), once)
        assert np.abs(once - x).max() > 0  # the quantisation did something
    # NVFP4 with normal scales gives the same BYTES too (amax / s stays in [5.6, 6.4], so the
    # largest code is 6 and the scale comes back).
    rec = R.encode_nvfp4(x)
    np.testing.assert_array_equal(R.encode_nvfp4(R.decode_nvfp4(rec)), rec)


def test_where_reencoding_is_not_the_identity():
    # MXFP8: amax 230, 230 / 448 in (2^-1, 1] -> e = 0 (byte 127); 230 rounds to 224 (quantum
    # 16 in [128, 256)) = 1.75 * 2^7 = 0x76. Decoded, amax 224 * fp32(1/448) rounds to exactly
    # 2^-1 -> e = -1 (byte 126), 224 * 2 = 448 = 0x7E: other bytes, the same values.
    x = np.zeros(32)
    x[0] = 230.0
    once = R.encode_mxfp8(x)
    twice = R.encode_mxfp8(R.decode_mxfp8(once))
    assert (once[0], once[32], twice[0], twice[32]) == (0x76, 127, 0x7E, 126)
    np.testing.assert_array_equal(R.decode_mxfp8(twice), R.decode_mxfp8(once))
    # NVFP4 with a subnormal scale: amax 9 * 2^-9 -> 1.5 * 2^-9 ties to s = 2 * 2^-9; 4.5 -> 4:
    # 8 * 2^-9 decoded; again: s = e4m3(8/6 * 2^-9) = 2^-9, 8 saturates to 6: 6 * 2^-9.
    y = np.zeros(16)
    y[0] = 9 * 2.0**-9
    assert R.fake_quant_nvfp4(y)[0] == 8 * 2.0**-9
    assert R.fake_quant_nvfp4(R.fake_quant_nvfp4(y))[0] == 6 * 2.0**-9
