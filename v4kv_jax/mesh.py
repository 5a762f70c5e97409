"""Data parallelism over a device mesh: requests, their pages and State spread over devices.

A mesh for v4kv_jax has one axis, `DATA` ("data"), of N devices (`data_mesh`). Each device
holds one shard: a whole cache of the geometry it was given (`max_slots` slots, `num_pages`
pages, its own free stack and refcounts; page ids and slot ids local to the shard), so a
request on a shard never reads or writes another shard's memory, and the single MQA latent
of a request lives once, on its shard (tensor parallelism would replicate it). The mesh
holds N times the geometry's slots and pages.

As one jax.Array tree (`init_cache(..., mesh=...)`, `assemble`) the cache of a mesh is the
shards' arrays laid end to end along the axis `pools.shard_axes` names: the slot axis for
the State and the page table, the page axis for the Classical stores, the free stack and the
refcounts; the free-page count gets a leading axis of N. Sharded along `DATA` that way, the
block each device holds is exactly its shard's cache (`split` gives it back without a copy;
only the free-page count is reshaped), which is what the sharded programs see:
`shard_program` runs a per-shard body under `jax.shard_map`, with every Cache argument and
result converted between the two views inside the program. The bodies hold no collective:
a sharded step moves no data between devices except what its outputs need.

Several processes (`jax.distributed.initialize`, one global mesh) run the same code; each
process holds the shards of its own devices (`split` and `assemble` take and give only
those).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Mapping, Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from v4kv_jax import checks, pools, programs
from v4kv_jax.config import AttentionConfig, CacheConfig
from v4kv_jax.pools import Cache

P = PartitionSpec
DATA = "data"
CACHE = "cache"  # marks a Cache argument or result of `shard_program`


def data_mesh(devices: Sequence | int | None = None) -> Mesh:
    """A mesh with the one axis `DATA` over `devices` (default: every device of every
    process; an int n: the first n of them)."""
    every = jax.devices()
    if devices is None:
        devices = every
    elif isinstance(devices, (int, np.integer)) and not isinstance(devices, bool):
        n = checks.integer("devices", devices, lo=1, hi=len(every))
        devices = every[:n]
    elif isinstance(devices, (str, bytes)) or not hasattr(devices, "__len__") or not devices:
        checks.fail("devices", f"None, a device count in [1, {len(every)}] or a non-empty "
                    "sequence of jax devices", repr(devices), TypeError)
    return Mesh(np.asarray(list(devices), dtype=object), (DATA,))


def check_mesh(mesh, name: str = "mesh") -> Mesh:
    """`mesh` if it is a `jax.sharding.Mesh` whose only axis is `DATA`, else an error naming
    `name`."""
    if not isinstance(mesh, Mesh):
        checks.fail(name, "a jax.sharding.Mesh (v4kv_jax.mesh.data_mesh)", type(mesh).__name__,
                    TypeError)
    if tuple(mesh.axis_names) != (DATA,):
        checks.fail(name, f"a mesh with the one axis {DATA!r}", f"axes {mesh.axis_names}")
    return mesh


def shard_devices(mesh: Mesh) -> list:
    """The mesh's devices in shard order (shard i on `shard_devices(mesh)[i]`)."""
    return list(mesh.devices.flat)


def _spec(axis, ndim: int) -> PartitionSpec:
    if axis == pools.STACKED:
        return PartitionSpec(DATA)
    return PartitionSpec(*([None] * axis), DATA, *([None] * (ndim - axis - 1)))


def cache_specs(cache: Cache) -> Cache:
    """The PartitionSpec of each array of a mesh's cache (a Cache-shaped tree)."""
    return jax.tree.map(lambda axis, x: _spec(axis, x.ndim), pools.shard_axes(cache), cache)


def cache_shardings(cache: Cache, mesh: Mesh) -> Cache:
    """The NamedSharding of each array of a mesh's cache."""
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), cache_specs(cache),
                        is_leaf=lambda x: isinstance(x, PartitionSpec))


def _local(cache: Cache) -> Cache:
    """A shard's block of the global cache (inside `shard_map`) -> that shard's cache."""
    return jax.tree.map(lambda axis, x: x.reshape(x.shape[1:]) if axis == pools.STACKED else x,
                        pools.shard_axes(cache), cache)


def _block(cache: Cache) -> Cache:
    """A shard's cache -> its block of the global cache."""
    return jax.tree.map(lambda axis, x: x.reshape((1,) + x.shape) if axis == pools.STACKED
                        else x, pools.shard_axes(cache), cache)


def shard_program(fn: Callable, mesh: Mesh, in_specs: Sequence, out_specs) -> Callable:
    """`fn`, a per-shard body, over `mesh` with `jax.shard_map` (call it inside jit).

    in_specs has one entry per positional argument: `CACHE` for a Cache (the body gets the
    shard's cache), else a PartitionSpec (or a tree prefix of them) as shard_map takes it.
    out_specs is the same for the results (a tuple for several); a `CACHE` result takes the
    specs of the first Cache argument.
    """
    many = isinstance(out_specs, tuple)
    outs = out_specs if many else (out_specs,)

    def run(*args):
        marked = list(zip(args, in_specs, strict=True))
        caches = [a for a, s in marked if s is CACHE]
        ins = tuple(cache_specs(a) if s is CACHE else s for a, s in marked)
        out = tuple(cache_specs(caches[0]) if s is CACHE else s for s in outs)

        def body(*blocks):
            local = [_local(b) if s is CACHE else b for b, s in zip(blocks, in_specs, strict=True)]
            res = fn(*local)
            res = res if many else (res,)
            res = tuple(_block(r) if s is CACHE else r for r, s in zip(res, outs, strict=True))
            return res if many else res[0]

        return jax.shard_map(body, mesh=mesh, in_specs=ins, out_specs=out if many else out[0],
                             check_vma=False)(*args)

    return run


def init_cache(model: AttentionConfig, geometry: CacheConfig, mesh: Mesh) -> Cache:
    """An empty cache of `mesh.size` shards of `geometry`; each device makes its own."""
    mesh = check_mesh(mesh)
    return _init_jit(model, geometry, mesh)


def _init(model: AttentionConfig, geometry: CacheConfig, mesh: Mesh) -> Cache:
    specs = cache_specs(jax.eval_shape(lambda: pools.init_cache(model, geometry)))
    return jax.shard_map(lambda: _block(pools.init_cache(model, geometry)), mesh=mesh,
                         in_specs=(), out_specs=specs, check_vma=False)()


_init_jit = programs.program("mesh.init_cache", _init, static=("model", "geometry", "mesh"))


def _global_shape(axis, local_shape: tuple, n: int) -> tuple:
    if axis == pools.STACKED:
        return (n,) + local_shape
    return local_shape[:axis] + (local_shape[axis] * n,) + local_shape[axis + 1:]


def assemble(shards: Mapping[int, Cache], mesh: Mesh) -> Cache:
    """The global cache of `mesh` from shard index -> that shard's cache, on its device (every
    shard this process holds; no copy but the free-page count's reshape)."""
    devices = shard_devices(mesh)
    mine = [i for i, d in enumerate(devices) if d.process_index == jax.process_index()]
    if sorted(shards) != mine:
        checks.fail("shards", f"the caches of this process's shards {mine}", sorted(shards))
    first = shards[mine[0]]
    axes = jax.tree.leaves(pools.shard_axes(first))
    treedef = jax.tree.structure(first)
    leaves = [jax.tree.leaves(shards[i]) for i in mine]
    out = []
    for k, axis in enumerate(axes):
        pieces = [leaves[j][k] for j in range(len(mine))]
        if axis == pools.STACKED:
            pieces = [p.reshape((1,) + p.shape) for p in pieces]
        shape = _global_shape(axis, leaves[0][k].shape, len(devices))
        kind = pieces[0].sharding.memory_kind  # host memory: the C4 entries of c4_tier="host"
        out.append(jax.make_array_from_single_device_arrays(
            shape, NamedSharding(mesh, _spec(axis, len(shape)), memory_kind=kind), pieces))
    return jax.tree.unflatten(treedef, out)


def split(cache: Cache, mesh: Mesh) -> dict[int, Cache]:
    """shard index -> that shard's cache, for the shards of this process (no copy but the
    free-page count's reshape)."""
    index = {d: i for i, d in enumerate(shard_devices(mesh))}
    axes = jax.tree.leaves(pools.shard_axes(cache))
    treedef = jax.tree.structure(cache)
    by_shard: dict[int, list] = {}
    for axis, x in zip(axes, jax.tree.leaves(cache), strict=True):
        for piece in x.addressable_shards:
            data = piece.data
            if axis == pools.STACKED:
                data = data.reshape(data.shape[1:])
            if x.sharding.memory_kind == "pinned_host":  # keep the host memory space (no copy)
                data = jax.make_array_from_single_device_arrays(
                    data.shape, NamedSharding(Mesh(np.asarray([piece.device]), (DATA,)), P(),
                                              memory_kind="pinned_host"), [data])
            by_shard.setdefault(index[piece.device], []).append(data)
    return {i: jax.tree.unflatten(treedef, by_shard[i]) for i in sorted(by_shard)}


def put(x, sharding: NamedSharding) -> jax.Array:
    """A host value every process holds whole, as a global array of `sharding` (each process
    places only its own devices' blocks)."""
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def fetch(x: jax.Array) -> np.ndarray:
    """A global array whole on the host, on every process (gathered from the others when
    this process does not hold all of it)."""
    if x.is_fully_addressable:
        return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def any_process(flag: bool) -> bool:
    """Whether `flag` is True on any process (every process must call it)."""
    if jax.process_count() == 1:
        return bool(flag)
    return bool(np.any(multihost_utils.process_allgather(np.asarray([bool(flag)]))))


def exchange(value) -> list:
    """`value` of every process, by process index (every process must call it; one process:
    [value], with no communication). Values are pickled: for the small host records that
    processes share (placement scores, admission results, reports)."""
    if jax.process_count() == 1:
        return [value]
    data = np.frombuffer(pickle.dumps(value), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.asarray([data.size], np.int32)))
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[:data.size] = data
    every = np.asarray(multihost_utils.process_allgather(padded))
    return [pickle.loads(every[p, :int(n)].tobytes()) for p, n in enumerate(sizes.reshape(-1))]


def owner(mesh: Mesh, shard: int) -> int:
    """The index of the process that holds shard `shard` of `mesh`."""
    return shard_devices(mesh)[shard].process_index


def replicated(mesh: Mesh) -> NamedSharding:
    """The sharding of an array every shard reads whole (weights, keys)."""
    return NamedSharding(mesh, PartitionSpec())


def by_shard(mesh: Mesh) -> NamedSharding:
    """The sharding of an array whose leading axis is the shards' rows laid end to end."""
    return NamedSharding(mesh, PartitionSpec(DATA))


def collectives(hlo_text: str) -> dict[str, int]:
    """Collective operations by kind in an optimized HLO module's text (what a sharded
    program moves between devices)."""
    kinds = ("all-reduce", "all-gather", "all-to-all", "collective-permute",
             "reduce-scatter", "collective-broadcast")
    counts = {}
    for line in hlo_text.splitlines():
        for kind in kinds:
            if f" {kind}(" in line or f" {kind}-start(" in line:
                counts[kind] = counts.get(kind, 0) + 1
    return counts


__all__ = ["CACHE", "DATA", "P", "any_process", "assemble", "by_shard", "cache_shardings",
           "cache_specs", "check_mesh", "collectives", "data_mesh", "exchange", "fetch",
           "init_cache", "owner", "put", "replicated", "shard_devices", "shard_program", "split"]
