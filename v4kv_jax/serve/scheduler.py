"""Which request runs where and when: the Engine's requests from their arrival (checked and
queued) to their output, its queue, admission with a bounded head wait, and the placement of
a request on a shard.

Admission is first come, first served while the pool can hold each request's whole prompt
and output (its pages at full length: `Request.total_pages`), except that the oldest queued
request, when no shard can hold it yet while a slot is free, lets later requests that fit
pass it for up to `max_head_wait` steps; from then on admission waits for it (it runs as soon
as running requests free enough pages), so no request starves. A live request's pages are
never evicted: admission reserves each running request's pages up to its full length.

The `n` samples of a prompt are n requests of consecutive ids. Samples 1..n-1 of a prompt
longer than a page wait in the queue (passing nothing, blocking nothing) until sample 0 has
computed its prompt; they then hit its full pages, which the samples hold together (one copy,
refcounted), and the snapshot of its State at the last of them, so each computes only the
prompt's tokens past its last full page.

Placement: among the shards with a free slot, the one holding the longest prefix of the
prompt (on any tier), then the one with the fewest pages promised to its running requests,
then the lowest index; the first that can hold the request takes it. Under
`jax.distributed` each process scores and tries its own shards, and every process takes the
same decision from the exchanged results (`mesh.exchange`).
"""

from __future__ import annotations

import itertools
import time

import jax
import numpy as np

from v4kv_jax import checks, pools, prefix
from v4kv_jax import mesh as meshes
from v4kv_jax.serve import clock
from v4kv_jax.serve.batch import StepProgram
from v4kv_jax.serve.manager import PoolExhaustedError, SlotFlaggedError
from v4kv_jax.serve.request import (
    Request,
    RequestOutput,
    ServingMetrics,
    check_request,
    finished_output,
)
from v4kv_jax.serve.sampling import sample_stream, stream_key
from v4kv_jax.serve.shards import Shard, Shards

# The fields of a Request that admission sets, sent by a shard's owner to the other processes.
_ADMITTED = ("slot", "shard", "length", "cached", "replay_at", "replay_end", "replayed",
             "restored_by", "snapshot_tier", "cached_from")

STATS = ("requests", "hits", "prompt_tokens", "cached_tokens", "replayed_tokens",
         "recomputed_tokens")


class Scheduler:
    """The requests of an Engine and their admission into the slots of its shards.

    Args:
      shards: the engine's `Shards`.
      max_head_wait: steps a blocked oldest request lets later ones pass (see the module
        docstring).
      seed: the sampling seed of requests without one of their own.
      fingerprint: the engine's prefix namespace (`prefix.fingerprint`).
      vocab_size: the model's.
      keep_logits: outputs carry their logits.

    Attributes:
      requests: request id -> `Request`, every queued and running one, in order of arrival.
      queue: ids of the queued requests, in order of arrival.
      unreleased: finished requests whose slot is still held (released at the next step).
      finished: the outputs of finished requests that no `Engine.step()` returned yet.
      stats: admission counts (`STATS`) over every admitted request.
      metrics: the `ServingMetrics` of the finished requests.
    """

    def __init__(self, shards: Shards, *, max_head_wait: int, seed: int, fingerprint: bytes,
                 vocab_size: int, keep_logits: bool):
        self.shards = shards
        self.max_head_wait = checks.integer("max_head_wait", max_head_wait, lo=0)
        self._key = jax.random.PRNGKey(checks.integer("seed", seed))
        self.fingerprint, self.vocab_size = fingerprint, vocab_size
        self.keep_logits = keep_logits
        self.requests: dict[int, Request] = {}
        self.queue: list[int] = []
        self.unreleased: list[Request] = []
        self.finished: list[RequestOutput] = []
        self.stats = dict.fromkeys(STATS, 0)
        self.metrics = ServingMetrics()
        self._ids = itertools.count()

    def submit(self, name: str, prompt_ids, max_new_tokens: int, cache_salt,
               options: dict) -> int:
        """Checks a request (`request.check_request`, the prompt called `name` in errors;
        `options`: its `SamplingParams`'), queues its `n` samples as requests of consecutive
        ids and returns the first id. A sample's stream: with a `seed`,
        `sampling.sample_stream(PRNGKey(seed), j)` for sample j; else the engine's seed
        folded with its id."""
        arrival, compiled = time.perf_counter(), clock.compile_seconds()
        prompt, max_new_tokens, sampling, pages = check_request(
            name, prompt_ids, max_new_tokens, options, self.vocab_size, self.shards.geometry)
        namespace = prefix.salt_namespace(self.fingerprint, cache_salt)
        first = None
        for j in range(sampling.n):
            request_id = next(self._ids)
            key = (np.asarray(jax.random.fold_in(self._key, request_id))
                   if sampling.seed is None else sample_stream(stream_key(sampling.seed), j))
            self.requests[request_id] = Request(
                request_id, prompt, max_new_tokens, sampling, key, namespace, prompt.tolist(),
                pages, arrival=arrival, compiled=compiled, sample_index=j, first_sample=first)
            self.queue.append(request_id)
            first = request_id if first is None else first
        return first

    def warmup(self) -> None:
        """Runs jax's helpers that `submit` calls (a request's stream) once."""
        jax.random.fold_in(self._key, 0)
        stream_key(0)

    def finish(self, req: Request, reason: str) -> RequestOutput:
        """The output of `req`, which leaves the requests in flight (and the queue) and is
        counted in `metrics`; its slot is not released here."""
        self.requests.pop(req.id, None)
        if req.id in self.queue:
            self.queue.remove(req.id)
        out = finished_output(req, reason, keep_logits=self.keep_logits,
                              vocab_size=self.vocab_size)
        self.metrics.record(out.metrics)
        return out

    def request(self, request_id) -> Request:
        """The request in flight of id `request_id`; TypeError / KeyError naming it."""
        if isinstance(request_id, (bool, np.bool_)) or not isinstance(request_id, int):
            checks.fail("request_id", "an int returned by add_request", repr(request_id),
                        TypeError)
        if request_id not in self.requests:
            checks.fail("request_id", f"a request in flight ({list(self.requests)})",
                        request_id, KeyError)
        return self.requests[request_id]

    def running(self) -> list[Request]:
        """The requests that hold a slot, in order of arrival."""
        return [r for r in self.requests.values() if r.slot is not None]

    def step(self, program: StepProgram) -> PoolExhaustedError | SlotFlaggedError | None:
        """One step: releases the slots of finished requests, admits queued ones, runs
        `program` on the running ones (their progress recorded as soon as it ran), adds the
        outputs of those that finished to `finished`, then lists their pages and snapshots
        their States in the prefix caches and releases the finished slots (even when that
        prefix-cache work raises). Returns the error of slots the step flagged (None: none
        was)."""
        self.release_finished()
        self.admit_queued()
        running = self.running()
        if not running:
            if self.queue:  # cannot happen: an empty pool holds any queued request
                raise RuntimeError(f"requests {self.queue} cannot be admitted into an idle "
                                   "engine")
            return None
        finished, advanced, tables, flag_error = program.step(self.shards, running)
        self.finished += [self.finish(req, reason) for req, reason in finished]
        self.unreleased += [req for req, _ in finished]
        try:
            self.shards.record(advanced, tables)
        except BaseException:
            if not self.shards.lost():
                try:
                    self.release_finished()
                except Exception:  # noqa: BLE001 - kept in unreleased, tried next step
                    pass
            raise
        self.release_finished()
        return flag_error

    # --- admission --------------------------------------------------------------------------------

    def admit_queued(self) -> None:
        """Admits queued requests in order of arrival. The first that does not fit (the
        head) lets later ones that fit pass it while it has waited fewer than
        `max_head_wait` steps; then nothing passes it. Every process takes the same
        decisions (from the same requests and the exchanged outcomes of `admit`)."""
        head, now = None, clock.serving_time()
        slots = self.shards.geometry.max_slots * self.shards.count
        for request_id in list(self.queue):
            if len(self.running()) >= slots:
                break  # no free slot on any shard
            req = self.requests[request_id]
            if self._waits_for_first_sample(req):
                continue
            if self.admit(req):
                req.admitted_at = now
                self.queue.remove(request_id)
            elif head is None:
                head = req
                if head.head_wait >= self.max_head_wait:
                    break
        if head is not None:
            head.head_wait += 1

    def _waits_for_first_sample(self, req: Request) -> bool:
        """Whether `req`, a sample j > 0, waits for sample 0 to compute the prompt's full
        pages (see the module docstring)."""
        first = self.requests.get(req.first_sample)
        return (first is not None and len(req.prompt) > self.shards.geometry.page_tokens
                and first.phase() in ("waiting", "replay", "prefill"))

    def admit(self, req: Request) -> bool:
        """Admits `req` into a free slot with its prefix hit, if a shard's pool can hold it
        (after evicting what it needs); False (nothing changed) otherwise. Placement: see
        the module docstring; the owner of the shard that admits the request sends its slot
        and hit, which the other processes record."""
        shards, S = self.shards, self.shards.geometry.max_slots
        digests = shards[0].prefix_cache.prompt_digests(req.prompt, req.namespace)
        running = self.running()

        def order(shard: Shard) -> tuple:
            mine = [r for r in running if r.shard == shard.index]
            return (-shard.prefix_cache.hit_pages(digests), sum(r.total_pages for r in mine),
                    len(mine), shard.index)

        scores = [order(s) for s in shards if len(s.table) < S]
        several = shards.count > 1
        if several:
            scores = [key for keys in meshes.exchange(scores) for key in keys]
        for key in sorted(scores):
            index = key[-1]
            outcome, error = (self._try_shard(shards.shard(index), req, digests, running)
                              if shards.holds(index) else (None, None))
            if several:
                outcome = meshes.exchange(outcome)[shards.owners[index]]
            if outcome is None:
                continue  # the shard cannot hold it now: the next one
            if isinstance(outcome, str):
                if error is not None:
                    raise error
                raise RuntimeError(f"Engine: admitting request {req.id} on shard {index} "
                                   f"failed in process {shards.owners[index]}: {outcome}")
            if not shards.holds(index):
                for name, value in outcome.items():
                    setattr(req, name, value)
            break
        else:
            return False
        self.stats["requests"] += 1
        self.stats["prompt_tokens"] += len(req.prompt)
        self.stats["cached_tokens"] += req.cached
        self.stats["replayed_tokens"] += req.replayed
        self.stats["recomputed_tokens"] += len(req.prompt) - req.cached
        self.stats["hits"] += bool(req.cached)
        return True

    def _try_shard(self, shard: Shard, req: Request, digests: list[bytes],
                   running: list[Request]) -> tuple[dict | str | None, BaseException | None]:
        """Admits `req` on `shard` (of this process) if its pool can hold it: (the fields
        of `req` admission set, None); (None, None) when it cannot; (the error's text, the
        error) when admission raised (nothing changed: all or nothing)."""
        try:
            plan = shard.prefix_cache.plan(digests, req.total_pages, shard.prefix_cache
                                           .reserved_pages([r for r in running
                                                            if r.shard == shard.index]))
            if plan is None:
                return None, None
            shard.cache, req.slot = shard.table.admit(shard.cache, req.id)
            req.shard = shard.index
            shard.prefix_cache.enter(req, digests, plan)
        except BaseException as e:  # noqa: BLE001 - returned, raised by the caller
            if req.slot is not None and not pools.is_deleted(shard.cache):
                self.shards.release(req)
            req.slot = req.shard = None
            req.length = req.cached = req.replay_at = req.replay_end = req.replayed = 0
            req.digests, req.restored_by, req.snapshot_tier = [], "none", None
            req.cached_from = {}
            return f"{type(e).__name__}: {e}", e
        return {name: getattr(req, name) for name in _ADMITTED}, None

    # --- release ----------------------------------------------------------------------------------

    def release_finished(self) -> None:
        """Releases the slots of finished requests; one that raises stays listed (and is
        tried again at the next step) while the others go on."""
        failed, error = [], None
        for req in self.unreleased:
            try:
                self.shards.release(req)
            except Exception as e:  # noqa: BLE001 - kept, re-raised below
                failed.append(req)
                error = error or e
        self.unreleased[:] = failed
        if error is not None:
            raise error


__all__ = ["STATS", "Scheduler"]
