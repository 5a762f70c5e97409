"""HiSparse: the decode step with the C4 entries on the device, with hot sets over the device
pool, and in host memory with hot sets (`CacheConfig.c4_tier`, `hot_rows`).

Per context and configuration: device and host bytes of the cache (the memory report), the
step time (median), the C4 rows copied into the hot sets per step (hot rows whose entry
changed; the first step fills them, later steps fetch the misses) and the compile time. The
layer pattern of V4-Flash at reduced widths (`decode.py`), fp32. The queries are the same
every step, so after the first step the picks change only where new entries are emitted:
the fetches measure the steady state of a slowly moving top-k, not a worst case.

On this CPU "host" and "device" memory are the same RAM: the times show what the hot-set
bookkeeping and the host gathers cost, not a PCIe transfer.

    python benchmarks/tiers.py                       # 8k and 32k; writes tiers.json
    python benchmarks/tiers.py --contexts 4096 --hot-rows 1024 2048
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
from v4kv_jax.testing import synthetic

HERE = os.path.dirname(os.path.abspath(__file__))


def configurations(hot_rows: list[int]):
    """(name, CacheConfig fields) per configuration measured."""
    yield "device", dict(hot_rows=0, c4_tier="device")
    for h in hot_rows:
        yield f"hot {h}", dict(hot_rows=h, c4_tier="device")
        yield f"host+hot {h}", dict(hot_rows=h, c4_tier="host")


def run(args) -> dict:
    model = bench_model(args)
    rows = []
    print(HEADER, flush=True)
    for context in args.contexts:
        pages = -(-(context + args.steps + 1) // 128)
        data = synthetic.SyntheticBatch.draw(model, args.batch, 1, seed=1)
        vectors = data.span(0, 1)
        queries = data.stacked_queries(np.zeros((args.batch, 1), int))
        slots, ones = np.arange(args.batch), np.ones(args.batch, np.int32)
        for name, fields in configurations(args.hot_rows):
            geometry = cfg.CacheConfig(num_pages=args.batch * pages + 1, max_slots=args.batch,
                                       max_pages_per_seq=pages, **fields)
            cache = synthetic.random_cache(model, geometry, [context] * args.batch,
                                           seed=context)
            options = cfg.Options(implementation=args.implementation)
            t0 = time.perf_counter()
            cache, out = step.append_and_attend(cache, vectors, queries, data.weights, slots,
                                                ones, options=options)
            jax.block_until_ready(out)
            compile_s = time.perf_counter() - t0
            times, fetched = [], []
            for _ in range(args.steps):
                before = _held(cache)
                t0 = time.perf_counter()
                cache, out = step.append_and_attend(cache, vectors, queries, data.weights,
                                                    slots, ones, options=options)
                jax.block_until_ready(out)
                times.append(time.perf_counter() - t0)
                if before is not None:
                    fetched.append(int(np.sum(_held(cache) != before)))
            report = pools.memory_report(cache)
            row = dict(context=context, config=name, batch=args.batch, **fields,
                       step_ms=1e3 * statistics.median(times), compile_s=compile_s,
                       fetched_rows_per_step=statistics.median(fetched) if fetched else 0,
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
        rows=rows,
    )


def _held(cache):
    hot = pools.hot_set(cache)
    return None if hot is None else np.asarray(hot.held)


HEADER = (f"{'context':>8} {'config':>14} {'device MiB':>11} {'host MiB':>9} "
          f"{'dev B/tok':>10} {'step ms':>8} {'fetched':>8} {'compile s':>9}")


def _format_row(r) -> str:
    device = sum(r["device_bytes"].values()) / 2**20
    host = sum(r["host_bytes"].values()) / 2**20
    return (f"{r['context']:>8} {r['config']:>14} {device:11.1f} {host:9.1f} "
            f"{r['device_bytes_per_token']:10.1f} {r['step_ms']:8.2f} "
            f"{r['fetched_rows_per_step']:8.0f} {r['compile_s']:9.1f}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--hot-rows", type=int, nargs="+", default=[1024],
                   help="hot rows per CSA layer and request (at least --topk)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--implementation", default="auto", choices=cfg.IMPLEMENTATIONS)
    add_model_arguments(p)
    p.add_argument("--out", default=os.path.join(HERE, "results", "tiers.json"))
    args = p.parse_args(argv)
    write_result(run(args), args.out)


if __name__ == "__main__":
    main()
