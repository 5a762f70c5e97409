"""The transformers 5.23.0 `DeepseekV4Attention` run side by side with v4kv (parity, benchmarks).

`TransformersAttention` holds one transformers attention layer per layer of an
`AttentionConfig` and runs them on a `DynamicCache`, either as bare layers (`residual=False`:
output = attn(x) of the one layer) or as the attention stack x -> x + attn(RMSNorm(x)) per
layer. It does what transformers' own model does around its layers: the 4D sliding-window mask
(built before the cache update; the layer ignores causality and the top-k without it), the
"main" / "compress" RoPE tables from the positions, and positions that continue across calls.

Needs torch and transformers==5.23.0 (the `test` extra).
"""

from __future__ import annotations

import numpy as np
import torch

from v4kv_jax import checks
from v4kv_jax.config import AttentionConfig
from v4kv_jax.interop import convert, names
from v4kv_jax.interop.hf_config import transformers_config_kwargs


def transformers_config(config: AttentionConfig, **extra):
    """A `DeepseekV4Config` with this attention geometry and the eager attention path."""
    from transformers import DeepseekV4Config

    hf = DeepseekV4Config(**transformers_config_kwargs(config, **extra))
    hf._attn_implementation = "eager"
    return hf


class TransformersAttention:
    """transformers' attention layers for every layer of `config`, fp32 on CPU.

    Args:
      config: the geometry (layer kinds from `compress_ratios`).
      residual: run x -> x + attn(RMSNorm(x)) per layer (the stack); False runs a
        one-layer config as a bare layer (output = attn(x)).
    """

    def __init__(self, config: AttentionConfig, residual: bool = True):
        from transformers.models.deepseek_v4 import modeling_deepseek_v4 as m

        names.check_config(config)
        if not isinstance(residual, bool):
            checks.fail("residual", "a bool", residual, TypeError)
        if not residual and config.num_layers != 1:
            checks.fail("residual", "True for a config of several layers (False runs one bare "
                        "layer)", f"False with {config.num_layers} layers")
        self.config = config
        self.residual = residual
        self.hf_config = transformers_config(config)
        self.layers = [m.DeepseekV4Attention(self.hf_config, i).eval()
                       for i in range(config.num_layers)]
        self.norms = [m.DeepseekV4RMSNorm(config.hidden_size, eps=config.rms_eps)
                      for _ in range(config.num_layers)]
        self.rotary = m.DeepseekV4RotaryEmbedding(self.hf_config)

    # --- weights ---------------------------------------------------------------------------

    @torch.no_grad()
    def randomize(self, seed: int = 0, bias_scale: float = 0.5, norm_scale: float = 0.1) -> None:
        """Random weights: projections N(0, 1/fan_in), norm weights 1 + N(0, norm_scale^2),
        ape (`position_bias`) and sinks N(0, bias_scale^2) (transformers leaves them empty)."""
        seed = names.index("seed", seed, hi=2**63 - 1)
        checks.real("bias_scale", bias_scale, lo=0.0)
        checks.real("norm_scale", norm_scale, lo=0.0)
        gen = torch.Generator().manual_seed(seed)
        for module in [*self.layers, *self.norms]:
            for name, p in module.named_parameters():
                noise = torch.randn(p.shape, generator=gen)
                if p.ndim == 2 and not name.endswith("position_bias"):
                    p.copy_(noise / p.shape[1] ** 0.5)
                elif "norm" in name or module in self.norms:
                    p.copy_(1 + norm_scale * noise)
                else:
                    p.copy_(bias_scale * noise)

    def state_dict(self, layer: int) -> dict[str, np.ndarray]:
        """The transformers-named tensors of one attention layer, as numpy."""
        return {k: v.detach().numpy().copy()
                for k, v in self.layers[self._layer(layer)].state_dict().items()}

    def attention_params(self, layer: int) -> dict[str, np.ndarray]:
        """One layer's weights as `V4Attention` params (through `convert.attention_params`)."""
        layer = self._layer(layer)
        return convert.attention_params(self.state_dict(layer), self.config,
                                        self.config.layer_kinds[layer], names.TRANSFORMERS)

    def norm_weight(self, layer: int) -> np.ndarray:
        return self.norms[self._layer(layer)].weight.detach().numpy().copy()

    def _layer(self, layer) -> int:
        return names.index("layer", layer, hi=self.config.num_layers - 1)

    @torch.no_grad()
    def load(self, layer: int, params, norm=None) -> None:
        """Sets one layer's weights from `V4Attention` params (and its pre-norm weight)."""
        layer = self._layer(layer)
        tensors = convert.checkpoint_tensors(params, self.config.layer_kinds[layer],
                                             names.TRANSFORMERS, config=self.config)
        if norm is not None:
            checks.shape("norm", norm, (self.config.hidden_size,))
        self.layers[layer].load_state_dict(
            {k: torch.from_numpy(np.array(v, np.float32)) for k, v in tensors.items()},
            strict=True)
        if norm is not None:
            self.norms[layer].weight.copy_(torch.from_numpy(np.array(norm, np.float32)))

    # --- running ---------------------------------------------------------------------------

    def new_cache(self):
        from transformers.cache_utils import DynamicCache

        return DynamicCache(config=self.hf_config)

    @torch.no_grad()
    def forward(self, x, cache, start: int) -> np.ndarray:
        """One chunk x [B, T, D] at positions start .. start + T - 1 of every row (transformers'
        cache holds equal-length rows). Returns f32[B, T, D]."""
        from transformers.masking_utils import create_sliding_window_causal_mask

        checks.shape("x", x, (None, None, self.config.hidden_size))
        start = names.index("start", start)
        h = torch.as_tensor(np.asarray(x, np.float32))
        batch, tokens, _ = h.shape
        pos = torch.arange(start, start + tokens)[None].expand(batch, -1)
        mask = create_sliding_window_causal_mask(
            config=self.hf_config, inputs_embeds=h, attention_mask=None,
            past_key_values=cache, position_ids=pos)
        tables = {t: self.rotary(h, pos, layer_type=t) for t in ("main", "compress")}
        for layer, norm in zip(self.layers, self.norms, strict=True):
            inp = norm(h) if self.residual else h
            out, _ = layer(inp, position_embeddings=tables, position_ids=pos,
                           attention_mask=mask, past_key_values=cache)
            h = h + out if self.residual else out
        return h.numpy()

    def run_chunks(self, x, chunks) -> np.ndarray:
        """Feeds x [B, L, D] in chunks of the given sizes through a fresh cache; returns the
        outputs of every position, f32[B, sum(chunks), D]."""
        checks.shape("x", x, (None, None, self.config.hidden_size))
        chunks = [names.index("chunks", n, lo=1) for n in chunks]
        if sum(chunks) > np.shape(x)[1]:
            checks.fail("chunks", f"sizes summing to at most x's {np.shape(x)[1]} positions",
                        f"{chunks} (sum {sum(chunks)})")
        cache, outs, done = self.new_cache(), [], 0
        for n in chunks:
            outs.append(self.forward(np.asarray(x)[:, done:done + n], cache, done))
            done += n
        return np.concatenate(outs, axis=1)
