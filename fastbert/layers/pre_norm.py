"""The pre-norm encoder layer with a gated MLP: ModernBERT.

    h      = LN1(x)                                          [T, H]     (layer 0: the identity)
    qkv    = qkv_projection(h)                               [T, 3, nh, hd]
    ctx    = attention(qkv, layout, rotary, window)          [T, H]     rotary q/k; a window on local layers
    x, h   = residual_layernorm(ctx @ Wo + x)                [T, H] x2  the new stream and LN2 of it
    g      = bias_gelu(h @ Wi^T, gated)                      [T, I]     act(a) * g for [a, g] = h @ Wi^T
    x      = x + g @ Wo2^T                                   [T, H]     one addmm

The model applies the final norm after the last layer. A linear an adapter wraps is called as the module it is.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from .. import adapters, families, rotary, twins
from ..mask import tracing
from ..units.attention import Extras
from .base import NO_DROPOUT, EncoderLayer


class PreNormLayer(EncoderLayer):
    """ModernBERT's layer (HF's ModernBertEncoderLayer) at its module paths: biases as its config says, Wi holding
    both halves of the gated MLP, layer 0 without LN1, a sliding window on the layers its config names local."""

    def __init__(self, config, family: families.Family = families.MODERNBERT, index: int = 0):
        super().__init__(config, family, index)
        self.layer_type = rotary.layer_types(config)[index]
        self.window = rotary.window(config, self.layer_type) if family.windows else None

    def leaves(self, config, family, index):
        H, I = config.hidden_size, family.get(config, "intermediate_size")
        eps = family.get(config, "layer_norm_eps")
        attn_bias, mlp_bias, norm_bias = config.attention_bias, config.mlp_bias, config.norm_bias
        return {"ln1": nn.Identity() if index == 0 else nn.LayerNorm(H, eps=eps, bias=norm_bias),
                "qkv": nn.Linear(H, 3 * H, bias=attn_bias), "attn_out": nn.Linear(H, H, bias=attn_bias),
                "ln2": nn.LayerNorm(H, eps=eps, bias=norm_bias), "ffn_in": nn.Linear(H, 2 * I, bias=mlp_bias),
                "ffn_out": nn.Linear(I, H, bias=mlp_bias)}

    def place_dropout(self, holder, name, kind, p):
        """HF's: the dropout on the attention probabilities is a float on the attention module (its
        `attention_dropout`); the one after Wo an nn.Identity when p is 0."""
        if kind == "attention":
            holder.attention_dropout = p
        else:
            holder.add_module(name, nn.Identity() if kind == "attention_output" and p == 0 else nn.Dropout(p))

    @staticmethod
    def workspace(x, run) -> twins.Workspace | None:
        """The buffers the twins reuse from layer to layer (twins.Workspace), where nothing records the calls: on CPU,
        autograd off, not traced, every op on its twin. Else None: the ops allocate as usual."""
        if x.device.type != "cpu" or torch.is_grad_enabled() or run.traced or run.triton or tracing():
            return None
        return twins.Workspace()

    def forward(self, x, attn, run, output_attentions: bool = False, rotary=None, workspace=None):
        """x [T, H] -> ([T, H], attention probabilities or None); `rotary`: this layer type's cos/sin of the packed
        tokens; `workspace`: the twins' buffers, or None. What the layer returns is never one of the workspace's
        buffers (the addmm or x + wo(g) allocates the new stream)."""
        ln1, qkv_in, out, ln2, wi, wo = map(self.module, ("ln1", "qkv", "attn_out", "ln2", "ffn_in", "ffn_out"))
        p_attn, p_attn_out, p_mlp, _, _ = self.dropouts() if self.training else NO_DROPOUT
        plain = adapters.is_plain_linear
        ws = {} if workspace is None else {"workspace": workspace}
        if type(ln1) is nn.LayerNorm:
            h = torch.layer_norm(x, (x.shape[-1],), ln1.weight, ln1.bias, ln1.eps)
        else:  # layer 0's nn.Identity, or another module in the norm's place
            h = ln1(x)
        if plain(qkv_in):
            qkv = run.qkv_projection(h, qkv_in.weight, qkv_in.bias, self.num_heads, **ws)        # [T, 3, nh, hd]
        else:
            qkv = qkv_in(h).view(h.shape[0], 3, self.num_heads, -1)
        ctx, probs = run.attention(qkv, attn, self.scale, p_attn, output_attentions,
                                   Extras(window=self.window, rotary=rotary), **ws)             # [T, H]
        if plain(out) and type(ln2) is nn.LayerNorm:
            x, h = run.residual_layernorm(ctx, out.weight, out.bias, x, ln2.weight, ln2.bias, ln2.eps, p_attn_out,
                                          pre_norm=True, **ws)                                  # [T, H] each
        else:
            x = x + twins.dropout(out(ctx), p_attn_out)  # p_attn_out is 0 in eval mode
            h = ln2(x)
        if plain(wi):
            g = run.bias_gelu(h, wi.weight, wi.bias, self.activation, gated=True, **ws)       # [T, I]
        else:
            a, gate = wi(h).chunk(2, dim=-1)
            g = twins.activate(a, self.activation) * gate
        if p_mlp > 0:
            g = twins.dropout(g, p_mlp)
        if plain(wo):
            return twins.add_linear(x, g, wo.weight, wo.bias, run.fmt), probs  # x + g @ Wo^T: one GEMM (no bias)
        return x + wo(g.to(x.dtype)), probs  # g: bf16 where the bf16 format keeps bias_gelu's output so
