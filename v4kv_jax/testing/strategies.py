"""Hypothesis strategies for property tests of code built on the cache (needs hypothesis,
which the test extra installs).

  attention_configs   small `AttentionConfig`s: any order of SWA, CSA and HCA layers, a few
                      windows, heads and top-k sizes (each config compiles its own programs:
                      draw few of them, many request programs per config)
  cache_configs       small `CacheConfig`s: pages, slots, pages per request, storage dtypes,
                      the HCA tail
  request_programs    a `RequestProgram`: admissions, appends and releases of several
                      requests that the geometry can hold (no call of it is refused)

`RequestProgram.run` drives one through the core calls (`v4.reset_slot`, `v4.prefill`,
`v4.release_slot`) with a `synthetic.SyntheticBatch`'s vectors, one program shape for every
append ([B = max_slots, T = chunk]), and returns the cache and each live request's slot.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np
from hypothesis import strategies as st

from v4kv_jax import checks, config, pools, step
from v4kv_jax.config import AttentionConfig, CacheConfig, Options
from v4kv_jax.pools import Cache
from v4kv_jax.testing.synthetic import SyntheticBatch


def attention_configs(*, max_layers: int = 3) -> st.SearchStrategy[AttentionConfig]:
    """`config.tiny` with 1 to `max_layers` layers of any kinds in any order (ratios 0, 4
    and 16), a window of 8, 16 or 32 tokens, 2 or 4 heads and an indexer top-k of 4 or 8."""
    return _attention_configs(checks.integer("max_layers", max_layers, lo=1))


@st.composite
def _attention_configs(draw, max_layers: int) -> AttentionConfig:
    ratios = draw(st.lists(st.sampled_from((0, 4, 16)), min_size=1, max_size=max_layers))
    return config.tiny(compress_ratios=tuple(ratios), window=draw(st.sampled_from((8, 16, 32))),
                       num_heads=draw(st.sampled_from((2, 4))),
                       index_topk=draw(st.sampled_from((4, 8))))


def cache_configs(*, max_pages: int = 16, max_slots: int = 4, max_pages_per_seq: int = 4,
                  dtypes=("float32", "bfloat16")) -> st.SearchStrategy[CacheConfig]:
    """A `CacheConfig` of 1..`max_pages` pages of 128 tokens, 1..`max_slots` slots and
    1..`max_pages_per_seq` pages a request, its entries, indexer keys and window in one of
    `dtypes` (storage formats of `config.STORAGE_FORMATS`), its HCA tail online or a ring."""
    for name, value in (("max_pages", max_pages), ("max_slots", max_slots),
                        ("max_pages_per_seq", max_pages_per_seq)):
        checks.integer(name, value, lo=1)
    if isinstance(dtypes, str) or not dtypes:
        checks.fail("dtypes", "a non-empty sequence of storage formats", repr(dtypes))
    for dtype in dtypes:
        checks.one_of("dtypes", dtype, config.STORAGE_FORMATS)
    return _cache_configs(max_pages, max_slots, max_pages_per_seq, tuple(dtypes))


@st.composite
def _cache_configs(draw, max_pages: int, max_slots: int, max_pages_per_seq: int,
                   dtypes: tuple) -> CacheConfig:
    dtype = draw(st.sampled_from(dtypes))
    return CacheConfig(num_pages=draw(st.integers(1, max_pages)),
                       max_slots=draw(st.integers(1, max_slots)),
                       max_pages_per_seq=draw(st.integers(1, max_pages_per_seq)),
                       entry_dtype=dtype, index_dtype=dtype, window_dtype=dtype,
                       hca_tail=draw(st.sampled_from(config.HCA_TAILS)))


class Step(NamedTuple):
    """One step of a `RequestProgram`: op "admit" or "release" of `requests` (one request),
    or "append" of `tokens[i]` tokens (1..chunk) to each of `requests` in one call."""

    op: str
    requests: tuple[int, ...]
    tokens: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class RequestProgram:
    """Steps over requests 0, 1, ... that `geometry` can hold: a request is admitted into a
    free slot before it appends, never passes max_seq_len, the pages of the live requests
    fit num_pages, and a released request is not named again.

    Attributes:
      geometry: the cache geometry it was drawn for.
      chunk: the most tokens one append gives a request (the chunk length T of `run`).
      steps: the steps, in order.
    """

    geometry: CacheConfig
    chunk: int
    steps: tuple[Step, ...]

    @property
    def lengths(self) -> dict[int, int]:
        """request -> its length after the program, for the requests still admitted."""
        live: dict[int, int] = {}
        for s in self.steps:
            if s.op == "admit":
                live[s.requests[0]] = 0
            elif s.op == "release":
                del live[s.requests[0]]
            else:
                for r, n in zip(s.requests, s.tokens, strict=True):
                    live[r] += n
        return live

    @property
    def requests(self) -> int:
        """How many requests the program admits (ids 0 .. requests - 1)."""
        return sum(s.op == "admit" for s in self.steps)

    def run(self, cache: Cache, data: SyntheticBatch, *, options: Options | None = None
            ) -> tuple[Cache, dict[int, int]]:
        """Runs the steps on `cache` (donated; its slots FREE) with request r's vectors from
        row r of `data` (at least `requests` rows, `max_seq_len` tokens); returns the cache
        and request -> slot for the requests still admitted."""
        if not isinstance(cache, Cache) or cache.geometry != self.geometry:
            checks.fail("cache", f"a v4kv_jax Cache of {self.geometry}",
                        getattr(cache, "geometry", type(cache).__name__))
        if data.batch < self.requests:
            checks.fail("data", f"a SyntheticBatch of at least {self.requests} rows (one per "
                        "request)", f"{data.batch} rows")
        S = self.geometry.max_slots
        slots: dict[int, int] = {}
        lengths: dict[int, int] = {}
        for s in self.steps:
            if s.op == "admit":
                free = min(set(range(S)) - set(slots.values()))
                cache = pools.reset_slot(cache, free)
                slots[s.requests[0]], lengths[s.requests[0]] = free, 0
            elif s.op == "release":
                cache = pools.release_slot(cache, slots.pop(s.requests[0]))
            else:
                slot_ids = np.full((S,), -1, np.int32)
                n_new = np.zeros((S,), np.int32)
                rows = np.zeros((S,), np.int64)
                starts = np.zeros((S,), np.int64)
                for i, (r, n) in enumerate(zip(s.requests, s.tokens, strict=True)):
                    slot_ids[i], n_new[i], rows[i], starts[i] = slots[r], n, r, lengths[r]
                    lengths[r] += n
                positions = starts[:, None] + np.arange(self.chunk)[None, :]
                cache = step.prefill(cache, data.take(positions, rows), data.weights, slot_ids,
                                     n_new, options=options)
        return cache, slots


def request_programs(geometry: CacheConfig, *, chunk: int = 32, max_steps: int = 12
                     ) -> st.SearchStrategy[RequestProgram]:
    """A `RequestProgram` of 1..`max_steps` steps for `geometry`: each step admits a request
    (when a slot is free), appends 1..`chunk` tokens to some of the admitted ones in one call
    (as many as fit their max_seq_len and the free pages, in call order), or releases one."""
    if not isinstance(geometry, CacheConfig):
        checks.fail("geometry", "a v4kv_jax CacheConfig", type(geometry).__name__, TypeError)
    return _request_programs(geometry, checks.integer("chunk", chunk, lo=1),
                             checks.integer("max_steps", max_steps, lo=1))


@st.composite
def _request_programs(draw, geometry: CacheConfig, chunk: int, max_steps: int
                      ) -> RequestProgram:
    P, S = geometry.page_tokens, geometry.max_slots
    live: dict[int, int] = {}
    steps: list[Step] = []
    admitted = 0

    def pages(length: int) -> int:
        return -(-length // P)

    for _ in range(draw(st.integers(1, max_steps))):
        free = geometry.num_pages - sum(pages(n) for n in live.values())
        room = {r: min(chunk, geometry.max_seq_len - n) for r, n in live.items()
                if n < geometry.max_seq_len}
        ops = (["admit"] if len(live) < S else []) + (["append"] if room else []) + (
            ["release"] if live else [])
        op = draw(st.sampled_from(ops))
        if op == "admit":
            live[admitted] = 0
            steps.append(Step("admit", (admitted,)))
            admitted += 1
        elif op == "release":
            r = draw(st.sampled_from(sorted(live)))
            del live[r]
            steps.append(Step("release", (r,)))
        else:
            chosen = draw(st.lists(st.sampled_from(sorted(room)), min_size=1, unique=True))
            requests, tokens = [], []
            for r in chosen:
                n = draw(st.integers(1, room[r]))
                need = pages(live[r] + n) - pages(live[r])
                if need > free:
                    continue  # would run out of pages: left out of the call
                free -= need
                live[r] += n
                requests.append(r)
                tokens.append(n)
            if requests:
                steps.append(Step("append", tuple(requests), tuple(tokens)))
    return RequestProgram(geometry, chunk, tuple(steps))


__all__ = ["RequestProgram", "Step", "attention_configs", "cache_configs", "request_programs"]
