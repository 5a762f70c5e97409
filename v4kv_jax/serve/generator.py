"""Jitted generation over a batch of prompts of different lengths: chunked prefill, then decode.

The whole loop is ONE jitted function: a `fori_loop` over prefill chunks (its trip count is
the longest prompt, in chunks, a runtime value) followed by a `while_loop` of decode steps
(it stops early once every row has drawn `eos_id` or a stop token id). Shapes depend only on
the static settings (batch = `max_slots`, prompt buffer `max_prompt_len`, `prefill_chunk`,
`max_new_tokens`), so every prompt length and every batch of up to `max_slots` prompts runs
the same compiled program.

The Generator is a `ModelCache`, the host lifecycle (`v4kv_jax.serve.manager.SlotCache`) of a
model, as the Engine is: before each batch it releases the previous batch's requests and
admits the prompts (request b = prompt b); the program runs on those slots (rows without a
prompt are padding rows, slot id -1), and after it the table turns any slot flag into the
manager's exception. `v4kv_jax.serve.sampling.sample` is the one sampling rule of both, with
the same per-request options (`SamplingParams`), the same streams for a `seed` and the same
length rule (prompt + max_new_tokens - 1 <= max_seq_len).

The model is split once (`nnx.split`); its params and the cache are arguments of the jitted
function, the cache donated, so the step updates the pools in place.

    gen = Generator(model, geometry, max_prompt_len=256, max_new_tokens=32)
    out = gen.generate([[5, 7, 1], [2, 2, 9, 4, 4]], temperature=0.0)   # greedy
    out.tokens    # i32[B, max_new_tokens], -1 after a row's last token
"""

from __future__ import annotations

import dataclasses
import functools
import time
import weakref
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from v4kv_jax import checks, pools, programs
from v4kv_jax import mesh as meshes
from v4kv_jax.config import AttentionConfig, CacheConfig, Options, options_or_default
from v4kv_jax.nn.model import check_chunk
from v4kv_jax.pools import Cache, SlotStatus
from v4kv_jax.serve import protocol
from v4kv_jax.serve.manager import SlotCache, SlotFlaggedError, slot_tables
from v4kv_jax.serve.request import Completion, check_prompt
from v4kv_jax.serve.sampling import (
    SamplingParams,
    penalize,
    penalizes,
    row_keys,
    sample,
    sample_stream,
    token_logprobs,
)

STOP_IDS = 16  # the Generator's stop buffer per row: eos_id and stop_token_ids


def _generate(graphdef, max_new_tokens: int, prefill_chunk: int, options: Options, params,
              cache: Cache,
              slot_ids: jax.Array, prompts: jax.Array, prompt_lengths: jax.Array,
              keys: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
              min_p: jax.Array, repetition: jax.Array, presence: jax.Array,
              frequency: jax.Array, fork_from: jax.Array, split: jax.Array, stop_ids: jax.Array,
              limit: jax.Array):
    """Row b prefills prompts[b, :prompt_lengths[b]] into slot_ids[b] (an empty slot), then
    decodes up to `limit` tokens (<= max_new_tokens), until it draws one of stop_ids[b] (-1
    pads); a row of length 0 (slot id -1) appends and reads nothing. Token i of row b is drawn
    with fold_in(keys[b], i) from the logits with the row's penalties (`sampling.penalize`:
    its prompt's tokens and the counts of its tokens so far, i32[B, V] carried by the loop)
    and its sampling options (`sampling.sample`). Returns (cache, tokens i32[B, T], their
    log-probabilities f32[B, T], the top ids i32[B, T, K] and log-probabilities f32[B, T, K]
    of each step, `sampling.token_logprobs`).

    A row with fork_from[b] = l >= 0 takes row l's first split[b] tokens instead of
    computing them (split[b]: a multiple of page_tokens, = split[l]): row l (fork_from -1)
    prefills its first split[l] tokens, then row b attaches those full pages of row l's slot
    (refcount + 1, one copy) and restores row l's State, and both prefill the rest."""
    model = protocol.merge(graphdef, params)
    batch, buffer = prompts.shape
    rows = jnp.arange(batch)
    V = model.vocab_size
    at = jnp.where(jnp.arange(buffer)[None] < prompt_lengths[:, None], prompts, V)
    in_prompt = jnp.zeros((batch, V), bool).at[rows[:, None], at].set(True, mode="drop")

    def prefill_forks(cache, last):
        """Prefills every prompt in chunks, in one loop (one model call in the program):
        first rows that do not fork prefill [0, split[b]), then the forks take their pages
        and State, then every row prefills [split[b], prompt_lengths[b])."""
        first_end = jnp.where(fork_from < 0, split, 0)
        forks = jnp.any(fork_from >= 0)
        first = (jnp.max(first_end) + prefill_chunk - 1) // prefill_chunk
        second = (jnp.max(prompt_lengths - split) + prefill_chunk - 1) // prefill_chunk
        # At least one trip past the first phase where a row forks: the forks run there.
        second = jnp.where(forks, jnp.maximum(second, 1), second)

        def chunk(i, carry):
            cache, last = carry
            later = i >= first
            cache = jax.lax.cond(forks & (i == first),
                                 lambda c: jax.lax.fori_loop(0, batch, fork, c), lambda c: c,
                                 cache)
            begin = jnp.where(later, split, 0)
            end = jnp.where(later, prompt_lengths, first_end)
            start = begin + jnp.where(later, i - first, i) * prefill_chunk
            at = jnp.clip(start[:, None] + jnp.arange(prefill_chunk)[None], 0, buffer - 1)
            n_new = jnp.clip(end - start, 0, prefill_chunk)
            cache, h = protocol.chunk(model, jnp.take_along_axis(prompts, at, axis=1), cache,
                                      slot_ids, n_new, options)
            at = end - 1 - start
            here = (at >= 0) & (at < prefill_chunk)
            last = jnp.where(here[:, None], h[rows, jnp.clip(at, 0, prefill_chunk - 1)], last)
            return cache, last

        return jax.lax.fori_loop(0, first + second, chunk, (cache, last))

    def fork(b, cache):
        """Row b takes the pages and State of row fork_from[b] at split[b] (none: -1)."""
        src = slot_ids[jnp.maximum(fork_from[b], 0)]
        dst = jnp.where(fork_from[b] >= 0, slot_ids[b], -1)
        state = pools.snapshot_state(cache, src)
        cache = pools.attach_prefix(cache, dst, pools.page_table(cache)[src],
                                    split[b] // cache.geometry.page_tokens)
        return pools.restore_state(cache, dst, state)

    def draw(logits, i, counts, drawing):
        """(tokens, -1 where not `drawing`; their log-probabilities and top ones; counts)."""
        penalized = jax.lax.cond(
            jnp.any(penalizes(repetition, presence, frequency)),
            lambda x: penalize(x, counts, in_prompt, repetition, presence, frequency),
            lambda x: x, logits)
        token = jnp.where(drawing, sample(penalized, row_keys(keys, i), temperature, top_k,
                                          top_p, min_p), -1)
        counts = counts.at[rows, jnp.where(drawing, token, V)].add(1, mode="drop")
        return token, token_logprobs(logits, token), counts

    def stops(token):
        return jnp.any(token[:, None] == stop_ids, axis=1)

    cache, last = prefill_forks(cache, jnp.zeros((batch, protocol.width(model)), jnp.float32))
    active = prompt_lengths > 0
    token, scores, counts = draw(protocol.head(model, last), 0, jnp.zeros((batch, V), jnp.int32),
                                 active)
    K = scores[1].shape[-1]
    out = (jnp.full((batch, max_new_tokens), -1, jnp.int32),
           jnp.full((batch, max_new_tokens), jnp.nan, jnp.float32),
           jnp.full((batch, max_new_tokens, K), -1, jnp.int32),
           jnp.full((batch, max_new_tokens, K), jnp.nan, jnp.float32))

    def put(out, i, token, scores):
        return tuple(o.at[:, i].set(v) for o, v in zip(out, (token, *scores), strict=True))

    out = put(out, 0, token, scores)
    done = ~active | stops(token)

    def cond(state):
        i, _, _, done, _, _ = state
        return (i < limit) & ~jnp.all(done)

    def decode(state):
        i, cache, token, done, counts, out = state
        cache, h = protocol.chunk(model, jnp.maximum(token, 0)[:, None], cache, slot_ids,
                                  (~done).astype(jnp.int32), options)
        nxt, scores, counts = draw(protocol.head(model, h[:, 0]), i, counts, ~done)
        return i + 1, cache, nxt, done | stops(nxt), counts, put(out, i, nxt, scores)

    _, cache, _, _, _, out = jax.lax.while_loop(
        cond, decode, (jnp.int32(1), cache, token, done, counts, out))
    return (cache, *out)


def _generate_on_mesh(mesh, body, params, cache: Cache, *args):
    """`body` (`_generate` with its statics) per shard of `mesh`: the rows (and their keys
    and options) are the shards' rows end to end; params and the limit are replicated."""
    rows, one = meshes.P(meshes.DATA), meshes.P()
    return meshes.shard_program(body, mesh, (one, meshes.CACHE) + (rows,) * 14 + (one,),
                                (meshes.CACHE,) + (rows,) * 4)(params, cache, *args)


@dataclasses.dataclass
class GenerationResult:
    """One row per sample: row b * n + j is sample j of prompt b (n = 1: row b is prompt b).

    tokens: i32[rows, max_new_tokens] (-1 after a row's last token); lengths: i32[rows]
    tokens generated per row (up to and including `eos_id`, a stop token or a stop
    sequence); finish_reasons: per row, "eos", "stop" or "length"; prompt_ids: each row's
    prompt; n: samples per prompt; with the `logprobs=k` option, logprobs: f32[rows,
    max_new_tokens], each token's log-probability (NaN after a row's last token), top_ids,
    top_logprobs: i32/f32[rows, max_new_tokens, k], the k most likely tokens of each step,
    most likely first (else None).

    Indexing or iterating gives one `Completion` per row (prompt_ids, tokens as a list,
    finish_reason, sample_index, logprobs, top_logprobs): the fields of the Engine's
    `RequestOutput` that every generation has.
    """

    tokens: np.ndarray
    lengths: np.ndarray
    finish_reasons: list[str] = dataclasses.field(default_factory=list)
    prompt_ids: list[list[int]] = dataclasses.field(default_factory=list)
    n: int = 1
    logprobs: np.ndarray | None = None
    top_ids: np.ndarray | None = None
    top_logprobs: np.ndarray | None = None

    def as_lists(self) -> list[list[int]]:
        return [row[:n].tolist() for row, n in zip(self.tokens, self.lengths, strict=True)]

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, b: int) -> Completion:
        n = self.lengths[b]
        scores = {}
        if self.logprobs is not None:
            scores = dict(logprobs=self.logprobs[b, :n].tolist(), top_logprobs=[
                list(zip(ids.tolist(), lp.tolist(), strict=True))
                for ids, lp in zip(self.top_ids[b, :n], self.top_logprobs[b, :n], strict=True)])
        return Completion(prompt_ids=self.prompt_ids[b], tokens=self.tokens[b, :n].tolist(),
                          finish_reason=self.finish_reasons[b], sample_index=b % self.n,
                          **scores)

    def __iter__(self):
        return (self[b] for b in range(len(self)))


class ModelCache(SlotCache):
    """A `SlotCache` of a served model, the base of the Generator and the Engine: the model
    is split once (`graphdef`, `params`; later changes to it are not seen).

    Args:
      model: a `v4kv_jax.serve.protocol.ServedModel` (e.g. a `v4kv_jax.nn.Decoder`); one
        that lacks part of it raises a TypeError naming the part.
      geometry: the cache geometry.
      options: how the ops run (`v4kv_jax.Options`; default: "auto").
      replays: whether the model must have `replay` (the Engine's prefix hits).
    """

    def __init__(self, model: protocol.ServedModel, geometry: CacheConfig,
                 options: Options | None = None, *, replays: bool = False):
        self.config = protocol.check_model(model, replay=replays)
        super().__init__(self.config.attn_config, geometry, options)
        self.graphdef, self.params = protocol.split(model)


class Generator(ModelCache):
    """Generates from a served model (`protocol.ServedModel`) with its own cache of
    `geometry.max_slots` slots.

    Each instance jits its own program and counts its traces (`traces`; one trace is one
    compiled program); `Generator.compiled_programs()` sums them over the live instances.

    Args:
      model: the model, e.g. a `v4kv_jax.nn.Decoder` (split once here; later changes to it
        are not seen).
      geometry: the cache geometry; `max_slots` is the batch. The length rule is the
        Engine's: a prompt and its output must fit `max_seq_len` less one token, since the
        last generated token is never appended: max_prompt_len + max_new_tokens - 1 <=
        max_seq_len (and the pages of every row must fit the pool).
      max_prompt_len: the longest prompt (the prompt buffer, rounded up to whole chunks).
      max_new_tokens: the most tokens a call generates per prompt (the output buffer; a
        call may ask for fewer).
      prefill_chunk: tokens per prefill step.
      options: how the ops run (`v4kv_jax.Options`; default: "auto").
      mesh: a `v4kv_jax.mesh.data_mesh` (None: one device): each device holds a shard of
        `geometry`, so a call takes up to mesh.size * max_slots prompts; prompt b runs on
        shard b // max_slots. Every row draws from its own stream (see `generate`), so a
        mesh gives the tokens of one device.
    """

    _live: weakref.WeakSet[Generator] = weakref.WeakSet()

    def __init__(self, model: protocol.ServedModel, geometry: CacheConfig, *,
                 max_prompt_len: int, max_new_tokens: int, prefill_chunk: int = 128,
                 options: Options | None = None, mesh: meshes.Mesh | None = None):
        self.mesh = None if mesh is None else meshes.check_mesh(mesh)
        super().__init__(model, geometry, options)
        max_prompt_len = checks.integer("max_prompt_len", max_prompt_len, lo=1)
        max_new_tokens = checks.integer("max_new_tokens", max_new_tokens, lo=1)
        prefill_chunk = checks.integer("prefill_chunk", prefill_chunk, lo=1)
        if max_prompt_len + max_new_tokens - 1 > geometry.max_seq_len:
            checks.fail("max_new_tokens", f"at most {geometry.max_seq_len - max_prompt_len + 1} "
                        f"for max_prompt_len={max_prompt_len} (max_prompt_len + max_new_tokens "
                        f"- 1 <= max_seq_len={geometry.max_seq_len})", max_new_tokens)
        self.max_new_tokens = max_new_tokens
        self.prefill_chunk = min(prefill_chunk, max_prompt_len)
        self.buffer = -(-max_prompt_len // self.prefill_chunk) * self.prefill_chunk
        self.max_prompt_len = max_prompt_len
        body = functools.partial(_generate, self.graphdef, self.max_new_tokens,
                                 self.prefill_chunk, self.options)
        if self.mesh is not None:
            body = functools.partial(_generate_on_mesh, self.mesh, body)
            self.params = jax.device_put(self.params, meshes.replicated(self.mesh))
        self._program = programs.program("generator", body, donate=("cache",), register=False)
        base = jax.random.PRNGKey(0)
        self._row_streams = np.stack([np.asarray(jax.random.fold_in(base, b))
                                      for b in range(self.batch)])
        Generator._live.add(self)

    def _init_pools(self, model: AttentionConfig, geometry: CacheConfig) -> None:
        if self.mesh is None:
            super()._init_pools(model, geometry)
            self.tables = {0: self.table}
            return
        self.cache = meshes.init_cache(model, geometry, self.mesh)
        self.tables = slot_tables(geometry, self.mesh)
        self.table = None  # one per shard: `tables`

    @property
    def batch(self) -> int:
        """Prompts per call: max_slots, times the mesh's devices."""
        return self.geometry.max_slots * (1 if self.mesh is None else self.mesh.size)

    @property
    def slots(self) -> dict[int, int]:
        """prompt -> its row of `cache` (shard * max_slots + slot), for this process's."""
        S = self.geometry.max_slots
        return {b: i * S + s for i, t in self.tables.items() for b, s in t.slots.items()}

    @property
    def program(self) -> programs.Program:
        """The generator's one device program (`programs.capture` records its calls, and
        `v4kv_jax.targets.compile_for` compiles one for a TPU)."""
        return self._program

    @property
    def traces(self) -> int:
        """How many programs this generator has traced and compiled."""
        return self._program.traces

    @classmethod
    def compiled_programs(cls) -> int:
        """How many programs the generators alive now have traced and compiled, together."""
        return sum(gen.traces for gen in cls._live)

    def warmup(self) -> float:
        """Compiles, before the first `generate`, every device program it runs: the
        generator's program (its one shape) and the slot lifecycle (admission, release), with
        jax's helpers a call uses. Each runs once on no rows (slot ids -1, prompts of length
        0), so the cache's contents do not change. Returns the seconds it took; a second
        call compiles nothing and returns about 0."""
        start, batch = time.perf_counter(), self.batch
        np.asarray(jax.random.PRNGKey(0))  # the stream of a call with a seed
        caches = self._caches()
        for i, table in self.tables.items():
            caches[i] = table.warmup(caches[i])
        out = self._run(caches, np.full((batch,), -1, np.int32),
                        np.zeros((batch, self.buffer), np.int32), np.zeros((batch,), np.int32),
                        self._row_streams, np.zeros((batch,), np.float32),
                        np.zeros((batch,), np.int32), np.ones((batch,), np.float32),
                        np.zeros((batch,), np.float32), np.ones((batch,), np.float32),
                        np.zeros((batch,), np.float32), np.zeros((batch,), np.float32),
                        np.full((batch,), -1, np.int32), np.zeros((batch,), np.int32),
                        np.full((batch, STOP_IDS), -1, np.int32), limit=1)
        self._caches()
        for x in out:
            meshes.fetch(x)
        return time.perf_counter() - start

    def _caches(self) -> dict[int, Cache]:
        """shard index -> its cache, for this process's shards."""
        return {0: self.cache} if self.mesh is None else meshes.split(self.cache, self.mesh)

    def _run(self, caches: dict[int, Cache], *rows: np.ndarray, limit: int
             ) -> tuple[jax.Array, ...]:
        """Runs the program on the shards' caches and the host arrays of every row
        (`_generate`'s arguments from slot_ids to stop_ids), up to `limit` tokens; the new
        cache is `cache`. Returns the tokens, their log-probabilities and the top ones (on
        the device; `_generate`)."""
        if self.mesh is None:
            cache = caches[0]
            args = tuple(jnp.asarray(a) for a in rows) + (jnp.int32(limit),)
        else:
            cache = meshes.assemble(caches, self.mesh)
            args = tuple(meshes.put(a, meshes.by_shard(self.mesh)) for a in rows) + (
                meshes.put(np.int32(limit), meshes.replicated(self.mesh)),)
        self.cache = cache  # the admitted rows' cache, if the program does not run (capture)
        self.cache, *out = self._program(self.params, cache, *args)
        return tuple(out)

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int | None = None, *,
                 temperature: float = 0.0, top_k: int | None = 0, top_p: float = 1.0,
                 min_p: float = 0.0, seed: int | None = None, eos_id: int | None = None,
                 stop_token_ids: Sequence[int] = (), stop: Sequence[Sequence[int]] = (),
                 n: int = 1, logprobs: int | None = None, repetition_penalty: float = 1.0,
                 presence_penalty: float = 0.0, frequency_penalty: float = 0.0
                 ) -> GenerationResult:
        """Generates for up to `max_slots` prompts of 1..max_prompt_len tokens each, with the
        arguments of `Engine.generate` (the options of `v4kv_jax.serve.sampling.SamplingParams`,
        the same for every prompt of the call).

        Each of the n samples of a prompt is a row (row b * n + j: sample j of prompt b; at
        most `max_slots` rows): the requests 0..rows-1 of the generator's `SlotTable` (the
        previous call's requests are released first), which stay admitted until the next
        call. The samples of a prompt on one shard compute its full pages before its last
        token once: sample 0's row prefills them, the others attach them (one copy,
        refcounted) and take its State there, then every row prefills the rest.

        Args:
          prompts: token ids per prompt.
          max_new_tokens: tokens to generate per prompt, at most the constructor's (None:
            the constructor's); fewer for a row that stops. Any value runs the same program.
          temperature: 0 = greedy; > 0 samples from softmax(logits / temperature).
          top_k, top_p, min_p: the sampling filters (off: 0, 1.0, 0.0).
          seed: an int: sample j of every prompt draws from
            `sampling.sample_stream(PRNGKey(seed), j)` (a prompt gives the same tokens as in
            the Engine with the same seed, alone or in any batch); None: row r from
            PRNGKey(0) folded with r.
          eos_id: a token id in [0, vocab_size) that ends a row (included in its output).
          stop_token_ids: more token ids that end a row (eos_id and these: at most
            `STOP_IDS`, checked on the device).
          stop: token-id sequences that end a row: applied on the host to the output (the
            row is cut after the first stop sequence its tokens complete; the device decodes
            on until the row's other ends, so a stop sequence saves no compute here).
          n: samples per prompt (len(prompts) * n rows at most).
          logprobs, repetition_penalty, presence_penalty, frequency_penalty: see
            `SamplingParams` (the penalties count each row's own tokens).

        Returns:
          A `GenerationResult`: arrays of every row, and a `Completion` per row
          (`result[r]`, or iterate) with its finish reason, sample index and logprobs.

        Raises:
          TypeError / ValueError naming the argument for bad prompts (not integer token ids,
          ids outside [0, vocab_size), empty or longer than max_prompt_len) or options.
          After the program, `SlotTable.flag_error` of the flagged prompts (as the manager):
          `PoolExhaustedError` ("prompts [b, ...] could not append (['OUT_OF_PAGES'])...",
          each shortfall counted for the prompt plus max_new_tokens - 1 tokens) when the pool
          ran out, `SlotFlaggedError` for other flags.
        """
        batch = self.batch
        if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__len__"):
            checks.fail("prompts", "a sequence of token-id sequences", prompts, TypeError)
        if not 1 <= len(prompts) <= batch:
            checks.fail("prompts", f"1 to {batch} prompts (max_slots"
                        + ("" if self.mesh is None else " x mesh devices") + ")",
                        f"{len(prompts)} prompts")
        limit = self.max_new_tokens if max_new_tokens is None else checks.integer(
            "max_new_tokens", max_new_tokens, lo=1, hi=self.max_new_tokens)
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                seed=seed, eos_id=eos_id, stop_token_ids=stop_token_ids,
                                stop=stop, n=n, logprobs=logprobs,
                                repetition_penalty=repetition_penalty,
                                presence_penalty=presence_penalty,
                                frequency_penalty=frequency_penalty)
        n, count = params.n, len(prompts) * params.n
        if count > batch:
            checks.fail("n", f"at most {batch // len(prompts)} for {len(prompts)} prompts "
                        f"(len(prompts) * n <= {batch} rows: max_slots"
                        + ("" if self.mesh is None else " x mesh devices") + ")", n)
        V = self.config.vocab_size
        params.check_vocab(V)
        stop_ids = ([] if eos_id is None else [params.eos_id]) + list(params.stop_token_ids)
        if len(stop_ids) > STOP_IDS:
            checks.fail("stop_token_ids", f"at most {STOP_IDS} ids with eos_id (the "
                        "Generator's stop buffer)", f"{len(stop_ids)} ids")
        buf = np.zeros((batch, self.buffer), np.int32)
        lengths = np.zeros((batch,), np.int32)
        prompt_ids = []
        for b, p in enumerate(prompts):
            p = check_prompt(f"prompts[{b}]", p, V)
            if p.size > self.max_prompt_len:
                checks.fail(f"prompts[{b}]", f"1 to {self.max_prompt_len} tokens "
                            "(max_prompt_len)", f"{p.size} tokens")
            buf[b * n:(b + 1) * n, :p.size] = p
            lengths[b * n:(b + 1) * n] = p.size
            prompt_ids += [p.tolist()] * n
        S = self.geometry.max_slots
        caches = self._caches()
        slot_ids = np.full((batch,), -1, np.int32)
        for i, table in self.tables.items():  # prompt b on shard b // S
            cache = table.release_all(caches[i])
            for b in range(i * S, min((i + 1) * S, count)):
                cache, slot_ids[b] = table.admit(cache, b)
            caches[i] = cache
        slot_ids[:count] = np.arange(count) % S  # every process's rows
        if params.seed is None:
            keys = self._row_streams
        else:
            seeded = jax.random.PRNGKey(params.seed)
            keys = np.zeros((batch, 2), np.uint32)
            keys[:count] = [sample_stream(seeded, r % n) for r in range(count)]
        stops = np.full((batch, STOP_IDS), -1, np.int32)
        stops[:, :len(stop_ids)] = stop_ids
        full = lambda value, dtype: np.full((batch,), value, dtype)  # noqa: E731
        fork_from, split = full(-1, np.int32), full(0, np.int32)
        P = self.geometry.page_tokens
        for r in range(count):  # sample j > 0 takes sample 0's pages, on the same shard
            lead = r - r % n
            if r != lead and r // S == lead // S and lengths[r] > P:
                fork_from[r], split[r] = lead % S, (lengths[r] - 1) // P * P
                split[lead] = split[r]
        out = self._run(caches, slot_ids, buf, lengths, np.asarray(keys),
                        full(params.temperature, np.float32), full(params.top_k, np.int32),
                        full(params.top_p, np.float32), full(params.min_p, np.float32),
                        full(params.repetition_penalty, np.float32),
                        full(params.presence_penalty, np.float32),
                        full(params.frequency_penalty, np.float32), fork_from, split, stops,
                        limit=limit)
        wanted = {b: int(lengths[b]) + limit - 1 for b in range(count)}
        error = None
        caches = self._caches()
        for i, table in self.tables.items():
            mine = [b for b in table if b < count]
            error = error or table.flag_error(caches[i], mine, wanted, noun="prompt")
        out, chosen, top_ids, top_lp = (np.array(meshes.fetch(x)[:count]) for x in out)
        if self.mesh is not None and meshes.any_process(error is not None) and error is None:
            status = meshes.fetch(pools.status(self.cache))  # row b's row is b
            error = SlotFlaggedError({b: SlotStatus(int(status[b])).name
                                      for b in range(count)
                                      if status[b] not in (SlotStatus.ACTIVE, SlotStatus.FREE)},
                                     noun="prompt")
        if error is not None:
            raise error
        made = np.sum(out >= 0, axis=1).astype(np.int32)
        reasons = []
        for b in range(count):
            row, reason = out[b, :made[b]].tolist(), None
            ends = range(1, len(row) + 1) if params.stop else [len(row)]
            for n in ends:  # the first end: the device's, or a stop sequence's
                reason = params.finish(row[:n])
                if reason is not None:
                    made[b] = n
                    break
            reasons.append(reason or "length")
            out[b, made[b]:] = -1
            chosen[b, made[b]:], top_lp[b, made[b]:], top_ids[b, made[b]:] = np.nan, np.nan, -1
        scores = {}
        if params.logprobs is not None:
            k = params.logprobs
            scores = dict(logprobs=chosen, top_ids=top_ids[..., :k],
                          top_logprobs=top_lp[..., :k])
        return GenerationResult(tokens=out, lengths=made, finish_reasons=reasons,
                                prompt_ids=prompt_ids, n=n, **scores)


def _forward_body(graphdef, params, cache: Cache, tokens: jax.Array, slot_ids: jax.Array,
                  n_new: jax.Array, options: Options) -> tuple[Cache, jax.Array]:
    return protocol.merge(graphdef, params)(tokens, cache, slot_ids, n_new, options=options)


_forward = programs.program("nn.forward", _forward_body, donate=("cache",),
                            static=("graphdef", "options"))


def forward(graphdef, params, cache: Cache, tokens, slot_ids, n_new, *,
            options: Options | None = None) -> tuple[Cache, jax.Array]:
    """One jitted model call (prefill chunk or decode step): (cache, logits f32[B, T, V]).

    `graphdef, params = nnx.split(model)` once (or `protocol.split(model)`, for any served
    model); the cache is donated. Concrete arguments are
    checked first (`model.check_chunk`): distinct ACTIVE slots in [0, max_slots), n_new in
    [0, T], token ids in [0, vocab_size). Called inside a caller's jit, the device-side rules
    of `append.begin_append` hold instead.
    """
    config = _config_of(graphdef, params)
    check_chunk(config, cache, tokens, slot_ids, n_new)
    return _forward(graphdef, params, cache, jnp.asarray(tokens),
                    jnp.asarray(slot_ids, jnp.int32), jnp.asarray(n_new, jnp.int32),
                    options=options_or_default(options))


_CONFIGS: dict = {}


def _config_of(graphdef, params) -> protocol.ServedConfig:
    """The config of a split served model (one merge per graphdef, then remembered)."""
    if graphdef not in _CONFIGS:
        _CONFIGS[graphdef] = protocol.check_model(protocol.merge(graphdef, params),
                                                  replay=False)
    return _CONFIGS[graphdef]
