"""`v4kv_jax.testing.strategies`: the configs it draws make caches, and the request programs
it draws keep to the geometry they were drawn for (the property test that runs one is the
example of docs/testing.md, run by tests/test_docs.py)."""

from __future__ import annotations

import jax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import v4kv_jax as v4
from v4kv_jax.testing import strategies

from conftest import hypothesis_examples


@settings(max_examples=hypothesis_examples(40), deadline=None)
@given(strategies.attention_configs(max_layers=4), strategies.cache_configs())
def test_drawn_configs_make_caches(model, geometry):
    assert 1 <= model.num_layers <= 4
    cache = jax.eval_shape(lambda: v4.init_cache(model, geometry))
    assert cache.geometry == geometry and cache.attn_config == model


@settings(max_examples=hypothesis_examples(100), deadline=None)
@given(st.data(), strategies.cache_configs(max_pages=6, max_slots=3, max_pages_per_seq=3),
       st.integers(1, 200))
def test_request_programs_keep_to_their_geometry(data, geometry, chunk):
    program = data.draw(strategies.request_programs(geometry, chunk=chunk, max_steps=16))
    P = geometry.page_tokens
    live, seen = {}, set()
    for step in program.steps:
        if step.op == "admit":
            (r,) = step.requests
            assert r == len(seen) and len(live) < geometry.max_slots
            live[r] = 0
            seen.add(r)
        elif step.op == "release":
            (r,) = step.requests
            del live[r]
        else:
            assert step.op == "append" and len(set(step.requests)) == len(step.requests) >= 1
            for r, n in zip(step.requests, step.tokens, strict=True):
                assert 1 <= n <= chunk
                live[r] += n  # KeyError: a request appended before admission or after release
                assert live[r] <= geometry.max_seq_len
            assert sum(-(-n // P) for n in live.values()) <= geometry.num_pages
    assert program.lengths == live and program.requests == len(seen)


def test_strategy_arguments_are_checked():
    with pytest.raises(TypeError, match=r"geometry: expected a v4kv_jax CacheConfig; got str"):
        strategies.request_programs("pages")
    with pytest.raises(ValueError, match=r"chunk: expected an integer in \[1, inf\]; got 0"):
        strategies.request_programs(v4.CacheConfig(4, 2, 2), chunk=0)
    with pytest.raises(ValueError, match=r"dtypes: expected one of \('float32', 'bfloat16', "
                                         r"'float16'\); got 'fp8_latent'"):
        strategies.cache_configs(dtypes=("fp8_latent",))
    with pytest.raises(ValueError, match=r"max_layers: expected an integer in \[1, inf\]"):
        strategies.attention_configs(max_layers=0)
