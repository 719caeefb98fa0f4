"""ModernBERT's positions: rotary q/k per layer type, and the sliding window of its local layers, read off the config.

Each layer is "full_attention" or "sliding_attention" (config.layer_types; configs written before transformers 5
give global_attn_every_n_layers instead: layer i is full when i % n == 0). A layer type has its own rotary theta
(rope_parameters[type]["rope_theta"]; older configs: global_rope_theta / local_rope_theta). A sliding layer's query
i sees keys j with |i - j| <= local_attention // 2 (transformers' config.sliding_window; inclusive, as its mask).

inv_freq is HF's default rotary formula, 1 / theta^(2k / hd); the model turns it into per-token cos/sin tables once
per forward (twins.rotary_tables), which the attention reads.
"""
from __future__ import annotations

import torch

FULL, SLIDING = "full_attention", "sliding_attention"
_DEFAULT_THETA = {FULL: 160_000.0, SLIDING: 10_000.0}  # ModernBertConfig's defaults
_OLD_THETA_FIELD = {FULL: "global_rope_theta", SLIDING: "local_rope_theta"}


def layer_types(config) -> list[str]:
    types = getattr(config, "layer_types", None)
    if types is None:
        every = getattr(config, "global_attn_every_n_layers", 3)
        types = [FULL if i % every == 0 else SLIDING for i in range(config.num_hidden_layers)]
    types = list(types)
    unknown = sorted(set(types) - {FULL, SLIDING})
    if unknown or len(types) != config.num_hidden_layers:
        raise ValueError(f"config.layer_types must give one of {FULL!r} / {SLIDING!r} for each of the "
                         f"{config.num_hidden_layers} layers, got {types!r}")
    return types


def window(config, layer_type: str) -> int | None:
    """The half-window of a sliding layer (keys within +-w positions), None for a full one."""
    return config.local_attention // 2 if layer_type == SLIDING else None


def rope_theta(config, layer_type: str) -> float:
    params = (getattr(config, "rope_parameters", None) or {}).get(layer_type)
    if params is None:
        return float(getattr(config, _OLD_THETA_FIELD[layer_type], _DEFAULT_THETA[layer_type]))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default":
        raise NotImplementedError(f"config.rope_parameters[{layer_type!r}]: rope_type={kind!r} is not supported by "
                                  f"fastbert (only 'default' rotary embeddings)")
    return float(params["rope_theta"])


def inv_freq(config, layer_type: str, head_dim: int, device) -> torch.Tensor:
    """[head_dim / 2] float32, as transformers' ModernBertRotaryEmbedding computes it."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    return 1.0 / (rope_theta(config, layer_type) ** exponents)
