"""The lane map (`v4kv_jax.pools.lanes`): where each word of each row of a block lives.

Hand-computed cuts for the arrays of the V4-Flash and test widths, the TPU layout rule every
plane follows (minor dim a multiple of 128, second-minor 1, 2, 4 or a multiple of 8),
property tests of `Lanes.take` / `put` / `pack` / `block_records` against a plain
[..., E, w] array, and the table of bytes as stored in docs/formats.md recomputed from the
maps."""

from __future__ import annotations

import pathlib
import re

import hypothesis
import hypothesis.strategies as st
import jax.numpy as jnp
import numpy as np
import pytest

import v4kv_jax as v4
from v4kv_jax import pools
from v4kv_jax.pools import layout, storage
from v4kv_jax.pools.lanes import LaneMap, lane_rows

ROOT = pathlib.Path(__file__).resolve().parents[1]


def cut(words: int, records: int) -> list[tuple[int, int, int, int]]:
    return [(p.first, p.words, p.slot, p.rows)
            for p in LaneMap(words, records, np.uint32).parts]


def test_lane_rows_follow_the_tpu_rule():
    assert [lane_rows(n) for n in (1, 2, 3, 4, 5, 8, 9, 16, 37)] == [1, 2, 4, 4, 8, 8, 16, 16,
                                                                     40]
    with pytest.raises(ValueError, match=r"n: expected at least 1 lane row; got 0"):
        lane_rows(0)


def test_the_cuts_of_the_v4_flash_release_arrays():
    # C4 entries, 32 a page: 112 code + 16 RoPE words in a 128-lane row each, the other 16
    # RoPE words 8 to a lane row, the 2 scale words 64 to a lane row: 37 lane rows, 592 B.
    assert cut(146, 32) == [(0, 128, 128, 32), (128, 16, 16, 4), (144, 2, 2, 1)]
    # fp4 keys: the 16 code words 8 to a lane row, the scale word 128 to a row (32 used).
    assert cut(17, 32) == [(0, 16, 16, 4), (16, 1, 1, 1)]
    # One C128 entry a page: two lane rows (one part of 18 words in a 32-lane slot).
    assert cut(146, 1) == [(0, 128, 128, 1), (128, 18, 32, 1)]
    # The window ring of 128 rows: no padding at all.
    assert cut(146, 128) == [(0, 128, 128, 128), (128, 16, 16, 16), (144, 2, 2, 2)]
    assert LaneMap(146, 128, np.uint32).overhead == 1.0
    # Wide float rows: one row a lane row of their own width.
    assert cut(1024, 8) == [(0, 1024, 1024, 8)]
    assert cut(32, 8) == [(0, 32, 32, 2)]


def test_a_map_needs_a_32_bit_dtype_and_positive_sizes():
    with pytest.raises(ValueError, match=r"dtype: expected a 32-bit dtype"):
        LaneMap(4, 4, np.float16)
    with pytest.raises(ValueError, match=r"records: expected a positive int; got 0"):
        LaneMap(4, 0, np.uint32)


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(words=st.integers(1, 300), records=st.integers(1, 140))
def test_every_map_covers_each_word_once_in_planes_a_tpu_keeps_row_major(words, records):
    lanes = LaneMap(words, records, np.uint32)
    covered = []
    for p in lanes.parts:
        assert p.lanes % 128 == 0 and p.lanes % p.slot == 0
        assert p.rows in (1, 2, 4) or p.rows % 8 == 0
        assert p.rows * p.per_row >= records
        covered += range(p.first, p.first + p.words)
    assert covered == list(range(words))
    # No cut of the narrow words takes fewer lane rows than the one chosen.
    wide = 128 * (words // 128)
    rows = sum(p.rows for p in lanes.parts if p.first >= wide and words % 128)
    if words % 128:
        slot = 1 << (words % 128 - 1).bit_length()
        assert rows <= lane_rows(-(-records // (128 // slot)))


@hypothesis.settings(max_examples=30, deadline=None)
@hypothesis.given(words=st.sampled_from([1, 2, 9, 17, 32, 49, 146, 256]),
                  records=st.sampled_from([1, 3, 8, 32, 33]), seed=st.integers(0, 2**31))
def test_take_put_and_pack_are_a_plain_array_of_rows(words, records, seed):
    rng = np.random.default_rng(seed)
    lanes = LaneMap(words, records, np.uint32)
    rows = rng.integers(0, 1 << 32, (2, 3, records, words), dtype=np.uint32)
    stored = lanes.pack(jnp.asarray(rows), pad=0xFFFFFFFF)
    np.testing.assert_array_equal(np.asarray(stored.records()), rows)
    # Padding lanes and rows hold the pad word; every other word is a row's.
    total = sum(int(np.asarray(x).size) for x in stored.planes)
    padding = sum(int((np.asarray(x) == 0xFFFFFFFF).sum()) for x in stored.planes)
    assert total - padding <= rows.size <= total
    # Both ways a read or write finds a record: by its id (off a TPU: the planes viewed as
    # records) and by its lane row and first lane (`locate`; on a TPU, and the host tier's).
    def take(index, record, located):
        if located:
            return stored.take(index, None, stored.locate(record))
        return stored.take(index, record)

    def put(index, record, values, located):
        if located:
            return stored.put(index, None, values, stored.locate(record))
        return stored.put(index, record, values)

    # Whole blocks by index (a layer scalar, blocks by an array), as a plain array reads.
    b1 = rng.integers(0, 3, (2, 4))
    np.testing.assert_array_equal(
        np.asarray(stored.block_records((np.int32(1), jnp.asarray(b1)))), rows[1][b1])
    np.testing.assert_array_equal(np.asarray(stored[jnp.int32(1), jnp.asarray(b1)].records()),
                                  rows[1][b1])
    for located in (False, True):
        # take: any (block, record) pairs.
        b0, b1 = rng.integers(0, 2, 5), rng.integers(0, 3, 5)
        e = rng.integers(0, records, 5)
        np.testing.assert_array_equal(np.asarray(take((b0, b1), e, located)), rows[b0, b1, e])
        # put: one record changed, every other word of every plane as it was; a record
        # past the block or a block index past the array (or negative) writes nothing.
        new = rng.integers(0, 1 << 32, (words,), dtype=np.uint32)
        want = rows.copy()
        want[1, 2, records - 1] = new
        got = put((np.int32(1), np.int32(2)), np.int32(records - 1), jnp.asarray(new),
                  located)
        np.testing.assert_array_equal(np.asarray(got.records()), want)
        changed = sum(int((np.asarray(a) != np.asarray(b)).sum())
                      for a, b in zip(got.planes, stored.planes, strict=True))
        assert changed <= words
        for index, record in (((1, 2), records), ((2, 0), 0), ((-1, 0), 0), ((0, 0), -1)):
            same = put(tuple(np.int32(i) for i in index), np.int32(record), jnp.asarray(new),
                       located)
            for a, b in zip(same.planes, stored.planes, strict=True):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_rows_of_16_bit_floats_are_word_pairs():
    codec = storage.RowCodec("bfloat16", 5)
    assert codec.stored_width == 3 and codec.dtype == jnp.uint32
    assert codec.lanes(32).parts[0].slot == 4


# --- the table of docs/formats.md ---------------------------------------------------------

BENCH = v4.flash(hidden_size=1024, num_heads=8, head_dim=128, rope_dim=64, q_lora_rank=256,
                 o_groups=2, o_lora_rank=128, index_heads=8, index_head_dim=64,
                 index_topk=512)  # benchmarks/decode.py's widths
WIDTHS = {"V4-Flash": v4.flash(), "V4-Pro": v4.pro(), "benchmarks/decode.py": BENCH,
          "`v4.tiny()`": v4.tiny()}


def _table(heading: str) -> list[list[str]]:
    page = (ROOT / "docs/formats.md").read_text()
    section = page.split(heading, 1)[1].split("\n#", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")][2:]
    return [[c.strip() for c in row.strip("|").split("|")] for row in rows]


def _number(text: str) -> float:
    return float(re.sub(r"[,*` ]", "", text.split()[0]))


def test_the_formats_page_states_the_bytes_each_array_takes_as_stored():
    """docs/formats.md's table of the V4-Flash arrays: each row's logical bytes, its cut
    and its bytes as stored, as the lane maps give them."""
    rows = _table("### Every array of a V4-Flash cache")
    fixed = layout.of(v4.flash(), v4.CacheConfig.with_formats(
        "release", num_pages=2, max_slots=1, max_pages_per_seq=1, hot_rows=1024))
    names = {"C4 entries": "csa", "indexer keys": "csa_index", "C128 entries": "hca",
             "window ring": "window", "hot rows": "hot", "CSA tails": "tail:csa",
             "indexer tails": "tail:csa_index", "HCA online tail": "tail:hca"}
    seen = set()
    for array, logical, parts, stored, ratio in rows:
        name = next(n for label, n in names.items() if array.startswith(label))
        lanes = fixed.lanes[name]
        seen.add(name)
        assert _number(logical) == lanes.record_bytes, array
        assert parts == ", ".join(f"{p.slot} x {p.rows}" for p in lanes.parts), array
        assert _number(stored) == lanes.block_bytes / lanes.records, array
        assert _number(ratio) == round(lanes.overhead, 3), array
    assert seen == set(names.values())


def test_the_formats_page_states_the_classical_bytes_per_token_as_stored():
    rows = _table("### Classical bytes per token, as stored")
    assert len(rows) >= 8
    for widths, formats, logical, stored, ratio in rows:
        geometry = v4.CacheConfig.with_formats(formats.strip("`"), num_pages=1, max_slots=1,
                                               max_pages_per_seq=1)
        model = WIDTHS[widths]
        want_logical = pools.classical_bytes_per_token(model, geometry)["total"]
        want_stored = pools.stored_bytes_per_token(model, geometry)["total"]
        # The page rounds to 2 decimals (1,248.625 is 1,248.62).
        assert _number(logical) == pytest.approx(want_logical, abs=0.0051), (widths, formats)
        assert _number(stored) == pytest.approx(want_stored, abs=0.0051), (widths, formats)
        assert _number(ratio) == round(want_stored / want_logical, 3), (widths, formats)
