"""Every kernel lowers for its platform at V4 sizes (hd 512, r 64, 64 heads, W 128, c 128,
k 512, P 256; bf16 storage, and the read kernels also on the packed release formats), on
planes laid out as the cache lays them out (`v4kv_jax.pools.lanes`): TPU kernels to Mosaic,
GPU kernels to Triton IR.

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
from v4kv_jax.pools import storage

B, H, HD, W, NI, C, K = 4, 64, 512, 128, 64, 128, 512
P, PAGES, MAX_PAGES, LAYERS, KIND_LAYERS, T = 256, 64, 32, 4, 2, 64
F32, I32 = jnp.float32, jnp.int32


def sds(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


def stored(fmt: str, width: int, records: int, lead: tuple, rope_dim: int = 0):
    """(planes as shape structs, lane map spec) of a stored array of `records`-row blocks
    with leading dims `lead`, as the cache lays it out (`v4kv_jax.pools.lanes`)."""
    lanes = storage.RowCodec(fmt, width, rope_dim).lanes(records)
    return tuple(sds(shape, lanes.dtype) for shape in lanes.shapes(lead)), lanes.spec


ROWS, FREQ = sds((B, MAX_PAGES), I32), sds((32,), F32)  # inv_freq of 64 RoPE dims


def _attention(packed: bool) -> tuple[tuple, dict]:
    """(the decode attention's arguments up to the entries, its format keywords): the
    window in bf16, or in fp8_latent with the entries (the release formats)."""
    fmt, rope = ("fp8_latent", 64) if packed else ("bfloat16", 0)
    window, lanes = stored(fmt, HD, W, (LAYERS, B), rope)
    args = (sds((B, H, HD), F32), sds((H,), F32), window, sds((), I32), sds((B,), I32),
            sds((B,), I32), sds((B,), I32))
    return args, dict(entry_format=fmt, window_format=fmt, rope_dim=64, window_lanes=lanes)


def _entries(packed: bool, records: int):
    return stored("fp8_latent" if packed else "bfloat16", HD, records, (KIND_LAYERS, PAGES),
                  64 if packed else 0)


def _sparse(module, packed=False):
    args, kwargs = _attention(packed)
    c4, lanes = _entries(packed, P // 4)
    return module.sparse_decode_attention, (
        *args, c4, sds((), I32), ROWS, sds((B, K), I32), FREQ), dict(kwargs, entry_lanes=lanes)


def _dense(module, packed=False):
    args, kwargs = _attention(packed)
    c128, lanes = _entries(packed, P // 128)
    return module.dense_decode_attention, (*args, c128, sds((), I32), ROWS, FREQ), dict(
        kwargs, entry_lanes=lanes, ratio=128)


def _indexer(module, packed=False):
    fmt = "fp4_index" if packed else "bfloat16"
    keys, lanes = stored(fmt, C, P // 4, (KIND_LAYERS, PAGES))
    return module.index_scores, (
        sds((B, NI, C), F32), sds((B, NI), F32), keys, sds((), I32), ROWS, sds((B,), I32),
        sds((B,), I32)), dict(ratio=4, index_format=fmt, index_lanes=lanes)


def _compress(module, ratio, overlap, packed=False, width=HD):
    """packed: fp8_latent entries (width HD), fp4_index keys (width C); else bf16."""
    in_width = 2 * width if overlap else width
    ring = 2 * ratio if overlap else ratio
    fmt = ("fp8_latent" if width == HD else "fp4_index") if packed else "bfloat16"
    pool, pool_lanes = stored(fmt, width, P // ratio, (KIND_LAYERS, PAGES),
                              64 if fmt == "fp8_latent" else 0)
    tail, tail_lanes = stored("float32", in_width, ring, (KIND_LAYERS, B))
    return module.emit_entries, (
        pool, ROWS, sds((KIND_LAYERS,), I32), tail, tail, sds((B,), I32),
        sds((KIND_LAYERS, B, T, in_width), F32), sds((KIND_LAYERS, B, T, in_width), F32),
        sds((B,), I32), sds((B,), I32), sds((KIND_LAYERS, width), F32), FREQ), dict(
        ratio=ratio, overlap=overlap, eps=1e-6, entry_format=fmt, rope_dim=64,
        entry_lanes=pool_lanes, tail_lanes=tail_lanes)


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
    fmt = "fp8_latent" if packed else "bfloat16"
    pool, pool_lanes = stored(fmt, HD, P // 128, (KIND_LAYERS, PAGES), 64 if packed else 0)
    tail, tail_lanes = stored("float32", HD, 1, (KIND_LAYERS, B))
    return module.emit_entries_online, (
        pool, ROWS, sds((KIND_LAYERS,), I32), tail, tail, tail, sds((B,), I32),
        sds((KIND_LAYERS, B, T, HD), F32), sds((KIND_LAYERS, B, T, HD), F32), sds((B,), I32),
        sds((B,), I32), sds((KIND_LAYERS, HD), F32), FREQ), dict(
        ratio=128, eps=1e-6, entry_format=fmt, rope_dim=64, entry_lanes=pool_lanes,
        tail_lanes=tail_lanes)


@pytest.mark.parametrize("packed", [False, True], ids=["bf16", "fp8"])
def test_tpu_online_tail_lowers_to_mosaic(packed, tpu_lowering_target):
    fn, args, kwargs = _online(compress_tpu, packed)
    assert "tpu_custom_call" in _lower(fn, args, kwargs, "tpu")


@pytest.mark.parametrize("packed", [False, True], ids=["bf16", "fp8"])
def test_gpu_online_tail_lowers_to_triton(packed):
    fn, args, kwargs = _online(compress_gpu, packed)
    assert "triton" in _lower(fn, args, kwargs, "cuda")
