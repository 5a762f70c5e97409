"""Block pooling math shared by the compressor kernels (term by term as the reference):
the softmax pooling of whole blocks and the online tail's per-token step."""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.common import MASK_VALUE, rounded


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


def online_step(state, a, z, fresh):
    """One token of the online HCA tail (update rule of `v4kv_jax.pools`), in the
    reference's fp32 expressions: state (max, sum, weighted), a the token's kv, z its biased
    gate, fresh: the token starts a block (the state is replaced without being read)."""
    mx, s, u = state
    top = jnp.maximum(mx, z)
    c, e = jnp.exp(mx - top), jnp.exp(z - top)
    sc, uc, ea = rounded(s * c), rounded(u * c), rounded(e * a)
    return (jnp.where(fresh, z, top), jnp.where(fresh, 1.0, sc + e),
            jnp.where(fresh, a, uc + ea))
