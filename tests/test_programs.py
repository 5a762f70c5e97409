"""`v4kv_jax.programs`: a call that compiles says so on the "v4kv_jax" logger; a program traces
the branches of the platforms it compiles for."""

from __future__ import annotations

import logging
import re

import jax.numpy as jnp
import numpy as np
import pytest

from v4kv_jax import programs


def test_a_compiling_call_logs_its_start_and_duration(caplog):
    inner = programs.program("test.inner", lambda x: x + 1, register=False)
    outer = programs.program("test.outer", lambda x: inner(x) * 2, register=False)
    caplog.set_level(logging.INFO, logger="v4kv_jax")
    outer(jnp.ones(3))
    lines = [(r.name, r.levelno, r.getMessage()) for r in caplog.records]
    assert lines[0] == ("v4kv_jax", logging.INFO,
                        "compiling test.outer (its first call with these shapes and statics)")
    assert lines[1][:2] == ("v4kv_jax", logging.INFO)
    assert re.fullmatch(r"compiled test\.outer in \d+\.\d\d s", lines[1][2])
    assert len(lines) == 2  # the inner program compiles as part of the outer one
    caplog.clear()
    outer(jnp.zeros(3))  # the same signature: compiled already
    assert caplog.records == []
    outer(jnp.zeros(4))  # a new shape compiles again
    assert [r.getMessage().split()[0] for r in caplog.records] == ["compiling", "compiled"]


def test_capture_stop_at_records_the_call_without_compiling_or_running_it():
    ran = []
    inner = programs.program("capture_inner", lambda x: x * 2, register=False)
    outer = programs.program("capture_outer", lambda x: inner(x) + 1, register=False)
    with programs.capture(stop_at=outer) as calls:
        inner(jnp.ones(3))
        outer(jnp.ones((2, 3)))
        ran.append("after")
    assert [c.program for c in calls] == [inner, outer]  # outermost calls only
    assert calls[1].args[0].shape == (2, 3) and calls[1].args[0].dtype == jnp.float32
    assert ran == [] and outer.traces == 0 and inner.traces == 1
    with programs.capture() as calls:  # without stop_at every call runs
        assert float(outer(jnp.ones(()))) == 3.0
    assert [c.program for c in calls] == [outer]


def test_capture_names_a_bad_stop_at():
    with pytest.raises(TypeError, match="stop_at: expected a v4kv_jax Program or None; "
                                        "got function"):
        with programs.capture(stop_at=lambda x: x):
            pass


def test_a_generator_keeps_working_after_a_capture_stopped_at_its_program():
    """The stopped call consumes nothing: the Generator's cache (donated by its program) is
    the one its admission returned, so later calls run and give the same tokens."""
    from flax import nnx

    import v4kv_jax as v4
    from v4kv_jax.nn import Decoder, ModelConfig
    from v4kv_jax.serve import Generator

    from conftest import GEOMETRY

    window_only = v4.tiny(compress_ratios=(0,))  # compiles fastest
    decoder = Decoder(ModelConfig(window_only, vocab_size=40, mlp_hidden=0), rngs=nnx.Rngs(3),
                      bias_scale=0.3)
    gen = Generator(decoder, GEOMETRY, max_prompt_len=16, max_new_tokens=3, prefill_chunk=8)
    before = gen.generate([[1, 2, 3], [4, 5]]).as_lists()
    with programs.capture(stop_at=gen.program) as calls:
        gen.generate([[7, 8, 9]])
    assert calls.stopped is calls[-1] and calls.stopped.program is gen.program
    assert [c.program.name for c in calls[:-1]] == ["slots.release"] * 2 + ["slots.reset"]
    assert gen.traces == 1  # the stopped call compiled nothing
    assert gen.generate([[1, 2, 3], [4, 5]]).as_lists() == before
    assert v4.inspect_slots(gen.cache)[0].length == 3 + 3 - 1


def test_compile_cache_turns_the_persistent_cache_on_in_one_line(tmp_path, monkeypatch):
    """`v4kv_jax.compile_cache()`: jax's persistent cache on, in the folder given, else
    JAX_COMPILATION_CACHE_DIR's, else the per-user one (the CLI's; its files are written by
    the demo in tests/test_cli.py)."""
    import jax

    import v4kv_jax as v4

    config = ("jax_enable_compilation_cache", "jax_compilation_cache_dir",
              "jax_persistent_cache_min_compile_time_secs")
    before = {name: getattr(jax.config, name) for name in config}
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    monkeypatch.delenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", raising=False)
    try:
        assert v4.compile_cache(tmp_path / "mine") == str(tmp_path / "mine")
        assert jax.config.jax_enable_compilation_cache
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "mine")
        assert jax.config.jax_persistent_cache_min_compile_time_secs == 0.0
        monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "env"))
        assert v4.compile_cache() == str(tmp_path / "env")
        monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")
        assert v4.compile_cache() == str(tmp_path / "xdg" / "v4kv_jax" / "jax")
        assert jax.config.jax_compilation_cache_dir == programs.default_cache_dir()
        with pytest.raises(TypeError, match=r"directory: expected a path \(str or "
                                            r"os.PathLike\) or None; got int"):
            v4.compile_cache(3)
    finally:
        for name, value in before.items():
            jax.config.update(name, value)


def _branches(seen: list):
    """A body of three platform branches that note which were traced."""
    def body(x):
        return programs.platform_dependent(
            x, tpu=lambda x: seen.append("tpu") or x * 2,
            cuda=lambda x: seen.append("gpu") or x * 3,
            default=lambda x: seen.append("default") or x + 1)

    return body


def test_a_program_traces_only_the_branches_of_the_platforms_it_compiles_for():
    """A Program's body traces the `platform_dependent` branch of the platform its arrays are
    on (a CPU call: the default branch, called directly), and a program called inside it
    inherits that; a caller's own jit of the same body traces every branch."""
    import jax

    seen = []
    body = _branches(seen)
    assert programs.traced_platforms() is None
    inner = programs.program("test.platform_inner", body, register=False)
    outer = programs.program("test.platform_outer", lambda x: inner(x) * 10, register=False)
    assert outer(jnp.ones(3)).tolist() == [20.0] * 3
    assert seen == ["default"]
    seen.clear()
    assert jax.jit(body)(jnp.ones(3)).tolist() == [2.0] * 3  # the CPU's branch runs
    assert sorted(seen) == ["default", "gpu", "tpu"]  # all traced


def test_the_step_traced_for_the_cpu_holds_no_kernel():
    """The decode step with "auto", called with arrays on the CPU: the reference only, no
    Pallas kernel of another platform traced into it (tracing them took over half the
    step's trace time)."""
    import jax

    import v4kv_jax as v4
    from v4kv_jax.testing import compile_sweep as sweep

    model, geometry = v4.tiny(), v4.CacheConfig(num_pages=8, max_slots=2, max_pages_per_seq=4)
    args = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                        sweep.step_arguments(model, geometry, 2, 1))
    cache, vectors, weights, slot_ids, n_new = args
    queries = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                           sweep.step_queries(model, 2, 1))
    program = programs.PROGRAMS["step.append_and_attend"]
    text = str(program.trace(cache, vectors, queries, weights, slot_ids, n_new,
                             options=v4.Options(), mesh=None).jaxpr)
    assert "pallas_call" not in text and "platform_index" not in text
    # Outside a Program (a caller's jit), every platform's kernel is traced.
    traced = jax.jit(lambda *a: v4.append_and_attend(*a)).trace(
        cache, vectors, queries, weights, slot_ids, n_new)
    assert "pallas_call" in str(traced.jaxpr)


def test_a_branch_that_is_not_callable_is_named():
    with pytest.raises(TypeError, match=r"^tpu: expected a callable \(a branch\); got int$"):
        programs.platform_dependent(jnp.ones(3), tpu=3, default=lambda x: x)


def test_a_gpu_program_leaves_cuda_or_rocm_to_lowering():
    """A program for a GPU traces the GPU branches and the default (a ROCm GPU lowers the
    default where a branch is CUDA's), never the TPU's."""
    import jax

    seen = []
    token = programs._PLATFORMS.set(frozenset({"gpu"}))
    try:
        jax.make_jaxpr(_branches(seen))(jnp.ones(3))
    finally:
        programs._PLATFORMS.reset(token)
    assert sorted(seen) == ["default", "gpu"]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int32, jnp.uint32])
@pytest.mark.parametrize("batched", [False, True])
def test_lookup_selects_on_a_tpu_the_bits_a_gather_reads(dtype, batched):
    """The TPU form of `programs.lookup` (compare against an iota, max over the rows) gives
    the gather's bits: -0.0, infinities and NaN pass, indices out of range are clamped and
    negative ones count from the end, as jnp indexing does."""
    rng = np.random.default_rng(7)
    shape = (3, 6, 5) if batched else (6, 5)
    table = rng.standard_normal(shape) * 4
    if jnp.issubdtype(dtype, jnp.floating):
        flat = table.reshape(-1)
        flat[:4] = [-0.0, np.inf, -np.inf, np.nan]
    else:
        table = rng.integers(0, 2**31 - 1, shape) * (-1 if dtype == jnp.int32 else 1)
        table.reshape(-1)[:2] = [np.iinfo(np.int32).min, 0] if dtype == jnp.int32 else [
            0, 2**31 - 1]
    table = jnp.asarray(table, dtype)
    index = jnp.asarray(rng.integers(-8, 9, (3, 4) if batched else (2, 4)), jnp.int32)
    rows = shape[1 if batched else 0]
    clamped = jnp.clip(jnp.where(index < 0, index + rows, index), 0, rows - 1)
    want = (table[jnp.arange(3)[:, None], clamped] if batched else table[clamped])
    got = programs._select_rows(table, clamped, batched=batched)
    assert got.shape == want.shape == programs.lookup(table, index, batched=batched).shape
    assert np.asarray(got).tobytes() == np.asarray(want).tobytes()
    assert np.asarray(programs.lookup(table, index, batched=batched)).tobytes() == (
        np.asarray(want).tobytes())


@pytest.mark.parametrize("op", ["set", "max", "add"])
def test_scatter_writes_on_a_tpu_the_bits_a_scatter_writes(op):
    """The TPU form of `programs.scatter` equals XLA's scatter with out-of-range indices
    (negative too) dropped: "set" with distinct indices, "max" and "add" with repeats."""
    rng = np.random.default_rng(3)
    for rest in ((), (3,)):
        table = jnp.asarray(rng.integers(-50, 50, (9, *rest)), jnp.int32)
        index = (jnp.asarray([4, -1, 0, 12, 8, 9]) if op == "set"
                 else jnp.asarray([[4, 4, -3], [0, 9, 4]]))
        values = jnp.asarray(rng.integers(-60, 60, (*index.shape, *rest)), jnp.int32)
        kept = jnp.where((index >= 0) & (index < 9), index, 9)
        want = getattr(table.at[kept], op)(values, mode="drop")
        got = programs._select_scatter(table, kept, values, op=op)
        assert np.array_equal(got, want)
        assert np.array_equal(programs.scatter(table, index, values, op=op), want)
        assert not np.array_equal(want, table)


def test_scatter_names_a_bad_op_and_a_float_add():
    table = jnp.zeros((4,), jnp.int32)
    with pytest.raises(ValueError, match='op.*"set", "max" or "add".*min'):
        programs.scatter(table, jnp.asarray([1]), 1, op="min")
    with pytest.raises(TypeError, match="table.*integers.*float32"):
        programs.scatter(jnp.zeros((4,)), jnp.asarray([1]), 1.0, op="add")


def test_lookup_names_a_bad_table_and_index():
    with pytest.raises(TypeError, match="index: expected an array of integer dtype"):
        programs.lookup(jnp.arange(3), jnp.array([0.5]))
    with pytest.raises(ValueError, match=r"table: expected an array of at least 1 dims"):
        programs.lookup(jnp.zeros(()), jnp.array([0]))
    with pytest.raises(ValueError, match=r"index: expected a leading batch dim of 2"):
        programs.lookup(jnp.zeros((2, 3)), jnp.array([0, 1, 1]), batched=True)
