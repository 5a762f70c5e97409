"""Shared configs and drivers for the tests.

The tests reuse a few fixed geometries and chunk shapes so that each jitted function compiles
once per test session; the chunking itself varies through `n_new`, never through shapes.
"""

from __future__ import annotations

import contextlib
import os

import hypothesis
import jax
import numpy as np
import pytest

import v4kv_jax as v4
from v4kv_jax import step
from v4kv_jax.testing import oracle, synthetic

import xla_defaults
from guardrails import pytest_configure as _guardrails_configure
from guardrails import pytest_runtest_protocol  # noqa: F401 (a hook)

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
# "auto" reads the rows `v4kv check` records in the user's table: the suite reads none of a
# developer's (a path no test writes; tests that record point V4KV_MEASURED elsewhere).
os.environ["V4KV_MEASURED"] = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                           "no-such-dir", "measured.json")
# Two ways to compile.
#
# The suite: XLA:CPU at optimization level 0, with its older per-element fusion emitters, for
# the tests and the processes they start. Most of the suite's time is compiling small
# programs, and this halves it (the tiny config's step: 1.9 s -> 1.0 s; tests/test_formats.py
# 90 s -> 70 s). The HLO passes (fusion, layouts) are the same; the code of each fusion and
# dot comes from another emitter and another LLVM pipeline, so float results differ from the
# default's in the last bits. Every comparison with an oracle has a tolerance, and a
# comparison of two runs of ONE program (poisoned against clean, padding rows) keeps its bits
# under any flags.
#
# The bit-for-bit promises between two DIFFERENT programs (HiSparse against the all-on-device
# read, a mesh against one device, replay and restore against the request that wrote the
# State, chunked prefill against decode) hold for the programs users compile, XLA's
# defaults: their tests are marked `xla_defaults` and run in a pytest subprocess per file
# without these flags (tests/xla_defaults.py; tests/multi_device.py, which needs eight host
# devices, in its own: tests/test_mesh.py). Under these flags some of them differ by an ulp
# (a hot-set read of host-memory entries: 0.3% of outputs), so the fast flags would test
# other programs than the ones promised. A subprocess, because XLA reads XLA_FLAGS once per
# process; jax 0.10.2 does apply a DebugOptions override per compile over XLA_FLAGS
# (`.lower().compile(compiler_options={"xla_backend_optimization_level": 3,
# "xla_cpu_use_fusion_emitters": True})` gives the default's bits under these flags), but the
# library compiles its programs itself (`v4kv_jax.programs`, the Engine), with no options a
# test could hand down, and a patch of jax's compile path would test something users do not
# run. Benchmarks keep XLA's defaults.
if not xla_defaults.IN_SUBPROCESS:
    _flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = " ".join(
        [_flags] + [f for f in ("--xla_backend_optimization_level=0",
                                "--xla_cpu_use_fusion_emitters=false")
                    if f.split("=")[0] not in _flags]).strip()


def pytest_configure(config):
    _guardrails_configure(config)
    if not config.pluginmanager.has_plugin("xla_defaults"):  # else loaded with -p
        config.pluginmanager.register(xla_defaults, "xla_defaults")


# The files that take longest, longest first: `--dist loadfile --no-loadscope-reorder` hands
# files to the workers in collection order, so these start first and the short files fill in
# around them (tests/test_suite_guards.py checks the option stays).
_LONGEST_FIRST = ("test_mesh.py", "test_tpu_compile.py", "test_formats.py", "test_step.py",
                  "test_hot.py", "test_engine.py", "test_kernel_compressor.py",
                  "test_prefix_device.py", "test_layer_recipe.py", "test_nn_model.py",
                  "test_own_model.py", "test_isolation.py", "test_notebook.py",
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


@contextlib.contextmanager
def lowerings(name: str):
    """The programs jax lowers while inside, named `name` (one per executable it makes, from
    XLA or the persistent cache), counted into the list it yields."""
    made = []

    def listen(event, duration, **kwargs):
        if event == "/jax/core/compile/jaxpr_to_mlir_module_duration" and name in str(
                kwargs.get("fun_name")):
            made.append(kwargs["fun_name"])

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield made
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


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
