"""The serving clock: seconds this process has spent compiling, and host time less them.

jax reports each compilation stage as a duration event (`jax.monitoring`): tracing a function
to a jaxpr, lowering it to MLIR, and the backend's compile (XLA). `compile_seconds()` sums
them over the process, from the import of this module on, counting only outermost events:
a function traced inside another's trace (a nested jit) reports its own tracing event within
its caller's, and is not counted twice. Nesting is read from the start of each stage, which
jax records as a scalar event of the same name when the stage begins; a jax that stops
recording those starts makes the clock count nested traces too (an overestimate of the
small nested ones, never an undercount).

`serving_time()` is `time.perf_counter()` less `compile_seconds()`: a clock that stands
still while the process compiles. The Engine's request metrics (`RequestMetrics`: queue
time, time to first token, time per output token, tokens per second) are intervals of this
clock, and the compile seconds within a request's life are reported apart
(`RequestMetrics.compile_time`, `Engine.metrics()["compile_s"]`). Compilations of other
threads of the process count too: the clock is process-wide.
"""

from __future__ import annotations

import threading
import time

import jax

# jax's compilation stages (jax._src.dispatch: JAXPR_TRACE_EVENT, JAXPR_TO_MLIR_MODULE_EVENT,
# BACKEND_COMPILE_EVENT), each reported as a duration when the stage ends.
STAGES = ("/jax/core/compile/jaxpr_trace_duration",
          "/jax/core/compile/jaxpr_to_mlir_module_duration",
          "/jax/core/compile/backend_compile_duration")

_seconds = 0.0
_open = threading.local()  # per thread: how many stages have begun and not ended
_lock = threading.Lock()


def _began(event: str, value: float, **kwargs) -> None:
    if event in STAGES:
        _open.depth = getattr(_open, "depth", 0) + 1


def _ended(event: str, seconds: float, **kwargs) -> None:
    global _seconds
    if event not in STAGES:
        return
    depth = max(getattr(_open, "depth", 0) - 1, 0)
    _open.depth = depth
    if depth == 0:  # an outermost stage: the nested ones ran inside its seconds
        with _lock:
            _seconds += seconds


jax.monitoring.register_scalar_listener(_began)
jax.monitoring.register_event_duration_secs_listener(_ended)


def compile_seconds() -> float:
    """Seconds this process has spent tracing, lowering and compiling device programs since
    the library was imported (every thread's)."""
    return _seconds


def serving_time() -> float:
    """`time.perf_counter()` less `compile_seconds()`: host seconds that stand still while
    the process compiles."""
    return time.perf_counter() - _seconds


__all__ = ["STAGES", "compile_seconds", "serving_time"]
