"""One of two processes of one JAX runtime (`jax.distributed`, a localhost coordinator, CPU
collectives over gloo), four host devices each, one global mesh of eight; started by
tests/test_mesh.py. Not collected on its own.

    python two_processes.py PROCESS_ID PORT generate DIR  # prints the tokens as JSON
    python two_processes.py PROCESS_ID PORT die           # process 1 exits before generating

`generate` runs the prompts through a Generator and an Engine over the mesh (the Engine's
snapshot_dir is DIR), then a second round on the Engine that hits the first round's pages.
"""

from __future__ import annotations

import json
import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=4")
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

PROMPT_LENGTHS = (5, 130, 60, 200, 17, 99, 1, 150)


def engine_rounds(engine, prompts) -> dict:
    """Round one: every prompt, greedy; round two: prompts sharing round one's full pages,
    sampled. The tokens and the cached tokens of every request."""
    first = engine.generate(prompts, 4)
    again = [p[:128] + [7, 8, 9] for p in prompts if len(p) > 128]
    second = engine.generate(again, 3, temperature=0.8)
    return {"tokens": [o.tokens for o in first + second],
            "cached": [o.cached_tokens for o in first + second]}


def main(process_id: int, port: int, mode: str, snapshot_dir: str | None) -> None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=process_id,
                               heartbeat_timeout_seconds=10, initialization_timeout=60)
    import numpy as np
    from flax import nnx

    import v4kv_jax as v4
    from v4kv_jax import mesh as meshes
    from v4kv_jax.nn import Decoder, ModelConfig
    from v4kv_jax.serve import Generator

    assert jax.device_count() == 8 and jax.local_device_count() == 4
    attention = v4.tiny(index_heads=16, window=64, compress_ratios=(0, 4, 16))
    decoder = Decoder(ModelConfig(attention, vocab_size=40, mlp_hidden=48), rngs=nnx.Rngs(1),
                      bias_scale=0.5)
    geometry = v4.CacheConfig(num_pages=4, max_slots=1, max_pages_per_seq=4)
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, 40, n).tolist() for n in PROMPT_LENGTHS]
    gen = Generator(decoder, geometry, max_prompt_len=200, max_new_tokens=4, prefill_chunk=64,
                    mesh=meshes.data_mesh())
    if mode == "die" and process_id == 1:
        os._exit(3)  # dies without a word to the coordinator
    out = gen.generate(prompts)
    engine = v4.Engine(decoder, geometry, prefill_chunk=64, mesh=meshes.data_mesh(),
                       snapshot_dir=snapshot_dir)
    rounds = engine_rounds(engine, prompts)
    report = engine.memory_report()
    engine.close()
    print(json.dumps({"process": process_id, "tokens": out.as_lists(), "engine": rounds,
                      "shards": [s.index for s in engine.shards],
                      "reports": len(report.shards), "hits": report.stats["hits"],
                      "pages_indexed": report.pages_indexed}), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], (sys.argv[4:] or [None])[0])
