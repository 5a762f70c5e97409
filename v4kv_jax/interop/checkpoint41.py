"""DeepSeek-V4.1 attention weights from and to safetensors (names: `interop.names41`).

    per_layer = read_attention41(ckpt_dir, config, layers=[0, 1, 2])
    load_into41(model, per_layer)                  # a v4kv_jax.nn.Decoder41

Only tensors named `layers.N.attn.*` of the requested layers are read, one shard at a time
(`SafetensorsFile` copies out just those; experts, Engram tables, embeddings, norms, DSpark
`mtp.*` and vision are never read).

Weight formats (the official `inference/model.py`'s `Linear`; V41_SPEC.md section 0's
[REF]): a projection `X.weight` may be stored
  fp8    e4m3 [out, in] with `X.scale` e8m0 [ceil(out / b), ceil(in / b)], one scale per
         b x b block: b = 32 in V4.1's release (`fp8_block_size`), 128 in V4's; the block
         follows from the scale's shape;
  fp4    e2m1 [out, in] (safetensors "F4": torch's `float4_e2m1fn_x2`, two a byte) with
         `X.scale` e8m0 [out, in / 32], one scale per 32 inputs (the release's experts;
         accepted for any projection);
  float  f32, bf16, f16 (any other tensor: norms, `attn_sink`);
and loads as weight * scale in fp32. An fp8 or fp4 weight without its scale is an error (it
would load unscaled).

`write_attention41` writes params under the official names, each projection in a format of
`FORMATS41` (fp8 and fp4 quantised with power-of-two e8m0 scales, as the release's), so a
test can round-trip weights through a file.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from v4kv_jax import checks, plan
from v4kv_jax.config41 import V41Config
from v4kv_jax.interop import names41
from v4kv_jax.interop.checkpoint import _layer_list
from v4kv_jax.interop.convert import (
    CheckpointError,
    _float_array,
    _mapping,
    check_layer_params,
)
from v4kv_jax.interop.names import index
from v4kv_jax.interop.safetensors_io import SafetensorsFile, save_tensors, shard_files
from v4kv_jax.nn.attention41 import V41Attention
from v4kv_jax.nn.model41 import Decoder41

_PATTERN = re.compile(r"^layers\.(\d+)\.attn\.(.+)$")
FP8_BLOCKS = (32, 128)  # V4.1's block, then V4's
FP4_BLOCK = 32
FORMATS41 = ("float32", "bfloat16", "fp8", "fp4")
_FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
_FP4 = np.dtype(ml_dtypes.float4_e2m1fn)


def _scale_of(name: str) -> str | None:
    return name[: -len(".weight")] + ".scale" if name.endswith(".weight") else None


def dequantize41(weight: np.ndarray, scale: np.ndarray, name: str) -> np.ndarray:
    """weight * scale in fp32, the scale broadcast over its blocks (module docstring): an
    fp4 (`float4_e2m1fn`) weight [o, i] takes scale [o, ceil(i / 32)], any other one
    [ceil(o / b), ceil(i / b)] for a block b of `FP8_BLOCKS`.

    Raises:
      CheckpointError naming `name`: a weight that is not 2-D, a scale of another shape or
      with a non-finite value.
    """
    if not isinstance(name, str):
        checks.fail("name", "the weight's name (str)", name, TypeError)
    weight = _float_array(f"{name} (weight)", weight, CheckpointError)
    scale = _float_array(f"{name} (scale)", scale, CheckpointError)
    if weight.ndim != 2:
        raise CheckpointError(f"{name}: a block-scaled weight must be 2-D; got shape "
                              f"{weight.shape}")
    o, i = weight.shape
    if weight.dtype == _FP4:
        blocks = [(1, FP4_BLOCK)]
    else:
        blocks = [(b, b) for b in FP8_BLOCKS]
    wants = {blk: (-(-o // blk[0]), -(-i // blk[1])) for blk in blocks}
    block = next((blk for blk, want in wants.items() if want == scale.shape), None)
    if block is None:
        shown = " or ".join(f"{w} ({b[0]}x{b[1]} blocks)" for b, w in wants.items())
        raise CheckpointError(f"{name}: scale has shape {tuple(scale.shape)}; a "
                              f"{weight.dtype.name} weight {weight.shape} needs {shown}")
    scale = scale.astype(np.float32)
    if not np.isfinite(scale).all():
        bad = tuple(int(j) for j in np.argwhere(~np.isfinite(scale))[0])
        checks.fail(f"{name} (scale)", "finite block scales", f"{scale[bad]} at block {bad}",
                    CheckpointError)
    full = np.repeat(np.repeat(scale, block[0], 0), block[1], 1)[:o, :i]
    return weight.astype(np.float32) * full


def attention_params41(tensors: Mapping[str, np.ndarray], config: V41Config, layer: int,
                       prefix: str = "") -> dict[str, np.ndarray]:
    """One V4.1 attention layer's checkpoint tensors -> `V41Attention` params.

    Args:
      tensors: name -> array (numpy, or anything `np.asarray` takes), names under `prefix`
        (e.g. a whole checkpoint's tensors with prefix "layers.3.attn.").
      config: the stack the tensors must fit.
      layer: the layer (its plan says which tensors it has).
      prefix: prepended to every expected name; names outside it are ignored.

    Returns:
      {V41Attention path: f32 array}.

    Raises:
      CheckpointError naming the tensor: a name under `prefix` the layer does not have, a
        missing name, a shape the config does not imply, an fp8 / fp4 weight without its
        `.scale`, a scale of the wrong shape.
    """
    _mapping("tensors", tensors)
    names41.check_config41(config)
    layer = index("layer", layer, hi=config.num_layers - 1)
    if not isinstance(prefix, str):
        checks.fail("prefix", "a str", prefix, TypeError)
    mode = _mode(config, layer)
    wanted = {prefix + n.official: n for n in names41.names_for41(config, layer)}
    scales = {s for n in wanted if (s := _scale_of(n)) in tensors}
    ours = [n for n in tensors if n.startswith(prefix)]
    unknown = sorted(n for n in ours if n not in wanted and n not in scales)
    if unknown:
        owners = {prefix + n.official: n.owner for n in names41.TABLE41}
        shown = [f"{n} (only {owners[n]}s have it)" if n in owners else n for n in unknown]
        raise CheckpointError(f"unknown tensor(s) for layer {layer} ({mode}): "
                              f"{', '.join(shown)}; expected names: {sorted(wanted)}")
    missing = sorted(n for n in wanted if n not in tensors)
    if missing:
        raise CheckpointError(f"missing tensor(s) for layer {layer} ({mode}): "
                              f"{', '.join(missing)}")
    shapes = names41.expected_shapes41(config, layer)
    out = {}
    for name, n in wanted.items():
        value = _float_array(name, tensors[name], CheckpointError)
        if tuple(value.shape) != shapes[n.path]:
            raise CheckpointError(f"{name} has shape {tuple(value.shape)}; the config expects "
                                  f"{shapes[n.path]} ({n.path} of layer {layer}, {mode})")
        scale = _scale_of(name)
        if scale in tensors:
            value = dequantize41(value, tensors[scale], name)
        elif value.dtype.name.startswith(("float8", "float4")):
            checks.fail(name, f"its block scale {scale} next to a {value.dtype.name} weight "
                        "(without it the weight would load unscaled)", "no scale tensor",
                        CheckpointError)
        out[n.path] = value.astype(np.float32)
    return out


def _mode(config: V41Config, layer: int) -> str:
    p = plan.of(config)[layer]
    return p.mode if p.ratio == 0 else f"{p.mode}, ratio {p.ratio}"


def read_attention41(location, config: V41Config, layers: Iterable[int] | None = None
                     ) -> dict[int, dict[str, np.ndarray]]:
    """Reads and converts the V4.1 attention tensors of a checkpoint.

    Args:
      location: a .safetensors file, a list of them, or a directory of shards.
      config: the stack; each layer's plan says which tensors it has.
      layers: the layers to read (default: all `config.num_layers`); other layers' tensors
        are not read.

    Returns:
      {layer: {V41Attention path: f32 array}}.

    Raises:
      CheckpointError: a layer's tensor is unknown, missing, of the wrong shape or without
        its scale (the message names the tensor, the layer and its shards), or a requested
        layer has no tensors.
    """
    names41.check_config41(config)
    wanted = set(range(config.num_layers) if layers is None else _layer_list(layers, config))
    files = shard_files(location)
    raw: dict[int, dict[str, np.ndarray]] = {i: {} for i in wanted}
    where: dict[str, str] = {}
    for path in files:
        shard = SafetensorsFile(path)
        for name in shard.names():
            match = _PATTERN.match(name)
            if match and int(match.group(1)) in wanted:
                raw[int(match.group(1))][name] = shard.read(name)
                where[name] = os.path.basename(path)
        del shard
    out = {}
    for layer in sorted(wanted):
        prefix = names41.layer_prefix41(layer)
        if not raw[layer]:
            raise CheckpointError(f"no attention tensors for layer {layer} ({prefix}*) in "
                                  f"{len(files)} shard(s)")
        try:
            out[layer] = attention_params41(raw[layer], config, layer, prefix)
        except CheckpointError as err:
            shards = sorted({where[n] for n in raw[layer]})
            raise CheckpointError(f"shards {shards}: {err}") from None
        raw[layer] = {}
    return out


def _attention(target, layer) -> V41Attention:
    """The `V41Attention` of a V41Attention (layer None) or of a Decoder41's layer."""
    if isinstance(target, Decoder41):
        if layer is None:
            checks.fail("layer", f"a layer index in [0, {target.config.num_layers}) (the "
                        "target is a Decoder41)", None)
        layer = index("layer", layer, hi=target.config.num_layers - 1)
        return target.layers[layer].attn
    if not isinstance(target, V41Attention):
        checks.fail("target", "a V41Attention or a Decoder41", type(target).__name__,
                    TypeError)
    if layer is not None and layer != target.layer:
        checks.fail("layer", f"None or the module's own layer {target.layer}", layer)
    return target


def check_params41(params: Mapping[str, object], config: V41Config, layer: int,
                   where: str = "") -> None:
    """Raises CheckpointError unless `params` holds exactly layer `layer`'s paths, each a
    float array of its shape."""
    context = f"layer {layer}, {_mode(config, layer)}" + (f", {where}" if where else "")
    check_layer_params(params, names41.expected_shapes41(config, layer), "the layer",
                       where=context)


def load_attention41(target, params: Mapping[str, np.ndarray], *, layer: int | None = None
                     ) -> None:
    """Writes one layer's params {V41Attention path: array} (all of them, shapes checked)
    into a `V41Attention`, or into layer `layer` of a `Decoder41`, each in the dtype of the
    param it replaces."""
    attn = _attention(target, layer)
    check_params41(params, attn.config, attn.layer)
    for path, value in params.items():
        param = attn.weight(path)
        param[...] = jnp.asarray(value, param[...].dtype)


def attention_state41(target, *, layer: int | None = None) -> dict[str, np.ndarray]:
    """{V41Attention path: f32 numpy array} of every param of one attention layer (a
    `V41Attention`, or layer `layer` of a `Decoder41`)."""
    attn = _attention(target, layer)
    return {path: np.asarray(attn.weight(path)[...], np.float32) for path in attn.paths()}


def load_into41(model: Decoder41, per_layer: Mapping[int, Mapping[str, np.ndarray]]) -> None:
    """Writes `read_attention41`'s output into a `Decoder41`."""
    if not isinstance(model, Decoder41):
        checks.fail("model", "a v4kv_jax.nn.Decoder41", type(model).__name__, TypeError)
    _mapping("per_layer", per_layer)
    for layer, params in per_layer.items():
        load_attention41(model, params, layer=layer)


def _quantized(value: np.ndarray, fmt: str) -> tuple[np.ndarray, np.ndarray | None]:
    """(weight, scale) of a projection [o, i] stored in `fmt` (e8m0 power-of-two scales:
    the smallest 2^k with amax / 2^k <= the format's largest value)."""
    if fmt in ("float32", "bfloat16"):
        return value.astype(np.float32 if fmt == "float32" else ml_dtypes.bfloat16), None
    o, i = value.shape
    if fmt == "fp8":
        b, top, dtype = (FP8_BLOCKS[0], FP8_BLOCKS[0]), 448.0, _FP8
    else:
        b, top, dtype = (1, FP4_BLOCK), 6.0, _FP4
    rows, cols = -(-o // b[0]), -(-i // b[1])
    padded = np.zeros((rows * b[0], cols * b[1]), np.float32)
    padded[:o, :i] = np.abs(value)
    amax = padded.reshape(rows, b[0], cols, b[1]).max(axis=(1, 3))
    scale = np.exp2(np.ceil(np.log2(np.maximum(amax, 2.0**-100) / top)))
    full = np.repeat(np.repeat(scale, b[0], 0), b[1], 1)[:o, :i]
    return (np.clip(value / full, -top, top).astype(dtype),
            scale.astype(np.float32).astype(ml_dtypes.float8_e8m0fnu))


def write_attention41(path: str | os.PathLike, per_layer: Mapping[int, Mapping[str, object]],
                      config: V41Config, *, formats: Mapping[str, str] | None = None) -> None:
    """Writes V4.1 attention params {layer: {V41Attention path: array}} under the official
    names to one .safetensors file.

    Args:
      path: the file.
      per_layer: each layer's params (all of its paths, shapes checked).
      config: the stack.
      formats: {path: one of `FORMATS41`} for projections (2-D params); default float32
        for every param. fp8 / fp4 write `X.scale` next to `X.weight`.
    """
    if not isinstance(path, (str, os.PathLike)):
        checks.fail("path", "a str or os.PathLike", path, TypeError)
    names41.check_config41(config)
    _mapping("per_layer", per_layer)
    formats = dict(_mapping("formats", formats) if formats is not None else {})
    for key, fmt in formats.items():
        checks.one_of(f"formats[{key!r}]", fmt, FORMATS41)
    tensors = {}
    for layer, params in per_layer.items():
        layer = index("per_layer key", layer, hi=config.num_layers - 1)
        check_params41(params, config, layer, where=f"per_layer[{layer}]")
        prefix = names41.layer_prefix41(layer)
        for n in names41.names_for41(config, layer):
            value = np.asarray(params[n.path], np.float32)
            fmt = formats.get(n.path, "float32")
            if value.ndim != 2 and fmt not in ("float32", "bfloat16"):
                checks.fail(f"formats[{n.path!r}]", "float32 or bfloat16 for a 1-D param", fmt)
            weight, scale = _quantized(value, fmt)
            tensors[prefix + n.official] = weight
            if scale is not None:
                tensors[prefix + _scale_of(n.official)] = scale
    save_tensors(path, tensors)


__all__ = ["FORMATS41", "FP4_BLOCK", "FP8_BLOCKS", "attention_params41", "attention_state41",
           "check_params41", "dequantize41", "load_attention41", "load_into41",
           "read_attention41", "write_attention41"]
