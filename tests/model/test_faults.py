"""Faults that stay recorded: a sticky CUDA error (the device's context is lost) stops the autotuner at once, is
recorded by "auto"'s safety net before it is raised, and a process that dies inside a kernel's first launch leaves a
pending entry that the next process reads as that kernel's failure. On CPU: the faults are exceptions built as torch
and Triton raise them (torch.AcceleratorError "CUDA error: ...", Triton's "Triton Error [CUDA]: ..."), the device and
its table as in test_auto.py.
"""
import json
import os
import subprocess
import sys

import pytest
import torch
import triton
import triton.language as tl
from helpers import AUTO_IDS as IDS
from helpers import AUTO_MASK as MASK
from helpers import Breaks, FakeTimer, failure_warnings, kernel_module, random_hf_bert, twin_for

import fastbert
from fastbert import dispatch, fallback, measure, units
from fastbert.kernels import utils as kernel_utils

ILLEGAL_ADDRESS = "CUDA error: an illegal memory access was encountered"


def _measure_on_cpu(monkeypatch, cache_dir):
    """CPU counts as a measured device (Triton runs through the interpreter), with the table under `cache_dir`; no
    in-memory state of an earlier "process"."""
    monkeypatch.setattr(dispatch, "MEASURED_DEVICE_TYPES", ("cpu",))
    monkeypatch.setattr(kernel_utils, "INTERPRET", True)
    monkeypatch.setattr(measure, "_CHOICES", {})
    monkeypatch.setattr(fallback, "_FAILED", {})
    monkeypatch.setenv("FASTBERT_CACHE_DIR", str(cache_dir))


@pytest.fixture
def measured_here(monkeypatch, tmp_path):
    _measure_on_cpu(monkeypatch, tmp_path)
    return tmp_path


@pytest.fixture(scope="module")
def hf():
    return random_hf_bert(hidden=32, heads=2, layers=1, intermediate=40, vocab=50, max_pos=16)


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


# ---- the safety net records a sticky fault, then raises it ----------------------------------------------------------
class DeadContext:
    """After the kernel's fault every call on the device fails: the twin too, with torch's error."""

    def __init__(self):
        self.lost = False

    def kernel(self, *args, **kwargs):
        self.lost = True
        raise illegal_address()

    def twin(self, original):
        def run(*args, **kwargs):
            if self.lost:
                raise torch.AcceleratorError(ILLEGAL_ADDRESS)
            return original(*args, **kwargs)
        return run


def test_the_net_records_a_sticky_fault_before_raising_it(measured_here):
    x = torch.randn(4, 8)
    dead = DeadContext()
    key = "bias_gelu|float32|T16|H8|I12|gelu"
    with pytest.warns(RuntimeWarning, match="cannot go on using the device") as record, \
            pytest.raises(torch.AcceleratorError, match="illegal memory access") as info:
        fallback.with_net("bias_gelu", x, x.device, dead.kernel, dead.twin(lambda: None), table_key=key)
    assert info.value.error_code == 700  # the kernel's error, not the twin's
    assert len(failure_warnings(record)) == 1
    assert "illegal memory access" in fallback._FAILED[("bias_gelu", torch.float32, 16)]
    table = json.loads(open(measure.choices_for(torch.device("cpu")).path).read())
    assert table[key]["choice"] == "torch" and "AcceleratorError" in table[key]["error"]
    assert "CUDA_LAUNCH_BLOCKING=1" in table[key]["error"]  # the report may name a later launch than the faulty one


def test_the_net_still_records_nothing_when_a_plain_error_meets_a_failing_twin(measured_here):
    x = torch.randn(4, 8)

    def twin():
        raise ValueError("the twin rejects this input too")

    with pytest.raises(RuntimeError, match="invalid argument"):
        fallback.with_net("bias_gelu", x, x.device, Breaks(lambda: RuntimeError("CUDA driver: invalid argument")),
                          twin, table_key="bias_gelu|float32|T16|H8|I12|gelu")
    assert fallback._FAILED == {} and not os.path.exists(measure.choices_for(torch.device("cpu")).path)


def test_a_sticky_fault_in_a_forward_puts_the_next_process_on_the_twin(hf, measured_here, monkeypatch):
    """bias_gelu's kernel is measured fine, then faults in the forward and every later call fails (the twins too):
    the forward raises the kernel's error, and the table says so. A new process runs bias_gelu on its twin, said
    once, without launching the kernel."""
    dead = DeadContext()
    measured = []
    real_launch = kernel_module("bias_gelu").launch

    def launch(*args, **kwargs):
        if not measured:  # the measurement's launch works
            measured.append(1)
            return real_launch(*args, **kwargs)
        return dead.kernel(*args, **kwargs)

    monkeypatch.setattr(kernel_module("bias_gelu"), "launch", launch)
    for unit in units.UNITS.values():
        monkeypatch.setattr(unit, "twin", dead.twin(unit.twin))
    measure.choices_for(torch.device("cpu"), FakeTimer([1.0, 2.0] * 4))  # the kernels measured faster
    fb = fastbert.BertModel.from_hf(hf, kernels="auto").eval()
    with pytest.warns(RuntimeWarning, match="cannot go on using the device"), \
            pytest.raises(torch.AcceleratorError, match="illegal memory access"), torch.no_grad():
        fb(IDS, attention_mask=MASK)
    table = json.loads(open(measure.choices_for(torch.device("cpu")).path).read())
    (key,) = [k for k in table if k.startswith("bias_gelu|")]
    assert table[key]["choice"] == "torch" and "illegal memory access" in table[key]["error"]
    assert all(entry["choice"] == "triton" for k, entry in table.items() if k != key)

    # a new process (a live context; the table read from disk)
    monkeypatch.undo()
    _measure_on_cpu(monkeypatch, measured_here)
    again = Breaks(illegal_address)
    monkeypatch.setattr(kernel_module("bias_gelu"), "launch", again)
    timer = measure.choices_for(torch.device("cpu"), FakeTimer([]))
    fb = fastbert.BertModel.from_hf(hf, kernels="auto").eval()
    with pytest.warns(RuntimeWarning, match="in an earlier process") as record, torch.no_grad():
        got = fb(IDS, attention_mask=MASK).last_hidden_state
    assert len(failure_warnings(record)) == 1 and again.calls == 0 and timer.timer.calls == 0
    assert torch.equal(got, twin_for(hf, "bias_gelu"))


def test_a_sticky_fault_while_measured_is_recorded_and_raised(measured_here, monkeypatch):
    """The kernel's timing meets an illegal address: recorded against the kernel, then raised (running the twin in a
    lost context would only fail later, elsewhere)."""
    monkeypatch.setattr(kernel_module("bias_gelu"), "launch", Breaks(illegal_address))
    measure.choices_for(torch.device("cpu"), FakeTimer([1.0, 2.0]))
    shapes = measure.Shapes(16, 32, 40, 2, 16, 16, "gelu")
    situation = dispatch.Situation(("auto",) * 4, torch.device("cpu"), torch.float32, 16, False, 0.0, 0.0, None,
                                   shapes)
    with pytest.warns(RuntimeWarning, match="cannot go on using the device"), \
            pytest.raises(torch.AcceleratorError, match="illegal memory access"):
        dispatch._measured("bias_gelu", situation)
    table = json.loads(open(measure.choices_for(torch.device("cpu")).path).read())
    key = measure.op_key("bias_gelu", torch.float32, shapes)
    assert table[key]["choice"] == "torch" and "illegal memory access" in table[key]["error"]
    assert ("bias_gelu", torch.float32, 16) in fallback._FAILED


# ---- a process that dies inside a kernel's first launch --------------------------------------------------------------
def test_the_pending_entry_is_on_disk_during_the_kernel_launch_only(tmp_path):
    path = str(tmp_path / "t.json")
    seen = {}

    def on_disk():
        return json.loads(open(path).read())

    def kernel():
        seen["kernel"] = on_disk()

    def twin():
        seen["twin"] = on_disk()

    choices = measure.Choices(torch.device("cpu"), FakeTimer([1.0, 2.0]), path)
    assert choices.choose("k", kernel, twin) is True
    assert list(seen["kernel"]["k"]) == ["pending"] and f"process {os.getpid()}" in seen["kernel"]["k"]["pending"]
    assert seen["twin"]["k"] == {"triton_ms": 1.0}  # the kernel's launch is over: a death now is not its fault
    assert on_disk()["k"] == {"triton_ms": 1.0, "torch_ms": 2.0, "choice": "triton"}


def test_a_process_that_dies_in_the_kernel_launch_puts_the_next_on_the_twin(hf, measured_here, monkeypatch):
    """A child process measures bias_gelu and dies inside the kernel's launch (os._exit: nothing after it runs,
    as after a fault that kills the process). This process reads the pending entry as the kernel's failure: that op
    runs its twin, said once, and neither kernel nor timer is called for it."""
    key = measure.op_key("bias_gelu", torch.float32, measure.Shapes(16, 32, 40, 2, 16, 16, "gelu"))
    path = measure.Choices.default_path(torch.device("cpu"))
    child = ("import os, sys, torch\nfrom fastbert import measure\n"
             "choices = measure.Choices(torch.device('cpu'), lambda fn: fn(), sys.argv[2])\n"
             "choices.choose(sys.argv[1], lambda: os._exit(3), lambda: None)\n")
    done = subprocess.run([sys.executable, "-c", child, key, path], capture_output=True, text=True, timeout=300)
    assert done.returncode == 3, done.stderr
    assert list(json.loads(open(path).read())[key]) == ["pending"]

    timer = FakeTimer([1.0, 2.0] * 3)  # qkv, attention, residual_layernorm: measured; bias_gelu: not
    measure.choices_for(torch.device("cpu"), timer)
    kernel = Breaks(illegal_address)
    monkeypatch.setattr(kernel_module("bias_gelu"), "launch", kernel)
    fb = fastbert.BertModel.from_hf(hf, kernels="auto").eval()
    with pytest.warns(RuntimeWarning, match="ended during the kernel's first launch") as record, torch.no_grad():
        assert fb.resolved_kernels(tokens=8, max_seqlen=5)["bias_gelu"] == "torch"
        got = fb(IDS, attention_mask=MASK).last_hidden_state
        fb(IDS, attention_mask=MASK)
    assert len(failure_warnings(record)) == 1 and "in an earlier process" in str(failure_warnings(record)[0].message)
    assert kernel.calls == 0 and timer.calls == 6
    assert torch.equal(got, twin_for(hf, "bias_gelu"))
    entry = json.loads(open(path).read())[key]
    assert entry["choice"] == "torch" and "ended during the kernel's first launch" in entry["error"]
