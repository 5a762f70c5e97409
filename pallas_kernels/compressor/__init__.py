"""Compressor: pool every block a chunk completes and write its entry in place into the pool.

  C_i[ch] = sum_s softmax_s(z_s[ch]) a_s[ch];  entry_i = RoPE_{i m}(RMSNorm_w(C_i))

With overlap (CSA), the 2m slots are the first halves of block i-1 and the second halves of
block i. Slot rows come from the compressor's tail ring (positions before the chunk) or the
chunk itself. `tpu.emit_entries` (Mosaic: scalar-prefetched lengths and page table, row-run
DMAs in, row DMAs out into the aliased pool) and `gpu.emit_entries` (Triton: gathered tiles,
masked scatter into the aliased pool) take the same arguments; the reference is
`v4kv_jax.ops.compressor.emit_entries`. Serves prefill (many blocks) and decode (at most one
block per slot per step). Both write float pools and the packed formats (fp8_latent entries,
fp4_index keys), encoded in the kernel.

The HCA compressor with an online tail (hca_tail="online"): `tpu.emit_entries_online` and
`gpu.emit_entries_online` (reference `v4kv_jax.ops.compressor.emit_entries_online`) fold a chunk
token by token into each row's (max, sum, weighted) with the update rule of the
`v4kv_jax.pools` docstring (`pooling.online_step`, the reference's expressions, so the tails
are bit for bit the reference's in interpret mode), writing an entry at each block end.
One program per (layer, row): the fold is sequential in position order anyway.
"""

from pallas_kernels.compressor.blocks import BlockSizes

__all__ = ["BlockSizes"]
