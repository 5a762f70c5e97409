"""Pallas kernels of the V4 cache, one folder per op, each with a TPU (Mosaic) and a GPU variant.

  compress/          pool complete blocks + RMSNorm + RoPE, written in place into the pool
  sparse_attention/  CSA decode: window ring + top-k C4 entries, one softmax with the sink
  dense_attention/   HCA decode: window ring + every visible C128 entry, same softmax
  indexer/           lightning-indexer scores over every visible key (top-k runs after it)

The pure-jnp reference of every op lives in `v4kv_jax` and is the truth; `v4kv_jax.ops`
chooses between them and hands the kernels plain arrays (RoPE comes in as a per-lane
frequency row), so kernels import nothing from `v4kv_jax`. Tests check each kernel against
the reference in interpret mode on CPU (tests/kernels) and lower each one for TPU and GPU.

Neither the Mosaic nor the Triton variants have been compiled or timed on hardware here:
interpret mode checks the numbers and the control flow (DMAs, semaphores, page-table reads),
cross-platform lowering checks that Mosaic / Triton accept every op, but the Mosaic layout
passes and the Triton compiler only run on a TPU / GPU host.
"""
