"""Interleaved RoPE on the last `rope_dim` dims, with the YaRN frequencies of V4 (SPEC section 2).

Pair i is dims (2i, 2i+1) of the rotated slice. SWA layers use `rope_theta` without YaRN;
CSA and HCA layers use `compress_rope_theta` with YaRN for every rotation in the layer.
Frequencies are built in fp32 the way the executable reference builds them (SPEC pitfall 11).
"""

from __future__ import annotations

import functools
import math

import jax.numpy as jnp
import numpy as np

from v4kv_jax.config import AttentionConfig, LayerKind


def yarn_bounds(rope_dim: int, theta: float, original_max_position: int, beta_fast: float,
                beta_slow: float) -> tuple[int, int]:
    """(lo, hi) of the YaRN ramp, with the floor / ceil the SPEC requires (V4: 15, 25)."""

    def correction_dim(rotations: float) -> float:
        return rope_dim * math.log(original_max_position / (rotations * 2 * math.pi)) / (
            2 * math.log(theta)
        )

    lo = max(math.floor(correction_dim(beta_fast)), 0)
    hi = min(math.ceil(correction_dim(beta_slow)), rope_dim - 1)
    return lo, hi


def yarn_ramp(rope_dim: int, theta: float, original_max_position: int, beta_fast: float,
              beta_slow: float) -> np.ndarray:
    """gamma_i in [0, 1] per frequency pair: 0 keeps f_i, 1 divides it by the YaRN factor."""
    lo, hi = yarn_bounds(rope_dim, theta, original_max_position, beta_fast, beta_slow)
    if lo == hi:
        hi += 0.001
    ramp = (np.arange(rope_dim // 2, dtype=np.float32) - lo) / np.float32(hi - lo)
    return np.clip(ramp, 0, 1).astype(np.float32)


@functools.cache
def inv_frequencies(config: AttentionConfig, kind: LayerKind) -> np.ndarray:
    """f32[rope_dim // 2]: the rotation frequency of each pair for layers of `kind`."""
    r = config.rope_dim
    theta = config.rope_base(kind)
    pos_freqs = np.float32(theta) ** (np.arange(0, r, 2, dtype=np.float32) / np.float32(r))
    extrapolation = (np.float32(1.0) / pos_freqs).astype(np.float32)
    if not config.uses_yarn(kind):
        return extrapolation
    interpolation = (np.float32(1.0) / (np.float32(config.yarn_factor) * pos_freqs)).astype(
        np.float32
    )
    ramp = yarn_ramp(r, theta, config.yarn_original_max_position, config.yarn_beta_fast,
                     config.yarn_beta_slow)
    keep = np.float32(1.0) - ramp
    return (interpolation * (np.float32(1.0) - keep) + extrapolation * keep).astype(np.float32)


def rotate(x: jnp.ndarray, positions: jnp.ndarray, inv_freq: np.ndarray,
           inverse: bool = False) -> jnp.ndarray:
    """Rotates the last `2 * len(inv_freq)` dims of x by angle `position * f_i` per pair.

    Args:
      x: [..., d] with d >= 2 * len(inv_freq); computed in fp32, returned in x.dtype.
      positions: int array broadcastable to x.shape[:-1].
      inv_freq: f32[r // 2] from `inv_frequencies`.
      inverse: rotate by -angle (the output de-rotation).
    """
    r = 2 * inv_freq.shape[0]
    angle = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    if inverse:
        sin = -sin
    rope = x[..., -r:].astype(jnp.float32)
    x0, x1 = rope[..., 0::2], rope[..., 1::2]
    rotated = jnp.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], axis=-1)
    rotated = rotated.reshape(rope.shape).astype(x.dtype)
    return jnp.concatenate([x[..., :-r], rotated], axis=-1)
