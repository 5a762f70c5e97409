"""The NNX decoder and its jitted generation loop: layer groups, chunking invariance, greedy
generation against a recompute-everything reference, compile-once, sampling, errors."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import v4kv_jax as v4
from v4kv_jax import interop
from v4kv_jax.config import LayerKind
from v4kv_jax.nn import Decoder, ModelConfig, V4Attention, layer_groups
from v4kv_jax.nn.model import MLP
from v4kv_jax.serve import Generator, forward
from v4kv_jax.serve.sampling import row_keys, sample, sample_stream

from test_sampling import np_logprobs, np_penalize

MODEL = v4.tiny(index_heads=16)  # all three kinds; enough indexer heads to avoid score ties
CONFIG = ModelConfig(MODEL, vocab_size=48, mlp_hidden=80)
GEOMETRY = v4.CacheConfig(num_pages=12, max_slots=3, max_pages_per_seq=2)
MAX_PROMPT, MAX_NEW, CHUNK = 90, 12, 32


@pytest.fixture(scope="module")
def model():
    return Decoder(CONFIG, rngs=nnx.Rngs(0), bias_scale=0.5)


@pytest.fixture(scope="module")
def generator(model):
    return Generator(model, GEOMETRY, max_prompt_len=MAX_PROMPT, max_new_tokens=MAX_NEW,
                     prefill_chunk=CHUNK)


def _prompts(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, CONFIG.vocab_size, n).tolist() for n in lengths]


def test_layer_groups_of_the_presets():
    S, C, H = LayerKind.SWA, LayerKind.CSA, LayerKind.HCA
    flash = layer_groups(v4.flash().layer_kinds)
    assert [(g.first, g.pattern, g.repeats) for g in flash] == [
        (0, (S,), 2), (2, (C, H), 20), (42, (C,), 1)]
    pro = layer_groups(v4.pro().layer_kinds)
    assert [(g.first, g.pattern, g.repeats) for g in pro] == [
        (0, (H,), 2), (2, (C, H), 29), (60, (C,), 1)]
    assert [(g.pattern, g.repeats) for g in layer_groups([S, C, H, S])] == [
        ((S,), 1), ((C,), 1), ((H,), 1), ((S,), 1)]
    for kinds in (v4.flash().layer_kinds, v4.pro().layer_kinds, MODEL.layer_kinds):
        covered = [i for g in layer_groups(kinds) for j in range(len(g.pattern))
                   for i in g.layers(j)]
        assert sorted(covered) == list(range(len(kinds)))


def test_stacked_params_follow_the_groups(model):
    # tiny: SWA, then (CSA, HCA) x 2: the CSA block's leaves are stacked over 2 repeats.
    assert [(g.pattern, g.repeats) for g in model.layout] == [
        ((LayerKind.SWA,), 1), ((LayerKind.CSA, LayerKind.HCA), 2)]
    csa = model.groups[1][0]
    assert csa.attn.q_a_proj[...].shape == (2, MODEL.q_lora_rank, MODEL.hidden_size)
    assert csa.attn.indexer.compressor.ape[...].shape == (2, MODEL.csa_ratio,
                                                           2 * MODEL.index_head_dim)
    a, b = interop.attention_state(model, layer=1), interop.attention_state(model, layer=3)
    assert not np.allclose(a["q_a_proj"], b["q_a_proj"])  # distinct random layers


def _fresh_cache(slots):
    cache = v4.init_cache(MODEL, GEOMETRY)
    for s in range(slots):
        cache = v4.reset_slot(cache, s)
    return cache


def test_chunked_prefill_and_decode_match_one_shot(model):
    graphdef, params = nnx.split(model)
    tokens = np.asarray(_prompts([70, 70], seed=1), np.int32)
    _, full = forward(graphdef, params, _fresh_cache(2), jnp.asarray(tokens), jnp.arange(2),
                      jnp.asarray([70, 45]))
    full = np.asarray(full)
    cache, pieces, done = _fresh_cache(2), [], np.zeros(2, int)
    for n in ([30, 20], [32, 25], [8, 0]):
        chunk = np.zeros((2, 32), np.int32)
        for b in range(2):
            chunk[b, :n[b]] = tokens[b, done[b]:done[b] + n[b]]
        cache, lg = forward(graphdef, params, cache, jnp.asarray(chunk), jnp.arange(2),
                            jnp.asarray(n))
        pieces.append((np.asarray(lg), list(n), done.copy()))
        done += n
    for lg, n, start in pieces:
        for b in range(2):
            np.testing.assert_allclose(lg[b, :n[b]], full[b, start[b]:start[b] + n[b]],
                                       atol=2e-5)


def _greedy_reference(model, prompt, steps):
    """Greedy tokens by recomputing the whole sequence in one prefill per new token."""
    graphdef, params = nnx.split(model)
    seq = list(prompt)
    for _ in range(steps):
        buf = np.zeros((1, MAX_PROMPT + MAX_NEW), np.int32)
        buf[0, :len(seq)] = seq
        _, lg = forward(graphdef, params, _fresh_cache(1), jnp.asarray(buf), jnp.arange(1),
                        jnp.asarray([len(seq)]))
        seq.append(int(np.argmax(np.asarray(lg)[0, len(seq) - 1])))
    return seq[len(prompt):]


def test_greedy_generation_matches_recomputing_everything(model, generator):
    prompts = _prompts([5, 77, 33])
    out = generator.generate(prompts)
    assert out.tokens.shape == (3, MAX_NEW)
    for prompt, got in zip(prompts, out.as_lists(), strict=True):
        assert got == _greedy_reference(model, prompt, MAX_NEW)


def test_generation_compiles_once_for_every_length_and_batch(generator):
    before = Generator.compiled_programs()
    generator.generate(_prompts([1]))
    for lengths in ([90, 2, 40], [33, 64], [17, 17, 17]):
        generator.generate(_prompts(lengths, seed=len(lengths)), temperature=0.7, seed=3)
    assert Generator.compiled_programs() - before <= 1


def test_rows_are_independent_of_their_batch(generator):
    prompts = _prompts([60, 9, 31], seed=5)
    together = generator.generate(prompts).as_lists()
    for b, p in enumerate(prompts):
        assert generator.generate([p]).as_lists()[0] == together[b]


def test_sampling_is_seeded_and_stays_in_the_vocabulary(generator):
    prompts = _prompts([12, 50], seed=2)
    a = generator.generate(prompts, temperature=1.0, seed=11)
    b = generator.generate(prompts, temperature=1.0, seed=11)
    c = generator.generate(prompts, temperature=1.0, seed=12)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert not np.array_equal(a.tokens, c.tokens)
    assert a.tokens.min() >= 0 and a.tokens.max() < CONFIG.vocab_size


def test_eos_ends_a_row(generator):
    prompts = _prompts([20, 40], seed=4)
    free = generator.generate(prompts).as_lists()
    eos = free[0][3]
    out = generator.generate(prompts, eos_id=eos)
    row = out.as_lists()[0]
    assert row == free[0][:free[0].index(eos) + 1]
    assert out.lengths[0] == len(row) and (out.tokens[0, len(row):] == -1).all()
    if eos in free[1]:
        assert out.as_lists()[1] == free[1][:free[1].index(eos) + 1]
    else:
        assert out.as_lists()[1] == free[1]


def test_generation_fills_the_cache(generator):
    generator.generate(_prompts([90, 10]))
    lengths = np.asarray(generator.cache.state.lengths)[:2]
    # prompt + every generated token but the last is in the cache
    np.testing.assert_array_equal(lengths, [90 + MAX_NEW - 1, 10 + MAX_NEW - 1])
    report = generator.memory_report()
    assert report.pages_used == 2  # 101 and 21 tokens: one 128-token page each
    assert report.entry_bytes > 0


def test_bad_requests_are_clear_errors(model, generator):
    with pytest.raises(ValueError, match=r"prompts\[1\]: expected 1 to 90 tokens .*got 91"):
        generator.generate(_prompts([3, 91]))
    with pytest.raises(ValueError, match=r"prompts: expected 1 to 3 prompts .*got 4"):
        generator.generate(_prompts([3, 3, 3, 3]))
    with pytest.raises(ValueError, match=r"prompts\[0\]: expected token ids in \[0, 48\) "
                                         r"\(vocab_size\); got 48 at position 1"):
        generator.generate([[1, 48]])
    with pytest.raises(ValueError, match=r"max_new_tokens: expected at most 7 for "
                                         r"max_prompt_len=250 \(max_prompt_len \+ max_new_tokens "
                                         r"- 1 <= max_seq_len=256\); got 8"):
        Generator(model, GEOMETRY, max_prompt_len=250, max_new_tokens=8)
    Generator(model, GEOMETRY, max_prompt_len=250, max_new_tokens=7)  # the Engine's rule


def test_pool_exhaustion_is_reported(model):
    small = v4.CacheConfig(num_pages=2, max_slots=3, max_pages_per_seq=2)
    gen = Generator(model, small, max_prompt_len=MAX_PROMPT, max_new_tokens=2,
                    prefill_chunk=CHUNK)
    with pytest.raises(RuntimeError, match=r"prompts \[2\] could not append \(\['OUT_OF_PAGES'\]"):
        gen.generate(_prompts([10, 10, 10]))


def _rms(x, w=None, eps=MODEL.rms_eps):
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return y if w is None else y * w


def _first_token_logits(model: Decoder, token: int) -> np.ndarray:
    """f64[V]: logits of a sequence's first token, recomputed in numpy from the SPEC's formulas.

    At position 0 RoPE is the identity and no compressed entry exists, so every layer attends
    to the token's own window vector and the sink alone.
    """
    H, hd, g = MODEL.num_heads, MODEL.head_dim, MODEL.o_groups

    def f64(param, r):
        return np.asarray(param[...] if r is None else param[...][r], np.float64)

    embed = f64(model.embed, None)
    x = embed[token]
    for layer in range(MODEL.num_layers):
        block, r = model.block_of(layer)
        p = {k: np.asarray(v, np.float64)
             for k, v in interop.attention_state(model, layer=layer).items()}
        h = _rms(x, f64(block.attn_norm, r))
        q = _rms((p["q_b_proj"] @ _rms(p["q_a_proj"] @ h, p["q_a_norm"])).reshape(H, hd))
        kv = _rms(p["kv_proj"] @ h, p["kv_norm"])
        logit = q @ kv * hd**-0.5
        weight = np.exp(logit) / (np.exp(logit) + np.exp(p["sinks"]))  # [H]
        o = (weight[:, None] * kv).reshape(g, -1)  # g contiguous groups of H / g heads
        rank = p["o_a_proj"].shape[0] // g
        y = np.concatenate([p["o_a_proj"][j * rank:(j + 1) * rank] @ o[j] for j in range(g)])
        x = x + p["o_b_proj"] @ y
        if block.mlp is not None:
            h = _rms(x, f64(block.mlp_norm, r))
            gate, up, down = (f64(w, r) for w in (block.mlp.gate_proj, block.mlp.up_proj,
                                                   block.mlp.down_proj))
            silu = gate @ h / (1.0 + np.exp(-(gate @ h)))
            x = x + down @ (silu * (up @ h))
    return embed @ _rms(x, f64(model.norm, None))


def test_logits_of_tied_embeddings_match_numpy():
    tied = Decoder(ModelConfig(MODEL, vocab_size=16, mlp_hidden=24, tie_embeddings=True),
                   rngs=nnx.Rngs(1), bias_scale=0.5)
    assert tied.lm_head is None
    rng = np.random.default_rng(0)
    for layer in range(MODEL.num_layers):  # norm weights away from 1, so that each one counts
        interop.set_norms(tied, layer=layer,
                          attn_norm=1 + 0.3 * rng.standard_normal(MODEL.hidden_size),
                          mlp_norm=1 + 0.3 * rng.standard_normal(MODEL.hidden_size))
        params = interop.attention_state(tied, layer=layer)
        for name in ("q_a_norm", "kv_norm"):
            params[name] = 1 + 0.3 * rng.standard_normal(params[name].shape)
        interop.load_attention(tied, params, layer=layer)
    tied.norm[...] = jnp.asarray(1 + 0.3 * rng.standard_normal(MODEL.hidden_size))
    graphdef, params = nnx.split(tied)
    _, lg = forward(graphdef, params, _fresh_cache(1), jnp.asarray([[5, 11, 5, 2]], jnp.int32),
                    jnp.arange(1), jnp.asarray([4]))
    assert lg.shape == (1, 4, 16)
    assert jax.tree.leaves(params)  # params are plain arrays once split
    want = _first_token_logits(tied, 5)
    np.testing.assert_allclose(lg[0, 0], want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_mlp_is_down_of_silu_gate_times_up_by_hand():
    mlp = MLP(2, 3, rngs=nnx.Rngs(0))
    mlp.gate_proj[...] = jnp.asarray([[1.0, 0.0], [0.0, -0.5], [0.5, 0.5]])
    mlp.up_proj[...] = jnp.asarray([[1.0, 1.0], [2.0, 0.0], [0.0, -1.0]])
    mlp.down_proj[...] = jnp.asarray([[1.0, 0.0, 1.0], [0.0, 1.0, -2.0]])
    # x = (1, -2): gate x = (1, 1, -0.5), up x = (-1, 2, 2).
    # silu(1) = 1 / (1 + e^-1) = 0.7310585786300049, silu(-0.5) = -0.1887703343990727, so
    # h = (-0.7310585786300049, 1.4621171572600098, -0.3775406687981454) and
    # down h = (h0 + h2, h1 - 2 h2). (silu on the up branch would give (-1.1497, 3.5232).)
    got = mlp(jnp.asarray([[1.0, -2.0]]))
    np.testing.assert_allclose(got, [[-1.1085992474281503, 2.2171984948563006]], rtol=1e-6)


def test_output_projection_equals_the_grouped_formula():
    """SPEC section 6 in float64: group j of the heads' outputs goes through rows
    j*R .. (j+1)*R - 1 of W_oa, the groups' results are concatenated and go through W_ob.
    The reference and the Flax modules share this one projection."""
    from v4kv_jax.ops.attention import output_projection

    rng = np.random.default_rng(0)
    H, hd, g, R, D = MODEL.num_heads, MODEL.head_dim, MODEL.o_groups, MODEL.o_lora_rank, 24
    o = rng.standard_normal((2, 3, H, hd))
    w_oa = rng.standard_normal((g * R, H * hd // g))
    w_ob = rng.standard_normal((D, g * R))
    flat = o.reshape(2, 3, g, H * hd // g)
    y = np.concatenate([flat[:, :, j] @ w_oa[j * R:(j + 1) * R].T for j in range(g)], -1)
    want = y @ w_ob.T
    got = output_projection(*(jnp.asarray(x, jnp.float32) for x in (o, w_oa, w_ob)), g)
    assert got.shape == (2, 3, D) and got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    # The layout V4Attention stores: group blocks [g, H hd / g, R] and W_ob transposed.
    stored = (o, w_oa.reshape(g, R, -1).swapaxes(1, 2), w_ob.T)
    got = output_projection(*(jnp.asarray(x, jnp.float32) for x in stored), g, layout="in_out")
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match=r"layout: expected one of \('out_in', 'in_out'\); "
                                         r"got 'io'"):
        output_projection(*stored, g, layout="io")


def test_projection_views_read_and_write_the_stored_weights():
    """Every named projection of a layer is a view of its stored [in, out] weights: writing
    one changes exactly its part of the stored weight, reading it back gives what was
    written, stacked layers included; a wrong shape or index is refused by name."""
    rng = np.random.default_rng(0)
    for kind in LayerKind:
        layer = V4Attention(MODEL, kind, rngs=nnx.Rngs(0))
        before = {k: np.asarray(v) for k, v in interop.attention_state(layer).items()}
        for path, value in before.items():
            new = rng.standard_normal(value.shape).astype(np.float32)
            layer.weight(path)[...] = new
            after = interop.attention_state(layer)
            np.testing.assert_array_equal(after[path], new)
            for other, was in before.items():
                if other != path:
                    np.testing.assert_array_equal(after[other], was, err_msg=other)
            before[path] = new
    view = layer.weight("q_a_proj")
    with pytest.raises(ValueError, match=r"value: expected an array of shape \(\d+, \d+\); "
                                         r"got shape \(3,\)"):
        view[...] = np.zeros(3, np.float32)
    with pytest.raises(TypeError, match="index: expected ... "):
        view[0]
    with pytest.raises(ValueError, match=r"path: expected a param path of the V4Attention \(it "
                                         r"has no 'x_proj'\)"):
        layer.weight("x_proj")


def test_unrolled_layers_hold_one_block_per_layer(model):
    unrolled = Decoder(CONFIG, rngs=nnx.Rngs(0), scan_layers=False)
    assert [(g.first, g.repeats) for g in unrolled.layout] == [(i, 1) for i in range(5)]
    assert unrolled.groups[1][0].attn.q_a_proj[...].shape == (MODEL.q_lora_rank,
                                                               MODEL.hidden_size)
    for layer in range(MODEL.num_layers):
        interop.load_attention(unrolled, interop.attention_state(model, layer=layer),
                               layer=layer)
        np.testing.assert_array_equal(interop.attention_state(unrolled, layer=layer)["sinks"],
                                      interop.attention_state(model, layer=layer)["sinks"])
    with pytest.raises(ValueError, match=r"layer 2 has no MLP"):
        interop.set_norms(Decoder(ModelConfig(MODEL, vocab_size=8), rngs=nnx.Rngs(0)), layer=2,
                          mlp_norm=1.0)


def test_demo_generation_step_prints_tokens_per_second(capsys):
    import argparse

    from v4kv_jax import cli

    args = argparse.Namespace(vocab=32, seed=0, new_tokens=5, pages=8, chunk=32, unroll=True)
    cli.generate(MODEL, np.asarray([40, 7]), args)
    out = capsys.readouterr().out
    assert "2 prompts of [40, 7] tokens, 5 new tokens each" in out
    assert len([line for line in out.splitlines() if " -> [" in line]) == 2
    assert re.search(r"Generation: [\d,]+ tokens/s end to end \(10 new tokens", out)
    # Step 1 prefills 32 of req0's 40 tokens (nothing to show) and draws req1's first token.
    assert re.search(r"\n      step 1: req1 \+\[\d+\]\n", out)
    assert re.search(r"\n      step 6: req0 \+\[\d+\] \(length\)\n", out)
    assert "Streamed tokens equal the generated ones: yes" in out


def test_shape_and_config_mismatches_name_the_argument(model):
    graphdef, params = nnx.split(model)
    with pytest.raises(ValueError, match=r"tokens: expected .*\[B, T\].*got shape \(4,\)"):
        forward(graphdef, params, _fresh_cache(1), jnp.zeros((4,), jnp.int32), jnp.arange(1),
                jnp.asarray([4]))
    other = v4.init_cache(v4.tiny(index_heads=8), GEOMETRY)
    with pytest.raises(ValueError, match="cache: expected a cache built for the model's attention"):
        forward(graphdef, params, other, jnp.zeros((1, 4), jnp.int32), jnp.arange(1),
                jnp.asarray([4]))
    from v4kv_jax.nn import V4Attention

    layer = V4Attention(MODEL, LayerKind.SWA, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"x has shape \(1, 2, 7\); expected \[B, T, "
                                         r"hidden_size=64\]"):
        layer.vectors(jnp.zeros((1, 2, 7)), jnp.zeros((1, 2), jnp.int32))


def test_stops_lengths_and_completions(generator):
    prompts = _prompts([20, 40, 7], seed=6)
    free = generator.generate(prompts)
    rows = free.as_lists()
    assert [c.tokens for c in free] == rows and free.finish_reasons == ["length"] * 3
    assert [c.prompt_ids for c in free] == prompts
    out = generator.generate(prompts, stop_token_ids=[rows[0][2]], stop=[rows[1][1:3]])
    assert out[0].tokens == rows[0][:rows[0].index(rows[0][2]) + 1]
    assert out[0].finish_reason == "stop"
    assert out[1].tokens == rows[1][:3] and out[1].finish_reason == "stop"  # cut on the host
    assert out.lengths[1] == 3 and (out.tokens[1, 3:] == -1).all()
    short = generator.generate(prompts, 2)
    assert short.as_lists() == [r[:2] for r in rows] and short.finish_reasons == ["length"] * 3
    a = generator.generate(prompts[:1], temperature=1.0, top_k=5, top_p=0.9, seed=8)
    b = generator.generate([prompts[2], prompts[0]], temperature=1.0, top_k=5, top_p=0.9,
                           seed=8)
    assert a[0].tokens == b[1].tokens  # a seed: the same row whatever the batch


def _reference(model, prompt, steps, penalties, *, key=None, temperature=0.0, top_k=0):
    """Tokens and their logits by recomputing the whole sequence per new token, each drawn by
    the numpy penalty rule (`test_sampling.np_penalize`) then argmax (no `key`) or `sample`
    with fold_in(key, i)."""
    graphdef, params = nnx.split(model)
    seq, logits = list(prompt), []
    for i in range(steps):
        buf = np.zeros((1, MAX_PROMPT + MAX_NEW), np.int32)
        buf[0, :len(seq)] = seq
        _, lg = forward(graphdef, params, _fresh_cache(1), jnp.asarray(buf), jnp.arange(1),
                        jnp.asarray([len(seq)]))
        logits.append(np.asarray(lg)[0, len(seq) - 1])
        scores = np_penalize(logits[-1], prompt, seq[len(prompt):], *penalties)
        if key is None:
            seq.append(int(np.argmax(scores)))
        else:
            seq.append(int(sample(jnp.asarray(scores, jnp.float32)[None], row_keys(key[None], i),
                                  jnp.full((1,), temperature, jnp.float32),
                                  jnp.full((1,), top_k, jnp.int32))[0]))
    return seq[len(prompt):], logits


def test_penalties_logprobs_and_samples_follow_the_numpy_rules(model, generator):
    """Greedy rows with penalties (changing the tokens of prompts of few distinct tokens)
    and n = 3 sampled samples of one prompt, each with its own stream, against the numpy
    rule over recomputed logits; logprobs are log_softmax of those logits; one compiled
    program serves calls with and without the options."""
    prompts = [[4, 9, 4, 9, 4, 30, 4], [7] * 40 + [2, 7]]
    generator.generate(prompts)
    traces = generator.traces
    penalties = (1.6, 0.5, 0.3)
    names = dict(repetition_penalty=1.6, presence_penalty=0.5, frequency_penalty=0.3)
    plain = generator.generate(prompts, 5)
    out = generator.generate(prompts, 5, logprobs=4, **names)
    assert plain.logprobs is None and plain[0].logprobs is None
    assert out.as_lists() != plain.as_lists()
    for b, prompt in enumerate(prompts):
        tokens, logits = _reference(model, prompt, 5, penalties)
        assert out[b].tokens == tokens
        for i, token in enumerate(tokens):
            lp, top = np_logprobs(logits[i], token, 4)
            np.testing.assert_allclose(out[b].logprobs[i], lp, atol=1e-4)
            assert [t for t, _ in out[b].top_logprobs[i]] == [t for t, _ in top]
            np.testing.assert_allclose(out.top_logprobs[b, i], [v for _, v in top], atol=1e-4)
    samples = generator.generate(prompts[:1], 3, n=3, temperature=1.0, top_k=6, seed=13,
                                 logprobs=0, **names)
    assert [c.sample_index for c in samples] == [0, 1, 2] and samples.top_ids.shape[-1] == 0
    assert len({tuple(c.tokens) for c in samples}) == 3
    for j, c in enumerate(samples):
        key = sample_stream(jax.random.PRNGKey(13), j)
        tokens, _ = _reference(model, prompts[0], 3, penalties, key=key, temperature=1.0,
                               top_k=6)
        assert c.tokens == tokens and c.prompt_ids == prompts[0]
    assert generator.traces == traces
    with pytest.raises(ValueError, match=r"n: expected at most 1 for 2 prompts "
                                         r"\(len\(prompts\) \* n <= 3 rows: max_slots\); got 2"):
        generator.generate(prompts, n=2)
    with pytest.raises(ValueError, match=r"presence_penalty: expected a finite number; got inf"):
        generator.generate(prompts, presence_penalty=float("inf"))
