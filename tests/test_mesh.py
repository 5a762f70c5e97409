"""Data parallelism (`v4kv_jax.mesh`): mesh arguments are checked, tests/multi_device.py runs
on eight host devices in a subprocess compiling at XLA's defaults (the rest of the suite keeps
one device and its faster flags), and two processes of four devices serve as one mesh."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from flax import nnx

import v4kv_jax as v4
from v4kv_jax import mesh as meshes
from v4kv_jax.nn import Decoder, ModelConfig
from v4kv_jax.serve import Generator
from v4kv_jax.serve.engine import Engine

import xla_defaults

HERE = os.path.dirname(os.path.abspath(__file__))
ATTENTION = v4.tiny(index_heads=16, window=64, compress_ratios=(0, 4, 16))
CONFIG = ModelConfig(ATTENTION, vocab_size=40, mlp_hidden=48)
DECODER = Decoder(CONFIG, rngs=nnx.Rngs(1), bias_scale=0.5)
GEOMETRY = v4.CacheConfig(num_pages=8, max_slots=2, max_pages_per_seq=4)


def test_mesh_arguments_are_checked():
    with pytest.raises(TypeError, match="mesh: expected a jax.sharding.Mesh"):
        Engine(DECODER, GEOMETRY, mesh="data")
    other = jax.sharding.Mesh(np.asarray(jax.devices()[:1]), ("batch",))
    with pytest.raises(ValueError, match="mesh: expected a mesh with the one axis 'data'"):
        Engine(DECODER, GEOMETRY, mesh=other)
    with pytest.raises(ValueError, match="devices: expected"):
        meshes.data_mesh(0)
    with pytest.raises(TypeError, match="devices: expected"):
        meshes.data_mesh("cpu")
    mesh = meshes.data_mesh(1)
    with pytest.raises(ValueError, match="shards: expected the caches of this process's"):
        meshes.assemble({}, mesh)
    one = Engine(DECODER, GEOMETRY, mesh=mesh)
    assert one.table is one.shards[0].table


@pytest.mark.time_limit(480)  # 95 to 150 s on 2 cores; 280 s seen with the cores shared
def test_eight_host_devices():
    """tests/multi_device.py with eight host devices, in a subprocess compiling at XLA's
    defaults, as users do (tests/conftest.py)."""
    env = xla_defaults.environment("--xla_force_host_platform_device_count=8",
                                   JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
         os.path.join(HERE, "multi_device.py")],
        cwd=HERE, env=env, capture_output=True, text=True, timeout=450)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-2000:]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _two_processes(mode: str, bound: float, *args: str) -> tuple[list, float]:
    """Runs tests/two_processes.py as processes 0 and 1; [(rc, stdout, stderr)], seconds."""
    port, start = _free_port(), time.monotonic()
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "two_processes.py"), str(i),
                               str(port), mode, *args], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=HERE) for i in range(2)]
    results = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=max(1.0, bound - (time.monotonic() - start)))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            out, err = p.communicate()
            pytest.fail(f"two processes ({mode}) still ran after {bound} s:\n{err[-3000:]}")
        results.append((p.returncode, out, err))
    return results, time.monotonic() - start


def test_two_processes_give_the_tokens_of_one(tmp_path):
    """jax.distributed with a localhost coordinator: two processes of four devices, one mesh
    of eight, one prompt per shard. Every process gets every prompt's tokens: the Generator's
    those of a one-device Generator, the Engine's (two rounds, the second hitting the
    first's pages on the shards that hold them) those of a one-device Engine."""
    results, _ = _two_processes("generate", 240, str(tmp_path))
    for rc, _, err in results:
        assert rc == 0, err[-4000:]
    got = [json.loads(out.splitlines()[-1]) for _, out, _ in results]
    sys.path.insert(0, HERE)
    import two_processes

    decoder = Decoder(ModelConfig(ATTENTION, vocab_size=40, mlp_hidden=48), rngs=nnx.Rngs(1),
                      bias_scale=0.5)
    geometry = v4.CacheConfig(num_pages=4, max_slots=1, max_pages_per_seq=4)
    one = Generator(decoder, geometry, max_prompt_len=200, max_new_tokens=4, prefill_chunk=64)
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, 40, n).tolist() for n in two_processes.PROMPT_LENGTHS]
    want = two_processes.engine_rounds(Engine(decoder, geometry, prefill_chunk=64), prompts)
    for process, g in enumerate(got):
        assert g["tokens"] == [one.generate([p]).as_lists()[0] for p in prompts]
        assert g["engine"] == want
        assert g["shards"] == list(range(4 * process, 4 * process + 4))
        assert g["reports"] == 8 and g["hits"] == 3 and g["pages_indexed"] == 3
    assert sum(want["cached"]) == 3 * 128
    written = sorted(p.name for p in tmp_path.iterdir() if any(p.iterdir()))
    assert written == [f"shard-{i}" for i in (1, 3, 7)], written


def test_a_dead_process_fails_the_other_within_the_bound():
    """Process 1 dies before the call; process 0 does not hang: JAX's coordination service
    misses its heartbeats (10 s) and ends process 0 with an error naming the dead task."""
    results, seconds = _two_processes("die", 120)
    (rc0, out0, err0), (rc1, _, _) = results
    assert rc1 == 3
    assert rc0 != 0 and '"tokens"' not in out0
    assert "another task died" in err0 or "unhealthy" in err0, err0[-3000:]
    assert seconds < 120
