"""A small decoder of `V41Attention` layers: embedding, residual blocks, final norm, LM head.

Each block is `x + attn(RMSNorm_{attn_norm}(x))`, then `x + ffn(RMSNorm_{ffn_norm}(x))` with
a dense SwiGLU MLP (`nn.model.MLP`; `mlp_hidden=0` leaves it out: an attention-only stack).
The layers are unrolled (one block per layer, each its own weights; the program holds a copy
of every layer, so compile time grows with depth): V4.1's layers differ in what they own
(SWA, Full of ratio 1 or 2, Reindex, Reuse) and in what they read, so a scan over stacked
layers, as V4's `Decoder` does, would need runs of layers with equal plans.

One step (`Decoder41.step`, one jitted program `nn.forward41`, the cache donated) runs
`step41.begin41`, every block in layer order (a source before the layers that read it: the
`Chunk41` threads the picks, keys and candidate blocks), `step41.end41`, then the final norm
and the head: (cache, logits f32[B, T, V]). Every call with the same B, T (and model
structure) runs the same compiled program, whatever the chunk lengths `n_new`.

Out of scope: DeepSeek-V4.1's MoE, its hyper-connections (4 residual streams mixed per
block), Engram (the n-gram hash embeddings added at layers 1 and 14), DSpark and vision.
Names follow the official checkpoint where they exist (`embed`, `layers.N.attn_norm`,
`layers.N.attn`, `layers.N.ffn_norm`, `norm`, `head`), but only the attention layers load
from one (`v4kv_jax.interop.read_attention41`): this model runs V4.1 attention and its cache
end to end; it is not V4.1.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from v4kv_jax import append, checks, programs, step41
from v4kv_jax.config41 import V41Config
from v4kv_jax.nn.attention41 import V41Attention, linear
from v4kv_jax.nn.model import MLP
from v4kv_jax.ops.compressor import rms_norm
from v4kv_jax.pools.cache41 import Cache41


@dataclasses.dataclass(frozen=True)
class ModelConfig41:
    """Geometry of a `Decoder41`.

    Attributes:
      attn_config: the attention stack (its layers and their plans).
      vocab_size: V.
      mlp_hidden: width of each block's SwiGLU MLP; 0 = no MLP.
      tie_embeddings: use the embedding as the LM head.
    """

    attn_config: V41Config
    vocab_size: int = 256
    mlp_hidden: int = 0
    tie_embeddings: bool = False

    def __post_init__(self):
        if not isinstance(self.attn_config, V41Config):
            checks.fail("attn_config", "a V41Config", type(self.attn_config).__name__,
                        TypeError)
        checks.integer("vocab_size", self.vocab_size, lo=1)
        checks.integer("mlp_hidden", self.mlp_hidden, lo=0)
        if not isinstance(self.tie_embeddings, bool):
            checks.fail("tie_embeddings", "a bool", repr(self.tie_embeddings), TypeError)

    @property
    def num_layers(self) -> int:
        return self.attn_config.num_layers


def check_chunk41(config: ModelConfig41, cache: Cache41, tokens, slot_ids, n_new) -> None:
    """Checks of one model call: a `Cache41` of the model's stack, token ids [B, T] of an
    integer dtype, slot_ids and n_new [B], and (when concrete) the rows
    (`append.check_rows`, `append.check_room`) and token ids in [0, vocab_size) among each
    row's n_new tokens. Raises TypeError / ValueError naming the argument."""
    if not isinstance(cache, Cache41):
        checks.fail("cache", "a Cache41 (init_cache41)", type(cache).__name__, TypeError)
    checks.alive("cache", cache)
    if cache.config != config.attn_config:
        checks.fail("cache", "a cache built for the model's V41Config",
                    "a cache of another V41Config")
    checks.dtype_kind("tokens", tokens, "integer")
    if np.ndim(tokens) != 2 or np.shape(tokens)[1] < 1:
        checks.fail("tokens", "token ids of shape [B, T] with T >= 1",
                    f"shape {tuple(np.shape(tokens))}")
    batch, T = np.shape(tokens)
    for name, x in (("slot_ids", slot_ids), ("n_new", n_new)):
        if np.shape(x) != (batch,):
            checks.fail(name, f"shape ({batch},) (one per row of tokens)",
                        f"shape {np.shape(x)}")
    if not checks.concrete(tokens, slot_ids, n_new, cache):
        return
    append.check_rows(cache, slot_ids, n_new, T)
    ids = np.asarray(tokens)
    given = np.arange(T)[None, :] < np.asarray(n_new)[:, None]
    bad = given & ((ids < 0) | (ids >= config.vocab_size))
    if bad.any():
        b, t = np.argwhere(bad)[0]
        checks.fail("tokens", f"token ids in [0, {config.vocab_size}) (vocab_size)",
                    f"{int(ids[b, t])} at row {b}, position {t}")
    append.check_room(cache, slot_ids, n_new)


class Block41(nnx.Module):
    """Pre-norm residual block: x + attn(RMSNorm(x)), then x + ffn(RMSNorm(x))."""

    def __init__(self, config: ModelConfig41, layer: int, *, rngs: nnx.Rngs,
                 param_dtype=jnp.float32, sink_scale: float = 0.0, bf16_latent: bool = False):
        attn_config = config.attn_config
        D = attn_config.hidden_size
        self.eps = attn_config.rms_eps
        self.attn_norm = nnx.Param(jnp.ones((D,), jnp.float32))
        self.attn = V41Attention(attn_config, layer, rngs=rngs, param_dtype=param_dtype,
                                 sink_scale=sink_scale, bf16_latent=bf16_latent)
        with_mlp = config.mlp_hidden > 0
        self.ffn_norm = nnx.data(nnx.Param(jnp.ones((D,), jnp.float32)) if with_mlp else None)
        self.ffn = nnx.data(MLP(D, config.mlp_hidden, rngs=rngs, param_dtype=param_dtype)
                            if with_mlp else None)

    def __call__(self, x: jax.Array, cache: Cache41, chunk: step41.Chunk41
                 ) -> tuple[Cache41, step41.Chunk41, jax.Array]:
        cache, chunk, a = self.attn(rms_norm(x, self.attn_norm[...], self.eps), cache, chunk)
        x = x + a
        if self.ffn is not None:
            x = x + self.ffn(rms_norm(x, self.ffn_norm[...], self.eps))
        return cache, chunk, x


class Decoder41(nnx.Module):
    """Embedding -> one `Block41` per layer of the stack -> final RMSNorm -> LM head.

    Args:
      config: the model geometry.
      rngs: random streams; `nnx.Rngs(seed)` gives a reproducible random init.
      param_dtype: storage dtype of the projection weights.
      sink_scale: std of the attention layers' initial sinks (0 = zeros).
      bf16_latent: the attention layers round each pooled latent to bf16 before its norm.
    """

    def __init__(self, config: ModelConfig41, *, rngs: nnx.Rngs, param_dtype=jnp.float32,
                 sink_scale: float = 0.0, bf16_latent: bool = False):
        if not isinstance(config, ModelConfig41):
            checks.fail("config", "a ModelConfig41", type(config).__name__, TypeError)
        D, V = config.attn_config.hidden_size, config.vocab_size
        self.config = config
        self.embed = nnx.Param(jax.random.normal(rngs.params(), (V, D)).astype(param_dtype))
        self.layers = nnx.List([
            Block41(config, layer, rngs=rngs, param_dtype=param_dtype, sink_scale=sink_scale,
                    bf16_latent=bf16_latent) for layer in range(config.num_layers)])
        self.norm = nnx.Param(jnp.ones((D,), jnp.float32))
        self.head = nnx.data(None if config.tie_embeddings else nnx.Param(
            (D**-0.5 * jax.random.normal(rngs.params(), (V, D))).astype(param_dtype)))

    @property
    def attn_config(self) -> V41Config:
        return self.config.attn_config

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def hidden(self, tokens: jax.Array, cache: Cache41, slot_ids, n_new
               ) -> tuple[Cache41, jax.Array]:
        """Appends a chunk of tokens to every layer and returns the final-normed hidden
        states (traceable; `step` is the jitted call).

        Args:
          tokens: i32[B, T]; row b's first n_new[b] tokens are appended to slot slot_ids[b],
            the rest are padding.
          cache: a `Cache41` of the model's stack.
          slot_ids: i32[B] distinct ACTIVE slots (-1: a padding row, n_new 0).
          n_new: i32[B] in [0, T].

        Returns:
          (cache, f32[B, T, D]). With concrete arguments a broken row raises ValueError
          (`check_chunk41`); inside jit the rules of `append.begin_append` hold, and a row
          holding a token id outside the vocabulary among its n_new appends nothing and its
          slot is flagged REJECTED.
        """
        check_chunk41(self.config, cache, tokens, slot_ids, n_new)
        tokens = jnp.asarray(tokens)
        T = tokens.shape[1]
        n_new = jnp.asarray(n_new, jnp.int32)
        given = jnp.arange(T)[None, :] < n_new[:, None]
        outside = jnp.any(given & ((tokens < 0) | (tokens >= self.config.vocab_size)), axis=1)
        # A count outside [0, T] is how begin_append rejects a row (nothing appended, slot
        # flagged REJECTED), so a row with an id outside the vocabulary reads no clamped row.
        cache, chunk = step41.begin41(cache, jnp.asarray(slot_ids, jnp.int32),
                                      jnp.where(outside, -1, n_new), T)
        x = jnp.take(self.embed[...], tokens, axis=0, mode="clip").astype(jnp.float32)
        for block in self.layers:
            cache, chunk, x = block(x, cache, chunk)
        cache = step41.end41(cache, chunk)
        return cache, rms_norm(x, self.norm[...], self.config.attn_config.rms_eps)

    def logits(self, h: jax.Array) -> jax.Array:
        """f32[..., V] from final hidden states [..., D]."""
        head = self.embed if self.head is None else self.head
        return linear(h, head[...])

    def __call__(self, tokens: jax.Array, cache: Cache41, slot_ids, n_new
                 ) -> tuple[Cache41, jax.Array]:
        """(cache, logits f32[B, T, V]) for a chunk; see `hidden` (traceable)."""
        cache, h = self.hidden(tokens, cache, slot_ids, n_new)
        return cache, self.logits(h)

    def step(self, tokens, cache: Cache41, slot_ids, n_new) -> tuple[Cache41, jax.Array]:
        """One jitted model call (a prefill chunk or a decode step, T = 1): the program
        `nn.forward41` with the cache donated. Concrete arguments are checked first
        (`check_chunk41`); see `hidden` for the rest."""
        check_chunk41(self.config, cache, tokens, slot_ids, n_new)
        graphdef, params = nnx.split(self)
        return _forward41(graphdef, params, cache, jnp.asarray(tokens),
                          jnp.asarray(slot_ids, jnp.int32), jnp.asarray(n_new, jnp.int32))


def _forward_body(graphdef, params, cache: Cache41, tokens: jax.Array, slot_ids: jax.Array,
                  n_new: jax.Array) -> tuple[Cache41, jax.Array]:
    return nnx.merge(graphdef, params)(tokens, cache, slot_ids, n_new)


_forward41 = programs.program("nn.forward41", _forward_body, donate=("cache",),
                              static=("graphdef",))


__all__ = ["Block41", "Decoder41", "ModelConfig41", "check_chunk41"]
