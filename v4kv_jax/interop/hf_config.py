"""`AttentionConfig` from and to a DeepSeek-V4 `config.json` (transformers 5.23.0 fields, or the
released checkpoint's, which uses the legacy `compress_ratios` / `qk_rope_head_dim` /
`rope_scaling` keys that transformers folds in), and a `V41Config` from a DeepSeek-V4.1 one
(`v41_config_from_hf`: its `text_config`)."""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Mapping

from v4kv_jax import checks
from v4kv_jax.config import AttentionConfig, LayerKind
from v4kv_jax.config41 import V41Config

LAYER_TYPES = {
    LayerKind.SWA: "sliding_attention",
    LayerKind.CSA: "compressed_sparse_attention",
    LayerKind.HCA: "heavily_compressed_attention",
}


_MISSING = object()
ROPE_TYPES = ("default", "yarn")  # "default": plain RoPE; "yarn": YaRN on CSA / HCA layers


def _field(d: Mapping, key: str, default=_MISSING, where: str = "config"):
    value = d.get(key, default)
    if value is _MISSING:
        checks.fail(where, f"a {key!r} entry (DeepSeek-V4 attention needs it)",
                    f"none among its keys {sorted(d)}")
    return value


def _int(name: str, value, lo: int | None = 1) -> int:
    """An integer entry; a float, string or bool is shown with its type."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        bound = "" if lo is None else f" >= {lo}"
        checks.fail(name, f"an integer{bound}", f"{value!r} ({type(value).__name__})",
                    TypeError)
    return checks.integer(name, value, lo=lo)


def _real(name: str, value, lo: float = 0.0) -> float:
    """A finite number > lo."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        checks.fail(name, f"a number > {lo}", f"{value!r} ({type(value).__name__})", TypeError)
    return checks.real(name, value, lo=lo, lo_open=True)


def _mapping_or_none(name: str, value) -> Mapping | None:
    if value is not None and not isinstance(value, Mapping):
        checks.fail(name, "a JSON object (or null)", value, TypeError)
    return value


def _rope(d: Mapping) -> tuple[Mapping, Mapping, str, str]:
    """The RoPE parameters of the SWA layers ("main") and of the compressed layers
    ("compress"), and the names of both for error messages. transformers 5.23.0 nests them
    (`rope_parameters: {"main": ..., "compress": ...}`, each with its `rope_theta`); a flat
    `rope_parameters` or the legacy `rope_scaling` is the compressed layers' scaling only
    (its `rope_theta`, if any, is not theirs: transformers replaces it with
    `compress_rope_theta`), so it comes back without `rope_theta`."""
    key = "rope_parameters" if d.get("rope_parameters") is not None else "rope_scaling"
    rope = _mapping_or_none(key, d.get(key)) or {}
    if "main" in rope or "compress" in rope:
        main = _mapping_or_none(f"{key}['main']", rope.get("main")) or {}
        compress = _mapping_or_none(f"{key}['compress']", rope.get("compress")) or {}
        main_type = main.get("rope_type", main.get("type", "default"))
        if main_type != "default":
            checks.fail(f"{key}['main'] rope_type", "'default' (SWA layers use plain RoPE, "
                        "never scaled)", repr(main_type))
        return main, compress, f"{key}['main']", f"{key}['compress']"
    return {}, {k: v for k, v in rope.items() if k != "rope_theta"}, key, key


def _yarn(compress: Mapping, where: str) -> dict:
    type_key = "type" if "type" in compress and "rope_type" not in compress else "rope_type"
    kind = compress.get(type_key, "default")
    if kind not in ROPE_TYPES:
        checks.fail(f"{where} {type_key}", f"one of {ROPE_TYPES} (the RoPE scalings V4 "
                    "attention supports)", repr(kind))
    if kind == "default":
        return {"yarn_factor": 1.0}
    out = {"yarn_factor": _real(f"{where} factor", _field(compress, "factor", where=where),
                                lo=0.0)}
    if out["yarn_factor"] < 1.0:
        checks.fail(f"{where} factor", "a YaRN factor >= 1", out["yarn_factor"])
    for ours, theirs in (("yarn_original_max_position", "original_max_position_embeddings"),
                         ("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
        if theirs in compress:
            value = compress[theirs]
            out[ours] = (_int(f"{where} {theirs}", value) if ours.endswith("position")
                         else _real(f"{where} {theirs}", value))
    attention_factor = compress.get("attention_factor", 1.0)
    if attention_factor is not None and attention_factor != 1.0:
        checks.fail(f"{where} attention_factor", "1.0 (V4 does not rescale cos / sin)",
                    attention_factor)
    return out


def _theta(d: Mapping, key: str, nested: Mapping, where: str, default: float) -> float:
    """`key` at the top level or as `rope_theta` in the nested RoPE parameters (they must
    agree when both are given)."""
    top, inner = d.get(key), nested.get("rope_theta")
    if top is not None:
        top = _real(key, top)
    if inner is not None:
        inner = _real(f"{where} rope_theta", inner)
    if top is not None and inner is not None and top != inner:
        checks.fail(key, f"the same value as {where} rope_theta={inner}", top)
    return top if top is not None else inner if inner is not None else default


def _rate(d: Mapping, rates: Mapping, kind: LayerKind, legacy: str, default: int) -> int:
    """A layer kind's compression ratio, from `compress_rates` or its legacy scalar key."""
    if LAYER_TYPES[kind] in rates:
        return _int(f"compress_rates[{LAYER_TYPES[kind]!r}]", rates[LAYER_TYPES[kind]])
    return _int(legacy, d.get(legacy, default))


def _layer_ratios(d: Mapping, csa: int, hca: int) -> tuple[list[int], int, int]:
    """Per-layer compression ratios (0 for SWA) and the CSA and HCA ratios."""
    n = d.get("num_hidden_layers")
    if n is not None:
        n = _int("num_hidden_layers", n)
    layer_types, legacy = d.get("layer_types"), d.get("compress_ratios")
    if layer_types is None and legacy is None:
        checks.fail("config", "layer_types (transformers) or compress_ratios (official "
                    "checkpoint) giving the kind of every layer", "neither")
    from_types = None
    if layer_types is not None:
        by_type = {v: k for k, v in LAYER_TYPES.items()}
        if not isinstance(layer_types, (list, tuple)) or not layer_types:
            checks.fail("layer_types", "a non-empty list of layer types", layer_types,
                        TypeError)
        unknown = sorted({repr(t) for t in layer_types
                          if not isinstance(t, str) or t not in by_type})
        if unknown:
            checks.fail("layer_types", f"values in {sorted(by_type)}",
                        f"{', '.join(unknown)}")
        if n is not None and len(layer_types) != n:
            checks.fail("layer_types", f"one entry per layer (num_hidden_layers={n})",
                        f"{len(layer_types)} entries")
        ratio = {LayerKind.SWA: 0, LayerKind.CSA: csa, LayerKind.HCA: hca}
        from_types = [ratio[by_type[t]] for t in layer_types]
    if legacy is None:
        return from_types, csa, hca
    if not isinstance(legacy, (list, tuple)) or not legacy:
        checks.fail("compress_ratios", "a non-empty list of per-layer ratios", legacy,
                    TypeError)
    ratios = [_int(f"compress_ratios[{i}]", r, lo=0) for i, r in enumerate(legacy)]
    if n is None:
        if from_types is None:
            checks.fail("num_hidden_layers", "an integer >= 1 next to compress_ratios (it "
                        "tells the layers from the trailing MTP entry)", "no such entry")
        n = len(from_types)
    if len(ratios) not in (n, n + 1):
        checks.fail("compress_ratios", f"num_hidden_layers={n} entries, or {n + 1} with the "
                    "trailing MTP entry of the official checkpoint", f"{len(ratios)} entries")
    ratios = ratios[:n]
    nonzero = sorted({r for r in ratios if r})
    if len(nonzero) > 2:
        checks.fail("compress_ratios", "at most two distinct non-zero ratios (CSA's m and "
                    "HCA's m')", nonzero)
    if len(nonzero) == 2 and from_types is None:
        csa, hca = nonzero
    if from_types is not None and from_types != ratios:
        checks.fail("compress_ratios", f"the ratios layer_types gives ({from_types})", ratios)
    return ratios, csa, hca


def attention_config_from_hf(d: Mapping, **overrides) -> AttentionConfig:
    """An `AttentionConfig` from a DeepSeek-V4 config.json dict (or `config.to_dict()`).

    Layer kinds come from `layer_types` + `compress_rates` (one entry per layer), else from
    `compress_ratios` (`num_hidden_layers` entries, or one more: the official list ends with
    an entry for the MTP block, which is dropped). `overrides` replace any field afterwards.

    Raises:
      TypeError, ValueError: an entry of the wrong type or value, a missing entry, layer
        lists that disagree with `num_hidden_layers` or with each other, or a RoPE scaling
        other than plain or YaRN; the message names the entry.
    """
    if not isinstance(d, Mapping):
        checks.fail("d", "a config.json dict (or config.to_dict())", type(d).__name__,
                    TypeError)
    fields = {f.name for f in dataclasses.fields(AttentionConfig)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        checks.fail("overrides", f"AttentionConfig fields ({sorted(fields)})", unknown,
                    TypeError)
    kv_heads = _int("num_key_value_heads", d.get("num_key_value_heads", 1))
    if kv_heads != 1:
        checks.fail("num_key_value_heads", "1 (V4 attention has one KV head)", kv_heads)
    head_dim = _int("head_dim", _field(d, "head_dim"))
    rope_dim = None
    if d.get("qk_rope_head_dim") is not None:
        rope_dim = _int("qk_rope_head_dim", d["qk_rope_head_dim"])
    if d.get("partial_rotary_factor") is not None:
        factor = _real("partial_rotary_factor", d["partial_rotary_factor"])
        from_factor = head_dim * factor
        if abs(from_factor - round(from_factor)) > 1e-6:
            checks.fail("partial_rotary_factor", f"a whole number of rope dims out of "
                        f"head_dim={head_dim}", f"{factor} ({from_factor} dims)")
        if rope_dim is not None and rope_dim != round(from_factor):
            checks.fail("qk_rope_head_dim", f"head_dim x partial_rotary_factor = "
                        f"{round(from_factor)}", rope_dim)
        rope_dim = round(from_factor)
    if rope_dim is None:
        rope_dim = head_dim * 64 // 512
    rates = _mapping_or_none("compress_rates", d.get("compress_rates")) or {}
    unknown = sorted(set(rates) - {LAYER_TYPES[LayerKind.CSA], LAYER_TYPES[LayerKind.HCA]})
    if unknown:
        checks.fail("compress_rates", f"keys {LAYER_TYPES[LayerKind.CSA]!r} and "
                    f"{LAYER_TYPES[LayerKind.HCA]!r}", unknown)
    csa, hca = (_rate(d, rates, kind, legacy, default)
                for kind, legacy, default in ((LayerKind.CSA, "compress_rate_csa", 4),
                                              (LayerKind.HCA, "compress_rate_hca", 128)))
    ratios, csa, hca = _layer_ratios(d, csa, hca)
    window_key = "sliding_window" if "sliding_window" in d else "window_size"
    window = d.get(window_key, 128)
    if window is None:
        checks.fail(window_key, "a positive integer: every V4 layer attends through a "
                    "sliding window", None)
    main, compress, main_where, where = _rope(d)
    fields = dict(
        hidden_size=_int("hidden_size", _field(d, "hidden_size")),
        num_heads=_int("num_attention_heads", _field(d, "num_attention_heads")),
        head_dim=head_dim, rope_dim=rope_dim,
        q_lora_rank=_int("q_lora_rank", _field(d, "q_lora_rank")),
        o_groups=_int("o_groups", _field(d, "o_groups")),
        o_lora_rank=_int("o_lora_rank", _field(d, "o_lora_rank")),
        window=_int(window_key, window),
        compress_ratios=tuple(ratios), csa_ratio=csa, hca_ratio=hca,
        index_heads=_int("index_n_heads", _field(d, "index_n_heads")),
        index_head_dim=_int("index_head_dim", _field(d, "index_head_dim")),
        index_topk=_int("index_topk", _field(d, "index_topk")),
        rope_theta=_theta(d, "rope_theta", main, main_where, 10000.0),
        compress_rope_theta=_theta(d, "compress_rope_theta", compress, where, 160000.0),
        rms_eps=_real("rms_norm_eps", d.get("rms_norm_eps", 1e-6)),
    )
    fields.update(_yarn(compress, where))
    fields.update(overrides)
    return AttentionConfig(**fields)


def _layer_list(name: str, value) -> tuple[int, ...]:
    if isinstance(value, (str, bytes, Mapping)) or not hasattr(value, "__iter__"):
        checks.fail(name, "a list of layer indices", repr(value), TypeError)
    return tuple(_int(f"{name}[{i}]", v, lo=0) for i, v in enumerate(value))


def v41_config_from_hf(d: Mapping, **overrides) -> V41Config:
    """A `V41Config` from a DeepSeek-V4.1 config.json dict: the model's (its attention
    fields nested in `text_config`) or the `text_config` itself (V41_SPEC.md section 1.1).

    `compress_ratios` holds `num_hidden_layers` entries or more (the DSpark layers', which
    are not attention layers of the backbone: dropped). `overrides` replace any field
    afterwards.

    Raises:
      TypeError, ValueError: an entry of the wrong type or value or a missing one (the
        message names it), and every `V41Config` check.
    """
    if not isinstance(d, Mapping):
        checks.fail("d", "a config.json dict (or config.to_dict())", type(d).__name__,
                    TypeError)
    if "text_config" in d:
        d = _mapping_or_none("text_config", d["text_config"]) or {}
    fields = {f.name for f in dataclasses.fields(V41Config)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        checks.fail("overrides", f"V41Config fields ({sorted(fields)})", unknown, TypeError)
    layers = _int("num_hidden_layers", _field(d, "num_hidden_layers"))
    ratios = _layer_list("compress_ratios", _field(d, "compress_ratios"))
    if len(ratios) < layers:
        checks.fail("compress_ratios", f"at least num_hidden_layers={layers} entries",
                    f"{len(ratios)} entries")
    scaling = _mapping_or_none("rope_scaling", d.get("rope_scaling")) or {}
    candidate = d.get("candidate_source_layer_id", -1)
    fields = dict(
        hidden_size=_int("hidden_size", _field(d, "hidden_size")),
        num_heads=_int("num_attention_heads", _field(d, "num_attention_heads")),
        head_dim=_int("head_dim", _field(d, "head_dim")),
        rope_dim=_int("qk_rope_head_dim", _field(d, "qk_rope_head_dim")),
        q_lora_rank=_int("q_lora_rank", _field(d, "q_lora_rank")),
        o_groups=_int("o_groups", _field(d, "o_groups")),
        o_lora_rank=_int("o_lora_rank", _field(d, "o_lora_rank")),
        window=_int("sliding_window", _field(d, "sliding_window")),
        compress_ratios=ratios[:layers],
        kv_source_layers=_layer_list("kv_source_layer_ids", _field(d, "kv_source_layer_ids")),
        index_source_layers=_layer_list("index_source_layer_ids",
                                        _field(d, "index_source_layer_ids")),
        candidate_source_layer=-1 if candidate is None else _int(
            "candidate_source_layer_id", candidate, lo=-1),
        candidate_topk_blocks=_int("candidate_topk_blocks", d.get("candidate_topk_blocks",
                                                                    2048)),
        candidate_block_size=_int("candidate_block_size", d.get("candidate_block_size", 8)),
        index_heads=_int("index_n_heads", _field(d, "index_n_heads")),
        index_head_dim=_int("index_head_dim", _field(d, "index_head_dim")),
        index_topk=_int("index_topk", _field(d, "index_topk")),
        rope_theta=_real("rope_theta", d.get("rope_theta", 10000.0)),
        compress_rope_theta=_real("compress_rope_theta", d.get("compress_rope_theta",
                                                               160000.0)),
        rms_eps=_real("rms_norm_eps", _field(d, "rms_norm_eps")),
    )
    if scaling:
        fields.update(_yarn({"rope_type": "yarn", **scaling}, "rope_scaling"))
    else:
        fields["yarn_factor"] = 1.0
    fields.update(overrides)
    return V41Config(**fields)


def transformers_config_kwargs(config: AttentionConfig, **extra) -> dict:
    """Keyword arguments of a transformers 5.23.0 `DeepseekV4Config` with this attention
    geometry (one decoder layer per attention layer; MoE sizes minimal unless given)."""
    if not isinstance(config, AttentionConfig):
        checks.fail("config", "an AttentionConfig", type(config).__name__, TypeError)
    kwargs = dict(
        hidden_size=config.hidden_size, num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads, num_key_value_heads=1,
        head_dim=config.head_dim, qk_rope_head_dim=config.rope_dim,
        q_lora_rank=config.q_lora_rank, o_groups=config.o_groups,
        o_lora_rank=config.o_lora_rank, sliding_window=config.window,
        layer_types=[LAYER_TYPES[k] for k in config.layer_kinds],
        compress_rates={LAYER_TYPES[LayerKind.CSA]: config.csa_ratio,
                        LAYER_TYPES[LayerKind.HCA]: config.hca_ratio},
        index_n_heads=config.index_heads, index_head_dim=config.index_head_dim,
        index_topk=config.index_topk, rope_theta=config.rope_theta,
        compress_rope_theta=config.compress_rope_theta, rms_norm_eps=config.rms_eps,
        vocab_size=32, moe_intermediate_size=8, n_routed_experts=2, num_experts_per_tok=1,
        n_shared_experts=1,
    )
    if config.yarn_factor > 1.0:
        kwargs["rope_parameters"] = {
            "rope_type": "yarn", "factor": config.yarn_factor,
            "original_max_position_embeddings": config.yarn_original_max_position,
            "beta_fast": config.yarn_beta_fast, "beta_slow": config.yarn_beta_slow,
        }
    kwargs.update(extra)
    return kwargs
