"""The PyTorch twins of the four fused ops: the definitions the Triton kernels are tested against, and the path
for CPU, autograd and anything a kernel cannot serve.

Every op works on token-major 2-D matrices [T, features] (T = real tokens, packed).

    op                  twin (the contract)                                   Triton kernel fuses
    qkv_projection      x @ W_qkv^T + b_qkv viewed [T, 3, nh, hd]            one GEMM, bias in the epilogue
    attention           softmax(q k^T * scale + bias + mask) v -> [T, nh*hd] flash attention, online softmax
    bias_gelu           act(x @ W^T + b)                                      GEMM with bias+activation epilogue
    residual_layernorm  LN(y @ W^T + b + residual)                            bias+residual+LN in one pass per row
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .layout import TokenLayout
from .mask import AttentionMask, tracing

# hidden_act -> the activation name the kernels understand. HF's "gelu" is the exact erf GELU; "gelu_new" and
# "gelu_pytorch_tanh" are the same tanh approximation computed two ways.
ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}


def qkv_projection_torch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         num_heads: int) -> torch.Tensor:
    """x [T, H] @ W_qkv[3*nh*hd, H]^T + b -> [T, 3, nh, hd] (a view of the GEMM output, no copy)."""
    return F.linear(x, weight, bias).view(x.shape[0], 3, num_heads, weight.shape[0] // (3 * num_heads))


def relative_bias(table: torch.Tensor, num_queries: int, num_keys: int, dtype: torch.dtype) -> torch.Tensor:
    """The scores bias of one sequence, [nh, num_queries, num_keys] in `dtype`, from a per-distance table:
    B[h, i, j] = table[h, (j - i) + L - 1] for a table [nh, 2L - 1]. Distances beyond +-(L - 1) read the table's end
    columns (T5/MPNet buckets are constant from some distance on: a table reaching it is exact at every distance)."""
    reach = (table.shape[1] - 1) // 2
    keys, queries = torch.arange(num_keys, device=table.device), torch.arange(num_queries, device=table.device)
    distance = keys[None, :] - queries[:, None]  # [num_queries, num_keys]: j - i
    return table[:, (distance + reach).clamp_(0, 2 * reach)].to(dtype)


def attention_torch(qkv: torch.Tensor, attn, scale: float, dropout_p: float = 0.0, return_probs: bool = False,
                    bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """qkv [T, 3, nh, hd] -> (context [T, nh*hd], probs [B, nh, S, S] or None). `attn` is a TokenLayout (packed
    sequences, padding-free) or an AttentionMask (padded rows, T = B*S). `bias`: None, or a float32 table
    [nh, 2L - 1] of an additive score bias that depends on (head, j - i) only (see `relative_bias`), added after the
    scale and before the softmax."""
    if isinstance(attn, TokenLayout):
        return attention_varlen_torch(qkv, attn, scale, dropout_p, bias), None
    return attention_padded_torch(qkv, attn, scale, dropout_p, return_probs, bias)


def attention_varlen_torch(qkv: torch.Tensor, layout: TokenLayout, scale: float, dropout_p: float = 0.0,
                           bias: torch.Tensor | None = None) -> torch.Tensor:
    """Packed sequences -> context [T, nh*hd]. Equal lengths run as one dense batch; otherwise one sdpa per sequence
    on its [1, nh, L, hd] view: on CPU faster than padding to the longest with a mask, and than the same loop on
    3-D [nh, L, hd] inputs (bench/RESULTS.md, "Measurements cited by the code"). A `bias` table becomes one
    sequence's [1, nh, L, L] attn_mask (shared by the dense batch), never one for the whole batch."""
    T, _, nh, hd = qkv.shape
    if layout.uniform:
        B, S = layout.num_seqs, layout.max_seqlen
        q, k, v = qkv.view(B, S, 3, nh, hd).permute(2, 0, 3, 1, 4).unbind(0)  # each [B, nh, S, hd], strided views
        attn_mask = None if bias is None else relative_bias(bias, S, S, qkv.dtype)[None]
        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, scale=scale)
        return ctx.transpose(1, 2).reshape(T, nh * hd)
    if layout.lengths is None:
        raise RuntimeError("the PyTorch attention twin needs the sequence lengths on the host; this layout has none "
                           "(a captured CUDA graph runs the Triton kernel)")
    contexts = []
    for piece in qkv.split(layout.lengths):  # views; under autograd one SplitBackward, not a zeroed [T, ...] each
        length = piece.shape[0]
        q, k, v = piece.unsqueeze(0).permute(2, 0, 3, 1, 4).unbind(0)  # [1, nh, L, hd]
        attn_mask = None if bias is None else relative_bias(bias, length, length, qkv.dtype)[None]
        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, scale=scale)
        contexts.append(ctx[0].transpose(0, 1))  # [L, nh, hd], a strided view
    return torch.cat(contexts).view(T, nh * hd)  # cat reads the strided views: the one copy


def attention_padded_torch(qkv: torch.Tensor, mask: "AttentionMask", scale: float, dropout_p: float = 0.0,
                           return_probs: bool = False,
                           bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Padded rows, qkv [B*S, 3, nh, hd] -> (context [B*S, nh*hd], probs [B, nh, S, S] or None). A `bias` table is
    read at the padded positions (as HF does: distances count padding); a fully padded row still attends
    uniformly."""
    B, S = mask.batch_size, mask.seq_len
    T, _, nh, hd = qkv.shape
    q, k, v = qkv.view(B, S, 3, nh, hd).permute(2, 0, 3, 1, 4).unbind(0)  # each [B, nh, S, hd], strided views
    rel = None if bias is None else relative_bias(bias, S, S, qkv.dtype)[None]  # [1, nh, S, S]
    if return_probs:  # HF's eager math, because the caller wants the probabilities themselves
        scores = torch.matmul(q, k.transpose(-1, -2)) * scale
        if rel is not None:
            scores = scores + rel
        if mask.additive is not None:
            scores = scores + mask.additive
        probs = torch.softmax(scores, dim=-1)
        ctx = torch.matmul(F.dropout(probs, dropout_p) if dropout_p > 0 else probs, v)
    else:
        probs = None
        if rel is not None and mask.additive is not None and mask.additive.shape[-2] == 1 and not tracing():
            # key mask [B, 1, 1, S] + bias [1, nh, S, S]: one row at a time, so no [B, nh, S, S] sum is formed (a
            # traced graph keeps the batch dynamic instead: one broadcast sum)
            ctx = torch.cat([F.scaled_dot_product_attention(q[b:b + 1], k[b:b + 1], v[b:b + 1],
                                                            attn_mask=rel + mask.additive[b:b + 1],
                                                            dropout_p=dropout_p, scale=scale) for b in range(B)])
        else:
            attn_mask = mask.additive if rel is None else rel if mask.additive is None else rel + mask.additive
            ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, scale=scale)
    if mask.empty_rows is not None:
        # Fully padded rows: HF eager's uniform attention over all S keys, stated outright. Adding finfo.min only
        # equalises the scores when it swamps them; sdpa adds fp16's -65504 in fp32, where it does not.
        ctx = torch.where(mask.empty_rows, v.mean(dim=2, keepdim=True).to(ctx.dtype), ctx)
        if probs is not None:
            probs = torch.where(mask.empty_rows, torch.full_like(probs, 1.0 / S), probs)
    return ctx.transpose(1, 2).reshape(T, nh * hd), probs  # [B, S, nh, hd] -> [T, nh*hd]


def _activation_torch(h: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "gelu":
        return F.gelu(h)
    if activation == "gelu_tanh":
        return F.gelu(h, approximate="tanh")
    if activation == "relu":
        return F.relu(h)
    raise ValueError(f"activation={activation!r} is not one of {sorted(set(ACTIVATIONS.values()))}")


def bias_gelu_torch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    activation: str = "gelu") -> torch.Tensor:
    """x [T, H] -> act(x @ W[I, H]^T + b) [T, I]; activation in {"gelu" (erf), "gelu_tanh", "relu"}."""
    return _activation_torch(F.linear(x, weight, bias), activation)


def residual_layernorm_torch(y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor,
                             ln_weight: torch.Tensor, ln_bias: torch.Tensor, eps: float,
                             dropout_p: float = 0.0) -> torch.Tensor:
    """LayerNorm(dropout(y [T, K] @ W[H, K]^T + b) + residual [T, H]) -> [T, H]."""
    h = F.linear(y, weight, bias)
    if dropout_p > 0:
        h = F.dropout(h, dropout_p)
    h += residual  # in place: h is a fresh tensor that autograd does not save, so this only saves an allocation
    return torch.layer_norm(h, (h.shape[-1],), ln_weight, ln_bias, eps)  # skips F.layer_norm's Python wrapper


def default_scale(head_dim: int) -> float:
    return head_dim ** -0.5  # written as HF writes it, so the float is bit-identical
