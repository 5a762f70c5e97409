"""Checkpoint interop: transformers 5.23.0 and official names, safetensors loading, configs;
DeepSeek-V4.1's official attention names and loading (`names41`, `checkpoint41`).

`torch_reference` (transformers' attention run side by side) needs torch and transformers and
is not imported here.
"""

from v4kv_jax.interop.checkpoint import detect_layout, load_into, read_attention, write_attention
from v4kv_jax.interop.checkpoint41 import (
    attention_params41,
    attention_state41,
    dequantize41,
    load_attention41,
    load_into41,
    read_attention41,
    write_attention41,
)
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
from v4kv_jax.interop.names41 import TABLE41, expected_shapes41, layer_prefix41
from v4kv_jax.interop.safetensors_io import SafetensorsFile

__all__ = [
    "OFFICIAL", "TABLE", "TABLE41", "TRANSFORMERS", "CheckpointError", "SafetensorsFile",
    "attention_config_from_hf", "attention_params", "attention_params41", "attention_state",
    "attention_state41", "checkpoint_tensors", "dequantize", "dequantize41", "detect_layout",
    "expected_shapes", "expected_shapes41", "layer_prefix", "layer_prefix41", "load_attention",
    "load_attention41", "load_into", "load_into41", "read_attention", "read_attention41",
    "set_norms", "transformers_config_kwargs", "v41_config_from_hf", "write_attention",
    "write_attention41",
]
