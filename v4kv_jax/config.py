"""Static geometry: the attention layers of a V4-style model and the cache that serves them.

Both configs are frozen, hashable dataclasses, so they can be static arguments of `jax.jit`
and static (aux) fields of the cache pytree. Everything that changes per step lives in
arrays inside the cache, never here.

Layer kinds come from a `compress_ratios` list (one int per layer, as in the official
checkpoint): 0 = SWA (sliding window only), `csa_ratio` = CSA (top-k of C4 entries chosen by
the lightning indexer), `hca_ratio` = HCA (all C128 entries, dense).
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Iterable, Sequence

from v4kv_jax import checks

SUPERBLOCK_TOKENS = 128  # lcm(4, 128): pages are aligned to this in every layer kind.


# The AttentionConfig fields that are sizes or counts: integers >= 1 (never a bool or float).
_POSITIVE_INTS = ("hidden_size", "num_heads", "head_dim", "rope_dim", "q_lora_rank", "o_groups",
                  "o_lora_rank", "window", "csa_ratio", "hca_ratio", "index_heads",
                  "index_head_dim", "index_topk", "yarn_original_max_position")


class LayerKind(enum.IntEnum):
    SWA = 0
    CSA = 1
    HCA = 2


def layer_ratios(value) -> tuple[int, ...]:
    """`compress_ratios` as a tuple of integers >= 0 (a config's validation)."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        checks.fail("compress_ratios", "a sequence of per-layer ratios", repr(value), TypeError)
    ratios = tuple(value)
    for i, r in enumerate(ratios):
        checks.integer(f"compress_ratios[{i}]", r, lo=0)
    return tuple(int(r) for r in ratios)


def check_widths(config, positive: tuple[str, ...]) -> None:
    """The checks an attention config of either family shares: the `positive` fields integers
    >= 1, the RoPE bases, YaRN factor and eps positive, the YaRN betas real, the RoPE dims
    even and within the head and the index head, the heads split into the output groups."""
    for name in positive:
        checks.integer(name, getattr(config, name), lo=1)
    for name in ("rope_theta", "compress_rope_theta", "yarn_factor", "rms_eps"):
        checks.real(name, getattr(config, name), lo=0.0, lo_open=True)
    for name in ("yarn_beta_fast", "yarn_beta_slow"):
        checks.real(name, getattr(config, name))
    if config.rope_dim % 2 or config.rope_dim > config.head_dim:
        checks.fail("rope_dim", f"an even integer <= head_dim={config.head_dim}",
                    config.rope_dim)
    if config.index_head_dim < config.rope_dim:
        checks.fail("index_head_dim", f"an integer >= rope_dim={config.rope_dim}",
                    config.index_head_dim)
    if config.num_heads % config.o_groups:
        checks.fail("num_heads", f"a multiple of o_groups={config.o_groups}", config.num_heads)



@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """Geometry of the attention layers (SPEC section 1). Field names follow the SPEC symbols.

    Attributes:
      hidden_size: D.
      num_heads: H query heads (one shared KV head: MQA, key = value).
      head_dim: hd.
      rope_dim: r, the LAST r dims of every rotated vector.
      q_lora_rank: rank of the query down-projection.
      o_groups: g output groups.
      o_lora_rank: R, rank per output group.
      window: W, the sliding window (the query itself included).
      compress_ratios: one ratio per attention layer (0, csa_ratio or hca_ratio).
      csa_ratio: m, tokens per C4 entry (CSA, overlapping blocks).
      hca_ratio: m', tokens per C128 entry (HCA).
      index_heads: nI indexer heads.
      index_head_dim: c indexer head dim (>= rope_dim).
      index_topk: k, C4 entries read per query in CSA layers.
      rope_theta: RoPE base of SWA layers (no YaRN).
      compress_rope_theta: RoPE base of CSA and HCA layers (with YaRN).
      yarn_factor, yarn_original_max_position, yarn_beta_fast, yarn_beta_slow: YaRN of the
        compressed layers; `yarn_factor=1` disables it.
      rms_eps: epsilon of every RMSNorm.
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
    csa_ratio: int = 4
    hca_ratio: int = 128
    index_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    yarn_factor: float = 16.0
    yarn_original_max_position: int = 65536
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    rms_eps: float = 1e-6

    def __post_init__(self):
        object.__setattr__(self, "compress_ratios", layer_ratios(self.compress_ratios))
        check_widths(self, _POSITIVE_INTS)
        if self.csa_ratio == self.hca_ratio:
            checks.fail("csa_ratio", f"a ratio other than hca_ratio={self.hca_ratio}",
                        self.csa_ratio)
        if not self.compress_ratios:
            checks.fail("compress_ratios", "at least one layer", self.compress_ratios)
        allowed = {0, self.csa_ratio, self.hca_ratio}
        bad = sorted({r for r in self.compress_ratios if r not in allowed})
        if bad:
            checks.fail("compress_ratios", f"only ratios in {sorted(allowed)} (0 = SWA, "
                        "csa_ratio, hca_ratio)", f"the ratios {bad}")

    @classmethod
    def from_compress_ratios(
        cls, compress_ratios: Sequence[int], num_layers: int | None = None, **fields
    ) -> AttentionConfig:
        """Builds a config from a checkpoint's `compress_ratios`.

        The official list carries one trailing entry for the MTP block; pass `num_layers` to
        keep only the first `num_layers` entries.
        """
        ratios = tuple(compress_ratios)
        if num_layers is not None:
            checks.integer("num_layers", num_layers, lo=1)
            if num_layers > len(ratios):
                checks.fail("num_layers", f"at most len(compress_ratios)={len(ratios)}",
                            num_layers)
            ratios = ratios[:num_layers]
        return cls(compress_ratios=ratios, **fields)

    # --- derived layout -------------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        return len(self.compress_ratios)

    @property
    def layer_kinds(self) -> tuple[LayerKind, ...]:
        kind = {0: LayerKind.SWA, self.csa_ratio: LayerKind.CSA, self.hca_ratio: LayerKind.HCA}
        return tuple(kind[r] for r in self.compress_ratios)

    def layers_of(self, kind: LayerKind) -> tuple[int, ...]:
        """Global indices of the layers of one kind, in order."""
        return tuple(i for i, k in enumerate(self.layer_kinds) if k == kind)

    @property
    def num_csa(self) -> int:
        return len(self.layers_of(LayerKind.CSA))

    @property
    def num_hca(self) -> int:
        return len(self.layers_of(LayerKind.HCA))

    def kind_index(self, layer: int) -> int:
        """Position of global layer `layer` in the stacked arrays of its kind."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer={layer} must be in [0, {self.num_layers})")
        return self.layers_of(self.layer_kinds[layer]).index(layer)

    def ratio(self, kind: LayerKind) -> int:
        return {LayerKind.CSA: self.csa_ratio, LayerKind.HCA: self.hca_ratio}[kind]

    def uses_yarn(self, kind: LayerKind) -> bool:
        return kind != LayerKind.SWA and self.yarn_factor > 1.0

    def rope_base(self, kind: LayerKind) -> float:
        return self.rope_theta if kind == LayerKind.SWA else self.compress_rope_theta


def _v4(first_two: int, num_layers: int, overrides: dict, **fields) -> AttentionConfig:
    """A V4 release: layers 0-1 of ratio `first_two`, then CSA on even and HCA on odd layers;
    head_dim 512 (64 RoPE dims), window 128, indexer 64 x 128."""
    ratios = (first_two,) * 2 + tuple(4 if i % 2 == 0 else 128 for i in range(2, num_layers))
    base = dict(head_dim=512, rope_dim=64, o_lora_rank=1024, window=128, index_heads=64,
                index_head_dim=128, compress_ratios=ratios)
    return AttentionConfig(**{**base, **fields, **overrides})


def flash(**overrides) -> AttentionConfig:
    """DeepSeek-V4-Flash: 43 layers, 0-1 SWA, then CSA on even and HCA on odd layers."""
    return _v4(0, 43, overrides, hidden_size=4096, num_heads=64, q_lora_rank=1024, o_groups=8,
               index_topk=512)


def pro(**overrides) -> AttentionConfig:
    """DeepSeek-V4-Pro: 61 layers, 0-1 HCA, then CSA on even and HCA on odd layers."""
    return _v4(128, 61, overrides, hidden_size=7168, num_heads=128, q_lora_rank=1536,
               o_groups=16, index_topk=1024)


def tiny(**overrides) -> AttentionConfig:
    """A few-KiB config with all three layer kinds, for tests (m' = 16, W = 16)."""
    fields = dict(
        hidden_size=64,
        num_heads=4,
        head_dim=32,
        rope_dim=8,
        q_lora_rank=32,
        o_groups=2,
        o_lora_rank=16,
        window=16,
        compress_ratios=(0, 4, 16, 4, 16),
        csa_ratio=4,
        hca_ratio=16,
        index_heads=4,
        index_head_dim=16,
        index_topk=8,
    )
    fields.update(overrides)
    return AttentionConfig(**fields)


PRESETS = {"flash": flash, "pro": pro, "tiny": tiny}

STORAGE_FORMATS = ("float32", "bfloat16", "float16")
# The packed formats of the official release (`v4kv_jax.pools.storage`): "fp8_latent" for C4 / C128
# entries and the window ring, "fp4_index" for the CSA indexer keys.
# DeepSeek-V4.1's records (`v4kv_jax.pools.records41`, a V4.1 cache only): "nvfp4" entries,
# "mxfp4" index keys, "mxfp8" window rows.
V41_FORMATS = {"entry_dtype": "nvfp4", "index_dtype": "mxfp4", "window_dtype": "mxfp8"}
ENTRY_FORMATS = STORAGE_FORMATS + ("fp8_latent", "nvfp4")
INDEX_FORMATS = STORAGE_FORMATS + ("fp4_index", "mxfp4")
WINDOW_FORMATS = STORAGE_FORMATS + ("fp8_latent", "mxfp8")
# How the HCA compressor keeps its open block: an online softmax (3 x hd floats per layer) or
# the raw ring of its (kv, gate) rows (m' x 2 hd floats per layer).
HCA_TAILS = ("online", "ring")
C4_TIERS = ("device", "host")

# Named sets of storage fields for `CacheConfig.with_formats` (and `v4kv memory --formats`).
# "release": the formats of the official V4 release (its reference fake-quantises at the same
# points), the default of the flash and pro presets (`PRESET_FORMATS`).
FORMAT_SETS = {
    "release": dict(entry_dtype="fp8_latent", index_dtype="fp4_index",
                    window_dtype="fp8_latent", tail_dtype="float32", hca_tail="online"),
    **{name: dict(entry_dtype=name, index_dtype=name, window_dtype=name, tail_dtype="float32",
                  hca_tail="ring") for name in STORAGE_FORMATS},
}
# The storage a preset's model is served with by default: the release formats for the V4
# releases; fp32 for the test config (whose widths the packed formats do not fit).
PRESET_FORMATS = {"flash": "release", "pro": "release", "tiny": "float32"}

# How the decode attention, the indexer and the compressor emission run (see `v4kv_jax.ops`).
IMPLEMENTATIONS = ("auto", "reference", "pallas_tpu", "pallas_gpu")

# The ops with a Pallas kernel (`v4kv_jax.ops`): the keys of `Options.block_sizes`.
KERNEL_OPS = ("emit_entries", "emit_entries_online", "index_scores", "sparse_decode_attention",
              "dense_decode_attention", "sparse_decode41")


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """Geometry and storage of the two pools: what a `Cache` holds, nothing about how it is
    computed (that is `Options`).

    Attributes:
      page_tokens: P, tokens per page; a multiple of 128 (and of both ratios).
      num_pages: pages in the Classical pool, shared by all requests.
      max_slots: concurrent requests (rows of the State pool).
      max_pages_per_seq: length of a request's page-table row; the longest sequence is
        `max_pages_per_seq * page_tokens` tokens.
      entry_dtype: storage format of C4 and C128 entries: a float format or "fp8_latent"
        (`ENTRY_FORMATS`; needs head_dim - rope_dim a positive multiple of 64).
      index_dtype: storage format of the CSA indexer keys: a float format or "fp4_index"
        (`INDEX_FORMATS`; Hadamard-rotated keys, needs a power-of-two index_head_dim >= 32).
      window_dtype: storage format of the sliding-window ring (`WINDOW_FORMATS`).
        A V4.1 cache (`pools.init_cache41`) takes V4.1's records instead of the packed V4
        ones: "nvfp4" entries, "mxfp4" index keys, "mxfp8" window rows (`V41_FORMATS`).
      tail_dtype: storage format of the compressor tails, a float format (the SPEC pools them
        in fp32).
      hca_tail: how the HCA compressor keeps its open block: "online" (running max, sum of
        exponentials and weighted sum, 3 x hd values per layer; `pools.OnlineTail`) or "ring"
        (the block's raw kv and gate rows; `pools.Tail`).
      hot_rows: HiSparse's hot set (`v4kv_jax.ops.hot`): 0 reads C4 entries straight from the
        Classical pool; H > 0 keeps, per CSA layer and slot, H device rows holding the entries
        the indexer picked (least recently used out), and the sparse read reads only those.
        At least the model's index_topk; reads are bit-identical either way. None (the
        default): 2 x index_topk with c4_tier="host", else 0 (`hot_set_rows`).
      c4_tier: where the CSA layers' C4 entries live: "device" or "host" (JAX's host memory
        space, `jax.memory.Space.Host`; HiSparse: needs hot_rows > 0, the read fetches the
        picks into the hot rows and new entries are written there as they are emitted).
        Indexer keys, C128 entries, the window and the tails stay on the device.

    The float32 defaults store every value exactly as computed. `CacheConfig.with_formats`
    builds a config with a named set of formats (`FORMAT_SETS`: "release", "float32",
    "bfloat16", "float16").
    """

    num_pages: int
    max_slots: int
    max_pages_per_seq: int
    page_tokens: int = 128
    entry_dtype: str = "float32"
    window_dtype: str = "float32"
    tail_dtype: str = "float32"
    index_dtype: str = "float32"
    hca_tail: str = "ring"
    hot_rows: int | None = None
    c4_tier: str = "device"

    def __post_init__(self):
        for name in ("num_pages", "max_slots", "max_pages_per_seq", "page_tokens"):
            checks.integer(name, getattr(self, name), lo=1)
        if self.hot_rows is not None:
            checks.integer("hot_rows", self.hot_rows, lo=0)
        if self.page_tokens % SUPERBLOCK_TOKENS:
            checks.fail("page_tokens", f"a positive multiple of {SUPERBLOCK_TOKENS} (lcm of the "
                        "compression ratios)", self.page_tokens)
        allowed = {"entry_dtype": ENTRY_FORMATS, "index_dtype": INDEX_FORMATS,
                   "window_dtype": WINDOW_FORMATS, "tail_dtype": STORAGE_FORMATS,
                   "hca_tail": HCA_TAILS, "c4_tier": C4_TIERS}
        for name, choices in allowed.items():
            checks.one_of(name, getattr(self, name), choices)
        if self.c4_tier == "host" and self.hot_rows == 0:
            checks.fail("hot_rows", "a hot set (None, or at least the model's index_topk) "
                        "with c4_tier='host': reads fetch C4 entries into it", 0)

    @classmethod
    def with_formats(cls, formats: str, **fields) -> CacheConfig:
        """A config storing in the named set of formats (`FORMAT_SETS`): "release" (fp8_latent
        entries and window, fp4_index indexer keys, fp32 tails, online HCA tail), "float32",
        "bfloat16" or "float16" (entries, keys and window in that dtype, fp32 ring tails).
        `fields` are the other fields (and may override single formats)."""
        checks.one_of("formats", formats, tuple(FORMAT_SETS))
        return cls(**{**FORMAT_SETS[formats], **fields})

    @property
    def max_seq_len(self) -> int:
        return self.max_pages_per_seq * self.page_tokens

    def check_against(self, model: AttentionConfig) -> None:
        """Raises if the page size does not align with the model's compression ratios, or a
        format is one of V4.1's records (`V41_FORMATS`)."""
        for name, fmt in V41_FORMATS.items():
            if getattr(self, name) == fmt:
                checks.fail(name, "a V4 format (V4.1's records serve a V41Config's cache: "
                            "pools.init_cache41)", repr(fmt))
        lcm = math.lcm(model.csa_ratio, model.hca_ratio)
        if self.page_tokens % lcm:
            checks.fail("page_tokens", f"a multiple of lcm(csa_ratio, hca_ratio)={lcm}",
                        self.page_tokens)
        if self.hot_rows and self.hot_rows < model.index_topk:
            checks.fail("hot_rows", f"0 (no hot set) or at least the model's index_topk="
                        f"{model.index_topk}", self.hot_rows)

    def hot_set_rows(self, model: AttentionConfig) -> int:
        """Hot rows per CSA layer and slot: `hot_rows`, or by default 2 x the model's
        index_topk with the C4 entries on the host and 0 (no hot set) on the device."""
        if self.hot_rows is not None:
            return self.hot_rows
        return 2 * model.index_topk if self.c4_tier == "host" else 0

    def entries_per_page(self, ratio: int) -> int:
        return self.page_tokens // ratio


@dataclasses.dataclass(frozen=True)
class Options:
    """How the ops run, passed to the calls (static under jit); never part of a `Cache`, so
    switching the implementation does not change the cache's type.

    Attributes:
      implementation: the CSA / HCA decode attention, the indexer and the compressor
        emission: "auto" (per op and platform, the faster of the reference and the kernels
        as measured (`v4kv_jax/measured.json`), else the platform's kernels; the reference
        on CPU), "reference", "pallas_tpu" or "pallas_gpu" (see `v4kv_jax.ops`).
      interpret: run the Pallas kernels in interpret mode (tests on CPU).
      block_sizes: tiling of the kernels, per op: a mapping from names in `KERNEL_OPS` to
        the op's `BlockSizes` (`pallas_kernels.<op folder>.blocks`); an op not named uses
        its kernel's defaults. Stored as a sorted tuple of pairs (hashable).
      index_read_entries: indexer keys the reference scores per loop step (rounded to whole
        pages); the loop runs over used pages only, so its cost follows the context.
      hca_read_entries: C128 entries the reference reads per loop step (whole pages).
      query_tile: queries per tile in prefill attention (bounds memory, not results).
      unroll_layers: run the layers one after the other in the program instead of in a
        `lax.scan` per kind (`step.layers_step`, `step.decode_attention_all`): each layer's
        inputs a static slice, the outputs stacked once; the same results, a program that
        grows with the layers and compiles longer; XLA's cost analysis then counts every
        layer (it counts a loop's body once).
    """

    implementation: str = "auto"
    interpret: bool = False
    index_read_entries: int = 4096
    hca_read_entries: int = 512
    query_tile: int = 64
    block_sizes: tuple = ()
    unroll_layers: bool = False

    def __post_init__(self):
        checks.one_of("implementation", self.implementation, IMPLEMENTATIONS)
        for name in ("interpret", "unroll_layers"):
            if not isinstance(getattr(self, name), bool):
                checks.fail(name, "a bool", repr(getattr(self, name)), TypeError)
        for name in ("index_read_entries", "hca_read_entries", "query_tile"):
            checks.integer(name, getattr(self, name), lo=1)
        pairs = self.block_sizes
        if isinstance(pairs, dict):
            pairs = tuple(pairs.items())
        if not isinstance(pairs, tuple) or not all(isinstance(p, tuple) and len(p) == 2
                                                   for p in pairs):
            checks.fail("block_sizes", "a mapping {op name: BlockSizes}", repr(pairs),
                        TypeError)
        for op, sizes in pairs:
            checks.one_of("block_sizes key", op, KERNEL_OPS)
            if not dataclasses.is_dataclass(sizes) or isinstance(sizes, type):
                checks.fail(f"block_sizes[{op!r}]", "a BlockSizes instance", repr(sizes),
                            TypeError)
        object.__setattr__(self, "block_sizes", tuple(sorted(pairs, key=lambda p: p[0])))

    def blocks(self, op: str):
        """The `BlockSizes` given for `op`, or None (the kernel's defaults)."""
        return dict(self.block_sizes).get(op)

    def read_chunk_pages(self, geometry: CacheConfig, entries: int, ratio: int) -> int:
        """Pages per loop step when reading about `entries` entries of a kind with `ratio`."""
        return max(1, entries // geometry.entries_per_page(ratio))


DEFAULT_OPTIONS = Options()


def options_or_default(options: Options | None) -> Options:
    if options is None:
        return DEFAULT_OPTIONS
    if not isinstance(options, Options):
        checks.fail("options", "a v4kv_jax Options", type(options).__name__, TypeError)
    return options
