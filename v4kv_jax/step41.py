"""The step of a DeepSeek-V4.1 stack: append a chunk to the two pools and attend, every layer
as its `plan.LayerPlan` says (V41_SPEC.md sections 3-5).

One program serves decode (T = 1) and prefill (any T, any start length, any chunking), per
layer in order:

  window     the layer's window rows R_t(win_t) (through the window format) into its ring
  compress   a kv source: the entries its chunk closes (`ops.compressor41`), C_j and K_j into
             the slot's pages, the ratio-2 open row into the State; published before any
             query of the chunk attends, so the token that closes an entry sees it
  score      an index source: its queries against its kv source's keys of every entry the
             query sees (`ops.indexer41`); the candidate source's best blocks kept for the
             index sources after it; its top-k, shared with the Reuse layers after it
  attend     one softmax over the window (positions t - W + 1 .. t) and the picks, with the
             sink in the denominator, V = K, then the inverse RoPE at t

`prefill41` / `decode_step41` run every layer from vectors given for all of them (one jitted
program, the cache donated); a model whose layer l + 1's input depends on layer l's output
runs the same pieces inside its own program: `begin41`, then `layer41` per layer in order
(the `Chunk41` it threads carries the picks and candidate blocks the later layers
share), then `end41`.

Inputs are the per-layer vectors a V4.1 layer projects (`LayerVectors41`: the form the
float64 oracle `testing.v41_oracle` takes) and its weights (`LayerWeights41`); the outputs are
the attention outputs before the output projection. Slots, pages and flags work as V4's
(`append.begin_append`: a padding row, a FREE or flagged slot, a slot out of pages or past
max_seq_len appends nothing and reads nothing).

Memory is bounded by the working set, not the chunk or the cache: queries go in tiles of
`Options.query_tile` (a tile's scores [B, tile, E], picks [B, tile, K, hd] and logits at
once), and a tile's scores read the index keys a few pages a loop step
(`Options.index_read_entries`); the scores span every entry of a row's page-table row,
masked by visibility.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from v4kv_jax import append, checks, ops, plan, pools, programs, rope
from v4kv_jax.config import Options, options_or_default
from v4kv_jax.ops import attention41, compressor41, indexer41
from v4kv_jax.pools import cache41, paging
from v4kv_jax.pools.cache41 import Cache41
from v4kv_jax.pools.tree import SlotStatus


@struct.dataclass
class LayerVectors41:
    """One layer's vectors for a chunk of T tokens of B rows (tokens past a row's n_new are
    padding and may hold anything).

    Attributes:
      q: [B, T, H, hd] queries (wq_b qr_t) before RoPE.
      win: [B, T, hd] window vectors RMSNorm_{kv_norm}(wkv x_t) before RoPE.
      a, z: [B, T, hd] compressor projections (a kv source; z for ratio 2), else None.
      q_index: [B, T, nI, c] index queries before RoPE; w_index: [B, T, nI] raw index
        weights (an index source), else None.
    """

    q: jax.Array
    win: jax.Array
    a: jax.Array | None = None
    z: jax.Array | None = None
    q_index: jax.Array | None = None
    w_index: jax.Array | None = None


@struct.dataclass
class LayerWeights41:
    """One layer's weights the step reads: sink [H]; a kv source's norm_c [hd], wk [c, hd]
    and k_norm [c] (else None)."""

    sink: jax.Array
    norm_c: jax.Array | None = None
    wk: jax.Array | None = None
    k_norm: jax.Array | None = None


@struct.dataclass
class Step41:
    """What a step returns besides the cache.

    Attributes:
      outputs: per backbone layer, f32[B, T, H, hd] attention outputs (zeros for padding
        tokens and rows that appended nothing).
      picks: per index source (`V41Config.index_source_layers` order), (ids i32[B, T, K],
        valid bool[B, T, K]): the entries each query read, ascending, invalid last.
    """

    outputs: tuple[jax.Array, ...]
    picks: tuple[tuple[jax.Array, jax.Array], ...]


def _window(cache: Cache41, layer: int, slots: jax.Array, start: jax.Array) -> jax.Array:
    """f32[B, W, hd]: the ring's rows of positions start - W .. start - 1 (before the chunk)."""
    W = cache.config.window
    positions = start[:, None] - W + jnp.arange(W, dtype=jnp.int32)[None, :]
    ring = cache41.window41(cache)
    rows = ring.take((jnp.full_like(slots, layer)[:, None], slots[:, None]), positions % W)
    return cache.codec("window").decode(rows)


def _write_window(cache: Cache41, layer: int, ap: append.AppendPlan, rows: jax.Array
                  ) -> Cache41:
    """The chunk's window rows (encoded) into the layer's ring (each ring row written once)."""
    W, tokens = cache.config.window, rows.shape[1]
    j = jnp.arange(tokens, dtype=jnp.int32)[None, :]
    n = ap.n_new[:, None]
    record = jnp.where((j < n) & (j >= n - W), (ap.start[:, None] + j) % W, W)
    ring = cache41.window41(cache).put(
        (jnp.full_like(ap.slot_ids, layer)[:, None], ap.slot_ids[:, None]), record, rows)
    return cache41.with_window41(cache, ring)


def _compress(cache: Cache41, p: plan.LayerPlan, ap: append.AppendPlan, slots, pages,
              x: LayerVectors41, w: LayerWeights41, inv_freq, bf16_latent: bool) -> Cache41:
    """A kv source's entries and keys of the chunk into the slot's pages; its open row."""
    config, r = cache.config, p.ratio
    width = config.head_dim
    per_page = cache.geometry.page_tokens // r
    if r == 2:
        pair = cache.pair_sources.index(p.layer)
        row = cache41.open_rows(cache).take((jnp.full_like(slots, pair), slots), 0)
        open_a, open_z, z = row[:, :width], row[:, width:], x.z
    else:
        open_a = open_z = jnp.zeros((x.a.shape[0], width), jnp.float32)
        z = x.a
    chunk = compressor41.compress_chunk(x.a, z, ap.start, ap.n_new, open_a, open_z, w.norm_c,
                                        ratio=r, eps=config.rms_eps, bf16_latent=bf16_latent)
    entries = compressor41.main_entries(chunk.latents, chunk.entry, r, inv_freq)
    keys = compressor41.index_keys(chunk.latents, chunk.entry, w.wk, w.k_norm, r, inv_freq,
                                   config.rms_eps)
    page = jnp.take_along_axis(pages, jnp.clip(chunk.entry // per_page, 0,
                                               pages.shape[1] - 1), axis=1)
    page = jnp.where(chunk.valid, page, -1)  # dropped
    record = chunk.entry % per_page
    for name, values in (("entries", entries), ("keys", keys)):
        store = cache41.source_store(cache, name, p.layer)
        cache = cache41.with_source_store(cache, name, p.layer, store.put(
            (page,), record, cache.codec(name).encode(values)))
    if r == 2:
        opened = cache41.open_rows(cache).put(
            (jnp.full_like(ap.slot_ids, pair), ap.slot_ids), 0,
            jnp.concatenate([chunk.open_a, chunk.open_z], axis=-1))
        cache = cache41.with_open_rows(cache, opened)
    return cache


def _scores(cache: Cache41, source: int, pages: jax.Array, q_index: jax.Array,
            w_index: jax.Array, n_visible: jax.Array, read_entries: int) -> jax.Array:
    """f32[B, t, E]: the index scores of a tile of queries against every key of kv source
    `source` in the rows' pages, decoded about `read_entries` keys (whole pages) a loop
    step; -inf past each query's n_t (pages -1 read page 0, masked so)."""
    store = cache41.source_store(cache, "keys", source)
    codec = cache.codec("keys")
    per_page = store.map.records
    step = max(1, min(pages.shape[1], read_entries // per_page))
    count = -(-pages.shape[1] // step)
    cut = jnp.pad(jnp.clip(pages, 0, None), ((0, 0), (0, count * step - pages.shape[1])))
    cut = jnp.moveaxis(cut.reshape(pages.shape[0], count, step), 1, 0)

    def body(first, page_ids):
        keys = codec.decode(store.block_records((page_ids,)))  # [B, step, per_page, c]
        keys = keys.reshape(keys.shape[0], -1, keys.shape[-1])
        seen = n_visible - first  # entries of this piece the query sees
        return first + keys.shape[1], indexer41.index_scores(q_index, w_index, keys, seen)

    _, pieces = jax.lax.scan(body, jnp.int32(0), cut)  # [count, B, t, step * per_page]
    pieces = jnp.moveaxis(pieces, 0, 2)
    return pieces.reshape(*pieces.shape[:2], -1)[..., :pages.shape[1] * per_page]


def _picked(cache: Cache41, source: int, pages: jax.Array, ids: jax.Array) -> jax.Array:
    """f32[B, T, K, hd]: the entries `ids` (i32[B, T, K]; E: none) of a kv source."""
    r = cache.config.compress_ratios[source]
    per_page = cache.geometry.page_tokens // r
    flat = ids.reshape(ids.shape[0], -1)
    page = jnp.take_along_axis(pages, jnp.clip(flat // per_page, 0, pages.shape[1] - 1), axis=1)
    store = cache41.source_store(cache, "entries", source)
    rows = store.take((page.reshape(ids.shape),), ids % per_page)
    return cache.codec("entries").decode(rows)


@struct.dataclass
class Chunk41:
    """What the layers of one step share (`begin41`, `layer41`, `end41`).

    Attributes:
      plan: the `append.AppendPlan` of the step (who appends how much).
      positions: i32[B, T] absolute positions; real: bool[B, T] the rows' appended tokens.
      slots: i32[B] slot ids clipped for State reads; pages: i32[B, max_pages_per_seq] the
        rows' page-table rows (-1: none).
      picks: per index source run so far, its (ids, valid) (`ops.indexer41.select`).
      candidates: the candidate source's blocks i32[B, T, KB] once it ran
        (`ops.indexer41.candidate_blocks`), else None.
    """

    plan: append.AppendPlan
    positions: jax.Array
    real: jax.Array
    slots: jax.Array
    pages: jax.Array
    picks: dict = struct.field(default_factory=dict)
    candidates: jax.Array | None = None


def begin41(cache: Cache41, slot_ids, n_new, tokens: int, *, reject=None
            ) -> tuple[Cache41, Chunk41]:
    """Takes the pages the chunk needs and flags slots that cannot append
    (`append.begin_append`'s rules; `reject`: optional bool[B], rows the caller found invalid,
    e.g. token ids outside the vocabulary); the `Chunk41` the layers then share."""
    cache, ap = append.begin_append(cache, slot_ids, n_new, tokens, reject=reject)
    return cache, Chunk41(
        plan=ap, positions=ap.positions(tokens),
        real=jnp.arange(tokens)[None, :] < ap.n_new[:, None],
        slots=append.read_slots(cache, ap.slot_ids),
        pages=paging.slot_rows(pools.page_state(cache), ap.slot_ids))


def _by_tiles(fn, tile: int, *arrays):
    """fn over query tiles: each array [B, T, ...] cut into [B, tile, ...] pieces (T padded
    with zeros to whole tiles), `lax.map` over them, the results joined back to [B, T, ...]."""
    tokens = arrays[0].shape[1]
    if tokens <= tile:
        return fn(*arrays)
    count = -(-tokens // tile)

    def cut(x):
        x = jnp.pad(x, [(0, 0), (0, count * tile - tokens)] + [(0, 0)] * (x.ndim - 2))
        return jnp.moveaxis(x.reshape(x.shape[0], count, tile, *x.shape[2:]), 1, 0)

    def join(y):
        y = jnp.moveaxis(y, 0, 1)
        return y.reshape(y.shape[0], count * tile, *y.shape[3:])[:, :tokens]

    out = jax.lax.map(lambda xs: fn(*xs), tuple(cut(x) for x in arrays))
    return jax.tree.map(join, out)


def _score(cache: Cache41, chunk: Chunk41, p: plan.LayerPlan, x: LayerVectors41, freqs,
           options: Options) -> Chunk41:
    """An index source's picks (and the candidate source's blocks) into the chunk."""
    config = cache.config
    width = chunk.pages.shape[1] * (cache.geometry.page_tokens // p.ratio)
    n_visible = indexer41.visible_entries(chunk.positions, p.ratio)
    q_index = rope.rotate(x.q_index.astype(jnp.float32), chunk.positions[..., None], freqs)
    if cache.geometry.index_dtype == "mxfp4":  # the query rounded as the keys
        q_index = cache.codec("keys").decode(cache.codec("keys").encode(q_index))
    scale = indexer41.weights_scale(config.index_heads, config.index_head_dim)
    consumes = p.candidates is not None
    blocks = chunk.candidates if consumes else jnp.zeros(n_visible.shape + (0,), jnp.int32)

    def tile_picks(q, w, n, kept):
        scores = _scores(cache, p.keys, chunk.pages, q, w, n, options.index_read_entries)
        published = (indexer41.candidate_blocks(scores, n, config.candidate_block_size,
                                                config.candidate_topk_blocks)
                     if p.publishes_candidates else jnp.zeros(n.shape + (0,), jnp.int32))
        if consumes:
            mask = indexer41.candidate_mask(kept, n, width, config.candidate_block_size)
            scores = jnp.where(mask, scores, -jnp.inf)
        return indexer41.select(scores, n, config.index_topk), published

    picks, published = _by_tiles(tile_picks, options.query_tile, q_index,
                                 x.w_index.astype(jnp.float32) * scale, n_visible, blocks)
    return chunk.replace(picks={**chunk.picks, p.layer: picks},
                         candidates=published if p.publishes_candidates else chunk.candidates)


def layer41(cache: Cache41, chunk: Chunk41, layer: int, vectors: LayerVectors41,
            weights: LayerWeights41, *, bf16_latent: bool = False,
            options: Options | None = None) -> tuple[Cache41, Chunk41, jax.Array]:
    """One layer of the step, as its plan says: its window rows, a kv source's entries and
    keys, an index source's picks, then the attention of its queries.

    Layers run in order within a step (a source before its consumers), each once.

    Args:
      cache, chunk: from `begin41` or the previous layer.
      layer: the layer's index (static).
      vectors: its `LayerVectors41` ([B, T, ...]); weights: its `LayerWeights41`.
      bf16_latent: as `prefill41`.
      options: `Options.query_tile` queries are scored and attended at once, and the index
        keys decoded `Options.index_read_entries` at a time (they bound memory, not
        results); a decode step's (T = 1) sparse reads run `ops.sparse_decode41`'s kernel
        where `Options.implementation` chooses it (`ops.choices`), else the step's own read.

    Returns:
      (cache, chunk, f32[B, T, H, hd] attention outputs before the output projection; zeros
      for tokens the rows did not append).
    """
    config = cache.config
    options = options_or_default(options)
    p = plan.of(config)[layer]
    ap, positions = chunk.plan, chunk.positions
    freqs = rope.inv_frequencies_v41(config, p.rope == "compress")
    W = config.window
    before = _window(cache, p.layer, chunk.slots, ap.start)
    codec = cache.codec("window")
    encoded = codec.encode(rope.rotate(vectors.win.astype(jnp.float32), positions, freqs))
    cache = _write_window(cache, p.layer, ap, encoded)
    rows = codec.decode(encoded)
    if p.writes_entries:
        cache = _compress(cache, p, ap, chunk.slots, chunk.pages, vectors, weights, freqs,
                          bf16_latent)
    if p.scores:
        chunk = _score(cache, chunk, p, vectors, freqs, options)
    # Keys of the window: the ring's rows before the chunk, then the chunk's own; a key no
    # query may see is 0, never multiplied (padding may be NaN).
    key_pos = jnp.concatenate([ap.start[:, None] - W + jnp.arange(W)[None, :], positions],
                              axis=1)
    key_ok = jnp.concatenate([jnp.ones((len(chunk.slots), W), bool), chunk.real], axis=1)
    stored = key_ok & (key_pos >= 0)
    window = jnp.where(stored[..., None], jnp.concatenate([before, rows], axis=1), 0.0)
    sparse = p.read == "sparse"
    none = positions.shape + (0,)  # a window-only layer reads no picks
    ids, valid = (chunk.picks[p.picks] if sparse
                  else (jnp.zeros(none, jnp.int32), jnp.zeros(none, bool)))

    def tile_read(q, t, ids, valid):  # rotated queries; the output before the inverse RoPE
        ok = stored[:, None, :] & (key_pos[:, None, :] <= t) & (key_pos[:, None, :] > t - W)
        key_sets = [(window, ok)]
        if sparse:
            picked = _picked(cache, p.entries, chunk.pages, ids)
            key_sets.append((jnp.where(valid[..., None], picked, 0.0), valid))
        return attention41.attend(q, weights.sink, key_sets)

    def tile_attend(q, t, ids, valid):
        t = t[..., None]
        q = rope.rotate(q.astype(jnp.float32), t, freqs)
        return rope.rotate(tile_read(q, t, ids, valid), t, freqs, inverse=True)

    if sparse and positions.shape[1] == 1 and _read_by_kernel(cache, options):
        t = positions[..., None]
        q = rope.rotate(vectors.q.astype(jnp.float32), t, freqs)
        o = ops.sparse_decode41(
            config, cache.geometry, options, window=cache41.window41(cache), layer=p.layer,
            slot_ids=chunk.slots, q_pos=ap.start,
            entries=cache41.source_store(cache, "entries", p.entries), ids=ids[:, 0],
            valid=valid[:, 0], page_rows=chunk.pages, q=q[:, 0], sink=weights.sink,
            reference=lambda: tile_read(q, t, ids, valid)[:, 0])
        out = rope.rotate(o[:, None], t, freqs, inverse=True)
    else:
        out = _by_tiles(tile_attend, options.query_tile, vectors.q, positions, ids, valid)
    return cache, chunk, jnp.where(chunk.real[..., None, None], out, 0.0)


def _read_by_kernel(cache: Cache41, options: Options) -> bool:
    """Whether some platform runs the decode read's kernel (`ops.sparse_decode41`) under
    `options` (then the op is called, with the step's own read where no kernel runs)."""
    return any(c.implementation != "reference" for c in ops.choices(
        "sparse_decode41", cache.config, cache.geometry, options).values())


def end41(cache: Cache41, chunk: Chunk41) -> Cache41:
    """Advances the lengths of the slots that appended."""
    return append.end_append(cache, chunk.plan)


def _step(cache: Cache41, vectors, weights, slot_ids, n_new, *, bf16_latent: bool = False,
          options: Options | None = None) -> tuple[Cache41, Step41]:
    cache, chunk = begin41(cache, slot_ids, n_new, vectors[0].q.shape[1])
    outputs = []
    for layer in range(len(vectors)):
        cache, chunk, out = layer41(cache, chunk, layer, vectors[layer], weights[layer],
                                    bf16_latent=bf16_latent, options=options)
        outputs.append(out)
    picks = tuple(chunk.picks[i] for i in cache.config.index_source_layers)
    return end41(cache, chunk), Step41(outputs=tuple(outputs), picks=picks)


_step_jit = programs.program("step41.prefill", _step, donate=("cache",),
                             static=("bf16_latent", "options"))


def _check_call(cache: Cache41, vectors, weights, batch: int) -> int:
    """Named checks of a call's pytree shapes (concrete or traced); returns T."""
    if not isinstance(cache, Cache41):
        checks.fail("cache", "a Cache41 (pools.init_cache41)", type(cache).__name__, TypeError)
    checks.alive("cache", cache)
    config = cache.config
    layers = plan.of(config)
    for name, value, kind in (("vectors", vectors, LayerVectors41),
                              ("weights", weights, LayerWeights41)):
        if not isinstance(value, (tuple, list)) or len(value) != len(layers):
            size = len(value) if isinstance(value, (tuple, list)) else "?"
            checks.fail(name, f"a sequence of {len(layers)} {kind.__name__} (one per layer)",
                        f"{type(value).__name__} of {size}", TypeError)
        for i, v in enumerate(value):
            if not isinstance(v, kind):
                checks.fail(f"{name}[{i}]", f"a {kind.__name__}", type(v).__name__, TypeError)
    if np.ndim(vectors[0].q) != 4:
        checks.fail("vectors[0].q", "an array [B, T, H, hd]", f"shape {np.shape(vectors[0].q)}")
    tokens = np.shape(vectors[0].q)[1]
    B, H, hd = batch, config.num_heads, config.head_dim
    nI, c = config.index_heads, config.index_head_dim
    for p in layers:
        x, w, at = vectors[p.layer], weights[p.layer], f"[{p.layer}]"
        need = {"q": (B, tokens, H, hd), "win": (B, tokens, hd)}
        wants = {"sink": (H,)}
        if p.writes_entries:
            need["a"] = (B, tokens, hd)
            if p.ratio == 2:
                need["z"] = (B, tokens, hd)
            wants.update(norm_c=(hd,), wk=(c, hd), k_norm=(c,))
        if p.scores:
            need.update(q_index=(B, tokens, nI, c), w_index=(B, tokens, nI))
        for group, obj, fields in (("vectors", x, need), ("weights", w, wants)):
            for field, shape in fields.items():
                value = getattr(obj, field)
                name = f"{group}{at}.{field}"
                if value is None:
                    checks.fail(name, f"an array of shape {shape} ({p.mode} layer)", None)
                checks.shape(name, value, shape)
                checks.dtype_kind(name, value, "floating")
    return tokens


def prefill41(cache: Cache41, vectors, weights, slot_ids, n_new, *,
              bf16_latent: bool = False, options: Options | None = None
              ) -> tuple[Cache41, Step41]:
    """Appends up to T tokens to each of B slots (any start length) and attends in every
    layer; jitted, the input cache donated.

    Args:
      cache: a `Cache41` (donated).
      vectors: one `LayerVectors41` per backbone layer, [B, T, ...] arrays.
      weights: one `LayerWeights41` per backbone layer.
      slot_ids: i32[B] distinct slots (-1: a padding row, n_new 0).
      n_new: i32[B] tokens of each row to append (the rest of the row is padding).
      bf16_latent: round each pooled latent to bf16 before its norm, as the official code.
      options: `Options` (`layer41`: the query tile and the keys a scoring loop step reads).

    Returns:
      (cache, `Step41`).

    Raises:
      ValueError / TypeError naming the argument: a vector or weight of the wrong shape or
      missing for its layer's mode, and, with concrete arguments, the row rules of
      `append.begin_append` (a FREE or flagged slot that appends, an append the device would
      drop) before anything runs.
    """
    tokens = _check_call(cache, vectors, weights, int(np.shape(slot_ids)[0]))
    if checks.concrete(slot_ids, n_new, cache):
        append.check_rows(cache, slot_ids, n_new, tokens)
        append.check_room(cache, slot_ids, n_new)
    return _step_jit(cache, tuple(vectors), tuple(weights), jnp.asarray(slot_ids, jnp.int32),
                     jnp.asarray(n_new, jnp.int32), bf16_latent=bf16_latent,
                     options=options_or_default(options))


def decode_step41(cache: Cache41, vectors, weights, active=None, *,
                  bf16_latent: bool = False, options: Options | None = None
                  ) -> tuple[Cache41, Step41]:
    """Appends one token to every active slot: `prefill41` over all max_slots slots with
    T = 1 (vectors [max_slots, 1, ...]); `active` bool[max_slots], by default the slots whose
    status is ACTIVE."""
    checks.alive("cache", cache)
    S = cache.geometry.max_slots
    if active is None:
        active = pools.status(cache) == SlotStatus.ACTIVE
    elif checks.concrete(active):
        checks.shape("active", active, (S,))
        checks.dtype_kind("active", active, "bool")
    return prefill41(cache, vectors, weights, np.arange(S, dtype=np.int32),
                     jnp.asarray(active, jnp.int32), bf16_latent=bf16_latent, options=options)


__all__ = ["Chunk41", "LayerVectors41", "LayerWeights41", "Step41", "begin41", "decode_step41",
           "end41", "layer41", "prefill41"]
