"""CSA sparse decode attention: the window ring plus the top-k C4 entries of each slot.

`tpu.sparse_decode_attention` (Mosaic: scalar-prefetched page table and picks, row DMAs) and
`gpu.sparse_decode_attention` (Triton: gathered tiles, split-K) take the same arguments; the
reference is `v4kv_jax.ops.attention.attend` with the same picks.
"""

from pallas_kernels.sparse_attention.blocks import BlockSizes

__all__ = ["BlockSizes"]
