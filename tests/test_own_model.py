"""A model of one's own, served: docs/own-model.md's model (V4Attention layers with a mixture of
experts of its own) runs as the page writes it, the Engine serves it with prefix hits from
every tier and the C4 entries in host memory (HiSparse), and the Generator serves it as a
plain pytree, each with the tokens of the page's own greedy loop (its mesh case:
tests/multi_device.py); a model that lacks part of the protocol gets an error naming it."""

from __future__ import annotations

import contextlib
import io
import os
import re

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx, struct

import v4kv_jax as v4
from v4kv_jax.serve import Generator, check_model
from v4kv_jax.serve.engine import Engine, fingerprint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def own_model_blocks() -> list[str]:
    """The python blocks of the page's section, each with the output block after it."""
    page = open(os.path.join(ROOT, "docs/own-model.md")).read()
    section = page.split("## A whole model of your own, served\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)\n```\n(?:```text\n(.*?)\n```)?", section, re.S)


def run_blocks(blocks, scope: dict) -> None:
    """Runs the page's blocks in `scope`, each block's printed lines checked against its
    output block."""
    for code, output in blocks:
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(code, scope)  # noqa: S102 - the page's own code
        assert printed.getvalue().splitlines() == output.splitlines(), code


def greedy_tokens(scope: dict, prompt: list[int], steps: int) -> list[int]:
    """The page's greedy loop on `prompt`, in a cache of its own."""
    cache = v4.reset_slot(v4.init_cache(scope["attention"], scope["geometry"]), 0)
    padded = np.pad(prompt, (0, scope["BUFFER"] - len(prompt)))
    _, tokens = scope["greedy"](scope["params"], cache, jnp.asarray(padded), len(prompt),
                                steps=steps)
    return np.asarray(tokens).tolist()


@pytest.fixture(scope="module")
def page():
    blocks = own_model_blocks()
    assert len(blocks) == 3
    scope: dict = {"__name__": "docs"}
    run_blocks(blocks, scope)
    return scope


def test_the_engine_serves_the_page_model_with_hits_from_every_tier(page, tmp_path):
    """Four conversations of two turns through a pool of 8 pages (2 on the host tier, the
    rest on disk, one snapshot per memory tier): the second turns hit snapshots from every
    tier and pages from the host and the disk, and every turn's tokens are the greedy loop's
    on the whole conversation."""
    engine = Engine(page["model"], page["geometry"], prefill_chunk=page["CHUNK"], host_pages=2,
                    snapshot_dir=tmp_path, device_snapshots=1, host_snapshots=1)
    tokens = np.random.default_rng(5).integers(0, 64, 400).tolist()
    conversations = [tokens[40 * i:40 * i + 270] for i in range(4)]
    outputs = []
    for turn in range(2):
        for i, conversation in enumerate(conversations):
            (out,) = engine.generate([conversation], 8, cache_salt=f"conversation-{i}")
            assert out.tokens == greedy_tokens(page, conversation, 8), (turn, i)
            outputs.append(out)
            conversation += out.tokens + [i, turn + 1]
    hits = outputs[4:]
    assert {o.snapshot_tier for o in hits} == {"device", "host", "disk"}
    assert all(o.cached_tokens == 256 for o in hits)
    assert sum(o.cached_from["host"] for o in hits) and sum(o.cached_from["disk"] for o in hits)
    assert page["geometry"].c4_tier == "host"


@struct.dataclass
class Pytree:
    """The page's model as a plain pytree: its graph static, its state the leaves."""

    graphdef: nnx.GraphDef = struct.field(pytree_node=False)
    state: nnx.State
    attn_config: v4.AttentionConfig = struct.field(pytree_node=False)
    vocab_size: int = struct.field(pytree_node=False)

    def __call__(self, tokens, cache, slot_ids, n_new, *, options=None):
        return nnx.merge(self.graphdef, self.state)(tokens, cache, slot_ids, n_new,
                                                    options=options)


def test_the_generator_serves_the_page_model_as_a_pytree(page):
    model = page["model"]
    pytree = Pytree(*nnx.split(model), model.attn_config, model.vocab_size)
    gen = Generator(pytree, page["geometry"], max_prompt_len=page["BUFFER"], max_new_tokens=8,
                    prefill_chunk=page["CHUNK"])
    assert isinstance(gen.params, list)  # the leaves, not a module's state
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 64, int(n)).tolist() for n in (150, 7)]
    out = gen.generate(prompts, temperature=0.0)
    assert out.as_lists() == [greedy_tokens(page, p, 8) for p in prompts]


def _model(**changes):
    """A stand-in with every part of the protocol, `changes` replacing some (None: left out)."""
    parts = {"attn_config": v4.tiny(), "vocab_size": 64,
             "__call__": lambda self, tokens, cache, slot_ids, n_new, *, options=None: None,
             "replay": lambda self, tokens, cache, slot_ids, start, n_new, *, options=None: None}
    parts.update(changes)
    return type("Model", (), {k: v for k, v in parts.items() if v is not None})


def test_a_model_lacking_part_of_the_protocol_is_named(page):
    geometry = page["geometry"]
    cases = [
        (dict(attn_config=None), TypeError, r"model.attn_config: expected the v4kv_jax "
         r"AttentionConfig of the model's cache; got no attribute attn_config on Model"),
        (dict(attn_config="tiny"), TypeError, r"model.attn_config: expected .*; got str on "
         r"Model"),
        (dict(vocab_size=None), TypeError, r"model.vocab_size: expected the number of token "
         r"ids \(an integer >= 1\); got no attribute vocab_size on Model"),
        (dict(vocab_size=0), ValueError, r"model.vocab_size: expected an integer in \[1, "),
        (dict(__call__=None), TypeError, r"model.__call__: expected a method __call__\(tokens, "
         r"cache, slot_ids, n_new, \*, options=None\) -> \(cache, logits\); got no attribute "
         r"__call__ on Model"),
        (dict(__call__=lambda self, tokens, cache: None), TypeError, r"model.__call__: expected "
         r".*; got Model.__call__\(tokens, cache\)"),
        (dict(replay=None), TypeError, r"model.replay: expected a method replay\(tokens, cache, "
         r"slot_ids, start, n_new, \*, options=None\) -> cache; got no attribute replay on "
         r"Model"),
        (dict(replay=lambda self, tokens, cache, slot_ids, n_new: None), TypeError,
         r"model.replay: expected .*; got Model.replay\(tokens, cache, slot_ids, n_new\)"),
    ]
    for changes, error, message in cases:
        with pytest.raises(error, match=message):
            Engine(_model(**changes)(), geometry)
    assert check_model(page["model"], replay=True).vocab_size == 64
    with pytest.raises(TypeError, match=r"model: expected an nnx.Module or a pytree whose "
                                        r"leaves are its parameter arrays; got a leaf of type "
                                        r"Model at the root"):
        Engine(_model()(), geometry)


def test_a_call_of_the_wrong_shape_is_named_when_traced(page):
    """The head's width is not the vocab_size the model names: the first generate says so."""
    model = page["model"]
    wrong = Pytree(*nnx.split(model), model.attn_config, 65)
    with pytest.raises(TypeError, match=r"model.replay: expected a method replay"):
        Engine(wrong, page["geometry"])  # the Generator has no prefix hits: it needs none
    gen = Generator(wrong, page["geometry"], max_prompt_len=16, max_new_tokens=2,
                    prefill_chunk=16)
    with pytest.raises(ValueError, match=r"model.__call__'s result: expected \(cache, logits "
                                         r"of shape \(2, 16, 65\)\); got logits of shape "
                                         r"\(2, 16, 64\)"):
        gen.generate([[1, 2]])


class _Printed:
    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text


def test_the_prefix_namespace_leaves_out_function_addresses(page):
    """flax layers keep functions in their graph, printed with their address: the Engine's
    prefix namespace leaves the address out, so an engine of the same model in another
    process shares it (its disk tier), while the structure itself counts."""
    graphdef, params = nnx.split(page["model"])
    text = repr(graphdef)
    assert " at 0x" in text
    elsewhere = re.sub(r" at 0x[0-9a-fA-F]+", " at 0x1", text)

    def namespace(structure: str) -> bytes:
        return fingerprint(page["attention"], _Printed(structure), page["geometry"],
                           v4.Options(), params)

    assert namespace(elsewhere) == namespace(text) != namespace(text.replace("Block", "Blocks"))
