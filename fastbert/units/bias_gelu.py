"""bias_gelu: act(x @ W^T + b), the FFN's first GEMM with its bias and activation in the epilogue
(kernels/bias_gelu.py). The activation is any of twins.ACTIVATIONS' (GELU erf or tanh, ReLU, SiLU); gated: W holds
two halves [a; g] and the op returns act(a) * g (ModernBERT's GeGLU; with SiLU the SwiGLU of NomicBERT, GTE and
EuroBERT). The name stays the kernel's: GELU is what BERT runs."""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..twins import Workspace, activate, activate_into, linear_into
from .common import kernel_reason, random_inputs, run_backend

OP = "bias_gelu"


def twin(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str = "gelu",
         gated: bool = False, workspace: Workspace | None = None, fmt=None) -> torch.Tensor:
    """x [T, H] -> act(x @ W[I, H]^T + b) [T, I]; activation in {"gelu" (erf), "gelu_tanh", "relu", "silu"}. gated:
    W is [2I, H] (HF's Wi: the input half, then the gate half) and the result act(a) * g [T, I] for
    [a, g] = x @ W^T + b (GeGLU; SwiGLU with "silu"). `workspace`: see twins.Workspace. `fmt`: the GEMM's number
    format (a formats.Format; None: F.linear on the weights as they are)."""
    if fmt is not None:  # the GEMM in a number format (fastbert/formats.py); its fresh output takes the activation
        h = fmt.hidden(x, weight, bias)  # in the format's working dtype (bf16: bf16)
        if not gated:
            return activate_into(h, activation, h)
        a, g = h.chunk(2, dim=-1)
        return activate_into(a, activation, a).mul_(g)
    if workspace is None:
        h = F.linear(x, weight, bias)
    else:
        h = linear_into(x, weight, bias, workspace, "ffn")
    if gated and workspace is not None:
        a, g = h.chunk(2, dim=-1)
        out = workspace.take("gated", a.shape, a)
        return activate_into(a, activation, out).mul_(g)
    if gated:
        a, g = h.chunk(2, dim=-1)
        return activate(a, activation) * g
    return activate(h, activation)


_KERNEL = []  # [fastbert.kernels.bias_gelu] once imported (Triton is imported only where a kernel runs)


def kernels():
    if not _KERNEL:
        from ..kernels import bias_gelu as module
        _KERNEL.append(module)
    return _KERNEL[0]


def kernel(x, weight, bias, activation="gelu", gated=False, workspace=None, checked=False):
    k = kernels()
    return (k.bias_gelu if checked else k.launch)(x, weight, bias, activation, gated)


class TrainKernel(torch.autograd.Function):
    """act(x @ W^T + b) through the kernel, with a backward (`train_kernel`).

    Forward: the inference kernel as it is (kernels/bias_gelu.py), the [T, N] pre-activation h = x @ W^T + b
    (N = I, or 2I gated) never written. Saved: x, W and b, which the caller holds anyway (the layer's input and the
    parameters), so 0 extra bytes per token. Backward: h recomputed by the GEMM without epilogue into one [T, N]
    buffer, overwritten in place by the derivative kernel with dh = dOut * act'(h) (gated: [dOut g act'(a),
    dOut act(a)]), then dx = dh @ W, dW = dh^T @ x, db = dh.sum(0) through torch (cuBLAS on a GPU).

    The trade, per token and per layer, s bytes per element: the twin's autograd keeps the linear's output h alive
    until the backward (the activation saves it as its input; ReLU saves its output instead, which the next linear
    keeps anyway): I s bytes, and gated 3 I s (h's 2I, which the halves a and g are views of, plus act(a), saved by
    the product). BERT-base in fp16 (I = 3072): 6 KB per token per layer, 72 KB over 12 layers; ModernBERT-base
    gated (I = 1152): 6.75 KB. Here: 0, for one more GEMM of the forward's 2 T N H FLOPs in the backward (which runs
    two of that size already: dx and dW). Saving h instead would need a second output from the GEMM's epilogue
    (N s bytes written per token in the forward): the choice to revisit once the GPU measures both."""

    @staticmethod
    def forward(ctx, x, weight, bias, activation: str, gated: bool, checked: bool = False):
        out = kernel(x, weight, bias, activation, gated, checked=checked)
        ctx.save_for_backward(x, weight, bias)
        ctx.activation, ctx.gated = activation, gated
        return out

    @staticmethod
    def backward(ctx, dout):
        x, weight, bias = ctx.saved_tensors
        dh = kernels().backward(dout, x, weight, bias, ctx.activation, ctx.gated)  # [T, N]
        dx = dh @ weight if ctx.needs_input_grad[0] else None
        dweight = dh.t() @ x if ctx.needs_input_grad[1] else None
        dbias = dh.sum(0) if bias is not None and ctx.needs_input_grad[2] else None
        return dx, dweight, dbias, None, None, None


def train_kernel(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str = "gelu",
                 gated: bool = False, workspace: Workspace | None = None, checked: bool = False) -> torch.Tensor:
    """`twin`'s result and gradients (x, W, b) through the kernels (`TrainKernel`): what a forward that trains runs
    under the "triton" backend. checked: every argument is checked by the kernel's public launcher
    (kernels/bias_gelu.py's `bias_gelu`), as for `kernel`."""
    return TrainKernel.apply(x, weight, bias, activation, gated, checked)


def train_reason(situation) -> str | None:
    """Why train_kernel cannot serve a training forward's situation: never (every activation and the gated form
    have their derivative in the kernel)."""
    return None


@torch.library.custom_op("fastbert::bias_gelu", mutates_args=())
def custom_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str,
              backend: str, gated: bool = False) -> torch.Tensor:
    """act(x @ W^T + b) [T, N]; gated: W [2I, H] and act(a) * g [T, I]."""
    return run_backend(OP, backend, x, lambda: kernels().launch(x, weight, bias, activation, gated),
                       lambda: twin(x, weight, bias, activation, gated))


@custom_op.register_fake
def _(x, weight, bias, activation, backend, gated=False):
    return x.new_empty(x.shape[0], weight.shape[0] // (2 if gated else 1))


def traced(backend: str):
    def run(x, weight, bias, activation="gelu", gated=False, workspace=None):
        return torch.ops.fastbert.bias_gelu(x, weight, bias, activation, backend, gated)
    return run


def reason(situation, facts) -> str | None:
    return kernel_reason(OP, situation, facts, train_reason)


class Variant(NamedTuple):
    """What bias_gelu's speed depends on beyond the shared shapes (measure.Shapes.bias_gelu)."""
    gated: bool = False  # W [2I, H] and act(a) * g


def key(dtype: torch.dtype, shapes) -> str:
    # gated: twice the GEMM's columns, and an epilogue the twin runs as three more passes
    key = f"{OP}|{str(dtype).replace('torch.', '')}|T{shapes.tokens}|H{shapes.hidden}|I{shapes.intermediate}|" \
          f"{shapes.activation}"
    return key + ("|gated" if shapes.bias_gelu.gated else "")


def contenders(dtype, shapes, device, kernel, twin):
    rand, _ = random_inputs(device, dtype)
    T, H, I = shapes.tokens, shapes.hidden, shapes.intermediate
    gated = shapes.bias_gelu.gated
    N = 2 * I if gated else I
    args = (rand(T, H), rand(N, H, scale=H ** -0.5), rand(N), shapes.activation, gated)
    return (lambda: kernel(*args)), (lambda: twin(*args))
