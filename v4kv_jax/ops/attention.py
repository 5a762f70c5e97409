"""Reference attention (kernels: `pallas_kernels/sparse_attention/`, `.../dense_attention/`):
one softmax over the window and the compressed entries, with a sink.

For a query at position t (SPEC section 6), with scale hd^-0.5 on every key:
  window      kv_j for max(0, t - W + 1) <= j <= t
  SWA         nothing else
  CSA         C4 entries picked by the lightning indexer (top-k, -1 picks skipped)
  HCA         every C128 entry i < (t + 1) // m'
The per-head sink adds exp(sink_h) to the denominator only. V = K, so the output's last r dims
are rotated back by -t. Everything is one online softmax (running max, sum, weighted sum)
started from the sink, so the window and the entry chunks fold into it in any order.

Keys are read as stored (`CacheConfig.window_dtype` for the window, `entry_dtype` for C4 and
C128 entries) and decoded to fp32 by their `storage.RowCodec` once, where they are folded
(key sets joined for one query per slot are joined as stored, then decoded together); a key
no query may see is then replaced by zeros with `where` before any arithmetic.

Shapes: q f32[B, T, H, hd]; window keys [B, Wk, sw(hd)] (as stored) at positions
base + 0 .. Wk - 1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from v4kv_jax import checks, programs, rope
from v4kv_jax.config import AttentionConfig, CacheConfig, LayerKind, Options
from v4kv_jax.pools import paging, storage
from v4kv_jax.pools.layout import visible_entries

_HIGHEST = jax.lax.Precision.HIGHEST


@struct.dataclass
class _Softmax:
    max: jax.Array  # [B, T, H]
    denom: jax.Array  # [B, T, H]
    acc: jax.Array  # [B, T, H, hd]


def _softmax_init(sink: jax.Array, q: jax.Array) -> _Softmax:
    lead = q.shape[:-1]
    return _Softmax(
        max=jnp.broadcast_to(sink.astype(jnp.float32), lead),
        denom=jnp.ones(lead, jnp.float32),
        acc=jnp.zeros(q.shape, jnp.float32),
    )


def _softmax_fold(state: _Softmax, q: jax.Array, keys: jax.Array, visible: jax.Array
                  ) -> _Softmax:
    """Folds keys (= values) into the running softmax.

    keys are f32 [B, K, hd] shared by all queries or [B, T, K, hd] per query (decoded);
    visible is bool[B, T, K]. A key no query may see can hold anything (another request's
    rows, NaN): it is replaced by zeros with `where` before any arithmetic, since 0 * NaN is
    NaN.
    """
    seen = visible.any(axis=1) if keys.ndim == 3 else visible
    keys = jnp.where(seen[..., None], keys, 0.0)
    scale = q.shape[-1] ** -0.5
    if keys.ndim == 4:
        return _softmax_fold_per_query(state, q, keys, visible, scale)
    logits = jnp.einsum("bthd,bkd->bthk", q, keys, precision=_HIGHEST)
    visible = visible[:, :, None, :]
    logits = jnp.where(visible, logits * scale, -jnp.inf)
    new_max = jnp.maximum(state.max, jnp.max(logits, axis=-1))
    correction = jnp.exp(state.max - new_max)
    p = jnp.where(visible, jnp.exp(logits - new_max[..., None]), 0.0)
    weighted = jnp.einsum("bthk,bkd->bthd", p, keys, precision=_HIGHEST)
    return _Softmax(
        max=new_max,
        denom=state.denom * correction + jnp.sum(p, axis=-1),
        acc=state.acc * correction[..., None] + weighted,
    )


def _softmax_fold_per_query(state: _Softmax, q: jax.Array, keys: jax.Array,
                            visible: jax.Array, scale: float) -> _Softmax:
    """`_softmax_fold` of keys [B, T, K, hd] read per query (masked), visible bool[B, T, K]:
    the logits laid out [B, T, K, H], keys before heads, so that each query's product has
    the K keys as its rows rather than the H heads (XLA:CPU: a prefill tile of 64 queries
    x 128 picks folds in 4.3-5.0 instead of 5.4-6.6 ms)."""
    logits = jnp.einsum("btkd,bthd->btkh", keys, q, precision=_HIGHEST)
    visible = visible[..., None]
    logits = jnp.where(visible, logits * scale, -jnp.inf)
    new_max = jnp.maximum(state.max, jnp.max(logits, axis=2))
    correction = jnp.exp(state.max - new_max)
    p = jnp.where(visible, jnp.exp(logits - new_max[:, :, None, :]), 0.0)
    weighted = jnp.einsum("btkh,btkd->bthd", p, keys, precision=_HIGHEST)
    return _Softmax(
        max=new_max,
        denom=state.denom * correction + jnp.sum(p, axis=2),
        acc=state.acc * correction[..., None] + weighted,
    )


def _fold_key_sets(state: _Softmax, q: jax.Array, key_sets, join: bool) -> _Softmax:
    """Folds (stored keys, their `storage.RowCodec`, visible) sets into the softmax, each
    stored array decoded once; with `join` (T = 1) into one set. Joined sets of one codec
    are joined as stored and decoded together: one decode pass over all the rows instead of
    one per set and a copy of the decoded rows (the decode is row by row, so the values are
    the same)."""
    if join and len(key_sets) > 1:
        per_slot = [k[:, 0] if k.ndim == 4 else k for k, _, _ in key_sets]
        codecs = {codec for _, codec, _ in key_sets}
        if len(codecs) == 1:
            keys = codecs.pop().decode(jnp.concatenate(per_slot, axis=1))
        else:
            keys = jnp.concatenate([codec.decode(k) for k, (_, codec, _) in
                                    zip(per_slot, key_sets, strict=True)], axis=1)
        visible = jnp.concatenate([v for _, _, v in key_sets], axis=2)
        return _softmax_fold(state, q, keys, visible)
    for keys, codec, visible in key_sets:
        state = _softmax_fold(state, q, codec.decode(keys), visible)
    return state


def _fold_picks(state: _Softmax, q: jax.Array, key_sets, join: bool, entries: jax.Array,
                layer, page_rows: jax.Array, picks: jax.Array, codec) -> _Softmax:
    """Folds `key_sets` and the picked entries (picks i32[B, T, k], -1 = none) into the
    softmax, reading only the shortest prefix of the picks' columns (a multiple of k / 4,
    chosen at run time by `lax.switch`) that holds every pick of the batch. The indexer
    puts its unused picks last, so below k * csa_ratio tokens the picks that do not exist
    yet are mostly neither gathered, decoded nor multiplied."""
    k = picks.shape[-1]
    sizes = sorted({max(1, k * i // 4) for i in range(1, 5)})
    last = jnp.max(jnp.where(picks >= 0, jnp.arange(1, k + 1, dtype=jnp.int32), 0))

    def fold(size):
        def run(state):
            picked, present = paging.gather_entries(entries, layer, page_rows,
                                                    picks[..., :size])
            return _fold_key_sets(state, q, [*key_sets, (picked, codec, present)], join)
        return run

    return jax.lax.switch(paging.prefix_bucket(sizes, last), [fold(s) for s in sizes], state)


def _ring_order(W: int, kv_end: jax.Array) -> jax.Array:
    """i32[B, W]: the ring row of position kv_end - W + e, for each e."""
    return (kv_end[:, None] - W + jnp.arange(W, dtype=jnp.int32)[None, :]) % W


def ordered_window(ring: jax.Array, kv_end: jax.Array) -> jax.Array:
    """Ring rows [B, W, sw] -> rows ordered by position: row e is position kv_end - W + e."""
    return jnp.take_along_axis(ring, _ring_order(ring.shape[1], kv_end)[..., None], axis=1)


def ordered_rings(ring, index: tuple, kv_end: jax.Array) -> jax.Array:
    """[B, W, sw]: the rings of blocks `index` of `ring` (`pools.Lanes`; one index per
    leading dim, each a scalar or i32[B]), ordered by position (`ordered_window`). On a TPU
    the blocks are gathered whole, then ordered; elsewhere each row is taken from its ring
    slot directly (one gather per lane part, not the ring and then its order)."""
    W = ring.map.records

    def whole():
        return ordered_window(ring.block_records(index), kv_end)

    def rows():
        return ring.take(tuple(i if jnp.ndim(i) == 0 else i[:, None] for i in index),
                         _ring_order(W, kv_end))

    return programs.platform_dependent(tpu=whole, default=rows)


def attend(model: AttentionConfig, geometry: CacheConfig, options: Options, kind: LayerKind, *,
           layer, entries: jax.Array | None, page_rows: jax.Array, q: jax.Array,
           sink: jax.Array, q_pos: jax.Array, kv_end: jax.Array, window_keys: jax.Array,
           window_base: jax.Array, picks: jax.Array | None = None,
           one_query: bool | None = None) -> jax.Array:
    """Attention output of one layer before the output projection, de-rotated.

    Args:
      model, geometry, options: static configs.
      kind: the layer's kind (static).
      layer: index into the stack of that kind (may be traced); unused for SWA.
      entries: the kind's Classical array (`pools.Lanes`: C4 for CSA, C128 for HCA), None
        for SWA.
      page_rows: i32[B, max_pages_per_seq].
      q: f32[B, T, H, hd] queries (RoPE applied); sink: f32[H].
      q_pos: i32[B, T] query positions.
      kv_end: i32[B], tokens in the sequence including this chunk; keys at or past it are
        never read (padded queries stay finite).
      window_keys: [B, Wk, sw(hd)] as stored in the window ring's format, key i at position
        window_base + i.
      window_base: i32[B].
      picks: CSA only: i32[B, T, k] entries chosen by the indexer (-1 = none).
      one_query: fold the key sets as for one query per row (joined into one softmax step);
        default T == 1. A chunk read a few queries at a time passes the chunk's choice, so
        that its outputs keep the bits of a whole-chunk read.

    Returns:
      f32[B, T, H, hd].
    """
    q = q.astype(jnp.float32)
    join = q.shape[1] == 1 if one_query is None else one_query
    key_pos = window_base[:, None] + jnp.arange(window_keys.shape[1], dtype=jnp.int32)
    readable = (key_pos >= 0) & (key_pos < kv_end[:, None])
    visible = ((key_pos[:, None, :] <= q_pos[..., None])
               & (key_pos[:, None, :] > q_pos[..., None] - model.window)
               & readable[:, None, :])
    # Key sets (stored rows [B, K, sw] per slot or [B, T, K, sw] per query, their codec,
    # visible [B, T, K]) folded into one softmax, decoded there. With one query per slot they
    # are joined first: one decode and one pair of dots per layer.
    state = _softmax_init(sink, q)
    key_sets = [(window_keys, storage.codec(model, geometry, "window"), visible)]

    if kind == LayerKind.HCA:
        m = model.hca_ratio
        epp = geometry.entries_per_page(m)
        seen = visible_entries(q_pos, kv_end, m)
        chunk_pages = options.read_chunk_pages(geometry, options.hca_read_entries, m)
        codec = storage.codec(model, geometry, "hca")

        def chunk(page_ids, first):
            ent, present = paging.gather_pages(entries, layer, page_ids)
            idx = first + jnp.arange(ent.shape[1], dtype=jnp.int32)
            return ent, codec, (idx[None, None, :] < seen[..., None]) & present[:, None, :]

        if page_rows.shape[1] <= chunk_pages:  # one read covers every page: no loop
            key_sets.append(chunk(page_rows, 0))
        else:
            state = _fold_key_sets(state, q, key_sets, join)
            key_sets = []
            state = paging.fold_page_chunks(
                page_rows, kv_end // m, epp, chunk_pages,
                lambda state, ids, first: _fold_key_sets(state, q, [chunk(ids, first)], join),
                state)
    elif kind == LayerKind.CSA:
        if picks is None:
            raise ValueError("picks: expected the indexer's picks i32[B, T, k] for a CSA layer; "
                             "got None")
        state = _fold_picks(state, q, key_sets, join, entries, layer, page_rows, picks,
                            storage.codec(model, geometry, "csa"))
        key_sets = []

    state = _fold_key_sets(state, q, key_sets, join)
    out = state.acc / state.denom[..., None]
    return rope.rotate(out, q_pos[..., None], rope.inv_frequencies(model, kind), inverse=True)


def _decode(model, geometry, options, kind, q, sink, window, window_layer, slot_ids, q_pos,
            kv_end, entries, entry_layer, page_rows, picks=None):
    out = attend(model, geometry, options, kind, layer=entry_layer, entries=entries,
                 page_rows=page_rows, q=q[:, None], sink=sink, q_pos=q_pos[:, None],
                 kv_end=kv_end,
                 window_keys=ordered_rings(window, (window_layer, slot_ids), kv_end),
                 window_base=kv_end - model.window,
                 picks=None if picks is None else picks[:, None])
    return out[:, 0]


def sparse_decode_attention(model: AttentionConfig, geometry: CacheConfig, options: Options,
                            q: jax.Array, sink: jax.Array, window: jax.Array, window_layer,
                            slot_ids: jax.Array, q_pos: jax.Array, kv_end: jax.Array,
                            c4: jax.Array, c4_layer, page_rows: jax.Array, picks: jax.Array
                            ) -> jax.Array:
    """CSA decode attention of one query per slot: window ring + picked C4 entries.

    Args:
      q: f32[B, H, hd] (RoPE applied); sink: f32[H].
      window: the State pool's rings (`pools.Lanes` of blocks [n_layers, max_slots]) as
        stored; window_layer: global layer.
      slot_ids, q_pos, kv_end: i32[B]: the slot, the query position and the tokens in the
        sequence (the ring holds every position below kv_end).
      c4: the C4 entries (`pools.Lanes` of blocks [n_csa, num_pages]) as stored; c4_layer:
        index in the CSA stack.
      page_rows: i32[B, max_pages_per_seq]; picks: i32[B, k] entry ids (-1 = none).

    Returns:
      f32[B, H, hd], de-rotated by -q_pos.
    """
    return _decode(model, geometry, options, LayerKind.CSA, q, sink, window, window_layer,
                   slot_ids, q_pos, kv_end, c4, c4_layer, page_rows, picks)


def dense_decode_attention(model: AttentionConfig, geometry: CacheConfig, options: Options,
                           q: jax.Array, sink: jax.Array, window: jax.Array, window_layer,
                           slot_ids: jax.Array, q_pos: jax.Array, kv_end: jax.Array,
                           c128: jax.Array, c128_layer, page_rows: jax.Array) -> jax.Array:
    """HCA decode attention of one query per slot: window ring + every visible C128 entry.

    Arguments as `sparse_decode_attention` without picks; c128 is the C128 entries
    (`pools.Lanes` of blocks [n_hca, num_pages]) as stored.
    """
    return _decode(model, geometry, options, LayerKind.HCA, q, sink, window, window_layer,
                   slot_ids, q_pos, kv_end, c128, c128_layer, page_rows)


def output_projection(o: jax.Array, w_oa: jax.Array, w_ob: jax.Array, groups: int,
                      precision=_HIGHEST, *, layout: str = "out_in") -> jax.Array:
    """Grouped output projection (SPEC section 6), in fp32: a batched matmul with the group
    as the leading batch axis, then one plain matmul; only activations are transposed, never
    the weights (a transposed weight is a copy of it on every call).

    Args:
      o: [..., H, hd] attention output.
      w_oa: layout "out_in" (the checkpoints'): [g * R, H * hd / g], group j uses rows
        j*R .. (j+1)*R - 1; "in_out": [g, H * hd / g, R], group j's block transposed.
      w_ob: "out_in": [D, g * R]; "in_out": [g * R, D].
      groups: g.
      precision: of both matmuls (the library's reference: HIGHEST; the Flax modules pass
        their own).
      layout: "out_in" or "in_out", as above (`V4Attention` stores "in_out").

    Returns:
      f32[..., D].
    """
    checks.one_of("layout", layout, ("out_in", "in_out"))
    lead = o.shape[:-2]
    per_group = o.shape[-2] * o.shape[-1] // groups
    x = o.reshape(-1, groups, per_group).astype(jnp.float32).transpose(1, 0, 2)
    if layout == "out_in":
        y = jnp.einsum("gni,gri->gnr", x,
                       w_oa.reshape(groups, -1, per_group).astype(jnp.float32),
                       precision=precision)
    else:
        y = jnp.einsum("gni,gir->gnr", x, w_oa.astype(jnp.float32), precision=precision)
    y = y.transpose(1, 0, 2).reshape(y.shape[1], -1)
    spec = "ni,oi->no" if layout == "out_in" else "ni,io->no"
    return jnp.einsum(spec, y, w_ob.astype(jnp.float32),
                      precision=precision).reshape(*lead, -1)
