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


def heads_view(out2d: torch.Tensor, num_heads: int, kv_heads: int | None = None) -> torch.Tensor:
    """[T, N] -> [T, 3, nh, hd] (q, k, v along dim 1), or with grouped key/value heads [T, nh + 2 kv, hd] (the q
    heads, then the k heads, then the v heads): views, by strides."""
    T, N = out2d.shape
    if kv_heads is None:
        return out2d.view(T, 3, num_heads, N // (3 * num_heads))
    return out2d.view(T, num_heads + 2 * kv_heads, N // (num_heads + 2 * kv_heads))


def qkv_projection(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, num_heads: int,
                   out: torch.Tensor | None = None, kv_heads: int | None = None) -> torch.Tensor:
    """x [T, H] (unit-stride last dim; rows may be strided), weight [3*nh*hd, H], bias [3*nh*hd] or None
    -> [T, 3, nh, hd], a view of one contiguous [T, 3*nh*hd] buffer (q, k, v along dim 1). With kv_heads (grouped
    key/value heads): weight [(nh + 2 kv) * hd, H] -> [T, nh + 2 kv, hd].

    out: optional contiguous tensor of the view's shape or [T, N] to write into (returned as the view).
    Every argument is checked, with an error naming the bad value; `launch` is the same call without the checks.
    """
    check_dtypes(OP, x=x, weight=weight, bias=bias)
    for name, value in (("num_heads", num_heads), ("kv_heads", 1 if kv_heads is None else kv_heads)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{OP}: {name} must be a positive int; got {name}={value!r}")
    T, N, H = check_linear(OP, x, weight, bias)
    parts = 3 * num_heads if kv_heads is None else num_heads + 2 * kv_heads
    if N % parts != 0:
        heads = "3 * num_heads" if kv_heads is None else "num_heads + 2 * kv_heads"
        raise ValueError(f"{OP}: weight.shape[0]={N} must be {heads} * head_dim, i.e. divisible by {heads} = "
                         f"{parts} (weight.shape={tuple(weight.shape)})")
    device = check_device(OP, x=x, weight=weight, bias=bias, out=out)
    if out is not None:
        view = tuple(heads_view(x.new_empty(0, N), num_heads, kv_heads).shape[1:])
        if tuple(out.shape) not in ((T, *view), (T, N)):
            raise ValueError(f"{OP}: out.shape={tuple(out.shape)} must be {(T, *view)} or {(T, N)}")
        check_out(OP, out, tuple(out.shape), x.dtype, device)
        if not out.is_contiguous():
            raise ValueError(f"{OP}: out must be contiguous (it is the packed [T, N] buffer); "
                             f"got out.stride()={out.stride()}")
    return launch(x, weight, bias, num_heads, out, kv_heads)


def launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, num_heads: int,
           out: torch.Tensor | None = None, kv_heads: int | None = None) -> torch.Tensor:
    """`qkv_projection` for arguments the caller has validated (the model does it once per forward)."""
    return heads_view(project(x, weight, bias, out), num_heads, kv_heads)  # [T, N] -> q/k/v heads by strides


def project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """The GEMM itself: x @ W^T + b into a contiguous [T, N] (`out`, or a new tensor), validated by the caller."""
    T, N = x.shape[0], weight.shape[0]
    out2d = torch.empty((T, N), dtype=x.dtype, device=x.device) if out is None else out.view(T, N)
    gemm(x, weight, bias, out2d, activation=None)
    return out2d


def aot_specs() -> list:
    """Every kernel x dtype x config, with and without the bias epilogue (BERT's q/k/v have one; bias=None is
    accepted too), on the archs each runs on."""
    return gemm_aot_specs(OP, (None,))
