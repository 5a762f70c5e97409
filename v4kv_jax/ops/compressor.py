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

The HCA compressor can instead keep its open block as an online softmax (hca_tail="online",
`emit_entries_online`): running max, sum of exponentials and weighted sum per channel, folded
token by token in position order with the update rule of the `pools` docstring ("The online
HCA tail"); the entry of a block is RoPE(RMSNorm(weighted / sum)).

Entries are written in the pool's format: pooled, normed and rotated in fp32, then encoded
by the pool's `storage.RowCodec` (fp8_latent quantises the non-RoPE dims, fp4_index rotates
by the Hadamard matrix and quantises: the official order). The emissions take the codecs, the
RoPE tables and the page geometry from the `layout.CacheLayout` handed to them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from v4kv_jax import pools, programs, rope
from v4kv_jax.config import AttentionConfig
from v4kv_jax.pools import paging
from v4kv_jax.pools.layout import CacheLayout, CompressorSpec

_HIGHEST = jax.lax.Precision.HIGHEST


def rms_norm(x: jax.Array, weight: jax.Array | None, eps: float) -> jax.Array:
    """RMSNorm in fp32: x / sqrt(mean(x^2) + eps) (* weight)."""
    x = x.astype(jnp.float32)
    y = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps)
    return y if weight is None else y * weight.astype(jnp.float32)


def biased_gate(spec: CompressorSpec, gate: jax.Array, ape: jax.Array,
                positions: jax.Array) -> jax.Array:
    """z_t + ape[t mod m] in fp32. gate [B, T, w], positions i32[B, T]."""
    return gate.astype(jnp.float32) + programs.lookup(ape, positions % spec.ratio).astype(
        jnp.float32)


def tail_writes(spec: CompressorSpec, start: jax.Array, n_new: jax.Array, tokens: int
                ) -> jax.Array:
    """Ring row of each new token, or `ring` (out of bounds, dropped) where it is not kept.

    Only the last `ring` tokens of a chunk are written, so every kept row is written once.
    Returns i32[B, T].
    """
    ring = spec.ring
    j = jnp.arange(tokens, dtype=jnp.int32)[None, :]
    keep = (j < n_new[:, None]) & (j >= n_new[:, None] - ring)
    return jnp.where(keep, (start[:, None] + j) % ring, ring)


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
    ring_row = pos % spec.ring
    chunk_row = jnp.clip(pos - start[:, None, None], 0, tokens - 1)

    def source(tail, new):
        return jnp.where(from_tail[..., None], programs.lookup(tail, ring_row, batched=True),
                         programs.lookup(new, chunk_row, batched=True))

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
    return finish_entries(spec, config, pooled, block, norm, inv_freq)


def finish_entries(spec: CompressorSpec, config: AttentionConfig, pooled: jax.Array,
                   block: jax.Array, norm: jax.Array, inv_freq) -> jax.Array:
    """f32[B, nb, width] entries RoPE_{i m}(RMSNorm_w(pooled)) of blocks i = `block`."""
    entries = rms_norm(pooled, norm, config.rms_eps)
    return rope.rotate(entries, block * spec.ratio, inv_freq)


def _over_layers(fn, sequential: bool, *xs):
    """Maps fn over a leading layer axis: vectorised for small chunks, one layer at a time for
    large ones (bounded memory)."""
    if sequential:
        return jax.lax.map(lambda args: fn(*args), xs)
    return jax.vmap(fn)(*xs)


def emit_entries(spec: CompressorSpec, layout: CacheLayout, *, pool: pools.Lanes,
                 page_rows: jax.Array, layers: jax.Array, tail_kv: jax.Array,
                 tail_gate: jax.Array, slot_ids: jax.Array, kv: jax.Array, gate: jax.Array,
                 start: jax.Array, n_new: jax.Array, norm: jax.Array) -> jax.Array:
    """Pools every block the chunk completes and writes each entry into its page and row.

    Blocks whose page is absent are dropped (nothing else is written).

    Args:
      layout: what the configs fix (`cache.layout`): the pool's row codec, the kind's RoPE
        table, entries per page.
      pool: the compressor's Classical array (`pools.Lanes` of blocks [n_kind, num_pages]).
      page_rows: i32[B, max_pages_per_seq] of the batch's slots.
      layers: i32[n] indices into the kind's stack.
      tail_kv, tail_gate: the compressor's rings (blocks [n_kind, max_slots]), as
        they were BEFORE this chunk.
      slot_ids, start, n_new: i32[B] slot, length before the chunk, tokens appended.
      kv, gate: f32[n, B, T, in_width], the chunk (gate already biased).
      norm: f32[n, width].

    Returns:
      The updated pool.
    """
    tokens = kv.shape[2]
    block, done = completed_blocks(spec, start, n_new, tokens)

    config, inv_freq = layout.model, layout.inv_freq[spec.kind]
    tail_rows = layout.tail_rows[spec.name]

    def emit():
        old_kv = tail_rows.decode(tail_kv.block_records((layers[:, None], slot_ids[None, :])))
        old_gate = tail_rows.decode(tail_gate.block_records((layers[:, None], slot_ids[None, :])))

        def one_layer(tkv, tgate, ckv, cgate, weight):
            return pool_blocks(spec, config, tkv, tgate, ckv, cgate, start, block, weight,
                               inv_freq)

        return _over_layers(one_layer, tokens > spec.ratio, old_kv, old_gate, kv, gate, norm)

    entries = jax.lax.cond(
        jnp.any(done), emit,
        lambda: jnp.zeros((layers.shape[0], *block.shape, spec.width), jnp.float32))
    return write_entries(spec, layout, pool, page_rows, layers, block, done, entries)


def write_entries(spec: CompressorSpec, layout: CacheLayout, pool: pools.Lanes,
                  page_rows: jax.Array, layers: jax.Array, block: jax.Array, done: jax.Array,
                  entries: jax.Array) -> jax.Array:
    """Encodes f32 entries [n, B, nb, width] of blocks `block` i32[B, nb] in the pool's
    format and writes those marked `done` into their page and row (absent pages: dropped)."""
    page, row = paging.entry_pages(page_rows, jnp.where(done, block, -1),
                                   layout.entries_per_page[spec.name])
    stored = layout.rows[spec.name].encode(entries)
    return pools.put_rows(pool, layers[:, None, None], page[None], row[None], stored,
                          host=spec.name in layout.host)


def _rounded(x: jax.Array) -> jax.Array:
    """x (a NaN stays NaN) through a select that no compiler pass removes, so that a
    product is rounded to fp32 before it is added (never contracted into an FMA)."""
    return jnp.where(x == x, x, jnp.nan)


def touched_blocks(spec: CompressorSpec, start: jax.Array, n_new: jax.Array, tokens: int
                   ) -> tuple[jax.Array, jax.Array]:
    """Blocks a chunk of `tokens` tokens appended at `start` can touch, (block index
    i32[B, nb], complete after the chunk bool[B, nb]); nb = (T + m - 2) // m + 1."""
    m = spec.ratio
    k = jnp.arange((tokens + m - 2) // m + 1, dtype=jnp.int32)[None, :]
    block = start[:, None] // m + k
    return block, (block + 1) * m <= (start + n_new)[:, None]


def online_fold(spec: CompressorSpec, state: tuple[jax.Array, jax.Array, jax.Array],
                kv: jax.Array, gate: jax.Array, start: jax.Array, n_new: jax.Array):
    """Folds a chunk into the online tails (`pools` docstring), block by block in parallel.

    Every block the chunk touches is folded from its first token in the chunk (or from the
    stored state for a block that began before it) in position order, one token per step,
    with the same fp32 expressions as a single-token decode, so any chunking gives the same
    bits.

    Args:
      state: (max, sum, weighted) f32[B, width], each row's stored tail before the chunk.
      kv, gate: f32[B, T, width], the chunk (gate already biased).
      start, n_new: i32[B], slot length before the chunk and tokens appended.

    Returns:
      (state after the chunk (max, sum, weighted) f32[B, width], pooled f32[B, nb, width]
      = weighted / sum of each touched block, block i32[B, nb], done bool[B, nb]: the block
      is complete after the chunk).
    """
    m, tokens = spec.ratio, kv.shape[1]
    block, done = touched_blocks(spec, start, n_new, tokens)
    nb = block.shape[1]
    k = block - start[:, None] // m
    lo = jnp.where(k == 0, start[:, None] % m, 0)  # first offset folded in this chunk
    shape = (kv.shape[0], nb, kv.shape[2])
    first = k == 0
    carry = tuple(jnp.where(first[..., None], x[:, None, :], 0.0) for x in state)
    carry = tuple(jnp.broadcast_to(x, shape) for x in carry)

    def fold(carry, i):
        mx, s, u = carry
        offset = lo + i
        idx = block * m + offset - start[:, None]  # >= 0: offsets start at lo
        valid = ((offset < m) & (idx < n_new[:, None]))[..., None]
        row = jnp.clip(idx, 0, tokens - 1)
        a, z = (programs.lookup(x, row, batched=True) for x in (kv, gate))
        fresh = (offset == 0)[..., None]
        top = jnp.maximum(mx, z)
        c, e = jnp.exp(mx - top), jnp.exp(z - top)
        # Products rounded on their own: XLA:CPU contracts a product and a sum into an FMA
        # in some programs and not in others (an optimization barrier does not stop it),
        # which would make the bits depend on the chunking. A select between the product
        # and the sum (always the product) leaves nothing to contract.
        sc, uc, ea = (_rounded(x) for x in (s * c, u * c, e * a))
        new = (jnp.where(fresh, z, top), jnp.where(fresh, 1.0, sc + e),
               jnp.where(fresh, a, uc + ea))
        return tuple(jnp.where(valid, n, o) for n, o in zip(new, carry, strict=True)), None

    steps = min(tokens, m)
    if steps == 1:
        carry, _ = fold(carry, jnp.int32(0))
    else:
        carry, _ = jax.lax.scan(fold, carry, jnp.arange(steps, dtype=jnp.int32))
    _, s, u = carry
    last = jnp.clip((start + n_new - 1) // m - start // m, 0, nb - 1)
    new_state = tuple(programs.lookup(x, last, batched=True) for x in carry)
    return new_state, u / s, block, done


def emit_entries_online(spec: CompressorSpec, layout: CacheLayout, *,
                        pool: pools.Lanes | None, page_rows: jax.Array, layers: jax.Array,
                        tail: pools.OnlineTail, slot_ids: jax.Array, kv: jax.Array,
                        gate: jax.Array, start: jax.Array, n_new: jax.Array,
                        norm: jax.Array) -> tuple[jax.Array | None, pools.OnlineTail]:
    """Folds the chunk into the online tails and writes the entry of every block it
    completes (hca_tail="online"; `online_fold`).

    Args:
      layout: what the configs fix (`cache.layout`): the row codecs of the pool and the
        tails, the RoPE table, entries per page.
      pool: the C128 entries (blocks [n_hca, num_pages]), or None to update the
        tails only (a state-only replay).
      page_rows: i32[B, max_pages_per_seq] of the batch's slots.
      layers: i32[n] indices into the HCA stack.
      tail: the `pools.OnlineTail` of the stack (blocks [n_hca, max_slots] of one row).
      slot_ids: i32[B], each row's slot; a row with an id outside [0, max_slots) or with
        n_new 0 changes nothing.
      kv, gate: f32[n, B, T, width], the chunk (gate already biased).
      start, n_new: i32[B], slot length before the chunk and tokens appended.
      norm: f32[n, width].

    Returns:
      (the updated pool, or None, the updated `OnlineTail`).
    """
    S = tail.max.lead[1]
    read = jnp.clip(slot_ids, 0, S - 1)
    codec = layout.tail_rows[spec.name]
    state = tuple(codec.decode(x.block_records((layers[:, None], read[None, :]))[..., 0, :])
                  for x in (tail.max, tail.sum, tail.weighted))
    config, inv_freq = layout.model, layout.inv_freq[spec.kind]

    def one_layer(mx, s, u, ckv, cgate, weight):
        new_state, pooled, block, done = online_fold(spec, (mx, s, u), ckv, cgate, start, n_new)
        if pool is None:
            return new_state, None
        return new_state, finish_entries(spec, config, pooled, block, weight, inv_freq)

    new_state, entries = _over_layers(one_layer, False, *state, kv, gate, norm)
    if pool is not None:
        block, done = touched_blocks(spec, start, n_new, kv.shape[2])
        pool = write_entries(spec, layout, pool, page_rows, layers, block, done, entries)
    dest = jnp.where((slot_ids >= 0) & (slot_ids < S) & (n_new > 0), slot_ids, S)
    new_tail = pools.OnlineTail(*(
        x.put((layers[:, None], dest[None, :]), 0, codec.encode(v))
        for x, v in zip((tail.max, tail.sum, tail.weighted), new_state, strict=True)))
    return pool, new_tail
