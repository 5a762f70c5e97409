"""Parameter names of one attention layer: `V4Attention` paths, transformers 5.23.0 names and
the official checkpoint's names, with the shapes a config implies.

  V4Attention path         transformers 5.23.0 (self_attn.*)      official (attn.*)
  q_a_proj                 q_a_proj.weight                        wq_a.weight
  q_a_norm                 q_a_norm.weight                        q_norm.weight
  q_b_proj                 q_b_proj.weight                        wq_b.weight
  kv_proj, kv_norm         kv_proj.weight, kv_norm.weight         wkv.weight, kv_norm.weight
  o_a_proj, o_b_proj       o_a_proj.weight, o_b_proj.weight       wo_a.weight, wo_b.weight
  sinks                    sinks                                  attn_sink
  compressor.kv_proj       compressor.kv_proj.weight              compressor.wkv.weight
  compressor.gate_proj     compressor.gate_proj.weight            compressor.wgate.weight
  compressor.ape           compressor.position_bias               compressor.ape
  compressor.norm          compressor.kv_norm.weight              compressor.norm.weight
  indexer.q_b_proj         compressor.indexer.q_b_proj.weight     indexer.wq_b.weight
  indexer.weights_proj     compressor.indexer.scorer.             indexer.weights_proj.weight
                             weights_proj.weight
  indexer.compressor.X     compressor.indexer.{kv_proj.weight,    indexer.compressor.{wkv,
    (X = kv_proj,            gate_proj.weight, position_bias,       wgate}.weight, .ape,
     gate_proj, ape, norm)   kv_norm.weight}                        .norm.weight

Weights are [out, in] in all three. Rows with `compressor.*` exist in CSA and HCA layers, rows
with `indexer.*` only in CSA layers. In a whole checkpoint the names carry a layer prefix:
`model.layers.N.self_attn.` (transformers) or `layers.N.attn.` (official).
"""

from __future__ import annotations

import dataclasses
import numbers

from v4kv_jax import checks
from v4kv_jax.config import AttentionConfig, LayerKind

TRANSFORMERS = "transformers"
OFFICIAL = "official"
LAYOUTS = (TRANSFORMERS, OFFICIAL)


@dataclasses.dataclass(frozen=True)
class ParamName:
    path: str  # the V4Attention attribute path, dot-separated
    transformers: str
    official: str
    kinds: tuple[LayerKind, ...]

    def name(self, layout: str) -> str:
        return getattr(self, check_layout(layout))


_ALL = (LayerKind.SWA, LayerKind.CSA, LayerKind.HCA)
_COMPRESSED = (LayerKind.CSA, LayerKind.HCA)
_CSA = (LayerKind.CSA,)

TABLE: tuple[ParamName, ...] = (
    ParamName("q_a_proj", "q_a_proj.weight", "wq_a.weight", _ALL),
    ParamName("q_a_norm", "q_a_norm.weight", "q_norm.weight", _ALL),
    ParamName("q_b_proj", "q_b_proj.weight", "wq_b.weight", _ALL),
    ParamName("kv_proj", "kv_proj.weight", "wkv.weight", _ALL),
    ParamName("kv_norm", "kv_norm.weight", "kv_norm.weight", _ALL),
    ParamName("o_a_proj", "o_a_proj.weight", "wo_a.weight", _ALL),
    ParamName("o_b_proj", "o_b_proj.weight", "wo_b.weight", _ALL),
    ParamName("sinks", "sinks", "attn_sink", _ALL),
    ParamName("compressor.kv_proj", "compressor.kv_proj.weight", "compressor.wkv.weight",
              _COMPRESSED),
    ParamName("compressor.gate_proj", "compressor.gate_proj.weight", "compressor.wgate.weight",
              _COMPRESSED),
    ParamName("compressor.ape", "compressor.position_bias", "compressor.ape", _COMPRESSED),
    ParamName("compressor.norm", "compressor.kv_norm.weight", "compressor.norm.weight",
              _COMPRESSED),
    ParamName("indexer.q_b_proj", "compressor.indexer.q_b_proj.weight", "indexer.wq_b.weight",
              _CSA),
    ParamName("indexer.weights_proj", "compressor.indexer.scorer.weights_proj.weight",
              "indexer.weights_proj.weight", _CSA),
    ParamName("indexer.compressor.kv_proj", "compressor.indexer.kv_proj.weight",
              "indexer.compressor.wkv.weight", _CSA),
    ParamName("indexer.compressor.gate_proj", "compressor.indexer.gate_proj.weight",
              "indexer.compressor.wgate.weight", _CSA),
    ParamName("indexer.compressor.ape", "compressor.indexer.position_bias",
              "indexer.compressor.ape", _CSA),
    ParamName("indexer.compressor.norm", "compressor.indexer.kv_norm.weight",
              "indexer.compressor.norm.weight", _CSA),
)


def check_layout(layout, name: str = "layout") -> str:
    """`layout` if it is one of `LAYOUTS`; raises naming it otherwise."""
    if not isinstance(layout, str):
        checks.fail(name, f"one of {LAYOUTS}", repr(layout), TypeError)
    checks.one_of(name, layout, LAYOUTS)
    return layout


def index(name: str, value, lo: int = 0, hi: int | None = None) -> int:
    """`checks.integer`, with a value of the wrong type shown with its repr and type (so that
    the string "3" does not read as the integer 3)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        checks.fail(name, "an integer", f"{value!r} ({type(value).__name__})", TypeError)
    return checks.integer(name, value, lo=lo, hi=hi)


def layer_kind(kind, name: str = "kind") -> LayerKind:
    """A `LayerKind` from a `LayerKind` or its int value; raises naming it otherwise."""
    if isinstance(kind, LayerKind):
        return kind
    if (isinstance(kind, bool) or not isinstance(kind, numbers.Integral)
            or kind not in {k.value for k in LayerKind}):
        checks.fail(name, "a LayerKind (" + ", ".join(f"{k.name}={k.value}" for k in LayerKind)
                    + ")", repr(kind))
    return LayerKind(kind)


def check_config(config, name: str = "config") -> AttentionConfig:
    if not isinstance(config, AttentionConfig):
        checks.fail(name, "an AttentionConfig", type(config).__name__, TypeError)
    return config


def names_for(kind: LayerKind) -> tuple[ParamName, ...]:
    """The parameters a layer of `kind` has."""
    kind = layer_kind(kind)
    return tuple(p for p in TABLE if kind in p.kinds)


def expected_shapes(config: AttentionConfig, kind: LayerKind) -> dict[str, tuple[int, ...]]:
    """V4Attention path -> shape, for one layer of `kind`."""
    check_config(config)
    kind = layer_kind(kind)
    D, H, hd, q = config.hidden_size, config.num_heads, config.head_dim, config.q_lora_rank
    g, R = config.o_groups, config.o_lora_rank
    nI, c = config.index_heads, config.index_head_dim
    shapes = {
        "q_a_proj": (q, D), "q_a_norm": (q,), "q_b_proj": (H * hd, q),
        "kv_proj": (hd, D), "kv_norm": (hd,), "o_a_proj": (g * R, H * hd // g),
        "o_b_proj": (D, g * R), "sinks": (H,),
    }
    if kind != LayerKind.SWA:
        coff = 2 if kind == LayerKind.CSA else 1
        m = config.ratio(kind)
        shapes.update({
            "compressor.kv_proj": (coff * hd, D), "compressor.gate_proj": (coff * hd, D),
            "compressor.ape": (m, coff * hd), "compressor.norm": (hd,),
        })
    if kind == LayerKind.CSA:
        m = config.csa_ratio
        shapes.update({
            "indexer.q_b_proj": (nI * c, q), "indexer.weights_proj": (nI, D),
            "indexer.compressor.kv_proj": (2 * c, D), "indexer.compressor.gate_proj": (2 * c, D),
            "indexer.compressor.ape": (m, 2 * c), "indexer.compressor.norm": (c,),
        })
    return shapes


def layer_prefix(layout: str, layer: int) -> str:
    """The prefix of layer `layer`'s attention tensors in a whole checkpoint."""
    check_layout(layout)
    layer = index("layer", layer)
    if layout == TRANSFORMERS:
        return f"model.layers.{layer}.self_attn."
    return f"layers.{layer}.attn."
