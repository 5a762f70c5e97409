"""HCA dense decode attention: the window ring plus every visible C128 entry of each slot.

`tpu.dense_decode_attention` (Mosaic: scalar-prefetched page table, page DMAs, double
buffered) and `gpu.dense_decode_attention` (Triton: gathered tiles, split-K) take the same
arguments; the reference is `v4kv_jax.ops.attention.attend` for an HCA layer.
"""

from pallas_kernels.dense_attention.blocks import BlockSizes

__all__ = ["BlockSizes"]
