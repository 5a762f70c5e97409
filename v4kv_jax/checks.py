"""Argument checks shared by every public entry point (core, nn, manager, interop, CLI).

Each check raises `TypeError` (wrong kind of value) or `ValueError` (right kind, wrong value)
with one message shape: the argument's name, what was expected, and what was given:

    slot_ids: expected distinct slot ids in [0, 4); got [0, 0]

Checks on values only run when the values are concrete. Inside a caller's `jax.jit` the
arguments are tracers and `concrete` is False: there the device-side rule holds instead
(a row that breaks a rule writes nothing and its slot is flagged; see `v4kv_jax.step`).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable

import jax
import numpy as np


def _show(value, limit: int = 12) -> str:
    """A short repr of a value for an error message (long arrays are cut)."""
    if isinstance(value, (jax.Array, np.ndarray)) and not isinstance(value, jax.core.Tracer):
        flat = np.asarray(value).reshape(-1)
        items = ", ".join(repr(v) for v in flat[:limit].tolist())
        return f"[{items}{', ...' if flat.size > limit else ''}]"
    return value if isinstance(value, str) else repr(value)


def fail(name: str, expected: str, got, error: type[Exception] = ValueError) -> None:
    """Raises `error` with the uniform message `name: expected ...; got ...`."""
    raise error(f"{name}: expected {expected}; got {_show(got)}")


class DonatedCacheError(RuntimeError):
    """A cache (or another argument a program donates) was passed again after a call that
    donated it: its arrays were handed over to that call's result and are deleted. The
    call's returned cache is the one to use (`cache = v4.prefill(cache, ...)`)."""


def alive(name: str, tree) -> None:
    """Raises `DonatedCacheError` when an array of `tree` was deleted (donated to an earlier
    call); one flag read per array, no transfer. Tracers pass."""
    for leaf in jax.tree.leaves(tree):
        if (isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer)
                and leaf.is_deleted()):
            kind = type(tree).__name__
            raise DonatedCacheError(
                f"{name}: expected a {kind} whose arrays are alive; got one that an earlier "
                f"call donated (array {leaf.dtype.name}{list(leaf.shape)} is deleted): use "
                "what that call returned instead, e.g. cache = v4.prefill(cache, ...) or "
                "cache, out = v4.append_and_attend(cache, ...)")


def concrete(*values) -> bool:
    """True when no value (or pytree leaf) is a tracer, so its contents can be inspected."""
    return not any(isinstance(leaf, jax.core.Tracer)
                   for leaf in jax.tree.leaves(list(values)))


def integer(name: str, value, *, lo: int | None = None, hi: int | None = None) -> int:
    """A Python or numpy integer (not a bool, not a float) in [lo, hi]; returns it as int."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        fail(name, "an integer", repr(value), TypeError)
    value = int(value)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        fail(name, f"an integer in [{'-inf' if lo is None else lo}, "
             f"{'inf' if hi is None else hi}]", value)
    return value


def real(name: str, value, *, lo: float | None = None, hi: float | None = None,
         lo_open: bool = False) -> float:
    """A finite real number in [lo, hi] (or (lo, hi] with `lo_open`); returns it as float."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        fail(name, "a real number", repr(value), TypeError)
    value = float(value)
    if not math.isfinite(value):
        fail(name, "a finite number", value)
    below = lo is not None and (value <= lo if lo_open else value < lo)
    if below or (hi is not None and value > hi):
        left = "(" if lo_open else "["
        fail(name, f"a number in {left}{'-inf' if lo is None else lo}, "
             f"{'inf' if hi is None else hi}]", value)
    return value


def one_of(name: str, value, choices: Iterable) -> None:
    choices = tuple(choices)
    if value not in choices:
        fail(name, f"one of {choices}", repr(value))


def shape(name: str, x, expected: tuple) -> None:
    """x.shape equals `expected` (a None entry matches any size)."""
    got = tuple(np.shape(x))
    if len(got) != len(expected) or any(e is not None and e != g
                                        for e, g in zip(expected, got, strict=False)):
        shown = "(" + ", ".join("*" if e is None else str(e) for e in expected) + ")"
        fail(name, f"shape {shown}", f"shape {got}")


def dtype_kind(name: str, x, kind: str) -> None:
    """x's dtype is of `kind`: "integer", "floating" or "bool"."""
    dt = np.dtype(x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype)
    ok = {"integer": np.issubdtype(dt, np.integer) and dt != np.bool_,
          "floating": np.issubdtype(dt, np.floating) or dt.name == "bfloat16",
          "bool": dt == np.bool_}[kind]
    if not ok:
        fail(name, f"an array of {kind} dtype", f"dtype {dt}", TypeError)


def int_array(name: str, x, *, ndim: int | None = None, lo: int | None = None,
              hi: int | None = None) -> np.ndarray:
    """A concrete integer array with values in [lo, hi]; returns it as a numpy array."""
    if isinstance(x, (list, tuple)):
        for v in np.asarray(x, dtype=object).reshape(-1):
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Integral):
                fail(name, "integers", list(x), TypeError)
        arr = np.asarray(x, np.int64)
    else:
        arr = np.asarray(x)
        dtype_kind(name, arr, "integer")
    if ndim is not None and arr.ndim != ndim:
        fail(name, f"a {ndim}-D array", f"shape {arr.shape}")
    if arr.size and lo is not None and arr.min() < lo:
        fail(name, f"values >= {lo}", arr)
    if arr.size and hi is not None and arr.max() > hi:
        fail(name, f"values <= {hi}", arr)
    return arr


def slot_ids(x, max_slots: int, *, name: str = "slot_ids", padding: bool = False
             ) -> np.ndarray:
    """Distinct slot ids of a 1-D integer array, each in [0, max_slots); with `padding`, -1
    also marks a padding row (any number of them)."""
    ids = int_array(name, x, ndim=1)
    lo = -1 if padding else 0
    if ids.size and (ids.min() < lo or ids.max() >= max_slots):
        extra = " or -1 for a padding row" if padding else ""
        fail(name, f"slot ids in [0, {max_slots}) (max_slots){extra}", ids)
    real = ids[ids >= 0].tolist()
    if len(set(real)) != len(real):
        fail(name, "distinct slot ids (a slot appears once per call)", ids)
    return ids


def slot(x, max_slots: int, *, name: str = "slot") -> int:
    """One slot id in [0, max_slots)."""
    if isinstance(x, (jax.Array, np.ndarray)) and np.ndim(x) == 0:
        dtype_kind(name, x, "integer")
        x = int(x)
    return integer(name, x, lo=0, hi=max_slots - 1)


__all__ = ["DonatedCacheError", "alive", "concrete", "dtype_kind", "fail", "int_array", "integer",
           "one_of", "real", "shape", "slot", "slot_ids"]
