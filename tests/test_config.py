import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import v4kv_jax as v4
from v4kv_jax.config import LayerKind
from v4kv_jax.nn import ModelConfig


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
    with pytest.raises(ValueError, match=r"compress_ratios: expected only ratios in "
                                         r"\[0, 4, 16\] \(0 = SWA, csa_ratio, hca_ratio\); "
                                         r"got the ratios \[8\]$"):
        v4.tiny(compress_ratios=(0, 4, 8))
    with pytest.raises(ValueError, match="index_head_dim: expected an integer >= rope_dim=8; "
                                         "got 4$"):
        v4.tiny(index_head_dim=4)
    with pytest.raises(ValueError, match="entry_dtype: expected one of .*; got 'int8'"):
        v4.CacheConfig(num_pages=4, max_slots=1, max_pages_per_seq=2, entry_dtype="int8")
    with pytest.raises(ValueError, match="num_heads: expected a multiple of o_groups=2; got 5$"):
        v4.tiny(num_heads=5)
    with pytest.raises(ValueError, match=r"rope_dim: expected an even integer <= head_dim=32; "
                                         r"got 7$"):
        v4.tiny(rope_dim=7)
    with pytest.raises(ValueError, match="csa_ratio: expected a ratio other than hca_ratio=16; "
                                         "got 16$"):
        v4.tiny(csa_ratio=16, compress_ratios=(0, 16))
    with pytest.raises(ValueError, match=r"compress_ratios: expected at least one layer; got \(\)"):
        v4.tiny(compress_ratios=())
    with pytest.raises(TypeError, match="compress_ratios: expected a sequence of per-layer "
                                        "ratios; got 4$"):
        v4.tiny(compress_ratios=4)
    with pytest.raises(ValueError, match=r"num_layers: expected at most "
                                         r"len\(compress_ratios\)=5; got 6$"):
        v4.AttentionConfig.from_compress_ratios(
            v4.tiny().compress_ratios, num_layers=6,
            **{f.name: getattr(v4.tiny(), f.name) for f in dataclasses.fields(v4.AttentionConfig)
               if f.name != "compress_ratios"})


INT_FIELDS = ("hidden_size", "num_heads", "head_dim", "rope_dim", "q_lora_rank", "o_groups",
              "o_lora_rank", "window", "csa_ratio", "hca_ratio", "index_heads", "index_head_dim",
              "index_topk", "yarn_original_max_position")


@pytest.mark.parametrize("bad", [64.5, 8.0, True, "8", None], ids=repr)
@pytest.mark.parametrize("name", INT_FIELDS)
def test_attention_sizes_must_be_integers_not_floats_or_bools(name, bad):
    shown = re.escape(repr(bad))
    with pytest.raises(TypeError, match=rf"^{name}: expected an integer; got {shown}$"):
        v4.tiny(**{name: bad})


@pytest.mark.parametrize("name", INT_FIELDS)
def test_attention_sizes_must_be_positive(name):
    with pytest.raises(ValueError, match=rf"^{name}: expected an integer in \[1, inf\]; got 0$"):
        v4.tiny(**{name: 0})


@pytest.mark.parametrize("bad, error, shown", [
    (4.0, TypeError, r"expected an integer; got 4\.0"),
    (True, TypeError, r"expected an integer; got True"),
    (-4, ValueError, r"expected an integer in \[0, inf\]; got -4"),
])
def test_compress_ratios_must_be_integers(bad, error, shown):
    with pytest.raises(error, match=rf"^compress_ratios\[1\]: {shown}$"):
        v4.tiny(compress_ratios=(0, bad, 16))


@pytest.mark.parametrize("name", ["rope_theta", "compress_rope_theta", "yarn_factor", "rms_eps",
                                  "yarn_beta_fast", "yarn_beta_slow"])
def test_attention_reals_reject_bools_and_strings(name):
    with pytest.raises(TypeError, match=rf"^{name}: expected a real number; got True$"):
        v4.tiny(**{name: True})
    with pytest.raises(TypeError, match=rf"^{name}: expected a real number; got '1'$"):
        v4.tiny(**{name: "1"})


def test_valid_attention_configs_are_unchanged():
    """Integer-valued numpy sizes still pass, ints given for float fields are kept as given."""
    assert v4.tiny(hidden_size=np.int64(64), compress_ratios=np.array([0, 4, 16])) == \
        v4.tiny(compress_ratios=(0, 4, 16))
    assert v4.tiny(compress_ratios=np.array([0, 4])).compress_ratios == (0, 4)
    assert v4.tiny(rope_theta=10000).rope_theta == 10000
    with pytest.raises(ValueError,
                       match=r"^rms_eps: expected a number in \(0\.0, inf\]; got 0\.0$"):
        v4.tiny(rms_eps=0.0)


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


@pytest.mark.parametrize("name, bad, error, shown", [
    ("vocab_size", 64.5, TypeError, "expected an integer; got 64.5"),
    ("vocab_size", True, TypeError, "expected an integer; got True"),
    ("vocab_size", 0, ValueError, r"expected an integer in \[1, inf\]; got 0"),
    ("mlp_hidden", 48.0, TypeError, r"expected an integer; got 48\.0"),
    ("mlp_hidden", False, TypeError, "expected an integer; got False"),
    ("mlp_hidden", -1, ValueError, r"expected an integer in \[0, inf\]; got -1"),
    ("tie_embeddings", 1, TypeError, "expected a bool; got 1"),
])
def test_model_config_rejects_floats_and_bools_as_sizes(name, bad, error, shown):
    with pytest.raises(error, match=rf"^{name}: {shown}$"):
        ModelConfig(v4.tiny(), **{name: bad})


def test_model_config_needs_an_attention_config():
    with pytest.raises(TypeError, match=r"^attn_config: expected a v4kv_jax AttentionConfig; "
                                        r"got dict$"):
        ModelConfig({"hidden_size": 64})


def test_valid_model_config_and_its_repr_are_unchanged():
    """The repr is part of prefix-cache fingerprints: a valid config keeps it."""
    config = ModelConfig(v4.tiny(), vocab_size=np.int64(40), mlp_hidden=48)
    assert config == ModelConfig(v4.tiny(), vocab_size=40, mlp_hidden=48)
    assert repr(ModelConfig(v4.tiny(), vocab_size=40, mlp_hidden=48)) == (
        "ModelConfig(attn_config=AttentionConfig(hidden_size=64, num_heads=4, head_dim=32, "
        "rope_dim=8, q_lora_rank=32, o_groups=2, o_lora_rank=16, window=16, "
        "compress_ratios=(0, 4, 16, 4, 16), csa_ratio=4, hca_ratio=16, index_heads=4, "
        "index_head_dim=16, index_topk=8, rope_theta=10000.0, compress_rope_theta=160000.0, "
        "yarn_factor=16.0, yarn_original_max_position=65536, yarn_beta_fast=32.0, "
        "yarn_beta_slow=1.0, rms_eps=1e-06), vocab_size=40, mlp_hidden=48, "
        "tie_embeddings=False)")
