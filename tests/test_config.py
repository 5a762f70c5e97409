import dataclasses

import jax
import jax.numpy as jnp
import pytest

import v4kv_jax as v4
from v4kv_jax.config import LayerKind


def test_flash_preset_matches_spec():
    c = v4.flash()
    assert c.num_layers == 43
    assert c.layer_kinds[:2] == (LayerKind.SWA, LayerKind.SWA)
    assert c.num_csa == 21 and c.num_hca == 20
    assert all(c.layer_kinds[i] == LayerKind.CSA for i in range(2, 43, 2))
    assert all(c.layer_kinds[i] == LayerKind.HCA for i in range(3, 43, 2))
    assert (c.hidden_size, c.num_heads, c.head_dim, c.rope_dim) == (4096, 64, 512, 64)
    assert (c.q_lora_rank, c.o_groups, c.o_lora_rank) == (1024, 8, 1024)
    assert (c.index_heads, c.index_head_dim, c.index_topk) == (64, 128, 512)
    assert (c.window, c.csa_ratio, c.hca_ratio) == (128, 4, 128)


def test_pro_preset_matches_spec():
    c = v4.pro()
    assert c.num_layers == 61
    assert c.layer_kinds[:2] == (LayerKind.HCA, LayerKind.HCA)
    assert c.num_csa == 30 and c.num_hca == 31
    assert (c.hidden_size, c.num_heads, c.q_lora_rank) == (7168, 128, 1536)
    assert (c.o_groups, c.o_lora_rank, c.index_topk) == (16, 1024, 1024)


def test_official_compress_ratios_drop_the_mtp_entry():
    ratios = list(v4.flash().compress_ratios) + [0]
    c = v4.AttentionConfig.from_compress_ratios(
        ratios, num_layers=43, **{f.name: getattr(v4.flash(), f.name)
                                  for f in dataclasses.fields(v4.AttentionConfig)
                                  if f.name != "compress_ratios"})
    assert c == v4.flash()


def test_kind_index_and_layers_of():
    c = v4.tiny()
    assert c.layers_of(LayerKind.CSA) == (1, 3)
    assert c.layers_of(LayerKind.HCA) == (2, 4)
    assert [c.kind_index(i) for i in range(5)] == [0, 0, 0, 1, 1]


@pytest.mark.parametrize("page_tokens", [64, 100, 200, 0])
def test_page_size_must_be_multiple_of_128(page_tokens):
    with pytest.raises(ValueError, match=f"page_tokens: expected .*; got {page_tokens}$"):
        v4.CacheConfig(num_pages=4, max_slots=1, max_pages_per_seq=2, page_tokens=page_tokens)


def test_page_size_must_align_with_model_ratios():
    model = v4.tiny(hca_ratio=256, compress_ratios=(0, 4, 256))
    geo = v4.CacheConfig(num_pages=4, max_slots=1, max_pages_per_seq=2, page_tokens=128)
    with pytest.raises(ValueError, match="lcm"):
        v4.init_cache(model, geo)


def test_bad_fields_name_the_argument():
    with pytest.raises(ValueError, match="compress_ratios holds \\[8\\]"):
        v4.tiny(compress_ratios=(0, 4, 8))
    with pytest.raises(ValueError, match="index_head_dim=4"):
        v4.tiny(index_head_dim=4)
    with pytest.raises(ValueError, match="entry_dtype: expected one of .*; got 'int8'"):
        v4.CacheConfig(num_pages=4, max_slots=1, max_pages_per_seq=2, entry_dtype="int8")
    with pytest.raises(ValueError, match="num_heads=5"):
        v4.tiny(num_heads=5)


def test_configs_are_hashable_static_jit_arguments():
    model, geo = v4.tiny(), v4.CacheConfig(num_pages=4, max_slots=2, max_pages_per_seq=2)
    assert hash(model) == hash(v4.tiny()) and hash(geo)
    f = jax.jit(lambda x, m: x * m.num_layers, static_argnums=1)
    assert int(f(jnp.int32(2), model)) == 10
    with pytest.raises(dataclasses.FrozenInstanceError):
        model.window = 3


def test_options_are_checked_hashable_and_not_part_of_the_cache():
    opts = v4.Options(implementation="reference", query_tile=16)
    assert hash(opts) == hash(v4.Options(implementation="reference", query_tile=16))
    with pytest.raises(ValueError, match="implementation: expected one of .*; got 'xla'"):
        v4.Options(implementation="xla")
    with pytest.raises(TypeError, match="interpret: expected a bool; got 'yes'"):
        v4.Options(interpret="yes")
    with pytest.raises(ValueError, match=r"query_tile: expected an integer in \[1, inf\]"):
        v4.Options(query_tile=0)
    geo = v4.CacheConfig(num_pages=4, max_slots=2, max_pages_per_seq=2)
    assert not {"implementation", "interpret", "query_tile"} & set(vars(geo))
