"""Pallas kernels of the V4 cache, one folder per op, each with a TPU (Mosaic) and a GPU variant.

  compressor/        pool complete blocks + RMSNorm + RoPE, written in place into the pool
                     (and the online HCA tail, folded token by token)
  sparse_attention/  CSA decode: window ring + top-k C4 entries, one softmax with the sink
  dense_attention/   HCA decode: window ring + every visible C128 entry, same softmax
  indexer/           lightning-indexer scores over every visible key (top-k runs after it)

The pure-jnp reference of every op lives in `v4kv_jax` and is the truth; `v4kv_jax.ops`
chooses between them and hands the kernels plain arrays (RoPE comes in as a per-lane
frequency row), so kernels import nothing from `v4kv_jax`. Tests check each kernel against
the reference in interpret mode on CPU (tests/kernels) and lower each one for TPU and GPU.

The Triton (GPU) variants were compiled and timed on one NVIDIA H200 (docs/performance.md),
where they are slower than XLA's fusion of the reference; the Mosaic (TPU) variants have only
been lowered, never run on a TPU: interpret mode checks their numbers and control flow (DMAs,
semaphores, page-table reads) and lowering checks that Mosaic accepts every op, but its layout
passes only run on a TPU host.
"""
