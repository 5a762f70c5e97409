"""What a model must provide to be served by the `Engine` and the `Generator` (`ServedModel`),
the check that names what a model lacks (`check_model`), and the calls the serving programs
make on one (`split`, `merge`, `chunk`, `head`).

A served model has:

  attn_config   the `AttentionConfig` its cache is built for (its layers' kinds and widths)
  vocab_size    V: token ids are in [0, V), logits are f32[..., V]
  __call__(tokens, cache, slot_ids, n_new, *, options=None) -> (cache, logits f32[B, T, V])
                appends row b's first n_new[b] tokens of tokens i32[B, T] to slot
                slot_ids[b] (-1: a padding row) and returns every position's logits (rows
                past n_new are padding)
  replay(tokens, cache, slot_ids, start, n_new, *, options=None) -> cache
                (the Engine only: its prefix hits) rebuilds the State of tokens the slots
                already hold, positions start[b] ... start[b] + n_new[b] - 1, writing no
                entry and changing no length

and, optionally, the pair `hidden(tokens, cache, slot_ids, n_new, *, options=None) ->
(cache, f32[B, T, attn_config.hidden_size])` and `logits(h) -> f32[..., V]`, the call split
in two: with both, the programs apply the LM head only to the positions they sample from.

Its parameters are those of an `nnx.Module` (split once by `nnx.split`: the graph is static,
the `nnx.State` an argument of the jitted programs) or, for any other object, its leaves as
a jax pytree (every leaf an array; the tree structure and static fields are static).
`v4kv_jax.nn.Decoder` is one; docs/own-model.md builds another on `V4Attention` with
`append.begin_append`, each layer's call and `append.end_append` (`__call__`), and
`append.replay_plan` in place of the first two (`replay`).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Protocol

import jax
import numpy as np
from flax import nnx

from v4kv_jax import checks
from v4kv_jax.config import AttentionConfig, Options
from v4kv_jax.pools import Cache

CALL = "__call__(tokens, cache, slot_ids, n_new, *, options=None) -> (cache, logits)"
REPLAY = "replay(tokens, cache, slot_ids, start, n_new, *, options=None) -> cache"
HIDDEN = "hidden(tokens, cache, slot_ids, n_new, *, options=None) -> (cache, hidden)"


class ServedModel(Protocol):
    """A model the `Engine` and the `Generator` serve; see the module docstring."""

    attn_config: AttentionConfig
    vocab_size: int

    def __call__(self, tokens: jax.Array, cache: Cache, slot_ids: jax.Array, n_new: jax.Array,
                 *, options: Options | None = None) -> tuple[Cache, jax.Array]: ...

    def replay(self, tokens: jax.Array, cache: Cache, slot_ids: jax.Array, start: jax.Array,
               n_new: jax.Array, *, options: Options | None = None) -> Cache: ...


@dataclasses.dataclass(frozen=True)
class ServedConfig:
    """What the serving loops read of a model: its attention config and vocabulary size."""

    attn_config: AttentionConfig
    vocab_size: int


@dataclasses.dataclass(frozen=True)
class PytreeDef:
    """The static part of a model that is a plain pytree (its tree structure)."""

    treedef: Any

    def merge(self, params) -> Any:
        return jax.tree.unflatten(self.treedef, params)


def _check_method(model, name: str, expected: str, positional: int) -> None:
    method = getattr(model, name, None)
    if method is None or not callable(method):
        what = "no attribute" if method is None else f"a {type(method).__name__}"
        checks.fail(f"model.{name}", f"a method {expected}",
                    f"{what} {name} on {type(model).__name__}", TypeError)
    try:
        signature = inspect.signature(method)
    except (TypeError, ValueError):  # a builtin or C callable: nothing to bind against
        return
    try:
        signature.bind(*range(positional), options=None)
    except TypeError:
        checks.fail(f"model.{name}", f"a method {expected}",
                    f"{type(model).__name__}.{name}{signature}", TypeError)


def check_model(model, *, replay: bool) -> ServedConfig:
    """Checks that `model` is a `ServedModel` (`replay`: with the Engine's `replay` method) and
    returns its `ServedConfig`. Raises TypeError / ValueError naming the missing or wrong
    attribute, what is expected and what the model has."""
    attn_config = getattr(model, "attn_config", None)
    if not isinstance(attn_config, AttentionConfig):
        checks.fail("model.attn_config", "the v4kv_jax AttentionConfig of the model's cache",
                    f"{type(attn_config).__name__} on {type(model).__name__}"
                    if hasattr(model, "attn_config") else
                    f"no attribute attn_config on {type(model).__name__}", TypeError)
    if not hasattr(model, "vocab_size"):
        checks.fail("model.vocab_size", "the number of token ids (an integer >= 1)",
                    f"no attribute vocab_size on {type(model).__name__}", TypeError)
    vocab_size = checks.integer("model.vocab_size", model.vocab_size, lo=1)
    _check_method(model, "__call__", CALL, 4)
    if replay:
        _check_method(model, "replay", REPLAY, 5)
    if has_hidden(model):
        _check_method(model, "hidden", HIDDEN, 4)
    if not isinstance(model, nnx.Module):
        for path, leaf in jax.tree_util.tree_leaves_with_path(model):
            if not isinstance(leaf, (jax.Array, np.ndarray)):
                checks.fail("model", "an nnx.Module or a pytree whose leaves are its parameter "
                            "arrays", f"a leaf of type {type(leaf).__name__} at "
                            f"{jax.tree_util.keystr(path) or 'the root'}", TypeError)
    return ServedConfig(attn_config, vocab_size)


def has_hidden(model) -> bool:
    """Whether the model splits its call into `hidden` and `logits` (both present)."""
    return callable(getattr(model, "hidden", None)) and callable(getattr(model, "logits", None))


def split(model) -> tuple[Any, Any]:
    """(static part, params): `nnx.split` of an nnx.Module; else a `PytreeDef` and the leaves."""
    if isinstance(model, nnx.Module):
        return nnx.split(model)
    leaves, treedef = jax.tree.flatten(model)
    return PytreeDef(treedef), leaves


def merge(graphdef, params) -> Any:
    """The model again from `split`'s two parts (inside the jitted programs)."""
    if isinstance(graphdef, PytreeDef):
        return graphdef.merge(params)
    return nnx.merge(graphdef, params)


def _checked(model, name: str, result, batch: int, T: int, width: int, what: str):
    """result = (cache, f32[batch, T, width]), as the protocol promises (checked when traced)."""
    expected = f"(cache, {what} of shape ({batch}, {T}, {width}))"
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], Cache)):
        checks.fail(f"model.{name}'s result", expected,
                    f"{type(result).__name__}" + (f" of {len(result)}" if isinstance(
                        result, tuple) else ""), TypeError)
    shape = tuple(np.shape(result[1]))
    if shape != (batch, T, width):
        checks.fail(f"model.{name}'s result", expected, f"{what} of shape {shape}")
    return result


def chunk(model, tokens: jax.Array, cache: Cache, slot_ids: jax.Array, n_new: jax.Array,
          options: Options | None) -> tuple[Cache, jax.Array]:
    """Appends a chunk: (cache, f32[B, T, W]), what `head` turns into logits: the hidden
    states (W = hidden_size) when the model has `hidden` and `logits`, else the logits."""
    B, T = tokens.shape
    if has_hidden(model):
        return _checked(model, "hidden", model.hidden(tokens, cache, slot_ids, n_new,
                                                      options=options),
                        B, T, model.attn_config.hidden_size, "hidden states")
    return _checked(model, "__call__", model(tokens, cache, slot_ids, n_new, options=options),
                    B, T, model.vocab_size, "logits")


def head(model, h: jax.Array) -> jax.Array:
    """Logits f32[..., V] of what `chunk` returned, at the positions the caller picked."""
    return model.logits(h) if has_hidden(model) else h


def width(model) -> int:
    """W, the last dim of what `chunk` returns."""
    return model.attn_config.hidden_size if has_hidden(model) else model.vocab_size


def replay(model, tokens: jax.Array, cache: Cache, slot_ids: jax.Array, start: jax.Array,
           n_new: jax.Array, options: Options | None) -> Cache:
    """`model.replay`, its result checked to be a cache (when traced)."""
    cache = model.replay(tokens, cache, slot_ids, start, n_new, options=options)
    if not isinstance(cache, Cache):
        checks.fail("model.replay's result", "the cache", type(cache).__name__, TypeError)
    return cache


__all__ = ["ServedConfig", "ServedModel", "check_model", "chunk", "head", "merge", "replay",
           "split", "width"]
