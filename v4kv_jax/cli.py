"""`v4kv`: the command line.

  v4kv demo      prefill + decode a ragged batch on a small random model with all three layer
                 kinds; prints occupancy, the memory report against a dense cache, tokens/s
                 and the largest deviation from the brute-force oracle; then generates
                 tokens with a Flax decoder of the same attention geometry (the Engine), and
                 a prompt sharing a prefix hits its pages (checked against a cold run).
  v4kv memory    the cache cost of a preset (flash, pro; DeepSeek-V4.1's flash41) at a given
                 context, computed from the geometry alone, in the preset's storage formats
                 (the release formats for flash, pro and flash41) or those of --formats;
                 with --target v5e (v4, v6e) also the bytes the TPU compiler lays the cache
                 out in on that chip.
  v4kv check     every Pallas kernel against the jnp reference on this machine's accelerator
                 (a CPU interprets them) at a preset's widths or yours: per op, agreement,
                 largest error, both times; records the rows "auto" follows.

`v4kv demo` keeps the programs it compiles in jax's persistent compilation cache, in
~/.cache/v4kv_jax/jax ($XDG_CACHE_HOME/v4kv_jax/jax; JAX_COMPILATION_CACHE_DIR moves it,
--no-compile-cache or JAX_ENABLE_COMPILATION_CACHE=false turns it off): the first run compiles
for about half a minute on a 2-core CPU, later runs load the programs in a few seconds.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import numpy as np

from v4kv_jax import checks, costs, kernel_check, pools, programs
from v4kv_jax import config as cfg
from v4kv_jax.costs import memory  # noqa: F401 (`v4kv memory`, by name)
from v4kv_jax.programs import default_cache_dir  # noqa: F401 (the CLI's folder, by name)

DEMO_MODEL = dict(hidden_size=256, num_heads=4, head_dim=64, rope_dim=16, q_lora_rank=64,
                  o_groups=2, o_lora_rank=32, window=128, compress_ratios=(0, 0, 4, 128, 4, 128),
                  csa_ratio=4, hca_ratio=128, index_heads=8, index_head_dim=32, index_topk=32)


def _say(msg: str) -> None:
    print(msg, flush=True)


def _mib(n: float) -> str:
    return f"{n / 2**20:,.2f} MiB"


# --- jax's persistent compilation cache --------------------------------------------------------

_FALSE = ("0", "false", "f", "no", "n", "off")


def compile_cache(enabled: bool = True) -> str | None:
    """Turns jax's persistent compilation cache on for this process, before anything compiles,
    and returns its folder (`programs.compile_cache`: JAX_COMPILATION_CACHE_DIR if set, else
    `default_cache_dir()`). Returns None, and turns the cache off, when `enabled` is False or
    the environment says JAX_ENABLE_COMPILATION_CACHE=false."""
    if not enabled or os.environ.get("JAX_ENABLE_COMPILATION_CACHE", "").lower() in _FALSE:
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    return programs.compile_cache()


class CacheEvents:
    """Counts, while open, the programs jax loads from the persistent compilation cache
    (`loaded`) and the ones it compiles and writes to it (`written`), from jax's monitoring
    events."""

    HIT, WRITE = "/jax/compilation_cache/cache_hits", "/jax/compilation_cache/cache_misses"

    def __init__(self):
        self.loaded = self.written = 0

    def _event(self, event: str, **kwargs) -> None:
        if event == self.HIT:
            self.loaded += 1
        elif event == self.WRITE:
            self.written += 1

    def __enter__(self) -> CacheEvents:
        jax.monitoring.register_event_listener(self._event)
        return self

    def __exit__(self, *exc) -> None:
        jax.monitoring.unregister_event_listener(self._event)


def _has_programs(cache_dir: str | None) -> bool:
    """Whether the compilation cache holds programs (jax names its entries `<key>-cache`)."""
    return bool(cache_dir) and os.path.isdir(cache_dir) and any(
        name.endswith("-cache") for name in os.listdir(cache_dir))


def _compiling(what: str, seconds: str, cache_dir: str | None, warm: bool) -> None:
    """The notice printed before a program is first needed: compiling it shows nothing."""
    if cache_dir is None:
        _say(f"      compiling the {what} (about {seconds} s on a 2-core CPU) ...")
    elif warm:
        _say(f"      loading the {what} from the compilation cache (about {seconds} s on a "
             "2-core CPU to compile what it lacks) ...")
    else:
        _say(f"      compiling the {what} (about {seconds} s on a 2-core CPU; the next run "
             "loads it from the compilation cache) ...")


def _compiled(what: str, seconds: float, events: CacheEvents, cache_dir: str | None) -> None:
    """The seconds it took, and what the compilation cache did meanwhile."""
    done = []
    if events.loaded:
        done.append(f"{_count(events.loaded, 'program')} loaded from the compilation cache")
    if events.written:
        done.append(f"{_count(events.written, 'program')} compiled and written to "
                    + ("it" if events.loaded else "the compilation cache"))
    if cache_dir is None:
        done.append("no compilation cache")
    _say(f"      {what}: {seconds:.1f} s" + (f" ({', '.join(done)})" if done else ""))


def demo(args) -> int:
    from v4kv_jax.serve.manager import CacheManager
    from v4kv_jax.testing import oracle, synthetic

    _check_namespace(args, ("lengths", "decode_steps", "chunk", "pages", "seed", "new_tokens",
                            "vocab"))
    problem = _demo_problem(args)
    if problem:
        raise ValueError(problem)
    cache_dir = compile_cache(not getattr(args, "no_compile_cache", False))
    jax.config.update("jax_default_matmul_precision", "highest")
    model = cfg.AttentionConfig(**DEMO_MODEL)
    lengths = np.asarray(args.lengths)
    total = lengths + args.decode_steps
    chunk = min(args.chunk, int(lengths.max()))  # a longer chunk would only add padding
    geometry = cfg.CacheConfig(num_pages=args.pages, max_slots=len(lengths),
                               max_pages_per_seq=-(-int(total.max()) // 128))
    kinds = ", ".join(f"{k.name} x{len(model.layers_of(k))}" for k in cfg.LayerKind)
    _say(f"v4kv demo on {jax.default_backend().upper()}: {model.num_layers} layers ({kinds}), "
         f"H={model.num_heads} hd={model.head_dim} W={model.window} m={model.csa_ratio} "
         f"m'={model.hca_ratio} top-k={model.index_topk}; pages of {geometry.page_tokens} "
         "tokens")
    warm = _has_programs(cache_dir)
    if cache_dir:
        _say(f"Compilation cache: {cache_dir} (JAX_COMPILATION_CACHE_DIR moves it, "
             "--no-compile-cache turns it off). A first run compiles the demo's programs, "
             "about half a minute in all on a 2-core CPU; later runs load them from this cache"
             + ("; this one finds programs there." if warm else "."))
    else:
        _say("Compilation cache: off. Every run compiles the demo's programs, about half a "
             "minute in all on a 2-core CPU.")
    data = synthetic.SyntheticBatch.draw(model, len(lengths), int(total.max()), seed=args.seed)
    mgr = CacheManager(model, geometry, data.weights)
    requests = [f"req{i}" for i in range(len(lengths))]
    for r in requests:
        mgr.admit(r)
    rows = np.arange(len(lengths))
    outputs = np.zeros((model.num_layers, len(lengths), int(total.max()), model.num_heads,
                        model.head_dim), np.float32)

    _say(f"[1/6] prefill of {lengths.tolist()} tokens, {chunk}-token chunks")
    done = np.zeros_like(lengths)
    compile_s, prefill_s, prefill_tokens = 0.0, 0.0, 0
    while (done < lengths).any():
        n = np.minimum(chunk, lengths - done)
        pos = done[:, None] + np.arange(chunk)[None, :]
        vectors, queries = data.take(pos), data.stacked_queries(pos)
        first = compile_s == 0.0
        if first:
            _compiling("prefill program", "10", cache_dir, warm)
        t0 = time.perf_counter()
        with CacheEvents() as events:
            out = np.asarray(mgr.prefill(requests, vectors, n, queries=queries))
        dt = time.perf_counter() - t0
        if first:
            compile_s = dt
            _compiled("prefill program ready, first call", dt, events, cache_dir)
        else:
            prefill_s += dt
            prefill_tokens += int(n.sum())
        for b in rows:
            outputs[:, b, done[b]:done[b] + n[b]] = out[:, b, :n[b]]
        done += n
        _say(f"      {done.tolist()}")

    _say(f"[2/6] decode of {args.decode_steps} steps x {len(lengths)} requests")
    decode_s = decode_compile = 0.0
    for i in range(args.decode_steps):
        pos = lengths + i
        vectors, queries = data.take(pos), data.stacked_queries(pos)
        if i == 0:
            _compiling("decode step program", "6", cache_dir, warm)
        t0 = time.perf_counter()
        with CacheEvents() as events:
            out = np.asarray(mgr.decode(vectors, queries=queries))
        dt = time.perf_counter() - t0
        if i == 0:
            decode_compile = dt
            _compiled("decode step program ready, first call", dt, events, cache_dir)
        else:
            decode_s += dt
        outputs[:, rows, pos] = out[:, rows, 0]

    _say("[3/6] brute-force oracle (every entry recomputed from the full history)")
    worst, worst_at = 0.0, None
    for layer, kind in enumerate(model.layer_kinds):
        for b in rows:
            L = int(total[b])
            want, _ = oracle.attention_outputs(model, kind, data.history(layer, b), L)
            dev = float(np.abs(outputs[layer, b, :L] - want).max())
            if dev > worst:
                worst, worst_at = dev, (layer, kind.name, requests[b])

    _say("[4/6] report\n")
    _say(f"{'request':>8} {'length':>7} {'C4/layer':>9} {'C128/layer':>11} {'tails':>7} "
         f"{'window':>12} pages")
    for r, rep in mgr.inspect().items():
        window = f"{rep.window[0]}..{rep.window[1]}" if rep.window else "-"
        _say(f"{r:>8} {rep.length:>7} {rep.c4_entries:>9} {rep.c128_entries:>11} "
             f"{rep.csa_tail:>3}/{rep.hca_tail:<3} {window:>12} {list(rep.pages)}")
    report = mgr.memory_report()
    _say("\n" + report.format())
    tokens_held = int(total.sum())
    dense = tokens_held * pools.dense_cache_bytes_per_token(model, geometry.entry_dtype)
    v4_bytes = report.allocated_bytes + len(lengths) * report.state_bytes_per_request
    _say(f"\nDense per-token cache of the same {model.num_layers} layers for {tokens_held} "
         f"tokens: {_mib(dense)}; V4 Classical in use + State: {_mib(v4_bytes)} "
         f"({dense / v4_bytes:.1f}x smaller)")
    _say(f"Classical entries {_mib(report.entry_bytes)} = {report.entry_bytes / tokens_held:.1f} "
         f"B/token vs dense {pools.dense_cache_bytes_per_token(model, geometry.entry_dtype)} "
         "B/token")
    decode_tokens = (args.decode_steps - 1) * len(lengths)
    _say(f"\nPrefill: {prefill_tokens / prefill_s:,.0f} tokens/s after a {compile_s:.1f} s "
         "first call" if prefill_s else f"\nPrefill: one call of {compile_s:.1f} s")
    if decode_s:
        _say(f"Decode:  {decode_tokens / decode_s:,.0f} tokens/s "
             f"({1e3 * decode_s / (args.decode_steps - 1):.1f} ms/step for {len(lengths)} "
             f"requests, all layers) after a {decode_compile:.1f} s first step")
    _say(f"Largest deviation from the brute-force oracle: {worst:.2e}"
         + (f" (layer {worst_at[0]} {worst_at[1]}, {worst_at[2]})" if worst_at else ""))
    prefix_ok = generate(model, lengths, args, cache_dir, warm)
    return 0 if worst < 1e-4 and prefix_ok else 1


def generate(attention: cfg.AttentionConfig, lengths: np.ndarray, args,
             cache_dir: str | None = None, warm: bool = False) -> bool:
    """Generates with a random-weight `v4kv_jax.nn.Decoder` of the demo's attention geometry,
    served by the `v4kv_jax.Engine`; then a prompt sharing req0's prefix hits its pages.
    `cache_dir`: the compilation cache's folder (None: off); `warm`: whether it held programs
    when the demo started (the notices say "loading" instead of "compiling"). Returns whether
    that hit's output equals a cold run's."""
    from flax import nnx

    from v4kv_jax.nn import Decoder, ModelConfig
    from v4kv_jax.serve.engine import Engine

    config = ModelConfig(attention, vocab_size=args.vocab, mlp_hidden=2 * attention.hidden_size)
    model = Decoder(config, rngs=nnx.Rngs(args.seed), bias_scale=0.5,
                    scan_layers=not args.unroll)
    batch, new = len(lengths), args.new_tokens
    longest = int(lengths.max())
    geometry = cfg.CacheConfig(num_pages=args.pages, max_slots=batch,
                               max_pages_per_seq=-(-(longest + new) // 128))
    P = geometry.page_tokens
    chunk = 1 << (min(args.chunk, P).bit_length() - 1)  # the Engine's chunks divide a page
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(0, args.vocab, int(n)).tolist() for n in lengths]
    _say(f"\n[5/6] generation with a {config.num_layers}-layer Flax decoder (vocab "
         f"{args.vocab}, SwiGLU MLP {config.mlp_hidden}, random weights, layers "
         f"{'unrolled' if args.unroll else 'scanned'}) served by v4kv_jax.Engine (continuous "
         f"batching, {chunk}-token prefill chunks): {batch} prompts of {lengths.tolist()} "
         f"tokens, {new} new tokens each, greedy")
    engine = Engine(model, geometry, prefill_chunk=chunk, snapshot_every_pages=1,
                    keep_logits=True)
    _compiling("Engine's programs", "16", cache_dir, warm)
    with CacheEvents() as events:
        first = engine.warmup()
    _compiled("Engine's programs ready (its step, the slot lifecycle, the prefix cache's "
              "transfers), Engine.warmup()", first, events, cache_dir)
    t0 = time.perf_counter()
    out = engine.generate(prompts, new)
    full = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine.generate([p[:1] for p in prompts], new)  # the same program with 1-token prompts
    short = time.perf_counter() - t0
    for i, o in enumerate(out):
        row = o.tokens
        _say(f"      req{i}: ... {prompts[i][-3:]} -> {row[:12]}{' ...' if len(row) > 12 else ''}")
    made = sum(len(o.tokens) for o in out)
    _say(f"Generation: {made / full:,.0f} tokens/s end to end ({made} new tokens for "
         f"{int(lengths.sum())} prompt tokens in {full:.2f} s), {batch * new / short:,.0f} "
         f"tokens/s with 1-token prompts (decode alone); one compiled step program, "
         f"ready after {first:.1f} s of Engine.warmup()")
    _say("Streaming (engine.generate(prompts, new, stream=True)): each step's new tokens, "
         "as they come")
    streamed = {i: [] for i in range(batch)}
    for step, events in enumerate(engine.generate(prompts, new, stream=True), 1):
        for e in events:
            streamed[e.index] += e.new_tokens
        if step <= 6 or any(e.finished for e in events):
            _say(f"      step {step}: " + "  ".join(
                f"req{e.index} +{e.new_tokens}" + (f" ({e.finish_reason})" if e.finished
                                                   else "") for e in events))
    same_stream = all(streamed[i] == o.tokens for i, o in enumerate(out))
    _say(f"Streamed tokens equal the generated ones: {'yes' if same_stream else 'NO'}")

    shared = (len(prompts[0]) - 1) // P * P
    if not shared:
        _say(f"\n[6/6] prefix sharing: skipped (req0 holds no full page of {P} tokens)")
        return True
    prompt = prompts[0][:shared + 5] + rng.integers(0, args.vocab, 20).tolist()
    _say(f"\n[6/6] prefix sharing: a prompt of req0's first {shared + 5} tokens and 20 new ones")
    request = engine.add_request(prompt, new)
    hit = None
    while engine.status(request) != "decode":
        engine.step()
    slot = engine.table.slot(request)
    attached = np.asarray(pools.page_table(engine.cache))[slot, :shared // P].tolist()
    refcount = np.asarray(pools.refcounts(engine.cache))[attached].tolist()
    while hit is None:
        hit = next((o for o in engine.step() if o.request_id == request), None)
    (cold,) = engine.generate([prompt], new, cache_salt="cold")
    same = hit.tokens == cold.tokens
    diff = float(np.abs(hit.logits - cold.logits).max()) if same else float("inf")
    tier = f" on the {hit.snapshot_tier} tier" if hit.snapshot_tier else ""
    _say(f"      pages shared: {attached} (refcounts {refcount}: the prefix index and this "
         f"request; one physical copy)")
    _say(f"      cached tokens {hit.cached_tokens} of {len(prompt)} (State restored by "
         f"{hit.restored_by}{tier}; {hit.replayed_tokens} tokens replayed)")
    ok = same and diff <= 1e-5
    _say(f"Prefix hit equals the cold run: {'yes' if ok else 'NO'} (greedy tokens "
         f"{'identical' if same else 'differ'}, largest logit difference {diff:.1e})")
    _say("\n" + engine.memory_report().format())
    return ok


def _count(n: int, noun: str) -> str:
    """`1 token`, `2 tokens`, `1,024 tokens`."""
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


# Integer options: (lowest, highest or None). argparse checks them on the command line; `demo`
# checks them again when called with a hand-made namespace (`costs.BOUNDS`: `memory`'s).
BOUNDS = {"lengths": (1, None), "decode_steps": (0, None), "chunk": (1, None),
          "pages": (1, None), "seed": (0, 2**32 - 1), "new_tokens": (1, None),
          "vocab": (1, None)}


def _check_namespace(args, options: tuple[str, ...]) -> None:
    """Raises naming the option (`--chunk: expected an integer in [1, inf]; got 0`)."""
    for option in options:
        lo, hi = BOUNDS[option]
        name = "--" + option.replace("_", "-")
        values = getattr(args, option, None)
        if isinstance(values, np.ndarray):
            values = values.tolist()
        if values is None:
            checks.fail(name, "a value (an argparse namespace of the subcommand's options)",
                        None, TypeError)
        for value in values if isinstance(values, (list, tuple)) else [values]:
            checks.integer(name, value, lo=lo, hi=hi)


def _int_option(lo: int, hi: int | None = None):
    """An argparse `type` for an integer option in [lo, hi]; argparse prefixes its error with
    the option's name: `argument --chunk: expected an integer >= 1; got '0'`."""
    expected = f"an integer >= {lo}" if hi is None else f"an integer in [{lo}, {hi}]"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}; got {text!r}") from None
        if value < lo or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"expected {expected}; got {text!r}")
        return value

    parse.__name__ = "integer"
    return parse


def _demo_problem(args) -> str | None:
    """What is wrong with a combination of `v4kv demo` options (each one alone is valid)."""
    page_tokens = cfg.CacheConfig(num_pages=1, max_slots=1, max_pages_per_seq=1).page_tokens
    lengths = np.asarray(args.lengths)
    need = max(int(np.sum(-(-(lengths + extra) // page_tokens)))
               for extra in (args.decode_steps, args.new_tokens))
    if args.pages < need:
        return (f"--pages: expected at least {need} (pages of {page_tokens} tokens "
                f"that prompts of {lengths.tolist()} tokens need with --decode-steps "
                f"{args.decode_steps} and --new-tokens {args.new_tokens}); got {args.pages}")
    return None


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's help ends with its default. An option whose help already states its
    default, or whose default is None or False (a flag, or a default that depends on another
    option), is left as written."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default is None or action.default is False or "(default:" in text:
            return text
        return super()._get_help_string(action)


class _TopHelpFormatter(_HelpFormatter, argparse.RawDescriptionHelpFormatter):
    """`v4kv --help`: the module docstring, line breaks kept, describes the commands."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="v4kv", description=__doc__, formatter_class=_TopHelpFormatter,
        epilog="`v4kv <command> --help` lists the options of a command, with their defaults.")
    sub = parser.add_subparsers(dest="command", required=True, title="commands",
                                metavar="<command>")
    option = {name: _int_option(*bounds) for name, bounds in BOUNDS.items()}
    p = sub.add_parser(
        "demo", formatter_class=_HelpFormatter,
        help="prefill + decode a ragged batch on a small random model and check it against "
             "a brute-force oracle; then generate with the Engine and hit a shared prefix",
        description="Prefills and decodes a ragged batch of requests on a small random model "
                    "with all three layer kinds (SWA, CSA, HCA), prints occupancy, the memory "
                    "report against a dense cache, tokens/s and the largest deviation from the "
                    "brute-force oracle; then generates tokens with a Flax decoder of the same "
                    "attention geometry served by the Engine, and checks that a prompt "
                    "sharing a prefix hits its pages and equals a cold run. Exit status 0 when "
                    "both checks pass, 1 otherwise.")
    p.add_argument("--lengths", type=option["lengths"], nargs="+", default=[700, 384, 129, 37],
                   metavar="N", help="prompt lengths of the requests, one per request "
                                     "(default: 700 384 129 37)")
    p.add_argument("--decode-steps", type=option["decode_steps"], default=24, metavar="N",
                   help="decode steps after the prefill (0: prefill only)")
    p.add_argument("--chunk", type=option["chunk"], default=128, metavar="TOKENS",
                   help="prefill chunk (tokens per call)")
    p.add_argument("--pages", type=option["pages"], default=64, metavar="N",
                   help="pages in the Classical pool (of 128 tokens each)")
    p.add_argument("--seed", type=option["seed"], default=0, metavar="N",
                   help="seed of the random weights, vectors and prompts")
    p.add_argument("--new-tokens", type=option["new_tokens"], default=32, metavar="N",
                   help="tokens generated per prompt by the Engine")
    p.add_argument("--vocab", type=option["vocab"], default=512, metavar="N",
                   help="vocabulary of the Flax decoder")
    p.add_argument("--unroll", action="store_true",
                   help="unroll the decoder's layers instead of scanning over layer groups "
                        "(default: scanned)")
    p.add_argument("--no-compile-cache", action="store_true",
                   help="compile every program instead of loading it from jax's persistent "
                        "compilation cache (default: the cache is on, in "
                        "JAX_COMPILATION_CACHE_DIR or ~/.cache/v4kv_jax/jax)")
    p.set_defaults(run=demo, problem=_demo_problem, parser=p)
    costs.add_parser(sub, _int_option, _HelpFormatter)
    kernel_check.add_parser(sub, _int_option, _HelpFormatter)
    return parser


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    problem = args.problem(args)
    if problem:
        args.parser.error(f"argument {problem}")
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
