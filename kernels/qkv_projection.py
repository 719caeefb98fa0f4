"""qkv_projection: x[T, H] @ W_qkv[3*nh*hd, H]^T + b_qkv, returned as a view [T, 3, nh, hd].

Why it pays. HF runs three nn.Linear (query, key, value): three launches, x read three times, and then
`transpose_for_scores` views each [T, H] output as [B, nh, S, hd] (attention kernels that want contiguous heads
then copy). Here the three weights are concatenated once at load time into W_qkv [3H, H] and one GEMM reads x once
(2TH bytes in fp16 instead of 6TH), adds the bias in the epilogue (no separate bias pass over the [T, 3H] output,
i.e. 12TH bytes saved against an unfused add), and writes [T, 3H] contiguous. Viewed as [T, 3, nh, hd], that is
exactly the packed layout flash attention's varlen API reads, so attention consumes it through strides and no
transpose or .contiguous() copy ever happens.

The GEMM itself, its tiles and autotuning live in kernels/gemm.py (the shared GEMM-with-epilogue core); this file
is the op's contract: validate -> allocate -> launch -> view back.
"""
from __future__ import annotations

import torch

from .gemm import check_device, check_dtypes, check_linear, check_out, gemm, gemm_aot_specs

OP = "qkv_projection"


def qkv_projection(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, num_heads: int,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, H] (unit-stride last dim; rows may be strided), weight [3*nh*hd, H], bias [3*nh*hd] or None
    -> [T, 3, nh, hd], a view of one contiguous [T, 3*nh*hd] buffer (q, k, v along dim 1).

    out: optional contiguous tensor of shape [T, 3, nh, hd] or [T, 3*nh*hd] to write into (returned as the view).
    Every argument is checked, with an error naming the bad value; `launch` is the same call without the checks.
    """
    check_dtypes(OP, x=x, weight=weight, bias=bias)
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads <= 0:
        raise ValueError(f"{OP}: num_heads must be a positive int; got num_heads={num_heads!r}")
    T, N, H = check_linear(OP, x, weight, bias)
    if N % (3 * num_heads) != 0:
        raise ValueError(f"{OP}: weight.shape[0]={N} must be 3 * num_heads * head_dim, i.e. divisible by "
                         f"3 * num_heads = {3 * num_heads} (weight.shape={tuple(weight.shape)})")
    head_dim = N // (3 * num_heads)
    device = check_device(OP, x=x, weight=weight, bias=bias, out=out)
    if out is not None:
        if tuple(out.shape) not in ((T, 3, num_heads, head_dim), (T, N)):
            raise ValueError(f"{OP}: out.shape={tuple(out.shape)} must be {(T, 3, num_heads, head_dim)} or {(T, N)}")
        check_out(OP, out, tuple(out.shape), x.dtype, device)
        if not out.is_contiguous():
            raise ValueError(f"{OP}: out must be contiguous (it is the packed [T, 3H] buffer); "
                             f"got out.stride()={out.stride()}")
    return launch(x, weight, bias, num_heads, out)


def launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, num_heads: int,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """`qkv_projection` for arguments the caller has validated (the model does it once per forward)."""
    T, N = x.shape[0], weight.shape[0]
    if out is None:
        out = torch.empty((T, N), dtype=x.dtype, device=x.device)
    out2d = out.view(T, N)
    gemm(x, weight, bias, out2d, activation=None)
    return out2d.view(T, 3, num_heads, N // (3 * num_heads))  # [T, 3H] -> [T, 3, nh, hd]: q/k/v/heads by strides


def aot_specs() -> list:
    """Every kernel x dtype x config, with and without the bias epilogue (BERT's q/k/v have one; bias=None is
    accepted too), on the archs each runs on."""
    return gemm_aot_specs(OP, (None,))
