"""The dispatcher: which implementation runs where, its errors, and the core decode path
running the kernels (interpret mode) with the results of the reference."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import v4kv_jax as v4
from v4kv_jax import ops, pools, step
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
    if jax.default_backend() == "cpu":
        assert ops.selected(MODEL, DEFAULT) == ("reference", False)


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
            ops.selected(MODEL, v4.Options(implementation="pallas_gpu"))
        with pytest.raises(ops.KernelUnavailableError, match="needs a TPU backend"):
            ops.dense_decode_attention(
                MODEL, GEOMETRY, q=jnp.zeros((1, 4, 32)), sink=jnp.zeros(4),
                window=pools.window_ring(cache), window_layer=2,
                slot_ids=jnp.zeros(1, jnp.int32), q_pos=jnp.zeros(1, jnp.int32),
                kv_end=jnp.ones(1, jnp.int32), c128=pools.entries(cache, "hca"), c128_layer=0,
                page_rows=cache.pages.page_table[:1], implementation="pallas_tpu")


def test_unknown_implementations_are_rejected_by_name():
    with pytest.raises(ValueError, match=r"implementation: expected one of \('auto', "
                                         r"'reference', 'pallas_tpu', 'pallas_gpu'\); got "
                                         r"'triton'"):
        ops.resolve("triton")
    with pytest.raises(ValueError, match=r"implementation: expected one of .*; got 'xla'"):
        v4.Options(implementation="xla")
    with pytest.raises(TypeError, match=r"interpret: expected a bool; got 'yes'"):
        v4.Options(interpret="yes")


def test_gpu_kernels_need_power_of_two_widths():
    odd = v4.tiny(window=24)
    assert ops.gpu_support_problem(MODEL) is None
    assert ops.gpu_support_problem(odd) == (
        "window=24 is not a power of two (needed by the GPU kernels)")
    assert ops.selected(odd, DEFAULT, backend="gpu") == ("reference", False)
    assert ops.selected(MODEL, DEFAULT, backend="gpu") == ("pallas_gpu", False)
    with pytest.raises(ValueError, match="'pallas_gpu' cannot run this config: window=24"):
        ops.selected(odd, DEFAULT, implementation="pallas_gpu", interpret=True)


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
    """A decode step (T = 1) of a cache configured for kernels calls all four of them."""
    options = v4.Options(implementation=implementation, interpret=True)
    data = synthetic.SyntheticBatch.draw(MODEL, 3, 1, seed=0)
    zeros = np.zeros(3, int)
    jaxpr = jax.make_jaxpr(step._append_attend_all, static_argnums=6)(
        v4.init_cache(MODEL, GEOMETRY), data.take(zeros), data.stacked_queries(zeros),
        data.weights, jnp.arange(3), jnp.ones(3, jnp.int32), options)
    suffix = "_gpu" if implementation == "pallas_gpu" else ""
    assert _kernel_names(jaxpr) == {
        f"v4kv_{name}{suffix}" for name in ("compress_emit", "indexer_scores",
                                            "csa_sparse_decode_attention",
                                            "hca_dense_decode_attention")}
    reference = jax.make_jaxpr(step._append_attend_all, static_argnums=6)(
        v4.init_cache(MODEL, GEOMETRY), data.take(zeros), data.stacked_queries(zeros),
        data.weights, jnp.arange(3), jnp.ones(3, jnp.int32), DEFAULT)
    assert not _kernel_names(reference)


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
