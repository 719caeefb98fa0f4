"""Host instructions per TMA GEMM launch spent on its scratch buffer: the host side only, measured on a CPU.

Triton's launcher (3.6 and 3.9) calls the allocator that triton.set_allocator installed at every launch of a kernel
with device-side tensor descriptors; kernels/gemm.py's launcher checks first that one is installed. This script
runs that pair N times, as one launch does: `_ensure_allocator()`, then the launcher's
`_allocation._allocator.get()(size, alignment, stream)`, the buffer held until the next launch. `--variant before`
runs the two functions as the commit given (default HEAD) has them, `after` as the working tree has them (each
taken from its source and run in one namespace).

There is no CUDA here, so the namespace's `torch` is a stand-in: torch.empty itself (the dispatcher and the CPU
allocator stand in for the CUDA caching allocator), CPU devices, and constant lambdas for
torch.cuda.current_device and torch.cuda.is_current_stream_capturing (the real ones are Python wrappers over a C
call, so they cost more than these). Run it under callgrind at two N; the difference over the extra launches is the
per-launch count. `bench/host_scratch.sh VARIANT N` runs it with the instrumentation off until the launches start
(importing torch under full instrumentation takes minutes) and prints callgrind's instruction total.
"""
from __future__ import annotations

import argparse
import ast
import os
import subprocess
import types

import torch
import triton
from triton.runtime import _allocation

FUNCTIONS = ("_scratch", "_ensure_allocator")
SIZE, ALIGNMENT, STREAM = 132 * 3 * 128, 128, 0  # 132 programs x 3 descriptors x 128 B, the default stream


def functions(source: str) -> str:
    """The module-level assignments and functions of kernels/gemm.py that the scratch path uses."""
    tree = ast.parse(source)
    keep = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name in FUNCTIONS:
            keep.append(ast.get_source_segment(source, node))
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            text = ast.get_source_segment(source, node)
            if text.startswith(("_SCRATCH", "_ALLOCATOR")):
                keep.append(text)
    return "\n\n".join(keep)


def stand_in_torch():
    cpu = torch.device("cpu")
    cuda = types.SimpleNamespace(current_device=lambda: 0, is_current_stream_capturing=lambda: False)
    return types.SimpleNamespace(empty=torch.empty, int8=torch.int8, device=lambda kind, index=None: cpu, cuda=cuda)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variant", choices=("before", "after"), required=True)
    parser.add_argument("--commit", default="HEAD", help="the 'before' source (default HEAD)")
    parser.add_argument("-n", type=int, default=20000, help="launches")
    parser.add_argument("--wait", action="store_true",
                        help="print 'ready' once set up and wait for a line on stdin before the launches (so that "
                             "callgrind's instrumentation can be switched on there: `callgrind_control -i on PID`)")
    args = parser.parse_args()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if args.variant == "before":
        source = subprocess.run(["git", "show", f"{args.commit}:kernels/gemm.py"], cwd=root, check=True,
                                capture_output=True, text=True).stdout
    else:
        with open(os.path.join(root, "kernels", "gemm.py"), encoding="utf-8") as f:
            source = f.read()
    namespace = {"torch": stand_in_torch(), "triton": triton, "_allocation": _allocation}
    exec(compile(functions(source), f"gemm.py ({args.variant})", "exec"), namespace)
    ensure, slot = namespace["_ensure_allocator"], _allocation._allocator
    buffer = None
    if args.wait:
        print("ready", flush=True)
        input()
    for _ in range(args.n):  # one TMA launch's scratch work
        ensure()
        buffer = slot.get()(SIZE, ALIGNMENT, STREAM)
    print(args.variant, args.n, None if buffer is None else buffer.numel())


if __name__ == "__main__":
    main()
