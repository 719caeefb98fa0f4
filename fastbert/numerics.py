"""The accuracy rule, written once: the tests, the benchmarks' correctness gates and the main job all call it.

fp32: a fixed bar (1e-5 against HF, the twin or an fp64 reference). fp16/bf16: rounding makes any fixed bar either
too loose or unfair, so a result may be off a high-precision reference by at most twice what the baseline itself is
off in that dtype (flash-attention's rule; the baseline is HF's model or the PyTorch twin run in the same dtype).
"""
from __future__ import annotations

import torch

FP32_TOL = 1e-5  # the project's fp32 bar
HALF_FLOOR = 1e-6  # so that an exact baseline does not demand an exact result


def error_bound(dtype: torch.dtype, baseline_error: float, fp32_tol: float = FP32_TOL) -> float:
    """The largest error against the reference that a result in `dtype` may have, given the baseline's own error
    in that dtype (unused in fp32/fp64, where the bar is `fp32_tol`)."""
    if dtype in (torch.float32, torch.float64):
        return fp32_tol
    return 2 * baseline_error + HALF_FLOOR


def max_error(out: torch.Tensor, reference: torch.Tensor, where: torch.Tensor | None = None) -> float:
    """max |out - reference| in fp64 (over `where` only, e.g. the real tokens); NaN anywhere gives NaN, which no
    bound passes."""
    diff = (out.double() - reference.double()).abs()
    if where is not None:
        diff = diff[where]
    if diff.numel() == 0:
        return 0.0
    return float("nan") if torch.isnan(diff).any() else float(diff.max())


def within(dtype: torch.dtype, error: float, baseline_error: float = 0.0, fp32_tol: float = FP32_TOL) -> bool:
    """Does `error` meet the rule? False for NaN."""
    return error <= error_bound(dtype, baseline_error, fp32_tol)
