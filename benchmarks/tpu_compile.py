"""The decode step compiled for TPUs without a TPU: XLA:TPU's and Mosaic's own figures.

Compiles the V4 decode step (append one token to every layer and attend in every layer,
`step.append_and_attend`, implementation "auto": the TPU kernels where `supported()` says
they run) for one chip of each generation (`v4kv_jax.targets`), on abstract arrays (nothing
is allocated), and prints per generation, context and batch:

  compile s     XLA:TPU + Mosaic compile time on this machine
  ops / fusions the optimized program's top-level operations and fusions, per layer
  temp MiB      the compiler's temporaries
  cache MiB     the cache's rows' own bytes (logical) / the cache as the compiler lays it
                out on the chip (`pools.laid_out`: lane-dense planes, tiles' padding)
  copied MiB    bytes of the cache's planes the program copies or moves
                (`targets.cache_copies`: relayouts and copies within HBM, and moves
                between HBM and VMEM; a loop body's once)
  alias MiB     argument bytes aliased to outputs: the cache updated in place when it
                equals the cache (no copy of a pool in the program)
  est. read     XLA's estimated bytes accessed (its cost analysis) of the step as compiled
                (a loop's body counted once: the layers of a kind run in one loop), and of
                the same step with its layer loops unrolled (`Options.unroll_layers`: every
                layer counted; nan where that program does not fit the chip), next to the
                bytes the step must read (`decode.v4_step_bytes`).
                A Pallas kernel is charged its cost estimate (the bytes its DMAs move, every
                page of a row read); XLA charges a gather at least a tile per index
  largest       per row, the ten operations touching the most bytes (result + operands,
                from the optimized HLO; XLA:TPU's estimated cycles beside them)

These are the compiler's estimates, never measurements (no TPU ran anything).

    python benchmarks/tpu_compile.py          # decode and V4-Flash widths; v5e, v6e; 32k,
                                              # 128k; batch 4, 64
    python benchmarks/tpu_compile.py --widths flash --generations v5e
    python benchmarks/tpu_compile.py --cache-layout default auto   # the pools' layouts
    python benchmarks/tpu_compile.py --programs  # every program that takes the cache
    python benchmarks/tpu_compile.py --sweep  # every kernel over the product
    python benchmarks/tpu_compile.py --shares --widths flash --generations v5e \
        --contexts 32768 --batches 4          # who the est. step's bytes are charged to

`--shares` splits the est. step: the unrolled step compiled again with one kind of kernel's
cost estimate set to 0 bytes (its share: the difference), and with every kernel's (what XLA
charges its own ops), beside what XLA:TPU charges a small gather and scatter of int32 ids,
and the same lookups as selects over an iota.

`--sweep` compiles every Pallas TPU kernel, one op at a time, over generations x widths x
formats x page sizes x batches (`v4kv_jax.testing.compile_sweep`) and prints where
`supported()` and Mosaic agree (they must, everywhere). Writes results/tpu_compile.json.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import importlib
import os
import re
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from decode import add_model_arguments, bench_model, v4_step_bytes  # noqa: E402
from jax.experimental.layout import Format, Layout  # noqa: E402
from measure import hlo_counts, hlo_operations, write_result  # noqa: E402

import v4kv_jax as v4  # noqa: E402
from v4kv_jax import pools, programs, targets  # noqa: E402
from v4kv_jax.testing import compile_sweep  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
MIB = 2**20


def step_arguments(model, geometry, batch: int):
    cache, vectors, weights, slot_ids, n_new = compile_sweep.step_arguments(model, geometry,
                                                                            batch, 1)
    return (cache, vectors, compile_sweep.step_queries(model, batch, 1), weights, slot_ids,
            n_new)


def geometry_for(formats: str, context: int, batch: int) -> v4.CacheConfig:
    pages = -(-(context + 1) // 128)
    return v4.CacheConfig.with_formats(formats, num_pages=batch * pages + 1, max_slots=batch,
                                       max_pages_per_seq=pages, page_tokens=128)


_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4,
             "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}


def _type_bytes(result: str) -> int:
    """Bytes of an HLO result type (a tuple counts each element)."""
    total = 0
    for dtype, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", result):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * _ITEMSIZE.get(dtype, 4)
    return total


def largest_operations(computations: dict, count: int = 10) -> list[dict]:
    """The `count` operations of the optimized program (`hlo_operations` of its text) outside
    fusion bodies that touch the most bytes: their result plus their operands, each counted
    once per execution of its computation (a loop body's operations once, whatever the trip
    count), with XLA:TPU's estimated cycles where it records them."""
    types = {op["name"]: op["result"] for ops in computations.values() for op in ops}
    rows = []
    for name, ops in computations.items():
        if "fused" in name or name.startswith(("region", "horizontally_fused")):
            continue
        for op in ops:
            if op["opcode"] in ("parameter", "constant", "get-tuple-element", "tuple",
                                "bitcast", "while", "conditional", "call"):
                continue
            call = op["rhs"][op["rhs"].index(op["opcode"] + "("):]
            operands = re.findall(r"%([\w.\-]+)", call.split(")", 1)[0])
            touched = _type_bytes(op["result"]) + sum(_type_bytes(types.get(o, ""))
                                                      for o in operands)
            cycles = re.search(r'"estimated_cycles":"(\d+)"', op["rhs"])
            rows.append(dict(name=op["name"], opcode=op["opcode"], computation=name,
                             result=op["result"], bytes=touched,
                             estimated_cycles=int(cycles.group(1)) if cycles else None))
    return sorted(rows, key=lambda r: -r["bytes"])[:count]


def cost_of(compiled) -> dict:
    """XLA's cost analysis of a compiled program as one dict (empty where it has none)."""
    cost = compiled.cost_analysis()
    return cost[0] if isinstance(cost, (list, tuple)) else (cost or {})


def _compile(args, device, cache_layout: str, options=None):
    """The step compiled for `device`; cache_layout "auto": the cache's layouts (in and out)
    left to the compiler (a caller would place the cache with `compiled.input_formats`)."""
    step = programs.PROGRAMS["step.append_and_attend"]
    options = options or v4.Options()
    if cache_layout == "default":
        return targets.compile_for(step, *args, target=device, options=options, mesh=None)
    here = jax.sharding.SingleDeviceSharding(device)
    auto = Format(Layout.AUTO, here)
    jitted = jax.jit(lambda cache, *rest: step(cache, *rest, options=options, mesh=None),
                     in_shardings=(jax.tree.map(lambda _: auto, args[0]),) + (here,) * 5,
                     out_shardings=auto, donate_argnums=0)
    return jitted.trace(*targets.abstract(args, device)).lower().compile()


def compile_step(model, generation: str, formats: str, context: int, batch: int,
                 cache_layout: str = "default") -> dict:
    geometry = geometry_for(formats, context, batch)
    args = step_arguments(model, geometry, batch)
    device = targets.tpu_devices(targets.GENERATIONS[generation])[0]
    start = time.perf_counter()
    base = dict(generation=generation, formats=formats, context=context, batch=batch,
                cache_layout=cache_layout,
                must_read_bytes=v4_step_bytes(model, geometry, batch, context))
    try:
        compiled = _compile(args, device, cache_layout)
    except Exception as e:  # the compiler's verdict (e.g. temporaries past the chip's HBM)
        return dict(base, error=str(e).split("\n")[0][:300],
                    compile_s=round(time.perf_counter() - start, 1))
    seconds = time.perf_counter() - start
    memory = compiled.memory_analysis()
    cost = cost_of(compiled)
    counts = hlo_counts(compiled)
    text = compiled.as_text()
    kernels = collections.Counter(
        name for name in ("v4kv_compress_emit", "v4kv_compress_online", "v4kv_indexer_scores",
                          "v4kv_csa_sparse_decode_attention",
                          "v4kv_hca_dense_decode_attention", "v4kv_swa_decode_attention",
                          "v4kv_write_records")
        for _ in range(text.count(name)))
    laid_out = pools.laid_out(model, geometry, generation)
    computations = hlo_operations(text)
    copies = targets.cache_copies(compiled)
    try:  # every layer unrolled holds more at once than the loops do: it may not fit
        unrolled = _compile(args, device, cache_layout, v4.Options(unroll_layers=True))
        step_cost = cost_of(unrolled)
        unrolled_error = None
    except Exception as e:
        step_cost, unrolled_error = {}, str(e).split("\n")[0][:300]
    return dict(
        base, compile_s=round(seconds, 1), layers=model.num_layers,
        entry_ops=counts["entry_ops"], fusions=counts["fusions"],
        temp_mib=memory.temp_size_in_bytes / MIB,
        cache_mib=logical_bytes(args[0]) / MIB,
        cache_laid_out_mib=(laid_out.argument_bytes + laid_out.host_bytes) / MIB,
        not_row_major=list(laid_out.not_row_major),
        argument_mib=memory.argument_size_in_bytes / MIB,
        alias_mib=memory.alias_size_in_bytes / MIB,
        pool_copy_mib=(copies.copied_bytes + copies.moved_bytes) / MIB,
        relayouts=len(copies.relayouts),
        estimated_bytes_accessed=cost.get("bytes accessed"),
        estimated_step_bytes_accessed=step_cost.get("bytes accessed"),
        unrolled_error=unrolled_error,
        estimated_flops=cost.get("flops"),
        estimated_seconds=cost.get("optimal_seconds"), kernels=sorted(kernels),
        largest=largest_operations(computations))


HEADER = (f"{'gen':4s} {'context':>8s} {'B':>3s} {'layout':7s} {'compile s':>9s} "
          f"{'fus/layer':>9s} {'temp MiB':>9s} {'cache MiB':>10s} {'laid out':>10s} "
          f"{'x':>6s} {'copied MiB':>10s} {'est. MiB':>9s} {'est. step':>10s} "
          f"{'must read':>10s} {'x':>5s}  kernels")


def format_row(r: dict) -> str:
    if "error" in r:
        return (f"{r['generation']:4s} {r['context']:8d} {r['batch']:3d} "
                f"{r['cache_layout']:7s} {r['compile_s']:9.1f} does not compile: {r['error']}")
    est, step = (r[k] or 0 for k in ("estimated_bytes_accessed",
                                       "estimated_step_bytes_accessed"))
    must = r["must_read_bytes"]
    return (f"{r['generation']:4s} {r['context']:8d} {r['batch']:3d} {r['cache_layout']:7s} "
            f"{r['compile_s']:9.1f} {r['fusions'] / r['layers']:9.1f} "
            f"{r['temp_mib']:9.1f} {r['cache_mib']:10.1f} {r['cache_laid_out_mib']:10.1f} "
            f"{r['cache_laid_out_mib'] / r['cache_mib']:6.3f} {r['pool_copy_mib']:10.1f} "
            f"{est / MIB:9.1f} {step / MIB if step else float('nan'):10.1f} {must / MIB:10.1f} "
            f"{step / must if step else float('nan'):5.2f}  "
            f"{len(r['kernels'])} ({', '.join(k.removeprefix('v4kv_') for k in r['kernels'])})")


def logical_bytes(cache) -> int:
    """The rows' own bytes of a cache (or its shape structs): every stored array's records,
    and the small int32 arrays as they are."""
    total = 0
    for x in jax.tree.leaves(cache, is_leaf=lambda y: isinstance(y, v4.pools.Lanes)):
        if isinstance(x, v4.pools.Lanes):
            lead = int(np.prod(x.lead, dtype=np.int64))
            total += lead * x.map.records * x.map.record_bytes
        else:
            total += int(np.prod(x.shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize
    return total


PROGRAM_HEADER = (f"{'gen':4s} {'widths':6s} {'program':10s} {'compile s':>9s} "
                  f"{'temp MiB':>9s} {'cache MiB':>10s} {'temp/cache':>10s} {'relayouts':>9s} "
                  f"{'copied MiB':>10s} {'moved MiB':>9s}")


def run_programs(args) -> dict:
    """Every program that takes the cache (`compile_sweep.cache_program`), at the tests'
    widths (float32) and V4-Flash's (one layer of each kind, release formats), 16 slots of
    32k tokens: temporaries, and what it does to the cache's arrays (`targets.cache_copies`:
    relayouts, copies within HBM, moves to VMEM)."""
    rows = []
    print(PROGRAM_HEADER, flush=True)
    for gen in args.generations:
        device = targets.tpu_devices(targets.GENERATIONS[gen])[0]
        for widths, make, formats, tokens in (("tiny", v4.tiny, "float32", 64),
                                              ("flash", compile_sweep.flash_layers,
                                               "release", 16)):
            pages = 32768 // 128
            geometry = v4.CacheConfig.with_formats(formats, num_pages=16 * pages + 1,
                                                   max_slots=16, max_pages_per_seq=pages)
            for name in compile_sweep.CACHE_PROGRAMS:
                start = time.perf_counter()
                compiled, cache = compile_sweep.cache_program(name, make(), geometry, tokens,
                                                              device)
                seconds = time.perf_counter() - start
                found = targets.cache_copies(compiled)
                cache_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache))
                temp = compiled.memory_analysis().temp_size_in_bytes
                rows.append(dict(generation=gen, widths=widths, program=name,
                                 compile_s=round(seconds, 1), temp_mib=temp / MIB,
                                 cache_mib=cache_bytes / MIB, relayouts=len(found.relayouts),
                                 copied_mib=found.copied_bytes / MIB,
                                 moved_mib=found.moved_bytes / MIB))
                r = rows[-1]
                print(f"{gen:4s} {widths:6s} {name:10s} {r['compile_s']:9.1f} "
                      f"{r['temp_mib']:9.1f} {r['cache_mib']:10.1f} "
                      f"{temp / cache_bytes:10.3f} {r['relayouts']:9d} "
                      f"{r['copied_mib']:10.1f} {r['moved_mib']:9.1f}", flush=True)
    return dict(programs=rows)


# The kernels' modules, by the name --shares gives their share.
KERNEL_MODULES = {
    "sparse read": "pallas_kernels.sparse_attention.tpu",
    "dense read (HCA, SWA)": "pallas_kernels.dense_attention.tpu",
    "indexer": "pallas_kernels.indexer.tpu",
    "compressors": "pallas_kernels.compressor.tpu",
    "writes": "pallas_kernels.records",
}


@contextlib.contextmanager
def kernel_bytes_zeroed(names):
    """The kernels of `names` (KERNEL_MODULES keys) charge 0 bytes while inside: each
    module's `cost_estimate` wrapped (they import it by name)."""
    saved = {}
    for name in names:
        module = importlib.import_module(KERNEL_MODULES[name])
        saved[module] = module.cost_estimate
        module.cost_estimate = (lambda real: lambda flops, bytes_accessed, transcendentals=0:
                                real(flops, 0, transcendentals))(module.cost_estimate)
    jax.clear_caches()  # the programs traced before still hold the old estimates
    try:
        yield
    finally:
        for module, real in saved.items():
            module.cost_estimate = real
        jax.clear_caches()


def _estimate(fn, args, device, donate=()) -> float:
    compiled = jax.jit(fn, donate_argnums=donate).trace(*targets.abstract(args, device)).lower(
    ).compile()
    return cost_of(compiled).get("bytes accessed") or 0.0


def index_charges(device) -> dict:
    """Bytes XLA:TPU charges 8 int32 ids looked up in, or written into, s32[1029] (a free
    stack, a refcount array), as a gather / scatter and as selects over an iota."""
    table = jax.ShapeDtypeStruct((1029,), np.int32)
    ids = jax.ShapeDtypeStruct((4, 2), np.int32)

    def select_gather(x, i):
        hit = np.arange(x.shape[0])[None, None, :] == i[..., None]
        return jax.numpy.max(jax.numpy.where(hit, x[None, None, :], np.iinfo(np.int32).min),
                             axis=-1)

    def select_scatter(x, i, v):
        hit = np.arange(x.shape[0])[:, None] == i.reshape(-1)[None, :]
        value = jax.numpy.max(jax.numpy.where(hit, v.reshape(-1)[None, :],
                                              np.iinfo(np.int32).min), axis=-1)
        return jax.numpy.where(hit.any(-1), value, x)

    return {
        "gather": _estimate(lambda x, i: x[jax.numpy.clip(i, 0, None)], (table, ids), device),
        "gather as selects": _estimate(select_gather, (table, ids), device),
        "scatter": _estimate(lambda x, i, v: x.at[i].set(v, mode="drop"), (table, ids, ids),
                             device, donate=(0,)),
        "scatter as selects": _estimate(select_scatter, (table, ids, ids), device,
                                        donate=(0,)),
    }


def _step_estimate(step_args, device, zeroed=()) -> float:
    """XLA's estimated bytes of the unrolled step, the kernels of `zeroed` charged 0."""
    with kernel_bytes_zeroed(zeroed):
        compiled = _compile(step_args, device, "default", v4.Options(unroll_layers=True))
    return cost_of(compiled).get("bytes accessed") or 0.0


def run_shares(args) -> dict:
    """Who the unrolled step's estimated bytes are charged to (module docstring)."""
    rows = []
    for widths in args.widths:
        model = v4.flash() if widths == "flash" else bench_model(args)
        for gen in args.generations:
            device = targets.tpu_devices(targets.GENERATIONS[gen])[0]
            charges = index_charges(device)
            print(f"{gen}: 8 int32 ids in s32[1029]: " + ", ".join(
                f"{k} {v / 1024:,.0f} KiB" for k, v in charges.items()), flush=True)
            for context in args.contexts:
                for batch in args.batches:
                    geometry = geometry_for(args.formats, context, batch)
                    step_args = step_arguments(model, geometry, batch)

                    total = _step_estimate(step_args, device)
                    shares = {name: total - _step_estimate(step_args, device, (name,))
                              for name in KERNEL_MODULES}
                    xla = _step_estimate(step_args, device, tuple(KERNEL_MODULES))
                    must = v4_step_bytes(model, geometry, batch, context)
                    rows.append(dict(widths=widths, generation=gen, context=context,
                                     batch=batch, step_bytes=total, kernel_bytes=shares,
                                     xla_bytes=xla, index_charges=charges,
                                     must_read_bytes=must))
                    print(f"{widths} widths, {gen} {context} tokens, batch {batch}: est. step "
                          f"{total / MIB:,.1f} MiB (must read {must / MIB:,.1f}); "
                          + ", ".join(f"{k} {v / MIB:,.1f}" for k, v in shares.items())
                          + f"; XLA's own ops {xla / MIB:,.1f}", flush=True)
    return dict(shares=rows)


def run_sweep(args) -> dict:
    rows = []
    for row in compile_sweep.sweep(generations=args.generations, page_tokens=(128, 256),
                                   batches=(1, 64)):
        rows.append(dict(row.__dict__, agrees=row.agrees,
                         error=None if row.error is None else row.error.split("\n")[0]))
        print(f"{row.generation:4s} {row.widths:8s} {row.formats:8s} P{row.page_tokens:<4d} "
              f"B{row.batch:<3d} {row.case:26s} {'runs' if row.supported is None else 'no':4s} "
              f"{'compiles' if row.error is None else 'fails':8s} "
              f"{'' if row.agrees else 'DISAGREE'}", flush=True)
    wrong = [r for r in rows if not r["agrees"]]
    print(f"{len(rows)} configs, {len(rows) - len(wrong)} agree, {len(wrong)} disagree")
    return dict(sweep=rows)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--generations", nargs="+", choices=sorted(targets.GENERATIONS),
                   help="default: v5e v6e for the table, every generation for --sweep")
    p.add_argument("--contexts", nargs="+", type=int, default=[32768, 131072])
    p.add_argument("--batches", nargs="+", type=int, default=[4, 64])
    p.add_argument("--formats", default="release", choices=sorted(v4.config.FORMAT_SETS))
    p.add_argument("--widths", nargs="+", default=["decode", "flash"],
                   choices=["decode", "flash"],
                   help="decode: benchmarks/decode.py's reduced widths; flash: V4-Flash's")
    p.add_argument("--cache-layout", nargs="+", default=["default"],
                   choices=["default", "auto"],
                   help="default: the TPU's own layout for each pool array (narrow packed "
                        "rows: pages minor); auto: the compiler's choice for the step")
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--shares", action="store_true",
                   help="split the est. step among the kernels and XLA's own ops")
    p.add_argument("--programs", action="store_true",
                   help="every program that takes the cache, tiny and V4-Flash widths")
    p.add_argument("--out", default=os.path.join(HERE, "results", "tpu_compile.json"))
    add_model_arguments(p)
    args = p.parse_args(argv)
    args.generations = args.generations or (list(targets.GENERATIONS) if args.sweep
                                            else ["v5e", "v6e"])
    if args.sweep:
        return write_result(run_sweep(args), args.out)
    if args.programs:
        return write_result(run_programs(args), args.out)
    if args.shares:
        return write_result(run_shares(args), args.out)
    rows = []
    for widths in args.widths:
        model = v4.flash() if widths == "flash" else bench_model(args)
        print(f"V4-Flash layer pattern ({model.num_layers} layers), {widths} widths "
              f"(H={model.num_heads} hd={model.head_dim}), {args.formats} formats; "
              "XLA:TPU's estimates, not measurements", flush=True)
        print(HEADER, flush=True)
        for gen in args.generations:
            for context in args.contexts:
                for batch in args.batches:
                    for layout in args.cache_layout:
                        rows.append(dict(compile_step(model, gen, args.formats, context,
                                                      batch, layout), widths=widths))
                        print(format_row(rows[-1]), flush=True)
    for r in rows:
        if r.get("largest"):
            print(f"\nlargest operations by bytes touched, {r['widths']} widths, "
                  f"{r['generation']} {r['context']} tokens, batch {r['batch']}, "
                  f"{r['cache_layout']} layout:")
            for op in r["largest"]:
                print(f"  {op['bytes'] / MIB:9.1f} MiB  {op['opcode']:14s} {op['name']:32s} "
                      f"{op['result'][:48]:48s} cycles {op['estimated_cycles']}")
    write_result(dict(widths=args.widths, formats=args.formats, rows=rows), args.out)


if __name__ == "__main__":
    main()
