"""fastbert's Triton kernels, one file per fused op. Installed as `fastbert.kernels` (see setup.py).

Imported lazily by fastbert.ops, so a machine without Triton never imports this package. Each op module exposes
its launcher (named like the op) and `aot_specs()`, the kernel x dtype x config list that tests/tooling/test_aot.py
compiles ahead of time for sm_90 and sm_80.

What Triton specialises, and why. A plain @triton.jit compiles one binary per specialisation of its integer
arguments (a multiple of 16 or not, equal to 1 or not; a cold GPU pays a fresh compile, seconds, for each). Every
argument that follows the batch, and only feeds cdiv, masks, loop bounds or descriptor shapes, is listed in its
kernel's `do_not_specialize` (Triton 3.6 and 3.9: neither divisibility nor the ==1 constant), so one binary per
config serves every token count:
- gemm_kernel: M; gemm_tma_kernel: M and NUM_PROGRAMS (min(SMs, tiles): 1 at a single tile);
- _attention_fwd_kernel: max_seqlen, seq_bucket (an autotune key only) and stride_mask_b (the padded length S);
- bias_residual_layernorm_kernel: T.
What stays specialised is fixed by the model, so it costs no extra compile across batches, and it pays: pointer
alignment and the row strides (3H, H, I, hd multiples of 16) let loads and stores run as 16-byte vectors and
cp.async copies (without them the pointer GEMM turns its loads scalar and spills: gemm.gemm_aot_specs); N, K, H are
model constants; unit strides are the constant 1; and the placeholder 1s the launchers pass for unused arguments
fold away. M_BUCKET (a power of two >= 16) only ever takes one specialisation. The AOT specs (`aot_specs()`)
compile the same: hint None for each argument listed here. tests/kernels/test_launch.py checks with Triton's own
binder that a launch at 1, 203 and 4096 tokens gets one key.
"""
if __name__ == "kernels":
    # Imported as a top-level `kernels`: Python runs from the repository root (python -m fastbert, pytest), where this
    # folder shadows Hugging Face's `kernels` package, which transformers (5.25 on: a dependency) imports. Load that
    # package in this module's place: once this body has run, the import returns what sys.modules holds. Without
    # one installed, stay an empty module, which transformers' probe reads as "not installed".
    import os as _os
    import sys as _sys
    from importlib.machinery import PathFinder as _PathFinder
    from importlib.util import module_from_spec as _module_from_spec

    _ROOT = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    _spec = _PathFinder.find_spec("kernels", [p for p in _sys.path if _os.path.abspath(p or _os.curdir) != _ROOT])
    if _spec is not None and _spec.loader is not None:
        _module = _module_from_spec(_spec)
        _sys.modules["kernels"] = _module
        _spec.loader.exec_module(_module)
else:
    import triton  # noqa: F401  (fail here, once, with the real ImportError, if Triton is missing or broken)
