"""The sandwich-norm encoder layer: Gemma 3 run both ways (EmbeddingGemma; transformers' Gemma3DecoderLayer with
use_bidirectional_attention). A norm before and after each sublayer, every one Gemma's (1 + w) RMSNorm:

    h    = N_in(x)                                           [T, H]     input_layernorm
    qkv  = qkv_projection(h)                                 [T, nh + 2 kv, hd]   q_proj/k_proj/v_proj: one GEMM
    q, k = N_q(q), N_k(k)                                    per head   q_norm / k_norm over head_dim
    ctx  = attention(qkv, layout, rotary, window)            [T, nh*hd] scale 1/sqrt(query_pre_attn_scalar); a
                                                                        window on the sliding layers
    x    = x + N_after_attention(ctx @ W_o^T)                [T, H]     post_attention_layernorm
    h    = N_before_ffn(x)                                   [T, H]     pre_feedforward_layernorm
    g    = bias_gelu(h @ [W_gate; W_up]^T, gelu_tanh, gated) [T, I]     gelu_tanh(gate) * up
    x    = x + N_after_ffn(g @ W_down^T)                     [T, H]     post_feedforward_layernorm

It is the RMSNorm pre-norm layer (rms_pre_norm.py: the fused QKV over grouped key/value heads, the per-head q/k
norms, the gated MLP over [gate; up]) with a norm after each sublayer: those norms sit between a GEMM and the
residual add, where residual_layernorm's fused form (norm after the add) does not apply, so they run as the modules
they are. A sliding layer's query i sees keys j with |i - j| < sliding_window (HF's bidirectional window overlay,
exclusive): the attention window w = sliding_window - 1 (inclusive), per layer type, with that type's rope.
"""
from __future__ import annotations

import torch

from .. import adapters, families, rotary, twins
from ..units.attention import Extras
from .base import OffsetRMSNorm
from .rms_pre_norm import RMSPreNormLayer


class SandwichNormLayer(RMSPreNormLayer):
    """Gemma 3's layer (HF's Gemma3DecoderLayer) at its module paths: no biases unless attention_bias says, key/value
    heads as num_key_value_heads says, heads head_dim wide, the layer type from config.layer_types."""

    def __init__(self, config, family: families.Family = families.GEMMA3_TEXT, index: int = 0):
        super().__init__(config, family, index)
        self.layer_type = rotary.layer_types(config)[index]
        self.window = config.sliding_window - 1 if self.layer_type == rotary.SLIDING else None

    def leaves(self, config, family, index):
        H, I, hd = config.hidden_size, family.get(config, "intermediate_size"), family.head_dim(config)
        eps = family.get(config, "layer_norm_eps")
        width = config.num_attention_heads * hd
        return {"attn_out": torch.nn.Linear(width, H, bias=config.attention_bias),
                "ffn_out": torch.nn.Linear(I, H, bias=False),
                "q_norm": OffsetRMSNorm(hd, eps), "k_norm": OffsetRMSNorm(hd, eps),
                **{role: OffsetRMSNorm(H, eps) for role in ("ln1", "ln_after_attention", "ln2", "ln_after_ffn")}}

    def forward(self, x, attn, run, output_attentions: bool = False, rotary=None, workspace=None):
        """x [T, H] -> ([T, H], attention probabilities or None); `rotary`: this layer type's cos/sin of the packed
        tokens."""
        n_in, n_attn, n_ffn, n_after = map(self.module, ("ln1", "ln_after_attention", "ln2", "ln_after_ffn"))
        out, wo = self.module("attn_out"), self.module("ffn_out")
        p_attn = self.dropouts()[0] if self.training else 0.0
        qkv = self.normed_qk(self.qkv(n_in(x), run))                      # [T, 3, nh, hd] or [T, nh + 2 kv, hd]
        kv_heads = self.kv_heads if self.kv_heads < self.num_heads else None
        ctx, probs = run.attention(qkv, attn, self.scale, p_attn, output_attentions,
                                   Extras(window=self.window, rotary=rotary, kv_heads=kv_heads))   # [T, nh*hd]
        plain = adapters.is_plain_linear
        x = x + n_attn(twins.linear(ctx, out.weight, out.bias, run.fmt) if plain(out) else out(ctx))  # [T, H]
        h = n_ffn(x)
        gate, up = self.module("ffn_gate"), self.module("ffn_up")
        if plain(gate) and plain(up):
            weight, bias = self.gate_up(run)
            g = run.bias_gelu(h, weight, bias, self.activation, gated=True)                      # [T, I]
        else:
            g = twins.activate(gate(h), self.activation) * up(h)
        return x + n_after(twins.linear(g, wo.weight, wo.bias, run.fmt) if plain(wo) else wo(g.to(x.dtype))), probs
