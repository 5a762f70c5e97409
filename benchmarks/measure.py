"""Pieces shared by the benchmark scripts (imported from the script's own folder)."""

from __future__ import annotations

import json
import os
import time

import jax
import jax.numpy as jnp


def best_seconds(f, *args, repeats: int = 5) -> float:
    """Fastest of `repeats` timed calls of a jitted f, after one warm-up call."""
    jax.block_until_ready(f(*args))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        best = min(best, time.perf_counter() - t0)
    return best


def read_bandwidth() -> float:
    """Bytes/s of a jitted sum over a 1 GiB float32 array (best of 5)."""
    x = jnp.ones((1 << 28,), jnp.float32)
    return x.nbytes / best_seconds(jax.jit(jnp.sum), x)


def copy_bandwidth(gib: float = 1.0) -> float:
    """Bytes/s of a jitted x + 1 over `gib` GiB of fp32 (read + write), best of 5."""
    x = jnp.zeros((int(gib * 2**28),), jnp.float32)
    return 2 * x.nbytes / best_seconds(jax.jit(lambda v: v + 1), x)


def write_result(result: dict, path: str) -> None:
    """Writes the benchmark's result as JSON (creating the folder) and says where."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {path}")
