"""Decode-step time of the V4 cache against a dense cache and against the memory roofline.

One step = the cache update of every layer (window, tails, entries emitted at block edges)
+ the attention of every layer (CSA: indexer over all visible keys, top-k gather; HCA: all
C128 entries; every layer: the window). Layer pattern of V4-Flash (2 SWA, 21 CSA, 20 HCA)
at reduced widths. The dense baseline keeps one hd-vector per token per layer (MQA, K = V)
and attends over all of them.

Roofline: bytes the step must read / read bandwidth, the bandwidth measured in the same run
by a jitted sum over a 1 GiB array. The bytes follow the storage formats (`--formats`, one
row per context and format): "release" (fp8_latent entries and window, fp4_index indexer
keys, online HCA tail), "float32", "bfloat16" or "float16".

    python benchmarks/decode.py                  # 1k, 8k, 32k, 128k; writes decode.json
    python benchmarks/decode.py --contexts 1024 8192 --batch 2
    python benchmarks/decode.py --contexts 131072 --formats float32 release
    python benchmarks/decode.py --devices 8 --contexts 1024 8192   # data-parallel rows

With `--devices N` (N > 1) each context runs the step data-parallel over a mesh of N devices
(`v4kv_jax.mesh`; on CPU, N host devices made with XLA_FLAGS), `--batch` requests on each,
next to the same step on one device with `--batch` requests: per-device bytes and times,
and the collectives of the compiled sharded step. On a CPU the N host devices share the
same cores and memory, so the times say what the sharding costs, not how it scales.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time


def _devices_argument(argv) -> int:
    """--devices N from the command line, read before jax is imported (XLA_FLAGS)."""
    for i, a in enumerate(argv):
        if a == "--devices" and i + 1 < len(argv) and argv[i + 1].isdigit():
            return int(argv[i + 1])
        if a.startswith("--devices=") and a.split("=", 1)[1].isdigit():
            return int(a.split("=", 1)[1])
    return 1


if __name__ == "__main__" and _devices_argument(sys.argv[1:]) > 1:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_"
                               f"device_count={_devices_argument(sys.argv[1:])}")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from measure import hlo_counts, read_bandwidth, write_result  # noqa: E402

from v4kv_jax import append, pools, step  # noqa: E402
from v4kv_jax import config as cfg  # noqa: E402
from v4kv_jax import mesh as meshes  # noqa: E402
from v4kv_jax.config import FORMAT_SETS  # noqa: E402
from v4kv_jax.pools import storage  # noqa: E402
from v4kv_jax.testing import synthetic  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def bench_model(args) -> cfg.AttentionConfig:
    return cfg.flash(hidden_size=1024, num_heads=args.heads, head_dim=args.head_dim,
                     rope_dim=args.rope_dim, q_lora_rank=256, o_groups=2, o_lora_rank=128,
                     index_heads=args.index_heads, index_head_dim=args.index_head_dim,
                     index_topk=args.topk)


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """The reduced widths `bench_model` reads."""
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--rope-dim", type=int, default=64,
                   help="RoPE dims (head_dim - rope_dim a multiple of 64 for fp8_latent)")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--index-heads", type=int, default=8)
    p.add_argument("--index-head-dim", type=int, default=64)
    p.add_argument("--topk", type=int, default=512)


def timed(fn, *args, repeats: int):
    """(first call seconds incl. compile, median of `repeats` later calls, last result)."""
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    first = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return first, statistics.median(times), out


def v4_step_bytes(model, geometry, batch: int, context: int) -> int:
    """Bytes one decode step must read in the geometry's storage formats: every visible
    indexer key, the k picked C4 entries, every visible C128 entry and the window, per CSA /
    HCA / every layer."""
    entry, key, window = (storage.codec(model, geometry, name).row_bytes
                          for name in ("csa", "csa_index", "window"))
    n_c4 = context // model.csa_ratio
    per_seq = (
        model.num_layers * model.window * window
        + model.num_csa * (n_c4 * key + min(model.index_topk, n_c4) * entry)
        + model.num_hca * (context // model.hca_ratio) * entry
    )
    return batch * per_seq


def bench_geometry(formats: str, context: int, args) -> cfg.CacheConfig:
    """`--batch` slots of `context` tokens plus the timed steps, in pages of 128 tokens."""
    pages_per_seq = -(-(context + args.steps + 1) // 128)
    return cfg.CacheConfig.with_formats(
        formats, num_pages=args.batch * pages_per_seq + 1, max_slots=args.batch,
        max_pages_per_seq=pages_per_seq, page_tokens=128)


def make_v4_step(model, options: cfg.Options, mesh=None):
    def v4_step(cache, vectors, queries, weights):
        slots = jnp.arange(cache.geometry.max_slots)
        cache, plan = append.begin_append(cache, slots, jnp.ones_like(slots), 1)
        cache = append.append_layers(cache, plan, vectors, weights, options)
        cache = append.end_append(cache, plan)
        return cache, step.decode_attention_all(cache, queries, plan.slot_ids, options=options)

    if mesh is None:
        return jax.jit(v4_step, donate_argnums=0)
    rows = meshes.P(None, meshes.DATA)
    queries = step.Queries(q=rows, sink=meshes.P(), index_q=rows, index_weights=rows)
    return jax.jit(meshes.shard_program(v4_step, mesh, (meshes.CACHE, rows, queries, meshes.P()),
                                        (meshes.CACHE, rows)), donate_argnums=0)


def run_devices(args) -> dict:
    """The decode step on one device (`--batch` requests) and data-parallel over
    `--devices` devices (`--batch` requests each)."""
    model, n = bench_model(args), args.devices
    if jax.device_count() < n:
        raise SystemExit(f"--devices: expected at most {jax.device_count()} devices here; "
                         f"got {n}")
    mesh = meshes.data_mesh(n)
    options = cfg.Options(implementation=args.implementation)
    print(f"{'context':>8} {'formats':>8} {'batch':>5} {'MiB/device':>10} {'1 device ms':>11} "
          f"{f'{n} devices ms':>13} {'collectives':>11}", flush=True)
    rows = []
    for context, formats in [(c, f) for c in args.contexts for f in args.formats]:
        geometry = bench_geometry(formats, context, args)
        data = synthetic.SyntheticBatch.draw(model, n * args.batch, 1, seed=1)
        times, found = {}, {}
        for devices in (1, n):
            rows_now = np.arange(devices * args.batch)
            vectors = data.take(np.zeros(len(rows_now), int), rows_now)
            queries = data.stacked_queries(np.zeros(len(rows_now), int), rows_now)
            shards = [synthetic.random_cache(model, geometry, [context] * args.batch,
                                             seed=context + i) for i in range(devices)]
            per_device = pools.memory_report(shards[0])  # before the step donates it
            if devices == 1:
                fn, cache = make_v4_step(model, options), shards[0]
            else:
                fn = make_v4_step(model, options, mesh)
                cache = meshes.assemble({i: jax.device_put(c, meshes.shard_devices(mesh)[i])
                                         for i, c in enumerate(shards)}, mesh)
                found = meshes.collectives(
                    fn.lower(cache, vectors, queries, data.weights).compile().as_text())
            del shards
            cache, out = fn(cache, vectors, queries, data.weights)  # compiles
            jax.block_until_ready(out)
            dt = []
            for _ in range(args.steps):
                t0 = time.perf_counter()
                cache, out = fn(cache, vectors, queries, data.weights)
                jax.block_until_ready(out)
                dt.append(time.perf_counter() - t0)
            times[devices] = 1e3 * statistics.median(dt)
            del cache, out
        row = dict(context=context, formats=formats, batch_per_device=args.batch, devices=n,
                   bytes_read_per_device=v4_step_bytes(model, geometry, args.batch, context),
                   cache_bytes_per_device=per_device.allocated_bytes
                   + per_device.state_bytes_total,
                   one_device_ms=times[1], mesh_ms=times[n],
                   collectives=found)
        rows.append(row)
        print(f"{context:>8} {formats:>8} {args.batch:>5} "
              f"{row['bytes_read_per_device'] / 2**20:10.1f} {times[1]:11.2f} {times[n]:13.2f} "
              f"{sum(found.values()):>11}", flush=True)
    return dict(benchmark="decode_devices", devices=n, note=(
        "host devices of one CPU share its cores and memory: the times say what the "
        "sharding costs, not how it scales"),
        machine=dict(platform=platform.platform(), cpus=os.cpu_count(),
                     backend=jax.default_backend(), jax=jax.__version__), rows=rows)


def make_dense_step(model):
    scale = model.head_dim**-0.5

    def dense_step(kcache, length, new_kv, q):
        """kcache [n_layers, B, L, hd]; new_kv [n_layers, B, hd]; q [n_layers, B, H, hd]."""
        kcache = jax.lax.dynamic_update_slice_in_dim(kcache, new_kv[:, :, None], length, axis=2)
        valid = jnp.arange(kcache.shape[2]) <= length

        def layer(_, x):
            k, qq = x
            logits = jnp.einsum("bhd,bld->bhl", qq, k) * scale
            logits = jnp.where(valid, logits, -jnp.inf)
            p = jax.nn.softmax(logits, axis=-1)
            return None, jnp.einsum("bhl,bld->bhd", p, k)

        _, out = jax.lax.scan(layer, None, (kcache, q))
        return kcache, out

    return jax.jit(dense_step, donate_argnums=0)


def run(args) -> dict:
    model = bench_model(args)
    bandwidth = read_bandwidth()
    print(f"read bandwidth (jitted sum over 1 GiB): {bandwidth / 2**30:.1f} GiB/s", flush=True)
    print(HEADER, flush=True)
    rows = []
    for context, formats in [(c, f) for c in args.contexts for f in args.formats]:
        geometry = bench_geometry(formats, context, args)
        cache = synthetic.random_cache(model, geometry, [context] * args.batch, seed=context)
        data = synthetic.SyntheticBatch.draw(model, args.batch, 1, seed=1)
        vectors, queries = data.span(0, 1), data.stacked_queries(
            np.zeros((args.batch, 1), int))
        v4 = make_v4_step(model, cfg.Options(implementation=args.implementation))
        t0 = time.perf_counter()
        cache, out = v4(cache, vectors, queries, data.weights)
        jax.block_until_ready(out)
        compile_s = time.perf_counter() - t0
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            cache, out = v4(cache, vectors, queries, data.weights)
            jax.block_until_ready(out)
            times.append(time.perf_counter() - t0)
        v4_ms = 1e3 * statistics.median(times)
        counts = hlo_counts(v4.lower(cache, vectors, queries, data.weights).compile())
        del cache
        need = v4_step_bytes(model, geometry, args.batch, context)
        roofline_ms = 1e3 * need / bandwidth

        dense_ms = dense_compile = None
        dense_bytes = model.num_layers * args.batch * (context + 1) * model.head_dim * 4
        measured = formats != args.formats[0]  # the dense baseline ignores the formats
        if not (args.skip_dense or measured) and dense_bytes < args.dense_limit_gib * 2**30:
            kc = jnp.zeros((model.num_layers, args.batch, context + 1, model.head_dim),
                           jnp.float32)
            kc = kc + jax.random.normal(jax.random.PRNGKey(0), (1, 1, 1, model.head_dim))
            dense = make_dense_step(model)
            new_kv = jnp.ones((model.num_layers, args.batch, model.head_dim))
            q = jnp.asarray(queries.q[:, :, 0])
            t0 = time.perf_counter()
            kc, o = dense(kc, context, new_kv, q)
            jax.block_until_ready(o)
            dense_compile = time.perf_counter() - t0
            dt = []
            for _ in range(args.steps):
                t0 = time.perf_counter()
                kc, o = dense(kc, context, new_kv, q)
                jax.block_until_ready(o)
                dt.append(time.perf_counter() - t0)
            dense_ms = 1e3 * statistics.median(dt)
            del kc
        if dense_ms is None and rows and rows[-1]["context"] == context:
            dense_ms, dense_compile = rows[-1]["dense_ms"], rows[-1]["dense_compile_s"]
        row = dict(context=context, formats=formats, implementation=args.implementation,
                   batch=args.batch, v4_ms=v4_ms,
                   v4_compile_s=compile_s,
                   v4_bytes_read=need, roofline_ms=roofline_ms,
                   v4_over_roofline=v4_ms / roofline_ms, dense_ms=dense_ms,
                   dense_compile_s=dense_compile, dense_bytes_read=dense_bytes,
                   speedup_vs_dense=(dense_ms / v4_ms) if dense_ms else None,
                   hlo=counts, fusions_per_layer=counts["fusions"] / model.num_layers)
        rows.append(row)
        print(_format_row(row), flush=True)
    return dict(
        benchmark="decode",
        machine=dict(platform=platform.platform(), cpus=os.cpu_count(),
                     backend=jax.default_backend(), jax=jax.__version__),
        model=dict(layers=model.num_layers, csa=model.num_csa, hca=model.num_hca,
                   head_dim=model.head_dim, heads=model.num_heads,
                   index=f"{model.index_heads}x{model.index_head_dim}", topk=model.index_topk,
                   window=model.window),
        read_bandwidth_gib_s=bandwidth / 2**30,
        rows=rows,
    )


HEADER = (f"{'context':>8} {'formats':>8} {'batch':>5} {'MiB read':>9} {'v4 ms':>8} "
          f"{'roofline':>9} {'x roof':>7} {'dense ms':>9} {'speedup':>8} {'compile s':>9} "
          f"{'ops':>5} {'fusions':>7} {'/layer':>6}")
# ops: operations of the step's optimized HLO entry computation (parameters, constants, tuples
# and bitcasts not counted); fusions: its fusions with every loop body and branch counted once;
# /layer: fusions per layer.


def _format_row(r) -> str:
    dense = f"{r['dense_ms']:9.2f}" if r["dense_ms"] else f"{'-':>9}"
    speed = f"{r['speedup_vs_dense']:7.1f}x" if r["speedup_vs_dense"] else f"{'-':>8}"
    return (f"{r['context']:>8} {r['formats']:>8} {r['batch']:>5} "
            f"{r['v4_bytes_read'] / 2**20:9.1f} {r['v4_ms']:8.2f} {r['roofline_ms']:8.2f}m "
            f"{r['v4_over_roofline']:6.2f}x {dense} {speed} {r['v4_compile_s']:9.1f} "
            f"{r['hlo']['entry_ops']:>5} {r['hlo']['fusions']:>7} {r['fusions_per_layer']:6.1f}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192, 32768, 131072])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--formats", nargs="+", choices=tuple(FORMAT_SETS),
                   default=["float32", "release"],
                   help="storage formats, one row each (CacheConfig.with_formats)")
    p.add_argument("--implementation", default="auto", choices=cfg.IMPLEMENTATIONS,
                   help="the ops' implementation (auto: Pallas on TPU / GPU, jnp on CPU)")
    add_model_arguments(p)
    p.add_argument("--skip-dense", action="store_true")
    p.add_argument("--dense-limit-gib", type=float, default=12.0)
    p.add_argument("--devices", type=int, default=1,
                   help="run the step data-parallel over this many devices, --batch requests "
                   "each, next to one device (default 1: off)")
    p.add_argument("--out", default=None,
                   help="JSON file (default results/decode.json, decode_devices.json)")
    args = p.parse_args(argv)
    if args.devices < 1:
        p.error(f"--devices: expected at least 1; got {args.devices}")
    result = run_devices(args) if args.devices > 1 else run(args)
    write_result(result, args.out or os.path.join(
        HERE, "results", "decode_devices.json" if args.devices > 1 else "decode.json"))


if __name__ == "__main__":
    main()
