"""Per-kernel time and achieved bandwidth: compressor, indexer, CSA and HCA decode attention.

Each op runs through `v4kv_jax.ops` with the implementation of `--implementation` (default
"auto": the Pallas kernels on TPU and GPU, the jnp reference on CPU) on a cache of random
content at V4-Flash attention widths (hd 512, r 64, 64 heads, 64 x 128 indexer, k 512, W 128,
m 4, m' 128, bf16 entries and window). For every call the table gives the bytes the op must
move at the least (entries, keys and window read once, inputs read and entries written once),
the achieved bandwidth, and its fraction of the copy bandwidth measured in the same run (a
jitted x + 1 over 1 GiB: 2 GiB moved per call).

    python benchmarks/kernels.py            # CPU-sized contexts (a couple of minutes on CPU)
    python benchmarks/kernels.py --native   # the sizes of the issue: CSA decode at 32k and
                                            # 128k, HCA decode at 128k and 1M, compressor
                                            # prefill of 32k tokens (meant for a TPU / GPU)
    python benchmarks/kernels.py --implementation pallas_tpu --interpret --csa-contexts 1024 \
        --hca-contexts 4096 --compress-tokens 512 --repeats 1   # smoke run of the kernel path
                                                                # on CPU (times meaningless)

    python benchmarks/kernels.py --native --record   # on a TPU / GPU: times each op with
                                                     # the reference and the kernels and
                                                     # records the faster in measured.json

Writes benchmarks/results/kernels.json; with --record also `v4kv_jax/measured.json`, the
table "auto" chooses from (one row per platform and op, replaced by each recording).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import platform
import statistics
import time
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from measure import copy_bandwidth, write_result

from v4kv_jax import config as cfg
from v4kv_jax import ops, pools, step
from v4kv_jax.config import LayerKind
from v4kv_jax.pools.layout import compressor_specs
from v4kv_jax.testing import synthetic
from v4kv_jax.vectors import LayerRef

HERE = os.path.dirname(os.path.abspath(__file__))
CPU_SIZES = dict(csa=(8192, 32768), hca=(32768, 131072), compress=(8192,))
NATIVE_SIZES = dict(csa=(32768, 131072), hca=(131072, 1048576), compress=(32768,))


def flash_layer(kind: LayerKind, **overrides) -> cfg.AttentionConfig:
    """V4-Flash attention widths with a single layer of `kind`."""
    return cfg.flash(compress_ratios=(4,) if kind == LayerKind.CSA else (128,), **overrides)


def timed(fn, args, repeats: int):
    """(seconds of the first call incl. compile, median seconds of `repeats` later calls).

    `fn` returns the new first argument (a donated pool comes back) and anything else."""
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    first = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        args = (out[0], *args[1:]) if isinstance(out, tuple) else args
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return first, statistics.median(times)


@dataclasses.dataclass
class Row:
    op: str
    implementation: str
    batch: int
    context: int
    first_s: float
    seconds: float
    bytes: int

    @property
    def bandwidth(self) -> float:
        return self.bytes / self.seconds


def _decode_cache(kind: LayerKind, batch: int, context: int, seed: int = 0):
    model = flash_layer(kind)
    P = 256
    pages = -(-context // P)
    geometry = cfg.CacheConfig(num_pages=batch * pages, max_slots=batch, max_pages_per_seq=pages,
                               page_tokens=P, entry_dtype="bfloat16", window_dtype="bfloat16")
    cache = synthetic.random_cache(model, geometry, [context] * batch, seed=seed)
    data = synthetic.SyntheticBatch.draw(model, batch, 1, seed=seed)
    queries = data.queries(0, np.zeros((batch, 1), int))
    return model, geometry, cache, queries


def _window_bytes(model, batch: int) -> int:
    return batch * model.window * model.head_dim * 2


def _query_bytes(model, batch: int) -> int:  # queries in, outputs out, fp32
    return 2 * batch * model.num_heads * model.head_dim * 4


def bench_csa(batch, context, implementation, interpret, repeats) -> Iterator[Row]:
    model, geometry, cache, queries = _decode_cache(LayerKind.CSA, batch, context)
    slots = jnp.arange(batch, dtype=jnp.int32)
    kv_end = jnp.full((batch,), context, jnp.int32)
    rows = cache.pages.page_table
    options = cfg.Options(implementation=implementation, interpret=interpret)
    entries = context // model.csa_ratio

    @jax.jit
    def scores(cache, queries):
        return ops.index_scores(model, geometry, options,
                                index_keys=pools.csa_entries(cache).index_keys, layer=0,
                                page_rows=rows, index_q=queries.index_q[:, 0],
                                index_weights=queries.index_weights[:, 0], q_pos=kv_end - 1,
                                kv_end=kv_end)

    @jax.jit
    def decode(cache, queries):
        return step.decode_attention(cache, LayerRef.of(cache, 0), queries, slots,
                                     options=options)

    picks = ops.index_topk(model, geometry, cfg.Options(implementation="reference"),
                           index_keys=pools.csa_entries(cache).index_keys, layer=0,
                           page_rows=rows, index_q=queries.index_q[:, 0],
                           index_weights=queries.index_weights[:, 0], q_pos=kv_end - 1,
                           kv_end=kv_end)

    @jax.jit
    def sparse(cache, queries):
        return ops.sparse_decode_attention(
            model, geometry, options, q=queries.q[:, 0], sink=queries.sink,
            window=pools.window_ring(cache), window_layer=0, slot_ids=slots, q_pos=kv_end - 1,
            kv_end=kv_end, c4=pools.csa_entries(cache).c4, c4_layer=0, page_rows=rows,
            picks=picks)

    key_bytes = batch * entries * model.index_head_dim * 2
    pick_bytes = batch * model.index_topk * (model.head_dim * 2 + 4)
    index_q = batch * model.index_heads * (model.index_head_dim + 1) * 4
    for name, op, fn, nbytes in (
            ("indexer scores", "index_scores", scores,
             key_bytes + index_q + batch * entries * 4),
            ("csa sparse attention", "sparse_decode_attention", sparse,
             pick_bytes + _window_bytes(model, batch) + _query_bytes(model, batch)),
            ("csa decode (indexer+top-k+attention)", "sparse_decode_attention", decode,
             key_bytes + index_q + pick_bytes + _window_bytes(model, batch)
             + _query_bytes(model, batch))):
        first, seconds = timed(fn, (cache, queries), repeats)
        impl = ops.choose(op, model, geometry, options).implementation
        yield Row(name, impl, batch, context, first, seconds, nbytes)


def bench_hca(batch, context, implementation, interpret, repeats) -> Iterator[Row]:
    model, geometry, cache, queries = _decode_cache(LayerKind.HCA, batch, context)
    slots = jnp.arange(batch, dtype=jnp.int32)
    options = cfg.Options(implementation=implementation, interpret=interpret)

    @jax.jit
    def dense(cache, queries):
        return step.decode_attention(cache, LayerRef.of(cache, 0), queries, slots,
                                     options=options)

    nbytes = (batch * (context // model.hca_ratio) * model.head_dim * 2
              + _window_bytes(model, batch) + _query_bytes(model, batch))
    first, seconds = timed(dense, (cache, queries), repeats)
    impl = ops.choose("dense_decode_attention", model, geometry, options).implementation
    yield Row("hca dense attention", impl, batch, context, first, seconds, nbytes)


def bench_compress(tokens, implementation, interpret, repeats) -> Iterator[Row]:
    """Prefill of `tokens` tokens into one empty slot, CSA main compressor (the widest)."""
    model = flash_layer(LayerKind.CSA)
    spec = next(s for s in compressor_specs(model) if s.name == "csa")
    P = 256
    geometry = cfg.CacheConfig(num_pages=-(-tokens // P), max_slots=1,
                               max_pages_per_seq=-(-tokens // P), page_tokens=P,
                               entry_dtype="bfloat16")
    cache = synthetic.random_cache(model, geometry, [tokens])
    rng = np.random.default_rng(0)
    kv = jnp.asarray(rng.standard_normal((1, 1, tokens, spec.in_width)), jnp.float32)
    gate = jnp.asarray(rng.standard_normal((1, 1, tokens, spec.in_width)), jnp.float32)
    tail = pools.csa_tails(cache).main
    zero = jnp.zeros((1,), jnp.int32)
    options = cfg.Options(implementation=implementation, interpret=interpret)

    @functools.partial(jax.jit, donate_argnums=0)
    def emit(pool, kv, gate):
        return (ops.emit_entries(spec, model, geometry, options, pool=pool,
                                 page_rows=cache.pages.page_table,
                                 layers=jnp.zeros((1,), jnp.int32), tail_kv=tail.kv,
                                 tail_gate=tail.gate, slot_ids=zero, kv=kv, gate=gate,
                                 start=zero, n_new=jnp.full((1,), tokens, jnp.int32),
                                 norm=jnp.ones((1, spec.width), jnp.float32)),)

    nbytes = 2 * tokens * spec.in_width * 4 + (tokens // spec.ratio) * spec.width * 2
    pool = jax.tree.map(jnp.copy, pools.csa_entries(cache).c4)
    first, seconds = timed(emit, (pool, kv, gate), repeats)
    impl = ops.choose("emit_entries", model, geometry, options).implementation
    yield Row("compressor prefill (csa)", impl, 1, tokens, first, seconds, nbytes)


HEADER = (f"{'op':<38} {'impl':<11} {'B':>3} {'context':>8} {'ms/call':>9} {'MB':>9} "
          f"{'GB/s':>8} {'of copy':>8} {'1st call s':>10}")


def _format(row: Row, copy_bw: float) -> str:
    return (f"{row.op:<38} {row.implementation:<11} {row.batch:>3} {row.context:>8} "
            f"{row.seconds * 1e3:>9.3f} {row.bytes / 1e6:>9.2f} {row.bandwidth / 1e9:>8.2f} "
            f"{row.bandwidth / copy_bw:>7.1%} {row.first_s:>10.2f}")


# Row names of the ops "auto" chooses for -> their name in `ops`.
RECORDED_OPS = {"indexer scores": "index_scores", "csa sparse attention": "sparse_decode_attention",
                "hca dense attention": "dense_decode_attention",
                "compressor prefill (csa)": "emit_entries"}


def record(rows: list[Row], backend: str, device: str, path: str = ops.MEASURED_PATH) -> None:
    """Writes the reference and kernel times of each op into the table "auto" reads: per op,
    the largest context timed with both replaces that platform's row; other rows are kept."""
    with open(path) as f:
        table = json.load(f)
    new = []
    for name, op in RECORDED_OPS.items():
        times = {}
        for r in rows:
            if r.op == name:
                times.setdefault(r.context, {})[r.implementation] = r.seconds * 1e3
        both = [c for c, t in times.items() if "reference" in t and len(t) == 2]
        if not both:
            continue
        context = max(both)
        kernel = next(ms for impl, ms in times[context].items() if impl != "reference")
        new.append(dict(platform=backend, op=op, device=device, jax=jax.__version__,
                         shape=f"V4-Flash widths, batch {rows[0].batch}, context {context}",
                         reference_ms=round(times[context]["reference"], 4),
                         kernel_ms=round(kernel, 4)))
    replaced = {(r["platform"], r["op"]) for r in new}
    kept = [r for r in table["measurements"] if (r["platform"], r["op"]) not in replaced]
    table["measurements"] = sorted(kept + new, key=lambda r: (r["platform"], r["op"]))
    # Written whole or not at all: "auto" reads this file on every choice.
    with open(path + ".tmp", "w") as f:
        json.dump(table, f, indent=1)
        f.write("\n")
    os.replace(path + ".tmp", path)
    print(f"recorded {len(new)} of {len(table['measurements'])} rows in {path}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--native", action="store_true",
                   help="the issue's sizes: CSA 32k/128k, HCA 128k/1M, compressor 32k")
    p.add_argument("--implementation", default="auto", choices=ops.IMPLEMENTATIONS)
    p.add_argument("--interpret", action="store_true",
                   help="run Pallas kernels in interpret mode (checks the path; times are not "
                        "kernel times)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--ops", nargs="+", choices=("csa", "hca", "compress"),
                   default=["csa", "hca", "compress"], help="which ops to time")
    p.add_argument("--csa-contexts", type=int, nargs="+")
    p.add_argument("--hca-contexts", type=int, nargs="+")
    p.add_argument("--compress-tokens", type=int, nargs="+")
    p.add_argument("--out", default=os.path.join(HERE, "results", "kernels.json"))
    p.add_argument("--record", action="store_true",
                   help="time every op with the reference and with this platform's kernels and "
                        "record both in v4kv_jax/measured.json (run on the accelerator itself)")
    args = p.parse_args(argv)
    implementations = [args.implementation]
    if args.record:
        if jax.default_backend() not in ("tpu", "gpu") or args.interpret:
            p.error("--record: expected a TPU or GPU backend without --interpret; got "
                    f"{jax.default_backend()!r}")
        implementations = ["reference", ops.resolve("auto")]
    sizes = dict(NATIVE_SIZES if args.native else CPU_SIZES)
    for key, given in (("csa", args.csa_contexts), ("hca", args.hca_contexts),
                       ("compress", args.compress_tokens)):
        if given:
            sizes[key] = tuple(given)

    copy_bw = copy_bandwidth()
    device = jax.devices()[0]
    print(f"backend {jax.default_backend()} ({device.device_kind}); copy bandwidth "
          f"(x + 1 over 1 GiB, read + write): {copy_bw / 1e9:.1f} GB/s", flush=True)
    print(HEADER, flush=True)
    rows = []

    def run(results):
        for row in results:
            rows.append(row)
            print(_format(row, copy_bw), flush=True)

    for impl in implementations:
        for context in sizes["csa"] if "csa" in args.ops else ():
            run(bench_csa(args.batch, context, impl, args.interpret, args.repeats))
        for context in sizes["hca"] if "hca" in args.ops else ():
            run(bench_hca(args.batch, context, impl, args.interpret, args.repeats))
        for tokens in sizes["compress"] if "compress" in args.ops else ():
            run(bench_compress(tokens, impl, args.interpret, args.repeats))

    result = dict(
        backend=jax.default_backend(), device=device.device_kind, jax=jax.__version__,
        machine=platform.machine(), copy_bandwidth_bytes_per_s=copy_bw, native=args.native,
        requested_implementation=args.implementation, interpret=args.interpret,
        rows=[dict(dataclasses.asdict(r), bandwidth_bytes_per_s=r.bandwidth,
                   fraction_of_copy=r.bandwidth / copy_bw) for r in rows])
    write_result(result, args.out)
    if args.record:
        record(rows, jax.default_backend(), device.device_kind)


if __name__ == "__main__":
    main()
