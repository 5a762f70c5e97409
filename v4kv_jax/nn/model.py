"""A small decoder built from `V4Attention` layers: embedding, residual blocks, final norm, LM head.

Each block is `x + attn(RMSNorm(x))`, then `x + mlp(RMSNorm(x))` with a dense SwiGLU MLP
(`mlp_hidden=0` leaves the MLP out: an attention-only stack). DeepSeek-V4's MoE and its
hyper-connections (several residual streams mixed per block) are out of scope: this model
exists to run V4 attention and its cache end to end, not to load a whole V4 checkpoint
(its attention layers do load, see `v4kv_jax.interop.load_into`).

Layer layout (`scan_layers=True`, the default): the kinds (from `compress_ratios`) are cut
into groups of a repeated pattern, e.g. V4-Flash = [SWA] x 2, [CSA, HCA] x 20, [CSA] x 1. Each
pattern position of a group holds ONE `Block` whose params are stacked over the repeats
([repeats, ...] leaves), the layout `lax.scan` iterates over: the program holds one copy of
each pattern position, so compile time does not grow with depth.

`scan_layers=False` keeps one unstacked `Block` per layer and unrolls the layers in the
program: compile time grows with depth, but each layer reads its weights where they are. On
CPU the scan's per-iteration slices of the stacked weights are copies, an extra pass over the
weights of a decode step (memory-bound); measured on the 8-layer config S of
`benchmarks/model.py` at 4k context, three alternating runs of 20 steps (2026-12-03):
5.2, 5.3, 4.9 ms scanned, 5.0, 5.0, 4.4 ms unrolled (about 1.06x). Unrolling the scan
itself (`lax.scan(..., unroll=)` over all repeats) was measured 3x slower (14-16 ms).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from v4kv_jax import append, checks
from v4kv_jax.config import AttentionConfig, LayerKind, Options
from v4kv_jax.nn.attention import V4Attention, linear
from v4kv_jax.ops.compressor import rms_norm
from v4kv_jax.pools import Cache
from v4kv_jax.vectors import LayerRef


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Geometry of the decoder.

    Attributes:
      attn_config: the attention layers (their number and kinds come from `compress_ratios`).
      vocab_size: V.
      mlp_hidden: width of the SwiGLU MLP of each block; 0 = no MLP.
      tie_embeddings: use the embedding as the LM head.
    """

    attn_config: AttentionConfig
    vocab_size: int = 256
    mlp_hidden: int = 0
    tie_embeddings: bool = False

    def __post_init__(self):
        if not isinstance(self.attn_config, AttentionConfig):
            checks.fail("attn_config", "a v4kv_jax AttentionConfig",
                        type(self.attn_config).__name__, TypeError)
        checks.integer("vocab_size", self.vocab_size, lo=1)
        checks.integer("mlp_hidden", self.mlp_hidden, lo=0)
        if not isinstance(self.tie_embeddings, bool):
            checks.fail("tie_embeddings", "a bool", repr(self.tie_embeddings), TypeError)

    @property
    def num_layers(self) -> int:
        return self.attn_config.num_layers


@dataclasses.dataclass(frozen=True)
class LayerGroup:
    """Layers `first .. first + len(pattern) * repeats - 1`: `pattern` repeated `repeats` times."""

    first: int
    pattern: tuple[LayerKind, ...]
    repeats: int

    def layers(self, position: int) -> tuple[int, ...]:
        """Global indices of pattern position `position`, one per repeat."""
        p = len(self.pattern)
        return tuple(self.first + r * p + position for r in range(self.repeats))


def layer_groups(kinds, max_period: int = 4) -> tuple[LayerGroup, ...]:
    """Cuts a kind sequence into repeated patterns, greedily taking at each layer the period
    that repeats and covers the most layers (the shortest on ties); a layer that starts no
    repetition is a group of its own."""
    kinds = tuple(LayerKind(k) for k in kinds)
    groups, i = [], 0
    while i < len(kinds):
        best = (1, 1)  # (period, repeats)
        for p in range(1, max_period + 1):
            pattern = kinds[i:i + p]
            if len(pattern) < p:
                break
            r = 1
            while kinds[i + r * p:i + (r + 1) * p] == pattern:
                r += 1
            if r > 1 and r * p > best[0] * best[1]:
                best = (p, r)
        p, r = best
        groups.append(LayerGroup(i, kinds[i:i + p], r))
        i += p * r
    return tuple(groups)


def check_chunk(config: ModelConfig, cache: Cache, tokens, slot_ids, n_new) -> None:
    """Checks of one model call: token ids [B, T] of an integer dtype, a cache of the model's
    attention config, and (when concrete) slots, counts and token ids in [0, vocab_size).
    Raises TypeError / ValueError naming the argument, the expected and the actual value."""
    if not isinstance(cache, Cache):
        checks.fail("cache", "a v4kv_jax Cache", type(cache).__name__, TypeError)
    if cache.attn_config != config.attn_config:
        checks.fail("cache", "a cache built for the model's attention config",
                    "a cache of another AttentionConfig")
    checks.dtype_kind("tokens", tokens, "integer")
    if np.ndim(tokens) != 2 or np.shape(tokens)[1] < 1:
        checks.fail("tokens", "token ids of shape [B, T] with T >= 1",
                    f"shape {tuple(np.shape(tokens))}")
    batch = np.shape(tokens)[0]
    for name, x in (("slot_ids", slot_ids), ("n_new", n_new)):
        if np.shape(x) != (batch,):
            checks.fail(name, f"shape ({batch},) (one per row of tokens)",
                        f"shape {np.shape(x)}")
    if not checks.concrete(tokens, slot_ids, n_new):
        return
    append.check_rows(cache, slot_ids, n_new, np.shape(tokens)[1])
    ids = np.asarray(tokens)
    given = np.arange(ids.shape[1])[None, :] < np.asarray(n_new)[:, None]
    bad = given & ((ids < 0) | (ids >= config.vocab_size))
    if bad.any():
        b, t = np.argwhere(bad)[0]
        checks.fail("tokens", f"token ids in [0, {config.vocab_size}) (vocab_size)",
                    f"{int(ids[b, t])} at row {b}, position {t}")


class MLP(nnx.Module):
    """Dense SwiGLU: down_proj(silu(gate_proj x) * up_proj x); weights [out, in]."""

    def __init__(self, hidden: int, width: int, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
        def w(o, i):
            return nnx.Param((i**-0.5 * jax.random.normal(rngs.params(), (o, i))).astype(
                param_dtype))

        self.gate_proj = w(width, hidden)
        self.up_proj = w(width, hidden)
        self.down_proj = w(hidden, width)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = jax.nn.silu(linear(x, self.gate_proj[...])) * linear(x, self.up_proj[...])
        return linear(h, self.down_proj[...])


class Block(nnx.Module):
    """Pre-norm residual block: x + attn(RMSNorm(x)), then x + mlp(RMSNorm(x))."""

    def __init__(self, config: ModelConfig, kind: LayerKind, *, rngs: nnx.Rngs,
                 param_dtype=jnp.float32, bias_scale: float = 0.0):
        D = config.attn_config.hidden_size
        self.eps = config.attn_config.rms_eps
        self.attn_norm = nnx.Param(jnp.ones((D,), jnp.float32))
        self.attn = V4Attention(config.attn_config, kind, rngs=rngs, param_dtype=param_dtype,
                                bias_scale=bias_scale)
        with_mlp = config.mlp_hidden > 0
        self.mlp_norm = nnx.data(nnx.Param(jnp.ones((D,), jnp.float32)) if with_mlp else None)
        self.mlp = nnx.data(MLP(D, config.mlp_hidden, rngs=rngs, param_dtype=param_dtype)
                            if with_mlp else None)

    def __call__(self, x: jax.Array, cache: Cache, plan: append.AppendPlan, ref: LayerRef, *,
                 options: Options | None = None) -> tuple[Cache, jax.Array]:
        cache, a = self.attn(rms_norm(x, self.attn_norm[...], self.eps), cache, plan, ref,
                             options=options)
        x = x + a
        if self.mlp is not None:
            x = x + self.mlp(rms_norm(x, self.mlp_norm[...], self.eps))
        return cache, x


def _stack(modules: list[nnx.Module]) -> nnx.Module:
    """One module whose every array leaf is the stack of the modules' leaves ([n, ...])."""
    graphdef, *_ = nnx.split(modules[0])
    states = [nnx.split(m)[1] for m in modules]
    return nnx.merge(graphdef, jax.tree.map(lambda *xs: jnp.stack(xs), *states))


class Decoder(nnx.Module):
    """Embedding -> blocks (kinds from `compress_ratios`) -> final RMSNorm -> LM head.

    Args:
      config: the model geometry.
      rngs: random streams; `nnx.Rngs(seed)` gives a reproducible random init.
      param_dtype: storage dtype of the projection weights.
      bias_scale: std of the attention layers' initial `ape` and sinks (0 = zeros).
      scan_layers: scan over layer groups with stacked params (True) or unroll the layers
        with one block per layer (False); see the module docstring.
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, param_dtype=jnp.float32,
                 bias_scale: float = 0.0, scan_layers: bool = True):
        attn_config = config.attn_config
        D, V = attn_config.hidden_size, config.vocab_size
        self.config = config
        self.scan_layers = scan_layers
        if scan_layers:
            self.layout = layer_groups(attn_config.layer_kinds)
        else:
            self.layout = tuple(LayerGroup(i, (k,), 1)
                                for i, k in enumerate(attn_config.layer_kinds))
        self.embed = nnx.Param(jax.random.normal(rngs.params(), (V, D)).astype(param_dtype))

        def blocks(kind, n):
            made = [Block(config, kind, rngs=rngs, param_dtype=param_dtype,
                          bias_scale=bias_scale) for _ in range(n)]
            return _stack(made) if scan_layers else made[0]

        self.groups = nnx.List([
            nnx.List([blocks(kind, group.repeats) for kind in group.pattern])
            for group in self.layout])
        self.norm = nnx.Param(jnp.ones((D,), jnp.float32))
        self.lm_head = nnx.data(None if config.tie_embeddings else nnx.Param(
            (D**-0.5 * jax.random.normal(rngs.params(), (V, D))).astype(param_dtype)))

    # --- the served model's attributes (`v4kv_jax.serve.protocol.ServedModel`) ----------------

    @property
    def attn_config(self) -> AttentionConfig:
        """The attention config of the model's cache."""
        return self.config.attn_config

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    # --- forward ---------------------------------------------------------------------------

    def layers(self, x: jax.Array, cache: Cache, plan: append.AppendPlan, *,
               options: Options | None = None) -> tuple[Cache, jax.Array]:
        """Runs every block over x [B, T, D] (the residual stream), appending to the cache.

        One `lax.scan` per layer group (the cache and the residual stream are its carry), or
        one layer after the other with `scan_layers=False`.
        """
        attn_config = self.config.attn_config
        if not self.scan_layers:
            for group, (block,) in zip(self.layout, self.groups, strict=True):
                ref = LayerRef(jnp.int32(group.first),
                               jnp.int32(attn_config.kind_index(group.first)), group.pattern[0])
                cache, x = block(x, cache, plan, ref, options=options)
            return cache, x
        for group, blocks in zip(self.layout, self.groups, strict=True):
            split = [nnx.split(b) for b in blocks]
            refs = [(np.asarray(group.layers(j), np.int32),
                     np.asarray([attn_config.kind_index(i) for i in group.layers(j)], np.int32))
                    for j in range(len(group.pattern))]

            def body(carry, xs, group=group, split=split):
                cache, h = carry
                for j, kind in enumerate(group.pattern):
                    state, (layer, kind_layer) = xs[j]
                    block = nnx.merge(split[j][0], state)
                    cache, h = block(h, cache, plan, LayerRef(layer, kind_layer, kind),
                                     options=options)
                return (cache, h), None

            xs = [(state, ref) for (_, state), ref in zip(split, refs, strict=True)]
            (cache, x), _ = jax.lax.scan(body, (cache, x), xs)
        return cache, x

    def _checked_chunk(self, tokens: jax.Array, cache: Cache, slot_ids: jax.Array,
                       n_new: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Checks a chunk's arguments (eagerly: raises naming them); returns n_new as i32[B]
        and bool[B]: the rows holding a token id outside the vocabulary among their n_new
        tokens (inside jit the caller makes those rows change nothing)."""
        check_chunk(self.config, cache, tokens, slot_ids, n_new)
        n_new = jnp.asarray(n_new, jnp.int32)
        given = jnp.arange(tokens.shape[1])[None, :] < n_new[:, None]
        V = self.config.vocab_size
        return n_new, jnp.any(given & ((tokens < 0) | (tokens >= V)), axis=1)

    def hidden(self, tokens: jax.Array, cache: Cache, slot_ids: jax.Array, n_new: jax.Array,
               *, options: Options | None = None) -> tuple[Cache, jax.Array]:
        """Appends a chunk of tokens and returns the final-normed hidden states.

        Args:
          tokens: i32[B, T]; row b's first n_new[b] tokens are appended to slot slot_ids[b],
            the rest are padding.
          cache: the cache.
          slot_ids: i32[B] distinct active slots.
          n_new: i32[B] in [0, T].
          options: how the ops run (`v4kv_jax.Options`; default: "auto").

        Returns:
          (cache, f32[B, T, D]); a slot that could not get its pages appends nothing and is
          flagged in its status (see `v4kv_jax.pools.SlotStatus`).
        """
        # Inside jit, a row holding a token id outside the vocabulary is rejected (nothing
        # appended, slot flagged REJECTED) instead of reading a clamped embedding row.
        n_new, outside = self._checked_chunk(tokens, cache, slot_ids, n_new)
        cache, plan = append.begin_append(cache, slot_ids, n_new, tokens.shape[1], reject=outside)
        x = self.embed[...][tokens].astype(jnp.float32)
        cache, x = self.layers(x, cache, plan, options=options)
        cache = append.end_append(cache, plan)
        return cache, rms_norm(x, self.norm[...], self.config.attn_config.rms_eps)

    def replay(self, tokens: jax.Array, cache: Cache, slot_ids: jax.Array, start: jax.Array,
               n_new: jax.Array, *, options: Options | None = None) -> Cache:
        """Rebuilds the State (window rings, compressor tails) of tokens the slots already
        hold, e.g. after `v4kv_jax.pools.attach_prefix`: runs the blocks over the tokens of
        positions [start, start + n_new) with a state-only plan (`append.replay_plan`), which
        writes no entry and changes no length, while attention reads the entries in the
        slots' (shared) pages.

        Whatever State the slots held before, replaying the last n_layers * (W - 1) + 1
        tokens (or more) before a boundary leaves the State a full run leaves there: layer
        l's input is exact from l * (W - 1) tokens past `start` on (its window reads nothing
        older), so the last layer's W window rows and every tail ring are.

        Args:
          tokens: i32[B, T]; row b's first n_new[b] tokens are positions start[b] ... of
            slot slot_ids[b], the rest padding.
          cache: the cache.
          slot_ids: i32[B] distinct ACTIVE slots (-1: a padding row, n_new 0).
          start: i32[B] first replayed position per row.
          n_new: i32[B] in [0, T], with start + n_new <= the slot's length.
          options: how the ops run.

        Returns:
          The cache. Called with concrete arguments, a broken row raises ValueError; inside
          jit it (and a row holding a token id outside the vocabulary) changes nothing.
        """
        n_new, outside = self._checked_chunk(tokens, cache, slot_ids, n_new)
        plan = append.replay_plan(cache, slot_ids, start, jnp.where(outside, 0, n_new),
                                  tokens.shape[1])
        x = self.embed[...][tokens].astype(jnp.float32)
        cache, _ = self.layers(x, cache, plan, options=options)
        return cache

    def logits(self, h: jax.Array) -> jax.Array:
        """f32[..., V] from final hidden states [..., D]."""
        head = self.embed if self.lm_head is None else self.lm_head
        return linear(h, head[...])

    def __call__(self, tokens: jax.Array, cache: Cache, slot_ids: jax.Array, n_new: jax.Array,
                 *, options: Options | None = None) -> tuple[Cache, jax.Array]:
        """(cache, logits f32[B, T, V]) for a chunk; see `hidden`."""
        cache, h = self.hidden(tokens, cache, slot_ids, n_new, options=options)
        return cache, self.logits(h)

    # --- layout ----------------------------------------------------------------------------

    def block_of(self, layer: int) -> tuple[Block, int | None]:
        """The block holding layer `layer` and the layer's index in that block's stacked params
        (None when the layers are unrolled: the block is the layer's own).

        Raises:
          ValueError: `layer` is not in [0, num_layers).
        """
        for group, blocks in zip(self.layout, self.groups, strict=True):
            for j in range(len(group.pattern)):
                if layer in group.layers(j):
                    return blocks[j], (group.layers(j).index(layer) if self.scan_layers
                                       else None)
        raise ValueError(f"layer={layer} must be in [0, {self.config.num_layers})")
