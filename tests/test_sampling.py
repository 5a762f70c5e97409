"""The one sampling rule (`v4kv_jax.serve.sampling`): filters off draw exactly as the rule before
them, each filter keeps the tokens written here by hand, and the options are checked."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from v4kv_jax.serve.sampling import (
    MAX_LOGPROBS,
    SamplingParams,
    penalize,
    row_keys,
    sample,
    token_logprobs,
)

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


# --- a numpy reimplementation of the rules, for this file and the serving tests -----------


def np_penalize(logits, prompt, generated, repetition=1.0, presence=0.0, frequency=0.0):
    """One row's logits with the penalties: a token of the prompt or the output has its
    logit divided by `repetition` where positive, multiplied where not; a token generated
    c times loses presence (once) and frequency * c."""
    out = np.asarray(logits, np.float64).copy()
    counts = np.bincount(np.asarray(generated, np.int64), minlength=out.size)
    seen = counts > 0
    seen[np.asarray(prompt, np.int64)] = True
    out[seen] = np.where(out[seen] > 0, out[seen] / repetition, out[seen] * repetition)
    return out - presence * (counts > 0) - frequency * counts


def np_logprobs(logits, token, k):
    """(log-probability of `token`, the k most likely (token, log-probability)) under
    softmax(logits)."""
    x = np.asarray(logits, np.float64)
    lp = x - x.max() - np.log(np.sum(np.exp(x - x.max())))
    top = np.argsort(-lp, kind="stable")[:k]
    return lp[token], [(int(t), lp[t]) for t in top]


def np_kept(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> set[int]:
    """The tokens the filters keep: the k largest logits, then the smallest set of the largest
    whose probability (renormalised over what top_k kept) reaches top_p, then those at least
    min_p times as likely as the most likely; ties with the last kept logit are kept."""
    x = np.asarray(logits, np.float64) / temperature
    order = np.argsort(-x, kind="stable")
    ranked = x[order]
    keep = np.ones(x.size, bool) if top_k <= 0 else np.arange(x.size) < top_k
    p = np.where(keep, np.exp(ranked - ranked[0]), 0.0)
    p /= p.sum()
    before = np.cumsum(p) - p
    if top_p < 1.0:
        keep &= before < top_p
    keep &= p >= min_p * p[0]
    last = ranked[np.flatnonzero(keep)[-1]]
    return set(np.flatnonzero(x >= last).tolist())


def test_penalties_and_logprobs_match_the_numpy_rules():
    """`penalize` and `token_logprobs` on random rows, each with its own penalties (rows
    with every penalty off among them), against the numpy rules; greedy draws take the
    argmax of the penalised logits."""
    rng = np.random.default_rng(4)
    B, V = 6, 30
    logits = rng.normal(0.0, 3.0, (B, V)).astype(np.float32)
    prompts = [rng.integers(0, V, rng.integers(1, 12)) for _ in range(B)]
    outputs = [rng.integers(0, V, rng.integers(0, 15)) for _ in range(B)]
    repetition = np.asarray([1.0, 1.3, 0.7, 1.0, 2.0, 1.0], np.float32)
    presence = np.asarray([0.0, 0.5, 0.0, -0.4, 1.0, 0.0], np.float32)
    frequency = np.asarray([0.0, 0.25, 0.1, 0.0, -0.3, 0.0], np.float32)
    counts = np.stack([np.bincount(o, minlength=V) for o in outputs]).astype(np.int32)
    in_prompt = np.zeros((B, V), bool)
    for b, p in enumerate(prompts):
        in_prompt[b, p] = True
    got = np.asarray(penalize(jnp.asarray(logits), jnp.asarray(counts), jnp.asarray(in_prompt),
                              jnp.asarray(repetition), jnp.asarray(presence),
                              jnp.asarray(frequency)))
    want = np.stack([np_penalize(logits[b], prompts[b], outputs[b], repetition[b],
                                 presence[b], frequency[b]) for b in range(B)])
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)
    np.testing.assert_array_equal(got[[0, 5]], logits[[0, 5]])  # penalties off: unchanged
    assert not np.allclose(got[1:5], logits[1:5])
    greedy = sample(jnp.asarray(got), row_keys(jnp.zeros((B, 2), jnp.uint32), 0),
                    jnp.zeros((B,), jnp.float32))
    np.testing.assert_array_equal(greedy, np.argmax(want, axis=1))

    tokens = rng.integers(0, V, B).astype(np.int32)
    chosen, top_ids, top_lp = token_logprobs(jnp.asarray(logits), jnp.asarray(tokens))
    assert top_ids.shape == (B, MAX_LOGPROBS)
    for b in range(B):
        lp, top = np_logprobs(logits[b], tokens[b], MAX_LOGPROBS)
        np.testing.assert_allclose(chosen[b], lp, atol=1e-5)
        assert np.asarray(top_ids[b]).tolist() == [t for t, _ in top]
        np.testing.assert_allclose(top_lp[b], [v for _, v in top], atol=1e-5)


FILTERS = [  # (top_k, top_p, min_p) of the rows, in turn; (0, 1.0, 0.0) is unfiltered
    (1, 1.0, 0.0), (0, 1.0, 0.0), (0, 0.7, 0.0), (0, 1.0, 0.0), (0, 1.0, 0.4), (2, 0.6, 0.0),
    (0, 1.0, 0.0), (3, 1.0, 0.0)]


def test_each_filter_applies_to_its_own_row_of_a_mixed_batch():
    """One batch whose rows take the filters of FILTERS in turn (filtered rows next to rows
    with no filter): the tokens each kind of row draws, over DRAWS rows of it, are the ones
    the numpy rule keeps for its own filter, and an unfiltered row draws every token."""
    kinds = len(FILTERS)
    rows = kinds * DRAWS
    logits = jnp.broadcast_to(jnp.asarray(LOGITS), (rows, 4))
    keys = row_keys(jnp.broadcast_to(jax.random.PRNGKey(9), (rows, 2)), jnp.arange(rows))
    pick = np.arange(rows) % kinds
    top_k, top_p, min_p = (np.asarray([f[i] for f in FILTERS])[pick] for i in range(3))
    got = np.asarray(jax.jit(sample)(
        logits, keys, jnp.ones((rows,), jnp.float32), jnp.asarray(top_k, jnp.int32),
        jnp.asarray(top_p, jnp.float32), jnp.asarray(min_p, jnp.float32)))
    for kind, (k, p, m) in enumerate(FILTERS):
        drawn = set(got[pick == kind].tolist())
        assert drawn == np_kept(LOGITS, top_k=k, top_p=p, min_p=m), FILTERS[kind]
    assert np_kept(LOGITS) == {0, 1, 2, 3}


def test_the_new_options_are_checked_naming_each():
    cases = [
        (dict(n=0), ValueError, r"n: expected an integer in \[1, inf\]; got 0"),
        (dict(logprobs=21), ValueError, r"logprobs: expected an integer in \[0, 20\]; got 21"),
        (dict(logprobs=-1), ValueError, r"logprobs: expected an integer in \[0, 20\]; got -1"),
        (dict(repetition_penalty=0.0), ValueError,
         r"repetition_penalty: expected a number in \(0.0, inf\]; got 0.0"),
        (dict(repetition_penalty=-1.2), ValueError,
         r"repetition_penalty: expected a number in \(0.0, inf\]; got -1.2"),
        (dict(presence_penalty=float("nan")), ValueError,
         r"presence_penalty: expected a finite number; got nan"),
        (dict(frequency_penalty="1"), TypeError,
         r"frequency_penalty: expected a real number; got '1'"),
    ]
    for kwargs, error, message in cases:
        with pytest.raises(error, match=message):
            SamplingParams(**kwargs)
    with pytest.raises(ValueError, match=r"logprobs: expected at most 8 \(vocab_size\); got 10"):
        SamplingParams(logprobs=10).check_vocab(8)
    assert SamplingParams(presence_penalty=-0.5).penalizes
    assert not SamplingParams(logprobs=3, n=4).penalizes
