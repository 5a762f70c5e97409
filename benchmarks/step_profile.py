"""Where a compiled decode step spends its time: a profile, grouped by operation kind.

Runs the decode step of `benchmarks/decode.py` (43 layers, V4-Flash pattern, reduced widths)
or of `benchmarks/model.py` (config S, the Flax stack) under `jax.profiler.trace`, reads the
trace's per-operation events (one event per fusion, dot, gather, loop, ... as XLA runs it)
and sums their time per step: per operation kind (the opcode or fusion kind of the operation
in the optimized HLO) and per operation. Loops and conditionals contain the operations they
run, so their own rows are left out of the kind totals (their bodies' operations are counted).

    python benchmarks/step_profile.py                              # decode.py's step at 131072
    python benchmarks/step_profile.py --bench model --context 4096         # --scan: scanned
    python benchmarks/step_profile.py --context 32768 --formats release --top 30
    python benchmarks/step_profile.py --bench model --context 3584 --tokens 512  # a prefill chunk

Prints a table and writes benchmarks/results/step_profile.json.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from measure import CONTROL, hlo_operations, write_result

HERE = os.path.dirname(os.path.abspath(__file__))


def decode_bench_step(args):
    """(jitted step, its arguments) of benchmarks/decode.py at `args.context`."""
    import decode

    from v4kv_jax import config as cfg
    from v4kv_jax.testing import synthetic

    ns = argparse.Namespace(heads=8, head_dim=128, rope_dim=64, index_heads=8,
                            index_head_dim=64, topk=512, batch=args.batch,
                            steps=args.steps + 2)
    model = decode.bench_model(ns)
    geometry = decode.bench_geometry(args.formats, args.context, ns)
    cache = synthetic.random_cache(model, geometry, [args.context] * args.batch,
                                   seed=args.context)
    data = synthetic.SyntheticBatch.draw(model, args.batch, 1, seed=1)
    queries = data.stacked_queries(np.zeros((args.batch, 1), int))
    fn = decode.make_v4_step(model, cfg.Options())
    return fn, [cache, data.span(0, 1), queries, data.weights], model.num_layers


def model_bench_step(args):
    """(jitted step, its arguments) of benchmarks/model.py's stack at `args.context`, the
    cache filled by a real prefill; the step appends `args.tokens` tokens to every row (1: a
    decode step; more: a prefill chunk at that context). The cache holds the context's power
    of two, as model.py sizes it, plus every profiled step's tokens."""
    import model as model_bench
    from flax import nnx

    from v4kv_jax.nn import Decoder, ModelConfig

    jax.config.update("jax_default_matmul_precision", "highest")
    config = model_bench.config_s()
    decoder = Decoder(ModelConfig(config, vocab_size=8), rngs=nnx.Rngs(0), bias_scale=0.5,
                      scan_layers=args.scan)
    capacity = (1 << (args.context - 1).bit_length()) + (2 * args.steps + 4) * args.tokens
    stack = model_bench.V4Stack(decoder, args.batch, capacity, 512)
    x = np.random.default_rng(1).standard_normal(
        (args.batch, args.context, config.hidden_size)).astype(np.float32)
    cache, _ = stack.prefill(jnp.asarray(x))
    step_x = jnp.asarray(x[:, :args.tokens])
    n_new = jnp.full((args.batch,), args.tokens, jnp.int32)
    return stack._run, [stack.params, cache, step_x, n_new], config.num_layers


def operation_kinds(hlo_text: str) -> tuple[dict[str, str], dict[str, str]]:
    """Operation name -> kind in an optimized HLO module (the opcode, or for a fusion the
    heaviest opcode it fuses: dot, gather, scatter, reduce, sort, ...), and operation name ->
    its result type (`f32[4,8,128]`)."""
    computations = hlo_operations(hlo_text)
    heavy = ("sort", "scatter", "dot", "convolution", "gather", "reduce-window", "reduce",
             "dynamic-update-slice", "concatenate", "dynamic-slice")
    kinds, shapes = {}, {}
    for op in (op for ops in computations.values() for op in ops):
        kinds[op["name"]] = op["opcode"]
        shapes[op["name"]] = op["result"]
        called = re.search(r"calls=%?([\w.\-]+)", op["rhs"])
        if op["opcode"] == "fusion" and called:
            inner = {o["opcode"] for o in computations.get(called.group(1), [])}
            kinds[op["name"]] = "fusion(" + next((h for h in heavy if h in inner),
                                                 "elementwise") + ")"
    return kinds, shapes


def trace_events(trace_dir: str) -> list[dict]:
    """The complete events of the perfetto trace `jax.profiler.trace` wrote."""
    files = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
    if not files:
        raise SystemExit(f"no trace file under {trace_dir}: the profiler wrote nothing")
    with gzip.open(files[0], "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def run(args) -> dict:
    build = model_bench_step if args.bench == "model" else decode_bench_step
    fn, fn_args, n_layers = build(args)
    compiled = fn.lower(*fn_args).compile()
    kinds, shapes = operation_kinds(compiled.as_text())
    donated = 1 if args.bench == "model" else 0  # the cache is donated and returned

    def call(fn_args):
        out = fn(*fn_args)
        jax.block_until_ready(out)
        fn_args[donated] = out[0]
        return fn_args

    for _ in range(2):  # compile and warm up
        fn_args = call(fn_args)
    wall = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        fn_args = call(fn_args)
        wall.append(time.perf_counter() - t0)
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            for _ in range(args.steps):
                fn_args = call(fn_args)
        events = trace_events(trace_dir)

    per_op: dict[str, float] = collections.defaultdict(float)
    calls: dict[str, int] = collections.defaultdict(int)
    for e in events:
        name = e["name"]
        if name in kinds:
            per_op[name] += e["dur"] / 1e3 / args.steps
            calls[name] += 1
    per_kind: dict[str, float] = collections.defaultdict(float)
    for name, ms in per_op.items():
        if kinds[name] not in CONTROL:
            per_kind[kinds[name]] += ms
    device_ms = sum(per_kind.values())
    step_ms = 1e3 * statistics.median(wall)
    what = "decode step" if args.tokens == 1 else f"{args.tokens}-token prefill chunk"
    print(f"{args.bench}.py {what} at {args.context:,} tokens, batch {args.batch}"
          + (f", {args.formats}" if args.bench == "decode" else "")
          + f": {step_ms:.2f} ms a step (median of {args.steps}), {device_ms:.2f} ms of it "
          f"in operations outside loops' and branches' own rows; load average "
          f"{os.getloadavg()[0]:.2f}")
    print(f"\n{'kind':<34} {'ms/step':>8} {'share':>6}")
    for kind, ms in sorted(per_kind.items(), key=lambda kv: -kv[1]):
        print(f"{kind:<34} {ms:8.3f} {ms / device_ms:6.1%}")
    print(f"\n{'operation':<34} {'kind':<24} {'result':<24} {'ms/step':>8} {'runs/step':>9}")
    top = sorted(per_op.items(), key=lambda kv: -kv[1])[:args.top]
    for name, ms in top:
        print(f"{name[:34]:<34} {kinds[name][:24]:<24} {shapes[name][:24]:<24} {ms:8.3f} "
              f"{calls[name] / args.steps:9.1f}")
    return dict(benchmark="profile", bench=args.bench, context=args.context,
                tokens=args.tokens, batch=args.batch,
                formats=args.formats if args.bench == "decode" else None,
                layers=n_layers, scanned=args.scan if args.bench == "model" else None,
                step_ms=step_ms, device_ms=device_ms,
                per_kind=dict(per_kind),
                top=[dict(name=n, kind=kinds[n], result=shapes[n], ms=ms,
                          runs=calls[n] / args.steps) for n, ms in top],
                load_average=os.getloadavg()[0], backend=jax.default_backend(),
                jax=jax.__version__)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bench", choices=["decode", "model"], default="decode")
    p.add_argument("--context", type=int, default=131072)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--formats", default="float32", help="decode.py's storage formats")
    p.add_argument("--scan", action="store_true",
                   help="model.py's stack: scan over layer groups instead of unrolling")
    p.add_argument("--tokens", type=int, default=1,
                   help="model.py's stack: tokens each row appends per step (1: decode; "
                        "more: a prefill chunk at --context)")
    p.add_argument("--steps", type=int, default=5, help="steps timed, then profiled")
    p.add_argument("--top", type=int, default=20, help="operations listed")
    p.add_argument("--out", default=os.path.join(HERE, "results", "step_profile.json"))
    args = p.parse_args(argv)
    for name in ("context", "batch", "tokens", "steps", "top"):
        if getattr(args, name) < 1:
            p.error(f"--{name}: expected at least 1; got {getattr(args, name)}")
    if args.bench == "decode" and args.tokens != 1:
        p.error(f"--tokens: expected 1 with --bench decode (decode.py's step appends one "
                f"token); got {args.tokens}")
    write_result(run(args), args.out)


if __name__ == "__main__":
    main()
