"""Serving a model over the cache: requests in, tokens out.

  protocol    what a served model provides (`ServedModel`: a `v4kv_jax.nn.Decoder`, or a
              model of your own) and the check that names what one lacks

  manager     `SlotTable` (which request holds which slot of which shard) and the host
              lifecycle of a cache (`CacheManager`, `SlotCache`)
  sampling    `SamplingParams` and the one sampling rule (temperature, top-k, top-p, min-p,
              repetition, presence and frequency penalties, per-request and per-sample
              streams) and the tokens' log-probabilities
  request     what a request is and what it returns (`Completion`, `RequestOutput`,
              `RequestMetrics`, `StreamOutput`, `EngineError`, `EngineReport`)
  generator   `Generator`: a batch of prompts in one jitted program (prefill, then decode)
  clock       seconds the process spent compiling, and the serving clock that leaves them out
              (the Engine's request metrics)
  shards      the Engine's `Shards`: each device's cache, slot table and prefix cache
  batch       the Engine's step: `StepBatch`, its one program, `StepProgram` (rows in, tokens
              out)
  scheduler   the Engine's `Scheduler`: requests in flight, the queue, admission, placement
  engine      `Engine`: continuous batching with prefix sharing, tiers and streaming

`forward` runs the model over a chunk of tokens for given slots (`generator.forward`).
"""

from v4kv_jax.serve.engine import Engine
from v4kv_jax.serve.generator import GenerationResult, Generator, ModelCache, forward
from v4kv_jax.serve.manager import (
    CacheManager,
    PoolExhaustedError,
    SlotCache,
    SlotFlaggedError,
    SlotTable,
)
from v4kv_jax.serve.protocol import ServedModel, check_model
from v4kv_jax.serve.request import (
    Completion,
    EngineError,
    EngineReport,
    RequestMetrics,
    RequestOutput,
    StreamOutput,
)
from v4kv_jax.serve.sampling import SamplingParams, sample

__all__ = [
    "CacheManager", "Completion", "Engine", "EngineError", "EngineReport", "GenerationResult",
    "Generator", "ModelCache", "PoolExhaustedError", "RequestMetrics", "RequestOutput",
    "SamplingParams", "ServedModel", "SlotCache", "SlotFlaggedError", "SlotTable",
    "StreamOutput", "check_model", "forward", "sample",
]
