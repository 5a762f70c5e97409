"""Reference of the compressors (kernels: `pallas_kernels/compressor/`): m tokens become
one entry (SPEC sections 3 and 4).

There are three compressors per model, one array stack each:
  "csa"        main compressor of CSA layers:    ratio m,  overlap, entries of head_dim
  "csa_index"  indexer compressor of CSA layers: ratio m,  overlap, keys of index_head_dim
  "hca"        compressor of HCA layers:         ratio m', no overlap, entries of head_dim

Inputs per token are `kv` (a_t) and `gate` (z_t before the position bias), each of width
coff * d_c (coff = 2 with overlap). The tail of a slot is a ring of `ring = coff * m` rows
indexed by position mod ring, holding (a_t, z_t + ape[t mod m]) in fp32: with overlap this is
the open block plus the complete block before it (whose first halves the next entry pools),
without overlap just the open block. Which rows are meaningful follows from the slot length
alone, so a reset slot (length 0) never reads stale rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from v4kv_jax import paging, rope, storage
from v4kv_jax.config import AttentionConfig, CacheConfig
from v4kv_jax.layout import CompressorSpec

_HIGHEST = jax.lax.Precision.HIGHEST


def rms_norm(x: jax.Array, weight: jax.Array | None, eps: float) -> jax.Array:
    """RMSNorm in fp32: x / sqrt(mean(x^2) + eps) (* weight)."""
    x = x.astype(jnp.float32)
    y = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps)
    return y if weight is None else y * weight.astype(jnp.float32)


def biased_gate(spec: CompressorSpec, gate: jax.Array, ape: jax.Array,
                positions: jax.Array) -> jax.Array:
    """z_t + ape[t mod m] in fp32. gate [B, T, w], positions i32[B, T]."""
    return gate.astype(jnp.float32) + ape[positions % spec.ratio].astype(jnp.float32)


def tail_writes(spec: CompressorSpec, start: jax.Array, n_new: jax.Array, tokens: int
                ) -> jax.Array:
    """Ring row of each new token, or `ring` (out of bounds, dropped) where it is not kept.

    Only the last `ring` tokens of a chunk are written, so every kept row is written once.
    Returns i32[B, T].
    """
    j = jnp.arange(tokens, dtype=jnp.int32)[None, :]
    keep = (j < n_new[:, None]) & (j >= n_new[:, None] - spec.ring)
    return jnp.where(keep, (start[:, None] + j) % spec.ring, spec.ring)


def completed_blocks(spec: CompressorSpec, start: jax.Array, n_new: jax.Array, tokens: int
                     ) -> tuple[jax.Array, jax.Array]:
    """Blocks completed by appending n_new tokens at `start`: (block index i32[B, nb], bool)."""
    k = jnp.arange(spec.blocks_per_chunk(tokens), dtype=jnp.int32)[None, :]
    block = start[:, None] // spec.ratio + k
    done = (block + 1) * spec.ratio <= (start + n_new)[:, None]
    return block, done


def pool_blocks(spec: CompressorSpec, config: AttentionConfig, tail_kv: jax.Array,
                tail_gate: jax.Array, kv: jax.Array, gate: jax.Array, start: jax.Array,
                block: jax.Array, norm: jax.Array, inv_freq) -> jax.Array:
    """Entries of the given blocks, pooled from the tail ring and the new chunk.

    Args:
      tail_kv, tail_gate: f32[B, ring, in_width], the ring BEFORE this chunk.
      kv, gate: f32[B, T, in_width], the chunk (gate already biased).
      start: i32[B], slot length before the chunk.
      block: i32[B, nb], block indices (all must be complete after the chunk).
      norm: f32[width].
      inv_freq: RoPE frequencies of the kind.

    Returns:
      f32[B, nb, width]: RoPE_{i m}(RMSNorm_w(softmax-pooled block i)).
    """
    m, w, tokens = spec.ratio, spec.width, kv.shape[1]
    s = jnp.arange(spec.slots, dtype=jnp.int32)
    first = (block - 1) * m if spec.overlap else block * m
    pos = first[..., None] + s  # [B, nb, slots]
    from_tail = pos < start[:, None, None]
    bidx = jnp.arange(kv.shape[0])[:, None, None]
    ring_row = pos % spec.ring
    chunk_row = jnp.clip(pos - start[:, None, None], 0, tokens - 1)

    def source(tail, new):
        return jnp.where(from_tail[..., None], tail[bidx, ring_row], new[bidx, chunk_row])

    a, z = source(tail_kv, kv), source(tail_gate, gate)  # [B, nb, slots, in_width]
    if spec.overlap:
        # Slots [0, m) are block i-1 through the FIRST half; [m, 2m) are block i, SECOND half.
        half = (s >= m)[None, None, :, None]
        a = jnp.where(half, a[..., w:], a[..., :w])
        z = jnp.where(half, z[..., w:], z[..., :w])
    valid = (pos >= 0)[..., None]
    z = jnp.where(valid, z, -jnp.inf)
    weights = jax.nn.softmax(z, axis=-2)
    pooled = jnp.sum(jnp.where(valid, weights * a, 0.0), axis=-2)
    entries = rms_norm(pooled, norm, config.rms_eps)
    return rope.rotate(entries, block * m, inv_freq)


def _over_layers(fn, sequential: bool, *xs):
    """Maps fn over a leading layer axis: vectorised for small chunks, one layer at a time for
    large ones (bounded memory)."""
    if sequential:
        return jax.lax.map(lambda args: fn(*args), xs)
    return jax.vmap(fn)(*xs)


def emit_entries(spec: CompressorSpec, config: AttentionConfig, geometry: CacheConfig, *,
                 pool: jax.Array, page_rows: jax.Array, layers: jax.Array, tail_kv: jax.Array,
                 tail_gate: jax.Array, slot_ids: jax.Array, kv: jax.Array, gate: jax.Array,
                 start: jax.Array, n_new: jax.Array, norm: jax.Array) -> jax.Array:
    """Pools every block the chunk completes and writes each entry into its page and row.

    Blocks whose page is absent are dropped (nothing else is written).

    Args:
      pool: the compressor's Classical array [n_kind, num_pages, P // m, width].
      page_rows: i32[B, max_pages_per_seq] of the batch's slots.
      layers: i32[n] indices into the kind's stack.
      tail_kv, tail_gate: the compressor's rings [n_kind, max_slots, ring, in_width], as
        they were BEFORE this chunk.
      slot_ids, start, n_new: i32[B] slot, length before the chunk, tokens appended.
      kv, gate: f32[n, B, T, in_width], the chunk (gate already biased).
      norm: f32[n, width].

    Returns:
      The updated pool.
    """
    tokens = kv.shape[2]
    block, done = completed_blocks(spec, start, n_new, tokens)

    def emit():
        old_kv = storage.decode(tail_kv[layers[:, None], slot_ids[None, :]])
        old_gate = storage.decode(tail_gate[layers[:, None], slot_ids[None, :]])
        inv_freq = rope.inv_frequencies(config, spec.kind)

        def one_layer(tkv, tgate, ckv, cgate, weight):
            return pool_blocks(spec, config, tkv, tgate, ckv, cgate, start, block, weight,
                               inv_freq)

        return _over_layers(one_layer, tokens > spec.ratio, old_kv, old_gate, kv, gate, norm)

    entries = jax.lax.cond(
        jnp.any(done), emit,
        lambda: jnp.zeros((layers.shape[0], *block.shape, spec.width), jnp.float32))
    page, row = paging.entry_pages(page_rows, jnp.where(done, block, -1),
                                   geometry.entries_per_page(spec.ratio))
    page = jnp.where(page >= 0, page, pool.shape[1])  # absent -> out of bounds -> dropped
    return pool.at[layers[:, None, None], page[None], row[None]].set(
        storage.encode(entries, pool), mode="drop")
