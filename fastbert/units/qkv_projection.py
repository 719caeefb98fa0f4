"""qkv_projection: x [T, H] @ W_qkv [3H, H]^T + b_qkv -> [T, 3, nh, hd], one GEMM over the fused weight, the bias in
its epilogue (kernels/qkv_projection.py). The output is the layout the attention kernel reads. With grouped key/value
heads (kv_heads, EuroBERT): W_qkv [(nh + 2 kv) hd, H] -> [T, nh + 2 kv, hd], the q heads then the k and v heads."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..twins import Workspace, linear_into
from .common import kernel_reason, random_inputs, run_backend

OP = "qkv_projection"


def heads_view(out: torch.Tensor, num_heads: int, kv_heads: int | None = None) -> torch.Tensor:
    """The GEMM's [T, N] output as attention reads it: [T, 3, nh, hd], or [T, nh + 2 kv, hd] with grouped key/value
    heads (a view, no copy)."""
    T, N = out.shape
    if kv_heads is None:
        return out.view(T, 3, num_heads, N // (3 * num_heads))
    return out.view(T, num_heads + 2 * kv_heads, N // (num_heads + 2 * kv_heads))


def twin(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, num_heads: int,
         workspace: Workspace | None = None, kv_heads: int | None = None, fmt=None) -> torch.Tensor:
    """x [T, H] @ W_qkv[3*nh*hd, H]^T + b -> [T, 3, nh, hd] (a view of the GEMM output, no copy). `fmt`: the GEMM's
    number format (a formats.Format; None: F.linear on the weights as they are)."""
    if fmt is not None:  # the GEMM in a number format (fastbert/formats.py)
        h = fmt.linear(x, weight, bias)
    elif workspace is None:
        h = F.linear(x, weight, bias)
    else:
        h = linear_into(x, weight, bias, workspace, "qkv")
    return heads_view(h, num_heads, kv_heads)


_KERNEL = []  # [fastbert.kernels.qkv_projection] once imported (Triton is imported only where a kernel runs)


def kernels():
    if not _KERNEL:
        from ..kernels import qkv_projection as module
        _KERNEL.append(module)
    return _KERNEL[0]


def kernel(x, weight, bias, num_heads, workspace=None, checked=False, kv_heads=None):
    k = kernels()
    return (k.qkv_projection if checked else k.launch)(x, weight, bias, num_heads, kv_heads=kv_heads)


class TrainKernel(torch.autograd.Function):
    """x @ W^T + b through the GEMM kernel, with the GEMM gradients through torch (cuBLAS on a GPU): dx = dqkv @ W,
    dW = dqkv^T @ x, db = dqkv summed over tokens. No epilogue pays in the backward (there is no activation to
    differentiate), so the backward is the linear's own. Saved: x and W, which the caller holds anyway (the layer's
    input and the parameter), 0 extra bytes per token: the same as the twin's F.linear."""

    @staticmethod
    def forward(ctx, x, weight, bias, num_heads: int, checked: bool = False, kv_heads: int | None = None):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        out = x.new_empty(x.shape[0], weight.shape[0])  # returned itself, not a view: adapters add to it in place
        k = kernels()
        (k.qkv_projection if checked else k.launch)(x, weight, bias, num_heads, out, kv_heads)
        return out

    @staticmethod
    def backward(ctx, dout):
        x, weight = ctx.saved_tensors
        dx = dout @ weight if ctx.needs_input_grad[0] else None
        dweight = dout.t() @ x if ctx.needs_input_grad[1] else None
        dbias = dout.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dweight, dbias, None, None, None


def train_kernel(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, num_heads: int,
                 workspace: Workspace | None = None, checked: bool = False,
                 kv_heads: int | None = None) -> torch.Tensor:
    """`twin`'s contract on the GEMM kernel, with gradients for x, W and b (`TrainKernel`). The output is a view of
    the autograd function's [T, 3H] result, so an adapter may add to its thirds in place (LoRA on q or v).
    checked: every argument is checked by the kernel's public launcher, as for `kernel`."""
    return heads_view(TrainKernel.apply(x, weight, bias, num_heads, checked, kv_heads), num_heads, kv_heads)


def train_reason(situation) -> str | None:
    """Why train_kernel cannot serve a training forward's situation: never (a linear has no dropout or variant)."""
    return None


@torch.library.custom_op("fastbert::qkv_projection", mutates_args=())
def custom_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, num_heads: int,
              backend: str) -> torch.Tensor:
    """x [T, H] @ W_qkv^T + b -> [T, N] (the caller views it as its heads)."""
    return run_backend(OP, backend, x, lambda: kernels().project(x, weight, bias), lambda: F.linear(x, weight, bias))


@custom_op.register_fake
def _(x, weight, bias, num_heads, backend):
    return x.new_empty(x.shape[0], weight.shape[0])


def traced(backend: str):
    def run(x, weight, bias, num_heads, workspace=None, kv_heads=None):
        # the custom op's [T, N] result; its kernel launch views it as the q/k/v heads, which only the caller reads
        return heads_view(torch.ops.fastbert.qkv_projection(x, weight, bias, num_heads, backend), num_heads,
                          kv_heads)
    return run


def reason(situation, facts) -> str | None:
    return kernel_reason(OP, situation, facts, train_reason)


def key(dtype: torch.dtype, shapes) -> str:
    return f"{OP}|{str(dtype).replace('torch.', '')}|T{shapes.tokens}|H{shapes.hidden}|N{3 * shapes.hidden}"


def contenders(dtype, shapes, device, kernel, twin):
    rand, _ = random_inputs(device, dtype)
    H = shapes.hidden
    args = (rand(shapes.tokens, H), rand(3 * H, H, scale=H ** -0.5), rand(3 * H), shapes.heads)
    return (lambda: kernel(*args)), (lambda: twin(*args))
