"""The pre-norm encoder layer with RMSNorm, grouped-query attention and a SwiGLU MLP: EuroBERT (transformers'
EuroBertModel, Llama's decoder layer attending both ways) and Qwen3 (Qwen3Model: the same layer attending causally,
with an RMSNorm over each head's q and k).

    h    = RMSNorm1(x)                                       [T, H]     input_layernorm
    qkv  = qkv_projection(h)                                 [T, 3, nh, hd]   q_proj/k_proj/v_proj: one GEMM
    q, k = RMSNorm_q(q), RMSNorm_k(k)                        per head   Qwen3's q_norm / k_norm over head_dim
    ctx  = attention(qkv, layout, rotary, causal)            [T, nh*hd] q and k rotated per token; Qwen3: j <= i
    x, h = residual_layernorm(ctx @ W_o^T + x, rms)          [T, H] x2  the new stream, post_attention_layernorm of it
    g    = bias_gelu(h @ [W_gate; W_up]^T, silu, gated)      [T, I]     silu(gate) * up
    x    = x + g @ W_down^T                                  [T, H]     one addmm

With num_key_value_heads < num_attention_heads, k_proj and v_proj are narrower: the fused weight's rows are q, then
k, then v, and each key/value head serves num_attention_heads / num_key_value_heads query heads (transformers'
repeat_kv). The GEMM's output viewed per head, [T, nh + 2 kv, hd], is what the attention op takes then: the key/value
heads are read for their groups, never repeated in memory. The model applies the final RMSNorm after the last layer.
A linear an adapter wraps is called as the module it is. Qwen3's heads are head_dim wide whatever hidden / heads is
(16 of 128 over 1,024): q_proj is [nh * hd, H] and o_proj [H, nh * hd].
"""
from __future__ import annotations

import torch
import torch.nn as nn

from .. import adapters, families, rotary, twins
from ..units.attention import Extras
from ..units.residual_layernorm import rms_norm
from .base import EncoderLayer, RMSNorm
from .fused_qkv import FusedQKV


class RMSPreNormLayer(EncoderLayer):
    """EuroBERT's layer (HF's EuroBertDecoderLayer) and Qwen3's (Qwen3DecoderLayer) at their module paths: biases as
    attention_bias / mlp_bias say, key/value heads as num_key_value_heads says; the family's axes add causal
    attention and the q/k norms."""

    def __init__(self, config, family: families.Family = families.EUROBERT, index: int = 0):
        super().__init__(config, family, index)
        self.layer_type = rotary.FULL  # one rope for every layer (rotary.layer_types)
        self.window = None
        self.kv_heads = _kv_heads(config)
        self.head_dim = family.head_dim(config)
        # the scores' scale (families.Family.attention_scale): 1/sqrt(head_dim), Gemma's 1/sqrt(query_pre_attn_scalar)
        self.scale = twins.default_scale(config.query_pre_attn_scalar if family.attention_scale ==
                                         "query_pre_attn_scalar" else self.head_dim)
        self.causal = family.causal

    def leaves(self, config, family, index):
        H, I = config.hidden_size, family.get(config, "intermediate_size")
        eps = family.get(config, "layer_norm_eps")
        width = config.num_attention_heads * family.head_dim(config)  # the heads side by side
        leaves = {"attn_out": nn.Linear(width, H, bias=config.attention_bias),
                  "ffn_out": nn.Linear(I, H, bias=_mlp_bias(config)), "ln1": RMSNorm(H, eps), "ln2": RMSNorm(H, eps)}
        if family.qk_norm:  # over one head's head_dim, shared by every head
            leaves["q_norm"], leaves["k_norm"] = RMSNorm(family.head_dim(config), eps), \
                RMSNorm(family.head_dim(config), eps)
        return leaves

    def fused_linears(self, config, roles, names):
        H = config.hidden_size
        if roles[0] == "query":
            hd = self.family.head_dim(config)
            q, kv = config.num_attention_heads * hd, _kv_heads(config) * hd
            return FusedQKV(H, names, (q, kv, kv), bias=config.attention_bias)
        return FusedQKV(H, names, self.family.get(config, "intermediate_size"), bias=_mlp_bias(config))

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

    def normed_qk(self, qkv: torch.Tensor) -> torch.Tensor:
        """Qwen3: q_norm over each query head, k_norm over each key head (HF's RMSNorm on head_dim, before rotary),
        into a new qkv of the same layout; v as it is. A norm another module replaced is called as the module it
        is."""
        qn, kn = self.module("q_norm"), self.module("k_norm")
        grouped = qkv.dim() == 3
        nh = self.num_heads
        q, k, v = (qkv[:, :nh], qkv[:, nh:nh + self.kv_heads], qkv[:, nh + self.kv_heads:]) if grouped \
            else qkv.unbind(1)                                                       # [T, heads, hd] each
        q, k = (rms_norm(x, n.weight, n.variance_epsilon) if RMSNorm.is_plain(n) else n(x)
                for x, n in ((q, qn), (k, kn)))
        return torch.cat((q, k, v), dim=1) if grouped else torch.stack((q, k, v), dim=1)

    def forward(self, x, attn, run, output_attentions: bool = False, rotary=None, workspace=None):
        """x [T, H] -> ([T, H], attention probabilities or None); `rotary`: the cos/sin of the packed tokens."""
        ln1, out, ln2, wo = map(self.module, ("ln1", "attn_out", "ln2", "ffn_out"))
        p_attn = self.dropouts()[0] if self.training else 0.0
        plain = adapters.is_plain_linear
        qkv = self.qkv(ln1(x), run)                                          # [T, 3, nh, hd] or [T, nh + 2 kv, hd]
        if self.family.qk_norm:
            qkv = self.normed_qk(qkv)
        kv_heads = self.kv_heads if self.kv_heads < self.num_heads else None
        ctx, probs = run.attention(qkv, attn, self.scale, p_attn, output_attentions,
                                   Extras(rotary=rotary, kv_heads=kv_heads, causal=self.causal))  # [T, nh*hd]
        if plain(out) and RMSNorm.is_plain(ln2):  # no dropout: HF adds o_proj's output as it is
            x, h = run.residual_layernorm(ctx, out.weight, out.bias, x, ln2.weight, None, ln2.variance_epsilon,
                                          pre_norm=True, rms=True, workspace=workspace)          # [T, H] each
        else:  # an adapter on W_o, or another module in the norm's place: each called as the module it is
            x = twins.add_linear(x, ctx, out.weight, out.bias, run.fmt) if plain(out) else x + out(ctx)
            h = ln2(x)
        gate, up = self.module("ffn_gate"), self.module("ffn_up")
        if plain(gate) and plain(up):
            weight, bias = self.gate_up(run)
            g = run.bias_gelu(h, weight, bias, self.activation, gated=True)                      # [T, I]
        else:
            g = twins.activate(gate(h), self.activation) * up(h)
        if plain(wo):
            return twins.add_linear(x, g, wo.weight, wo.bias, run.fmt), probs  # x + g @ W_down^T (+ b)
        return x + wo(g.to(x.dtype)), probs  # g: bf16 where the bf16 format keeps bias_gelu's output so


def _mlp_bias(config) -> bool:
    """EuroBERT's mlp_bias; Qwen3's MLP has none (its config has no such field)."""
    return getattr(config, "mlp_bias", False)


def _kv_heads(config) -> int:
    """num_key_value_heads (None: as many as the query heads)."""
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads
