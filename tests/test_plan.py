"""The layer plan of both families, and V4.1's config: held to the V4.1 oracle's own derivation
of the plan (written from V41_SPEC.md section 1.2 without the library's code), the spec's
Flash table, and its negative cases."""

from __future__ import annotations

import hypothesis
import hypothesis.strategies as st
import pytest

import v4kv_jax as v4
from v4kv_jax import plan
from v4kv_jax.interop import v41_config_from_hf
from v4kv_jax.testing import v41_oracle as oracle

TINY = dict(hidden_size=64, num_heads=4, head_dim=64, rope_dim=16, q_lora_rank=32, o_groups=2,
            o_lora_rank=16, window=8, index_heads=4, index_head_dim=32)


def _same_plan(ours, theirs) -> None:
    assert len(ours) == len(theirs)
    for p, q in zip(ours, theirs, strict=True):
        assert (p.layer, p.ratio, p.mode, p.entries, p.picks, p.rope) == (
            q.layer, q.ratio, q.mode, q.kv_src, q.idx_src, q.rope), (p, q)
        assert (p.candidates is not None, p.publishes_candidates) == (
            q.uses_candidates, q.is_candidate_source), (p, q)
        assert p.writes_entries == p.writes_keys == (q.mode == "Full")
        assert p.scores == (q.mode in ("Full", "Reindex"))
        assert p.read == ("window" if q.ratio == 0 else "sparse")


def test_flash41_plans_as_the_spec_table_and_the_oracle():
    ours = plan.of(v4.flash41())
    _same_plan(ours, oracle.flash_stack().layer_plan()[:40])
    modes = {p.layer: p.mode for p in ours}
    assert [layer for layer, m in modes.items() if m == "Full"] == [2, 8, 14, 20]
    assert [layer for layer, m in modes.items() if m == "Reindex"] == [24, 28, 32, 36]
    assert [layer for layer, m in modes.items() if m == "SWA"] == [0, 1]
    assert ours[25].picks == 24 and ours[25].entries == 20 and ours[25].keys is None
    assert ours[24].keys == 20 and ours[24].candidates == 20 and ours[20].candidates is None
    assert ours[20].publishes_candidates and not ours[24].publishes_candidates
    assert "| 3-7 | 2 | Reuse | sparse | 2 | 2 | - | - |" in plan.table(v4.flash41())


@pytest.mark.parametrize("config, stack", [
    (v4.tiny41(), oracle.tiny6_stack()),
    (v4.V41Config(**TINY, compress_ratios=(0, 2, 2, 2, 1, 1, 1, 1), kv_source_layers=(1, 4),
                  index_source_layers=(1, 4, 6), candidate_source_layer=4,
                  candidate_topk_blocks=3, candidate_block_size=4, index_topk=6),
     oracle.mini8_stack()),
])
def test_the_spec_test_stacks_plan_as_the_oracle(config, stack):
    _same_plan(plan.of(config), stack.layer_plan())


@st.composite
def stacks(draw):
    n = draw(st.integers(1, 9))
    ratios = draw(st.lists(st.sampled_from((0, 1, 2)), min_size=n, max_size=n))
    layers = st.lists(st.integers(0, n - 1), unique=True, max_size=n).map(sorted)
    kv = draw(layers)
    index = sorted(set(kv) | set(draw(layers)) if draw(st.booleans()) else draw(layers))
    candidate = draw(st.one_of(st.just(-1), st.sampled_from(kv) if kv else st.just(-1),
                               st.integers(0, n - 1)))
    return dict(compress_ratios=tuple(ratios), kv_source_layers=tuple(kv),
                index_source_layers=tuple(index), candidate_source_layer=candidate,
                candidate_topk_blocks=draw(st.integers(1, 4)),
                candidate_block_size=draw(st.integers(1, 4)), index_topk=draw(st.integers(1, 8)))


@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(stacks())
def test_any_stack_is_valid_and_plans_as_the_oracle_says(fields):
    """Two derivations written apart agree: a stack either config rejects, the other
    rejects too, and a valid one plans the same."""
    try:
        config = v4.V41Config(**TINY, **fields)
    except ValueError:
        config = None
    try:
        stack = oracle.V41Stack(
            compress_ratios=fields["compress_ratios"],
            kv_source_layer_ids=fields["kv_source_layers"],
            index_source_layer_ids=fields["index_source_layers"],
            candidate_source_layer_id=fields["candidate_source_layer"],
            candidate_topk_blocks=fields["candidate_topk_blocks"],
            candidate_block_size=fields["candidate_block_size"],
            index_topk=fields["index_topk"], head_dim=64, qk_rope_head_dim=16,
            index_head_dim=32)
    except ValueError:
        stack = None
    assert (config is None) == (stack is None), fields
    if config is not None:
        _same_plan(plan.of(config), stack.layer_plan())


@pytest.mark.parametrize("change, field, words", [
    (dict(kv_source_layers=(1, 3), index_source_layers=(3, 5)), "index_source_layers",
     "without [1]"),
    (dict(compress_ratios=(0, 2, 1, 1, 1, 1)), "compress_ratios[2]", "kv source"),
    (dict(candidate_topk_blocks=1), "candidate_topk_blocks", "index_topk=4"),
    (dict(compress_ratios=(0, 0, 2, 1, 1, 1)), "kv_source_layers", "nonzero"),
    (dict(compress_ratios=(0, 4, 4, 128, 128, 128)), "compress_ratios", "use AttentionConfig"),
    (dict(candidate_source_layer=5), "candidate_source_layer", "a kv source"),
    (dict(kv_source_layers=(3,), index_source_layers=(3, 5)), "kv_source_layers",
     "first nonzero-ratio layer (1)"),
    (dict(kv_source_layers=(3, 1)), "kv_source_layers", "increasing order"),
    (dict(window=0), "window", "[1, inf]; got 0"),
])
def test_a_bad_v41_config_names_the_field_and_both_values(change, field, words):
    with pytest.raises(ValueError) as err:
        v4.tiny41(**change)
    assert field in str(err.value) and words in str(err.value), str(err.value)


def test_a_v4_config_plans_each_kind_on_its_own_entries():
    config = v4.tiny()
    for p, kind in zip(plan.of(config), config.layer_kinds, strict=True):
        assert p.mode == kind.name
        if kind == v4.LayerKind.SWA:
            assert (p.read, p.entries, p.ratio, p.rope) == ("window", None, 0, "base")
        else:
            assert (p.entries, p.writes_entries, p.rope) == (p.layer, True, "compress")
            assert p.ratio == config.ratio(kind)
            csa = kind == v4.LayerKind.CSA
            assert (p.read, p.picks, p.keys, p.writes_keys) == (
                ("sparse", p.layer, p.layer, True) if csa else ("dense", None, None, False))
    with pytest.raises(TypeError, match="config.*AttentionConfig or a V41Config.*dict"):
        plan.of({})


def _text_config() -> dict:
    return dict(num_hidden_layers=40, hidden_size=5120, num_attention_heads=64, head_dim=512,
                qk_rope_head_dim=64, q_lora_rank=1280, o_groups=8, o_lora_rank=1024,
                sliding_window=128, rms_norm_eps=1e-20, rope_theta=10000,
                compress_rope_theta=160000, compress_ratios=list(oracle.FLASH_RATIOS),
                rope_scaling=dict(type="yarn", factor=16, original_max_position_embeddings=65536,
                                  beta_fast=32, beta_slow=1),
                kv_source_layer_ids=[2, 8, 14, 20],
                index_source_layer_ids=[2, 8, 14, 20, 24, 28, 32, 36],
                candidate_source_layer_id=20, candidate_topk_blocks=2048,
                candidate_block_size=8, index_n_heads=32, index_head_dim=128, index_topk=512)


def test_the_hf_config_of_v41_flash_reads_as_flash41():
    text = _text_config()
    assert v41_config_from_hf({"model_type": "deepseek_v41", "text_config": text}) == (
        v4.flash41())
    assert v41_config_from_hf(text) == v4.flash41()
    assert v41_config_from_hf(text, index_topk=256).index_topk == 256
    assert v41_config_from_hf({**text, "rope_scaling": None}).yarn_factor == 1.0
    _same_plan(plan.of(v41_config_from_hf(text)),
               oracle.V41Stack.from_text_config(text).layer_plan()[:40])


@pytest.mark.parametrize("change, error, words", [
    (dict(kv_source_layer_ids=None), TypeError, "kv_source_layer_ids.*list of layer indices"),
    (dict(index_n_heads="32"), TypeError, "index_n_heads.*integer"),
    (dict(compress_ratios=[0, 0, 2]), ValueError, "compress_ratios.*num_hidden_layers=40"),
    (dict(kv_source_layer_ids=[2, 8, 14]), ValueError, r"compress_ratios\[20\].*kv source"),
])
def test_a_bad_v41_hf_config_names_the_entry(change, error, words):
    with pytest.raises(error, match=words):
        v41_config_from_hf({**_text_config(), **change})
    text = _text_config()
    del text["index_topk"]
    with pytest.raises(ValueError, match="config.*'index_topk'"):
        v41_config_from_hf(text)
