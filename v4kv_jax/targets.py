"""Compile the library's programs for a TPU from any host (ahead of time, no TPU needed).

With libtpu installed (jax's `[tpu]` extra), `jax.experimental.topologies` describes the
devices of a named TPU topology without a TPU: a program traced on `jax.ShapeDtypeStruct`s
placed on them compiles with XLA:TPU, and its Pallas kernels with Mosaic, as on a TPU host.
The CPU backend stays as it was (`JAX_PLATFORMS=cpu` works).

  devices = targets.tpu_devices("v5e:1x1")            # one v5e chip, as Colab offers
  cache = targets.abstract(jax.eval_shape(lambda: v4.init_cache(model, geometry)),
                           devices[0])
  compiled = targets.compile_for(step_program, cache, vectors, ..., options=v4.Options())

`compile_for` takes a `programs.Program` (every device program of the library; `PROGRAMS`,
`Generator.program`, `Engine.step_program`) or any jitted function, and arguments as
arrays or shape structs; arrays are placed where `abstract` says. "auto" picks the kernels
of the platform the program is compiled for (`ops.choices`), so the same call compiles the
reference on CPU and the TPU kernels on a TPU. `compiled.memory_analysis()` and
`compiled.cost_analysis()` are then the TPU compiler's own estimates (never measurements).

`programs.capture()` records the arguments of the programs a piece of code calls, so a
program built inside a class (the Generator's, the Engine's step) compiles for a TPU with the
same arguments: `compile_for(call.program, *call.args, target=devices[0], **call.kwargs)`.
With `stop_at=` that program's call is recorded without being compiled or run here (any
width: nothing of its size is allocated on this host).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re

import jax
import numpy as np

from v4kv_jax import checks

# One chip of each generation the tests compile for; `tpu_devices` takes any topology name.
GENERATIONS = {"v4": "v4:1x1x1", "v5e": "v5e:1x1", "v6e": "v6e:1x1"}


@functools.cache
def tpu_devices(topology: str = "v5e:1x1") -> tuple:
    """The devices of a TPU topology ("v5e:1x1", "v5e:2x2", "v6e:1x1", "v4:2x2x1", ...),
    described by libtpu without a TPU; programs placed on them compile for that TPU.

    Raises:
      ImportError: libtpu is not installed (`pip install "jax[tpu]"` installs the version
        this jax names).
      ValueError: an unknown topology name.
    """
    if not isinstance(topology, str) or ":" not in topology:
        checks.fail("topology", "a TPU topology name such as 'v5e:1x1' or 'v4:2x2x1'",
                    repr(topology))
    try:
        import libtpu  # noqa: F401
    except ImportError as e:
        raise ImportError("compiling for a TPU needs libtpu: pip install 'jax[tpu]' (the "
                          "libtpu version this jax names)") from e
    from jax.experimental import topologies

    # A topology description touches no TPU: several processes may describe one at once
    # (libtpu otherwise holds a lock file per machine, for processes that own the chips).
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    chips = [int(c) for c in topology.split(":", 1)[1].split("x")]
    kwargs = {}
    if int(np.prod(chips)) == 1:  # one chip is one host, whatever the generation's host size
        kwargs["chips_per_host_bounds"] = (1, 1, 1)
    try:
        desc = topologies.get_topology_desc(topology, platform="tpu", **kwargs)
    except Exception as e:
        raise ValueError(f"topology: expected a TPU topology libtpu knows; got {topology!r} "
                         f"({e})") from e
    return tuple(desc.devices)


def _target_sharding(x, target):
    """Where `x` goes on `target`: a `jax.Device` (its memory kind kept), a `Sharding`, or a
    `jax.sharding.Mesh` (the same `PartitionSpec` on it as `x` has on its own mesh)."""
    sharding = getattr(x, "sharding", None)
    memory_kind = getattr(sharding, "memory_kind", None)
    if isinstance(target, jax.sharding.Mesh):
        spec = (sharding.spec if isinstance(sharding, jax.sharding.NamedSharding)
                else jax.sharding.PartitionSpec())
        out = jax.sharding.NamedSharding(target, spec)
    elif isinstance(target, jax.sharding.Sharding):
        out = target
    else:
        out = jax.sharding.SingleDeviceSharding(target)
    if memory_kind is not None and memory_kind != out.memory_kind:
        out = out.with_memory_kind(memory_kind)
    return out


def abstract(tree, target):
    """`tree` with every array (or shape struct) as a `jax.ShapeDtypeStruct` placed on
    `target`: a device (memory kinds kept: host-memory arrays stay in host memory), a
    sharding, or a mesh (an array sharded on its own mesh gets the same partition spec on
    this one). Python scalars and other leaves pass unchanged."""
    if not isinstance(target, (jax.Device, jax.sharding.Sharding, jax.sharding.Mesh)):
        checks.fail("target", "a jax.Device, Sharding or Mesh", type(target).__name__,
                    TypeError)

    def one(x):
        if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)) or (
                isinstance(x, np.ndarray) and x.dtype != object):
            return jax.ShapeDtypeStruct(x.shape, x.dtype,
                                        sharding=_target_sharding(x, target))
        return x

    return jax.tree.map(one, tree)


def compile_for(program, *args, target=None, **kwargs) -> jax.stages.Compiled:
    """`program` (a `programs.Program` or a jitted function) compiled for `target`
    (a device, sharding or mesh: see `abstract`; None: the arguments as placed) with
    `args` and `kwargs` (static arguments as the program takes them)."""
    if not hasattr(program, "trace"):
        checks.fail("program", "a v4kv_jax Program or a jitted function",
                    type(program).__name__, TypeError)
    if target is not None:
        args, kwargs = abstract((args, kwargs), target)
    return program.trace(*args, **kwargs).lower().compile()


# An HLO value's type: dtype[dims]{minor_to_major:tiling, memory space}.
_VALUE = re.compile(r"^([a-z]+\d*)\[([\d,]*)\](\{[^}]*\})?$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.*?) ([a-z][\w\-]*)\((.*)$")
# Ops that hand a value on unchanged (its layout and buffer): a cache array stays one.
_SAME = ("copy", "copy-done", "bitcast", "opt-barrier")


def _split(text: str) -> list[str]:
    """The top-level comma-separated parts of `text` (brackets nest)."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    return parts + [text[start:].strip()] if text.strip() else parts


def _elements(result: str):
    """An HLO result type as a nested list of (shape key, layout, off HBM) per array."""
    if result.startswith("("):
        return [_elements(part) for part in _split(result[1:-1])]
    m = _VALUE.match(result)
    if not m:
        return None
    braces = m.group(3) or ""
    space = re.search(r"S\((\d+)\)", braces)
    dims = tuple(int(d) for d in m.group(2).split(",") if d)
    return ((m.group(1), dims), re.sub(r"S\(\d+\)", "", braces),
            bool(space and int(space.group(1)) > 0))


@dataclasses.dataclass(frozen=True)
class CacheCopies:
    """What a compiled program does to the stored arrays of a cache (`pools.Lanes` planes:
    the entry pools, index keys, window ring, tails, hot sets), from its optimized HLO: the
    planes are followed from the program's parameters through loops, branches, in-place
    updates and kernels.

    Attributes:
      relayouts: operations that give a plane another layout than the program takes it in
        (a relayout of a pool, in or out of a loop).
      copies: copies of a plane that stay in HBM (a relayout or a duplicate).
      moves: copies of a plane between HBM and on-chip memory (VMEM), which XLA's memory-space
        assignment makes for an array small enough to hold there.
      copied_bytes, moved_bytes: the bytes of those copies and moves (each operation once,
        a loop's body once).
    """

    relayouts: tuple[str, ...]
    copies: tuple[str, ...]
    moves: tuple[str, ...]
    copied_bytes: int
    moved_bytes: int

    @property
    def none(self) -> bool:
        """No relayout and no copy of any kind."""
        return not (self.relayouts or self.copies or self.moves)


def _parse(text: str) -> tuple[str, dict]:
    """(the entry computation's name, {computation: [(name, elements, opcode, operands,
    attributes, line)]}) of an optimized HLO module's text, fusion and reducer bodies left
    out (they hold no buffers of their own)."""
    text = re.sub(r"/\*.*?\*/", "", text)
    inner = set(re.findall(r"\b(?:calls|to_apply)=%([\w.\-]+)", text))
    computations, entry = {}, None
    for block in re.split(r"\n(?=\S)", text):
        head = re.match(r"(ENTRY )?%([\w.\-]+) ", block)
        if head is None or head.group(2) in inner:
            continue
        if head.group(1):
            entry = head.group(2)
        body = []
        for line in block.splitlines()[1:]:
            m = _INSTRUCTION.match(line)
            if m:
                name, result, opcode, rest = m.groups()
                args, _, attributes = rest.partition(")")
                body.append((name, _elements(result), opcode,
                             re.findall(r"%([\w.\-]+)", args), attributes, line.strip()))
        computations[head.group(2)] = body
    return entry, computations


def _shaped(mask, elements):
    """`mask` (per array: the cache layout of a plane, or None) in `elements`' structure."""
    if isinstance(elements, list):
        return [_shaped(mask[i] if isinstance(mask, list) and i < len(mask) else None, e)
                for i, e in enumerate(elements)]
    return None if isinstance(mask, list) else mask


def _merge(a, b):
    if isinstance(a, list) and isinstance(b, list):
        return [_merge(x, y) for x, y in zip(a, b, strict=False)]
    return a if a is not None else b


def _pairs(mask, elements) -> list[tuple[str, tuple]]:
    """(cache layout, element) of every array of a value that holds a cache plane."""
    if isinstance(mask, list) and isinstance(elements, list):
        return [p for m, e in zip(mask, elements, strict=False) for p in _pairs(m, e)]
    return [(mask, elements)] if isinstance(mask, str) and isinstance(elements, tuple) else []


_PASSING = ("parameter", "get-tuple-element", "tuple", "while", "call", "conditional")


def cache_copies(compiled: jax.stages.Compiled) -> CacheCopies:
    """The `CacheCopies` of `compiled`, a program that takes a cache (a `pools.Cache`, as
    the library's programs do: its planes are the parameters named `...planes...`),
    compiled for a TPU (`compile_for`)."""
    entry, computations = _parse(compiled.as_text())
    elements_of = {name: e for body in computations.values() for name, e, *_ in body}
    # cache[value]: per array of the value (nested like its type), the layout the program
    # takes that cache plane in, or None where the array is not a cache plane.
    cache: dict[str, object] = {}
    params: dict[tuple[str, int], object] = {}
    roots: dict[str, object] = {}
    for _ in range(4):  # a loop body sees its carried planes after a pass; nesting, more
        for comp, body in computations.items():
            for name, elements, opcode, operands, attributes, line in body:
                src = [cache.get(o) for o in operands]
                first = src[0] if src else None
                if opcode == "parameter":
                    index = int(re.search(r"parameter\((\d+)", line).group(1))
                    mask = (elements[1] if comp == entry and "planes" in name
                            and isinstance(elements, tuple) else params.get((comp, index)))
                elif opcode == "get-tuple-element":
                    index = int(re.search(r"index=(\d+)", attributes).group(1))
                    mask = first[index] if isinstance(first, list) else None
                elif opcode == "tuple":
                    mask = src
                elif opcode in _SAME:  # a bitcast to another shape is a view, not a plane
                    source = elements_of.get(operands[0]) if operands else None
                    same = (isinstance(elements, tuple) and isinstance(source, tuple)
                            and elements[0] == source[0])
                    mask = first if opcode != "bitcast" or same else None
                elif opcode == "copy-start":
                    mask = [first, first, None]
                elif opcode in ("while", "call", "conditional"):
                    called = [c for c in re.findall(r"%([\w.\-]+)",
                                                    attributes.split("metadata=")[0])
                              if c in computations]
                    for i, c in enumerate(called):
                        if opcode == "call":
                            for j, x in enumerate(src):
                                params[(c, j)] = _merge(params.get((c, j)), x)
                        else:
                            x = first if opcode == "while" else src[i + 1]
                            params[(c, 0)] = _merge(params.get((c, 0)), x)
                    mask = first if opcode == "while" else None
                    for c in called:
                        if opcode != "while" or f"body=%{c}" in attributes:
                            mask = _merge(mask, roots.get(c))
                else:  # an update in place: the result shares a cache operand's buffer
                    mask = None
                    aliased = re.findall(r"\{(\d*)\}: \((\d+)",
                                         attributes.split("output_to_operand_aliasing=")[-1]
                                         if "output_to_operand_aliasing" in attributes else "")
                    for out, operand in aliased:
                        if out == "":
                            mask = src[int(operand)]
                        else:
                            mask = _shaped(mask, elements)
                            mask[int(out)] = src[int(operand)]
                    if (not aliased and isinstance(first, str) and opcode in (
                            "fusion", "scatter", "dynamic-update-slice")
                            and isinstance(elements, tuple)
                            and isinstance(elements_of.get(operands[0]), tuple)
                            and elements[0] == elements_of[operands[0]][0]):
                        mask = first
                cache[name] = _shaped(mask, elements)
                if line.startswith("ROOT "):
                    roots[comp] = cache[name]
    relayouts, copies, moves, copied, moved = set(), [], [], 0, 0
    for body in computations.values():
        for name, elements, opcode, operands, _, line in body:
            pairs = _pairs(cache.get(name), elements)
            if not pairs or opcode in _PASSING:
                continue
            if any(layout != e[1] for layout, e in pairs):
                relayouts.add(line[:200])
            if opcode in ("copy", "copy-start"):
                (dtype, dims), _, off_hbm = pairs[0][1]
                source = elements_of.get(operands[0]) if operands else None
                off_hbm |= isinstance(source, tuple) and source[2]
                if opcode == "copy-start":  # (destination, source, context)
                    off_hbm |= elements[1][2]
                size = int(np.prod(dims, dtype=np.int64)) * _ITEMSIZE.get(dtype, 4)
                if off_hbm:
                    moves.append(line[:200])
                    moved += size
                else:
                    copies.append(line[:200])
                    copied += size
    return CacheCopies(tuple(sorted(relayouts)), tuple(copies), tuple(moves), copied, moved)


_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4,
             "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}


__all__ = ["GENERATIONS", "CacheCopies", "abstract", "cache_copies", "compile_for",
           "tpu_devices"]
