"""The one GEMM-with-epilogue core behind qkv_projection and bias_gelu:  C[M, N] = act(A[M, K] @ W[N, K]^T + bias[N]).

Why an epilogue pays. The unfused PyTorch sequence for a BERT FFN-in (T tokens, H -> I, fp16, 2 bytes/element):

    h = x @ W^T        reads x (2TH) + W (2IH), writes h (2TI)
    h = h + b          reads h (2TI) + b,        writes h (2TI)     (cuBLASLt fuses this one into the GEMM)
    y = gelu(h)        reads h (2TI),            writes y (2TI)

so besides the GEMM's own traffic the activation costs one extra round trip of the [T, I] matrix (4TI bytes: for
BERT-base at T=4096, 2*4096*3072*2 = 50 MB, ~12 us at 4.3 TB/s, next to a ~40 us GEMM) plus a launch. Here the
bias and the activation are applied to the fp32 accumulator while it is still in registers: the pre-activation
never reaches memory and the output is rounded exactly once, at the store.

Design notes
- W is an nn.Linear weight [N, K] read through its strides as the B operand (no transpose copy). A and C must have
  a unit-stride last dimension (validated in `check_linear` / `check_out`); W may have any strides. Triton
  specialises an integer argument equal to 1 into a constant, so the common contiguous weight (stride_wk == 1)
  gets vectorised, coalesced loads; `gemm_aot_specs()` mirrors that by passing stride_wk=1 as a constant.
- Program ids are swizzled in groups of GROUP_M row-blocks (the Triton matmul tutorial's ordering): consecutive
  programs share the same W column-panel while it is hot in L2 instead of sweeping all of W per row-block.
- fp32 inputs: tl.dot's input_precision is a constexpr set from torch.backends.cuda.matmul.allow_tf32 by the
  launcher ("tf32" when on, "ieee" when off), so fastbert honours the same switch as torch.matmul. For fp16/bf16
  the flag does not change the math; we always pass "ieee" there so the flag never causes a second compile.
- On sm_90, tl.dot on fp16/bf16 (and tf32) tiles lowers to wgmma when num_warps >= 4 and BLOCK_M is a multiple of
  64 (one warpgroup covers 64 rows): every config below keeps BLOCK_M in {64, 128} for that reason.

Configs (`gemm_configs`): a handful of tiles, autotuned on the GPU and keyed on (N, K, bucketed M, epilogue).
- 128x128 with 8 warps: the throughput tile for large T. With 4 warps each thread would hold 128 fp32 accumulators
  and the erf-GELU epilogue (a libdevice polynomial with several live temporaries) pushed it to 255 registers and
  752 bytes of spill stack when compiled for sm_90; 8 warps halve the accumulator per thread (64 registers).
- 128x64 / 64x128 with 4 warps: 64 accumulators per thread, the mid-size tiles.
- 64x64 and 64x32 (deeper BLOCK_K) for small T: at T <= 64 the GEMM is a weight-streaming problem, and narrower
  column panels give more programs (N/32 instead of N/128) to spread the weight reads over more SMs.
- BLOCK_K is 64 for 2-byte types (128 for the narrow tile) and 32 for fp32 (16 for the narrow tile), so that
  stages * (BLOCK_M + BLOCK_N) * BLOCK_K * bytes stays <= 96 KB: it fits sm_80's 163 KB and sm_90's 227 KB.
  fp32 with TF32 off runs tl.dot on FMA units, where the operand fragments live in registers: 64x32x64 and
  64x32x32 spilled there (sm_90, STACK 16-32 bytes), 64x32x16 does not.
Checked by compiling every spec of `gemm_aot_specs` for sm_90 and sm_80 with triton 3.9 (tests/aot_compile.py,
cuobjdump -res-usage):
STACK 0 everywhere; REG peaks at ~185 for the 16-bit/TF32 tiles and ~254 for fp32 "ieee" (FMA) 128-wide tiles;
fp16/bf16/tf32 use wgmma on sm_90 and mma.sync on sm_80; shared memory <= 96 KB.
The token count M is bucketed to the next power of two (>= 16) in the autotune key, so a new sequence length does
not re-tune; M itself is a plain runtime argument.

Under TRITON_INTERPRET=1 the launcher skips the autotuner and runs one fixed tile (32x128x128): benchmarking every
config through numpy would dominate the test time and measures nothing real. The interpreter's cost follows the
elements a tile computes more than the number of programs (a 64-row tile does 64 rows of numpy work for T = 7), so
the tile is short and wide: ~3x faster than 64x64x64 on the test shapes. The kernel code is the same, and the tests
run every autotune config explicitly (`config=`) on shapes that are partial tiles in M, N and K.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import utils
from .utils import DTYPES, input_precision

ACTIVATIONS = ("gelu", "gelu_tanh", "relu")  # plus None: no activation
GROUP_M = 8


# --------------------------------------------------------------------------------------------------------------------
# The kernel
# --------------------------------------------------------------------------------------------------------------------
@triton.jit
def gemm_kernel(
    # pointers: A [M, K] (unit last stride), W [N, K] (any strides), bias [N] (contiguous), C [M, N] (unit last stride)
    a_ptr, w_ptr, bias_ptr, c_ptr,
    # sizes; M_BUCKET is unused by the code, it only feeds the autotune key (next power of two of M)
    M, N, K, M_BUCKET,
    # strides, in elements
    stride_am, stride_wn, stride_wk, stride_cm,
    # epilogue and precision choices
    HAS_BIAS: tl.constexpr,  # add bias[N] to the fp32 accumulator
    ACTIVATION: tl.constexpr,  # None, "gelu" (erf), "gelu_tanh", "relu"
    INPUT_PRECISION: tl.constexpr,  # "ieee" or "tf32" (only matters for fp32 inputs)
    # tile shape
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # Grouped ordering: walk GROUP_M row-blocks down one column-panel of W before moving right, so the panel is
    # reused from L2 by GROUP_M programs in flight together.
    pid = tl.program_id(0).to(tl.int64)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m

    # Rows/columns past the edge wrap around (% M, % N) instead of being masked: the loads stay unmasked along M and
    # N (full-width vector loads), and the wrapped rows/columns are simply not stored.
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_am = offs_m % M
    offs_wn = offs_n % N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_am[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + offs_k[:, None] * stride_wk + offs_wn[None, :] * stride_wn  # W^T tile [BLOCK_K, BLOCK_N]

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_remaining = K - k * BLOCK_K  # only the last K step is partial; masked lanes load 0 and add nothing
        a = tl.load(a_ptrs, mask=offs_k[None, :] < k_remaining, other=0.0)
        w = tl.load(w_ptrs, mask=offs_k[:, None] < k_remaining, other=0.0)
        acc = tl.dot(a, w, acc, input_precision=INPUT_PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk

    # Epilogue on the fp32 accumulator, in registers.
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    if ACTIVATION == "gelu":  # exact GELU, as F.gelu / HF "gelu": x * Phi(x)
        acc = 0.5 * acc * (1.0 + tl.erf(acc * 0.7071067811865476))
    elif ACTIVATION == "gelu_tanh":  # F.gelu(approximate="tanh"): 0.5x(1 + tanh(u)) == x * sigmoid(2u)
        u = 0.7978845608028654 * (acc + 0.044715 * acc * acc * acc)
        acc = acc / (1.0 + tl.exp(-2.0 * u))  # exp overflow -> inf -> -0.0 for very negative x, as tanh gives
    elif ACTIVATION == "relu":
        acc = tl.maximum(acc, 0.0)

    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :]
    c_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


# --------------------------------------------------------------------------------------------------------------------
# Autotune configs
# --------------------------------------------------------------------------------------------------------------------
def gemm_configs(element_size: int) -> list:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) per element size in bytes; reasons in the module header."""
    if element_size == 4:  # fp32 (tf32 or ieee): half the BLOCK_K so the stages fit shared memory / FMA registers
        return [(128, 128, 32, 8, 3), (128, 64, 32, 4, 4), (64, 128, 32, 4, 4), (64, 64, 32, 4, 4),
                (64, 32, 16, 4, 4)]
    return [(128, 128, 64, 8, 3), (128, 64, 64, 4, 4), (64, 128, 64, 4, 4), (64, 64, 64, 4, 4),
            (64, 32, 128, 4, 4)]


INTERPRETER_CONFIG = (32, 128, 128, 4, 1)  # one fixed tile under TRITON_INTERPRET=1 (num_warps/stages are ignored)

_AUTOTUNE_KEY = ["N", "K", "M_BUCKET", "HAS_BIAS", "ACTIVATION", "INPUT_PRECISION"]  # + tensor dtypes, implicitly


def _triton_config(cfg) -> "triton.Config":
    bm, bn, bk, warps, stages = cfg
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": GROUP_M},
                         num_warps=warps, num_stages=stages)


# One Autotuner per element size (each wraps the same JIT function): fp32 needs its own BLOCK_K list.
_AUTOTUNED = {size: triton.autotune(configs=[_triton_config(c) for c in gemm_configs(size)],
                                    key=_AUTOTUNE_KEY)(gemm_kernel)
              for size in (2, 4)}


def config_name(cfg) -> str:
    bm, bn, bk, warps, stages = cfg
    return f"{bm}x{bn}x{bk}-w{warps}-s{stages}"


# --------------------------------------------------------------------------------------------------------------------
# Validation shared by the GEMM launchers (qkv_projection, bias_gelu, residual_layernorm)
# --------------------------------------------------------------------------------------------------------------------
def check_device(op: str, **tensors) -> torch.device:
    """All tensors on one device, and that device is CUDA (or CPU under TRITON_INTERPRET=1)."""
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        listing = ", ".join(f"{name} on {device}" for name, device in devices.items())
        raise ValueError(f"{op}: all tensors must be on one device; got {listing}")
    device = next(iter(devices.values()))
    if utils.device_unsupported(device):
        raise ValueError(f"{op}: the tensors are on {device}; the Triton kernels need CUDA tensors "
                         f"(or CPU tensors with TRITON_INTERPRET=1 to run them in Triton's interpreter)")
    return device


def check_dtypes(op: str, **tensors) -> torch.dtype:
    """All given tensors share one dtype out of fp32/fp16/bf16."""
    for name, t in tensors.items():
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    dtypes = {name: t.dtype for name, t in tensors.items() if t is not None}
    first_name, dtype = next(iter(dtypes.items()))
    if dtype not in DTYPES:
        raise TypeError(f"{op}: {first_name}.dtype={dtype} is not one of float32, float16, bfloat16")
    mismatched = {name: d for name, d in dtypes.items() if d != dtype}
    if mismatched:
        listing = ", ".join(f"{name}.dtype={d}" for name, d in dtypes.items())
        raise TypeError(f"{op}: all tensors must share one dtype; got {listing}")
    return dtype


def check_linear(op: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, x_name: str = "x",
                 unit_stride: bool = True):
    """x [M, K] (with a unit-stride last dim when `unit_stride`), weight [N, K], bias [N] or None. Returns (M, N, K)."""
    if x.dim() != 2:
        raise ValueError(f"{op}: {x_name} must be 2-D [tokens, features]; got {x_name}.shape={tuple(x.shape)}")
    if weight.dim() != 2:
        raise ValueError(f"{op}: weight must be 2-D [out_features, in_features]; "
                         f"got weight.shape={tuple(weight.shape)}")
    M, K = x.shape
    N = weight.shape[0]
    if weight.shape[1] != K:
        raise ValueError(f"{op}: {x_name}.shape[1]={K} must match weight.shape[1]={weight.shape[1]} "
                         f"(weight is [out_features, in_features] = {tuple(weight.shape)})")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != N):
        raise ValueError(f"{op}: bias must be [{N}] (weight.shape[0]); got bias.shape={tuple(bias.shape)}")
    if bias is not None and N > 1 and bias.stride(0) != 1:
        raise ValueError(f"{op}: bias must be contiguous; got bias.stride()={bias.stride()}")
    if unit_stride and K > 1 and x.stride(1) != 1:
        raise ValueError(f"{op}: {x_name} must have a unit-stride last dimension (rows may be strided); "
                         f"got {x_name}.stride()={x.stride()} for shape {tuple(x.shape)}")
    return M, N, K


def check_out(op: str, out: torch.Tensor, shape: tuple, dtype: torch.dtype, device: torch.device) -> None:
    """A caller-provided output: exact shape, dtype and device, unit-stride last dimension."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{op}: out must be a torch.Tensor, got {type(out).__name__}")
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"{op}: out.shape={tuple(out.shape)} must be {tuple(shape)}")
    if out.dtype != dtype:
        raise TypeError(f"{op}: out.dtype={out.dtype} must be the input dtype {dtype}")
    if out.device != device:
        raise ValueError(f"{op}: out is on {out.device} but the inputs are on {device}")
    if out.dim() >= 2 and out.shape[-1] > 1 and out.stride(-1) != 1:
        raise ValueError(f"{op}: out must have a unit-stride last dimension; got out.stride()={out.stride()}")


# --------------------------------------------------------------------------------------------------------------------
# The launcher (inputs already validated by the op launcher)
# --------------------------------------------------------------------------------------------------------------------
def gemm(a: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
         activation: str | None = None, *, config: tuple | None = None) -> torch.Tensor:
    """out[M, N] = act(a[M, K] @ weight[N, K]^T + bias). `out` must be allocated and checked by the caller (the op
    launchers do it with `check_linear` / `check_out`). `config` = (BLOCK_M, BLOCK_N, BLOCK_K, num_warps,
    num_stages) pins one tile instead of autotuning (the tests use it to run every config's edge handling)."""
    if activation is not None and activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r} is not one of {ACTIVATIONS} or None")
    if utils.INTERPRET and a.dtype == torch.bfloat16:
        raise NotImplementedError(utils.INTERPRETER_BF16_DOT)
    M, K = a.shape
    N = weight.shape[0]
    if M == 0 or N == 0:
        return out  # nothing to compute (a zero-size grid is not launchable)
    args = (a, weight, bias if bias is not None else a, out,  # bias_ptr is never read when HAS_BIAS is False
            M, N, K, max(16, triton.next_power_of_2(M)),
            a.stride(0), weight.stride(0), weight.stride(1), out.stride(0))
    meta = dict(HAS_BIAS=bias is not None, ACTIVATION=activation, INPUT_PRECISION=input_precision(a.dtype))
    if config is None and utils.INTERPRET:
        config = INTERPRETER_CONFIG
    if config is not None:
        bm, bn, bk, warps, stages = config
        grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)
        gemm_kernel[grid](*args, **meta, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=GROUP_M,
                          num_warps=warps, num_stages=stages)
    else:
        grid = lambda META: (triton.cdiv(M, META["BLOCK_M"]) * triton.cdiv(N, META["BLOCK_N"]),)  # noqa: E731
        _AUTOTUNED[a.element_size()][grid](*args, **meta)
    return out


# --------------------------------------------------------------------------------------------------------------------
# Ahead-of-time compile list
# --------------------------------------------------------------------------------------------------------------------
def gemm_aot_specs(prefix: str, activations, has_bias: bool = True) -> list:
    """One spec per dtype x config x activation (x input precision for fp32), named like
    "bias_gelu-fp16-gelu-128x128x64-w8-s3". The spec describes the kernel Triton compiles at run time for BERT's
    contiguous tensors, so that the AOT check (registers, spills, shared memory, wgmma) sees the code that runs:
    - stride_wk is the constant 1: Triton specialises an int argument equal to 1 (a contiguous nn.Linear weight);
    - pointers and the other integers are compiled as multiples of 16 (the "tt.divisibility" attribute the JIT
      adds for allocator-aligned pointers, N, K and row strides at BERT's sizes 384, 768, 1024, 1536, 3072, 3H):
      tests/aot_compile.py assumes that by default, and "hints" {"M": None} takes it back for the token count,
      which is arbitrary at run time. The divisibility matters: without it Triton cannot prove 16-byte alignment,
      loads turn scalar, the stages go through registers instead of cp.async into shared memory, and every
      config spills (sm_90, 128x128x64 fp16 GELU at 8 warps: REG 255 STACK 32 without; REG 166 STACK 0 with)."""
    specs = []
    for dtype, short in DTYPES.items():
        ptr = "*" + short
        precisions = ("ieee", "tf32") if dtype == torch.float32 else ("ieee",)
        for cfg in gemm_configs(torch.empty((), dtype=dtype).element_size()):
            bm, bn, bk, warps, stages = cfg
            for activation in activations:
                for precision in precisions:
                    parts = [prefix, short] + ([activation] if activation else []) + \
                            ([precision] if dtype == torch.float32 else []) + [config_name(cfg)]
                    specs.append({
                        "name": "-".join(parts),
                        "fn": gemm_kernel,
                        "signature": {"a_ptr": ptr, "w_ptr": ptr, "bias_ptr": ptr, "c_ptr": ptr,
                                      "M": "i32", "N": "i32", "K": "i32", "M_BUCKET": "i32",
                                      "stride_am": "i32", "stride_wn": "i32", "stride_cm": "i32"},
                        "constexprs": {"stride_wk": 1, "HAS_BIAS": has_bias, "ACTIVATION": activation,
                                       "INPUT_PRECISION": precision, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk,
                                       "GROUP_M": GROUP_M},
                        "num_warps": warps, "num_stages": stages,
                        "hints": {"M": None},
                    })
    return specs

# No aot_specs() here: the core is compiled through the op modules that use it (qkv_projection: bias, no activation;
# bias_gelu: bias + each GELU), which are exactly the variants that run.
