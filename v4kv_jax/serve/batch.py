"""The Engine's step: its batch (`StepBatch`), its one program (`_step`: replay, prefill and
decode rows, then sampling) and `StepProgram`, which builds a step's batch from the running
requests, runs the program and applies its tokens to the requests.

A batch has one row per slot of every shard, in every phase (slot id -1 where a slot sits the
phase out; a phase with no row is skipped by `lax.cond`), so every step and every prompt
length runs the same compiled program:

  replay   state-only rows (the model's `replay`, e.g. `Decoder.replay`): rebuild a hit's
           State before its boundary
  prefill  chunk rows of `prefill_chunk` tokens, within `token_budget` tokens a step and
           shard (replay rows included); a chunk never crosses a multiple of `prefill_chunk`,
           so every page boundary is the end of a chunk
  decode   one token of every request that has finished its prompt

The penalties (`sampling.penalize`) read each row's counts of generated tokens and its
prompt's tokens from two arrays the `StepProgram` keeps on the device, i32[S, V] and
bool[S, V] (S: rows of every shard): `_penalty_row` sets a request's row from its prompt
when it first runs with a penalty, and every step adds the tokens it draws.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from v4kv_jax import checks, pools, programs
from v4kv_jax import mesh as meshes
from v4kv_jax.config import CacheConfig, Options
from v4kv_jax.pools import Cache
from v4kv_jax.serve import clock, protocol
from v4kv_jax.serve.manager import PoolExhaustedError, SlotFlaggedError
from v4kv_jax.serve.request import Request
from v4kv_jax.serve.sampling import (
    no_logprobs,
    penalize,
    penalizes,
    row_keys,
    sample,
    token_logprobs,
)
from v4kv_jax.serve.shards import Shards


@struct.dataclass
class StepBatch:
    """The rows of one step, one per slot (slot id -1 where the slot sits the phase out).

    replay_*: state-only rows, tokens i32[S, C] of positions replay_start ...; prefill_*:
    chunk rows i32[S, C]; decode_*: i32[S, 1]; each with slot ids i32[S] and counts i32[S].
    key: u32[S, 2] each slot's sampling stream, draw: i32[S] the index of the token it draws
    (its key is fold_in(key, draw)), temperature, top_k, top_p, min_p: f32/i32/f32/f32[S] its
    options (`v4kv_jax.serve.sampling`), repetition, presence, frequency: f32[S] its
    penalties, drawing: i32[S] 1 where the row draws a token in this step, logprobs: i32[S]
    1 where its request asks for log-probabilities.
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
    repetition: jax.Array
    presence: jax.Array
    frequency: jax.Array
    drawing: jax.Array
    logprobs: jax.Array


def _step(graphdef, options: Options, mesh, params, cache: Cache, batch: StepBatch,
          counts: jax.Array, in_prompt: jax.Array):
    """(cache, next i32[S], logits f32[S, V], counts, chosen f32[S], top_ids i32[S, K],
    top_logprobs f32[S, K]): replay, prefill and decode rows in that order; row s's logits
    are those of its prefill chunk's last token or of its decode token, its token drawn by
    `sampling.sample` with its key and options from the logits with its penalties
    (`counts`, i32[S, V], and `in_prompt`, bool[S, V]; the drawn tokens are added to
    `counts`), and the log-probabilities of the logits (`sampling.token_logprobs`; zeros in a
    step where no row asks for them). A step whose rows have no penalty and ask for no
    log-probabilities skips both (a branch taken at run time: one program serves all).

    With a `mesh`, every shard runs this on its own cache and rows (the batch's rows are the
    shards' rows end to end, each shard's slot ids its own); params are replicated.
    """
    if mesh is not None:
        per_shard = functools.partial(_step, graphdef, options, None)
        rows = meshes.P(meshes.DATA)
        return meshes.shard_program(
            per_shard, mesh, (meshes.P(), meshes.CACHE, rows, rows, rows),
            (meshes.CACHE,) + (rows,) * 6)(params, cache, batch, counts, in_prompt)
    model = protocol.merge(graphdef, params)
    S, V = batch.draw.shape[0], model.vocab_size
    rows = jnp.arange(S)
    none = jnp.zeros((S, V), jnp.float32)

    def replay(cache):
        return protocol.replay(model, batch.replay_tokens, cache, batch.replay_slots,
                               batch.replay_start, batch.replay_n, options)

    cache = jax.lax.cond(jnp.any(batch.replay_n > 0), replay, lambda c: c, cache)

    def prefill(cache):
        cache, h = protocol.chunk(model, batch.prefill_tokens, cache, batch.prefill_slots,
                                  batch.prefill_n, options)
        last = h[rows, jnp.clip(batch.prefill_n - 1, 0, h.shape[1] - 1)]
        return cache, protocol.head(model, last)

    cache, prefill_logits = jax.lax.cond(jnp.any(batch.prefill_n > 0), prefill,
                                         lambda c: (c, none), cache)

    def decode(cache):
        cache, h = protocol.chunk(model, batch.decode_tokens, cache, batch.decode_slots,
                                  batch.decode_n, options)
        return cache, protocol.head(model, h[:, 0])

    cache, decode_logits = jax.lax.cond(jnp.any(batch.decode_n > 0), decode,
                                        lambda c: (c, none), cache)
    logits = jnp.where((batch.prefill_n > 0)[:, None], prefill_logits, decode_logits)
    penalized = jax.lax.cond(
        jnp.any(penalizes(batch.repetition, batch.presence, batch.frequency)),
        lambda x: penalize(x, counts, in_prompt, batch.repetition, batch.presence,
                           batch.frequency),
        lambda x: x, logits)
    nxt = sample(penalized, row_keys(batch.key, batch.draw), batch.temperature, batch.top_k,
                 batch.top_p, batch.min_p)
    counts = counts.at[rows, jnp.where(batch.drawing > 0, nxt, V)].add(1, mode="drop")
    scores = jax.lax.cond(jnp.any(batch.logprobs > 0), token_logprobs, no_logprobs, logits,
                          nxt)
    return (cache, nxt, logits, counts, *scores)


_step_jit = programs.program("engine.step", _step, donate=("cache", "counts"),
                             static=("graphdef", "options", "mesh"))


def _penalty_row(counts: jax.Array, in_prompt: jax.Array, row: jax.Array, prompt: jax.Array
                 ) -> tuple[jax.Array, jax.Array]:
    """Row `row` of the penalty arrays for a new request: no token generated, its prompt's
    tokens (`prompt`: i32[max_seq_len], -1 pads); a row out of range changes nothing."""
    V = counts.shape[-1]
    ids = jnp.where(prompt >= 0, prompt, V)
    mask = jnp.zeros((V,), bool).at[ids].set(True, mode="drop")
    return (counts.at[row].set(0, mode="drop"), in_prompt.at[row].set(mask, mode="drop"))


_penalty_row_jit = programs.program("engine.penalty_row", _penalty_row,
                                    donate=("counts", "in_prompt"))


def compiled_step_programs() -> int:
    """How many step programs the engines of this process have compiled (one per model
    structure, geometry and options: every step and every prompt length share it)."""
    return _step_jit.traces


class StepProgram:
    """An Engine's step program and its fixed settings (checked here, errors naming them).

    Args:
      graphdef, params: the split model (params replicated over `mesh` here).
      options: how the ops run.
      mesh: the engine's mesh (None: one device).
      geometry: the geometry of a shard.
      shards: shards of the whole mesh (every process's).
      prefill_chunk: tokens per prefill row and step; divides page_tokens.
      token_budget: replay + prefill tokens per step and shard (None: max_slots *
        prefill_chunk).
      keep_logits: fetch every row's logits.
    """

    def __init__(self, graphdef, params, options: Options, mesh: meshes.Mesh | None,
                 geometry: CacheConfig, *, shards: int, prefill_chunk: int,
                 token_budget: int | None, keep_logits: bool):
        P = geometry.page_tokens
        prefill_chunk = checks.integer("prefill_chunk", prefill_chunk, lo=1)
        if P % prefill_chunk:
            checks.fail("prefill_chunk", f"a divisor of page_tokens={P}", prefill_chunk)
        if token_budget is None:
            token_budget = geometry.max_slots * prefill_chunk
        self.token_budget = checks.integer("token_budget", token_budget, lo=1)
        if not isinstance(keep_logits, bool):
            checks.fail("keep_logits", "a bool", repr(keep_logits), TypeError)
        self.prefill_chunk, self.keep_logits = prefill_chunk, keep_logits
        self.graphdef, self.options, self.mesh = graphdef, options, mesh
        self.params = params if mesh is None else jax.device_put(params,
                                                                 meshes.replicated(mesh))
        self.max_slots, self.shards = geometry.max_slots, shards
        self.max_seq_len = geometry.max_seq_len
        self.vocab_size = protocol.merge(graphdef, params).vocab_size
        S, V = self.max_slots * shards, self.vocab_size
        if mesh is not None:
            put = functools.partial(meshes.put, sharding=meshes.by_shard(mesh))
        elif geometry.c4_tier == "host":
            # Placed as the cache is (committed throughout: `init_cache`), which the step
            # returns them as: else its second call compiles the program again.
            put = functools.partial(jax.device_put, device=jax.memory.Space.Device)
        else:
            put = jnp.asarray
        self.counts, self.in_prompt = put(np.zeros((S, V), np.int32)), put(np.zeros((S, V), bool))

    def row(self, req: Request) -> int:
        """A running request's row in the batch (shard index * max_slots + slot)."""
        return req.shard * self.max_slots + req.slot

    def batch(self, running: list[Request]) -> tuple[StepBatch, dict[int, tuple[str, int]]]:
        """The step's rows (host arrays, every shard's), and request id -> (phase, tokens)
        for each request with work. Row `row(req)` is the request's; its slot ids are local
        to its shard. Every process computes the same batch from the same requests."""
        S, C = self.max_slots * self.shards, self.prefill_chunk
        rows = {name: np.full((S,) + shape, fill, np.int32) for name, shape, fill in (
            ("replay_tokens", (C,), 0), ("replay_slots", (), -1), ("replay_start", (), 0),
            ("replay_n", (), 0), ("prefill_tokens", (C,), 0), ("prefill_slots", (), -1),
            ("prefill_n", (), 0), ("decode_tokens", (1,), 0), ("decode_slots", (), -1),
            ("decode_n", (), 0), ("draw", (), 0), ("top_k", (), 0))}
        keys = np.zeros((S, 2), np.uint32)
        rows["drawing"] = np.zeros((S,), np.int32)
        rows["logprobs"] = np.zeros((S,), np.int32)
        reals = {name: np.full((S,), fill, np.float32) for name, fill in (
            ("temperature", 0.0), ("top_p", 1.0), ("min_p", 0.0), ("repetition", 1.0),
            ("presence", 0.0), ("frequency", 0.0))}
        budget = dict.fromkeys(range(self.shards), self.token_budget)  # per shard
        work = {}
        for req in running:
            s, phase = self.row(req), req.phase()
            keys[s], rows["draw"][s] = req.key, len(req.generated)
            rows["top_k"][s] = req.sampling.top_k
            rows["logprobs"][s] = int(req.sampling.logprobs is not None)
            for name, field in _REALS.items():
                reals[name][s] = getattr(req.sampling, field)
            if phase == "decode":
                rows["drawing"][s] = 1
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
            else:
                rows["drawing"][s] = int(at + n == end)
            work[req.id] = (phase, n)
        return StepBatch(**rows, **reals, key=keys), work

    def set_penalty_rows(self, running: list[Request]) -> None:
        """Sets the penalty row of each running request with a penalty that has none yet
        (its prompt's tokens, no token generated)."""
        for req in running:
            if req.sampling.penalizes and not req.penalty_row:
                self._set_penalty_row(self.row(req), req.prompt)
                req.penalty_row = True

    def _set_penalty_row(self, row: int, prompt: np.ndarray) -> None:
        padded = np.full((self.max_seq_len,), -1, np.int32)
        padded[:len(prompt)] = prompt
        self.counts, self.in_prompt = _penalty_row_jit(self.counts, self.in_prompt,
                                                       np.int32(row), padded)

    def run(self, cache: Cache, batch: StepBatch
            ) -> tuple[dict[int, Cache], np.ndarray, np.ndarray | None, tuple[np.ndarray, ...]]:
        """Runs the program on `cache` (donated; the global cache with a mesh) and `batch`
        (host arrays): (shard index -> its new cache, for this process's shards; next tokens
        i32[S]; logits f32[S, V] with `keep_logits`, else None; the log-probabilities of the
        tokens f32[S], the top ids i32[S, K] and theirs f32[S, K]), fetched to the host. A
        device failure surfaces here, before any host state changes."""
        if self.mesh is None:
            put = jnp.asarray
        else:
            rows = meshes.by_shard(self.mesh)
            put = functools.partial(meshes.put, sharding=rows)
        cache, nxt, logits, self.counts, *scores = _step_jit(
            self.graphdef, self.options, self.mesh, self.params, cache,
            jax.tree.map(put, batch), self.counts, self.in_prompt)
        caches = {0: cache} if self.mesh is None else meshes.split(cache, self.mesh)
        return (caches, meshes.fetch(nxt), meshes.fetch(logits) if self.keep_logits else None,
                tuple(meshes.fetch(x) for x in scores))

    def step(self, shards: Shards, running: list[Request]) -> tuple[
            list[tuple[Request, str]], list[tuple[Request, str]], dict[int, np.ndarray],
            PoolExhaustedError | SlotFlaggedError | None]:
        """Runs one step of the `running` requests on `shards` and records their progress
        (`advance`): (finished requests with their reason, requests that appended tokens
        with their phase, shard index -> its page table after the step, the error of the
        slots the step flagged or None)."""
        batch, work = self.batch(running)
        self.set_penalty_rows(running)
        caches, nxt, logits, scores = self.run(shards.cache, batch)
        tables = {i: np.asarray(pools.page_table(cache)) for i, cache in caches.items()}
        flags, flag_error = shards.commit(caches, running)
        finished, advanced = self.advance(running, work, set(flags), nxt, logits,
                                          clock.serving_time(), scores)
        return finished, advanced, tables, flag_error

    def warmup(self, shards: Shards) -> None:
        """Runs the program and the setting of a penalty row once on no rows (compiling
        them; the caches and the penalty arrays do not change)."""
        shards.set_caches(self.run(shards.cache, self.batch([])[0])[0])
        self._set_penalty_row(self.counts.shape[0], np.zeros((0,), np.int32))

    def advance(self, running: list[Request], work: dict[int, tuple[str, int]],
                flagged: set[int], nxt: np.ndarray, logits: np.ndarray | None, now: float,
                scores: tuple[np.ndarray, ...]
                ) -> tuple[list[tuple[Request, str]], list[tuple[Request, str]]]:
        """Records every request's progress in the step, as the device has it (nothing here
        can fail): replayed and appended tokens, the drawn token of each row that ended its
        prompt or decoded (`now`: the serving clock, for a first token) with its
        log-probabilities (`scores`: those `run` returns) when the request asks for them. A
        `flagged` request appended nothing. Returns (finished requests with their finish
        reason, requests that appended tokens with the phase they ran)."""
        chosen, top_ids, top_logprobs = scores
        finished, advanced = [], []
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
            row = self.row(req)
            token = int(nxt[row])
            req.generated.append(token)
            req.tokens.append(token)
            if req.first_token_at is None:
                req.first_token_at = now
            if logits is not None:
                req.logits.append(logits[row].copy())
            k = req.sampling.logprobs
            if k is not None:
                req.logprobs.append(float(chosen[row]))
                req.top_logprobs.append(list(zip(top_ids[row, :k].tolist(),
                                                 top_logprobs[row, :k].tolist(), strict=True)))
            reason = req.sampling.finish(req.generated)
            if reason is not None:
                finished.append((req, reason))
            elif len(req.generated) == req.max_new_tokens:
                finished.append((req, "length"))
        return finished, advanced


# The batch's penalty fields and the `SamplingParams` fields they hold.
_REALS = {"temperature": "temperature", "top_p": "top_p", "min_p": "min_p",
          "repetition": "repetition_penalty", "presence": "presence_penalty",
          "frequency": "frequency_penalty"}

__all__ = ["StepBatch", "StepProgram", "compiled_step_programs"]
