"""The four fused ops of a BERT layer: their PyTorch twins (the definitions) and the one place that picks a backend.

Every op works on token-major 2-D matrices [T, features] (T = batch*seq). Each public function takes a
`backend` keyword: "torch" runs the twin below, "triton" runs the kernel in `fastbert.kernels` (and raises, naming
the reason, when it cannot), "auto" runs Triton when the tensors are on CUDA (or TRITON_INTERPRET=1 is set) and the
call is one the kernel serves, else the twin. When "auto" has to leave a CUDA call on the twin (autograd, dropout,
output_attentions, a custom mask, an unsupported head dim) it says so once per op and reason, not per call.

    op                  twin (the contract)                                   Triton kernel fuses
    qkv_projection      x @ W_qkv^T + b_qkv viewed [T, 3, nh, hd]            one GEMM, bias in the epilogue
    attention           softmax(q k^T * scale + mask) v  -> [T, nh*hd]       flash attention, online softmax
    bias_gelu           act(x @ W^T + b)                                      GEMM with bias+activation epilogue
    residual_layernorm  LN(y @ W^T + b + residual)                            bias+residual+LN in one pass per row
"""
from __future__ import annotations

import importlib
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

OPS = ("qkv_projection", "attention", "bias_gelu", "residual_layernorm")
BACKENDS = ("auto", "torch", "triton")

# hidden_act -> the activation name the kernels understand. HF's "gelu" is the exact erf GELU; "gelu_new" and
# "gelu_pytorch_tanh" are the same tanh approximation computed two ways.
ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}


# --------------------------------------------------------------------------------------------------------------------
# The padding mask, computed once per forward
# --------------------------------------------------------------------------------------------------------------------
def tracing() -> bool:
    """True while torch.jit.trace, torch.compile or torch.export records the forward: then nothing may branch on a
    tensor's values or read one back to the host, because the recorded graph must serve every later input."""
    return torch.jit.is_tracing() or torch.compiler.is_compiling()


@dataclass(frozen=True)
class AttentionMask:
    """What attention needs to know about padding. Built once per forward by `AttentionMask.build`.

    The rules for `attention_mask` (README, "Masks"):
      2-D [B, S]           key padding: 1 / True = a real token, 0 / False = padding. Any dtype; values must be 0 or 1.
      3-D [B, S, S]        query i may attend to key j where 1 / True. Any dtype, float included; values 0 or 1.
      4-D [B, 1|nh, S, S]  bool or integer: 1 / True = may attend (values 0 or 1); floating: additive, added to the
                           scores as is (0 = attend, a large negative number = masked), as Hugging Face does.
    The model checks the 0/1 values (in its one host sync); this class trusts them.

    batch_size, seq_len: the padded shape; tokens are laid out row-major, T = batch_size * seq_len.
    key_valid: [B, S] bool, True where the key is a real token; None when every key is real (no mask work at all).
    additive:  the mask in the compute dtype, 0 where attended and finfo(dtype).min where masked, [B, 1, 1, S] from
               a 2-D mask or [B, 1|nh, S, S] from a 3-D/4-D one (torch path).
    custom:    True when the user gave a 3-D/4-D mask; only the torch twin serves those.
    empty_rows: [B, 1, 1, 1] bool, True for fully padded rows; None when there is none (decided once per forward).

    A fully padded row (attention_mask all 0) follows HF's eager path: every score is finfo.min, softmax of equal
    values is uniform, so each query of that row attends uniformly to all S keys (its output is the mean of the
    row's values). It stays finite and does not touch other rows. (HF's sdpa path returns something else there.)
    """

    batch_size: int
    seq_len: int
    key_valid: torch.Tensor | None = None
    additive: torch.Tensor | None = None
    custom: bool = False
    empty_rows: torch.Tensor | None = None

    @staticmethod
    def build(attention_mask: torch.Tensor | None, batch_size: int, seq_len: int, dtype: torch.dtype,
              flags: tuple | None = None) -> "AttentionMask":
        """flags: `padding_flags` of a 2-D mask, already read by the caller (the model reads them in the same host
        sync as its input checks); None = read them here. While tracing, nothing is read: the mask is always applied
        and the fully-padded-row rule always runs, so the recorded graph is right for any mask."""
        if attention_mask is None:
            return AttentionMask(batch_size, seq_len)
        min_value = torch.finfo(dtype).min
        if attention_mask.dim() == 2:
            keep = attention_mask != 0
            if tracing():
                all_real, no_empty_row = False, False
            else:
                all_real, no_empty_row = flags if flags is not None else padding_flags(keep).tolist()
            if all_real:  # the common unpadded batch: no mask at all, attention takes its dense path
                return AttentionMask(batch_size, seq_len)
            additive = torch.zeros(batch_size, 1, 1, seq_len, dtype=dtype, device=keep.device)
            additive.masked_fill_(~keep[:, None, None, :], min_value)
            empty_rows = None if no_empty_row else ~keep.any(dim=1)[:, None, None, None]
            return AttentionMask(batch_size, seq_len, keep, additive, empty_rows=empty_rows)
        mask = attention_mask[:, None] if attention_mask.dim() == 3 else attention_mask
        if attention_mask.dim() == 4 and mask.is_floating_point():
            additive = mask.to(dtype)  # already additive: Hugging Face adds a float 4-D mask to the scores as is
        else:
            additive = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask == 0, min_value)
        return AttentionMask(batch_size, seq_len, additive=additive, custom=True)


def padding_flags(keep: torch.Tensor) -> torch.Tensor:
    """[2] int64 for a [B, S] bool key mask: (every key is real, every row has a real key), for one host read."""
    return torch.stack([keep.all(), keep.any(dim=1).all()]).long()


def not_zero_one(mask: torch.Tensor) -> torch.Tensor:
    """0-dim bool: does a 0/1 mask hold any other value? (Always False for a bool mask.)"""
    if mask.dtype == torch.bool:
        return torch.zeros((), dtype=torch.bool, device=mask.device)
    return ((mask != 0) & (mask != 1)).any()


# --------------------------------------------------------------------------------------------------------------------
# The torch twins: the definitions the kernels are tested against, and the CPU / autograd path
# --------------------------------------------------------------------------------------------------------------------
def qkv_projection_torch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, num_heads: int) -> torch.Tensor:
    """x [T, H] @ W_qkv[3*nh*hd, H]^T + b -> [T, 3, nh, hd] (a view of the GEMM output, no copy)."""
    return F.linear(x, weight, bias).view(x.shape[0], 3, num_heads, weight.shape[0] // (3 * num_heads))


def attention_torch(qkv: torch.Tensor, mask: AttentionMask, scale: float, dropout_p: float = 0.0,
                    return_probs: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """qkv [B*S, 3, nh, hd] -> (context [B*S, nh*hd], probs [B, nh, S, S] or None)."""
    B, S = mask.batch_size, mask.seq_len
    T, _, nh, hd = qkv.shape
    q, k, v = qkv.view(B, S, 3, nh, hd).permute(2, 0, 3, 1, 4).unbind(0)  # each [B, nh, S, hd], strided views
    if return_probs:  # HF's eager math, because the caller wants the probabilities themselves
        scores = torch.matmul(q, k.transpose(-1, -2)) * scale
        if mask.additive is not None:
            scores = scores + mask.additive
        probs = torch.softmax(scores, dim=-1)
        ctx = torch.matmul(F.dropout(probs, dropout_p) if dropout_p > 0 else probs, v)
    else:
        probs = None
        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.additive, dropout_p=dropout_p, scale=scale)
    if mask.empty_rows is not None:
        # Fully padded rows: HF eager's uniform attention over all S keys, stated outright. Adding finfo.min only
        # equalises the scores when it swamps them; sdpa adds fp16's -65504 in fp32, where it does not.
        ctx = torch.where(mask.empty_rows, v.mean(dim=2, keepdim=True).to(ctx.dtype), ctx)
        if probs is not None:
            probs = torch.where(mask.empty_rows, torch.full_like(probs, 1.0 / S), probs)
    return ctx.transpose(1, 2).reshape(T, nh * hd), probs  # [B, S, nh, hd] -> [T, nh*hd]


def _activation_torch(h: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "gelu":
        return F.gelu(h)
    if activation == "gelu_tanh":
        return F.gelu(h, approximate="tanh")
    if activation == "relu":
        return F.relu(h)
    raise ValueError(f"activation={activation!r} is not one of {sorted(set(ACTIVATIONS.values()))}")


def bias_gelu_torch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str = "gelu") -> torch.Tensor:
    """x [T, H] -> act(x @ W[I, H]^T + b) [T, I]; activation in {"gelu" (erf), "gelu_tanh", "relu"}."""
    return _activation_torch(F.linear(x, weight, bias), activation)


def residual_layernorm_torch(y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor,
                             ln_weight: torch.Tensor, ln_bias: torch.Tensor, eps: float,
                             dropout_p: float = 0.0) -> torch.Tensor:
    """LayerNorm(dropout(y [T, K] @ W[H, K]^T + b) + residual [T, H]) -> [T, H]."""
    h = F.linear(y, weight, bias)
    if dropout_p > 0:
        h = F.dropout(h, dropout_p)
    h += residual  # in place: h is a fresh tensor that autograd does not save, so this only saves an allocation
    return F.layer_norm(h, (h.shape[-1],), ln_weight, ln_bias, eps)


# --------------------------------------------------------------------------------------------------------------------
# Dispatch: the one place that chooses a backend
# --------------------------------------------------------------------------------------------------------------------
def check_backend(op: str, backend: str) -> None:
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; the ops are {', '.join(OPS)}")
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r} for op {op!r}; the backends are {', '.join(BACKENDS)}")


_TRITON_IMPORT_ERROR: list = []  # [None] once triton imported fine, [message] once it failed


def triton_import_error() -> str | None:
    """None when Triton (and fastbert's kernels) import, else why not. Imported once, lazily."""
    if not _TRITON_IMPORT_ERROR:
        try:
            importlib.import_module("fastbert.kernels")
            _TRITON_IMPORT_ERROR.append(None)
        except Exception as e:  # ImportError, or a broken triton install
            _TRITON_IMPORT_ERROR.append(f"Triton could not be imported ({type(e).__name__}: {e})")
    return _TRITON_IMPORT_ERROR[0]


def _kernel(op: str):
    return importlib.import_module(f"fastbert.kernels.{op}")


def _kernel_facts():
    """fastbert.kernels.utils: what the kernels support (imported only once Triton is known to import)."""
    return importlib.import_module("fastbert.kernels.utils")


def triton_unavailable(device: torch.device) -> str | None:
    """Why the Triton backend cannot run on this device at all (None when it can)."""
    return triton_import_error() or _kernel_facts().device_unsupported(device)


_WARNED: set = set()


def _use_triton(op: str, backend: str, device: torch.device, unsupported: str | None) -> bool:
    """Resolve `backend` for one call. `unsupported` says why the kernel cannot serve this particular call."""
    if backend == "torch":
        return False
    unavailable = triton_unavailable(device)
    if backend == "triton":
        if unavailable or unsupported:
            raise RuntimeError(f"op {op!r}: backend 'triton' was requested but {unavailable or unsupported}; "
                               f"use backend 'torch' or 'auto' for this op")
        return True
    if backend != "auto":
        check_backend(op, backend)
    if unavailable:  # e.g. CPU tensors without the interpreter: the twin is the expected path, nothing to say
        return False
    if unsupported:
        if (op, unsupported) not in _WARNED:
            _WARNED.add((op, unsupported))
            warnings.warn(f"fastbert: op {op!r} runs on the PyTorch twin because {unsupported}; said once",
                          stacklevel=4)
        return False
    return True


def _unsupported(op: str, *tensors: torch.Tensor, dropout_p: float = 0.0, head_dim: int | None = None) -> str | None:
    """Why the kernel of `op` cannot serve this call (None when it can). Only asked once Triton is available."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        return "autograd is needed (inputs require grad; the kernels serve inference: wrap it in torch.no_grad())"
    if dropout_p > 0:
        return f"dropout is active (p={dropout_p}; the kernels serve inference: call model.eval())"
    if tensors[0].dim() and tensors[0].stride(-1) != 1:
        return f"the input's last dimension has stride {tensors[0].stride(-1)} (the kernels read unit-stride rows)"
    return _kernel_facts().call_unsupported(op, tensors[0].dtype, head_dim)


def _why_not(op: str, backend: str, device: torch.device, reason) -> str | None:
    """The reason the kernel cannot serve the call, computed only when it matters (not for backend 'torch', and not
    when Triton cannot run here at all). `reason` is a function returning it."""
    if backend == "torch" or triton_unavailable(device):
        return None
    return reason()


def qkv_projection(x, weight, bias, num_heads: int, *, backend: str = "torch") -> torch.Tensor:
    why = _why_not("qkv_projection", backend, x.device, lambda: _unsupported("qkv_projection", x, weight, bias))
    if _use_triton("qkv_projection", backend, x.device, why):
        return _kernel("qkv_projection").qkv_projection(x, weight, bias, num_heads)
    return qkv_projection_torch(x, weight, bias, num_heads)


def attention(qkv, mask: AttentionMask, scale: float, *, dropout_p: float = 0.0, return_probs: bool = False,
              backend: str = "torch") -> tuple[torch.Tensor, torch.Tensor | None]:
    def reason():
        if return_probs:
            return "output_attentions=True needs the probabilities (flash attention never forms them)"
        if mask.custom:
            return "a custom 3-D/4-D attention mask was given (the kernel takes a [B, S] key mask)"
        return _unsupported("attention", qkv, dropout_p=dropout_p, head_dim=qkv.shape[-1])

    if _use_triton("attention", backend, qkv.device, _why_not("attention", backend, qkv.device, reason)):
        return _kernel("attention").attention(qkv, mask.seq_len, scale, key_valid=mask.key_valid), None
    return attention_torch(qkv, mask, scale, dropout_p, return_probs)


def bias_gelu(x, weight, bias, activation: str = "gelu", *, backend: str = "torch") -> torch.Tensor:
    why = _why_not("bias_gelu", backend, x.device, lambda: _unsupported("bias_gelu", x, weight, bias))
    if _use_triton("bias_gelu", backend, x.device, why):
        return _kernel("bias_gelu").bias_gelu(x, weight, bias, activation)
    return bias_gelu_torch(x, weight, bias, activation)


def residual_layernorm(y, weight, bias, residual, ln_weight, ln_bias, eps: float, *, dropout_p: float = 0.0,
                       backend: str = "torch") -> torch.Tensor:
    why = _why_not("residual_layernorm", backend, y.device, lambda: _unsupported(
        "residual_layernorm", y, weight, bias, residual, ln_weight, ln_bias, dropout_p=dropout_p))
    if _use_triton("residual_layernorm", backend, y.device, why):
        return _kernel("residual_layernorm").residual_layernorm(y, weight, bias, residual, ln_weight, ln_bias, eps)
    return residual_layernorm_torch(y, weight, bias, residual, ln_weight, ln_bias, eps, dropout_p)


def default_scale(head_dim: int) -> float:
    return head_dim ** -0.5  # written as HF writes it, so the float is bit-identical
