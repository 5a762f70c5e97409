"""DeepSeek-V4.1's storage records in the library's codec (v4kv_jax/pools/records41.py,
V41_SPEC.md section 7): "nvfp4", "mxfp8" and "mxfp4" rows of uint32 words against the
independent numpy codec `v4kv_jax.testing.v41_records`, word for word.

* Encoding: hand-picked rows (every e4m3 and e2m1 rounding midpoint and its neighbours,
  saturation, all-zero blocks, the subnormal e4m3 scales of nvfp4 and their midpoints,
  negative zero, fp32 subnormal inputs, the fp32 range's ends) and random rows of many
  magnitudes (hypothesis), at widths 16 / 32 / 64 / 512 (128 for keys).
* Decoding: every code at every scale byte, random words and the encoded rows equal the numpy
  decoder's float64 values rounded to float32 (the scale byte 0xFF of mxfp8 / mxfp4 aside,
  which decodes to NaN here).
* The release widths: 72 / 132 / 17 words, 288 / 528 / 68 B; the NaN / inf rules and the
  NaN-poison row; one compilation per shape, and a trace that does not grow with the width.
"""

from __future__ import annotations

import functools

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from v4kv_jax.pools import records41, storage
from v4kv_jax.testing import v41_records as R

from conftest import hypothesis_examples

FORMATS = records41.RECORD_FORMATS
NP_ENCODE = {"nvfp4": R.encode_nvfp4, "mxfp8": R.encode_mxfp8, "mxfp4": R.encode_mxfp4}
NP_DECODE = {"nvfp4": R.decode_nvfp4, "mxfp8": R.decode_mxfp8, "mxfp4": R.decode_mxfp4}
NP_BYTES = {"nvfp4": R.nvfp4_bytes, "mxfp8": R.mxfp8_bytes, "mxfp4": R.mxfp4_bytes}
RELEASE = {"nvfp4": 512, "mxfp8": 512, "mxfp4": 128}
E4M3 = np.arange(0x7F, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
E2M1 = R.E2M1_VALUES


@functools.cache
def _encoder(fmt, width):
    return jax.jit(storage.RowCodec(fmt, width).encode)


@functools.cache
def _decoder(fmt, width):
    return jax.jit(storage.RowCodec(fmt, width).decode)


def _f32(x):
    x = np.asarray(x, np.float32)
    assert np.isfinite(x).all()
    return x


def _numpy_words(fmt, x):
    return R.to_words(NP_ENCODE[fmt](np.asarray(x, np.float32).astype(np.float64)))


def _numpy_values(fmt, words, width):
    """The numpy decoder's values of uint32 records, rounded to float32."""
    record = R.from_words(np.asarray(words), NP_BYTES[fmt](width))
    with np.errstate(over="ignore"):
        return NP_DECODE[fmt](record).astype(np.float32)


def _same_bits(got, want):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    nan = np.isnan(want)
    return (got.shape == want.shape and np.array_equal(np.isnan(got), nan)
            and np.array_equal(got.view(np.uint32)[~nan], want.view(np.uint32)[~nan]))


def assert_encodes_like_numpy(fmt, x):
    """The library's words of f32 rows x [n, width] equal the numpy codec's, and decode to its
    values."""
    x = _f32(x)
    width = x.shape[-1]
    got = np.asarray(_encoder(fmt, width)(x))
    want = _numpy_words(fmt, x)
    assert got.dtype == np.uint32 and got.shape == want.shape
    bad = np.flatnonzero((got != want).any(axis=-1))
    assert not bad.size, (fmt, width, bad[:5], x[bad[0]], got[bad[0]], want[bad[0]])
    assert _same_bits(_decoder(fmt, width)(got), _numpy_values(fmt, want, width))


def _rows(values, anchor, block, width):
    """f32 rows of `width`: each block holds `anchor` (its amax) then block - 1 of `values`
    (zero-filled), so every value is quantised against the scale the anchor sets."""
    values = np.asarray(values, np.float64)
    per = block - 1
    blocks = -(-values.size // per)
    blocks += -blocks % (width // block)
    out = np.zeros((blocks, block))
    out[:, 0] = anchor
    out[:, 1:].flat[:values.size] = values
    return _f32(out.reshape(-1, width))


def _padded(values, n):
    """values followed by zeros up to n."""
    return np.r_[values, np.zeros(n - len(values))]


def _within(values, amax):
    """The values of magnitude <= amax (so that they leave the block's scale alone)."""
    return values[np.abs(values) <= amax]


def _around(points):
    """points, and the next fp32 numbers below and above them, both signs."""
    p = np.asarray(points, np.float32)
    near = np.concatenate([p, np.nextafter(p, np.float32(0)), np.nextafter(p, np.float32(np.inf))])
    return np.concatenate([near, -near]).astype(np.float64)


# The scale 1 in every format: nvfp4 amax 6 (6 / 6 = 1 = e4m3 0x38), mxfp4 amax 6 (fp32(6) *
# fp32(1 / 6) rounds to 1, e = 0), mxfp8 amax 448 (fp32(448) * fp32(1 / 448) rounds to 1).
E2M1_MIDS = (E2M1[1:] + E2M1[:-1]) / 2
E4M3_MIDS = (E4M3[1:] + E4M3[:-1]) / 2


def _hand_cases():
    tiny = 2.0 ** -126
    return {
        # every e2m1 midpoint (ties to the even code) and its fp32 neighbours, and the values
        "nvfp4 e2m1 ties": ("nvfp4", _rows(_around(np.r_[E2M1_MIDS, E2M1]), 6.0, 16, 64)),
        "mxfp4 e2m1 ties": ("mxfp4", _rows(_within(_around(np.r_[E2M1_MIDS, E2M1]), 6.0), 6.0,
                                           32, 64)),
        # the same at a subnormal nvfp4 scale (amax 5 * 2^-9: s = e4m3(5/6 * 2^-9) = 2^-9)
        "nvfp4 ties at scale 2^-9": (
            "nvfp4", _rows(_around(np.r_[E2M1_MIDS, E2M1]) * 2.0 ** -9, 5 * 2.0 ** -9, 16, 64)),
        # every e4m3 midpoint (ties to even, subnormals included) and value, at scale 1
        "mxfp8 e4m3 ties": ("mxfp8", _rows(_within(_around(np.r_[E4M3_MIDS, E4M3]), 448.0),
                                           448.0, 32, 64)),
        # nvfp4 scales: amax / 6 at every e4m3 midpoint and value (subnormal scales included:
        # amax 6 * 1.5 * 2^-9 ties to 2 * 2^-9) and their fp32 neighbours, up to saturation
        "nvfp4 scale ties": ("nvfp4", _scale_rows()),
        # saturation: nvfp4 amax above 6 * 448 (scale 448, codes saturate at 6), e4m3 scale
        # saturation far above, and the largest fp32 values in every format
        "saturation": ("nvfp4", _f32([[3000.0, -2688.0, 2700.0, 1e6] + [0.0] * 12
                                      + [3e38, -1e38, 448.0 * 6, 1.0] + [0.0] * 12])),
        "fp32 max mxfp8": ("mxfp8", _f32([[3.4e38, -3.3e38, 3.2e38, 2.9e38] + [1.0] * 28,
                                          [-3.4028235e38, 1e30] + [0.0] * 30])),
        "fp32 max mxfp4": ("mxfp4", _f32([[3.4028235e38, -1e38, 5e37] + [1.0] * 29])),
        # all-zero blocks (the amax floors), negative zeros, values rounding to a signed zero
        "zeros nvfp4": ("nvfp4", _f32([[0.0] * 16 + [-0.0] * 16, [-1e-30, 1e-30, -0.0]
                                       + [0.0] * 13 + [1.0, -0.01] + [-0.0] * 14])),
        "zeros mxfp8": ("mxfp8", _f32([[0.0] * 32 + [-0.0] * 32, [-1e-30, 1e-30, -0.0]
                                       + [0.0] * 29 + [1.0, -1e-6] + [-0.0] * 30])),
        "zeros mxfp4": ("mxfp4", _f32([[0.0] * 32 + [-0.0] * 32, [-1e-30, 1e-30, -0.0]
                                       + [0.0] * 29 + [1.0, -0.01] + [-0.0] * 30])),
        # fp32 subnormal inputs and the smallest scales: mxfp4 e = -126 / -125 blocks read their
        # subnormal values (codes 1 .. 7), which a flushing product would lose
        "subnormal inputs mxfp4": ("mxfp4", _f32([
            _padded([6 * tiny, *_around(E2M1_MIDS[:5] * tiny)], 32),
            _padded([12 * tiny, *_around(E2M1_MIDS[:5] * tiny * 2)], 32),
            _padded([tiny / 2, -tiny / 4, 3 * tiny / 4, -5 * tiny / 8, 1e-45, -1e-44], 32)])),
        "subnormal inputs nvfp4": ("nvfp4", _f32([[1e-40, -1e-45, 2.0 ** -130] + [0.0] * 13])),
        "subnormal inputs mxfp8": ("mxfp8", _f32([[1e-40, -1e-45, 2.0 ** -130] + [0.0] * 29])),
    }


def _scale_rows():
    """nvfp4 rows whose block amaxes / 6 lie at every e4m3 midpoint and value and their fp32
    neighbours (the other 15 values of a block: a spread of fractions of the amax)."""
    amax = np.abs(_around(np.r_[E4M3_MIDS, E4M3[1:]] * 6))
    amax = np.unique(amax[amax >= 6 * 2.0 ** -9])
    fractions = np.linspace(-1, 1, 15)
    blocks = np.concatenate([amax[:, None], amax[:, None] * fractions], axis=1)
    blocks = np.concatenate([blocks, np.zeros((-len(blocks) % 4, 16))])
    return _f32(blocks.reshape(-1, 64))


HAND = _hand_cases()


# Cases that must reach every code (their rows are built to): which field, and the codes.
COVERS = {"nvfp4 e2m1 ties": ("codes", range(16)), "mxfp4 e2m1 ties": ("codes", range(16)),
          "nvfp4 ties at scale 2^-9": ("codes", range(16)),
          "mxfp8 e4m3 ties": ("codes", [*range(0x7F), *range(0x80, 0xFF)]),
          "nvfp4 scale ties": ("scales", range(1, 0x7F))}


def _fields(fmt, words, width):
    """(codes, scale bytes) of numpy records, as flat arrays."""
    record = R.from_words(words, NP_BYTES[fmt](width))
    n = width if fmt == "mxfp8" else width // 2
    codes = record[..., :n] if fmt == "mxfp8" else np.stack(
        [record[..., :n] & 0xF, record[..., :n] >> 4], -1)
    return codes.ravel(), record[..., n:].ravel()


@pytest.mark.parametrize("case", list(HAND))
def test_hand_picked_rows_encode_to_the_numpy_words(case):
    fmt, x = HAND[case]
    assert_encodes_like_numpy(fmt, x)
    if case in COVERS:
        field, codes = COVERS[case]
        codes_seen, scales_seen = _fields(fmt, _numpy_words(fmt, x), x.shape[-1])
        seen = codes_seen if field == "codes" else scales_seen
        assert set(codes) <= set(seen.tolist()), sorted(set(codes) - set(seen.tolist()))


# --- random rows -------------------------------------------------------------------------------

WIDTHS = [("nvfp4", 16), ("nvfp4", 64), ("nvfp4", 512), ("mxfp8", 32), ("mxfp8", 64),
          ("mxfp8", 512), ("mxfp4", 32), ("mxfp4", 64), ("mxfp4", 128)]


@st.composite
def rows(draw, width):
    """8 f32 rows of `width`: normal values at a drawn magnitude (10^-44 .. 10^36) with a
    spread between groups of 16, some of them zeros or negative zeros, and optionally snapped
    to quarter steps of a power of two near the group's magnitude (so that ties occur)."""
    seed = draw(st.integers(0, 2**32 - 1))
    center = draw(st.floats(-44.0, 36.0))
    spread = draw(st.floats(0.0, 6.0))
    zeros = draw(st.sampled_from([0.0, 0.1, 0.9]))
    snap = draw(st.booleans())
    rng = np.random.default_rng(seed)
    block = 16
    lead = 10.0 ** (center + spread * rng.uniform(-1, 1, (8, width // block, 1)))
    x = rng.standard_normal((8, width // block, block)) * lead
    if snap:
        step = 2.0 ** np.floor(np.log2(lead)) / 4
        x = np.round(x / step) * step
    x[rng.random(x.shape) < zeros] = 0.0
    x[rng.random(x.shape) < 0.05] = -0.0
    return _f32(np.clip(x, -3.4e38, 3.4e38).reshape(8, width))


@pytest.mark.parametrize("fmt, width", WIDTHS)
@hypothesis.settings(max_examples=hypothesis_examples(12), deadline=None)
@hypothesis.given(data=st.data())
def test_random_rows_encode_to_the_numpy_words(fmt, width, data):
    assert_encodes_like_numpy(fmt, data.draw(rows(width)))


# --- decoding ----------------------------------------------------------------------------------

def _words(byte_rows):
    """uint8 [..., n] -> uint32 words, byte j of word w at bits [8 j, 8 j + 8), zero-padded."""
    return R.to_words(np.asarray(byte_rows, np.uint8))


def _every_code_at_every_scale(fmt):
    """(width, records) holding every code under every scale byte (mxfp8 / mxfp4: 0 .. 254;
    nvfp4: the 256 e4m3 scale codes), one block per scale byte."""
    scales = np.arange(256 if fmt == "nvfp4" else 255, dtype=np.uint8)
    if fmt == "mxfp8":  # 255 rows of 8 blocks of 32: codes 32 b .. 32 b + 31, scale s
        codes = np.tile(np.arange(256, dtype=np.uint8), (255, 1))
        return 256, np.concatenate([codes, np.repeat(scales[:, None], 8, axis=1)], axis=1)
    block = records41.BLOCKS[fmt]  # e2m1: one row, a block per scale, all 16 nibbles in each
    nib = np.tile(np.arange(16, dtype=np.uint8), block // 16 * len(scales))
    return block * len(scales), np.concatenate([nib[0::2] | nib[1::2] << 4, scales])[None]


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_code_at_every_scale_decodes_to_the_numpy_values(fmt):
    width, records = _every_code_at_every_scale(fmt)
    words = _words(records)
    got = np.asarray(_decoder(fmt, width)(words))
    want = _numpy_values(fmt, words, width)
    assert _same_bits(got, want)
    # the subnormal fp32 results are there, not flushed (mxfp8 / mxfp4 at scale bytes < 9)
    tiny = (want != 0) & (np.abs(want) < 2.0 ** -126)
    assert (tiny.any() or fmt == "nvfp4") and np.array_equal(got[tiny], want[tiny])


@pytest.mark.parametrize("fmt, width", [("nvfp4", 64), ("mxfp8", 64), ("mxfp4", 32),
                                        ("mxfp8", 512)])
def test_random_words_decode_to_the_numpy_values_and_scale_byte_ff_to_nan(fmt, width):
    nbytes = NP_BYTES[fmt](width)
    records = np.random.default_rng(width).integers(0, 256, (64, nbytes), dtype=np.uint8)
    records[:4, -1] = 0xFF  # a NaN scale (of the last block) in the first rows
    words = _words(records)
    got = np.asarray(_decoder(fmt, width)(words))
    want = _numpy_values(fmt, words, width)
    if fmt != "nvfp4":  # UE8M0 0xFF is NaN here (the numpy decoder reads it as 2^128)
        ff = np.repeat(records[:, -width // 32:] == 0xFF, 32, axis=1)
        want = np.where(ff, np.float32(np.nan), want)
    assert _same_bits(got, want)


# --- sizes -------------------------------------------------------------------------------------

def test_the_release_widths_store_72_132_17_words():
    sizes = {fmt: (storage.stored_width(RELEASE[fmt], fmt), storage.row_bytes(RELEASE[fmt], fmt),
                   records41.record_bytes(RELEASE[fmt], fmt)) for fmt in FORMATS}
    assert sizes == {"nvfp4": (72, 288, 288), "mxfp8": (132, 528, 528), "mxfp4": (17, 68, 68)}
    # tiny widths: zero bytes up to a whole word, as the numpy word view
    tiny = {(fmt, w): (storage.stored_width(w, fmt), records41.record_bytes(w, fmt))
            for fmt, w in [("nvfp4", 16), ("nvfp4", 64), ("mxfp8", 64), ("mxfp4", 32)]}
    assert tiny == {("nvfp4", 16): (3, 9), ("nvfp4", 64): (9, 36), ("mxfp8", 64): (17, 66),
                    ("mxfp4", 32): (5, 17)}
    for fmt in FORMATS:
        codec = storage.RowCodec(fmt, RELEASE[fmt])
        assert codec.packed and codec.dtype == jnp.uint32 and codec.row_bytes == sizes[fmt][1]
        assert fmt in storage.PACKED_FORMATS and storage.dtype(fmt) == jnp.uint32
        x = np.random.default_rng(0).standard_normal((2, RELEASE[fmt]))
        assert np.asarray(_encoder(fmt, RELEASE[fmt])(x)).shape == (2, sizes[fmt][0])


@pytest.mark.parametrize("fmt, width", [("nvfp4", 24), ("nvfp4", 0), ("mxfp8", 48),
                                        ("mxfp4", 16), ("mxfp4", 80)])
def test_a_width_off_the_block_is_refused(fmt, width):
    with pytest.raises(ValueError, match=f"{fmt}: needs a width that is a positive multiple"):
        storage.RowCodec(fmt, width)


def test_a_record_of_the_wrong_size_is_refused():
    with pytest.raises(ValueError, match=r"mxfp4: records of 128 values are uint32\[..., 17\]"):
        records41.decode_mxfp4(jnp.zeros((2, 16), jnp.uint32), 128)


def test_mxfp8_values_from_248_times_2_120_decode_to_inf():
    """The documented limit: at scale 2^120 such values are stored as 256 * 2^120 = 2^128."""
    x = np.zeros((1, 32), np.float32)
    x[0, :3] = [3.4e38, -248 * 2.0 ** 120, 247 * 2.0 ** 120]
    words = _encoder("mxfp8", 32)(x)
    assert R.from_words(np.asarray(words), 33)[0, 32] == 127 + 120
    values = np.asarray(_decoder("mxfp8", 32)(words))[0, :3]
    assert values[0] == np.inf and values[1] == -np.inf and values[2] == 240 * 2.0 ** 120


# --- NaN and inf -------------------------------------------------------------------------------

def test_mxfp8_stores_nan_as_the_nan_code_and_saturates_inf_outside_the_amax():
    x = np.linspace(-3, 3, 64).astype(np.float32)[None]
    y = x.copy()
    y[0, [1, 5, 40]] = [np.nan, -np.nan, np.inf]
    y[0, 41] = -np.inf
    clean = np.where(np.isfinite(y), y, 0).astype(np.float32)
    got = R.from_words(np.asarray(_encoder("mxfp8", 64)(y)), 66)[0]
    want = R.encode_mxfp8(clean.astype(np.float64))[0]
    assert list(got[[1, 5, 40, 41]]) == [0x7F, 0x7F, 0x7E, 0xFE]
    keep = np.ones(66, bool)
    keep[[1, 5, 40, 41]] = False
    np.testing.assert_array_equal(got[keep], want[keep])  # the scales too: amax of the rest
    values = np.asarray(_decoder("mxfp8", 64)(_words(got[None])))[0]
    assert np.isnan(values[[1, 5]]).all() and not np.isnan(np.delete(values, [1, 5])).any()
    scale = 2.0 ** (int(got[65]) - 127)
    assert values[40] == 448 * scale and values[41] == -448 * scale


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("bad", [np.nan, -np.nan, np.inf, -np.inf])
def test_an_e2m1_block_with_a_nonfinite_value_decodes_to_nan(fmt, bad):
    block, width = records41.BLOCKS[fmt], 64
    x = np.linspace(-3, 3, width).astype(np.float32)[None]
    y = x.copy()
    y[0, block + 3] = bad  # the second block
    words = np.asarray(_encoder(fmt, width)(y))
    got = R.from_words(words, NP_BYTES[fmt](width))[0]
    want = R.encode_mxfp4(x)[0] if fmt == "mxfp4" else R.encode_nvfp4(x)[0]
    n = width // 2
    second = np.zeros(n + width // block, bool)
    second[block // 2:block] = True
    second[n + 1] = True
    np.testing.assert_array_equal(got[~second], want[~second])
    assert not got[block // 2:block].any()
    assert got[n + 1] == (0x7F if fmt == "nvfp4" else 0xFF)
    values = np.asarray(_decoder(fmt, width)(words))[0]
    assert np.isnan(values[block:2 * block]).all()
    assert not np.isnan(np.delete(values, np.s_[block:2 * block])).any()


@pytest.mark.parametrize("fmt, width", [("nvfp4", 16), ("nvfp4", 512), ("mxfp8", 64),
                                        ("mxfp8", 512), ("mxfp4", 32), ("mxfp4", 128)])
def test_the_nan_poison_row_decodes_to_nan_and_a_filled_value_is_its_record(fmt, width):
    codec = storage.RowCodec(fmt, width)
    poison = np.asarray(codec.filled(float("nan")))
    assert poison.shape == (codec.stored_width,) and (poison == 0xFFFFFFFF).all()
    assert np.isnan(np.asarray(_decoder(fmt, width)(poison[None]))).all()
    filled = jax.jit(codec.filled, static_argnums=0)
    np.testing.assert_array_equal(np.asarray(filled(1.5)),
                                  _numpy_words(fmt, np.full((1, width), 1.5))[0])
    # a row encoded from NaN decodes to NaN everywhere too (never a finite value)
    nan_row = np.full((1, width), np.nan, np.float32)
    assert np.isnan(np.asarray(_decoder(fmt, width)(_encoder(fmt, width)(nan_row)))).all()


# --- arithmetic pieces and compilation ------------------------------------------------------------

def test_the_nvfp4_scale_divides_by_6_correctly_rounded():
    """amax / 6 is computed with integers (XLA rewrites a division by a constant into a
    product with its rounded reciprocal): equal to the IEEE fp32 quotient, numpy's, at every
    significand near the 3 * 2^22 switch, at both ends and at random, for amax >= 6 * 2^-9."""
    rng = np.random.default_rng(0)
    base = np.uint32(127 << 23)
    mant = np.r_[np.arange(-4096, 4096) + (3 << 22) - (1 << 23), np.arange(4096),
                 (1 << 23) - 1 - np.arange(4096)].astype(np.uint32)
    bits = np.r_[base | mant, rng.integers(0x3C400000, 0x7F800000, 200_000, dtype=np.uint32)]
    amax = bits.view(np.float32)
    div = jax.jit(lambda a: records41._div6(jax.lax.bitcast_convert_type(a, jnp.uint32)))
    got = np.asarray(div(amax))
    np.testing.assert_array_equal(got.view(np.uint32), (amax / np.float32(6)).view(np.uint32))


@pytest.mark.parametrize("fmt", FORMATS)
def test_one_compilation_for_any_values_and_a_trace_that_does_not_grow_with_width(fmt):
    traces = []

    def round_trip(x):
        traces.append(x.shape)
        return records41.decode(records41.encode(x, fmt), x.shape[-1], fmt)

    program = jax.jit(round_trip)
    rng = np.random.default_rng(1)
    for scale in (1.0, 1e-30, 1e30):
        x = _f32(rng.standard_normal((3, 64)) * scale)
        out = program(x)
        assert out.shape == (3, 64) and out.dtype == jnp.float32
    poisoned = np.full((3, 64), np.nan, np.float32)
    assert np.isnan(np.asarray(program(poisoned))).all()
    assert traces == [(3, 64)]
    sizes = {w: len(jax.make_jaxpr(round_trip)(np.zeros((2, w), np.float32)).eqns)
             for w in (512, 2048)}
    assert sizes[512] == sizes[2048], sizes
