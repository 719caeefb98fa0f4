"""Faults that lose the device's context (sticky CUDA errors) stop the autotuner at once. On CPU: the faults are
exceptions built as torch and Triton raise them (torch.AcceleratorError "CUDA error: ...", Triton's "Triton Error
[CUDA]: ...").
"""
import pytest
import torch
import triton
import triton.language as tl

from fastbert.kernels import utils as kernel_utils

ILLEGAL_ADDRESS = "CUDA error: an illegal memory access was encountered"


def illegal_address():
    """What torch raises once a kernel has touched memory it does not own (code 700, cudaErrorIllegalAddress)."""
    error = torch.AcceleratorError(ILLEGAL_ADDRESS + "\nCUDA kernel errors might be asynchronously reported at some "
                                   "other API call, so the stacktrace below might be incorrect.")
    error.error_code = 700
    return error


# ---- which errors lose the context ----------------------------------------------------------------------------------
def _chained(outer, inner):
    try:
        try:
            raise inner
        except Exception as e:
            raise outer from e
    except Exception as e:
        return e


def test_the_sticky_classifier_names_the_errors_that_lose_the_context():
    coded = torch.AcceleratorError("CUDA error: (message from an unknown driver)")
    coded.error_code = 715  # cudaErrorIllegalInstruction
    sticky = [illegal_address(), coded,
              RuntimeError("Triton Error [CUDA]: an illegal instruction was encountered"),
              RuntimeError("Triton Error [CUDA]: unspecified launch failure"),
              RuntimeError("CUDA error: misaligned address"),
              torch.AcceleratorError("CUDA error: device-side assert triggered"),
              # a wrapper, as the autotuner's "every config failed": the cause decides
              _chained(RuntimeError("gemm_kernel: every autotune config failed (1 of 1)"), illegal_address())]
    from triton.runtime.errors import OutOfResources
    capture = torch.AcceleratorError("CUDA error: operation not permitted when stream is capturing")
    capture.error_code = 900
    not_sticky = [capture, RuntimeError("CUDA driver: invalid argument at launch"),
                  torch.AcceleratorError("CUDA error: invalid configuration argument"),
                  torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
                  OutOfResources(262144, 232448, "shared memory"), ValueError("BLOCK_K must be a power of two")]
    assert [kernel_utils.sticky_cuda_error(e) for e in sticky] == [True] * len(sticky)
    assert [kernel_utils.sticky_cuda_error(e) for e in not_sticky] == [False] * len(not_sticky)
    assert sorted(kernel_utils.STICKY_CUDA_ERRORS) == [700, 702, 710, 714, 715, 716, 717, 718, 719]


# ---- the autotuner stops at the first sticky error ------------------------------------------------------------------
def test_benchmark_raises_a_sticky_error_at_once():
    """utils.Benchmark: a config that loses the context is not timed as inf (that would go on launching the round's
    other configs into the dead context and end in "every autotune config failed"): its error is raised as it is."""
    calls = []

    def bench(fn, quantiles):
        calls.append(fn)
        fn()
        return [1.0, 0.5, 2.0]

    def faults():
        raise illegal_address()

    def broken():
        raise ValueError("boom")

    benchmark = kernel_utils.Benchmark("toy_kernel", bench)
    benchmark.prune(lambda configs, named_args, **kwargs: configs)(list("abc"), {})  # a round of 3
    assert benchmark(broken, quantiles=(0.5, 0.2, 0.8)) == [float("inf")] * 3  # an ordinary failure: skipped
    with pytest.raises(torch.AcceleratorError, match="illegal memory access") as info:
        benchmark(faults, quantiles=(0.5, 0.2, 0.8))
    assert info.value.error_code == 700 and benchmark.failed == 1  # not counted as a failed config
    def launch_fails():  # Triton's launcher, once the context is lost
        raise RuntimeError("Triton Error [CUDA]: unspecified launch failure")

    with pytest.raises(RuntimeError, match=r"^Triton Error \[CUDA\]: unspecified launch failure$"):
        benchmark(launch_fails, quantiles=(0.5, 0.2, 0.8))
    assert benchmark.failed == 1 and len(calls) == 3


@triton.jit
def _copy_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


@pytest.mark.skipif(not kernel_utils.INTERPRET, reason="runs Triton's autotuner in the interpreter")
def test_the_autotuner_launches_no_config_after_a_sticky_error(monkeypatch, tmp_path):
    """A real triton.autotune with fastbert's Benchmark over three configs: the first config's benchmark meets an
    illegal address; the autotuner stops there (one benchmark call) and the caller gets that error, not "every
    autotune config failed"."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # no winner from an earlier run on disk
    calls = []

    def bench(fn, quantiles):
        calls.append(1)
        raise illegal_address()

    configs = [triton.Config({"BLOCK": b}) for b in (16, 32, 64)]
    tuner = kernel_utils.autotune(_copy_kernel, configs, ["n"], lambda configs, named_args, **kwargs: configs,
                                  bench=bench)
    x = torch.arange(40, dtype=torch.float32)
    y = torch.zeros_like(x)
    with pytest.raises(torch.AcceleratorError, match="illegal memory access"):
        tuner[lambda META: (triton.cdiv(40, META["BLOCK"]),)](x, y, 40)
    assert len(calls) == 1 and not tuner.cache
