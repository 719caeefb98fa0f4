"""The one place that picks a backend for each of the four ops.

The backend of each op is resolved once per forward (`plan`, cached per `Situation` by the model): "torch" runs the
twin (its unit in fastbert/units/), "triton" runs the kernel in `fastbert.kernels` (and raises, naming the reason,
when it cannot), "auto" runs Triton when the tensors are on CUDA (or TRITON_INTERPRET=1 is set) and the kernel serves
the call, else the twin. On a GPU "auto" also measures kernel against twin per shape bucket (fastbert/measure.py),
and runs every kernel under the safety net of fastbert/fallback.py. When "auto" has to leave a call on the twin
(autograd, dropout, output_attentions, a custom mask, an unsupported head dim or dtype) it says so once per op and
reason.
"""
from __future__ import annotations

import contextlib
import functools
import threading
import warnings
from typing import Callable, NamedTuple

import torch

from . import fallback
from .fallback import kernel_failed, net_callable
from .mask import tracing
from .units import OPS, UNITS
from .units.common import trains

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
            from .kernels import utils  # Triton itself, and what the kernels support
            _KERNEL_FACTS.append(utils)
            _TRITON_IMPORT_ERROR.append(None)
        except Exception as e:  # ImportError, or a broken triton install
            _TRITON_IMPORT_ERROR.append(f"Triton could not be imported ({type(e).__name__}: {e})")
    return _TRITON_IMPORT_ERROR[0]


def _kernel_facts():
    """fastbert.kernels.utils: what the kernels support (only asked once Triton is known to import)."""
    return _KERNEL_FACTS[0]


_INVARIANT = threading.local()


@contextlib.contextmanager
def batch_invariant(enabled: bool = True):
    """Within the block (this thread only), a text's outputs do not depend on what else is in its batch: "auto" takes
    each op's kernel wherever it can serve the call (never a choice measured per token-count bucket, which could put
    one batch on the kernel and the next on the twin), and the kernels take one fixed tile per variant instead of the
    autotuner's per-size choice (fastbert.kernels.utils.batch_invariant). Padding-free execution does the rest: no
    padding, each sequence's attention over its own keys, every other op per token. On a GPU a text's vector is then
    the same bits in any batch; the PyTorch twins (the CPU path) are left to their libraries (docs/serve.md has what
    they give). What `python -m fastbert serve` runs its model under."""
    saved = getattr(_INVARIANT, "on", False)
    _INVARIANT.on = enabled
    kernels = _kernel_facts().batch_invariant(enabled) if triton_import_error() is None \
        else contextlib.nullcontext()
    try:
        with kernels:
            yield
    finally:
        _INVARIANT.on = saved


def invariant() -> bool:
    """Whether this thread is inside `batch_invariant()`."""
    return getattr(_INVARIANT, "on", False)


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
    shapes: object = None  # measure.Shapes where "auto" measures (a forward on CUDA), else None
    variants: tuple = ()  # the model's Variant of each op that has one (attention's, bias_gelu's, ...), by type
    fmt: object = None  # the number format of the GEMMs (a formats.Format), or None: the weights' own dtype


# The ops that hold a GEMM, which a number format (fastbert/formats.py) runs in torch: its int8 / bf16 GEMM
GEMM_OPS = ("qkv_projection", "bias_gelu", "residual_layernorm")


# Where "auto" picks by measuring (fastbert/measure.py): on a GPU. Elsewhere it takes the kernel wherever one can run
# (CUDA, or the interpreter in tests) and the twin otherwise.
MEASURED_DEVICE_TYPES = ("cuda",)


def reasons(situation: Situation) -> dict:
    """op -> a function giving why its kernel cannot serve `situation` (None when it can): each unit's `reason`."""
    return {op: (lambda unit=unit: unit.reason(situation, _kernel_facts())) for op, unit in UNITS.items()}


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
    fmt: object = None  # the GEMMs' number format (formats.Format), or None; the ops hold it already (functools.
                        # partial), and a layer's linears that no op holds take it from here (twins.linear)


# While a forward is traced for inference, the four ops are recorded as torch custom ops (each unit's),
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
    """The four ops for one situation, decided here once. Each op's callables are its unit's (fastbert/units/),
    looked up now: tests may patch a unit's twin or kernel."""
    fmt = situation.fmt
    if fmt is not None and tracing():
        raise NotImplementedError(f"fastbert: a forward in the {fmt.name} format is not traced (its GEMMs read "
                                  f"weights prepared outside the graph): trace or export the fp32 model")
    if tracing() and not TRACE_AS_CUSTOM_OPS:  # an ONNX export (traced_as_aten): every op on its twin
        return Ops(*(unit.twin for unit in UNITS.values()), frozenset(), traced=True)
    why = reasons(situation)
    training = {op: trains(op, situation) for op in OPS}
    kernels = situation.kernels
    if fmt is not None:
        for op, backend in zip(OPS, kernels):
            if op in GEMM_OPS and backend == "triton":
                raise RuntimeError(f"op {op!r}: backend 'triton' was requested, but the {fmt.name} format runs this "
                                   f"op's GEMM in torch; use backend 'torch' or 'auto' for it")
        kernels = tuple("torch" if op in GEMM_OPS else backend for op, backend in zip(OPS, kernels))
    use = {op: resolve(op, backend, situation.device, why[op]) for op, backend in zip(OPS, kernels)}
    inference = not any(training.values())
    for op, backend in zip(OPS, kernels):
        if backend != "auto" or not use[op]:
            continue
        if situation.shapes is not None:  # a GPU: measured (forward + backward where the op trains)
            use[op] = _measured(op, situation, training[op])
        elif training[op]:  # unmeasured (the interpreter): a forward that trains keeps the twin, as on a CPU
            use[op] = False
    requested = dict(zip(OPS, kernels))
    backends = {op: requested[op] if use[op] else "torch" for op in OPS}  # "auto" here: the kernel, with its net
    triton = frozenset(op for op, on in use.items() if on)
    if tracing() and inference and TRACE_AS_CUSTOM_OPS:
        traced = traced_ops(backends)
        if situation.padded is not None:  # probabilities and custom masks: the twin
            traced["attention"] = UNITS["attention"].twin
        return Ops(*traced.values(), triton=triton, traced=True, grad=situation.needs_grad)

    def chosen(op):
        unit = UNITS[op]
        if backends[op] == "torch":
            return unit.twin if fmt is None or op not in GEMM_OPS else functools.partial(unit.twin, fmt=fmt)
        kernel = unit.train_kernel if training[op] else unit.kernel  # the autograd function where the op trains
        if backends[op] == "triton":  # asked for: the kernel's own error reaches the caller
            return kernel
        table_key = None if situation.shapes is None else table_key_of(op, situation, training[op])
        return net_callable(op, kernel, unit.twin, situation.device, table_key)

    return Ops(*map(chosen, OPS), triton=triton, traced=tracing(), grad=situation.needs_grad, fmt=fmt)


def _measure():
    from . import measure  # times with Triton's clock: imported when "auto" first measures
    return measure


def table_key_of(op: str, situation: Situation, training: bool) -> str:
    """"auto"'s table key for `op` in `situation` (a GPU forward): the unit's key, and "|train" where the op trains,
    since forward + backward is what is timed there."""
    key = UNITS[op].key(situation.dtype, situation.shapes)
    return key + "|train" if training else key


def with_backward(fn: Callable) -> Callable:
    """fn's call, then the backward of its floating outputs (ones as their gradients), the tensor arguments made
    leaves that need gradients: what a training step costs an op, for "auto" to time."""
    def run(*args, **kwargs):
        args = [a.detach().requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                for a in args]
        out = fn(*args, **kwargs)
        outs = [o for o in (out if isinstance(out, tuple) else (out,))
                if isinstance(o, torch.Tensor) and o.requires_grad]
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
        return out
    return run


def _measured(op: str, situation: Situation, training: bool = False) -> bool:
    """"auto" on a GPU: the kernel when it measured at least as fast as the twin for these shapes (measure.py), and has
    not failed for them. While a forward is traced or a CUDA graph captured, nothing is timed (a device sync would
    break the capture): an op not yet measured takes its kernel, whose launcher uses a fixed config there."""
    measure = _measure()
    unit = UNITS[op]
    choices = measure.choices_for(situation.device)
    key = table_key_of(op, situation, training)
    failed = (op, situation.dtype, situation.shapes.tokens)  # a failure, forward or backward, sets both aside
    if failed in fallback._FAILED:
        return False
    if choices.failure(key) is not None:  # an earlier process with these versions saw the kernel fail
        kernel_failed(failed, f"{choices.failure(key)} (in an earlier process)", situation.device, key)
        return False
    if tracing() or not choices.known(key) and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return choices.table.get(key, {}).get("choice", "triton") == "triton"
    if training:
        kernel_fn, twin_fn = unit.contenders(situation.dtype, situation.shapes, situation.device,
                                             with_backward(unit.train_kernel), with_backward(unit.twin))
    else:
        kernel_fn, twin_fn = unit.contenders(situation.dtype, situation.shapes, situation.device, unit.kernel,
                                             unit.twin)
    try:
        return choices.choose(key, kernel_fn, twin_fn)
    except measure.KernelFailed as failure:  # compiling, autotuning or timing the kernel (the twin's errors propagate)
        kernel_failed(failed, failure.error, situation.device, key)
        if fallback.sticky(failure.error):  # recorded; but the context is lost, for the twin too
            raise failure.error from None
        return False


def traced_ops(backends: dict) -> dict:
    """op -> the callable a traced forward's plan holds for it: the twin's signature, recording one custom op node
    that runs `backends[op]` ("torch", "triton", or "auto": the kernel under the safety net)."""
    return {op: unit.traced(backends[op]) for op, unit in UNITS.items()}
