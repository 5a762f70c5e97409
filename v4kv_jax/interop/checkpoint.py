"""Loading the attention weights of a whole checkpoint from safetensors shards.

Only tensors under a layer's attention prefix are read (`layers.N.attn.` in the official
layout, `model.layers.N.self_attn.` in transformers'), one shard at a time: each shard's
header is parsed, its attention tensors of the requested layers are copied out, and the
shard is closed before the next one is opened. Experts, embeddings, norms and MTP layers are
never read.

    per_layer = read_attention(ckpt_dir, config, layout="official")
    load_into(model, per_layer)          # a v4kv_jax.nn.Decoder
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping

import numpy as np

from v4kv_jax import checks
from v4kv_jax.config import AttentionConfig
from v4kv_jax.interop import convert, names
from v4kv_jax.interop.safetensors_io import SafetensorsFile, shard_files
from v4kv_jax.nn.model import Decoder

_PATTERNS = {
    names.TRANSFORMERS: re.compile(r"^model\.layers\.(\d+)\.self_attn\.(.+)$"),
    names.OFFICIAL: re.compile(r"^layers\.(\d+)\.attn\.(.+)$"),
}


def attention_names(file: SafetensorsFile, layout: str) -> dict[str, int]:
    """Tensor name -> layer index, for the attention tensors of one shard."""
    if not isinstance(file, SafetensorsFile):
        checks.fail("file", "a SafetensorsFile", type(file).__name__, TypeError)
    pattern = _PATTERNS[names.check_layout(layout)]
    found = {}
    for name in file.names():
        match = pattern.match(name)
        if match:
            found[name] = int(match.group(1))
    return found


def detect_layout(files: Iterable[str] | str | os.PathLike) -> str:
    """"official" or "transformers", from the names in the shards' headers.

    Args:
      files: the shards: a list of .safetensors files, one file, or a directory of them.
    """
    if isinstance(files, (str, os.PathLike)):
        files = shard_files(files)
    else:
        if not isinstance(files, Iterable):
            checks.fail("files", ".safetensors paths (a list of files, one file or a "
                        "directory)", type(files).__name__, TypeError)
        files = shard_files(list(files))
    seen = set()
    for path in files:
        f = SafetensorsFile(path)
        seen |= {layout for layout in names.LAYOUTS if attention_names(f, layout)}
    if len(seen) != 1:
        raise convert.CheckpointError(
            f"cannot tell the checkpoint layout: found attention tensors of {sorted(seen)} "
            f"layouts (expected exactly one of {list(names.LAYOUTS)})")
    return seen.pop()


def read_attention(location, config: AttentionConfig, layout: str | None = None,
                   layers: Iterable[int] | None = None) -> dict[int, dict[str, np.ndarray]]:
    """Reads and converts the attention tensors of a checkpoint.

    Args:
      location: a .safetensors file, a list of them, or a directory of shards.
      config: the geometry; layer kinds come from its `compress_ratios`.
      layout: "official", "transformers", or None to detect it from the names.
      layers: the layers to read (default: all `config.num_layers`). Attention tensors of
        other layers (e.g. a config that keeps the first few layers) are not read.

    Returns:
      {layer: {V4Attention path: f32 array}}.

    Raises:
      CheckpointError: a layer's tensor is unknown, missing or of the wrong shape (the
        message names the tensor and its shard), or a requested layer has no tensors.
    """
    names.check_config(config)
    if layout is not None:
        names.check_layout(layout)
    wanted = set(range(config.num_layers) if layers is None else _layer_list(layers, config))
    files = shard_files(location)
    if layout is None:
        layout = detect_layout(files)
    raw: dict[int, dict[str, np.ndarray]] = {i: {} for i in wanted}
    where: dict[str, str] = {}
    for path in files:
        shard = SafetensorsFile(path)
        for name, layer in attention_names(shard, layout).items():
            if layer in wanted:
                raw[layer][name] = shard.read(name)
                where[name] = os.path.basename(path)
        del shard
    out = {}
    for layer in sorted(wanted):
        kind = config.layer_kinds[layer]
        prefix = names.layer_prefix(layout, layer)
        if not raw[layer]:
            raise convert.CheckpointError(
                f"no attention tensors for layer {layer} ({prefix}*) in {len(files)} shard(s)")
        try:
            out[layer] = convert.attention_params(raw[layer], config, kind, layout, prefix)
        except convert.CheckpointError as err:
            shards = sorted({where[n] for n in raw[layer]})
            raise convert.CheckpointError(f"layer {layer} ({kind.name}, shards {shards}): "
                                          f"{err}") from None
        raw[layer] = {}
    return out


def _layer_list(layers, config) -> list[int]:
    """`layers` as a non-empty list of layer indices of `config` (an AttentionConfig or a
    V41Config); raises naming it otherwise."""
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Iterable):
        checks.fail("layers", "an iterable of layer indices", layers, TypeError)
    layers = list(layers)
    if not layers:
        checks.fail("layers", "at least one layer index (None reads every layer)", layers)
    for i in layers:
        names.index("layers", i, lo=None)
    bad = sorted({int(i) for i in layers if not 0 <= i < config.num_layers})
    if bad:
        checks.fail("layers", f"layer indices in [0, {config.num_layers}) (the config's "
                    f"{config.num_layers} layers)", bad)
    return [int(i) for i in layers]


def _per_layer(per_layer, num_layers: int) -> dict:
    """Checks {layer index: params mapping} against a model of `num_layers` layers."""
    if not isinstance(per_layer, Mapping):
        checks.fail("per_layer", "a mapping {layer index: {V4Attention path: array}}",
                    type(per_layer).__name__, TypeError)
    for layer, params in per_layer.items():
        names.index("per_layer key", layer, hi=num_layers - 1)
        if not isinstance(params, Mapping):
            checks.fail(f"per_layer[{layer}]", "a mapping {V4Attention path: array}",
                        type(params).__name__, TypeError)
    return per_layer


def load_into(model, per_layer: dict[int, dict[str, np.ndarray]]) -> None:
    """Writes `read_attention`'s output into a `v4kv_jax.nn.Decoder`."""
    if not isinstance(model, Decoder):
        checks.fail("model", "a v4kv_jax.nn.Decoder", type(model).__name__, TypeError)
    for layer, params in _per_layer(per_layer, model.config.num_layers).items():
        convert.load_attention(model, params, layer=layer)


def write_attention(path: str | os.PathLike, per_layer: dict[int, dict[str, np.ndarray]],
                    config: AttentionConfig, layout: str) -> None:
    """Writes attention params under a layout's names to one .safetensors file (needs the
    `safetensors` package)."""
    from safetensors.numpy import save_file

    if not isinstance(path, (str, os.PathLike)):
        checks.fail("path", "a str or os.PathLike", path, TypeError)
    names.check_config(config)
    names.check_layout(layout)
    tensors = {}
    for layer, params in _per_layer(per_layer, config.num_layers).items():
        try:
            tensors.update(convert.checkpoint_tensors(
                params, config.layer_kinds[layer], layout, names.layer_prefix(layout, layer),
                config=config))
        except convert.CheckpointError as err:
            raise convert.CheckpointError(f"per_layer[{layer}]: {err}") from None
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, os.fspath(path))
