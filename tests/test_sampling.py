"""The one sampling rule (`v4kv_jax.serve.sampling`): filters off draw exactly as the rule before
them, each filter keeps the tokens written here by hand, and the options are checked."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from v4kv_jax.serve.sampling import SamplingParams, row_keys, sample

# Probabilities 0.5, 0.3, 0.15, 0.05 (token order shuffled so sorting matters).
PROBS = np.asarray([0.15, 0.5, 0.05, 0.3])
LOGITS = np.log(PROBS).astype(np.float32)
DRAWS = 512


def _drawn(top_k=0, top_p=1.0, min_p=0.0, temperature=1.0) -> set[int]:
    """The tokens DRAWS rows of LOGITS draw, each with its own key."""
    logits = jnp.broadcast_to(jnp.asarray(LOGITS), (DRAWS, 4))
    keys = row_keys(jnp.broadcast_to(jax.random.PRNGKey(3), (DRAWS, 2)), jnp.arange(DRAWS))
    full = lambda v, dt: jnp.full((DRAWS,), v, dt)  # noqa: E731
    got = jax.jit(sample)(logits, keys, full(temperature, jnp.float32), full(top_k, jnp.int32),
                          full(top_p, jnp.float32), full(min_p, jnp.float32))
    return set(np.asarray(got).tolist())


def test_each_filter_keeps_the_tokens_computed_by_hand():
    assert _drawn() == {0, 1, 2, 3}
    assert _drawn(top_k=1) == {1}
    assert _drawn(top_k=2) == {1, 3}  # 0.5 and 0.3
    assert _drawn(top_k=3) == {0, 1, 3}
    assert _drawn(top_p=0.5) == {1}  # 0.5 alone reaches 0.5
    assert _drawn(top_p=0.7) == {1, 3}  # 0.5 < 0.7, 0.8 >= 0.7
    assert _drawn(top_p=0.9) == {0, 1, 3}  # 0.8 < 0.9, 0.95 >= 0.9
    assert _drawn(min_p=0.3) == {1, 3, 0}  # p >= 0.15
    assert _drawn(min_p=0.4) == {1, 3}  # p >= 0.2
    # top_p on what top_k kept, renormalised: 0.5 / 0.8 = 0.625 >= 0.6
    assert _drawn(top_k=2, top_p=0.6) == {1}
    assert _drawn(top_k=2, top_p=0.7) == {1, 3}
    assert _drawn(temperature=0.0, top_k=3) == {1}  # greedy ignores the filters


def test_without_filters_the_draws_are_those_of_the_rule_before_them():
    """The Engine drew fold_in(fold_in(engine key, request id), draw) per row with
    categorical(logits / temperature): rows without filters still do, bit for bit, next to
    rows with filters."""
    logits = jax.random.normal(jax.random.PRNGKey(0), (6, 40)) * 3
    base = jax.random.PRNGKey(7)
    request, draw = jnp.arange(6) + 11, jnp.asarray([0, 3, 1, 9, 2, 5])
    temperature = jnp.asarray([0.7, 1.0, 0.0, 1.3, 0.5, 2.0], jnp.float32)
    old_keys = jax.vmap(lambda r, i: jax.random.fold_in(jax.random.fold_in(base, r), i))(
        request, draw)
    old = jax.vmap(lambda lg, k, t: jnp.where(
        t > 0, jax.random.categorical(k, lg / jnp.maximum(t, 1e-6)), jnp.argmax(lg)))(
            logits, old_keys, temperature)
    streams = jax.vmap(lambda r: jax.random.fold_in(base, r))(request)
    new = sample(logits, row_keys(streams, draw), temperature)
    np.testing.assert_array_equal(new, old)
    top_k = jnp.asarray([0, 0, 0, 5, 0, 0], jnp.int32)  # row 3 filters: the cond's other side
    mixed = sample(logits, row_keys(streams, draw), temperature, top_k)
    np.testing.assert_array_equal(np.delete(np.asarray(mixed), 3), np.delete(np.asarray(old), 3))


def test_the_options_are_checked_naming_each():
    cases = [
        (dict(temperature=-1.0), ValueError, r"temperature: expected a number in \[0.0, inf\]"),
        (dict(top_k=-2), ValueError, r"top_k: expected an integer in \[0, inf\]; got -2"),
        (dict(top_p=1.5), ValueError, r"top_p: expected a number in \(0.0, 1.0\]; got 1.5"),
        (dict(min_p=2.0), ValueError, r"min_p: expected a number in \[0.0, 1.0\]; got 2.0"),
        (dict(seed=2**32), ValueError, r"seed: expected an integer in \[0, 4294967295\]"),
        (dict(stop="ab"), TypeError, r"stop: expected a sequence of token-id sequences"),
        (dict(stop_token_ids=[True]), TypeError, r"stop_token_ids: expected integer token ids"),
    ]
    for kwargs, error, message in cases:
        with pytest.raises(error, match=message):
            SamplingParams(**kwargs)
    params = SamplingParams(top_k=None, stop_token_ids=np.asarray([3]), stop=[[1, 2], (4,)])
    assert params.top_k == 0 and params.stop_token_ids == (3,) and params.stop == ((1, 2), (4,))
    assert not params.filters and SamplingParams(min_p=0.1).filters
    assert params.finish([5, 1, 2]) == "stop" and params.finish([2, 1]) is None
    assert params.finish([4]) == "stop" and params.finish([3]) == "stop"
    assert SamplingParams(eos_id=3, stop_token_ids=[3]).finish([3]) == "eos"
