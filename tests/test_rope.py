import math

import jax.numpy as jnp
import numpy as np

import v4kv_jax as v4
from v4kv_jax import rope
from v4kv_jax.config import LayerKind


def test_yarn_bounds_for_v4_are_15_and_25():
    lo, hi = rope.yarn_bounds(64, 160000.0, 65536, 32.0, 1.0)
    assert (lo, hi) == (15, 25)


def test_swa_frequencies_have_exponent_over_rope_dim_and_no_yarn():
    c = v4.flash()
    f = rope.inv_frequencies(c, LayerKind.SWA)
    assert f.shape == (32,)
    np.testing.assert_allclose(f[1], 10000.0 ** (-2 / 64), rtol=1e-6)


def test_compressed_layers_use_yarn_between_lo_and_hi():
    c = v4.flash()
    f = rope.inv_frequencies(c, LayerKind.CSA)
    base = 160000.0 ** (-np.arange(0, 64, 2) / 64)
    np.testing.assert_allclose(f[:15], base[:15], rtol=1e-6)  # gamma = 0: unchanged
    np.testing.assert_allclose(f[25:], base[25:] / 16, rtol=1e-6)  # gamma = 1: divided by s
    gamma = (20 - 15) / (25 - 15)
    np.testing.assert_allclose(f[20], base[20] * (1 - gamma) + base[20] / 16 * gamma, rtol=1e-6)


def test_interleaved_pairs_on_the_last_dims_by_hand():
    # 6 dims, r = 4: dims 0-1 untouched, pairs (2, 3) and (4, 5) rotate.
    inv_freq = np.asarray([1.0, 0.5], np.float32)
    x = jnp.asarray([1.0, 2.0, 1.0, 0.0, 0.0, 1.0])
    y = np.asarray(rope.rotate(x, jnp.int32(1), inv_freq))
    c1, s1, c2, s2 = math.cos(1), math.sin(1), math.cos(0.5), math.sin(0.5)
    np.testing.assert_allclose(y, [1, 2, c1, s1, -s2, c2], atol=1e-6)


def test_inverse_undoes_rotation():
    inv_freq = rope.inv_frequencies(v4.tiny(), LayerKind.CSA)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((5, 32)), jnp.float32)
    pos = jnp.arange(5) * 37
    back = rope.rotate(rope.rotate(x, pos, inv_freq), pos, inv_freq, inverse=True)
    np.testing.assert_allclose(back, x, atol=1e-5)
