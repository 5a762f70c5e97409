"""Converting attention-layer tensors between checkpoint names and `V4Attention` params.

  attention_params(tensors, config, kind, layout)   checkpoint names -> {V4Attention path: f32}
  checkpoint_tensors(params, kind, layout)          the inverse (for exporting weights)
  load_attention(module, params)                    writes params into a V4Attention
  attention_state(module)                           reads them back out
  load_attention(model, params, layer=i)            the same for layer i of a Decoder
  attention_state(model, layer=i)                   (scanned or unrolled layers)
  set_norms(model, layer=i, attn_norm=, mlp_norm=)  the Decoder's pre-attention / pre-MLP norms

`layout` is "transformers" (transformers 5.23.0 module names, e.g. `q_a_proj.weight`,
`compressor.indexer.scorer.weights_proj.weight`) or "official" (the released checkpoint's,
e.g. `wq_a.weight`, `indexer.weights_proj.weight`, `attn_sink`); see `names.TABLE`.

Block-quantised weights are dequantised: a weight `X.weight` stored in fp8 with a companion
`X.scale` (official) or `X.weight_scale_inv` (transformers' fp8 format) holding one scale per
128 x 128 block becomes `weight * scale` in fp32. An fp8 tensor without its scale is an error
(it would load unscaled). Every other tensor is cast to fp32.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax.numpy as jnp
import numpy as np

from v4kv_jax import checks
from v4kv_jax.config import AttentionConfig, LayerKind
from v4kv_jax.interop import names
from v4kv_jax.nn.attention import V4Attention
from v4kv_jax.nn.model import Block, Decoder

SCALE_SUFFIXES = (".scale", ".weight_scale_inv")
FP8_BLOCK = (128, 128)


class CheckpointError(ValueError):
    """A checkpoint tensor is unknown, missing, or of the wrong shape; the message names it."""


def _is_float(dtype) -> bool:
    """numpy floats and the ml_dtypes ones (bfloat16, the float8 formats)."""
    return np.dtype(dtype).name.startswith(("float", "bfloat"))


def _is_fp8(dtype) -> bool:
    return np.dtype(dtype).name.startswith("float8")


def _float_array(name: str, value, error: type[Exception] = TypeError) -> np.ndarray:
    """`value` as a numpy array of a floating dtype; raises naming it otherwise."""
    try:
        array = np.asarray(value)
    except (TypeError, ValueError, RuntimeError) as err:
        checks.fail(name, "an array (numpy, jax, or a CPU torch tensor via .numpy())",
                    f"{type(value).__name__} ({err})", error)
    if not _is_float(array.dtype):
        checks.fail(name, "a floating-point array", f"dtype {array.dtype}", error)
    return array


def _mapping(name: str, value) -> Mapping:
    if not isinstance(value, Mapping):
        checks.fail(name, "a mapping of name -> array", type(value).__name__, TypeError)
    return value


def scale_name(weight_name: str, tensors: Mapping[str, object]) -> str | None:
    """The block-scale companion of `weight_name` present in `tensors`, if any."""
    if not isinstance(weight_name, str):
        checks.fail("weight_name", "a tensor name (str)", weight_name, TypeError)
    _mapping("tensors", tensors)
    if not weight_name.endswith(".weight"):
        return None
    stem = weight_name[: -len(".weight")]
    for suffix in SCALE_SUFFIXES:
        if stem + suffix in tensors:
            return stem + suffix
    return None


def dequantize(weight: np.ndarray, scale: np.ndarray, name: str,
               block: tuple[int, int] = FP8_BLOCK) -> np.ndarray:
    """weight [o, i] * scale[ceil(o / b0), ceil(i / b1)] broadcast over its blocks, in fp32."""
    if not isinstance(name, str):
        checks.fail("name", "the weight's name (str)", name, TypeError)
    weight = _float_array(f"{name} (weight)", weight, CheckpointError)
    scale = _float_array(f"{name} (scale)", scale, CheckpointError)
    if (not isinstance(block, (tuple, list)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        checks.fail("block", "two positive ints (rows, columns of a scale block)", block)
    if weight.ndim != 2:
        raise CheckpointError(f"{name}: a block-scaled weight must be 2-D; got shape "
                              f"{weight.shape}")
    o, i = weight.shape
    want = (-(-o // block[0]), -(-i // block[1]))
    if tuple(scale.shape) != want:
        raise CheckpointError(f"{name}: scale has shape {tuple(scale.shape)}; a {weight.shape} "
                              f"weight in {block[0]}x{block[1]} blocks needs {want}")
    scale = scale.astype(np.float32)
    if not np.isfinite(scale).all():
        bad = tuple(int(j) for j in np.argwhere(~np.isfinite(scale))[0])
        checks.fail(f"{name} (scale)", "finite block scales",
                    f"{scale[bad]} at block {bad}", CheckpointError)
    full = np.repeat(np.repeat(scale, block[0], 0), block[1], 1)[:o, :i]
    return weight.astype(np.float32) * full


def attention_params(tensors: Mapping[str, np.ndarray], config: AttentionConfig,
                     kind: LayerKind, layout: str, prefix: str = "") -> dict[str, np.ndarray]:
    """One attention layer's checkpoint tensors -> `V4Attention` params.

    Args:
      tensors: name -> array (numpy, or anything `np.asarray` takes: torch CPU tensors via
        `.numpy()`), names under `prefix` (e.g. `layer.state_dict()` of a transformers
        `DeepseekV4Attention` with prefix "", or a whole checkpoint's tensors with prefix
        "model.layers.3.self_attn.").
      config: the geometry the tensors must fit.
      kind: the layer's kind.
      layout: "transformers" or "official".
      prefix: prepended to every expected name; names outside it are ignored.

    Returns:
      {V4Attention path: f32 array}, e.g. {"q_a_proj": [q, D], "compressor.ape": [m, w], ...}.

    Raises:
      CheckpointError: a name under `prefix` that the layer does not have, a missing name, or
        a shape that does not match the config; the message names the tensor.
    """
    _mapping("tensors", tensors)
    names.check_config(config)
    kind = names.layer_kind(kind)
    names.check_layout(layout)
    if not isinstance(prefix, str):
        checks.fail("prefix", "a str", prefix, TypeError)
    table = names.names_for(kind)
    wanted = {prefix + p.name(layout): p for p in table}
    scales = {s for n in wanted if (s := scale_name(n, tensors)) is not None}
    ours = [n for n in tensors if n.startswith(prefix)]
    unknown = sorted(n for n in ours if n not in wanted and n not in scales)
    if unknown:
        other = {prefix + p.name(layout) for p in names.TABLE} - set(wanted)
        hint = [f"{n} (exists only in {_kinds_of(n[len(prefix):], layout)} layers)"
                for n in unknown if n in other]
        raise CheckpointError(
            f"unknown tensor(s) for a {kind.name} layer in the {layout} layout: "
            + ", ".join(hint or unknown) + f"; expected names: {sorted(wanted)}")
    missing = sorted(n for n in wanted if n not in tensors)
    if missing:
        raise CheckpointError(f"missing tensor(s) for a {kind.name} layer in the {layout} "
                              f"layout: {', '.join(missing)}")
    shapes = names.expected_shapes(config, kind)
    out = {}
    for name, p in wanted.items():
        value = _float_array(name, tensors[name], CheckpointError)
        if tuple(value.shape) != shapes[p.path]:
            raise CheckpointError(f"{name} has shape {tuple(value.shape)}; the config expects "
                                  f"{shapes[p.path]} ({p.path} of a {kind.name} layer)")
        s = scale_name(name, tensors)
        if s is not None:
            value = dequantize(value, tensors[s], name)
        elif _is_fp8(value.dtype):
            _missing_scale(name, value.dtype)
        out[p.path] = value.astype(np.float32)
    return out


def _missing_scale(name: str, dtype) -> None:
    if name.endswith(".weight"):
        stem = name[: -len(".weight")]
        companions = " or ".join(stem + suffix for suffix in SCALE_SUFFIXES)
        checks.fail(name, f"its block scale {companions} next to a {np.dtype(dtype).name} "
                    "weight (without it the weight would load unscaled)", "no scale tensor",
                    CheckpointError)
    checks.fail(name, "a bf16 / fp16 / fp32 tensor (only X.weight tensors carry fp8 block "
                "scales)", f"dtype {np.dtype(dtype).name}", CheckpointError)


def _kinds_of(relative: str, layout: str) -> str:
    for p in names.TABLE:
        if p.name(layout) == relative:
            return "/".join(k.name for k in p.kinds)
    return "no"


def checkpoint_tensors(params: Mapping[str, np.ndarray], kind: LayerKind, layout: str,
                       prefix: str = "", config: AttentionConfig | None = None
                       ) -> dict[str, np.ndarray]:
    """`V4Attention` params -> checkpoint names (the inverse of `attention_params`).

    With `config`, every shape is checked against the one the config implies (without it,
    only the paths and the dtypes are checked).
    """
    _mapping("params", params)
    kind = names.layer_kind(kind)
    names.check_layout(layout)
    if not isinstance(prefix, str):
        checks.fail("prefix", "a str", prefix, TypeError)
    table = {p.path: p for p in names.names_for(kind)}
    unknown = sorted(set(params) - set(table))
    if unknown:
        raise CheckpointError(f"unknown V4Attention path(s) for a {kind.name} layer: "
                              f"{unknown}; expected paths: {sorted(table)}")
    missing = sorted(set(table) - set(params))
    if missing:
        raise CheckpointError(f"missing V4Attention path(s) for a {kind.name} layer: {missing}")
    if config is not None:
        check_layer_params(params, names.expected_shapes(config, kind), kind)
    return {prefix + table[path].name(layout): _float_array(path, v, CheckpointError)
            for path, v in params.items()}


def param_at(module, path: str):
    """The param at a dot-separated path of a `V4Attention` (`V4Attention.weight`: an
    `nnx.Param`, or a `Projection` view for a projection kept in a stored weight)."""
    if not isinstance(module, V4Attention):
        checks.fail("module", "a V4Attention", type(module).__name__, TypeError)
    return module.weight(path)


def check_layer_params(params: Mapping[str, object], shapes: Mapping[str, tuple[int, ...]],
                       kind: LayerKind | str, where: str = "") -> None:
    """Raises CheckpointError unless `params` has exactly the paths of `shapes`, each a float
    array of its shape. `kind`: the layer's kind, or the words that name the layer (a V4.1
    layer: "layer 5 (Reindex, ratio 1)"), in the messages with `where`."""
    at = f" ({where})" if where else ""
    what = kind if isinstance(kind, str) else f"a {LayerKind(kind).name} layer"
    _mapping("params", params)
    missing, unknown = sorted(set(shapes) - set(params)), sorted(set(params) - set(shapes))
    if missing or unknown:
        raise CheckpointError(
            f"params for {what}{at} must be exactly {sorted(shapes)}; "
            f"missing {missing}, unknown {unknown}")
    for path, value in params.items():
        dtype = getattr(value, "dtype", None)
        if dtype is None or not hasattr(value, "shape"):
            value = _float_array(f"{path}{at}", value, CheckpointError)
        elif not _is_float(dtype):
            checks.fail(f"{path}{at}", "a floating-point array", f"dtype {dtype}",
                        CheckpointError)
        if tuple(np.shape(value)) != tuple(shapes[path]):
            raise CheckpointError(f"{path}{at} has shape {tuple(np.shape(value))}; expected "
                                  f"{tuple(shapes[path])}")


def load_attention(module, params: Mapping[str, np.ndarray], *, layer: int | None = None
                   ) -> None:
    """Writes one attention layer's params {V4Attention path: array} (all of them, shapes
    checked), each in the dtype of the param it replaces.

    Args:
      module: a `V4Attention` (stacked params take stacked arrays), or a `Decoder` with
        `layer`.
      params: {V4Attention path: array}, e.g. from `attention_params` or `read_attention`.
      layer: the Decoder's layer to write (into its slice of the stacked params when the
        layers are scanned); None for a V4Attention.
    """
    if layer is not None or isinstance(module, Decoder):
        block, r = _block(module, layer)
        shapes = names.expected_shapes(module.config.attn_config, block.attn.kind)
        check_layer_params(params, shapes, block.attn.kind, where=f"layer {layer}")
        for path, value in params.items():
            param = param_at(block.attn, path)
            current = param[...]
            value = jnp.asarray(value, current.dtype)
            param[...] = value if r is None else current.at[r].set(value)
        return
    _check_module(module)
    shapes = {p.path: tuple(param_at(module, p.path)[...].shape)
              for p in names.names_for(module.kind)}
    check_layer_params(params, shapes, module.kind)
    for path, value in params.items():
        param = param_at(module, path)
        param[...] = jnp.asarray(value, param[...].dtype)


def attention_state(module, *, layer: int | None = None) -> dict[str, np.ndarray]:
    """{V4Attention path: f32 numpy array} of every attention param of one layer.

    Args:
      module: a `V4Attention` (stacked leaves stay stacked), or a `Decoder` with `layer`.
      layer: the Decoder's layer to read (its slice when the layers are scanned); None for a
        V4Attention.
    """
    if layer is not None or isinstance(module, Decoder):
        block, r = _block(module, layer)
        state = attention_state(block.attn)
        return state if r is None else {k: v[r] for k, v in state.items()}
    _check_module(module)
    return {p.path: np.asarray(param_at(module, p.path)[...], np.float32)
            for p in names.names_for(module.kind)}


def set_norms(model, *, layer: int, attn_norm=None, mlp_norm=None) -> None:
    """Sets the weights [D] of a Decoder layer's pre-attention and pre-MLP RMSNorms (None
    leaves one as it is)."""
    block, r = _block(model, layer, name="model")
    for param, value in ((block.attn_norm, attn_norm), (block.mlp_norm, mlp_norm)):
        if value is None:
            continue
        if param is None:
            raise ValueError(f"layer {layer} has no MLP (mlp_hidden=0)")
        current = param[...]
        value = jnp.asarray(value, current.dtype)
        want = current.shape if r is None else current.shape[1:]
        if value.shape != want:
            raise ValueError(f"norm weight of layer {layer} has shape {value.shape}; "
                             f"expected {want}")
        param[...] = value if r is None else current.at[r].set(value)


def _block(model, layer, name: str = "module") -> tuple[Block, int | None]:
    """`model.block_of(layer)` after checking that `model` is a Decoder and `layer` an int."""
    if not isinstance(model, Decoder):
        checks.fail(name, "a v4kv_jax.nn.Decoder (layer= picks one of its layers)",
                    type(model).__name__, TypeError)
    if layer is None:
        checks.fail("layer", f"a layer index in [0, {model.config.num_layers}) ({name} is a "
                    "Decoder)", None)
    checks.integer("layer", layer)
    return model.block_of(layer)


def _check_module(module) -> None:
    if not isinstance(getattr(module, "kind", None), LayerKind):
        checks.fail("module", "a v4kv_jax.nn.V4Attention (a module with a LayerKind `kind`)",
                    type(module).__name__, TypeError)
