"""The post-norm encoder layer with rotary q/k: Jina-Embeddings-v3, NomicBERT, GTE (transformers'
JinaEmbeddingsV3Layer, which the other two inherit).

    qkv = qkv_projection(x)                                  [T, 3, nh, hd]   one GEMM over q_proj/k_proj/v_proj
    ctx = attention(qkv, layout, rotary)                     [T, H]           q and k rotated per token
    x   = residual_layernorm(ctx @ W_o + b_o + x)            [T, H]           post_attention_layernorm
    h   = bias_gelu(x @ W_1 + b_1)                           [T, I]           plain MLP (Jina: fc1)
        | bias_gelu(x @ [W_gate; W_up]^T, gated)             [T, I]           act(gate) * up (NomicBERT, GTE)
    x   = residual_layernorm(h @ W_2 + b_2 + x)              [T, H]           post_mlp_layernorm

BERT's layer with rotary positions instead of a position table, HF's module names, and biases only where the family
has them (NomicBERT: none on its linears; GTE: on q/k/v/o and down_proj). The gated MLP's gate_proj and up_proj sit
side by side in one fused weight (FusedQKV over the pair), so the MLP's input GEMM stays one GEMM; GTE drops out
act(gate) * up before down_proj.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from .. import adapters, families, rotary, twins
from ..units.attention import Extras
from .base import NO_DROPOUT, EncoderLayer
from .fused_qkv import FusedQKV
from .post_norm import PostNormLayer, _layer_weights


class RotaryPostNormLayer(PostNormLayer):
    """LN1(x + attention(x) with rotary q/k), LN2(x + MLP(x)), the MLP plain or gated, at the family's HF paths."""

    def __init__(self, config, family: families.Family = families.JINA_V3, index: int = 0):
        # EncoderLayer's: PostNormLayer's precomputed reads assume BERT's eight roles, which a gated MLP lacks
        EncoderLayer.__init__(self, config, family, index)
        self.gated = family.mlp == "gated"
        self.layer_type = rotary.FULL  # one rope for every layer (rotary.layer_types)
        self.window = None

    def _biased(self, role: str) -> bool:
        return role not in self.family.unbiased

    def leaves(self, config, family, index):
        H, I = config.hidden_size, family.get(config, "intermediate_size")
        eps = family.get(config, "layer_norm_eps")
        leaves = {"attn_out": nn.Linear(H, H, bias=self._biased("attn_out")), "ln1": nn.LayerNorm(H, eps=eps),
                  "ffn_out": nn.Linear(I, H, bias=self._biased("ffn_out")), "ln2": nn.LayerNorm(H, eps=eps)}
        if "ffn_in" in family.layer:
            leaves["ffn_in"] = nn.Linear(H, I, bias=self._biased("ffn_in"))
        return leaves

    def fused_linears(self, config, roles, names):
        width = config.hidden_size if roles[0] == "query" else self.family.get(config, "intermediate_size")
        return FusedQKV(config.hidden_size, names, width, bias=self._biased(roles[0]))

    def place_dropout(self, holder, name, kind, p):
        """HF's: the dropout on the attention probabilities is a float on the attention module (its
        `attention_dropout`)."""
        if kind == "attention":
            holder.attention_dropout = p
        else:
            holder.add_module(name, nn.Dropout(p))

    def extras(self, qkv, w_qkv, b_qkv, positions, p_pos: float) -> Extras:
        return Extras(rotary=positions)

    def forward(self, x: torch.Tensor, attn, run, output_attentions: bool = False, positions=None, workspace=None,
                tasks=None):
        """x [T, H] -> ([T, H], attention probabilities or None); `positions`: the rotary cos/sin of the packed
        tokens (BertModel.attention_positions); `tasks`: each token's task selection where the model has Jina's task
        adapters (`_forward_tasks`)."""
        if tasks is not None:
            return self._forward_tasks(x, attn, run, output_attentions, positions, tasks)
        w = self.weights(run)
        p = self.dropouts() if self.training else NO_DROPOUT
        if w is None:  # an adapter (PEFT) wraps one of the layer's linears, or another module sits at one
            return self._forward_adapted(x, attn, run, output_attentions, positions, p)
        p_attn, p_attn_out, p_ffn_out, _, p_gated = p
        qkv = run.qkv_projection(x, w.qkv, w.qkv_bias, self.num_heads)                           # [T, 3, nh, hd]
        ctx, probs = run.attention(qkv, attn, self.scale, p_attn, output_attentions,
                                   Extras(rotary=positions))                                    # [T, H]
        x = run.residual_layernorm(ctx, w.attn_out, w.attn_out_bias, x, w.ln1, w.ln1_bias, w.ln1_eps,
                                   p_attn_out)                                                  # [T, H]
        h = run.bias_gelu(x, w.ffn_in, w.ffn_in_bias, self.activation, gated=self.gated)         # [T, I]
        if p_gated > 0:
            h = twins.dropout(h, p_gated)
        x = run.residual_layernorm(h, w.ffn_out, w.ffn_out_bias, x, w.ln2, w.ln2_bias, w.ln2_eps,
                                   p_ffn_out)                                                   # [T, H]
        return x, probs

    def _forward_tasks(self, x, attn, run, output_attentions, positions, tasks):
        """The layer with Jina's task adapters (eval mode): each token of task t runs W + s B_t A_t in every linear.
        The base GEMMs stay one GEMM over all tokens whatever their tasks; each adds its tokens' low-rank terms
        (adapters.TaskLoRA, `tasks` [T, tasks * rank] selecting each token's own), where the fused op allows:

            qkv = qkv_projection(x) + down(x) @ up                          [T, 3, nh, hd]  added to the output
            x   = residual_layernorm(ctx @ W_o + b_o + (x + down(ctx) @ up))   [T, H]  the term joins the residual
            h   = bias_gelu([x | down(x)] @ [W_1 | up^T]^T + b_1)           [T, I]  under the activation: a longer K
            x   = residual_layernorm(h @ W_2 + b_2 + (x + down(h) @ up))     [T, H]
        """
        w = self.weights(run)
        if w is None:
            raise NotImplementedError("task adapters together with PEFT adapters (or a module replaced at one of the "
                                      "layer's linears or norms) are not supported; merge those first")
        lora = self._modules["task_adapters"]
        qkv = run.qkv_projection(x, w.qkv, w.qkv_bias, self.num_heads)                           # [T, 3, nh, hd]
        qkv = lora["qkv"].add_delta(qkv.view(qkv.shape[0], -1), x, tasks, in_place=not run.grad).view(qkv.shape)
        ctx, probs = run.attention(qkv, attn, self.scale, 0.0, output_attentions, Extras(rotary=positions))  # [T, H]
        x = run.residual_layernorm(ctx, w.attn_out, w.attn_out_bias, lora["attn_out"].add_delta(x, ctx, tasks),
                                   w.ln1, w.ln1_bias, w.ln1_eps)                                # [T, H]
        ffn_in = lora["ffn_in"]
        h = run.bias_gelu(ffn_in.widen(x, tasks), ffn_in.widened(w.ffn_in), w.ffn_in_bias, self.activation)  # [T, I]
        x = run.residual_layernorm(h, w.ffn_out, w.ffn_out_bias, lora["ffn_out"].add_delta(x, h, tasks),
                                   w.ln2, w.ln2_bias, w.ln2_eps)                                # [T, H]
        return x, probs

    def _ffn_hidden(self, x, run, p_gated: float) -> torch.Tensor:
        """The MLP's hidden [T, I] with adapters about: the fused op where its input linears are plain, else the
        modules as they are (act(gate(x)) * up(x))."""
        if not self.gated:
            return super()._ffn_hidden(x, run, p_gated)
        gate, up = self.module("ffn_gate"), self.module("ffn_up")
        if adapters.is_plain_linear(gate) and adapters.is_plain_linear(up):
            weight, bias = self._slots["ffn_gate"][0].fused()
            h = run.bias_gelu(x, weight, bias, self.activation, gated=True)
        else:
            h = twins.activate(gate(x), self.activation) * up(x)
        return twins.dropout(h, p_gated) if p_gated > 0 else h

    def weights(self, run):
        """The layer's tensors as the four ops take them (post_norm.LayerWeights; ffn_in: the fused [gate; up] of a
        gated MLP), or None where a linear or norm is not the plain torch module (`_forward_adapted` calls those)."""
        module = self.module
        inner = ("ffn_gate", "ffn_up") if self.gated else ("ffn_in",)
        linears = [module(role) for role in ("query", "key", "value", "attn_out", "ffn_out", *inner)]
        ln1, ln2 = module("ln1"), module("ln2")
        if not (all(type(m) is nn.Linear for m in linears) and type(ln1) is type(ln2) is nn.LayerNorm):
            return None
        sa = self.self_attention
        qkv, qkv_bias = sa.fused(sa.parts(), run.traced, run.grad)
        if self.gated:
            ffn_in, ffn_in_bias = self.gate_up(run)
        else:
            ffn_in, ffn_in_bias = linears[5].weight, linears[5].bias
        o, f = linears[3], linears[4]
        return _layer_weights((qkv, qkv_bias, o.weight, o.bias, ln1.weight, ln1.bias, ln1.eps, ffn_in, ffn_in_bias,
                               f.weight, f.bias, ln2.weight, ln2.bias, ln2.eps))
