"""residual_layernorm: LayerNorm(y @ W^T + b + residual), a layer's output GEMM with bias, residual and LayerNorm
in one pass per row (kernels/residual_layernorm.py). Post-norm (BERT) returns the norm, which is the new stream;
pre-norm (ModernBERT) returns the new stream s and LN(s), the next sublayer's input. rms: RMSNorm in LayerNorm's
place (EuroBERT), as transformers computes it."""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..twins import Workspace, dropout, linear_into
from .common import kernel_reason, random_inputs, run_backend

OP = "residual_layernorm"


def twin(y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor,
         ln_weight: torch.Tensor, ln_bias: torch.Tensor | None, eps: float, dropout_p: float = 0.0,
         pre_norm: bool = False, rms: bool = False, workspace: Workspace | None = None, fmt=None):
    """LayerNorm(dropout(y [T, K] @ W[H, K]^T + b) + residual [T, H]) -> [T, H] (post-norm: the new residual stream
    is the LayerNorm). pre_norm: (s, LayerNorm(s)) for s = dropout(y @ W^T + b) + residual, the new residual stream
    and the next sublayer's input. ln_bias None: a LayerNorm without bias. rms: `rms_norm` (weight ln_weight,
    ln_bias None) in LayerNorm's place, in either form. `workspace`: see twins.Workspace (s is then its buffer: the
    layer must not return it). `fmt`: the GEMM's number format (a formats.Format; None: F.linear on the weights as
    they are)."""
    if fmt is not None:  # the GEMM in a number format (fastbert/formats.py)
        h = fmt.linear(y, weight, bias)
    elif workspace is None:
        h = F.linear(y, weight, bias)
    else:
        h = linear_into(y, weight, bias, workspace, "stream")
    if dropout_p > 0:
        h = dropout(h, dropout_p)
    h += residual  # in place: h is a fresh tensor that autograd does not save, so this only saves an allocation
    if rms:
        if ln_bias is not None:
            raise ValueError(f"{OP}: RMSNorm has no bias (rms=True takes ln_bias=None)")
        normed = rms_norm(h, ln_weight, eps)
    else:
        normed = torch.layer_norm(h, (h.shape[-1],), ln_weight, ln_bias, eps)  # skips F.layer_norm's Python wrapper
    return (h, normed) if pre_norm else normed


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as transformers' Llama-shaped encoders compute it (EuroBertRMSNorm, LlamaRMSNorm), operation for
    operation, so with the same rounding in every dtype: x / sqrt(mean(x^2) + eps) in float32, rounded back to x's
    dtype, then times weight (in that dtype)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


_KERNEL = []  # [fastbert.kernels.residual_layernorm] once imported (Triton is imported only where a kernel runs)


def kernels():
    if not _KERNEL:
        from ..kernels import residual_layernorm as module
        _KERNEL.append(module)
    return _KERNEL[0]


def kernel(y, weight, bias, residual, ln_weight, ln_bias, eps, dropout_p=0.0, pre_norm=False, rms=False,
           workspace=None, checked=False):
    k = kernels()
    return (k.residual_layernorm if checked else k.launch)(y, weight, bias, residual, ln_weight, ln_bias, eps,
                                                           pre_norm, rms=rms)


class TrainKernel(torch.autograd.Function):
    """residual_layernorm on the kernels with a backward: the row kernel's forward (pre-norm form, with its row
    statistics, and dropout when dropout_p > 0) and the row kernel's backward (layernorm_backward), the GEMM
    gradients through torch (cuBLAS on a GPU). Call it through `train_kernel`.

    Saved for the backward, per token (e = the dtype's bytes, K = y's width, H = the hidden size):
        y          K·e   (dW = dH^T @ y)
        s          H·e   (the norm's input: x_hat is recomputed from it and the statistics)
        stats      8 B   (mean and rstd, fp32) for LayerNorm, 4 B (rstd) for RMSNorm
    plus W and gamma (parameters, not per token): (K + H)·e + 8 (LayerNorm) or + 4 (RMSNorm).
    The twin's autograd saves, per token: for LayerNorm the same, (K + H)·e + 8 (linear keeps y, layer_norm keeps
    its input s and fp32 mean and rstd); for RMSNorm, run as transformers' elementwise ops, y, s in fp32 (a copy in
    fp16/bf16, s itself in fp32), the normalised row in the input dtype and rstd: (K + H)·e + 4H + 4. So the
    LayerNorm saves as much as the twin (the gain there is fewer passes, not memory) and the RMSNorm 4H bytes per
    token less (3 KB at H = 768), in every dtype. In the pre-norm form the saved s is the returned stream itself.

    Dropout (dropout_p > 0) adds one 8-byte seed per call (utils.dropout_seed, drawn from torch's generator), not
    per token: the backward regenerates the keep bits from it. The twin's dropout keeps its mask: F.dropout's bool
    mask, H bytes per token (T·H per call: 3 MiB at T = 4096, H = 768, twice per post-norm layer, so 72 MiB per step
    of BERT-base's 12 layers), or on CPU in float32 its float32 noise, 4H bytes per token. The two draw different
    masks (Philox in the kernels, torch's generator in the twin): they agree in distribution, not element by
    element."""

    @staticmethod
    def forward(ctx, y, weight, bias, residual, ln_weight, ln_bias, eps, dropout_p, pre_norm, rms):
        seed = kernels().utils.dropout_seed(y.device) if dropout_p > 0 else None
        s, normed, stats = kernels().train_forward(y, weight, bias, residual, ln_weight, ln_bias, eps, rms=rms,
                                                   dropout_p=dropout_p, seed=seed)
        ctx.save_for_backward(y, weight, s, stats, ln_weight, seed)
        ctx.pre_norm, ctx.rms, ctx.has_ln_bias, ctx.dropout_p = pre_norm, rms, ln_bias is not None, dropout_p
        ctx.param_dtypes = (None if bias is None else bias.dtype, ln_weight.dtype,
                            None if ln_bias is None else ln_bias.dtype)
        return (s, normed) if pre_norm else normed

    @staticmethod
    def backward(ctx, *grads):
        y, weight, s, stats, ln_weight, seed = ctx.saved_tensors
        ds_extra, dn = grads if ctx.pre_norm else (None, grads[0])
        needs = ctx.needs_input_grad  # y, weight, bias, residual, ln_weight, ln_bias, eps, dropout_p, pre_norm, rms
        dn = dn if dn.stride(-1) == 1 else dn.contiguous()
        if ds_extra is not None and ds_extra.stride(-1) != 1:
            ds_extra = ds_extra.contiguous()
        # dS is the residual's gradient; dH, the GEMM output's (dS through the dropout mask; dS itself at p = 0)
        ds, dh, dgamma, dbeta = kernels().layernorm_backward(dn, ds_extra, s, stats, ln_weight, ctx.has_ln_bias,
                                                             ctx.rms, dropout_p=ctx.dropout_p, seed=seed)
        bias_dtype, gamma_dtype, beta_dtype = ctx.param_dtypes
        dy = dh @ weight if needs[0] else None
        dweight = dh.t() @ y if needs[1] else None
        dbias = dh.sum(0).to(bias_dtype) if needs[2] else None
        dresidual = ds if needs[3] else None
        dgamma = dgamma.to(gamma_dtype) if needs[4] else None
        dbeta = dbeta.to(beta_dtype) if needs[5] and dbeta is not None else None
        return dy, dweight, dbias, dresidual, dgamma, dbeta, None, None, None, None


def train_kernel(y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor,
                 ln_weight: torch.Tensor, ln_bias: torch.Tensor | None, eps: float, dropout_p: float = 0.0,
                 pre_norm: bool = False, rms: bool = False, workspace: Workspace | None = None,
                 checked: bool = True):
    """`twin`'s contract (2-D y and residual) on the kernels, with gradients for y, weight, bias, residual,
    ln_weight and ln_bias (None for an input that is None or does not require grad); see TrainKernel for what it
    saves. dropout_p > 0: dropout on y @ W^T + b before the residual joins, as the twin's, drawn inside the row
    kernel from a seed taken from torch's generator once per call (torch.manual_seed reproduces a call); the
    backward regenerates the same mask. Its mask is not the twin's (another generator). dropout_p = 0 draws no seed
    and runs the kernels without dropout. Every argument is checked by the row kernel's launcher whatever
    `checked` says (the training launch has no unchecked form); `workspace` is not read."""
    return TrainKernel.apply(y, weight, bias, residual, ln_weight, ln_bias, eps, dropout_p, pre_norm, rms)


@torch.library.custom_op("fastbert::residual_layernorm", mutates_args=())
def custom_op(y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor,
              ln_weight: torch.Tensor, ln_bias: torch.Tensor | None, eps: float, backend: str,
              rms: bool = False) -> torch.Tensor:
    return run_backend(OP, backend, y,
                       lambda: kernels().launch(y, weight, bias, residual, ln_weight, ln_bias, eps, rms=rms),
                       lambda: twin(y, weight, bias, residual, ln_weight, ln_bias, eps, rms=rms))


@custom_op.register_fake
def _(y, weight, bias, residual, ln_weight, ln_bias, eps, backend, rms=False):
    return residual.new_empty(residual.shape)


# The pre-norm form is its own op: it returns two tensors (the new residual stream s and LN(s)), both fresh.
@torch.library.custom_op("fastbert::residual_layernorm_pre", mutates_args=())
def custom_op_pre(y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor,
                  ln_weight: torch.Tensor, ln_bias: torch.Tensor | None, eps: float,
                  backend: str, rms: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    return run_backend(OP, backend, y,
                       lambda: kernels().launch(y, weight, bias, residual, ln_weight, ln_bias, eps, pre_norm=True,
                                                rms=rms),
                       lambda: twin(y, weight, bias, residual, ln_weight, ln_bias, eps, pre_norm=True, rms=rms))


@custom_op_pre.register_fake
def _(y, weight, bias, residual, ln_weight, ln_bias, eps, backend, rms=False):
    return residual.new_empty(residual.shape), residual.new_empty(residual.shape)


def traced(backend: str):
    def run(y, weight, bias, residual, ln_weight, ln_bias, eps, dropout_p=0.0, pre_norm=False, rms=False,
            workspace=None):
        # dropout_p is 0 here: a traced forward records the custom ops for inference only (dispatch.plan)
        op = torch.ops.fastbert.residual_layernorm_pre if pre_norm else torch.ops.fastbert.residual_layernorm
        return op(y, weight, bias, residual, ln_weight, ln_bias, eps, backend, rms)
    return run


def train_reason(situation) -> str | None:
    """Why train_kernel cannot serve a training forward's situation: never (both norm placements, RMSNorm, and
    hidden dropout drawn in the row kernels)."""
    return None


def reason(situation, facts) -> str | None:
    return kernel_reason(OP, situation, facts, train_reason)


class Variant(NamedTuple):
    """What residual_layernorm's speed depends on beyond the shared shapes (measure.Shapes.residual_layernorm)."""
    pre_norm: bool = False  # the pre-norm form: returns the stream s and LN(s)
    rms: bool = False  # RMSNorm: the twin runs HF's elementwise passes where torch's layer_norm is one kernel


def key(dtype: torch.dtype, shapes) -> str:
    # pre-norm: the kernel writes a second [T, H] output
    variant = shapes.residual_layernorm
    key = f"{OP}|{str(dtype).replace('torch.', '')}|T{shapes.tokens}|H{shapes.hidden}|I{shapes.intermediate}"
    return key + ("|prenorm" if variant.pre_norm else "") + ("|rms" if variant.rms else "")


def contenders(dtype, shapes, device, kernel, twin):
    """A post-norm layer calls it twice: after attention (K = H) and after the FFN (K = I); pre-norm is timed as
    ModernBERT runs it, a LayerNorm without bias, and RMSNorm (never a bias) as EuroBERT runs it."""
    rand, _ = random_inputs(device, dtype)
    T, H, I = shapes.tokens, shapes.hidden, shapes.intermediate
    x = rand(T, H)
    ones = torch.ones(H, device=device, dtype=dtype)
    pre_norm, rms = shapes.residual_layernorm.pre_norm, shapes.residual_layernorm.rms
    beta = None if pre_norm or rms else torch.zeros(H, device=device, dtype=dtype)
    first = (rand(T, H), rand(H, H, scale=H ** -0.5), rand(H), x, ones, beta, 1e-12, 0.0, pre_norm, rms)
    second = (rand(T, I), rand(H, I, scale=I ** -0.5), rand(H), x, ones, beta, 1e-12, 0.0, pre_norm, rms)
    return (lambda: (kernel(*first), kernel(*second))), (lambda: (twin(*first), twin(*second)))
