"""The token-aware engine: requests by token ids, continuous batching, prefix sharing.

`Engine` owns a `nn.Decoder`'s params, one cache and the requests. `add_request` queues a
prompt with its options (`v4kv_jax.serve.sampling.SamplingParams`: temperature, top_k, top_p,
min_p, seed, eos_id, stop token ids and sequences); each `step()` admits queued requests
into free slots, in order of arrival while the pool can hold each one's whole prompt and
output, except that later requests that fit may pass one that does not for up to
`max_head_wait` steps (then admission waits for it: no request starves), then runs ONE
jitted program of fixed shapes:

  replay   state-only rows (`Decoder.replay`): rebuild a hit's State before its boundary
  prefill  chunk rows of `prefill_chunk` tokens, within `token_budget` tokens a step (replay
           rows included); a chunk never crosses a multiple of `prefill_chunk`, so every page
           boundary is the end of a chunk
  decode   one token of every request that has finished its prompt

Every phase has one row per slot (slot id -1 where a slot has nothing to do; a phase with no
row is skipped by `lax.cond`), so every step and every prompt length runs the same compiled
program; the last rows draw each request's token with its own key and options
(`sampling.sample`). Finished requests come back from `step()` as `RequestOutput`s, with
their `RequestMetrics` (host times less the seconds spent compiling, which are reported apart:
queue time, time to first token, time per output token, compile time);
`generate(..., stream=True)` yields every step's new tokens instead. `warmup()` compiles every
program a step runs before the first request.

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

import dataclasses
import functools
import itertools
import os
import time
import warnings
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from v4kv_jax import checks, pools, prefix, programs
from v4kv_jax import mesh as meshes
from v4kv_jax.config import AttentionConfig, CacheConfig, Options
from v4kv_jax.nn.model import Decoder
from v4kv_jax.pools import Cache
from v4kv_jax.pools.paging import pages_for
from v4kv_jax.prefix import tiers as page_tiers
from v4kv_jax.prefix.cache import RESTORES, PrefixCache
from v4kv_jax.serve import clock
from v4kv_jax.serve.generator import ModelCache, check_prompt
from v4kv_jax.serve.manager import SlotFlaggedError, SlotTable
from v4kv_jax.serve.request import (
    FINISH_REASONS,
    Completion,
    EngineError,
    EngineReport,
    Request,
    RequestMetrics,
    RequestOutput,
    StreamOutput,
)
from v4kv_jax.serve.sampling import SamplingParams, row_keys, sample, stream_key

# --- the one step program -------------------------------------------------------------------------


@struct.dataclass
class StepBatch:
    """The rows of one step, one per slot (slot id -1 where the slot sits the phase out).

    replay_*: state-only rows, tokens i32[S, C] of positions replay_start ...; prefill_*:
    chunk rows i32[S, C]; decode_*: i32[S, 1]; each with slot ids i32[S] and counts i32[S].
    key: u32[S, 2] each slot's sampling stream, draw: i32[S] the index of the token it draws
    (its key is fold_in(key, draw)), temperature, top_k, top_p, min_p: f32/i32/f32/f32[S] its
    options (`v4kv_jax.serve.sampling`).
    """

    replay_tokens: jax.Array
    replay_slots: jax.Array
    replay_start: jax.Array
    replay_n: jax.Array
    prefill_tokens: jax.Array
    prefill_slots: jax.Array
    prefill_n: jax.Array
    decode_tokens: jax.Array
    decode_slots: jax.Array
    decode_n: jax.Array
    key: jax.Array
    draw: jax.Array
    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array


def _step(graphdef, options: Options, mesh, params, cache: Cache, batch: StepBatch):
    """(cache, next i32[S], logits f32[S, V]): replay, prefill and decode rows in that order;
    row s's logits are those of its prefill chunk's last token or of its decode token, its
    token drawn by `sampling.sample` with its key and options.

    With a `mesh`, every shard runs this on its own cache and rows (the batch's rows are the
    shards' rows end to end, each shard's slot ids its own); params are replicated.
    """
    if mesh is not None:
        per_shard = functools.partial(_step, graphdef, options, None)
        return meshes.shard_program(
            per_shard, mesh, (meshes.P(), meshes.CACHE, meshes.P(meshes.DATA)),
            (meshes.CACHE, meshes.P(meshes.DATA), meshes.P(meshes.DATA)))(
                params, cache, batch)
    model = nnx.merge(graphdef, params)
    S, V = batch.draw.shape[0], model.config.vocab_size
    rows = jnp.arange(S)
    none = jnp.zeros((S, V), jnp.float32)

    def replay(cache):
        return model.replay(batch.replay_tokens, cache, batch.replay_slots, batch.replay_start,
                            batch.replay_n, options=options)

    cache = jax.lax.cond(jnp.any(batch.replay_n > 0), replay, lambda c: c, cache)

    def prefill(cache):
        cache, h = model.hidden(batch.prefill_tokens, cache, batch.prefill_slots,
                                batch.prefill_n, options=options)
        last = h[rows, jnp.clip(batch.prefill_n - 1, 0, h.shape[1] - 1)]
        return cache, model.logits(last)

    cache, prefill_logits = jax.lax.cond(jnp.any(batch.prefill_n > 0), prefill,
                                         lambda c: (c, none), cache)

    def decode(cache):
        cache, h = model.hidden(batch.decode_tokens, cache, batch.decode_slots, batch.decode_n,
                                options=options)
        return cache, model.logits(h[:, 0])

    cache, decode_logits = jax.lax.cond(jnp.any(batch.decode_n > 0), decode,
                                        lambda c: (c, none), cache)
    logits = jnp.where((batch.prefill_n > 0)[:, None], prefill_logits, decode_logits)
    nxt = sample(logits, row_keys(batch.key, batch.draw), batch.temperature, batch.top_k,
                 batch.top_p, batch.min_p)
    return cache, nxt, logits


_step_jit = programs.program("engine.step", _step, donate=("cache",),
                             static=("graphdef", "options", "mesh"))


def compiled_step_programs() -> int:
    """How many step programs the engines of this process have compiled (one per model
    structure, geometry and options: every step and every prompt length share it)."""
    return _step_jit.traces


# The fields of a Request that admission sets, sent by a shard's owner to the other processes.
_ADMITTED = ("slot", "shard", "length", "cached", "replay_at", "replay_end", "replayed",
             "restored_by", "snapshot_tier", "cached_from")


# --- the engine -----------------------------------------------------------------------------------


class Shard:
    """One data shard of an Engine: the cache on its device, its slot table and its prefix
    cache (listed pages, snapshots, host and disk tiers of its own).

    Attributes:
      index: the shard's place on the mesh (0 without one).
      cache: the shard's cache (slot and page ids local to it).
      table: its `SlotTable`.
      prefix_cache: its `PrefixCache`.
    """

    def __init__(self, index: int, cache: Cache, table: SlotTable):
        self.index, self.cache, self.table = index, cache, table
        self.prefix_cache: PrefixCache

    def __repr__(self) -> str:
        return f"Shard({self.index}, {len(self.table)} requests)"


class Engine(ModelCache):
    """Continuous batching with prefix sharing over one cache; see the module docstring.

    Args:
      model: the decoder (split once here: later changes to it are not seen; its weights
        are hashed once, into the prefix keys).
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
        from the scores its peers send (see `_admit`); every output comes back on every
        process.
    """

    def __init__(self, model: Decoder, geometry: CacheConfig, *, prefill_chunk: int = 128,
                 token_budget: int | None = None, snapshot_every_pages: int | None = None,
                 device_snapshots: int = 8, host_snapshots: int = 32,
                 host_pages: int | None = None, snapshot_dir: str | os.PathLike | None = None,
                 disk_snapshots: int | None = None, disk_bytes: int | None = prefix.DISK_BYTES,
                 seed: int = 0, keep_logits: bool = False, max_head_wait: int = 16,
                 options: Options | None = None, mesh: meshes.Mesh | None = None):
        self.mesh = None if mesh is None else meshes.check_mesh(mesh)
        super().__init__(model, geometry, options)
        P = geometry.page_tokens
        prefill_chunk = checks.integer("prefill_chunk", prefill_chunk, lo=1)
        if P % prefill_chunk:
            checks.fail("prefill_chunk", f"a divisor of page_tokens={P}", prefill_chunk)
        if token_budget is None:
            token_budget = geometry.max_slots * prefill_chunk
        self.token_budget = checks.integer("token_budget", token_budget, lo=1)
        if snapshot_every_pages is not None:
            snapshot_every_pages = checks.integer("snapshot_every_pages", snapshot_every_pages,
                                                  lo=1)
        if not isinstance(keep_logits, bool):
            checks.fail("keep_logits", "a bool", repr(keep_logits), TypeError)
        self.prefill_chunk = prefill_chunk
        self.keep_logits = keep_logits
        self.max_head_wait = checks.integer("max_head_wait", max_head_wait, lo=0)
        self._key = jax.random.PRNGKey(checks.integer("seed", seed))
        attn = model.config.attn_config
        self.replay_pages = pages_for(attn.num_layers * (attn.window - 1) + 1, P)
        self.fingerprint = prefix.fingerprint(
            repr(attn), f"page_tokens={P} entry={geometry.entry_dtype} "
            f"index={geometry.index_dtype} window={geometry.window_dtype} "
            f"tail={geometry.tail_dtype} hca_tail={geometry.hca_tail}",
            repr(model.config), repr(self.options), prefix.tree_digest(self.params))
        several = self.mesh is not None and self.mesh.size > 1
        for shard in self.shards:
            shard.prefix_cache = PrefixCache(
                shard, replay_pages=self.replay_pages, snapshot_every_pages=snapshot_every_pages,
                device_snapshots=device_snapshots, host_snapshots=host_snapshots,
                host_pages=geometry.num_pages if host_pages is None else host_pages,
                snapshot_dir=(os.path.join(snapshot_dir, f"shard-{shard.index}")
                              if several and snapshot_dir is not None else snapshot_dir),
                disk_snapshots=disk_snapshots, disk_bytes=disk_bytes)
        if self.mesh is not None:
            self._step_params = jax.device_put(self.params, meshes.replicated(self.mesh))
        self._requests: dict[int, Request] = {}
        self._queue: list[int] = []
        self._ids = itertools.count()
        self._finished: list[RequestOutput] = []  # outputs no step() has returned yet
        self._unreleased: list[Request] = []  # finished requests whose slot is still held
        self._broken: str | None = None  # what lost the cache
        self._closed = False
        self.stats = dict.fromkeys(
            ("requests", "hits", "prompt_tokens", "cached_tokens", "replayed_tokens",
             "recomputed_tokens"), 0)
        self._done = {"requests_finished": 0, "tokens_generated": 0, "ttft": [0.0, 0],
                      "tpot": [0.0, 0], "queue_time": [0.0, 0]}  # [sum, count]
        self._compile_s = 0.0  # seconds compiling during warmup() and steps

    # --- the shards -------------------------------------------------------------------------------

    def _init_pools(self, model: AttentionConfig, geometry: CacheConfig) -> None:
        if self.mesh is None:
            self.shards = [Shard(0, pools.init_cache(model, geometry),
                                 SlotTable(geometry.max_slots))]
        else:
            caches = meshes.split(meshes.init_cache(model, geometry, self.mesh), self.mesh)
            self.shards = [Shard(i, c, SlotTable(geometry.max_slots)) for i, c in caches.items()]
        self._shard = {s.index: s for s in self.shards}
        self._owners = ([0] if self.mesh is None else
                        [meshes.owner(self.mesh, i) for i in range(self.mesh.size)])

    @property
    def cache(self) -> Cache:
        """The cache; with a mesh, the global view of the shards' caches (`v4kv_jax.mesh`:
        slot s of shard i is row i * max_slots + s). Setting it replaces every shard's."""
        if self.mesh is None:
            return self.shards[0].cache
        return meshes.assemble({s.index: s.cache for s in self.shards}, self.mesh)

    @cache.setter
    def cache(self, cache: Cache) -> None:
        if self.mesh is None:
            self.shards[0].cache = cache
            return
        for i, c in meshes.split(cache, self.mesh).items():
            self._shard[i].cache = c

    def _only(self, what: str) -> Shard:
        if len(self.shards) != 1:
            raise AttributeError(f"Engine.{what}: the engine runs {len(self.shards)} shards, "
                                 f"each with its own; use engine.shards[i].{what}")
        return self.shards[0]

    @property
    def table(self) -> SlotTable:
        """The slot table (one shard only; else each shard's `table`)."""
        return self._only("table").table

    @property
    def prefix_cache(self) -> PrefixCache:
        """The prefix cache (one shard only; else each shard's `prefix_cache`)."""
        return self._only("prefix_cache").prefix_cache

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
        return self.shards[0].cache.geometry

    @property
    def slots(self) -> dict[int, int]:
        """request id -> its row in `cache` (shard index * max_slots + slot), for every
        running request (of every process's shards)."""
        return {r.id: self._row(r) for r in self._requests.values() if r.slot is not None}

    def shard_of(self, request_id: int) -> int | None:
        """The shard a request in flight runs on (None while it waits)."""
        return self._request(request_id).shard

    def _lost(self) -> bool:
        return any(pools.is_deleted(s.cache) for s in self.shards)

    # --- the disk tier and shutdown ---------------------------------------------------------------

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
            for request_id in list(self._requests):
                out.append(self.abort(request_id))
            if out:
                warnings.warn(f"Engine.close: requests {[o.request_id for o in out]} were in "
                              "flight; aborted", RuntimeWarning, stacklevel=2)
        out = self._finished + out
        self._finished = []
        self._closed = True
        return out

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # --- requests ---------------------------------------------------------------------------------

    def add_request(self, prompt_ids, max_new_tokens: int, temperature: float = 0.0,
                    eos_id: int | None = None, cache_salt: str | bytes | None = None, *,
                    top_k: int | None = 0, top_p: float = 1.0, min_p: float = 0.0,
                    seed: int | None = None, stop_token_ids: Sequence[int] = (),
                    stop: Sequence[Sequence[int]] = ()) -> int:
        """Queues a request; returns its id. It is admitted by a later `step()`.

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

        Raises:
          TypeError / ValueError naming the argument: a prompt longer than max_seq_len names
          `prompt_ids`, a prompt and output past it `max_new_tokens`, and a request needing
          more pages than the whole pool holds (it could never run) says so.
        """
        return self._queue_request(
            "prompt_ids", prompt_ids, max_new_tokens, temperature=temperature, eos_id=eos_id,
            cache_salt=cache_salt, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed,
            stop_token_ids=stop_token_ids, stop=stop)

    def _queue_request(self, name: str, prompt_ids, max_new_tokens: int, *, temperature,
                       eos_id, cache_salt, top_k, top_p, min_p, seed, stop_token_ids,
                       stop) -> int:
        """`add_request`, the prompt called `name` in its errors."""
        self._check_usable()
        arrival, compiled = time.perf_counter(), clock.compile_seconds()
        V = self.config.vocab_size
        prompt = check_prompt(name, prompt_ids, V)
        max_new_tokens = checks.integer("max_new_tokens", max_new_tokens, lo=1)
        sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p,
                                  min_p=min_p, seed=seed, eos_id=eos_id,
                                  stop_token_ids=stop_token_ids, stop=stop)
        sampling.check_vocab(V)
        namespace = prefix.salt_namespace(self.fingerprint, cache_salt)
        geo = self.geometry
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
        request_id = next(self._ids)
        key = (np.asarray(jax.random.fold_in(self._key, request_id)) if sampling.seed is None
               else stream_key(sampling.seed))
        self._requests[request_id] = Request(
            request_id, prompt, max_new_tokens, sampling, key, namespace, prompt.tolist(), need,
            arrival=arrival, compiled=compiled)
        self._queue.append(request_id)
        return request_id

    def abort(self, request_id: int) -> RequestOutput:
        """Ends a queued or running request now; returns what it generated ("aborted")."""
        self._check_usable()
        req = self._request(request_id)
        if req.slot is None:
            self._queue.remove(request_id)
        return self._finish(req, "aborted")

    def status(self, request_id: int) -> str:
        """The phase of a request in flight: "waiting" (queued), "replay", "prefill" or
        "decode"."""
        return self._request(request_id).phase()

    @property
    def in_flight(self) -> list[int]:
        """Ids of the queued and running requests."""
        return list(self._requests)

    def _request(self, request_id) -> Request:
        if isinstance(request_id, (bool, np.bool_)) or not isinstance(request_id, int):
            checks.fail("request_id", "an int returned by add_request", repr(request_id),
                        TypeError)
        if request_id not in self._requests:
            checks.fail("request_id", f"a request in flight ({list(self._requests)})",
                        request_id, KeyError)
        return self._requests[request_id]

    def generate(self, prompts: Sequence, max_new_tokens: int, *, temperature: float = 0.0,
                 eos_id: int | None = None, cache_salt: str | bytes | None = None,
                 top_k: int | None = 0, top_p: float = 1.0, min_p: float = 0.0,
                 seed: int | None = None, stop_token_ids: Sequence[int] = (),
                 stop: Sequence[Sequence[int]] = (), stream: bool = False
                 ) -> list[RequestOutput] | Iterator[list[StreamOutput]]:
        """Runs `prompts` to completion (steps shared with any request already in flight,
        whose outputs come back from the next `step()`); returns their outputs in order.

        The options are `add_request`'s, the same for every prompt (with a `seed`, every
        prompt draws from PRNGKey(seed), so equal prompts give equal tokens). Every prompt
        is checked and queued before this returns (all or nothing: a bad one, named
        `prompts[i]`, queues none).

        With `stream`, returns an iterator instead, whose every item is one step: a list of
        `StreamOutput`s, one for each of these prompts that drew tokens or finished in that
        step (request id, index in `prompts`, `new_tokens`, `finished`, `finish_reason` and
        the `RequestOutput` once finished). A prompt's streamed tokens, concatenated, are its
        output's tokens. Steps run as the iterator is consumed; closing it early aborts the
        prompts still in flight.
        """
        if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__len__"):
            checks.fail("prompts", "a sequence of token-id sequences", prompts, TypeError)
        if not len(prompts):
            checks.fail("prompts", "at least one prompt", "an empty sequence")
        if not isinstance(stream, bool):
            checks.fail("stream", "a bool", repr(stream), TypeError)
        options = dict(temperature=temperature, eos_id=eos_id, cache_salt=cache_salt,
                       top_k=top_k, top_p=top_p, min_p=min_p, seed=seed,
                       stop_token_ids=stop_token_ids, stop=stop)
        ids = []
        try:
            for i, p in enumerate(prompts):
                ids.append(self._queue_request(f"prompts[{i}]", p, max_new_tokens, **options))
        except BaseException:
            for r in ids:  # all or nothing: the prompts queued before the bad one leave
                self.abort(r)
            raise
        if stream:
            return self._stream(ids)
        done: dict[int, RequestOutput] = {}
        while len(done) < len(ids):
            done.update((o.request_id, o) for o in self._step_for(ids))
        return [done[r] for r in ids]

    def _step_for(self, ids: list[int]) -> list[RequestOutput]:
        """Runs a step; takes the outputs of `ids` that finished (the others' stay for
        `step()`)."""
        self._step()
        mine = [o for o in self._finished if o.request_id in ids]
        self._finished = [o for o in self._finished if o.request_id not in ids]
        return mine

    def _stream(self, ids: list[int]) -> Iterator[list[StreamOutput]]:
        sent = dict.fromkeys(ids, 0)
        index = {r: i for i, r in enumerate(ids)}
        try:
            while sent:
                finished = {o.request_id: o for o in self._step_for(list(sent))}
                events = []
                for r in list(sent):
                    out = finished.get(r)
                    if out is None and r not in self._requests:  # aborted by the caller
                        del sent[r]
                        continue
                    tokens = out.tokens if out is not None else self._requests[r].generated
                    new = list(tokens[sent[r]:])
                    sent[r] = len(tokens)
                    if out is not None:
                        del sent[r]
                    if new or out is not None:
                        events.append(StreamOutput(
                            index=index[r], request_id=r, new_tokens=new,
                            finished=out is not None,
                            finish_reason=None if out is None else out.finish_reason,
                            output=out))
                yield events
        finally:
            if sent and self._broken is None and not self._closed:
                for r in sent:  # closed early: what is still in flight leaves
                    if r in self._requests:
                        self.abort(r)

    # --- the step ---------------------------------------------------------------------------------

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
        self._step()
        out, self._finished = self._finished, []
        return out

    def _step(self) -> None:
        self._guarded(self._run_step)

    def _guarded(self, run) -> None:
        """Runs `run` (which may run device programs on the cache), counting the seconds
        compiled meanwhile; a failure that lost the cache breaks the engine (`step`)."""
        self._check_usable()
        compiled = clock.compile_seconds()
        try:
            run()
        except BaseException as e:
            if self._lost():
                self._broken = f"{type(e).__name__}: {e}"
                raise self._error() from e
            raise
        finally:
            self._compile_s += clock.compile_seconds() - compiled

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
            jax.random.fold_in(self._key, 0)  # add_request's stream of a request
            stream_key(0)  # and of a request with a seed
            self._commit_caches(self._run_program(self._batch([])[0])[0])
            for shard in self.shards:
                shard.cache = shard.table.warmup(shard.cache)
                shard.prefix_cache.warmup()

        self._guarded(run)
        return time.perf_counter() - start

    def _check_usable(self) -> None:
        if self._closed:
            raise RuntimeError("Engine: closed (close() was called); make a new Engine")
        if self._broken is not None:
            raise self._error()

    def _error(self) -> EngineError:
        finished, self._finished = self._finished, []
        return EngineError(self._broken, finished, list(self._requests))

    def _admit_queued(self) -> None:
        """Admits queued requests in order of arrival. The first that does not fit (the
        head) lets later ones that fit pass it while it has waited fewer than
        `max_head_wait` steps; then nothing passes it. Every process takes the same
        decisions (from the same requests and the exchanged outcomes of `_admit`)."""
        head, now = None, clock.serving_time()
        for request_id in list(self._queue):
            if sum(r.slot is not None for r in self._requests.values()) >= (
                    self.geometry.max_slots * len(self._owners)):
                break  # no free slot on any shard
            req = self._requests[request_id]
            if self._admit(req):
                req.admitted_at = now
                self._queue.remove(request_id)
            elif head is None:
                head = req
                if head.head_wait >= self.max_head_wait:
                    break
        if head is not None:
            head.head_wait += 1

    def _run_step(self) -> None:
        self._release_finished()
        self._admit_queued()
        running = [r for r in self._requests.values() if r.slot is not None]
        if not running:
            if self._queue:  # cannot happen: an empty pool holds any queued request
                raise RuntimeError(f"requests {self._queue} cannot be admitted into an idle "
                                   "engine")
            return
        batch, work = self._batch(running)
        caches, nxt, logits = self._run_program(batch)
        tables, flag_error, flags = {}, None, {}
        for i, cache in caches.items():
            tables[i] = np.asarray(pools.page_table(cache))
            mine = [r for r in running if r.shard == i]
            error = self._shard[i].table.flag_error(cache, [r.id for r in mine],
                                                    {r.id: r.length + 1 for r in mine})
            if error is not None:
                flag_error = flag_error or error
                flags.update(error.flags)
        self._commit_caches(caches)
        if self.mesh is not None and meshes.any_process(bool(flags)):  # every process's
            flags = {k: v for every in meshes.exchange(flags) for k, v in every.items()}
            flag_error = flag_error or SlotFlaggedError(flags)
        flagged = set(flags)
        now = clock.serving_time()
        # Commit: every request's progress, as the device has it. Nothing here can fail.
        finished: list[Request] = []
        advanced = []
        for req in running:
            if req.id not in work or req.id in flagged:
                continue
            phase, n = work[req.id]
            if phase == "replay":
                req.replay_at += n
                continue
            req.length += n
            advanced.append((req, phase))
            if phase == "prefill" and req.length < len(req.prompt):
                continue
            row = self._row(req)
            token = int(nxt[row])
            req.generated.append(token)
            req.tokens.append(token)
            if req.first_token_at is None:
                req.first_token_at = now
            if logits is not None:
                req.logits.append(logits[row].copy())
            reason = req.sampling.finish(req.generated)
            if reason is not None:
                finished.append((req, reason))
            elif len(req.generated) == req.max_new_tokens:
                finished.append((req, "length"))
        self._finished += [self._output(req, reason) for req, reason in finished]
        # Prefix-cache work; finished slots are released whatever happens to it.
        self._unreleased += [req for req, _ in finished]
        try:
            for req, phase in advanced:
                if req.shard in self._shard:  # the shard's owner lists and snapshots
                    self._shard[req.shard].prefix_cache.record(req, tables[req.shard],
                                                               prompt_end=phase == "prefill")
        except BaseException:
            if not self._lost():
                try:
                    self._release_finished()
                except Exception:  # noqa: BLE001 - kept in _unreleased, tried next step
                    pass
            raise
        self._release_finished()
        if flag_error is not None:  # a bug of admission (it reserves every page needed)
            self._broken = f"{type(flag_error).__name__}: {flag_error}"
            raise flag_error

    def _run_program(self, batch: StepBatch
                     ) -> tuple[dict[int, Cache], np.ndarray, np.ndarray | None]:
        """Runs the step program on `batch` (host arrays): (shard index -> its new cache, for
        this process's shards; next tokens i32[S]; logits f32[S, V] with `keep_logits`, else
        None), fetched to the host. A device failure surfaces here, before any host state
        changes (the old cache was taken over: see `_step`)."""
        if self.mesh is None:
            cache, nxt, logits = _step_jit(self.graphdef, self.options, None, self.params,
                                           self.cache, jax.tree.map(jnp.asarray, batch))
            caches = {0: cache}
        else:
            rows = meshes.by_shard(self.mesh)
            cache, nxt, logits = _step_jit(self.graphdef, self.options, self.mesh,
                                           self._step_params, self.cache,
                                           jax.tree.map(lambda x: meshes.put(x, rows), batch))
            caches = meshes.split(cache, self.mesh)
        return caches, meshes.fetch(nxt), meshes.fetch(logits) if self.keep_logits else None

    def _commit_caches(self, caches: dict[int, Cache]) -> None:
        for i, cache in caches.items():
            self._shard[i].cache = cache

    def _row(self, req: Request) -> int:
        """The request's row in a step's batch (its slot's row in `cache`)."""
        return req.shard * self.geometry.max_slots + req.slot

    def _batch(self, running: list[Request]) -> tuple[StepBatch, dict[int, tuple[str, int]]]:
        """The step's rows (host arrays, every shard's), and request id -> (phase, tokens)
        for each request with work. Row `_row(req)` is the request's; its slot ids are local
        to its shard. Every process computes the same batch from the same requests."""
        S, C = self.geometry.max_slots * len(self._owners), self.prefill_chunk
        rows = {name: np.full((S,) + shape, fill, np.int32) for name, shape, fill in (
            ("replay_tokens", (C,), 0), ("replay_slots", (), -1), ("replay_start", (), 0),
            ("replay_n", (), 0), ("prefill_tokens", (C,), 0), ("prefill_slots", (), -1),
            ("prefill_n", (), 0), ("decode_tokens", (1,), 0), ("decode_slots", (), -1),
            ("decode_n", (), 0), ("draw", (), 0), ("top_k", (), 0))}
        keys = np.zeros((S, 2), np.uint32)
        reals = {name: np.full((S,), fill, np.float32) for name, fill in (
            ("temperature", 0.0), ("top_p", 1.0), ("min_p", 0.0))}
        budget = dict.fromkeys(range(len(self._owners)), self.token_budget)  # per shard
        work = {}
        for req in running:
            s, phase = self._row(req), req.phase()
            keys[s], rows["draw"][s] = req.key, len(req.generated)
            rows["top_k"][s] = req.sampling.top_k
            for name in reals:
                reals[name][s] = getattr(req.sampling, name)
            if phase == "decode":
                rows["decode_slots"][s], rows["decode_n"][s] = req.slot, 1
                rows["decode_tokens"][s, 0] = req.tokens[req.length]
                work[req.id] = (phase, 1)
                continue
            at, end = ((req.replay_at, req.replay_end) if phase == "replay"
                       else (req.length, len(req.prompt)))
            n = min(C - at % C, end - at, budget[req.shard])
            if n <= 0:
                continue
            budget[req.shard] -= n
            rows[f"{phase}_slots"][s], rows[f"{phase}_n"][s] = req.slot, n
            rows[f"{phase}_tokens"][s, :n] = req.tokens[at:at + n]
            if phase == "replay":
                rows["replay_start"][s] = at
            work[req.id] = (phase, n)
        return StepBatch(**rows, **reals, key=keys), work

    def _release_finished(self) -> None:
        """Releases the slots of finished requests; one that raises stays listed (and is
        tried again at the next step) while the others go on."""
        failed, error = [], None
        for req in self._unreleased:
            try:
                self._release(req)
            except Exception as e:  # noqa: BLE001 - kept, re-raised below
                failed.append(req)
                error = error or e
        self._unreleased = failed
        if error is not None:
            raise error

    def _release(self, req: Request) -> None:
        """Gives a request's slot (and the pages only it holds) back."""
        if req.slot is not None:
            if req.shard in self._shard:  # else another process's shard: its owner releases
                shard = self._shard[req.shard]
                shard.cache = shard.table.release(shard.cache, req.id)
            req.slot = req.shard = None

    def _finish(self, req: Request, reason: str) -> RequestOutput:
        out = self._output(req, reason)
        self._release(req)
        return out

    def _output(self, req: Request, reason: str) -> RequestOutput:
        """The request's output; it leaves the requests in flight (its slot is not released
        here)."""
        self._requests.pop(req.id, None)
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
        done = self._done
        done["requests_finished"] += 1
        done["tokens_generated"] += n
        for name in ("ttft", "tpot", "queue_time"):
            value = getattr(metrics, name)
            if value is not None:
                done[name][0] += value
                done[name][1] += 1
        return RequestOutput(
            request_id=req.id, prompt_ids=req.prompt.tolist(), tokens=list(req.generated),
            finish_reason=reason, cached_tokens=req.cached, replayed_tokens=req.replayed,
            restored_by=req.restored_by, snapshot_tier=req.snapshot_tier,
            cached_from=dict(req.cached_from),
            logits=np.stack(req.logits) if self.keep_logits and req.logits else (
                np.zeros((0, self.config.vocab_size), np.float32) if self.keep_logits
                else None), metrics=metrics)

    def metrics(self) -> dict[str, float | int | None]:
        """Engine-wide serving metrics (host times, seconds) over every request that has
        finished (aborted ones included): requests_finished, tokens_generated, and the means
        mean_ttft, mean_tpot, mean_queue_time of the requests that have one (None before
        any), which leave out the seconds spent compiling (see `RequestMetrics`);
        compile_s, the seconds this process spent compiling device programs during this
        engine's `warmup` and steps (a first step without `warmup` compiles the step
        program: on a GPU, seconds to tens of seconds); with the prefix cache's prompt-token
        counts of `memory_report().stats`."""
        done = self._done
        return {"requests_finished": done["requests_finished"],
                "tokens_generated": done["tokens_generated"],
                **{f"mean_{k}": done[k][0] / done[k][1] if done[k][1] else None
                   for k in ("ttft", "tpot", "queue_time")},
                "compile_s": self._compile_s,
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
        for s in self.shards:
            s.prefix_cache.clear(disk=disk, running=[
                r.slot for r in self._requests.values()
                if r.slot is not None and r.shard == s.index])

    # --- admission --------------------------------------------------------------------------------

    def _admit(self, req: Request) -> bool:
        """Admits `req` into a free slot with its prefix hit, if a shard's pool can hold it
        (after evicting what it needs); False (nothing changed) otherwise.

        Placement: the shards with a free slot, by the longest prefix of the prompt they hold
        (on any tier), then by the fewest pages promised to their running requests, then by
        index; the first that can hold the request takes it. With several processes each
        scores and tries its own shards and every process takes the same decision from the
        exchanged results (`mesh.exchange`): the owner of the shard that admits the request
        sends its slot and hit, which the others record."""
        S = self.geometry.max_slots
        digests = self.shards[0].prefix_cache.prompt_digests(req.prompt, req.namespace)
        running = [r for r in self._requests.values() if r.slot is not None]

        def order(shard: Shard) -> tuple:
            mine = [r for r in running if r.shard == shard.index]
            return (-shard.prefix_cache.hit_pages(digests), sum(r.total_pages for r in mine),
                    len(mine), shard.index)

        scores = [order(s) for s in self.shards if len(s.table) < S]
        if len(self._owners) > 1:
            scores = [key for keys in meshes.exchange(scores) for key in keys]
        for key in sorted(scores):
            index = key[-1]
            outcome, error = (self._try_shard(self._shard[index], req, digests, running)
                              if index in self._shard else (None, None))
            if len(self._owners) > 1:
                outcome = meshes.exchange(outcome)[self._owners[index]]
            if outcome is None:
                continue  # the shard cannot hold it now: the next one
            if isinstance(outcome, str):
                if error is not None:
                    raise error
                raise RuntimeError(f"Engine: admitting request {req.id} on shard {index} "
                                   f"failed in process {self._owners[index]}: {outcome}")
            if index not in self._shard:
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
                self._release(req)
            req.slot = req.shard = None
            req.length = req.cached = req.replay_at = req.replay_end = req.replayed = 0
            req.digests, req.restored_by, req.snapshot_tier = [], "none", None
            req.cached_from = {}
            return f"{type(e).__name__}: {e}", e
        return {name: getattr(req, name) for name in _ADMITTED}, None

    # --- reports ----------------------------------------------------------------------------------

    def memory_report(self) -> EngineReport:
        """The memory report; with several shards the totals, and each shard's report in
        `shards` (its own pages, tiers and prefix-cache counters). With several processes
        every process must call it (the shards' reports are exchanged)."""
        reports = [self._shard_report(s) for s in self.shards]
        if self.mesh is not None:
            reports = [r for every in meshes.exchange(reports) for r in every]
        if len(reports) == 1:
            return reports[0]
        first = reports[0]

        def tiers(field):
            return {t: tuple(sum(getattr(r, field)[t][k] for r in reports) for k in (0, 1))
                    for t in getattr(first, field)}

        dirs = [r.snapshot_dir for r in reports if r.snapshot_dir]
        return dataclasses.replace(
            first, cache=pools.total_report([r.cache for r in reports]),
            **{f: sum(getattr(r, f) for r in reports) for f in (
                "pages_in_requests", "pages_shared", "pages_indexed", "pages_cached_only")},
            snapshots=tiers("snapshots"), cold_pages=tiers("cold_pages"),
            stats={k: (v if k in self.stats else sum(r.stats[k] for r in reports))
                   for k, v in first.stats.items()},
            snapshot_dir="; ".join(f"shard {r_i}: {d}" for r_i, d in enumerate(dirs)) or None,
            shards=tuple(reports))

    def _shard_report(self, shard: Shard) -> EngineReport:
        table = np.asarray(pools.page_table(shard.cache))
        holders = np.bincount(table[table >= 0], minlength=self.geometry.num_pages)
        pc = shard.prefix_cache
        listed = set(pc.index.pages().values())
        disk, page_disk = pc.snapshots.disk, pc.cold.disk
        return EngineReport(
            cache=pools.memory_report(shard.cache),
            pages_in_requests=int(np.sum(holders > 0)),
            pages_shared=int(np.sum(holders > 1)),
            pages_indexed=len(listed),
            pages_cached_only=sum(1 for p in listed if holders[p] == 0),
            snapshots={t: (pc.snapshots.count(t), pc.snapshots.nbytes(t)) for t in prefix.TIERS},
            cold_pages={t: (pc.cold.count(t), pc.cold.nbytes(t)) for t in page_tiers.TIERS},
            stats={**self.stats, **pc.stats, **pc.cold.stats,
                   "snapshots_dropped": pc.snapshots.dropped,
                   "disk_errors": 0 if disk is None else disk.errors + page_disk.errors},
            snapshot_dir=None if disk is None else (
                f"{disk.describe()}; page files: {len(page_disk)}, {page_disk.nbytes:,} B, "
                f"{page_disk.errors} filesystem errors caught"),
        )

__all__ = ["FINISH_REASONS", "RESTORES", "Completion", "Engine", "EngineError", "EngineReport",
           "RequestMetrics", "RequestOutput", "SamplingParams", "Shard", "StepBatch",
           "StreamOutput", "compiled_step_programs"]
