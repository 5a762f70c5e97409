"""Shared configs and drivers for the tests.

The tests reuse a few fixed geometries and chunk shapes so that each jitted function compiles
once per test session; the chunking itself varies through `n_new`, never through shapes.
"""

from __future__ import annotations

import os

import hypothesis
import jax
import numpy as np
import pytest

import v4kv_jax as v4
from v4kv_jax import step
from v4kv_jax.testing import oracle, synthetic

from guardrails import pytest_configure, pytest_runtest_protocol  # noqa: F401 (hooks)

jax.config.update("jax_default_matmul_precision", "highest")

# No persistent compilation cache, in the tests or in the processes they start (set through
# the environment, which child processes inherit): a worker once died of a segmentation fault
# inside jaxlib while serializing an executable for a cache the workers shared, and the cache
# saved nothing measurable (the suite on 2 cores: 722 s without it, 737 to 761 s with it).
# benchmarks/compile_cache.py checks the cache on the library's programs as users meet it.
os.environ["JAX_ENABLE_COMPILATION_CACHE"] = "false"
# libtpu is installed (the TPU compile tests): without a TPU, jax would try it first and
# print a warning in every process. Runs on a device (V4KV_KERNEL_DEVICE) pick their own.
if not os.environ.get("V4KV_KERNEL_DEVICE"):
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
jax.config.update("jax_enable_compilation_cache", False)
# XLA:CPU at optimization level 0, with its older per-element fusion emitters, for the tests
# and the processes they start: most of the suite's time is compiling small programs, and
# this halves it (the tiny config's step: 1.9 s -> 1.0 s; tests/test_formats.py 90 s -> 70 s).
# The HLO passes (fusion, layouts) are the same; each fusion's code comes from another
# emitter, so float results can differ from the default's in the last bits: every bit-for-bit
# comparison in the suite is between two programs compiled with these same flags, and every
# comparison with an oracle has a tolerance. Benchmarks keep XLA's defaults. The one
# exception: a sharded program and a one-device program of the same rows are compiled for
# different shapes, and the older emitters then round a few outputs differently (6 of 40,960
# by one ulp), where XLA's default emitters give the same bits; tests/multi_device.py holds
# the mesh to those bits with the default emitters (`default_emitters`).
LEGACY_EMITTERS = "--xla_cpu_use_fusion_emitters=false"
_flags = os.environ.get("XLA_FLAGS", "")
os.environ["XLA_FLAGS"] = " ".join(
    [_flags] + [f for f in ("--xla_backend_optimization_level=0", LEGACY_EMITTERS)
                if f.split("=")[0] not in _flags]).strip()


def default_emitters(flags: str) -> str:
    """XLA_FLAGS `flags` with XLA's default fusion emitters (kept by a conftest it starts)."""
    return " ".join(f for f in flags.split() if f != LEGACY_EMITTERS) + (
        " --xla_cpu_use_fusion_emitters=true")


# The files that take longest, longest first: `--dist loadfile --no-loadscope-reorder` hands
# files to the workers in collection order, so these start first and the short files fill in
# around them (tests/test_suite_guards.py checks the option stays).
_LONGEST_FIRST = ("test_mesh.py", "test_tpu_compile.py", "test_formats.py", "test_step.py",
                  "test_engine.py", "test_kernel_compressor.py", "test_layer_recipe.py",
                  "test_nn_model.py", "test_hot.py", "test_isolation.py", "test_notebook.py",
                  "test_cli.py", "test_engine_faults.py", "test_kernel_dense_attention.py",
                  "test_parity_transformers.py")


def pytest_collection_modifyitems(session, config, items):
    def rank(item):
        name = os.path.basename(str(item.path))
        return _LONGEST_FIRST.index(name) if name in _LONGEST_FIRST else len(_LONGEST_FIRST)

    items.sort(key=rank)  # stable: a file's tests keep their order


# Enough indexer heads that exact-zero (ReLU) score ties are practically absent.
MODEL = v4.tiny(index_heads=16)
GEOMETRY = v4.CacheConfig(num_pages=24, max_slots=3, max_pages_per_seq=6)
OPTIONS = v4.Options(query_tile=16)  # two query tiles per chunk: the tiled path runs
CHUNK = 32  # the one prefill chunk shape used by the tests


# Library vs the float64 oracle, outside the RoPE dims: fp32 arithmetic alone. Observed at
# most 9e-7 on values up to |4| (about 4 ulps); 4e-6 leaves a factor 4 for other seeds.
ORACLE_FP32_ATOL = 4e-6
# Largest |value| the library rotates in these tests: RMS-normed entries (norm weights
# 1 +- 0.1) and attention outputs, weighted means of N(0, 1) draws; observed at most 4.
ROTATED_BOUND = 6.0


# CI draws the same examples every run (a failure there reproduces); locally
# V4KV_HYPOTHESIS_PROFILE=explore draws new ones each run.
hypothesis.settings.register_profile("ci", derandomize=True)
hypothesis.settings.register_profile("explore", derandomize=False)
hypothesis.settings.load_profile(os.environ.get("V4KV_HYPOTHESIS_PROFILE", "ci"))


def hypothesis_examples(default: int) -> int:
    return int(os.environ.get("V4KV_HYPOTHESIS_EXAMPLES", default))


def oracle_atol(model, kind, positions, magnitude=ROTATED_BOUND, rotations: int = 1):
    """Tolerance of library values against the oracle: fp32 arithmetic plus `rotations` times
    the bound on the fp32 RoPE angles at `positions` (`oracle.rope_atol`, SPEC pitfall 11).

    A cached entry is rotated once. An attention output carries three such errors: its entries'
    rotations (a weighted mean of them), the logit shift they cause, and its own de-rotation.
    """
    return ORACLE_FP32_ATOL + rotations * oracle.rope_atol(model, kind, positions, magnitude)


def assert_matches_oracle(got, want, atol, err_msg=""):
    """|got - want| <= atol elementwise (atol broadcast against them, e.g. per position)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, f"{err_msg}: shape {got.shape} != {want.shape}"
    atol = np.broadcast_to(atol, got.shape)
    off = ~(np.abs(got - want) <= atol)
    if off.any():
        i = np.unravel_index(np.argmax(np.where(off, np.abs(got - want) - atol, -np.inf)),
                             got.shape)
        raise AssertionError(
            f"{err_msg}: {int(off.sum())} of {off.size} values off the oracle; worst at {i}: "
            f"got {got[i]:.9g}, want {want[i]:.9g}, tolerance {atol[i]:.3g}")


def new_cache(model=MODEL, geometry=GEOMETRY, slots=None):
    cache = v4.init_cache(model, geometry)
    for s in range(geometry.max_slots) if slots is None else slots:
        cache = v4.reset_slot(cache, s)
    return cache


def run_chunks(cache, data: synthetic.SyntheticBatch, plan, rows=None, slot_ids=None,
               chunk=CHUNK, with_attention=True, *, options=OPTIONS):
    """Feeds `data` rows into slots following `plan`, a list of per-row token counts per call.

    plan[i][b] tokens of row b go in call i (0 <= plan[i][b] <= chunk). Returns the cache and
    the attention outputs gathered per row, f32[n_layers, B, L, H, hd] (L = data length).
    """
    rows = np.arange(data.batch) if rows is None else np.asarray(rows)
    slot_ids = np.arange(len(rows)) if slot_ids is None else np.asarray(slot_ids)
    model = data.config
    total = data.window.shape[2]
    out = np.zeros((model.num_layers, len(rows), total, model.num_heads, model.head_dim),
                   np.float32)
    done = np.zeros(len(rows), np.int64)
    for counts in plan:
        counts = np.asarray(counts)
        vectors = data.take(positions(done, chunk), rows)
        if with_attention:
            queries = data.stacked_queries(positions(done, chunk), rows)
            cache, o = step.append_and_attend(cache, vectors, queries, data.weights, slot_ids,
                                              counts, options=options)
            o = np.asarray(o)
            for b in range(len(rows)):
                out[:, b, done[b]:done[b] + counts[b]] = o[:, b, :counts[b]]
        else:
            cache = step.prefill(cache, vectors, data.weights, slot_ids, counts,
                                 options=options)
        done += counts
    return cache, out


def positions(starts, chunk):
    """i32[B, chunk]: the positions of a chunk starting at each row's `starts`."""
    return np.asarray(starts)[:, None] + np.arange(chunk)[None, :]


def chunk_plan(lengths, sizes):
    """Calls that feed each row `lengths[b]` tokens in pieces of sizes[i % len(sizes)]."""
    lengths = np.asarray(lengths)
    done = np.zeros_like(lengths)
    plan, i = [], 0
    while (done < lengths).any():
        n = np.minimum(sizes[i % len(sizes)], lengths - done)
        plan.append(n)
        done += n
        i += 1
    return plan


@pytest.fixture(scope="session")
def model():
    return MODEL


@pytest.fixture(autouse=True)
def _fresh_tpu_interpreter(request):
    """A kernel that failed mid-run leaves TPU interpreter state behind: cleared after each
    kernel test."""
    yield
    if "kernels" in request.node.path.parts:
        from pallas_kernels.common import reset_tpu_interpreter

        reset_tpu_interpreter()
