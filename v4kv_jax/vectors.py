"""The model -> cache contract: what a model hands the cache per token and per layer.

  Queries            one layer's queries for T tokens (and the CSA indexer's)
  CompressorInput    per-token compressor projections a_t, z_t of one compressor
  CompressorParams   a compressor's learned ape and norm weight
  CompressorWeights  the CompressorParams of every layer, per compressor
  TokenVectors       every layer's new-token vectors, stacked per kind
  LayerVectors       one layer's new-token vectors
  LayerParams        one layer's compressor params
  LayerRef           which layer: kind (static), global index, index in its kind's stack

Shapes follow SPEC section 2 (B batch rows, T tokens, H heads of hd, nI indexer heads of c).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from v4kv_jax import checks
from v4kv_jax.config import AttentionConfig, LayerKind
from v4kv_jax.pools.layout import compressor_specs


@struct.dataclass
class Queries:
    """Query-side vectors of one layer for T query tokens.

    Attributes:
      q: f32[B, T, H, hd], per-head RMSNorm and RoPE applied.
      sink: f32[H], per-head sink logits.
      index_q: f32[B, T, nI, c], indexer queries with RoPE per head (CSA layers only).
      index_weights: f32[B, T, nI], raw head weights W_iw x_t (CSA layers only).
    """

    q: jax.Array
    sink: jax.Array
    index_q: jax.Array | None = None
    index_weights: jax.Array | None = None


@struct.dataclass
class CompressorParams:
    """Learned parameters the cache needs to pool entries (stacked over the kind's layers).

    Attributes:
      ape: f32[n, m, in_width], position bias added to the gate by t mod m.
      norm: f32[n, width], weight of the entry RMSNorm.
    """

    ape: jax.Array
    norm: jax.Array


@struct.dataclass
class CompressorWeights:
    csa: CompressorParams
    csa_index: CompressorParams
    hca: CompressorParams

    @classmethod
    def init(cls, config: AttentionConfig, key: jax.Array | None = None,
             scale: float = 0.5) -> CompressorWeights:
        """Random ape (N(0, scale^2)) and norm weights (1 + N(0, 0.1^2)); `key=None` gives
        zero ape and unit norms."""
        params = {}
        for i, spec in enumerate(compressor_specs(config)):
            n = len(config.layers_of(spec.kind))
            shape_ape, shape_norm = (n, spec.ratio, spec.in_width), (n, spec.width)
            if key is None:
                params[spec.name] = CompressorParams(
                    jnp.zeros(shape_ape, jnp.float32), jnp.ones(shape_norm, jnp.float32))
            else:
                ka, kn = jax.random.split(jax.random.fold_in(key, i))
                params[spec.name] = CompressorParams(
                    scale * jax.random.normal(ka, shape_ape, jnp.float32),
                    1.0 + 0.1 * jax.random.normal(kn, shape_norm, jnp.float32),
                )
        return cls(**params)


@struct.dataclass
class CompressorInput:
    """Per-token compressor projections: kv = a_t, gate = z_t without the position bias.

    Shapes [..., B, T, in_width]; a leading layer axis when given for all layers of a kind.
    """

    kv: jax.Array
    gate: jax.Array


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
    def of(cls, cache, layer: int) -> LayerRef:
        """The layer `layer` of a cache (or of an AttentionConfig)."""
        return cls.of_config(getattr(cache, "attn_config", cache), layer)

    @classmethod
    def of_config(cls, config: AttentionConfig, layer: int) -> LayerRef:
        layer = checks.integer("layer", layer, lo=0, hi=config.num_layers - 1)
        return cls(jnp.int32(layer), jnp.int32(config.kind_index(layer)),
                   config.layer_kinds[layer])


__all__ = ["CompressorInput", "CompressorParams", "CompressorWeights", "LayerParams",
           "LayerRef", "LayerVectors", "Queries", "TokenVectors"]
