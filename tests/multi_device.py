"""Data parallelism over eight host devices (`v4kv_jax.mesh`); run by tests/test_mesh.py in a
subprocess with XLA_FLAGS=--xla_force_host_platform_device_count=8, so that the rest of the
suite keeps one device, and compiling at XLA's defaults, as users do (tests/conftest.py). Not
collected on its own (its name does not start with test_).

Each shard of a mesh runs the body a one-device cache runs, on its own rows: a shard's
outputs, stored rows and State are held bit for bit to a one-device run of the same rows, and
an Engine's tokens and logits to a one-device Engine running the same batches (a mesh of one
device; eight shards each serving one request at a time); an Engine serving docs/own-model.md's
model gives the tokens of the page's greedy loop.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import v4kv_jax as v4
from v4kv_jax import mesh as meshes
from v4kv_jax import pools, programs
from v4kv_jax.nn import Decoder, ModelConfig
from v4kv_jax.pools import SlotStatus
from v4kv_jax.serve.engine import Engine, compiled_step_programs
from v4kv_jax.testing import synthetic

from faults import FaultyDirectory
from test_own_model import greedy_tokens, own_model_blocks, run_blocks

N = 8
ATTENTION = v4.tiny()
GEOMETRY = v4.CacheConfig(num_pages=6, max_slots=2, max_pages_per_seq=3)
ROWS = GEOMETRY.max_slots  # rows per shard
CHUNK = 32

pytestmark = pytest.mark.skipif(jax.device_count() < N, reason="needs 8 devices (run by "
                                "tests/test_mesh.py with XLA_FLAGS)")


@pytest.fixture(scope="module")
def mesh():
    return meshes.data_mesh(N)


def assert_same_bits(a, b):
    """Two trees of arrays (caches) equal bit for bit (NaN where the other has NaN)."""
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


def admitted(cache, slots):
    for s in slots:
        cache = pools.reset_slot(cache, s)
    return cache


# Host-side work on a shard's cache (admitting, poisoning, reading) runs on device 0 and the
# results are copied to the shard's device: eager operations compile once per device, and once
# is enough.
HOME = jax.devices()[0]


def on_shards(caches: dict, mesh):
    """The mesh's cache of shard index -> a cache on any device."""
    devices = meshes.shard_devices(mesh)
    return meshes.assemble({i: jax.device_put(c, devices[i]) for i, c in caches.items()}, mesh)


def admitted_shards(geometry, mesh, shards=None):
    """A mesh cache of `geometry` with every slot of `shards` (default: all) admitted."""
    empty = pools.init_cache(ATTENTION, geometry)
    full = admitted(empty, range(ROWS))
    return on_shards({i: full if shards is None or i in shards else empty
                      for i in range(mesh.size)}, mesh)


def poison_on_home(cache, **kwargs):
    """`synthetic.poison_unowned` of a cache on any device (and memory), poisoned on HOME
    and put back where each array was."""
    home = jax.tree.map(lambda x: jax.device_put(x, jax.sharding.SingleDeviceSharding(
        HOME, memory_kind=x.sharding.memory_kind)), cache)
    poisoned = synthetic.poison_unowned(home, **kwargs)
    return jax.tree.map(lambda new, old: jax.device_put(new, old.sharding), poisoned, cache)


def poison_shards(cache, mesh):
    return on_shards({i: synthetic.poison_unowned(jax.device_put(c, HOME))
                      for i, c in meshes.split(cache, mesh).items()}, mesh)


def run(cache, batch, lengths, steps, *, mesh=None, rows=None, poison=None):
    """Chunked prefill of `lengths` tokens per row, then `steps` decode tokens of every row,
    through `append_and_attend`; returns (cache, outputs of every call)."""
    rows = np.arange(batch.batch) if rows is None else np.asarray(rows)
    slots = np.tile(np.arange(ROWS, dtype=np.int32), len(rows) // ROWS)
    longest = int(np.max(lengths))  # as many chunks whatever the rows
    lengths = np.asarray(lengths)[rows]
    outs = []
    for start in range(0, longest, CHUNK):
        n = np.clip(lengths - start, 0, CHUNK).astype(np.int32)
        pos = start + np.arange(CHUNK)[None, :].repeat(len(rows), 0)
        cache, out = v4.append_and_attend(cache, batch.take(pos, rows),
                                          batch.stacked_queries(pos, rows), batch.weights,
                                          slots, n, mesh=mesh)
        outs.append(np.where((np.arange(CHUNK) < n[:, None])[None, :, :, None, None],
                             np.asarray(out), 0))
        cache = poison(cache) if poison else cache
    for step in range(steps):
        pos = (lengths + step)[:, None]
        cache, out = v4.append_and_attend(cache, batch.take(pos, rows),
                                          batch.stacked_queries(pos, rows), batch.weights,
                                          slots, np.ones(len(rows), np.int32), mesh=mesh)
        outs.append(np.asarray(out))
        cache = poison(cache) if poison else cache
    return cache, outs


def test_every_shard_equals_a_one_device_run_of_its_rows(mesh):
    """Outputs, stored rows and final States of eight shards, NaN in every row no request of
    a shard owns after every call, against one-device runs of each shard's rows."""
    batch = synthetic.SyntheticBatch.draw(ATTENTION, N * ROWS, 170, seed=3)
    lengths = np.random.default_rng(3).integers(1, 160, N * ROWS)
    lengths[:4] = [1, 128, 129, 160]  # a page boundary on each side, a one-token prompt
    cache = admitted_shards(GEOMETRY, mesh)
    traces = {name: programs.PROGRAMS[name].traces for name in ("step.append_and_attend",)}
    cache, outs = run(cache, batch, lengths, 2, mesh=mesh,
                      poison=lambda c: poison_shards(c, mesh))
    # One program per chunk shape (T = CHUNK, T = 1) for every length and step.
    assert programs.PROGRAMS["step.append_and_attend"].traces - traces[
        "step.append_and_attend"] == 2
    shards = meshes.split(cache, mesh)
    for i in range(N):
        rows = np.arange(i * ROWS, (i + 1) * ROWS)
        one = admitted(pools.init_cache(ATTENTION, GEOMETRY), range(ROWS))
        one, want = run(one, batch, lengths, 2, rows=rows, poison=synthetic.poison_unowned)
        for got, expected in zip(outs, want, strict=True):
            np.testing.assert_array_equal(got[:, rows], expected)
        # Poisoned alike, the whole caches are equal: stored rows, States, pages, free stacks.
        assert_same_bits(shards[i], one)


def test_shards_handing_out_different_page_ids_keep_to_their_own(mesh):
    """Each shard's free stack in its own order (as its own history of appends and releases
    leaves it), so the shards give their rows different page ids: every shard's outputs and
    whole cache equal a one-device run of its rows from the same pool (unowned rows NaN), so
    every row reads and writes the pages of its own shard's page table."""
    batch = synthetic.SyntheticBatch.draw(ATTENTION, N * ROWS, 170, seed=5)
    lengths = np.random.default_rng(5).integers(129, 170, N * ROWS)  # two pages a row
    rng = np.random.default_rng(6)

    def reordered():
        cache = admitted(pools.init_cache(ATTENTION, GEOMETRY), range(ROWS))
        pages = pools.page_state(cache)
        stack = jnp.asarray(rng.permutation(np.asarray(pages.free_stack)))
        return synthetic.poison_unowned(pools.with_page_state(cache,
                                                              pages.replace(free_stack=stack)))

    starts = {i: reordered() for i in range(N)}
    cache, outs = run(on_shards({i: jax.tree.map(jnp.copy, c) for i, c in starts.items()}, mesh),
                      batch, lengths, 1, mesh=mesh)
    shards = meshes.split(cache, mesh)
    tables = {np.asarray(pools.page_table(c)).tobytes() for c in shards.values()}
    assert len(tables) == N  # eight different page tables
    for i in range(N):
        rows = np.arange(i * ROWS, (i + 1) * ROWS)
        one, want = run(starts[i], batch, lengths, 1, rows=rows)
        for got, expected in zip(outs, want, strict=True):
            np.testing.assert_array_equal(got[:, rows], expected, err_msg=f"shard {i}")
        assert_same_bits(shards[i], one)


def test_kernels_in_interpret_mode_on_a_shard():
    """The Pallas kernels (GPU flavour, interpret mode) inside the sharded program: each
    shard of two gives the kernels' one-device outputs and stored rows of its rows."""
    two = meshes.data_mesh(2)
    options = v4.Options(implementation="pallas_gpu", interpret=True, query_tile=16)
    batch = synthetic.SyntheticBatch.draw(ATTENTION, 2 * ROWS, CHUNK, seed=6)
    lengths = np.array([32, 1, 29, 17])  # one chunk: CSA and HCA entries, a one-token row

    def kernel_run(cache, lengths, rows, mesh=None):
        outs = []
        for start in range(0, int(lengths.max()), CHUNK):
            n = np.clip(lengths - start, 0, CHUNK).astype(np.int32)
            pos = start + np.arange(CHUNK)[None, :].repeat(len(n), 0)
            cache, out = v4.append_and_attend(
                cache, batch.take(pos, rows), batch.stacked_queries(pos, rows),
                batch.weights, np.tile(np.arange(ROWS, dtype=np.int32), len(n) // ROWS), n,
                options=options, mesh=mesh)
            outs.append(np.where((np.arange(CHUNK) < n[:, None])[None, :, :, None, None],
                                 np.asarray(out), 0))
        return cache, outs

    cache = admitted_shards(GEOMETRY, two)
    cache, outs = kernel_run(cache, lengths, np.arange(2 * ROWS), two)
    for i, shard in meshes.split(cache, two).items():
        rows = np.arange(i * ROWS, (i + 1) * ROWS)
        one = admitted(pools.init_cache(ATTENTION, GEOMETRY), range(ROWS))
        one, want = kernel_run(one, lengths[rows], rows)
        for got, expected in zip(outs, want, strict=True):
            np.testing.assert_array_equal(got[:, rows], expected)
        assert_same_bits(shard, one)


def test_a_shard_out_of_pages_leaves_the_others_bit_identical(mesh):
    """Shard 0's two rows need 4 pages of its 3 (num_pages=3): its rows are flagged and write
    nothing; every other shard ends bit for bit as in a run where shard 0 appends nothing.
    The step's program is called as a caller's jit would (traced rows: flagged, not raised;
    an eager `v4.prefill` raises first)."""
    geometry = v4.CacheConfig(num_pages=3, max_slots=2, max_pages_per_seq=3)
    batch = synthetic.SyntheticBatch.draw(ATTENTION, N * ROWS, 256, seed=4)
    ends = {}
    for name, first in (("starved", 256), ("idle", 0)):
        cache = admitted_shards(geometry, mesh)
        n = np.full(N * ROWS, 200, np.int32)
        n[:ROWS] = first
        pos = np.arange(256)[None, :].repeat(N * ROWS, 0)
        slot_ids = np.tile(np.arange(ROWS, dtype=np.int32), N)
        if name == "starved":
            with pytest.raises(ValueError, match=r"n_new: expected appends whose new pages fit "
                                                 r"the 3 free page\(s\)"):
                v4.prefill(cache, batch.take(pos), batch.weights, slot_ids, n, mesh=mesh)
        ends[name] = meshes.split(programs.PROGRAMS["step.prefill"](
            cache, batch.take(pos), batch.weights, jnp.asarray(slot_ids), jnp.asarray(n),
            options=v4.Options(), mesh=mesh), mesh)
    status = np.asarray(pools.status(ends["starved"][0]))
    assert SlotStatus.OUT_OF_PAGES in status.tolist()
    assert int(pools.free_pages(ends["starved"][0])) == 3 - 2 * (status == SlotStatus.ACTIVE
                                                                ).sum()
    for i in range(1, N):
        assert_same_bits(ends["starved"][i], ends["idle"][i])


def test_decode_step_over_every_shards_slots(mesh):
    batch = synthetic.SyntheticBatch.draw(ATTENTION, N * ROWS, 4, seed=5)
    cache = admitted_shards(GEOMETRY, mesh, shards=range(1, N, 2))
    for t in range(3):
        cache = v4.decode_step(cache, batch.take(np.full(N * ROWS, t)), batch.weights,
                               mesh=mesh)
    lengths = np.asarray(pools.lengths(cache)).reshape(N, ROWS)
    np.testing.assert_array_equal(lengths, [[3, 3] if i % 2 else [0, 0] for i in range(N)])
    compiled = jax.jit(lambda c, v: v4.decode_step(c, v, batch.weights, mesh=mesh)).lower(
        cache, batch.take(np.full(N * ROWS, 3))).compile().as_text()
    assert meshes.collectives(compiled) == {}


# --- the engine -------------------------------------------------------------------------------

MODEL_ATTENTION = v4.tiny(index_heads=16, window=64, compress_ratios=(0, 4, 16))
CONFIG = ModelConfig(MODEL_ATTENTION, vocab_size=40, mlp_hidden=48)
DECODER = Decoder(CONFIG, rngs=nnx.Rngs(1), bias_scale=0.5)
# The C4 entries in host memory (HiSparse): each shard's on its own device's host memory.
ENGINE_GEOMETRY = v4.CacheConfig(num_pages=8, max_slots=2, max_pages_per_seq=4,
                                 c4_tier="host")


def test_a_mesh_of_one_device_is_the_one_device_engine():
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 40, int(n)).tolist() for n in (150, 9, 270)]
    want = Engine(DECODER, ENGINE_GEOMETRY, prefill_chunk=64, keep_logits=True).generate(
        prompts, 3)
    got = Engine(DECODER, ENGINE_GEOMETRY, prefill_chunk=64, keep_logits=True,
                 mesh=meshes.data_mesh(1)).generate(prompts, 3)
    for g, w in zip(got, want, strict=True):
        assert g.tokens == w.tokens
        assert g.logits.tobytes() == w.logits.tobytes()


def test_engine_over_eight_shards(mesh, tmp_path, monkeypatch):
    """Requests of many lengths (some sharing prefixes) over eight shards: the greedy tokens
    of a one-device engine serving them all, and the tokens and logits bit for bit of one
    serving each alone, as each shard did; one step program; the request with a cached
    prefix on the shard holding it; NaN in every row no request or index of a shard holds;
    a report per shard; the C4 entries in host memory on every shard; a full disk on one
    shard costs only its files."""
    rng = np.random.default_rng(7)
    base = rng.integers(0, 40, 400).tolist()
    prompts = [rng.integers(0, 40, int(n)).tolist() for n in (130, 77, 256, 3)]
    one = Engine(DECODER, ENGINE_GEOMETRY, prefill_chunk=64, keep_logits=True)
    eng = Engine(DECODER, ENGINE_GEOMETRY, prefill_chunk=64, keep_logits=True, mesh=mesh,
                 snapshot_dir=tmp_path)
    before = compiled_step_programs()
    ids = [eng.add_request(p, 4) for p in prompts]
    first = eng.add_request(base[:300], 3)
    eng.step()
    home = eng.shard_of(first)
    assert home == len(prompts)  # the least loaded shard then; the hit's only by its prefix
    outputs = {}
    while eng.in_flight:
        for out in eng.step():
            outputs[out.request_id] = out
        for shard in eng.shards:
            shard.cache = poison_on_home(
                shard.cache, held_pages=list(shard.prefix_cache.index.pages().values()))
    hit = eng.add_request(base[:280] + [1, 2], 3)  # two full pages of `first` are cached
    eng.step()
    assert eng.shard_of(hit) == home
    while eng.in_flight:
        for out in eng.step():
            outputs[out.request_id] = out
    assert compiled_step_programs() - before == 1
    assert outputs[hit].cached_tokens == 256
    requests = list(zip(ids + [first, hit], prompts + [base[:300], base[:280] + [1, 2]],
                        [4] * len(prompts) + [3, 3], strict=True))
    batched = one.generate([p for _, p, _ in requests], 4)
    for (rid, prompt, n), w in zip(requests, batched, strict=True):
        got = outputs[rid]
        assert got.tokens == w.tokens[:len(got.tokens)]
        # Each shard ran one request at a time: served alone on one device (the hit a hit
        # again), it runs in the same batches, so the logits are the bits.
        (alone,) = one.generate([prompt], n)
        assert (alone.tokens, alone.logits.tobytes()) == (got.tokens, got.logits.tobytes())
    assert pools.csa_entries(eng.cache).c4.sharding.memory_kind == "pinned_host"
    assert all(pools.csa_entries(s.cache).c4.sharding.memory_kind == "pinned_host"
               for s in eng.shards)
    report = eng.memory_report()
    assert len(report.shards) == N
    assert report.cache.host_bytes["classical"] == sum(
        r.cache.host_bytes["classical"] for r in report.shards) > 0
    assert report.cache.pages_total == N * ENGINE_GEOMETRY.num_pages
    assert report.pages_indexed == sum(r.pages_indexed for r in report.shards)
    # The disk of the hit's shard is full: its files fail with a warning, the other shards'
    # are written, and the engine serves the hit again from the device as before.
    faults = FaultyDirectory(monkeypatch, tmp_path / f"shard-{home}")
    faults.disk_full(free_bytes=0)
    with pytest.warns(RuntimeWarning, match="No space left"):
        assert eng.flush() > 0
    assert faults.failures["write"] > 0
    assert not [f for f in (tmp_path / f"shard-{home}").iterdir() if f.stat().st_size]
    written = sorted(p.name for p in tmp_path.iterdir() if any(p.iterdir()))
    assert written and all(name.startswith("shard-") for name in written)
    (again,) = eng.generate([base[:280] + [1, 2]], 3)
    assert (again.tokens, again.cached_tokens) == (outputs[hit].tokens, 256)


def test_engine_serves_the_own_model_page_model_over_eight_shards(mesh):
    """docs/own-model.md's model (V4Attention layers, a mixture of experts of its own) over
    eight shards with the C4 entries in host memory: every request, a prefix hit included,
    gets the tokens of the page's own greedy loop."""
    scope: dict = {"__name__": "docs"}
    run_blocks(own_model_blocks()[:2], scope)  # the model and its greedy loop
    eng = Engine(scope["model"], scope["geometry"], prefill_chunk=scope["CHUNK"], mesh=mesh)
    rng = np.random.default_rng(4)
    base = rng.integers(0, 64, 300).tolist()
    prompts = [rng.integers(0, 64, int(n)).tolist() for n in (130, 9)] + [base[:270]]
    outputs = list(eng.generate(prompts, 8))
    prompts.append(base[:260] + [1, 2])
    outputs += eng.generate(prompts[-1:], 8)
    assert outputs[-1].cached_tokens == 256
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.tokens == greedy_tokens(scope, prompt, 8)
