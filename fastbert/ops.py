"""The four fused ops of a BERT layer: their PyTorch twins (the definitions) and the one place that picks a backend.

Every op works on token-major 2-D matrices [T, features] (T = real tokens, packed). The backend of each op is
resolved once per forward (`resolve`, cached per situation): "torch" runs the twin below, "triton" runs the kernel in
`fastbert.kernels` (and raises, naming the reason, when it cannot), "auto" runs Triton when the tensors are on CUDA
(or TRITON_INTERPRET=1 is set) and the kernel serves the call, else the twin. When "auto" has to leave a call on the
twin (autograd, dropout, output_attentions, a custom mask, an unsupported head dim or dtype) it says so once per op
and reason. The public per-op functions (`qkv_projection(..., backend=)` and so on) resolve per call, for callers
outside the model.

    op                  twin (the contract)                                   Triton kernel fuses
    qkv_projection      x @ W_qkv^T + b_qkv viewed [T, 3, nh, hd]            one GEMM, bias in the epilogue
    attention           softmax(q k^T * scale + mask) v  -> [T, nh*hd]       flash attention, online softmax
    bias_gelu           act(x @ W^T + b)                                      GEMM with bias+activation epilogue
    residual_layernorm  LN(y @ W^T + b + residual)                            bias+residual+LN in one pass per row
"""
from __future__ import annotations

import contextlib
import importlib
import warnings
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from .layout import TokenLayout, token_bucket

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


def attention_torch(qkv: torch.Tensor, attn, scale: float, dropout_p: float = 0.0,
                    return_probs: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """qkv [T, 3, nh, hd] -> (context [T, nh*hd], probs [B, nh, S, S] or None). `attn` is a TokenLayout (packed
    sequences, padding-free) or an AttentionMask (padded rows, T = B*S)."""
    if isinstance(attn, TokenLayout):
        return attention_varlen_torch(qkv, attn, scale, dropout_p), None
    return attention_padded_torch(qkv, attn, scale, dropout_p, return_probs)


def attention_varlen_torch(qkv: torch.Tensor, layout: TokenLayout, scale: float, dropout_p: float = 0.0) -> torch.Tensor:
    """Packed sequences -> context [T, nh*hd]. Equal lengths run as one dense batch; otherwise one sdpa per sequence
    on its [1, nh, L, hd] view (the fastest CPU form measured: 0.27 s for 32 sequences of 16-512 tokens, against
    1.05 s padded to the longest with a mask, and 5 s for the same loop on 3-D [nh, L, hd] inputs)."""
    T, _, nh, hd = qkv.shape
    if layout.uniform:
        B, S = layout.num_seqs, layout.max_seqlen
        q, k, v = qkv.view(B, S, 3, nh, hd).permute(2, 0, 3, 1, 4).unbind(0)  # each [B, nh, S, hd], strided views
        ctx = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, scale=scale)
        return ctx.transpose(1, 2).reshape(T, nh * hd)
    if layout.lengths is None:
        raise RuntimeError("the PyTorch attention twin needs the sequence lengths on the host; this layout has none "
                           "(a captured CUDA graph runs the Triton kernel)")
    out, start = qkv.new_empty(T, nh * hd), 0
    for length in layout.lengths:
        if length:
            q, k, v = qkv[start:start + length].unsqueeze(0).permute(2, 0, 3, 1, 4).unbind(0)  # [1, nh, L, hd]
            ctx = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, scale=scale)
            out[start:start + length].view(length, nh, hd).copy_(ctx[0].transpose(0, 1))  # one copy, no cat
        start += length
    return out


def attention_padded_torch(qkv: torch.Tensor, mask: "AttentionMask", scale: float, dropout_p: float = 0.0,
                           return_probs: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Padded rows, qkv [B*S, 3, nh, hd] -> (context [B*S, nh*hd], probs [B, nh, S, S] or None)."""
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
    return torch.layer_norm(h, (h.shape[-1],), ln_weight, ln_bias, eps)  # F.layer_norm's Python wrapper costs 0.5 us


# --------------------------------------------------------------------------------------------------------------------
# Dispatch: the one place that chooses a backend
# --------------------------------------------------------------------------------------------------------------------
def check_backend(op: str, backend: str) -> None:
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; the ops are {', '.join(OPS)}")
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r} for op {op!r}; the backends are {', '.join(BACKENDS)}")


_TRITON_IMPORT_ERROR: list = []  # [None] once triton imported fine, [message] once it failed
_KERNEL_FACTS: list = []  # [fastbert.kernels.utils] once imported


def triton_import_error() -> str | None:
    """None when Triton (and fastbert's kernels) import, else why not. Imported once, lazily (BertModel asks at
    construction, so that a traced forward never meets an import)."""
    if not _TRITON_IMPORT_ERROR:
        try:
            _KERNEL_FACTS.append(importlib.import_module("fastbert.kernels.utils"))
            _TRITON_IMPORT_ERROR.append(None)
        except Exception as e:  # ImportError, or a broken triton install
            _TRITON_IMPORT_ERROR.append(f"Triton could not be imported ({type(e).__name__}: {e})")
    return _TRITON_IMPORT_ERROR[0]


def _kernel(op: str):
    return importlib.import_module(f"fastbert.kernels.{op}")


def _kernel_facts():
    """fastbert.kernels.utils: what the kernels support (only asked once Triton is known to import)."""
    return _KERNEL_FACTS[0]


def triton_unavailable(device: torch.device) -> str | None:
    """Why the Triton backend cannot run on this device at all (None when it can)."""
    return triton_import_error() or _kernel_facts().device_unsupported(device)


_WARNED: set = set()


def resolve(op: str, backend: str, device: torch.device, reason) -> bool:
    """True when `op` runs its Triton kernel. `reason()` says why the kernel cannot serve this situation (None when
    it can); it is only asked when Triton can run on `device` at all. "triton" raises where "auto" takes the twin
    (with one warning per op and reason)."""
    if backend == "torch":
        return False
    if backend not in BACKENDS:
        check_backend(op, backend)
    unavailable = triton_unavailable(device)
    unsupported = None if unavailable else reason()
    if backend == "triton":
        if unavailable or unsupported:
            raise RuntimeError(f"op {op!r}: backend 'triton' was requested but {unavailable or unsupported}; "
                               f"use backend 'torch' or 'auto' for this op")
        return True
    if unavailable:  # e.g. CPU tensors without the interpreter: the twin is the expected path, nothing to say
        return False
    if unsupported:
        if (op, unsupported) not in _WARNED:
            _WARNED.add((op, unsupported))
            warnings.warn(f"fastbert: op {op!r} runs on the PyTorch twin because {unsupported}; said once",
                          stacklevel=5)
        return False
    return True


@dataclass(frozen=True)
class Situation:
    """Everything the backend choice of a forward depends on (the model's cache key)."""
    kernels: tuple  # the requested backend of each op, in OPS order
    device: torch.device
    dtype: torch.dtype
    head_dim: int
    needs_grad: bool  # autograd will need the ops' graph
    attention_dropout: float
    hidden_dropout: float
    padded: str | None  # why attention runs on padded rows ("output_attentions=True needs ...", a custom mask), or None
    shapes: object = None  # auto.Shapes where "auto" measures (an inference forward on CUDA), else None


# Where "auto" picks by measuring (fastbert/auto.py): on a GPU. Elsewhere it takes the kernel wherever one can run
# (CUDA, or the interpreter in tests) and the twin otherwise.
MEASURED_DEVICE_TYPES = ("cuda",)


def reasons(situation: Situation) -> dict:
    """op -> a function giving why its kernel cannot serve `situation` (None when it can)."""
    def common(op, dropout=0.0, head_dim=None):
        def why():
            if situation.needs_grad:
                return "autograd is needed (the kernels serve inference: wrap it in torch.no_grad())"
            if dropout > 0:
                return f"dropout is active (p={dropout}; the kernels serve inference: call model.eval())"
            return _kernel_facts().call_unsupported(op, situation.dtype, head_dim)
        return why

    def attention_why():
        return situation.padded or common("attention", situation.attention_dropout, situation.head_dim)()

    return {"qkv_projection": common("qkv_projection"), "attention": attention_why,
            "bias_gelu": common("bias_gelu"), "residual_layernorm": common("residual_layernorm", situation.hidden_dropout)}


class Ops(NamedTuple):
    """The four ops of one forward, each the kernel or the twin; every callable takes the same arguments whichever
    backend it runs (see the layer's forward). `triton`: the ops that run their kernel."""
    qkv_projection: Callable
    attention: Callable
    bias_gelu: Callable
    residual_layernorm: Callable
    triton: frozenset


# While a forward is traced for inference, the four ops are recorded as torch custom ops (fastbert/custom_ops.py),
# one node each. False records the twins' aten ops instead (what an ONNX export needs: onnx has no fastbert ops).
TRACE_AS_CUSTOM_OPS = True


@contextlib.contextmanager
def traced_as_aten():
    """Within the block, a traced forward records the PyTorch twins as plain aten ops, whatever backend each op was
    asked for (for torch.onnx.export: the kernels cannot be exported)."""
    global TRACE_AS_CUSTOM_OPS
    saved, TRACE_AS_CUSTOM_OPS = TRACE_AS_CUSTOM_OPS, False
    try:
        yield
    finally:
        TRACE_AS_CUSTOM_OPS = saved


def plan(situation: Situation) -> Ops:
    """The four ops for one situation, decided here once."""
    if tracing() and not TRACE_AS_CUSTOM_OPS:  # an ONNX export (traced_as_aten): every op on its twin
        return Ops(qkv_projection_torch, attention_torch, bias_gelu_torch, residual_layernorm_torch, frozenset())
    why = reasons(situation)
    use = {op: resolve(op, backend, situation.device, why[op]) for op, backend in zip(OPS, situation.kernels)}
    inference = not situation.needs_grad and situation.attention_dropout == 0 and situation.hidden_dropout == 0
    if situation.shapes is not None:
        for op, backend in zip(OPS, situation.kernels):
            if backend == "auto" and use[op]:
                use[op] = _measured(op, situation)
    requested = dict(zip(OPS, situation.kernels))
    backends = {op: requested[op] if use[op] else "torch" for op in OPS}  # "auto" here: the kernel, with its net
    if tracing() and inference and TRACE_AS_CUSTOM_OPS:
        traced = custom_ops.traced_ops(backends)
        return Ops(traced["qkv_projection"],
                   traced["attention"] if situation.padded is None else attention_torch,  # probabilities, custom masks
                   traced["bias_gelu"], traced["residual_layernorm"],
                   triton=frozenset(op for op, on in use.items() if on))
    g = globals()

    def chosen(op):
        kernel, twin = g[_KERNELS[op]], g[_TWINS[op]]
        if backends[op] == "torch":
            return twin
        if backends[op] == "triton":  # asked for: the kernel's own error reaches the caller
            return kernel
        table_key = None if situation.shapes is None else _auto().op_key(op, situation.dtype, situation.shapes)
        return _with_net(op, kernel, twin, situation.device, table_key)

    return Ops(*(chosen(op) for op in OPS), triton=frozenset(op for op, on in use.items() if on))


_TWINS = {"qkv_projection": "qkv_projection_torch", "attention": "attention_torch", "bias_gelu": "bias_gelu_torch",
          "residual_layernorm": "residual_layernorm_torch"}
_KERNELS = {op: f"_{op}_triton" for op in OPS}


def _auto():
    from . import auto  # measures with Triton's clock: imported when "auto" first measures or records
    return auto


# ---- "auto"'s safety net: a kernel that breaks never breaks the forward ----------------------------------------------
# A kernel can fail on a GPU nobody here ran (an MLIR pass error, shared memory, an API change between Triton
# versions). Under "auto" that (op, dtype, token bucket) runs the twin for the rest of the process, said once, and on a
# measured GPU the "auto" table on disk records it, so later processes with the same versions do not retry.
_FAILED: dict = {}  # (op, dtype, token bucket) -> "ErrorType: message"


def failure_key(op: str, x: torch.Tensor) -> tuple:
    return op, x.dtype, token_bucket(x.shape[0])


def failed(op: str, dtype: torch.dtype, tokens: int) -> bool:
    """Has `op`'s kernel failed for this dtype and token count (so "auto" runs its twin there)?"""
    return (op, dtype, token_bucket(tokens)) in _FAILED


def with_net(op: str, x: torch.Tensor, device, kernel: Callable, twin: Callable, table_key: str | None = None):
    """kernel() under "auto": twin() instead once this (op, bucket) has failed. When the kernel raises, the twin
    answers this call; if the twin raises too, the input is at fault, not the kernel: its error is raised and nothing
    is recorded."""
    if _FAILED and failure_key(op, x) in _FAILED:
        return twin()
    try:
        return kernel()
    except Exception as error:
        try:
            out = twin()
        except Exception:
            raise error from None
        kernel_failed(failure_key(op, x), error, device, table_key)
        return out


def _with_net(op, kernel, twin, device, table_key):
    """An op callable with the twin's signature that runs `kernel` under the safety net."""
    def run(*args, **kwargs):
        return with_net(op, args[0], device, lambda: kernel(*args, **kwargs), lambda: twin(*args, **kwargs), table_key)
    return run


def kernel_failed(key: tuple, error: BaseException | str, device, table_key: str | None = None) -> None:
    """Record that a kernel failed for `key` (and in the "auto" table under `table_key`), and say so once."""
    op, dtype, bucket = key
    why = error if isinstance(error, str) else f"{type(error).__name__}: {str(error).strip()}"
    why = why if len(why) <= 2000 else why[:2000] + " ..."
    _FAILED[key] = why
    where = ""
    if table_key is not None:
        choices = _auto().choices_for(device)
        if choices.failure(table_key) is None:
            choices.record_failure(table_key, why)
        where = f"; recorded in {choices.path}, so later processes with these versions use the twin too"
    warnings.warn(f"fastbert: the Triton kernel of op {op!r} failed ({str(dtype).replace('torch.', '')}, "
                  f"{bucket}-token bucket): {why}. Under 'auto' this op runs its PyTorch twin there for the rest of "
                  f"this process{where}. Set the op to 'triton' to have the error raised.", RuntimeWarning,
                  stacklevel=2)


def _measured(op: str, situation: Situation) -> bool:
    """"auto" on a GPU: the kernel when it measured at least as fast as the twin for these shapes (auto.py), and has
    not failed for them. While a forward is traced or a CUDA graph captured, nothing is timed (a device sync would
    break the capture): an op not yet measured takes its kernel, whose launcher uses a fixed config there."""
    auto = _auto()
    choices = auto.choices_for(situation.device)
    key = auto.op_key(op, situation.dtype, situation.shapes)
    failed = (op, situation.dtype, situation.shapes.tokens)
    if failed in _FAILED:
        return False
    if choices.failure(key) is not None:  # an earlier process with these versions saw the kernel fail
        kernel_failed(failed, f"{choices.failure(key)} (in an earlier process)", situation.device, key)
        return False
    if tracing() or not choices.known(key) and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return choices.table.get(key, {}).get("choice", "triton") == "triton"
    g = globals()
    kernel_fn, twin_fn = auto.contenders(op, situation.dtype, situation.shapes, situation.device, g[_KERNELS[op]],
                                         g[_TWINS[op]])
    try:
        return choices.choose(key, kernel_fn, twin_fn)
    except Exception as error:  # compiling, autotuning or timing the kernel
        kernel_failed(failed, error, situation.device, key)
        return False


# The kernels behind the same signatures as the twins (the plan has already ruled out dropout and autograd). The model
# has validated its tensors once per forward, so these call each kernel's unchecked `launch`; the per-op functions
# below, for callers outside the model, go through the kernels' checked entry points instead (checked=True).
def _qkv_projection_triton(x, weight, bias, num_heads, checked=False):
    kernel = _kernel("qkv_projection")
    return (kernel.qkv_projection if checked else kernel.launch)(x, weight, bias, num_heads)


def _attention_triton(qkv, attn, scale, dropout_p=0.0, return_probs=False, checked=False):
    kernel = _kernel("attention")
    run = kernel.attention if checked else kernel.launch
    if isinstance(attn, TokenLayout):
        return run(qkv, attn.cu_seqlens, attn.max_seqlen, scale), None
    cu_seqlens = kernel.uniform_cu_seqlens(attn.batch_size, attn.seq_len, qkv.device)
    return run(qkv, cu_seqlens, attn.seq_len, scale, key_valid=attn.key_valid), None


def _bias_gelu_triton(x, weight, bias, activation="gelu", checked=False):
    kernel = _kernel("bias_gelu")
    return (kernel.bias_gelu if checked else kernel.launch)(x, weight, bias, activation)


def _residual_layernorm_triton(y, weight, bias, residual, ln_weight, ln_bias, eps, dropout_p=0.0, checked=False):
    kernel = _kernel("residual_layernorm")
    return (kernel.residual_layernorm if checked else kernel.launch)(y, weight, bias, residual, ln_weight, ln_bias, eps)


# ---- the per-op functions for callers outside the model: resolved per call ------------------------------------------
def _use_kernel(op: str, backend: str, x, *tensors, dropout: float = 0.0, head_dim: int | None = None,
                padded: str | None = None) -> bool:
    """resolve() for one call of the functions below (the model resolves once per forward instead)."""
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, *tensors))
    why = reasons(Situation((), x.device, x.dtype, head_dim or 0, needs_grad, dropout, dropout, padded))[op]

    def reason():
        if x.dim() and x.stride(-1) != 1:
            return f"the input's last dimension has stride {x.stride(-1)} (the kernels read unit-stride rows)"
        return why()

    return resolve(op, backend, x.device, reason)


def _call(op: str, backend: str, x: torch.Tensor, kernel: Callable, twin: Callable):
    """A kernel the per-op functions chose: as asked for under "triton", under the safety net under "auto"."""
    return kernel() if backend == "triton" else with_net(op, x, x.device, kernel, twin)


def qkv_projection(x, weight, bias, num_heads: int, *, backend: str = "torch") -> torch.Tensor:
    twin = lambda: qkv_projection_torch(x, weight, bias, num_heads)  # noqa: E731
    if _use_kernel("qkv_projection", backend, x, weight, bias):
        return _call("qkv_projection", backend, x,
                     lambda: _qkv_projection_triton(x, weight, bias, num_heads, checked=True), twin)
    return twin()


def attention(qkv, attn, scale: float, *, dropout_p: float = 0.0, return_probs: bool = False,
              backend: str = "torch") -> tuple[torch.Tensor, torch.Tensor | None]:
    """`attn`: a TokenLayout (packed, padding-free) or an AttentionMask (padded rows)."""
    padded = None
    if return_probs:
        padded = "output_attentions=True needs the probabilities (flash attention never forms them)"
    elif isinstance(attn, AttentionMask) and attn.custom:
        padded = "a custom 3-D/4-D attention mask was given (the kernel takes a [B, S] key mask)"
    twin = lambda: attention_torch(qkv, attn, scale, dropout_p, return_probs)  # noqa: E731
    if _use_kernel("attention", backend, qkv, dropout=dropout_p, head_dim=qkv.shape[-1], padded=padded):
        return _call("attention", backend, qkv, lambda: _attention_triton(qkv, attn, scale, checked=True), twin)
    return twin()


def bias_gelu(x, weight, bias, activation: str = "gelu", *, backend: str = "torch") -> torch.Tensor:
    twin = lambda: bias_gelu_torch(x, weight, bias, activation)  # noqa: E731
    if _use_kernel("bias_gelu", backend, x, weight, bias):
        return _call("bias_gelu", backend, x, lambda: _bias_gelu_triton(x, weight, bias, activation, checked=True),
                     twin)
    return twin()


def residual_layernorm(y, weight, bias, residual, ln_weight, ln_bias, eps: float, *, dropout_p: float = 0.0,
                       backend: str = "torch") -> torch.Tensor:
    twin = lambda: residual_layernorm_torch(y, weight, bias, residual, ln_weight, ln_bias, eps, dropout_p)  # noqa: E731
    if _use_kernel("residual_layernorm", backend, y, weight, bias, residual, ln_weight, ln_bias, dropout=dropout_p):
        return _call("residual_layernorm", backend, y, lambda: _residual_layernorm_triton(
            y, weight, bias, residual, ln_weight, ln_bias, eps, checked=True), twin)
    return twin()


def default_scale(head_dim: int) -> float:
    return head_dim ** -0.5  # written as HF writes it, so the float is bit-identical


from . import custom_ops  # noqa: E402  (registers the fastbert:: ops; it uses the twins above)
