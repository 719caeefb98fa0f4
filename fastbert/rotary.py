"""Rotary positions, read off the config: each layer's type, its rotary frequencies (and the scaled rope types
transformers implements), and the sliding window of ModernBERT's local layers.

Two config layouts carry them:
- one rope for every layer (NomicBERT, GTE, Jina-Embeddings-v3): `rope_parameters` is one dict, {"rope_type",
  "rope_theta", and the scaled types' fields}; every layer is "full_attention";
- a rope per layer type (ModernBERT): each layer is "full_attention" or "sliding_attention" (config.layer_types;
  configs written before transformers 5 give global_attn_every_n_layers instead: layer i is full when i % n == 0),
  and rope_parameters[type] holds that type's dict (older configs: global_rope_theta / local_rope_theta). A sliding
  layer's query i sees keys j with |i - j| <= local_attention // 2 (transformers' config.sliding_window; inclusive,
  as its mask).

inv_freq is HF's default formula, 1 / theta^(2k / hd); a scaled rope type ("linear", "yarn", "llama3", ...) is
computed by transformers' own function for that type (modeling_rope_utils.ROPE_INIT_FUNCTIONS), so its frequencies
and its attention factor (the scale HF applies to cos and sin) are HF's to the bit. The model turns them into
per-token cos/sin tables once per forward (twins.rotary_tables), which the attention reads. "dynamic" and "longrope"
are refused: HF recomputes their frequencies from the longest position in each batch (and keeps the largest seen),
which a padding-free forward of the same text cannot reproduce from one sequence alone.
"""
from __future__ import annotations

import torch

FULL, SLIDING = "full_attention", "sliding_attention"
_DEFAULT_THETA = {FULL: 160_000.0, SLIDING: 10_000.0}  # ModernBertConfig's defaults
_OLD_THETA_FIELD = {FULL: "global_rope_theta", SLIDING: "local_rope_theta"}
_BATCH_DEPENDENT = ("dynamic", "longrope")  # rope types whose frequencies HF recomputes from each batch


def _per_layer_type(config) -> bool:
    """ModernBERT's layout: a rope per layer type (rope_parameters keyed by type, or the pre-5 theta fields)."""
    params = getattr(config, "rope_parameters", None) or {}
    if FULL in params or SLIDING in params:
        return True
    return "rope_theta" not in params and hasattr(config, "global_attn_every_n_layers")


def layer_types(config) -> list[str]:
    if not _per_layer_type(config):
        return [FULL] * config.num_hidden_layers
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


def _params(config, layer_type: str) -> dict | None:
    """The rope dict of `layer_type` (None: a pre-5 ModernBERT config with theta fields only)."""
    params = getattr(config, "rope_parameters", None) or {}
    if _per_layer_type(config):
        return params.get(layer_type)
    return params or None


def rope_type(config, layer_type: str) -> str:
    """The layer type's rope_type; a batch-dependent one is a NotImplementedError naming it."""
    params = _params(config, layer_type) or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in _BATCH_DEPENDENT:
        raise NotImplementedError(f"config.rope_parameters: rope_type={kind!r} is not supported by fastbert: "
                                  f"transformers recomputes its frequencies from the longest position of each batch "
                                  f"(supported: 'default' and the static scaled types, e.g. 'linear', 'yarn', "
                                  f"'llama3')")
    if kind != "default":
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
        if kind not in ROPE_INIT_FUNCTIONS:
            raise NotImplementedError(f"config.rope_parameters: rope_type={kind!r} is not one transformers implements "
                                      f"({', '.join(['default', *ROPE_INIT_FUNCTIONS])})")
    return kind


def rope_theta(config, layer_type: str) -> float:
    params = _params(config, layer_type)
    if params is None:
        return float(getattr(config, _OLD_THETA_FIELD[layer_type], _DEFAULT_THETA[layer_type]))
    rope_type(config, layer_type)  # refuses what fastbert cannot compute
    return float(params["rope_theta"])


def inv_freq(config, layer_type: str, head_dim: int, device) -> tuple[torch.Tensor, float]:
    """([head_dim / 2] float32, attention factor): as transformers' rotary embedding of the family computes them (the
    factor scales cos and sin; 1.0 but for scaled types such as "yarn")."""
    kind = rope_type(config, layer_type)
    if kind != "default":
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
        layer = {"layer_type": layer_type} if _per_layer_type(config) else {}
        freq, factor = ROPE_INIT_FUNCTIONS[kind](config, device, **layer)
        return freq.float(), float(factor)
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    return 1.0 / (rope_theta(config, layer_type) ** exponents), 1.0
