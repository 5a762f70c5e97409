"""Storage formats in the pools (issue 11): fp8_latent entries and window, fp4_index indexer
keys, the online HCA tail, and what they cost.

* Attention with the release formats equals an independent float64 run (the oracle) of the
  same math with the official fake-quantisation at the same points: the window vectors and
  the entries after pool, norm and RoPE in fp8_latent, the indexer keys and query rotated and
  in fp4_index. The entries the oracle reads are those of the pools; that they are exactly
  the encoded fp32 entries of a float32 run is checked word for word.
* The online HCA tail: any chunking leaves the tails and entries of a token-by-token decode
  bit for bit, and the entries and outputs stay within 1e-6 of the raw ring's.
* Bytes: the memory report and `v4kv memory` in the stored formats (V4-Flash: 3,514.25 B per
  token, 5,057,544 B of State per request), equal to the arrays' own sizes.
* Poisoned packed pools never leak; snapshots carry packed windows and online tails.
* Decoding packed rows equals an independent numpy decoder of the documented byte layout bit
  for bit: every e4m3 code and e2m1 nibble at every scale byte, every bf16 RoPE half, random
  words and the NaN-poison rows.
"""

from __future__ import annotations

import dataclasses

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_isolation import POISONS, _poisoner, assert_runs_identical, core_scenario

import v4kv_jax as v4
from v4kv_jax import cli, pools, step
from v4kv_jax.config import LayerKind
from v4kv_jax.ops import indexer
from v4kv_jax.pools import storage
from v4kv_jax.testing import oracle, synthetic

from conftest import hypothesis_examples, positions

# The tiny preset at widths the packed formats fit (hd - r = 64, c = 32); top-k 4 of up to 8
# C4 entries, so the indexer selects; 16 indexer heads keep ReLU ties away.
TINY = v4.tiny(head_dim=80, rope_dim=16, index_head_dim=32, index_heads=16,
               compress_ratios=(0, 4, 16), index_topk=4)
# One CSA and one HCA layer at V4 widths (hd 512, r 64, c 128), few tokens (m' = 16).
WIDE = v4.tiny(head_dim=512, rope_dim=64, index_head_dim=128, index_heads=16, num_heads=2,
               o_groups=1, compress_ratios=(4, 16), index_topk=4)
SMALL = dict(num_pages=4, max_slots=1, max_pages_per_seq=2)
TOL = 1e-5  # attention outputs against the fake-quantised float64 run (observed 2e-6)


@jax.jit
def _identity(x):
    return x


def _round_trip(codec, x):
    """decode(encode(x)) as one jitted program (eager codecs compile op by op)."""
    return np.asarray(jax.jit(lambda v: codec.decode(codec.encode(v)))(jnp.asarray(x)))


def _stored_entries(cache, name, slot, count):
    """[n_kind, count, sw] stored rows of entries 0..count-1 of `slot`, as stored."""
    spec = {s.name: s for s in cache.specs}[name]
    epp = cache.geometry.entries_per_page(spec.ratio)
    table = np.asarray(cache.pages.page_table[slot])
    idx = np.arange(count)
    return np.asarray(pools.entries(cache, spec).records())[:, table[idx // epp], idx % epp]


def _run(model, geometry, data, plan, chunk=32):
    """append_and_attend of `plan` token counts (T = chunk, or 1 for single tokens) into one
    slot per row; returns the cache and the outputs [n_layers, B, L, H, hd]."""
    cache = v4.init_cache(model, geometry)
    for s in range(data.batch):
        cache = v4.reset_slot(cache, s)
    total = sum(plan)
    out = np.zeros((model.num_layers, data.batch, total, model.num_heads, model.head_dim),
                   np.float32)
    done = 0
    for n in plan:
        pos = positions(np.full(data.batch, done), chunk if n > 1 else 1)
        cache, o = step.append_and_attend(cache, data.take(pos), data.stacked_queries(pos),
                                          data.weights, np.arange(data.batch),
                                          np.full(data.batch, n))
        out[:, :, done:done + n] = np.asarray(o)[:, :, :n]
        done += n
    return cache, out


PLAN = [32, 1, 1]  # a prefill chunk, then two decode steps
_RUNS = {}


def _release_and_fp32_runs(model):
    """(data, release cache, its outputs, a float32 cache of the same run, online tail too),
    once per model."""
    if model not in _RUNS:
        data = synthetic.SyntheticBatch.draw(model, 1, 64, seed=3)
        release = v4.CacheConfig.with_formats("release", **SMALL)
        cache, out = _run(model, release, data, PLAN)
        fp32, _ = _run(model, v4.CacheConfig.with_formats("float32", hca_tail="online",
                                                          **SMALL), data, PLAN)
        _RUNS[model] = data, cache, out, fp32
    return _RUNS[model]


@pytest.mark.parametrize("model", [TINY, WIDE], ids=["tiny", "v4_width"])
def test_release_formats_match_the_fake_quantised_float64_run(model):
    length = sum(PLAN)
    data, cache, out, fp32_cache = _release_and_fp32_runs(model)
    release = cache.geometry
    fp32 = pools.read_slot(fp32_cache, 0)
    window = storage.codec(model, release, "window")
    for layer, kind in enumerate(model.layer_kinds):
        h = dataclasses.replace(data.history(layer, 0),
                                window=_round_trip(window, data.history(layer, 0).window))
        given = {}
        names = {LayerKind.CSA: ("csa", "csa_index"), LayerKind.HCA: ("hca",)}.get(kind, ())
        for name in names:
            k, m = model.kind_index(layer), model.ratio(kind)
            codec = storage.codec(model, release, name)
            words = _stored_entries(cache, name, 0, length // m)[k]
            # Encoded after pool, norm and RoPE: the fp32 run's entries, encoded, word for word.
            want = np.asarray(jax.jit(codec.encode)(jnp.asarray(fp32.entries[name][k])))
            np.testing.assert_array_equal(words, want, err_msg=f"layer {layer} {name}")
            decoded = np.asarray(jax.jit(codec.decode)(jnp.asarray(words)))
            given["index_keys" if name == "csa_index" else "entries"] = decoded
        if kind == LayerKind.CSA:
            # The official reference's indexer query: rotated, fp4 fake-quantised per head.
            h.index_q = np.asarray(jax.jit(indexer.prepare_index_query, static_argnums=0)(
                release, jnp.asarray(h.index_q)))
        want, margin = oracle.attention_outputs(model, kind, h, length, **given)
        assert margin > 1e-4, (layer, margin)  # the picks are not decided by rounding
        err = np.abs(out[layer, 0] - want).max()
        assert err <= TOL, f"layer {layer} {kind.name}: {err:.3g}"


def test_prepare_index_query_is_identity_for_float_keys_and_rotates_for_fp4():
    q = jnp.asarray(np.random.default_rng(0).standard_normal((2, 3, 32)), jnp.float32)
    prepare = jax.jit(indexer.prepare_index_query, static_argnums=0)
    plain = v4.CacheConfig(**SMALL)
    np.testing.assert_array_equal(prepare(plain, q), q)
    fp4 = v4.CacheConfig(index_dtype="fp4_index", **SMALL)
    got = np.asarray(prepare(fp4, q))
    want = jax.jit(lambda x: storage.decode_fp4_key(
        storage.encode_fp4_key(storage.hadamard(x), rotated=True), 32))(q)
    np.testing.assert_array_equal(got, want)
    # the rotation is orthonormal: scores stay those of the unrotated vectors up to fp4
    k = np.random.default_rng(1).standard_normal((32,)).astype(np.float32)
    key = jax.jit(lambda x: storage.decode_fp4_key(storage.encode_fp4_key(x), 32))(k)
    approx = np.asarray(got) @ np.asarray(key)
    np.testing.assert_allclose(approx, np.asarray(q) @ k, atol=0.25 * np.sqrt(32))


def test_read_slot_decodes_packed_rows_to_fp32():
    data, cache, _, f32 = _release_and_fp32_runs(TINY)
    geometry = cache.geometry
    got = pools.read_slot(cache, 0)
    assert got.window.dtype == np.float32 and got.window.shape == (3, 16, 80)
    want = _round_trip(storage.codec(TINY, geometry, "window"), data.window[:, 0, 18:34])
    np.testing.assert_array_equal(got.window, want)
    # fp4 keys come back unrotated: near the fp32 run's keys (fp4 has 1 mantissa bit)
    keys, want_keys = got.entries["csa_index"], pools.read_slot(f32, 0).entries["csa_index"]
    assert keys.dtype == np.float32 and keys.shape == want_keys.shape == (1, 8, 32)
    assert np.abs(keys - want_keys).max() < 0.5 * np.abs(want_keys).max()
    assert set(got.online) == {"hca"} and got.online["hca"]["sum"].shape == (1, 1, 80)
    assert "hca" not in got.tail_kv and got.tail_start["hca"] == 32


# --- the online HCA tail ----------------------------------------------------------------------

HCA_ONLY = v4.tiny(compress_ratios=(16, 16))  # m' = 16: two HCA layers
ONLINE = v4.CacheConfig(num_pages=4, max_slots=1, max_pages_per_seq=2, hca_tail="online")
ONLINE_LENGTH = 60


def _prefill(geometry, data, sizes, chunk):
    cache = v4.reset_slot(v4.init_cache(HCA_ONLY, geometry), 0)
    done = 0
    for n in sizes:
        cache = step.prefill(cache, data.take(positions([done], chunk)), data.weights, [0], [n])
        done += n
    return pools.read_slot(cache, 0)


@pytest.fixture(scope="module")
def online_decode():
    """(data, read_slot after ONLINE_LENGTH single-token decodes) of the HCA-only model."""
    data = synthetic.SyntheticBatch.draw(HCA_ONLY, 1, ONLINE_LENGTH + 32, seed=5)
    return data, _prefill(ONLINE, data, [1] * ONLINE_LENGTH, 1)


@pytest.mark.xla_defaults  # two programs (chunk, decode): their bits as users compile
@hypothesis.settings(max_examples=hypothesis_examples(4), deadline=None)
@hypothesis.given(st.lists(st.integers(1, 32), min_size=1, max_size=12))
def test_online_tail_any_chunking_equals_decode_bit_for_bit(online_decode, sizes):
    data, want = online_decode
    cut, done = [], 0
    for n in sizes + [32] * 2:
        n = min(n, ONLINE_LENGTH - done)
        if n:
            cut.append(n)
            done += n
    got = _prefill(ONLINE, data, cut, 32)
    np.testing.assert_array_equal(got.entries["hca"], want.entries["hca"])
    for field in ("max", "sum", "weighted"):
        np.testing.assert_array_equal(got.online["hca"][field], want.online["hca"][field])
    np.testing.assert_array_equal(got.window, want.window)


def test_online_tail_equals_the_raw_ring_within_1e6():
    data = synthetic.SyntheticBatch.draw(TINY, 1, 96, seed=6)
    plan = [32, 32, 1, 1, 1]  # 67 tokens: 4 C128 blocks, the last one open
    geometry = dict(num_pages=4, max_slots=1, max_pages_per_seq=2)
    online, out_online = _run(TINY, v4.CacheConfig(hca_tail="online", **geometry), data, plan)
    ring, out_ring = _run(TINY, v4.CacheConfig(hca_tail="ring", **geometry), data, plan)
    a, b = pools.read_slot(online, 0), pools.read_slot(ring, 0)
    assert a.entries["hca"].shape == (1, 4, 80)
    np.testing.assert_allclose(a.entries["hca"], b.entries["hca"], rtol=0, atol=1e-6)
    np.testing.assert_allclose(out_online, out_ring, rtol=0, atol=1e-6)
    # the open block (positions 64..66) as an online softmax of the ring's rows
    z, kv = b.tail_gate["hca"][:, -3:], b.tail_kv["hca"][:, -3:]
    top = z.max(axis=1)
    np.testing.assert_allclose(a.online["hca"]["max"][:, 0], top, rtol=0, atol=0)
    np.testing.assert_allclose(a.online["hca"]["sum"][:, 0], np.exp(z - top[:, None]).sum(1),
                               rtol=1e-6)
    np.testing.assert_allclose(a.online["hca"]["weighted"][:, 0],
                               (np.exp(z - top[:, None]) * kv).sum(1), rtol=1e-5, atol=1e-6)


# --- bytes ------------------------------------------------------------------------------------


def test_flash_and_pro_bytes_in_the_release_formats():
    flash = v4.CacheConfig.with_formats("release", **SMALL)
    per_token = pools.classical_bytes_per_token(v4.flash(), flash)
    assert per_token == {"CSA": 21 * (584 + 68) / 4, "HCA": 20 * 584 / 128,
                         "total": 21 * (584 + 68) / 4 + 20 * 584 / 128}
    assert per_token["total"] == 3514.25
    # window 43 x 128 x 584 + CSA tails 21 x 8 rows x (1024 + 256) x 4 B x (kv, gate)
    # + online HCA tails 20 x 3 x 512 x 4 B + length and status
    state = 43 * 128 * 584 + 21 * 8 * (1024 + 256) * 4 * 2 + 20 * 3 * 512 * 4 + 8
    assert pools.state_bytes_per_request(v4.flash(), flash) == state == 5_057_544
    assert state <= 5 * 2**20
    assert pools.classical_bytes_per_token(v4.pro(), flash)["total"] == (
        30 * (584 + 68) / 4 + 31 * 584 / 128)
    assert pools.state_bytes_per_request(v4.pro(), flash) == (
        61 * 128 * 584 + 30 * 8 * (1024 + 256) * 8 + 31 * 3 * 512 * 4 + 8)
    # one page: 32 C4 entries and keys per CSA layer, one C128 entry per HCA layer
    assert pools.page_logical_bytes(v4.flash(), flash) == 21 * 32 * (584 + 68) + 20 * 584
    # as stored: an entry of 146 words in 128 + 16 + 4 lanes, its keys of 17 in 16 + 4, and
    # the HCA page's one entry in two lane rows
    assert pools.page_bytes(v4.flash(), flash) == 21 * 32 * (148 + 20) * 4 + 20 * 256 * 4
    assert pools.state_logical_bytes_per_request(v4.flash(), flash) == state
    ring = dataclasses.replace(flash, hca_tail="ring")
    assert pools.state_bytes_per_request(v4.flash(), ring) == (
        state - 20 * 3 * 512 * 4 + 20 * 128 * 512 * 4 * 2)


def test_v4kv_memory_reports_the_release_formats_for_flash_and_pro(capsys):
    assert cli.main(["memory", "--preset", "flash", "--tokens", "1048576"]) == 0
    out = capsys.readouterr().out
    assert "entries fp8_latent (584 B), indexer keys fp4_index (68 B)" in out
    assert "total 3514.25 B" in out and "State 4.82 MiB (5,057,544 B)" in out
    # As stored (lane-dense pools): 3,688 B a token, x1.049 of the rows' own bytes.
    assert "as stored (lane-dense pools): CSA 3528.00 B, HCA 160.00 B, total 3688.00 B" in out
    assert "(x1.049 of the entries' own bytes)" in out
    assert cli.main(["memory", "--preset", "flash", "--tokens", "1000000"]) == 0
    overhead = float(capsys.readouterr().out.split("pages (x")[1].split(" of the")[0])
    assert 1.049 < overhead < 1.06  # a partly filled last page on top
    assert cli.main(["memory", "--preset", "pro", "--tokens", "1048576"]) == 0
    assert "total 5031.44 B" in capsys.readouterr().out


@pytest.mark.parametrize("formats", ["release", "float32", "bfloat16"])
def test_memory_report_counts_the_stored_bytes(formats):
    geometry = v4.CacheConfig.with_formats(formats, num_pages=3, max_slots=2,
                                           max_pages_per_seq=2)
    cache = synthetic.random_cache(WIDE, geometry, [130, 40])
    report = pools.memory_report(cache)
    classical = sum(pools.entries(cache, s).nbytes for s in cache.specs)
    assert report.page_bytes * geometry.num_pages == classical == report.capacity_bytes
    assert report.state_bytes_total == 2 * report.state_bytes_per_request
    assert report.pages_used == 3 and report.allocated_bytes == 3 * report.page_bytes
    row = {name: storage.codec(WIDE, geometry, name).row_bytes for name in ("csa", "csa_index")}
    assert report.entry_bytes == (row["csa"] + row["csa_index"]) * (130 // 4 + 40 // 4) + (
        row["csa"] * (130 // 16 + 40 // 16))
    # Logical bytes: the rows' own; stored: the planes', padding included.
    assert report.page_logical_bytes == (row["csa"] + row["csa_index"]) * 32 + row["csa"] * 8
    assert report.page_logical_bytes <= report.page_bytes
    stored, logical = report.stored_bytes_per_token, report.classical_bytes_per_token
    assert stored["total"] * 128 == report.page_bytes and logical["total"] * 128 == (
        report.page_logical_bytes)
    if formats == "release":
        assert pools.csa_entries(cache).c4.records().shape == (1, 3, 32, 146)
        assert pools.csa_entries(cache).index_keys.records().shape == (1, 3, 32, 17)
        assert pools.csa_entries(cache).c4.dtype == jnp.uint32
        assert isinstance(pools.hca_tail(cache), pools.OnlineTail)


# --- decoding packed rows, bit for bit -------------------------------------------------------
# An independent numpy decoder, written from the byte layout in storage's docstring (field j of
# a word w at bits [b j, b j + b)) and the formats' definitions, in float64 (every product
# q * 2^k is exact there) rounded once to fp32.

F32_TINY = np.finfo(np.float32).tiny


def _np_fields(words, bits):
    """uint32 words [..., n] -> their `bits`-wide fields [..., n * 32 / bits], low bits first."""
    words = np.asarray(words, np.uint32).astype(np.uint64)
    shifts = bits * np.arange(32 // bits, dtype=np.uint64)
    return ((words[..., None] >> shifts) & ((1 << bits) - 1)).reshape(*words.shape[:-1], -1)


def _np_e4m3(c):
    sign, e, m = c >> 7, (c >> 3) & 15, (c & 7).astype(np.float64)
    mag = np.where(e == 0, m / 8 * 2.0**-6, (1 + m / 8) * 2.0 ** (e.astype(np.float64) - 7))
    mag = np.where((e == 15) & (c & 7 == 7), np.nan, mag)
    return np.where(sign == 1, -mag, mag)


def _np_e2m1(c):
    sign, e, m = c >> 3, (c >> 1) & 3, (c & 1).astype(np.float64)
    mag = np.where(e == 0, m / 2, (1 + m / 2) * 2.0 ** (e.astype(np.float64) - 1))
    return np.where(sign == 1, -mag, mag)


def _np_scaled(q, scale_bytes, block, flush):
    """fp32 q * 2^(byte - 127) per block (byte 0xFF: NaN). flush: the platform flushes fp32
    subnormals (XLA on CPU): scale byte 0 (2^-127) reads as 0 and subnormal products as 0."""
    b = np.repeat(scale_bytes.astype(np.float64), block, axis=-1)
    scale = np.where(b == 255, np.nan, 2.0 ** (b - 127))
    if flush:
        scale = np.where(b == 0, 0.0, scale)
    with np.errstate(over="ignore", invalid="ignore"):
        v = (q * scale).astype(np.float32)
    if flush:
        v = np.where(np.abs(v) < F32_TINY, np.copysign(np.float32(0), v), v)
    return v


def np_decode_fp8(words, hd, r):
    nope, nb = hd - r, (hd - r) // 64
    b = _np_fields(words, 8)
    halves = _np_fields(words[..., nope // 4:nope // 4 + r // 2], 16).astype(np.uint32)
    rope = (halves << 16).view(np.float32)
    return [np.concatenate([_np_scaled(_np_e4m3(b[..., :nope]), b[..., nope + 2 * r:][..., :nb],
                                       64, flush), rope], axis=-1) for flush in (True, False)]


def np_decode_fp4(words, c):
    q = _np_e2m1(_np_fields(words[..., :c // 8], 4))
    scale_bytes = _np_fields(words[..., c // 8:], 8)[..., :c // 32]
    return [_np_scaled(q, scale_bytes, 32, flush) for flush in (True, False)]


def _bits_equal(got, want):
    """Same fp32 bits, NaN at the same places (NaN payloads aside)."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    nan = np.isnan(got)
    return (got.shape == want.shape and np.array_equal(nan, np.isnan(want))
            and np.array_equal(got.view(np.uint32)[~nan], want.view(np.uint32)[~nan]))


def _assert_decodes_like_numpy(codec, words):
    """The jitted codec decode of `words` equals the numpy decoder under one of the two fp32
    subnormal conventions (the whole array under the same one)."""
    words = np.asarray(words, np.uint32)
    got = np.asarray(jax.jit(codec.decode)(jnp.asarray(words)))
    wants = (np_decode_fp8(words, codec.width, codec.rope_dim) if codec.fmt == "fp8_latent"
             else np_decode_fp4(words, codec.width))
    assert any(_bits_equal(got, want) for want in wants), codec
    return got


def _words(byte_rows):
    """uint8 [..., 4 n] -> uint32 [..., n], byte j of word w at bits [8 j, 8 j + 8)."""
    b = np.asarray(byte_rows, np.uint32).reshape(*np.shape(byte_rows)[:-1], -1, 4)
    return b[..., 0] | b[..., 1] << 8 | b[..., 2] << 16 | b[..., 3] << 24


def test_narrowing_bitcasts_split_a_word_low_field_first():
    """The decoders split words with XLA's narrowing bitcast-convert: the documented order."""
    split = jax.jit(lambda w: [jax.lax.bitcast_convert_type(w, t).astype(jnp.uint32)
                               for t in (jnp.uint4, jnp.uint8, jnp.uint16)])
    nibbles, octets, halves = (np.asarray(x)[0] for x in split(jnp.uint32([0x87654321])))
    np.testing.assert_array_equal(nibbles, [1, 2, 3, 4, 5, 6, 7, 8])
    np.testing.assert_array_equal(octets, [0x21, 0x43, 0x65, 0x87])
    np.testing.assert_array_equal(halves, [0x4321, 0x8765])
    bf16 = jax.jit(lambda w: jax.lax.bitcast_convert_type(w, jnp.bfloat16).astype(jnp.float32))
    np.testing.assert_array_equal(bf16(jnp.uint32([0x3F804000]))[0], [2.0, 1.0])


def test_every_e4m3_code_at_every_scale_and_every_bf16_half_decode_exactly():
    # hd 512 with r 256: row s holds the 256 codes (4 blocks, scale byte s in each) and the
    # bf16 patterns 256 s .. 256 s + 255, so the 256 rows cover every code x scale byte pair
    # and every bf16 pattern once.
    codec = storage.RowCodec("fp8_latent", 512, 256)
    every = np.arange(256, dtype=np.uint8)
    halves = np.arange(1 << 16, dtype=np.uint32).reshape(256, 256)
    rows = np.concatenate([np.tile(every, (256, 1)),
                           np.stack([halves & 0xFF, halves >> 8], -1).reshape(256, 512),
                           np.repeat(every[:, None], 4, axis=1)], axis=1)
    got = _assert_decodes_like_numpy(codec, _words(rows))
    nan_codes = np.isnan(got[:, :256])
    assert nan_codes[:, [0x7F, 0xFF]].all() and nan_codes[255].all()
    assert nan_codes.sum() == 2 * 255 + 256


def test_every_e2m1_nibble_at_every_scale_decodes_exactly():
    codec = storage.RowCodec("fp4_index", 32)
    nibbles = np.tile(np.arange(16, dtype=np.uint8), 2)
    codes = nibbles[0::2] | nibbles[1::2] << 4
    rows = np.concatenate([np.tile(codes, (256, 1)), np.arange(256, dtype=np.uint8)[:, None],
                           np.zeros((256, 3), np.uint8)], axis=1)
    got = _assert_decodes_like_numpy(codec, _words(rows))
    assert np.isnan(got[255]).all() and not np.isnan(got[:255]).any()


@pytest.mark.parametrize("fmt, width, rope_dim", [
    ("fp8_latent", 512, 64), ("fp8_latent", 128, 64), ("fp8_latent", 80, 16),
    ("fp8_latent", 64, 0), ("fp8_latent", 194, 2),
    ("fp4_index", 32, 0), ("fp4_index", 64, 0), ("fp4_index", 128, 0)])
def test_random_and_nan_poison_rows_decode_exactly(fmt, width, rope_dim):
    codec = storage.RowCodec(fmt, width, rope_dim)
    rng = np.random.default_rng(width + rope_dim)
    words = rng.integers(0, 1 << 32, (3, 40, codec.stored_width), dtype=np.uint32)
    words[1, :4] = np.asarray(codec.filled(float("nan")))
    got = _assert_decodes_like_numpy(codec, words)
    assert np.isnan(got[1, :4]).all()
    # encoded rows too, across magnitudes
    x = rng.standard_normal((2, 30, width)) * 10.0 ** rng.uniform(-30, 30, (2, 30, 1))
    _assert_decodes_like_numpy(codec, jax.jit(codec.encode)(jnp.asarray(x, jnp.float32)))


# --- configuration errors ---------------------------------------------------------------------


@pytest.mark.parametrize("field, value, message", [
    ("entry_dtype", "fp4_index", "entry_dtype: expected one of ('float32', 'bfloat16', "
     "'float16', 'fp8_latent', 'nvfp4'); got 'fp4_index'"),
    ("index_dtype", "fp8_latent", "index_dtype: expected one of ('float32', 'bfloat16', "
     "'float16', 'fp4_index', 'mxfp4'); got 'fp8_latent'"),
    ("window_dtype", "int8", "window_dtype: expected one of"),
    ("tail_dtype", "fp8_latent", "tail_dtype: expected one of ('float32', 'bfloat16', "
     "'float16'); got 'fp8_latent'"),
    ("hca_tail", "stream", "hca_tail: expected one of ('online', 'ring'); got 'stream'"),
])
def test_cache_config_names_the_bad_format(field, value, message):
    with pytest.raises(ValueError) as err:
        v4.CacheConfig(**SMALL, **{field: value})
    assert message in str(err.value)


def test_formats_the_model_widths_do_not_fit_are_named():
    release = v4.CacheConfig.with_formats("release", **SMALL)
    with pytest.raises(ValueError, match=r"entry_dtype: expected a format that rows of "
                                         r"head_dim=32 and rope_dim=8 fit .*; got "
                                         r"'fp8_latent'"):
        v4.init_cache(v4.tiny(), release)
    with pytest.raises(ValueError, match=r"window_dtype: expected a format that rows of "
                                         r"head_dim=32 and rope_dim=8 fit"):
        v4.init_cache(v4.tiny(), v4.CacheConfig(window_dtype="fp8_latent", **SMALL))
    with pytest.raises(ValueError, match=r"index_dtype: expected a format that rows of "
                                         r"index_head_dim=16 fit .*power-of-two.*; got "
                                         r"'fp4_index'"):
        v4.init_cache(v4.tiny(), v4.CacheConfig(index_dtype="fp4_index", **SMALL))
    with pytest.raises(ValueError, match=r"formats: expected one of \('release', 'float32', "
                                         r"'bfloat16', 'float16'\); got 'fp8'"):
        v4.CacheConfig.with_formats("fp8", **SMALL)


# --- isolation and snapshots ------------------------------------------------------------------

RELEASE = v4.CacheConfig.with_formats("release", num_pages=24, max_slots=3, max_pages_per_seq=6)
ROUNDS = (2, 1, 1)


@pytest.fixture(scope="module")
def clean_release_run():
    return core_scenario(_poisoner(None), rounds=ROUNDS, model=TINY, geometry=RELEASE)


@pytest.mark.parametrize("poison", ["nan", "huge"])
def test_poisoned_packed_pools_never_leak(clean_release_run, poison):
    poisoned = core_scenario(_poisoner(POISONS[poison]), rounds=ROUNDS, model=TINY,
                             geometry=RELEASE)
    assert_runs_identical(clean_release_run, poisoned)


# Power-of-two widths, as the GPU kernels need.
POW2 = v4.tiny(head_dim=128, rope_dim=64, index_head_dim=64, index_heads=16,
               compress_ratios=(0, 4, 16), index_topk=4)


@pytest.mark.parametrize("implementation", ["pallas_tpu", "pallas_gpu"])
def test_kernels_on_packed_pools_and_online_tails_never_read_unowned_rows(implementation):
    """The kernels (interpret mode) decode packed rows, encode emitted entries and fold the
    online HCA tail without reading a row no request owns."""
    options = v4.Options(implementation=implementation, interpret=True, query_tile=16)
    rounds = (1, 1, 1)
    clean = core_scenario(_poisoner(None), options, rounds, model=POW2, geometry=RELEASE)
    poisoned = core_scenario(_poisoner(POISONS["nan"]), options, rounds, model=POW2,
                             geometry=RELEASE)
    assert_runs_identical(clean, poisoned)


def test_poison_fills_unowned_packed_rows_with_nan_words():
    cache = synthetic.random_cache(TINY, RELEASE, [40], fill_unused=float("nan"))
    poisoned = synthetic.poison_unowned(cache)
    c4 = np.asarray(pools.csa_entries(poisoned).c4.records())
    assert (c4[:, 0, 10:] == 0xFFFFFFFF).all() and (c4[:, 1:] == 0xFFFFFFFF).all()
    assert (c4[:, 0, :10] != 0xFFFFFFFF).any()
    decode = jax.jit(storage.codec(TINY, RELEASE, "csa").decode)
    assert np.isnan(np.asarray(decode(c4[:, 1]))).all()
    ring = np.asarray(pools.window_ring(poisoned).records())
    assert (ring[:, 1:] == 0xFFFFFFFF).all() and (ring[:, 0, 24:] != 0xFFFFFFFF).all()
    hca = pools.hca_tail(poisoned)  # 40 % 16 = 8 tokens in the open block: owned
    assert not np.isnan(np.asarray(hca.sum[:, 0].records())).any()
    assert np.isnan(np.asarray(hca.sum[:, 1:].records())).all()
    # Padding lanes and rows (read by no one) are poisoned too: every plane word of a page
    # no request holds is the NaN word.
    for plane in pools.csa_entries(poisoned).c4[:, 1:].planes:
        assert (np.asarray(plane) == 0xFFFFFFFF).all()


def test_snapshot_round_trip_with_packed_window_and_online_tails():
    data = synthetic.SyntheticBatch.draw(TINY, 1, 80, seed=8)
    cache = v4.reset_slot(v4.init_cache(TINY, RELEASE), 0)
    cache = step.prefill(cache, data.take(positions([0], 32)), data.weights, [0], [32])
    cache = step.prefill(cache, data.take(positions([32], 32)), data.weights, [0], [8])
    snap = pools.snapshot_state(cache, 0)
    assert snap.window.dtype == jnp.uint32 and isinstance(snap.tails["hca"], pools.OnlineTail)
    keep = jax.tree.map(np.asarray, snap)
    wiped = pools.with_window_ring(cache, jax.tree.map(lambda x: jnp.full_like(x, 0xFFFFFFFF),
                                                       pools.window_ring(cache)))
    for spec in wiped.specs:
        wiped = pools.with_tail(wiped, spec, jax.tree.map(
            lambda x: jnp.full_like(x, jnp.nan), pools.tail(wiped, spec)))
    restored = pools.restore_state(wiped, 0, snap)
    again = pools.snapshot_state(restored, 0)
    for a, b in zip(jax.tree.leaves(keep), jax.tree.leaves(again), strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))
    pos = positions([40], 1)
    outs = []
    for c in (cache, restored):
        c = jax.tree.map(_identity, c)  # the call donates its cache
        _, o = step.append_and_attend(c, data.take(pos), data.stacked_queries(pos),
                                      data.weights, [0], [1])
        outs.append(np.asarray(o))
    np.testing.assert_array_equal(*outs)
    assert not np.isnan(outs[0]).any()
