"""The one sampling rule of the Engine and the Generator, and its per-request options.

`SamplingParams` is the validated record of a request's options (the keyword arguments of
`Engine.add_request`, `Engine.generate` and `Generator.generate` build it). On the device
they become one row per request of fixed-shape arrays, so one compiled program serves every
mix of options:

  keys         u32[B, 2]  the row's stream; token i is drawn with fold_in(keys[b], i)
  temperature  f32[B]     0 = greedy (argmax), else logits / temperature
  top_k        i32[B]     keep the k largest logits (0 = off)
  top_p        f32[B]     keep the smallest set of largest logits whose probability reaches
                          top_p (1 = off)
  min_p        f32[B]     keep the logits whose probability is at least min_p times the
                          largest one's (0 = off)

and, for the penalties (`penalize`, before temperature and filters), per row the counts of
each token among the generated ones, i32[B, V], and whether it is in the prompt, bool[B, V]
(fixed shapes: a row without penalties has repetition 1 and presence, frequency 0):

  repetition   f32[B]     a logit of a token seen in the prompt or the output is divided
                          by it where positive, multiplied by it where not (1 = off)
  presence     f32[B]     subtracted once from the logit of every token generated so far
  frequency    f32[B]     subtracted from a logit as many times as the token was generated

`token_logprobs` gives each row's log-probability of its drawn token and its `MAX_LOGPROBS` most
likely tokens with theirs, from the model's distribution (log_softmax of the logits, before
penalties, temperature and filters); a request keeps the first `logprobs` of them.

`sample` sorts each row once when any row filters (`lax.cond`: rows that do not filter draw
exactly as without filters), finds the smallest logit each filter keeps in the sorted row,
and masks with `jnp.where`. The filters apply in that order: top_k, then top_p on what top_k
kept (renormalised), then min_p; logits tied with the last kept one are kept too.

A row's stream: with `seed` an int, key = PRNGKey(seed), so a prompt and seed give the same
tokens whatever the batch, the request id or what ran before; with seed None, the Engine
folds its own seed with the request id and the Generator PRNGKey(0) with the prompt's index.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from v4kv_jax import checks

SEED_BOUND = 2**32  # PRNGKey takes seeds in [0, 2**32)
MAX_LOGPROBS = 20  # the most top logprobs a request may ask for per token
SAMPLE_STREAMS = 2**31  # sample j > 0 of a request: its stream folded with this + j


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """A request's sampling and stop options, checked at construction.

    Attributes:
      temperature: 0 = greedy, > 0 samples from softmax(logits / temperature).
      top_k: keep the k most likely tokens (0 or None: off).
      top_p: nucleus sampling, a real in (0, 1] (1: off).
      min_p: keep tokens at least min_p times as likely as the most likely one, a real in
        [0, 1] (0: off).
      seed: an int in [0, 2**32): the request's own stream (same prompt and seed, same
        tokens, alone or in any batch); None: the caller's stream (see the module docstring).
      eos_id: a token id that ends the request (finish reason "eos"), or None.
      stop_token_ids: token ids that end the request (finish reason "stop").
      stop: token-id sequences that end the request once the generated tokens end with one
        (finish reason "stop"; it may span several steps). The output keeps the tokens up to
        and including the stop token or sequence, as for `eos_id`.
      n: samples of the prompt (>= 1), each its own output with its own stream
        (`sample_stream`).
      logprobs: None: none; k in [0, MAX_LOGPROBS]: each generated token's log-probability
        and the k most likely tokens' (token id, log-probability), most likely first.
      repetition_penalty: > 0; 1: off (see the module docstring).
      presence_penalty, frequency_penalty: reals (0: off; negative ones favour repeats).
    """

    temperature: float = 0.0
    top_k: int | None = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    eos_id: int | None = None
    stop_token_ids: Sequence[int] = ()
    stop: Sequence[Sequence[int]] = ()
    n: int = 1
    logprobs: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def __post_init__(self):
        put = _setter(self)
        put("temperature", checks.real("temperature", self.temperature, lo=0.0))
        put("top_k", 0 if self.top_k is None else checks.integer("top_k", self.top_k, lo=0))
        put("top_p", checks.real("top_p", self.top_p, lo=0.0, hi=1.0, lo_open=True))
        put("min_p", checks.real("min_p", self.min_p, lo=0.0, hi=1.0))
        if self.seed is not None:
            put("seed", checks.integer("seed", self.seed, lo=0, hi=SEED_BOUND - 1))
        if self.eos_id is not None:
            put("eos_id", checks.integer("eos_id", self.eos_id, lo=0))
        put("stop_token_ids", _token_ids("stop_token_ids", self.stop_token_ids))
        if isinstance(self.stop, (str, bytes)) or not isinstance(self.stop, Sequence):
            checks.fail("stop", "a sequence of token-id sequences", repr(self.stop), TypeError)
        stop = tuple(_token_ids(f"stop[{i}]", s) for i, s in enumerate(self.stop))
        for i, s in enumerate(stop):
            if not s:
                checks.fail(f"stop[{i}]", "at least one token id", "an empty sequence")
        put("stop", stop)
        put("n", checks.integer("n", self.n, lo=1))
        if self.logprobs is not None:
            put("logprobs", checks.integer("logprobs", self.logprobs, lo=0, hi=MAX_LOGPROBS))
        put("repetition_penalty", checks.real("repetition_penalty", self.repetition_penalty,
                                              lo=0.0, lo_open=True))
        put("presence_penalty", checks.real("presence_penalty", self.presence_penalty))
        put("frequency_penalty", checks.real("frequency_penalty", self.frequency_penalty))

    @property
    def filters(self) -> bool:
        """Whether top_k, top_p or min_p removes any token."""
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0

    @property
    def penalizes(self) -> bool:
        """Whether a repetition, presence or frequency penalty is on."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    def check_vocab(self, vocab_size: int) -> None:
        """Every token id of the options is in [0, vocab_size), and `logprobs` at most
        vocab_size."""
        if self.logprobs is not None and self.logprobs > vocab_size:
            checks.fail("logprobs", f"at most {vocab_size} (vocab_size)", self.logprobs)
        ids = [("eos_id", self.eos_id)] if self.eos_id is not None else []
        ids += [(f"stop_token_ids[{i}]", t) for i, t in enumerate(self.stop_token_ids)]
        ids += [(f"stop[{i}][{j}]", t) for i, s in enumerate(self.stop) for j, t in enumerate(s)]
        for name, t in ids:
            if t >= vocab_size:
                checks.fail(name, f"a token id in [0, {vocab_size}) (vocab_size)", t)

    def finish(self, generated: Sequence[int]) -> str | None:
        """The finish reason the last of `generated` gives ("eos", "stop"), or None."""
        last = generated[-1]
        if last == self.eos_id:
            return "eos"
        if last in self.stop_token_ids or any(
                len(s) <= len(generated) and tuple(generated[-len(s):]) == s for s in self.stop):
            return "stop"
        return None


def _setter(obj):
    """A setter of a frozen dataclass's fields, for its own `__post_init__`."""
    return lambda name, value: object.__setattr__(obj, name, value)


def _token_ids(name: str, ids) -> tuple[int, ...]:
    if isinstance(ids, (str, bytes)) or not isinstance(ids, (Sequence, np.ndarray)):
        checks.fail(name, "a sequence of token ids", repr(ids), TypeError)
    out = []
    for i, t in enumerate(ids):
        if isinstance(t, (bool, np.bool_)) or not isinstance(t, numbers.Integral):
            checks.fail(name, "integer token ids", f"{t!r} at position {i}", TypeError)
        if t < 0:
            checks.fail(name, "token ids >= 0", f"{int(t)} at position {i}")
        out.append(int(t))
    return tuple(out)


def stream_key(seed: int) -> np.ndarray:
    """u32[2]: the stream of a request with an int `seed` (PRNGKey(seed))."""
    return np.asarray(jax.random.PRNGKey(seed))


def sample_stream(key: np.ndarray, j: int) -> np.ndarray:
    """u32[2]: the stream of sample j of a request whose stream is `key` (sample 0: `key`;
    sample j > 0: fold_in(key, SAMPLE_STREAMS + j), apart from every token's key)."""
    if j == 0:
        return np.asarray(key)
    return np.asarray(jax.random.fold_in(jnp.asarray(key), SAMPLE_STREAMS + j))


def penalize(logits: jax.Array, counts: jax.Array, in_prompt: jax.Array,
             repetition: jax.Array, presence: jax.Array, frequency: jax.Array) -> jax.Array:
    """f32[B, V]: the logits with each row's penalties (see the module docstring).

    Args:
      logits: f32[B, V].
      counts: i32[B, V], how many times each token was generated in the row.
      in_prompt: bool[B, V], the tokens of the row's prompt.
      repetition, presence, frequency: f32[B].
    """
    seen = in_prompt | (counts > 0)
    rep = repetition[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    return (logits - presence[:, None] * (counts > 0)
            - frequency[:, None] * counts.astype(jnp.float32))


def penalizes(repetition: jax.Array, presence: jax.Array, frequency: jax.Array) -> jax.Array:
    """bool[B]: the rows whose penalties change their logits (`penalize` is the identity,
    bit for bit, on the others)."""
    return (repetition != 1.0) | (presence != 0.0) | (frequency != 0.0)


def no_logprobs(logits: jax.Array, tokens: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Zeros shaped as `token_logprobs(logits, tokens)` (a step where no row asks)."""
    B, K = logits.shape[0], min(MAX_LOGPROBS, logits.shape[-1])
    del tokens
    return (jnp.zeros((B,), jnp.float32), jnp.zeros((B, K), jnp.int32),
            jnp.zeros((B, K), jnp.float32))


def token_logprobs(logits: jax.Array, tokens: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(f32[B] the log-probability of tokens[b], i32[B, K] the K = min(MAX_LOGPROBS, V) most
    likely tokens, f32[B, K] theirs, most likely first) under log_softmax(logits)."""
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    top, ids = jax.lax.top_k(lp, min(MAX_LOGPROBS, logits.shape[-1]))
    chosen = jnp.take_along_axis(lp, jnp.maximum(tokens, 0)[:, None], axis=-1)[:, 0]
    return chosen, ids.astype(jnp.int32), top


def _sample_row(logits, key, temperature, top_k, top_p, min_p, filtered: bool):
    """i32[]: one row's token (see `sample`)."""
    scaled = logits / jnp.maximum(temperature, 1e-6)
    if filtered:
        V = logits.shape[-1]
        ranked = jnp.sort(scaled)[::-1]
        rank = jnp.arange(V)
        in_k = (top_k <= 0) | (rank < top_k)
        probs = jax.nn.softmax(jnp.where(in_k, ranked, -jnp.inf))
        before = jnp.cumsum(probs) - probs  # the probability of the larger logits
        in_p = (top_p >= 1.0) | (before < top_p)
        in_min = (min_p <= 0.0) | (probs >= min_p * probs[0])
        kept = jnp.sum(in_k & in_p & in_min)  # >= 1: the largest logit passes every filter
        scaled = jnp.where(scaled >= ranked[kept - 1], scaled, -jnp.inf)
    drawn = jax.random.categorical(key, scaled, axis=-1)
    return jnp.where(temperature > 0, drawn, jnp.argmax(logits, axis=-1)).astype(jnp.int32)


def sample(logits: jax.Array, keys: jax.Array, temperature: jax.Array,
           top_k: jax.Array | None = None, top_p: jax.Array | None = None,
           min_p: jax.Array | None = None) -> jax.Array:
    """i32[B]: per row, argmax where temperature <= 0, else a draw with keys[b] from
    softmax(logits / temperature) restricted by the row's top_k, top_p and min_p.

    Args:
      logits: f32[B, V].
      keys: u32[B, 2], each row's key for this draw.
      temperature: f32[B].
      top_k, top_p, min_p: i32[B], f32[B], f32[B] (None: off for every row).
    """
    B = logits.shape[0]
    top_k = jnp.zeros((B,), jnp.int32) if top_k is None else top_k
    top_p = jnp.ones((B,), jnp.float32) if top_p is None else top_p
    min_p = jnp.zeros((B,), jnp.float32) if min_p is None else min_p
    args = (logits, keys, temperature, top_k, top_p, min_p)
    any_filter = jnp.any((temperature > 0) & ((top_k > 0) | (top_p < 1.0) | (min_p > 0.0)))
    return jax.lax.cond(
        any_filter,
        lambda a: jax.vmap(lambda *r: _sample_row(*r, filtered=True))(*a),
        lambda a: jax.vmap(lambda *r: _sample_row(*r, filtered=False))(*a), args)


def row_keys(keys: jax.Array, draw) -> jax.Array:
    """u32[B, 2]: fold_in(keys[b], draw[b]) (draw an int or i32[B])."""
    draw = jnp.broadcast_to(jnp.asarray(draw, jnp.int32), keys.shape[:1])
    return jax.vmap(jax.random.fold_in)(keys, draw)


__all__ = ["MAX_LOGPROBS", "SAMPLE_STREAMS", "SamplingParams", "no_logprobs", "penalize",
           "penalizes", "row_keys", "sample", "sample_stream", "stream_key", "token_logprobs"]
