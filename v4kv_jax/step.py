"""Reads and drivers: one layer's append + attention, every layer's, and the jitted steps.

A model calls `append.begin_append`, then `layer_step` per layer (append that layer and
attend), then `append.end_append`, since a layer's inputs depend on the layer below. With
every layer's vectors up front, `layers_step` runs them all (a `lax.scan` per kind), and the
jitted entry points run the whole step with the cache donated:

  append_and_attend  append a chunk (prefill, or decode with T = 1) and attend in every layer
  prefill            append a chunk to every layer, no attention
  decode_step        append one token to every active slot, no attention
  decode_attention   read one layer's attention of each slot's last token
  replay             rewrite the State (window rings, tails) of tokens a slot already holds

How the ops run (reference or Pallas kernels, read tiling) is `Options`, passed to the calls.

Given a `mesh` (`v4kv_jax.mesh`), the jitted entry points take a mesh's cache and run every
shard's rows on its own device: the batch is the shards' rows end to end (B = N * rows per
shard; row r is shard r // (B / N)'s), each row's slot id local to its shard.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from v4kv_jax import append, checks, ops, pools, programs
from v4kv_jax import mesh as meshes
from v4kv_jax import vectors as vec
from v4kv_jax.append import AppendPlan, read_slots
from v4kv_jax.config import LayerKind, Options
from v4kv_jax.config import options_or_default as _options
from v4kv_jax.pools import Cache, SlotStatus
from v4kv_jax.vectors import CompressorWeights, LayerRef, Queries, TokenVectors


def _read(cache: Cache, ref: LayerRef, queries: Queries, slot_ids: jax.Array,
          window: ops.WindowKeys, q_pos: jax.Array, kv_end: jax.Array, options: Options):
    """`ops.read` of layer `ref` for the rows `slot_ids`, its stored arrays taken from the
    cache's pools (a slot id outside [0, max_slots) has no page): (cache with the rows' new
    hot sets, output, picks)."""
    rows = pools.page_rows(cache, slot_ids)
    hot = None
    if ref.kind == LayerKind.CSA:
        csa = pools.csa_entries(cache)
        if pools.hot_set(cache) is not None:
            hot = pools.hot_rows(cache, ref.kind_layer, slot_ids)
        stored = ops.Stored(ref.kind_layer, rows, csa.c4, csa.index_keys, hot)
    elif ref.kind == LayerKind.HCA:
        stored = ops.Stored(ref.kind_layer, rows, pools.hca_entries(cache).c128)
    else:
        stored = ops.Stored(ref.kind_layer, rows)
    out, picks, hot = ops.read(ref.kind, cache.attn_config, cache.geometry, options, queries,
                               q_pos=q_pos, kv_end=kv_end, window=window, stored=stored,
                               layout=cache.layout)
    if hot is not None:
        cache = pools.with_hot_rows(cache, ref.kind_layer, slot_ids, hot)
    return cache, out, picks


# The `LayerVectors` / `LayerParams` field of each compressor of a layer.
_FIELDS = {"csa": "compressor", "csa_index": "index_compressor", "hca": "compressor"}


def _check_layer_inputs(cache: Cache, plan: AppendPlan, ref: LayerRef,
                        vectors: vec.LayerVectors, queries: Queries, params: vec.LayerParams
                        ) -> None:
    """Shape checks of one layer's inputs (static: they run inside jit too)."""
    model = cache.attn_config
    batch = plan.slot_ids.shape[0]
    if vectors.window is None or np.ndim(vectors.window) != 3:
        checks.fail("vectors.window", f"an array [B={batch}, T, {model.head_dim}]",
                    None if vectors.window is None else f"shape {np.shape(vectors.window)}")
    tokens = vectors.window.shape[1]
    _float_field("vectors.window", vectors.window, (batch, tokens, model.head_dim))
    check_queries(cache, ref, queries, batch, tokens)
    for spec in cache.layout.kind_specs[ref.kind]:
        field = _FIELDS[spec.name]
        inp, p = getattr(vectors, field), getattr(params, field)
        if inp is None or p is None:
            checks.fail(f"vectors.{field} / params.{field}",
                        f"the {spec.name} compressor's inputs and params of a "
                        f"{ref.kind.name} layer", None)
        _float_field(f"vectors.{field}.kv", inp.kv, (batch, tokens, spec.in_width))
        _float_field(f"vectors.{field}.gate", inp.gate, (batch, tokens, spec.in_width))
        _float_field(f"params.{field}.ape", p.ape, (spec.ratio, spec.in_width))
        _float_field(f"params.{field}.norm", p.norm, (spec.width,))


def layer_step(cache: Cache, plan: AppendPlan, ref: LayerRef, vectors: vec.LayerVectors,
               queries: Queries, params: vec.LayerParams, *, options: Options | None = None,
               with_picks: bool = False):
    """Appends one layer's chunk and computes its attention for the chunk's queries.

    Args:
      cache: after `append.begin_append`.
      plan: from `append.begin_append`, or `append.replay_plan` (a replay: the window and
        tails are rewritten, no entry is emitted, attention reads the slot's entries).
      ref: the layer.
      vectors: the layer's new-token vectors [B, T, ...].
      queries: the layer's queries for the same T tokens.
      params: the layer's compressor params.
      options: how the ops run (default `Options()`).
      with_picks: also return the CSA indexer's picks.

    Returns:
      (cache, f32[B, T, H, hd]) the de-rotated attention output (rows of tokens past a slot's
      n_new are padding); with `with_picks`, (cache, output, picks i32[B, T, k] for a CSA
      layer (-1 = unused pick), None otherwise).
    """
    checks.alive("cache", cache)
    options = _options(options)
    fixed = cache.layout
    _check_layer_inputs(cache, plan, ref, vectors, queries, params)
    tokens = vectors.window.shape[1]
    slots = read_slots(cache, plan.slot_ids)
    new_window = vectors.window
    if tokens > 1:
        # Prefill attends over the window as it was before the chunk: read it first.
        old_ring = pools.window_ring(cache)[ref.layer, slots]
        new_window = append.after(new_window, old_ring)
    cache = append.write_window(cache, plan, ref.layer[None], new_window[None], options)
    for spec in fixed.kind_specs[ref.kind]:
        inp, p = getattr(vectors, _FIELDS[spec.name]), getattr(params, _FIELDS[spec.name])
        cache = append.append_compressor(
            cache, plan, spec, ref.kind_layer[None], jax.tree.map(lambda x: x[None], inp),
            jax.tree.map(lambda x: x[None], p), options)

    if tokens == 1:
        # Decode: the ring and the pools now hold the new token; read them like any decode.
        window = ops.WindowKeys(pools.window_ring(cache), plan.end, layer=ref.layer,
                                slots=slots)
        q_pos = (plan.end - 1)[:, None]
    else:
        window = ops.WindowKeys(old_ring, plan.start, fixed.rows["window"].encode(vectors.window))
        q_pos = plan.positions(tokens)
    cache, out, picks = _read(cache, ref, queries, plan.slot_ids, window, q_pos, plan.end,
                              options)
    return (cache, out, picks) if with_picks else (cache, out)


def decode_attention(cache: Cache, ref: LayerRef, queries: Queries, slot_ids, *,
                     options: Options | None = None) -> jax.Array:
    """Attention of each slot's LAST token, reading the cache after its append.

    Args:
      queries: `Queries` with T = 1.
      slot_ids: i32[B]; concrete ids outside [0, max_slots) raise ValueError, inside a
        caller's jit such a row reads nothing and its output is zeros.

    Returns:
      f32[B, 1, H, hd]. With a hot set (`CacheConfig.hot_rows`) the read fetches what it
      needs into a copy of the rows' hot sets that is not kept (the cache is not returned);
      `layer_step` keeps it.
    """
    checks.alive("cache", cache)
    S = cache.geometry.max_slots
    if checks.concrete(slot_ids):
        checks.int_array("slot_ids", slot_ids, ndim=1, lo=0, hi=S - 1)
    slot_ids = jnp.asarray(slot_ids, jnp.int32)
    check_queries(cache, ref, queries, slot_ids.shape[0], 1)
    inside = (slot_ids >= 0) & (slot_ids < S)
    slots = read_slots(cache, slot_ids)
    length = jnp.where(inside, pools.lengths(cache)[slots], 0)  # a row outside reads nothing
    window = ops.WindowKeys(pools.window_ring(cache), length, layer=ref.layer, slots=slots)
    _, out, _ = _read(cache, ref, queries, slot_ids, window, (length - 1)[:, None], length,
                      options)
    return out


def decode_attention_all(cache: Cache, queries: Queries, slot_ids, *,
                         options: Options | None = None) -> jax.Array:
    """Every layer's attention of each slot's last token (after `decode_step` appended it):
    one `lax.scan` per layer kind.

    Args:
      queries: `Queries` stacked over layers with T = 1: q [n_layers, B, 1, H, hd], sink
        [n_layers, H], index_q [n_csa, B, 1, nI, c], index_weights [n_csa, B, 1, nI].
      slot_ids: i32[B] (as `decode_attention`).

    Returns:
      f32[n_layers, B, 1, H, hd].
    """
    checks.alive("cache", cache)
    model = cache.attn_config
    if checks.concrete(slot_ids):
        checks.int_array("slot_ids", slot_ids, ndim=1, lo=0, hi=cache.geometry.max_slots - 1)
    slot_ids = jnp.asarray(slot_ids, jnp.int32)
    check_queries(cache, None, queries, slot_ids.shape[0], 1)

    def inputs(kind, glob, index):
        q = Queries(q=queries.q[glob], sink=queries.sink[glob])
        if kind == LayerKind.CSA:
            q = q.replace(**_kind_layer(index, index_q=queries.index_q,
                                        index_weights=queries.index_weights))
        return {"ref": _ref(kind, glob, index), "q": q}

    def body(_, x):
        return None, decode_attention(cache, x["ref"], x["q"], slot_ids, options=options)

    _, out = _over_layers(model, options, body, None, inputs)
    return out


def _ref(kind: LayerKind, glob, index) -> LayerRef:
    return LayerRef(jnp.asarray(glob, jnp.int32), jnp.asarray(index, jnp.int32), kind)


def _kind_layer(at, /, **stacks) -> dict:
    """Each stack over a kind's layers at `at` (an int: one layer), or whole (an array of
    every layer's index: for a scan over them)."""
    if isinstance(at, int):
        return jax.tree.map(lambda v: v[at], stacks)
    return stacks


def _over_layers(model, options: Options | None, body, carry, inputs):
    """Runs `body(carry, x) -> (carry, y)` over every layer, kind by kind, `x = inputs(kind,
    glob, index)` (the layers' global indices and their indices in their kind's stack):
    (carry, the y's stacked in layer order, [n_layers, ...]).

    A `lax.scan` per kind (the program's size does not grow with the layers), its outputs
    scattered to their layers; with `Options.unroll_layers`, one layer after the other with
    static indices (each layer's inputs a slice) and the outputs stacked once at the end.
    """
    if _options(options).unroll_layers:
        outs = {}
        for kind in LayerKind:
            for i, layer in enumerate(model.layers_of(kind)):
                carry, outs[layer] = body(carry, inputs(kind, layer, i))
        return carry, jnp.stack([outs[layer] for layer in range(model.num_layers)])
    out = None
    for kind in LayerKind:
        layers = model.layers_of(kind)
        if not layers:
            continue
        glob = jnp.asarray(layers, jnp.int32)
        carry, o = jax.lax.scan(body, carry,
                                inputs(kind, glob, jnp.arange(len(layers), dtype=jnp.int32)))
        if out is None:
            out = jnp.zeros((model.num_layers, *o.shape[1:]), o.dtype)
        out = out.at[glob].set(o)
    return carry, out


def layers_step(cache: Cache, plan: AppendPlan, vectors: TokenVectors, queries: Queries,
                weights: CompressorWeights, options: Options | None = None
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
    checks.alive("cache", cache)
    model = cache.attn_config

    def inputs(kind, glob, index):
        x = {"ref": _ref(kind, glob, index), "window": vectors.window[glob],
             "q": queries.q[glob], "sink": queries.sink[glob]}
        if kind == LayerKind.CSA:
            x.update(_kind_layer(index, main=vectors.csa, index=vectors.csa_index,
                                 main_p=weights.csa, index_p=weights.csa_index,
                                 index_q=queries.index_q,
                                 index_weights=queries.index_weights))
        elif kind == LayerKind.HCA:
            x.update(_kind_layer(index, main=vectors.hca, main_p=weights.hca))
        return x

    def body(carry, x):
        cache, below = carry
        # A layer's writes come after the read of the layer below, as in a model (whose
        # layer inputs are the output below): else XLA may write a plane in place while
        # the read below still needs it, and copies the whole plane first.
        layer_vectors = jax.tree.map(
            lambda v: append.after(v, below),
            vec.LayerVectors(x["window"], x.get("main"), x.get("index")))
        params = vec.LayerParams(x.get("main_p"), x.get("index_p"))
        q = Queries(q=x["q"], sink=x["sink"], index_q=x.get("index_q"),
                    index_weights=x.get("index_weights"))
        cache, o = layer_step(cache, plan, x["ref"], layer_vectors, q, params,
                              options=options)
        return (cache, o.ravel()[0]), o

    (cache, _), out = _over_layers(model, options, body,
                                   (cache, jnp.zeros((), jnp.float32)), inputs)
    return cache, out


# --- checks and jitted entry points -----------------------------------------------------------


def _float_field(name: str, x, expected: tuple) -> None:
    if x is None:
        checks.fail(name, f"an array of shape {expected}", None)
    checks.shape(name, x, expected)
    checks.dtype_kind(name, x, "floating")


def check_vectors(cache: Cache, vectors: TokenVectors, batch: int, tokens: int) -> None:
    """Raises ValueError / TypeError naming the field whose shape or dtype does not match."""
    model = cache.attn_config
    _float_field("vectors.window", vectors.window,
                 (model.num_layers, batch, tokens, model.head_dim))
    for spec in cache.layout.specs:
        n = len(cache.layout.layers[spec.kind])
        inp = vectors.compressor(spec.name)
        for field in ("kv", "gate"):
            _float_field(f"vectors.{spec.name}.{field}", getattr(inp, field),
                         (n, batch, tokens, spec.in_width))


def check_weights(cache: Cache, weights: CompressorWeights) -> None:
    """Raises naming the compressor param whose shape does not match the config."""
    for spec in cache.layout.specs:
        n = len(cache.layout.layers[spec.kind])
        params = getattr(weights, spec.name)
        _float_field(f"weights.{spec.name}.ape", params.ape, (n, spec.ratio, spec.in_width))
        _float_field(f"weights.{spec.name}.norm", params.norm, (n, spec.width))


def check_queries(cache: Cache, ref: LayerRef | None, queries: Queries, batch: int,
                  tokens: int) -> None:
    """Raises naming the query field whose shape does not match (one layer's queries when
    `ref` is given, else queries stacked over all layers as `forward` takes them)."""
    model = cache.attn_config
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


def chunk_length(vectors: TokenVectors) -> int:
    """T of `TokenVectors` [.., B, T, ..]: raises unless they hold a chunk of T >= 1 tokens."""
    if not isinstance(vectors, TokenVectors):
        checks.fail("vectors", "a v4kv_jax TokenVectors", type(vectors).__name__, TypeError)
    window = vectors.window
    if window is None or np.ndim(window) != 4:
        checks.fail("vectors.window", "an array [n_layers, B, T, head_dim]",
                    None if window is None else f"shape {np.shape(window)}")
    tokens = window.shape[2]
    if tokens < 1:
        checks.fail("vectors", "a chunk of at least one token (T >= 1)", f"T={tokens}")
    return tokens


def _check_call(cache: Cache, vectors: TokenVectors, weights: CompressorWeights, slot_ids,
                n_new, mesh=None, start=None, n_new_name: str = "n_new") -> int:
    """Checks of the eager entry points (each shard's rows against its cache with a `mesh`);
    returns the chunk length T. An append that would drop tokens (past max_seq_len, or
    pages the free stack lacks) raises here, before the program runs (`append.check_room`);
    traced arguments are not checked (the device flags the slot instead)."""
    if not isinstance(cache, Cache):
        checks.fail("cache", "a v4kv_jax Cache", type(cache).__name__, TypeError)
    checks.alive("cache", cache)
    tokens = chunk_length(vectors)
    batch = np.shape(slot_ids)[0] if np.ndim(slot_ids) else -1
    check_vectors(cache, vectors, batch, tokens)
    check_weights(cache, weights)
    if not checks.concrete(slot_ids, n_new, start):
        return tokens
    shards = {0: cache} if mesh is None else meshes.split(cache, meshes.check_mesh(mesh))
    n = 1 if mesh is None else mesh.size
    if batch % n:
        checks.fail("slot_ids", f"a multiple of the mesh's {n} devices rows (each shard's "
                    "rows end to end)", f"{batch} rows")
    rows = batch // n
    for i, local in shards.items():
        def part(x, i=i):  # the shard's rows (all of them, as given, without a mesh)
            return x if mesh is None else np.asarray(x)[i * rows:(i + 1) * rows]

        append.check_rows(local, part(slot_ids), part(n_new), tokens)
        if start is not None:
            append.check_replay(local, part(slot_ids), part(start), part(n_new), tokens)
        else:
            append.check_room(local, part(slot_ids), part(n_new), name=n_new_name)
    return tokens


_ROWS = meshes.P(None, meshes.DATA)  # [n, B, ...]: the rows on axis 1
_BY_ROW = meshes.P(meshes.DATA)


def _on_mesh(body, mesh, in_specs, out_specs):
    """`body` run per shard over `mesh` (`mesh.shard_program`)."""
    return meshes.shard_program(body, mesh, in_specs, out_specs)


def _query_specs(queries: Queries) -> Queries:
    return Queries(q=_ROWS, sink=meshes.P(),
                   index_q=None if queries.index_q is None else _ROWS,
                   index_weights=None if queries.index_weights is None else _ROWS)


def _append_all(cache: Cache, vectors: TokenVectors, weights: CompressorWeights,
                slot_ids: jax.Array, n_new: jax.Array, options: Options, mesh=None) -> Cache:
    if mesh is not None:
        return _on_mesh(functools.partial(_append_all, options=options), mesh,
                        (meshes.CACHE, _ROWS, meshes.P(), _BY_ROW, _BY_ROW), meshes.CACHE)(
                            cache, vectors, weights, slot_ids, n_new)
    cache, plan = append.begin_append(cache, slot_ids, n_new, vectors.window.shape[2])
    cache = append.append_layers(cache, plan, vectors, weights, options)
    return append.end_append(cache, plan)


def _append_attend_all(cache: Cache, vectors: TokenVectors, queries: Queries,
                       weights: CompressorWeights, slot_ids: jax.Array, n_new: jax.Array,
                       options: Options, mesh=None):
    if mesh is not None:
        return _on_mesh(functools.partial(_append_attend_all, options=options), mesh,
                        (meshes.CACHE, _ROWS, _query_specs(queries), meshes.P(), _BY_ROW,
                         _BY_ROW), (meshes.CACHE, _ROWS))(
                            cache, vectors, queries, weights, slot_ids, n_new)
    cache, plan = append.begin_append(cache, slot_ids, n_new, vectors.window.shape[2])
    cache, out = layers_step(cache, plan, vectors, queries, weights, options)
    return append.end_append(cache, plan), out


def _replay_all(cache: Cache, vectors: TokenVectors, weights: CompressorWeights,
                slot_ids: jax.Array, start: jax.Array, n_new: jax.Array,
                options: Options, mesh=None) -> Cache:
    if mesh is not None:
        return _on_mesh(functools.partial(_replay_all, options=options), mesh,
                        (meshes.CACHE, _ROWS, meshes.P(), _BY_ROW, _BY_ROW, _BY_ROW),
                        meshes.CACHE)(cache, vectors, weights, slot_ids, start, n_new)
    plan = append.replay_plan(cache, slot_ids, start, n_new, vectors.window.shape[2])
    return append.append_layers(cache, plan, vectors, weights, options)


_append_all_jit = programs.program("step.prefill", _append_all, donate=("cache",),
                                   static=("options", "mesh"))
_append_attend_all_jit = programs.program("step.append_and_attend", _append_attend_all,
                                          donate=("cache",), static=("options", "mesh"))
_replay_all_jit = programs.program("step.replay", _replay_all, donate=("cache",),
                                   static=("options", "mesh"))


def append_and_attend(cache: Cache, vectors: TokenVectors, queries: Queries,
                      weights: CompressorWeights, slot_ids, n_new, *,
                      options: Options | None = None, mesh: meshes.Mesh | None = None
                      ) -> tuple[Cache, jax.Array]:
    """Appends a chunk (prefill, or decode with T = 1) and attends in every layer; jitted,
    cache donated.

    Args as `prefill`, plus `queries` stacked over layers (see `layers_step`).

    Returns:
      (cache, f32[n_layers, B, T, H, hd]) attention outputs before the output projection.
    """
    tokens = _check_call(cache, vectors, weights, slot_ids, n_new, mesh)
    check_queries(cache, None, queries, len(slot_ids), tokens)
    return _append_attend_all_jit(cache, vectors, queries, weights,
                                  jnp.asarray(slot_ids, jnp.int32), jnp.asarray(n_new, jnp.int32),
                                  options=_options(options), mesh=mesh)


def prefill(cache: Cache, vectors: TokenVectors, weights: CompressorWeights,
            slot_ids, n_new, *, options: Options | None = None,
            mesh: meshes.Mesh | None = None) -> Cache:
    """Appends up to T tokens to each of B slots, from any starting length.

    Leaves the state that feeding the same tokens one by one through `decode_step` leaves:
    window ring, tails, lengths and page tables bit for bit; compressed entries within 8 ulp
    of the largest entry magnitude (XLA vectorises the pooling softmax differently for one
    block than for many; `tests/test_chunking_bound.py`). The input cache is donated.

    Args:
      cache: the cache (donated).
      vectors: `TokenVectors` with [.., B, T, ..] arrays.
      weights: compressor params of every layer.
      slot_ids: i32[B] distinct slots (-1: a padding row, n_new 0).
      n_new: i32[B] tokens of each row to append (the rest of the row is padding).
      options: how the ops run.
      mesh: a `v4kv_jax.mesh.data_mesh` the cache is a mesh's cache of (the batch is the
        shards' rows end to end; see the module docstring), or None.

    Raises:
      ValueError / TypeError naming the argument, with concrete arguments: bad rows, a
        FREE or flagged slot that appends (with its flag's remedy), and an append that the
        device would drop (past max_seq_len: release the slot; pages the free stack does
        not have: free pages), before anything runs. Inside a caller's jit the device
        flags such slots instead (`append.begin_append`).
      v4kv_jax.DonatedCacheError: `cache` was donated to an earlier call.
    """
    _check_call(cache, vectors, weights, slot_ids, n_new, mesh)
    return _append_all_jit(cache, vectors, weights, jnp.asarray(slot_ids, jnp.int32),
                           jnp.asarray(n_new, jnp.int32), options=_options(options), mesh=mesh)


def replay(cache: Cache, vectors: TokenVectors, weights: CompressorWeights, slot_ids, start,
           n_new, *, options: Options | None = None, mesh: meshes.Mesh | None = None) -> Cache:
    """Rewrites the State of positions [start, start + n_new) of each slot, tokens the slot
    already holds: window rings and compressor tails only (`append.replay_plan`); no entry,
    page, length or status changes. The input cache is donated.

    After `pools.attach_prefix`, the State of the attached slot is not valid; replaying the
    last n_layers * (W - 1) + 1 tokens (or more) before the boundary with the vectors a model
    computes for them rebuilds it exactly, whatever State the slot held (layer l's vectors
    are exact from l * (W - 1) tokens past the replay start; see `nn.Decoder.replay`). With
    vectors given per layer, as here, the rewritten rows are the vectors' own, so any replay
    covering the last max(W, tail ring) positions rebuilds the State.

    Args:
      cache: the cache (donated).
      vectors: `TokenVectors` with [.., B, T, ..] arrays: row b's first n_new[b] tokens are
        those of positions start[b] ...
      weights: compressor params of every layer (the tails hold gates with the position bias).
      slot_ids: i32[B] distinct ACTIVE slots (-1: a padding row, n_new 0).
      start: i32[B] first replayed position per row.
      n_new: i32[B] tokens replayed per row (start + n_new <= the slot's length).
      options: how the ops run.
      mesh: a `v4kv_jax.mesh.data_mesh` the cache is a mesh's cache of (the batch is the
        shards' rows end to end; see the module docstring), or None.
    """
    _check_call(cache, vectors, weights, slot_ids, n_new, mesh, start=start)
    return _replay_all_jit(cache, vectors, weights, jnp.asarray(slot_ids, jnp.int32),
                           jnp.asarray(start, jnp.int32), jnp.asarray(n_new, jnp.int32),
                           options=_options(options), mesh=mesh)


def decode_step(cache: Cache, vectors: TokenVectors, weights: CompressorWeights,
                active=None, *, options: Options | None = None,
                mesh: meshes.Mesh | None = None) -> Cache:
    """Appends one token to every active slot (a batch over all `max_slots` slots; with a
    mesh, over every shard's slots, shard after shard).

    Args:
      cache: the cache (donated).
      vectors: `TokenVectors` with [.., max_slots, 1, ..] arrays (N * max_slots rows with
        a mesh of N devices).
      weights: compressor params of every layer.
      active: bool[max_slots] (bool[N * max_slots]); default: every slot whose status is
        ACTIVE.
      options: how the ops run.
      mesh: a `v4kv_jax.mesh.data_mesh` the cache is a mesh's cache of (the batch is the
        shards' rows end to end; see the module docstring), or None.
    """
    checks.alive("cache", cache)
    S = cache.geometry.max_slots
    slots = np.arange(S, dtype=np.int32)
    if mesh is not None:
        slots = np.tile(slots, meshes.check_mesh(mesh).size)
    if active is None:
        active = pools.status(cache) == SlotStatus.ACTIVE
    elif checks.concrete(active):
        checks.shape("active", active, slots.shape)
        checks.dtype_kind("active", active, "bool")
    n_new = jnp.asarray(active, jnp.int32)
    _check_call(cache, vectors, weights, slots, n_new, mesh, n_new_name="active")
    return _append_all_jit(cache, vectors, weights, jnp.asarray(slots), n_new,
                           options=_options(options), mesh=mesh)


def __getattr__(name: str):
    if name == "jitted":
        raise AttributeError("v4kv_jax.step.jitted was removed: device programs are compiled "
                             "by v4kv_jax.programs.program(name, fn, donate=('cache',), "
                             "static=('options',))")
    raise AttributeError(f"module 'v4kv_jax.step' has no attribute {name!r}")


__all__ = [
    "append_and_attend", "check_queries", "check_vectors", "check_weights", "decode_attention",
    "chunk_length", "decode_attention_all",
    "decode_step", "layer_step", "layers_step", "prefill", "replay",
]
