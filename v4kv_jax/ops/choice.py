"""Which implementation runs each op: the reference, a Pallas kernel, or per platform the
faster of the two as measured, and the dispatch that traces the choice into a program
(`programs.platform_dependent` where platforms differ). The ops door (`v4kv_jax.ops`) calls
`_dispatch`; nothing else imports a kernel module.

"auto" reads two tables of measured rows (one per platform and op): the committed
`measured.json` beside this module, and the user's own, `user_measured_path()`, which
`v4kv check` writes on the user's chip (`v4kv_jax.kernel_check`); a user's row replaces the
committed row of its platform and op. A row whose kernel disagreed with the reference makes
"auto" run the reference.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import json
import logging
import os

import jax
import jax.extend
from jax.interpreters import mlir

from v4kv_jax import checks, programs
from v4kv_jax.config import (
    IMPLEMENTATIONS,
    KERNEL_OPS,
    AttentionConfig,
    CacheConfig,
    Options,
)
from v4kv_jax.config import options_or_default as _options
from v4kv_jax.ops import attention, attention41, compressor, indexer
from v4kv_jax.pools.layout import CompressorSpec

_BACKEND_OF = {"pallas_tpu": "tpu", "pallas_gpu": "gpu"}
_KERNELS_OF = {"tpu": "pallas_tpu", "gpu": "pallas_gpu"}

# op -> (reference function, kernel folder); the kernel function has the op's name.
_OPS = {
    "emit_entries": (compressor.emit_entries, "compressor"),
    "emit_entries_online": (compressor.emit_entries_online, "compressor"),
    "index_scores": (indexer.index_scores, "indexer"),
    "sparse_decode_attention": (attention.sparse_decode_attention, "sparse_attention"),
    "dense_decode_attention": (attention.dense_decode_attention, "dense_attention"),
    "sparse_decode41": (attention41.sparse_decode41, "sparse_attention"),
}
assert tuple(_OPS) == KERNEL_OPS

MEASURED_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "measured.json")

log = logging.getLogger(__name__)
# What has been logged once: (platform, op) of an unmeasured kernel, (path, stamp) of an
# unreadable user table.
_SAID: set[tuple] = set()


_UNCHECKED: list[bool] = []


@contextlib.contextmanager
def unchecked():
    """Inside the block a forced kernel runs even a config its `supported()` rejects, so a
    compiler says what it makes of it (the compile sweep, `v4kv_jax.testing.compile_sweep`);
    never for serving."""
    _UNCHECKED.append(True)
    try:
        yield
    finally:
        _UNCHECKED.pop()


class KernelUnavailableError(RuntimeError):
    """A forced Pallas implementation cannot run on the current backend."""


def user_dir() -> str:
    """The per-user folder of the library's files: $XDG_CACHE_HOME/v4kv_jax, by default
    ~/.cache/v4kv_jax."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "v4kv_jax")


def user_measured_path() -> str:
    """The user's table of measured rows (`v4kv check` writes it; "auto" reads it):
    $V4KV_MEASURED if set, else measured.json in `user_dir()`."""
    return os.environ.get("V4KV_MEASURED") or os.path.join(user_dir(), "measured.json")


@functools.cache
def _table(path: str, stamp: tuple[int, int] | None) -> tuple[dict, ...]:
    """The rows of one table file, each with its `table` (the path); `stamp` (mtime, size)
    is part of the cache key, so a rewritten file is read again."""
    if stamp is None:
        return ()
    with open(path) as f:
        rows = json.load(f)["measurements"]
    return tuple(dict(row, table=path) for row in rows)


def _stamp(path: str) -> tuple[int, int] | None:
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return None
    return info.st_mtime_ns, info.st_size


def measured() -> dict[tuple[str, str], dict]:
    """{(platform, op): measurement} from the committed `measured.json` and the user's table
    (`user_measured_path()`; its rows replace the committed ones of the same platform and
    op). Each row names its `table`."""
    user, stamp = user_measured_path(), None
    try:
        stamp = _stamp(user)
        rows = _table(user, stamp)
        if not all(isinstance(row.get("platform"), str) and isinstance(row.get("op"), str)
                   for row in rows):
            raise ValueError("a row without its platform or op")
    except (OSError, ValueError, KeyError, TypeError) as e:
        if (user, stamp) not in _SAID:
            _SAID.add((user, stamp))
            log.warning("auto ignores the user's table %s, which it cannot read (%s: %s); "
                        "`v4kv check` writes it anew", user, type(e).__name__, e)
        rows = ()
    rows = _table(MEASURED_PATH, _stamp(MEASURED_PATH)) + rows
    return {(row["platform"], row["op"]): row for row in rows}


def record(rows: list[dict], path: str | None = None) -> str:
    """Writes measured rows (dicts with at least `platform` and `op`) into a table, by
    default the user's (`user_measured_path()`): each replaces the row of its platform and
    op, other rows are kept. Returns the path."""
    path = path or user_measured_path()
    table = {"about": "Rows measured on this user's chips by `v4kv check`; \"auto\" reads "
                      "them beside the committed table (v4kv_jax/ops/measured.json) and "
                      "prefers them.", "measurements": []}
    if os.path.exists(path):
        try:
            with open(path) as f:
                table = json.load(f)
            table["measurements"] = list(table["measurements"])
        except (ValueError, TypeError, KeyError) as e:  # kept: it is the user's file
            checks.fail(path, "the JSON table of measured rows `v4kv check` writes",
                        f"a file it cannot read ({type(e).__name__}: {e}); move it away to "
                        "record anew")
    replaced = {(r["platform"], r["op"]) for r in rows}
    kept = [r for r in table["measurements"] if (r["platform"], r["op"]) not in replaced]
    table["measurements"] = sorted(kept + [dict(r) for r in rows],
                                   key=lambda r: (r["platform"], r["op"]))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    # Written whole or not at all: "auto" reads this file on every choice. A failed write
    # (a full disk, a read-only folder) leaves the table as it was and no partial file.
    tmp = path + ".tmp"
    try:
        with open(tmp, "w", opener=lambda name, flags: os.open(name, flags, 0o644)) as f:
            json.dump(table, f, indent=1)
            f.write("\n")
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    return path


def resolve(implementation: str = "auto", *, interpret: bool = False,
            backend: str | None = None) -> str:
    """The implementation a platform runs by default ("reference", "pallas_tpu" or
    "pallas_gpu"), before any per-op measurement or config check (`choose` adds those).

    Args:
      implementation: one of `IMPLEMENTATIONS`.
      interpret: Pallas kernels will run in interpret mode, so any backend can run them.
      backend: the platform to decide for; default `jax.default_backend()`.
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation: expected one of {IMPLEMENTATIONS}; got "
                         f"{implementation!r}")
    backend = backend or jax.default_backend()
    if implementation == "auto":
        return _KERNELS_OF.get(backend, "reference")
    if implementation == "reference" or interpret:
        return implementation
    needed = _BACKEND_OF[implementation]
    if backend != needed:
        raise KernelUnavailableError(
            f"implementation={implementation!r} needs a {needed.upper()} backend; the current "
            f"backend is {backend!r}. {_ADVICE}")
    return implementation


def kernel_module(op: str, implementation: str):
    """The module of `op`'s kernel for "pallas_tpu" or "pallas_gpu"."""
    folder = _OPS[op][1]
    return importlib.import_module(f"pallas_kernels.{folder}.{_BACKEND_OF[implementation]}")


def record_writer():
    """The TPU kernel that writes records of a stored array in place, at most one a block
    (`pallas_kernels.records.write_records`; `v4kv_jax.ops.put_records`)."""
    return importlib.import_module("pallas_kernels.records").write_records


def supported(op: str, implementation: str, model: AttentionConfig,
              geometry: CacheConfig, spec: CompressorSpec | None = None) -> str | None:
    """Why `op`'s kernel of `implementation` cannot run this config (for an emission, the
    compressor `spec`; None: every compressor of the model), or None if it can."""
    if implementation == "reference":
        return None
    return kernel_module(op, implementation).supported(model, geometry, spec)


@dataclasses.dataclass(frozen=True)
class Choice:
    """What runs one op: `implementation` ("reference", "pallas_tpu" or "pallas_gpu"),
    `interpret`, the kernel's `block_sizes` (None: its defaults) and `why`, one line."""

    implementation: str
    interpret: bool
    block_sizes: object
    why: str


def choose(op: str, model: AttentionConfig, geometry: CacheConfig,
           options: Options | None = None, *, backend: str | None = None,
           spec: CompressorSpec | None = None) -> Choice:
    """The `Choice` for `op` (a name in `KERNEL_OPS`) under `options` on `backend` (for an
    emission, of the compressor `spec`; None: a kernel must run every compressor).

    Raises:
      KernelUnavailableError: a forced Pallas implementation on another backend (not
        interpret mode).
      ValueError: a forced Pallas implementation whose kernel cannot run this config.
    """
    if op not in _OPS:
        raise ValueError(f"op: expected one of {KERNEL_OPS}; got {op!r}")
    options = _options(options)
    requested = options.implementation
    backend = backend or jax.default_backend()
    impl = resolve(requested, interpret=options.interpret, backend=backend)
    why = f"implementation={requested!r}"
    if requested == "auto":
        row = measured().get((backend, op))
        if row is not None and impl != "reference" and row.get("implementation", impl) != impl:
            row = None  # another platform's kernels, interpreted on this one
        if impl != "reference" and row is not None and row.get("agree") is False:
            impl = "reference"
            why = (f"auto: the kernel disagreed with the reference on {row['device']} "
                   f"({row['shape']}: max error {row.get('max_error')}, tolerance "
                   f"{row.get('tolerance')}; {row['table']})")
        elif impl != "reference" and row is not None and (
                row["reference_ms"] < row["kernel_ms"]):
            impl = "reference"
            why = (f"auto: measured faster on {row['device']} ({row['shape']}: reference "
                   f"{row['reference_ms']} ms, kernel {row['kernel_ms']} ms)")
        elif row is not None:
            why = (f"auto on {backend}, as measured on {row['device']} ({row['shape']}: "
                   f"reference {row['reference_ms']} ms, kernel {row['kernel_ms']} ms"
                   + (", interpreted" if row.get("interpret") else "") + ")")
        else:
            why = f"auto on {backend}"
    # The TPU kernels' limits are Mosaic's: interpret mode runs every config.
    mosaic_only = impl == "pallas_tpu" and options.interpret
    problem = None if _UNCHECKED or mosaic_only else supported(op, impl, model, geometry, spec)
    if problem is not None:
        if requested == "auto":
            impl, why = "reference", f"auto: the {backend} kernel cannot run it: {problem}"
        else:
            raise ValueError(f"implementation={requested!r} cannot run {op} for this config: "
                             f"{problem}")
    if (requested == "auto" and impl != "reference" and row is None and not options.interpret
            and backend == jax.default_backend()):
        _say_unmeasured(backend, op, impl)
    return Choice(impl, options.interpret, options.blocks(op), why)


def _say_unmeasured(backend: str, op: str, implementation: str) -> None:
    """Logs, once per platform and op, that "auto" runs a kernel no measurement backs."""
    if (backend, op) in _SAID:
        return
    _SAID.add((backend, op))
    log.warning(
        "auto on %s runs the %s kernel of %s: no table holds a measured row for this platform "
        "and op (%s, %s), and a platform's kernels are the default there. `v4kv check` "
        "compares each kernel with the reference on this chip, times both and records the "
        "rows auto then follows.", backend, implementation, op, MEASURED_PATH,
        user_measured_path())


# Lowering platform names (`jax.lax.platform_dependent`) of the platforms with kernels.
_LOWERING_NAMES = {"tpu": "tpu", "gpu": "cuda"}
PLATFORMS = ("cpu", "tpu", "gpu")


def choices(op: str, model: AttentionConfig, geometry: CacheConfig,
            options: Options | None = None, spec: CompressorSpec | None = None
            ) -> dict[str, Choice]:
    """{platform: the `Choice` for `op` in a program compiled for it}, for "cpu", "tpu" and
    "gpu". A library program traces the choice of the platform it compiles for (where its
    arrays are placed, or the devices it is compiled for ahead of time:
    `programs.platform_dependent`); traced by a caller's own jit, the program holds every
    distinct choice (`jax.lax.platform_dependent`) and the platform it is lowered for keeps
    one. A forced Pallas implementation (not interpret
    mode) is its own platform's only choice: lowered for another platform, the program
    raises `KernelUnavailableError`. With `Options.interpret` every platform runs what the
    default backend would (interpret-mode kernels call the host, so the program cannot
    hold branches for other platforms)."""
    options = _options(options)
    impl = options.implementation
    if options.interpret:  # tests: interpret-mode kernels call the host, on any platform
        return {p: choose(op, model, geometry, options, spec=spec) for p in PLATFORMS}
    if impl in _BACKEND_OF:
        return {_BACKEND_OF[impl]: choose(op, model, geometry, options,
                                          backend=_BACKEND_OF[impl], spec=spec)}
    return {p: choose(op, model, geometry, options, backend=p, spec=spec) for p in PLATFORMS}


def _unavailable_abstract_eval(*args, avals, message):
    del args, message
    return avals


_ADVICE = ("Use implementation='auto' or 'reference', or interpret=True "
           "(Options(interpret=True)) to run it in interpret mode")


def _unavailable(*args, avals, message):
    del args, avals
    raise KernelUnavailableError(f"{message}; the current backend is "
                                 f"{jax.default_backend()!r}. {_ADVICE}")


def _unavailable_lowering(ctx, *args, avals, message):
    del args, avals
    platforms = ", ".join(repr(p) for p in ctx.module_context.platforms)
    raise KernelUnavailableError(f"{message}; this program is compiled for {platforms}. "
                                 f"{_ADVICE}")


# What a forced kernel leaves on the platforms it cannot run on: a value of the right type
# whose lowering raises, so the program fails when compiled there, never earlier.
_unavailable_p = jax.extend.core.Primitive("v4kv_kernel_unavailable")
_unavailable_p.multiple_results = True
_unavailable_p.def_abstract_eval(_unavailable_abstract_eval)
_unavailable_p.def_impl(_unavailable)
mlir.register_lowering(_unavailable_p, _unavailable_lowering)


def _dispatch(op: str, model: AttentionConfig, geometry: CacheConfig, options: Options | None,
              reference, kernel_call, spec: CompressorSpec | None = None):
    """`reference()` or `kernel_call(kernel function, Choice)` (same outputs) as `choices`
    decides per platform: one branch when every platform runs the same, else a
    `jax.lax.platform_dependent` over the distinct choices (the reference the default)."""
    per_platform = choices(op, model, geometry, options, spec)

    def run(choice):
        if choice.implementation == "reference":
            return reference()
        return kernel_call(getattr(kernel_module(op, choice.implementation), op), choice)

    distinct = set(per_platform.values())
    if len(per_platform) == len(PLATFORMS) and len(distinct) == 1:
        return run(distinct.pop())
    kernels = {p: c for p, c in per_platform.items() if c.implementation != "reference"}
    branches = {_LOWERING_NAMES[p]: functools.partial(run, c) for p, c in kernels.items()}
    if len(per_platform) == len(PLATFORMS):
        default = functools.partial(run, per_platform["cpu"])
    else:  # a forced kernel: nothing runs on the other platforms
        (platform, choice), = per_platform.items()

        def default():
            avals = jax.eval_shape(functools.partial(run, choice))
            leaves, tree = jax.tree.flatten(avals)
            out = _unavailable_p.bind(
                avals=tuple(jax.core.ShapedArray(x.shape, x.dtype) for x in leaves),
                message=f"implementation={_options(options).implementation!r} needs a "
                        f"{platform.upper()} backend ({op} runs its Pallas kernel only)")
            return jax.tree.unflatten(tree, out)

    return programs.platform_dependent(default=default, **branches)
