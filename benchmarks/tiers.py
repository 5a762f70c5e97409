"""HiSparse: the decode step with every C4 entry on the device against the C4 entries in
host memory with a hot set per CSA layer and request (`CacheConfig.c4_tier`, `hot_rows`).

Per context and configuration: the step time (median), the miss rate (C4 rows copied into
the hot sets per step / picks per step), the bytes those copies move per step, the device
bytes of the C4 entries (the pool's C4 store on the device, or the hot sets), the device
and host bytes of the cache (the memory report) and the compile time. The layer pattern of
V4-Flash at reduced widths (`decode.py`), in the release storage formats by default.

The queries of a step are one of `--query-sets` sets drawn once, in turn, so the picks move
between a few patterns as a model's would between related queries: a hot set that holds
them all stops missing, a smaller one keeps fetching. The first step fills the hot sets and
is not counted.

On this CPU "host" and "device" memory are the same RAM: the times show what the hot-set
bookkeeping and the host gathers cost, not a PCIe transfer.

    python benchmarks/tiers.py                       # 32k and 128k, batch 4; writes tiers.json
    python benchmarks/tiers.py --contexts 8192 --batch 2 --hot-multiples 2
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import jax
import numpy as np
from decode import add_model_arguments, bench_model
from measure import write_result

from v4kv_jax import config as cfg
from v4kv_jax import pools, step
from v4kv_jax.config import FORMAT_SETS
from v4kv_jax.testing import synthetic

HERE = os.path.dirname(os.path.abspath(__file__))


def configurations(hot_rows: list[int], device_hot: bool):
    """(name, CacheConfig fields) per configuration measured."""
    yield "device", dict(hot_rows=0, c4_tier="device")
    for h in hot_rows:
        if device_hot:
            yield f"dev+hot {h}", dict(hot_rows=h, c4_tier="device")
        yield f"host+hot {h}", dict(hot_rows=h, c4_tier="host")


def run(args) -> dict:
    model = bench_model(args)
    hot_rows = [m * model.index_topk for m in args.hot_multiples]
    rows = []
    print(HEADER, flush=True)
    for context in args.contexts:
        pages = -(-(context + args.steps + 2) // 128)
        data = synthetic.SyntheticBatch.draw(model, args.batch, args.query_sets, seed=1)
        vectors = data.span(0, 1)
        queries = [data.stacked_queries(np.full((args.batch, 1), i))
                   for i in range(args.query_sets)]
        slots, ones = np.arange(args.batch), np.ones(args.batch, np.int32)
        for name, fields in configurations(hot_rows, args.device_hot):
            geometry = cfg.CacheConfig.with_formats(
                args.formats, num_pages=args.batch * pages + 1,
                max_slots=args.batch, max_pages_per_seq=pages, **fields)
            cache = synthetic.random_cache(model, geometry, [context] * args.batch,
                                           seed=context)
            options = cfg.Options(implementation=args.implementation)
            t0 = time.perf_counter()
            cache, out = step.append_and_attend(cache, vectors, queries[0], data.weights,
                                                slots, ones, options=options)
            jax.block_until_ready(out)
            compile_s = time.perf_counter() - t0
            times, fetched = [], []
            for i in range(args.steps):
                before = _held(cache)
                t0 = time.perf_counter()
                cache, out = step.append_and_attend(
                    cache, vectors, queries[(i + 1) % args.query_sets], data.weights, slots,
                    ones, options=options)
                jax.block_until_ready(out)
                times.append(time.perf_counter() - t0)
                if before is not None:
                    fetched.append(int(np.sum(_held(cache) != before)))
            report = pools.memory_report(cache)
            picks = model.index_topk * model.num_csa * args.batch
            c4, hot = pools.csa_entries(cache).c4, pools.hot_set(cache)
            row_bytes = c4.map.record_bytes
            c4_device = (0 if hot is None else hot.rows.nbytes) + (
                0 if fields["c4_tier"] == "host" else c4.nbytes)
            fetched_rows = statistics.mean(fetched) if fetched else 0.0
            row = dict(context=context, config=name, batch=args.batch, formats=args.formats,
                       **fields, step_ms=1e3 * statistics.median(times), compile_s=compile_s,
                       fetched_rows_per_step=fetched_rows, miss_rate=fetched_rows / picks,
                       moved_bytes_per_step=fetched_rows * row_bytes,
                       c4_device_bytes=int(c4_device),
                       device_bytes=report.device_bytes, host_bytes=report.host_bytes,
                       device_bytes_per_token=report.device_bytes_per_token,
                       state_bytes_per_request=report.state_bytes_per_request)
            rows.append(row)
            print(_format_row(row), flush=True)
            del cache
    return dict(
        benchmark="tiers",
        machine=dict(platform=platform.platform(), cpus=os.cpu_count(),
                     backend=jax.default_backend(), jax=jax.__version__),
        model=dict(layers=model.num_layers, csa=model.num_csa, hca=model.num_hca,
                   head_dim=model.head_dim, topk=model.index_topk),
        settings={k: v for k, v in vars(args).items() if k != "out"},
        rows=rows,
    )


def _held(cache):
    hot = pools.hot_set(cache)
    return None if hot is None else np.asarray(hot.held)


HEADER = (f"{'context':>8} {'config':>14} {'step ms':>8} {'miss %':>7} {'moved KiB':>10} "
          f"{'C4 dev MiB':>11} {'device MiB':>11} {'host MiB':>9} {'dev B/tok':>10} "
          f"{'compile s':>9}")


def _format_row(r) -> str:
    device = sum(r["device_bytes"].values()) / 2**20
    host = sum(r["host_bytes"].values()) / 2**20
    return (f"{r['context']:>8} {r['config']:>14} {r['step_ms']:8.1f} "
            f"{100 * r['miss_rate']:7.2f} {r['moved_bytes_per_step'] / 1024:10.1f} "
            f"{r['c4_device_bytes'] / 2**20:11.1f} {device:11.1f} {host:9.1f} "
            f"{r['device_bytes_per_token']:10.1f} {r['compile_s']:9.1f}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[32768, 131072])
    p.add_argument("--hot-multiples", type=int, nargs="+", default=[1, 2, 4],
                   help="hot rows per CSA layer and request, in multiples of --topk")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--query-sets", type=int, default=4, help="query sets the steps cycle")
    p.add_argument("--formats", default="release", choices=tuple(FORMAT_SETS))
    p.add_argument("--device-hot", action="store_true",
                   help="also hot sets over C4 entries on the device (the bookkeeping alone)")
    p.add_argument("--implementation", default="auto", choices=cfg.IMPLEMENTATIONS)
    add_model_arguments(p)
    p.add_argument("--out", default=os.path.join(HERE, "results", "tiers.json"))
    args = p.parse_args(argv)
    write_result(run(args), args.out)


if __name__ == "__main__":
    main()
