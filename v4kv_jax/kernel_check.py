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
precision; and for stored rows at least one step of their storage format (two fp32 values
round to neighbours when they straddle a rounding boundary), each array held to its own.
The array furthest from its tolerance gives the op's error and tolerance.

`record` writes the results as rows of the table "auto" reads (`ops.choice.measured`), in
the user's table (`ops.choice.user_measured_path()`), one row per platform and op. The
command `v4kv check` (`command`, `add_parser`: the CLI adds it) prints and records them.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from v4kv_jax import checks, ops, pools, programs
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


def _errors(kernel, reference) -> list[float]:
    """Per output array, max |kernel - reference| / max(1, max |reference|) (module doc)."""
    errors = []
    for k, r in zip(jax.tree.leaves(kernel), jax.tree.leaves(reference), strict=True):
        k, r = np.asarray(k, np.float64), np.asarray(r, np.float64)
        with np.errstate(invalid="ignore"):  # inf - inf: NaN, then infinite below
            diff = np.where(k == r, 0.0, np.abs(k - r))
        diff = np.where(np.isnan(k) & np.isnan(r), 0.0, diff)
        diff = np.where(np.isnan(diff), np.inf, diff)
        finite = np.abs(r[np.isfinite(r)])
        scale = max(1.0, float(finite.max(initial=0.0)))
        errors.append(float(diff.max(initial=0.0)) / scale)
    return errors


def _lengths(batch: int, context: int) -> list[int]:
    """A ragged batch: `context` tokens in the first request, fewer in the others (off the
    page and block edges: 4096 tokens over 4 requests give 4096, 3071, 2046, 1021)."""
    return [max(1, context - (context * i) // batch - i) for i in range(batch)]


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
                  q_pos=kv_end - 1, kv_end=kv_end, page_rows=pools.page_state(cache).page_table,
                  q=normal(batch, model.num_heads, model.head_dim), sink=normal(model.num_heads))
    cases = {}
    if model.num_csa:
        index = dict(index_keys=pools.csa_entries(cache).index_keys,
                     page_rows=pools.page_state(cache).page_table,
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
    """{op: (function of (Options, inputs), inputs, steps)} for the emissions: every
    compressor appends `chunk` tokens to each request (its last tokens rewritten), and the
    rows it writes are compared decoded; `steps`: each output array's format step."""
    rng = np.random.default_rng(seed + 1)
    batch = len(lengths)
    counts = np.minimum(chunk, np.asarray(lengths))
    common = dict(page_rows=pools.page_state(cache).page_table,
                  slot_ids=jnp.arange(batch, dtype=jnp.int32),
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
                                 [FORMAT_STEP[codecs[spec.name].fmt] for spec in ring])
    if online is not None:
        spec, inputs = online
        tails = cache.layout.tail_rows[spec.name]

        def emit_online(options, inputs):
            pool, tail = ops.emit_entries_online(spec, model, geometry, options, **inputs)
            return [codecs[spec.name].decode(pool.records()),
                    *(tails.decode(x.records()) for x in (tail.max, tail.sum, tail.weighted))]

        cases["emit_entries_online"] = (
            emit_online, inputs, [FORMAT_STEP[codecs[spec.name].fmt]] + 3 * [
                FORMAT_STEP[tails.fmt]])
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
    cases = {op: (fn, inputs, None)
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
        fn, inputs, steps = cases[op]
        # Interpret mode runs every config of the TPU kernels: their limits are Mosaic's.
        mosaic_only = implementation == "pallas_tpu" and interpret
        skipped = None if mosaic_only else choice.supported(op, implementation, model, geometry)
        if skipped is not None:
            result = OpCheck(op, implementation, interpret, shape, None, skipped=skipped)
        else:
            run = programs.program(f"check.{op}", fn, static=("options",), register=False)
            want, reference_ms = _timed(functools.partial(run, reference), (inputs,), repeats)
            try:
                got, kernel_ms = _timed(functools.partial(run, kernel), (inputs,), repeats)
            except Exception as e:  # a kernel the device's compiler or runtime refuses
                first = (str(e).strip().splitlines() or [""])[0]
                result = OpCheck(op, implementation, interpret, shape, False,
                                 reference_ms=reference_ms,
                                 failed=f"{type(e).__name__}: {first}")
            else:
                errors = _errors(got, want)
                tolerances = [max(floor, step) for step in steps or [0.0] * len(errors)]
                # The array furthest from its tolerance speaks for the op.
                error, tolerance = max(zip(errors, tolerances, strict=True),
                                       key=lambda et: et[0] / et[1])
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


# --- `v4kv check` --------------------------------------------------------------------------

def _say(msg: str) -> None:
    print(msg, flush=True)


# Integer options of `v4kv check`: (lowest, highest or None).
BOUNDS = {"batch": (1, None), "context": (1, None), "chunk": (1, None), "repeats": (1, None)}

# The integer widths `v4kv check --set` may change (the AttentionConfig fields the kernels
# read).
WIDTHS = ("num_heads", "head_dim", "rope_dim", "window", "csa_ratio", "hca_ratio",
          "index_heads", "index_head_dim", "index_topk")


def _widths(values) -> dict[str, int]:
    """{field: value} of `--set FIELD=N` options, each checked by name."""
    out = {}
    for text in values or ():
        field, _, value = str(text).partition("=")
        if field not in WIDTHS or not value.strip().lstrip("-").isdigit():
            checks.fail("--set", f"FIELD=INTEGER with FIELD one of {WIDTHS}", repr(text))
        out[field] = int(value)
    return out


def _check_model(args) -> cfg.AttentionConfig:
    """The preset's widths with the `--set` overrides; a config the overrides make invalid
    raises naming --set."""
    checks.one_of("--preset", getattr(args, "preset", None), sorted(cfg.PRESETS))
    widths = _widths(getattr(args, "set", None))
    try:
        return cfg.PRESETS[args.preset](**widths)
    except (TypeError, ValueError) as e:
        raise ValueError(f"--set: expected widths the {args.preset} preset accepts; got "
                         f"{widths} ({e})") from None


def problem(args) -> str | None:
    """What is wrong with a combination of `v4kv check` options."""
    try:
        _check_model(args)
    except ValueError as e:
        return str(e)
    return None


def _ms(x: float | None) -> str:
    return "-" if x is None or x != x else f"{x:.3f}"


def command(args) -> int:
    """`v4kv check` on a namespace of its options (argparse's, or one made by hand: each
    option is checked by name)."""
    for name, (lo, _) in BOUNDS.items():
        if getattr(args, name, None) is None:
            checks.fail(f"--{name}", "a value (an argparse namespace of the subcommand's "
                        "options)", None, TypeError)
        checks.integer(f"--{name}", getattr(args, name), lo=lo)
    model = _check_model(args)
    formats = getattr(args, "formats", None) or cfg.PRESET_FORMATS[args.preset]
    checks.one_of("--formats", formats, tuple(cfg.FORMAT_SETS))
    selected = tuple(getattr(args, "ops", None) or KERNEL_OPS)
    for op in selected:
        checks.one_of("--ops", op, KERNEL_OPS)
    implementation, interpret = default_implementation()
    implementation = getattr(args, "implementation", None) or implementation
    checks.one_of("--implementation", implementation, ("pallas_tpu", "pallas_gpu"))
    backend = jax.default_backend()
    interpret = interpret or backend != implementation.removeprefix("pallas_")
    device = jax.devices()[0].device_kind
    overrides = _widths(getattr(args, "set", None))
    _say(f"v4kv check on {backend.upper()} ({device}): the {implementation} kernels "
         + ("in interpret mode (times are the interpreter's, not a kernel's)"
            if interpret else "compiled for this device")
         + f" against the reference; {args.preset} widths"
         + (f" with {', '.join(f'{k}={v}' for k, v in overrides.items())}" if overrides else "")
         + f" (H={model.num_heads} hd={model.head_dim} r={model.rope_dim} W={model.window} "
         f"m={model.csa_ratio} m'={model.hca_ratio} indexer {model.index_heads}x"
         f"{model.index_head_dim} top-k={model.index_topk}), {formats} formats, batch "
         f"{args.batch}, context {args.context}")
    _say(f"{'op':<24} {'agree':<6} {'max error':>10} {'tolerance':>10} {'reference ms':>13} "
         f"{'kernel ms':>10}")

    def show(r) -> None:
        agree = "skip" if r.agree is None else "yes" if r.agree else "NO"
        error = "-" if r.max_error != r.max_error else f"{r.max_error:.2e}"
        tolerance = "-" if r.tolerance != r.tolerance else f"{r.tolerance:.3g}"
        _say(f"{r.op:<24} {agree:<6} {error:>10} {tolerance:>10} {_ms(r.reference_ms):>13} "
             f"{_ms(r.kernel_ms):>10}" + (f"  {r.skipped or r.failed}"
                                          if r.skipped or r.failed else ""))

    results = check_kernels(
        model, formats=formats, batch=args.batch, context=args.context, chunk=args.chunk,
        repeats=args.repeats, implementation=implementation, interpret=interpret,
        ops_to_check=selected, on_result=show)
    disagree = [r.op for r in results if r.agree is False]
    _say(("Every kernel checked agrees with the reference." if not disagree else
          f"Disagree with the reference: {', '.join(disagree)} (\"auto\" runs the reference "
          "for them).") if results else "No op to check: the model has no CSA or HCA layer.")
    own = (implementation, interpret) == default_implementation()
    if getattr(args, "no_record", False):
        _say("Not recorded (--no-record).")
    elif not own:
        _say(f"Not recorded: \"auto\" on {backend} does not run the {implementation} kernels"
             + (" in interpret mode." if interpret else "."))
    elif results:
        n = len(rows(results))
        try:
            path = record(results)
        except (OSError, ValueError) as e:
            _say(f"Not recorded: the {n} row{'' if n == 1 else 's'} for {backend} could not "
                 f"be written ({type(e).__name__}: {e}); the table is as it was.")
            return 1
        _say(f"Recorded {n} row{'' if n == 1 else 's'} for {backend} in "
             f"{path}: \"auto\" on {backend} reads them (a disagreeing kernel is not run, "
             "else the faster of the two)"
             + (", though on a CPU it always runs the reference." if backend == "cpu" else "."))
    return 1 if disagree else 0


def add_parser(sub, int_option, formatter):
    """Adds `v4kv check` to the CLI's subparsers `sub`; `int_option(lo, hi)` makes an
    argparse type for an integer option, `formatter` is the help formatter class."""
    p = sub.add_parser(
        "check", formatter_class=formatter,
        help="every Pallas kernel against the jnp reference on this machine's accelerator; "
             "records the rows \"auto\" follows",
        description="Runs each op with a Pallas kernel (the compressor emissions, the "
                    "indexer's scores, the CSA sparse and the HCA dense decode reads) with the "
                    "kernel and with the jnp reference on the same random cache, on this "
                    "machine's accelerator (on a CPU, the TPU kernels in interpret mode), at a "
                    "preset's widths or those --set gives. Prints per op whether the two "
                    "agree, the largest error and the time of each, and records the results "
                    "in the user's table (~/.cache/v4kv_jax/measured.json; $V4KV_MEASURED "
                    "moves it), which \"auto\" reads: an op whose kernel disagrees runs the "
                    "reference, else the faster of the two. Exit status 0 when every kernel "
                    "checked agrees, 1 otherwise.")
    p.add_argument("--preset", choices=sorted(cfg.PRESETS), default="flash",
                   help="the model's attention widths")
    p.add_argument("--set", action="append", metavar="FIELD=N",
                   help="change one width of the preset, e.g. --set head_dim=256 (repeat it "
                        f"for several; FIELD one of {', '.join(WIDTHS)}) (default: the "
                        "preset's widths)")
    p.add_argument("--formats", choices=tuple(cfg.FORMAT_SETS), default=None,
                   help="storage formats (default: the preset's: release for flash and pro, "
                        "float32 for tiny)")
    p.add_argument("--batch", type=int_option(*BOUNDS["batch"]), default=4, metavar="N",
                   help="requests in the batch")
    p.add_argument("--context", type=int_option(*BOUNDS["context"]), default=4096, metavar="TOKENS",
                   help="tokens of the longest request (the others hold fewer)")
    p.add_argument("--chunk", type=int_option(*BOUNDS["chunk"]), default=64, metavar="TOKENS",
                   help="tokens each request appends in the compressor checks")
    p.add_argument("--repeats", type=int_option(*BOUNDS["repeats"]), default=5, metavar="N",
                   help="timed calls of each implementation after the first")
    p.add_argument("--ops", nargs="+", choices=KERNEL_OPS, default=None, metavar="OP",
                   help=f"the ops to check, of {', '.join(KERNEL_OPS)} (default: all)")
    p.add_argument("--implementation", choices=("pallas_tpu", "pallas_gpu"), default=None,
                   help="the kernels to check (default: this platform's; on a CPU pallas_tpu, "
                        "in interpret mode as every kernel off its own platform)")
    p.add_argument("--no-record", action="store_true",
                   help="print only; leave the table \"auto\" reads as it is (default: "
                        "record)")
    p.set_defaults(run=command, problem=problem, parser=p)
    return p
