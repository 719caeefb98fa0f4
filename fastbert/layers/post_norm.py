"""The post-norm encoder layer: BERT, RoBERTa, XLM-RoBERTa, CamemBERT, ELECTRA, DistilBERT, MPNet.

    qkv = qkv_projection(x)                                  [T, 3, nh, hd]   one GEMM over the fused W_qkv
    ctx = attention(qkv, layout, extras)                     [T, H]           per sequence, never across
    x   = residual_layernorm(ctx @ W_o + b_o + x)            [T, H]           LN1
    h   = bias_gelu(x @ W_1 + b_1)                           [T, I]           the family's activation
    x   = residual_layernorm(h @ W_2 + b_2 + x)              [T, H]           LN2

`extras` is what attention adds to its scores: MPNet's per-distance bias table, or nothing. With a PEFT adapter on
one of the linears the same math runs with that module called as it is (`_forward_adapted`).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn as nn

from .. import adapters, families, twins
from ..units.attention import NONE, Extras
from .base import NO_DROPOUT, EncoderLayer


class LayerWeights(NamedTuple):
    """The twelve tensors of one post-norm layer, as the four ops take them, and its LayerNorms' eps (read off the
    modules at every forward, as nn.LayerNorm's forward reads it)."""
    qkv: torch.Tensor
    qkv_bias: torch.Tensor
    attn_out: torch.Tensor
    attn_out_bias: torch.Tensor
    ln1: torch.Tensor
    ln1_bias: torch.Tensor
    ln1_eps: float
    ffn_in: torch.Tensor
    ffn_in_bias: torch.Tensor
    ffn_out: torch.Tensor
    ffn_out_bias: torch.Tensor
    ln2: torch.Tensor
    ln2_bias: torch.Tensor
    ln2_eps: float


# LayerWeights(*fields) runs the named tuple's Python-level __new__, a frame of 15 arguments, in every layer's
# forward; tuple.__new__ builds the same object in C (host work: bench/host_instructions.py)
_layer_weights = functools.partial(tuple.__new__, LayerWeights)


class PostNormLayer(EncoderLayer):
    """x = LN1(x + attention(x)), x = LN2(x + FFN(x)), at the family's HF module paths."""

    def __init__(self, config, family: families.Family = families.BERT, index: int = 0):
        super().__init__(config, family, index)
        # what `weights` reads: the fused QKV's holder, then each linear's and LayerNorm's container dict and name
        self.__dict__["_leaves"] = (self._slots["query"][0], *(
            (self._slots[role][0]._modules, self._slots[role][1])
            for role in ("query", "key", "value", "attn_out", "ffn_in", "ffn_out", "ln1", "ln2")))

    def leaves(self, config, family, index):
        H, I = config.hidden_size, family.get(config, "intermediate_size")
        eps = family.get(config, "layer_norm_eps")
        return {"attn_out": nn.Linear(H, H), "ln1": nn.LayerNorm(H, eps=eps), "ffn_in": nn.Linear(H, I),
                "ffn_out": nn.Linear(I, H), "ln2": nn.LayerNorm(H, eps=eps)}

    def extras(self, qkv, w_qkv, b_qkv, positions, p_pos: float) -> Extras:
        """What attention adds to its scores, from this forward's `positions` (not None): MPNet's per-distance bias
        table."""
        return Extras(positions)

    def forward(self, x: torch.Tensor, attn, run, output_attentions: bool = False, positions=None, workspace=None):
        """x [T, H] -> ([T, H], attention probabilities or None). `attn`: a TokenLayout (packed) or an AttentionMask
        (padded rows); `run`: the four ops as resolved for this forward (dispatch.plan); `positions`: what this
        layer's attention reads of positions (BertModel.attention_positions), or None; `workspace`: unused here.
        Under gradient checkpointing, GradientCheckpointingLayer recomputes this in the backward pass (the arguments
        come positionally for that)."""
        w = self.weights(run)
        p_attn, p_attn_out, p_ffn_out, p_pos, _ = self.dropouts() if self.training else NO_DROPOUT
        if w is None:  # an adapter (PEFT) wraps one of the layer's linears, or another module sits at one
            return self._forward_adapted(x, attn, run, output_attentions, positions,
                                         (p_attn, p_attn_out, p_ffn_out, p_pos, 0.0))

        qkv = run.qkv_projection(x, w.qkv, w.qkv_bias, self.num_heads)                           # [T, 3, nh, hd]
        extras = NONE if positions is None else self.extras(qkv, w.qkv, w.qkv_bias, positions, p_pos)
        ctx, probs = run.attention(qkv, attn, self.scale, p_attn, output_attentions, extras)     # [T, H]
        x = run.residual_layernorm(ctx, w.attn_out, w.attn_out_bias, x, w.ln1, w.ln1_bias, w.ln1_eps,
                                   p_attn_out)                                                  # [T, H]
        h = run.bias_gelu(x, w.ffn_in, w.ffn_in_bias, self.activation)                            # [T, I]
        x = run.residual_layernorm(h, w.ffn_out, w.ffn_out_bias, x, w.ln2, w.ln2_bias, w.ln2_eps,
                                   p_ffn_out)                                                   # [T, H]
        return x, probs

    def _forward_adapted(self, x, attn, run, output_attentions, positions, p):
        """The same layer with adapters on some linears. The QKV projection stays one GEMM over the base weights;
        each adapted part adds its low-rank x·A·B to its third of the output. Any other adapted linear is called as
        the module it is (its op runs as PyTorch: merge_and_unload() puts it back on the fused ops)."""
        p_attn, p_attn_out, p_ffn_out, p_pos, _ = p
        sa = self.self_attention
        weight, bias_qkv = sa.fused()
        qkv = run.qkv_projection(x, weight, bias_qkv, self.num_heads)                            # [T, 3, nh, hd]
        for i, name in enumerate(sa.names):
            delta = adapters.lora_delta(sa._modules[name], x)                                   # [T, H] or None
            if delta is not None:
                qkv[:, i] += delta.view(qkv.shape[0], *qkv.shape[2:]).to(qkv.dtype)
        extras = NONE if positions is None else self.extras(qkv, weight, bias_qkv, positions, p_pos)
        ctx, probs = run.attention(qkv, attn, self.scale, p_attn, output_attentions, extras)     # [T, H]
        x = self._dense_residual_layernorm("attn_out", "ln1", ctx, x, run, p_attn_out)          # [T, H]
        h = self._ffn_hidden(x, run, p[4])                                                      # [T, I]
        return self._dense_residual_layernorm("ffn_out", "ln2", h, x, run, p_ffn_out), probs    # [T, H]

    def _ffn_hidden(self, x, run, p_gated: float) -> torch.Tensor:
        """act(x @ W_1 + b_1) with adapters about: on the fused op when ffn_in is a plain linear."""
        dense = self.module("ffn_in")
        if adapters.is_plain_linear(dense):
            return run.bias_gelu(x, dense.weight, dense.bias, self.activation)                   # [T, I]
        return twins.activate(dense(x), self.activation)

    def _dense_residual_layernorm(self, dense_role, ln_role, y, residual, run, p):
        """LayerNorm(dropout(dense(y)) + residual), on the fused op when `dense` is a plain linear."""
        dense, ln = self.module(dense_role), self.module(ln_role)
        if adapters.is_plain_linear(dense) and type(ln) is nn.LayerNorm:
            return run.residual_layernorm(y, dense.weight, dense.bias, residual, ln.weight, ln.bias, ln.eps, p)
        h = dense(y)
        if p > 0:
            h = twins.dropout(h, p)
        return ln(h + residual)

    def weights(self, run) -> LayerWeights | None:
        """The layer's current parameters for a forward of plan `run` (dispatch.Ops), read through the module dicts
        (see `module`). None when a linear or LayerNorm is not the plain torch module (an adapter PEFT put there, a
        norm of another kind): `_forward_adapted` calls those."""
        sa, (dq, q), (dk, k), (dv, v), (do, o), (di, i), (df, f), (d1, ln1), (d2, ln2) = self._leaves
        q, k, v, o, i, f, ln1, ln2 = dq[q], dk[k], dv[v], do[o], di[i], df[f], d1[ln1], d2[ln2]
        if not (type(q) is type(k) is type(v) is type(o) is type(i) is type(f) is nn.Linear
                and type(ln1) is type(ln2) is nn.LayerNorm):
            return None
        q, k, v, o, i, f = q._parameters, k._parameters, v._parameters, o._parameters, i._parameters, f._parameters
        eps1, eps2, ln1, ln2 = ln1.eps, ln2.eps, ln1._parameters, ln2._parameters
        qkv, qkv_bias = sa.fused((q["weight"], k["weight"], v["weight"], q["bias"], k["bias"], v["bias"]), run.traced,
                                 run.grad)
        return _layer_weights((qkv, qkv_bias, o["weight"], o["bias"], ln1["weight"], ln1["bias"], eps1,
                               i["weight"], i["bias"], f["weight"], f["bias"], ln2["weight"], ln2["bias"], eps2))
