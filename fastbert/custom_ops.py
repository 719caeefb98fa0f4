"""The four ops as torch custom ops, so that torch.compile and torch.export see one op each.

A traced forward (torch.compile, torch.export) records `fastbert::qkv_projection`, `fastbert::attention`,
`fastbert::bias_gelu` and `fastbert::residual_layernorm` (its pre-norm form: `fastbert::residual_layernorm_pre`,
which returns the new residual stream and its LayerNorm) as single nodes with fake (shape-only) implementations,
instead of the Python of a Triton launcher, which a tracer cannot follow. When the graph runs, each node runs the
Triton kernel (CUDA) or the PyTorch twin (CPU, or when the forward resolved that op to its twin).

Each node carries the op's backend as the forward resolved it: "torch" (the twin), "triton" (the kernel; its error
reaches the caller) or "auto" (the kernel under with_net: a kernel that raises leaves that op on its twin).

Eager forwards never go through here: the dispatcher adds a cost per call that a small batch would feel
(bench/RESULTS.md, "Measurements cited by the code"). The
ops are only used while tracing (dispatch.plan), for inference (no autograd formula is registered; a traced training
forward uses the plain twins, which autograd and ONNX export understand).
"""
from __future__ import annotations

import dataclasses
import importlib

import torch

from . import twins
from .fallback import with_net
from .layout import TokenLayout
from .mask import AttentionMask


def _kernel(op: str):
    return importlib.import_module(f"fastbert.kernels.{op}")


def _run(op: str, backend: str, x: torch.Tensor, kernel, twin):
    if backend == "torch":
        return twin()
    if backend == "triton":
        return kernel()
    return with_net(op, x, x.device, kernel, twin)


@torch.library.custom_op("fastbert::qkv_projection", mutates_args=())
def qkv_projection(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, num_heads: int,
                   backend: str) -> torch.Tensor:
    """x [T, H] @ W_qkv^T + b -> [T, 3H] (the caller views it as [T, 3, nh, hd])."""
    return _run("qkv_projection", backend, x,
                lambda: (_kernel("qkv_projection").launch(x, weight, bias, num_heads)
                         .reshape(x.shape[0], weight.shape[0])),
                lambda: torch.nn.functional.linear(x, weight, bias))


@qkv_projection.register_fake
def _(x, weight, bias, num_heads, backend):
    return x.new_empty(x.shape[0], weight.shape[0])


@torch.library.custom_op("fastbert::attention", mutates_args=())
def attention(qkv: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, scale: float,
              key_valid: torch.Tensor | None, backend: str, bias: torch.Tensor | None = None, window: int = -1,
              cos: torch.Tensor | None = None, sin: torch.Tensor | None = None, c2p: torch.Tensor | None = None,
              p2c: torch.Tensor | None = None, column: torch.Tensor | None = None,
              pairwise: bool = False) -> torch.Tensor:
    """Packed qkv [T, 3, nh, hd] -> [T, nh*hd]; key_valid [n, S] for padded rows (then every row has S tokens);
    bias: None or a float32 per-distance table [nh, 2L - 1] (twins.relative_bias); window: w >= 0, or -1 for none
    (a schema int cannot be None); cos, sin: None or the float32 [T, hd/2] rotary tables (twins.Rotary); c2p, p2c,
    column: DeBERTa's terms (twins.Disentangled; column None: none); pairwise: padded rows follow DeBERTa's
    mask_i * mask_j (a padded query attends uniformly to its row)."""
    win = None if window < 0 else window
    rotary = None if cos is None else twins.Rotary(cos, sin)
    dis = None if column is None else twins.Disentangled(c2p, p2c, column)
    # DeBERTa's terms reach the kernel as plain tensors; its padded rows follow HF's mask_i * mask_j
    extra = {} if dis is None else dict(c2p=c2p, p2c=p2c, column=column)

    def twin():
        if key_valid is None:
            lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()  # the twin loops over sequences on the host
            layout = TokenLayout.from_cu_seqlens(cu_seqlens, max_seqlen, lengths)
            return twins.attention_varlen_torch(qkv, layout, scale, bias=bias, window=win, rotary=rotary,
                                                disentangled=dis)
        B, S = key_valid.shape
        mask = AttentionMask.build(key_valid, B, S, qkv.dtype, flags=(False, False))
        if pairwise:
            mask = dataclasses.replace(mask, pairwise=True)
        return twins.attention_padded_torch(qkv, mask, scale, bias=bias, window=win, rotary=rotary,
                                            disentangled=dis)[0]

    return _run("attention", backend, qkv, lambda: _kernel("attention").launch(
        qkv, cu_seqlens, max_seqlen, scale, key_valid=key_valid, bias=bias, window=win, rotary=rotary, **extra,
        uniform_padded_queries=pairwise), twin)


@attention.register_fake
def _(qkv, cu_seqlens, max_seqlen, scale, key_valid, backend, bias=None, window=-1, cos=None, sin=None, c2p=None,
      p2c=None, column=None, pairwise=False):
    return qkv.new_empty(qkv.shape[0], qkv.shape[2] * qkv.shape[3])


@torch.library.custom_op("fastbert::bias_gelu", mutates_args=())
def bias_gelu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str,
              backend: str, gated: bool = False) -> torch.Tensor:
    """act(x @ W^T + b) [T, N]; gated: W [2I, H] and act(a) * g [T, I]."""
    return _run("bias_gelu", backend, x, lambda: _kernel("bias_gelu").launch(x, weight, bias, activation, gated),
                lambda: twins.bias_gelu_torch(x, weight, bias, activation, gated))


@bias_gelu.register_fake
def _(x, weight, bias, activation, backend, gated=False):
    return x.new_empty(x.shape[0], weight.shape[0] // (2 if gated else 1))


@torch.library.custom_op("fastbert::residual_layernorm", mutates_args=())
def residual_layernorm(y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor,
                       ln_weight: torch.Tensor, ln_bias: torch.Tensor | None, eps: float,
                       backend: str) -> torch.Tensor:
    return _run("residual_layernorm", backend, y,
                lambda: _kernel("residual_layernorm").launch(y, weight, bias, residual, ln_weight, ln_bias, eps),
                lambda: twins.residual_layernorm_torch(y, weight, bias, residual, ln_weight, ln_bias, eps))


@residual_layernorm.register_fake
def _(y, weight, bias, residual, ln_weight, ln_bias, eps, backend):
    return residual.new_empty(residual.shape)


# The pre-norm form is its own op: it returns two tensors (the new residual stream s and LN(s)), both fresh.
@torch.library.custom_op("fastbert::residual_layernorm_pre", mutates_args=())
def residual_layernorm_pre(y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor,
                           ln_weight: torch.Tensor, ln_bias: torch.Tensor | None, eps: float,
                           backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    return _run("residual_layernorm", backend, y,
                lambda: _kernel("residual_layernorm").launch(y, weight, bias, residual, ln_weight, ln_bias, eps,
                                                             pre_norm=True),
                lambda: twins.residual_layernorm_torch(y, weight, bias, residual, ln_weight, ln_bias, eps,
                                                       pre_norm=True))


@residual_layernorm_pre.register_fake
def _(y, weight, bias, residual, ln_weight, ln_bias, eps, backend):
    return residual.new_empty(residual.shape), residual.new_empty(residual.shape)


# ---- the op callables a traced forward's plan holds (the layer's signatures) -----------------------------------------
def traced_ops(use: dict) -> dict:
    """op -> a callable with the twin's signature that records one custom op node. `use`: op -> its backend as
    resolved ("torch", "triton", or "auto" for the kernel under the safety net). `workspace` is only in the
    signature: a traced forward is never handed one (BertModel._workspace)."""
    def run_qkv(x, weight, bias, num_heads, workspace=None):
        out = torch.ops.fastbert.qkv_projection(x, weight, bias, num_heads, use["qkv_projection"])
        return out.view(x.shape[0], 3, num_heads, weight.shape[0] // (3 * num_heads))

    def run_attention(qkv, attn, scale, dropout_p=0.0, return_probs=False, bias=None, window=None, rotary=None,
                      disentangled=None, workspace=None):
        if isinstance(attn, TokenLayout):
            cu_seqlens, max_seqlen, key_valid, pairwise = attn.cu_seqlens, attn.max_seqlen, None, False
        else:  # padded rows (what a traced forward runs): uniform cu_seqlens and the key mask
            B, S = attn.batch_size, attn.seq_len
            cu_seqlens = torch.arange(0, (B + 1) * S, S, dtype=torch.int32, device=qkv.device)
            max_seqlen, key_valid, pairwise = S, attn.key_valid, attn.pairwise
            if key_valid is None:
                key_valid = torch.ones(B, S, dtype=torch.bool, device=qkv.device)
        cos, sin = (None, None) if rotary is None else (rotary.cos, rotary.sin)
        d = disentangled
        c2p, p2c, column = (None, None, None) if d is None else (d.c2p, d.p2c, d.column)
        return torch.ops.fastbert.attention(qkv, cu_seqlens, max_seqlen, scale, key_valid, use["attention"],
                                            bias, -1 if window is None else window, cos, sin, c2p, p2c,
                                            column, pairwise), None

    def run_bias_gelu(x, weight, bias, activation="gelu", gated=False, workspace=None):
        return torch.ops.fastbert.bias_gelu(x, weight, bias, activation, use["bias_gelu"], gated)

    def run_residual_layernorm(y, weight, bias, residual, ln_weight, ln_bias, eps, dropout_p=0.0, pre_norm=False,
                               workspace=None):
        # dropout_p is 0 here: a traced forward records the custom ops for inference only (dispatch.plan)
        if pre_norm:
            return torch.ops.fastbert.residual_layernorm_pre(y, weight, bias, residual, ln_weight, ln_bias, eps,
                                                             use["residual_layernorm"])
        return torch.ops.fastbert.residual_layernorm(y, weight, bias, residual, ln_weight, ln_bias, eps,
                                                     use["residual_layernorm"])

    return {"qkv_projection": run_qkv, "attention": run_attention, "bias_gelu": run_bias_gelu,
            "residual_layernorm": run_residual_layernorm}
