"""Interleaved RoPE on the last `rope_dim` dims, with the YaRN frequencies of V4 (SPEC section 2).

Pair i is dims (2i, 2i+1) of the rotated slice. SWA layers use `rope_theta` without YaRN;
CSA and HCA layers use `compress_rope_theta` with YaRN for every rotation in the layer.
DeepSeek-V4.1 keeps the formula (V41_SPEC.md section 2): `inv_frequencies_v41` gives the base
table of its ratio-0 layers and the compress table of its ratio-1 and ratio-2 layers.

The frequency tables repeat, operation by operation in fp32, what transformers 5.23.0's
`DeepseekV4RotaryEmbedding` (and the YaRN code of `modeling_rope_utils` it calls) computes,
so that the angles `p * f_i` match the reference's bit for bit and their rounding does not
grow with p (SPEC pitfall 11):

  powers = f32(theta) ** (arange(0, r, 2) / r)     one C-library `powf` per pair
  f      = 1 / powers                              the SWA table
  YaRN:  keep = 1 - gamma,  f <- (1 / (s * powers)) * (1 - keep) + f * keep

Every step but the power is an IEEE fp32 operation, identical in numpy and torch. The power is
where implementations differ: numpy's float32 *array* power may run SIMD code of its own (SVML
on AVX-512 builds: 1 to 4 ulp away from torch in the final tables), so each power here is a float32
*scalar* power, which calls the C library's `powf`. torch's CPU `pow` calls that same `powf`
for the pairs outside its SIMD blocks and Sleef's `powf` (within 1 ulp, not correctly rounded)
inside them: the first 32 * (r // 64) pairs with AVX-512, the first 16 * (r // 32) with AVX2,
none without SIMD (ATEN_CPU_CAPABILITY=default). Measured against transformers on an
AVX-512 machine:
  - V4-Flash and V4-Pro (r = 64, theta 10000 and 160000, YaRN 16 / 65536 / 32 / 1): equal, bit
    for bit, with AVX-512, AVX2 and without SIMD;
  - pairs outside torch's Sleef blocks (with AVX-512, every pair when r < 64): equal;
  - pairs inside them: over thetas 1e3..1e7 and r = 8..256 (2.5M powers), 1.4% of the powers
    are 1 ulp away from Sleef's; with the YaRN settings of tests/test_rope_parity.py, 1.3% of
    the frequencies then differ, by at most 3.0e-7 relative (1 to 4 ulp), so their angles by
    at most p * f_i * 3e-7. Matching those would mean re-implementing Sleef's `powf`.
"""

from __future__ import annotations

import functools
import math

import jax.numpy as jnp
import numpy as np

from v4kv_jax.config import AttentionConfig, LayerKind
from v4kv_jax.config41 import V41Config


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


def _theta_powers(theta: float, rope_dim: int) -> np.ndarray:
    """f32[rope_dim // 2]: f32(theta) ** f32(2i / r), each rounded by the C library's `powf`."""
    base = np.float32(theta)
    exponents = np.arange(0, rope_dim, 2, dtype=np.float32) / np.float32(rope_dim)
    # Scalar, not array, power: numpy's float32 scalar power is `powf`, its array loop is not.
    return np.array([base ** e for e in exponents], np.float32)


def _frequency_table(rope_dim: int, theta: float, yarn: tuple | None) -> np.ndarray:
    """f32[rope_dim // 2]: 1 / powers, or with `yarn` = (factor, original_max_position,
    beta_fast, beta_slow) the YaRN blend of the module docstring."""
    powers = _theta_powers(theta, rope_dim)
    extrapolation = np.float32(1.0) / powers
    if yarn is None:
        return extrapolation
    factor, original, beta_fast, beta_slow = yarn
    interpolation = np.float32(1.0) / (np.float32(factor) * powers)
    ramp = yarn_ramp(rope_dim, theta, original, beta_fast, beta_slow)
    keep = np.float32(1.0) - ramp
    return interpolation * (np.float32(1.0) - keep) + extrapolation * keep


@functools.cache
def inv_frequencies(config: AttentionConfig, kind: LayerKind) -> np.ndarray:
    """f32[rope_dim // 2]: the rotation frequency of each pair for layers of `kind`."""
    yarn = ((config.yarn_factor, config.yarn_original_max_position, config.yarn_beta_fast,
             config.yarn_beta_slow) if config.uses_yarn(kind) else None)
    return _frequency_table(config.rope_dim, config.rope_base(kind), yarn)


@functools.cache
def inv_frequencies_v41(config: V41Config, compressed: bool) -> np.ndarray:
    """f32[rope_dim // 2]: a V4.1 layer's table (V41_SPEC.md section 2), by V4's formula.

    `compressed` (a layer of ratio 1 or 2): `compress_rope_theta` with YaRN (when
    `yarn_factor` > 1, as for V4), the table of every RoPE in such a layer; else the base
    table of ratio-0 layers (`rope_theta`, no YaRN).
    """
    if not compressed:
        return _frequency_table(config.rope_dim, config.rope_theta, None)
    yarn = ((config.yarn_factor, config.yarn_original_max_position, config.yarn_beta_fast,
             config.yarn_beta_slow) if config.yarn_factor > 1.0 else None)
    return _frequency_table(config.rope_dim, config.compress_rope_theta, yarn)


def rotate(x: jnp.ndarray, positions: jnp.ndarray, inv_freq: np.ndarray,
           inverse: bool = False) -> jnp.ndarray:
    """Rotates the last `2 * len(inv_freq)` dims of x by angle `position * f_i` per pair.

    The angle is one fp32 product of the position (converted to fp32) and the frequency, as
    transformers forms it, so it equals the reference's angle bit for bit; cos and sin then
    differ from torch's by at most an ulp, whatever the position.

    Args:
      x: [..., d] with d >= 2 * len(inv_freq); computed in fp32, returned in x.dtype.
      positions: int array broadcastable to x.shape[:-1].
      inv_freq: f32[r // 2] from `inv_frequencies`.
      inverse: rotate by -angle (the output de-rotation).
    """
    r = 2 * inv_freq.shape[0]
    angle = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    if inverse:
        sin = -sin
    rope = x[..., -r:].astype(jnp.float32)
    x0, x1 = rope[..., 0::2], rope[..., 1::2]
    rotated = jnp.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], axis=-1)
    rotated = rotated.reshape(rope.shape).astype(x.dtype)
    return jnp.concatenate([x[..., :-r], rotated], axis=-1)
