"""The only door to an op: each op of the hot path runs its jnp reference or a Pallas kernel.

  op                       reference (v4kv_jax)              kernels (pallas_kernels)
  emit_entries             compressor.emit_entries           compressor/{tpu,gpu}.py
  emit_entries_online      compressor.emit_entries_online    compressor/{tpu,gpu}.py
  index_scores             indexer.index_scores              indexer/{tpu,gpu}.py
  sparse_decode_attention  attention.sparse_decode_attention sparse_attention/{tpu,gpu}.py
  dense_decode_attention   attention.dense_decode_attention  dense_attention/{tpu,gpu}.py

`index_topk` (scores, then the reference top-k) and `decode_attention` (one CSA or HCA layer
read straight from a `Cache`) are built on them. Nothing else in the library calls a kernel
or chooses an implementation.

Implementations (`Options.implementation`): "reference" (pure jnp), "pallas_tpu" (Mosaic),
"pallas_gpu" (Triton-lowered) and "auto": Pallas on TPU and GPU, the reference on CPU (and
on a GPU whose config the GPU kernels cannot tile; see `gpu_support_problem`). Forcing a
Pallas implementation on a backend that cannot run it raises `KernelUnavailableError`, unless
`Options.interpret`, which runs the kernel in Pallas interpret mode on any backend (tests).
Kernels take what the reference takes (arrays as stored, RoPE frequencies, page tables) and
return what it returns; their own conventions stay inside their wrappers.

The choice is static (`Options` is hashable), so a jitted step traces once per
implementation and never branches at run time.
"""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp

from v4kv_jax import attention, compressor, indexer, paging, pools, rope, storage
from v4kv_jax.config import IMPLEMENTATIONS, AttentionConfig, CacheConfig, LayerKind, Options
from v4kv_jax.config import options_or_default as _options
from v4kv_jax.layout import CompressorSpec
from v4kv_jax.vectors import Queries

_BACKEND_OF = {"pallas_tpu": "tpu", "pallas_gpu": "gpu"}

# op -> (reference function, kernel folder, kernel function name)
_OPS = {
    "emit_entries": (compressor.emit_entries, "compressor", "emit_entries"),
    "emit_entries_online": (compressor.emit_entries_online, "compressor",
                            "emit_entries_online"),
    "index_scores": (indexer.index_scores, "indexer", "index_scores"),
    "sparse_decode_attention": (attention.sparse_decode_attention, "sparse_attention",
                                "sparse_decode_attention"),
    "dense_decode_attention": (attention.dense_decode_attention, "dense_attention",
                               "dense_decode_attention"),
}


class KernelUnavailableError(RuntimeError):
    """A forced Pallas implementation cannot run on the current backend."""


def resolve(implementation: str = "auto", *, interpret: bool = False,
            backend: str | None = None) -> str:
    """The concrete implementation ("reference", "pallas_tpu" or "pallas_gpu") to run.

    Args:
      implementation: one of `IMPLEMENTATIONS`.
      interpret: Pallas kernels will run in interpret mode, so any backend can run them.
      backend: the platform to decide for; default `jax.default_backend()`.
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation: expected one of {IMPLEMENTATIONS}; got "
                         f"{implementation!r}")
    backend = backend or jax.default_backend()
    if implementation == "auto":
        return {"tpu": "pallas_tpu", "gpu": "pallas_gpu"}.get(backend, "reference")
    if implementation == "reference" or interpret:
        return implementation
    needed = _BACKEND_OF[implementation]
    if backend != needed:
        raise KernelUnavailableError(
            f"implementation={implementation!r} needs a {needed.upper()} backend; the current "
            f"backend is {backend!r}. Use implementation='auto' or 'reference', or "
            f"interpret=True (Options(interpret=True)) to run it in interpret mode")
    return implementation


def gpu_support_problem(model: AttentionConfig) -> str | None:
    """Why the GPU (Triton) kernels cannot tile this config, or None if they can.

    Triton tensors have power-of-two shapes, so the row widths, the window and the tokens
    pooled into one entry must be powers of two (every V4 size is).
    """
    dims = {
        "head_dim": model.head_dim, "index_head_dim": model.index_head_dim,
        "window": model.window, "csa_ratio": model.csa_ratio, "hca_ratio": model.hca_ratio,
    }
    for name, value in dims.items():
        if value & (value - 1):
            return f"{name}={value} is not a power of two (needed by the GPU kernels)"
    return None


def selected(model: AttentionConfig, options: Options | None = None,
             implementation: str | None = None, interpret: bool | None = None,
             backend: str | None = None) -> tuple[str, bool]:
    """(implementation, interpret) for a config: arguments override the options' fields.

    "auto" on a GPU falls back to the reference when `gpu_support_problem` finds one; a
    forced "pallas_gpu" raises ValueError instead.
    """
    options = _options(options)
    requested = options.implementation if implementation is None else implementation
    interpret = options.interpret if interpret is None else interpret
    impl = resolve(requested, interpret=interpret, backend=backend)
    if impl == "pallas_gpu":
        problem = gpu_support_problem(model)
        if problem is not None:
            if requested == "auto":
                return "reference", interpret
            raise ValueError(f"implementation='pallas_gpu' cannot run this config: {problem}")
    return impl, interpret


def _kernel(op: str, model: AttentionConfig, options: Options | None, implementation,
            interpret) -> tuple[object | None, bool]:
    """(kernel function or None for the reference, interpret) of `op`."""
    impl, interpret = selected(model, options, implementation, interpret)
    if impl == "reference":
        return None, interpret
    _, folder, name = _OPS[op]
    module = importlib.import_module(f"pallas_kernels.{folder}.{_BACKEND_OF[impl]}")
    return getattr(module, name), interpret


def _read_formats(model: AttentionConfig, geometry: CacheConfig) -> dict:
    """Static format arguments of the decode attention kernels: they read the window ring and
    the entries as stored (packed rows decoded in the kernel)."""
    return dict(entry_format=geometry.entry_dtype, window_format=geometry.window_dtype,
                rope_dim=model.rope_dim)


def emit_entries(spec: CompressorSpec, model: AttentionConfig, geometry: CacheConfig,
                 options: Options | None = None, *, pool: jax.Array, page_rows: jax.Array,
                 layers: jax.Array, tail_kv: jax.Array, tail_gate: jax.Array,
                 slot_ids: jax.Array, kv: jax.Array, gate: jax.Array, start: jax.Array,
                 n_new: jax.Array, norm: jax.Array, implementation: str | None = None,
                 interpret: bool | None = None, block_sizes=None) -> jax.Array:
    """Entries of every block the chunk completes, written into the pool (in place under
    donation). Arguments as `compressor.emit_entries`; returns the updated pool.

    The Pallas kernels alias the pool to their output and donate it: called outside jit,
    the `pool` passed in is consumed (use the returned one).
    """
    arrays = dict(pool=pool, page_rows=page_rows, layers=layers, tail_kv=tail_kv,
                  tail_gate=tail_gate, slot_ids=slot_ids, kv=kv, gate=gate, start=start,
                  n_new=n_new, norm=norm)
    kernel, interpret = _kernel("emit_entries", model, options, implementation, interpret)
    codec = storage.codec(model, geometry, spec.name)
    if kernel is None or (codec.packed and codec.fmt not in
                          importlib.import_module(kernel.__module__).WRITES_PACKED):
        # A kernel that cannot encode the pool's packed format leaves it to the reference.
        return compressor.emit_entries(spec, model, geometry, **arrays)
    return kernel(*arrays.values(), rope.inv_frequencies(model, spec.kind), ratio=spec.ratio,
                  overlap=spec.overlap, eps=model.rms_eps, block_sizes=block_sizes,
                  interpret=interpret, entry_format=codec.fmt, rope_dim=codec.rope_dim)


def emit_entries_online(spec: CompressorSpec, model: AttentionConfig, geometry: CacheConfig,
                        options: Options | None = None, *, pool: jax.Array | None,
                        page_rows: jax.Array, layers: jax.Array, tail: pools.OnlineTail,
                        slot_ids: jax.Array, kv: jax.Array, gate: jax.Array, start: jax.Array,
                        n_new: jax.Array, norm: jax.Array, implementation: str | None = None,
                        interpret: bool | None = None, block_sizes=None
                        ) -> tuple[jax.Array | None, pools.OnlineTail]:
    """The HCA compressor with hca_tail="online": folds the chunk into the online tails and
    writes the entry of every block it completes (`compressor.emit_entries_online`; layout
    and update rule in the `pools` docstring). Returns (pool or None, `pools.OnlineTail`).

    The Pallas kernels alias the pool and the tails to their outputs and donate them: called
    outside jit, the arrays passed in are consumed (use the returned ones).
    """
    kernel, interpret = _kernel("emit_entries_online", model, options, implementation,
                                interpret)
    codec = storage.codec(model, geometry, spec.name)
    if kernel is None or (pool is not None and codec.packed and codec.fmt not in
                          importlib.import_module(kernel.__module__).WRITES_PACKED):
        return compressor.emit_entries_online(
            spec, model, geometry, pool=pool, page_rows=page_rows, layers=layers, tail=tail,
            slot_ids=slot_ids, kv=kv, gate=gate, start=start, n_new=n_new, norm=norm)
    del block_sizes  # one program per layer and row: nothing to tile
    pool, state = kernel(pool, page_rows, layers, tail.max, tail.sum, tail.weighted, slot_ids,
                         kv, gate, start, n_new, norm, rope.inv_frequencies(model, spec.kind),
                         ratio=spec.ratio, eps=model.rms_eps, interpret=interpret,
                         entry_format=codec.fmt, rope_dim=codec.rope_dim)
    return pool, pools.OnlineTail(*state)


def index_scores(model: AttentionConfig, geometry: CacheConfig, options: Options | None = None,
                 *, index_keys: jax.Array, layer, page_rows: jax.Array, index_q: jax.Array,
                 index_weights: jax.Array, q_pos: jax.Array, kv_end: jax.Array,
                 implementation: str | None = None, interpret: bool | None = None,
                 block_sizes=None) -> jax.Array:
    """f32[B, capacity]: indexer scores of one query per slot, -inf where not a candidate.

    Entries i < min((q_pos + 1) // m, kv_end // m) on present pages are candidates.
    Capacity is at least max_pages_per_seq * P // m.

    Args:
      index_keys: [n_csa, num_pages, P // m, c]; layer: index in the CSA stack.
      page_rows: i32[B, max_pages_per_seq].
      index_q: f32[B, nI, c] (RoPE per head); index_weights: f32[B, nI] raw head weights.
      q_pos, kv_end: i32[B].

    The query is prepared for the keys' format first (`indexer.prepare_index_query`: for
    fp4_index keys rotated and fake-quantised like them), for every implementation.
    """
    index_q = indexer.prepare_index_query(geometry, index_q)
    kernel, interpret = _kernel("index_scores", model, options, implementation, interpret)
    if kernel is None:
        return indexer.index_scores(
            model, geometry, _options(options), index_keys=index_keys, layer=layer,
            page_rows=page_rows, index_q=index_q[:, None], index_weights=index_weights[:, None],
            q_pos=q_pos[:, None], kv_end=kv_end)[:, 0]
    return kernel(index_q, index_weights, index_keys, layer, page_rows, q_pos, kv_end,
                  ratio=model.csa_ratio, block_sizes=block_sizes, interpret=interpret,
                  index_format=geometry.index_dtype)


def index_topk(model: AttentionConfig, geometry: CacheConfig, options: Options | None = None,
               **kwargs) -> jax.Array:
    """i32[B, k]: the indexer's top-k picks of one query per slot (-1 = unused pick).

    Scores come from `index_scores` (arguments as there); the selection is the reference's
    `indexer.picks_from_scores` for every implementation.
    """
    scores = index_scores(model, geometry, options, **kwargs)
    return indexer.picks_from_scores(model, geometry, scores[:, None], kwargs["kv_end"])[:, 0]


def sparse_decode_attention(model: AttentionConfig, geometry: CacheConfig,
                            options: Options | None = None, *, q: jax.Array, sink: jax.Array,
                            window: jax.Array, window_layer, slot_ids: jax.Array,
                            q_pos: jax.Array, kv_end: jax.Array, c4: jax.Array, c4_layer,
                            page_rows: jax.Array, picks: jax.Array,
                            implementation: str | None = None, interpret: bool | None = None,
                            block_sizes=None) -> jax.Array:
    """CSA decode attention of one query per slot (`attention.sparse_decode_attention`)."""
    args = (q, sink, window, window_layer, slot_ids, q_pos, kv_end, c4, c4_layer, page_rows,
            picks)
    kernel, interpret = _kernel("sparse_decode_attention", model, options, implementation,
                                interpret)
    if kernel is None:
        return attention.sparse_decode_attention(model, geometry, _options(options), *args)
    return kernel(*args, rope.inv_frequencies(model, LayerKind.CSA), block_sizes=block_sizes,
                  interpret=interpret, **_read_formats(model, geometry))


def dense_decode_attention(model: AttentionConfig, geometry: CacheConfig,
                           options: Options | None = None, *, q: jax.Array, sink: jax.Array,
                           window: jax.Array, window_layer, slot_ids: jax.Array,
                           q_pos: jax.Array, kv_end: jax.Array, c128: jax.Array, c128_layer,
                           page_rows: jax.Array, implementation: str | None = None,
                           interpret: bool | None = None, block_sizes=None) -> jax.Array:
    """HCA decode attention of one query per slot (`attention.dense_decode_attention`)."""
    args = (q, sink, window, window_layer, slot_ids, q_pos, kv_end, c128, c128_layer, page_rows)
    kernel, interpret = _kernel("dense_decode_attention", model, options, implementation,
                                interpret)
    if kernel is None:
        return attention.dense_decode_attention(model, geometry, _options(options), *args)
    return kernel(*args, rope.inv_frequencies(model, LayerKind.HCA), ratio=model.hca_ratio,
                  block_sizes=block_sizes, interpret=interpret, **_read_formats(model, geometry))


def decode_attention(cache: pools.Cache, kind: LayerKind, layer, kind_layer, queries: Queries,
                     slot_ids: jax.Array, q_pos: jax.Array, kv_end: jax.Array,
                     options: Options | None = None, *, implementation: str | None = None,
                     interpret: bool | None = None) -> tuple[jax.Array, jax.Array | None]:
    """One layer's attention for one query per slot, read from a `Cache`.

    Args:
      cache: a `pools.Cache` whose window ring already holds every position below kv_end.
      kind: the layer's kind (static); layer: global layer (window ring); kind_layer: index
        in the kind's stack.
      queries: `Queries` with T = 1 (CSA: index_q and index_weights too).
      slot_ids, q_pos, kv_end: i32[B]; a row whose slot id is outside [0, max_slots) must
        have kv_end 0: it reads nothing.

    Returns:
      (f32[B, 1, H, hd] de-rotated, the CSA picks i32[B, 1, k] or None).
    """
    model, geo = cache.attn_config, cache.geometry
    page_rows = paging.slot_rows(cache.pages, slot_ids)
    slot_ids = jnp.clip(slot_ids, 0, geo.max_slots - 1)  # a row with kv_end 0 reads nothing
    window = pools.window_ring(cache)
    q, sink = queries.q[:, 0], queries.sink
    common = dict(q=q, sink=sink, window=window, window_layer=layer, slot_ids=slot_ids,
                  q_pos=q_pos, kv_end=kv_end, page_rows=page_rows,
                  implementation=implementation, interpret=interpret)
    if kind == LayerKind.SWA:
        out = attention.attend(model, geo, _options(options), kind, layer=kind_layer,
                               entries=None, page_rows=page_rows, q=queries.q, sink=sink,
                               q_pos=q_pos[:, None], kv_end=kv_end,
                               window_keys=attention.ordered_window(window[layer, slot_ids],
                                                                    kv_end),
                               window_base=kv_end - model.window)
        return out, None
    if kind == LayerKind.CSA:
        picks = index_topk(model, geo, options, index_keys=pools.entries(cache, "csa_index"),
                           layer=kind_layer, page_rows=page_rows,
                           index_q=queries.index_q[:, 0],
                           index_weights=queries.index_weights[:, 0], q_pos=q_pos,
                           kv_end=kv_end, implementation=implementation, interpret=interpret)
        out = sparse_decode_attention(model, geo, options, c4=pools.entries(cache, "csa"),
                                      c4_layer=kind_layer, picks=picks, **common)
        return out[:, None], picks[:, None]
    out = dense_decode_attention(model, geo, options, c128=pools.entries(cache, "hca"),
                                 c128_layer=kind_layer, **common)
    return out[:, None], None


__all__ = [
    "IMPLEMENTATIONS", "KernelUnavailableError", "decode_attention", "dense_decode_attention",
    "emit_entries", "emit_entries_online", "gpu_support_problem", "index_scores",
    "index_topk", "resolve", "selected", "sparse_decode_attention",
]
