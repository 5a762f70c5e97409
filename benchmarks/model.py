"""The V4 attention stack in v4kv (Flax NNX + the paged cache) against transformers 5.23.0.

Config S: 8 attention layers [SWA, SWA, CSA, HCA, CSA, HCA, CSA, HCA], hidden 512, 8 heads of
128 (RoPE 32), q rank 256, 4 output groups of 128, window 128, ratios 4 / 128, indexer
8 heads x 64, top-k 128, fp32, batch 4. Both sides run the same weights as the stack
x -> x + attn(RMSNorm(x)) per layer (transformers: `DeepseekV4Attention` + `DeepseekV4RMSNorm`
on a `DynamicCache`, eager attention, `--torch-threads` threads).

Measured, side by side:
  prefill tokens/s   from an empty cache to each context, both in `--chunk`-token chunks
                     (v4kv: one compiled program for every chunk)
  decode step        median over `--steps` single-token steps of the whole batch, at each
                     decode context (the cache filled by a real prefill on both sides;
                     transformers is skipped where its prefill passes `--torch-limit-s`);
                     the v4kv cache is sized to the next power of two of the context
                     (`--capacity bucket`: part of the reference attention's cost follows
                     the capacity) or to the longest context for all (`shared`)
  roofline           (weights + cache bytes one decode step must read) / read bandwidth,
                     the bandwidth measured in the same run by a jitted sum over 1 GiB
  projections        the v4kv stack's projections alone (no cache, no attention), to show
                     how much of a step is the cache + attention of `v4kv_jax.step`

    python benchmarks/model.py                       # writes benchmarks/results/model.json
    python benchmarks/model.py --decode-contexts 1024 4096 --prefill-contexts 1024

Run it on an otherwise idle machine: with another process busy, torch's two OpenMP threads
wait on each other at every barrier (a 1k decode step went from about 25 ms to 1 s here), and
XLA's thread pool suffers less but too. The load average is printed and stored at the start
and the end.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from measure import hlo_counts, read_bandwidth, write_result

import v4kv_jax as v4
from v4kv_jax import append, interop
from v4kv_jax.nn import Decoder, ModelConfig

HERE = os.path.dirname(os.path.abspath(__file__))
# Ratios (this machine's absolute speed moves by 3x from one day to the next).
TARGETS = dict(decode_speedup_at_4k=8.0, decode_x_roofline_at_4k=2.0,
               prefill_speedup_at_4k=5.0)


def config_s() -> v4.AttentionConfig:
    return v4.AttentionConfig(
        hidden_size=512, num_heads=8, head_dim=128, rope_dim=32, q_lora_rank=256, o_groups=4,
        o_lora_rank=128, window=128, compress_ratios=(0, 0, 4, 128, 4, 128, 4, 128),
        csa_ratio=4, hca_ratio=128, index_heads=8, index_head_dim=64, index_topk=128)


def step_bytes(model: Decoder, batch: int, context: int) -> tuple[int, int]:
    """(weight bytes, cache bytes) one decode step at `context` tokens must read: every
    attention weight; per sequence the window of every layer, and per CSA layer every
    visible indexer key and the k picked C4 entries, per HCA layer every C128 entry."""
    _, params = nnx.split(model)
    weights = sum(x.nbytes for x in jax.tree.leaves(params))
    weights -= model.embed[...].nbytes + (0 if model.lm_head is None else
                                          model.lm_head[...].nbytes)
    c = model.config.attn_config
    n_c4 = context // c.csa_ratio
    per_seq = (c.num_layers * c.window * c.head_dim
               + c.num_csa * (n_c4 * c.index_head_dim + min(c.index_topk, n_c4) * c.head_dim)
               + c.num_hca * (context // c.hca_ratio) * c.head_dim) * 4
    return weights, batch * per_seq


class V4Stack:
    """The attention stack of a `Decoder` (no embedding, MLP or head) on a paged cache."""

    def __init__(self, model: Decoder, batch: int, capacity: int, chunk: int):
        self.graphdef, self.params = nnx.split(model)
        self.config = model.config.attn_config
        self.batch, self.chunk = batch, chunk
        pages = -(-capacity // 128)
        self.geometry = v4.CacheConfig(num_pages=batch * pages, max_slots=batch,
                                       max_pages_per_seq=pages)

        def run(params, cache, x, n_new):
            m = nnx.merge(self.graphdef, params)
            cache, plan = append.begin_append(cache, jnp.arange(batch), n_new, x.shape[1])
            cache, y = m.layers(x, cache, plan)
            return append.end_append(cache, plan), y

        self._run = jax.jit(run, donate_argnums=1)
        self._counts = {}

    def new_cache(self):
        cache = v4.init_cache(self.config, self.geometry)
        for s in range(self.batch):
            cache = v4.reset_slot(cache, s)
        return cache

    def __call__(self, cache, x):
        """Appends x [B, T, D] (T = 1 or the chunk); returns (cache, y)."""
        if x.shape[1] not in self._counts:  # made once: a decode loop keeps its arrays
            self._counts[x.shape[1]] = jnp.full((self.batch,), x.shape[1], jnp.int32)
        return self._run(self.params, cache, x, self._counts[x.shape[1]])

    def prefill(self, x) -> tuple[object, float]:
        """A fresh cache filled with x [B, L, D] in chunks; (cache, seconds)."""
        cache = self.new_cache()
        jax.block_until_ready(cache)
        length = x.shape[1]
        t0 = time.perf_counter()
        for start in range(0, length - length % self.chunk, self.chunk):
            cache, y = self(cache, x[:, start:start + self.chunk])
        for start in range(length - length % self.chunk, length):  # a tail shorter than a chunk
            cache, y = self(cache, x[:, start:start + 1])
        jax.block_until_ready((cache, y))
        return cache, time.perf_counter() - t0


def projections_only(model: Decoder):
    """A jitted function running only the stack's projections (vectors and the grouped
    output projection of every layer, with the query standing in for the attention output;
    every vector is summed into the result so that no projection is left out), layers
    unrolled."""
    if model.scan_layers:
        unrolled = Decoder(model.config, rngs=nnx.Rngs(0), scan_layers=False)
        for layer in range(model.config.num_layers):
            interop.load_attention(unrolled, interop.attention_state(model, layer=layer),
                                   layer=layer)
        model = unrolled
    graphdef, params = nnx.split(model)

    def run(params, x):
        m = nnx.merge(graphdef, params)
        positions = jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape[:2])
        for blocks in m.groups:
            for block in blocks:
                attn = block.attn
                vectors, queries, _ = attn.vectors(x, positions)
                # Every vector feeds the result, so none of the projections is dropped.
                rest = sum(jnp.sum(v, axis=-1, keepdims=True)
                           for v in jax.tree.leaves((vectors, queries.index_q,
                                                     queries.index_weights))
                           if v.ndim == 3 and v.shape[:2] == x.shape[:2])
                x = x + attn.output(queries.q) + 1e-6 * rest
        return x

    return jax.jit(run), params


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def inputs(context: int, steps: int, batch: int, hidden: int) -> np.ndarray:
    """The hidden states both sides run at `context`: prefill + `steps` decode tokens."""
    rng = np.random.default_rng(context)
    return rng.standard_normal((batch, context + steps + 1, hidden)).astype(np.float32)


PARITY_TOKENS = 256


def torch_worker(args) -> None:
    """The transformers side, in its own process (torch's and XLA's CPU thread pools both
    spin while idle and slow each other down when they share one). Reads the weights the
    main process wrote, writes timings and the parity outputs."""
    import torch

    from v4kv_jax.interop.torch_reference import TransformersAttention

    torch.set_num_threads(args.torch_threads)
    config = config_s()
    weights = np.load(os.path.join(args.torch_worker, "weights.npz"))
    ref = TransformersAttention(config, residual=True)
    for layer in range(config.num_layers):
        prefix = f"{layer}/"
        ref.load(layer, {k[len(prefix):]: weights[k] for k in weights.files
                         if k.startswith(prefix)})
    B, D = args.batch, config.hidden_size
    x = np.random.default_rng(1).standard_normal((B, PARITY_TOKENS, D)).astype(np.float32)
    np.save(os.path.join(args.torch_worker, "parity.npy"), ref.run_chunks(x, [PARITY_TOKENS]))
    rows, gave_up = {}, False
    for context in contexts(args):
        if gave_up:
            rows[context] = dict(torch_skipped="a shorter context's prefill passed the limit")
            continue
        xs = inputs(context, args.steps, B, D)
        cache = ref.new_cache()
        size = context if context <= args.torch_one_shot_max else args.chunk
        t0 = time.perf_counter()
        for start in range(0, context, size):
            ref.forward(xs[:, start:start + size], cache, start)
            if time.perf_counter() - t0 > args.torch_limit_s:
                gave_up = True
                break
        seconds = time.perf_counter() - t0
        if gave_up:
            rows[context] = dict(torch_skipped=f"prefill passed {args.torch_limit_s:.0f} s")
            continue
        row = dict(torch_prefill_tok_s=B * context / seconds)
        if context in args.decode_contexts:
            times = []
            for i in range(args.steps):
                t0 = time.perf_counter()
                ref.forward(xs[:, context + i:context + i + 1], cache, context + i)
                times.append(time.perf_counter() - t0)
            row["torch_decode_ms"] = 1e3 * statistics.median(times)
        rows[context] = row
        print(f"  transformers at {context}: {row}", flush=True)
        del cache
    with open(os.path.join(args.torch_worker, "torch.json"), "w") as f:
        json.dump({str(k): v for k, v in rows.items()}, f)


def run_torch(model: Decoder, args) -> tuple[dict, np.ndarray]:
    """Runs `torch_worker` in a subprocess on the model's weights."""
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        np.savez(os.path.join(tmp, "weights.npz"), **{
            f"{layer}/{k}": v for layer in range(model.config.num_layers)
            for k, v in interop.attention_state(model, layer=layer).items()})
        cmd = [sys.executable, os.path.abspath(__file__), "--torch-worker", tmp,
               "--batch", str(args.batch), "--steps", str(args.steps), "--chunk",
               str(args.chunk), "--torch-threads", str(args.torch_threads), "--torch-limit-s",
               str(args.torch_limit_s), "--torch-one-shot-max", str(args.torch_one_shot_max),
               "--prefill-contexts", *map(str, args.prefill_contexts),
               "--decode-contexts", *map(str, args.decode_contexts)]
        subprocess.run(cmd, check=True)
        with open(os.path.join(tmp, "torch.json")) as f:
            rows = {int(k): v for k, v in json.load(f).items()}
        return rows, np.load(os.path.join(tmp, "parity.npy"))


def contexts(args) -> list[int]:
    return sorted(set(args.prefill_contexts) | set(args.decode_contexts))


def run(args) -> dict:
    jax.config.update("jax_default_matmul_precision", "highest")
    config = config_s()
    model = Decoder(ModelConfig(config, vocab_size=8), rngs=nnx.Rngs(0), bias_scale=0.5,
                    scan_layers=args.scan)
    B, D = args.batch, config.hidden_size
    load_start = os.getloadavg()
    print(f"load average at start: {load_start[0]:.2f}"
          + ("  (not idle: timings will suffer, torch's most)" if load_start[0] > 0.5 else ""),
          flush=True)
    torch_rows, torch_parity = ({}, None) if args.skip_torch else run_torch(model, args)
    bandwidth = read_bandwidth()
    print(f"read bandwidth (jitted sum over 1 GiB): {bandwidth / 2**30:.1f} GiB/s; "
          f"{jax.default_backend()} backend, {os.cpu_count()} CPUs, layers "
          f"{'scanned' if args.scan else 'unrolled'}", flush=True)
    stacks: dict[int, V4Stack] = {}

    def stack_for(context: int) -> V4Stack:
        """The stack whose cache holds `context` + the decode steps: one shared capacity
        (the longest context's) or the context's power-of-two bucket (+ the steps)."""
        if args.capacity == "shared":
            need = max(contexts(args)) + args.steps + 2
        else:
            need = (1 << (context - 1).bit_length()) + args.steps + 2
        if need not in stacks:
            stack = V4Stack(model, B, need, args.chunk)
            warm = stack.new_cache()
            warm, y = stack(warm, jnp.zeros((B, args.chunk, D), jnp.float32))  # compiles
            warm, y = stack(warm, jnp.zeros((B, 1, D), jnp.float32))  # the decode program
            jax.block_until_ready(y)
            stack.counts = hlo_counts(stack._run.lower(
                stack.params, warm, jnp.zeros((B, 1, D), jnp.float32),
                jnp.ones((B,), jnp.int32)).compile())
            stacks[need] = stack
        return stacks[need]

    x = np.random.default_rng(1).standard_normal((B, PARITY_TOKENS, D)).astype(np.float32)
    parity = None
    if torch_parity is not None:
        small = V4Stack(model, B, PARITY_TOKENS, PARITY_TOKENS)
        _, got = small(small.new_cache(), jnp.asarray(x))
        parity = float(np.abs(np.asarray(got) - torch_parity).max())
        print(f"same weights, same inputs: max |v4kv - transformers| over {PARITY_TOKENS} "
              f"tokens = {parity:.2e} (outputs up to {np.abs(torch_parity).max():.1f})",
              flush=True)
    proj, proj_params = projections_only(model)
    rng = np.random.default_rng(2)
    proj_decode = jnp.asarray(x[:, :1])
    proj_chunk = jnp.asarray(rng.standard_normal((B, args.chunk, D)).astype(np.float32))
    jax.block_until_ready((proj(proj_params, proj_decode), proj(proj_params, proj_chunk)))
    projections = dict(
        decode_ms=1e3 * median_time(lambda: proj(proj_params, proj_decode), args.steps),
        prefill_tok_s=B * args.chunk / median_time(lambda: proj(proj_params, proj_chunk), 3))

    print(HEADER, flush=True)
    rows = []
    for context in contexts(args):
        xs = inputs(context, args.steps, B, D)
        stack = stack_for(context)
        cache, v4_prefill_s = stack.prefill(jnp.asarray(xs[:, :context]))
        row = dict(context=context, capacity=stack.geometry.max_seq_len,
                   v4_prefill_tok_s=B * context / v4_prefill_s)
        if context in args.decode_contexts:
            token = [jnp.asarray(xs[:, context + i:context + i + 1]) for i in range(args.steps)]
            times = []
            for i in range(args.steps):
                t0 = time.perf_counter()
                cache, y = stack(cache, token[i])
                jax.block_until_ready(y)
                times.append(time.perf_counter() - t0)
            weights, cache_bytes = step_bytes(model, B, context)
            row.update(v4_decode_ms=1e3 * statistics.median(times), weight_bytes=weights,
                       cache_bytes=cache_bytes,
                       roofline_ms=1e3 * (weights + cache_bytes) / bandwidth)
            row["v4_x_roofline"] = row["v4_decode_ms"] / row["roofline_ms"]
            row["decode_hlo"] = stack.counts
        del cache
        row.update(torch_rows.get(context, {}))
        if "torch_decode_ms" in row and "v4_decode_ms" in row:
            row["decode_speedup"] = row["torch_decode_ms"] / row["v4_decode_ms"]
        rows.append(row)
        print(format_row(row), flush=True)

    result = dict(
        benchmark="model",
        machine=dict(platform=platform.platform(), cpus=os.cpu_count(),
                     backend=jax.default_backend(), jax=jax.__version__,
                     torch_threads=args.torch_threads, load_average_start=load_start[0],
                     load_average_end=os.getloadavg()[0]),
        config="S", batch=B, chunk=args.chunk, decode_steps=args.steps,
        capacity=args.capacity,
        layers="scanned" if args.scan else "unrolled",
        read_bandwidth_gib_s=bandwidth / 2**30, parity_max_abs=parity,
        projections_only=projections, rows=rows,
        kinds=[k.name for k in config.layer_kinds],
    )
    result["targets"] = check_targets(rows)
    for stack in stacks.values():
        c = stack.counts
        print(f"decode program, capacity {stack.geometry.max_seq_len}: {c['entry_ops']} "
              f"operations in the entry computation ({c['entry_fusions']} fusions, "
              f"{c['entry_conditionals']} conditionals, {c['entry_whiles']} loops); "
              f"{c['fusions']} fusions with loop and branch bodies, "
              f"{c['fusions'] / config.num_layers:.0f} per layer (optimized HLO, "
              f"{jax.default_backend()})")
    print(f"load average at the end: {result['machine']['load_average_end']:.2f}")
    print(HEADER_NOTE.format(**projections))
    for name, t in result["targets"].items():
        print(f"target {name}: {t['reached']} (want {t['want']}) -> "
              f"{'met' if t['met'] else 'NOT met'}")
    return result


def check_targets(rows) -> dict:
    at4k = next((r for r in rows if r["context"] == 4096), None)
    out = {}
    if at4k is None:
        return out
    if "decode_speedup" in at4k:
        out["decode_speedup_at_4k"] = dict(
            reached=round(at4k["decode_speedup"], 2),
            want=f">= {TARGETS['decode_speedup_at_4k']}",
            met=at4k["decode_speedup"] >= TARGETS["decode_speedup_at_4k"])
    if "v4_x_roofline" in at4k:
        out["decode_x_roofline_at_4k"] = dict(
            reached=round(at4k["v4_x_roofline"], 2),
            want=f"<= {TARGETS['decode_x_roofline_at_4k']}",
            met=at4k["v4_x_roofline"] <= TARGETS["decode_x_roofline_at_4k"])
    if at4k.get("torch_prefill_tok_s"):
        ratio = at4k["v4_prefill_tok_s"] / at4k["torch_prefill_tok_s"]
        out["prefill_speedup_at_4k"] = dict(
            reached=round(ratio, 2), want=f">= {TARGETS['prefill_speedup_at_4k']}",
            met=ratio >= TARGETS["prefill_speedup_at_4k"])
    return out


HEADER = (f"{'context':>8} | {'prefill tok/s':>21} | {'decode ms':>17} | {'speedup':>7} | "
          f"{'roofline ms':>11} | {'x roof':>6}\n"
          f"{'':>8} | {'v4kv':>10} {'transf.':>10} | {'v4kv':>8} {'transf.':>8} | "
          f"{'':>7} | {'':>11} | {'':>6}")
HEADER_NOTE = ("v4kv projections alone (no cache, no attention): decode {decode_ms:.2f} ms, "
               "prefill {prefill_tok_s:,.0f} tok/s")


def _f(value, fmt, width):
    return f"{value:{width}{fmt}}" if value is not None else f"{'-':>{width}}"


def format_row(r) -> str:
    return (f"{r['context']:>8} | {_f(r.get('v4_prefill_tok_s'), ',.0f', 10)} "
            f"{_f(r.get('torch_prefill_tok_s'), ',.0f', 10)} | "
            f"{_f(r.get('v4_decode_ms'), '.2f', 8)} {_f(r.get('torch_decode_ms'), '.2f', 8)} | "
            f"{_f(r.get('decode_speedup'), '.1f', 6)}x | {_f(r.get('roofline_ms'), '.2f', 11)} | "
            f"{_f(r.get('v4_x_roofline'), '.2f', 5)}x"
            + (f"   (transformers skipped: {r['torch_skipped']})" if "torch_skipped" in r else ""))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prefill-contexts", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--decode-contexts", type=int, nargs="+", default=[1024, 4096, 16384, 65536])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=20, help="decode steps timed per context")
    p.add_argument("--chunk", type=int, default=512, help="v4kv prefill chunk")
    p.add_argument("--capacity", choices=["bucket", "shared"], default="bucket",
                   help="cache capacity per context: the next power of two (one compiled "
                        "program per bucket) or the longest context's for all")
    p.add_argument("--scan", action="store_true",
                   help="scan over layer groups (stacked params) instead of unrolling")
    p.add_argument("--torch-threads", type=int, default=2)
    p.add_argument("--torch-limit-s", type=float, default=60.0,
                   help="skip transformers from the context whose prefill passes this")
    p.add_argument("--torch-one-shot-max", type=int, default=0,
                   help="longest transformers prefill done in one call instead of chunks")
    p.add_argument("--skip-torch", action="store_true")
    p.add_argument("--torch-worker", help=argparse.SUPPRESS)
    p.add_argument("--out", default=os.path.join(HERE, "results", "model.json"))
    args = p.parse_args(argv)
    if args.torch_worker:
        return torch_worker(args)
    result = run(args)
    write_result(result, args.out)


if __name__ == "__main__":
    main()
