""""auto" that measures: on a GPU, each op runs whichever of its Triton kernel and its PyTorch twin is faster there.

A fused kernel is not faster than cuBLAS plus a few elementwise passes on every GPU and every shape (a small T leaves
SMs idle; a new architecture may favour cuBLAS's GEMMs). So on CUDA, "auto" times both once per (op, dtype, shapes,
token bucket) with the device's own clock and keeps the answer on disk per GPU name and library versions: fastbert is
then at worst equal to its twin, op by op, on any GPU, including ones nobody here measured. Explicit "triton" always
runs Triton; explicit "torch" always the twin.

    Choices.choose(key, kernel_fn, twin_fn) -> True when the kernel wins (ties go to the kernel)
    the table: ~/.cache/fastbert/auto/<gpu>-torch<v>-triton<v>-fastbert<v>.json  (FASTBERT_CACHE_DIR overrides)

The kernel's timing is its first launch for those shapes (compile, autotune, load, run). A CUDA fault there can take
the process down (an illegal address loses the context: nothing after it runs, the twin included), so the table on
disk says "pending" for the key before that launch; a process that finds an entry still pending reads it as the
kernel's failure and runs the twin there, instead of crashing the same way.
"""
from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass

import torch

from . import units
from .files import write_atomically
from .layout import token_bucket  # noqa: F401  (the buckets the table is keyed on)
from .units import UNITS
from .version import __version__


@dataclass(frozen=True)
class Shapes:
    """What an op's speed depends on, besides the op and the dtype."""
    tokens: int  # the token bucket
    hidden: int
    intermediate: int
    heads: int
    head_dim: int
    max_seqlen: int  # attention: a bucket of the longest sequence
    activation: str
    ragged: bool = True  # attention: sequences of different lengths (the twin then loops over them on the host)
    # what else each op's speed depends on: its unit's own Variant (the op's axes, defined beside its key)
    attention: units.attention.Variant = units.attention.Variant()
    bias_gelu: units.bias_gelu.Variant = units.bias_gelu.Variant()
    residual_layernorm: units.residual_layernorm.Variant = units.residual_layernorm.Variant()


def default_timer(fn) -> float:
    """Milliseconds per call on the device: Triton's do_bench (median over warmed-up repetitions, L2 flushed; its
    default summary is the mean, which one stall in 40 ms of repetitions moves)."""
    import triton.testing
    return float(triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median"))


class KernelFailed(Exception):
    """`Choices.choose`: the kernel raised while it was compiled, autotuned or timed (`error`, also the cause). The
    twin's own errors are not wrapped: they are not the kernel's to answer for."""

    def __init__(self, error: BaseException):
        super().__init__(f"{type(error).__name__}: {error}")
        self.error = error


class Choices:
    """The measured table for one device, loaded from and saved to disk."""

    def __init__(self, device: torch.device, timer=None, path: str | None = None):
        self.device = device
        self.timer = timer or default_timer
        self.path = path or self.default_path(device)
        self.table = self._load()

    @staticmethod
    def default_path(device: torch.device) -> str:
        import triton
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        stem = re.sub(r"[^A-Za-z0-9.]+", "-", f"{name}-torch{torch.__version__}-triton{triton.__version__}-"
                                                  f"fastbert{__version__}").strip("-")
        root = os.environ.get("FASTBERT_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "fastbert")
        return os.path.join(root, "auto", stem + ".json")

    def _load(self) -> dict:
        try:
            with open(self.path, encoding="utf-8") as f:
                table = json.load(f)
        except (OSError, ValueError):  # absent, unreadable or corrupt: measure again
            return {}
        if not isinstance(table, dict):
            return {}
        for key, entry in table.items():
            # left by a process that ended inside the kernel's first launch: that kernel failed there
            if isinstance(entry, dict) and "pending" in entry:
                table[key] = {"choice": "torch", "error": f"a process ended during the kernel's first launch for "
                                                          f"these shapes ({entry['pending']}): most likely a CUDA "
                                                          f"fault that lost its context, or a kill"}
        return table

    def _save(self) -> None:
        """Atomically (another process may be measuring too; the last complete table wins)."""
        def write(tmp):
            with open(tmp, "x", encoding="utf-8") as f:
                json.dump(self.table, f, indent=1, sort_keys=True)

        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            write_atomically(self.path, write)
        except OSError:
            pass  # a read-only home: the choices still hold for this process

    def choose(self, key: str, kernel_fn, twin_fn) -> bool:
        """True when the kernel is at least as fast as the twin for `key`; measured the first time only. A kernel
        that raises while it is compiled, autotuned or timed raises KernelFailed (the caller records it with
        `record_failure`); the twin's errors propagate as they are and record nothing. A key recorded as failed is
        never timed again."""
        entry = self.table.get(key)
        if entry is None or "choice" not in entry:  # new, or a process ended while timing the twin: measure
            entry = self._measure(key, kernel_fn, twin_fn)
        return entry["choice"] == "triton"

    def _measure(self, key: str, kernel_fn, twin_fn) -> dict:
        """Times kernel, then twin, with the table on disk saying at each point what a process that dies there
        leaves behind: "pending" during the kernel's launch (read as its failure), its time alone during the twin's
        (measured again)."""
        self.table[key] = {"pending": f"process {os.getpid()}, {time.strftime('%Y-%m-%d %H:%M:%S')}"}
        self._save()  # flushed to disk before the launch (write_atomically fsyncs)
        try:
            kernel_ms = self.timer(kernel_fn)
        except Exception as error:
            raise KernelFailed(error) from error  # still pending: the caller records the failure over it
        except BaseException:  # an interrupt, not the kernel's fault: as if never started
            del self.table[key]
            self._save()
            raise
        self.table[key] = {"triton_ms": kernel_ms}
        self._save()
        twin_ms = self.timer(twin_fn)  # outside the kernel's try: a twin that raises is not the kernel's failure
        entry = self.table[key] = {"triton_ms": kernel_ms, "torch_ms": twin_ms,
                                   "choice": "triton" if kernel_ms <= twin_ms else "torch"}
        self._save()
        return entry

    def record_failure(self, key: str, error: str) -> None:
        """The kernel failed for `key`: the twin from now on, in this process and (the table is on disk, named by the
        library versions) in the next ones, until a version changes."""
        self.table[key] = {"choice": "torch", "error": error}
        self._save()

    def failure(self, key: str) -> str | None:
        """The error recorded for `key`, or None."""
        return self.table.get(key, {}).get("error")

    def known(self, key: str) -> bool:
        return key in self.table


def op_key(op: str, dtype: torch.dtype, shapes: Shapes) -> str:
    """The table key of `op` at these shapes (its unit's `key`)."""
    return UNITS[op].key(dtype, shapes)


def contenders(op: str, dtype: torch.dtype, shapes: Shapes, device, kernel, twin):
    """(kernel_fn, twin_fn): zero-argument calls of the op on random inputs of these shapes (its unit's
    `contenders`). `kernel` and `twin` are the op's two implementations with the layer's signature."""
    return UNITS[op].contenders(dtype, shapes, device, kernel, twin)


_CHOICES: dict = {}


def choices_for(device: torch.device, timer=None) -> Choices:
    """The process's table for `device` (one per device; a timer given here replaces the device clock)."""
    key = str(device)
    if key not in _CHOICES or timer is not None:
        _CHOICES[key] = Choices(device, timer)
    return _CHOICES[key]
