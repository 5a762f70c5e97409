"""Parameter names of one DeepSeek-V4.1 attention layer: `V41Attention` paths and the official
checkpoint's names, which layers own each, and the shapes a `V41Config` implies.

  V41Attention path      official (layers.N.attn.*)    owned by            shape [out, in]
  wq_a                   wq_a.weight                   every layer         [q, D]
  q_norm                 q_norm.weight                 every layer         [q]
  wq_b                   wq_b.weight                   every layer         [H hd, q]
  wkv                    wkv.weight                    every layer         [hd, D]
  kv_norm                kv_norm.weight                every layer         [hd]
  wo_a                   wo_a.weight                   every layer         [g R, H hd / g]
  wo_b                   wo_b.weight                   every layer         [D, g R]
  attn_sink              attn_sink                     every layer         [H]
  compressor.wkv         compressor.wkv.weight         kv sources (Full)   [hd, D]
  compressor.wgate       compressor.wgate.weight       ratio-2 kv sources  [hd, D]
  compressor.norm        compressor.norm.weight        kv sources          [hd]
  indexer.wq_b           indexer.wq_b.weight           index sources       [nI c, q]
  indexer.weights_proj   indexer.weights_proj.weight   index sources       [nI, D]
  indexer.wk             indexer.wk.weight             kv sources          [c, hd]
  indexer.k_norm         indexer.k_norm.weight         kv sources          [c]

(D hidden, q q_lora_rank, H heads of hd, g o_groups of rank R, nI index heads of c.) Index
sources are the Full and Reindex layers; SWA and Reuse layers own only the first eight rows.
A whole checkpoint prefixes every name with `layers.N.attn.` (N the layer); a quantised
projection `X.weight` comes with its block scales `X.scale` (`checkpoint41`).

Where the names come from:
  * The module names are those of the official inference code, `inference/model.py` of
    deepseek-ai/DeepSeek-V4.1-Flash rev dba1be0a (V41_SPEC.md's [REF], read through the
    vendored copy its section 0 names): `Attention` holds `attn_sink`, `wq_a`, `q_norm`,
    `wq_b`, `wkv`, `kv_norm`, `wo_a`, `wo_b`, a `compressor` (`Compressor`: `wkv`, `wgate` only
    above ratio 1, `norm`) on kv sources only and an `indexer` (`Indexer`: `wq_b`,
    `weights_proj`, and `wk`, `k_norm` only where the layer is a kv source, `owns_k`) on
    index sources only; `Transformer` holds them as `layers.N.attn`. They are V4's official
    names (`interop.names`, OFFICIAL) without V4's `compressor.ape`, `indexer.compressor.*`
    and per-head q norm, plus `indexer.wk` and `indexer.k_norm`. Spec sections 1 and 6 name
    the same modules and owners (its [PLOW] counts: 4 `compressor.wkv`, 3 `compressor.wgate`,
    8 `indexer.wq_b`, 4 `indexer.wk` in V4.1-Flash).
  * Shapes: the same `__init__`s (`Linear(in, out)` stores [out, in]; `wo_a` is
    `Linear(H hd / g, g R)`), and spec sections 3, 4.1 (wkv_c, wgate_c [hd, D]; wk [c, hd]).
  * `.scale` companions, 32 x 32 fp8 blocks with e8m0 scales, and fp4 ([out, in / 2] packed,
    an e8m0 scale every 32 inputs): the reference's `Linear` (`self.weight.scale =
    self.scale`; `fp8_block_size = fp4_block_size = 32`); a third-party port's loader that
    reads the released shards by `layers.{i}.attn.*` names and dequantises fp8 with
    `.scale` in 32 x 32 blocks agrees.

Uncertain:
  * The released safetensors were not opened here: that the shards hold exactly the module
    names of `model.py` (no renaming by the release's `convert.py`, which was not read) is
    inferred from how this library names V4's release (`interop.names`, OFFICIAL:
    `layers.N.attn.*`, the module names of V4's `model.py`) and from the third-party loader
    above.
  * The stored dtypes per tensor (the reference loads wo_a, weights_proj, indexer.wk and the
    compressor in bf16 / fp32 and the other projections in fp8) are not relied on: any float
    dtype loads, fp8 and fp4 with their scales.
  * The transformers port (PR #48721, closed, in no release) uses the same module names
    under `model.layers.N.self_attn.`; no transformers layout is offered for V4.1.
"""

from __future__ import annotations

import dataclasses

from v4kv_jax import checks, plan
from v4kv_jax.config41 import V41Config
from v4kv_jax.interop.names import index
from v4kv_jax.nn.attention41 import param_shapes41

OWNERS = ("every layer", "kv source", "ratio-2 kv source", "index source")


@dataclasses.dataclass(frozen=True)
class ParamName41:
    path: str  # the V41Attention attribute path, dot-separated
    official: str  # the name under layers.N.attn.
    owner: str  # one of OWNERS

    def owned_by(self, p: plan.LayerPlan) -> bool:
        """Whether a layer of plan `p` has this param."""
        return {"every layer": True, "kv source": p.writes_entries,
                "ratio-2 kv source": p.writes_entries and p.ratio == 2,
                "index source": p.scores}[self.owner]


def _name(path: str, owner: str) -> ParamName41:
    return ParamName41(path, path if path == "attn_sink" else path + ".weight", owner)


TABLE41: tuple[ParamName41, ...] = (
    *(_name(p, "every layer") for p in ("wq_a", "q_norm", "wq_b", "wkv", "kv_norm", "wo_a",
                                         "wo_b", "attn_sink")),
    _name("compressor.wkv", "kv source"),
    _name("compressor.wgate", "ratio-2 kv source"),
    _name("compressor.norm", "kv source"),
    _name("indexer.wq_b", "index source"),
    _name("indexer.weights_proj", "index source"),
    _name("indexer.wk", "kv source"),
    _name("indexer.k_norm", "kv source"),
)


def check_config41(config, name: str = "config") -> V41Config:
    if not isinstance(config, V41Config):
        checks.fail(name, "a V41Config", type(config).__name__, TypeError)
    return config


def names_for41(config: V41Config, layer: int) -> tuple[ParamName41, ...]:
    """The params layer `layer` of `config` has (by its plan)."""
    check_config41(config)
    layer = index("layer", layer, hi=config.num_layers - 1)
    p = plan.of(config)[layer]
    return tuple(n for n in TABLE41 if n.owned_by(p))


def expected_shapes41(config: V41Config, layer: int) -> dict[str, tuple[int, ...]]:
    """V41Attention path -> shape, for layer `layer` of `config`."""
    names_for41(config, layer)
    return param_shapes41(config, layer)


def layer_prefix41(layer: int) -> str:
    """The prefix of layer `layer`'s attention tensors in a whole checkpoint."""
    return f"layers.{index('layer', layer)}.attn."


__all__ = ["OWNERS", "ParamName41", "TABLE41", "check_config41", "expected_shapes41",
           "layer_prefix41", "names_for41"]
