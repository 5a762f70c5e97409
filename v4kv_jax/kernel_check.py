"""Every kernel against its jnp reference on the present accelerator, at a model's widths:
does it agree, by how much, and which is faster (`v4kv check`).

Each op of `KERNEL_OPS` runs twice on the same random cache (`synthetic.random_cache`, a
ragged batch of `batch` requests up to `context` tokens) through `v4kv_jax.ops`: once with
the reference, once with the platform's kernels (on a CPU, the TPU kernels in interpret
mode; there the times are the interpreter's, not a kernel's). The decode reads query each
request's last token; the emissions append a chunk of `chunk` tokens to each request (the
online HCA tail too, on a geometry with hca_tail="online" when the formats keep a ring).

Agreement is measured on float values: the outputs of the reads and the scores, and the
rows an emission writes decoded from their storage format (`pools.storage`). The error of a
value array is max |kernel - reference| / max(1, max |reference|) (equal values, infinities
included, count as 0; a NaN where the reference has none is an infinite error). It must be
at most the tolerance: 1e-5 in interpret mode (both compute in fp32 on the host); 2e-2
compiled on a device, whose matrix units multiply fp32 in bf16 passes at the default
precision; and for stored rows at least one step of the storage format (two fp32 values
round to neighbours when they straddle a rounding boundary).

`record` writes the results as rows of the table "auto" reads (`ops.choice.measured`), in
the user's table (`ops.choice.user_measured_path()`), one row per platform and op.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from v4kv_jax import checks, ops, pools
from v4kv_jax import config as cfg
from v4kv_jax.config import KERNEL_OPS, AttentionConfig, CacheConfig, LayerKind
from v4kv_jax.ops import choice
from v4kv_jax.testing import synthetic

INTERPRET_TOLERANCE = 1e-5
DEVICE_TOLERANCE = 2e-2
# The relative spacing of values stored in a format (its mantissa step at 1.0).
FORMAT_STEP = {"float32": 2.0**-23, "bfloat16": 2.0**-7, "float16": 2.0**-10,
               "fp8_latent": 2.0**-3, "fp4_index": 2.0**-1}


@dataclasses.dataclass(frozen=True)
class OpCheck:
    """One op checked: `implementation` ("pallas_tpu" or "pallas_gpu") run in `interpret`
    mode or compiled, against the reference on `shape` (a line). `agree` is None when the
    kernel does not run this config (`skipped` says why); `failed` is the kernel's error
    when it raised (then `agree` is False). Times are medians, in milliseconds."""

    op: str
    implementation: str
    interpret: bool
    shape: str
    agree: bool | None
    max_error: float = float("nan")
    tolerance: float = float("nan")
    reference_ms: float = float("nan")
    kernel_ms: float = float("nan")
    skipped: str | None = None
    failed: str | None = None


def default_implementation(backend: str | None = None) -> tuple[str, bool]:
    """(implementation, interpret) that `check_kernels` runs on `backend` (default: the
    present one): the platform's kernels, compiled; on a CPU the TPU kernels interpreted."""
    backend = backend or jax.default_backend()
    if backend in ("tpu", "gpu"):
        return f"pallas_{backend}", False
    return "pallas_tpu", True


def _timed(fn, args, repeats: int) -> tuple[object, float]:
    """(the first call's output, median milliseconds of `repeats` later calls)."""
    out = jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return out, 1e3 * statistics.median(times)


def _error(kernel, reference) -> float:
    """max |kernel - reference| / max(1, max |reference|) over float arrays (module doc)."""
    worst = 0.0
    for k, r in zip(jax.tree.leaves(kernel), jax.tree.leaves(reference), strict=True):
        k, r = np.asarray(k, np.float64), np.asarray(r, np.float64)
        with np.errstate(invalid="ignore"):  # inf - inf: NaN, then infinite below
            diff = np.where(k == r, 0.0, np.abs(k - r))
        diff = np.where(np.isnan(k) & np.isnan(r), 0.0, diff)
        diff = np.where(np.isnan(diff), np.inf, diff)
        finite = np.abs(r[np.isfinite(r)])
        scale = max(1.0, float(finite.max(initial=0.0)))
        worst = max(worst, float(diff.max(initial=0.0)) / scale)
    return worst


def _lengths(batch: int, context: int) -> list[int]:
    """A ragged batch: `context` tokens in the first request, fewer in the others."""
    return [max(1, context - (context * i) // batch) for i in range(batch)]


def _geometry(model, formats: str, batch: int, context: int, **fields) -> CacheConfig:
    pages = -(-context // cfg.CacheConfig(1, 1, 1).page_tokens)
    return CacheConfig.with_formats(formats, num_pages=batch * pages, max_slots=batch,
                                    max_pages_per_seq=pages, **fields)


def _one_layer_of_each_kind(model: AttentionConfig) -> AttentionConfig:
    """`model` with one CSA and one HCA layer (those it has): a kernel runs one layer at a
    time, the same way whatever the layer count, and the pools stay small."""
    ratios = tuple(model.ratio(kind) for kind in (LayerKind.CSA, LayerKind.HCA)
                   if model.layers_of(kind))
    return dataclasses.replace(model, compress_ratios=ratios or (0,))


def _decode_cases(model, geometry, cache, lengths, seed: int):
    """{op: (function of (Options, inputs), inputs)} for the three decode reads."""
    batch = len(lengths)
    rng = np.random.default_rng(seed)

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.float32)

    kv_end = jnp.asarray(lengths, jnp.int32)
    common = dict(window=pools.window_ring(cache), slot_ids=jnp.arange(batch, dtype=jnp.int32),
                  q_pos=kv_end - 1, kv_end=kv_end, page_rows=cache.pages.page_table,
                  q=normal(batch, model.num_heads, model.head_dim), sink=normal(model.num_heads))
    cases = {}
    if model.num_csa:
        index = dict(index_keys=pools.csa_entries(cache).index_keys,
                     page_rows=cache.pages.page_table,
                     index_q=normal(batch, model.index_heads, model.index_head_dim),
                     index_weights=normal(batch, model.index_heads), q_pos=kv_end - 1,
                     kv_end=kv_end)
        picks = ops.index_topk(model, geometry, cfg.Options(implementation="reference"),
                               layer=0, **index)
        csa_layer = model.layers_of(LayerKind.CSA)[0]
        cases["index_scores"] = (
            lambda options, x: ops.index_scores(model, geometry, options, layer=0, **x), index)
        cases["sparse_decode_attention"] = (
            lambda options, x: ops.sparse_decode_attention(
                model, geometry, options, window_layer=csa_layer, c4_layer=0, **x),
            dict(common, c4=pools.csa_entries(cache).c4, picks=picks))
    if model.num_hca:
        hca_layer = model.layers_of(LayerKind.HCA)[0]
        cases["dense_decode_attention"] = (
            lambda options, x: ops.dense_decode_attention(
                model, geometry, options, window_layer=hca_layer, c128_layer=0, **x),
            dict(common, c128=pools.hca_entries(cache).c128))
    return cases


def _emission_cases(model, geometry, cache, lengths, chunk: int, seed: int):
    """{op: (function of (Options, inputs), inputs, tolerance floor)} for the emissions:
    every compressor appends `chunk` tokens to each request (its last tokens rewritten), and
    the rows it writes are compared decoded; the floor is the coarsest format's step."""
    rng = np.random.default_rng(seed + 1)
    batch = len(lengths)
    counts = np.minimum(chunk, np.asarray(lengths))
    common = dict(page_rows=cache.pages.page_table, slot_ids=jnp.arange(batch, dtype=jnp.int32),
                  start=jnp.asarray(np.asarray(lengths) - counts, jnp.int32),
                  n_new=jnp.asarray(counts, jnp.int32))
    ring, online = {}, None
    for spec in cache.specs:
        n = len(model.layers_of(spec.kind))
        online_spec = pools.online_tail(geometry, spec)
        width = spec.width if online_spec else spec.in_width
        kv, gate = (jnp.asarray(rng.standard_normal((n, batch, chunk, width)), jnp.float32)
                    for _ in range(2))
        inputs = dict(common, layers=jnp.arange(n, dtype=jnp.int32), kv=kv, gate=gate,
                      norm=jnp.asarray(1 + 0.1 * rng.standard_normal((n, spec.width)),
                                       jnp.float32), pool=pools.entries(cache, spec))
        if online_spec:
            online = (spec, dict(inputs, tail=pools.hca_tail(cache)))
        else:
            tail = pools.tail(cache, spec)
            ring[spec] = dict(inputs, tail_kv=tail.kv, tail_gate=tail.gate)
    codecs = {spec.name: pools.codec(cache, spec.name) for spec in cache.specs}
    cases = {}
    if ring:
        def emit(options, inputs):
            return [codecs[spec.name].decode(ops.emit_entries(
                spec, model, geometry, options, **inputs[spec.name]).records())
                for spec in ring]

        cases["emit_entries"] = (emit, {spec.name: x for spec, x in ring.items()},
                                 max(FORMAT_STEP[codecs[spec.name].fmt] for spec in ring))
    if online is not None:
        spec, inputs = online
        tails = cache.layout.tail_rows[spec.name]

        def emit_online(options, inputs):
            pool, tail = ops.emit_entries_online(spec, model, geometry, options, **inputs)
            return [codecs[spec.name].decode(pool.records()),
                    *(tails.decode(x.records()) for x in (tail.max, tail.sum, tail.weighted))]

        cases["emit_entries_online"] = (emit_online, inputs,
                                        FORMAT_STEP[codecs[spec.name].fmt])
    return cases


def check_kernels(model: AttentionConfig, *, formats: str = "float32", batch: int = 4,
                  context: int = 4096, chunk: int = 64, repeats: int = 3, seed: int = 0,
                  implementation: str | None = None, interpret: bool | None = None,
                  ops_to_check=KERNEL_OPS, on_result=None) -> list[OpCheck]:
    """Each kernel op of `KERNEL_OPS` against the reference on the present backend.

    Args:
      model: the attention widths (a preset such as `v4kv_jax.flash()`, or the user's own).
      formats: the storage formats (`config.FORMAT_SETS`).
      batch, context: requests, and the tokens of the longest (the others hold fewer).
      chunk: tokens each request appends in the emission checks.
      repeats: timed calls of each implementation after the first (which compiles).
      implementation, interpret: the kernels to check; default `default_implementation()`.
      ops_to_check: names in `KERNEL_OPS` (an op the model has no layer for is left out).
      on_result: called with each `OpCheck` as it is done (the CLI prints it).

    Returns:
      An `OpCheck` per op, in `KERNEL_OPS` order.
    """
    checks.one_of("formats", formats, tuple(cfg.FORMAT_SETS))
    for op in ops_to_check:
        checks.one_of("ops_to_check", op, KERNEL_OPS)
    batch = checks.integer("batch", batch, lo=1)
    context = checks.integer("context", context, lo=1)
    chunk = checks.integer("chunk", chunk, lo=1)
    repeats = checks.integer("repeats", repeats, lo=1)
    default, default_interpret = default_implementation()
    implementation = implementation or default
    checks.one_of("implementation", implementation, tuple(choice._BACKEND_OF))
    interpret = default_interpret if interpret is None else interpret
    model = _one_layer_of_each_kind(model)
    lengths = _lengths(batch, context)
    geometry = _geometry(model, formats, batch, context)
    cache = synthetic.random_cache(model, geometry, lengths, seed=seed)
    cases = {op: (fn, inputs, 0.0)
             for op, (fn, inputs) in _decode_cases(model, geometry, cache, lengths, seed).items()}
    cases.update(_emission_cases(model, geometry, cache, lengths, chunk, seed))
    if "emit_entries_online" not in cases and model.num_hca:
        online = _geometry(model, formats, batch, context, hca_tail="online")
        online_cache = synthetic.random_cache(model, online, lengths, seed=seed)
        cases["emit_entries_online"] = _emission_cases(
            model, online, online_cache, lengths, chunk, seed)["emit_entries_online"]
    shape = (f"{formats} formats, batch {batch}, context {context} (lengths {lengths}), "
             f"emissions of {min(chunk, context)} tokens")
    floor = INTERPRET_TOLERANCE if interpret else DEVICE_TOLERANCE
    reference = cfg.Options(implementation="reference")
    kernel = cfg.Options(implementation=implementation, interpret=interpret)
    results = []
    for op in KERNEL_OPS:
        if op not in cases or op not in ops_to_check:
            continue
        fn, inputs, step = cases[op]
        tolerance = max(floor, step)
        # Interpret mode runs every config of the TPU kernels: their limits are Mosaic's.
        mosaic_only = implementation == "pallas_tpu" and interpret
        skipped = None if mosaic_only else choice.supported(op, implementation, model, geometry)
        if skipped is not None:
            result = OpCheck(op, implementation, interpret, shape, None, skipped=skipped)
        else:
            want, reference_ms = _timed(jax.jit(functools.partial(fn, reference)), (inputs,),
                                        repeats)
            try:
                got, kernel_ms = _timed(jax.jit(functools.partial(fn, kernel)), (inputs,),
                                        repeats)
            except Exception as e:  # a kernel the device's compiler or runtime refuses
                first = (str(e).strip().splitlines() or [""])[0]
                result = OpCheck(op, implementation, interpret, shape, False,
                                 tolerance=tolerance, reference_ms=reference_ms,
                                 failed=f"{type(e).__name__}: {first}")
            else:
                error = _error(got, want)
                result = OpCheck(op, implementation, interpret, shape, error <= tolerance,
                                 error, tolerance, reference_ms, kernel_ms)
        results.append(result)
        if on_result is not None:
            on_result(result)
    return results


def rows(results: list[OpCheck], device: str | None = None,
         platform: str | None = None) -> list[dict]:
    """The rows of the table "auto" reads (`ops.choice.measured`) for the checked ops (an op
    skipped as unsupported has none): one per op, on `platform` (default: the present
    backend) and `device` (default: its first device's kind)."""
    platform = platform or jax.default_backend()
    device = device or jax.devices()[0].device_kind
    out = []
    for r in results:
        if r.agree is None:
            continue
        row = dict(platform=platform, op=r.op, device=device, jax=jax.__version__,
                   shape=r.shape, implementation=r.implementation, interpret=r.interpret,
                   agree=r.agree, max_error=_number(r.max_error),
                   tolerance=_number(r.tolerance), reference_ms=_number(r.reference_ms, 4),
                   kernel_ms=_number(r.kernel_ms, 4),
                   checked=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        if r.failed:
            row["failed"] = r.failed
        out.append(row)
    return out


def _number(x: float, digits: int | None = None) -> float | None:
    """A JSON number (None for NaN: a kernel that failed has no time; inf stays a string)."""
    if np.isnan(x):
        return None
    if np.isinf(x):
        return str(x)
    return round(float(x), digits) if digits is not None else float(f"{x:.3g}")


def record(results: list[OpCheck], path: str | None = None) -> str:
    """Writes `rows(results)` into the user's table (`ops.choice.user_measured_path()`, or
    `path`), replacing the rows of the same platform and op; returns the path."""
    return choice.record(rows(results), path)
