"""The library compiled for TPUs, without a TPU: XLA:TPU and Mosaic (libtpu) compile the
programs for devices of a named topology (`v4kv_jax.targets`). Run in a process of their own
by tests/test_tpu_compile.py (libtpu and the TPU compiler's memory leave with it); by hand:
`python -m pytest -o addopts= tests/tpu_compile_checks.py`.

- Every Pallas TPU kernel, forced one op at a time, over a sweep of generations (v4, v5e,
  v6e), widths (the tests' tiny config, the notebook's, V4-Flash, V4-Pro), storage formats
  (float32, bfloat16, release), page sizes and batches: `supported()` says None exactly
  where Mosaic compiles (each generation sweeps its own slice of the product here; the
  whole product is `python benchmarks/tpu_compile.py --sweep`).
- The step programs with "auto" (decode and a prefill chunk) pick the TPU kernels where
  they run and compile; the notebook's Generator program for the single chips Colab offers;
  the data-parallel step on a 4-chip topology holds no collective.
"""

from __future__ import annotations

import itertools
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("libtpu", reason="compiling for a TPU needs libtpu (jax's [tpu] extra)")

import v4kv_jax as v4  # noqa: E402
from v4kv_jax import mesh as meshes  # noqa: E402
from v4kv_jax import ops, programs, targets  # noqa: E402
from v4kv_jax.testing import compile_sweep as sweep  # noqa: E402

GENERATIONS = tuple(targets.GENERATIONS)


def _device(generation: str):
    return targets.tpu_devices(targets.GENERATIONS[generation])[0]


# This suite's share of the sweep, per generation: every format and op over one or two
# widths (one of them a release width: the packed formats do not fit the tiny and notebook
# rows), one page size and one batch, so that together the generations cover every width,
# page size and batch. The whole product is `python benchmarks/tpu_compile.py --sweep`.
SLICES = {
    "v4": dict(widths=("notebook", "flash"), page_tokens=(128,), batches=(1,)),
    "v5e": dict(widths=("pro",), page_tokens=(256,), batches=(64,)),
    "v6e": dict(widths=("tiny", "flash"), page_tokens=(128,), batches=(4,)),
}


@pytest.mark.time_limit(280)
@pytest.mark.parametrize("generation", GENERATIONS)
def test_supported_is_none_exactly_where_mosaic_compiles(generation):
    rows = list(sweep.sweep(generations=(generation,), **SLICES[generation]))
    assert {r.formats for r in rows} == set(sweep.FORMATS)
    assert {r.case for r in rows} == set(sweep.OP_CASES)
    wrong = [(r.case, r.widths, r.formats, r.page_tokens, r.batch, r.supported, r.error)
             for r in rows if not r.agrees]
    assert not wrong, wrong
    # Every kernel compiles in float32 and in the release formats.
    for r in rows:
        if r.formats != "bfloat16":
            assert r.error is None, (r.case, r.widths, r.formats, r.error)


def test_a_rejected_config_says_why_and_auto_falls_back():
    model, geometry = sweep.WIDTHS["notebook"](), sweep.geometry_for("bfloat16", 128, 4)
    choice = ops.choose("sparse_decode_attention", model, geometry, backend="tpu")
    assert choice.implementation == "reference"
    assert "entry_dtype='bfloat16'" in choice.why and "Mosaic" in choice.why
    with pytest.raises(ValueError, match="cannot run sparse_decode_attention.*16-bit"):
        ops.choose("sparse_decode_attention", model, geometry,
                   v4.Options(implementation="pallas_tpu"), backend="tpu")
    assert ops.choices("sparse_decode_attention", model,
                       sweep.geometry_for("release", 128, 4))["tpu"].implementation == (
        "pallas_tpu")


def _step_arguments(model, geometry, batch, tokens):
    cache, vectors, weights, slot_ids, n_new = sweep.step_arguments(model, geometry, batch,
                                                                    tokens)
    return cache, vectors, sweep.step_queries(model, batch, tokens), weights, slot_ids, n_new


def _kernels(compiled) -> set[str]:
    text = compiled.as_text()
    return {name for name in ("v4kv_compress_emit", "v4kv_indexer_scores",
                              "v4kv_csa_sparse_decode_attention",
                              "v4kv_hca_dense_decode_attention") if name in text}


@pytest.mark.time_limit(280)
@pytest.mark.parametrize("generation", GENERATIONS)
def test_auto_compiles_the_step_with_the_tpu_kernels(generation):
    """Decode and a prefill chunk of the public step program, "auto", at the tests' widths:
    the decode step holds all four TPU kernels, the chunk the emission (its reads are the
    reference's), and the cache is updated in place (aliased, not copied)."""
    model, geometry = v4.tiny(), sweep.geometry_for("float32", 128, 4, context=512)
    program = programs.PROGRAMS["step.append_and_attend"]
    for tokens, kernels in ((1, 4), (16, 1)):
        args = _step_arguments(model, geometry, 4, tokens)
        compiled = targets.compile_for(program, *args, target=_device(generation),
                                       options=v4.Options(), mesh=None)
        assert len(_kernels(compiled)) == kernels, (tokens, _kernels(compiled))
        memory = compiled.memory_analysis()
        cache_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(args[0]))
        assert memory.alias_size_in_bytes >= cache_bytes


def test_a_forced_kernel_compiles_for_its_platform_only():
    model, geometry = v4.tiny(), sweep.geometry_for("float32", 128, 4, context=512)
    args = _step_arguments(model, geometry, 4, 1)
    program = programs.PROGRAMS["step.append_and_attend"]
    tpu = v4.Options(implementation="pallas_tpu")
    targets.compile_for(program, *args, target=_device("v5e"), options=tpu, mesh=None)
    with pytest.raises(ops.KernelUnavailableError,
                       match="needs a TPU backend.*compiled for 'cpu'"):
        targets.compile_for(program, *args, target=jax.devices("cpu")[0], options=tpu,
                            mesh=None)


@pytest.fixture(scope="module")
def notebook_generator_call():
    """The notebook's model and Generator, its program's call recorded (not compiled or run on
    the CPU: `capture(stop_at=...)`)."""
    from flax import nnx

    from v4kv_jax.nn import Decoder, ModelConfig
    from v4kv_jax.serve import Generator

    attention = sweep.WIDTHS["notebook"]()
    config = ModelConfig(attention, vocab_size=1000, mlp_hidden=256)
    model = Decoder(config, rngs=nnx.Rngs(0), bias_scale=0.5)
    geometry = v4.CacheConfig(num_pages=64, max_slots=4, max_pages_per_seq=8)
    gen = Generator(model, geometry, max_prompt_len=512, max_new_tokens=24, prefill_chunk=128)
    with programs.capture(stop_at=gen.program) as calls:
        gen.generate([[1, 2, 3]], 2)
    assert gen.program.traces == 0  # recorded only
    (call,) = [c for c in calls if c.program is gen.program]
    return call


@pytest.mark.time_limit(280)
@pytest.mark.parametrize("generation", ["v5e", "v6e"])
def test_the_notebooks_generator_compiles_for_a_colab_tpu(notebook_generator_call, generation):
    """The notebook's Generator program (what it runs on a Colab TPU) compiled for the single
    chips Colab offers, with the TPU kernels "auto" picks."""
    call = notebook_generator_call
    compiled = targets.compile_for(call.program, *call.args, target=_device(generation),
                                   **call.kwargs)
    assert {"v4kv_compress_emit", "v4kv_indexer_scores"} <= _kernels(compiled)


def test_the_data_parallel_step_compiles_for_four_chips_without_collectives():
    """The step over a data mesh of a v5e 2x2 slice (4 chips, 2 slots each): one program,
    every shard's rows on its chip, no collective (as on CPU)."""
    devices = targets.tpu_devices("v5e:2x2")
    mesh = jax.sharding.Mesh(np.array(devices), (meshes.DATA,))
    model, geometry = v4.tiny(), sweep.geometry_for("float32", 128, 2, context=512)
    whole = jax.eval_shape(lambda: meshes.init_cache(model, geometry, mesh))
    cache = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                         whole, meshes.cache_shardings(whole, mesh))
    _, vectors, queries, weights, slot_ids, n_new = _step_arguments(model, geometry, 8, 1)
    named = lambda spec: jax.sharding.NamedSharding(mesh, spec)  # noqa: E731
    rows, by_row = named(meshes.P(None, meshes.DATA)), named(meshes.P(meshes.DATA))
    queries = targets.abstract(queries, rows).replace(
        sink=targets.abstract(queries.sink, named(meshes.P())))
    compiled = targets.compile_for(
        programs.PROGRAMS["step.append_and_attend"], cache, targets.abstract(vectors, rows),
        queries, targets.abstract(weights, named(meshes.P())),
        targets.abstract(slot_ids, by_row), targets.abstract(n_new, by_row),
        options=v4.Options(), mesh=mesh)
    assert not any(meshes.collectives(compiled.as_text()).values())
    assert len(_kernels(compiled)) == 4


def test_the_slices_cover_every_width_page_size_and_batch():
    for field, every in (("widths", set(sweep.WIDTHS)), ("page_tokens", {128, 256}),
                         ("batches", {1, 64})):
        assert every <= set(itertools.chain(*(s[field] for s in SLICES.values()))), field


def test_bad_targets_are_named():
    with pytest.raises(ValueError, match=r"topology: expected a TPU topology name such as "
                                         r"'v5e:1x1' or 'v4:2x2x1'; got 'v5e'"):
        targets.tpu_devices("v5e")
    with pytest.raises(ValueError, match=r"topology: expected a TPU topology libtpu knows; "
                                         r"got 'v9z:1x1'"):
        targets.tpu_devices("v9z:1x1")
    with pytest.raises(TypeError, match=r"target: expected a jax.Device, Sharding or Mesh; "
                                        r"got str$"):
        targets.abstract(jnp.zeros(2), "tpu")
    with pytest.raises(TypeError, match=r"program: expected a v4kv_jax Program or a jitted "
                                        r"function; got function$"):
        targets.compile_for(lambda x: x, jnp.zeros(2))


def test_the_kernels_page_recipe_compiles_v4_flash_for_a_v5e_as_written():
    page = (pathlib.Path(__file__).resolve().parents[1] / "docs/kernels.md").read_text()
    section = page.split("## Compiling for a TPU from any host\n", 1)[1].split("\n## ")[0]
    (code,) = re.findall(r"```python\n(.*?)\n```", section, re.S)
    scope: dict = {}
    exec(code, scope)  # noqa: S102 - the page's own code
    memory = scope["compiled"].memory_analysis()
    assert memory.alias_size_in_bytes > 0.9 * memory.argument_size_in_bytes
    text = scope["compiled"].as_text()
    assert len(_kernels(scope["compiled"])) == 4 and "v4kv_compress_online" in text
