"""What an entry is: the compressors, their entry kinds and who may see which entry.

Three compressors per model, one Classical array stack each (SPEC sections 3 and 5):

  name        layers   ratio   overlap   entry width        input width (a_t, z_t)
  "csa"       CSA      m       yes       hd (C4 entry)      2 hd
  "csa_index" CSA      m       yes       c  (indexer key)   2 c
  "hca"       HCA      m'      no        hd (C128 entry)    hd

Entry i of a kind pools tokens i*m .. i*m+m-1 (with overlap also the m tokens before them);
query t may read entry i iff i < (t + 1) // m (`visible_entries`). The tail of a slot is a
ring of `ring = coff * m` rows indexed by position mod ring.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from v4kv_jax.config import AttentionConfig, LayerKind


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


def visible_entries(q_pos: jax.Array, kv_end: jax.Array, ratio: int) -> jax.Array:
    """i32[B, T]: entries query t may read, min((t+1) // m, entries written so far).

    q_pos: i32[B, T] query positions; kv_end: i32[B] tokens in the sequence.
    """
    return jnp.minimum((q_pos + 1) // ratio, (kv_end // ratio)[:, None])


__all__ = ["CompressorSpec", "compressor_specs", "num_layers", "specs_of",
           "visible_entries"]
