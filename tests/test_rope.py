"""RoPE by hand: frequency tables and rotations with the expected numbers written out.

The comparison with transformers' tables and caches is in test_rope_parity.py.
"""

import dataclasses

import jax.numpy as jnp
import numpy as np

import v4kv_jax as v4
from v4kv_jax import rope
from v4kv_jax.config import LayerKind

# One fp32 power and one reciprocal (plus, with YaRN, one product and one sum): a few ulp.
FREQ_RTOL = 3e-7


def test_yarn_bounds_for_v4_are_15_and_25():
    lo, hi = rope.yarn_bounds(64, 160000.0, 65536, 32.0, 1.0)
    assert (lo, hi) == (15, 25)


def test_swa_frequencies_are_theta_powers_over_rope_dim_without_yarn():
    f = rope.inv_frequencies(v4.flash(), LayerKind.SWA)
    assert f.shape == (32,) and f.dtype == np.float32
    i = np.arange(32)
    # Every pair, also those at and past hi = 25 that YaRN would divide by 16.
    np.testing.assert_allclose(f, 10000.0 ** (-2 * i / 64), rtol=FREQ_RTOL)
    assert f[0] == 1.0
    assert f[16] == np.float32(0.01)  # 10000 ** -0.5
    np.testing.assert_allclose(f[31], 1.333521432163324e-04, rtol=FREQ_RTOL)  # 10 ** -3.875


def test_compressed_layers_use_yarn_between_lo_and_hi():
    c = v4.flash()
    f = rope.inv_frequencies(c, LayerKind.CSA)
    base = 160000.0 ** (-np.arange(0, 64, 2) / 64)
    np.testing.assert_allclose(f[:16], base[:16], rtol=FREQ_RTOL)  # gamma = 0 up to i = lo
    np.testing.assert_allclose(f[25:], base[25:] / 16, rtol=FREQ_RTOL)  # gamma = 1 from hi
    gamma = (np.arange(16, 25) - 15) / (25 - 15)
    np.testing.assert_allclose(f[16:25], base[16:25] * (1 - gamma + gamma / 16), rtol=FREQ_RTOL)
    # The numbers: f_14 = 160000 ** -(28/64); f_20 = 160000 ** -(40/64) * (1/2 + 1/32);
    # f_31 = 160000 ** -(62/64) / 16.
    np.testing.assert_allclose(f[[14, 20, 31]],
                               [5.286856317202821e-03, 2.9697777826169085e-04,
                                5.680529036909976e-07], rtol=FREQ_RTOL)
    np.testing.assert_array_equal(rope.inv_frequencies(c, LayerKind.HCA), f)


def test_yarn_depends_on_the_layer_kind_not_on_theta():
    """With one theta for both tables, SWA keeps every f_i while CSA / HCA ramp them."""
    c = dataclasses.replace(v4.flash(), rope_theta=160000.0)
    swa = rope.inv_frequencies(c, LayerKind.SWA)
    for kind in (LayerKind.CSA, LayerKind.HCA):
        f = rope.inv_frequencies(c, kind)
        np.testing.assert_array_equal(f[:16], swa[:16])
        np.testing.assert_array_equal(f[25:], swa[25:] / 16)  # 1 / (16 p) == (1 / p) / 16
        assert (f[16:25] < swa[16:25]).all() and (f[16:25] > swa[16:25] / 16).all()


def test_yarn_factor_one_disables_yarn():
    c = v4.flash(yarn_factor=1.0, rope_theta=160000.0)
    np.testing.assert_array_equal(rope.inv_frequencies(c, LayerKind.CSA),
                                  rope.inv_frequencies(c, LayerKind.SWA))


def test_interleaved_pairs_on_the_last_dims_by_hand():
    # 6 dims, r = 4: dims 0-1 untouched, pairs (2, 3) and (4, 5) rotate.
    inv_freq = np.asarray([1.0, 0.5], np.float32)
    x = jnp.asarray([1.0, 2.0, 1.0, 0.0, 0.0, 1.0])
    y = np.asarray(rope.rotate(x, jnp.int32(1), inv_freq))
    c1, s1, c2, s2 = 0.5403023058681398, 0.8414709848078965, 0.8775825618903728, 0.479425538604203
    np.testing.assert_allclose(y, [1, 2, c1, s1, -s2, c2], atol=1e-6)


def test_rotation_of_a_known_vector_by_a_known_angle():
    """(3, 4) at position 2 with f = 1/4: angle 0.5 rad, counter-clockwise; inverse: -0.5 rad."""
    inv_freq = np.asarray([0.25], np.float32)
    x = jnp.asarray([7.0, 3.0, 4.0])
    y = np.asarray(rope.rotate(x, jnp.int32(2), inv_freq))
    np.testing.assert_allclose(y, [7.0, 0.7150455312543063, 4.9486068633741], rtol=1e-6)
    back = np.asarray(rope.rotate(x, jnp.int32(2), inv_freq, inverse=True))
    np.testing.assert_allclose(back, [7.0, 4.55044984008793, 2.072053631748882], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(rope.rotate(jnp.asarray(y), jnp.int32(2), inv_freq,
                                                      inverse=True)), [7, 3, 4], rtol=1e-6)


def test_angle_is_position_times_frequency_at_a_large_position():
    """p = 1000, f = 2**-10: the angle 0.9765625 is exact in fp32; cos and sin to 1 ulp."""
    inv_freq = np.asarray([2.0**-10, 0.0], np.float32)
    y = np.asarray(rope.rotate(jnp.asarray([1.0, 0.0, 2.0, 5.0]), jnp.int32(1000), inv_freq))
    np.testing.assert_allclose(y, [0.5598740848558614, 0.8285777025160715, 2.0, 5.0],
                               rtol=2e-7)


def test_rotations_compose_by_relative_position():
    """q.k after rotating q at p and k at s depends on p - s only; the inverse at p undoes p."""
    inv_freq = rope.inv_frequencies(v4.tiny(), LayerKind.CSA)
    rng = np.random.default_rng(0)
    q, k = (jnp.asarray(rng.standard_normal(32), jnp.float32) for _ in range(2))
    dots = [float(jnp.dot(rope.rotate(q, jnp.int32(p), inv_freq),
                          rope.rotate(k, jnp.int32(p - 5), inv_freq))) for p in (5, 40, 333)]
    np.testing.assert_allclose(dots, dots[0], rtol=1e-5)
    moved = rope.rotate(q, jnp.int32(37), inv_freq)
    assert not np.allclose(moved, q, atol=1e-2)
    np.testing.assert_allclose(rope.rotate(moved, jnp.int32(37), inv_freq, inverse=True), q,
                               atol=1e-5)
    np.testing.assert_allclose(rope.rotate(q, jnp.int32(-37), inv_freq),
                               rope.rotate(q, jnp.int32(37), inv_freq, inverse=True), atol=1e-6)
