"""What an entry is: the compressors, their entry kinds and who may see which entry.

Three compressors per model, one Classical array stack each (SPEC sections 3 and 5):

  name        layers   ratio   overlap   entry width        input width (a_t, z_t)
  "csa"       CSA      m       yes       hd (C4 entry)      2 hd
  "csa_index" CSA      m       yes       c  (indexer key)   2 c
  "hca"       HCA      m'      no        hd (C128 entry)    hd

Entry i of a kind pools tokens i*m .. i*m+m-1 (with overlap also the m tokens before them);
query t may read entry i iff i < (t + 1) // m (`visible_entries`). The tail of a slot is a
ring of `ring = coff * m` rows indexed by position mod ring.

What a model and a cache config fix together (the compressors, each stored row's codec, the
RoPE tables, page geometry, where the entries live) is derived once per pair of configs,
`of(model, geometry)`: a `CacheLayout`, which a `Cache` carries (`cache.layout`) and the
write and read paths hand down to the ops, instead of each floor deriving it again.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from v4kv_jax import checks, rope
from v4kv_jax.config import AttentionConfig, CacheConfig, LayerKind
from v4kv_jax.pools import lanes, storage


@dataclasses.dataclass(frozen=True)
class CompressorSpec:
    name: str
    kind: LayerKind
    ratio: int
    overlap: bool
    width: int  # d_c, the entry width

    @property
    def in_width(self) -> int:
        return 2 * self.width if self.overlap else self.width

    @property
    def ring(self) -> int:
        return 2 * self.ratio if self.overlap else self.ratio

    @property
    def slots(self) -> int:
        """Tokens pooled into one entry."""
        return self.ring

    def blocks_per_chunk(self, tokens: int) -> int:
        """Static bound on blocks that complete while `tokens` tokens are appended."""
        return -(-tokens // self.ratio)


def compressor_specs(config: AttentionConfig) -> tuple[CompressorSpec, ...]:
    return (
        CompressorSpec("csa", LayerKind.CSA, config.csa_ratio, True, config.head_dim),
        CompressorSpec("csa_index", LayerKind.CSA, config.csa_ratio, True, config.index_head_dim),
        CompressorSpec("hca", LayerKind.HCA, config.hca_ratio, False, config.head_dim),
    )


def specs_of(config: AttentionConfig, kind: LayerKind) -> tuple[CompressorSpec, ...]:
    """The compressors of a layer kind: CSA (main, indexer), HCA (main), SWA (none)."""
    return tuple(s for s in compressor_specs(config) if s.kind == kind)


def num_layers(config: AttentionConfig, spec: CompressorSpec) -> int:
    """Layers in the compressor's stack."""
    return len(config.layers_of(spec.kind))


def entries_on_host(geometry: CacheConfig, name: str) -> bool:
    """Whether compressor `name`'s entries live in host memory (the C4 entries with
    c4_tier="host"); every other array lives on the device."""
    return name == "csa" and geometry.c4_tier == "host"


def keeps_online_tail(geometry: CacheConfig, name: str) -> bool:
    """Whether compressor `name` keeps an online tail (the HCA compressor with
    hca_tail="online") rather than a raw ring."""
    return name == "hca" and geometry.hca_tail == "online"


def _frozen(mapping: dict) -> Mapping:
    return types.MappingProxyType(mapping)


def _derived():
    return dataclasses.field(init=False, compare=False, repr=False)


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    """What a model and a cache config fix, derived once (`of`): equal and hashed as the two
    configs are, so it is a static value under jit like them.

    Attributes:
      model, geometry: the two configs.
      specs: the compressors (`compressor_specs`); `kind_specs[kind]` those of a layer kind
        (`specs_of`), `layers[kind]` the global indices of the kind's layers.
      rows: the `storage.RowCodec` of each stored row kind (`storage.codec`): "csa" C4
        entries, "csa_index" indexer keys, "hca" C128 entries, "window" the window ring.
      tail_rows: the `RowCodec` of each compressor's tail rows (`storage.tail_codec`): ring
        rows of in_width, or width for an online tail.
      inv_freq: f32[rope_dim // 2] RoPE frequencies per layer kind (`rope.inv_frequencies`).
      entries_per_page: P // m of each compressor.
      lanes: where each stored array's rows live (`lanes.LaneMap`): "csa", "csa_index",
        "hca" (blocks: a page's entries of one layer), "window" (a slot's ring of one
        layer), "tail:<compressor>" (a slot's tail ring, or its online tail: one row),
        and with a hot set "hot" (a slot's hot rows of one layer) and "hot_ids" (the
        int32 held / used words of those rows).
      host: the compressors whose entries live in host memory (`entries_on_host`).
      online: the compressors that keep an online tail (`keeps_online_tail`).

    Raises ValueError naming the `CacheConfig` field whose format the model's rows do not fit
    (`storage.codec`)."""

    model: AttentionConfig
    geometry: CacheConfig
    specs: tuple[CompressorSpec, ...] = _derived()
    kind_specs: Mapping[LayerKind, tuple[CompressorSpec, ...]] = _derived()
    layers: Mapping[LayerKind, tuple[int, ...]] = _derived()
    rows: Mapping[str, storage.RowCodec] = _derived()
    tail_rows: Mapping[str, storage.RowCodec] = _derived()
    inv_freq: Mapping[LayerKind, np.ndarray] = _derived()
    entries_per_page: Mapping[str, int] = _derived()
    lanes: Mapping[str, lanes.LaneMap] = _derived()
    host: frozenset[str] = _derived()
    online: frozenset[str] = _derived()

    def __post_init__(self):
        model, geometry = self.model, self.geometry
        specs = compressor_specs(model)
        online = frozenset(s.name for s in specs if keeps_online_tail(geometry, s.name))
        rows = {name: storage.codec(model, geometry, name) for name in storage.FORMAT_FIELDS}
        tail_rows = {s.name: storage.tail_codec(
            geometry, s.width if s.name in online else s.in_width) for s in specs}
        per_page = {s.name: geometry.entries_per_page(s.ratio) for s in specs}
        maps = {s.name: rows[s.name].lanes(per_page[s.name]) for s in specs}
        maps["window"] = rows["window"].lanes(model.window)
        for s in specs:
            maps[f"tail:{s.name}"] = tail_rows[s.name].lanes(1 if s.name in online else s.ring)
        hot = geometry.hot_set_rows(model)
        if hot:
            maps["hot"] = rows["csa"].lanes(hot)
            maps["hot_ids"] = lanes.LaneMap(1, hot, np.int32)
        derived = dict(
            specs=specs,
            kind_specs=_frozen({k: tuple(s for s in specs if s.kind == k) for k in LayerKind}),
            layers=_frozen({k: model.layers_of(k) for k in LayerKind}),
            rows=_frozen(rows),
            tail_rows=_frozen(tail_rows),
            inv_freq=_frozen({k: rope.inv_frequencies(model, k) for k in LayerKind}),
            entries_per_page=_frozen(per_page),
            lanes=_frozen(maps),
            host=frozenset(s.name for s in specs if entries_on_host(geometry, s.name)),
            online=online,
        )
        for name, value in derived.items():
            object.__setattr__(self, name, value)

    def __reduce__(self):
        # Pickled and copied as its two configs: the copy derives the rest again.
        return of, (self.model, self.geometry)

    def codec(self, name: str) -> storage.RowCodec:
        """The row codec of a stored array by name ("csa", "csa_index", "hca", "window")."""
        checks.one_of("name", name, tuple(self.rows))
        return self.rows[name]


@functools.cache
def of(model: AttentionConfig, geometry: CacheConfig) -> CacheLayout:
    """The `CacheLayout` of a model and a cache config, derived once per pair."""
    return CacheLayout(model, geometry)


def visible_entries(q_pos: jax.Array, kv_end: jax.Array, ratio: int) -> jax.Array:
    """i32[B, T]: entries query t may read, min((t+1) // m, entries written so far).

    q_pos: i32[B, T] query positions; kv_end: i32[B] tokens in the sequence.
    """
    return jnp.minimum((q_pos + 1) // ratio, (kv_end // ratio)[:, None])


__all__ = ["CacheLayout", "CompressorSpec", "compressor_specs", "entries_on_host",
           "keeps_online_tail", "num_layers", "of", "specs_of", "visible_entries"]
