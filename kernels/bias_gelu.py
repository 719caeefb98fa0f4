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
"""
from __future__ import annotations

import torch

from .gemm import ACTIVATIONS, check_device, check_dtypes, check_linear, check_out, gemm, gemm_aot_specs

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
    epilogue for gelu, gelu_tanh and silu in every dtype with its tiles, on the archs each runs on."""
    return gemm_aot_specs(OP, ACTIVATIONS, GATED_AOT_ACTIVATIONS)
