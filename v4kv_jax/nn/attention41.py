"""`V41Attention`: one DeepSeek-V4.1 attention layer as a Flax NNX module (V41_SPEC.md
sections 3-5; which weights a layer owns follows its `plan.LayerPlan`, spec section 6).

The module owns the layer's weights and projects its input x [B, T, D] into the vectors the
V4.1 step takes (`step41.LayerVectors41`, `step41.LayerWeights41`); the cache
(`v4kv_jax.step41.layer41`) owns the window ring, the compressor's open row, the entries,
the index keys, the indexer and the attention itself. The module then applies the grouped
output projection.

Parameters are named and laid out as the official checkpoint names them (`layers.N.attn.`
+ the path, `.weight` appended except for `attn_sink`; `v4kv_jax.interop.names41`), every
projection [out, in] (D hidden, q = q_lora_rank, H heads of hd, g = o_groups of rank R,
nI index heads of c):

  every layer          wq_a [q, D]   q_norm [q]   wq_b [H hd, q]   wkv [hd, D]   kv_norm [hd]
                       wo_a [g R, H hd / g]   wo_b [D, g R]   attn_sink [H]
  a kv source (Full)   compressor.wkv [hd, D]   compressor.norm [hd]
                       compressor.wgate [hd, D] (ratio 2 only)
                       indexer.wk [c, hd]   indexer.k_norm [c]
  an index source      indexer.wq_b [nI c, q]   indexer.weights_proj [nI, D]
  (Full, Reindex)

SWA and Reuse layers have neither `compressor` nor `indexer` (None). The vectors (spec
sections 4.2, 5; no per-head query norm in V4.1):

  qr      = RMSNorm_{q_norm}(wq_a x)         q       = wq_b qr        as [H, hd]
  win     = RMSNorm_{kv_norm}(wkv x)         a, z    = compressor.wkv x, compressor.wgate x
  q_index = indexer.wq_b qr  as [nI, c]      w_index = indexer.weights_proj x (raw)

all before RoPE (the step rotates them) and in fp32 whatever `param_dtype` stores.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from v4kv_jax import checks, plan, step41
from v4kv_jax.config41 import V41Config
from v4kv_jax.ops.attention import output_projection
from v4kv_jax.ops.compressor import rms_norm
from v4kv_jax.pools.cache41 import Cache41
from v4kv_jax.step41 import Chunk41, LayerVectors41, LayerWeights41


def _projection(rngs: nnx.Rngs, out_dim: int, in_dim: int, dtype) -> nnx.Param:
    """A weight [out, in] with entries N(0, 1 / in)."""
    w = in_dim**-0.5 * jax.random.normal(rngs.params(), (out_dim, in_dim), jnp.float32)
    return nnx.Param(w.astype(dtype))


def _ones(width: int) -> nnx.Param:
    return nnx.Param(jnp.ones((width,), jnp.float32))


def linear(x: jax.Array, weight: jax.Array, precision=None) -> jax.Array:
    """x [..., in] @ weight[out, in].T in fp32: [..., out]."""
    return jnp.einsum("...i,oi->...o", x.astype(jnp.float32), weight.astype(jnp.float32),
                      precision=precision)


def param_shapes41(config: V41Config, layer: int) -> dict[str, tuple[int, ...]]:
    """{path: shape} of the params layer `layer` of `config` owns (the module docstring's
    table, by the layer's plan)."""
    if not isinstance(config, V41Config):
        checks.fail("config", "a V41Config", type(config).__name__, TypeError)
    checks.integer("layer", layer, lo=0, hi=config.num_layers - 1)
    p = plan.of(config)[layer]
    D, H, hd, q = config.hidden_size, config.num_heads, config.head_dim, config.q_lora_rank
    g, R = config.o_groups, config.o_lora_rank
    nI, c = config.index_heads, config.index_head_dim
    shapes = {"wq_a": (q, D), "q_norm": (q,), "wq_b": (H * hd, q), "wkv": (hd, D),
              "kv_norm": (hd,), "wo_a": (g * R, H * hd // g), "wo_b": (D, g * R),
              "attn_sink": (H,)}
    if p.writes_entries:
        shapes.update({"compressor.wkv": (hd, D), "compressor.norm": (hd,)})
        if p.ratio == 2:
            shapes["compressor.wgate"] = (hd, D)
    if p.scores:
        shapes.update({"indexer.wq_b": (nI * c, q), "indexer.weights_proj": (nI, D)})
    if p.writes_keys:
        shapes.update({"indexer.wk": (c, hd), "indexer.k_norm": (c,)})
    return shapes


class Compressor41(nnx.Module):
    """A kv source's compressor (V41_SPEC.md section 3): wkv [hd, D], wgate [hd, D] (ratio 2;
    else None) and the entry norm [hd]."""

    def __init__(self, config: V41Config, ratio: int, *, rngs: nnx.Rngs, param_dtype):
        D, hd = config.hidden_size, config.head_dim
        self.wkv = _projection(rngs, hd, D, param_dtype)
        self.wgate = nnx.data(_projection(rngs, hd, D, param_dtype) if ratio == 2 else None)
        self.norm = _ones(hd)


class Indexer41(nnx.Module):
    """An index source's indexer (V41_SPEC.md section 4): its queries wq_b [nI c, q] and head
    weights weights_proj [nI, D]; a kv source's also the key projection wk [c, hd] and
    k_norm [c] (else None)."""

    def __init__(self, config: V41Config, owns_keys: bool, *, rngs: nnx.Rngs, param_dtype):
        nI, c = config.index_heads, config.index_head_dim
        self.wq_b = _projection(rngs, nI * c, config.q_lora_rank, param_dtype)
        self.weights_proj = _projection(rngs, nI, config.hidden_size, param_dtype)
        self.wk = nnx.data(_projection(rngs, c, config.head_dim, param_dtype)
                           if owns_keys else None)
        self.k_norm = nnx.data(_ones(c) if owns_keys else None)


class V41Attention(nnx.Module):
    """Layer `layer` of a V4.1 stack, reading and appending to a `Cache41`.

    Args:
      config: the stack (shared by every layer of the model).
      layer: this layer's index in it; its plan (`plan.of(config)[layer]`) says which
        weights it owns.
      rngs: random streams for the initial weights (projections N(0, 1/fan_in), norms 1).
      param_dtype: storage dtype of the projections (norms and the sink stay fp32).
      sink_scale: std of the initial `attn_sink` (0 = zeros).
      precision: matmul precision of the projections (None = backend default).
      bf16_latent: round each pooled latent to bf16 before its norm, as the official code
        (`step41.layer41`).
    """

    def __init__(self, config: V41Config, layer: int, *, rngs: nnx.Rngs,
                 param_dtype=jnp.float32, sink_scale: float = 0.0, precision=None,
                 bf16_latent: bool = False):
        param_shapes41(config, layer)  # checks config and layer
        p = plan.of(config)[layer]
        D, H, hd = config.hidden_size, config.num_heads, config.head_dim
        g, R = config.o_groups, config.o_lora_rank
        self.config, self.layer = config, int(layer)
        self.precision, self.bf16_latent = precision, bool(bf16_latent)
        self.wq_a = _projection(rngs, config.q_lora_rank, D, param_dtype)
        self.q_norm = _ones(config.q_lora_rank)
        self.wq_b = _projection(rngs, H * hd, config.q_lora_rank, param_dtype)
        self.wkv = _projection(rngs, hd, D, param_dtype)
        self.kv_norm = _ones(hd)
        self.wo_a = _projection(rngs, g * R, H * hd // g, param_dtype)
        self.wo_b = _projection(rngs, D, g * R, param_dtype)
        self.attn_sink = nnx.Param(sink_scale * jax.random.normal(rngs.params(), (H,),
                                                                  jnp.float32))
        self.compressor = nnx.data(Compressor41(config, p.ratio, rngs=rngs,
                                                param_dtype=param_dtype)
                                   if p.writes_entries else None)
        self.indexer = nnx.data(Indexer41(config, p.writes_keys, rngs=rngs,
                                          param_dtype=param_dtype) if p.scores else None)

    @property
    def layer_plan(self) -> plan.LayerPlan:
        """This layer's part in the cache."""
        return plan.of(self.config)[self.layer]

    def paths(self) -> tuple[str, ...]:
        """The dot-separated paths of the params this layer owns (module docstring)."""
        found = []
        for path, value in nnx.iter_graph(self):
            if isinstance(value, nnx.Param):
                found.append(".".join(str(k) for k in path))
        return tuple(sorted(found))

    def weight(self, path: str) -> nnx.Param:
        """The param at `path` (e.g. "wq_a", "compressor.norm", "indexer.wk")."""
        if not isinstance(path, str):
            checks.fail("path", "a dot-separated param path (str)", path, TypeError)
        owned = self.paths()
        if path not in owned:
            checks.fail("path", f"a param of layer {self.layer} ({self.layer_plan.mode}, ratio "
                        f"{self.layer_plan.ratio}): one of {list(owned)}", repr(path))
        obj = self
        for part in path.split("."):
            obj = getattr(obj, part)
        return obj

    def _check_input(self, x) -> None:
        if np.ndim(x) != 3 or np.shape(x)[-1] != self.config.hidden_size:
            checks.fail("x", f"an array [B, T, hidden_size={self.config.hidden_size}]",
                        f"shape {tuple(np.shape(x))}")
        checks.dtype_kind("x", x, "floating")

    def vectors(self, x: jax.Array) -> tuple[LayerVectors41, LayerWeights41]:
        """The layer's vectors (module docstring) for x [B, T, D] and the weights the step
        reads (sink; a kv source's norm_c, wk, k_norm)."""
        self._check_input(x)
        config, prec = self.config, self.precision
        B, T, _ = x.shape
        eps = config.rms_eps
        qr = rms_norm(linear(x, self.wq_a[...], prec), self.q_norm[...], eps)
        vectors = LayerVectors41(
            q=linear(qr, self.wq_b[...], prec).reshape(B, T, config.num_heads, config.head_dim),
            win=rms_norm(linear(x, self.wkv[...], prec), self.kv_norm[...], eps))
        weights = LayerWeights41(sink=self.attn_sink[...].astype(jnp.float32))
        if self.compressor is not None:
            c = self.compressor
            vectors = vectors.replace(
                a=linear(x, c.wkv[...], prec),
                z=None if c.wgate is None else linear(x, c.wgate[...], prec))
            weights = weights.replace(norm_c=c.norm[...].astype(jnp.float32))
        if self.indexer is not None:
            ix = self.indexer
            vectors = vectors.replace(
                q_index=linear(qr, ix.wq_b[...], prec).reshape(
                    B, T, config.index_heads, config.index_head_dim),
                w_index=linear(x, ix.weights_proj[...], prec))
            if ix.wk is not None:
                weights = weights.replace(wk=ix.wk[...].astype(jnp.float32),
                                          k_norm=ix.k_norm[...].astype(jnp.float32))
        return vectors, weights

    def output(self, o: jax.Array) -> jax.Array:
        """The grouped output projection (V41_SPEC.md section 5, as V4's) of the attention
        output o [..., H, hd]: f32 [..., D]."""
        return output_projection(o, self.wo_a[...], self.wo_b[...], self.config.o_groups,
                                 self.precision, layout="out_in")

    def __call__(self, x: jax.Array, cache: Cache41, chunk: Chunk41
                 ) -> tuple[Cache41, Chunk41, jax.Array]:
        """Appends the chunk x [B, T, D] to this layer's part of the cache and attends
        (`step41.layer41`), then projects the output.

        Layers of a step run in order (a source before the layers that read it), each once,
        between `step41.begin41` and `step41.end41` (a `Decoder41` does this).

        Args:
          x: the layer's input (already normed by the caller); tokens past a row's n_new
            are padding.
          cache: a `Cache41` of the module's config.
          chunk: from `step41.begin41` or the previous layer.

        Returns:
          (cache, chunk, f32[B, T, D]) the layer output (no residual; zeros for tokens the
          rows did not append).
        """
        if not isinstance(cache, Cache41):
            checks.fail("cache", "a Cache41 (init_cache41)", type(cache).__name__, TypeError)
        if cache.config != self.config:
            checks.fail("cache", "a cache built for the module's V41Config",
                        "a cache of another V41Config")
        if not isinstance(chunk, Chunk41):
            checks.fail("chunk", "a Chunk41 (step41.begin41)", type(chunk).__name__, TypeError)
        self._check_input(x)
        if tuple(chunk.positions.shape) != tuple(x.shape[:2]):
            checks.fail("x", f"[B, T] = {tuple(chunk.positions.shape)} as the chunk's "
                        "(step41.begin41)", f"shape {tuple(x.shape)}")
        vectors, weights = self.vectors(x)
        cache, chunk, o = step41.layer41(cache, chunk, self.layer, vectors, weights,
                                         bf16_latent=self.bf16_latent)
        return cache, chunk, self.output(o)


__all__ = ["Compressor41", "Indexer41", "V41Attention", "linear", "param_shapes41"]
