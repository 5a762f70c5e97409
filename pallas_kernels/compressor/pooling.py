"""Block pooling math shared by the compressor kernels (term by term as the reference)."""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.common import MASK_VALUE


def softmax_pool(a, z, valid, done):
    """sum over slots of softmax_slots(z) * a, per channel.

    Args:
      a, z: f32[G, slots, w] slot values and biased gates (anything where not valid).
      valid: bool[G, slots, 1]; done: bool[G, 1, 1] blocks that complete (the others give 0
        instead of 0 / 0).

    Returns:
      f32[G, w].
    """
    z = jnp.where(valid, z, MASK_VALUE)
    e = jnp.where(valid, jnp.exp(z - jnp.max(z, axis=1, keepdims=True)), 0.0)
    total = jnp.where(done, jnp.sum(e, axis=1, keepdims=True), 1.0)
    return jnp.sum(jnp.where(valid, (e / total) * a, 0.0), axis=1)
