"""bias_gelu: act(x[T, H] @ W[I, H]^T + b[I]) -> [T, I], the FFN's first half (BertIntermediate).

Why it pays. Unfused (HF): the GEMM writes the pre-activation h [T, I] (cuBLASLt may fold the bias in), then the
activation reads h and writes y: 2 * 2TI extra bytes in fp16. For BERT-base (I = 3072) at T = 4096 that is 50 MB
of traffic, ~12 us at 4.3 TB/s, against a ~40 us GEMM, plus a launch. Here bias and activation run on the fp32
accumulator in registers (kernels/gemm.py's epilogue): h never reaches memory, and the output is rounded once.

Activations (`fastbert.ops.ACTIVATIONS` maps HF's hidden_act to these):
    "gelu"       erf GELU, x * Phi(x)                        == F.gelu(h), HF "gelu" (to ~3e-7 in fp32: gemm._gelu_erf)
    "gelu_tanh"  0.5x(1 + tanh(sqrt(2/pi)(x + 0.044715x^3)))  == F.gelu(h, approximate="tanh"), HF "gelu_new" /
                 "gelu_pytorch_tanh"; computed as x * sigmoid(2u), the same function without a tanh call
    "relu"       max(h, 0)
    "silu"       x * sigmoid(x)                              == F.silu(h), HF "silu"; computed from e = exp(-|x|) as
                 x - x e / (1 + e) for x > 0, x e / (1 + e) else: no 1 + exp(-x) rounded near 1 (gemm._silu)

Gated (GeGLU, ModernBERT's MLP in; with "silu" SwiGLU, NomicBERT's, GTE's and EuroBERT's): weight is HF's Wi
[2I, H] (the input half, then the gate half), bias [2I] or None, and the result act(a) * g [T, I] for
[a, g] = x @ W^T + b, from two fp32 accumulators over the two halves read in place, rounded once: the [T, 2I]
pre-activation never reaches memory either (kernels/gemm.py's header).

Training (not yet called by the model): `backward` recomputes h with the GEMM without epilogue and overwrites it in
place with dh = dOut * act'(h) (`bias_gelu_backward_kernel`, the last section); torch takes dx, dW and db from dh.
"""
from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

from . import utils
from .gemm import (
    ACTIVATIONS,
    _activate,
    check_device,
    check_dtypes,
    check_linear,
    check_out,
    gemm,
    gemm_aot_specs,
)
from .utils import DTYPES

OP = "bias_gelu"


# GeGLU's (ModernBERT: "gelu") and SwiGLU's ("silu"); the launcher takes relu gated too
GATED_AOT_ACTIVATIONS = ("gelu", "gelu_tanh", "silu")


def bias_gelu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str = "gelu",
              gated: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, H] (unit-stride last dim; rows may be strided), weight [I, H], bias [I] or None -> act(x W^T + b) [T, I].
    gated: weight [2I, H], bias [2I] or None -> act(a) * g [T, I] (see the header).

    out: optional [T, I] tensor (unit-stride last dim) to write into; it is returned. Every argument is checked,
    with an error naming the bad value; `launch` is the same call without the checks.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"{OP}: activation={activation!r} is not one of {ACTIVATIONS}")
    if not isinstance(gated, bool):
        raise TypeError(f"{OP}: gated must be a bool; got gated={gated!r}")
    check_dtypes(OP, x=x, weight=weight, bias=bias)
    T, N, _ = check_linear(OP, x, weight, bias)
    if gated and N % 2:
        raise ValueError(f"{OP}: gated needs weight.shape[0] even (HF's Wi: [2 * intermediate, hidden], the input "
                         f"half then the gate half); got weight.shape={tuple(weight.shape)}")
    I = N // 2 if gated else N
    device = check_device(OP, x=x, weight=weight, bias=bias, out=out)
    if out is not None:
        check_out(OP, out, (T, I), x.dtype, device)
    return launch(x, weight, bias, activation, gated, out)


def launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str = "gelu",
           gated: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """`bias_gelu` for arguments the caller has validated (the model does it once per forward): allocate, launch."""
    if out is None:
        out = torch.empty((x.shape[0], weight.shape[0] // (2 if gated else 1)), dtype=x.dtype, device=x.device)
    return gemm(x, weight, bias, out, activation=activation, gated=gated)


def aot_specs() -> list:
    """Every kernel x dtype x config x activation (gelu, gelu_tanh, relu, silu) x {bias, no bias}, and the gated
    epilogue for gelu, gelu_tanh and silu in every dtype with its tiles, on the archs each runs on. The backward's
    derivative kernel has its own list (`backward_aot_specs`): this one is the GEMM's, tile for tile."""
    return gemm_aot_specs(OP, ACTIVATIONS, GATED_AOT_ACTIVATIONS)


# --------------------------------------------------------------------------------------------------------------------
# The backward: dh = dOut * act'(h), elementwise (training; the GEMM gradients go to torch, cuBLAS on a GPU)
# --------------------------------------------------------------------------------------------------------------------
# Why recompute h rather than save it. The forward's h [T, N] never reaches memory (the epilogue above), and keeping
# it would need a second output from the epilogue (N x element-size bytes per token written and held until the
# backward). `backward` instead runs the GEMM again without epilogue (the no-activation variant qkv_projection
# compiles), into one [T, N] buffer that the derivative kernel then overwrites with dh in place: one extra GEMM of
# the forward's FLOPs per backward, and no [T, N] tensor held between the passes (fastbert/units/bias_gelu.py counts
# the bytes).
#
# The derivatives, in fp32 on the loaded values, each finite for every finite h (large |h| saturates to 0 or 1):
#     gelu       Phi(x) + x phi(x), phi(x) = exp(-x^2 / 2) / sqrt(2 pi); x phi(x) with x capped at +-40 (0 there)
#     gelu_tanh  s + 2 c x s (1 - s) (1 + 3 * 0.044715 x^2), s = sigmoid(2u), u = c (x + 0.044715 x^3),
#                c = sqrt(2 / pi); s and s (1 - s) = e / (1 + e)^2 from e = exp(-2|u|) <= 1 (no overflow)
#     relu       1 for x > 0, else 0 (torch's threshold_backward: 0 at x = 0)
#     silu       sigmoid(x) (1 + x (1 - sigmoid(x))), both sigmoids from e = exp(-|x|) <= 1, x capped at +-128
# Gated (h = [a, g], out = act(a) * g): da = dOut * g * act'(a), dg = dOut * act(a), act(a) from gemm.py's epilogue
# functions (the forward's own fp32 values).
@triton.jit
def _sigmoid_parts(x):
    """(sigmoid(x), sigmoid(x) * (1 - sigmoid(x))) from e = exp(-|x|) <= 1: no exp overflow at any x."""
    e = tl.exp2(-1.4426950408889634 * tl.abs(x))
    r = 1.0 / (1.0 + e)
    s = tl.where(x >= 0, r, e * r)
    return s, e * r * r


@triton.jit
def _activation_grad(x, ACTIVATION: tl.constexpr):
    """act'(x) in fp32."""
    if ACTIVATION == "gelu":
        xc = tl.minimum(tl.maximum(x, -40.0), 40.0)  # x phi(x) is 0 in fp32 well before: keeps inf * 0 out
        pdf = 0.3989422804014327 * tl.exp2(-0.7213475204444817 * (xc * xc))  # exp(-x^2 / 2) / sqrt(2 pi)
        grad = 0.5 * (1.0 + tl.math.erf(x * 0.7071067811865476)) + xc * pdf
    elif ACTIVATION == "gelu_tanh":
        xc = tl.minimum(tl.maximum(x, -128.0), 128.0)  # s (1 - s) is 0 there; keeps the x^3 term finite
        u = 0.7978845608028654 * (xc + 0.044715 * xc * xc * xc)
        s, ds = _sigmoid_parts(2.0 * u)
        grad = s + 2.0 * 0.7978845608028654 * xc * ds * (1.0 + 0.134145 * xc * xc)
    elif ACTIVATION == "relu":
        grad = tl.where(x > 0, 1.0, 0.0)
    else:  # silu
        xc = tl.minimum(tl.maximum(x, -128.0), 128.0)
        s, ds = _sigmoid_parts(xc)
        grad = s + xc * ds  # sigmoid(x) (1 + x (1 - sigmoid(x)))
    return grad


@triton.jit
def bias_gelu_backward_kernel(
    # pointers: dOut [T, N] (any strides), h [T, N] ([T, 2N] when GATED; unit last stride), dh like h (may be h)
    dout_ptr, h_ptr, dh_ptr,
    # sizes: N output columns (the intermediate size); the token count is the grid's first axis
    N,
    # strides, in elements
    stride_dom, stride_don, stride_hm, stride_dhm,
    ACTIVATION: tl.constexpr,  # "gelu" (erf), "gelu_tanh", "relu", "silu"
    GATED: tl.constexpr,  # h = [a, g]: dh = [dOut g act'(a), dOut act(a)]
    BLOCK_N: tl.constexpr,
):
    # One program per (row, BLOCK_N columns): memory-bound, every element read and written once.
    row = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = offs_n < N
    dout = tl.load(dout_ptr + row * stride_dom + offs_n * stride_don, mask=mask, other=0.0).to(tl.float32)
    h_row = h_ptr + row * stride_hm
    dh_row = dh_ptr + row * stride_dhm
    a = tl.load(h_row + offs_n, mask=mask, other=0.0).to(tl.float32)
    if GATED:
        g = tl.load(h_row + N + offs_n, mask=mask, other=0.0).to(tl.float32)
        da = dout * g * _activation_grad(a, ACTIVATION)
        dg = dout * _activate(a, ACTIVATION)  # the forward epilogue's act(a)
        tl.store(dh_row + offs_n, da.to(dh_ptr.dtype.element_ty), mask=mask)
        tl.store(dh_row + N + offs_n, dg.to(dh_ptr.dtype.element_ty), mask=mask)
    else:
        da = dout * _activation_grad(a, ACTIVATION)
        tl.store(dh_row + offs_n, da.to(dh_ptr.dtype.element_ty), mask=mask)


BACKWARD_BLOCK_N = 1024  # 8 elements per thread at 4 warps: 16-byte vectors in 16-bit types
BACKWARD_WARPS = 4


def pre_activation_grad(dout: torch.Tensor, h: torch.Tensor, activation: str = "gelu", gated: bool = False,
                        out: torch.Tensor | None = None) -> torch.Tensor:
    """dh = dOut * act'(h) [T, N] from dOut [T, N] (any strides) and the pre-activation h [T, N] (unit-stride last
    dim); gated: h [T, 2N] = [a, g] and dh [T, 2N] = [dOut g act'(a), dOut act(a)]. fp32 math, stored in h's dtype.
    out: optional, like h (h itself to overwrite it in place). Cheap asserts only: the unit checks its inputs."""
    assert activation in ACTIVATIONS, activation
    assert dout.dim() == 2 and h.dim() == 2 and h.shape == (dout.shape[0], dout.shape[1] * (2 if gated else 1)), \
        (dout.shape, h.shape, gated)
    assert h.shape[1] <= 1 or h.stride(1) == 1, h.stride()
    if out is None:
        out = torch.empty_like(h, memory_format=torch.contiguous_format)
    assert out.shape == h.shape and out.dtype == h.dtype and (out.shape[1] <= 1 or out.stride(1) == 1)
    T, N = dout.shape
    if T == 0 or N == 0:
        return out
    grid = (T, triton.cdiv(N, BACKWARD_BLOCK_N))
    with utils.device_guard(h):
        bias_gelu_backward_kernel[grid](dout, h, out, N, dout.stride(0), dout.stride(1), h.stride(0), out.stride(0),
                                        ACTIVATION=activation, GATED=bool(gated), BLOCK_N=BACKWARD_BLOCK_N,
                                        num_warps=BACKWARD_WARPS)
    return out


def backward(dout: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
             activation: str = "gelu", gated: bool = False) -> torch.Tensor:
    """dh [T, N] ([T, 2N] gated) for the forward `launch(x, weight, bias, activation, gated)`: h recomputed by the
    GEMM without epilogue into a fresh buffer, then overwritten in place by `pre_activation_grad` (see above)."""
    h = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
    gemm(x, weight, bias, h, activation=None)
    return pre_activation_grad(dout, h, activation, gated, out=h)


def backward_aot_specs() -> list:
    """The derivative kernel for every dtype x activation x {plain, gated}, on sm_90 and sm_80, as it runs at model
    sizes: a contiguous dOut (unit column stride, the constant the JIT specialises it to) and row strides that are
    multiples of 16 (tests/tooling/aot_compile.py's default)."""
    specs = []
    for (dtype, short), activation, gated in itertools.product(DTYPES.items(), ACTIVATIONS, (False, True)):
        ptr = "*" + short
        specs.append({
            "name": "-".join([f"{OP}_backward", short, activation] + (["gated"] if gated else [])
                             + [f"{BACKWARD_BLOCK_N}-w{BACKWARD_WARPS}"]),
            "fn": bias_gelu_backward_kernel,
            "signature": {"dout_ptr": ptr, "h_ptr": ptr, "dh_ptr": ptr, "N": "i32", "stride_dom": "i32",
                          "stride_hm": "i32", "stride_dhm": "i32"},
            "constexprs": {"ACTIVATION": activation, "GATED": gated, "BLOCK_N": BACKWARD_BLOCK_N, "stride_don": 1},
            "num_warps": BACKWARD_WARPS, "num_stages": 1,
        })
    return specs
