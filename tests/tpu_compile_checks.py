"""The library compiled for TPUs, without a TPU: XLA:TPU and Mosaic (libtpu) compile the
programs for devices of a named topology (`v4kv_jax.targets`). Run in a process of their own
by tests/test_tpu_compile.py (libtpu and the TPU compiler's memory leave with it); by hand:
`python -m pytest -o addopts= tests/tpu_compile_checks.py`.

- Every Pallas TPU kernel, forced one op at a time, over a sweep of generations (v4, v5e,
  v6e), widths (the tests' tiny config, the notebook's, V4-Flash, V4-Pro), storage formats
  (float32, bfloat16, release), page sizes and batches: `supported()` says None exactly
  where Mosaic compiles (each generation sweeps its own slice of the product here; the
  whole product is `python benchmarks/tpu_compile.py --sweep`).
- Every program that takes the cache (the decode step, a prefill chunk, replay, the Engine's
  step, the Generator's program), "auto", at the tests' and V4-Flash's widths on v5e and
  v6e: no cache array relayouted or copied in HBM (`targets.cache_copies`), temporaries
  bounded by the working set, not by the cache; every cache array row-major and unpadded
  as the chip lays it out (`pools.laid_out`; a V4.1-Flash cache too, `pools.laid_out41`).
- V4.1's decode read kernel (`ops.sparse_decode41`) at V4.1-Flash's widths in the release
  records on v5e and v6e, copying no cache array; "auto" puts it in the V4.1 decode step.
- The notebook's Generator program compiles for the single chips Colab offers; the
  data-parallel step on a 4-chip topology holds no collective.
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
from v4kv_jax import ops, programs, step41, targets  # noqa: E402
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
    # Every kernel compiles in every storage format (rows are 32-bit words in lane planes).
    for r in rows:
        assert r.error is None, (r.case, r.widths, r.formats, r.error)


def test_auto_picks_the_tpu_kernel_of_every_op_in_every_format():
    model = sweep.WIDTHS["notebook"]()
    for formats in sweep.FORMATS:
        geometry = sweep.geometry_for(formats, 128, 4)
        for op in ops.KERNEL_OPS:
            choice = ops.choices(op, model, geometry)["tpu"]
            assert (choice.implementation, choice.why) == ("pallas_tpu", "auto on tpu"), (
                formats, op, choice)


def _step_arguments(model, geometry, batch, tokens):
    cache, vectors, weights, slot_ids, n_new = sweep.step_arguments(model, geometry, batch,
                                                                    tokens)
    return cache, vectors, sweep.step_queries(model, batch, tokens), weights, slot_ids, n_new


def _kernels(compiled) -> set[str]:
    text = compiled.as_text()
    return {name for name in ("v4kv_compress_emit", "v4kv_indexer_scores",
                              "v4kv_csa_sparse_decode_attention",
                              "v4kv_hca_dense_decode_attention", "v4kv_write_records",
                              "v4kv_swa_decode_attention")
            if name in text}


MIB = 2**20


# (config, formats, chunk tokens, allowance MiB) per width. The allowance is what a program
# holds that does not grow with the cache: activations, and a chunk's reads (rows x query
# tile x picks x head dim); any temporary beyond it must stay under 10 % of the cache.
WIDTHS = {"tiny": (v4.tiny, "float32", 64, 32),
          "flash": (sweep.flash_layers, "release", 4, 192)}
# The programs that take the cache, each once at each width, the chips taking turns (the
# suite's share; `python benchmarks/tpu_compile.py --programs` compiles every program at both
# widths for both chips). The Generator's program is the notebook's (both chips, below),
# V4-Flash's whole decode step the kernels page's (a v5e, below), the tiny prefill chunk
# test_temporaries_do_not_grow_with_the_context's (a v5e, 4k and 128k a slot).
CACHE_PROGRAMS = {
    "v5e": {"tiny": ("decode",), "flash": ("chunk", "replay")},
    "v6e": {"tiny": ("replay", "engine"), "flash": ("decode",)},
}


# 4k tokens a slot: what these tests hold (no copy, temporaries against the cache) does not
# depend on the context (the tiny decode step compiles for a v5e in about 2 s at 4k, 32k and
# 128k alike, one sort each), and that the temporaries do not grow with it is
# test_temporaries_do_not_grow_with_the_context's.
def _cache_geometry(formats: str, context: int = 4096, slots: int = 16) -> v4.CacheConfig:
    pages = context // 128
    return v4.CacheConfig.with_formats(formats, num_pages=slots * pages + 1, max_slots=slots,
                                       max_pages_per_seq=pages)


def _bytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


@pytest.mark.time_limit(280)
@pytest.mark.parametrize("generation", ["v5e", "v6e"])
def test_the_programs_that_take_the_cache_keep_it_in_place(generation):
    """The decode step, a prefill chunk, replay, the Engine's step and the Generator's
    program, "auto" (the TPU kernels), 16 slots of 4k tokens: no cache array relayouted or
    copied within HBM (XLA may still hold a plane small enough in VMEM: a move, not a
    copy), and temporaries within 10 % of the cache plus the width's allowance."""
    device = _device(generation)
    for width, names in CACHE_PROGRAMS[generation].items():
        make, formats, tokens, allowance = WIDTHS[width]
        model, geometry = make(), _cache_geometry(formats)
        for name in names:
            compiled, cache = sweep.cache_program(name, model, geometry, tokens, device)
            _assert_in_place(compiled, cache, allowance, (width, name))
            if width == "tiny" and name == "decode":  # the kernels "auto" picks
                assert len(_kernels(compiled)) == 6, name  # with the row writes, SWA's read


# The V4.1 step (`step41.prefill41`'s program) at V4.1-Flash's widths: (generation, width,
# chunk tokens) the suite compiles (4 rows, 16 slots of 4k): the decode step on a v6e, its
# sparse reads the kernel's. A chunk compiles too (v5e, 64 tokens: 20 s at the tiny widths,
# 200 s at V4.1-Flash's, cache in place, 141 MiB of temporaries: docs/v41.md). The
# allowance: a query tile's picks and logits (4 rows x 64 queries x 512 picks x 512 values:
# 256 MiB at V4.1-Flash's widths, none of it the decode's) and a scoring step's keys.
V41_PROGRAMS = (("v6e", "flash", 1),)


@pytest.mark.time_limit(280)
@pytest.mark.parametrize("generation, width, tokens", V41_PROGRAMS)
def test_the_v41_step_keeps_the_cache_in_place(generation, width, tokens):
    config, formats, allowance = {"tiny": (v4.tiny41(), "float32", 8),
                                  "flash": (sweep.flash41_layers(), "release", 192)}[width]
    geometry = v4.cache_config41(formats, num_pages=16 * 32 + 1, max_slots=16,
                                 max_pages_per_seq=32)
    args = sweep.step41_arguments(config, geometry, 4, tokens)
    compiled = targets.compile_for(step41._step_jit, *args, target=_device(generation),
                                   bf16_latent=False, options=v4.Options())
    _assert_in_place(compiled, args[0], allowance, (width, tokens))
    # "auto" on a TPU: a decode step's sparse reads are the kernel's, a chunk's the step's.
    assert ("v4kv_sparse_decode41" in compiled.as_text()) == (tokens == 1)


@pytest.mark.time_limit(120)
@pytest.mark.parametrize("generation", ["v5e"])  # v6e's: in the step above
def test_the_v41_decode_read_kernel_compiles_at_flash_widths(generation):
    """`ops.sparse_decode41` forced to its TPU kernel at V4.1-Flash's widths (64 heads of
    512, window 128, 512 picks) in the release records (nvfp4 entries, mxfp8 window rows,
    decoded in the kernel): Mosaic compiles it, and no cache array is copied or relayouted."""
    config = sweep.flash41_layers()
    geometry = v4.cache_config41("release", num_pages=16 * 32 + 1, max_slots=16,
                                 max_pages_per_seq=32)
    cache = jax.eval_shape(lambda: v4.pools.init_cache41(config, geometry))
    B, K, H, hd = 4, config.index_topk, config.num_heads, config.head_dim
    sds = jax.ShapeDtypeStruct
    args = dict(window=v4.pools.cache41.window41(cache),
                entries=v4.pools.cache41.source_store(cache, "entries", 3),
                slot_ids=sds((B,), jnp.int32), q_pos=sds((B,), jnp.int32),
                ids=sds((B, K), jnp.int32), valid=sds((B, K), bool),
                page_rows=sds((B, 32), jnp.int32), q=sds((B, H, hd), jnp.float32),
                sink=sds((H,), jnp.float32))
    kernel = v4.Options(implementation="pallas_tpu")
    read = jax.jit(lambda a: ops.sparse_decode41(config, geometry, kernel, layer=4, **a))
    compiled = targets.compile_for(read, args, target=_device(generation))
    assert "v4kv_sparse_decode41" in compiled.as_text()
    found = targets.cache_copies(compiled)
    assert not (found.relayouts or found.copies or found.moves), found


def _assert_in_place(compiled, cache, allowance_mib: float, what) -> None:
    """No cache array relayouted or copied within HBM; temporaries within 10 % of the cache
    plus `allowance_mib`; the cache updated in place (its bytes aliased to the outputs)."""
    found = targets.cache_copies(compiled)
    assert not found.relayouts and not found.copies, (what, found)
    memory = compiled.memory_analysis()
    assert memory.temp_size_in_bytes <= 0.1 * _bytes(cache) + allowance_mib * MIB, (
        what, memory.temp_size_in_bytes / MIB, _bytes(cache) / MIB)
    assert memory.alias_size_in_bytes >= _bytes(cache), what


def test_temporaries_do_not_grow_with_the_context():
    """A prefill chunk of 64 tokens at 4k and at 128k tokens a slot (the tiny widths, a v5e,
    "auto"): each keeps the cache in place, and the temporaries grow by less than 10 % of what
    the cache grows by (a chunk's indexer keeps its best k per query, not a score per entry
    of the context: that would be 31 MB more here). The decode step's at 32k and 128k:
    benchmarks/tpu_compile.py."""
    model, device = v4.tiny(), _device("v5e")
    temps, sizes = [], []
    for context in (4096, 131072):
        compiled, cache = sweep.cache_program("chunk", model, _cache_geometry(
            "float32", context, slots=4), 64, device)
        _assert_in_place(compiled, cache, WIDTHS["tiny"][3], ("tiny", "chunk", context))
        assert len(_kernels(compiled)) == 1  # the kernel "auto" picks for a chunk
        # XLA:TPU compiles a top-k or a scatter of many indices as a sort (seconds of
        # compiling each): the chunk sorts only each query's best k with a read chunk (on
        # the scores' integer keys, the scores and ids carried along).
        sorts = re.findall(r" = \(?(\w+\[[\d,]*\])[^=]* sort\(", compiled.as_text())
        assert sorts and all(re.match(r"\w+\[4,64,\d+\]$", s) for s in sorts), sorts
        temps.append(compiled.memory_analysis().temp_size_in_bytes)
        sizes.append(_bytes(cache))
    assert temps[1] - temps[0] <= 0.1 * (sizes[1] - sizes[0]), (temps, sizes)


@pytest.mark.parametrize("width", list(sweep.WIDTHS))
def test_every_cache_array_is_row_major_and_unpadded_on_a_tpu(width):
    """The chip's default layout of every array of the cache is row-major and pads nothing
    beyond the planes' own lanes (`pools.laid_out`), in every storage format: the chip holds
    the stored bytes, and a few KiB of tiles around the int32 counters and page table."""
    model = sweep.WIDTHS[width]()
    # The release formats pack rows of the releases' widths only.
    for formats in sweep.FORMATS if width in ("flash", "pro") else ("float32", "bfloat16"):
        laid = v4.pools.laid_out(model, _cache_geometry(formats, 4096, slots=4), "v6e")
        assert laid.error is None and laid.not_row_major == (), (formats, laid)
        assert laid.stored_bytes <= laid.argument_bytes <= laid.stored_bytes + 16 * 1024, (
            formats, laid)


@pytest.mark.parametrize("formats", ["release", "float32"])
def test_every_v41_cache_array_is_row_major_and_unpadded_on_a_tpu(formats):
    """A V4.1-Flash cache (`pools.laid_out41`) as the chip lays it out: every array row-major,
    its stored bytes (`pools.page_bytes41` a page, `pools.state_bytes_per_request41` a slot,
    the page state) and a few KiB of tiles around the counters and page table."""
    from v4kv_jax.pools import cache41

    config = v4.flash41()
    geometry = cache41.cache_config41(formats, num_pages=4 * 32 + 1, max_slots=4,
                                      max_pages_per_seq=32)
    laid = v4.pools.laid_out41(config, geometry, "v6e")
    assert laid.error is None and laid.not_row_major == (), (formats, laid)
    own = (geometry.num_pages * v4.pools.page_bytes41(config, geometry)
           + 4 * v4.pools.state_bytes_per_request41(config, geometry))
    # + the page state: page table, free stack, refcounts, free count (int32).
    assert laid.stored_bytes == own + 4 * (4 * 32 + 2 * geometry.num_pages + 1)
    assert laid.stored_bytes <= laid.argument_bytes <= laid.stored_bytes + 16 * 1024, (
        formats, laid)


@pytest.mark.time_limit(280)
def test_auto_compiles_the_step_with_the_tpu_kernels_on_a_v4():
    """Decode and a prefill chunk of the public step program, "auto", at the tests' widths,
    for a v4 chip: the decode step holds the four TPU kernels, the in-place row writes and
    the SWA layers' read, the chunk the emission (its reads and writes are the reference's),
    and the cache is updated in place (aliased, not copied)."""
    model, geometry = v4.tiny(), sweep.geometry_for("float32", 128, 4, context=512)
    program = programs.PROGRAMS["step.append_and_attend"]
    for tokens, kernels in ((1, 6), (16, 1)):
        args = _step_arguments(model, geometry, 4, tokens)
        compiled = targets.compile_for(program, *args, target=_device("v4"),
                                       options=v4.Options(), mesh=None)
        assert len(_kernels(compiled)) == kernels, (tokens, _kernels(compiled))
        memory = compiled.memory_analysis()
        assert memory.alias_size_in_bytes >= _bytes(args[0])


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
    cache = next(a for a in call.args if isinstance(a, v4.pools.Cache))
    _assert_in_place(compiled, cache, 64, ("notebook generator", generation))


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
    assert len(_kernels(compiled)) == 6


def test_the_slices_cover_every_width_page_size_and_batch():
    for field, every in (("widths", set(sweep.WIDTHS)), ("page_tokens", {128, 256}),
                         ("batches", {1, 64})):
        assert every <= set(itertools.chain(*(s[field] for s in SLICES.values()))), field
    # Every program that takes the cache, at both widths (the Generator's: the notebook's
    # widths, both chips; V4-Flash's Engine and Generator: benchmarks/tpu_compile.py).
    # (The tiny chunk: test_temporaries_do_not_grow_with_the_context.)
    for width, every in (("tiny", {"decode", "replay", "engine"}),
                         ("flash", {"decode", "chunk", "replay"})):
        held = set(itertools.chain(*(c.get(width, ()) for c in CACHE_PROGRAMS.values())))
        assert held == every, width


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
    # V4-Flash's whole decode step (43 layers, release formats): the cache kept in place.
    _assert_in_place(scope["compiled"], scope["cache"], 64, "V4-Flash decode step")
    text = scope["compiled"].as_text()
    assert len(_kernels(scope["compiled"])) == 6 and "v4kv_compress_online" in text
