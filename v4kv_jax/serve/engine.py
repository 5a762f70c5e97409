"""The token-aware engine: requests by token ids, continuous batching, prefix sharing.

`Engine` owns a served model's params, one cache and the requests. `add_request` queues a
prompt with its options (`v4kv_jax.serve.sampling.SamplingParams`: temperature, top_k, top_p,
min_p, seed, eos_id, stop token ids and sequences, n samples, logprobs, repetition, presence
and frequency penalties); each `step()` admits queued requests
into free slots (`scheduler`: in order of arrival while the pool can hold each one's whole
prompt and output, except that later requests that fit may pass one that does not for up to
`max_head_wait` steps), then runs ONE jitted program of fixed shapes (`batch`): the replay
rows that rebuild a hit's State, the prefill chunks within `token_budget` tokens, and one
decode token of every request past its prompt, one row per slot of every shard, so every
step and every prompt length runs the same compiled program; the last rows draw each
request's token with its own key and options (`sampling.sample`). Finished requests come
back from `step()` as `RequestOutput`s, with their `RequestMetrics` (host times less the
seconds spent compiling, which are reported apart: queue time, time to first token, time per
output token, compile time); `generate(..., stream=True)` yields every step's new tokens
instead. `warmup()` compiles every program a step runs before the first request.

The engine is built of parts it holds: its `Shards` (`shards`: each device's cache, slot
table and prefix cache), its `Scheduler` (`scheduler`: the requests, the queue, admission
and placement) and its `StepProgram` (`step_program`: the step's batch and program).

Prefix sharing (`v4kv_jax.prefix.cache`): every full page is listed under the digest of its
tokens' chain (namespaced by the engine's fingerprint: attention config, cache geometry, model
config, options, weights; and by the request's `cache_salt`), held by the index, so the pages
of finished requests stay cached. A new request attaches the longest chain of listed full
pages of its prompt and rebuilds the State at the hit boundary from a snapshot (device, host
or disk tier), a lower snapshot plus a replay, or a replay from the empty State. When the pool
cannot hold a request, least recently used pages only the index holds are evicted; if that
is not enough the request waits in the queue. A live request's pages and State are never
evicted: admission reserves each running request's pages up to its full length.

The host side of a step is all or nothing (see `Engine.step`), and the disk tier turns every
filesystem fault into a warning and a miss (`v4kv_jax.prefix.disk`).
"""

from __future__ import annotations

import os
import re
import time
import warnings
from collections.abc import Iterator, Sequence

from v4kv_jax import checks, prefix
from v4kv_jax import mesh as meshes
from v4kv_jax.config import AttentionConfig, CacheConfig, Options
from v4kv_jax.pools import Cache
from v4kv_jax.pools.paging import pages_for
from v4kv_jax.prefix.cache import RESTORES, PrefixCache
from v4kv_jax.serve import clock
from v4kv_jax.serve.batch import StepBatch, StepProgram, compiled_step_programs
from v4kv_jax.serve.generator import ModelCache
from v4kv_jax.serve.manager import SlotTable
from v4kv_jax.serve.protocol import ServedModel
from v4kv_jax.serve.request import (
    FINISH_REASONS,
    Completion,
    EngineError,
    EngineReport,
    RequestMetrics,
    RequestOutput,
    StreamOutput,
)
from v4kv_jax.serve.sampling import SamplingParams
from v4kv_jax.serve.scheduler import Scheduler
from v4kv_jax.serve.shards import Shard, Shards


class Engine(ModelCache):
    """Continuous batching with prefix sharing over one cache; see the module docstring.

    Args:
      model: a `v4kv_jax.serve.protocol.ServedModel` with its `replay`, e.g. a
        `v4kv_jax.nn.Decoder` (split once here: later changes to it are not seen; its
        weights are hashed once, into the prefix keys).
      geometry: the cache geometry (`max_slots` requests run at once).
      prefill_chunk: tokens per prefill row and step; divides page_tokens.
      token_budget: replay + prefill tokens per step and shard (decode tokens come on top);
        default max_slots * prefill_chunk.
      snapshot_every_pages: also snapshot the State every this many pages (None: only at
        the last full page boundary of every prompt).
      device_snapshots, host_snapshots: sizes of the device and host snapshot tiers.
      host_pages: the host tier of cold pages, in pages (None: num_pages, as many as the
        device pool). A listed page no request holds is moved there when the pool needs
        room, then (least recently used first) to `snapshot_dir` as one file per page; a
        prompt that hits it gets it back in the pool before its first step. 0: none (pages
        go straight to disk, or are dropped without a `snapshot_dir`).
      snapshot_dir: the disk tier's directory (None: no disk tier; made if missing; one that
        cannot be written is a read-only tier, said once by a warning); an engine over a
        directory another engine of the same fingerprint wrote (and `flush`ed or `close`d)
        hits its snapshots. Filesystem faults there never fail a step: see `step`.
      disk_snapshots: the disk tier's size in files (None: no bound on the count).
      disk_bytes: the disk tier's size in bytes (None: unbounded; default 4 GiB); least
        recently used files are deleted past either bound.
      seed: the sampling seed of requests without a `seed` of their own (each draws from
        this seed folded with its request id, whatever the batch).
      keep_logits: return each generated token's logits in its `RequestOutput`.
      max_head_wait: admission is first come, first served, except that the oldest queued
        request, when the pool cannot hold it yet while a slot is free, lets later requests
        that fit pass it for up to this many steps; from then on admission waits for it (it
        runs as soon as running requests free enough pages). 0: strictly in order.
      options: how the ops run.
      mesh: a `v4kv_jax.mesh.data_mesh` to run data-parallel over (None: one device). Each
        of its devices holds a shard: a cache of `geometry` (so the engine runs
        mesh.size * max_slots requests over mesh.size * num_pages pages) with its own prefix
        cache; a new request goes to the shard holding the longest prefix of its prompt,
        else to the least loaded one. With more than one shard, shard i keeps its files in
        `snapshot_dir`/shard-i. Under `jax.distributed` every process builds the engine and
        makes the same calls (add_request, step, generate, abort) in the same order; each
        process holds the shards of its own devices (their caches, slot tables, prefix
        caches, host tiers and files) and every process takes the same placement decisions
        from the scores its peers send (`v4kv_jax.serve.scheduler`); every output comes
        back on every process.

    Attributes:
      shards: this process's `Shards` (`shards[i]`: a `Shard` with its cache, slot table and
        prefix cache).
      scheduler: the `Scheduler` (requests in flight, queue, admission).
      step_program: the `StepProgram` (the step's batch and program).
    """

    def __init__(self, model: ServedModel, geometry: CacheConfig, *, prefill_chunk: int = 128,
                 token_budget: int | None = None, snapshot_every_pages: int | None = None,
                 device_snapshots: int = 8, host_snapshots: int = 32,
                 host_pages: int | None = None, snapshot_dir: str | os.PathLike | None = None,
                 disk_snapshots: int | None = None, disk_bytes: int | None = prefix.DISK_BYTES,
                 seed: int = 0, keep_logits: bool = False, max_head_wait: int = 16,
                 options: Options | None = None, mesh: meshes.Mesh | None = None):
        self.mesh = None if mesh is None else meshes.check_mesh(mesh)
        super().__init__(model, geometry, options, replays=True)
        program = StepProgram(self.graphdef, self.params, self.options, self.mesh, geometry,
                              shards=self.shards.count, prefill_chunk=prefill_chunk,
                              token_budget=token_budget, keep_logits=keep_logits)
        self.step_program = program
        self.prefill_chunk, self.token_budget = program.prefill_chunk, program.token_budget
        self.keep_logits = keep_logits
        if snapshot_every_pages is not None:
            snapshot_every_pages = checks.integer("snapshot_every_pages", snapshot_every_pages,
                                                  lo=1)
        self.fingerprint = fingerprint(self.config.attn_config, self.graphdef, geometry,
                                       self.options, self.params)
        self.scheduler = Scheduler(self.shards, max_head_wait=max_head_wait, seed=seed,
                                   fingerprint=self.fingerprint,
                                   vocab_size=self.config.vocab_size, keep_logits=keep_logits)
        attn = self.config.attn_config
        self.replay_pages = pages_for(attn.num_layers * (attn.window - 1) + 1,
                                      geometry.page_tokens)
        self.shards.open_prefix_caches(
            snapshot_dir, replay_pages=self.replay_pages, snapshot_every_pages=snapshot_every_pages,
            device_snapshots=device_snapshots, host_snapshots=host_snapshots,
            host_pages=geometry.num_pages if host_pages is None else host_pages,
            disk_snapshots=disk_snapshots, disk_bytes=disk_bytes)
        self._broken: str | None = None  # what lost the cache
        self._closed = False

    def _init_pools(self, model: AttentionConfig, geometry: CacheConfig) -> None:
        self.shards = Shards(model, geometry, self.mesh)

    # --- views --------------------------------------------------------------------------------

    @property
    def cache(self) -> Cache:
        """The cache; with a mesh, the global view of the shards' caches (`v4kv_jax.mesh`:
        slot s of shard i is row i * max_slots + s). Setting it replaces every shard's."""
        return self.shards.cache

    @cache.setter
    def cache(self, cache: Cache) -> None:
        self.shards.cache = cache

    @property
    def table(self) -> SlotTable:
        """The slot table (one shard only; else each shard's `table`)."""
        return self.shards.only("table").table

    @property
    def prefix_cache(self) -> PrefixCache:
        """The prefix cache (one shard only; else each shard's `prefix_cache`)."""
        return self.shards.only("prefix_cache").prefix_cache

    @property
    def index(self) -> prefix.PrefixIndex:
        """The prefix cache's index of listed pages."""
        return self.prefix_cache.index

    @property
    def snapshots(self) -> prefix.SnapshotStore:
        """The prefix cache's snapshot tiers."""
        return self.prefix_cache.snapshots

    @property
    def attn_config(self) -> AttentionConfig:
        return self.shards[0].cache.attn_config

    @property
    def geometry(self) -> CacheConfig:
        """The geometry of one shard (the whole cache without a mesh)."""
        return self.shards.geometry

    @property
    def max_head_wait(self) -> int:
        return self.scheduler.max_head_wait

    @property
    def stats(self) -> dict[str, int]:
        """Admission counts (`scheduler.STATS`) over every admitted request."""
        return self.scheduler.stats

    @property
    def slots(self) -> dict[int, int]:
        """request id -> its row in `cache` (shard index * max_slots + slot), for every
        running request (of every process's shards)."""
        return {r.id: self.shards.row(r) for r in self.scheduler.running()}

    def shard_of(self, request_id: int) -> int | None:
        """The shard a request in flight runs on (None while it waits)."""
        return self.scheduler.request(request_id).shard

    # --- the disk tier and shutdown -----------------------------------------------------------

    def flush(self) -> int:
        """Writes every device and host snapshot, and every listed or host-tier page, that is
        not on disk yet to `snapshot_dir`, so that an engine started later over the directory
        hits them; they also stay on their tiers. Returns how many files were written. A
        write that fails is warned about and skipped (see `step`); without a `snapshot_dir`,
        or over a read-only one, nothing is written (0)."""
        self._check_usable()
        return sum(s.prefix_cache.flush() for s in self.shards)

    def close(self) -> list[RequestOutput]:
        """Flushes the snapshots and pages to disk (`flush`) and ends the engine: later calls
        raise. Requests still in flight are aborted (a warning names them) and returned with
        the outputs no `step()` returned yet."""
        if self._closed:
            return []
        out = []
        if self._broken is None:
            self.flush()
            out = [self.abort(request_id) for request_id in list(self.scheduler.requests)]
            if out:
                warnings.warn(f"Engine.close: requests {[o.request_id for o in out]} were in "
                              "flight; aborted", RuntimeWarning, stacklevel=2)
        out, self.scheduler.finished = self.scheduler.finished + out, []
        self._closed = True
        return out

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # --- requests -----------------------------------------------------------------------------

    def add_request(self, prompt_ids, max_new_tokens: int, temperature: float = 0.0,
                    eos_id: int | None = None, cache_salt: str | bytes | None = None, *,
                    top_k: int | None = 0, top_p: float = 1.0, min_p: float = 0.0,
                    seed: int | None = None, stop_token_ids: Sequence[int] = (),
                    stop: Sequence[Sequence[int]] = (), n: int = 1,
                    logprobs: int | None = None, repetition_penalty: float = 1.0,
                    presence_penalty: float = 0.0, frequency_penalty: float = 0.0) -> int:
        """Queues a request; returns its id. It is admitted by a later `step()`. With `n`
        samples, queues n requests of ids id, id + 1, ..., id + n - 1 (the returned id is
        the first; `RequestOutput.sample_index` says which sample each is), whose prompt's
        full pages are computed once and shared (`v4kv_jax.serve.scheduler`).

        Args:
          prompt_ids: 1-D token ids in [0, vocab_size), at least one.
          max_new_tokens: tokens to generate (>= 1; fewer when the request stops). The
            length rule (the Generator's too): len(prompt_ids) + max_new_tokens - 1 <=
            max_seq_len, since the last generated token is never appended.
          temperature: 0 = greedy, > 0 samples from softmax(logits / temperature).
          eos_id: a token id in [0, vocab_size) that ends the request ("eos"), or None.
          cache_salt: None, a str or bytes: the request hits only pages written under the
            same salt.
          top_k, top_p, min_p, seed, stop_token_ids, stop: the rest of the request's options
            (`v4kv_jax.serve.sampling.SamplingParams`): the sampling filters, its own stream (the
            same prompt and seed give the same tokens whatever else runs), token ids and
            token-id sequences that end it ("stop", the stop tokens kept in the output).
          n, logprobs, repetition_penalty, presence_penalty, frequency_penalty: samples of
            the prompt, the log-probabilities in the output (each token's and the top
            `logprobs`), the penalties (`SamplingParams`).

        Raises:
          TypeError / ValueError naming the argument (`request.check_request`; a request
          needing more pages than the whole pool holds, which could never run, says so).
        """
        self._check_usable()
        return self.scheduler.submit("prompt_ids", prompt_ids, max_new_tokens, cache_salt, dict(
            temperature=temperature, eos_id=eos_id, top_k=top_k, top_p=top_p, min_p=min_p,
            seed=seed, stop_token_ids=stop_token_ids, stop=stop, n=n, logprobs=logprobs,
            repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty))

    def abort(self, request_id: int) -> RequestOutput:
        """Ends a queued or running request now; returns what it generated ("aborted")."""
        self._check_usable()
        req = self.scheduler.request(request_id)
        out = self.scheduler.finish(req, "aborted")
        self.shards.release(req)
        return out

    def status(self, request_id: int) -> str:
        """The phase of a request in flight: "waiting" (queued), "replay", "prefill" or
        "decode"."""
        return self.scheduler.request(request_id).phase()

    @property
    def in_flight(self) -> list[int]:
        """Ids of the queued and running requests."""
        return list(self.scheduler.requests)

    def generate(self, prompts: Sequence, max_new_tokens: int, *, temperature: float = 0.0,
                 eos_id: int | None = None, cache_salt: str | bytes | None = None,
                 top_k: int | None = 0, top_p: float = 1.0, min_p: float = 0.0,
                 seed: int | None = None, stop_token_ids: Sequence[int] = (),
                 stop: Sequence[Sequence[int]] = (), n: int = 1, logprobs: int | None = None,
                 repetition_penalty: float = 1.0, presence_penalty: float = 0.0,
                 frequency_penalty: float = 0.0, stream: bool = False
                 ) -> list[RequestOutput] | Iterator[list[StreamOutput]]:
        """Runs `prompts` to completion (steps shared with any request already in flight,
        whose outputs come back from the next `step()`); returns their outputs in order,
        n per prompt (output b * n + j: sample j of prompt b).

        The options are `add_request`'s, the same for every prompt (with a `seed`, every
        prompt draws from PRNGKey(seed), so equal prompts give equal tokens). Every prompt
        is checked and queued before this returns (all or nothing: a bad one, named
        `prompts[i]`, queues none).

        With `stream`, returns an iterator instead, whose every item is one step: a list of
        `StreamOutput`s, one for each of these prompts that drew tokens or finished in that
        step (request id, index in `prompts`, `new_tokens`, `finished`, `finish_reason` and
        the `RequestOutput` once finished; `sample_index`, and the new tokens' `logprobs`
        and `top_logprobs` with the `logprobs` option). A sample's streamed tokens,
        concatenated, are its output's tokens. Steps run as the iterator is consumed;
        closing it early aborts the prompts still in flight.
        """
        if not isinstance(stream, bool):
            checks.fail("stream", "a bool", repr(stream), TypeError)
        ids, index = _queue(self, prompts, max_new_tokens, cache_salt, dict(
            temperature=temperature, eos_id=eos_id, top_k=top_k, top_p=top_p, min_p=min_p,
            seed=seed, stop_token_ids=stop_token_ids, stop=stop, n=n, logprobs=logprobs,
            repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty))
        if stream:
            return _stream(self, ids, index, with_logprobs=logprobs is not None)
        done: dict[int, RequestOutput] = {}
        while len(done) < len(ids):
            done.update((o.request_id, o) for o in self._step_for(ids))
        return [done[r] for r in ids]

    def _step_for(self, ids: list[int]) -> list[RequestOutput]:
        """Runs a step; takes the outputs of `ids` that finished (the others' stay for
        `step()`)."""
        self._guarded(self._run_step)
        outbox = self.scheduler.finished
        self.scheduler.finished = [o for o in outbox if o.request_id not in ids]
        return [o for o in outbox if o.request_id in ids]

    # --- the step -----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One iteration: admissions, then one program with the replay and prefill rows
        within the token budget and one decode token of every request past its prompt.
        Returns the requests that finished (empty when nothing is in flight), those of an
        earlier step that raised included.

        The step is all or nothing on the host side: every request's progress is recorded as
        soon as the device program has run, before any prefix-cache work (listing pages,
        snapshots, disk), and finished requests are kept until a `step()` returns them. So
        when that later work raises, every request's host state still matches the device and
        the engine goes on. Should the cache itself be lost (a failure inside a device program
        after it took the cache over), the engine raises `EngineError` from then on, carrying
        the outputs it still holds and the ids of the requests it lost.
        """
        self._guarded(self._run_step)
        out, self.scheduler.finished = self.scheduler.finished, []
        return out

    def _guarded(self, run) -> None:
        """Runs `run` (which may run device programs on the cache), counting the seconds
        compiled meanwhile; a failure that lost the cache breaks the engine (`step`)."""
        self._check_usable()
        compiled = clock.compile_seconds()
        try:
            run()
        except BaseException as e:
            if self.shards.lost():
                self._broken = f"{type(e).__name__}: {e}"
                raise self._error() from e
            raise
        finally:
            self.scheduler.metrics.compile_s += clock.compile_seconds() - compiled

    def warmup(self) -> float:
        """Compiles, before the first request, every device program a step of this engine
        runs: the step program (its one batch shape: a row per slot of every shard), the
        slot lifecycle (admission, release), the prefix cache's pool transfers (listing,
        snapshots, attaching and restoring a hit, eviction, promotion) and jax's helpers
        that a request and a step call. Each program runs once on no rows (slot and page ids
        -1, token counts 0), so no request and no cache content changes; programs an engine
        of the same model, geometry and options compiled already are reused. Returns the
        seconds it took (`metrics()["compile_s"]` counts its compile seconds); a second call
        compiles nothing and returns about 0."""
        start = time.perf_counter()

        def run():
            self.scheduler.warmup()
            self.step_program.warmup(self.shards)
            self.shards.warmup()

        self._guarded(run)
        return time.perf_counter() - start

    def _check_usable(self) -> None:
        if self._closed:
            raise RuntimeError("Engine: closed (close() was called); make a new Engine")
        if self._broken is not None:
            raise self._error()

    def _error(self) -> EngineError:
        finished, self.scheduler.finished = self.scheduler.finished, []
        return EngineError(self._broken, finished, list(self.scheduler.requests))

    def _run_step(self) -> None:
        flag_error = self.scheduler.step(self.step_program)
        if flag_error is not None:  # a bug of admission (it reserves every page needed)
            self._broken = f"{type(flag_error).__name__}: {flag_error}"
            raise flag_error

    # --- metrics and reports ------------------------------------------------------------------

    def metrics(self) -> dict[str, float | int | None]:
        """Engine-wide serving metrics (host times, seconds) over every request that has
        finished (aborted ones included): requests_finished, tokens_generated, and the means
        mean_ttft, mean_tpot, mean_queue_time of the requests that have one (None before
        any), which leave out the seconds spent compiling (see `RequestMetrics`);
        compile_s, the seconds this process spent compiling device programs during this
        engine's `warmup` and steps (a first step without `warmup` compiles the step
        program: on a GPU, seconds to tens of seconds); with the prefix cache's prompt-token
        counts of `memory_report().stats`."""
        return {**self.scheduler.metrics.summary(),
                **{k: self.stats[k] for k in ("requests", "prompt_tokens", "cached_tokens",
                                              "replayed_tokens", "recomputed_tokens")}}

    def clear_prefix_cache(self, *, disk: bool = False) -> None:
        """Drops every listed page (the index's references), the host tier's pages and the
        device and host snapshots (with `disk`, the page and snapshot files too).

        A clear is a barrier: requests running at the time keep their pages and State and
        finish with the same tokens, but list no page and take no snapshot for the rest of
        their life (not even of pages they fill later: those depend on their State from
        before the clear), so no later request hits what they computed; their pages are
        freed when they finish. Requests admitted after the clear list and snapshot as
        usual (one with a running request's prompt recomputes it). Without `disk`, the files
        already in `snapshot_dir` stay and can still be hit."""
        self._check_usable()
        running = self.scheduler.running()
        for s in self.shards:
            s.prefix_cache.clear(disk=disk, running=[r.slot for r in running
                                                     if r.shard == s.index])

    def memory_report(self) -> EngineReport:
        """The memory report; with several shards the totals, and each shard's report in
        `shards` (its own pages, tiers and prefix-cache counters). With several processes
        every process must call it (the shards' reports are exchanged)."""
        return self.shards.report(self.stats)


def _queue(engine: Engine, prompts: Sequence, max_new_tokens: int, cache_salt,
           options: dict) -> tuple[list[int], list[int]]:
    """Checks and queues every prompt of `Engine.generate`, n samples each: (request ids,
    the index in `prompts` of each). All or nothing: a bad prompt, named `prompts[i]`,
    aborts the ones queued before it."""
    if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__len__"):
        checks.fail("prompts", "a sequence of token-id sequences", prompts, TypeError)
    if not len(prompts):
        checks.fail("prompts", "at least one prompt", "an empty sequence")
    ids, index = [], []
    engine._check_usable()
    try:
        for i, p in enumerate(prompts):
            first = engine.scheduler.submit(f"prompts[{i}]", p, max_new_tokens, cache_salt,
                                            options)
            samples = range(first, first + SamplingParams(**options).n)
            ids += samples
            index += [i] * len(samples)
    except BaseException:
        for r in ids:
            engine.abort(r)
        raise
    return ids, index


def fingerprint(attn_config: AttentionConfig, graphdef, geometry: CacheConfig,
                options: Options, params) -> bytes:
    """The namespace of an engine's prefix keys: its attention config, the model's structure
    (its split graph or tree, static fields included), the geometry fields a page's contents
    depend on (not pool size, slots or chunking), the options and the weights."""
    g = geometry
    # Static functions in a graph (flax layers keep their initializers and dtype promotion)
    # print with their address: without it, another process's engine gets the same namespace.
    structure = re.sub(r" at 0x[0-9a-fA-F]+", "", repr(graphdef))
    return prefix.fingerprint(
        repr(attn_config), f"page_tokens={g.page_tokens} entry={g.entry_dtype} "
        f"index={g.index_dtype} window={g.window_dtype} tail={g.tail_dtype} "
        f"hca_tail={g.hca_tail}", structure, repr(options), prefix.tree_digest(params))


def _stream(engine: Engine, ids: list[int], prompt_of: list[int], *, with_logprobs: bool
            ) -> Iterator[list[StreamOutput]]:
    """`Engine.generate(..., stream=True)` of the requests `ids` (of the prompts
    `prompt_of`), with their tokens' logprobs when they ask for them."""
    sent = dict.fromkeys(ids, 0)
    index = dict(zip(ids, prompt_of, strict=True))
    requests = engine.scheduler.requests
    try:
        while sent:
            finished = {o.request_id: o for o in engine._step_for(list(sent))}
            events = []
            for r in list(sent):
                out = finished.get(r)
                if out is None and r not in requests:  # aborted by the caller
                    del sent[r]
                    continue
                source = out if out is not None else requests[r]
                tokens = out.tokens if out is not None else requests[r].generated
                new, start = list(tokens[sent[r]:]), sent[r]
                sent[r] = len(tokens)
                if out is not None:
                    del sent[r]
                if new or out is not None:
                    scores = {}
                    if with_logprobs:
                        scores = dict(logprobs=list(source.logprobs[start:]),
                                      top_logprobs=list(source.top_logprobs[start:]))
                    events.append(StreamOutput(
                        index=index[r], request_id=r, new_tokens=new, finished=out is not None,
                        finish_reason=None if out is None else out.finish_reason, output=out,
                        sample_index=source.sample_index, **scores))
            yield events
    finally:
        if sent and engine._broken is None and not engine._closed:
            for r in sent:  # closed early: what is still in flight leaves
                if r in requests:
                    engine.abort(r)


__all__ = ["FINISH_REASONS", "RESTORES", "Completion", "Engine", "EngineError", "EngineReport",
           "RequestMetrics", "RequestOutput", "SamplingParams", "Shard", "StepBatch",
           "StreamOutput", "compiled_step_programs"]
