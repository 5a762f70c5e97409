"""What a request costs, from a preset's geometry alone: the `v4kv memory` command.

For a preset of DeepSeek-V4 (flash, pro, tiny) or DeepSeek-V4.1 (flash41) and a context of
`--tokens` tokens, nothing allocated: the storage formats (the preset's, or `--formats`), the
Classical bytes per token (the rows' own, and as stored: rows in lane-dense pools, as a TPU
keeps them) and for the context, the State of one request, a dense per-token cache of the
same layers, and how many such requests fit in `--device-gib` per device over `--devices`.
With `--target` also the compiler's bytes of the cache on one chip of that TPU generation
(libtpu, no TPU). V4's HiSparse (`--hot-rows`: C4 entries on the host) adds the host memory
the requests need; a V4.1 preset refuses it. The figures come from `pools.report` (V4) and
`pools.report41` (V4.1). The CLI adds the command (`add_parser`).
"""

from __future__ import annotations

import argparse

from v4kv_jax import checks, pools, targets
from v4kv_jax import config as cfg
from v4kv_jax.config41 import PRESET_FORMATS41, PRESETS41
from v4kv_jax.pools import cache41, storage
from v4kv_jax.pools.layout import compressor_specs

# The presets, V4's and V4.1's, and the storage formats each defaults to.
PRESETS = {**cfg.PRESETS, **PRESETS41}
PRESET_FORMATS = {**cfg.PRESET_FORMATS, **PRESET_FORMATS41}
# Integer options: (lowest, highest or None). argparse checks them on the command line;
# `memory` checks them again when called with a hand-made namespace.
BOUNDS = {"tokens": (1, None), "hot_rows": (0, None), "devices": (1, None)}


def _say(msg: str) -> None:
    print(msg, flush=True)


def _mib(n: float) -> str:
    return f"{n / 2**20:,.2f} MiB"


def _gib_text(n: float) -> str:
    return f"{n / 2**30:,.2f} GiB"


def _count(n: int, noun: str) -> str:
    """`1 token`, `2 tokens`, `1,024 tokens`."""
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def memory(args) -> int:
    """`v4kv memory`: prints the cost of one request of `args.tokens` tokens (module
    docstring). Every option is checked again by name (a hand-made namespace)."""
    tokens = getattr(args, "tokens", None)
    if tokens is None:
        checks.fail("--tokens", "a value (an argparse namespace of the subcommand's options)",
                    None, TypeError)
    checks.integer("--tokens", tokens, lo=BOUNDS["tokens"][0])
    checks.one_of("--preset", getattr(args, "preset", None), sorted(PRESETS))
    formats = getattr(args, "formats", None) or PRESET_FORMATS[args.preset]
    checks.one_of("--formats", formats, tuple(
        cache41.FORMAT_SETS41 if args.preset in PRESETS41 else cfg.FORMAT_SETS))
    target = getattr(args, "target", None)
    checks.one_of("--target", target, (None, *sorted(targets.GENERATIONS)))
    hot_rows = checks.integer("--hot-rows", getattr(args, "hot_rows", 0), lo=0)
    devices = checks.integer("--devices", getattr(args, "devices", 1), lo=1)
    budget = checks.real("--device-gib", getattr(args, "device_gib", 64.0), lo=0.0,
                         lo_open=True) * 2**30
    bad = problem(args)
    if bad:
        raise ValueError(bad)
    pages = -(-args.tokens // cfg.CacheConfig(1, 1, 1).page_tokens)
    if args.preset in PRESETS41:
        return _memory41(args, formats, pages, target, devices, budget)
    model = cfg.PRESETS[args.preset]()
    geometry = cfg.CacheConfig.with_formats(formats, num_pages=pages, max_slots=1,
                                            max_pages_per_seq=pages, hot_rows=hot_rows,
                                            c4_tier="host" if hot_rows else "device")
    logical = pools.classical_bytes_per_token(model, geometry)
    stored = pools.stored_bytes_per_token(model, geometry)
    state = pools.state_bytes_per_request(model, geometry)
    classical = pages * pools.page_bytes(model, geometry)
    needed = sum(len(model.layers_of(spec.kind)) * storage.codec(model, geometry, spec.name)
                 .row_bytes * (args.tokens // spec.ratio) for spec in compressor_specs(model)
                 if model.layers_of(spec.kind))
    first = min(spec.ratio for spec in compressor_specs(model) if model.layers_of(spec.kind))
    padding = (f"x{classical / needed:.3f} of the entries' own bytes" if needed else
               f"no compressed entry is complete before {first} tokens")
    dense = args.tokens * pools.dense_cache_bytes_per_token(model, geometry.entry_dtype)
    rows = {name: storage.codec(model, geometry, name) for name in ("csa", "csa_index", "window")}
    tails = (f"{geometry.tail_dtype} tails, HCA tail "
             f"{'online (3 x hd)' if geometry.hca_tail == 'online' else 'ring'}")
    _say(f"{args.preset}: {model.num_layers} layers ({model.num_csa} CSA, {model.num_hca} HCA, "
         f"{len(model.layers_of(cfg.LayerKind.SWA))} SWA); formats {formats}: entries "
         f"{geometry.entry_dtype} ({rows['csa'].row_bytes} B), indexer keys "
         f"{geometry.index_dtype} ({rows['csa_index'].row_bytes} B), window "
         f"{geometry.window_dtype} ({rows['window'].row_bytes} B), {tails}")
    _say("Classical bytes/token: " + ", ".join(f"{k} {v:.2f} B" for k, v in logical.items())
         + "; as stored (lane-dense pools): "
         + ", ".join(f"{k} {v:.2f} B" for k, v in stored.items())
         + f" (x{stored['total'] / logical['total']:.3f})")
    _say(f"At {_count(args.tokens, 'token')}: Classical {_mib(classical)} as stored in "
         f"{_count(pages, 'page')} ({padding}), State {_mib(state)} ({state:,} B) per "
         f"request, dense per-token cache {_mib(dense)}")
    if target is not None:
        _say(pools.format_laid_out(pools.laid_out(model, geometry, target)))
    device_request = classical
    if hot_rows:
        device_request = pages * pools.device_bytes_per_token(model, geometry) * (
            geometry.page_tokens)
        _say(f"HiSparse (C4 entries on the host, {hot_rows} hot rows per CSA layer and "
             f"request): device Classical {_mib(device_request)}, host "
             f"{_mib(classical - device_request)} per request of "
             f"{_count(args.tokens, 'token')}; device {_mib(device_request + state)} with "
             f"the State and hot sets {_mib(state)}")
    per_device = _fit(args.tokens, device_request + state, budget, devices)
    if hot_rows and per_device:
        host_request = pools.host_bytes_per_request(model, geometry)
        _say(f"Host memory they need (HiSparse): {per_device:,} x {_mib(host_request)} of C4 "
             f"entries = {_gib_text(per_device * host_request)} per device, "
             f"{_gib_text(devices * per_device * host_request)} over the "
             f"{_count(devices, 'device')} (data parallel); a host holds the sum over its "
             "devices")
    return 0


def _memory41(args, formats: str, pages: int, target, devices: int, budget: float) -> int:
    """`v4kv memory` of a DeepSeek-V4.1 preset (`pools.report41`): only the kv sources fill
    the Classical pool; the State is every layer's window ring and the ratio-2 sources' open
    rows."""
    config = PRESETS41[args.preset]()
    geometry = cache41.cache_config41(formats, num_pages=pages, max_slots=1,
                                      max_pages_per_seq=pages)
    logical = pools.classical_bytes_per_token41(config, geometry)
    stored = pools.stored_bytes_per_token41(config, geometry)
    classical = pages * pools.page_bytes41(config, geometry)
    needed = pools.entry_bytes41(config, geometry, args.tokens)
    state = pools.state_bytes_per_request41(config, geometry)
    own = pools.state_logical_bytes_per_request41(config, geometry)
    rows = {name: cache41.codec41(config, geometry, name).row_bytes
            for name in ("entries", "keys", "window")}
    (layers, ring), (pairs, open_row) = pools.state_maps41(config, geometry).values()
    ratios = config.compress_ratios
    _say(f"{args.preset}: {config.num_layers} layers ({ratios.count(0)} SWA, {ratios.count(2)} "
         f"ratio 2, {ratios.count(1)} ratio 1; kv sources "
         f"{', '.join(map(str, config.kv_source_layers))}); formats {formats}: entries "
         f"{geometry.entry_dtype} ({rows['entries']} B), index keys {geometry.index_dtype} "
         f"({rows['keys']} B), window {geometry.window_dtype} ({rows['window']} B)")
    _say("Classical bytes/token: " + ", ".join(f"{k} {v:.2f} B" for k, v in logical.items())
         + "; as stored (lane-dense pools): "
         + ", ".join(f"{k} {v:.2f} B" for k, v in stored.items())
         + f" (x{stored['total'] / logical['total']:.3f})")
    first = min(ratios[s] for s in config.kv_source_layers)
    own_bytes = _mib(needed) if needed >= 2**20 else f"{needed:,} B"
    padding = (f"x{classical / needed:.3f} of the entries' and keys' own {own_bytes}"
               if needed else f"no compressed entry is complete before {first} tokens")
    dense = args.tokens * config.num_layers * rows["entries"]
    _say(f"At {_count(args.tokens, 'token')}: Classical {_mib(classical)} as stored in "
         f"{_count(pages, 'page')} ({padding}), State {_mib(state)} ({state:,} B) per "
         f"request, dense per-token cache {_mib(dense)}")
    _say(f"State per request: {own:,} B of rows ({layers} window rings of {ring.records} x "
         f"{ring.record_bytes} B, {pairs} ratio-2 open rows of 2 x {config.head_dim} fp32 = "
         f"{open_row.record_bytes:,} B, length and status 8 B); as stored {state:,} B "
         f"(x{state / own:.3f})")
    if target is not None:
        _say(pools.format_laid_out(pools.laid_out41(config, geometry, target)))
    _fit(args.tokens, classical + state, budget, devices)
    return 0


def _fit(tokens: int, each: float, budget: float, devices: int) -> int:
    """Prints how many requests of `tokens` tokens, `each` bytes on the device, fit in
    `budget` bytes per device; returns that count per device."""
    per_device = int(budget // each)
    over = _count(devices, "device")
    _say(f"Requests of {_count(tokens, 'token')} in {budget / 2**30:g} GiB of cache per "
         f"device ({_mib(each)} each on the device): data parallel over {over} "
         f"{per_device:,} per device, {devices * per_device:,} in total; tensor parallel over "
         f"{over} {per_device:,} in total (the one MQA latent and its indexer keys are "
         "replicated on every device, so each holds every request)")
    if not per_device:
        _say(f"Not one request fits: each needs {_mib(each)} on the device, more than "
             f"--device-gib {budget / 2**30:g}")
    return per_device


def problem(args) -> str | None:
    """What is wrong with a combination of `v4kv memory` options."""
    hot_rows = getattr(args, "hot_rows", 0)
    if args.preset in PRESETS41:
        return (f"--hot-rows: expected 0 for the {args.preset} preset (HiSparse, V4's C4 "
                f"entries on the host, is not built for V4.1: its cache keeps every store on "
                f"the device); got {hot_rows}") if hot_rows else None
    topk = cfg.PRESETS[args.preset]().index_topk
    if hot_rows and hot_rows < topk:
        return (f"--hot-rows: expected 0 or at least the {args.preset} preset's "
                f"index_topk={topk}; got {hot_rows}")
    return None


def _gib(text: str) -> float:
    """An argparse `type` for --device-gib: a finite number of GiB > 0."""
    try:
        return checks.real("GiB", float(text), lo=0.0, lo_open=True)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of GiB > 0; got {text!r}") from None


def add_parser(sub, int_option, formatter):
    """Adds `memory` to the CLI's subparsers `sub`; `int_option(lo, hi)` makes an argparse
    type for an integer option, `formatter` is the help formatter class."""
    p = sub.add_parser(
        "memory", formatter_class=formatter,
        help="cache cost of a preset (flash, pro, flash41) at a context length, from the "
             "geometry alone",
        description="The cache cost of a preset at a given context, computed from the geometry "
                    "alone (nothing is allocated): Classical bytes per token and for the "
                    "context, page padding, the State of a request, a dense cache for "
                    "comparison, and how many such requests fit per device.")
    p.add_argument("--preset", choices=sorted(PRESETS), default="flash",
                   help="the model's attention geometry (flash41: DeepSeek-V4.1-Flash)")
    p.add_argument("--tokens", type=int_option(*BOUNDS["tokens"]), default=1 << 20, metavar="N",
                   help="context length of a request, in tokens")
    p.add_argument("--formats", choices=tuple(cfg.FORMAT_SETS), default=None,
                   help="storage formats (default: the preset's: release for flash, pro and "
                        "flash41, float32 for tiny)")
    p.add_argument("--hot-rows", type=int_option(*BOUNDS["hot_rows"]), default=0, metavar="N",
                   help="HiSparse: keep the C4 entries on the host and this many device rows "
                        "per CSA layer and request (0: everything on the device; V4 only)")
    p.add_argument("--devices", type=int_option(*BOUNDS["devices"]), default=1, metavar="N",
                   help="devices of a data-parallel mesh (each holds its own requests)")
    p.add_argument("--device-gib", type=_gib, default=64.0, metavar="GIB",
                   help="memory per device left for the cache after weights and activations")
    p.add_argument("--target", choices=sorted(targets.GENERATIONS), default=None,
                   help="also the bytes of one request's cache as the TPU compiler lays them "
                        "out on one chip of this generation, libtpu needed, no TPU (default: "
                        "none, the bytes as stored only)")
    p.set_defaults(run=memory, problem=problem, parser=p)
    return p


__all__ = ["BOUNDS", "PRESETS", "PRESET_FORMATS", "add_parser", "memory", "problem"]
