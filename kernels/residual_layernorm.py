"""residual_layernorm: LayerNorm(y[T, K] @ W[H, K]^T + b[H] + residual[T, H]) -> [T, H]  (BertSelfOutput, BertOutput).

The choice: cuBLAS GEMM, then one Triton row kernel (bias + residual + LayerNorm in one pass per row).

What the unfused sequence moves, per layer-norm site, counting only the [T, H] passes (fp16, 2 bytes each; the
GEMM's own reads of y and W are common to every option):

    twin (HF):  h = linear(y, W, b)   write h                  2TH
                s = h + residual      read h, residual; write  6TH
                out = layer_norm(s)   read s; write out        4TH     -> 12TH bytes, 3 launches
    here:       h = y @ W^T (cuBLAS)  write h                  2TH
                row kernel            read h, residual; write  6TH     ->  8TH bytes, 2 launches
    ideal:      GEMM epilogue         read residual; write out 4TH     ->  4TH bytes, 1 launch

So the row kernel leaves 4TH bytes on the table against a perfect epilogue: BERT-base, T = 4096, H = 768 is
12.6 MB, ~3 us at 4.3 TB/s, next to ~25-35 us for the FFN-out GEMM (2*4096*768*3072 = 19 GFLOP) and ~8 us for the
attention-out GEMM (K = 768). Why not the epilogue: LayerNorm's mean and variance are reductions over the whole
row, so a program can only normalise rows it owns completely, i.e. its tile needs BLOCK_N >= H (768 for base, 1024
for large, 384 for MiniLM). The fp32 accumulator of a BLOCK_M x H tile is BLOCK_M * H * 4 bytes: at H = 768 and
BLOCK_M = 64 that is 192 KB, three quarters of an SM's whole 256 KB register file (192 registers per thread at
8 warps before a single operand is loaded), and at H = 1024 it does not fit at all. Shrinking BLOCK_M to 16-32
fixes registers but (a) under-fills wgmma, whose minimum M per warpgroup is 64, and (b) leaves T/BLOCK_M programs
that each stream all of W (H x K; 4.7 MB for the FFN-out weight) through L2: T = 4096 -> 128-256 full passes over W,
0.6-1.2 GB of L2 traffic, slower than the GEMM itself. The other fix, split rows with a cross-program reduction
of (sum, sum of squares), needs a second pass over h anyway. cuBLAS at full tile efficiency plus an 8TH-byte row
pass is the better trade at H = 384-1024; the epilogue would win only for small H (a full row in one 128-wide tile).
Without a GPU to measure this here, that is the estimate; bench/ measures it.

The row kernel: one program per row (row offsets in int64: T * H can exceed 2^31 elements at large batch),
BLOCK_N = next_pow2(H) so the whole row sits in registers (H = 384 -> 512 lanes, 768 and 1024 -> 1024), loads in
the input dtype, bias + residual added in fp32, mean, biased variance and rstd in fp32 exactly like torch's
layer_norm (which for fp16/bf16 also computes its statistics in fp32 and rounds the output once), one rounding at
the store. Compared with the twin it skips one rounding (h + residual is not rounded to fp16 before the norm).
The GEMM is torch.matmul without the bias, so it honours torch.backends.cuda.matmul.allow_tf32 like the twin's
F.linear does. Each program reads its whole row before it stores, so `out` may alias `residual` (an in-place
residual stream); without `out` the result is written over the GEMM's own [T, H] buffer, no second allocation.
"""
from __future__ import annotations

import numbers

import torch
import triton
import triton.language as tl

from .gemm import DTYPES, check_device, check_dtypes, check_linear, check_out

OP = "residual_layernorm"
MAX_HIDDEN = 16384  # a row must fit in one program's registers: 16384 fp32 over 16 warps = 32 per thread per array


@triton.jit
def bias_residual_layernorm_kernel(
    # pointers: h [T, H] (the GEMM output), bias [H], residual [T, H], LayerNorm gamma/beta [H], out [T, H]
    h_ptr, bias_ptr, res_ptr, ln_w_ptr, ln_b_ptr, out_ptr,
    # sizes and LayerNorm epsilon
    N, eps,
    # row strides in elements (every last dim is unit-stride)
    stride_hm, stride_rm, stride_om,
    # meta-parameters
    HAS_BIAS: tl.constexpr,  # add bias[H] before the residual
    BLOCK_N: tl.constexpr,  # next_pow2(H): the whole row in one block
):
    row = tl.program_id(0).to(tl.int64)
    offs_n = tl.arange(0, BLOCK_N)
    mask = offs_n < N
    x = tl.load(h_ptr + row * stride_hm + offs_n, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        x += tl.load(bias_ptr + offs_n, mask=mask, other=0.0).to(tl.float32)
    x += tl.load(res_ptr + row * stride_rm + offs_n, mask=mask, other=0.0).to(tl.float32)

    # Two-pass statistics in fp32 (masked lanes hold 0 and are excluded from the centred sum).
    mean = tl.sum(x, axis=0) / N
    centred = tl.where(mask, x - mean, 0.0)
    var = tl.sum(centred * centred, axis=0) / N  # biased, as LayerNorm
    rstd = 1.0 / tl.sqrt(var + eps)

    gamma = tl.load(ln_w_ptr + offs_n, mask=mask, other=0.0).to(tl.float32)
    beta = tl.load(ln_b_ptr + offs_n, mask=mask, other=0.0).to(tl.float32)
    out = centred * rstd * gamma + beta
    tl.store(out_ptr + row * stride_om + offs_n, out.to(out_ptr.dtype.element_ty), mask=mask)


def row_config(hidden: int) -> tuple:
    """(BLOCK_N, num_warps): the row in one block; enough warps that each thread holds <= 8-16 elements (one or two
    16-byte vectors of fp16), not so many that a short row leaves threads idle."""
    block_n = triton.next_power_of_2(hidden)
    num_warps = 4 if block_n <= 1024 else 8 if block_n <= 4096 else 16
    return block_n, num_warps


def residual_layernorm(y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor,
                       ln_weight: torch.Tensor, ln_bias: torch.Tensor, eps: float,
                       out: torch.Tensor | None = None) -> torch.Tensor:
    """LN(y [T, K] @ weight[H, K]^T + bias[H] + residual[T, H]) with gamma=ln_weight, beta=ln_bias -> [T, H].

    y may have any strides (cuBLAS reads it); residual and out need a unit-stride last dimension. out may be
    `residual` itself (in-place update of the residual stream).
    """
    check_dtypes(OP, y=y, weight=weight, bias=bias, residual=residual, ln_weight=ln_weight, ln_bias=ln_bias)
    T, H, _ = check_linear(OP, y, weight, bias, x_name="y", unit_stride=False)
    if residual.dim() != 2 or tuple(residual.shape) != (T, H):
        raise ValueError(f"{OP}: residual.shape={tuple(residual.shape)} must be {(T, H)} "
                         f"(y.shape[0]={T}, weight.shape[0]={H})")
    if H > 1 and residual.stride(1) != 1:
        raise ValueError(f"{OP}: residual must have a unit-stride last dimension; "
                         f"got residual.stride()={residual.stride()}")
    for name, t in (("ln_weight", ln_weight), ("ln_bias", ln_bias)):
        if t.dim() != 1 or t.shape[0] != H:
            raise ValueError(f"{OP}: {name}.shape={tuple(t.shape)} must be {(H,)} (the hidden size weight.shape[0])")
        if H > 1 and t.stride(0) != 1:
            raise ValueError(f"{OP}: {name} must be contiguous; got {name}.stride()={t.stride()}")
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not eps >= 0:
        raise ValueError(f"{OP}: eps must be a non-negative float; got eps={eps!r}")
    if H > MAX_HIDDEN:
        raise ValueError(f"{OP}: hidden size H={H} exceeds {MAX_HIDDEN}, the widest row one program holds")
    device = check_device(OP, y=y, weight=weight, bias=bias, residual=residual, ln_weight=ln_weight, ln_bias=ln_bias,
                          out=out)
    if out is not None:
        check_out(OP, out, (T, H), y.dtype, device)

    h = torch.matmul(y, weight.t())  # [T, H], cuBLAS (no bias: it is added in fp32 in the row kernel)
    return bias_residual_layernorm(h, bias, residual, ln_weight, ln_bias, eps, out=out if out is not None else h)


def bias_residual_layernorm(h, bias, residual, ln_weight, ln_bias, eps, out=None):
    """The row pass alone: LN(h + bias + residual) for a GEMM output h [T, H] (unit-stride rows). `residual_layernorm`
    validates everything before calling it; the benchmarks call it directly to measure the row kernel's GB/s.
    out may be h itself (each program reads its row before writing it)."""
    T, H = h.shape
    if h.stride(1) != 1 and H > 1:
        raise ValueError(f"{OP}: h must have a unit-stride last dimension; got h.stride()={h.stride()}")
    if out is None:
        out = torch.empty_like(h)
    if T == 0 or H == 0:
        return out
    block_n, num_warps = row_config(H)
    bias_residual_layernorm_kernel[(T,)](
        h, bias if bias is not None else h, residual, ln_weight, ln_bias, out,
        H, float(eps),
        h.stride(0), residual.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_N=block_n, num_warps=num_warps)
    return out


def aot_specs() -> list:
    """The row kernel for every dtype x BLOCK_N of the BERT hidden sizes (384 -> 512; 768, 1024 -> 1024), with the
    num_warps `row_config` picks. Pointers, N and the row strides are multiples of 16 at these sizes, which is
    tests/aot_compile.py's default assumption, so no "hints" are needed."""
    specs = []
    for dtype, short in DTYPES.items():
        ptr = "*" + short
        for block_n in sorted({row_config(h)[0] for h in (384, 768, 1024)}):
            num_warps = row_config(block_n)[1]
            specs.append({
                "name": f"{OP}-{short}-row{block_n}-w{num_warps}",
                "fn": bias_residual_layernorm_kernel,
                "signature": {"h_ptr": ptr, "bias_ptr": ptr, "res_ptr": ptr, "ln_w_ptr": ptr, "ln_b_ptr": ptr,
                              "out_ptr": ptr, "N": "i32", "eps": "fp32",
                              "stride_hm": "i32", "stride_rm": "i32", "stride_om": "i32"},
                "constexprs": {"HAS_BIAS": True, "BLOCK_N": block_n},
                "num_warps": num_warps, "num_stages": 1,
            })
    return specs
