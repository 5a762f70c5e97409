"""What the V4.1 tests share: the oracle's description of a `V41Config`'s stack, and the
oracle's per-layer inputs as the step's batched vectors and weights."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

import v4kv_jax as v4
from v4kv_jax import plan
from v4kv_jax.step41 import LayerVectors41, LayerWeights41
from v4kv_jax.testing import v41_oracle as oracle


def stack_of(config: v4.V41Config, **extra) -> oracle.V41Stack:
    """The oracle's description of the same stack (its RoPE, YaRN and eps fields too)."""
    return oracle.V41Stack(
        compress_ratios=config.compress_ratios, kv_source_layer_ids=config.kv_source_layers,
        index_source_layer_ids=config.index_source_layers,
        candidate_source_layer_id=config.candidate_source_layer,
        candidate_topk_blocks=config.candidate_topk_blocks,
        candidate_block_size=config.candidate_block_size, index_topk=config.index_topk,
        index_n_heads=config.index_heads, index_head_dim=config.index_head_dim,
        head_dim=config.head_dim, qk_rope_head_dim=config.rope_dim,
        num_attention_heads=config.num_heads, sliding_window=config.window,
        **{"rms_norm_eps": config.rms_eps, "rope_theta": config.rope_theta,
           "compress_rope_theta": config.compress_rope_theta,
           "rope_factor": config.yarn_factor,
           "original_max_position_embeddings": config.yarn_original_max_position,
           "beta_fast": config.yarn_beta_fast, "beta_slow": config.yarn_beta_slow, **extra})


def _f32(x, lo: int, hi: int):
    return None if x is None else jnp.asarray(np.asarray(x, np.float32)[None, lo:hi])


def chunk(config: v4.V41Config, inputs: list[oracle.LayerInputs], lo: int, hi: int,
          tokens: int | None = None) -> tuple[list[LayerVectors41], list[LayerWeights41]]:
    """Positions [lo, hi) of one sequence as a batch of 1 row of `tokens` (>= hi - lo; the
    rest NaN padding) and the layers' weights."""
    tokens = hi - lo if tokens is None else tokens
    vectors, weights = [], []
    for p, x in zip(plan.of(config), inputs, strict=True):

        def pad(v):
            if v is None:
                return None
            v = _f32(v, lo, hi)
            fill = jnp.full((1, tokens - (hi - lo), *v.shape[2:]), jnp.nan, jnp.float32)
            return jnp.concatenate([v, fill], axis=1)

        vectors.append(LayerVectors41(
            q=pad(x.q), win=pad(x.win), a=pad(x.a) if p.writes_entries else None,
            z=pad(x.z) if p.writes_entries and p.ratio == 2 else None,
            q_index=pad(x.q_index) if p.scores else None,
            w_index=pad(x.w_index) if p.scores else None))
        own = p.writes_entries
        weights.append(LayerWeights41(
            sink=jnp.asarray(x.sink, jnp.float32),
            norm_c=jnp.asarray(x.norm_c, jnp.float32) if own else None,
            wk=jnp.asarray(x.wk, jnp.float32) if own else None,
            k_norm=jnp.asarray(x.k_norm, jnp.float32) if own else None))
    return vectors, weights
