"""Cases shared by the kernel tests: every kernel runs in interpret mode on CPU against the
jnp reference, on caches of random content whose unused pages are NaN.

A case is (implementation, page size, storage dtype, heads); the ragged batch of each case
holds the awkward lengths 0, 1, 3, 4, 127, 128, 129, P-1, P, P+1 and a few thousand.
"""

from __future__ import annotations

import functools
import os

import jax
import numpy as np

import v4kv_jax as v4
from v4kv_jax.testing import synthetic

jax.config.update("jax_default_matmul_precision", "highest")

# V4KV_KERNEL_DEVICE=gpu (or tpu) runs only that backend's kernels, compiled for the device
# instead of interpreted (benchmarks/gpu_check.sh); unset, both families run in interpret mode.
DEVICE = os.environ.get("V4KV_KERNEL_DEVICE", "")
IMPLEMENTATIONS = (f"pallas_{DEVICE}",) if DEVICE else ("pallas_tpu", "pallas_gpu")
INTERPRET = not DEVICE
REFERENCE = v4.Options(implementation="reference")


def kernel_options(implementation: str, op: str | None = None, block_sizes=None) -> v4.Options:
    """Options that run `implementation` (interpret mode unless on the device), with
    `block_sizes` for `op`."""
    return v4.Options(implementation=implementation,
                      interpret=INTERPRET and implementation != "reference",
                      block_sizes={op: block_sizes} if block_sizes is not None else {})
LONG = 3001  # "a few thousand": 750 C4 entries, 187 C128 entries (m' = 16)

# (page tokens, storage dtype, query heads): both page sizes with both dtypes, three head counts
# (3 is padded by the GPU kernels, 16 is one full GPU head block).
CASES = [(128, "float32", 4), (128, "bfloat16", 16), (256, "float32", 16),
         (256, "bfloat16", 3)]
CASE_IDS = [f"P{p}-{d}-H{h}" for p, d, h in CASES]
# Kernel and reference read the same stored values, widen them exactly to fp32 and compute in
# fp32 (interpret mode on CPU), so whatever the storage dtype their fp32 results differ only by
# the order of the sums: observed at most 4.8e-7 on values up to about 4; 1e-5 leaves 20x.
TOLERANCE = {"float32": 1e-5, "bfloat16": 1e-5}
# (rtol, atol) of values written back into storage. In bf16 the two fp32 results round to the
# same value unless they straddle a rounding boundary, then to neighbours one bf16 ulp apart:
# 8 significant bits, so at most 2^-7 of the value (observed: 1 value of 1024, 2^-7.7 apart).
STORED_TOLERANCE = {"float32": (1e-5, 1e-5), "bfloat16": (2.0**-7, 1e-5)}


def lengths_for(page_tokens: int) -> list[int]:
    """Slot lengths of the shared caches: the awkward ones, 15, 16, 17 (C128 edges with
    m' = 16), and last a slot of P + 1 tokens that tests query as a padding row of
    `layer_step` (q_pos == kv_end)."""
    edges = [0, 1, 3, 4, 15, 16, 17, 127, 128, 129, page_tokens - 1, page_tokens,
             page_tokens + 1, LONG]
    return sorted(set(edges)) + [page_tokens + 1]


def model_for(heads: int, **overrides) -> v4.AttentionConfig:
    fields = dict(num_heads=heads, o_groups=1, index_heads=16, index_topk=48, window=32)
    fields.update(overrides)
    return v4.tiny(**fields)


@functools.cache
def shared_cache(page_tokens: int, dtype: str):
    """One random cache per (P, dtype) for all decode tests (layouts do not depend on heads)."""
    return random_cache(model_for(4), page_tokens, dtype, lengths_for(page_tokens), seed=7)


def decode_positions(lengths) -> tuple[jax.Array, jax.Array]:
    """(q_pos, kv_end) i32[B]: each row queries its last token, the last row a padding one."""
    kv_end = np.asarray(lengths, np.int32)
    q_pos = kv_end - 1
    q_pos[-1] = kv_end[-1]
    return jax.numpy.asarray(q_pos), jax.numpy.asarray(kv_end)


def random_cache(model, page_tokens: int, dtype: str, lengths, seed: int = 0, spare_pages=2):
    """`synthetic.random_cache` with `lengths` tokens per slot in a geometry just large enough
    (plus `spare_pages` and one free slot), stored in `dtype`; unused pages are NaN."""
    lengths = np.asarray(lengths, np.int64)
    need = -(-lengths // page_tokens)
    geometry = v4.CacheConfig(
        num_pages=int(need.sum()) + spare_pages, max_slots=len(lengths) + 1,
        max_pages_per_seq=int(need.max()) + 1, page_tokens=page_tokens, entry_dtype=dtype,
        window_dtype=dtype, tail_dtype=dtype)
    return synthetic.random_cache(model, geometry, lengths, seed, fill_unused=float("nan"))


def assert_close(actual, expected, dtype: str, err_msg: str = ""):
    tol = TOLERANCE[dtype]
    np.testing.assert_allclose(np.asarray(actual, np.float32), np.asarray(expected, np.float32),
                               rtol=tol, atol=tol, err_msg=err_msg)


# --- packed storage formats (issue 11) ------------------------------------------------------
# Widths valid for fp8_latent (hd - r a multiple of 64: 3 scale blocks) and fp4_index (c >= 32,
# 2 blocks), powers of two for the GPU kernels. Kernels read the packed pools; the reference
# reads the same pools decoded by `v4kv_jax.pools.storage`, so both see the same values.
PACKED_WIDTHS = dict(head_dim=256, rope_dim=64, index_head_dim=64)
PACKED_PAGE_TOKENS = 128


def packed_model(heads: int, **overrides) -> v4.AttentionConfig:
    return model_for(heads, **PACKED_WIDTHS, **overrides)


@functools.cache
def packed_cache():
    """(cache, packed, decoded): a random fp32 cache at `PACKED_WIDTHS` (unused pages NaN), its
    pools packed ("csa", "hca", "window": fp8_latent; "csa_index": fp4_index of keys taken as
    already rotated) and those packed pools decoded back to fp32, all `pools.Lanes` stored
    as the cache stores them."""
    from v4kv_jax import pools
    from v4kv_jax.pools import storage

    model = packed_model(4)
    r = model.rope_dim
    cache = random_cache(model, PACKED_PAGE_TOKENS, "float32", lengths_for(PACKED_PAGE_TOKENS),
                         seed=11)
    floats = dict(csa=pools.csa_entries(cache).c4, hca=pools.hca_entries(cache).c128,
                  window=pools.window_ring(cache), csa_index=pools.csa_entries(cache).index_keys)
    packed, decoded = {}, {}
    for name, stored in floats.items():
        if name == "csa_index":
            codec = storage.RowCodec("fp4_index", model.index_head_dim)
            rows = storage.encode_fp4_key(stored.records(), rotated=True)
        else:
            codec = storage.RowCodec("fp8_latent", model.head_dim, r)
            rows = codec.encode(stored.records())
        packed[name] = codec.lanes(stored.map.records).pack(rows)
        decoded[name] = stored.map.pack(codec.decode(rows))
    return cache, packed, decoded


def kernel_function(folder: str, implementation: str, name: str):
    """The kernel entry point of `implementation` (called directly with packed pools and
    their formats as keyword arguments)."""
    import importlib

    backend = {"pallas_tpu": "tpu", "pallas_gpu": "gpu"}[implementation]
    return getattr(importlib.import_module(f"pallas_kernels.{folder}.{backend}"), name)
