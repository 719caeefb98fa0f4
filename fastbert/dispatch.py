"""The one place that picks a backend for each of the four ops.

The backend of each op is resolved once per forward (`plan`, cached per `Situation` by the model): "torch" runs the
twin (fastbert/twins.py), "triton" runs the kernel in `fastbert.kernels` (and raises, naming the reason, when it
cannot), "auto" runs Triton when the tensors are on CUDA (or TRITON_INTERPRET=1 is set) and the kernel serves the
call, else the twin. On a GPU "auto" also measures kernel against twin per shape bucket (fastbert/auto.py), and runs
every kernel under the safety net of fastbert/fallback.py. When "auto" has to leave a call on the twin (autograd,
dropout, output_attentions, a custom mask, an unsupported head dim or dtype) it says so once per op and reason.
"""
from __future__ import annotations

import contextlib
import importlib
import warnings
from typing import Callable, NamedTuple

import torch

from . import custom_ops, fallback, twins
from .fallback import kernel_failed, net_callable
from .layout import TokenLayout
from .mask import tracing

OPS = ("qkv_projection", "attention", "bias_gelu", "residual_layernorm")
BACKENDS = ("auto", "torch", "triton")


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


class Situation(NamedTuple):
    """Everything the backend choice of a forward depends on (the model's cache key: a tuple, so that building and
    hashing one per forward is C work, not a dataclass's Python __init__ and __hash__)."""
    kernels: tuple  # the requested backend of each op, in OPS order
    device: torch.device
    dtype: torch.dtype
    head_dim: int
    needs_grad: bool  # autograd will need the ops' graph
    attention_dropout: float
    hidden_dropout: float
    padded: str | None  # why attention runs on padded rows ("output_attentions=True needs ...", a custom mask), or None
    shapes: object = None  # auto.Shapes where "auto" measures (an inference forward on CUDA), else None
    disentangled: bool = False  # attention carries DeBERTa's c2p/p2c terms (twins.Disentangled)


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
            "bias_gelu": common("bias_gelu"),
            "residual_layernorm": common("residual_layernorm", situation.hidden_dropout)}


class Ops(NamedTuple):
    """The four ops of one forward, each the kernel or the twin; every callable takes the same arguments whichever
    backend it runs (see the layer's forward). `triton`: the ops that run their kernel. `traced`: the forward is
    being recorded (torch.jit.trace, torch.compile, export); `grad`: it records autograd (Situation.needs_grad).
    Both are asked once here rather than in every layer."""
    qkv_projection: Callable
    attention: Callable
    bias_gelu: Callable
    residual_layernorm: Callable
    triton: frozenset
    traced: bool = False
    grad: bool = False


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
        return Ops(twins.qkv_projection_torch, twins.attention_torch, twins.bias_gelu_torch,
                   twins.residual_layernorm_torch, frozenset(), traced=True)
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
                   # probabilities and custom masks: the twin
                   traced["attention"] if situation.padded is None else twins.attention_torch,
                   traced["bias_gelu"], traced["residual_layernorm"],
                   triton=frozenset(op for op, on in use.items() if on), traced=True, grad=situation.needs_grad)
    g = globals()

    def chosen(op):
        kernel, twin = g[_KERNELS[op]], getattr(twins, _TWINS[op])  # looked up now: tests may patch a twin
        if backends[op] == "torch":
            return twin
        if backends[op] == "triton":  # asked for: the kernel's own error reaches the caller
            return kernel
        table_key = None if situation.shapes is None else _auto().op_key(op, situation.dtype, situation.shapes)
        return net_callable(op, kernel, twin, situation.device, table_key)

    return Ops(*(chosen(op) for op in OPS), triton=frozenset(op for op, on in use.items() if on), traced=tracing(),
               grad=situation.needs_grad)


_TWINS = {"qkv_projection": "qkv_projection_torch", "attention": "attention_torch", "bias_gelu": "bias_gelu_torch",
          "residual_layernorm": "residual_layernorm_torch"}
_KERNELS = {op: f"_{op}_triton" for op in OPS}


def _auto():
    from . import auto  # measures with Triton's clock: imported when "auto" first measures
    return auto


def _measured(op: str, situation: Situation) -> bool:
    """"auto" on a GPU: the kernel when it measured at least as fast as the twin for these shapes (auto.py), and has
    not failed for them. While a forward is traced or a CUDA graph captured, nothing is timed (a device sync would
    break the capture): an op not yet measured takes its kernel, whose launcher uses a fixed config there."""
    auto = _auto()
    choices = auto.choices_for(situation.device)
    key = auto.op_key(op, situation.dtype, situation.shapes)
    failed = (op, situation.dtype, situation.shapes.tokens)
    if failed in fallback._FAILED:
        return False
    if choices.failure(key) is not None:  # an earlier process with these versions saw the kernel fail
        kernel_failed(failed, f"{choices.failure(key)} (in an earlier process)", situation.device, key)
        return False
    if tracing() or not choices.known(key) and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return choices.table.get(key, {}).get("choice", "triton") == "triton"
    g = globals()
    kernel_fn, twin_fn = auto.contenders(op, situation.dtype, situation.shapes, situation.device, g[_KERNELS[op]],
                                         getattr(twins, _TWINS[op]))
    try:
        return choices.choose(key, kernel_fn, twin_fn)
    except auto.KernelFailed as failure:  # compiling, autotuning or timing the kernel (the twin's errors propagate)
        kernel_failed(failed, failure.error, situation.device, key)
        if fallback.sticky(failure.error):  # recorded; but the context is lost, for the twin too
            raise failure.error from None
        return False


# The kernels behind the same signatures as the twins (the plan has already ruled out dropout and autograd). The model
# has validated its tensors once per forward, so these call each kernel's unchecked `launch`; the per-op functions
# below, for callers outside the model, go through the kernels' checked entry points instead (checked=True).
def _qkv_projection_triton(x, weight, bias, num_heads, checked=False):
    kernel = _kernel("qkv_projection")
    return (kernel.qkv_projection if checked else kernel.launch)(x, weight, bias, num_heads)


def _attention_triton(qkv, attn, scale, dropout_p=0.0, return_probs=False, bias=None, window=None, rotary=None,
                      disentangled=None, checked=False):
    kernel = _kernel("attention")
    run = kernel.attention if checked else kernel.launch
    # DeBERTa's terms reach the kernel (a leaf) as plain tensors
    terms = {} if disentangled is None else dict(c2p=disentangled.c2p, p2c=disentangled.p2c,
                                                 column=disentangled.column)
    if isinstance(attn, TokenLayout):
        return run(qkv, attn.cu_seqlens, attn.max_seqlen, scale, bias=bias, window=window, rotary=rotary,
                   **terms), None
    cu_seqlens = kernel.uniform_cu_seqlens(attn.batch_size, attn.seq_len, qkv.device)
    # DeBERTa masks with key_valid[i] * key_valid[j] (attn.pairwise): a padded query's scores are all finfo.min,
    # uniform over the row
    return run(qkv, cu_seqlens, attn.seq_len, scale, key_valid=attn.key_valid, bias=bias, window=window,
               rotary=rotary, **terms, uniform_padded_queries=attn.pairwise), None


def _bias_gelu_triton(x, weight, bias, activation="gelu", gated=False, checked=False):
    kernel = _kernel("bias_gelu")
    return (kernel.bias_gelu if checked else kernel.launch)(x, weight, bias, activation, gated)


def _residual_layernorm_triton(y, weight, bias, residual, ln_weight, ln_bias, eps, dropout_p=0.0, pre_norm=False,
                               checked=False):
    kernel = _kernel("residual_layernorm")
    return (kernel.residual_layernorm if checked else kernel.launch)(y, weight, bias, residual, ln_weight, ln_bias, eps,
                                                                     pre_norm)
