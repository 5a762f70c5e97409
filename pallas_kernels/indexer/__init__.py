"""Lightning-indexer scores of one decode query per slot over every visible indexer key.

  score[i] = sum_h w_h * nI^-0.5 * ReLU(q_h . K_i) * c^-0.5,  i < min((t+1) // m, kv_end // m)

`tpu.index_scores` (Mosaic: scalar-prefetched page table, page DMAs, double buffered, score
chunks copied out) and `gpu.index_scores` (Triton: one program per block of keys) return a
score row per slot; ids they did not visit hold garbage and masked ids a large negative
value, which `v4kv_jax.ops.index_scores` turns into -inf before the top-k.
"""

from pallas_kernels.indexer.blocks import BlockSizes

__all__ = ["BlockSizes"]
