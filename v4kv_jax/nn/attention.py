"""`V4Attention`: one DeepSeek-V4 attention layer as a Flax NNX module (SPEC section 2).

The module owns the layer's weights and computes the per-token vectors the cache takes; the
cache (`v4kv_jax.step`) owns the window ring, the compressor tails, the pooled entries and the
attention itself. The table below names and shapes the weights as the checkpoints do
([out, in]); how they are stored follows it.

Parameters by layer kind (D hidden, q query rank, H heads of hd, g groups of rank R,
m the layer's ratio, coff 2 for CSA and 1 for HCA, nI indexer heads of c):

  every kind     q_a_proj [q, D]   q_a_norm [q]   q_b_proj [H hd, q]
                 kv_proj [hd, D]   kv_norm [hd]   sinks [H]
                 o_a_proj [g R, H hd / g]   o_b_proj [D, g R]
  CSA and HCA    compressor.{kv_proj, gate_proj} [coff hd, D]
                 compressor.ape [m, coff hd]   compressor.norm [hd]
  CSA            indexer.q_b_proj [nI c, q]   indexer.weights_proj [nI, D]
                 indexer.compressor.{kv_proj, gate_proj} [2 c, D]
                 indexer.compressor.ape [m, 2 c]   indexer.compressor.norm [c]

Storage. The projections are stored transposed, [in, out] (a decode step multiplies a few
rows by each weight, and XLA:CPU reads an [in, out] weight 1.5x faster than an [out, in]
one), and those that read the same input are fused into one weight, so a layer runs one
matmul per input instead of up to seven (a decode step is a sequence of small products whose
count, not their bytes, sets its time; `benchmarks/model.py`):

  x_proj      [D, sum]          the columns of q_a_proj, kv_proj, compressor.kv_proj,
                                compressor.gate_proj, indexer.weights_proj,
                                indexer.compressor.kv_proj, indexer.compressor.gate_proj
                                (those the kind has, in this order)
  qr_proj     [q, sum]          the columns of q_b_proj, then indexer.q_b_proj (CSA)
  out_a_proj  [g, H hd / g, R]  o_a_proj, group j's block transposed
  out_b_proj  [g R, D]          o_b_proj transposed

Each projection of the table above stays addressable in the checkpoint layout [out, in]:
`layer.weight(path)` gives a `Projection` view that reads and writes like an `nnx.Param`
(`view[...]`, `view[...] = w`; stacked layers keep their leading axis); `q_a_proj`,
`q_b_proj`, `kv_proj`, `o_a_proj` and `o_b_proj` are properties returning it.
`v4kv_jax.interop` maps the names to and from transformers 5.23.0 and the official
checkpoint through these views.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from v4kv_jax import append, checks, rope, step
from v4kv_jax.config import AttentionConfig, LayerKind, Options
from v4kv_jax.ops.attention import output_projection
from v4kv_jax.ops.compressor import rms_norm
from v4kv_jax.pools import Cache
from v4kv_jax.vectors import (
    CompressorInput,
    CompressorParams,
    LayerParams,
    LayerRef,
    LayerVectors,
    Queries,
)


def _normal(rngs: nnx.Rngs, shape: tuple[int, ...], std: float, dtype) -> nnx.Param:
    return nnx.Param((std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype))


def _projection(rngs: nnx.Rngs, out_dim: int, in_dim: int, dtype) -> nnx.Param:
    """A weight [out, in] with entries N(0, 1 / in)."""
    return _normal(rngs, (out_dim, in_dim), in_dim**-0.5, dtype)


def _matmul(x: jax.Array, weight: jax.Array, precision=None) -> jax.Array:
    """x [..., in] @ weight[in, out] in fp32: [..., out]."""
    return jnp.einsum("...i,io->...o", x.astype(jnp.float32), weight.astype(jnp.float32),
                      precision=precision)


def linear(x: jax.Array, weight: jax.Array, precision=None) -> jax.Array:
    """x [..., in] @ weight[out, in].T in fp32: [..., out]."""
    return jnp.einsum("...i,oi->...o", x.astype(jnp.float32), weight.astype(jnp.float32),
                      precision=precision)


class Compressor(nnx.Module):
    """The pooling params of one compressor (SPEC section 3); its two projections (W_kv_c and
    W_gate_c, [coff * width, D] each) are columns of the layer's `x_proj` (transposed).

    Attributes:
      ape: [ratio, coff * width], the position bias added to the gate by t mod ratio.
      norm: [width], the weight of the entry RMSNorm.
    """

    def __init__(self, ratio: int, width: int, overlap: bool, *, rngs: nnx.Rngs,
                 bias_scale: float = 0.0):
        coff = 2 if overlap else 1
        self.ape = _normal(rngs, (ratio, coff * width), bias_scale, jnp.float32)
        self.norm = nnx.Param(jnp.ones((width,), jnp.float32))

    @property
    def params(self) -> CompressorParams:
        return CompressorParams(ape=self.ape[...], norm=self.norm[...])


class Indexer(nnx.Module):
    """The lightning indexer of a CSA layer (SPEC section 5): its own overlapping compressor
    of width c (the indexer's query and head-weight projections are columns of the layer's
    `qr_proj` and `x_proj`)."""

    def __init__(self, config: AttentionConfig, *, rngs: nnx.Rngs, bias_scale: float = 0.0):
        self.compressor = Compressor(config.csa_ratio, config.index_head_dim, True, rngs=rngs,
                                     bias_scale=bias_scale)


class Projection:
    """A projection [..., out, in] (the checkpoints' layout) held in a stored weight of the
    module, read and written like an `nnx.Param`: `view[...]` is the projection, `view[...]
    = w` replaces it (the rest of the stored weight is kept).

    The stored weight is [..., in, n] holding the projection as its columns [start, stop),
    or, `grouped`, [..., g, in / g, R] holding a grouped projection [g R, in / g] (group j's
    rows j R .. (j + 1) R - 1 as block j, transposed)."""

    def __init__(self, param: nnx.Param, start: int = 0, stop: int | None = None, *,
                 grouped: bool = False):
        self.param, self.start, self.stop, self.grouped = param, start, stop, grouped

    @staticmethod
    def _whole(index) -> None:
        if index is not Ellipsis:
            checks.fail("index", "... (a projection is read and written whole)", repr(index),
                        TypeError)

    def _named(self, stored: jax.Array) -> jax.Array:
        if self.grouped:
            *lead, g, i, r = stored.shape
            return jnp.swapaxes(stored, -1, -2).reshape(*lead, g * r, i)
        return jnp.swapaxes(stored[..., self.start:self.stop], -1, -2)

    def __getitem__(self, index) -> jax.Array:
        self._whole(index)
        return self._named(self.param[...])

    def __setitem__(self, index, value) -> None:
        self._whole(index)
        stored = self.param[...]
        want = self._named(stored).shape
        value = jnp.asarray(value, stored.dtype)
        if value.shape != want:
            checks.fail("value", f"an array of shape {want}", f"shape {value.shape}")
        if self.grouped:
            *lead, g, i, r = stored.shape
            self.param[...] = jnp.swapaxes(value.reshape(*lead, g, r, i), -1, -2)
        else:
            self.param[...] = stored.at[..., self.start:self.stop].set(
                jnp.swapaxes(value, -1, -2))


def fused_columns(config: AttentionConfig, kind: LayerKind) -> dict[str, tuple[str, int, int]]:
    """{projection path: (stored weight, first column, columns)} of the projections a layer
    of `kind` keeps in its fused weights `x_proj` and `qr_proj`, in their order (see the
    module docstring)."""
    kind = LayerKind(kind)
    x_cols = [("q_a_proj", config.q_lora_rank), ("kv_proj", config.head_dim)]
    q_cols = [("q_b_proj", config.num_heads * config.head_dim)]
    if kind != LayerKind.SWA:
        width = (2 if kind == LayerKind.CSA else 1) * config.head_dim
        x_cols += [("compressor.kv_proj", width), ("compressor.gate_proj", width)]
    if kind == LayerKind.CSA:
        c = config.index_head_dim
        x_cols += [("indexer.weights_proj", config.index_heads),
                   ("indexer.compressor.kv_proj", 2 * c),
                   ("indexer.compressor.gate_proj", 2 * c)]
        q_cols += [("indexer.q_b_proj", config.index_heads * c)]
    out = {}
    for stored, cols in (("x_proj", x_cols), ("qr_proj", q_cols)):
        start = 0
        for path, n in cols:
            out[path] = (stored, start, n)
            start += n
    return out


_STORED = ("x_proj", "qr_proj", "out_a_proj", "out_b_proj")


class V4Attention(nnx.Module):
    """One attention layer of kind SWA, CSA or HCA, reading and appending to the cache.

    Args:
      config: the attention geometry (shared by every layer of the model).
      kind: this layer's kind.
      rngs: random streams for the initial weights (projections N(0, 1/fan_in), norms 1).
      param_dtype: storage dtype of the projection weights (norms, ape and sinks stay fp32).
      bias_scale: std of the initial `ape` and `sinks` (0 = zeros, as transformers does).
      precision: matmul precision of the projections (None = backend default).
    """

    def __init__(self, config: AttentionConfig, kind: LayerKind, *, rngs: nnx.Rngs,
                 param_dtype=jnp.float32, bias_scale: float = 0.0, precision=None):
        D, H, hd = config.hidden_size, config.num_heads, config.head_dim
        g, R = config.o_groups, config.o_lora_rank
        self.config = config
        self.kind = LayerKind(kind)
        self.precision = precision
        # Drawn in the order of the unfused layer's params, so a seed gives the same weights.
        drawn = {"q_a_proj": _projection(rngs, config.q_lora_rank, D, param_dtype)}
        self.q_a_norm = nnx.Param(jnp.ones((config.q_lora_rank,), jnp.float32))
        drawn["q_b_proj"] = _projection(rngs, H * hd, config.q_lora_rank, param_dtype)
        drawn["kv_proj"] = _projection(rngs, hd, D, param_dtype)
        self.kv_norm = nnx.Param(jnp.ones((hd,), jnp.float32))
        drawn["o_a_proj"] = _projection(rngs, g * R, H * hd // g, param_dtype)
        drawn["o_b_proj"] = _projection(rngs, D, g * R, param_dtype)
        self.sinks = _normal(rngs, (H,), bias_scale, jnp.float32)
        compressor = indexer = None
        if self.kind != LayerKind.SWA:
            width = (2 if self.kind == LayerKind.CSA else 1) * hd
            drawn["compressor.kv_proj"] = _projection(rngs, width, D, param_dtype)
            drawn["compressor.gate_proj"] = _projection(rngs, width, D, param_dtype)
            compressor = Compressor(config.ratio(self.kind), hd, self.kind == LayerKind.CSA,
                                    rngs=rngs, bias_scale=bias_scale)
        if self.kind == LayerKind.CSA:
            c, n = config.index_head_dim, config.index_heads
            drawn["indexer.q_b_proj"] = _projection(rngs, n * c, config.q_lora_rank, param_dtype)
            drawn["indexer.weights_proj"] = _projection(rngs, n, D, param_dtype)
            drawn["indexer.compressor.kv_proj"] = _projection(rngs, 2 * c, D, param_dtype)
            drawn["indexer.compressor.gate_proj"] = _projection(rngs, 2 * c, D, param_dtype)
            indexer = Indexer(config, rngs=rngs, bias_scale=bias_scale)
        self.compressor = nnx.data(compressor)
        self.indexer = nnx.data(indexer)
        columns = fused_columns(config, self.kind)
        for stored in ("x_proj", "qr_proj"):
            parts = [drawn[path][...].T for path, (name, _, _) in columns.items()
                     if name == stored]
            setattr(self, stored, nnx.Param(jnp.concatenate(parts, axis=1)))
        o_a = drawn["o_a_proj"][...]
        self.out_a_proj = nnx.Param(o_a.reshape(g, R, -1).swapaxes(1, 2))
        self.out_b_proj = nnx.Param(drawn["o_b_proj"][...].T)

    def weight(self, path: str):
        """The param at `path` (a name of the module docstring's table, e.g. "q_a_proj",
        "compressor.ape", "indexer.compressor.kv_proj"): an `nnx.Param`, or the `Projection`
        view of a projection (checkpoint layout [out, in]) kept in a stored weight."""
        if not isinstance(path, str):
            checks.fail("path", "a dot-separated param path (str)", path, TypeError)
        columns = fused_columns(self.config, self.kind)
        if path in columns:
            stored, start, n = columns[path]
            return Projection(getattr(self, stored), start, start + n)
        if path == "o_a_proj":
            return Projection(self.out_a_proj, grouped=True)
        if path == "o_b_proj":
            return Projection(self.out_b_proj)
        obj, parts = self, path.split(".")
        for i, part in enumerate(parts):
            if not hasattr(obj, part) or (i == 0 and part in _STORED):
                checks.fail("path", f"a param path of the V4Attention (it has no "
                            f"{'.'.join(parts[:i + 1])!r})", repr(path))
            obj = getattr(obj, part)
        if not isinstance(obj, nnx.Param):
            checks.fail("path", "a param path of the V4Attention", repr(path))
        return obj

    # The checkpoint-layout projections most used by name, as views (`weight`).
    q_a_proj = property(lambda self: self.weight("q_a_proj"))
    q_b_proj = property(lambda self: self.weight("q_b_proj"))
    kv_proj = property(lambda self: self.weight("kv_proj"))
    o_a_proj = property(lambda self: self.weight("o_a_proj"))
    o_b_proj = property(lambda self: self.weight("o_b_proj"))

    def output(self, o: jax.Array) -> jax.Array:
        """The grouped output projection (SPEC section 6) of the attention output o
        [..., H, hd]: f32 [..., D] (`v4kv_jax.output_projection` with the stored layout)."""
        return output_projection(o, self.out_a_proj[...], self.out_b_proj[...],
                                 self.config.o_groups, self.precision, layout="in_out")

    def _check_input(self, x: jax.Array) -> None:
        if x.ndim != 3 or x.shape[-1] != self.config.hidden_size:
            raise ValueError(f"x has shape {tuple(x.shape)}; expected [B, T, "
                             f"hidden_size={self.config.hidden_size}]")

    def vectors(self, x: jax.Array, positions: jax.Array
                ) -> tuple[LayerVectors, Queries, LayerParams]:
        """The per-token vectors of SPEC section 2 for x [B, T, D] at positions i32[B, T]."""
        config, p = self.config, self.precision
        self._check_input(x)
        if positions.shape != x.shape[:2]:
            raise ValueError(f"positions has shape {tuple(positions.shape)}; expected "
                             f"{tuple(x.shape[:2])}")
        B, T, _ = x.shape
        inv_freq = rope.inv_frequencies(config, self.kind)
        eps = config.rms_eps
        columns = fused_columns(config, self.kind)

        def part(y, path):
            _, start, n = columns[path]
            return y[..., start:start + n]

        xw = _matmul(x, self.x_proj[...], p)
        q_residual = rms_norm(part(xw, "q_a_proj"), self.q_a_norm[...], eps)
        qw = _matmul(q_residual, self.qr_proj[...], p)
        q = part(qw, "q_b_proj").reshape(B, T, config.num_heads, config.head_dim)
        q = rope.rotate(rms_norm(q, None, eps), positions[..., None], inv_freq)
        kv = rms_norm(part(xw, "kv_proj"), self.kv_norm[...], eps)
        kv = rope.rotate(kv, positions, inv_freq)
        queries = Queries(q=q, sink=self.sinks[...])
        vectors = LayerVectors(window=kv)
        params = LayerParams()
        if self.compressor is not None:
            vectors = vectors.replace(compressor=CompressorInput(
                kv=part(xw, "compressor.kv_proj"), gate=part(xw, "compressor.gate_proj")))
            params = params.replace(compressor=self.compressor.params)
        if self.indexer is not None:
            index_q = part(qw, "indexer.q_b_proj").reshape(
                B, T, config.index_heads, config.index_head_dim)
            queries = queries.replace(
                index_q=rope.rotate(index_q, positions[..., None], inv_freq),
                index_weights=part(xw, "indexer.weights_proj"))
            vectors = vectors.replace(index_compressor=CompressorInput(
                kv=part(xw, "indexer.compressor.kv_proj"),
                gate=part(xw, "indexer.compressor.gate_proj")))
            params = params.replace(index_compressor=self.indexer.compressor.params)
        return vectors, queries, params

    def __call__(self, x: jax.Array, cache: Cache, plan: append.AppendPlan, ref: LayerRef, *,
                 options: Options | None = None) -> tuple[Cache, jax.Array]:
        """Appends the chunk x [B, T, D] to this layer's cache and attends.

        Args:
          x: hidden states (already normed by the caller) of the chunk's tokens; rows past a
            slot's `plan.n_new` are padding.
          cache: the cache after `append.begin_append`.
          plan: from `append.begin_append` (positions come from it).
          ref: this layer in the cache (`LayerRef`, indices may be traced).
          options: how the ops run (`v4kv_jax.Options`; default: "auto").

        Returns:
          (cache, f32[B, T, D]) the layer output (no residual).
        """
        if ref.kind != self.kind:
            raise ValueError(f"ref.kind={ref.kind.name} does not match the module's kind "
                             f"{self.kind.name}")
        vectors, queries, params = self.vectors(x, plan.positions(x.shape[1]))
        cache, o = step.layer_step(cache, plan, ref, vectors, queries, params, options=options)
        return cache, self.output(o)

    def step(self, x: jax.Array, cache: Cache, *, slot_ids, n_new, layer: int,
             options: Options | None = None) -> tuple[Cache, jax.Array]:
        """Runs this layer on its own over a chunk: `append.begin_append`, the layer (append to
        layer `layer` of the cache and attend), `append.end_append`.

        The cache may be one of a whole model: `layer` (static) picks the window ring and the
        compressed-entry stacks this module reads and writes, and must be of the module's
        kind. A slot's length is shared by every layer of the cache and this call advances
        it, so the cache's other layers hold nothing for these tokens: a slot run through one
        layer alone serves that layer only. To run several layers over the same tokens, use
        a `Decoder`, or call `begin_append`, each layer's `__call__` and `end_append`.

        Args:
          x: f32[B, T, D], the layer's input (already normed) for the chunk's tokens; row b's
            first n_new[b] tokens are appended to slot slot_ids[b], the rest are padding.
          cache: a cache built for this module's attention config.
          slot_ids: i32[B], distinct active slots (-1: a padding row that appends nothing).
          n_new: i32[B] in [0, T].
          layer: the layer's index in the cache's config.
          options: how the ops run.

        Returns:
          (cache, f32[B, T, D]) the layer output (no residual; rows past n_new are padding).
          Inside jit a slot that could not append is flagged in its slot status, as with
          `append.begin_append`.
        """
        if not isinstance(cache, Cache):
            checks.fail("cache", "a v4kv_jax Cache", type(cache).__name__, TypeError)
        if cache.attn_config != self.config:
            checks.fail("cache", "a cache built for the module's attention config",
                        "a cache of another AttentionConfig")
        ref = LayerRef.of(cache, layer)
        if ref.kind != self.kind:
            same = [i for i, k in enumerate(cache.attn_config.layer_kinds) if k == self.kind]
            checks.fail("layer", f"a {self.kind.name} layer like the module (the cache's "
                        f"{self.kind.name} layers: {same})", f"{layer}, a {ref.kind.name} layer")
        self._check_input(x)
        for name, value in (("slot_ids", slot_ids), ("n_new", n_new)):
            if np.shape(value) != x.shape[:1]:
                checks.fail(name, f"shape ({x.shape[0]},) (one per row of x)",
                            f"shape {np.shape(value)}")
        cache, plan = append.begin_append(cache, slot_ids, n_new, x.shape[1])
        cache, y = self(x, cache, plan, ref, options=options)
        return append.end_append(cache, plan), y
