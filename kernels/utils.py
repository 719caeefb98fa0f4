"""What every kernel file shares, and what fastbert.ops asks before it launches one.

This package is a leaf: it imports torch and triton, never fastbert. The facts both sides need live here, read once:
whether Triton's interpreter is on, the dtypes and head dims the kernels are built for, and which calls a kernel
cannot serve (so that "auto" uses the twin and "triton" raises, instead of a kernel returning garbage).
"""
from __future__ import annotations

import contextlib
import os
import threading

import torch
import triton
import triton.language as tl

# Triton reads TRITON_INTERPRET when a kernel is decorated (at import), so the flag cannot change afterwards either.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
_INTERPRET = tl.constexpr(INTERPRET)

DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
HEAD_DIMS = (16, 32, 64, 128)  # tl.dot needs a power of two >= 16
# the ops whose kernels run tl.dot (residual_layernorm's does not)
DOT_OPS = ("qkv_projection", "attention", "bias_gelu")

# Opt-in: warp-specialized tiles join the sm_90 GEMM's autotune list. Off by default: Triton 3.6 documents warp
# specialization as Blackwell-only, and triton-lang/triton#8311 reports wrong results with it on an inner K loop inside
# an outer loop, which is the persistent GEMM's shape. Read once, like TRITON_INTERPRET.
WARP_SPECIALIZE = os.environ.get("FASTBERT_WARP_SPECIALIZE", "0") not in ("", "0")

# The interpreter's tl.dot multiplies bf16 bit patterns as if they were integers (its numpy emulation has no bf16):
# answers off by 1e10, with no error. Compiled kernels are unaffected.
INTERPRETER_BF16_DOT = "Triton's interpreter (TRITON_INTERPRET=1) cannot run a bf16 tl.dot (its answers are garbage)"


def device_unsupported(device: torch.device) -> str | None:
    """Why no kernel can run on `device` (None when they can): CUDA, or CPU under the interpreter."""
    if device.type == "cuda" or (device.type == "cpu" and INTERPRET):
        return None
    return f"the tensors are on {device} (Triton kernels need CUDA tensors, or TRITON_INTERPRET=1 on CPU)"


def call_unsupported(op: str, dtype: torch.dtype, head_dim: int | None = None) -> str | None:
    """Why the kernel of `op` cannot serve a call in `dtype` (and head dim, for attention); None when it can."""
    if dtype not in DTYPES:
        return f"dtype {dtype} is not one of float32, float16, bfloat16"
    if INTERPRET and dtype == torch.bfloat16 and op in DOT_OPS:
        return INTERPRETER_BF16_DOT
    if head_dim is not None and head_dim not in HEAD_DIMS:
        return f"head_dim={head_dim} is not one of {HEAD_DIMS}"
    return None


def input_precision(dtype: torch.dtype) -> str:
    """tl.dot's input_precision: fp32 follows torch's TF32 switch ("tf32" when on, "ieee" when off); 16-bit types
    ignore it, so they always compile one way."""
    if dtype == torch.float32 and tf32_enabled():
        return "tf32"
    return "ieee"


def dropout_seed(device: torch.device) -> torch.Tensor:
    """A Philox seed for one dropout call: int64 [1] on `device`, drawn from torch's generator for that device (so
    torch.manual_seed makes a step reproducible, and a CUDA graph's replay draws a new one). A kernel loads it and
    draws element e's keep bit from Philox(seed, e); its backward is handed the same tensor and regenerates the
    forward's mask exactly. A tensor rather than a Python int: an int argument would be specialised by Triton (its
    value's width and divisibility by 16 enter the compile key) and baked into a captured graph."""
    return torch.randint(0, 2 ** 62, (1,), device=device, dtype=torch.int64)


@triton.jit
def dropout_keep(seed_ptr, offsets, p):
    """The keep mask of dropout with probability p at element numbers `offsets` (int32 or int64, any shape): Philox
    uniform(seed, offset) >= p, the seed loaded from `dropout_seed`'s tensor. The same seed and offsets give the same
    mask in any kernel, forward or backward."""
    seed = tl.load(seed_ptr)
    return tl.rand(seed, offsets) >= p


def tf32_enabled() -> bool:
    """torch's TF32 switch for fp32 matmuls. torch >= 2.9 has `fp32_precision`, which reflects both its own setting and
    the legacy `allow_tf32` (reading `allow_tf32` after the new API was used raises there)."""
    matmul = torch.backends.cuda.matmul
    precision = getattr(matmul, "fp32_precision", None)
    if precision in ("tf32", "ieee"):
        return precision == "tf32"
    return bool(matmul.allow_tf32)


@triton.jit
def loop_bound(n):
    """`n` as a bound or step of `range` / `tl.range`. Compiled: `n` itself. Interpreted: a Python int, because
    Triton 3.6's interpreter takes a scalar's index with int() of its shape-(1,) array, which numpy >= 2.4 refuses
    ("only 0-dimensional arrays can be converted to Python scalars"); Triton 3.9 squeezes it first. Call it inside
    the `range(...)`: the interpreter turns the value of every assignment back into a tensor."""
    if _INTERPRET:
        return n.handle.data.item()
    return n


# --------------------------------------------------------------------------------------------------------------------
# Launching: the device, autotuning that survives a failing config, and CUDA-graph capture
# --------------------------------------------------------------------------------------------------------------------
_NO_GUARD = contextlib.nullcontext()

# Batch invariance. The autotuners pick a tile per token-count bucket (the GEMMs) and per sequence-length bucket
# (attention), and a different tile groups a row's reduction differently: the GEMM's K loop in other chunks, the
# online softmax over other key blocks. So one text's output could move in its last bits with what else is in its
# batch. Inside `batch_invariant()` (this thread only) each launcher takes one fixed tile per kernel variant, dtype
# and head dim instead, whatever the batch: every row then goes through the same arithmetic in the same order, and
# its bits depend on it alone (each sequence's attention reads its own keys only; the row kernels are per row).
_INVARIANT = threading.local()


@contextlib.contextmanager
def batch_invariant(enabled: bool = True):
    """Launches in this thread take a fixed tile per kernel variant (see above) while the block runs."""
    saved = getattr(_INVARIANT, "on", False)
    _INVARIANT.on = enabled
    try:
        yield
    finally:
        _INVARIANT.on = saved


def invariant() -> bool:
    """Whether launches in this thread are inside `batch_invariant()`."""
    return getattr(_INVARIANT, "on", False)


def device_guard(t: torch.Tensor):
    """Triton launches on torch.cuda.current_device() (and tunes, and allocates scratch there): make that `t`'s
    device for the launch, so a model on cuda:1 runs there without torch.cuda.set_device(1). Nothing on CPU."""
    return torch.cuda.device(t.device) if t.device.type == "cuda" else _NO_GUARD


def capturing(t: torch.Tensor) -> bool:
    """Whether `t` is a CUDA tensor and the current stream is capturing a graph (a CPU-only torch cannot answer)."""
    return t.device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def autotune_key(tuner, args, kwargs) -> tuple:
    """The key Triton's Autotuner.run files this launch under (the same code in 3.6 and 3.9): the values of its key
    arguments, then the dtype of every argument that has one."""
    named = {**dict(zip(tuner.arg_names, args)), **kwargs}
    named = {name: value for name, value in named.items() if name in tuner.arg_names}
    key = [named[name] for name in tuner.keys if name in named]
    key += [str(value.dtype) for value in named.values() if hasattr(value, "dtype")]
    return tuple(key)


def capture_config(tuner, args, kwargs, fixed: "triton.Config") -> "triton.Config":
    """The config a launch inside a CUDA-graph capture takes: the autotuner's choice for this key, else `fixed`
    (tuning would benchmark, and a benchmark synchronises, which a capture forbids)."""
    return tuner.cache.get(autotune_key(tuner, args, kwargs), fixed)


# Inside a capture nothing may be compiled, tuned or loaded. Triton loads a compiled kernel into the CUDA context
# (cuModuleLoadData) at the first launch of its key, and that call fails inside a capture ("operation not permitted
# when stream is capturing") and invalidates the capture. So a launcher that sees a capture first asks `loaded`
# whether the exact binary it is about to launch is in the JIT's kernel cache with its module loaded, and refuses
# otherwise (`NotWarmedUp`). Outside a capture none of this runs: the only cost on the eager path is `capturing`.
class NotWarmedUp(RuntimeError):
    """A CUDA-graph capture reached a Triton kernel whose binary for this launch is not loaded yet."""


WARM_UP = ("run the same call once outside the capture first (for a model: one eager forward with the same "
           "batch shape and dtype), so that Triton compiles, tunes and loads it there")


def _run_kwargs(fn, kwargs: dict) -> dict:
    """The keyword arguments JITFunction.run hands its binder: the launch's, then the options run() adds (Triton 3.6:
    debug and instrumentation_mode; 3.9 also fpsan_homomorphic_casts). tests/kernels/test_launch.py checks that
    `loaded` finds the key run() files a kernel under, on the installed Triton."""
    from triton import knobs

    kwargs = dict(kwargs)
    kwargs["debug"] = kwargs.get("debug", fn.debug) or knobs.runtime.debug
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    if hasattr(knobs.compilation, "fpsan_homomorphic_casts"):
        kwargs["fpsan_homomorphic_casts"] = knobs.compilation.fpsan_homomorphic_casts
    return kwargs


def loaded(fn, args, kwargs: dict) -> bool:
    """Whether `fn[grid](*args, **kwargs)` would launch a binary that is compiled and loaded on the current CUDA
    device; it compiles and loads nothing itself. True for Triton's interpreter (nothing to load). The key is the
    one JITFunction.run computes (the same code in 3.6 and 3.9): the binder's specialisation and options."""
    caches = getattr(fn, "device_caches", None)
    if caches is None:
        return True
    from triton import knobs
    from triton.runtime.jit import compute_cache_key

    entry = caches.get(torch.cuda.current_device())  # .get: a defaultdict would build a binder for the lookup
    if entry is None:
        return False
    kernel_cache, key_cache, _, _, binder = entry
    _, specialization, options = binder(*args, **_run_kwargs(fn, kwargs))
    stages_hook = getattr(knobs.runtime, "add_stages_inspection_hook", None)  # Triton 3.9
    if stages_hook is not None:
        specialization.append(f'("custom_pipeline", {stages_hook()[1]})')
    kernel = kernel_cache.get(compute_cache_key(key_cache, specialization, options))
    return kernel is not None and getattr(kernel, "module", None) is not None


def require_loaded(fn, args, kwargs: dict, op: str) -> None:
    """Inside a capture: raise NotWarmedUp, saying how to warm up, unless `loaded(fn, args, kwargs)`."""
    if not loaded(fn, args, kwargs):
        raise NotWarmedUp(f"{op}: a CUDA graph is being captured, and the Triton kernel {fn.fn.__name__} has not "
                          f"run yet for this launch's shapes, dtypes and options (Triton would compile it, or load "
                          f"it into the CUDA context, which a capture forbids); {WARM_UP}")


# The CUDA errors after which the context is lost: the driver documents each as "the process must be terminated and
# relaunched" (or, for a device-side assert, "the context cannot be used anymore"), so every later call on the device
# fails with the same error. Codes are cudaError_t's, equal to the driver's CUresult for these nine; the messages are
# what cudaGetErrorString and cuGetErrorString say for them: torch raises "CUDA error: <message>" (torch >= 2.8 as
# torch.AcceleratorError, carrying `error_code`), Triton's launcher and module loader "Triton Error [CUDA]: <message>"
# as a RuntimeError. Not sticky, though raised the same ways: "invalid argument", "out of memory", "operation not
# permitted when stream is capturing" (the call fails, the context lives on).
STICKY_CUDA_ERRORS = {
    700: "an illegal memory access was encountered",
    702: "the launch timed out and was terminated",
    710: "device-side assert triggered",
    714: "hardware stack error",
    715: "an illegal instruction was encountered",
    716: "misaligned address",
    717: "operation not supported on global/shared address space",
    718: "invalid program counter",
    719: "unspecified launch failure",
}
_ACCELERATOR_ERROR = getattr(torch, "AcceleratorError", None)  # torch >= 2.8


def sticky_cuda_error(error: BaseException) -> bool:
    """Whether `error`, or an exception it was raised from (its cause or context: a wrapper such as the autotuner's
    "every config failed"), is a CUDA error that leaves the context unusable (STICKY_CUDA_ERRORS): an
    AcceleratorError with one of those codes, or any exception whose message holds one of those messages."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        code = getattr(error, "error_code", None) if _ACCELERATOR_ERROR and isinstance(error, _ACCELERATOR_ERROR) \
            else None
        message = str(error).lower()
        if code in STICKY_CUDA_ERRORS or any(text in message for text in STICKY_CUDA_ERRORS.values()):
            return True
        error = error.__cause__ or error.__context__
    return False


class Benchmark:
    """`do_bench` for triton.autotune that times a config raising anything as inf, so the autotuner skips it (its
    own handler skips only OutOfResources, CompileTimeAssertionFailure and PTXASError; any other error ended the
    whole call). When every config of a tuning round has failed it raises RuntimeError naming the kernel, the last
    error attached; the autotuner then records no choice for that key. A round is what `prune` kept.

    A sticky CUDA error (`sticky_cuda_error`: an illegal address, an illegal instruction, ...) is raised as it is, at
    once: the context is lost, so every later config would fail too, and "every config failed" would blame the
    configs for it."""

    def __init__(self, kernel: str, bench=None):
        self.kernel = kernel
        self._bench = bench  # None: Triton's default benchmarker (do_bench), looked up when first needed
        self.round, self.failed = 0, 0

    def prune(self, early_config_prune):
        """Wraps the autotuner's early_config_prune: the configs it keeps start a new round."""
        def prune(configs, named_args, **kwargs):
            kept = early_config_prune(configs, named_args, **kwargs)
            self.round, self.failed = len(kept), 0
            return kept
        return prune

    def __call__(self, kernel_call, quantiles=None, **kwargs):
        if self._bench is None:
            from triton.runtime import driver

            self._bench = driver.active.get_benchmarker()
        try:
            return self._bench(kernel_call, quantiles=quantiles, **kwargs)
        except Exception as exc:  # noqa: BLE001 - any failure of one config only disqualifies that config
            if sticky_cuda_error(exc):
                raise
            self.failed += 1
            if self.failed >= self.round:
                raise RuntimeError(f"{self.kernel}: every autotune config failed ({self.failed} of {self.round}); "
                                   f"the last: {type(exc).__name__}: {exc}") from exc
            return [float("inf")] * len(quantiles) if quantiles else float("inf")


def autotune(fn, configs, key, early_config_prune, bench=None):
    """triton.autotune with a `Benchmark` and Triton's on-disk cache of the winners (`cache_results`: a new
    process does not re-benchmark; accepted by Triton 3.6 and 3.9)."""
    benchmark = Benchmark(fn.__name__, bench)
    return triton.autotune(configs=configs, key=key, cache_results=True, do_bench=benchmark,
                           prune_configs_by={"early_config_prune": benchmark.prune(early_config_prune)})(fn)
