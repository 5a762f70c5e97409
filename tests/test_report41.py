"""The memory of a DeepSeek-V4.1 cache (v4kv_jax/pools/report41.py) and `v4kv memory --preset
flash41` (v4kv_jax/costs.py): V4.1-Flash's 890 B a token in the release records
(V41_SPEC.md section 6, the oracle's own count) and 896 as stored, its State per request
(section 8), figures by hand in float32, every figure equal to the bytes of the arrays
`init_cache41` makes, and the report of a live cache after appends, a held page and a
release.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import v41_cases as cases

import v4kv_jax as v4
from v4kv_jax import cli, pools, step41
from v4kv_jax.pools import cache41, report41
from v4kv_jax.testing import v41_oracle as oracle

FLASH41 = v4.flash41()
T1 = v4.tiny41()
FORMATS = ("release", "float32", "bfloat16")


def _geometry(formats: str, pages: int = 1, slots: int = 1, per_seq: int = 1):
    return cache41.cache_config41(formats, num_pages=pages, max_slots=slots,
                                  max_pages_per_seq=per_seq)


def test_flash41_in_the_release_records_is_890_bytes_a_token():
    g = _geometry("release")
    logical = pools.classical_bytes_per_token41(FLASH41, g)
    # Three ratio-2 sources and one ratio-1 source: (288 + 68) / 2 and 288 + 68.
    assert logical == {"layer 2": 178.0, "layer 8": 178.0, "layer 14": 178.0,
                       "layer 20": 356.0, "total": 890.0}
    assert logical["total"] == oracle.global_bytes_per_token(oracle.flash_stack())
    for length in (0, 1, 2, 3, 127, 128, 1000, 1 << 20):
        assert pools.entry_bytes41(FLASH41, g, length) == oracle.global_bytes(
            oracle.flash_stack(), length), length
    # As stored, pages of 128: a ratio-2 page's 64 entries of 72 words fill 36 lane rows
    # (64 + 8 words), its 64 keys of 17 words 9 (16 + 1: 72 B a key); a ratio-1 page's
    # 128 entries (72 rows) and keys (17 rows) fill theirs.
    stored = pools.stored_bytes_per_token41(FLASH41, g)
    assert stored == {"layer 2": 180.0, "layer 8": 180.0, "layer 14": 180.0,
                      "layer 20": 356.0, "total": 896.0}
    assert pools.page_bytes41(FLASH41, g) == 3 * (36 + 9) * 512 + (72 + 17) * 512 == 128 * 896
    assert pools.page_logical_bytes41(FLASH41, g) == 128 * 890
    # State: 40 MXFP8 window rings of 128 x 528 B, 3 open rows of 2 x 512 fp32, 8 B of
    # counters; a ring of 132-word rows fills 128 + 4 lane rows, an open row 8: no padding.
    state = 40 * 128 * 528 + 3 * 2 * 512 * 4 + 8
    assert state == 2_715_656
    assert pools.state_bytes_per_request41(FLASH41, g) == state
    assert pools.state_logical_bytes_per_request41(FLASH41, g) == state


@pytest.mark.parametrize("config, per_token, state", [
    # flash41: entries 512 x 4 B, keys 128 x 4 B: 3 x 2560 / 2 + 2560; rings 40 x 128 x 2048.
    (FLASH41, 3 * 2560 / 2 + 2560, 40 * 128 * 2048 + 3 * 4096 + 8),
    # tiny41: entries 64 x 4 B, keys 32 x 4 B: 384 / 2 + 384; rings 6 x 8 x 256, one open row
    # of 2 x 64 x 4 B.
    (T1, 384 / 2 + 384, 6 * 8 * 256 + 512 + 8),
])
def test_float32_figures_by_hand(config, per_token, state):
    g = _geometry("float32")
    assert pools.classical_bytes_per_token41(config, g)["total"] == per_token
    # Rows of 512, 128, 64 and 32 words fill whole lane rows or whole slots: no padding.
    assert pools.stored_bytes_per_token41(config, g)["total"] == per_token
    assert pools.page_bytes41(config, g) == pools.page_logical_bytes41(config, g) == (
        128 * per_token)
    assert pools.state_bytes_per_request41(config, g) == state
    assert pools.state_logical_bytes_per_request41(config, g) == state


@pytest.mark.parametrize("config", [FLASH41, T1], ids=["flash41", "tiny41"])
@pytest.mark.parametrize("formats", FORMATS)
def test_the_figures_are_the_bytes_of_the_arrays(config, formats):
    """A cache of 3 pages and 2 slots (abstract: nothing allocated): the Classical pool's
    planes are 3 pages, the State's 2 slots' State."""
    g = _geometry(formats, pages=3, slots=2, per_seq=3)
    cache = jax.eval_shape(lambda: cache41.init_cache41(config, g))

    def nbytes(tree):
        return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))

    assert nbytes(cache.classical) == 3 * pools.page_bytes41(config, g)
    assert nbytes(cache.state) == 2 * pools.state_bytes_per_request41(config, g)
    rows = {name: cache41.codec41(config, g, name).row_bytes for name in ("entries", "keys")}
    assert pools.classical_bytes_per_token41(config, g)["total"] == sum(
        (rows["entries"] + rows["keys"]) / config.compress_ratios[s]
        for s in config.kv_source_layers)
    assert (pools.stored_bytes_per_token41(config, g)["total"]
            >= pools.classical_bytes_per_token41(config, g)["total"])


def _append(cache, config, slots_lengths: dict[int, int], tokens: int = 16):
    """Feeds each slot its length in chunks of `tokens` (one batch row per slot, oracle
    random inputs)."""
    stack = cases.stack_of(config)
    inputs = {s: oracle.random_inputs(stack, n, seed=s) for s, n in slots_lengths.items()}
    done = dict.fromkeys(slots_lengths, 0)
    while any(done[s] < n for s, n in slots_lengths.items()):
        rows, n_new = [], []
        for s, n in slots_lengths.items():
            k = min(tokens, n - done[s])
            lo = min(done[s], n - 1) if k == 0 else done[s]
            vec, weights = cases.chunk(config, inputs[s], lo, lo + max(k, 1), tokens)
            rows.append(vec)
            n_new.append(k)
            done[s] += k
        vectors = [jax.tree.map(lambda *xs: jnp.concatenate(xs), *layer)
                   for layer in zip(*rows, strict=True)]
        cache, _ = step41.prefill41(cache, vectors, weights, list(slots_lengths), n_new)
    return cache


def test_the_report_of_a_live_cache():
    g = _geometry("float32", pages=8, slots=3, per_seq=2)
    cache = pools.reset_slot(pools.reset_slot(cache41.init_cache41(T1, g), 1), 2)
    cache = _append(cache, T1, {1: 40, 2: 130})
    report = pools.memory_report(cache)  # V4's entry point gives a Cache41's report
    assert report == pools.memory_report41(cache)
    page = pools.page_bytes41(T1, g)
    assert page == 128 * 576
    assert report.classical_bytes_per_token == {"layer 1": 192.0, "layer 3": 384.0,
                                                "total": 576.0}
    assert report.stored_bytes_per_token["total"] == report.device_bytes_per_token == 576.0
    assert (report.pages_total, report.pages_used, report.pages_free, report.pages_shared) == (
        8, 3, 5, 0)  # 40 tokens: one page; 130: two
    assert (report.slots_total, report.slots_used, report.request_tokens_max) == (3, 2, 256)
    # Complete entries and keys (256 + 128 B a pair): floor(L / 2) of layer 1, L of layer 3.
    assert report.entry_bytes == (40 // 2 + 40 + 130 // 2 + 130) * 384
    assert report.allocated_bytes == 3 * page
    assert report.page_logical_bytes == page and report.capacity_bytes == 8 * page
    assert report.state_bytes_per_request == report.state_logical_bytes_per_request == 12_808
    assert report.state_bytes_total == 3 * 12_808
    assert report.device_bytes == {"classical": 8 * page, "state": 3 * 12_808}
    assert report.host_bytes == {"classical": 0, "state": 0} and report.host_bytes_per_request == 0
    text = report.format()
    assert "layer 1 192.0 B, layer 3 384.0 B, total 576.0 B; as stored 576.0 B (x1.000)" in text
    assert "3 pages = 221,184 B holding 97,920 B of entries" in text

    # Slot 2's first page held outside the page tables: shared, counted once; then slot 2
    # released: the held page stays in use as a full page (128 tokens), its second page is
    # freed.
    first = int(np.asarray(cache.pages.page_table)[2, 0])
    cache = pools.hold_pages(cache, [first])
    shared = pools.memory_report(cache)
    assert (shared.pages_used, shared.pages_shared, shared.entry_bytes) == (
        3, 1, report.entry_bytes)
    cache = pools.release_slot(cache, 2)
    after = pools.memory_report(cache)
    assert (after.pages_used, after.pages_free, after.pages_shared, after.slots_used) == (
        2, 6, 0, 1)
    assert after.entry_bytes == (40 // 2 + 40 + 128 // 2 + 128) * 384


def test_memory_of_the_flash41_preset(capsys):
    assert cli.main(["memory", "--preset", "flash41", "--tokens", "1048576"]) == 0
    out = capsys.readouterr().out
    assert ("flash41: 40 layers (2 SWA, 18 ratio 2, 20 ratio 1; kv sources 2, 8, 14, 20); "
            "formats release: entries nvfp4 (288 B), index keys mxfp4 (68 B), window mxfp8 "
            "(528 B)") in out
    assert ("Classical bytes/token: layer 2 178.00 B, layer 8 178.00 B, layer 14 178.00 B, "
            "layer 20 356.00 B, total 890.00 B; as stored (lane-dense pools): layer 2 "
            "180.00 B, layer 8 180.00 B, layer 14 180.00 B, layer 20 356.00 B, total 896.00 B "
            "(x1.007)") in out
    # 8,192 pages of 114,688 B; the entries and keys themselves 890 x 2^20 B.
    assert ("At 1,048,576 tokens: Classical 896.00 MiB as stored in 8,192 pages (x1.007 of "
            "the entries' and keys' own 890.00 MiB), State 2.59 MiB (2,715,656 B) per "
            "request") in out
    assert ("State per request: 2,715,656 B of rows (40 window rings of 128 x 528 B, 3 ratio-2 "
            "open rows of 2 x 512 fp32 = 4,096 B, length and status 8 B); as stored 2,715,656 B "
            "(x1.000)") in out
    # 64 GiB / (896 MiB + 2,715,656 B): 72 requests of a million tokens.
    assert "data parallel over 1 device 72 per device" in out
    assert cli.main(["memory", "--preset", "flash41", "--tokens", "3", "--formats",
                     "float32"]) == 0
    out = capsys.readouterr().out
    assert "formats float32: entries float32 (2048 B), index keys float32 (512 B)" in out
    assert "total 6400.00 B; as stored (lane-dense pools)" in out and "(x1.000)" in out
    # 3 tokens: one entry of each ratio-2 source, three of the ratio-1 source.
    assert "(x53.333 of the entries' and keys' own 15,360 B)" in out
    assert "State 10.01 MiB (10,498,056 B) per request" in out


def test_options_that_do_not_apply_to_v41_are_refused_by_name(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["memory", "--preset", "flash41", "--hot-rows", "1024"])
    assert exit_info.value.code == 2
    assert ("v4kv memory: error: argument --hot-rows: expected 0 for the flash41 preset "
            "(HiSparse, V4's C4 entries on the host, is not built for V4.1") in (
        capsys.readouterr().err)
    with pytest.raises(ValueError, match="--hot-rows: expected 0 for the flash41 preset"):
        cli.memory(argparse.Namespace(preset="flash41", tokens=5, hot_rows=512))
    with pytest.raises(ValueError, match=r"--formats: expected one of \('release', "):
        cli.memory(argparse.Namespace(preset="flash41", tokens=5, formats="fp8_latent"))
    with pytest.raises(ValueError, match=r"--tokens: expected an integer in \[1, inf\]; got 0"):
        cli.memory(argparse.Namespace(preset="flash41", tokens=0))
    with pytest.raises(ValueError, match=r"--target: expected one of \(None, 'v4'"):
        cli.memory(argparse.Namespace(preset="flash41", tokens=5, target="v9"))


def test_bad_arguments_are_named():
    g = _geometry("release")
    with pytest.raises(TypeError, match="config: expected a V41Config; got AttentionConfig"):
        pools.classical_bytes_per_token41(v4.flash(), g)
    with pytest.raises(ValueError, match="c4_tier: expected 'device' with no hot set"):
        pools.stored_bytes_per_token41(FLASH41, cache41.cache_config41(
            "release", num_pages=1, max_slots=1, max_pages_per_seq=1, c4_tier="host"))
    with pytest.raises(ValueError, match="entry_dtype: expected one of"):
        pools.state_bytes_per_request41(FLASH41, v4.CacheConfig(
            num_pages=1, max_slots=1, max_pages_per_seq=1, entry_dtype="fp8_latent"))
    with pytest.raises(ValueError, match="tokens: expected an integer"):
        pools.entry_bytes41(FLASH41, g, -1)
    with pytest.raises(TypeError, match="cache: expected a Cache41; got object"):
        pools.memory_report41(object())
    with pytest.raises(TypeError, match="cache: expected a Cache41; got Cache"):
        report41.memory_report41(pools.init_cache(v4.tiny(), v4.CacheConfig(
            num_pages=1, max_slots=1, max_pages_per_seq=1)))
