"""DeepSeek-V4.1's compressors and index keys (v4kv_jax/ops/compressor41.py, V41_SPEC.md
sections 3 and 4.1) against the float64 oracle, and chunk invariance bit for bit.

* `rope.inv_frequencies_v41` against the oracle's tables (fp32 against f64).
* Entries and keys of ratio 1 and ratio 2 against `v41_oracle` at section 11's T3 lengths.
* Any chunking (token by token, one chunk, random chunks with odd starts, batch rows with other
  n_new, n_new 0, NaN padding) gives every entry, key and open row the same bits.
* Section 10's worked example; one trace per chunk length; named errors.
"""

from __future__ import annotations

import functools

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from v4kv_jax import config41, rope
from v4kv_jax.ops import compressor41 as c41
from v4kv_jax.testing import v41_oracle as O

from conftest import hypothesis_examples

CONFIG = config41.tiny41()  # hd 64, rope 16, index keys 32
STACK = O.tiny6_stack()  # the same widths and RoPE settings in the oracle's terms
HD, C = CONFIG.head_dim, CONFIG.index_head_dim
INV = rope.inv_frequencies_v41(CONFIG, True)
LENGTHS = (1, 2, 3, 7, 8, 9, 40, 67)  # V41_SPEC.md section 11, T3
MAX_LEN = 67

# |library - oracle| bound on entries and keys. Both are normed (|v| <= 4.2 on these inputs)
# and then rotated at p <= 66. The fp32 angle p * f_i is one rounded product of an fp32 table
# value (within an ulp of the f64 f_i), so it is within 2 * 66 * 2^-24 < 8e-6 rad of the f64
# angle (f_0 = 1), which moves a value by at most |v| * 8e-6 < 3.4e-5; the fp32 pooling, norms
# and projection add ~1e-6 (measured in all: 1.3e-6). A wrong position (one step: ~f_i |v|)
# or a wrong pooling weight is far outside.
ATOL = 5e-5


def _inputs(seed: int, length: int = MAX_LEN):
    rng = np.random.default_rng(seed)
    return dict(
        a=rng.normal(size=(length, HD)).astype(np.float32),
        z=(2.0 * rng.normal(size=(length, HD))).astype(np.float32),
        norm_c=rng.uniform(0.7, 1.3, HD).astype(np.float32),
        wk=(rng.normal(size=(C, HD)) / np.sqrt(HD)).astype(np.float32),
        k_norm=rng.uniform(0.7, 1.3, C).astype(np.float32))


TRACES: list[tuple] = []


@functools.partial(jax.jit, static_argnames=("ratio", "eps"))
def _chunk(a, z, start, n_new, open_a, open_z, norm_c, wk, k_norm, *, ratio, eps):
    """A chunk's latents, main entries and index keys (one program per T, ratio and eps)."""
    TRACES.append((a.shape, ratio, eps))
    out = c41.compress_chunk(a, z, start, n_new, open_a, open_z, norm_c, ratio=ratio, eps=eps)
    entries = c41.main_entries(out.latents, out.entry, ratio, INV)
    keys = c41.index_keys(out.latents, out.entry, wk, k_norm, ratio, INV, eps)
    return out, entries, keys


class Row:
    """One sequence fed chunk by chunk, collecting what each chunk publishes."""

    def __init__(self, data, ratio, eps=CONFIG.rms_eps):
        self.data, self.ratio, self.eps = data, ratio, eps
        self.length = 0
        self.open = (np.full(HD, np.nan, np.float32), np.full(HD, np.nan, np.float32))
        self.entries, self.keys, self.opens = {}, {}, {}

    def absorb(self, out, entries, keys, b, n):
        """Records row b of a chunk's result that appended n tokens."""
        valid = np.asarray(out.valid[b])
        ids = np.asarray(out.entry[b])[valid]
        assert list(ids) == list(range(self.length // self.ratio,
                                       (self.length + n) // self.ratio))
        for k, j in zip(np.flatnonzero(valid), ids, strict=True):
            assert j not in self.entries
            self.entries[int(j)] = np.asarray(entries[b, k])
            self.keys[int(j)] = np.asarray(keys[b, k])
        self.open = (np.asarray(out.open_a[b]), np.asarray(out.open_z[b]))
        self.length += n
        self.opens[self.length] = self.open


def _feed(rows_and_chunks, tokens, poison=np.nan):
    """Runs one chunk of T = tokens over a batch: rows_and_chunks is [(Row, n_new)]; padding
    past each row's n_new holds `poison`."""
    batch = len(rows_and_chunks)
    a = np.full((batch, tokens, HD), poison, np.float32)
    z = np.full((batch, tokens, HD), poison, np.float32)
    for b, (row, n) in enumerate(rows_and_chunks):
        a[b, :n] = row.data["a"][row.length: row.length + n]
        z[b, :n] = row.data["z"][row.length: row.length + n]
    first = rows_and_chunks[0][0]
    out = _chunk(a, z, np.array([r.length for r, _ in rows_and_chunks], np.int32),
                 np.array([n for _, n in rows_and_chunks], np.int32),
                 np.stack([r.open[0] for r, _ in rows_and_chunks]),
                 np.stack([r.open[1] for r, _ in rows_and_chunks]),
                 first.data["norm_c"], first.data["wk"], first.data["k_norm"],
                 ratio=first.ratio, eps=first.eps)
    for b, (row, n) in enumerate(rows_and_chunks):
        row.absorb(*out, b, n)


def _run(data, ratio, chunks, eps=CONFIG.rms_eps):
    row = Row(data, ratio, eps)
    for n in chunks:
        _feed([(row, n)], n)
    return row


def _oracle(data, ratio, length, eps=CONFIG.rms_eps):
    latents = O.compress_latents(data["a"], data["z"], data["norm_c"], ratio, eps, length)
    freqs = O.rope_frequencies(STACK, True)
    return (O.main_entries(latents, ratio, freqs),
            O.index_keys(latents, data["wk"], data["k_norm"], ratio, freqs, eps))


def _bits(x):
    return np.asarray(x, np.float32).view(np.uint32)


def _same_bits(row, want):
    assert sorted(row.entries) == sorted(want.entries)
    for j in want.entries:
        np.testing.assert_array_equal(_bits(row.entries[j]), _bits(want.entries[j]), f"C_{j}")
        np.testing.assert_array_equal(_bits(row.keys[j]), _bits(want.keys[j]), f"K_{j}")
    for length, (oa, oz) in row.opens.items():
        if want.ratio == 2 and length % 2:  # the open row is meaningful at odd lengths
            np.testing.assert_array_equal(_bits(oa), _bits(want.opens[length][0]))
            np.testing.assert_array_equal(_bits(oz), _bits(want.opens[length][1]))


# ---- RoPE tables ----

@pytest.mark.parametrize("compressed", [False, True])
def test_frequencies_are_the_oracles_in_fp32(compressed):
    got = rope.inv_frequencies_v41(CONFIG, compressed)
    want = O.rope_frequencies(STACK, compressed)
    assert got.dtype == np.float32 and got.shape == (CONFIG.rope_dim // 2,)
    np.testing.assert_allclose(got, want, rtol=4e-7, atol=0)  # fp32 powf, 1 / x, the blend


def test_flash_table_has_the_yarn_ramp_of_the_spec():
    flash = config41.flash41()
    got = rope.inv_frequencies_v41(flash, True)
    want = O.rope_frequencies(O.flash_stack(), True)
    np.testing.assert_allclose(got, want, rtol=4e-7, atol=0)
    base = rope.inv_frequencies_v41(flash, False)
    np.testing.assert_allclose(base, O.rope_frequencies(O.flash_stack(), False), rtol=4e-7)
    # Pairs below low = 15 keep theta^(-2i/64), pairs past high = 25 are divided by 16.
    raw = 160000.0 ** (-2.0 * np.arange(32) / 64)
    np.testing.assert_allclose(got[:15], raw[:15], rtol=4e-7)
    np.testing.assert_allclose(got[25:], raw[25:] / 16, rtol=4e-7)


# ---- against the float64 oracle ----

@pytest.mark.parametrize("ratio", [1, 2])
@pytest.mark.parametrize("eps", [1e-20, 1e-6])
def test_entries_and_keys_match_the_oracle(ratio, eps):
    data = _inputs(ratio)
    for length in LENGTHS:
        row = Row(data, ratio, eps)
        _feed([(row, length)], MAX_LEN)
        entries, keys = _oracle(data, ratio, length, eps)
        assert sorted(row.entries) == list(range(length // ratio))
        if not len(entries):
            continue
        np.testing.assert_allclose(np.stack([row.entries[j] for j in sorted(row.entries)]),
                                   entries, rtol=0, atol=ATOL, err_msg=f"L={length}")
        np.testing.assert_allclose(np.stack([row.keys[j] for j in sorted(row.keys)]), keys,
                                   rtol=0, atol=ATOL, err_msg=f"L={length}")


def test_bf16_latent_is_the_oracles_bf16_mode():
    data = _inputs(5, 9)
    out = c41.compress_chunk(data["a"][None], data["z"][None], np.zeros(1, np.int32),
                             np.array([9], np.int32), np.zeros((1, HD), np.float32),
                             np.zeros((1, HD), np.float32), data["norm_c"], ratio=2,
                             eps=1e-20, bf16_latent=True)
    want = O.compress_latents(data["a"], data["z"], data["norm_c"], 2, 1e-20, 9,
                              bf16_latent=True)
    np.testing.assert_allclose(np.asarray(out.latents[0, :4]), want, rtol=0, atol=1e-5)
    plain = O.compress_latents(data["a"], data["z"], data["norm_c"], 2, 1e-20, 9)
    assert np.abs(want - plain).max() > 1e-4  # the cast is visible at this bound


# ---- chunk invariance, bit for bit ----

@pytest.fixture(scope="module")
def references():
    """Per ratio: the 67 tokens token by token, and in one chunk."""
    out = {}
    for ratio in (1, 2):
        data = _inputs(10 + ratio)
        out[ratio] = (data, _run(data, ratio, [1] * MAX_LEN), _run(data, ratio, [MAX_LEN]))
    return out


@pytest.mark.xla_defaults  # two programs (chunk lengths): their bits as users compile
@pytest.mark.parametrize("ratio", [1, 2])
def test_token_by_token_is_one_chunk_bit_for_bit(references, ratio):
    _, by_token, whole = references[ratio]
    _same_bits(whole, by_token)
    assert len(by_token.entries) == MAX_LEN // ratio


@pytest.mark.xla_defaults
@hypothesis.settings(max_examples=hypothesis_examples(6), deadline=None)
@hypothesis.given(ratio=st.sampled_from([1, 2]), data=st.data())
def test_any_chunking_in_a_batch_is_bit_for_bit(references, ratio, data):
    """Three rows share each call: the row under test, a second row with its own chunking of
    the same sequence, and a row appending nothing; padding is NaN or a huge value. Chunks
    come from the few lengths T in {1, 3, 8} so compilations stay few; the odd ones give odd
    starts."""
    seq, by_token, _ = references[ratio]
    rows = [Row(seq, ratio) for _ in range(3)]
    poison = data.draw(st.sampled_from([np.nan, 1e30]))
    while rows[0].length < MAX_LEN or rows[1].length < MAX_LEN:
        tokens = data.draw(st.sampled_from([1, 3, 8]))
        batch = []
        for row in rows[:2]:
            left = MAX_LEN - row.length
            batch.append((row, data.draw(st.integers(min(1, left), min(tokens, left)))))
        batch.append((rows[2], 0))
        _feed(batch, tokens, poison)
    for row in rows[:2]:
        _same_bits(row, by_token)
    assert rows[2].entries == {} and rows[2].length == 0
    assert np.isnan(rows[2].open[0]).all() and np.isnan(rows[2].open[1]).all()  # as given


@pytest.mark.xla_defaults  # batch sizes 1 and 2: two programs
def test_padding_rows_and_poison_leave_the_bits():
    """A row's outputs depend neither on its padding nor on the other rows."""
    seq = _inputs(3)
    clean, dirty = Row(seq, 2), Row(seq, 2)
    other = Row(_inputs(4), 2)
    _feed([(clean, 3)], 8, poison=0.0)
    _feed([(dirty, 3), (other, 8)], 8, poison=np.nan)  # another batch size: its own program
    again = Row(seq, 2)
    _feed([(again, 3)], 8, poison=np.inf)
    _same_bits(again, clean)
    _same_bits(dirty, clean)
    for row in (clean, dirty, again):
        assert all(np.isfinite(v).all() for v in row.entries.values())
        assert np.isfinite(row.open[0]).all() and np.isfinite(row.open[1]).all()


# ---- worked example (V41_SPEC.md section 10) ----

def test_worked_example_visibility_and_positions():
    seq = _inputs(7, 8)
    by_token = _run(seq, 2, [1] * 8)
    row = Row(seq, 2)
    a = np.asarray(seq["a"])
    _feed([(row, 7)], 7)
    assert sorted(row.entries) == [0, 1, 2]  # C_0 = (0, 1), C_1 = (2, 3), C_2 = (4, 5)
    np.testing.assert_array_equal(row.open[0], a[6])  # the open row is token 6
    np.testing.assert_array_equal(row.open[1], seq["z"][6])
    # RoPE positions 0, 2, 4: the entry is the latent rotated by j * 2.
    lat = O.compress_latents(seq["a"], seq["z"], seq["norm_c"], 2, CONFIG.rms_eps, 8)
    for j, p in ((0, 0), (1, 2), (2, 4)):
        want = O.rotate(lat[j], p, O.rope_frequencies(STACK, True))
        np.testing.assert_allclose(row.entries[j], want, rtol=0, atol=ATOL)
        wrong = O.rotate(lat[j], p + 1, O.rope_frequencies(STACK, True))
        assert np.abs(row.entries[j] - wrong).max() > 10 * ATOL
    # Decode t = 7 closes C_3 = (6, 7) at position 6, from the open row.
    _feed([(row, 1)], 1)
    assert sorted(row.entries) == [0, 1, 2, 3]
    np.testing.assert_allclose(row.entries[3], O.rotate(
        lat[3], 6, O.rope_frequencies(STACK, True)), rtol=0, atol=ATOL)
    # Token by token: entry j appears at token 2j + 1; the open row is the last token iff the
    # length is odd.
    for length, (oa, _) in by_token.opens.items():
        if length % 2:
            np.testing.assert_array_equal(oa, a[length - 1])
        else:
            np.testing.assert_array_equal(oa, a[length - 2])  # kept, no longer meaningful
    ratio1 = _run(seq, 1, [7])
    assert sorted(ratio1.entries) == list(range(7))  # r = 1: C_j for j = 0..6 at position j


# ---- compilation and errors ----

def test_one_trace_serves_every_chunking():
    seq = _inputs(9)
    TRACES.clear()
    for chunks in ([3] * 5, [3, 3, 1], [2, 3, 3, 3]):
        row = Row(seq, 2, eps=1e-6)  # an eps no other test compiles with
        for n in chunks:
            _feed([(row, n)], 3)
    assert TRACES == [((1, 3, HD), 2, 1e-6)]


def _args(**changes):
    B, T = 2, 4
    args = dict(a=np.zeros((B, T, HD), np.float32), z=np.zeros((B, T, HD), np.float32),
                start=np.zeros(B, np.int32), n_new=np.full(B, T, np.int32),
                open_a=np.zeros((B, HD), np.float32), open_z=np.zeros((B, HD), np.float32),
                norm_c=np.ones(HD, np.float32))
    return {**args, **changes}


@pytest.mark.parametrize("changes, error, message", [
    (dict(z=np.zeros((2, 3, HD), np.float32)), ValueError,
     r"z: expected shape \(2, 4, 64\); got shape \(2, 3, 64\)"),
    (dict(open_a=np.zeros((2, 32), np.float32)), ValueError,
     r"open_a: expected shape \(2, 64\); got shape \(2, 32\)"),
    (dict(norm_c=np.ones(32, np.float32)), ValueError,
     r"norm_c: expected shape \(64\); got shape \(32,\)"),
    (dict(start=np.zeros(2, np.float32)), TypeError,
     "start: expected an array of integer dtype; got dtype float32"),
    (dict(a=np.zeros((2, 4, HD), np.int32)), TypeError,
     "a: expected an array of floating dtype; got dtype int32"),
    (dict(n_new=np.array([4, 5], np.int32)), ValueError, r"n_new: expected values <= 4"),
    (dict(start=np.array([0, -1], np.int32)), ValueError, r"start: expected values >= 0"),
    (dict(a=np.zeros((2, HD), np.float32)), ValueError,
     r"a: expected an array \[B, T, hd\]; got shape \(2, 64\)"),
])
def test_bad_arguments_are_named(changes, error, message):
    with pytest.raises(error, match=message):
        c41.compress_chunk(**_args(**changes), ratio=2, eps=1e-6)


def test_bad_ratio_and_key_weights_are_named():
    with pytest.raises(ValueError, match=r"ratio: expected one of \(1, 2\); got 4"):
        c41.compress_chunk(**_args(), ratio=4, eps=1e-6)
    lat, ids = jnp.zeros((1, 2, HD)), jnp.zeros((1, 2), jnp.int32)
    with pytest.raises(ValueError, match=r"wk: expected shape \(\*, 64\); got shape \(32, 63\)"):
        c41.index_keys(lat, ids, jnp.zeros((C, HD - 1)), jnp.ones(C), 2, INV, 1e-6)
    with pytest.raises(ValueError, match=r"k_norm: expected shape \(32\); got shape \(31,\)"):
        c41.index_keys(lat, ids, jnp.zeros((C, HD)), jnp.ones(C - 1), 2, INV, 1e-6)
