"""Brute-force oracle of a DeepSeek-V4.1 attention stack, float64 numpy, from V41_SPEC.md.

Written from the spec alone and sharing no code with the library (numpy, the standard library
and `v41_records`, the numpy codec of the storage records): its own config, per-layer plan,
RoPE tables, compressor, indexer, candidate blocks, top-k and attention. No cache: every
stored entry, index key and window row is recomputed from the whole history, and every query
attends over what it sees at its position, so a bug in paging, chunking or state shows up as
a difference.

Inputs are one sequence's per-layer vectors over positions 0..L-1 (`LayerInputs`, the form
of V41_SPEC.md section 9.6): the projections are the caller's, the oracle starts at the
pre-RoPE vectors. `run` returns, per layer, the attention outputs before the output
projection, and per source what it stores and selects (`StackResult`).

Numerics (V41_SPEC.md section 7, last paragraph): float64 throughout, no bf16 roundings
unless `bf16_latent` asks for section 3's cast; `quantize` applies the release formats'
fake quantisation in the spec's order: window = kv_norm -> RoPE -> MXFP8, main entry =
pool -> norm -> RoPE -> NVFP4, index key = latent -> wk -> k_norm -> RoPE -> MXFP4, index
query = RoPE -> MXFP4. Ties in a top-k or a block ranking go to the lower index (a stable
sort; the spec leaves ties to the implementation, and 4 index heads give exact ReLU-zero ties
often); `StackResult.margins` holds each query's score gap at its cuts, so a comparison of
selections is meaningful only where it exceeds the other side's rounding (section 11: 1e-9).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from v4kv_jax.testing import v41_records as records


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """One layer of the plan (V41_SPEC.md section 1.2).

    Attributes:
      mode: "SWA" (ratio 0), "Full" (a kv source, also an index source), "Reindex" (an index
        source, not a kv source), "Reuse" (nonzero ratio, neither).
      kv_src, idx_src: the latest kv / index source at or before the layer (None at ratio 0).
      uses_candidates: an index source after the candidate source: its scores outside the
        candidate blocks are -inf before its top-k.
      rope: "compress" (compress_rope_theta with YaRN) for a nonzero ratio, else "base".
    """

    layer: int
    ratio: int
    mode: str
    kv_src: int | None
    idx_src: int | None
    uses_candidates: bool
    is_candidate_source: bool
    rope: str


@dataclasses.dataclass(frozen=True)
class V41Stack:
    """A V4.1 attention stack in the spec's terms (field names: HF `text_config` keys; the
    `rope_scaling` keys flattened, `factor` as `rope_factor`). Defaults: V4.1-Flash.

    `num_hidden_layers` backbone layers (default: all of `compress_ratios`); ratios past them
    are DSpark layers, planned but never run. Construction validates section 1.2's invariants
    and raises ValueError naming the field, the expected and the actual value.
    """

    compress_ratios: tuple[int, ...]
    kv_source_layer_ids: tuple[int, ...]
    index_source_layer_ids: tuple[int, ...]
    candidate_source_layer_id: int = -1
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    index_topk: int = 512
    index_n_heads: int = 32
    index_head_dim: int = 128
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    num_attention_heads: int = 64
    sliding_window: int = 128
    rms_norm_eps: float = 1e-20
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_factor: float = 16.0
    original_max_position_embeddings: int = 65536
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    num_hidden_layers: int | None = None

    def __post_init__(self):
        for name in ("compress_ratios", "kv_source_layer_ids", "index_source_layer_ids"):
            object.__setattr__(self, name, tuple(int(v) for v in getattr(self, name)))
        if self.num_hidden_layers is None:
            object.__setattr__(self, "num_hidden_layers", len(self.compress_ratios))
        _validate(self)

    @classmethod
    def from_text_config(cls, text_config: dict) -> V41Stack:
        """The stack of an HF `text_config` dict (its nested `rope_scaling` included)."""
        fields = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in text_config.items() if k in fields}
        scaling = text_config.get("rope_scaling") or {}
        for key, name in (("factor", "rope_factor"), ("beta_fast", "beta_fast"),
                          ("beta_slow", "beta_slow"), ("original_max_position_embeddings",
                                                       "original_max_position_embeddings")):
            if key in scaling:
                kwargs[name] = scaling[key]
        return cls(**kwargs)

    def layer_plan(self) -> list[LayerPlan]:
        """Every layer's plan, DSpark layers included (V41_SPEC.md section 1.2)."""
        return [_plan_of(self, layer) for layer in range(len(self.compress_ratios))]


def _latest(sources, layer: int) -> int | None:
    before = [s for s in sources if s <= layer]
    return max(before) if before else None


def _plan_of(stack: V41Stack, layer: int) -> LayerPlan:
    r = stack.compress_ratios[layer]
    backbone = layer < stack.num_hidden_layers
    is_kv = backbone and layer in stack.kv_source_layer_ids
    is_index = backbone and layer in stack.index_source_layer_ids
    cand = stack.candidate_source_layer_id
    mode = "SWA" if r == 0 else "Full" if is_kv else "Reindex" if is_index else "Reuse"
    return LayerPlan(
        layer=layer, ratio=r, mode=mode,
        kv_src=_latest(stack.kv_source_layer_ids, layer) if r else None,
        idx_src=_latest(stack.index_source_layer_ids, layer) if r else None,
        uses_candidates=bool(is_index and 0 <= cand < layer),
        is_candidate_source=layer == cand, rope="compress" if r else "base")


def _fail(field: str, expected: str, got) -> None:
    raise ValueError(f"{field}: expected {expected}, got {got}")


def _validate(s: V41Stack) -> None:
    """V41_SPEC.md section 1.2's invariants and section 11's negative cases."""
    ratios, n = s.compress_ratios, s.num_hidden_layers
    bad = {r for r in ratios if r not in (0, 1, 2)}
    if bad:
        _fail("compress_ratios", "every ratio in (0, 1, 2)", sorted(bad))
    if not 0 < n <= len(ratios):
        _fail("num_hidden_layers", f"1 .. len(compress_ratios) = {len(ratios)}", n)
    for name in ("kv_source_layer_ids", "index_source_layer_ids"):
        ids = getattr(s, name)
        if len(set(ids)) != len(ids) or any(not 0 <= i < n for i in ids):
            _fail(name, f"distinct backbone layers in [0, {n})", list(ids))
        zero = [i for i in ids if ratios[i] == 0]
        if zero:
            _fail(name, "sources with a nonzero compress ratio",
                  f"compress_ratios[{zero[0]}] = 0")
    missing = sorted(set(s.kv_source_layer_ids) - set(s.index_source_layer_ids))
    if missing:
        _fail("kv_source_layer_ids", f"every kv source among index_source_layer_ids = "
              f"{list(s.index_source_layer_ids)}", f"{missing} not among them")
    cand = s.candidate_source_layer_id
    if cand != -1 and cand not in s.kv_source_layer_ids:
        _fail("candidate_source_layer_id", f"-1 or a kv source of "
              f"{list(s.kv_source_layer_ids)}", cand)
    first = next((layer for layer in range(n) if ratios[layer]), None)
    if first is not None and first not in s.kv_source_layer_ids:
        _fail("kv_source_layer_ids", f"the first nonzero-ratio layer {first} among them",
              list(s.kv_source_layer_ids))
    for layer in range(n):
        src = _latest(s.kv_source_layer_ids, layer)
        if ratios[layer] and ratios[layer] != ratios[src]:
            _fail(f"compress_ratios[{layer}]", f"the ratio of its kv source layer {src}, "
                  f"{ratios[src]}", ratios[layer])
    if cand != -1:
        capacity = s.candidate_topk_blocks * s.candidate_block_size - (
            s.candidate_block_size - 1)
        if capacity < s.index_topk:
            _fail("candidate_topk_blocks", "candidate_topk_blocks * candidate_block_size - "
                  f"(candidate_block_size - 1) >= index_topk = {s.index_topk}", capacity)
    rd = s.qk_rope_head_dim
    if rd <= 0 or rd % 2 or rd > min(s.head_dim, s.index_head_dim):
        _fail("qk_rope_head_dim", f"an even width <= head_dim = {s.head_dim} and "
              f"index_head_dim = {s.index_head_dim}", rd)
    for name in ("candidate_block_size", "candidate_topk_blocks", "index_topk",
                 "index_n_heads", "num_attention_heads", "sliding_window"):
        if getattr(s, name) < 1:
            _fail(name, "a positive count", getattr(s, name))


FLASH_RATIOS = (0, 0) + (2,) * 18 + (1,) * 20 + (0,) * 3

# V41_SPEC.md section 11's tiny widths: hd 64 (MXFP8 2 blocks, NVFP4 4), rope 16, index 32
# (1 MXFP4 block), 4 heads, 4 index heads; `original` puts YaRN's ramp at 0 < 2 < 5 < 8.
TINY_WIDTHS = dict(head_dim=64, qk_rope_head_dim=16, index_head_dim=32, num_attention_heads=4,
                   index_n_heads=4, original_max_position_embeddings=4096)


def flash_stack(**overrides) -> V41Stack:
    """V4.1-Flash: 43 ratios, 40 backbone layers, kv [2, 8, 14, 20], index sources
    [2, 8, ..., 36], candidate source 20 (V41_SPEC.md section 1.1)."""
    kwargs = dict(compress_ratios=FLASH_RATIOS, kv_source_layer_ids=(2, 8, 14, 20),
                  index_source_layer_ids=(2, 8, 14, 20, 24, 28, 32, 36),
                  candidate_source_layer_id=20, num_hidden_layers=40)
    return V41Stack(**{**kwargs, **overrides})


def tiny6_stack(**overrides) -> V41Stack:
    """T1 `v41_tiny6` (V41_SPEC.md section 11): SWA, Full r2, Reuse r2, Full r1 + candidate
    source, Reuse r1, Reindex with candidates; 4 blocks x 2, top-4, window 8."""
    kwargs = dict(compress_ratios=(0, 2, 2, 1, 1, 1), kv_source_layer_ids=(1, 3),
                  index_source_layer_ids=(1, 3, 5), candidate_source_layer_id=3,
                  candidate_topk_blocks=4, candidate_block_size=2, index_topk=4,
                  sliding_window=8, **TINY_WIDTHS)
    return V41Stack(**{**kwargs, **overrides})


def mini8_stack(**overrides) -> V41Stack:
    """T2 `v41_mini8`: layer 7 reuses layer 6's top-k and layer 4's entries; 3 blocks x 4,
    top-6, window 16: the candidate mask bites once n_t > 12."""
    kwargs = dict(compress_ratios=(0, 2, 2, 2, 1, 1, 1, 1), kv_source_layer_ids=(1, 4),
                  index_source_layer_ids=(1, 4, 6), candidate_source_layer_id=4,
                  candidate_topk_blocks=3, candidate_block_size=4, index_topk=6,
                  sliding_window=16, **TINY_WIDTHS)
    return V41Stack(**{**kwargs, **overrides})


def global_bytes_per_token(stack: V41Stack) -> float:
    """Global KV bytes per token: each kv source stores 1 / r entries per token, each an NVFP4
    entry plus an MXFP4 index key (V41_SPEC.md section 6: 890 for Flash)."""
    per_entry = records.nvfp4_bytes(stack.head_dim) + records.mxfp4_bytes(stack.index_head_dim)
    return sum(per_entry / stack.compress_ratios[s] for s in stack.kv_source_layer_ids)


def global_bytes(stack: V41Stack, length: int) -> int:
    """Global KV bytes of `length` tokens: floor(length / r) entries per kv source."""
    per_entry = records.nvfp4_bytes(stack.head_dim) + records.mxfp4_bytes(stack.index_head_dim)
    return sum(length // stack.compress_ratios[s] * per_entry for s in stack.kv_source_layer_ids)


# ---- RoPE and norms (V41_SPEC.md section 2) ----

def rope_frequencies(stack: V41Stack, compressed: bool) -> np.ndarray:
    """f64[rd / 2] frequencies: base theta^(-2i / rd) for ratio-0 layers; compress_rope_theta
    with YaRN (floor / ceil correction range, linear ramp, no mscale) for nonzero ratios."""
    rd = stack.qk_rope_head_dim
    i = np.arange(rd // 2, dtype=np.float64)
    if not compressed:
        return float(stack.rope_theta) ** (-2.0 * i / rd)
    theta = float(stack.compress_rope_theta)
    f = theta ** (-2.0 * i / rd)
    orig = stack.original_max_position_embeddings

    def c(beta: float) -> float:
        return rd * math.log(orig / (2 * math.pi * beta)) / (2 * math.log(theta))

    low = max(math.floor(c(stack.beta_fast)), 0)
    high = min(math.ceil(c(stack.beta_slow)), rd - 1)
    ramp = np.clip((i - low) / max(high - low, 1e-3), 0.0, 1.0)
    return f / stack.rope_factor * ramp + f * (1.0 - ramp)


def rotate(v, position, freqs: np.ndarray, inverse: bool = False) -> np.ndarray:
    """v [..., d] with adjacent pairs (d0 + 2i, d0 + 2i + 1) of its last 2 len(freqs) dims
    turned by position * f_i (by minus that when `inverse`)."""
    out = np.array(v, np.float64)
    rd = 2 * len(freqs)
    angle = np.asarray(position, np.float64)[..., None] * freqs
    if inverse:
        angle = -angle
    cos, sin = np.cos(angle), np.sin(angle)
    a, b = out[..., -rd::2].copy(), out[..., -rd + 1::2].copy()
    out[..., -rd::2] = a * cos - b * sin
    out[..., -rd + 1::2] = a * sin + b * cos
    return out


def rms_norm(v, weight, eps: float) -> np.ndarray:
    """weight * v / sqrt(mean(v^2) + eps) over the last axis."""
    v = np.asarray(v, np.float64)
    return np.asarray(weight, np.float64) * v / np.sqrt(np.mean(v * v, -1, keepdims=True) + eps)


# ---- compressor and index keys (V41_SPEC.md sections 3, 4.1) ----

def compress_latents(a, z, norm_c, ratio: int, eps: float, length: int,
                     bf16_latent: bool = False) -> np.ndarray:
    """[length // ratio, hd] latents before RoPE: ratio 1 RMSNorm(a_t); ratio 2 the per-channel
    softmax over z of the pair (2j, 2j + 1) pooling a, then RMSNorm. `bf16_latent` rounds the
    norm's input to bf16 (the [REF] cast of section 3)."""
    a = np.asarray(a, np.float64)[: length // ratio * ratio]
    if ratio == 1:
        pooled = a
    else:
        zz = np.asarray(z, np.float64)[: len(a)].reshape(-1, ratio, a.shape[-1])
        p = np.exp(zz - zz.max(axis=1, keepdims=True))
        pooled = (p / p.sum(axis=1, keepdims=True) * a.reshape(zz.shape)).sum(axis=1)
    if bf16_latent:
        pooled = records.bf16_round(pooled)
    return rms_norm(pooled, norm_c, eps).reshape(length // ratio, a.shape[-1])


def entry_positions(count: int, ratio: int) -> np.ndarray:
    """RoPE position j * r of entries 0..count-1 (the first token of each group)."""
    return np.arange(count) * ratio


def main_entries(latents, ratio: int, freqs, quantize: bool = False) -> np.ndarray:
    """C_j = NVFP4(R_{j r}(latent_j)) ([count, hd]; no NVFP4 unless `quantize`)."""
    c = rotate(latents, entry_positions(len(latents), ratio), freqs)
    return records.fake_quant_nvfp4(c) if quantize and len(c) else c


def index_keys(latents, wk, k_norm, ratio: int, freqs, eps: float,
               quantize: bool = False) -> np.ndarray:
    """K_j = MXFP4(R_{j r}(RMSNorm_{k_norm}(wk latent_j))) ([count, c])."""
    k = np.asarray(latents, np.float64) @ np.asarray(wk, np.float64).T
    k = rotate(rms_norm(k, k_norm, eps), entry_positions(len(k), ratio), freqs)
    return records.fake_quant_mxfp4(k) if quantize and len(k) else k


# ---- indexer, candidates, top-k (V41_SPEC.md sections 4.2-4.4) ----

def visible_entries(t: int, ratio: int) -> int:
    """n_t = (t + 1) // r: entries j < n_t are closed at query t (their last token <= t)."""
    return (t + 1) // ratio


def index_scores(stack: V41Stack, q_index, w_raw, keys, t: int, freqs,
                 quantize: bool = False) -> np.ndarray:
    """I_t,j = sum_h w_h ReLU(qI_h . K_j) over the given keys: qI rotated at t (then MXFP4
    when `quantize`), w = raw * index_head_dim^-0.5 * index_n_heads^-0.5."""
    q = rotate(q_index, t, freqs)
    if quantize:
        q = records.fake_quant_mxfp4(q)
    w = np.asarray(w_raw, np.float64) * stack.index_head_dim**-0.5 * stack.index_n_heads**-0.5
    return w @ np.maximum(q @ np.asarray(keys, np.float64).T, 0.0)


def candidate_blocks(scores, block_size: int, topk_blocks: int
                     ) -> tuple[np.ndarray, np.ndarray, float]:
    """Candidate selection of one query over its n_t visible scores: (kept blocks ascending,
    the positions they cover < n_t, the margin at the block cut).

    Block b's score is the max over positions 8b..8b+7 (block_size wide); the block of the
    newest entry is pinned (+inf); the top min(topk_blocks, n_blocks) are kept, -inf ones
    dropped (V41_SPEC.md section 4.4).
    """
    scores = np.asarray(scores, np.float64)
    n = len(scores)
    nb = -(-n // block_size)
    padded = np.full(nb * block_size, -np.inf)
    padded[:n] = scores
    blk = padded.reshape(nb, block_size).max(axis=1)
    blk[(n - 1) // block_size] = np.inf
    order = np.argsort(-blk, kind="stable")
    keep = min(topk_blocks, nb)
    kept = np.sort([b for b in order[:keep] if blk[b] > -np.inf]).astype(np.int64)
    margin = np.inf if keep == nb else float(blk[order[keep - 1]] - blk[order[keep]])
    positions = np.arange(nb * block_size).reshape(nb, block_size)[kept].ravel()
    return kept, positions[positions < n], margin


def topk_selection(scores, topk: int) -> tuple[np.ndarray, float]:
    """Entries query t selects from its n_t visible scores (-inf where masked), ascending,
    and the margin at the cut: all of them when n_t <= topk ([VLLM] shortcut), else the
    k = min(topk, n_t) best with non-finite picks dropped (V41_SPEC.md section 4.4)."""
    scores = np.asarray(scores, np.float64)
    n = len(scores)
    if n <= topk:
        return np.arange(n), np.inf
    order = np.argsort(-scores, kind="stable")
    picks = order[:topk]
    picks = np.sort(picks[np.isfinite(scores[picks])])
    below = scores[order[topk]]
    margin = float(scores[order[topk - 1]] - below) if np.isfinite(below) else np.inf
    return picks, margin


# ---- attention (V41_SPEC.md section 5) ----

def attend(q, keys, sink, t: int, freqs) -> np.ndarray:
    """o [H, hd] of one query: q [H, hd] (rotated) over keys [K, hd] (V = K), one softmax with
    the sink in the denominator, scale hd^-0.5, then R^-1_t on the rope dims."""
    q, keys = np.asarray(q, np.float64), np.asarray(keys, np.float64)
    logits = q @ keys.T * q.shape[-1] ** -0.5
    sink = np.asarray(sink, np.float64)[:, None]
    top = np.maximum(logits.max(axis=1, keepdims=True), sink)
    p = np.exp(logits - top)
    p /= p.sum(axis=1, keepdims=True) + np.exp(sink - top)
    return rotate(p @ keys, t, freqs, inverse=True)


@dataclasses.dataclass
class LayerInputs:
    """One layer's vectors over positions 0..L-1 (V41_SPEC.md section 9.6).

    Attributes:
      q: [L, H, hd] queries (wq_b qr_t) before RoPE.
      win: [L, hd] window vectors RMSNorm_{kv_norm}(wkv x_t), before RoPE (the norm is the
        caller's; the oracle rotates at t and, with `quantize`, applies MXFP8).
      sink: [H].
      a, z: [L, hd] compressor projections wkv_c x_t, wgate_c x_t (kv sources; z for ratio 2).
      norm_c: [hd]; wk: [c, hd]; k_norm: [c] (kv sources).
      q_index: [L, nI, c] index queries (wq_b^I qr_t) before RoPE; w_index: [L, nI] raw
        weights_proj x_t (index sources).
    """

    q: np.ndarray
    win: np.ndarray
    sink: np.ndarray
    a: np.ndarray | None = None
    z: np.ndarray | None = None
    norm_c: np.ndarray | None = None
    wk: np.ndarray | None = None
    k_norm: np.ndarray | None = None
    q_index: np.ndarray | None = None
    w_index: np.ndarray | None = None


def random_inputs(stack: V41Stack, length: int, seed: int = 0) -> list[LayerInputs]:
    """N(0, 1) vectors per backbone layer, sinks N(0, 1), norm weights in [0.7, 1.3]
    (V41_SPEC.md section 11); each layer gets the fields its mode needs."""
    rng = np.random.default_rng(seed)
    hd, c, nI = stack.head_dim, stack.index_head_dim, stack.index_n_heads
    out = []
    for p in stack.layer_plan()[: stack.num_hidden_layers]:
        x = LayerInputs(q=rng.normal(size=(length, stack.num_attention_heads, hd)),
                        win=rng.normal(size=(length, hd)),
                        sink=rng.normal(size=stack.num_attention_heads))
        if p.mode == "Full":
            x.a = rng.normal(size=(length, hd))
            x.z = rng.normal(size=(length, hd)) if p.ratio == 2 else None
            x.norm_c, x.k_norm = rng.uniform(0.7, 1.3, hd), rng.uniform(0.7, 1.3, c)
            x.wk = rng.normal(size=(c, hd)) * hd**-0.5
        if p.mode in ("Full", "Reindex"):
            x.q_index, x.w_index = rng.normal(size=(length, nI, c)), rng.normal(size=(length, nI))
        out.append(x)
    return out


@dataclasses.dataclass
class StackResult:
    """What `run` computes for positions 0..L-1.

    Attributes:
      outputs: per backbone layer, [L, H, hd] attention outputs (before wo_a / wo_b).
      windows: per backbone layer, [L, hd] stored window rows (rotated; MXFP8 if quantized).
      entries, keys: per kv source, [L // r, hd] main entries and [L // r, c] index keys.
      selections: per index source, per query t, the selected entry indices (ascending).
      candidates: per query t, the positions of the candidate blocks (None without a
        candidate source).
      margins: per index source, f64[L]: query t's score gap at its top-k cut, and for a
        candidate consumer also at the candidate-block cut (inf where nothing is cut).
      margin: the smallest of all margins (inf if none).
    """

    outputs: list[np.ndarray]
    windows: list[np.ndarray]
    entries: dict[int, np.ndarray]
    keys: dict[int, np.ndarray]
    selections: dict[int, list[np.ndarray]]
    candidates: list[np.ndarray] | None
    margins: dict[int, np.ndarray]
    margin: float


def run(stack: V41Stack, inputs: list[LayerInputs], *, quantize: bool = False,
        bf16_latent: bool = False) -> StackResult:
    """Every backbone layer of the stack over the whole history of `inputs` (one per backbone
    layer), queries 0..L-1.

    Sources run in layer order, so a consumer reads its source's entries, keys and selections
    of the same positions; every index source scores against its OWN kv source's keys
    (V41_SPEC.md section 12 item 9). A candidate consumer with n_t <= index_topk takes the
    shortcut (all visible) before any mask, as section 4.4's shortcut reads; under the
    capacity invariant the mask would keep them all anyway. `quantize` applies the release
    formats' fake quantisation, `bf16_latent` section 3's bf16 cast (module docstring).
    """
    if len(inputs) != stack.num_hidden_layers:
        raise ValueError(f"inputs: expected {stack.num_hidden_layers} layers, got {len(inputs)}")
    length = len(inputs[0].q)
    plan = stack.layer_plan()
    tables = {"base": rope_frequencies(stack, False),
              "compress": rope_frequencies(stack, True)}
    eps = stack.rms_norm_eps
    entries, keys = {}, {}
    for s in stack.kv_source_layer_ids:
        x, r = inputs[s], plan[s].ratio
        latents = compress_latents(x.a, x.z, x.norm_c, r, eps, length, bf16_latent)
        entries[s] = main_entries(latents, r, tables["compress"], quantize)
        keys[s] = index_keys(latents, x.wk, x.k_norm, r, tables["compress"], eps, quantize)
    selections, margins, candidates, block_cuts = {}, {}, None, np.full(length, np.inf)
    for i in sorted(stack.index_source_layer_ids):
        p, x = plan[i], inputs[i]
        chosen, margins[i] = [], np.full(length, np.inf)
        if p.is_candidate_source:
            candidates = []
        for t in range(length):
            n = visible_entries(t, p.ratio)
            if n == 0:  # no closed entry: the indexer does not run (section 4.3)
                chosen.append(np.zeros(0, np.int64))
                if p.is_candidate_source:
                    candidates.append(np.zeros(0, np.int64))
                continue
            scores = index_scores(stack, x.q_index[t], x.w_index[t], keys[p.kv_src][:n], t,
                                  tables[p.rope], quantize)
            if p.is_candidate_source:
                _, cand, cut = candidate_blocks(scores, stack.candidate_block_size,
                                                stack.candidate_topk_blocks)
                candidates.append(cand)
                block_cuts[t] = cut
            if p.uses_candidates and n > stack.index_topk:
                masked = np.full(n, -np.inf)
                masked[candidates[t]] = scores[candidates[t]]
                scores = masked
                margins[i][t] = block_cuts[t]
            picks, cut = topk_selection(scores, stack.index_topk)
            chosen.append(picks)
            margins[i][t] = min(margins[i][t], cut)
        selections[i] = chosen
    outputs, windows = [], []
    for layer in range(stack.num_hidden_layers):
        p, x = plan[layer], inputs[layer]
        freqs = tables[p.rope]
        rows = rotate(x.win, np.arange(length), freqs)
        if quantize:
            rows = records.fake_quant_mxfp8(rows)
        out = np.zeros((length, stack.num_attention_heads, stack.head_dim))
        for t in range(length):
            seen = [rows[max(0, t - stack.sliding_window + 1): t + 1]]
            if p.ratio:
                seen.append(entries[p.kv_src][selections[p.idx_src][t]])
            out[t] = attend(rotate(x.q[t], t, freqs), np.concatenate(seen), x.sink, t, freqs)
        outputs.append(out)
        windows.append(rows)
    margin = min([np.inf, *(float(m.min()) for m in margins.values() if len(m))])
    return StackResult(outputs, windows, entries, keys, selections, candidates, margins,
                       margin)
