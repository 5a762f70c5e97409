"""Compressor pooling by hand: the CSA overlap halves, block edges, the position bias."""

import jax.numpy as jnp
import numpy as np

import v4kv_jax as v4
from v4kv_jax import rope
from v4kv_jax.config import LayerKind
from v4kv_jax.ops import compressor as comp
from v4kv_jax.pools.layout import CompressorSpec
from v4kv_jax.testing import oracle

# width 8 with rope_dim 2: dims 0..5 are never rotated, so the numbers stay readable.
MODEL = v4.tiny(head_dim=8, rope_dim=2, index_head_dim=8, num_heads=2, o_groups=1)
CSA = CompressorSpec("csa", LayerKind.CSA, 4, True, 8)
INV = rope.inv_frequencies(MODEL, LayerKind.CSA)  # the library's table, which it pools with
ORACLE_INV = oracle.inv_frequencies(MODEL, LayerKind.CSA)  # the SPEC's, in float64


def _pool(spec, kv, gate, start, blocks, norm=None):
    """Pools `blocks` of one slot from a chunk holding positions start.. (empty tail)."""
    tail = jnp.zeros((1, spec.ring, spec.in_width))
    norm = jnp.ones((spec.width,)) if norm is None else norm
    return np.asarray(comp.pool_blocks(
        spec, MODEL, tail, tail, jnp.asarray(kv)[None], jnp.asarray(gate)[None],
        jnp.asarray([start]), jnp.asarray([blocks]), norm, INV))[0]


def test_overlap_halves_by_hand():
    # First halves (dims :8) of block 0 point along e0, second halves (dims 8:) of block 1
    # along e1. Entry 1 pools FIRST halves of tokens 0..3 and SECOND halves of tokens 4..7;
    # with gate ln 3 on those second halves the weights are 1/16 and 3/16.
    kv = np.zeros((8, 16), np.float32)
    gate = np.zeros((8, 16), np.float32)
    kv[0:4, 0] = 1.0  # first half, e0
    kv[4:8, 8 + 1] = 1.0  # second half, e1
    kv[0:4, 8 + 2] = 1.0  # second half of block 0: only entry 0 uses it
    kv[4:8, 3] = 1.0  # first half of block 1: only entry 2 would use it
    gate[4:8, 8:] = np.log(3.0)
    entries = _pool(CSA, kv, gate, 0, [0, 1])
    pooled1 = np.zeros(8)
    pooled1[0], pooled1[1] = 4 * (1 / 16), 4 * (3 / 16)  # 0.25 e0 + 0.75 e1
    expected1 = pooled1 / np.sqrt(np.mean(pooled1**2) + MODEL.rms_eps)
    np.testing.assert_allclose(entries[1, :6], expected1[:6], rtol=1e-6)
    # Entry 0 has no previous block: its first-half slots weigh exactly 0.
    pooled0 = np.zeros(8)
    pooled0[2] = 1.0
    expected0 = pooled0 / np.sqrt(np.mean(pooled0**2) + MODEL.rms_eps)
    np.testing.assert_allclose(entries[0], expected0, rtol=1e-6)


def test_library_matches_the_oracle_and_not_the_swapped_halves():
    # Random inputs: the library's entries equal the float64 oracle's, and the oracle fed the
    # two halves swapped (pitfall 1) is far from both.
    kv = np.random.default_rng(0).standard_normal((12, 16)).astype(np.float32)
    gate = np.random.default_rng(1).standard_normal((12, 16)).astype(np.float32)
    got = _pool(CSA, kv, gate, 0, [0, 1, 2])
    want = oracle.compress(kv, gate, np.zeros((4, 16)), np.ones(8), 4, True, ORACLE_INV, 1e-6,
                           12)
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
    swapped = oracle.compress(np.roll(kv, 8, axis=1), np.roll(gate, 8, axis=1),
                              np.zeros((4, 16)), np.ones(8), 4, True, ORACLE_INV, 1e-6, 12)
    assert np.abs(swapped[1:] - want[1:]).max(axis=-1).min() > 1e-1


def test_entry_rope_position_is_first_token_of_block():
    rng = np.random.default_rng(2)
    kv = rng.standard_normal((12, 16)).astype(np.float32)
    gate = rng.standard_normal((12, 16)).astype(np.float32)
    got = _pool(CSA, kv, gate, 0, [0, 1, 2])
    want = oracle.compress(kv, gate, np.zeros((4, 16)), np.ones(8), 4, True, ORACLE_INV, 1e-6,
                           12)
    np.testing.assert_allclose(got, want, atol=1e-6)
    # Entry 2 pooled alone: its rotated pair (dims 6, 7; f = 1 with rope_dim 2) is its
    # unrotated pair turned by 8 rad (token 8, the block's first), not 11 rad (its last).
    (entry,) = _pool(CSA, kv, gate, 0, [2])
    np.testing.assert_allclose(entry, got[2], atol=1e-6)
    unrotated = oracle.compress(kv, gate, np.zeros((4, 16)), np.ones(8), 4, True,
                                np.zeros(1), 1e-6, 12)[2]
    x0, x1 = unrotated[6], unrotated[7]

    def turned(angle):
        return [x0 * np.cos(angle) - x1 * np.sin(angle), x0 * np.sin(angle) + x1 * np.cos(angle)]

    np.testing.assert_allclose(entry[6:], turned(8.0), atol=1e-6)
    np.testing.assert_allclose(entry[:6], unrotated[:6], atol=1e-6)
    assert np.abs(entry[6:] - turned(11.0)).max() > 1e-1


def test_position_bias_row_is_t_mod_m_for_both_halves():
    rng = np.random.default_rng(3)
    kv = rng.standard_normal((8, 16)).astype(np.float32)
    gate = rng.standard_normal((8, 16)).astype(np.float32)
    ape = rng.standard_normal((4, 16)).astype(np.float32)
    biased = comp.biased_gate(CSA, jnp.asarray(gate)[None], jnp.asarray(ape),
                              jnp.arange(8)[None])
    np.testing.assert_allclose(np.asarray(biased)[0], gate + ape[np.arange(8) % 4], atol=1e-6)
    got = _pool(CSA, kv, np.asarray(biased)[0], 0, [0, 1])
    want = oracle.compress(kv, gate, ape, np.ones(8), 4, True, ORACLE_INV, 1e-6, 8)
    np.testing.assert_allclose(got, want, atol=1e-6)


def test_tail_keeps_last_ring_tokens_and_blocks_complete_at_edges():
    spec = CSA
    start, n_new = jnp.asarray([0, 5, 3]), jnp.asarray([13, 2, 1])
    rows = np.asarray(comp.tail_writes(spec, start, n_new, 13))
    # Slot 0 appends 13 tokens: only the last 8 (positions 5..12) are kept, at p % 8.
    assert rows[0].tolist() == [8] * 5 + [5, 6, 7, 0, 1, 2, 3, 4]
    assert rows[1].tolist()[:2] == [5, 6] and set(rows[1].tolist()[2:]) == {8}
    block, done = comp.completed_blocks(spec, start, n_new, 13)
    # Slot 0 completes blocks 0..2 (positions 3, 7, 11); slot 1 (5, 6) none; slot 2 (3) block 0.
    assert np.asarray(block[0])[np.asarray(done[0])].tolist() == [0, 1, 2]
    assert not np.asarray(done[1]).any()
    assert np.asarray(block[2])[np.asarray(done[2])].tolist() == [0]
