"""The V4.1 float64 oracle and record codec (v4kv_jax/testing/v41_oracle.py, v41_records.py)
against V41_SPEC.md: hand-computed bytes of the three records (section 7), the per-layer plan
and its invariants (1.2, 11), RoPE (2), the worked example (10), and properties of the oracle
on T1 and T2 (11), with queries' outputs re-derived here by direct formulas.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np
import pytest

from v4kv_jax.testing import v41_oracle as O
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


# ---- the per-layer plan (V41_SPEC.md section 1.2) ----

def test_the_flash_plan_is_the_spec_table():
    stack = O.flash_stack()
    plan = stack.layer_plan()
    assert len(plan) == 43 and stack.num_hidden_layers == 40
    want = {}
    for layer in (0, 1, 40, 41, 42):
        want[layer] = (0, "SWA", None, None, False, False, "base")
    for src in (2, 8, 14):
        want[src] = (2, "Full", src, src, False, False, "compress")
        for layer in range(src + 1, src + 6):
            want[layer] = (2, "Reuse", src, src, False, False, "compress")
    want[20] = (1, "Full", 20, 20, False, True, "compress")
    for layer in (21, 22, 23):
        want[layer] = (1, "Reuse", 20, 20, False, False, "compress")
    for src in (24, 28, 32, 36):
        want[src] = (1, "Reindex", 20, src, True, False, "compress")
        for layer in range(src + 1, src + 4):
            want[layer] = (1, "Reuse", 20, src, False, False, "compress")
    got = {p.layer: (p.ratio, p.mode, p.kv_src, p.idx_src, p.uses_candidates,
                     p.is_candidate_source, p.rope) for p in plan}
    assert got == dict(sorted(want.items()))


def test_a_text_config_gives_the_flash_stack():
    text_config = {
        "num_hidden_layers": 40, "compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0] * 3,
        "kv_source_layer_ids": [2, 8, 14, 20],
        "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36],
        "candidate_source_layer_id": 20, "rms_norm_eps": 1e-20, "hidden_size": 5120,
        "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings":
                         65536, "beta_fast": 32, "beta_slow": 1}}
    assert O.V41Stack.from_text_config(text_config) == O.flash_stack()
    text_config["rope_scaling"]["factor"] = 4
    assert O.V41Stack.from_text_config(text_config).rope_factor == 4


@pytest.mark.parametrize("change, field, words", [
    (dict(kv_source_layer_ids=(1, 3, 4)), "kv_source_layer_ids", ["[4] not among"]),
    (dict(compress_ratios=(0, 2, 2, 1, 2, 1)), "compress_ratios[4]", ["layer 3, 1", "got 2"]),
    (dict(candidate_topk_blocks=2), "candidate_topk_blocks", ["index_topk = 4", "got 3"]),
    (dict(compress_ratios=(0, 2, 2, 1, 1, 0)), "index_source_layer_ids",
     ["nonzero", "compress_ratios[5] = 0"]),
    (dict(compress_ratios=(0, 4, 4, 128, 128, 128)), "compress_ratios", ["got [4, 128]"]),
    (dict(candidate_source_layer_id=5), "candidate_source_layer_id", ["[1, 3]", "got 5"]),
    (dict(kv_source_layer_ids=(3,)), "kv_source_layer_ids", ["first nonzero-ratio layer 1",
                                                             "got [3]"]),
])
def test_invalid_stacks_name_the_field_and_both_values(change, field, words):
    with pytest.raises(ValueError) as caught:
        O.tiny6_stack(**change)
    message = str(caught.value)
    assert message.startswith(f"{field}: expected"), message
    assert all(w in message for w in words), message


def test_the_spec_configs_are_valid_and_plan_as_described():
    modes = [p.mode for p in O.tiny6_stack().layer_plan()]
    assert modes == ["SWA", "Full", "Reuse", "Full", "Reuse", "Reindex"]
    plan = O.mini8_stack().layer_plan()
    assert (plan[7].mode, plan[7].idx_src, plan[7].kv_src) == ("Reuse", 6, 4)
    assert [p.layer for p in plan if p.uses_candidates] == [6]


# ---- RoPE (V41_SPEC.md section 2) ----

def test_compress_frequencies_ramp_between_15_and_25_for_flash():
    f = O.rope_frequencies(O.flash_stack(), True)
    i = np.arange(32)
    base = 160000.0 ** (-2 * i / 64)
    ramp = np.clip((i - 15) / 10, 0, 1)  # c(32) = 15.45 -> 15, c(1) = 24.7 -> 25
    np.testing.assert_allclose(f, base / 16 * ramp + base * (1 - ramp), rtol=1e-15)
    np.testing.assert_allclose(O.rope_frequencies(O.flash_stack(), False),
                               10000.0 ** (-2 * i / 64), rtol=1e-15)
    # T1's widths: rope 16, original 4096: c(32) = 2.01 -> 2, c(1) = 4.33 -> 5
    t = O.rope_frequencies(O.tiny6_stack(), True)
    j = np.arange(8)
    ramp = np.clip((j - 2) / 3, 0, 1)
    base = 160000.0 ** (-2 * j / 16)
    np.testing.assert_allclose(t, base / 16 * ramp + base * (1 - ramp), rtol=1e-15)


def test_the_yarn_correction_range_is_clamped_to_the_rope_dims():
    # rope 16, original 4096: c(32) = 2.01 -> low 2; c(1e-8) = 16.6 -> ceil 17, clamped to
    # rd - 1 = 15: the ramp is (i - 2) / 13 over the 8 pairs.
    f = O.rope_frequencies(O.tiny6_stack(beta_slow=1e-8), True)
    i = np.arange(8)
    base = 160000.0 ** (-2 * i / 16)
    ramp = np.clip((i - 2) / 13, 0, 1)
    np.testing.assert_allclose(f, base / 16 * ramp + base * (1 - ramp), rtol=1e-15)


def test_rope_turns_adjacent_pairs_of_the_last_dims():
    freqs = np.array([1.0, 0.5])  # 4 rope dims: pairs (4, 5) and (6, 7) of 8
    v = np.arange(1.0, 9.0)
    got = O.rotate(v, 3, freqs)
    np.testing.assert_array_equal(got[:4], v[:4])
    np.testing.assert_allclose(got[4:6], [5 * math.cos(3) - 6 * math.sin(3),
                                          5 * math.sin(3) + 6 * math.cos(3)], rtol=1e-15)
    np.testing.assert_allclose(got[6:], [7 * math.cos(1.5) - 8 * math.sin(1.5),
                                         7 * math.sin(1.5) + 8 * math.cos(1.5)], rtol=1e-15)
    np.testing.assert_allclose(O.rotate(got, 3, freqs, inverse=True), v, rtol=1e-14)


# ---- the worked example (V41_SPEC.md section 10) ----

def test_visibility_of_the_worked_example():
    # r = 2: t = 3 and 4 see {0, 1}, t = 5 sees {0, 1, 2}; t = 6 is the open row; t = 7 has
    # closed C_3 = (6, 7) before its attention and sees 0..3.
    assert [O.visible_entries(t, 2) for t in range(8)] == [0, 1, 1, 2, 2, 3, 3, 4]
    assert [O.visible_entries(t, 1) for t in range(7)] == [1, 2, 3, 4, 5, 6, 7]  # 0..t
    np.testing.assert_array_equal(O.entry_positions(4, 2), [0, 2, 4, 6])
    np.testing.assert_array_equal(O.entry_positions(7, 1), np.arange(7))


def test_a_ratio2_entry_pools_its_pair_by_a_gate_per_channel():
    rng = np.random.default_rng(3)
    a, z = rng.normal(size=(8, 16)), rng.normal(size=(8, 16))
    norm = rng.uniform(0.7, 1.3, 16)
    assert O.compress_latents(a, z, norm, 2, 1e-6, 7).shape == (3, 16)  # token 6 open
    got = O.compress_latents(a, z, norm, 2, 1e-6, 8)
    g = 1 / (1 + np.exp(z[7] - z[6]))  # sigma(z_6 - z_7), the weight of token 6
    pooled = g * a[6] + (1 - g) * a[7]
    np.testing.assert_allclose(got[3], norm * pooled / np.sqrt(np.mean(pooled**2) + 1e-6),
                               rtol=1e-13)
    bf = O.compress_latents(a, z, norm, 2, 1e-6, 8, bf16_latent=True)
    assert 0 < np.abs(bf - got).max() < 1e-2


def test_the_candidate_example_keeps_all_three_blocks():
    scores = np.random.default_rng(4).normal(size=21)  # r = 1, t = 20: n = 21, block 8
    kept, positions, margin = O.candidate_blocks(scores, 8, 2048)
    np.testing.assert_array_equal(kept, [0, 1, 2])  # block 2 = positions 16..20
    np.testing.assert_array_equal(positions, np.arange(21))
    assert margin == np.inf


def test_the_newest_block_is_pinned_and_the_best_others_kept():
    scores = np.array([9.0, 0, 0, 0, 5, 0, 0, 0, 7, 0, 0, 0, -3])  # blocks of 4, n = 13
    kept, positions, margin = O.candidate_blocks(scores, 4, 1)
    np.testing.assert_array_equal(kept, [3])  # the newest block beats block 0's 9
    np.testing.assert_array_equal(positions, [12])
    kept, positions, margin = O.candidate_blocks(scores, 4, 3)
    np.testing.assert_array_equal(kept, [0, 2, 3])
    np.testing.assert_array_equal(positions, [0, 1, 2, 3, 8, 9, 10, 11, 12])
    assert margin == 2.0  # block 2's 7 against block 1's 5


def test_topk_selects_all_when_short_else_the_best_and_drops_minus_inf():
    np.testing.assert_array_equal(O.topk_selection([3.0, -1.0, 2.0], 4)[0], [0, 1, 2])
    picks, margin = O.topk_selection([3.0, -1.0, 2.0, 5.0, 0.0], 2)
    np.testing.assert_array_equal(picks, [0, 3])
    assert margin == 1.0  # 3 against 2
    picks, margin = O.topk_selection([3.0, -np.inf, -np.inf, -np.inf, 1.0], 3)
    np.testing.assert_array_equal(picks, [0, 4])
    assert margin == np.inf


# ---- the oracle on T1 and T2 (V41_SPEC.md section 11) ----

@functools.cache
def _case(name: str, length: int, seed: int = 0):
    stack = {"t1": O.tiny6_stack, "t2": O.mini8_stack}[name](index_n_heads=8)
    inputs = O.random_inputs(stack, length, seed)
    return stack, inputs, O.run(stack, inputs)


def _rot(v, position, freqs, inverse=False):
    """The rope dims as complex numbers (d0 + 2i real, d0 + 2i + 1 imaginary), turned by
    e^(+-i p f): written here apart from the oracle's `rotate`."""
    v = np.array(v, np.float64)
    rd = 2 * len(freqs)
    z = v[..., -rd::2] + 1j * v[..., -rd + 1::2]
    z = z * np.exp((-1j if inverse else 1j) * position * freqs)
    v[..., -rd::2], v[..., -rd + 1::2] = z.real, z.imag
    return v


def _attend_by_hand(q, keys, sink, t, freqs):
    """One query's output, head by head and key by key, with the sink in the denominator."""
    out = []
    for h in range(len(q)):
        qh = _rot(q[h], t, freqs)
        weights = [math.exp(qh @ k / math.sqrt(len(qh))) for k in keys]
        total = sum(weights) + math.exp(sink[h])
        mixed = sum(w / total * k for w, k in zip(weights, keys, strict=True))
        out.append(_rot(mixed, t, freqs, inverse=True))
    return np.array(out)


@pytest.mark.parametrize("name", ["t1", "t2"])
def test_each_query_selects_min_topk_nt_visible_entries(name):
    stack, _, res = _case(name, 32)
    plan = stack.layer_plan()
    for src, chosen in res.selections.items():
        r = plan[src].ratio
        for t, picks in enumerate(chosen):
            n = (t + 1) // r
            assert len(picks) == min(stack.index_topk, n), (src, t)
            assert (np.diff(picks) > 0).all() and (len(picks) == 0 or picks[-1] < n), (src, t)
            if n <= stack.index_topk:  # short context: all visible, the own token's entry too
                np.testing.assert_array_equal(picks, np.arange(n))


def test_a_ratio1_query_picks_its_own_entry_when_it_scores_best():
    stack, inputs, res = _case("t1", 24)
    t = 21  # 21 entries, top-4: with these inputs entry 21 is not among them
    # Entry t is visible to query t (j <= t): with every index head's query equal to key t
    # (un-rotated at t) and every weight positive, it scores best among the 21 and is picked.
    q_index = inputs[3].q_index.copy()
    q_index[t] = _rot(np.tile(res.keys[3][t], (stack.index_n_heads, 1)), t,
                      O.rope_frequencies(stack, True), inverse=True)
    changed = dataclasses.replace(inputs[3], q_index=q_index, w_index=np.abs(inputs[3].w_index))
    picks = O.run(stack, [*inputs[:3], changed, *inputs[4:]]).selections[3][t]
    assert t not in res.selections[3][t] and t in picks and len(picks) == stack.index_topk


def test_a_reuse_layer_reads_its_index_sources_picks_and_its_kv_sources_entries():
    # T2's layer 7 reuses layer 6's top-k (a Reindex layer with its own scores) over layer 4's
    # entries; layer 6's and layer 4's picks differ somewhere, so the check below would see a
    # layer that took the wrong selection.
    stack, inputs, res = _case("t2", 32)
    freqs = O.rope_frequencies(stack, True)
    assert any(not np.array_equal(a, b) for a, b in zip(res.selections[6], res.selections[4],
                                                     strict=True))
    x = inputs[7]
    for t in (5, 20, 31):
        window = [_rot(x.win[s], s, freqs) for s in range(max(0, t - 15), t + 1)]
        picked = [res.entries[4][j] for j in res.selections[6][t]]
        np.testing.assert_allclose(res.outputs[7][t],
                                   _attend_by_hand(x.q[t], window + picked, x.sink, t, freqs),
                                   rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("name, consumer, blocks", [("t1", 5, 4 * 2), ("t2", 6, 3 * 4)])
def test_candidate_consumers_pick_inside_the_candidate_blocks(name, consumer, blocks):
    stack, inputs, res = _case(name, 32)
    plan = stack.layer_plan()
    cand = stack.candidate_source_layer_id
    freqs = O.rope_frequencies(stack, True)
    x = inputs[consumer]
    outside = 0
    for t in range(32):
        n = (t + 1) // plan[consumer].ratio
        cands = res.candidates[t]
        assert len(cands) == min(n, blocks) or (n > blocks and len(cands) < blocks), t
        if n <= blocks:
            np.testing.assert_array_equal(cands, np.arange(n))  # the mask keeps everything
            continue
        assert n - 1 in cands  # the newest entry's block is pinned
        assert set(res.selections[consumer][t]) <= set(cands), t
        # the same scores without the mask would pick outside the candidates at some t
        scores = O.index_scores(stack, x.q_index[t], x.w_index[t],
                                res.keys[plan[consumer].kv_src][:n], t, freqs)
        outside += not set(O.topk_selection(scores, stack.index_topk)[0]) <= set(cands)
        # its margin is the smaller of the block cut and the cut among the candidates
        c = inputs[cand]
        block_cut = O.candidate_blocks(O.index_scores(stack, c.q_index[t], c.w_index[t],
                                                      res.keys[cand][:n], t, freqs),
                                       stack.candidate_block_size,
                                       stack.candidate_topk_blocks)[2]
        masked = np.full(n, -np.inf)
        masked[cands] = scores[cands]
        assert res.margins[consumer][t] == min(block_cut,
                                               O.topk_selection(masked, stack.index_topk)[1])
    assert outside > 0
    # the candidate source's own top-k is not restricted
    assert any(not set(res.selections[cand][t]) <= set(res.candidates[t]) for t in range(32))


def test_a_query_without_entries_attends_its_window_and_the_sink_only():
    stack, inputs, res = _case("t1", 32)
    # Layer 1 (ratio 2) at t = 0: no closed entry, one window row: o = p k with
    # p = e^l / (e^l + e^sink), then turned back at 0 (the identity).
    x = inputs[1]
    k = x.win[0]  # rotated at position 0: itself
    for h in range(stack.num_attention_heads):
        logit = x.q[0, h] @ k / 8.0  # head_dim 64
        p = math.exp(logit) / (math.exp(logit) + math.exp(x.sink[h]))
        np.testing.assert_allclose(res.outputs[1][0, h], p * k, rtol=1e-13)
    # The SWA layer 0 at t = 20 (base table): the window rows 13..20 and the sink.
    base = O.rope_frequencies(stack, False)
    x = inputs[0]
    window = [_rot(x.win[s], s, base) for s in range(13, 21)]
    np.testing.assert_allclose(res.outputs[0][20],
                               _attend_by_hand(x.q[20], window, x.sink, 20, base),
                               rtol=1e-11, atol=1e-12)


def test_one_ratio2_query_re_derived_from_the_inputs():
    # T1's layer 1 (Full, ratio 2) at t = 11: six closed entries, top-4 of them, window of 8.
    stack, inputs, res = _case("t1", 32)
    x, t, eps = inputs[1], 11, stack.rms_norm_eps
    freqs = O.rope_frequencies(stack, True)

    def norm(v, w):
        return w * v / math.sqrt(float(np.mean(v * v)) + eps)

    entries, keys = [], []
    for j in range(6):  # entry j pools tokens 2j, 2j + 1 and sits at RoPE position 2j
        g = 1 / (1 + np.exp(x.z[2 * j + 1] - x.z[2 * j]))
        latent = norm(g * x.a[2 * j] + (1 - g) * x.a[2 * j + 1], x.norm_c)
        entries.append(_rot(latent, 2 * j, freqs))
        keys.append(_rot(norm(x.wk @ latent, x.k_norm), 2 * j, freqs))
    w = x.w_index[t] / math.sqrt(32) / math.sqrt(stack.index_n_heads)
    q_index = [_rot(x.q_index[t, h], t, freqs) for h in range(stack.index_n_heads)]
    scores = [sum(w[h] * max(q_index[h] @ k, 0.0) for h in range(len(w))) for k in keys]
    ranked = sorted(range(6), key=lambda j: -scores[j])
    assert scores[ranked[3]] - scores[ranked[4]] > 1e-6  # no near-tie at the cut
    picks = sorted(ranked[:4])
    np.testing.assert_array_equal(res.selections[1][t], picks)
    assert res.margins[1][t] == pytest.approx(scores[ranked[3]] - scores[ranked[4]], rel=1e-9)
    np.testing.assert_allclose(res.entries[1][:6], entries, rtol=1e-12, atol=1e-13)
    window = [_rot(x.win[s], s, freqs) for s in range(4, 12)]
    np.testing.assert_allclose(res.outputs[1][t],
                               _attend_by_hand(x.q[t], window + [entries[j] for j in picks],
                                               x.sink, t, freqs), rtol=1e-11, atol=1e-12)
    # Layer 2 reuses these picks and entries with its own query, window and sink.
    y = inputs[2]
    window = [_rot(y.win[s], s, freqs) for s in range(4, 12)]
    np.testing.assert_allclose(res.outputs[2][t],
                               _attend_by_hand(y.q[t], window + [entries[j] for j in picks],
                                               y.sink, t, freqs), rtol=1e-11, atol=1e-12)


def test_a_ratio1_query_sees_its_token_twice():
    # T1's layer 4 (Reuse of layer 3, ratio 1) at t = 2: n = 3 <= top-4 selects entries 0..2,
    # so token 2 is there as its window row and as entry 2.
    stack, inputs, res = _case("t1", 32)
    freqs = O.rope_frequencies(stack, True)
    x = inputs[4]
    np.testing.assert_array_equal(res.selections[3][2], [0, 1, 2])
    keys = [_rot(x.win[s], s, freqs) for s in range(3)] + list(res.entries[3][:3])
    np.testing.assert_allclose(res.outputs[4][2], _attend_by_hand(x.q[2], keys, x.sink, 2,
                                                                  freqs), rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("name", ["t1", "t2"])
def test_extending_the_history_leaves_earlier_outputs_unchanged(name):
    stack, inputs, full = _case(name, 32)
    cut = [dataclasses.replace(x, **{f.name: getattr(x, f.name)[:17] for f in
                                     dataclasses.fields(x) if f.name in ("q", "win", "a", "z",
                                                                         "q_index", "w_index")
                                     and getattr(x, f.name) is not None}) for x in inputs]
    short = O.run(stack, cut)
    for layer in range(stack.num_hidden_layers):
        np.testing.assert_allclose(short.outputs[layer], full.outputs[layer][:17], rtol=1e-13,
                                   atol=1e-14)
    for src, entries in short.entries.items():
        assert len(entries) == 17 // stack.compress_ratios[src]  # the open row stays open
        np.testing.assert_allclose(entries, full.entries[src][: len(entries)], rtol=1e-13)
    for src, chosen in short.selections.items():
        for a, b in zip(chosen, full.selections[src][:17], strict=True):
            np.testing.assert_array_equal(a, b)


def test_fake_quantisation_stores_the_records_of_the_float_values():
    stack, inputs, plain = _case("t1", 32)
    quant = O.run(stack, inputs, quantize=True)
    for src in stack.kv_source_layer_ids:
        np.testing.assert_array_equal(quant.entries[src], R.fake_quant_nvfp4(plain.entries[src]))
        np.testing.assert_array_equal(quant.keys[src], R.fake_quant_mxfp4(plain.keys[src]))
    for layer in range(stack.num_hidden_layers):
        np.testing.assert_array_equal(quant.windows[layer], R.fake_quant_mxfp8(
            plain.windows[layer]))
        assert np.abs(quant.outputs[layer] - plain.outputs[layer]).max() > 0, layer
    # the SWA layer sees the MXFP8 rounding of its window only (the others also other picks)
    assert np.abs(quant.outputs[0] - plain.outputs[0]).max() < 0.3


def test_flash_stores_890_bytes_of_global_kv_per_token():
    flash = O.flash_stack()
    # 3 ratio-2 sources x 1/2 + 1 ratio-1 source = 2.5 entries a token, each 288 + 68 B
    assert O.global_bytes_per_token(flash) == 2.5 * (288 + 68) == 890
    assert O.global_bytes(flash, 300) == (3 * 150 + 300) * 356
    assert O.global_bytes(flash, 301) == (3 * 150 + 301) * 356  # token 300's pair is open
