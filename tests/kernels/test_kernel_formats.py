"""The in-kernel codecs (`pallas_kernels.formats`) bit for bit against `v4kv_jax.pools.storage`:
decoders of both plane layouts (TPU: whole stored rows; GPU: gathered power-of-two planes),
the plane permutation and its inverse, and the scalar encoders the compressor kernels use."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import formats
from v4kv_jax.pools import storage

# (format, width, rope_dim): V4 widths and the test widths of kernel_cases.PACKED_WIDTHS.
ROWS = [("fp8_latent", 512, 64), ("fp8_latent", 256, 64), ("fp8_latent", 128, 0),
        ("fp4_index", 128, 0), ("fp4_index", 64, 0), ("fp4_index", 32, 0)]


def _values(n: int, width: int, seed: int = 0) -> jax.Array:
    """Rows over many binades, with zeros, signed zero, NaN, inf and tiny blocks."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, width)).astype(np.float32)
    x *= np.exp2(rng.integers(-30, 30, (n, 1))).astype(np.float32)
    x[0, :5] = [0.0, -0.0, np.nan, np.inf, -np.inf]
    x[1] = 0.0
    x[2] *= np.float32(1e-30)
    return jnp.asarray(x)


def _assert_same_bits(got, want):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    same = (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))
    assert same.all(), np.argwhere(~same)[:5]


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _packed(fmt, width, rope_dim, x):
    if fmt == "fp8_latent":
        packed = storage.encode_fp8_latent(x, rope_dim)
        return packed, storage.decode_fp8_latent(packed, width, rope_dim)
    packed = storage.encode_fp4_key(x)
    return packed, storage.decode_fp4_key(packed, width)


@pytest.mark.parametrize("fmt,width,rope_dim", ROWS)
@pytest.mark.parametrize("backend", ["tpu", "gpu"])
def test_decoded_planes_are_the_storage_decode(fmt, width, rope_dim, backend):
    lay = formats.layout(fmt, width, rope_dim, backend)
    packed, want = _packed(fmt, width, rope_dim, _values(48, width))
    assert lay.stored_width == packed.shape[-1] == storage.stored_width(width, fmt, rope_dim)

    @jax.jit  # one program: eager op-by-op dispatch of the decoders is slow on CPU
    def decode(packed):
        if backend == "tpu":
            return formats.decode_tpu(lay, packed)
        return formats.decode_gpu(lay, lambda cols, lo, hi: jnp.take(packed, cols[0], axis=1))

    planes = decode(packed)
    assert len(planes) == lay.n_planes
    if backend == "gpu":
        assert all(p.shape[-1] & (p.shape[-1] - 1) == 0 for p in planes)  # Triton shapes
    _assert_same_bits(formats.from_planes(lay, jnp.stack(planes, axis=-2)), want)


@pytest.mark.parametrize("fmt,width,rope_dim", ROWS)
@pytest.mark.parametrize("backend", ["tpu", "gpu"])
def test_planes_hold_every_dim_once(fmt, width, rope_dim, backend):
    lay = formats.layout(fmt, width, rope_dim, backend)
    dims = lay.lane_dims()
    np.testing.assert_array_equal(np.sort(dims[dims >= 0]), np.arange(width))
    x = _values(4, width, seed=1)
    _assert_same_bits(formats.from_planes(lay, formats.to_planes(lay, x)), x)
    planes = formats.to_planes(lay, jnp.where(jnp.isfinite(x), x, 0.0))
    assert float(jnp.sum(jnp.where(jnp.asarray(dims) < 0, jnp.abs(planes), 0.0))) == 0.0


def test_v4_planes_waste_no_gpu_lane():
    """fp8_latent 512 / 64 on GPU: 4 planes of 128 lanes = 112 code words + 16 RoPE dims."""
    lay = formats.layout("fp8_latent", 512, 64, "gpu")
    assert (lay.n_planes, lay.plane_width) == (4, 128)
    assert (lay.lane_dims() >= 0).all()
    assert formats.layout("fp4_index", 128, 0, "gpu").plane_width == 16
    assert formats.layout("fp8_latent", 512, 64, "tpu").plane_width == 146  # a whole row
    # As the cache lays C4 entries out (128 + 16 + 2 words): a plane per part, side by side.
    lanes = storage.RowCodec("fp8_latent", 512, 64).lanes(32)
    assert formats.layout("fp8_latent", 512, 64, "tpu", lanes.spec).plane_width == 3 * 128


def test_layout_errors_name_the_problem():
    with pytest.raises(ValueError, match="width - rope_dim a positive multiple of 64"):
        formats.layout("fp8_latent", 32, 8, "tpu")
    with pytest.raises(ValueError, match="power-of-two width >= 32"):
        formats.layout("fp4_index", 16, 0, "gpu")
    lay = formats.layout("fp8_latent", 512, 64, "tpu")
    with pytest.raises(ValueError, match=r"c4: plane 0 of fp8_latent rows \(width 512, "
                                         r"rope_dim 64\) is \[\.\.\., 1, 146\]; got shape "
                                         r"\(2, 512\)"):
        formats.check_stored(lay, jnp.zeros((2, 512), jnp.uint32), "c4")
    with pytest.raises(ValueError, match="uint32 words; got float32"):
        formats.check_stored(lay, jnp.zeros((2, 146), jnp.float32), "c4")
    laid = formats.layout("fp8_latent", 512, 64, "tpu",
                          storage.RowCodec("fp8_latent", 512, 64).lanes(32).spec)
    with pytest.raises(ValueError, match=r"c4: rows of fp8_latent \(width 512\) in 3 "
                                         r"plane\(s\); got 1"):
        formats.check_stored(laid, (jnp.zeros((2, 32, 128), jnp.uint32),), "c4")
    with pytest.raises(ValueError, match=r"parts: expected consecutive runs of the 146 words"):
        formats.layout("fp8_latent", 512, 64, "tpu", (32, ((0, 128, 128, 32),)))


def _e4m3_edges() -> np.ndarray:
    """Every finite e4m3 value, the midpoints between neighbours (ties) and their float
    neighbours, values past 448, non-finite values, random values; both signs."""
    table = np.arange(256, dtype=np.uint8).view(jnp.float8_e4m3fn).astype(np.float32)
    mags = np.unique(np.abs(table[np.isfinite(table)]))
    mids = (mags[1:] + mags[:-1]) / 2
    x = np.concatenate([mags, mids, np.nextafter(mids, 0), np.nextafter(mids, np.inf),
                        [448, 449, 464, 479, 480, 1e9, np.inf, np.nan, 1e-30]]).astype(np.float32)
    x = np.concatenate([x, np.random.default_rng(0).standard_normal(20000).astype(np.float32)
                        * np.float32(100)])
    return np.concatenate([x, -x])


def test_e4m3_codes_are_xla_conversions():
    x = jnp.asarray(_e4m3_edges())
    want = jax.lax.bitcast_convert_type(jnp.clip(x, -448, 448).astype(jnp.float8_e4m3fn),
                                        jnp.uint8)
    want = np.where(np.isnan(np.asarray(x)), 0x7F, np.asarray(want).astype(np.int32))
    np.testing.assert_array_equal(np.asarray(formats.e4m3_code(x)), want)


def test_e2m1_codes_round_like_storage():
    x = np.concatenate([_e4m3_edges(), np.arange(-700, 701) / 100, np.arange(-24, 25) / 4])
    x = jnp.asarray(np.clip(x[np.isfinite(x)], -6, 6).astype(np.float32))
    np.testing.assert_array_equal(np.asarray(formats.e2m1_code(x)),
                                  np.asarray(storage._e2m1_codes(x)))


def test_bf16_bits_and_scale_bytes_match_storage():
    bits = np.random.default_rng(1).integers(0, 2**32, 100000, dtype=np.uint64).astype(np.uint32)
    x = jnp.asarray(np.concatenate([bits.view(np.float32),
                                    np.float32([0, -0.0, np.inf, -np.inf, np.nan, 1e-4])]))
    want = np.asarray(jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16))
    want = np.where(np.isnan(np.asarray(x)), 0x7FC0, want.astype(np.int32))
    np.testing.assert_array_equal(np.asarray(formats.bf16_bits(x)), want)
    amax = jnp.abs(x[jnp.isfinite(x)])
    for fmax, floor in ((448.0, formats.FP8_AMAX_FLOOR), (6.0, formats.FP4_AMAX_FLOOR)):
        want = storage._scale_bytes(amax[:, None], 1, fmax, floor)[:, 0]
        np.testing.assert_array_equal(np.asarray(formats.scale_byte(amax, fmax, floor)),
                                      np.asarray(want))
    assert formats.FP8_AMAX_FLOOR == storage.AMAX_FLOOR
    assert formats.FP4_AMAX_FLOOR == storage.FP4_AMAX_FLOOR


@pytest.mark.parametrize("fmt,width,rope_dim", ROWS)
def test_tpu_encoder_is_the_storage_encode(fmt, width, rope_dim):
    """The compressor's encoder (rotation included for fp4_index) on the same fp32 rows."""
    lay = formats.layout(fmt, width, rope_dim, "tpu")
    x = _values(40, width, seed=3)
    got = jax.jit(lambda x: formats.encode_tpu(lay, x))(x)
    want = (storage.encode_fp8_latent(x, rope_dim) if fmt == "fp8_latent"
            else storage.encode_fp4_key(x))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def _gpu_planes(lay, rows):
    rows = np.asarray(rows)
    return [jnp.asarray(rows[:, first + stride * np.arange(lanes)])
            for first, stride, lanes in formats.gpu_encoder_planes(lay)]


def _from_segments(segments, shape) -> np.ndarray:
    """uint32 rows [G, S] of `encode_gpu` segments; every word written exactly once."""
    got = np.zeros(shape, np.uint32)
    written = np.zeros(shape[-1], np.int32)
    for first, stride, words, n in segments:
        cols = first + stride * np.arange(n)
        got[:, cols] = np.asarray(words).view(np.uint32)[:, :n]
        written[cols] += 1
    np.testing.assert_array_equal(written, 1)
    return got


# V4 widths, a row without RoPE dims, the test width of indexer keys (kernel_cases).
GPU_ENCODER_ROWS = [("fp8_latent", 512, 64), ("fp8_latent", 128, 0), ("fp4_index", 128, 0),
                    ("fp4_index", 64, 0)]
FLOAT_FORMATS = ["float32", "bfloat16", "float16"]


@pytest.mark.parametrize("fmt,width,rope_dim", GPU_ENCODER_ROWS)
def test_gpu_encoder_is_the_storage_encode(fmt, width, rope_dim):
    """The GPU compressor's plane encoder on the same fp32 rows (fp4_index: already rotated),
    and its Hadamard planes summed over runs of dims against `storage.hadamard`."""
    lay = formats.layout(fmt, width, rope_dim, "gpu")
    x = _values(40, width, seed=3)
    if fmt == "fp8_latent":
        rows, want = x, storage.encode_fp8_latent(x, rope_dim)
    else:
        rows, want = storage.hadamard(x), storage.encode_fp4_key(x)
    segments = jax.jit(lambda planes: formats.encode_gpu(lay, planes))(_gpu_planes(lay, rows))
    np.testing.assert_array_equal(_from_segments(segments, want.shape), np.asarray(want))
    if fmt == "fp4_index":
        finite = jnp.asarray(np.random.default_rng(4).standard_normal((5, width)), jnp.float32)
        run = width // 4
        parts = [formats.hadamard_planes(lay, finite[:, d:d + run], d)
                 for d in range(0, width, run)]
        planes = [sum(p[j] for p in parts) * np.float32(width ** -0.5) for j in range(8)]
        want_planes = _gpu_planes(lay, storage.hadamard(finite))
        np.testing.assert_allclose(np.asarray(planes), np.asarray(want_planes), rtol=1e-5,
                                   atol=1e-5)


@pytest.mark.parametrize("fmt", FLOAT_FORMATS)
def test_gpu_float_encoder_is_the_storage_encode(fmt):
    """Float rows from their even / odd planes, whole or a run at a time (as the compressor
    writes them), are the storage words bit for bit (16-bit floats: nearest even)."""
    width = 64
    lay = formats.layout(fmt, width, 0, "gpu")
    x = _values(40, width, seed=5)
    codec = storage.RowCodec(fmt, width)
    want = np.asarray(codec.encode(x)).view(np.uint32)
    got = _from_segments(jax.jit(lambda p: formats.encode_gpu(lay, p))(_gpu_planes(lay, x)),
                         want.shape)
    _assert_same_words(got, want, fmt)
    rows, run, segments = np.asarray(x), 16, []
    for c0 in range(0, width, run):
        groups = ((c0, 2, run // 2), (c0 + 1, 2, run // 2))
        planes = [jnp.asarray(rows[:, f + s * np.arange(n)]) for f, s, n in groups]
        segments += formats.encode_gpu(lay, planes, groups)
    _assert_same_words(_from_segments(segments, want.shape), want, fmt)
    with pytest.raises(ValueError, match="pair even dims with the odd dims after them"):
        formats.encode_gpu(formats.layout("bfloat16", 8, 0, "gpu"), [x[:, :2]] * 2,
                           ((0, 2, 2), (2, 2, 2)))


def _assert_same_words(got, want, fmt):
    """Words equal, but NaN may be any NaN pattern (XLA's converts keep NaN payloads, the
    kernels write the canonical NaN)."""
    if fmt == "float32":
        _assert_same_bits(got.view(np.float32), want.view(np.float32))
        return
    dtype = jnp.dtype(fmt)
    halves = [np.asarray(jax.lax.bitcast_convert_type(jnp.asarray(w), dtype)).astype(np.float32)
              for w in (got, want)]
    _assert_same_bits(*halves)


# Every format in the lane-dense layouts of the cache's blocks: V4 C4 entries and indexer keys
# (a wide part and narrow parts), a window ring of 128 rows, a page of one C128 entry.
LANE_ROWS = [("fp8_latent", 512, 64, 32), ("fp4_index", 128, 0, 32), ("fp8_latent", 256, 64, 1),
             ("fp4_index", 64, 0, 32), ("bfloat16", 256, 0, 32), ("float16", 128, 0, 128),
             ("float32", 64, 0, 32), ("bfloat16", 32, 0, 16)]


@pytest.mark.parametrize("fmt,width,rope_dim,records", LANE_ROWS)
def test_gpu_decode_reads_lane_dense_blocks(fmt, width, rope_dim, records):
    """`decode_gpu` through `gpu_loader` on the planes of blocks packed by their `LaneMap`
    (records picked in any order, across blocks) gives the storage decode bit for bit, and
    reads no padding lane (padding is NaN words)."""
    from v4kv_jax.pools.lanes import LaneMap

    codec = storage.RowCodec(fmt, width, rope_dim)
    x = _values(3 * records, width, seed=6)
    rows = storage.encode_fp4_key(x, rotated=True) if fmt == "fp4_index" else codec.encode(x)
    want = codec.decode(rows)
    lanes = LaneMap(codec.stored_width, records, codec.dtype)
    pad = np.float32(np.nan) if fmt == "float32" else np.uint32(0xFFFFFFFF)
    blocks = lanes.pack(rows.reshape(3, records, -1), pad=pad)
    lay = formats.layout(fmt, width, rope_dim, "gpu", lanes.spec)
    formats.check_stored(lay, blocks.planes, "blocks")
    order = np.random.default_rng(0).permutation(3 * records).astype(np.int32)

    @jax.jit
    def decode(planes, order):
        load = formats.gpu_loader(lay, planes, (order // records,), order % records)
        return formats.decode_gpu(lay, load)

    planes = decode(blocks.planes, order)
    if fmt in formats.PACKED:
        assert all(p.shape[-1] & (p.shape[-1] - 1) == 0 for p in planes)  # Triton shapes
    _assert_same_bits(formats.from_planes(lay, jnp.stack(planes, axis=-2)),
                      np.asarray(want)[order])


# V4.1's records, read by the TPU kernels: Flash's widths and tiny41's.
RECORDS41 = [("nvfp4", 512), ("nvfp4", 64), ("mxfp8", 512), ("mxfp8", 64)]


@pytest.mark.parametrize("fmt,width", RECORDS41)
def test_v41_records_decode_in_planes_as_storage_decodes_them(fmt, width):
    codec = storage.RowCodec(fmt, width)
    rows = codec.encode(_values(48, width))
    lay = formats.layout(fmt, width, 0, "tpu")
    assert lay.stored_width == rows.shape[-1] == codec.stored_width
    planes = jax.jit(lambda rows: formats.decode_tpu(lay, rows))(rows)
    _assert_same_bits(formats.from_planes(lay, jnp.stack(planes, axis=-2)), codec.decode(rows))
    dims = lay.lane_dims()
    assert sorted(dims[dims >= 0].tolist()) == list(range(width))  # every dim once
    with pytest.raises(ValueError, match=f"{fmt} rows are read by the TPU kernels only"):
        formats.encode_tpu(lay, jnp.zeros((1, width)))
