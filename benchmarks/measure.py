"""Pieces shared by the benchmark scripts (imported from the script's own folder)."""

from __future__ import annotations

import json
import os
import time

import jax
import jax.numpy as jnp


def read_bandwidth() -> float:
    """Bytes/s of a jitted sum over a 1 GiB float32 array (best of 5)."""
    x = jnp.ones((1 << 28,), jnp.float32)
    f = jax.jit(jnp.sum)
    jax.block_until_ready(f(x))
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        jax.block_until_ready(f(x))
        best = min(best, time.perf_counter() - t0)
    del x
    return (1 << 30) / best


def write_result(result: dict, path: str) -> None:
    """Writes the benchmark's result as JSON (creating the folder) and says where."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {path}")
