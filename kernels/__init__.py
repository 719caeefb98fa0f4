"""fastbert's Triton kernels, one file per fused op. Installed as `fastbert.kernels` (see setup.py).

Imported lazily by fastbert.ops, so a machine without Triton never imports this package. Each op module exposes
its launcher (named like the op) and `aot_specs()`, the kernel x dtype x config list that tests/tooling/test_aot.py
compiles ahead of time for sm_90 and sm_80.
"""
import triton  # noqa: F401  (fail here, once, with the real ImportError, if Triton is missing or broken)
