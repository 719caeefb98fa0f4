"""residual_layernorm: LayerNorm(y @ W^T + b + residual), a layer's output GEMM with bias, residual and LayerNorm
in one pass per row (kernels/residual_layernorm.py). Post-norm (BERT) returns the norm, which is the new stream;
pre-norm (ModernBERT) returns the new stream s and LN(s), the next sublayer's input."""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..twins import Workspace, dropout, linear_into
from .common import inference_only, random_inputs, run_backend

OP = "residual_layernorm"


def twin(y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor,
         ln_weight: torch.Tensor, ln_bias: torch.Tensor | None, eps: float, dropout_p: float = 0.0,
         pre_norm: bool = False, workspace: Workspace | None = None):
    """LayerNorm(dropout(y [T, K] @ W[H, K]^T + b) + residual [T, H]) -> [T, H] (post-norm: the new residual stream
    is the LayerNorm). pre_norm: (s, LayerNorm(s)) for s = dropout(y @ W^T + b) + residual, the new residual stream
    and the next sublayer's input. ln_bias None: a LayerNorm without bias. `workspace`: see twins.Workspace (s is
    then its buffer: the layer must not return it)."""
    h = F.linear(y, weight, bias) if workspace is None else linear_into(y, weight, bias, workspace, "stream")
    if dropout_p > 0:
        h = dropout(h, dropout_p)
    h += residual  # in place: h is a fresh tensor that autograd does not save, so this only saves an allocation
    normed = torch.layer_norm(h, (h.shape[-1],), ln_weight, ln_bias, eps)  # skips F.layer_norm's Python wrapper
    return (h, normed) if pre_norm else normed


_KERNEL = []  # [fastbert.kernels.residual_layernorm] once imported (Triton is imported only where a kernel runs)


def kernels():
    if not _KERNEL:
        from ..kernels import residual_layernorm as module
        _KERNEL.append(module)
    return _KERNEL[0]


def kernel(y, weight, bias, residual, ln_weight, ln_bias, eps, dropout_p=0.0, pre_norm=False, workspace=None,
           checked=False):
    k = kernels()
    return (k.residual_layernorm if checked else k.launch)(y, weight, bias, residual, ln_weight, ln_bias, eps,
                                                           pre_norm)


@torch.library.custom_op("fastbert::residual_layernorm", mutates_args=())
def custom_op(y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor,
              ln_weight: torch.Tensor, ln_bias: torch.Tensor | None, eps: float, backend: str) -> torch.Tensor:
    return run_backend(OP, backend, y, lambda: kernels().launch(y, weight, bias, residual, ln_weight, ln_bias, eps),
                       lambda: twin(y, weight, bias, residual, ln_weight, ln_bias, eps))


@custom_op.register_fake
def _(y, weight, bias, residual, ln_weight, ln_bias, eps, backend):
    return residual.new_empty(residual.shape)


# The pre-norm form is its own op: it returns two tensors (the new residual stream s and LN(s)), both fresh.
@torch.library.custom_op("fastbert::residual_layernorm_pre", mutates_args=())
def custom_op_pre(y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor,
                  ln_weight: torch.Tensor, ln_bias: torch.Tensor | None, eps: float,
                  backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    return run_backend(OP, backend, y,
                       lambda: kernels().launch(y, weight, bias, residual, ln_weight, ln_bias, eps, pre_norm=True),
                       lambda: twin(y, weight, bias, residual, ln_weight, ln_bias, eps, pre_norm=True))


@custom_op_pre.register_fake
def _(y, weight, bias, residual, ln_weight, ln_bias, eps, backend):
    return residual.new_empty(residual.shape), residual.new_empty(residual.shape)


def traced(backend: str):
    def run(y, weight, bias, residual, ln_weight, ln_bias, eps, dropout_p=0.0, pre_norm=False, workspace=None):
        # dropout_p is 0 here: a traced forward records the custom ops for inference only (dispatch.plan)
        op = torch.ops.fastbert.residual_layernorm_pre if pre_norm else torch.ops.fastbert.residual_layernorm
        return op(y, weight, bias, residual, ln_weight, ln_bias, eps, backend)
    return run


def reason(situation, facts) -> str | None:
    return inference_only(OP, situation, facts, situation.hidden_dropout)


class Variant(NamedTuple):
    """What residual_layernorm's speed depends on beyond the shared shapes (measure.Shapes.residual_layernorm)."""
    pre_norm: bool = False  # the pre-norm form: returns the stream s and LN(s)


def key(dtype: torch.dtype, shapes) -> str:
    # pre-norm: the kernel writes a second [T, H] output
    key = f"{OP}|{str(dtype).replace('torch.', '')}|T{shapes.tokens}|H{shapes.hidden}|I{shapes.intermediate}"
    return key + ("|prenorm" if shapes.residual_layernorm.pre_norm else "")


def contenders(dtype, shapes, device, kernel, twin):
    """A layer calls it twice: after attention (K = H) and after the FFN (K = I); pre-norm is timed as ModernBERT
    runs it, a LayerNorm without bias."""
    rand, _ = random_inputs(device, dtype)
    T, H, I = shapes.tokens, shapes.hidden, shapes.intermediate
    x = rand(T, H)
    ones = torch.ones(H, device=device, dtype=dtype)
    pre_norm = shapes.residual_layernorm.pre_norm
    beta = None if pre_norm else torch.zeros(H, device=device, dtype=dtype)
    first = (rand(T, H), rand(H, H, scale=H ** -0.5), rand(H), x, ones, beta, 1e-12, 0.0, pre_norm)
    second = (rand(T, I), rand(H, I, scale=I ** -0.5), rand(H), x, ones, beta, 1e-12, 0.0, pre_norm)
    return (lambda: (kernel(*first), kernel(*second))), (lambda: (twin(*first), twin(*second)))
