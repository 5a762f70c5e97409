"""The dispatcher: which implementation runs where, its errors, and the core decode path
running the kernels (interpret mode) with the results of the reference."""

from __future__ import annotations

import functools
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import v4kv_jax as v4
from pallas_kernels.indexer import BlockSizes as IndexerBlocks
from v4kv_jax import ops, pools, step
from v4kv_jax.config import KERNEL_OPS
from v4kv_jax.testing import synthetic

MODEL = v4.tiny(index_heads=16)
CORE_MODEL = v4.tiny(index_heads=16, compress_ratios=(4, 16, 0))  # one layer per kind
GEOMETRY = v4.CacheConfig(num_pages=8, max_slots=3, max_pages_per_seq=3)
DEFAULT = v4.Options(query_tile=16)


def test_auto_picks_pallas_on_tpu_and_gpu_and_the_reference_on_cpu():
    assert ops.resolve("auto", backend="cpu") == "reference"
    assert ops.resolve("auto", backend="tpu") == "pallas_tpu"
    assert ops.resolve("auto", backend="gpu") == "pallas_gpu"
    assert DEFAULT.implementation == "auto"
    for op in KERNEL_OPS:
        assert ops.choose(op, MODEL, GEOMETRY, DEFAULT, backend="cpu") == ops.Choice(
            "reference", False, None, "auto on cpu")
        assert ops.choose(op, MODEL, GEOMETRY, DEFAULT, backend="tpu").implementation == (
            "pallas_tpu")


def test_auto_on_gpu_follows_the_measured_table(monkeypatch):
    """The committed H200 rows say the reference for the three read ops; the compressor has
    no row and runs its kernel; a row where the kernel was faster picks the kernel."""
    for op in ("index_scores", "sparse_decode_attention", "dense_decode_attention"):
        choice = ops.choose(op, MODEL, GEOMETRY, DEFAULT, backend="gpu")
        assert choice.implementation == "reference", op
        assert "measured faster on NVIDIA H200" in choice.why
    for op in ("emit_entries", "emit_entries_online"):
        assert ops.choose(op, MODEL, GEOMETRY, DEFAULT, backend="gpu").implementation == (
            "pallas_gpu")
    assert ops.choose("index_scores", MODEL, GEOMETRY, v4.Options(
        implementation="pallas_gpu", interpret=True), backend="gpu").implementation == (
            "pallas_gpu")  # a forced implementation ignores the table
    faster_kernel = dict(ops.measured())
    row = faster_kernel[("gpu", "index_scores")]
    faster_kernel[("gpu", "index_scores")] = {**row, "kernel_ms": row["reference_ms"] / 2}
    monkeypatch.setattr(ops.choice, "measured", lambda: faster_kernel)
    assert ops.choose("index_scores", MODEL, GEOMETRY, DEFAULT, backend="gpu").implementation == (
        "pallas_gpu")


def test_the_measured_table_has_one_row_per_platform_and_op():
    with open(ops.MEASURED_PATH) as f:
        rows = json.load(f)["measurements"]
    assert len({(r["platform"], r["op"]) for r in rows}) == len(rows) == len(ops.measured())
    for row in rows:
        assert row["platform"] in ("tpu", "gpu") and row["op"] in KERNEL_OPS, row
        assert row["reference_ms"] > 0 and row["kernel_ms"] > 0, row


def test_forced_implementation_on_the_wrong_backend_raises():
    with pytest.raises(ops.KernelUnavailableError,
                       match=r"implementation='pallas_tpu' needs a TPU backend; the current "
                             r"backend is 'cpu'"):
        ops.resolve("pallas_tpu", backend="cpu")
    with pytest.raises(ops.KernelUnavailableError, match="needs a GPU backend.*'tpu'"):
        ops.resolve("pallas_gpu", backend="tpu")
    assert ops.resolve("pallas_gpu", backend="gpu") == "pallas_gpu"
    assert ops.resolve("pallas_tpu", backend="cpu", interpret=True) == "pallas_tpu"
    assert ops.resolve("reference", backend="tpu") == "reference"
    if jax.default_backend() == "cpu":  # the same error from an op and from the options
        cache = v4.init_cache(MODEL, GEOMETRY)
        with pytest.raises(ops.KernelUnavailableError, match="needs a GPU backend"):
            ops.choose("index_scores", MODEL, GEOMETRY, v4.Options(implementation="pallas_gpu"))
        with pytest.raises(ops.KernelUnavailableError, match="needs a TPU backend"):
            ops.dense_decode_attention(
                MODEL, GEOMETRY, v4.Options(implementation="pallas_tpu"),
                q=jnp.zeros((1, 4, 32)), sink=jnp.zeros(4),
                window=pools.window_ring(cache), window_layer=2,
                slot_ids=jnp.zeros(1, jnp.int32), q_pos=jnp.zeros(1, jnp.int32),
                kv_end=jnp.ones(1, jnp.int32), c128=pools.hca_entries(cache).c128, c128_layer=0,
                page_rows=cache.pages.page_table[:1])


def test_unknown_implementations_ops_and_block_sizes_are_rejected_by_name():
    with pytest.raises(ValueError, match=r"implementation: expected one of \('auto', "
                                         r"'reference', 'pallas_tpu', 'pallas_gpu'\); got "
                                         r"'triton'"):
        ops.resolve("triton")
    with pytest.raises(ValueError, match=r"implementation: expected one of .*; got 'xla'"):
        v4.Options(implementation="xla")
    with pytest.raises(TypeError, match=r"interpret: expected a bool; got 'yes'"):
        v4.Options(interpret="yes")
    with pytest.raises(ValueError, match=r"op: expected one of \('emit_entries'.*got 'topk'"):
        ops.choose("topk", MODEL, GEOMETRY)
    with pytest.raises(ValueError, match=r"block_sizes key: expected one of .*got 'indexer'"):
        v4.Options(block_sizes={"indexer": IndexerBlocks()})
    with pytest.raises(TypeError, match=r"block_sizes\['index_scores'\]: expected a "
                                        r"BlockSizes instance; got 64"):
        v4.Options(block_sizes={"index_scores": 64})
    with pytest.raises(TypeError, match=r"block_sizes: expected a mapping"):
        v4.Options(block_sizes=[IndexerBlocks()])


def test_block_sizes_are_options_per_op():
    blocks = IndexerBlocks(entries_per_block=64)
    options = v4.Options(implementation="pallas_tpu", interpret=True,
                         block_sizes={"index_scores": blocks})
    assert options == v4.Options(implementation="pallas_tpu", interpret=True,
                                 block_sizes=(("index_scores", blocks),))
    hash(options)  # static under jit
    assert ops.choose("index_scores", MODEL, GEOMETRY, options).block_sizes == blocks
    assert ops.choose("sparse_decode_attention", MODEL, GEOMETRY, options).block_sizes is None


def test_each_kernel_says_which_configs_it_runs():
    odd = v4.tiny(window=24)
    for op in KERNEL_OPS:
        for impl in ("pallas_tpu", "pallas_gpu"):
            assert ops.supported(op, impl, MODEL, GEOMETRY) is None, (op, impl)
        assert ops.supported(op, "pallas_tpu", odd, GEOMETRY) is None
    problem = "window=24 is not a power of two (needed by the GPU kernels)"
    assert ops.supported("dense_decode_attention", "pallas_gpu", odd, GEOMETRY) == problem
    assert ops.supported("index_scores", "pallas_gpu", odd, GEOMETRY) is None
    choice = ops.choose("emit_entries", v4.tiny(head_dim=48), GEOMETRY, DEFAULT, backend="gpu")
    assert choice.implementation == "reference"
    assert "head_dim=48 is not a power of two" in choice.why
    with pytest.raises(ValueError, match="implementation='pallas_gpu' cannot run "
                                         "sparse_decode_attention for this config: window=24"):
        ops.choose("sparse_decode_attention", odd, GEOMETRY,
                   v4.Options(implementation="pallas_gpu", interpret=True))


def _kernel_names(jaxpr) -> set[str]:
    """Names of the Pallas kernels a jaxpr calls (every pallas_call here is named v4kv_*)."""
    return set(re.findall(r"\bv4kv_[a-z_]*[a-z]", str(jaxpr)))


def _run_core(options):
    """Prefill 45, 19 and 0 tokens in two chunks, decode a token through `layer_step`
    (`step.append_and_attend`, T = 1), then `decode_step` and `decode_attention` of a CSA and an HCA
    layer."""
    data = synthetic.SyntheticBatch.draw(CORE_MODEL, 3, 50, seed=4)
    slots, lengths = np.arange(3), np.asarray([45, 19, 0])
    cache = v4.init_cache(CORE_MODEL, GEOMETRY)
    for s in slots:
        cache = v4.reset_slot(cache, s)
    done = np.zeros(3, np.int64)
    for _ in range(2):
        pos = done[:, None] + np.arange(32)[None, :]
        n = np.minimum(lengths - done, 32)
        cache, _ = step.append_and_attend(cache, data.take(pos), data.stacked_queries(pos),
                                          data.weights, slots, n, options=options)
        done += n
    cache, o = step.append_and_attend(cache, data.take(lengths), data.stacked_queries(lengths),
                                      data.weights, slots, np.ones(3, np.int32), options=options)
    outs = [np.asarray(o)]
    pos = lengths + 1
    cache = v4.decode_step(cache, data.take(pos), data.weights, options=options)
    attend = jax.jit(functools.partial(v4.decode_attention, options=options))
    for layer in (0, 1):
        outs.append(np.asarray(attend(cache, v4.LayerRef.of(cache, layer),
                                      data.queries(layer, pos[:, None]), jnp.arange(3))))
    return cache, outs, data


@pytest.mark.parametrize("implementation", ["pallas_tpu", "pallas_gpu"])
def test_core_decode_step_calls_the_kernels(implementation):
    """A decode step (T = 1) of a cache configured for kernels calls all four of them, and
    with the TPU's, the in-place writes of the window and tail rows and the SWA layers'
    window-only read."""
    options = v4.Options(implementation=implementation, interpret=True)
    data = synthetic.SyntheticBatch.draw(MODEL, 3, 1, seed=0)
    zeros = np.zeros(3, int)
    jaxpr = jax.make_jaxpr(step._append_attend_all, static_argnums=6)(
        v4.init_cache(MODEL, GEOMETRY), data.take(zeros), data.stacked_queries(zeros),
        data.weights, jnp.arange(3), jnp.ones(3, jnp.int32), options)
    suffix = "_gpu" if implementation == "pallas_gpu" else ""
    writes = ({"v4kv_write_records", "v4kv_swa_decode_attention"}
              if implementation == "pallas_tpu" else set())
    assert _kernel_names(jaxpr) == writes | {
        f"v4kv_{name}{suffix}" for name in ("compress_emit", "indexer_scores",
                                            "csa_sparse_decode_attention",
                                            "hca_dense_decode_attention")}
    # "auto" holds a branch per platform; the program lowered for the CPU keeps the reference.
    auto = jax.make_jaxpr(step._append_attend_all, static_argnums=6)(
        v4.init_cache(MODEL, GEOMETRY), data.take(zeros), data.stacked_queries(zeros),
        data.weights, jnp.arange(3), jnp.ones(3, jnp.int32), DEFAULT)
    assert {f"v4kv_{name}" for name in ("compress_emit", "indexer_scores")} <= _kernel_names(
        auto)
    on_cpu = jax.jit(step._append_attend_all, static_argnums=6).lower(
        v4.init_cache(MODEL, GEOMETRY), data.take(zeros), data.stacked_queries(zeros),
        data.weights, jnp.arange(3), jnp.ones(3, jnp.int32), DEFAULT).as_text()
    assert "v4kv_" not in on_cpu and "tpu_custom_call" not in on_cpu


def test_core_decode_path_with_tpu_kernels_matches_the_reference():
    """Prefill (compressor kernel), decode through `layer_step` (all four kernels) and
    `decode_attention` after `decode_step`: same cache, same outputs as the reference.
    (The GPU kernels take the same path through `ops`; their results are checked op by op.)"""
    want_cache, want, _ = _run_core(DEFAULT)
    got_cache, got, _ = _run_core(v4.Options(implementation="pallas_tpu", interpret=True,
                                             query_tile=16))
    for a, b in zip(want, got, strict=True):
        np.testing.assert_allclose(b, a, atol=2e-5, rtol=2e-5)
    for a, b in zip(jax.tree.leaves(want_cache), jax.tree.leaves(got_cache), strict=True):
        np.testing.assert_allclose(np.asarray(b, np.float32), np.asarray(a, np.float32),
                                   atol=2e-5, rtol=2e-5)
