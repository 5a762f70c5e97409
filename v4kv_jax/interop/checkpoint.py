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
from collections.abc import Iterable

import numpy as np

from v4kv_jax.config import AttentionConfig
from v4kv_jax.interop import convert, names
from v4kv_jax.interop.safetensors_io import SafetensorsFile, shard_files

_PATTERNS = {
    names.TRANSFORMERS: re.compile(r"^model\.layers\.(\d+)\.self_attn\.(.+)$"),
    names.OFFICIAL: re.compile(r"^layers\.(\d+)\.attn\.(.+)$"),
}


def attention_names(file: SafetensorsFile, layout: str) -> dict[str, int]:
    """Tensor name -> layer index, for the attention tensors of one shard."""
    pattern = _PATTERNS[layout]
    found = {}
    for name in file.names():
        match = pattern.match(name)
        if match:
            found[name] = int(match.group(1))
    return found


def detect_layout(files: Iterable[str]) -> str:
    """"official" or "transformers", from the names in the shards' headers."""
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
    files = shard_files(location)
    if layout is None:
        layout = detect_layout(files)
    if layout not in names.LAYOUTS:
        raise ValueError(f"layout={layout!r} must be one of {names.LAYOUTS}")
    wanted = set(range(config.num_layers) if layers is None else layers)
    bad = sorted(i for i in wanted if not 0 <= i < config.num_layers)
    if bad:
        raise ValueError(f"layers {bad} are outside the config's {config.num_layers} layers")
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


def load_into(model, per_layer: dict[int, dict[str, np.ndarray]]) -> None:
    """Writes `read_attention`'s output into a `v4kv_jax.nn.Decoder`."""
    for layer, params in per_layer.items():
        model.load_attention(layer, params)


def write_attention(path: str | os.PathLike, per_layer: dict[int, dict[str, np.ndarray]],
                    config: AttentionConfig, layout: str) -> None:
    """Writes attention params under a layout's names to one .safetensors file (needs the
    `safetensors` package)."""
    from safetensors.numpy import save_file

    tensors = {}
    for layer, params in per_layer.items():
        tensors.update(convert.checkpoint_tensors(
            params, config.layer_kinds[layer], layout, names.layer_prefix(layout, layer)))
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, os.fspath(path))
