"""Prefix sharing: time to first token cold against each way a hit is restored, and a
multi-turn chat.

(a) TTFT: for each prompt length L, a prompt whose first 90 % (whole pages) another request
wrote first, timed from `add_request` to its first token, in a fresh engine per path:

  cold      a salt nothing was written under: the whole prompt is computed
  device    the State at the hit restored from the device snapshot tier
  host      ... from the host tier (numpy), the device tier off
  disk      ... from a file (the pages are in the pool; the file is read and checked)
  replay    no snapshot: R = n_layers * (W - 1) + 1 tokens (whole pages) replayed

(b) Chat: conversations over a shared system prompt; each turn is the conversation so far
(system prompt, earlier user texts and replies) plus a new user text, and generates a reply.
The device pool (`--chat-pages`) is too small for every conversation, so cold pages move to
the host tier (`--host-pages`) and on to a disk tier (a temporary directory) and come back on
a hit. Reports per turn the cached / prompt tokens, what full-page sharing allows (the whole
pages of the longest prefix the engine has computed before, the prompt's last token
excluded), the cached tokens served from each tier, the replayed tokens and the median TTFT;
the median TTFT by the lowest tier a request's hit came from; and in total the peak pages in
use and the pages demoted and promoted.

The model is the `v4kv demo` decoder (6 layers: SWA, SWA, CSA, HCA, CSA, HCA; hidden 256,
W 128, so R = 763 tokens, 6 pages) with random weights, on whatever JAX backend is present.

    python benchmarks/prefix.py                       # CPU-sized; writes results/prefix.json
    python benchmarks/prefix.py --lengths 4096 --conversations 8 --turns 6 --system 2048 \\
        --user 300 --reply 32
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import statistics
import tempfile
import time

import jax
import numpy as np
from flax import nnx
from measure import write_result

from v4kv_jax import cli
from v4kv_jax import config as cfg
from v4kv_jax.nn import Decoder, ModelConfig
from v4kv_jax.serve.engine import Engine

HERE = os.path.dirname(os.path.abspath(__file__))
PATHS = ("cold", "device", "host", "disk", "replay")


def ttft(engine: Engine, prompt, *, cache_salt=None, max_new_tokens: int = 1):
    """(seconds from add_request to the request's first token, request id, output or None)."""
    t0 = time.perf_counter()
    r = engine.add_request(prompt, max_new_tokens, cache_salt=cache_salt)
    done = None
    while r in engine.in_flight and engine.status(r) != "decode":
        for out in engine.step():
            if out.request_id == r:
                done = out
    return time.perf_counter() - t0, r, done


def finish(engine: Engine, r, done):
    """Steps until request r finishes; returns its output."""
    while done is None:
        for out in engine.step():
            if out.request_id == r:
                done = out
    return done


def path_engine(path: str, model, geometry, args, directory) -> Engine:
    sizes = {"cold": {}, "device": {}, "host": {"device_snapshots": 0},
             "disk": {"device_snapshots": 0, "host_snapshots": 0, "snapshot_dir": directory},
             "replay": {"device_snapshots": 0, "host_snapshots": 0}}[path]
    return Engine(model, geometry, prefill_chunk=args.chunk, snapshot_every_pages=1, **sizes)


def run_ttft(model, geometry, args, rng) -> list[dict]:
    P = geometry.page_tokens
    rows = []
    print(f"{'length':>7} {'cached':>7} " + " ".join(f"{p + ' ms':>10}" for p in PATHS)
          + f" {'device x':>9} {'replay x':>9}", flush=True)
    for length in args.lengths:
        shared = int(args.shared * length) // P * P
        times = {p: [] for p in PATHS}
        cached = {}
        for path in PATHS:
            with tempfile.TemporaryDirectory() as directory:
                engine = path_engine(path, model, geometry, args, directory)
                prefix = rng.integers(0, args.vocab, shared).tolist()
                writer = prefix + rng.integers(0, args.vocab, length - shared).tolist()
                engine.generate([writer], 1)  # writes the prefix's pages and snapshots
                for i in range(args.repeats):
                    prompt = prefix + rng.integers(0, args.vocab, length - shared).tolist()
                    salt = f"cold-{i}" if path == "cold" else None
                    seconds, r, done = ttft(engine, prompt, cache_salt=salt)
                    out = finish(engine, r, done)
                    times[path].append(seconds)
                    cached[path] = (out.cached_tokens, out.replayed_tokens, out.restored_by,
                                    out.snapshot_tier)
        ms = {p: 1e3 * min(v) for p, v in times.items()}
        row = dict(length=length, shared=shared, ms=ms, restored=cached,
                   speedup_device=ms["cold"] / ms["device"],
                   speedup_replay=ms["cold"] / ms["replay"])
        rows.append(row)
        print(f"{length:>7} {cached['device'][0]:>7} " + " ".join(f"{ms[p]:10.1f}" for p in PATHS)
              + f" {row['speedup_device']:8.1f}x {row['speedup_replay']:8.1f}x", flush=True)
    return rows


def run_chat(model, geometry, args, rng, directory) -> dict:
    P = geometry.page_tokens
    geometry = dataclasses.replace(geometry, num_pages=args.chat_pages)
    engine = Engine(model, geometry, prefill_chunk=args.chunk,
                    snapshot_every_pages=args.snapshot_every, host_pages=args.host_pages,
                    snapshot_dir=directory)
    engine.generate([[1, 2, 3]], 2, cache_salt="warm-up")  # its pool size compiles anew
    system = rng.integers(0, args.vocab, args.system).tolist()
    conversations = [list(system) for _ in range(args.conversations)]
    computed: list[list[int]] = []  # sequences whose pages the engine has computed
    turns, peak, by_tier = [], 0, {t: [] for t in ("none", "device", "host", "disk")}
    print(f"\n{'turn':>4} {'prompt':>8} {'cached':>8} {'allowed':>8} {'cached %':>8} "
          f"{'of allowed':>10} {'device':>7} {'host':>7} {'disk':>7} {'replayed':>9} "
          f"{'TTFT ms':>8}", flush=True)
    for t in range(args.turns):
        prompt_tokens = cached = allowed = replayed = 0
        tiers = dict.fromkeys(("device", "host", "disk"), 0)
        ttfts = []
        for c, conversation in enumerate(conversations):
            prompt = conversation + rng.integers(0, args.vocab, args.user).tolist()
            known = max((_common(prompt, seq) for seq in computed), default=0)
            allowed += min(known // P, (len(prompt) - 1) // P) * P
            seconds, r, done = ttft(engine, prompt, max_new_tokens=args.reply)
            peak = max(peak, engine.memory_report().cache.pages_used)
            out = finish(engine, r, done)
            ttfts.append(seconds)
            lowest = next((k for k in ("disk", "host", "device") if out.cached_from.get(k)),
                          "none")
            by_tier[lowest].append(seconds)
            prompt_tokens += len(prompt)
            cached += out.cached_tokens
            replayed += out.replayed_tokens
            for k in tiers:
                tiers[k] += out.cached_from.get(k, 0)
            conversations[c] = prompt + out.tokens
            computed.append(prompt + out.tokens[:-1])  # the last reply token is not appended
        turn = dict(turn=t + 1, prompt_tokens=prompt_tokens, cached_tokens=cached,
                    allowed_tokens=allowed, cached_from=tiers, replayed_tokens=replayed,
                    ttft_ms_median=1e3 * statistics.median(ttfts))
        turns.append(turn)
        print(f"{t + 1:>4} {prompt_tokens:>8} {cached:>8} {allowed:>8} "
              f"{100 * cached / prompt_tokens:7.1f}% {_pct(cached, allowed):>10} "
              f"{tiers['device']:>7} {tiers['host']:>7} {tiers['disk']:>7} "
              f"{replayed:>9} {turn['ttft_ms_median']:8.1f}", flush=True)
    report = engine.memory_report()
    total = {k: sum(t[k] for t in turns) for k in ("prompt_tokens", "cached_tokens",
                                                   "allowed_tokens", "replayed_tokens")}
    moved = {k: report.stats[k] for k in ("pages_evicted", "pages_to_host", "pages_to_disk",
                                          "pages_dropped", "pages_from_host", "pages_from_disk")}
    ttft_by_tier = {k: (1e3 * statistics.median(v), len(v)) for k, v in by_tier.items() if v}
    total.update(cached_fraction=total["cached_tokens"] / total["prompt_tokens"],
                 cached_of_allowed=total["cached_tokens"] / max(1, total["allowed_tokens"]),
                 peak_pages=peak, snapshots=report.snapshots, pages=moved,
                 ttft_ms_median_by_lowest_tier=ttft_by_tier)
    print(f"total: {total['cached_tokens']:,} of {total['prompt_tokens']:,} prompt tokens cached "
          f"({100 * total['cached_fraction']:.1f} %; {100 * total['cached_of_allowed']:.1f} % of "
          f"what full-page sharing allows), {total['replayed_tokens']:,} replayed, peak "
          f"{peak} pages of {geometry.num_pages}", flush=True)
    print("pages: " + ", ".join(f"{k[6:]} {v}" for k, v in moved.items()), flush=True)
    print("median TTFT by the lowest tier of the hit: " + ", ".join(
        f"{k} {ms:.1f} ms ({n} requests)" for k, (ms, n) in ttft_by_tier.items()), flush=True)
    return dict(turns=turns, total=total)


def _common(a, b) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if diff.size else n


def _pct(a, b) -> str:
    return f"{100 * a / b:.1f}%" if b else "-"


def run(args) -> dict:
    jax.config.update("jax_default_matmul_precision", "highest")
    attention = cfg.AttentionConfig(**cli.DEMO_MODEL)
    config = ModelConfig(attention, vocab_size=args.vocab, mlp_hidden=2 * attention.hidden_size)
    model = Decoder(config, rngs=nnx.Rngs(0), bias_scale=0.5, scan_layers=False)
    longest = max(max(args.lengths), args.system + args.turns * (args.user + args.reply))
    geometry = cfg.CacheConfig(num_pages=args.pages, max_slots=args.slots,
                               max_pages_per_seq=-(-(longest + args.reply) // 128))
    rng = np.random.default_rng(args.seed)
    t0 = time.perf_counter()
    warm = Engine(model, geometry, prefill_chunk=args.chunk)
    warm.generate([[1, 2, 3]], 2)
    print(f"compile: {time.perf_counter() - t0:.1f} s (one step program for every run below)",
          flush=True)
    ttft_rows = run_ttft(model, geometry, args, rng)
    with tempfile.TemporaryDirectory() as directory:
        chat = run_chat(model, geometry, args, rng, directory)
    return dict(
        benchmark="prefix",
        machine=dict(platform=platform.platform(), cpus=os.cpu_count(),
                     backend=jax.default_backend(), jax=jax.__version__),
        model=dict(layers=attention.num_layers, hidden=attention.hidden_size,
                   window=attention.window, vocab=args.vocab,
                   replay_tokens=warm.replay_pages * geometry.page_tokens),
        settings={k: v for k, v in vars(args).items() if k != "out"},
        ttft=ttft_rows,
        chat=chat,
    )


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--shared", type=float, default=0.9, help="shared fraction of the prompt")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--conversations", type=int, default=4)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system", type=int, default=1024, help="shared system prompt tokens")
    p.add_argument("--user", type=int, default=200, help="new user tokens per turn")
    p.add_argument("--reply", type=int, default=16, help="tokens generated per turn")
    p.add_argument("--snapshot-every", type=int, default=4, help="chat: snapshot_every_pages")
    p.add_argument("--chunk", type=int, default=128, help="prefill chunk")
    p.add_argument("--pages", type=int, default=160)
    p.add_argument("--chat-pages", type=int, default=28,
                   help="the chat's device pool (too small for every conversation)")
    p.add_argument("--host-pages", type=int, default=4, help="chat: the host tier of pages")
    p.add_argument("--slots", type=int, default=2)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.path.join(HERE, "results", "prefix.json"))
    args = p.parse_args(argv)
    write_result(run(args), args.out)


if __name__ == "__main__":
    main()
