"""The split-K launch shared by the GPU decode attention kernels (CSA sparse, HCA dense).

Grid (slot, head block, split): every program reads the scalars and the window and entry
pools whole (Triton indexes them itself), its head block of queries, and writes the partial
softmax state (acc, max, sum) of its split. XLA then merges the splits with the sink
(`decode.combine_partials`) and de-rotates the output by -q_pos (a lane-pair exchange has
no Triton equivalent in Pallas).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import decode
from pallas_kernels.common import rotate_lanes, triton_compiler_params


def swap_pairs(x: jax.Array) -> jax.Array:
    """x with lanes 2i and 2i + 1 exchanged (XLA, outside kernels)."""
    return x.reshape(*x.shape[:-1], -1, 2)[..., ::-1].reshape(x.shape)


def derotate(out: jax.Array, q_pos: jax.Array, lane_freq: jax.Array) -> jax.Array:
    """De-rotates f32[B, H, d] by -q_pos (XLA epilogue of the GPU kernels)."""
    angle = q_pos.astype(jnp.float32)[:, None, None] * lane_freq[None]
    return rotate_lanes(out, swap_pairs(out), angle, inverse=True)


def split_k_decode(kernel, scalars, q, window, entries, sink, q_pos, lane_freq, *, heads: int,
                   heads_per_block: int, num_splits: int, num_warps: int, num_stages: int,
                   interpret: bool, name: str) -> jax.Array:
    """Runs `kernel` over (slot, head block, split) and finishes its partial states.

    Args:
      kernel: refs (*scalars, q, window, entries, acc, max, sum).
      scalars: i32 arrays passed whole.
      q: f32[B, padded heads, hd], the heads padded to a multiple of `heads_per_block`.
      window, entries: the window rings and the kind's Classical array.
      sink: f32[heads]; q_pos: i32[B]; lane_freq: f32[1, hd].
      heads: the real head count (padding is dropped before the merge).

    Returns:
      f32[B, heads, hd], normalised and de-rotated.
    """
    batch, padded_heads, dim = q.shape
    bh = heads_per_block

    def whole(x):
        return pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)

    def partial(width):
        return pl.BlockSpec((None, None, bh, width), lambda b, h, s: (b, s, h, 0))

    def partial_shape(width):
        return jax.ShapeDtypeStruct((batch, num_splits, padded_heads, width), jnp.float32)

    acc, m, denom = pl.pallas_call(
        kernel,
        grid=(batch, padded_heads // bh, num_splits),
        in_specs=[*(whole(x) for x in scalars),
                  pl.BlockSpec((None, bh, dim), lambda b, h, s: (b, h, 0)),
                  whole(window), whole(entries)],
        out_specs=[partial(dim), partial(1), partial(1)],
        out_shape=[partial_shape(dim), partial_shape(1), partial_shape(1)],
        compiler_params=triton_compiler_params(num_warps, num_stages),
        interpret=interpret,
        name=name,
    )(*scalars, q, window, entries)
    out = decode.combine_partials(acc[:, :, :heads], m[:, :, :heads, 0],
                                  denom[:, :, :heads, 0], sink)
    return derotate(out, q_pos, lane_freq)
