"""The one place that compiles device programs: every `jax.jit` of the library is made here.

A device program is a traced function of the library (its body lives with its logic: the
step's bodies in `step`, the pool transfers in `pools`, the Generator's loop in
`nn.generate`, the Engine's step in `engine`) turned into a `Program` by `program(...)`,
which owns:

  donation   the arguments named in `donate` (always the `cache` a program returns
             updated): their buffers are reused for the output, so the caller's copy is
             consumed; passing it again raises `checks.DonatedCacheError` (use the returned
             one)
  statics    the arguments named in `static` (configs, `Options`, graph definitions):
             hashable, one compiled program per value
  counting   `Program.traces`: how often the body was traced (= programs compiled), which
             the tests read to hold "one compilation serves every length and step"
  logging    a call that compiles (a new signature) says so on the logger "v4kv_jax" at INFO
             when its trace starts, and how long tracing and compiling took when it returns
             (`logging.basicConfig(level=logging.INFO)` shows both lines)
  placement  a donated argument holding any committed array enters committed throughout
             (`committed_together`): the program returns it so, and call 2 would otherwise
             compile the program again from call 1's trace (c4_tier="host")
  meshes     the step programs take a static `mesh` (None: one device); given one, their
             body runs per shard under `jax.shard_map` (`v4kv_jax.mesh.shard_program`): one
             compiled program serves every shard, and no program moves data between shards
  platforms  the platforms a call compiles for (where its arrays, or the abstract arrays
             of `trace`, are placed; its mesh's devices) are a static of the program: its
             body traces only their branches of `platform_dependent` (a CPU program does
             not trace the TPU and GPU kernels, a TPU program not the GPU kernels), and a
             call placed elsewhere traces again. A function of the library traced by a
             caller's own jit traces every platform's branch (`jax.lax.platform_dependent`)

The library's programs, by name (`PROGRAMS`; the Generator makes one per instance):

  step.prefill             append a chunk to every layer (prefill, decode_step)
  step.append_and_attend   append a chunk and attend in every layer
  step.replay              rewrite the State of tokens a slot holds
  slots.reset, slots.release                        the slot lifecycle (manager)
  transfers.attach, .restore, .snapshot, .hold, .drop, .read_pages, .load_pages
                                                    the prefix cache's pool transfers
  batch.pad                pad a batch's arrays to a bucket (manager)
  nn.forward               one model call (`nn.forward`)
  nn.forward41             one Decoder41 call (`nn.Decoder41.step`)
  engine.step              the Engine's step: replay, prefill and decode rows, sampling
  engine.penalty_row       a request's row of the step's penalty counts (its prompt's tokens)
  mesh.init_cache          an empty cache of a mesh, each device making its shard
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import inspect
import logging
import math
import os
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from v4kv_jax import checks

log = logging.getLogger("v4kv_jax")


class Program:
    """A jitted device program that counts its traces. Call it like the function."""

    def __init__(self, name: str, fn: Callable, *, donate: Sequence[str] = (),
                 static: Sequence[str] = (), keep_unused: bool = False):
        self.name = name
        self.donate, self.static = tuple(donate), tuple(static)
        self._traces = 0
        self._compiling: float | None = None  # when this call's trace started
        self._call = None  # the arguments of the call in progress

        @functools.wraps(fn)
        def traced(*args, v4kv_platforms=None, **kwargs):
            self._traces += 1  # the Python body runs only while jax traces it
            if self._compiling is None and self._outermost():
                self._compiling = time.perf_counter()
                log.info("compiling %s (its first call with these shapes and statics)",
                         self.name)
            token = _PLATFORMS.set(v4kv_platforms)
            try:
                return fn(*args, **kwargs)
            finally:
                _PLATFORMS.reset(token)

        signature = inspect.signature(fn)
        traced.__signature__ = signature.replace(parameters=[
            *signature.parameters.values(),
            inspect.Parameter(_STATIC, inspect.Parameter.KEYWORD_ONLY, default=None)])
        self._jitted = jax.jit(traced, donate_argnames=self.donate,
                               static_argnames=(*self.static, _STATIC),
                               keep_unused=keep_unused)
        self._params = tuple(inspect.signature(fn).parameters)
        self._donated_at = frozenset(i for i, name in enumerate(self._params)
                                     if name in self.donate)

    def __call__(self, *args, **kwargs):
        names = list(self._params)
        for i, x in enumerate(args):
            if i in self._donated_at:
                checks.alive(names[i], x)
        for k in self.donate:
            if k in kwargs:
                checks.alive(k, kwargs[k])
        args = [committed_together(x) if i in self._donated_at else x
                for i, x in enumerate(args)]
        kwargs = {k: committed_together(x) if k in self.donate else x for k, x in kwargs.items()}
        self._call = (args, kwargs)
        if _CAPTURES and self._outermost():
            calls = _CAPTURES[-1]
            calls.append(Call(self, *_abstract_call(args, kwargs)))
            if calls.stop_at is self:
                raise _Stopped(calls)
        try:
            return self._jitted(*args, **kwargs, **{_STATIC: _platforms_of(args, kwargs)})
        finally:
            self._call = None
            if self._compiling is not None:
                log.info("compiled %s in %.2f s", self.name,
                         time.perf_counter() - self._compiling)
                self._compiling = None

    def _outermost(self) -> bool:
        """Whether the call being traced came from outside any trace: inside another
        program's trace (its arguments are tracers) it compiles nothing of its own. Looked at
        only when a call traces, so a call that runs a compiled program does not walk its
        arguments."""
        return not any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(self._call))

    def trace(self, *args, **kwargs) -> jax.stages.Traced:
        """The program traced for `args` (arrays or `jax.ShapeDtypeStruct`s, placed where it
        should compile: `v4kv_jax.targets`) and its static `kwargs`; `.lower().compile()`
        compiles it without running it."""
        return self._jitted.trace(*args, **kwargs, **{_STATIC: _platforms_of(args, kwargs)})

    @property
    def traces(self) -> int:
        """How many times the body was traced: one per compiled program."""
        return self._traces

    def __repr__(self) -> str:
        return (f"Program({self.name!r}, donate={self.donate}, static={self.static}, "
                f"traces={self.traces})")


def committed_together(tree):
    """`tree` with its uncommitted arrays committed where they are (same buffers, no copy)
    when any of its arrays is committed; else `tree` as it is.

    jit compiles one program per placement of its arguments: an uncommitted single-device
    array is placed nowhere in particular, a committed one where it is. A program with a
    committed argument, or one that moves data between memory kinds, returns every array
    committed, so a cache holding committed arrays (c4_tier="host": its C4 entries in host
    memory) and uncommitted ones would compile its first call and its second apart, from
    one trace. Committed throughout (`init_cache` with c4_tier="host", every donated
    argument holding a committed array) or not at all (the device tier, whose programs
    return it so), a cache keeps one placement across calls. Tracers and non-arrays pass.
    """
    def committed(x) -> bool | None:
        return x.committed if isinstance(x, jax.Array) and not isinstance(
            x, jax.core.Tracer) else None

    flags = [committed(x) for x in jax.tree.leaves(tree)]
    if True not in flags or False not in flags:
        return tree
    return jax.tree.map(
        lambda x: jax.device_put(x, x.sharding) if committed(x) is False else x, tree)


@dataclasses.dataclass(frozen=True)
class Call:
    """A recorded call of a `Program`: `args` and `kwargs` with every array as a
    `jax.ShapeDtypeStruct` (shape, dtype and placement), statics as passed."""

    program: Program
    args: tuple
    kwargs: dict


class _Calls(list):
    """The `Call`s a `capture` block made, in call order."""

    def __init__(self, stop_at):
        super().__init__()
        self.stop_at = stop_at

    @property
    def stopped(self) -> Call | None:
        """The call of `stop_at` that ended the block (always the last one recorded), or None
        when the block ran to its end."""
        return self[-1] if self and self.stop_at is not None and \
            self[-1].program is self.stop_at else None


class _Stopped(BaseException):
    """Ends a `capture(stop_at=...)` block at its program's call: control flow, not an error,
    so the library's `except Exception` handlers (an Engine's per-request failures) let it
    through."""

    def __init__(self, calls):
        super().__init__("a programs.capture(stop_at=...) block ended at its program's call")
        self.calls = calls


_CAPTURES: list[_Calls] = []


def _abstract_call(args, kwargs):
    def one(x):
        if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        return x

    return tuple(jax.tree.map(one, tuple(args))), jax.tree.map(one, dict(kwargs))


@contextlib.contextmanager
def capture(stop_at: Program | None = None):
    """Records the calls of every `Program` made inside the block as a list of `Call`s, in
    call order; `v4kv_jax.targets.compile_for(call.program, *call.args, target=...,
    **call.kwargs)` compiles one for another target.

    The calls run, except a call of `stop_at`: it is recorded, and the block ends there
    (the rest of the block is skipped, no error). So a program can be captured for another
    target without compiling or running it here, e.g. a Generator's program at widths this
    host could not run: `with capture(stop_at=gen.program) as calls: gen.generate(...)`.
    The calls before it ran as usual (a Generator's admission: `slots.reset`, then
    `generator`), so the program to compile is the last call, `calls.stopped` (None when
    the block ran to its end). The stopped call consumes nothing: its arguments, the
    donated cache included, stay as they were, and a Generator keeps working after the
    block (its cache is the one its admission returned). An Engine stopped in its step keeps
    that step's requests in flight (`Engine.in_flight`; its next steps run them).
    """
    if stop_at is not None and not isinstance(stop_at, Program):
        raise TypeError("stop_at: expected a v4kv_jax Program or None; got "
                        f"{type(stop_at).__name__}")
    calls = _Calls(stop_at)
    _CAPTURES.append(calls)
    try:
        yield calls
    except _Stopped as stopped:
        if stopped.calls is not calls:
            raise
    finally:
        _CAPTURES.remove(calls)


def default_cache_dir() -> str:
    """The per-user folder of the persistent compilation cache: $XDG_CACHE_HOME/v4kv_jax/jax,
    by default ~/.cache/v4kv_jax/jax."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "v4kv_jax", "jax")


def compile_cache(directory: str | os.PathLike | None = None) -> str:
    """Turns on jax's persistent compilation cache for this process and returns its folder:
    the programs compiled from then on are written there, and a later process that calls
    this too loads them instead of compiling them again (the library's programs take seconds
    each to compile; `v4kv demo` compiles 19).

    Call it once, first thing (`v4kv_jax.compile_cache()`): jax decides whether a process
    uses the cache at its first compilation, so a call after anything has compiled is
    ignored by jax.

    Args:
      directory: the folder (made when missing); None: JAX_COMPILATION_CACHE_DIR if set,
        else `default_cache_dir()`. Every program is kept however fast it compiled, unless
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS says otherwise.
    """
    if directory is not None and not isinstance(directory, (str, os.PathLike)):
        checks.fail("directory", "a path (str or os.PathLike) or None",
                    type(directory).__name__, TypeError)
    path = os.path.abspath(os.fspath(directory) if directory is not None else (
        os.environ.get("JAX_COMPILATION_CACHE_DIR") or default_cache_dir()))
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", path)
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return path


# --- the platforms a program compiles for --------------------------------------------------

# The static a Program passes its jitted body: the platforms its call compiles for.
_STATIC = "v4kv_platforms"
# While a Program's body traces: the platforms it compiles for ("cpu", "tpu", "gpu"), or None
# (unknown: every platform's branch is traced).
_PLATFORMS: contextvars.ContextVar[frozenset[str] | None] = contextvars.ContextVar(
    "v4kv_traced_platforms", default=None)
# `jax.lax.platform_dependent`'s branch names -> the platform (`jax.Device.platform`).
_BRANCH_PLATFORM = {"cpu": "cpu", "tpu": "tpu", "cuda": "gpu", "rocm": "gpu", "gpu": "gpu"}


def _platforms_of(args, kwargs) -> frozenset[str] | None:
    """The platforms a call with `args` and `kwargs` compiles for: those of the devices its
    arrays (or placed `jax.ShapeDtypeStruct`s) and its `mesh` are on; inside another
    program's trace (tracers), that program's; None when nothing says (every platform)."""
    found = set()
    for x in jax.tree.leaves((args, kwargs)):
        if isinstance(x, jax.core.Tracer):
            continue
        sharding = getattr(x, "sharding", None) if isinstance(
            x, (jax.Array, jax.ShapeDtypeStruct)) else None
        if sharding is not None:
            found.update(d.platform for d in sharding.device_set)
    mesh = kwargs.get("mesh")
    if isinstance(mesh, jax.sharding.Mesh):
        found.update(d.platform for d in mesh.devices.flat)
    if not found:
        return _PLATFORMS.get()
    return frozenset(_BRANCH_PLATFORM.get(p, p) for p in found)


def traced_platforms() -> frozenset[str] | None:
    """The platforms ("cpu", "tpu", "gpu") the `Program` whose body is tracing compiles for,
    or None outside one (a caller's own jit: any platform)."""
    return _PLATFORMS.get()


def platform_dependent(*args, default: Callable, **branches: Callable):
    """`jax.lax.platform_dependent(*args, default=..., **branches)` (branches named by
    lowering platform: "tpu", "cuda", "rocm", "cpu") that traces only the branches of the
    platforms the program compiles for (`traced_platforms`): for a CPU or a TPU alone, its
    branch (or `default`) is called directly; outside a program, every branch is traced."""
    for name, fn in (("default", default), *branches.items()):
        if not callable(fn):
            checks.fail(name, "a callable (a branch)", type(fn).__name__, TypeError)
    platforms = _PLATFORMS.get()
    if platforms is None:
        return jax.lax.platform_dependent(*args, default=default, **branches)
    kept = {name: fn for name, fn in branches.items()
            if _BRANCH_PLATFORM.get(name, name) in platforms}
    if platforms in ({"cpu"}, {"tpu"}):
        return next(iter(kept.values()), default)(*args)
    # A GPU is CUDA or ROCm, which only lowering tells apart: it picks among the GPU branches.
    return jax.lax.platform_dependent(*args, default=default, **kept)


# A lookup whose broadcast compare would touch more elements than this stays a gather.
_SELECT_BUDGET = 1 << 24


def lookup(table, index, *, batched: bool = False):
    """`table[index]` (or, `batched`, `table[b, index[b]]` per leading row b), with an index
    out of range clamped into it and a negative one counted from the end, as jnp indexing
    does, compiled as the platform reads it best.

    XLA:TPU charges a gather or a scatter of a handful of indices megabytes (a gather of 8
    int32 from s32[1029]: 2.1 MiB by its cost analysis) however small the table; a compare
    against an iota and a max over the table's rows, fused into one pass over it, is charged
    the table's bytes. So a TPU program selects (where the compare stays within
    `_SELECT_BUDGET` elements) and every other platform gathers. Both give the same bits:
    exactly one row matches, every other row is replaced by the lowest value (-inf, or the
    dtype's minimum) before the max, so -0.0, infinities and NaN pass unchanged.

    Args:
      table: [R, *rest], or `batched` [B, R, *rest].
      index: integer [*ix], or `batched` [B, *ix].

    Returns:
      [*ix, *rest], or `batched` [B, *ix, *rest].
    """
    axis = 1 if batched else 0
    shape = tuple(getattr(table, "shape", ()))
    if len(shape) <= axis:
        rows = "rows after the batch" if batched else "rows"
        checks.fail("table", f"an array of at least {axis + 1} dims ({rows})", f"shape {shape}")
    index = jnp.asarray(index)
    checks.dtype_kind("index", index, "integer")
    if batched and (index.ndim < 1 or index.shape[0] != table.shape[0]):
        checks.fail("index", f"a leading batch dim of {table.shape[0]} (batched)",
                    f"shape {index.shape}")
    rows = table.shape[axis]
    index = jnp.clip(jnp.where(index < 0, index + rows, index), 0, rows - 1)

    def gather(table, index):
        if not batched:
            return table[index]
        b = jnp.arange(table.shape[0]).reshape((-1,) + (1,) * (index.ndim - 1))
        return table[b, index]

    touched = index.size * rows * max(1, math.prod(table.shape[axis + 1:]))
    if touched > _SELECT_BUDGET or table.dtype == jnp.bool_:
        return gather(table, index)
    return platform_dependent(table, index, tpu=functools.partial(
        _select_rows, batched=batched), default=gather)


def _select_rows(table, index, *, batched: bool):
    """`lookup`'s TPU form: [*ix, R, *rest] compares fused into a max over R."""
    axis = 1 if batched else 0
    rows, rest = table.shape[axis], table.shape[axis + 1:]
    iota = jnp.arange(rows, dtype=index.dtype)
    hit = (index[..., None] == iota).reshape(*index.shape, rows, *(1,) * len(rest))
    if batched:
        table = table.reshape(table.shape[0], *(1,) * (index.ndim - 1), rows, *rest)
    low = (-jnp.inf if jnp.issubdtype(table.dtype, jnp.floating)
           else jnp.iinfo(table.dtype).min)
    return jnp.max(jnp.where(hit, table, jnp.array(low, table.dtype)), axis=index.ndim)


def scatter(table, index, values, *, op: str):
    """`table.at[index].<op>(values, mode="drop")` for op "set", "max" or "add" ("add" of
    integers only), an index outside [0, R) (negative too) dropped, compiled as the platform
    writes it best (`lookup`: on a TPU, compares against an iota fused into one pass over
    the table). Both forms give the same bits where no index repeats ("max" and "add": also
    where one does).

    Args:
      table: [R, *rest].
      index: integer [*ix].
      values: [*ix, *rest], or broadcastable to it.
    """
    if op not in ("set", "max", "add"):
        checks.fail("op", '"set", "max" or "add"', repr(op))
    if op == "add" and not jnp.issubdtype(table.dtype, jnp.integer):
        checks.fail("table", 'integers for op="add"', str(table.dtype), TypeError)
    rows = table.shape[0]
    index = jnp.asarray(index)
    index = jnp.where((index >= 0) & (index < rows), index, rows)
    values = jnp.broadcast_to(jnp.asarray(values, table.dtype), index.shape + table.shape[1:])

    def scattered(table, index, values):
        return getattr(table.at[index], op)(values, mode="drop")

    if index.size * table.size > _SELECT_BUDGET or table.dtype == jnp.bool_:
        return scattered(table, index, values)
    return platform_dependent(table, index, values, tpu=functools.partial(
        _select_scatter, op=op), default=scattered)


def _select_scatter(table, index, values, *, op: str):
    """`scatter`'s TPU form: [k, R, *rest] compares fused into a reduction over the k."""
    rows, rest = table.shape[0], table.shape[1:]
    index, values = index.reshape(-1), values.reshape(-1, *rest)
    hit = (index[:, None] == jnp.arange(rows, dtype=index.dtype)).reshape(
        index.size, rows, *(1,) * len(rest))
    values = values[:, None]
    if op == "add":
        return table + jnp.sum(jnp.where(hit, values, 0), axis=0, dtype=table.dtype)
    low = jnp.array(-jnp.inf if jnp.issubdtype(table.dtype, jnp.floating)
                    else jnp.iinfo(table.dtype).min, table.dtype)
    top = jnp.max(jnp.where(hit, values, low), axis=0)
    if op == "max":
        return jnp.maximum(table, top)
    return jnp.where(jnp.any(hit, axis=0), top, table)


PROGRAMS: dict[str, Program] = {}


def program(name: str, fn: Callable, *, donate: Sequence[str] = (), static: Sequence[str] = (),
            register: bool = True, keep_unused: bool = False) -> Program:
    """The `Program` of `fn`: jitted with `donate` donated and `static` static.

    Args:
      name: the program's name; a registered name is unique in `PROGRAMS`.
      fn: the traced body.
      donate: argument names whose buffers the program consumes.
      static: argument names that are hashable compile-time values.
      register: list it in `PROGRAMS` (off for programs made per instance).
      keep_unused: keep arguments the body does not read as the program's parameters (laid
        out and counted like the others).
    """
    made = Program(name, fn, donate=donate, static=static, keep_unused=keep_unused)
    if register:
        if name in PROGRAMS:
            raise ValueError(f"name: expected a program name not yet registered; got {name!r}")
        PROGRAMS[name] = made
    return made


__all__ = ["PROGRAMS", "Call", "Program", "capture", "committed_together", "compile_cache",
           "default_cache_dir", "platform_dependent", "program", "traced_platforms"]
