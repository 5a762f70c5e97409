"""What the Engine takes and gives back: the host record of a request (`Request`, its
arguments checked by `check_prompt` and `check_request`), the finished request
(`RequestOutput`, a `Completion` as the Generator's rows, with its `RequestMetrics`; made by
`finished_output`, counted by `ServingMetrics`), a streamed step of one request
(`StreamOutput`), the error of an engine that lost its cache (`EngineError`) and the memory
report with prefix sharing (`EngineReport`)."""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from v4kv_jax import checks, pools
from v4kv_jax.config import CacheConfig
from v4kv_jax.pools.paging import pages_for
from v4kv_jax.serve import clock
from v4kv_jax.serve.sampling import SamplingParams

FINISH_REASONS = ("eos", "stop", "length", "aborted")


@dataclasses.dataclass(frozen=True)
class Completion:
    """What every generation gives back per prompt (the Generator's rows, the base of the
    Engine's `RequestOutput`).

    Attributes:
      prompt_ids: the prompt.
      tokens: the generated tokens (up to and including `eos_id`, a stop token id or the
        last token of a stop sequence).
      finish_reason: "eos" (`eos_id`), "stop" (a stop token id or stop sequence), "length"
        (max_new_tokens reached) or "aborted" (the Engine's `abort`).
      sample_index: which of the prompt's `n` samples this is (0 to n - 1).
      logprobs: with the `logprobs` option, each token's log-probability under the model
        (log_softmax of its logits, before penalties, temperature and filters), else None.
      top_logprobs: with `logprobs=k`, per token the k most likely tokens as (token id,
        log-probability), most likely first (empty lists for k = 0), else None.
    """

    prompt_ids: list[int]
    tokens: list[int]
    finish_reason: str
    sample_index: int = dataclasses.field(default=0, kw_only=True)
    logprobs: list[float] | None = dataclasses.field(default=None, kw_only=True)
    top_logprobs: list[list[tuple[int, float]]] | None = dataclasses.field(default=None,
                                                                            kw_only=True)


@dataclasses.dataclass(frozen=True)
class RequestMetrics:
    """Host times of one request (`time.perf_counter()` seconds) and its token counts.

    The durations (queue_time, ttft, tpot, tokens_per_second) leave out the seconds the
    process spent compiling device programs meanwhile (`v4kv_jax.serve.clock`): they measure
    serving, and `compile_time` holds the rest. A wall-clock duration is the reported one
    plus the compile seconds that fell inside it (at most `compile_time`). After
    `Engine.warmup()` no request compiles (compile_time 0.0).

    Attributes:
      arrival_time: when `add_request` queued it.
      queue_time: arrival to admission into a slot (to the end, if never admitted).
      ttft: time to first token: arrival to the end of the step that drew it (None
        without one).
      tpot: time per output token after the first: (last - first token) / (tokens - 1)
        (None with fewer than 2 tokens).
      tokens_per_second: generated tokens / (finish - arrival) (0.0 without a token).
      finish_time: when it finished.
      prompt_tokens: len(prompt_ids) = cached_tokens + recomputed_tokens.
      cached_tokens: prompt tokens whose pages came from the prefix cache.
      replayed_tokens: cached tokens replayed (state only) to rebuild the State at the hit.
      recomputed_tokens: prompt tokens computed (prefilled).
      generated_tokens: len(tokens).
      compile_time: seconds the process spent compiling between its arrival and its end
        (a first request usually compiles the step program; left out of the durations).
    """

    arrival_time: float
    queue_time: float
    ttft: float | None
    tpot: float | None
    tokens_per_second: float
    finish_time: float
    prompt_tokens: int
    cached_tokens: int
    replayed_tokens: int
    recomputed_tokens: int
    generated_tokens: int
    compile_time: float = 0.0


@dataclasses.dataclass(frozen=True)
class RequestOutput(Completion):
    """A finished request of the Engine: a `Completion` and what the engine adds.

    Attributes:
      request_id: the id `add_request` returned.
      cached_tokens: prompt tokens whose pages came from the prefix cache (not computed).
      replayed_tokens: tokens replayed (state only) to rebuild the State at the hit.
      restored_by: how the State at the hit was rebuilt (`RESTORES`): "none" (no hit),
        "snapshot", "snapshot+replay", "replay" (R tokens from the empty State) or
        "recompute" (a hit below R with no snapshot: recomputed instead).
      snapshot_tier: "device", "host" or "disk" when a snapshot was used, else None.
      cached_from: tier -> the cached tokens whose pages were on that tier at admission
        ("device": listed in the pool; "host", "disk": promoted).
      logits: f32[len(tokens), V], the logits each token was drawn from (with the engine's
        `keep_logits`), else None.
      metrics: the request's `RequestMetrics` (times, token counts).
    """

    request_id: int
    cached_tokens: int
    replayed_tokens: int
    restored_by: str
    snapshot_tier: str | None
    cached_from: dict[str, int] = dataclasses.field(default_factory=dict)
    logits: np.ndarray | None = None
    metrics: RequestMetrics | None = None


@dataclasses.dataclass(frozen=True)
class StreamOutput:
    """What one step of a streamed `Engine.generate` gave one of its prompts.

    Attributes:
      index: the prompt's place in the call's `prompts`.
      request_id: its request id.
      new_tokens: the tokens generated in this step (empty while the prompt is prefilled).
      finished: whether the request ended in this step.
      finish_reason: its finish reason once finished, else None.
      output: its `RequestOutput` once finished, else None.
      sample_index: which of the prompt's `n` samples the request is.
      logprobs, top_logprobs: with the `logprobs` option, those of `new_tokens` (as in
        `Completion`), else None.
    """

    index: int
    request_id: int
    new_tokens: list[int]
    finished: bool
    finish_reason: str | None = None
    output: RequestOutput | None = None
    sample_index: int = 0
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None


class EngineError(RuntimeError):
    """The engine lost its cache (a device program failed after taking it over) and runs no
    further step; every later call raises this again.

    Attributes:
      cause: what failed, as "ExceptionType: message".
      finished: outputs of finished requests that no `step()` returned yet (only the first
        EngineError carries them).
      lost: ids of the requests in flight (queued or running) whose work is gone: submit
        their prompts to a new Engine.
    """

    def __init__(self, cause: str, finished: list[RequestOutput], lost: list[int]):
        self.cause, self.finished, self.lost = cause, finished, lost
        super().__init__(f"Engine: its cache was lost ({cause}); no further step runs. "
                         f"Requests in flight lost: {lost}; finished outputs carried by this "
                         f"error: {[o.request_id for o in finished]}. Make a new Engine.")


@dataclasses.dataclass
class Request:
    """The host record of one request: its prompt, settings, slot, progress and outputs."""

    id: int
    prompt: np.ndarray
    max_new_tokens: int
    sampling: SamplingParams
    key: np.ndarray  # u32[2]: its sampling stream (token i drawn with fold_in(key, i))
    namespace: bytes
    tokens: list[int]
    total_pages: int  # pages held at the full length (the last token is never appended)
    arrival: float = 0.0  # time.perf_counter() at add_request
    compiled: float = 0.0  # `clock.compile_seconds()` at add_request
    # `clock.serving_time()` (host time less compile seconds) at admission and first token
    admitted_at: float | None = None
    first_token_at: float | None = None
    head_wait: int = 0  # steps it waited blocked at the head of the queue
    slot: int | None = None
    shard: int | None = None  # the engine shard its slot is on
    length: int = 0  # tokens in the cache
    replay_at: int = 0
    replay_end: int = 0
    digests: list[bytes] = dataclasses.field(default_factory=list)
    generated: list[int] = dataclasses.field(default_factory=list)
    logits: list[np.ndarray] = dataclasses.field(default_factory=list)
    sample_index: int = 0  # which of its prompt's n samples it is
    first_sample: int | None = None  # sample 0's request id, for the samples j > 0
    logprobs: list[float] = dataclasses.field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)
    penalty_row: bool = False  # its row of the step's penalty counts is set
    cached: int = 0
    replayed: int = 0
    restored_by: str = "none"
    snapshot_tier: str | None = None
    cached_from: dict[str, int] = dataclasses.field(default_factory=dict)

    def phase(self) -> str:
        if self.slot is None:
            return "waiting"
        if self.replay_at < self.replay_end:
            return "replay"
        return "prefill" if self.length < len(self.prompt) else "decode"


def check_prompt(name: str, prompt, vocab_size: int) -> np.ndarray:
    """A prompt: a non-empty 1-D sequence of token ids in [0, vocab_size) (as `nn.forward`
    checks them); returns it as int32. Raises TypeError / ValueError naming `name`."""
    if isinstance(prompt, (str, bytes)):
        checks.fail(name, "a 1-D sequence of token ids", prompt, TypeError)
    p = checks.int_array(name, prompt, ndim=1)
    if not p.size:
        checks.fail(name, "at least one token id", "an empty sequence")
    bad = np.flatnonzero((p < 0) | (p >= vocab_size))
    if bad.size:
        checks.fail(name, f"token ids in [0, {vocab_size}) (vocab_size)",
                    f"{int(p[bad[0]])} at position {int(bad[0])}")
    return p.astype(np.int32)


def check_request(name: str, prompt_ids, max_new_tokens: int, options: dict, vocab_size: int,
                  geometry: CacheConfig) -> tuple[np.ndarray, int, SamplingParams, int]:
    """The checked arguments of an Engine request, the prompt called `name` in errors:
    (prompt i32[n], max_new_tokens, its `SamplingParams` from `options`, the pages it holds
    at its full length). Raises TypeError / ValueError naming the argument: a prompt longer
    than max_seq_len names `name`, a prompt and output past it `max_new_tokens`, and a
    request needing more pages than the whole pool holds (it could never run) says so."""
    prompt = check_prompt(name, prompt_ids, vocab_size)
    max_new_tokens = checks.integer("max_new_tokens", max_new_tokens, lo=1)
    sampling = SamplingParams(**options)
    sampling.check_vocab(vocab_size)
    geo = geometry
    if prompt.size > geo.max_seq_len:
        checks.fail(name, f"at most {geo.max_seq_len} tokens (max_seq_len)",
                    f"{prompt.size} tokens")
    end = prompt.size + max_new_tokens - 1
    if end > geo.max_seq_len:
        checks.fail("max_new_tokens", f"at most {geo.max_seq_len - prompt.size + 1} for a "
                    f"prompt of {prompt.size} tokens (max_seq_len={geo.max_seq_len})",
                    max_new_tokens)
    need = pages_for(end, geo.page_tokens)
    if need > geo.num_pages:
        raise ValueError(
            f"{name}, max_new_tokens: the pool is too small for this request: its "
            f"{prompt.size} prompt tokens and {max_new_tokens} new token(s) need {need} "
            f"pages of {geo.page_tokens} tokens, the whole pool has num_pages="
            f"{geo.num_pages}")
    return prompt, max_new_tokens, sampling, need


def finished_output(req: Request, reason: str, *, keep_logits: bool,
                    vocab_size: int) -> RequestOutput:
    """The output of a request that ends now, with its `RequestMetrics` (durations on the
    serving clock, `clock.serving_time`)."""
    end, compiled = time.perf_counter(), clock.compile_seconds()
    served, started = end - compiled, req.arrival - req.compiled  # the serving clock
    n = len(req.generated)
    metrics = RequestMetrics(
        arrival_time=req.arrival,
        queue_time=(served if req.admitted_at is None else req.admitted_at) - started,
        ttft=None if req.first_token_at is None else req.first_token_at - started,
        tpot=(served - req.first_token_at) / (n - 1) if n > 1 else None,
        tokens_per_second=n / (served - started) if n else 0.0, finish_time=end,
        prompt_tokens=len(req.prompt), cached_tokens=req.cached,
        replayed_tokens=req.replayed, recomputed_tokens=len(req.prompt) - req.cached,
        generated_tokens=n, compile_time=compiled - req.compiled)
    if not keep_logits:
        logits = None
    elif req.logits:
        logits = np.stack(req.logits)
    else:
        logits = np.zeros((0, vocab_size), np.float32)
    scores = {}
    if req.sampling.logprobs is not None:
        scores = dict(logprobs=list(req.logprobs),
                      top_logprobs=[list(top) for top in req.top_logprobs])
    return RequestOutput(
        request_id=req.id, prompt_ids=req.prompt.tolist(), tokens=list(req.generated),
        finish_reason=reason, cached_tokens=req.cached, replayed_tokens=req.replayed,
        restored_by=req.restored_by, snapshot_tier=req.snapshot_tier,
        cached_from=dict(req.cached_from), logits=logits, metrics=metrics,
        sample_index=req.sample_index, **scores)


class ServingMetrics:
    """An engine's counts over its finished requests (aborted ones included) and the seconds
    it spent compiling: what `summary` reports.

    Attributes:
      compile_s: seconds the process spent compiling during the engine's `warmup` and steps.
    """

    MEANS = ("ttft", "tpot", "queue_time")

    def __init__(self):
        self.requests_finished = self.tokens_generated = 0
        self.compile_s = 0.0
        self._sums = {k: [0.0, 0] for k in self.MEANS}  # [sum, count]

    def record(self, metrics: RequestMetrics) -> None:
        """Counts a finished request."""
        self.requests_finished += 1
        self.tokens_generated += metrics.generated_tokens
        for name, total in self._sums.items():
            value = getattr(metrics, name)
            if value is not None:
                total[0] += value
                total[1] += 1

    def summary(self) -> dict[str, float | int | None]:
        """requests_finished, tokens_generated, mean_ttft, mean_tpot, mean_queue_time (None
        before any request has one) and compile_s."""
        return {"requests_finished": self.requests_finished,
                "tokens_generated": self.tokens_generated,
                **{f"mean_{k}": s / n if n else None for k, (s, n) in self._sums.items()},
                "compile_s": self.compile_s}


@dataclasses.dataclass(frozen=True)
class EngineReport:
    """The cache's `pools.MemoryReport` and what prefix sharing adds to it.

    Attributes:
      cache: the pools' report (its pages_shared counts pages with refcount > 1, the index's
        reference included).
      pages_in_requests: pages some live request holds.
      pages_shared: pages two or more live requests hold (one physical copy).
      pages_indexed: pages the prefix index lists.
      pages_cached_only: listed pages no live request holds (evictable).
      snapshots: tier -> (count, bytes); disk: the files `snapshot_dir` holds (this
        engine's and any other's it found there).
      cold_pages: tier -> (pages, bytes) of full pages off the device: "host" and "disk"
        (the page files in `snapshot_dir`).
      snapshot_dir: the disk tier as one line (path, files, bytes, bound or read-only,
        filesystem errors caught), or None without one.
      shards: an engine over several shards: each shard's report (the fields above are
        their totals); else empty.
      stats: counters: requests, hits, prompt_tokens, cached_tokens, replayed_tokens,
        recomputed_tokens (prompt tokens computed), pages_evicted (left the device),
        pages_to_host, pages_to_disk (page files written), pages_dropped (off every tier),
        pages_from_host, pages_from_disk (promoted), snapshots_taken, snapshots_dropped,
        disk_errors (filesystem errors caught).
    """

    cache: pools.MemoryReport
    pages_in_requests: int
    pages_shared: int
    pages_indexed: int
    pages_cached_only: int
    snapshots: dict[str, tuple[int, int]]
    stats: dict[str, int]
    snapshot_dir: str | None = None
    cold_pages: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)
    shards: tuple[EngineReport, ...] = ()

    @property
    def cached_fraction(self) -> float:
        """Cached / prompt tokens over every admitted request."""
        prompt = self.stats["prompt_tokens"]
        return self.stats["cached_tokens"] / prompt if prompt else 0.0

    def format(self) -> str:
        s = self.stats
        tiers = ", ".join(f"{t} {n} ({b:,} B)" for t, (n, b) in self.snapshots.items())
        return "\n".join([
            self.cache.format(),
            f"Prefix cache: {self.pages_indexed} pages listed, {self.pages_cached_only} held "
            f"only by the index, {self.pages_shared} shared by live requests, "
            f"{self.pages_in_requests} in live requests",
            f"Snapshots: {tiers}",
            "Cold pages: " + ", ".join(f"{t} {n} ({b:,} B)" for t, (n, b)
                                       in self.cold_pages.items())
            + f"; {s.get('pages_from_host', 0)} promoted from host, "
            f"{s.get('pages_from_disk', 0)} from disk",
            f"Prompt tokens {s['prompt_tokens']:,}: cached {s['cached_tokens']:,} "
            f"({100 * self.cached_fraction:.1f} %), replayed {s['replayed_tokens']:,}, "
            f"computed {s['recomputed_tokens']:,}; {s['hits']} hits in {s['requests']} "
            f"requests; {s['pages_evicted']} pages evicted",
        ] + ([f"Snapshot directory {self.snapshot_dir}"] if self.snapshot_dir else [])
          + [f"Shard {i}: {r.cache.pages_used} pages in use, {r.cache.pages_free} free, "
             f"{r.pages_indexed} listed" for i, r in enumerate(self.shards)])


__all__ = ["FINISH_REASONS", "Completion", "EngineError", "EngineReport", "Request",
           "RequestMetrics", "RequestOutput", "ServingMetrics", "StreamOutput", "check_prompt",
           "check_request", "finished_output"]
