"""Reference of DeepSeek-V4.1's compressors and index keys (V41_SPEC.md sections 3 and 4.1).

A kv source layer of ratio r turns its tokens' projections a_t = wkv_c x_t (and, for r = 2,
z_t = wgate_c x_t), f32[hd] each, into one entry per group of r tokens:

  r = 1   latent_t = RMSNorm_{norm_c}(a_t)                 entry t, published at token t
  r = 2   latent_j = RMSNorm_{norm_c}(w0 a_2j + w1 a_2j+1)  entry j, published at token 2j + 1
          with (w0, w1) = softmax(z_2j, z_2j+1) per channel, all fp32 (no ape, no overlap)

The main entry is C_j = RoPE_{j r}(latent_j) and the index key K_j = RoPE_{j r}(
RMSNorm_{k_norm}(wk latent_j)), both with the layer's compress table (`rope.inv_frequencies_v41`)
and before any quantisation (V41_SPEC.md section 7, last paragraph).

State (ratio 2 only): one open row (a, z) f32[hd] each per sequence, the token 2j of a pair whose
2j + 1 is not yet seen; it is meaningful iff the processed length is odd. Ratio 1 has none.

A chunk's work is one array program of fixed shapes: `compress_chunk` pools every pair the
chunk can close ([B, nb, hd], nb = (T + 1) // 2 for r = 2, T for r = 1), a fixed expression of
(a_2j, z_2j, a_2j+1, z_2j+1) whether a_2j comes from the open row or from the chunk; slots that
close no entry are masked with `where` (padding tokens may hold anything, NaN included). Every
sum is written out in a fixed order (a pairwise tree over the channels, no `reduce` or `dot`,
whose order XLA:CPU may choose per program) and every product that is added is rounded to fp32
on its own (XLA:CPU contracts a product and a sum into an FMA in some programs and not in
others). So any chunking of a sequence gives every entry, key and open row the same bits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from v4kv_jax import checks, programs

RATIOS = (1, 2)


@struct.dataclass
class ChunkLatents:
    """What a chunk completes, per row b of the batch (`compress_chunk`).

    Attributes:
      latents: f32[B, nb, hd], the latent of entry `entry[b, k]` where `valid[b, k]`, else 0.
      entry: i32[B, nb], entry ids start // r + k (meaningful where valid).
      valid: bool[B, nb], the chunk closes that entry (in increasing entry order).
      open_a, open_z: f32[B, hd], the open row after the chunk (ratio 2: the chunk's last
        token where the row ends odd having appended something, else the row given; ratio 1:
        the row given).
    """

    latents: jax.Array
    entry: jax.Array
    valid: jax.Array
    open_a: jax.Array
    open_z: jax.Array


def _rounded(x: jax.Array) -> jax.Array:
    """x (a NaN stays NaN) through a select that no compiler pass removes, so that a product
    is rounded to fp32 before it is added (never contracted into an FMA)."""
    return jnp.where(x == x, x, jnp.nan)


def tree_sum(x: jax.Array) -> jax.Array:
    """Sum over the last axis in one fixed order, a pairwise tree of elementwise adds."""
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        total = x[..., :half] + x[..., half:2 * half]
        x = total if x.shape[-1] % 2 == 0 else jnp.concatenate(
            [total, x[..., 2 * half:]], axis=-1)
    return x[..., 0]


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """weight * x / sqrt(mean(x^2) + eps) over the last axis, fp32, in a fixed order."""
    x = x.astype(jnp.float32)
    mean = _rounded(tree_sum(_rounded(x * x)) / np.float32(x.shape[-1]))[..., None]
    return x / jnp.sqrt(mean + np.float32(eps)) * weight.astype(jnp.float32)


def rotate(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """RoPE of the last 2 len(inv_freq) dims of f32 x [..., d]: pair (2i, 2i + 1) turned by
    the fp32 angle position * f_i (as `rope.rotate`), each product rounded on its own.

    Args:
      x: f32[..., d].
      positions: integer array of shape x.shape[:-1].
      inv_freq: f32[r / 2], `rope.inv_frequencies_v41`.
    """
    r = 2 * inv_freq.shape[0]
    angle = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    x0, x1 = x[..., -r::2], x[..., -r + 1::2]
    turned = jnp.stack([_rounded(x0 * cos) - _rounded(x1 * sin),
                        _rounded(x0 * sin) + _rounded(x1 * cos)], axis=-1)
    return jnp.concatenate([x[..., :-r], turned.reshape(*x.shape[:-1], r)], axis=-1)


def pool_pair(a0: jax.Array, z0: jax.Array, a1: jax.Array, z1: jax.Array) -> jax.Array:
    """w0 a0 + w1 a1 with (w0, w1) = softmax(z0, z1) per channel (V41_SPEC.md section 3)."""
    top = jnp.maximum(z0, z1)
    e0, e1 = jnp.exp(z0 - top), jnp.exp(z1 - top)
    total = e0 + e1
    return _rounded(e0 / total * a0) + _rounded(e1 / total * a1)


def _check_chunk(a, z, start, n_new, open_a, open_z, norm_c, ratio) -> None:
    """Shapes, dtypes and the ratio of `compress_chunk`'s arguments, named."""
    checks.one_of("ratio", ratio, RATIOS)
    if np.ndim(a) != 3:
        checks.fail("a", "an array [B, T, hd]", f"shape {np.shape(a)}")
    batch, tokens, width = np.shape(a)
    if tokens < 1:
        checks.fail("a", "a chunk of T >= 1 tokens", f"shape {np.shape(a)}")
    for name, x, shape in (("a", a, (batch, tokens, width)), ("z", z, (batch, tokens, width)),
                           ("open_a", open_a, (batch, width)), ("open_z", open_z, (batch, width)),
                           ("norm_c", norm_c, (width,))):
        checks.shape(name, x, shape)
        checks.dtype_kind(name, x, "floating")
    for name, x in (("start", start), ("n_new", n_new)):
        checks.shape(name, x, (batch,))
        checks.dtype_kind(name, x, "integer")
    if checks.concrete(start, n_new):
        checks.int_array("start", start, lo=0)
        checks.int_array("n_new", n_new, lo=0, hi=tokens)


def compress_chunk(a: jax.Array, z: jax.Array, start: jax.Array, n_new: jax.Array,
                   open_a: jax.Array, open_z: jax.Array, norm_c: jax.Array, *, ratio: int,
                   eps: float, bf16_latent: bool = False) -> ChunkLatents:
    """The latents of every entry a chunk completes, and the open row after it.

    Args:
      a, z: f32[B, T, hd], the chunk's a_t and z_t (z unused for ratio 1); tokens at or past
        n_new are padding and may hold anything.
      start: i32[B], tokens of the row before the chunk.
      n_new: i32[B], the row's tokens in the chunk, 0 <= n_new <= T.
      open_a, open_z: f32[B, hd], the open row before the chunk (read where start is odd).
      norm_c: f32[hd], the compressor's norm weight.
      ratio: 1 or 2 (static).
      eps: the norm's epsilon (static).
      bf16_latent: round the pooled vector to bf16 before the norm, as the official code
        does (V41_SPEC.md section 3); the default keeps fp32, like the float64 oracle.

    Returns:
      `ChunkLatents`: nb = T slots for ratio 1, (T + 1) // 2 for ratio 2.
    """
    _check_chunk(a, z, start, n_new, open_a, open_z, norm_c, ratio)
    a, z = a.astype(jnp.float32), z.astype(jnp.float32)
    open_a, open_z = open_a.astype(jnp.float32), open_z.astype(jnp.float32)
    start, n_new = start.astype(jnp.int32), n_new.astype(jnp.int32)
    batch, tokens, width = a.shape
    if ratio == 1:
        k = jnp.arange(tokens, dtype=jnp.int32)[None, :]
        pooled, entry, valid = a, start[:, None] + k, k < n_new[:, None]
    else:
        nb = (tokens + 1) // 2
        odd = (start % 2 == 1)[:, None, None]

        def pairs(x, open_row):
            """[B, nb, 2, hd]: slot k's pair (the open row first where start is odd)."""
            padded = jnp.concatenate([open_row[:, None], x, jnp.zeros_like(x[:, :1])], axis=1)
            shifted = jnp.where(odd, padded[:, :2 * nb], padded[:, 1:2 * nb + 1])
            return shifted.reshape(batch, nb, 2, width)

        pa, pz = pairs(a, open_a), pairs(z, open_z)
        pooled = pool_pair(pa[:, :, 0], pz[:, :, 0], pa[:, :, 1], pz[:, :, 1])
        k = jnp.arange(nb, dtype=jnp.int32)[None, :]
        closing = 2 * k + 1 - start[:, None] % 2  # the chunk index of token 2j + 1
        entry, valid = start[:, None] // 2 + k, closing < n_new[:, None]
    if bf16_latent:
        pooled = pooled.astype(jnp.bfloat16).astype(jnp.float32)
    latents = jnp.where(valid[..., None], rms_norm(pooled, norm_c, eps), 0.0)
    if ratio == 2:
        end = start + n_new
        keep = ((n_new > 0) & (end % 2 == 1))[:, None]
        last = jnp.clip(n_new - 1, 0, tokens - 1)
        open_a = jnp.where(keep, programs.lookup(a, last, batched=True), open_a)
        open_z = jnp.where(keep, programs.lookup(z, last, batched=True), open_z)
    return ChunkLatents(latents=latents, entry=entry, valid=valid, open_a=open_a,
                        open_z=open_z)


def main_entries(latents: jax.Array, entry: jax.Array, ratio: int, inv_freq: np.ndarray
                 ) -> jax.Array:
    """f32[..., hd]: C_j = RoPE_{j r}(latent_j) before quantisation (V41_SPEC.md section 3).

    Args:
      latents: f32[..., hd] (`ChunkLatents.latents`).
      entry: integer [...], the entries' ids j.
      ratio: the layer's ratio (static).
      inv_freq: the compress table, `rope.inv_frequencies_v41(config, True)`.
    """
    return rotate(latents.astype(jnp.float32), entry * ratio, inv_freq)


def index_keys(latents: jax.Array, entry: jax.Array, wk: jax.Array, k_norm: jax.Array,
               ratio: int, inv_freq: np.ndarray, eps: float) -> jax.Array:
    """f32[..., c]: K_j = RoPE_{j r}(RMSNorm_{k_norm}(wk latent_j)) before quantisation
    (V41_SPEC.md section 4.1); the projection is a fixed-order sum over hd.

    Args:
      latents: f32[..., hd]; entry: integer [...], the entries' ids j.
      wk: f32[c, hd]; k_norm: f32[c].
      ratio, eps: the layer's ratio and the norm's epsilon (static).
      inv_freq: the compress table, `rope.inv_frequencies_v41(config, True)`.
    """
    width = latents.shape[-1]
    checks.shape("wk", wk, (None, width))
    checks.shape("k_norm", k_norm, (wk.shape[0],))
    x = latents.astype(jnp.float32)[..., None, :] * wk.astype(jnp.float32)
    keys = rms_norm(tree_sum(_rounded(x)), k_norm, eps)
    return rotate(keys, entry * ratio, inv_freq)


__all__ = ["RATIOS", "ChunkLatents", "compress_chunk", "index_keys", "main_entries",
           "pool_pair", "rms_norm", "rotate", "tree_sum"]
