"""The four fused ops for callers outside the model, resolved per call: `qkv_projection(..., backend=)` and so on,
"torch" by default. The model resolves once per forward instead (fastbert/dispatch.py).

Each op's definition (its twin) and kernel adapter are in its unit (fastbert/units/); the twins are re-exported here
under the names of the ops.
"""
from __future__ import annotations

import torch

from .dispatch import (  # noqa: F401
    BACKENDS,
    OPS,
    Situation,
    reasons,
    resolve,
    triton_import_error,
    triton_unavailable,
)
from .fallback import with_net
from .mask import AttentionMask
from .twins import ACTIVATIONS, Disentangled, Rotary, default_scale  # noqa: F401
from .units import attention as _attention
from .units import bias_gelu as _bias_gelu
from .units import qkv_projection as _qkv_projection
from .units import residual_layernorm as _residual_layernorm
from .units.attention import Extras, attention_padded_torch, attention_torch, attention_varlen_torch  # noqa: F401

qkv_projection_torch = _qkv_projection.twin
bias_gelu_torch = _bias_gelu.twin
residual_layernorm_torch = _residual_layernorm.twin


def _needs_grad(*tensors) -> bool:
    """Whether autograd records a call on `tensors`: its kernel is then the unit's train_kernel."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _use_kernel(op: str, backend: str, x, *tensors, dropout: float = 0.0, head_dim: int | None = None,
                padded: str | None = None) -> bool:
    """resolve() for one call of the functions below (the model resolves once per forward instead)."""
    needs_grad = _needs_grad(x, *tensors)
    why = reasons(Situation((), x.device, x.dtype, head_dim or 0, needs_grad, dropout, dropout, padded))[op]

    def reason():
        if x.dim() and x.stride(-1) != 1:
            return f"the input's last dimension has stride {x.stride(-1)} (the kernels read unit-stride rows)"
        return why()

    return resolve(op, backend, x.device, reason)


def _call(op: str, backend: str, x: torch.Tensor, kernel, twin):
    """A kernel the per-op functions chose: as asked for under "triton", under the safety net under "auto"."""
    return kernel() if backend == "triton" else with_net(op, x, x.device, kernel, twin)


def qkv_projection(x, weight, bias, num_heads: int, *, backend: str = "torch") -> torch.Tensor:
    twin = lambda: _qkv_projection.twin(x, weight, bias, num_heads)  # noqa: E731
    if _use_kernel("qkv_projection", backend, x, weight, bias):
        run = _qkv_projection.train_kernel if _needs_grad(x, weight, bias) else _qkv_projection.kernel
        return _call("qkv_projection", backend, x, lambda: run(x, weight, bias, num_heads, checked=True), twin)
    return twin()


def attention(qkv, attn, scale: float, *, dropout_p: float = 0.0, return_probs: bool = False,
              backend: str = "torch", bias: torch.Tensor | None = None, window: int | None = None,
              rotary=None, disentangled=None, kv_heads: int | None = None,
              causal: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`attn`: a TokenLayout (packed, padding-free) or an AttentionMask (padded rows). `bias`, `window`, `rotary`,
    `disentangled`, `kv_heads`, `causal`: the fields of units.attention.Extras (a per-distance bias table, a sliding
    window, rotary cos/sin, DeBERTa's c2p/p2c terms, grouped key/value heads: qkv [T, nh + 2 kv, hd], keys at or
    before each query only)."""
    padded = None
    if return_probs:
        padded = "output_attentions=True needs the probabilities (flash attention never forms them)"
    elif isinstance(attn, AttentionMask) and attn.custom:
        padded = "a custom 3-D/4-D attention mask was given (the kernel takes a [B, S] key mask)"
    extras = Extras(bias, window, rotary, disentangled, kv_heads, causal)
    twin = lambda: _attention.twin(qkv, attn, scale, dropout_p, return_probs, extras)  # noqa: E731
    tables = (bias, *(rotary or ()), *(() if disentangled is None else (disentangled.c2p, disentangled.p2c)))
    train = _needs_grad(qkv, *tables) or dropout_p > 0
    if train and padded is None:
        padded = _attention.train_unsupported(attn, dropout_p, return_probs, extras)
    if _use_kernel("attention", backend, qkv, *tables, dropout=dropout_p, head_dim=qkv.shape[-1], padded=padded):
        if train:
            kernel = lambda: _attention.train_kernel(qkv, attn, scale, dropout_p, extras=extras)  # noqa: E731
        else:
            kernel = lambda: _attention.kernel(qkv, attn, scale, extras=extras, checked=True)  # noqa: E731
        return _call("attention", backend, qkv, kernel, twin)
    return twin()


def bias_gelu(x, weight, bias, activation: str = "gelu", *, gated: bool = False,
              backend: str = "torch") -> torch.Tensor:
    """act(x @ W^T + b); gated: W [2I, H] (HF's Wi) and act(a) * g [T, I] (units.bias_gelu.twin)."""
    twin = lambda: _bias_gelu.twin(x, weight, bias, activation, gated)  # noqa: E731
    if _use_kernel("bias_gelu", backend, x, weight, bias):
        run = _bias_gelu.train_kernel if _needs_grad(x, weight, bias) else _bias_gelu.kernel
        return _call("bias_gelu", backend, x, lambda: run(x, weight, bias, activation, gated, checked=True), twin)
    return twin()


def residual_layernorm(y, weight, bias, residual, ln_weight, ln_bias, eps: float, *, dropout_p: float = 0.0,
                       pre_norm: bool = False, backend: str = "torch"):
    """LN(y @ W^T + b + residual) [T, H]; pre_norm: (s, LN(s)) for s = y @ W^T + b + residual; ln_bias may be None
    (units.residual_layernorm.twin)."""
    twin = lambda: _residual_layernorm.twin(y, weight, bias, residual, ln_weight, ln_bias, eps,  # noqa: E731
                                            dropout_p, pre_norm)
    tensors = (weight, bias, residual, ln_weight, ln_bias)
    if _use_kernel("residual_layernorm", backend, y, *tensors, dropout=dropout_p):
        train = _needs_grad(y, *tensors) or dropout_p > 0
        run = _residual_layernorm.train_kernel if train else _residual_layernorm.kernel
        return _call("residual_layernorm", backend, y, lambda: run(
            y, weight, bias, residual, ln_weight, ln_bias, eps, dropout_p, pre_norm, checked=True), twin)
    return twin()
