"""Pieces shared by the benchmark scripts (imported from the script's own folder)."""

from __future__ import annotations

import json
import os
import re
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


# Opcodes that compute nothing at run time: not counted as operations.
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast"}
# Opcodes whose called computations run as part of the step (followed); the computations of
# fusions, reductions, sorts and scatters are parts of one operation (not followed).
CONTROL = {"while", "conditional", "call"}


def hlo_operations(hlo_text: str) -> dict[str, list[dict]]:
    """The operations of an optimized HLO module's text, per computation in order: dicts of
    name, opcode, result (its type, layouts dropped: `f32[4,8,128]`), rhs (the text after
    `=`) and entry (whether the computation is the entry one)."""
    computations: dict[str, list[dict]] = {}
    current, is_entry = None, False
    for line in hlo_text.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            head = line.split()
            is_entry = head[0] == "ENTRY"
            current = (head[1] if is_entry else head[0]).lstrip("%")
            computations[current] = []
        elif current is not None and " = " in line:
            lhs, rhs = line.split(" = ", 1)
            match = re.search(r"(?:^|\s)([a-z][\w\-.]*)\(", rhs)
            if match is None:
                continue
            computations[current].append(dict(
                name=lhs.split()[-1].lstrip("%"), opcode=match.group(1),
                result=re.sub(r"\{[^}]*\}", "", rhs[:match.start()]).strip(), rhs=rhs,
                entry=is_entry))
    return computations


def hlo_counts(compiled) -> dict:
    """Operation counts of a compiled program's optimized HLO (`jit(f).lower(...).compile()`).

    entry_ops: the entry computation's operations (parameters, constants, tuples and bitcasts
    not counted); entry_fusions, entry_conditionals, entry_whiles: of those; fusions: fusion
    operations of the entry computation and of every loop body, loop condition and branch it
    runs, each computation counted once (a loop's body once, whatever its trip count).
    """
    computations = hlo_operations(compiled.as_text())
    entry = next((c for c, ops in computations.items() if ops and ops[0]["entry"]), None)

    def callees(op) -> list[str]:
        if op["opcode"] not in CONTROL:
            return []
        names = re.findall(r"(?:condition|body|to_apply|true_computation|"
                           r"false_computation)=%?([\w.\-]+)", op["rhs"])
        branches = re.search(r"branch_computations=\{([^}]*)\}", op["rhs"])
        if branches:
            names += [b.strip().lstrip("%") for b in branches.group(1).split(",")]
        return names

    ops = [op["opcode"] for op in computations.get(entry, []) if op["opcode"] not in _FREE]
    seen, todo, fusions = set(), [entry], 0
    while todo:
        name = todo.pop()
        if name in seen or name not in computations:
            continue
        seen.add(name)
        for op in computations[name]:
            fusions += op["opcode"] == "fusion"
            todo += callees(op)
    return dict(entry_ops=len(ops), entry_fusions=ops.count("fusion"),
                entry_conditionals=ops.count("conditional"), entry_whiles=ops.count("while"),
                fusions=fusions)
