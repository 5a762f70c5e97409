"""Brute-force oracle written straight from SPEC.md, in float64 numpy, with no cache at all.

Every entry is recomputed from the full token history, every query attends with dense masks.
It is slow on purpose and shares no code with the library (its RoPE frequencies, YaRN
included, are its own float64 table from the SPEC formula), so a bug in the pools, the
paging, the streaming or the library's RoPE tables shows up as a difference. Used by the tests
and by `v4kv demo` to report the largest deviation.

The library forms angles in fp32 (as the executable reference does), so its RoPE dims differ
from these by up to `rope_atol`, which grows with the position (SPEC pitfall 11).

Inputs are one sequence's per-token vectors, per layer (numpy arrays over positions 0..L-1).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from v4kv_jax.config import AttentionConfig, LayerKind


@dataclasses.dataclass
class LayerHistory:
    """One layer, one sequence, positions 0..L-1.

    Attributes:
      window: [L, hd] window vectors kv_t.
      kv, gate: [L, in_width] main compressor inputs (gate without the position bias);
        None for SWA layers.
      ape, norm: main compressor params ([m, in_width], [hd]).
      index_kv, index_gate, index_ape, index_norm: the indexer compressor (CSA only).
      q: [L, H, hd] queries; sink: [H].
      index_q: [L, nI, c]; index_weights: [L, nI] (raw, CSA only).
    """

    window: np.ndarray
    q: np.ndarray
    sink: np.ndarray
    kv: np.ndarray | None = None
    gate: np.ndarray | None = None
    ape: np.ndarray | None = None
    norm: np.ndarray | None = None
    index_kv: np.ndarray | None = None
    index_gate: np.ndarray | None = None
    index_ape: np.ndarray | None = None
    index_norm: np.ndarray | None = None
    index_q: np.ndarray | None = None
    index_weights: np.ndarray | None = None


def inv_frequencies(config: AttentionConfig, kind: LayerKind) -> np.ndarray:
    """f64[r // 2]: f_i = theta^(-2i / r), with YaRN for CSA and HCA layers (SPEC section 2).

    SWA layers use `rope_theta` as is. CSA and HCA layers use `compress_rope_theta` and the YaRN
    blend, with the floor / ceil of lo and hi (pitfall 10); a factor of 1 leaves f unchanged.
    """
    r = config.rope_dim
    i = np.arange(r // 2, dtype=np.float64)
    if kind == LayerKind.SWA:
        return float(config.rope_theta) ** (-2.0 * i / r)
    theta = float(config.compress_rope_theta)
    f = theta ** (-2.0 * i / r)
    original = config.yarn_original_max_position

    def delta(rotations: float) -> float:
        return r * math.log(original / (2 * math.pi * rotations)) / (2 * math.log(theta))

    lo = max(math.floor(delta(config.yarn_beta_fast)), 0)
    hi = min(math.ceil(delta(config.yarn_beta_slow)), r - 1)
    if lo == hi:
        hi += 0.001
    gamma = np.clip((i - lo) / (hi - lo), 0.0, 1.0)
    return f * (1.0 - gamma) + (f / config.yarn_factor) * gamma


def rope_atol(config: AttentionConfig, kind: LayerKind, position, magnitude) -> np.ndarray:
    """Bound on |library - oracle| in the RoPE dims of a vector rotated at `position` whose
    rotated values are at most `magnitude` in absolute value (SPEC pitfall 11).

    The library forms the angle in fp32 as fl32(p * F_i), F_i its fp32 table. F_i is off by
    at most 7 fp32 roundings (2^-24 relative each) of f_i: 2 for the power (`powf` is within
    an ulp), 2 for the reciprocals, 3 for the YaRN blend (measured: at most 2.8 for r = 8 and
    r = 64); the exponent 2i / r is exact when r is a power of two, else its rounding adds
    ln(theta) more; the product adds one. So the angle of pair i is off by at most
    (8 [+ ln theta]) * 2^-24 * p * f_i, except pair 0, whose f_0 = theta^0 = 1 and angle p * 1
    are exact. Turning a pair of norm at most sqrt(2) * magnitude by e radians moves each of
    its two values by at most that much times e.
    """
    r = config.rope_dim
    theta = config.rope_theta if kind == LayerKind.SWA else config.compress_rope_theta
    roundings = 8 + (0 if r & (r - 1) == 0 else math.log(theta))
    f = inv_frequencies(config, kind)[1:]
    worst = roundings * 2.0**-24 * (f.max() if f.size else 0.0)
    return worst * np.sqrt(2) * np.asarray(position, np.float64) * np.asarray(magnitude,
                                                                               np.float64)


def _rotate(x: np.ndarray, position, inv_freq: np.ndarray, inverse: bool = False) -> np.ndarray:
    r = 2 * inv_freq.shape[0]
    angle = np.float64(position) * np.asarray(inv_freq, np.float64)
    sign = -1.0 if inverse else 1.0
    cos, sin = np.cos(angle), sign * np.sin(angle)
    out = np.array(x, dtype=np.float64)
    x0, x1 = out[..., -r::2].copy(), out[..., -r + 1::2].copy()
    out[..., -r::2] = x0 * cos - x1 * sin
    out[..., -r + 1::2] = x0 * sin + x1 * cos
    return out


def _rms_norm(x: np.ndarray, weight: np.ndarray | None, eps: float) -> np.ndarray:
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return y if weight is None else y * weight


def compress(a: np.ndarray, z_raw: np.ndarray, ape: np.ndarray, norm: np.ndarray, ratio: int,
             overlap: bool, inv_freq: np.ndarray, eps: float, length: int) -> np.ndarray:
    """All complete entries of the first `length` tokens: [length // ratio, width]."""
    a = np.asarray(a, np.float64)
    z = np.asarray(z_raw, np.float64) + np.asarray(ape, np.float64)[np.arange(len(a)) % ratio]
    width = a.shape[-1] // 2 if overlap else a.shape[-1]
    out = []
    for i in range(length // ratio):
        cur = range(i * ratio, (i + 1) * ratio)
        if overlap:
            prev = [t for t in range((i - 1) * ratio, i * ratio) if t >= 0]
            slots_a = [a[t, :width] for t in prev] + [a[t, width:] for t in cur]
            slots_z = [z[t, :width] for t in prev] + [z[t, width:] for t in cur]
        else:
            slots_a = [a[t] for t in cur]
            slots_z = [z[t] for t in cur]
        za = np.stack(slots_z)
        w = np.exp(za - za.max(axis=0))
        w /= w.sum(axis=0)
        pooled = (w * np.stack(slots_a)).sum(axis=0)
        out.append(_rotate(_rms_norm(pooled, np.asarray(norm, np.float64), eps), i * ratio,
                           inv_freq))
    return np.asarray(out, np.float64).reshape(length // ratio, width)


def topk_picks(config: AttentionConfig, h: LayerHistory, t: int, index_keys: np.ndarray
               ) -> tuple[list[int], float]:
    """Entries the indexer picks for query t, and the score margin at the cut (inf if none)."""
    n_valid = (t + 1) // config.csa_ratio
    if n_valid == 0:
        return [], np.inf
    q = np.asarray(h.index_q[t], np.float64)  # [nI, c]
    w = np.asarray(h.index_weights[t], np.float64) * config.index_head_dim**-0.5 * (
        config.index_heads**-0.5)
    dots = np.maximum(q @ index_keys[:n_valid].T, 0.0)  # [nI, n]
    scores = w @ dots
    order = np.argsort(-scores, kind="stable")
    k = min(config.index_topk, n_valid)
    margin = np.inf if k == n_valid else float(scores[order[k - 1]] - scores[order[k]])
    return sorted(order[:k].tolist()), margin


def attention_outputs(config: AttentionConfig, kind: LayerKind, h: LayerHistory, length: int,
                      *, entries: np.ndarray | None = None,
                      index_keys: np.ndarray | None = None) -> tuple[np.ndarray, float]:
    """Outputs of queries 0..length-1 of one layer: ([length, H, hd], smallest top-k margin).

    `entries` (C4 or C128, [length // m, hd]) and `index_keys` ([length // m, c]) replace the
    compressed ones when given: e.g. entries as a storage format holds them, with the window
    and the indexer queries of `h` fake-quantised to match (the indexer scores
    h.index_q . index_keys whatever basis both are in).
    """
    inv_freq = inv_frequencies(config, kind)
    if kind == LayerKind.CSA:
        if entries is None:
            entries = compress(h.kv, h.gate, h.ape, h.norm, config.csa_ratio, True, inv_freq,
                               config.rms_eps, length)
        if index_keys is None:
            index_keys = compress(h.index_kv, h.index_gate, h.index_ape, h.index_norm,
                                  config.csa_ratio, True, inv_freq, config.rms_eps, length)
    elif kind == LayerKind.HCA and entries is None:
        entries = compress(h.kv, h.gate, h.ape, h.norm, config.hca_ratio, False, inv_freq,
                           config.rms_eps, length)
    entries = None if entries is None else np.asarray(entries, np.float64)
    index_keys = None if index_keys is None else np.asarray(index_keys, np.float64)
    window = np.asarray(h.window, np.float64)
    out = np.zeros((length, config.num_heads, config.head_dim))
    margin = np.inf
    for t in range(length):
        keys = [window[j] for j in range(max(0, t - config.window + 1), t + 1)]
        if kind == LayerKind.HCA:
            keys += list(entries[: (t + 1) // config.hca_ratio])
        elif kind == LayerKind.CSA:
            picks, cut = topk_picks(config, h, t, index_keys)
            margin = min(margin, cut)
            keys += [entries[i] for i in picks]
        k = np.stack(keys)  # [K, hd]
        q = np.asarray(h.q[t], np.float64)  # [H, hd]
        logits = q @ k.T * config.head_dim**-0.5  # [H, K]
        sink = np.asarray(h.sink, np.float64)[:, None]
        top = np.maximum(logits.max(axis=1, keepdims=True), sink)
        p = np.exp(logits - top)
        denom = p.sum(axis=1, keepdims=True) + np.exp(sink - top)
        out[t] = _rotate((p / denom) @ k, t, inv_freq, inverse=True)
    return out, margin
