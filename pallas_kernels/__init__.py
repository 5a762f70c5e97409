"""Pallas kernels of the V4 cache, one folder per op, each with a TPU (Mosaic) and a GPU variant.

  compress/          pool complete blocks + RMSNorm + RoPE, written in place into the pool
  sparse_attention/  CSA decode: window ring + top-k C4 entries, one softmax with the sink
  dense_attention/   HCA decode: window ring + every visible C128 entry, same softmax
  indexer/           lightning-indexer scores over every visible key (top-k runs after it)

The pure-jnp reference of every op lives in `v4kv_jax` and is the truth; `v4kv_jax.ops`
chooses between the two. Kernels import only `common` and `v4kv_jax.config` / `rope` tables;
tests check each one against the reference in interpret mode on CPU.
"""
