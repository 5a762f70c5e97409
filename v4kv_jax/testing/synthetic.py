"""Random per-token vectors and queries for a batch of sequences (demo, tests, benchmarks).

The cache API takes each layer's per-token vectors, not hidden states; this module draws
them at random for whole sequences, then serves any slice of positions as `TokenVectors`
(cache input), `Queries` (attention input) or `oracle.LayerHistory` (brute-force input).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from v4kv_jax import pools, programs
from v4kv_jax.config import AttentionConfig, CacheConfig, LayerKind
from v4kv_jax.pools import Cache, SlotStatus, init_cache, storage
from v4kv_jax.pools.layout import compressor_specs
from v4kv_jax.testing import oracle
from v4kv_jax.vectors import CompressorInput, CompressorWeights, Queries, TokenVectors


@dataclasses.dataclass
class SyntheticBatch:
    """Per-token vectors of B sequences of up to T tokens (numpy float32).

    Attributes:
      window: [n_layers, B, T, hd].
      compressors: name -> (kv, gate), each [n_kind, B, T, in_width].
      q: [n_layers, B, T, H, hd]; sinks: [n_layers, H].
      index_q: [n_csa, B, T, nI, c]; index_weights: [n_csa, B, T, nI].
      weights: compressor params of every layer.
    """

    config: AttentionConfig
    window: np.ndarray
    compressors: dict[str, tuple[np.ndarray, np.ndarray]]
    q: np.ndarray
    sinks: np.ndarray
    index_q: np.ndarray
    index_weights: np.ndarray
    weights: CompressorWeights

    @classmethod
    def draw(cls, config: AttentionConfig, batch: int, tokens: int, seed: int = 0
             ) -> SyntheticBatch:
        rng = np.random.default_rng(seed)

        def normal(*shape, scale=1.0):
            return (scale * rng.standard_normal(shape)).astype(np.float32)

        L, B, T = config.num_layers, batch, tokens
        compressors = {}
        for spec in compressor_specs(config):
            n = len(config.layers_of(spec.kind))
            compressors[spec.name] = (normal(n, B, T, spec.in_width),
                                      normal(n, B, T, spec.in_width))
        return cls(
            config=config,
            window=normal(L, B, T, config.head_dim),
            compressors=compressors,
            q=normal(L, B, T, config.num_heads, config.head_dim),
            sinks=normal(L, config.num_heads),
            index_q=normal(config.num_csa, B, T, config.index_heads, config.index_head_dim),
            index_weights=normal(config.num_csa, B, T, config.index_heads),
            weights=CompressorWeights.init(config, jax.random.PRNGKey(seed)),
        )

    @property
    def batch(self) -> int:
        return self.window.shape[1]

    def _index(self, positions, rows):
        rows = np.arange(self.batch) if rows is None else np.asarray(rows)
        pos = np.clip(np.asarray(positions), 0, self.window.shape[2] - 1)
        if pos.ndim == 1:  # one token per row
            pos = pos[:, None]
        return rows[:, None], pos

    def take(self, positions, rows=None) -> TokenVectors:
        """Cache input at positions i32[B', T] (or [B'], one token) of rows `rows` (default
        all). Positions past the end repeat the last token: use them as padding only."""
        r, pos = self._index(positions, rows)

        def cut(x):
            return jnp.asarray(x[:, r, pos])

        return TokenVectors(
            window=cut(self.window),
            **{name: CompressorInput(cut(kv), cut(gate))
               for name, (kv, gate) in self.compressors.items()},
        )

    def span(self, start: int, stop: int) -> TokenVectors:
        """Cache input for positions [start, stop) of every row."""
        return self.take(np.broadcast_to(np.arange(start, stop), (self.batch, stop - start)))

    def queries(self, layer: int, positions, rows=None) -> Queries:
        """Queries of one layer at positions i32[B', T] of the rows `rows` (default all)."""
        r, pos = self._index(positions, rows)
        fields = dict(q=jnp.asarray(self.q[layer][r, pos]), sink=jnp.asarray(self.sinks[layer]))
        if self.config.layer_kinds[layer] == LayerKind.CSA:
            k = self.config.kind_index(layer)
            fields.update(index_q=jnp.asarray(self.index_q[k][r, pos]),
                          index_weights=jnp.asarray(self.index_weights[k][r, pos]))
        return Queries(**fields)

    def stacked_queries(self, positions, rows=None) -> Queries:
        """Queries of every layer at positions i32[B', T], stacked as `step.append_and_attend`
        takes."""
        r, pos = self._index(positions, rows)
        return Queries(
            q=jnp.asarray(self.q[:, r, pos]),
            sink=jnp.asarray(self.sinks),
            index_q=jnp.asarray(self.index_q[:, r, pos]),
            index_weights=jnp.asarray(self.index_weights[:, r, pos]),
        )

    def history(self, layer: int, row: int) -> oracle.LayerHistory:
        """The oracle's view of one layer of one sequence."""
        config = self.config
        kind = config.layer_kinds[layer]
        h = oracle.LayerHistory(window=self.window[layer, row], q=self.q[layer, row],
                                sink=self.sinks[layer])
        if kind == LayerKind.SWA:
            return h
        k = config.kind_index(layer)
        main = "csa" if kind == LayerKind.CSA else "hca"
        params = getattr(self.weights, main)
        h.kv, h.gate = (x[k, row] for x in self.compressors[main])
        h.ape, h.norm = np.asarray(params.ape[k]), np.asarray(params.norm[k])
        if kind == LayerKind.CSA:
            h.index_kv, h.index_gate = (x[k, row] for x in self.compressors["csa_index"])
            h.index_ape = np.asarray(self.weights.csa_index.ape[k])
            h.index_norm = np.asarray(self.weights.csa_index.norm[k])
            h.index_q, h.index_weights = self.index_q[k, row], self.index_weights[k, row]
        return h


# One compiled program per row format (a codec run op by op compiles each op on its own).
_encode = jax.jit(lambda codec, values: codec.encode(values), static_argnums=0)
_filled = jax.jit(lambda codec, value: codec.filled(value), static_argnums=(0, 1))


def random_cache(model: AttentionConfig, geometry: CacheConfig, lengths, seed: int = 0,
                 fill_unused: float = 0.0) -> Cache:
    """A cache whose slots 0..len(lengths)-1 hold `lengths` tokens of random content.

    Page tables, lengths, refcounts and the free stack are exactly what appending that many
    tokens leaves (slot b takes its pages after slot b-1); entries, windows and tails are
    random normal values encoded in the geometry's formats (online HCA tails: max normal,
    sum uniform in [1, m'), weighted normal times the sum). Pages nobody holds are filled
    with rows that decode to `fill_unused` (NaN: words 0xFFFFFFFF in packed formats; NaN
    exposes stray reads). Meant for benchmarks and kernel tests at long
    contexts, where really appending would take minutes. Values are drawn with numpy (much
    faster on CPU than compiling a random program per array shape).
    """
    lengths = np.asarray(lengths, np.int64)
    P = geometry.page_tokens
    need = -(-lengths // P)
    if need.sum() > geometry.num_pages:
        raise ValueError(f"lengths: expected at most num_pages={geometry.num_pages} pages of "
                         f"tokens; got {lengths.tolist()} ({int(need.sum())} pages)")
    if lengths.max(initial=0) > geometry.max_seq_len:
        raise ValueError(f"lengths: expected at most max_seq_len={geometry.max_seq_len}; got "
                         f"{lengths.tolist()}")
    cache = init_cache(model, geometry)
    table = np.full((geometry.max_slots, geometry.max_pages_per_seq), -1, np.int32)
    first = np.concatenate([[0], np.cumsum(need)[:-1]]).astype(np.int32)
    for b, n in enumerate(need):
        table[b, :n] = first[b] + np.arange(n)
    used = int(need.sum())
    refcount = (np.arange(geometry.num_pages) < used).astype(np.int32)
    free = np.arange(geometry.num_pages - 1, used - 1, -1, dtype=np.int32)
    rng = np.random.default_rng(seed)

    def values(x: pools.Lanes, width: int, scale=None) -> np.ndarray:
        """Random normal f32 rows [*lead, E, width] for the blocks of x (times `scale`)."""
        out = rng.standard_normal((*x.lead, x.map.records, width)).astype(np.float32)
        return out if scale is None else out * scale

    def stored(x: pools.Lanes, codec, rows: np.ndarray, unused_pages=False) -> pools.Lanes:
        """x's blocks holding `rows` encoded by `codec`; with unused_pages, the pages past
        the used ones hold rows that decode to `fill_unused`."""
        encoded = _encode(codec, rows)
        if unused_pages:
            encoded = encoded.at[:, used:].set(_filled(codec, fill_unused))
        return x.map.pack(encoded)

    for spec in cache.specs:
        codec = pools.codec(cache, spec.name)
        pool = pools.entries(cache, spec)
        cache = pools.with_entries(cache, spec, stored(pool, codec, values(pool, codec.width),
                                                       unused_pages=True))
        tail = pools.tail(cache, spec)
        rows = cache.layout.tail_rows[spec.name]
        if pools.online_tail(geometry, spec):
            total = rng.uniform(1.0, spec.ratio, (*tail.sum.lead, 1, rows.width)
                                ).astype(np.float32)
            tail = pools.OnlineTail(
                max=stored(tail.max, rows, values(tail.max, rows.width)),
                sum=stored(tail.sum, rows, total),
                weighted=stored(tail.weighted, rows, values(tail.weighted, rows.width, total)))
        else:
            tail = pools.Tail(*(stored(x, rows, values(x, rows.width))
                                for x in (tail.kv, tail.gate)))
        cache = pools.with_tail(cache, spec, tail)
    ring, window = pools.window_ring(cache), pools.codec(cache, "window")
    cache = pools.with_window_ring(cache, stored(ring, window, values(ring, window.width)))
    status = np.zeros(geometry.max_slots, np.int32)
    status[: len(lengths)] = SlotStatus.ACTIVE
    all_lengths = np.zeros(geometry.max_slots, np.int32)
    all_lengths[: len(lengths)] = lengths
    cache = pools.with_slots(cache, lengths=jnp.asarray(all_lengths),
                             status=jnp.asarray(status))
    cache = pools.with_page_state(cache, pools.page_state(cache).replace(
        page_table=jnp.asarray(table),
        free_stack=jnp.asarray(np.concatenate([free, np.zeros(used, np.int32)])),
        num_free=jnp.asarray(geometry.num_pages - used, jnp.int32),
        refcount=jnp.asarray(refcount)))
    return programs.committed_together(cache)  # one placement, as init_cache gives


def owned_masks(cache: Cache, held_pages=()) -> dict[str, np.ndarray]:
    """What live requests own, as bool masks shaped like the cache's storage arrays.

    A slot is live unless FREE. It owns, per layer: the window rows of its last
    min(length, W) positions; the tail rows of its open block (and, with overlap, of the
    complete block before it), or its online tail while its open block holds tokens; and in
    the Classical pool the rows of its complete entries (entry i < length // m) in the pages
    of its page-table row. Every row of `held_pages` (full pages held outside the page
    tables, e.g. by a prefix index) is owned too. Everything else is memory no request may
    read.

    Returns:
      {"window", "<compressor>_tail", "<compressor>_entries"} -> bool masks broadcastable to
      the rows of those arrays (`pools.Lanes.records()`: [1, S, W, 1], [1, S, ring, 1] or
      [1, S, 1, 1] for an online tail, [1, pages, P // m, 1]); with a hot set also "hot"
      [n_csa, S, H] (its rows).
    """
    geo = cache.geometry
    lengths = np.asarray(pools.lengths(cache), np.int64)
    live = np.asarray(pools.status(cache)) != SlotStatus.FREE
    table = np.asarray(pools.page_table(cache))
    S, W = geo.max_slots, cache.attn_config.window
    masks = {"window": np.zeros((1, S, W, 1), bool)}
    for s in np.flatnonzero(live):
        n = lengths[s]
        masks["window"][0, s, np.arange(max(0, n - W), n) % W] = True
    for spec in cache.specs:
        m, epp = spec.ratio, geo.entries_per_page(spec.ratio)
        online = pools.online_tail(geo, spec)
        tail = np.zeros((1, S, 1 if online else spec.ring, 1), bool)
        entries = np.zeros((1, geo.num_pages, epp, 1), bool)
        for s in np.flatnonzero(live):
            n = lengths[s]
            first = (n // m - (1 if spec.overlap else 0)) * m
            if online:
                tail[0, s] = n % m != 0
            else:
                tail[0, s, np.arange(max(0, first), n) % spec.ring] = True
            count = n // m
            for col, page in enumerate(table[s]):
                if page >= 0:
                    rows = np.arange(epp)
                    entries[0, page] |= (col * epp + rows < count)[:, None]
        for page in held_pages:
            entries[0, int(page)] = True
        masks[f"{spec.name}_tail"] = tail
        masks[f"{spec.name}_entries"] = entries
    hot = pools.hot_set(cache)
    if hot is not None:  # a hot row is owned while a live slot's row holds an entry
        masks["hot"] = (np.asarray(hot.held.records())[..., 0] > 0) & live[None, :, None]
    return masks


def poison_unowned(cache: Cache, value: float = float("nan"), held_pages=()) -> Cache:
    """The cache with every storage row no live request owns set to rows that decode to
    `value` (`owned_masks`, with the full pages `held_pages` held outside the page tables);
    in a packed format NaN is the word 0xFFFFFFFF everywhere (NaN in every dim, scale bytes
    included), another value its encoded row.

    Outputs and states of live requests must not change by a single bit: a read that is
    not masked with `where` (0 * NaN = NaN) or that reaches another request's rows shows up.
    """
    masks = owned_masks(cache, held_pages)

    def fill(x: pools.Lanes, mask, codec: storage.RowCodec) -> pools.Lanes:
        """The stored array with the rows outside `mask` (and every padding lane and row,
        which no one may read) set to rows that decode to `value`; on the device (the
        accessors put it back in its tier)."""
        row = _filled(codec, value)
        on_host = any(getattr(p.sharding, "memory_kind", None) != "device"
                      for p in jax.tree.leaves(x))
        # Host planes onto the device; device planes as they are (uncommitted ones stay so:
        # the cache keeps its placement, and the programs it goes to one compilation).
        rows = jnp.where(jnp.asarray(mask),
                         (jax.device_put(x, jax.memory.Space.Device) if on_host else x).records(),
                         row)
        return x.map.pack(rows, pad=row[0])

    for spec in cache.specs:
        cache = pools.with_entries(cache, spec, fill(pools.entries(cache, spec),
                                                     masks[f"{spec.name}_entries"],
                                                     pools.codec(cache, spec.name)))
        tail_rows = cache.layout.tail_rows[spec.name]
        mask = masks[f"{spec.name}_tail"]
        cache = pools.with_tail(cache, spec, jax.tree.map(
            lambda x, mask=mask, tail_rows=tail_rows: fill(x, mask, tail_rows),
            pools.tail(cache, spec), is_leaf=lambda x: isinstance(x, pools.Lanes)))
    hot = pools.hot_set(cache)
    if hot is not None:
        cache = pools.with_hot_set(cache, hot.replace(rows=fill(
            hot.rows, masks["hot"][..., None], pools.codec(cache, "csa"))))
    return pools.with_window_ring(cache, fill(pools.window_ring(cache), masks["window"],
                                              pools.codec(cache, "window")))
