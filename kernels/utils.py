"""What every kernel file shares, and what fastbert.ops asks before it launches one.

This package is a leaf: it imports torch and triton, never fastbert. The facts both sides need live here, read once:
whether Triton's interpreter is on, the dtypes and head dims the kernels are built for, and which calls a kernel
cannot serve (so that "auto" uses the twin and "triton" raises, instead of a kernel returning garbage).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Triton reads TRITON_INTERPRET when a kernel is decorated (at import), so the flag cannot change afterwards either.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
_INTERPRET = tl.constexpr(INTERPRET)

DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
HEAD_DIMS = (16, 32, 64, 128)  # tl.dot needs a power of two >= 16
DOT_OPS = ("qkv_projection", "attention", "bias_gelu")  # the ops whose kernels run tl.dot (residual_layernorm's does not)

# Opt-in: warp-specialized tiles join the sm_90 GEMM's autotune list. Off by default: Triton 3.6 documents warp
# specialization as Blackwell-only, and triton-lang/triton#8311 reports wrong results with it on an inner K loop inside
# an outer loop, which is the persistent GEMM's shape. Read once, like TRITON_INTERPRET.
WARP_SPECIALIZE = os.environ.get("FASTBERT_WARP_SPECIALIZE", "0") not in ("", "0")

# The interpreter's tl.dot multiplies bf16 bit patterns as if they were integers (its numpy emulation has no bf16):
# answers off by 1e10, with no error. Compiled kernels are unaffected.
INTERPRETER_BF16_DOT = "Triton's interpreter (TRITON_INTERPRET=1) cannot run a bf16 tl.dot (its answers are garbage)"


def device_unsupported(device: torch.device) -> str | None:
    """Why no kernel can run on `device` (None when they can): CUDA, or CPU under the interpreter."""
    if device.type == "cuda" or (device.type == "cpu" and INTERPRET):
        return None
    return f"the tensors are on {device} (Triton kernels need CUDA tensors, or TRITON_INTERPRET=1 on CPU)"


def call_unsupported(op: str, dtype: torch.dtype, head_dim: int | None = None) -> str | None:
    """Why the kernel of `op` cannot serve a call in `dtype` (and head dim, for attention); None when it can."""
    if dtype not in DTYPES:
        return f"dtype {dtype} is not one of float32, float16, bfloat16"
    if INTERPRET and dtype == torch.bfloat16 and op in DOT_OPS:
        return INTERPRETER_BF16_DOT
    if head_dim is not None and head_dim not in HEAD_DIMS:
        return f"head_dim={head_dim} is not one of {HEAD_DIMS}"
    return None


def input_precision(dtype: torch.dtype) -> str:
    """tl.dot's input_precision: fp32 follows torch's TF32 switch ("tf32" when on, "ieee" when off); 16-bit types
    ignore it, so they always compile one way."""
    if dtype == torch.float32 and tf32_enabled():
        return "tf32"
    return "ieee"


def tf32_enabled() -> bool:
    """torch's TF32 switch for fp32 matmuls. torch >= 2.9 has `fp32_precision`, which reflects both its own setting and
    the legacy `allow_tf32` (reading `allow_tf32` after the new API was used raises there)."""
    matmul = torch.backends.cuda.matmul
    precision = getattr(matmul, "fp32_precision", None)
    if precision in ("tf32", "ieee"):
        return precision == "tf32"
    return bool(matmul.allow_tf32)


@triton.jit
def loop_bound(n):
    """`n` as a bound or step of `range` / `tl.range`. Compiled: `n` itself. Interpreted: a Python int, because
    Triton 3.6's interpreter takes a scalar's index with int() of its shape-(1,) array, which numpy >= 2.4 refuses
    ("only 0-dimensional arrays can be converted to Python scalars"); Triton 3.9 squeezes it first. Call it inside
    the `range(...)`: the interpreter turns the value of every assignment back into a tensor."""
    if _INTERPRET:
        return n.handle.data.item()
    return n
