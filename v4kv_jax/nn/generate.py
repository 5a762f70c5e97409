"""Jitted generation over a batch of prompts of different lengths: chunked prefill, then decode.

The whole loop is ONE jitted function: a `fori_loop` over prefill chunks (its trip count is
the longest prompt, in chunks, a runtime value) followed by a `while_loop` of decode steps
(it stops early once every row has produced `eos_id`). Shapes depend only on the static
settings (batch = `max_slots`, prompt buffer `max_prompt_len`, `prefill_chunk`,
`max_new_tokens`), so every prompt length and every batch of up to `max_slots` prompts runs
the same compiled program.

The Generator is a `ModelCache`, the host lifecycle (`v4kv_jax.manager.SlotCache`) of a
model, as the Engine is: before each batch it releases the previous batch's requests and
admits the prompts (request b = prompt b); the program runs on those slots (rows without a
prompt are padding rows, slot id -1), and after it the table turns any slot flag into the
manager's exception. `sample` is the one sampling rule of both.

The model is split once (`nnx.split`); its params and the cache are arguments of the jitted
function, the cache donated, so the step updates the pools in place.

    gen = Generator(model, geometry, max_prompt_len=256, max_new_tokens=32)
    out = gen.generate([[5, 7, 1], [2, 2, 9, 4, 4]], temperature=0.0)   # greedy
    out.tokens    # i32[B, max_new_tokens], -1 after a row's last token
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from v4kv_jax import checks, pools, programs
from v4kv_jax import mesh as meshes
from v4kv_jax.config import AttentionConfig, CacheConfig, Options, options_or_default
from v4kv_jax.manager import SlotCache, SlotFlaggedError, SlotTable
from v4kv_jax.nn.model import Decoder, ModelConfig, check_chunk
from v4kv_jax.pools import Cache, SlotStatus


def sample(logits: jax.Array, key: jax.Array, temperature: jax.Array) -> jax.Array:
    """i32[B]: argmax where temperature <= 0, else a draw from softmax(logits / temperature)."""
    t = jnp.maximum(temperature, 1e-6)
    drawn = jax.random.categorical(key, logits / t, axis=-1)
    return jnp.where(temperature > 0, drawn, jnp.argmax(logits, axis=-1)).astype(jnp.int32)


def _generate(graphdef, max_new_tokens: int, prefill_chunk: int, options: Options, params,
              cache: Cache,
              slot_ids: jax.Array, prompts: jax.Array, prompt_lengths: jax.Array,
              key: jax.Array, temperature: jax.Array, eos_id: jax.Array):
    """Row b prefills prompts[b, :prompt_lengths[b]] into slot_ids[b] (an empty slot), then
    decodes; a row of length 0 (slot id -1) appends and reads nothing."""
    model = nnx.merge(graphdef, params)
    batch, buffer = prompts.shape
    rows = jnp.arange(batch)

    def prefill(i, carry):
        cache, last = carry
        start = i * prefill_chunk
        chunk = jax.lax.dynamic_slice_in_dim(prompts, start, prefill_chunk, axis=1)
        n_new = jnp.clip(prompt_lengths - start, 0, prefill_chunk)
        cache, h = model.hidden(chunk, cache, slot_ids, n_new, options=options)
        at = prompt_lengths - 1 - start
        here = (at >= 0) & (at < prefill_chunk)
        last = jnp.where(here[:, None], h[rows, jnp.clip(at, 0, prefill_chunk - 1)], last)
        return cache, last

    trips = (jnp.max(prompt_lengths) + prefill_chunk - 1) // prefill_chunk
    last = jnp.zeros((batch, model.config.attn_config.hidden_size), jnp.float32)
    cache, last = jax.lax.fori_loop(0, trips, prefill, (cache, last))

    active = prompt_lengths > 0
    key, sub = jax.random.split(key)
    token = jnp.where(active, sample(model.logits(last), sub, temperature), -1)
    out = jnp.full((batch, max_new_tokens), -1, jnp.int32).at[:, 0].set(token)
    done = ~active | (token == eos_id)

    def cond(state):
        i, _, _, done, _, _ = state
        return (i < max_new_tokens) & ~jnp.all(done)

    def decode(state):
        i, cache, token, done, out, key = state
        cache, h = model.hidden(jnp.maximum(token, 0)[:, None], cache, slot_ids,
                                (~done).astype(jnp.int32))
        key, sub = jax.random.split(key)
        nxt = jnp.where(done, -1, sample(model.logits(h[:, 0]), sub, temperature))
        out = out.at[:, i].set(nxt)
        return i + 1, cache, nxt, done | (nxt == eos_id), out, key

    _, cache, _, _, out, _ = jax.lax.while_loop(
        cond, decode, (jnp.int32(1), cache, token, done, out, key))
    return cache, out


def _generate_on_mesh(mesh, body, params, cache: Cache, slot_ids, prompts, prompt_lengths,
                      key, temperature, eos_id):
    """`body` (`_generate` with its statics) per shard of `mesh`: the rows are the shards'
    rows end to end; params, temperature and eos_id are replicated, and each shard of several
    samples with the key folded with its index, so no two shards draw alike."""
    rows, one = meshes.P(meshes.DATA), meshes.P()

    def per_shard(params, cache, slot_ids, prompts, prompt_lengths, key, temperature, eos_id):
        if mesh.size > 1:
            key = jax.random.fold_in(key, jax.lax.axis_index(meshes.DATA))
        return body(params, cache, slot_ids, prompts, prompt_lengths, key, temperature, eos_id)

    return meshes.shard_program(per_shard, mesh,
                                (one, meshes.CACHE, rows, rows, rows, one, one, one),
                                (meshes.CACHE, rows))(
        params, cache, slot_ids, prompts, prompt_lengths, key, temperature, eos_id)


@dataclasses.dataclass
class GenerationResult:
    """tokens: i32[B, max_new_tokens] (-1 after a row's last token); lengths: i32[B] tokens
    generated per row (up to and including `eos_id`)."""

    tokens: np.ndarray
    lengths: np.ndarray

    def as_lists(self) -> list[list[int]]:
        return [row[:n].tolist() for row, n in zip(self.tokens, self.lengths, strict=True)]


class ModelCache(SlotCache):
    """A `SlotCache` of a `Decoder`, the base of the Generator and the Engine: the model is
    split once (`graphdef`, `params`; later changes to the module are not seen).

    Args:
      model: the decoder.
      geometry: the cache geometry.
      options: how the ops run (`v4kv_jax.Options`; default: "auto").
    """

    def __init__(self, model: Decoder, geometry: CacheConfig, options: Options | None = None):
        if not isinstance(model, Decoder):
            checks.fail("model", "a v4kv_jax.nn.Decoder", type(model).__name__, TypeError)
        super().__init__(model.config.attn_config, geometry, options)
        self.config: ModelConfig = model.config
        self.graphdef, self.params = nnx.split(model)


class Generator(ModelCache):
    """Generates from a `Decoder` with its own cache of `geometry.max_slots` slots.

    Each instance jits its own program and counts its traces (`traces`; one trace is one
    compiled program); `Generator.compiled_programs()` sums them over the live instances.

    Args:
      model: the decoder (split once here; later changes to it are not seen).
      geometry: the cache geometry; `max_slots` is the batch, and every slot must hold
        `max_prompt_len + max_new_tokens` tokens (`max_seq_len`) and its pages must fit.
      max_prompt_len: the longest prompt (the prompt buffer, rounded up to whole chunks).
      max_new_tokens: tokens generated per prompt (fewer for a row that emits `eos_id`).
      prefill_chunk: tokens per prefill step.
      options: how the ops run (`v4kv_jax.Options`; default: "auto").
      mesh: a `v4kv_jax.mesh.data_mesh` (None: one device): each device holds a shard of
        `geometry`, so a call takes up to mesh.size * max_slots prompts; prompt b runs on
        shard b // max_slots. Greedy rows give the tokens of one device; sampled rows draw
        from the call's key folded with their shard's index.
    """

    _live: weakref.WeakSet[Generator] = weakref.WeakSet()

    def __init__(self, model: Decoder, geometry: CacheConfig, *, max_prompt_len: int,
                 max_new_tokens: int, prefill_chunk: int = 128,
                 options: Options | None = None, mesh: meshes.Mesh | None = None):
        self.mesh = None if mesh is None else meshes.check_mesh(mesh)
        super().__init__(model, geometry, options)
        max_prompt_len = checks.integer("max_prompt_len", max_prompt_len, lo=1)
        max_new_tokens = checks.integer("max_new_tokens", max_new_tokens, lo=1)
        prefill_chunk = checks.integer("prefill_chunk", prefill_chunk, lo=1)
        need = max_prompt_len + max_new_tokens
        if need > geometry.max_seq_len:
            raise ValueError(f"max_prompt_len + max_new_tokens = {need} exceeds the cache's "
                             f"max_seq_len={geometry.max_seq_len}")
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
        Generator._live.add(self)

    def _init_pools(self, model: AttentionConfig, geometry: CacheConfig) -> None:
        if self.mesh is None:
            super()._init_pools(model, geometry)
            self.tables = {0: self.table}
            return
        self.cache = meshes.init_cache(model, geometry, self.mesh)
        self.tables = {i: SlotTable(geometry.max_slots)
                       for i in meshes.split(self.cache, self.mesh)}
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
    def traces(self) -> int:
        """How many programs this generator has traced and compiled."""
        return self._program.traces

    @classmethod
    def compiled_programs(cls) -> int:
        """How many programs the generators alive now have traced and compiled, together."""
        return sum(gen.traces for gen in cls._live)

    def generate(self, prompts: Sequence[Sequence[int]], *, temperature: float = 0.0,
                 seed: int = 0, eos_id: int | None = None) -> GenerationResult:
        """Generates for up to `max_slots` prompts of 1..max_prompt_len tokens each.

        The prompts are the requests 0..len(prompts)-1 of the generator's `SlotTable` (the
        previous call's requests are released first) and stay admitted until the next call.

        Args:
          prompts: token ids per prompt.
          temperature: 0 = greedy; > 0 samples from softmax(logits / temperature); a negative
            or non-finite value raises ValueError.
          seed: the sampling seed (an int).
          eos_id: a token id in [0, vocab_size) that ends a row (it is included in the row's
            output).

        Raises:
          TypeError / ValueError naming the argument for bad prompts (not integer token ids,
          ids outside [0, vocab_size), empty or longer than max_prompt_len) or settings.
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
        temperature = checks.real("temperature", temperature, lo=0.0)
        seed = checks.integer("seed", seed)
        V = self.config.vocab_size
        if eos_id is not None:
            eos_id = checks.integer("eos_id", eos_id, lo=0, hi=V - 1)
        buf = np.zeros((batch, self.buffer), np.int32)
        lengths = np.zeros((batch,), np.int32)
        for b, p in enumerate(prompts):
            p = checks.int_array(f"prompts[{b}]", p, ndim=1, lo=0, hi=V - 1)
            if not 1 <= p.size <= self.max_prompt_len:
                checks.fail(f"prompts[{b}]", f"1 to {self.max_prompt_len} tokens "
                            "(max_prompt_len)", f"{p.size} tokens")
            buf[b, :p.size] = p
            lengths[b] = p.size
        S = self.geometry.max_slots
        caches = {0: self.cache} if self.mesh is None else meshes.split(self.cache, self.mesh)
        slot_ids = np.full((batch,), -1, np.int32)
        for i, table in self.tables.items():  # prompt b on shard b // S
            cache = table.release_all(caches[i])
            for b in range(i * S, min((i + 1) * S, len(prompts))):
                cache, slot_ids[b] = table.admit(cache, b)
            caches[i] = cache
        slot_ids[:len(prompts)] = np.arange(len(prompts)) % S  # every process's rows
        args = (slot_ids, buf, lengths)
        scalars = (jax.random.PRNGKey(seed), jnp.float32(temperature),
                   jnp.int32(-1 if eos_id is None else eos_id))
        if self.mesh is None:
            cache = caches[0]
            args = tuple(jnp.asarray(a) for a in args)
        else:
            cache = meshes.assemble(caches, self.mesh)
            args = tuple(meshes.put(a, meshes.by_shard(self.mesh)) for a in args)
            scalars = tuple(meshes.put(a, meshes.replicated(self.mesh)) for a in scalars)
        self.cache, out = self._program(self.params, cache, *args, *scalars)
        wanted = {b: int(lengths[b]) + self.max_new_tokens - 1 for b in range(len(prompts))}
        error = None
        caches = {0: self.cache} if self.mesh is None else meshes.split(self.cache, self.mesh)
        for i, table in self.tables.items():
            mine = [b for b in table if b < len(prompts)]
            error = error or table.flag_error(caches[i], mine, wanted, noun="prompt")
        out = meshes.fetch(out)[:len(prompts)]
        if self.mesh is not None and meshes.any_process(error is not None) and error is None:
            status = meshes.fetch(pools.status(self.cache))  # prompt b's row is b
            error = SlotFlaggedError({b: SlotStatus(int(status[b])).name
                                      for b in range(len(prompts))
                                      if status[b] not in (SlotStatus.ACTIVE, SlotStatus.FREE)},
                                     noun="prompt")
        if error is not None:
            raise error
        return GenerationResult(tokens=out, lengths=np.sum(out >= 0, axis=1).astype(np.int32))


def _forward_body(graphdef, params, cache: Cache, tokens: jax.Array, slot_ids: jax.Array,
                  n_new: jax.Array, options: Options) -> tuple[Cache, jax.Array]:
    return nnx.merge(graphdef, params)(tokens, cache, slot_ids, n_new, options=options)


_forward = programs.program("nn.forward", _forward_body, donate=("cache",),
                            static=("graphdef", "options"))


def forward(graphdef, params, cache: Cache, tokens, slot_ids, n_new, *,
            options: Options | None = None) -> tuple[Cache, jax.Array]:
    """One jitted model call (prefill chunk or decode step): (cache, logits f32[B, T, V]).

    `graphdef, params = nnx.split(model)` once; the cache is donated. Concrete arguments are
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


def _config_of(graphdef, params) -> ModelConfig:
    """The ModelConfig of a split Decoder (one merge per graphdef, then remembered)."""
    if graphdef not in _CONFIGS:
        model = nnx.merge(graphdef, params)
        if not isinstance(model, Decoder):
            checks.fail("graphdef", "the graphdef of a split v4kv_jax.nn.Decoder",
                        type(model).__name__, TypeError)
        _CONFIGS[graphdef] = model.config
    return _CONFIGS[graphdef]
