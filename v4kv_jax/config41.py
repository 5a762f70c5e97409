"""Static geometry of DeepSeek-V4.1's attention layers (V41_SPEC.md section 1).

V4.1 keeps V4's two pools and changes what fills them: every attention layer is SWA
(ratio 0) or reads a compressed cache of ratio 1 (an entry per token) or 2 (an entry per two
tokens), but only the "kv source" layers own a compressor, its entries and their index keys;
the other layers read the latest kv source at or before them. Index sources run their own
indexer queries (the kv sources among them score their own keys, the others the latest kv
source's: "Reindex"), every other nonzero layer takes the latest index source's picks
("Reuse"), and the candidate source publishes blocks of entries that restrict the scores of
the index sources after it. `v4kv_jax.plan` derives what each layer writes and reads from a
`V41Config` (and from a V4 `AttentionConfig`), one plan for both families.

Like `AttentionConfig`, a `V41Config` is a frozen, hashable dataclass (a static argument of
`jax.jit`), validated on construction: every violation names its field, what was expected and
what was given. Field names follow `AttentionConfig` where the meaning is the same; the HF
`text_config` keys are read by `v4kv_jax.interop.hf_config.v41_config_from_hf`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from v4kv_jax import checks
from v4kv_jax.config import check_widths, layer_ratios

# The fields that are sizes or counts: integers >= 1.
_POSITIVE_INTS = ("hidden_size", "num_heads", "head_dim", "rope_dim", "q_lora_rank", "o_groups",
                  "o_lora_rank", "window", "index_heads", "index_head_dim", "index_topk",
                  "candidate_topk_blocks", "candidate_block_size", "yarn_original_max_position")

V41_RATIOS = (0, 1, 2)


def _layers(name: str, value, num_layers: int) -> tuple[int, ...]:
    """A sorted tuple of distinct layer indices in [0, num_layers)."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        checks.fail(name, "a sequence of layer indices", repr(value), TypeError)
    layers = tuple(value)
    for i, layer in enumerate(layers):
        checks.integer(f"{name}[{i}]", layer, lo=0, hi=num_layers - 1)
    layers = tuple(int(x) for x in layers)
    if list(layers) != sorted(set(layers)):
        checks.fail(name, "distinct layer indices in increasing order", layers)
    return layers


@dataclasses.dataclass(frozen=True)
class V41Config:
    """Geometry of a V4.1 attention stack (V41_SPEC.md sections 1, 4 and 5).

    Attributes:
      hidden_size, num_heads, head_dim, rope_dim, q_lora_rank, o_groups, o_lora_rank,
        window: as `AttentionConfig` (V4.1 has no per-head query norm).
      compress_ratios: one ratio per attention layer of the backbone: 0 (SWA), 1 or 2.
      kv_source_layers: the layers that own a compressor, its entries and their index keys.
      index_source_layers: the layers that run indexer queries (every kv source is one).
      candidate_source_layer: the kv source whose scores pick the candidate blocks of the
        index sources after it; -1: none.
      candidate_topk_blocks, candidate_block_size: blocks kept, entries a block.
      index_heads, index_head_dim, index_topk: nI, c and k of the indexer.
      rope_theta: RoPE base of SWA layers (no YaRN); compress_rope_theta and the yarn_*
        fields: the nonzero-ratio layers' table, used for every RoPE in such a layer.
      rms_eps: epsilon of every RMSNorm (1e-20 in the release).
    """

    hidden_size: int
    num_heads: int
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    window: int
    compress_ratios: tuple[int, ...]
    kv_source_layers: tuple[int, ...]
    index_source_layers: tuple[int, ...]
    candidate_source_layer: int = -1
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    index_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 512
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    yarn_factor: float = 16.0
    yarn_original_max_position: int = 65536
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    rms_eps: float = 1e-20

    def __post_init__(self):
        ratios = layer_ratios(self.compress_ratios)
        object.__setattr__(self, "compress_ratios", ratios)
        if not ratios:
            checks.fail("compress_ratios", "at least one layer", ratios)
        bad = sorted({r for r in ratios if r not in V41_RATIOS})
        if bad:
            hint = (" (a V4 checkpoint's CSA / HCA ratios: use AttentionConfig)"
                    if set(bad) <= {4, 128} else "")
            checks.fail("compress_ratios", f"only ratios in {list(V41_RATIOS)}{hint}",
                        f"the ratios {bad}")
        check_widths(self, _POSITIVE_INTS)
        n = len(ratios)
        kv = _layers("kv_source_layers", self.kv_source_layers, n)
        index = _layers("index_source_layers", self.index_source_layers, n)
        object.__setattr__(self, "kv_source_layers", kv)
        object.__setattr__(self, "index_source_layers", index)
        self._check_sources(ratios, kv, index)

    def _check_sources(self, ratios, kv, index) -> None:
        """V41_SPEC.md section 1.2's invariants (and section 11's negative cases)."""
        for name, layers in (("kv_source_layers", kv), ("index_source_layers", index)):
            zero = [s for s in layers if ratios[s] == 0]
            if zero:
                checks.fail(name, "layers of a nonzero compress ratio", f"SWA layers {zero}")
        missing = [s for s in kv if s not in index]
        if missing:
            checks.fail("index_source_layers", f"every kv source (kv_source_layers={kv})",
                        f"{index}, without {missing}")
        first = next((i for i, r in enumerate(ratios) if r), None)
        if first is not None and first not in kv:
            checks.fail("kv_source_layers", f"the first nonzero-ratio layer ({first}) among "
                        "them (it has no source before it)", kv)
        for layer, r in enumerate(ratios):
            source = max((s for s in kv if s <= layer), default=None)
            if r and ratios[source] != r:
                checks.fail(f"compress_ratios[{layer}]", f"the ratio of its kv source (layer "
                            f"{source}: {ratios[source]})", r)
        c = self.candidate_source_layer
        checks.integer("candidate_source_layer", c, lo=-1, hi=len(ratios) - 1)
        if c >= 0:
            if c not in kv:
                checks.fail("candidate_source_layer", f"-1 or a kv source (one of {kv})", c)
            reach = self.candidate_topk_blocks * self.candidate_block_size - (
                self.candidate_block_size - 1)
            if reach < self.index_topk:
                checks.fail("candidate_topk_blocks", f"blocks that hold index_topk="
                            f"{self.index_topk} entries (x block {self.candidate_block_size} "
                            f"- {self.candidate_block_size - 1} >= k)",
                            self.candidate_topk_blocks)

    @property
    def num_layers(self) -> int:
        return len(self.compress_ratios)



FLASH41_RATIOS = (0, 0) + (2,) * 18 + (1,) * 20


def flash41(**overrides) -> V41Config:
    """DeepSeek-V4.1-Flash's attention backbone (40 layers; the 3 DSpark layers are not
    attention layers of the backbone): layers 0-1 SWA, 2-19 ratio 2 with kv sources 2, 8, 14,
    20-39 ratio 1 with kv source 20 (the candidate source) and index sources 24, 28, 32, 36."""
    fields = dict(hidden_size=5120, num_heads=64, head_dim=512, rope_dim=64, q_lora_rank=1280,
                  o_groups=8, o_lora_rank=1024, window=128, compress_ratios=FLASH41_RATIOS,
                  kv_source_layers=(2, 8, 14, 20),
                  index_source_layers=(2, 8, 14, 20, 24, 28, 32, 36),
                  candidate_source_layer=20)
    return V41Config(**{**fields, **overrides})


def tiny41(**overrides) -> V41Config:
    """V41_SPEC.md section 11's T1 at its tiny widths: six layers, one of each block type
    (SWA; a ratio-2 kv source and its Reuse layer; a ratio-1 kv source that is the candidate
    source, its Reuse layer, and a Reindex layer that consumes candidates), window 8; YaRN's
    ramp between pairs 2 and 5 of 8."""
    fields = dict(hidden_size=64, num_heads=4, head_dim=64, rope_dim=16, q_lora_rank=32,
                  o_groups=2, o_lora_rank=16, window=8, compress_ratios=(0, 2, 2, 1, 1, 1),
                  kv_source_layers=(1, 3), index_source_layers=(1, 3, 5),
                  candidate_source_layer=3, candidate_topk_blocks=4, candidate_block_size=2,
                  index_heads=4, index_head_dim=32, index_topk=4,
                  yarn_original_max_position=4096)
    return V41Config(**{**fields, **overrides})


# The V4.1 presets of `v4kv memory` and the storage they default to there (the names of
# `pools.cache41.FORMAT_SETS41`: "release" is NVFP4 entries, MXFP4 keys, MXFP8 window rows).
PRESETS41 = {"flash41": flash41}
PRESET_FORMATS41 = {"flash41": "release"}


__all__ = ["FLASH41_RATIOS", "PRESETS41", "PRESET_FORMATS41", "V41Config", "V41_RATIOS",
           "flash41", "tiny41"]
