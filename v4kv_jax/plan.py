"""The layer plan: what each attention layer writes into the cache and what it reads, for
both families, so that one step can serve either (V41_SPEC.md section 1.2; SPEC section 1).

Every layer writes its window row. Beyond that a layer may own a compressor (it writes the
compressed entries of its ratio, and their index keys where it has an indexer), read entries
densely (all of them) or sparsely (the picks of an indexer), run indexer queries against some
layer's keys, and restrict those scores to the candidate blocks another layer published.

  V4 (`AttentionConfig`)     SWA: window only. CSA: its own C4 entries and index keys, its
                             own indexer, a sparse read. HCA: its own C128 entries, a dense
                             read.
  V4.1 (`V41Config`)         SWA: window only. Full (a kv source): its own entries and index
                             keys, its own indexer, a sparse read. Reindex (an index source,
                             not a kv source): its own indexer over the latest kv source's
                             keys, a sparse read of that source's entries. Reuse: the latest
                             index source's picks over the latest kv source's entries.

`of(config)` gives a `LayerPlan` per layer of either config.
"""

from __future__ import annotations

import dataclasses

from v4kv_jax import checks
from v4kv_jax.config import AttentionConfig, LayerKind
from v4kv_jax.config41 import V41Config

READS = ("window", "dense", "sparse")


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """One attention layer's part in the cache.

    Attributes:
      layer: the layer's index.
      ratio: tokens per compressed entry of what it reads (0: window only).
      mode: "SWA", "CSA", "HCA" (V4) or "SWA", "Full", "Reindex", "Reuse" (V4.1).
      read: "window" (window only), "dense" (every visible entry) or "sparse" (picks).
      entries: the layer whose compressed entries it reads (itself where it writes them);
        None for a window-only layer.
      writes_entries: it owns a compressor and writes its entries.
      writes_keys: it writes the index keys of its entries.
      picks: the layer whose indexer picks the entries it reads (itself where it scores);
        None unless `read` is "sparse".
      keys: the layer whose index keys its indexer scores; None where it runs no indexer.
      candidates: the layer whose candidate blocks restrict its scores, or None.
      publishes_candidates: its scores pick the candidate blocks of later index sources.
      rope: "compress" (compress_rope_theta with YaRN, every rotation of the layer) for a
        nonzero ratio, else "base".
    """

    layer: int
    ratio: int
    mode: str
    read: str
    entries: int | None
    writes_entries: bool
    writes_keys: bool
    picks: int | None
    keys: int | None
    candidates: int | None
    publishes_candidates: bool
    rope: str

    @property
    def scores(self) -> bool:
        """It runs indexer queries of its own."""
        return self.keys is not None


def _v4(config: AttentionConfig) -> tuple[LayerPlan, ...]:
    plans = []
    for layer, kind in enumerate(config.layer_kinds):
        ratio = 0 if kind == LayerKind.SWA else config.ratio(kind)
        own = None if kind == LayerKind.SWA else layer
        csa = kind == LayerKind.CSA
        plans.append(LayerPlan(
            layer=layer, ratio=ratio, mode=kind.name,
            read={LayerKind.SWA: "window", LayerKind.CSA: "sparse", LayerKind.HCA: "dense"}[kind],
            entries=own, writes_entries=own is not None, writes_keys=csa,
            picks=layer if csa else None, keys=layer if csa else None, candidates=None,
            publishes_candidates=False, rope="base" if own is None else "compress"))
    return tuple(plans)


def _latest(layers: tuple[int, ...], layer: int) -> int | None:
    return max((s for s in layers if s <= layer), default=None)


def _v41(config: V41Config) -> tuple[LayerPlan, ...]:
    kv, index = config.kv_source_layers, config.index_source_layers
    candidate = config.candidate_source_layer
    plans = []
    for layer, ratio in enumerate(config.compress_ratios):
        if ratio == 0:
            plans.append(LayerPlan(layer=layer, ratio=0, mode="SWA", read="window",
                                   entries=None, writes_entries=False, writes_keys=False,
                                   picks=None, keys=None, candidates=None,
                                   publishes_candidates=False, rope="base"))
            continue
        source, picker = _latest(kv, layer), _latest(index, layer)
        scores = layer in index
        mode = "Full" if layer in kv else ("Reindex" if scores else "Reuse")
        plans.append(LayerPlan(
            layer=layer, ratio=ratio, mode=mode, read="sparse", entries=source,
            writes_entries=layer in kv, writes_keys=layer in kv, picks=picker,
            keys=source if scores else None,
            candidates=candidate if scores and 0 <= candidate < layer else None,
            publishes_candidates=layer == candidate, rope="compress"))
    return tuple(plans)


def of(config: AttentionConfig | V41Config) -> tuple[LayerPlan, ...]:
    """Each layer's `LayerPlan`, in layer order."""
    if isinstance(config, AttentionConfig):
        return _v4(config)
    if isinstance(config, V41Config):
        return _v41(config)
    checks.fail("config", "an AttentionConfig or a V41Config", type(config).__name__, TypeError)


def table(config: AttentionConfig | V41Config) -> str:
    """The plan as a markdown table, runs of layers with the same part joined (docs)."""
    rows, run = [], []

    def key(p: LayerPlan):
        return (p.ratio, p.mode, p.read, p.entries, p.picks, p.keys, p.candidates,
                p.publishes_candidates)

    def show(v) -> str:
        return "-" if v is None else str(v)

    def flush():
        if run:
            p = run[0]
            span = str(p.layer) if len(run) == 1 else f"{p.layer}-{run[-1].layer}"
            rows.append(f"| {span} | {p.ratio} | {p.mode} | {p.read} | {show(p.entries)} | "
                        f"{show(p.picks)} | {show(p.keys)} | {show(p.candidates)} |")

    for p in of(config):
        if run and key(p) != key(run[-1]):
            flush()
            run.clear()
        run.append(p)
    flush()
    head = ("| layers | ratio | mode | read | entries of | picks of | scores keys of | "
            "candidates of |\n|---|---:|---|---|---:|---:|---:|---:|")
    return "\n".join([head, *rows])


__all__ = ["LayerPlan", "READS", "of", "table"]
