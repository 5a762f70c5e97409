"""Checkpoint interop: transformers 5.23.0 and official names, safetensors loading, configs.

`torch_reference` (transformers' attention run side by side) needs torch and transformers and
is not imported here.
"""

from v4kv_jax.interop.checkpoint import detect_layout, load_into, read_attention, write_attention
from v4kv_jax.interop.convert import (
    CheckpointError,
    attention_params,
    attention_state,
    checkpoint_tensors,
    dequantize,
    load_attention,
    set_norms,
)
from v4kv_jax.interop.hf_config import (
    attention_config_from_hf,
    transformers_config_kwargs,
    v41_config_from_hf,
)
from v4kv_jax.interop.names import OFFICIAL, TABLE, TRANSFORMERS, expected_shapes, layer_prefix
from v4kv_jax.interop.safetensors_io import SafetensorsFile

__all__ = [
    "OFFICIAL", "TABLE", "TRANSFORMERS", "CheckpointError", "SafetensorsFile",
    "attention_config_from_hf", "attention_params", "attention_state", "checkpoint_tensors",
    "dequantize", "detect_layout", "expected_shapes", "layer_prefix", "load_attention",
    "load_into", "read_attention", "set_norms", "transformers_config_kwargs",
    "v41_config_from_hf", "write_attention",
]
