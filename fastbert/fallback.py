""""auto"'s safety net: a kernel that breaks never breaks the forward.

A kernel can fail on a GPU nobody here ran (an MLIR pass error, shared memory, an API change between Triton
versions). Under "auto" that (op, dtype, token bucket) runs the twin for the rest of the process, said once, and on a
measured GPU the "auto" table on disk records it, so later processes with the same versions do not retry.

A sticky CUDA error (an illegal address or instruction, ...: kernels.utils.sticky_cuda_error) loses the device's
context: the twin then fails too and the process cannot go on there. It is recorded all the same, here and in the
table, before it is raised, so that the next process runs the twin for that op and bucket instead of faulting again.
CUDA reports such a fault at the next call that reaches the device, which may be a later launch than the faulty one
(CUDA_LAUNCH_BLOCKING=1 makes the report exact); the record says so.
"""
from __future__ import annotations

import warnings
from typing import Callable

import torch

from .layout import token_bucket

_FAILED: dict = {}  # (op, dtype, token bucket) -> "ErrorType: message"


def failure_key(op: str, x: torch.Tensor) -> tuple:
    return op, x.dtype, token_bucket(x.shape[0])


def failed(op: str, dtype: torch.dtype, tokens: int) -> bool:
    """Has `op`'s kernel failed for this dtype and token count (so "auto" runs its twin there)?"""
    return (op, dtype, token_bucket(tokens)) in _FAILED


def sticky(error: BaseException) -> bool:
    """Whether `error` lost the CUDA context (kernels.utils.sticky_cuda_error; False where the kernels cannot be
    imported, as then no kernel ran)."""
    try:
        from .kernels.utils import sticky_cuda_error
    except Exception:  # noqa: BLE001 - no Triton: no kernel launched, no CUDA fault of one
        return False
    return sticky_cuda_error(error)


def with_net(op: str, x: torch.Tensor, device, kernel: Callable, twin: Callable, table_key: str | None = None):
    """kernel() under "auto": twin() instead once this (op, bucket) has failed. When the kernel raises, the twin
    answers this call; if the twin raises too, the input is at fault, not the kernel: its error is raised and nothing
    is recorded. Unless the kernel's error was a sticky CUDA error (which the twin then meets too): that is recorded,
    then raised."""
    if _FAILED and failure_key(op, x) in _FAILED:
        return twin()
    try:
        return kernel()
    except Exception as error:
        return _recover(op, x, device, error, twin, table_key)


def _recover(op, x, device, error, twin, table_key):
    try:
        out = twin()
    except Exception:
        if sticky(error):  # the context is lost: record the kernel's fault for the next process, then stop here
            kernel_failed(failure_key(op, x), error, device, table_key)
        raise error from None
    kernel_failed(failure_key(op, x), error, device, table_key)
    return out


def net_callable(op, kernel, twin, device, table_key):
    """An op callable with the twin's signature that runs `kernel` under the safety net. The hot path (no failure
    yet) is one truthiness test and a call; closures are built only when an error is met."""
    def run(*args, **kwargs):
        x = args[0]
        if _FAILED and failure_key(op, x) in _FAILED:
            return twin(*args, **kwargs)
        try:
            return kernel(*args, **kwargs)
        except Exception as error:
            return _recover(op, x, device, error, lambda: twin(*args, **kwargs), table_key)
    return run


def kernel_failed(key: tuple, error: BaseException | str, device, table_key: str | None = None) -> None:
    """Record that a kernel failed for `key` (and in the "auto" table under `table_key`), and say so once."""
    op, dtype, bucket = key
    lost = not isinstance(error, str) and sticky(error)
    why = error if isinstance(error, str) else f"{type(error).__name__}: {str(error).strip()}"
    why = why if len(why) <= 2000 else why[:2000] + " ..."
    if lost:
        why += (" [a sticky CUDA error: the context is lost; CUDA may report it at a launch after the faulty one, "
                "CUDA_LAUNCH_BLOCKING=1 makes the report exact]")
    _FAILED[key] = why
    recorded = ""
    if table_key is not None:
        from . import measure  # imported only when a failure is recorded on a measured device
        choices = measure.choices_for(device)
        if choices.failure(table_key) is None:
            choices.record_failure(table_key, why)
        recorded = f"recorded in {choices.path}, so later processes with these versions use the twin"
    if lost:
        then = ("This process cannot go on using the device, so the error is raised" +
                (f"; {recorded} there" if recorded else "") + ".")
    else:
        then = ("Under 'auto' this op runs its PyTorch twin there for the rest of this process" +
                (f"; {recorded} too" if recorded else "") + ". Set the op to 'triton' to have the error raised.")
    warnings.warn(f"fastbert: the Triton kernel of op {op!r} failed ({str(dtype).replace('torch.', '')}, "
                  f"{bucket}-token bucket): {why}. {then}", RuntimeWarning, stacklevel=2)
