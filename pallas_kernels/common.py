"""Helpers shared by the kernels: mask value, lane-wise RoPE, interpret and compiler params.

RoPE inside a kernel works on whole rows: `lane_frequencies` gives each lane of a width-d row
its rotation frequency (0 on the first d - r lanes, f_i on lanes 2i and 2i + 1 of the last r),
so `cos(p * f)` is 1 and `sin(p * f)` is 0 where nothing rotates, and a pair rotation is
`x * cos + swap(x) * (-sin, +sin, ...)` with `swap` exchanging lanes 2i and 2i + 1. The angle
`p * f` is formed in fp32 exactly as `v4kv_jax.rope.rotate` forms it (SPEC pitfall 11).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

# Finite, so that `max` and `exp` of fully masked rows stay finite (no inf - inf).
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
# Scores at or below this were masked by a kernel (a real score is never this small).
MASKED_BELOW = 0.5 * MASK_VALUE

HIGHEST = jax.lax.Precision.HIGHEST

MIN_DOT = 16  # smallest matmul dimension Triton accepts (GPU kernels pad up to it)


def lane_frequencies(inv_freq, width: int) -> jax.Array:
    """f32[1, width]: rotation frequency per lane; the rotated dims are the LAST 2 * len(f)."""
    inv_freq = jnp.asarray(inv_freq, jnp.float32)
    r = 2 * inv_freq.shape[0]
    if r > width:
        raise ValueError(f"rope dims {r} exceed the row width {width}")
    return jnp.concatenate([jnp.zeros((width - r,), jnp.float32),
                            jnp.repeat(inv_freq, 2)])[None, :]


def present_picks(page_rows: jax.Array, picks: jax.Array, entries_per_page: int) -> jax.Array:
    """i32[B, k]: picks with -1 wherever the pick or its page is absent, so a kernel only
    tests `pick >= 0` (entry i lives at page_rows[b, i // entries_per_page])."""
    max_pages = page_rows.shape[1]
    col = picks // entries_per_page
    inside = (picks >= 0) & (col < max_pages)
    page = jnp.take_along_axis(page_rows, jnp.clip(col, 0, max_pages - 1), axis=1)
    return jnp.where(inside & (page >= 0), picks, -1).astype(jnp.int32)


def candidate_scores(scores: jax.Array, q_pos: jax.Array, kv_end: jax.Array, ratio: int
                     ) -> jax.Array:
    """f32[B, capacity]: kernel scores with -inf for every id that is not a candidate (past
    the visible entries, or masked by the kernel); ids the kernel did not visit held
    whatever the output buffer held."""
    visible = jnp.minimum((q_pos + 1) // ratio, kv_end // ratio)
    ids = jnp.arange(scores.shape[1], dtype=jnp.int32)[None, :]
    return jnp.where((ids < visible[:, None]) & (scores > MASKED_BELOW), scores, -jnp.inf)


def rotate_lanes(x: jax.Array, swapped: jax.Array, angle: jax.Array, inverse: bool = False
                 ) -> jax.Array:
    """Interleaved RoPE of rows x [..., d], given `swapped` = x with lanes 2i, 2i+1 exchanged.

    angle: f32 broadcastable to x, `position * lane_frequencies` (0 on unrotated lanes).
    Matches `rope.rotate` term by term: (x0 cos - x1 sin, x0 sin + x1 cos).
    """
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    if inverse:
        sin = -sin
    lane = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    signed = jnp.where(lane % 2 == 0, -sin, sin)
    # Each product rounded on its own (a select no compiler pass removes): never contracted
    # into an FMA, so a kernel's rows are the same bits in every program it runs in.
    return rounded(x * cos) + rounded(swapped * signed)


def rounded(x: jax.Array) -> jax.Array:
    """x, bit for bit (a NaN stays NaN), through a select that keeps a product from being
    contracted with the sum it feeds into an FMA."""
    return jnp.where(x == x, x, jnp.nan)


def swap_pairs_tpu(x: jax.Array) -> jax.Array:
    """x with lanes 2i and 2i + 1 exchanged, from two lane rotations (TPU kernels).

    The partner of each lane is picked by rolling the lane ids along with the data, so the
    result does not depend on the rotation direction convention of `pltpu.roll`.
    """
    axis, d = x.ndim - 1, x.shape[-1]
    lane = jax.lax.broadcasted_iota(jnp.int32, x.shape, axis)
    one = pltpu.roll(x, 1, axis)
    from_one = pltpu.roll(lane, 1, axis) == (lane ^ 1)
    return jnp.where(from_one, one, pltpu.roll(x, d - 1, axis))


def tpu_interpret(interpret: bool):
    """`interpret=` for a TPU pallas_call: the TPU interpreter (uninitialised memory is NaN,
    out-of-bounds reads raise) when asked, else compile with Mosaic."""
    return pltpu.InterpretParams() if interpret else False


def reset_tpu_interpreter() -> None:
    """Clears the TPU interpreter's shared state (needed after a kernel failed mid-run)."""
    reset = getattr(pltpu, "reset_tpu_interpret_mode_state", None)
    if reset is not None:
        reset()


def triton_compiler_params(num_warps: int, num_stages: int):
    """Compiler params that select the Triton lowering of a GPU pallas_call.

    Without them, current jax lowers GPU kernels with Mosaic GPU, whose programming model
    (warpgroups, explicit shared memory) these kernels do not use.
    """
    from jax.experimental.pallas import triton as pl_triton

    params = getattr(pl_triton, "CompilerParams", None) or pl_triton.TritonCompilerParams
    return params(num_warps=num_warps, num_stages=num_stages)


def cdiv(a, b):
    return (a + b - 1) // b


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def next_power_of_two(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def check_positive(obj) -> None:
    """Raises ValueError naming the first field of a block-size dataclass that is not > 0."""
    for field in dataclasses.fields(obj):
        value = getattr(obj, field.name)
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{type(obj).__name__}.{field.name}={value!r} must be a positive int")


def cost_estimate(flops, bytes_accessed, transcendentals=0) -> pl.CostEstimate:
    """What XLA's cost analysis charges a kernel (it cannot look inside one): the worst
    case, every page of every page-table row read."""
    return pl.CostEstimate(flops=int(flops), transcendentals=int(transcendentals),
                           bytes_accessed=int(bytes_accessed))


def nbytes(x, last_dims: int | None = None) -> int:
    """Bytes of `x` (an array or shape struct), or of one slice of its last `last_dims`
    dims (a stored row: 1; a ring of rows: 2)."""
    shape = x.shape if last_dims is None else x.shape[len(x.shape) - last_dims:]
    return int(np.prod(shape, dtype=np.int64)) * x.dtype.itemsize


def float32_tails_problem(tail_dtype: str) -> str | None:
    """Why a compressor kernel cannot run tails stored in `tail_dtype`, or None: the kernels
    pool the tail rows as they load them, float32."""
    if tail_dtype == "float32":
        return None
    return (f"tail_dtype={tail_dtype!r}: the compressor kernels pool float32 tail rows as "
            "they load them")


def power_of_two_problem(**dims: int) -> str | None:
    """Why a config cannot be tiled by Triton (power-of-two shapes), or None: names the first
    dim that is not a power of two."""
    for name, value in dims.items():
        if not is_power_of_two(value):
            return f"{name}={value} is not a power of two (needed by the GPU kernels)"
    return None


def check_power_of_two(**dims: int) -> None:
    """Triton tensors have power-of-two shapes: raises naming the first dim that is not."""
    for name, value in dims.items():
        if not is_power_of_two(value):
            raise ValueError(f"{name}={value} must be a power of two for the GPU (Triton) kernel")


def in_hbm(planes) -> tuple[jax.Array, ...]:
    """The planes of a stored array held in HBM for a TPU kernel: XLA may otherwise move an
    operand the kernel reads by DMA (`pl.ANY`) into VMEM around the call, copying a whole
    pool in and out for a few pages' reads."""
    return tuple(pltpu.with_memory_space_constraint(x, pltpu.HBM) for x in planes)


def layer_index(layer) -> jax.Array:
    """A (possibly traced) layer index as i32[1], for scalar prefetch."""
    return jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))
