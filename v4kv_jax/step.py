"""Appending tokens to the cache (decode and chunked prefill) and the per-layer attention.

One mechanism serves decode (T = 1) and prefill (any T, any start length, any chunking):

  begin_append   validate lengths, take the pages the new tokens need (all or nothing per slot)
  append_layers  per layer: window ring writes, compressor tail writes, and every block that
                 completes is pooled and written into its page and row
  end_append     advance the lengths

`decode_step` and `prefill` run the three over all layers, given every layer's token vectors
(jitted, cache donated). A model calls `begin_append`, then `layer_step` per layer (append
that layer and attend), then `end_append`, since a layer's inputs depend on the layer below.
A slot that cannot get its pages, or would pass the configured maximum length, appends
nothing at all and is flagged in `state.status`; other slots are unaffected.

The compressor emission and the decode attention (T = 1) of CSA and HCA layers go through
`ops`, which runs the jnp reference or a Pallas kernel as `CacheConfig.kernels` says.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from v4kv_jax import checks, ops, paging
from v4kv_jax import compressor as comp
from v4kv_jax.attention import Queries, attend
from v4kv_jax.compressor import CompressorInput, CompressorParams, CompressorWeights
from v4kv_jax.config import LayerKind
from v4kv_jax.pools import Cache, SlotStatus


@struct.dataclass
class TokenVectors:
    """New-token vectors of every layer, stacked per kind.

    Attributes:
      window: [n_layers, B, T, hd], the window key/value RoPE_t(RMSNorm(W_kv x_t)).
      csa: main compressor inputs of CSA layers, [n_csa, B, T, 2 hd] each.
      csa_index: indexer compressor inputs of CSA layers, [n_csa, B, T, 2 c] each.
      hca: compressor inputs of HCA layers, [n_hca, B, T, hd] each.
    """

    window: jax.Array
    csa: CompressorInput
    csa_index: CompressorInput
    hca: CompressorInput

    def compressor(self, name: str) -> CompressorInput:
        return getattr(self, name)


@struct.dataclass
class LayerVectors:
    """New-token vectors of ONE layer: window [B, T, hd]; compressor inputs [B, T, w] for CSA
    (main and index) and HCA (main) layers, None otherwise."""

    window: jax.Array
    compressor: CompressorInput | None = None
    index_compressor: CompressorInput | None = None


@struct.dataclass
class LayerParams:
    """Cache-side params of ONE layer: compressor and index compressor (ape [m, w], norm [w])."""

    compressor: CompressorParams | None = None
    index_compressor: CompressorParams | None = None


@struct.dataclass
class LayerRef:
    """Which layer: its kind (static), its global index (window ring) and its index in the
    stack of its kind. Indices may be traced, e.g. inside a scan over layer groups."""

    layer: jax.Array
    kind_layer: jax.Array
    kind: LayerKind = struct.field(pytree_node=False)

    @classmethod
    def of(cls, cache: Cache, layer: int) -> LayerRef:
        layer = checks.integer("layer", layer, lo=0, hi=cache.model.num_layers - 1)
        kind = cache.model.layer_kinds[layer]
        return cls(jnp.int32(layer), jnp.int32(cache.model.kind_index(layer)), kind)


@struct.dataclass
class AppendPlan:
    """Who appends how much in one step.

    Attributes:
      slot_ids: i32[B], the row's slot, or max_slots for a row that neither reads nor writes
        any slot (its slot id was outside [0, max_slots), or the row broke a rule).
      start: i32[B], the slot's length before the append (0 for such rows).
      n_new: i32[B], tokens granted (0 for a row that appends nothing).
    """

    slot_ids: jax.Array
    start: jax.Array
    n_new: jax.Array

    @property
    def end(self) -> jax.Array:
        return self.start + self.n_new

    def positions(self, tokens: int) -> jax.Array:
        """i32[B, T]: the absolute positions of the chunk's tokens (RoPE positions)."""
        return self.start[:, None] + jnp.arange(tokens, dtype=jnp.int32)[None, :]


def page_rows(cache: Cache, slot_ids: jax.Array) -> jax.Array:
    """i32[B, max_pages_per_seq]: the page-table rows of `slot_ids` (`paging.slot_rows`)."""
    return paging.slot_rows(cache.pages, slot_ids)


def _read_slots(cache: Cache, slot_ids: jax.Array) -> jax.Array:
    """Slot ids clipped into [0, max_slots) for reads of per-slot State rows; callers mask
    what a clipped row reads by its length (0 for rows that read nothing)."""
    return jnp.clip(slot_ids, 0, cache.geometry.max_slots - 1)


# --- the three phases ------------------------------------------------------------------------


def begin_append(cache: Cache, slot_ids, n_new, tokens: int, *, reject=None
                 ) -> tuple[Cache, AppendPlan]:
    """Takes the pages `n_new` more tokens need in each slot; flags slots that cannot append.

    Device-side rules (they hold inside a caller's jit, where nothing can raise):
      * a row whose slot id is outside [0, max_slots) (e.g. -1 for batch padding) appends
        nothing and reads nothing (its attention output is zeros);
      * a row naming a slot an earlier row of the call already named, a row with n_new
        outside [0, tokens], and a row marked in `reject` append and read nothing, and their
        slot is flagged REJECTED (unless FREE);
      * a slot that is not ACTIVE (FREE or flagged) appends nothing;
      * a slot whose pages do not fit appends nothing and is flagged OUT_OF_PAGES, one that
        would pass `max_seq_len` OVER_CAPACITY (`pools.clear_flags` makes them ACTIVE).
    Called with concrete arguments, the first two rules raise ValueError instead.

    Args:
      cache: the cache.
      slot_ids: i32[B], distinct slots.
      n_new: i32[B], tokens each slot appends (0 <= n_new <= tokens).
      tokens: T, the static chunk length (>= 1).
      reject: optional bool[B], rows the caller found invalid (e.g. token ids outside the
        vocabulary).
    """
    geo = cache.geometry
    S = geo.max_slots
    tokens = checks.integer("tokens", tokens, lo=1)
    if checks.concrete(slot_ids, n_new):
        check_rows(cache, slot_ids, n_new, tokens)
    slot_ids = jnp.asarray(slot_ids, jnp.int32)
    n_new = jnp.asarray(n_new, jnp.int32)
    in_range = (slot_ids >= 0) & (slot_ids < S)
    row = jnp.arange(slot_ids.shape[0])
    repeated = jnp.any((slot_ids[:, None] == slot_ids[None, :]) & (row[None, :] < row[:, None]),
                       axis=1)
    broken = repeated | (n_new < 0) | (n_new > tokens)
    if reject is not None:
        broken = broken | jnp.asarray(reject, bool)
    ok = in_range & ~broken
    ids = jnp.where(ok, slot_ids, S)
    read = jnp.clip(ids, 0, S - 1)
    status = jnp.where(ok, cache.state.status[read], SlotStatus.FREE)
    start = jnp.where(ok, cache.state.lengths[read], 0)
    wants = (n_new > 0) & (status == SlotStatus.ACTIVE)
    over = start + n_new > geo.max_seq_len
    max_new_pages = -(-tokens // geo.page_tokens) + 1
    pages, granted = paging.allocate(cache.pages, ids, start + n_new, wants & ~over,
                                     geo.page_tokens, max_new_pages)
    flag = jnp.where(over, SlotStatus.OVER_CAPACITY, SlotStatus.OUT_OF_PAGES)
    new_status = cache.state.status.at[ids].max(jnp.where(wants & ~granted, flag, status),
                                                mode="drop")
    # A broken row flags the slot it named, unless that slot is FREE (nothing to protect).
    named = jnp.where(in_range & broken, slot_ids, S)
    current = new_status[jnp.clip(named, 0, S - 1)]
    new_status = new_status.at[named].max(
        jnp.where(current != SlotStatus.FREE, SlotStatus.REJECTED, SlotStatus.FREE), mode="drop")
    state = cache.state.replace(status=new_status)
    plan = AppendPlan(slot_ids=ids, start=start, n_new=jnp.where(granted, n_new, 0))
    return cache.replace(pages=pages, state=state), plan


def end_append(cache: Cache, plan: AppendPlan) -> Cache:
    lengths = cache.state.lengths.at[plan.slot_ids].add(plan.n_new, mode="drop")
    return cache.replace(state=cache.state.replace(lengths=lengths))


def _after(x: jax.Array, dep: jax.Array) -> jax.Array:
    """x, bit for bit, data-dependent on `dep` through a term that is always +0 (NaN included;
    x - (+0) keeps even -0) and that XLA cannot fold.

    XLA:CPU puts an in-place write of a buffer after an earlier read of it only when the
    written values depend on the read; otherwise (an optimization barrier does not help) it
    copies the whole buffer, every step. Pass the read's result as `dep`.
    """
    d = dep.ravel()[0]
    return x - ((d != d) & (d == d)).astype(x.dtype)


def _write_window(cache: Cache, plan: AppendPlan, layers: jax.Array, window: jax.Array
                  ) -> Cache:
    """window: [n, B, T, hd] for global layers `layers` i32[n]."""
    W = cache.model.window
    tokens = window.shape[2]
    j = jnp.arange(tokens, dtype=jnp.int32)[None, :]
    n = plan.n_new[:, None]
    keep = (j < n) & (j >= n - W)  # each ring row written at most once
    row = jnp.where(keep, (plan.start[:, None] + j) % W, W)
    ring = cache.state.window.at[layers[:, None, None], plan.slot_ids[None, :, None],
                                 row[None]].set(window.astype(cache.state.window.dtype),
                                                mode="drop")
    return cache.replace(state=cache.state.replace(window=ring))


def _append_compressor(cache: Cache, plan: AppendPlan, spec: comp.CompressorSpec,
                       layers: jax.Array, inputs: CompressorInput, params: CompressorParams
                       ) -> Cache:
    """Tail writes and entry emission of one compressor for the layers `layers` (kind stack
    indices i32[n]); inputs [n, B, T, w], params ape [n, m, w] and norm [n, width]."""
    model, geo = cache.model, cache.geometry
    tokens = inputs.kv.shape[2]
    positions = plan.positions(tokens)
    kv = inputs.kv.astype(jnp.float32)
    gate = jax.vmap(lambda g, ape: comp.biased_gate(spec, g, ape, positions))(inputs.gate,
                                                                              params.ape)
    tail = cache.state.tail(spec.name)
    pool = ops.emit_entries(
        spec, model, geo, cache.classical.entries(spec.name), page_rows(cache, plan.slot_ids),
        layers, tail.kv, tail.gate, _read_slots(cache, plan.slot_ids), kv, gate, plan.start,
        plan.n_new, params.norm)

    ring_row = comp.tail_writes(spec, plan.start, plan.n_new, tokens)
    idx = (layers[:, None, None], plan.slot_ids[None, :, None], ring_row[None])
    # The emission read the tails: the writes below must come after it.
    new_tail = tail.replace(
        kv=tail.kv.at[idx].set(_after(kv, pool).astype(tail.kv.dtype), mode="drop"),
        gate=tail.gate.at[idx].set(_after(gate, pool).astype(tail.gate.dtype), mode="drop"),
    )
    return cache.replace(
        classical=cache.classical.with_entries(spec.name, pool),
        state=cache.state.replace(**{spec.name: new_tail}),
    )


def append_layers(cache: Cache, plan: AppendPlan, vectors: TokenVectors,
                  weights: CompressorWeights) -> Cache:
    """Appends the planned tokens to every layer."""
    model = cache.model
    cache = _write_window(cache, plan, jnp.arange(model.num_layers, dtype=jnp.int32),
                          vectors.window)
    for spec in cache.specs:
        n = len(model.layers_of(spec.kind))
        if n:
            cache = _append_compressor(cache, plan, spec, jnp.arange(n, dtype=jnp.int32),
                                       vectors.compressor(spec.name),
                                       getattr(weights, spec.name))
    return cache


# --- attention --------------------------------------------------------------------------------


def _ordered_ring(ring: jax.Array, length: jax.Array) -> jax.Array:
    """[B, W, hd] ring -> keys ordered by position: key e is position length - W + e."""
    W = ring.shape[1]
    e = jnp.arange(W, dtype=jnp.int32)[None, :]
    rows = (length[:, None] - W + e) % W
    return jnp.take_along_axis(ring, rows[..., None], axis=1)


def _attend_layer(cache: Cache, ref: LayerRef, page_rows, queries: Queries, q_pos, kv_end,
                  window_keys, window_base):
    kind = ref.kind
    entries = index_keys = None
    if kind == LayerKind.CSA:
        entries, index_keys = cache.classical.c4, cache.classical.index_keys
    elif kind == LayerKind.HCA:
        entries = cache.classical.c128
    return attend(cache.model, cache.geometry, kind, ref.kind_layer, entries, index_keys,
                  page_rows, queries, q_pos, kv_end, window_keys, window_base)


def _check_layer_inputs(cache: Cache, plan: AppendPlan, ref: LayerRef, vectors: LayerVectors,
                        queries: Queries, params: LayerParams) -> None:
    """Shape checks of one layer's inputs (static: they run inside jit too)."""
    model = cache.model
    batch = plan.slot_ids.shape[0]
    if vectors.window is None or np.ndim(vectors.window) != 3:
        checks.fail("vectors.window", f"an array [B={batch}, T, {model.head_dim}]",
                    None if vectors.window is None else f"shape {np.shape(vectors.window)}")
    tokens = vectors.window.shape[1]
    _float_field("vectors.window", vectors.window, (batch, tokens, model.head_dim))
    check_queries(cache, ref, queries, batch, tokens)
    specs = {s.name: s for s in cache.specs}
    needed = {LayerKind.CSA: (("compressor", "csa"), ("index_compressor", "csa_index")),
              LayerKind.HCA: (("compressor", "hca"),), LayerKind.SWA: ()}[ref.kind]
    for field, name in needed:
        spec = specs[name]
        inp, p = getattr(vectors, field), getattr(params, field)
        if inp is None or p is None:
            checks.fail(f"vectors.{field} / params.{field}",
                        f"the {name} compressor's inputs and params of a {ref.kind.name} layer",
                        None)
        _float_field(f"vectors.{field}.kv", inp.kv, (batch, tokens, spec.in_width))
        _float_field(f"vectors.{field}.gate", inp.gate, (batch, tokens, spec.in_width))
        _float_field(f"params.{field}.ape", p.ape, (spec.ratio, spec.in_width))
        _float_field(f"params.{field}.norm", p.norm, (spec.width,))


def layer_step(cache: Cache, plan: AppendPlan, ref: LayerRef, vectors: LayerVectors,
               queries: Queries, params: LayerParams) -> tuple[Cache, jax.Array]:
    """Appends one layer's chunk and computes its attention for the chunk's queries.

    Args:
      cache: after `begin_append`.
      plan: from `begin_append`.
      ref: the layer.
      vectors: the layer's new-token vectors [B, T, ...].
      queries: the layer's queries for the same T tokens.
      params: the layer's compressor params.

    Returns:
      (cache, f32[B, T, H, hd]) the de-rotated attention output (rows of tokens past a slot's
      n_new are padding).
    """
    model, geo = cache.model, cache.geometry
    _check_layer_inputs(cache, plan, ref, vectors, queries, params)
    tokens = vectors.window.shape[1]
    W = model.window
    new_window = vectors.window
    if tokens > 1:
        # Prefill attends over the window as it was before the chunk: read it first.
        old_ring = cache.state.window[ref.layer, _read_slots(cache, plan.slot_ids)]
        new_window = _after(new_window, old_ring)
    cache = _write_window(cache, plan, ref.layer[None], new_window[None])
    kind_layers = ref.kind_layer[None]
    if ref.kind == LayerKind.CSA:
        specs = {s.name: s for s in cache.specs}
        for name, inp, p in (("csa", vectors.compressor, params.compressor),
                             ("csa_index", vectors.index_compressor, params.index_compressor)):
            cache = _append_compressor(
                cache, plan, specs[name], kind_layers, jax.tree.map(lambda x: x[None], inp),
                jax.tree.map(lambda x: x[None], p))
    elif ref.kind == LayerKind.HCA:
        spec = next(s for s in cache.specs if s.name == "hca")
        cache = _append_compressor(
            cache, plan, spec, kind_layers, jax.tree.map(lambda x: x[None], vectors.compressor),
            jax.tree.map(lambda x: x[None], params.compressor))

    if tokens == 1:
        # Decode: the ring and the pools now hold the new token; read them like any decode.
        return cache, _decode_attention(cache, ref, queries, plan.slot_ids, plan.end)

    rows = page_rows(cache, plan.slot_ids)
    extended = jnp.concatenate(
        [_ordered_ring(old_ring, plan.start), vectors.window.astype(old_ring.dtype)], axis=1)
    q_pos = plan.positions(tokens)
    tile = min(geo.query_tile, tokens)
    n_tiles = -(-tokens // tile)
    if n_tiles == 1:
        out = _attend_layer(cache, ref, rows, queries, q_pos, plan.end, extended,
                            plan.start - W)
        return cache, out

    pad = n_tiles * tile - tokens
    extended = jnp.pad(extended, ((0, 0), (0, pad), (0, 0)))
    tiled_q = jax.tree.map(
        lambda x: jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)).reshape(
            x.shape[0], n_tiles, tile, *x.shape[2:]).swapaxes(0, 1),
        queries.replace(sink=None))
    q_pos_t = jnp.pad(q_pos, ((0, 0), (0, pad)), mode="edge").reshape(
        -1, n_tiles, tile).swapaxes(0, 1)

    def one_tile(args):
        i, q_tile, pos_tile = args
        keys = jax.lax.dynamic_slice_in_dim(extended, i * tile, W + tile, axis=1)
        return _attend_layer(cache, ref, rows, q_tile.replace(sink=queries.sink),
                             pos_tile, plan.end, keys, plan.start - W + i * tile)

    out = jax.lax.map(one_tile, (jnp.arange(n_tiles), tiled_q, q_pos_t))
    out = out.swapaxes(0, 1).reshape(out.shape[1], n_tiles * tile, *out.shape[3:])
    return cache, out[:, :tokens]


def decode_attention(cache: Cache, ref: LayerRef, queries: Queries, slot_ids) -> jax.Array:
    """Attention of each slot's LAST token, reading the cache after its append.

    Args:
      queries: `Queries` with T = 1.
      slot_ids: i32[B]; concrete ids outside [0, max_slots) raise ValueError, inside a
        caller's jit such a row reads nothing and its output is zeros.

    Returns:
      f32[B, 1, H, hd].
    """
    S = cache.geometry.max_slots
    if checks.concrete(slot_ids):
        checks.int_array("slot_ids", slot_ids, ndim=1, lo=0, hi=S - 1)
    slot_ids = jnp.asarray(slot_ids, jnp.int32)
    check_queries(cache, ref, queries, slot_ids.shape[0], 1)
    inside = (slot_ids >= 0) & (slot_ids < S)
    ids = jnp.where(inside, slot_ids, S)
    length = jnp.where(inside, cache.state.lengths[_read_slots(cache, ids)], 0)
    return _decode_attention(cache, ref, queries, ids, length)


def _decode_attention(cache: Cache, ref: LayerRef, queries: Queries, slot_ids: jax.Array,
                      length: jax.Array) -> jax.Array:
    """Attention of the token at length - 1 of each slot, whose append is in the cache.
    slot_ids may hold max_slots for rows that read nothing (their length is 0)."""
    if ref.kind != LayerKind.SWA and ops.uses_kernels(cache.model, cache.geometry):
        return ops.decode_attention(cache, ref.kind, ref.layer, ref.kind_layer, queries,
                                    slot_ids, length - 1, length)
    ring = cache.state.window[ref.layer, _read_slots(cache, slot_ids)]
    return _attend_layer(cache, ref, page_rows(cache, slot_ids), queries,
                         (length - 1)[:, None], length, _ordered_ring(ring, length),
                         length - cache.model.window)


def append_and_attend(cache: Cache, plan: AppendPlan, vectors: TokenVectors,
                      queries: Queries, weights: CompressorWeights
                      ) -> tuple[Cache, jax.Array]:
    """`layer_step` over every layer, for callers that have all layers' vectors up front
    (benchmarks, the demo, tests). Layers of a kind run in a `lax.scan`, so the program size
    does not grow with the number of layers.

    Args:
      cache, plan: from `begin_append`.
      vectors: `TokenVectors` [.., B, T, ..].
      queries: `Queries` stacked over layers: q [n_layers, B, T, H, hd], sink [n_layers, H],
        index_q [n_csa, B, T, nI, c], index_weights [n_csa, B, T, nI].
      weights: compressor params of every layer.

    Returns:
      (cache, f32[n_layers, B, T, H, hd]).
    """
    model = cache.model
    out = None
    for kind in LayerKind:
        layers = model.layers_of(kind)
        if not layers:
            continue
        glob = jnp.asarray(layers, jnp.int32)
        xs = {
            "ref": LayerRef(glob, jnp.arange(len(layers), dtype=jnp.int32), kind),
            "window": vectors.window[glob],
            "q": queries.q[glob],
            "sink": queries.sink[glob],
        }
        if kind == LayerKind.CSA:
            xs.update(main=vectors.csa, index=vectors.csa_index, main_p=weights.csa,
                      index_p=weights.csa_index, index_q=queries.index_q,
                      index_weights=queries.index_weights)
        elif kind == LayerKind.HCA:
            xs.update(main=vectors.hca, main_p=weights.hca)

        def body(cache, x):
            layer_vectors = LayerVectors(x["window"], x.get("main"), x.get("index"))
            params = LayerParams(x.get("main_p"), x.get("index_p"))
            q = Queries(q=x["q"], sink=x["sink"], index_q=x.get("index_q"),
                        index_weights=x.get("index_weights"))
            return layer_step(cache, plan, x["ref"], layer_vectors, q, params)

        cache, o = jax.lax.scan(body, cache, xs)
        if out is None:
            out = jnp.zeros((model.num_layers, *o.shape[1:]), o.dtype)
        out = out.at[glob].set(o)
    return cache, out


# --- jitted entry points ---------------------------------------------------------------------


def _float_field(name: str, x, expected: tuple) -> None:
    if x is None:
        checks.fail(name, f"an array of shape {expected}", None)
    checks.shape(name, x, expected)
    checks.dtype_kind(name, x, "floating")


def check_vectors(cache: Cache, vectors: TokenVectors, batch: int, tokens: int) -> None:
    """Raises ValueError / TypeError naming the field whose shape or dtype does not match."""
    model = cache.model
    _float_field("vectors.window", vectors.window,
                 (model.num_layers, batch, tokens, model.head_dim))
    for spec in cache.specs:
        n = len(model.layers_of(spec.kind))
        inp = vectors.compressor(spec.name)
        for field in ("kv", "gate"):
            _float_field(f"vectors.{spec.name}.{field}", getattr(inp, field),
                         (n, batch, tokens, spec.in_width))


def check_weights(cache: Cache, weights: CompressorWeights) -> None:
    """Raises naming the compressor param whose shape does not match the config."""
    model = cache.model
    for spec in cache.specs:
        n = len(model.layers_of(spec.kind))
        params = getattr(weights, spec.name)
        _float_field(f"weights.{spec.name}.ape", params.ape, (n, spec.ratio, spec.in_width))
        _float_field(f"weights.{spec.name}.norm", params.norm, (n, spec.width))


def check_queries(cache: Cache, ref: LayerRef | None, queries: Queries, batch: int,
                  tokens: int) -> None:
    """Raises naming the query field whose shape does not match (one layer's queries when
    `ref` is given, else queries stacked over all layers as `forward` takes them)."""
    model = cache.model
    H, hd, nI, c = model.num_heads, model.head_dim, model.index_heads, model.index_head_dim
    if ref is None:
        lead, csa, sink = (model.num_layers,), (model.num_csa,), (model.num_layers, H)
        needs_index = model.num_csa > 0
    else:
        lead, csa, sink = (), (), (H,)
        needs_index = ref.kind == LayerKind.CSA
    _float_field("queries.q", queries.q, (*lead, batch, tokens, H, hd))
    _float_field("queries.sink", queries.sink, sink)
    if needs_index:
        _float_field("queries.index_q", queries.index_q, (*csa, batch, tokens, nI, c))
        _float_field("queries.index_weights", queries.index_weights, (*csa, batch, tokens, nI))


def check_rows(cache: Cache, slot_ids, n_new, tokens: int) -> None:
    """Concrete checks of one call's rows: distinct slots in range (or -1 for a padding row,
    which must append nothing), n_new in [0, tokens], and every slot that appends is ACTIVE."""
    S = cache.geometry.max_slots
    ids = checks.slot_ids(slot_ids, S, padding=True)
    n = checks.int_array("n_new", n_new, ndim=1)
    if n.shape != ids.shape:
        checks.fail("n_new", f"shape {ids.shape} (one count per slot id)", f"shape {n.shape}")
    if n.size and (n.min() < 0 or n.max() > tokens):
        checks.fail("n_new", f"counts in [0, {tokens}] (the chunk length)", n)
    status = np.asarray(cache.state.status)
    for row, (slot, count) in enumerate(zip(ids.tolist(), n.tolist(), strict=True)):
        if slot < 0:
            if count:
                checks.fail("n_new", "0 for a padding row (slot id -1)",
                            f"{count} at row {row}")
            continue
        st = SlotStatus(int(status[slot]))
        if count > 0 and st != SlotStatus.ACTIVE:
            hint = ("reset_slot it first" if st == SlotStatus.FREE
                    else "pools.clear_flags it once the cause is fixed")
            checks.fail("slot_ids", f"ACTIVE slots for rows that append ({hint})",
                        f"slot {slot} {st.name}")


def _check_call(cache: Cache, vectors: TokenVectors, weights: CompressorWeights, slot_ids,
                n_new) -> int:
    """Checks of the eager entry points; returns the chunk length T."""
    if not isinstance(cache, Cache):
        checks.fail("cache", "a v4kv_jax Cache", type(cache).__name__, TypeError)
    window = vectors.window
    if window is None or np.ndim(window) != 4:
        checks.fail("vectors.window", "an array [n_layers, B, T, head_dim]",
                    None if window is None else f"shape {np.shape(window)}")
    tokens = window.shape[2]
    if tokens < 1:
        checks.fail("vectors", "a chunk of at least one token (T >= 1)", f"T={tokens}")
    batch = np.shape(slot_ids)[0] if np.ndim(slot_ids) else -1
    check_vectors(cache, vectors, batch, tokens)
    check_weights(cache, weights)
    if checks.concrete(slot_ids, n_new):
        check_rows(cache, slot_ids, n_new, tokens)
    return tokens


def _append_all(cache: Cache, vectors: TokenVectors, weights: CompressorWeights,
                slot_ids: jax.Array, n_new: jax.Array) -> Cache:
    cache, plan = begin_append(cache, slot_ids, n_new, vectors.window.shape[2])
    cache = append_layers(cache, plan, vectors, weights)
    return end_append(cache, plan)


_append_all_jit = jax.jit(_append_all, donate_argnums=0)


def _append_attend_all(cache: Cache, vectors: TokenVectors, queries: Queries,
                       weights: CompressorWeights, slot_ids: jax.Array, n_new: jax.Array):
    cache, plan = begin_append(cache, slot_ids, n_new, vectors.window.shape[2])
    cache, out = append_and_attend(cache, plan, vectors, queries, weights)
    return end_append(cache, plan), out


_append_attend_all_jit = jax.jit(_append_attend_all, donate_argnums=0)


def forward(cache: Cache, vectors: TokenVectors, queries: Queries, weights: CompressorWeights,
            slot_ids, n_new) -> tuple[Cache, jax.Array]:
    """Prefill (or decode, T = 1) with attention in every layer; jitted, cache donated.

    Args as `prefill`, plus `queries` stacked over layers (see `append_and_attend`).

    Returns:
      (cache, f32[n_layers, B, T, H, hd]) attention outputs before the output projection.
    """
    tokens = _check_call(cache, vectors, weights, slot_ids, n_new)
    check_queries(cache, None, queries, len(slot_ids), tokens)
    return _append_attend_all_jit(cache, vectors, queries, weights,
                                  jnp.asarray(slot_ids, jnp.int32), jnp.asarray(n_new, jnp.int32))


def prefill(cache: Cache, vectors: TokenVectors, weights: CompressorWeights,
            slot_ids, n_new) -> Cache:
    """Appends up to T tokens to each of B slots, from any starting length.

    Leaves the state that feeding the same tokens one by one through `decode_step` leaves:
    window ring, tails, lengths and page tables bit for bit; compressed entries within 8 ulp
    of the largest entry magnitude (XLA vectorises the pooling softmax differently for one
    block than for many; `tests/test_chunking_bound.py`). The input cache is donated.

    Args:
      cache: the cache (donated).
      vectors: `TokenVectors` with [.., B, T, ..] arrays.
      weights: compressor params of every layer.
      slot_ids: i32[B] distinct slots.
      n_new: i32[B] tokens of each row to append (the rest of the row is padding).
    """
    _check_call(cache, vectors, weights, slot_ids, n_new)
    return _append_all_jit(cache, vectors, weights, jnp.asarray(slot_ids, jnp.int32),
                           jnp.asarray(n_new, jnp.int32))


def decode_step(cache: Cache, vectors: TokenVectors, weights: CompressorWeights,
                active=None) -> Cache:
    """Appends one token to every active slot (a batch over all `max_slots` slots).

    Args:
      cache: the cache (donated).
      vectors: `TokenVectors` with [.., max_slots, 1, ..] arrays.
      weights: compressor params of every layer.
      active: bool[max_slots]; default: every slot whose status is ACTIVE.
    """
    S = cache.geometry.max_slots
    if active is None:
        active = cache.state.status == SlotStatus.ACTIVE
    elif checks.concrete(active):
        checks.shape("active", active, (S,))
        checks.dtype_kind("active", active, "bool")
    n_new = jnp.asarray(active, jnp.int32)
    _check_call(cache, vectors, weights, np.arange(S, dtype=np.int32), n_new)
    return _append_all_jit(cache, vectors, weights, jnp.arange(S, dtype=jnp.int32), n_new)


__all__ = [
    "AppendPlan", "LayerParams", "LayerRef", "LayerVectors", "TokenVectors",
    "append_and_attend", "append_layers", "begin_append", "check_queries", "check_rows",
    "check_vectors", "check_weights", "decode_attention", "decode_step", "end_append",
    "forward", "layer_step", "page_rows", "prefill",
]
