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

import functools
import os

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


__all__ = ["GENERATIONS", "abstract", "compile_for", "tpu_devices"]
