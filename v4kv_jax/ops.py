"""Dispatcher: the jnp reference or a Pallas kernel for each op of the decode path.

Ops (each takes `implementation` and `interpret`; None = from `geometry.kernels` and
`geometry.interpret_kernels`):
  emit_entries             pool completed blocks, RMSNorm, RoPE, write into the pool (prefill
                           and decode)
  index_scores             indexer scores of one decode query per slot over its visible keys
  index_topk               the same, then the top-k picks (-1 padded)
  sparse_decode_attention  CSA: window + top-k C4 entries, one softmax with the sink
  dense_decode_attention   HCA: window + every visible C128 entry, same softmax
  decode_attention         one CSA or HCA layer's decode attention straight from a `Cache`
                           (what `step.decode_attention` and `step.layer_step` call)

Implementations: "reference" (pure jnp, `v4kv_jax.attention` / `compressor`), "pallas_tpu"
(Mosaic kernels in `pallas_kernels/*/tpu.py`), "pallas_gpu" (Triton-lowered kernels in
`pallas_kernels/*/gpu.py`) and "auto": Pallas on TPU and GPU, the reference on CPU (and on a
GPU whose config the GPU kernels cannot tile; see `gpu_support_problem`). Forcing a Pallas
implementation on a backend that cannot run it raises `KernelUnavailableError`, unless
`interpret=True`, which runs the kernel in Pallas interpret mode on any backend (tests).

The choice is static: it lives in the (hashable) `CacheConfig`, so a jitted step traces
once per implementation and never branches at run time.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from v4kv_jax import attention, paging, rope
from v4kv_jax import compressor as comp
from v4kv_jax.attention import Queries
from v4kv_jax.config import KERNEL_IMPLEMENTATIONS, AttentionConfig, CacheConfig, LayerKind

IMPLEMENTATIONS = KERNEL_IMPLEMENTATIONS
_BACKEND_OF = {"pallas_tpu": "tpu", "pallas_gpu": "gpu"}


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
        raise ValueError(f"implementation={implementation!r} must be one of {IMPLEMENTATIONS}")
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
            f"interpret=True (CacheConfig(interpret_kernels=True)) to run it in interpret mode")
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


def selected(model: AttentionConfig, geometry: CacheConfig, implementation: str | None = None,
             interpret: bool | None = None, backend: str | None = None) -> tuple[str, bool]:
    """(implementation, interpret) for a config: arguments override the geometry's fields.

    "auto" on a GPU falls back to the reference when `gpu_support_problem` finds one; a
    forced "pallas_gpu" raises ValueError instead.
    """
    requested = geometry.kernels if implementation is None else implementation
    interpret = geometry.interpret_kernels if interpret is None else interpret
    impl = resolve(requested, interpret=interpret, backend=backend)
    if impl == "pallas_gpu":
        problem = gpu_support_problem(model)
        if problem is not None:
            if requested == "auto":
                return "reference", interpret
            raise ValueError(f"implementation='pallas_gpu' cannot run this config: {problem}")
    return impl, interpret


def uses_kernels(model: AttentionConfig, geometry: CacheConfig) -> bool:
    """Whether the config's decode path runs Pallas kernels (False: the jnp reference)."""
    return selected(model, geometry)[0] != "reference"


def _lane_freq(model: AttentionConfig, kind: LayerKind, width: int) -> jax.Array:
    from pallas_kernels.common import lane_frequencies

    return jnp.asarray(lane_frequencies(rope.inv_frequencies(model, kind), width))


# --- compressor ---------------------------------------------------------------------------------


def emit_entries(spec: comp.CompressorSpec, model: AttentionConfig, geometry: CacheConfig,
                 pool: jax.Array, page_rows: jax.Array, layers: jax.Array, tail_kv: jax.Array,
                 tail_gate: jax.Array, slot_ids: jax.Array, kv: jax.Array, gate: jax.Array,
                 start: jax.Array, n_new: jax.Array, norm: jax.Array, *,
                 implementation: str | None = None, interpret: bool | None = None,
                 block_sizes=None) -> jax.Array:
    """Entries of every block the chunk completes, written into the pool (in place under
    donation). Arguments as `compressor.emit_entries`; returns the updated pool.

    The Pallas kernels alias the pool to their output and donate it: called outside jit,
    the `pool` passed in is consumed (use the returned one).
    """
    impl, interpret = selected(model, geometry, implementation, interpret)
    if impl == "reference":
        return comp.emit_entries(spec, model, geometry, pool, page_rows, layers, tail_kv,
                                 tail_gate, slot_ids, kv, gate, start, n_new, norm)
    from pallas_kernels.compress import gpu, tpu

    module = tpu if impl == "pallas_tpu" else gpu
    return module.emit_entries(
        pool, page_rows, layers, tail_kv, tail_gate, slot_ids, kv, gate, start, n_new, norm,
        _lane_freq(model, spec.kind, spec.width), ratio=spec.ratio, overlap=spec.overlap,
        eps=model.rms_eps, block_sizes=block_sizes, interpret=interpret)


# --- indexer ------------------------------------------------------------------------------------


def index_scores(model: AttentionConfig, geometry: CacheConfig, index_keys: jax.Array, layer,
                 page_rows: jax.Array, index_q: jax.Array, index_weights: jax.Array,
                 q_pos: jax.Array, kv_end: jax.Array, *, implementation: str | None = None,
                 interpret: bool | None = None, block_sizes=None) -> jax.Array:
    """f32[B, capacity]: indexer scores of one query per slot, -inf where not a candidate.

    Entries i < min((q_pos + 1) // m, kv_end // m) on present pages are candidates; ids past
    the used pages are -inf. Capacity is at least max_pages_per_seq * P // m.

    Args:
      index_keys: [n_csa, num_pages, P // m, c]; layer: index in the CSA stack.
      page_rows: i32[B, max_pages_per_seq].
      index_q: f32[B, nI, c] (RoPE per head); index_weights: f32[B, nI] raw head weights.
      q_pos, kv_end: i32[B].
    """
    impl, interpret = selected(model, geometry, implementation, interpret)
    if impl == "reference":
        queries = Queries(q=None, sink=None, index_q=index_q[:, None],
                          index_weights=index_weights[:, None])
        scores = attention.score_visible_keys(model, geometry, index_keys, layer, page_rows,
                                              queries, q_pos[:, None], kv_end)
        return scores[:, 0]
    from pallas_kernels.common import MASKED_BELOW
    from pallas_kernels.indexer import gpu, tpu

    module = tpu if impl == "pallas_tpu" else gpu
    scores = module.index_scores(
        index_q, index_weights, index_keys, layer, page_rows, q_pos, kv_end,
        ratio=model.csa_ratio, block_sizes=block_sizes, interpret=interpret)
    # Ids past what the kernel visited hold whatever the output buffer held.
    visible = jnp.minimum((q_pos + 1) // model.csa_ratio, kv_end // model.csa_ratio)
    ids = jnp.arange(scores.shape[1], dtype=jnp.int32)[None, :]
    return jnp.where((ids < visible[:, None]) & (scores > MASKED_BELOW), scores, -jnp.inf)


def index_topk(model: AttentionConfig, geometry: CacheConfig, index_keys: jax.Array, layer,
               page_rows: jax.Array, index_q: jax.Array, index_weights: jax.Array,
               q_pos: jax.Array, kv_end: jax.Array, *, implementation: str | None = None,
               interpret: bool | None = None, block_sizes=None) -> jax.Array:
    """i32[B, k]: the indexer's top-k picks of one query per slot (-1 = unused pick).

    Scores come from `index_scores`; the selection is `attention.topk_of_scores` (a
    `lax.top_k` over a power-of-two prefix that follows the context) for every
    implementation. Arguments as `index_scores`.
    """
    scores = index_scores(model, geometry, index_keys, layer, page_rows, index_q,
                          index_weights, q_pos, kv_end, implementation=implementation,
                          interpret=interpret, block_sizes=block_sizes)
    picks = attention.topk_of_scores(scores[:, None], kv_end // model.csa_ratio,
                                     model.index_topk, geometry.entries_per_page(model.csa_ratio))
    return picks[:, 0]


# --- decode attention ---------------------------------------------------------------------------


def _ordered_window(ring: jax.Array, kv_end: jax.Array) -> jax.Array:
    """[B, W, hd] ring -> keys ordered by position: key e is position kv_end - W + e."""
    W = ring.shape[1]
    rows = (kv_end[:, None] - W + jnp.arange(W, dtype=jnp.int32)[None, :]) % W
    return jnp.take_along_axis(ring, rows[..., None], axis=1)


def _reference_decode(model, geometry, kind, q, sink, window, window_layer, slot_ids, q_pos,
                      kv_end, entries, entry_layer, page_rows, picks=None):
    ring = window[window_layer, slot_ids]
    queries = Queries(q=q[:, None], sink=sink)
    out = attention.attend(
        model, geometry, kind, entry_layer, entries, None, page_rows, queries, q_pos[:, None],
        kv_end, _ordered_window(ring, kv_end), kv_end - model.window,
        picks=None if picks is None else picks[:, None])
    return out[:, 0]


def sanitize_picks(geometry: CacheConfig, model: AttentionConfig, page_rows: jax.Array,
                   picks: jax.Array) -> jax.Array:
    """i32[B, k]: picks with -1 wherever the pick or its page is absent (what the reference
    skips), so a kernel only has to test `pick >= 0`."""
    page, _ = paging.entry_pages(page_rows, picks, geometry.entries_per_page(model.csa_ratio))
    return jnp.where((picks >= 0) & (page >= 0), picks, -1).astype(jnp.int32)


def sparse_decode_attention(model: AttentionConfig, geometry: CacheConfig, q: jax.Array,
                            sink: jax.Array, window: jax.Array, window_layer, slot_ids: jax.Array,
                            q_pos: jax.Array, kv_end: jax.Array, c4: jax.Array, c4_layer,
                            page_rows: jax.Array, picks: jax.Array, *,
                            implementation: str | None = None, interpret: bool | None = None,
                            block_sizes=None) -> jax.Array:
    """CSA decode attention of one query per slot: window ring + picked C4 entries.

    Args:
      q: f32[B, H, hd] (RoPE applied); sink: f32[H].
      window: the State pool's rings [n_layers, max_slots, W, hd]; window_layer: global layer.
      slot_ids, q_pos, kv_end: i32[B]: the slot, the query position and the tokens in the
        sequence (the ring holds every position below kv_end).
      c4: [n_csa, num_pages, P // m, hd]; c4_layer: index in the CSA stack.
      page_rows: i32[B, max_pages_per_seq]; picks: i32[B, k] entry ids (-1 = none).

    Returns:
      f32[B, H, hd], de-rotated by -q_pos.
    """
    impl, interpret = selected(model, geometry, implementation, interpret)
    if impl == "reference":
        return _reference_decode(model, geometry, LayerKind.CSA, q, sink, window, window_layer,
                                 slot_ids, q_pos, kv_end, c4, c4_layer, page_rows, picks)
    from pallas_kernels.sparse_attention import gpu, tpu

    module = tpu if impl == "pallas_tpu" else gpu
    return module.sparse_decode_attention(
        q, sink, window, window_layer, slot_ids, q_pos, kv_end, c4, c4_layer, page_rows,
        sanitize_picks(geometry, model, page_rows, picks),
        _lane_freq(model, LayerKind.CSA, model.head_dim),
        block_sizes=block_sizes, interpret=interpret)


def dense_decode_attention(model: AttentionConfig, geometry: CacheConfig, q: jax.Array,
                           sink: jax.Array, window: jax.Array, window_layer, slot_ids: jax.Array,
                           q_pos: jax.Array, kv_end: jax.Array, c128: jax.Array, c128_layer,
                           page_rows: jax.Array, *, implementation: str | None = None,
                           interpret: bool | None = None, block_sizes=None) -> jax.Array:
    """HCA decode attention of one query per slot: window ring + every visible C128 entry.

    Entries i < min((q_pos + 1) // m', kv_end // m') are read through the page table; the
    held pages of a row are a prefix of it (`paging`), which the kernels rely on. Arguments
    as `sparse_decode_attention` without picks; c128 is [n_hca, num_pages, P // m', hd].
    """
    impl, interpret = selected(model, geometry, implementation, interpret)
    if impl == "reference":
        return _reference_decode(model, geometry, LayerKind.HCA, q, sink, window, window_layer,
                                 slot_ids, q_pos, kv_end, c128, c128_layer, page_rows)
    from pallas_kernels.dense_attention import gpu, tpu

    module = tpu if impl == "pallas_tpu" else gpu
    return module.dense_decode_attention(
        q, sink, window, window_layer, slot_ids, q_pos, kv_end, c128, c128_layer, page_rows,
        _lane_freq(model, LayerKind.HCA, model.head_dim), ratio=model.hca_ratio,
        block_sizes=block_sizes, interpret=interpret)


def decode_attention(cache, kind: LayerKind, layer, kind_layer, queries: Queries,
                     slot_ids: jax.Array, q_pos: jax.Array, kv_end: jax.Array, *,
                     implementation: str | None = None, interpret: bool | None = None
                     ) -> jax.Array:
    """One CSA or HCA layer's attention for one query per slot, read from a `Cache`.

    Args:
      cache: a `pools.Cache` whose window ring already holds every position below kv_end.
      kind: LayerKind.CSA or LayerKind.HCA (static); layer: global layer (window ring);
        kind_layer: index in the kind's stack.
      queries: `Queries` with T = 1 (CSA: index_q and index_weights too).
      slot_ids, q_pos, kv_end: i32[B]; a row whose slot id is outside [0, max_slots) must
        have kv_end 0: it reads nothing.

    Returns:
      f32[B, 1, H, hd], de-rotated.
    """
    if kind not in (LayerKind.CSA, LayerKind.HCA):
        raise ValueError(f"kind={kind!r}: decode kernels exist for CSA and HCA layers only")
    model, geo = cache.model, cache.geometry
    page_rows = paging.slot_rows(cache.pages, slot_ids)
    slot_ids = jnp.clip(slot_ids, 0, geo.max_slots - 1)  # a row with kv_end 0 reads nothing
    q, sink = queries.q[:, 0], queries.sink
    options = dict(implementation=implementation, interpret=interpret)
    if kind == LayerKind.CSA:
        picks = index_topk(model, geo, cache.classical.index_keys, kind_layer, page_rows,
                           queries.index_q[:, 0], queries.index_weights[:, 0], q_pos, kv_end,
                           **options)
        out = sparse_decode_attention(model, geo, q, sink, cache.state.window, layer, slot_ids,
                                      q_pos, kv_end, cache.classical.c4, kind_layer, page_rows,
                                      picks, **options)
    else:
        out = dense_decode_attention(model, geo, q, sink, cache.state.window, layer, slot_ids,
                                     q_pos, kv_end, cache.classical.c128, kind_layer, page_rows,
                                     **options)
    return out[:, None]


__all__ = [
    "IMPLEMENTATIONS", "KernelUnavailableError", "decode_attention", "dense_decode_attention",
    "emit_entries", "gpu_support_problem", "index_scores", "index_topk", "resolve",
    "sanitize_picks", "selected", "sparse_decode_attention", "uses_kernels",
]
