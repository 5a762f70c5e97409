"""Programs of one op each, built from a (model, geometry) as the step builds them, to compile
every Pallas kernel for a target over a sweep of configs (tests/tpu_compile_checks.py,
benchmarks/tpu_compile.py).

`op_program(op, model, geometry, batch, tokens, options)` is (a `programs.Program`, abstract
arguments): the op as the decode step or a prefill chunk calls it (`ops.emit_entries` for
each compressor, `ops.emit_entries_online`, `ops.index_scores`, `ops.sparse_decode_attention`,
`ops.dense_decode_attention`), on arrays of the cache's shapes and storage formats. `compile_op`
compiles it for a device and returns None or the compiler's error; `sweep` runs a product of
configs and sets each against the kernel's `supported()`.
"""

from __future__ import annotations

import dataclasses
import itertools
import time

import jax
import jax.numpy as jnp

from v4kv_jax import append, ops, plan, pools, programs, step41, targets
from v4kv_jax import config as cfg
from v4kv_jax import config41 as cfg41
from v4kv_jax.pools import storage
from v4kv_jax.pools.layout import compressor_specs
from v4kv_jax.vectors import CompressorInput, CompressorWeights, Queries, TokenVectors

# Model widths the sweep covers: the tests' config, the notebook's, the two releases.
WIDTHS = {
    "tiny": cfg.tiny,
    "notebook": lambda: cfg.flash(hidden_size=128, num_heads=4, head_dim=64, rope_dim=16,
                                  q_lora_rank=64, o_groups=2, o_lora_rank=32, index_heads=8,
                                  index_head_dim=32, index_topk=64),
    "flash": cfg.flash,
    "pro": cfg.pro,
}
# Storage: the named format sets (`CacheConfig.with_formats`); "release" needs widths the
# packed formats fit (not the tests' tiny config).
FORMATS = ("float32", "bfloat16", "release")
# op -> the compressor it emits for ("csa", "csa_index", "hca"), or None for a read op.
OP_CASES = {
    "emit_entries:csa": ("emit_entries", "csa"),
    "emit_entries:csa_index": ("emit_entries", "csa_index"),
    "emit_entries:hca": ("emit_entries", "hca"),
    "emit_entries_online:hca": ("emit_entries_online", "hca"),
    "index_scores": ("index_scores", None),
    "sparse_decode_attention": ("sparse_decode_attention", None),
    "dense_decode_attention": ("dense_decode_attention", None),
}


def geometry_for(formats: str, page_tokens: int, batch: int, context: int = 4096
                 ) -> cfg.CacheConfig:
    """`batch` slots of up to `context` tokens in pages of `page_tokens`."""
    pages = -(-context // page_tokens)
    return cfg.CacheConfig.with_formats(formats, num_pages=batch * pages + 1, max_slots=batch,
                                        max_pages_per_seq=pages, page_tokens=page_tokens)


def applies(case: str, geometry: cfg.CacheConfig) -> bool:
    """Whether the geometry runs this op case (the HCA tail is a ring or online)."""
    op, name = OP_CASES[case]
    if name != "hca":
        return True
    online = geometry.hca_tail == "online"
    return online == (op == "emit_entries_online")


def _sds(shape, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype))


def step_arguments(model: cfg.AttentionConfig, geometry: cfg.CacheConfig, batch: int,
                   tokens: int):
    """Abstract (cache, vectors, weights, slot_ids, n_new) of a chunk of `tokens` tokens of
    `batch` rows, as `step.prefill` / `step.append_and_attend` take them."""
    cache = jax.eval_shape(lambda: pools.init_cache(model, geometry))
    weights = jax.eval_shape(lambda: CompressorWeights.init(model, None))
    inputs = {}
    for spec in compressor_specs(model):
        n = len(model.layers_of(spec.kind))
        x = _sds((n, batch, tokens, spec.in_width))
        inputs[spec.name] = CompressorInput(x, x)
    vectors = TokenVectors(window=_sds((model.num_layers, batch, tokens, model.head_dim)),
                           **inputs)
    return cache, vectors, weights, _sds((batch,), jnp.int32), _sds((batch,), jnp.int32)


def step_queries(model: cfg.AttentionConfig, batch: int, tokens: int) -> Queries:
    """Abstract `Queries` of every layer for a chunk, stacked as `step.append_and_attend`
    takes them."""
    L = model.num_layers
    return Queries(q=_sds((L, batch, tokens, model.num_heads, model.head_dim)),
                   sink=_sds((L, model.num_heads)),
                   index_q=_sds((model.num_csa, batch, tokens, model.index_heads,
                                 model.index_head_dim)),
                   index_weights=_sds((model.num_csa, batch, tokens, model.index_heads)))


def op_program(case: str, model: cfg.AttentionConfig, geometry: cfg.CacheConfig, batch: int,
               tokens: int, options: cfg.Options):
    """(a `programs.Program`, abstract arguments) of one op case (a key of `OP_CASES`): an
    emission over a chunk of `tokens` tokens, or a read of one query per row."""
    op, name = OP_CASES[case]
    cache, vectors, weights, slot_ids, n_new = step_arguments(model, geometry, batch, tokens)
    if name is not None:
        spec = next(s for s in compressor_specs(model) if s.name == name)

        def emit(cache, vectors, weights, slot_ids, n_new):
            cache, plan = append.begin_append(cache, slot_ids, n_new, tokens)
            layers = jnp.arange(len(model.layers_of(spec.kind)), dtype=jnp.int32)
            return append.append_compressor(cache, plan, spec, layers, getattr(vectors, name),
                                            getattr(weights, name), options)

        return (programs.program(f"sweep.{case}", emit, donate=("cache",), register=False),
                (cache, vectors, weights, slot_ids, n_new))

    def positions(cache, slot_ids):
        q_pos = pools.lengths(cache)[slot_ids]
        return q_pos, q_pos + 1, pools.page_rows(cache, slot_ids)

    H, hd = model.num_heads, model.head_dim
    if op == "index_scores":
        def read(cache, slot_ids, index_q, index_weights):
            q_pos, kv_end, rows = positions(cache, slot_ids)
            return ops.index_scores(model, geometry, options,
                                    index_keys=pools.csa_entries(cache).index_keys, layer=0,
                                    page_rows=rows, index_q=index_q,
                                    index_weights=index_weights, q_pos=q_pos, kv_end=kv_end)

        return programs.program(f"sweep.{case}", read, register=False), (cache, slot_ids,
                               _sds((batch, model.index_heads, model.index_head_dim)),
                               _sds((batch, model.index_heads)))
    kind = cfg.LayerKind.CSA if op == "sparse_decode_attention" else cfg.LayerKind.HCA
    layer = model.layers_of(kind)[0]

    def read(cache, slot_ids, q, sink, picks=None):
        q_pos, kv_end, rows = positions(cache, slot_ids)
        common = dict(q=q, sink=sink, window=pools.window_ring(cache), window_layer=layer,
                      slot_ids=slot_ids, q_pos=q_pos, kv_end=kv_end, page_rows=rows)
        if kind == cfg.LayerKind.CSA:
            return ops.sparse_decode_attention(model, geometry, options,
                                               c4=pools.csa_entries(cache).c4, c4_layer=0,
                                               picks=picks, **common)
        return ops.dense_decode_attention(model, geometry, options,
                                          c128=pools.hca_entries(cache).c128, c128_layer=0,
                                          **common)

    args = (cache, slot_ids, _sds((batch, H, hd)), _sds((H,)))
    if kind == cfg.LayerKind.CSA:
        args += (_sds((batch, model.index_topk), jnp.int32),)
    return programs.program(f"sweep.{case}", read, register=False), args


# The programs that take the cache (`cache_program`).
CACHE_PROGRAMS = ("decode", "chunk", "replay", "engine", "generator")


def flash_layers() -> cfg.AttentionConfig:
    """V4-Flash's widths (64 heads of 512, its indexer), one layer of each kind."""
    return cfg.flash(hidden_size=256, q_lora_rank=64, o_lora_rank=16,
                     compress_ratios=(0, 4, 128))


def flash41_layers() -> cfg41.V41Config:
    """V4.1-Flash's widths (64 heads of 512, its indexer, candidate blocks), T1's six layers:
    SWA, a ratio-2 kv source and a Reuse layer, a ratio-1 kv source that is the candidate
    source, a Reuse layer and a Reindex layer with candidates."""
    return cfg41.flash41(hidden_size=256, q_lora_rank=64, o_lora_rank=16,
                         compress_ratios=(0, 2, 2, 1, 1, 1), kv_source_layers=(1, 3),
                         index_source_layers=(1, 3, 5), candidate_source_layer=3)


def step41_arguments(config: cfg41.V41Config, geometry: cfg.CacheConfig, batch: int,
                     tokens: int) -> tuple:
    """Abstract arguments of `step41.prefill41`'s program: (cache, vectors, weights, slot_ids,
    n_new), each layer's vectors and weights as its plan needs them."""
    cache = jax.eval_shape(lambda: pools.init_cache41(config, geometry))
    B, T, H, hd = batch, tokens, config.num_heads, config.head_dim
    nI, c = config.index_heads, config.index_head_dim
    vectors, weights = [], []
    for p in plan.of(config):
        own, pair = p.writes_entries, p.writes_entries and p.ratio == 2
        vectors.append(step41.LayerVectors41(
            q=_sds((B, T, H, hd)), win=_sds((B, T, hd)), a=_sds((B, T, hd)) if own else None,
            z=_sds((B, T, hd)) if pair else None,
            q_index=_sds((B, T, nI, c)) if p.scores else None,
            w_index=_sds((B, T, nI)) if p.scores else None))
        weights.append(step41.LayerWeights41(
            sink=_sds((H,)), norm_c=_sds((hd,)) if own else None,
            wk=_sds((c, hd)) if own else None, k_norm=_sds((c,)) if own else None))
    rows = _sds((B,), jnp.int32)
    return cache, tuple(vectors), tuple(weights), rows, rows


def cache_program(name: str, model: cfg.AttentionConfig, geometry: cfg.CacheConfig,
                  tokens: int, device, rows: int = 4):
    """(compiled for `device`, its cache argument) of one program that takes the cache, as
    the library calls it ("auto"): "decode" (`step.append_and_attend`, one token a row),
    "chunk" (the same, `tokens` a row), "replay" (`step.replay`), "engine" (an `Engine`'s
    step, `prefill_chunk=tokens`) or "generator" (a `Generator`'s program, prompts and
    chunks of `tokens`); the step programs over `rows` rows, the Engine's and Generator's
    over `geometry.max_slots`. The Engine's and Generator's calls are recorded, not run
    (`programs.capture(stop_at=...)`), with a small decoder of `model`'s attention."""
    if name not in CACHE_PROGRAMS:
        raise ValueError(f"name: expected one of {CACHE_PROGRAMS}; got {name!r}")
    if name in ("decode", "chunk", "replay"):
        cache, vectors, weights, slot_ids, n_new = step_arguments(
            model, geometry, rows, 1 if name == "decode" else tokens)
        if name == "replay":
            program, args = programs.PROGRAMS["step.replay"], (
                cache, vectors, weights, slot_ids, slot_ids, n_new)
        else:
            queries = step_queries(model, rows, 1 if name == "decode" else tokens)
            program, args = programs.PROGRAMS["step.append_and_attend"], (
                cache, vectors, queries, weights, slot_ids, n_new)
        return targets.compile_for(program, *args, target=device, options=cfg.Options(),
                                   mesh=None), cache
    from flax import nnx

    from v4kv_jax.nn import Decoder, ModelConfig
    from v4kv_jax.serve import Engine, Generator

    decoder = Decoder(ModelConfig(model, vocab_size=128, mlp_hidden=64), rngs=nnx.Rngs(0))
    if name == "generator":
        gen = Generator(decoder, geometry, max_prompt_len=tokens, max_new_tokens=4,
                        prefill_chunk=tokens)
        program, run = gen.program, lambda: gen.generate([[1, 2, 3]], 2)
    else:
        eng = Engine(decoder, geometry, prefill_chunk=tokens)
        program, run = programs.PROGRAMS["engine.step"], lambda: eng.generate([[1, 2, 3]], 2)
    with programs.capture(stop_at=program) as calls:
        run()
    call = next(c for c in calls if c.program is program)
    cache = next(a for a in call.args if isinstance(a, pools.Cache))
    return targets.compile_for(call.program, *call.args, target=device, **call.kwargs), cache


def compile_op(case: str, model: cfg.AttentionConfig, geometry: cfg.CacheConfig, batch: int,
               tokens: int, device, options: cfg.Options | None = None):
    """(the compiled program or None, the compiler's error or None, seconds)."""
    options = options or cfg.Options(implementation="pallas_tpu")
    fn, args = op_program(case, model, geometry, batch, tokens, options)
    start = time.perf_counter()
    try:
        compiled = targets.compile_for(fn, *args, target=device)
    except Exception as e:  # the compiler's verdict is the result
        return None, f"{type(e).__name__}: {e}", time.perf_counter() - start
    return compiled, None, time.perf_counter() - start


@dataclasses.dataclass(frozen=True)
class Row:
    """One config of the sweep: what `supported()` said (None: runs) and what Mosaic did."""

    case: str
    generation: str
    widths: str
    formats: str
    page_tokens: int
    batch: int
    supported: str | None
    error: str | None
    seconds: float

    @property
    def agrees(self) -> bool:
        return (self.supported is None) == (self.error is None)


def kernel_supported(case: str, model, geometry, implementation: str = "pallas_tpu"):
    """What the op's kernel says of this case (`ops.supported`: None runs, else why not)."""
    op, name = OP_CASES[case]
    spec = None if name is None else next(s for s in compressor_specs(model) if s.name == name)
    return ops.supported(op, implementation, model, geometry, spec)


def sweep(cases=tuple(OP_CASES), generations=tuple(targets.GENERATIONS), widths=tuple(WIDTHS),
          formats=FORMATS, page_tokens=(128, 256), batches=(1, 64), tokens: int = 1,
          compile_unsupported: bool = True):
    """Yields a `Row` per config of the product (configs a geometry cannot hold skipped):
    `supported()` of the op's TPU kernel next to the Mosaic compile of it."""
    for gen, width, fmt, P, batch in itertools.product(generations, widths, formats,
                                                       page_tokens, batches):
        model = WIDTHS[width]()
        geometry = geometry_for(fmt, P, batch)
        try:
            geometry.check_against(model)
            for name in ("csa", "csa_index", "hca", "window"):
                storage.codec(model, geometry, name)
        except ValueError:
            continue  # formats these widths do not fit (the packed ones on narrow rows)
        device = targets.tpu_devices(targets.GENERATIONS[gen])[0]
        for case in cases:
            if not applies(case, geometry):
                continue
            why = kernel_supported(case, model, geometry)
            error, seconds = None, 0.0
            if why is None or compile_unsupported:
                with ops.unchecked():
                    _, error, seconds = compile_op(case, model, geometry, batch, tokens, device)
            yield Row(case, gen, width, fmt, P, batch, why, error, seconds)


__all__ = ["FORMATS", "OP_CASES", "Row", "WIDTHS", "applies", "compile_op", "geometry_for",
           "kernel_supported", "op_program", "step_arguments", "step_queries", "sweep"]
