"""Every kernel lowers for its platform at V4 sizes (hd 512, r 64, 64 heads, W 128, c 128,
k 512, P 256; bf16 storage, and the read kernels also on the packed release formats):
TPU kernels to Mosaic, GPU kernels to Triton IR.

Lowering runs on CPU (cross-platform lowering), so CI catches a primitive, a block shape or a
grid spec that the Mosaic or Triton lowering rejects. It does not run the Mosaic layout passes
or the Triton compiler, which only a TPU or GPU host runs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.compressor import gpu as compress_gpu
from pallas_kernels.compressor import tpu as compress_tpu
from pallas_kernels.dense_attention import gpu as dense_gpu
from pallas_kernels.dense_attention import tpu as dense_tpu
from pallas_kernels.indexer import gpu as indexer_gpu
from pallas_kernels.indexer import tpu as indexer_tpu
from pallas_kernels.sparse_attention import gpu as sparse_gpu
from pallas_kernels.sparse_attention import tpu as sparse_tpu

B, H, HD, W, NI, C, K = 4, 64, 512, 128, 64, 128, 512
P, PAGES, MAX_PAGES, LAYERS, KIND_LAYERS, T = 256, 64, 32, 4, 2, 64
BF16, F32, I32, U32 = jnp.bfloat16, jnp.float32, jnp.int32, jnp.uint32


def sds(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


ATTENTION = dict(q=sds((B, H, HD), F32), sink=sds((H,), F32),
                 window=sds((LAYERS, B, W, HD), BF16), window_layer=sds((), I32),
                 slot_ids=sds((B,), I32), q_pos=sds((B,), I32), kv_end=sds((B,), I32))
ROWS, FREQ = sds((B, MAX_PAGES), I32), sds((32,), F32)  # inv_freq of 64 RoPE dims


# The release formats (issue 11): fp8_latent entries and window, fp4_index keys, as uint32 rows.
FP8 = dict(entry_format="fp8_latent", window_format="fp8_latent", rope_dim=64)
FP8_WORDS, FP4_WORDS = 146, 17


def _attention(packed: bool) -> tuple:
    if not packed:
        return tuple(ATTENTION.values())
    return tuple(dict(ATTENTION, window=sds((LAYERS, B, W, FP8_WORDS), U32)).values())


def _sparse(module, packed=False):
    width, dtype = (FP8_WORDS, U32) if packed else (HD, BF16)
    return module.sparse_decode_attention, (
        *_attention(packed), sds((KIND_LAYERS, PAGES, P // 4, width), dtype), sds((), I32), ROWS,
        sds((B, K), I32), FREQ), FP8 if packed else {}


def _dense(module, packed=False):
    width, dtype = (FP8_WORDS, U32) if packed else (HD, BF16)
    return module.dense_decode_attention, (
        *_attention(packed), sds((KIND_LAYERS, PAGES, P // 128, width), dtype), sds((), I32),
        ROWS, FREQ), dict(ratio=128, **(FP8 if packed else {}))


def _indexer(module, packed=False):
    width, dtype = (FP4_WORDS, U32) if packed else (C, BF16)
    return module.index_scores, (
        sds((B, NI, C), F32), sds((B, NI), F32), sds((KIND_LAYERS, PAGES, P // 4, width), dtype),
        sds((), I32), ROWS, sds((B,), I32), sds((B,), I32)), dict(
        ratio=4, **(dict(index_format="fp4_index") if packed else {}))


def _compress(module, ratio, overlap, packed=False, width=HD):
    """packed: fp8_latent entries (width HD), fp4_index keys (width C)."""
    in_width = 2 * width if overlap else width
    ring = 2 * ratio if overlap else ratio
    fmt = ("fp8_latent" if width == HD else "fp4_index") if packed else None
    pool = sds((KIND_LAYERS, PAGES, P // ratio, FP8_WORDS if width == HD else FP4_WORDS),
               U32) if packed else sds((KIND_LAYERS, PAGES, P // ratio, width), BF16)
    return module.emit_entries, (
        pool, ROWS, sds((KIND_LAYERS,), I32),
        sds((KIND_LAYERS, B, ring, in_width), F32), sds((KIND_LAYERS, B, ring, in_width), F32),
        sds((B,), I32), sds((KIND_LAYERS, B, T, in_width), F32),
        sds((KIND_LAYERS, B, T, in_width), F32), sds((B,), I32), sds((B,), I32),
        sds((KIND_LAYERS, width), F32), FREQ), dict(
        ratio=ratio, overlap=overlap, eps=1e-6,
        **(dict(entry_format=fmt, rope_dim=64) if packed else {}))


KERNELS = {
    "sparse": _sparse, "dense": _dense, "indexer": _indexer,
    "sparse_fp8": functools.partial(_sparse, packed=True),
    "dense_fp8": functools.partial(_dense, packed=True),
    "indexer_fp4": functools.partial(_indexer, packed=True),
    "compress_csa": functools.partial(_compress, ratio=4, overlap=True),
    "compress_hca": functools.partial(_compress, ratio=128, overlap=False),
}
MODULES = {
    "tpu": {"sparse": sparse_tpu, "dense": dense_tpu, "indexer": indexer_tpu,
            "compress_csa": compress_tpu, "compress_hca": compress_tpu},
    "cuda": {"sparse": sparse_gpu, "dense": dense_gpu, "indexer": indexer_gpu,
             "compress_csa": compress_gpu, "compress_hca": compress_gpu},
}
for _backend in MODULES.values():
    _backend.update({f"{name}_{fmt}": _backend[name] for name, fmt in
                     (("sparse", "fp8"), ("dense", "fp8"), ("indexer", "fp4"))})


@pytest.fixture
def tpu_lowering_target(monkeypatch):
    """Mosaic lowering asks the current device for its TPU generation; stand in a v5p."""
    try:
        from jax._src.pallas.mosaic import tpu_info
    except ImportError:
        pytest.skip("this jax has no Mosaic TPU info module")
    if not hasattr(tpu_info, "get_device_kind"):
        pytest.skip("this jax looks TPU info up differently")
    monkeypatch.setattr(tpu_info, "get_device_kind", lambda: "TPU v5p")
    monkeypatch.setattr(tpu_info, "get_num_device_cores", lambda: 1)


def _lower(fn, args, kwargs, platform):
    traced = fn.trace(*args, **kwargs)
    try:
        return traced.lower(lowering_platforms=(platform,)).as_text()
    except TypeError as e:
        if "lowering_platforms" in str(e):
            pytest.skip("this jax cannot lower for another platform")
        raise


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_tpu_kernels_lower_to_mosaic(kernel, tpu_lowering_target):
    fn, args, kwargs = KERNELS[kernel](MODULES["tpu"][kernel])
    assert "tpu_custom_call" in _lower(fn, args, kwargs, "tpu")


def test_tpu_compressor_writing_fp8_latent_lowers_to_mosaic(tpu_lowering_target):
    fn, args, kwargs = _compress(compress_tpu, ratio=4, overlap=True, packed=True)
    assert "tpu_custom_call" in _lower(fn, args, kwargs, "tpu")


# The compressors writing the release formats: C4 and C128 entries in fp8_latent, indexer keys
# (c 128, 64 RoPE dims) in fp4_index.
PACKED_COMPRESSORS = {
    "csa_fp8": functools.partial(_compress, ratio=4, overlap=True, packed=True),
    "hca_fp8": functools.partial(_compress, ratio=128, overlap=False, packed=True),
    "csa_index_fp4": functools.partial(_compress, ratio=4, overlap=True, packed=True, width=C),
}


@pytest.mark.parametrize("compressor", sorted(PACKED_COMPRESSORS))
def test_gpu_compressor_writing_packed_pools_lowers_to_triton(compressor):
    fn, args, kwargs = PACKED_COMPRESSORS[compressor](compress_gpu)
    assert "triton" in _lower(fn, args, kwargs, "cuda")


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_gpu_kernels_lower_to_triton(kernel):
    fn, args, kwargs = KERNELS[kernel](MODULES["cuda"][kernel])
    assert "triton" in _lower(fn, args, kwargs, "cuda")


def _online(module, packed):
    """The online HCA tail (m' 128) folding a chunk of T tokens, C128 entries in bf16 or
    fp8_latent."""
    pool = sds((KIND_LAYERS, PAGES, P // 128, FP8_WORDS), U32) if packed else sds(
        (KIND_LAYERS, PAGES, P // 128, HD), BF16)
    tail = sds((KIND_LAYERS, B, HD), F32)
    return module.emit_entries_online, (
        pool, ROWS, sds((KIND_LAYERS,), I32), tail, tail, tail, sds((B,), I32),
        sds((KIND_LAYERS, B, T, HD), F32), sds((KIND_LAYERS, B, T, HD), F32), sds((B,), I32),
        sds((B,), I32), sds((KIND_LAYERS, HD), F32), FREQ), dict(
        ratio=128, eps=1e-6, **(dict(entry_format="fp8_latent", rope_dim=64) if packed else {}))


@pytest.mark.parametrize("packed", [False, True], ids=["bf16", "fp8"])
def test_tpu_online_tail_lowers_to_mosaic(packed, tpu_lowering_target):
    fn, args, kwargs = _online(compress_tpu, packed)
    assert "tpu_custom_call" in _lower(fn, args, kwargs, "tpu")


@pytest.mark.parametrize("packed", [False, True], ids=["bf16", "fp8"])
def test_gpu_online_tail_lowers_to_triton(packed):
    fn, args, kwargs = _online(compress_gpu, packed)
    assert "triton" in _lower(fn, args, kwargs, "cuda")
