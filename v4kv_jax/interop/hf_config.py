"""`AttentionConfig` from and to a DeepSeek-V4 `config.json` (transformers 5.23.0 fields, or the
released checkpoint's, which uses the legacy `compress_ratios` / `qk_rope_head_dim` /
`rope_scaling` keys that transformers folds in)."""

from __future__ import annotations

from collections.abc import Mapping

from v4kv_jax.config import AttentionConfig, LayerKind

LAYER_TYPES = {
    LayerKind.SWA: "sliding_attention",
    LayerKind.CSA: "compressed_sparse_attention",
    LayerKind.HCA: "heavily_compressed_attention",
}


def _yarn(d: Mapping) -> dict:
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if isinstance(rope.get("compress"), Mapping):
        rope = rope["compress"]
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "yarn":
        return {"yarn_factor": 1.0}
    out = {"yarn_factor": float(rope["factor"])}
    for ours, theirs, cast in (
            ("yarn_original_max_position", "original_max_position_embeddings", int),
            ("yarn_beta_fast", "beta_fast", float), ("yarn_beta_slow", "beta_slow", float)):
        if theirs in rope:
            out[ours] = cast(rope[theirs])
    if float(rope.get("attention_factor", 1.0)) != 1.0:
        raise ValueError(f"rope attention_factor={rope['attention_factor']} is not supported: "
                         "V4 does not rescale cos / sin (expected 1.0)")
    return out


def attention_config_from_hf(d: Mapping, **overrides) -> AttentionConfig:
    """An `AttentionConfig` from a DeepSeek-V4 config.json dict (or `config.to_dict()`).

    Layer kinds come from `layer_types` + `compress_rates`, else from `compress_ratios`
    (truncated to `num_hidden_layers`: the official list ends with an entry for the MTP
    block). `overrides` replace any field afterwards.
    """
    kv_heads = d.get("num_key_value_heads", 1)
    if kv_heads != 1:
        raise ValueError(f"num_key_value_heads={kv_heads}: V4 attention has one KV head")
    head_dim = int(d["head_dim"])
    if "qk_rope_head_dim" in d:
        rope_dim = int(d["qk_rope_head_dim"])
    else:
        rope_dim = int(head_dim * float(d.get("partial_rotary_factor", 64 / 512)))
    n = d.get("num_hidden_layers")
    rates = dict(d.get("compress_rates") or {})
    csa = int(rates.get(LAYER_TYPES[LayerKind.CSA], d.get("compress_rate_csa", 4)))
    hca = int(rates.get(LAYER_TYPES[LayerKind.HCA], d.get("compress_rate_hca", 128)))
    if d.get("layer_types"):
        by_type = {v: k for k, v in LAYER_TYPES.items()}
        unknown = sorted({t for t in d["layer_types"] if t not in by_type})
        if unknown:
            raise ValueError(f"layer_types holds {unknown}; expected values in "
                             f"{sorted(by_type)}")
        ratio = {LayerKind.SWA: 0, LayerKind.CSA: csa, LayerKind.HCA: hca}
        ratios = [ratio[by_type[t]] for t in d["layer_types"]]
    elif d.get("compress_ratios") is not None:
        ratios = [int(r) for r in d["compress_ratios"]]
        nonzero = sorted({r for r in ratios if r})
        if len(nonzero) == 2:
            csa, hca = nonzero
    else:
        raise ValueError("the config has neither layer_types nor compress_ratios")
    if n is not None:
        ratios = ratios[:int(n)]
    fields = dict(
        hidden_size=int(d["hidden_size"]), num_heads=int(d["num_attention_heads"]),
        head_dim=head_dim, rope_dim=rope_dim, q_lora_rank=int(d["q_lora_rank"]),
        o_groups=int(d["o_groups"]), o_lora_rank=int(d["o_lora_rank"]),
        window=int(d.get("sliding_window", d.get("window_size", 128))),
        compress_ratios=tuple(ratios), csa_ratio=csa, hca_ratio=hca,
        index_heads=int(d["index_n_heads"]), index_head_dim=int(d["index_head_dim"]),
        index_topk=int(d["index_topk"]), rope_theta=float(d.get("rope_theta", 10000.0)),
        compress_rope_theta=float(d.get("compress_rope_theta", 160000.0)),
        rms_eps=float(d.get("rms_norm_eps", 1e-6)),
    )
    fields.update(_yarn(d))
    fields.update(overrides)
    return AttentionConfig(**fields)


def transformers_config_kwargs(config: AttentionConfig, **extra) -> dict:
    """Keyword arguments of a transformers 5.23.0 `DeepseekV4Config` with this attention
    geometry (one decoder layer per attention layer; MoE sizes minimal unless given)."""
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
