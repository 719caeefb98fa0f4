"""Each Triton op against its torch twin (and each fused GEMM against a plain cuBLAS F.linear) at BERT-base shapes, in
the hardware's units, next to the device's ceilings.

Shapes: T = 4096 tokens (32 x 128 = 8 x 512), H = 768, 12 heads of 64, I = 3072, attention at S = 128 and 512;
fp16 and bf16 on CUDA. With --bench-tiny, or without CUDA, tiny shapes instead; on CPU in fp32, the Triton kernels
through the interpreter: there the correctness gates run (what CI checks) and nothing is timed. Units: TFLOP/s for
the GEMMs and attention (share of the measured bf16 GEMM ceiling), GB/s for the row-wise part of residual_layernorm
(share of the measured copy ceiling); both in extra_info, the flops and the minimal bytes (each input read once, the
output written once) too.

How an op is timed, and why not one call per round: a single call is 5-100 us of GPU work while the Python
launcher (validation + launch) costs 10-40 us of CPU, so one call per round would time the CPU, and repeated calls
on one input would read it from the 50 MB L2. So each round replays a CUDA graph of `calls_per_round` calls that
cycle through enough independent input sets to overflow L2 twice, then synchronises; the group table shows the
time of a round, extra_info the time per call (median round / calls_per_round) and the rates derived from it.
If a launcher cannot be captured, the round makes the same calls eagerly (extra_info says graph=False).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from bench import harness
from bench.conftest import Selection, option
from fastbert.numerics import error_bound, max_error

OPS_DTYPES = ("fp16", "bf16")
BACKENDS = ("triton", "torch", "cublas")
# "cublas": a plain F.linear with the op's weight and bias, no epilogue: the GEMM alone as cuBLAS(Lt) runs it, so a
# fused Triton GEMM reads as "x cuBLAS" (time of the plain GEMM / time of the fused op; >= 1 means the fused op,
# epilogue included, is as fast as cuBLAS without one). CUDA only: F.linear on a CPU is not cuBLAS.
GEMM_OPS = ("qkv_projection", "bias_gelu", "residual_layernorm")


@dataclass(frozen=True)
class OpCase:
    op: str  # a fastbert op, or "residual_layernorm.rows": its bias + residual + LayerNorm row kernel alone
    shape: str
    dims: dict

    @property
    def id(self) -> str:
        return f"{self.op}-{self.shape.replace(' ', '-')}"


def tiny_ops(config) -> bool:
    """The tiny shapes: asked for, or no CUDA (the interpreter runs BERT-base shapes in hours, not seconds)."""
    return bool(option(config, "--bench-tiny")) or not torch.cuda.is_available()


def op_cases(tiny: bool) -> list[OpCase]:
    if tiny:
        T, H, nh, I = 64, 64, 4, 128
        return [OpCase("qkv_projection", f"T{T} H{H}", dict(T=T, H=H, nh=nh)),
                OpCase("attention", f"B4 S16 nh{nh} hd16", dict(B=4, S=16, nh=nh, hd=16)),
                OpCase("bias_gelu", f"T{T} H{H} I{I}", dict(T=T, H=H, I=I)),
                OpCase("residual_layernorm", f"T{T} K{I} H{H}", dict(T=T, K=I, H=H)),
                OpCase("residual_layernorm.rows", f"T{T} H{H}", dict(T=T, H=H))]
    T, H, nh, I = 4096, 768, 12, 3072
    return [OpCase("qkv_projection", f"T{T} H{H}", dict(T=T, H=H, nh=nh)),
            OpCase("attention", f"B32 S128 nh{nh} hd64", dict(B=32, S=128, nh=nh, hd=64)),
            OpCase("attention", f"B8 S512 nh{nh} hd64", dict(B=8, S=512, nh=nh, hd=64)),
            OpCase("bias_gelu", f"T{T} H{H} I{I}", dict(T=T, H=H, I=I)),
            OpCase("residual_layernorm", f"T{T} K{I} H{H}", dict(T=T, K=I, H=H)),  # after the FFN
            OpCase("residual_layernorm", f"T{T} K{H} H{H}", dict(T=T, K=H, H=H)),  # after attention
            OpCase("residual_layernorm.rows", f"T{T} H{H}", dict(T=T, H=H))]


def pytest_generate_tests(metafunc):
    if "op_case" in metafunc.fixturenames:
        config = metafunc.config
        tiny = tiny_ops(config)
        selection = Selection(config)
        dtypes = (("fp16" if torch.cuda.is_available() else "fp32"),) if tiny else OPS_DTYPES
        params = [pytest.param(c, d, b, id=f"{c.id}-{d}-{b}") for c in op_cases(tiny) for d in dtypes
                  for b in BACKENDS if selection.keep_op(c.op.split(".")[0], d, b)
                  and (b != "cublas" or c.op in GEMM_OPS)]
        metafunc.parametrize(("op_case", "dtype_name", "backend"), params)


# --------------------------------------------------------------------------------------------------------------------
# Each op: inputs, the call for a backend, flops and minimal bytes
# --------------------------------------------------------------------------------------------------------------------
def _rows_triton(h, bias, residual, ln_weight, ln_bias, eps):
    """The row kernel of kernels/residual_layernorm.py alone, on a precomputed GEMM output h (the op's launcher
    always runs the GEMM first, and the row part's bandwidth is what matters here)."""
    from fastbert.kernels.residual_layernorm import bias_residual_layernorm
    return bias_residual_layernorm(h, bias, residual, ln_weight, ln_bias, eps)


def _rows_torch(h, bias, residual, ln_weight, ln_bias, eps):
    """The twin's row-wise part: (h + b) + residual, then LayerNorm (what F.linear's bias and the twin's add do)."""
    return F.layer_norm(h + bias + residual, (h.shape[-1],), ln_weight, ln_bias, eps)


class OpSpec:
    """Inputs for one set (seeded), the call, the work. Weights scaled like BERT's init (std 0.02)."""

    def __init__(self, case: OpCase, dtype: torch.dtype, device: str):
        self.case, self.dtype, self.device = case, dtype, device
        d = case.dims
        e = torch.tensor([], dtype=dtype).element_size()
        if case.op == "qkv_projection":
            self.flops, self.bytes, self.bound = 2 * d["T"] * d["H"] * 3 * d["H"], e * (
                d["T"] * d["H"] + 3 * d["H"] * d["H"] + 3 * d["H"] + 3 * d["T"] * d["H"]), "compute"
        elif case.op == "attention":
            T, H = d["B"] * d["S"], d["nh"] * d["hd"]
            self.flops = 4 * d["B"] * d["nh"] * d["S"] * d["S"] * d["hd"]  # q k^T and p v, no padding
            self.bytes, self.bound = e * (3 * T * H + T * H), "compute"
        elif case.op == "bias_gelu":
            self.flops, self.bytes, self.bound = 2 * d["T"] * d["H"] * d["I"], e * (
                d["T"] * d["H"] + d["I"] * d["H"] + d["I"] + d["T"] * d["I"]), "compute"
        elif case.op == "residual_layernorm":
            self.flops, self.bytes, self.bound = 2 * d["T"] * d["K"] * d["H"], e * (
                d["T"] * d["K"] + d["H"] * d["K"] + 2 * d["T"] * d["H"] + 3 * d["H"]), "compute"
        elif case.op == "residual_layernorm.rows":
            self.flops, self.bytes, self.bound = None, e * (3 * d["T"] * d["H"] + 3 * d["H"]), "memory"
        else:
            raise ValueError(f"unknown op {case.op!r}")

    def inputs(self, seed: int, dtype: torch.dtype | None = None) -> tuple:
        d, dtype = self.case.dims, dtype or self.dtype
        g = torch.Generator().manual_seed(seed)

        def randn(*shape, std=1.0, mean=0.0):
            return (torch.randn(*shape, generator=g, dtype=torch.float64) * std + mean).to(self.device, dtype)

        op = self.case.op
        if op == "qkv_projection":
            return randn(d["T"], d["H"]), randn(3 * d["H"], d["H"], std=0.02), randn(3 * d["H"], std=0.02), d["nh"]
        if op == "attention":
            from fastbert.ops import AttentionMask

            return (randn(d["B"] * d["S"], 3, d["nh"], d["hd"]), AttentionMask(d["B"], d["S"]), d["hd"] ** -0.5)
        if op == "bias_gelu":
            return randn(d["T"], d["H"]), randn(d["I"], d["H"], std=0.02), randn(d["I"], std=0.02)
        if op == "residual_layernorm":
            return (randn(d["T"], d["K"]), randn(d["H"], d["K"], std=0.02), randn(d["H"], std=0.02),
                    randn(d["T"], d["H"]), randn(d["H"], std=0.1, mean=1.0), randn(d["H"], std=0.1), 1e-12)
        return (randn(d["T"], d["H"]), randn(d["H"], std=0.02), randn(d["T"], d["H"]), randn(d["H"], std=0.1, mean=1.0),
                randn(d["H"], std=0.1), 1e-12)

    def call(self, backend: str, args: tuple) -> torch.Tensor:
        from fastbert import ops

        op = self.case.op
        if backend == "cublas":  # the op's GEMM alone: x/y [T, K], weight [N, K], bias [N]
            return F.linear(args[0], args[1], args[2])
        if op == "residual_layernorm.rows":
            return (_rows_triton if backend == "triton" else _rows_torch)(*args)
        if op == "attention":
            return ops.attention(*args, backend=backend)[0]
        return getattr(ops, op)(*args, backend=backend)

    def set_bytes(self) -> int:
        """Device bytes of one input set plus its output: what a call touches."""
        return self.bytes


def _finite(error: float) -> float:
    """NaN (max_error's answer for a NaN output) as inf, which the JSON report and the summary sort."""
    return error if math.isfinite(error) else math.inf


def _l2_bytes() -> int:
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return int(getattr(props, "L2_cache_size", 0) or 64 << 20)


def test_op(op_case, dtype_name, backend, benchmark, request, policy):
    cuda = torch.cuda.is_available()
    if backend == "cublas" and not cuda:
        pytest.skip("the cuBLAS baseline is CUDA only (F.linear on a CPU is not cuBLAS)")
    from fastbert import ops

    if backend == "triton" and ops.triton_import_error():
        pytest.fail(f"Triton backend unavailable: {ops.triton_import_error()}")
    ceilings = request.getfixturevalue("ceilings")  # measured once per session, only when an op runs
    device = "cuda" if cuda else "cpu"
    dtype = harness.DTYPES[dtype_name]
    spec = OpSpec(op_case, dtype, device)
    benchmark.group = f"op {op_case.op} {op_case.shape} {dtype_name}"

    # Check against an fp64 run of the twin, by fastbert.numerics' rule: fp32 within FP32_TOL, fp16/bf16 within
    # 2x the twin's own error in this dtype (+ a floor). The cuBLAS baseline is its own twin: it is held to a few
    # roundings of its largest output instead.
    args = spec.inputs(seed=0)
    twin = "cublas" if backend == "cublas" else "torch"
    reference = spec.call(twin, spec.inputs(seed=0, dtype=torch.float64))
    twin_error = max_error(spec.call(twin, args), reference)
    out, first_call_s = harness.first_call(benchmark, lambda: spec.call(backend, args), device)
    error = max_error(out, reference)
    bound = error_bound(dtype, twin_error)
    if backend == "cublas":
        bound = 4 * torch.finfo(dtype).eps * max(1.0, float(reference.abs().max()))
    benchmark.extra_info.update(kind="op", op=op_case.op, shape=op_case.shape, dtype=dtype_name, backend=backend,
                                device=device, flops=spec.flops, bytes=spec.bytes, bound=spec.bound,
                                ceilings=ceilings, max_abs_err=_finite(error), err_bound=bound,
                                twin_err=_finite(twin_error),
                                first_call_s=first_call_s, interpreter=device == "cpu" and backend == "triton")
    del out, reference
    assert error <= bound, (f"{op_case.op} {op_case.shape} {dtype_name} {backend}: max |out - fp64 twin| = "
                            f"{error:.3g} > bound {bound:.3g} (twin's own error {twin_error:.3g})")
    if benchmark.disabled or not cuda:  # CPU: the interpreter's speed is no measure of a kernel
        return

    # Enough independent input sets to overflow L2 twice, cycled; the same number of calls for both backends.
    n_sets = min(16, max(2, math.ceil(2 * _l2_bytes() / spec.set_bytes()))) if cuda else 1
    sets = [args] + [spec.inputs(seed=i) for i in range(1, n_sets)]
    calls = n_sets * math.ceil((32 if cuda else 2) / n_sets)
    for s in sets:  # warm every set (and every autotune key) before capture
        spec.call(backend, s)

    def eager_round():
        for i in range(calls):
            spec.call(backend, sets[i % n_sets])

    round_fn, graphed = eager_round, False
    if cuda:
        try:
            torch.cuda.synchronize()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                eager_round()  # graph capture wants one run on a side stream first (allocator warm-up)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                eager_round()
            round_fn, graphed = graph.replay, True
        except Exception as e:  # a launcher that syncs or allocates on the host cannot be captured
            benchmark.extra_info["graph_error"] = f"{type(e).__name__}: {e}"[:300]
    median = harness.run_timed(benchmark, round_fn, device, policy(device))
    per_call = median / calls
    info = dict(graph=graphed, input_sets=n_sets, calls_per_round=calls, per_call_s=per_call,
                GBps=spec.bytes / per_call / 1e9)
    if spec.flops:
        info["TFLOPs"] = spec.flops / per_call / 1e12
        info["share_of_gemm_ceiling"] = info["TFLOPs"] / ceilings["gemm_TFLOPs"]
    if spec.bound == "memory":
        info["share_of_copy_ceiling"] = info["GBps"] / ceilings["copy_GBps"]
    benchmark.extra_info.update(info)
