"""The pre-norm encoder layer with RMSNorm, grouped-query attention and a SwiGLU MLP: EuroBERT (transformers'
EuroBertModel, Llama's decoder layer attending both ways).

    h    = RMSNorm1(x)                                       [T, H]     input_layernorm
    qkv  = qkv_projection(h)                                 [T, 3, nh, hd]   q_proj/k_proj/v_proj: one GEMM
    ctx  = attention(qkv, layout, rotary)                    [T, H]     q and k rotated per token
    x, h = residual_layernorm(ctx @ W_o^T + x, rms)          [T, H] x2  the new stream, post_attention_layernorm of it
    g    = bias_gelu(h @ [W_gate; W_up]^T, silu, gated)      [T, I]     silu(gate) * up
    x    = x + g @ W_down^T                                  [T, H]     one addmm

With num_key_value_heads < num_attention_heads, k_proj and v_proj are narrower: the fused weight's rows are q, then
k, then v, and each key/value head serves num_attention_heads / num_key_value_heads query heads (transformers'
repeat_kv). The GEMM's output viewed per head, [T, nh + 2 kv, hd], is what the attention op takes then: the key/value
heads are read for their groups, never repeated in memory. The model applies the final RMSNorm after the last layer.
A linear an adapter wraps is called as the module it is.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from .. import adapters, families, rotary, twins
from ..units.attention import Extras
from .base import EncoderLayer, RMSNorm
from .fused_qkv import FusedQKV


class RMSPreNormLayer(EncoderLayer):
    """EuroBERT's layer (HF's EuroBertDecoderLayer) at its module paths: biases as attention_bias / mlp_bias say,
    key/value heads as num_key_value_heads says."""

    def __init__(self, config, family: families.Family = families.EUROBERT, index: int = 0):
        super().__init__(config, family, index)
        self.layer_type = rotary.FULL  # one rope for every layer (rotary.layer_types)
        self.window = None
        self.kv_heads = _kv_heads(config)
        self.head_dim = config.hidden_size // config.num_attention_heads

    def leaves(self, config, family, index):
        H, I = config.hidden_size, family.get(config, "intermediate_size")
        eps = family.get(config, "layer_norm_eps")
        return {"attn_out": nn.Linear(H, H, bias=config.attention_bias),
                "ffn_out": nn.Linear(I, H, bias=config.mlp_bias), "ln1": RMSNorm(H, eps), "ln2": RMSNorm(H, eps)}

    def fused_linears(self, config, roles, names):
        H = config.hidden_size
        if roles[0] == "query":
            kv = _kv_heads(config) * (H // config.num_attention_heads)
            return FusedQKV(H, names, (H, kv, kv), bias=config.attention_bias)
        return FusedQKV(H, names, self.family.get(config, "intermediate_size"), bias=config.mlp_bias)

    def place_dropout(self, holder, name, kind, p):
        """HF's: the dropout on the attention probabilities is a float on the attention module."""
        holder.attention_dropout = p

    def qkv(self, h: torch.Tensor, run) -> torch.Tensor:
        """h [T, H] -> q, k, v as [T, 3, nh, hd]; with fewer key/value heads, grouped [T, nh + 2 kv, hd] (q heads, k
        heads, v heads: the fused weight's rows), which attention reads as it is (Extras.kv_heads)."""
        sa = self.self_attention
        T, nh, hd, kv = h.shape[0], self.num_heads, self.head_dim, self.kv_heads
        plain = all(adapters.is_plain_linear(sa._modules[name]) for name in sa.names)
        if plain:
            weight, bias = sa.fused(sa.parts(), run.traced, run.grad)
            return run.qkv_projection(h, weight, bias, nh, kv_heads=kv if kv < nh else None)   # one GEMM
        # adapters on some of q/k/v: each module as it is, in the fused GEMM's column order
        qkv = torch.cat([sa._modules[name](h) for name in sa.names], dim=-1)
        return qkv.view(T, 3, nh, hd) if kv == nh else qkv.view(T, nh + 2 * kv, hd)

    def forward(self, x, attn, run, output_attentions: bool = False, rotary=None, workspace=None):
        """x [T, H] -> ([T, H], attention probabilities or None); `rotary`: the cos/sin of the packed tokens."""
        ln1, out, ln2, wo = map(self.module, ("ln1", "attn_out", "ln2", "ffn_out"))
        p_attn = self.dropouts()[0] if self.training else 0.0
        plain = adapters.is_plain_linear
        qkv = self.qkv(ln1(x), run)                                          # [T, 3, nh, hd] or [T, nh + 2 kv, hd]
        kv_heads = self.kv_heads if self.kv_heads < self.num_heads else None
        ctx, probs = run.attention(qkv, attn, self.scale, p_attn, output_attentions,
                                   Extras(rotary=rotary, kv_heads=kv_heads))                    # [T, H]
        if plain(out) and RMSNorm.is_plain(ln2):  # no dropout: HF adds o_proj's output as it is
            x, h = run.residual_layernorm(ctx, out.weight, out.bias, x, ln2.weight, None, ln2.variance_epsilon,
                                          pre_norm=True, rms=True, workspace=workspace)          # [T, H] each
        else:  # an adapter on W_o, or another module in the norm's place: each called as the module it is
            x = torch.addmm(x, ctx, out.weight.t()) if plain(out) and out.bias is None else x + out(ctx)
            h = ln2(x)
        gate, up = self.module("ffn_gate"), self.module("ffn_up")
        if plain(gate) and plain(up):
            weight, bias = self.gate_up(run)
            g = run.bias_gelu(h, weight, bias, self.activation, gated=True)                      # [T, I]
        else:
            g = twins.activate(gate(h), self.activation) * up(h)
        if plain(wo) and wo.bias is None:
            return torch.addmm(x, g, wo.weight.t()), probs  # x + g @ W_down^T
        return x + wo(g), probs


def _kv_heads(config) -> int:
    """num_key_value_heads (None: as many as the query heads)."""
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads
