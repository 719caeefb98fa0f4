"""Ahead-of-time compilation of fastbert's Triton kernels for real GPUs, on any Linux machine (no GPU needed).

Each op module in fastbert.kernels exposes `aot_specs()`: one dict per kernel x dtype x autotune config,
    {"name", "fn" (the raw @triton.jit JITFunction), "signature" {arg: "*fp16" | "i32" | "fp32" ...},
     "constexprs" {arg: value}, "num_warps", "num_stages"}
(optional: "hints" {arg: 16 | None}, see `_hints`; "maxnreg", "num_ctas", passed to the compiler as options;
"archs", the architectures the spec runs on (default: all of ARCHS); "tma": True when the kernel must load through
TMA on sm_90, which `problems` then checks in the SASS; "warp_specialize": True when Triton must split the kernel
into producer and consumer warps, checked in its GPU IR).
This module compiles every spec with `triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))` for sm_90
(H100/H200) and sm_80 (A100) with the ptxas shipped in the Triton wheel, then reads what a GPU would tell us:
shared memory (metadata.shared), tensor-core instructions in the PTX (wgmma / mma.sync), and the cubin's registers
and spill stack (`cuobjdump -res-usage`, also shipped in the wheel) and target architecture (`cuobjdump -elf`).

Recorded evidence. A compile is a pure function of its inputs, and Triton names them itself: the key of its own
compile cache (its version and sources, ptxas's version, the kernel's source and the functions it calls, the
signature, constexprs, hints and options, the target). aot_records/triton-<version>.jsonl holds, per key (and the
version of this file's measuring code), the record a compile gave. A child compiles every (spec, arch) whose key has
no record (a kernel or a spec that changed, another Triton) and, of the others, a sample (FASTBERT_AOT_VERIFY, a
fraction, default 0.05, drawn afresh each day; FASTBERT_AOT_VERIFY_SALT fixes the draw), whose fresh record must equal
the stored one, field for field; the rest take their stored record. FASTBERT_AOT_FRESH=1 compiles everything.
`python tests/tooling/aot_compile.py --record` rewrites the store for this Triton (every kernel list test_aot checks).

Why a subprocess. tests/conftest.py sets TRITON_INTERPRET=1 on a machine without CUDA, and then @triton.jit builds
InterpretedFunctions, which the compiler cannot take. So the compile runs in a child process with TRITON_INTERPRET
unset (`compile_module`), which imports the op module afresh, compiles its specs and streams one JSON line per
(spec, arch); the same path runs unchanged on a CUDA machine. Run it by hand for a table:
    python tests/tooling/aot_compile.py fastbert.kernels.bias_gelu [more modules] [--arch 90]
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import importlib
import inspect
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import traceback

ARCHS = (90, 80)
# Largest dynamic shared memory one block may opt into: H100/H200 227 KB, A100 163 KB (228/164 KB per SM minus the
# 1 KB the hardware reserves per block, which cuobjdump lists as SHARED:1024 on sm_90).
SHARED_LIMIT = {90: 227 * 1024, 80: 163 * 1024}
# The harness fails a spec whose compile takes longer than this (the whole AOT suite has to stay a few minutes).
CHILD_TIMEOUT_S = float(os.environ.get("FASTBERT_AOT_TIMEOUT", "1800"))
_TENSOR_CORE_DTYPES = {"f16", "bf16"}


# --------------------------------------------------------------------------------------------------------------------
# Tools
# --------------------------------------------------------------------------------------------------------------------
def tool_path(name: str) -> str:
    """A binary of the CUDA toolchain that ships inside the Triton wheel (backends/nvidia/bin)."""
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def missing_tools() -> str | None:
    """Why AOT compilation cannot run here (a precise reason for pytest.skip), or None when it can."""
    try:
        import triton
    except Exception as exc:  # noqa: BLE001 - any import failure means the same: nothing to compile with
        return f"triton does not import ({type(exc).__name__}: {exc})"
    if platform.system() != "Linux":
        return f"Triton's wheel ships ptxas/cuobjdump for Linux only (this is {platform.system()})"
    for name in ("ptxas", "cuobjdump"):
        path = tool_path(name)
        if not (os.path.isfile(path) and os.access(path, os.X_OK)):
            return f"{name} not found at {path} (triton {triton.__version__} wheel without the NVIDIA toolchain)"
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource
    except ImportError as exc:
        return f"triton {triton.__version__} lacks ASTSource/GPUTarget ({exc})"
    if "constexprs" not in inspect.signature(ASTSource.__init__).parameters:
        return (f"triton {triton.__version__}: ASTSource{inspect.signature(ASTSource.__init__)} predates the 3.3 API "
                "(constexprs=..., attrs keyed by argument index) that this harness targets")
    return None


# --------------------------------------------------------------------------------------------------------------------
# The adapter: a spec -> triton.compile arguments, for Triton 3.3 .. 3.9 (the GPU image has 3.6, this machine 3.9)
# --------------------------------------------------------------------------------------------------------------------
# What changed across versions, and what this code relies on:
# - Triton <= 3.2: ASTSource(fn, signature, constants=..., attrs=AttrsDescriptor) with integer-keyed signatures
#   that leave constexprs out. Not supported (missing_tools() says so).
# - Triton >= 3.3 (3.6 and 3.9 alike): ASTSource(fn, signature, constexprs=None, attrs=None). `signature` is keyed
#   by argument *name*; 3.3/3.4's ast_to_ttir walks it in declaration order next to the constants, so it must list
#   every argument, with "constexpr" for the constant ones (what JITFunction._pack_args builds). Constexprs may be
#   keyed by name (converted with fn.arg_names.index) or by path tuple (i,); we pass (i,) tuples, which every
#   3.3+ version takes as is. attrs maps (i,) -> [["tt.divisibility", 16]], the JIT's "D" specialisation.
# - The JIT specialises an integer argument equal to 1 into the constant 1 (("constexpr", 1) from specialize_impl);
#   a spec mirrors that by listing such an argument (e.g. a unit stride) under "constexprs" with the value 1.
def _hints(spec: dict, arg: str, ty: str) -> int | None:
    """Divisibility the JIT would see at run time for BERT shapes, unless the spec says otherwise.

    Pointers: torch allocations (and the views fastbert launches on) start 16-byte aligned, which the JIT marks.
    Integers: hidden sizes, head dims, row strides, S=128-style sequence buckets and B*128 token counts are all
    multiples of 16 in BERT, so the JIT's common specialisation marks them divisible by 16; without that hint the
    compiler cannot vectorise loads or pipeline them through cp.async, and would check a different (and much
    worse) kernel than the one that runs. A spec overrides per argument with "hints": {arg: None or 16}.
    """
    overrides = spec.get("hints") or {}
    if arg in overrides:
        return overrides[arg]
    if ty.startswith("*") or ty in ("i32", "i64", "u32", "u64"):
        return 16
    return None


def spec_problems(spec: dict) -> list[str]:
    """What is wrong with a spec's format, checked against the kernel's own parameter list."""
    problems = []
    for key in ("name", "fn", "signature", "constexprs", "num_warps", "num_stages"):
        if key not in spec:
            problems.append(f"missing key {key!r}")
    if problems:
        return problems
    fn = spec["fn"]
    if not hasattr(fn, "arg_names") or not hasattr(fn, "params"):
        inner = getattr(fn, "fn", None)
        hint = " (an Autotuner/Heuristics wrapper: pass its .fn)" if inner is not None else ""
        return [f"fn is a {type(fn).__name__}, not a triton JITFunction{hint}"]
    signature, constexprs = spec["signature"], spec["constexprs"]
    for param in fn.params:
        name = param.name
        if name in signature and name in constexprs:
            problems.append(f"argument {name!r} is in both signature and constexprs")
        elif param.is_constexpr and name not in constexprs and param.default is inspect.Parameter.empty:
            problems.append(f"tl.constexpr argument {name!r} has no value in constexprs")
        elif not param.is_constexpr and name not in signature and name not in constexprs:
            problems.append(f"argument {name!r} has no type in signature")
        elif param.is_constexpr and name in signature:
            problems.append(f"tl.constexpr argument {name!r} must go in constexprs, not signature")
    unknown = sorted((set(signature) | set(constexprs)) - set(fn.arg_names))
    if unknown:
        problems.append(f"{fn.__name__} has no arguments {unknown}")
    for key in ("num_warps", "num_stages"):
        if not isinstance(spec[key], int) or spec[key] < 1:
            problems.append(f"{key}={spec[key]!r} must be a positive int")
    if isinstance(spec["num_warps"], int) and spec["num_warps"] & (spec["num_warps"] - 1):
        problems.append(f"num_warps={spec['num_warps']} must be a power of two")
    return problems


def make_source(spec: dict):
    """The ASTSource the JIT would build for this spec (see the version notes above)."""
    from triton.compiler import ASTSource

    fn, signature, constexprs = spec["fn"], spec["signature"], spec["constexprs"]
    full_signature, constants, attrs = {}, {}, {}
    for index, param in enumerate(fn.params):
        name = param.name
        if name in constexprs or param.is_constexpr:
            value = constexprs[name] if name in constexprs else param.default
            full_signature[name] = "constexpr"
            constants[(index,)] = value
            continue
        ty = signature[name]
        full_signature[name] = ty
        # Arguments the kernel marks do_not_specialize(_on_alignment) never get the JIT's divisibility hint.
        unhinted = getattr(param, "do_not_specialize", False) or (
            ty.startswith("*") and getattr(param, "do_not_specialize_on_alignment", False))
        if _hints(spec, name, ty) == 16 and not unhinted:
            attrs[(index,)] = [["tt.divisibility", 16]]
    return ASTSource(fn, full_signature, constexprs=constants, attrs=attrs)


def compile_spec(spec: dict, arch: int):
    """triton.compile for one GPU architecture; returns the CompiledKernel (asm: ttir/ttgir/ptx/cubin, metadata)."""
    import triton
    from triton.backends.compiler import GPUTarget

    return triton.compile(make_source(spec), target=GPUTarget("cuda", arch, 32), options=_options(spec))


def _options(spec: dict) -> dict:
    options = {"num_warps": spec["num_warps"], "num_stages": spec["num_stages"]}
    for key in ("maxnreg", "num_ctas"):
        if key in spec:
            options[key] = spec[key]
    return options


# --------------------------------------------------------------------------------------------------------------------
# Reading the compiled kernel
# --------------------------------------------------------------------------------------------------------------------
def cuobjdump(cubin: bytes, *flags: str) -> list[str]:
    """`cuobjdump FLAG cubin` for each flag, the cubin written once: each run's stdout."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        return [subprocess.run([tool_path("cuobjdump"), flag, path], capture_output=True, text=True,
                               check=True).stdout for flag in flags]


def res_usage(usage: str, elf: str) -> dict:
    """REG / STACK / SHARED / LOCAL of the cubin's kernel function(s) from `cuobjdump -res-usage`, plus its sm
    (from `cuobjdump -elf`)."""
    functions = re.findall(r"Function ([^:\s]+):\s*\n\s*(.*)", usage)
    if not functions:
        raise RuntimeError(f"no 'Function' entry in cuobjdump -res-usage output:\n{usage}")
    out = {"functions": []}
    for fname, line in functions:
        fields = dict(re.findall(r"(\w+(?:\[\d+\])?):(\d+)", line))
        out["functions"].append({"function": fname, **{k: int(v) for k, v in fields.items()}})
    # The kernel is the function with the largest register count (device-side helpers are inlined by Triton).
    main = max(out["functions"], key=lambda f: f.get("REG", 0))
    out["reg"], out["local"] = main.get("REG", 0), main.get("LOCAL", 0)
    out["stack"] = max(f.get("STACK", 0) for f in out["functions"])
    # Static shared memory (on sm_90 the 1 KB the hardware reserves); Triton's own buffers are dynamic (`shared`).
    out["static_shared"] = main.get("SHARED", 0)
    # "64-bit ELF: ... sm=90a, ..." (CUDA 13 cuobjdump) or "64bit elf: ... sm=80, ..." (older header format).
    match = re.search(r"\bsm\s*=\s*(\d+[a-z]?)", elf)
    out["sm"] = match.group(1) if match else None
    return out


# The operand types of a tt.dot in Triton IR, e.g. (3.6 and 3.9 print the same form)
#   %acc = tt.dot %a, %b, %acc, inputPrecision = tf32 : tensor<128x64xf16> * tensor<64x128xf16> -> tensor<128x128xf32>
_DOT_TYPES_RE = re.compile(r"tensor<(?P<m>\d+)x(?P<k>\d+)x(?P<a>\w+)>\s*\*\s*tensor<(?P<k2>\d+)x(?P<n>\d+)x(?P<b>\w+)>")


def dots(ttir: str) -> list[dict]:
    """The tl.dot ops of the kernel (from its Triton IR): tile M x N x K, operand dtype, input precision."""
    found = []
    for line in ttir.splitlines():
        if not re.search(r"=\s*tt\.dot\s", line):
            continue
        match = _DOT_TYPES_RE.search(line)
        if match is None:
            found.append({"unparsed": line.strip()[:200]})
            continue
        precision = re.search(r"inputPrecision\s*=\s*(\w+)", line)
        found.append({"m": int(match.group("m")), "n": int(match.group("n")), "k": int(match.group("k")),
                      "dtype": match.group("a"), "precision": precision.group(1) if precision else "ieee"})
    return found


def expects_wgmma(dot: dict, num_warps: int) -> bool:
    """Hopper's wgmma serves a dot on fp16/bf16 (or fp32 as tf32) when a warpgroup (4 warps) owns 64-row slabs."""
    if "unparsed" in dot or num_warps % 4:
        return False
    tensor_core = dot["dtype"] in _TENSOR_CORE_DTYPES or (dot["dtype"] == "f32" and dot["precision"] == "tf32")
    return tensor_core and dot["m"] % 64 == 0 and dot["n"] % 8 == 0 and dot["k"] % 16 == 0


def expects_tensor_cores(dot: dict) -> bool:
    """fp16/bf16/tf32 dots run on tensor cores (mma.sync on sm_80; wgmma or mma.sync on sm_90)."""
    if "unparsed" in dot:
        return False
    return dot["dtype"] in _TENSOR_CORE_DTYPES or (dot["dtype"] == "f32" and dot["precision"] == "tf32")


# SSA definitions in Triton IR: "%x = op ...", "%x:2 = op ...", and the values an scf.for defines (induction variable
# "scf.for %iv = ...", iter_args "(%arg = %init, ...)").
_SSA_DEF_RE = re.compile(r"^\s*(%[\w.$-]+)(?::\d+)?\s*=\s*(.*)$")
_SSA_USE_RE = re.compile(r"%[\w.$-]+")
_FOR_RE = re.compile(r"scf\.for\s+(%[\w.$-]+)\s*=(.*?)(?:iter_args\((.*?)\))?\s*->|scf\.for\s+(%[\w.$-]+)\s*=(.*)")
_DESC_OP_RE = re.compile(r"tt\.descriptor_(load|store)\s+%[\w.$-]+\[([^\]]*)\]")


def descriptor_coordinate_sources(ttir: str) -> dict:
    """Where the TMA loads' and stores' tile coordinates come from, by following SSA definitions back in the Triton
    IR: {"load"/"store": {"induction": bool, "carried": bool}}, "induction" when a coordinate depends on an scf.for
    induction variable, "carried" when it depends on a loop-carried value (an iter_arg). None without descriptors."""
    deps, induction, carried, coords = {}, set(), set(), {"load": [], "store": []}
    for line in ttir.splitlines():
        code = line.split(" loc(")[0]
        loop = _FOR_RE.search(code)
        if loop:
            iv = loop.group(1) or loop.group(4)
            induction.add(iv)
            for pair in (loop.group(3) or "").split(","):
                if "=" in pair:
                    arg, init = (p.strip() for p in pair.split("=", 1))
                    carried.add(arg)
                    deps[arg] = set(_SSA_USE_RE.findall(init))
        match = _SSA_DEF_RE.match(code)
        if match and not loop:
            deps[match.group(1)] = set(_SSA_USE_RE.findall(match.group(2)))
        op = _DESC_OP_RE.search(code)
        if op:
            coords[op.group(1)].append(_SSA_USE_RE.findall(op.group(2)))
    if not coords["load"] and not coords["store"]:
        return None

    def sources(values):
        seen, todo = set(), list(values)
        while todo:
            value = todo.pop()
            if value not in seen:
                seen.add(value)
                todo.extend(deps.get(value, ()))
        return seen

    result = {}
    for kind, uses in coords.items():
        found = sources(v for use in uses for v in use)
        result[kind] = {"induction": bool(found & induction), "carried": bool(found & carried)}
    return result


# One SASS instruction per line of `cuobjdump --dump-sass`: "/*0a30*/  @!P0 HGMMA.64x128x16.F32 ... ;"
_SASS_RE = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")
SASS_OPS = ("HGMMA", "HMMA", "UTMALDG", "UTMASTG", "LDGSTS", "MUFU", "FFMA", "FMUL")


def sass_stats(sass: str) -> dict:
    """Static SASS instruction counts from `cuobjdump --dump-sass`: the total (the cost of an epilogue shows here)
    and the opcodes that prove which hardware path a kernel takes (HGMMA = wgmma, UTMALDG/UTMASTG = TMA, LDGSTS =
    cp.async, MUFU = SFU ops)."""
    opcodes = _SASS_RE.findall(sass)
    stats = {"sass": len(opcodes)}
    stats.update({op.lower(): sum(1 for o in opcodes if o == op) for op in SASS_OPS})
    return stats


def analyse(spec: dict, arch: int, kernel) -> dict:
    ptx = kernel.asm["ptx"]
    record = {"shared": int(kernel.metadata.shared), "dots": dots(kernel.asm["ttir"]),
              "wgmma": len(re.findall(r"\bwgmma\.mma_async", ptx)), "mma_sync": len(re.findall(r"\bmma\.sync", ptx)),
              "ptx_target": (re.search(r"^\.target\s+(\S+)", ptx, re.M) or [None, None])[1],
              # 16-byte global accesses vs narrower ones (a bandwidth-bound kernel wants only the former)
              "ld_global_v4": len(re.findall(r"\bld\.global(?:\.[a-z0-9_]+)*\.v4\.", ptx)),
              "ld_global": len(re.findall(r"\bld\.global\.", ptx)),
              "st_global_v4": len(re.findall(r"\bst\.global(?:\.[a-z0-9_]+)*\.v4\.", ptx)),
              "st_global": len(re.findall(r"\bst\.global\.", ptx)),
              "warp_specialized": "ttg.warp_specialize" in kernel.asm["ttgir"],
              "descriptor_coordinates": descriptor_coordinate_sources(kernel.asm["ttir"])}
    # Disassembly costs ~0.45 s a kernel, a third of a compile; what reads it (the MMA and TMA paths, the epilogue's
    # instruction count) concerns kernels with a tt.dot or TMA loads, so row kernels skip it.
    wants_sass = bool(record["dots"]) or bool(spec.get("tma"))
    usage, elf, *sass = cuobjdump(kernel.asm["cubin"], "-res-usage", "-elf", *(["--dump-sass"] if wants_sass else []))
    record.update(res_usage(usage, elf))
    if wants_sass:
        record.update(sass_stats(sass[0]))
    return record


def problems(record: dict) -> list[str]:
    """Every reason a compiled (spec, arch) is not fit to ship; empty when it is."""
    arch = record["arch"]
    if record.get("error"):
        return [record["error"]]
    found = []
    limit = SHARED_LIMIT[arch]
    if record["shared"] > limit:
        found.append(f"shared memory {record['shared']} B ({record['shared'] / 1024:.1f} KB) > sm_{arch} limit "
                     f"{limit} B ({limit // 1024} KB)")
    if record["stack"] > 0:
        found.append(f"register spills: cuobjdump STACK={record['stack']} B (REG={record['reg']}, "
                     f"LOCAL={record['local']})")
    if record["sm"] is None or not record["sm"].startswith(str(arch)):
        found.append(f"cubin is for sm={record['sm']}, expected sm_{arch}")
    dot_list = record["dots"]
    unparsed = [d["unparsed"] for d in dot_list if "unparsed" in d]
    if unparsed:
        found.append(f"harness cannot read the operand types of tt.dot {unparsed} (Triton IR format changed?)")
    if arch == 90 and any(expects_wgmma(d, record["num_warps"]) for d in dot_list) and (
            record["wgmma"] == 0 or record.get("hgmma") == 0):
        found.append(f"sm_90 code has no wgmma (PTX wgmma={record['wgmma']}, SASS HGMMA={record.get('hgmma')}) "
                     f"although dots {dot_list} qualify (num_warps={record['num_warps']})")
    if arch == 90 and record.get("tma") and not record.get("utmaldg"):
        found.append("spec asks for TMA loads but the sm_90 SASS has no UTMALDG")
    if record.get("warp_specialize") and not record.get("warp_specialized"):
        found.append("spec asks for warp specialization but Triton did not split the kernel (no ttg.warp_specialize)")
    if any(expects_tensor_cores(d) for d in dot_list) and record["wgmma"] + record["mma_sync"] == 0:
        found.append(f"sm_{arch} PTX has no tensor-core MMA (wgmma/mma.sync) for dots {dot_list}")
    return found


def mma_kind(record: dict) -> str:
    if record.get("error"):
        return "?"
    if not record["dots"]:
        return "-"
    if record["wgmma"]:
        return "wgmma"
    if record["mma_sync"]:
        return "mma.sync"
    return "fma"


# --------------------------------------------------------------------------------------------------------------------
# Recorded evidence: records keyed by Triton's own compile-cache key
# --------------------------------------------------------------------------------------------------------------------
RECORDS_DIR = os.environ.get("FASTBERT_AOT_RECORDS") or os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                                     "aot_records")
# The kernel lists the store holds: every list tests/tooling/test_aot.py checks but its own toy kernels, which it
# compiles every time (they test this harness).
RECORDED_LISTS = (("fastbert.kernels.qkv_projection", "aot_specs"), ("fastbert.kernels.attention", "aot_specs"),
                  ("fastbert.kernels.bias_gelu", "aot_specs"), ("fastbert.kernels.residual_layernorm", "aot_specs"),
                  ("fastbert.kernels.bias_gelu", "backward_aot_specs"),
                  ("fastbert.kernels.residual_layernorm", "dropout_aot_specs"),
                  ("fastbert.kernels.attention_backward", "backward_aot_specs"))
# What a record is made of: the code that compiles a spec and measures the result. A change to it makes every
# record stale (compiled afresh until recorded again); a change to `problems` (the verdict) does not.
_MEASURING = ("_hints", "make_source", "compile_spec", "_options", "cuobjdump", "res_usage", "dots",
              "descriptor_coordinate_sources", "sass_stats", "analyse")
_VOLATILE = ("seconds", "source", "key", "recorded")  # not part of what a compile gives


def harness_version() -> str:
    module = sys.modules[__name__]
    code = [inspect.getsource(getattr(module, name)) for name in _MEASURING]
    code += [pattern.pattern for pattern in (_DOT_TYPES_RE, _SASS_RE, _DESC_OP_RE, _FOR_RE)] + list(SASS_OPS)
    return hashlib.sha256("\n".join(code).encode()).hexdigest()[:16]


def cache_key(spec: dict, arch: int) -> str | None:
    """Triton's compile-cache key of (spec, arch) with this harness's version, or None where this Triton does not
    expose it (then nothing is taken from the store)."""
    try:
        from triton._C.libtriton import get_cache_invalidating_env_vars
        from triton.backends.compiler import GPUTarget
        from triton.compiler.compiler import make_backend
        from triton.runtime.cache import get_cache_key
        source = make_source(spec)
        backend = make_backend(GPUTarget("cuda", arch, 32))
        options = backend.parse_options(dict(_options(spec), **source.parse_options()))
        key = get_cache_key(source, backend, options, get_cache_invalidating_env_vars())
    except Exception:  # noqa: BLE001 - any change in Triton's internals: compile instead
        return None
    return hashlib.sha256(f"{key}-{harness_version()}".encode()).hexdigest()


def store_path(triton_version: str) -> str:
    return os.path.join(RECORDS_DIR, f"triton-{triton_version}.jsonl")


def read_store(triton_version: str) -> dict:
    """key -> record, from this Triton's store (empty when there is none)."""
    path = store_path(triton_version)
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return {entry["key"]: entry["record"] for entry in map(json.loads, f) if entry}


def measured(record: dict) -> dict:
    """What a compile gave: the record without the fields of one particular run."""
    return {k: v for k, v in record.items() if k not in _VOLATILE}


def verify_fraction() -> float:
    return float(os.environ.get("FASTBERT_AOT_VERIFY", "0.05"))


def verify_salt() -> str:
    return os.environ.get("FASTBERT_AOT_VERIFY_SALT") or datetime.date.today().isoformat()


def sampled(key: str, fraction: float, salt: str) -> bool:
    """Whether a recorded (spec, arch) is compiled again to check its record: a draw by key, fixed for a salt."""
    return int(hashlib.sha256(f"{salt}:{key}".encode()).hexdigest()[:8], 16) < fraction * 16 ** 8


def use_store() -> bool:
    return os.environ.get("FASTBERT_AOT_FRESH", "") in ("", "0")


# --------------------------------------------------------------------------------------------------------------------
# Driving it: the child process (compiles) and the parent side (starts it, reads its JSON lines)
# --------------------------------------------------------------------------------------------------------------------
def _child(module_name: str, specs_fn: str, archs: list[int], out_path: str, only: list[str] | None,
           shard: tuple[int, int] = (0, 1)) -> int:
    os.environ.pop("TRITON_INTERPRET", None)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    with open(out_path, "w") as out:
        def emit(obj):
            out.write(json.dumps(obj) + "\n")
            out.flush()

        try:
            module = importlib.import_module(module_name)
            specs = list(getattr(module, specs_fn)())
        except Exception:  # noqa: BLE001 - reported to the parent verbatim
            emit({"module_error": traceback.format_exc(limit=8)})
            return 0
        import triton
        if shard[0] == 0:
            emit({"specs": [s.get("name") for s in specs], "triton": triton.__version__})
        store = read_store(triton.__version__) if use_store() else {}
        fraction, salt = verify_fraction(), verify_salt()
        for index, spec in enumerate(specs):
            if index % shard[1] != shard[0] or (only is not None and spec.get("name") not in only):
                continue
            spec_errors = spec_problems(spec)
            for arch in archs:
                if arch not in spec.get("archs", ARCHS):
                    continue
                record = {"name": spec.get("name"), "arch": arch, "num_warps": spec.get("num_warps"),
                          "num_stages": spec.get("num_stages"), "tma": bool(spec.get("tma")),
                          "warp_specialize": bool(spec.get("warp_specialize"))}
                start = time.perf_counter()
                key = None if spec_errors else cache_key(spec, arch)
                stored = store.get(key) if key is not None else None
                if stored is not None and not sampled(key, fraction, salt):
                    emit({**stored, "source": "record", "key": key, "seconds": 0.0})
                    continue
                if spec_errors:
                    record["error"] = "bad spec: " + "; ".join(spec_errors)
                else:
                    try:
                        kernel = compile_spec(spec, arch)
                        record.update(analyse(spec, arch, kernel))
                    except Exception as exc:  # noqa: BLE001 - a compile error is a result to report
                        text = str(exc).strip() or repr(exc)
                        record["error"] = f"compile failed: {type(exc).__name__}: {text[-3000:]}"
                record.update(seconds=round(time.perf_counter() - start, 2), key=key,
                              source="compiled" if stored is None else "verified")
                if stored is not None:
                    record["recorded"] = stored
                emit(record)
    return 0


def default_jobs() -> int:
    """Child processes compiling at once: FASTBERT_AOT_JOBS, else one per CPU core (at most 8).

    Each compile is single-threaded (Triton's frontend, then ptxas), so N children on N cores finish ~N times
    sooner; the specs are dealt round-robin to the children, every spec is still compiled for every arch."""
    env = os.environ.get("FASTBERT_AOT_JOBS")
    if env:
        return max(1, int(env))
    return max(1, min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


def compile_module(module_name: str, specs_fn: str = "aot_specs", archs=ARCHS, only=None,
                   timeout: float = CHILD_TIMEOUT_S, jobs: int | None = None, fresh: bool = False) -> dict:
    """Compile every spec of `module_name` in child processes without TRITON_INTERPRET (taking recorded evidence
    where it applies, unless `fresh`).

    Returns {"module_error": str | None, "specs": [names], "records": {(name, arch): record}, "seconds": float,
    "crash": str | None}; each record's "source" says "compiled", "verified" (compiled, with the stored record it
    must equal in "recorded") or "record" (taken from the store).
    """
    jobs = default_jobs() if jobs is None else jobs
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    if fresh:
        env["FASTBERT_AOT_FRESH"] = "1"
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for shard in range(jobs):
            out_path = os.path.join(tmp, f"records{shard}.jsonl")
            cmd = [sys.executable, os.path.abspath(__file__), "--child", module_name, "--specs-fn", specs_fn,
                   "--json", out_path, "--shard", str(shard), str(jobs), "--arch", *[str(a) for a in archs]]
            if only is not None:
                cmd += ["--only", *only]
            err = open(os.path.join(tmp, f"stderr{shard}.txt"), "w+")
            procs.append((subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err), out_path, err))
        crashes = []
        for proc, out_path, err in procs:
            try:
                proc.wait(timeout=max(1.0, timeout - (time.perf_counter() - start)))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                crashes.append(f"timed out after {timeout:.0f} s")
            err.seek(0)
            if proc.returncode not in (0, None) and not crashes:
                crashes.append(f"exit code {proc.returncode}: {err.read()[-3000:]}")
            err.close()
        lines = []
        for _, out_path, _ in procs:
            if os.path.exists(out_path):
                lines += open(out_path).read().splitlines()
    crash = "; ".join(crashes) or None
    result = {"module_error": None, "specs": None, "triton": None, "records": {},
              "seconds": time.perf_counter() - start, "crash": crash}
    for line in lines:
        obj = json.loads(line)
        if "module_error" in obj:
            result["module_error"] = obj["module_error"]
        elif "specs" in obj:
            result["specs"], result["triton"] = obj["specs"], obj.get("triton")
        else:
            result["records"][(obj["name"], obj["arch"])] = obj
    if result["specs"] is None and result["module_error"] is None:
        result["module_error"] = f"the compile process produced no spec list ({crash})"
    # Keep the spec order (the children finish interleaved).
    order = {name: i for i, name in enumerate(result["specs"] or [])}
    result["records"] = dict(sorted(result["records"].items(), key=lambda kv: (order.get(kv[0][0], 1 << 30),
                                                                                 -kv[0][1])))
    return result


def format_table(records: list[dict]) -> str:
    """One line per (spec, arch): registers, spill stack, shared memory, MMA instructions, verdict."""
    header = (f"{'spec':<58} {'arch':>5} {'warps':>5} {'REG':>4} {'STACK':>6} {'smem KB':>8} {'mma':>8} {'SASS':>6} "
              f"{'TMA':>4} {'sec':>5}  status")
    lines = [header, "-" * len(header)]
    for r in records:
        bad = problems(r)
        if r.get("error"):
            status = "ERROR " + r["error"].splitlines()[0][:80] if r["error"].strip() else "ERROR"
            lines.append(f"{r['name']:<58} {'sm' + str(r['arch']):>5} {r.get('num_warps', '?')!s:>5} {'':>4} {'':>6} "
                         f"{'':>8} {'':>8} {'':>6} {'':>4} {r.get('seconds', 0):>5.1f}  {status}")
            continue
        status = "ok" if not bad else "FAIL " + " | ".join(b.split(":")[0] for b in bad)
        lines.append(f"{r['name']:<58} {'sm' + str(r['arch']):>5} {r['num_warps']:>5} {r['reg']:>4} {r['stack']:>6} "
                     f"{r['shared'] / 1024:>8.1f} {mma_kind(r):>8} {r.get('sass', '-')!s:>6} "
                     f"{'yes' if r.get('utmaldg') else '-':>4} {r['seconds']:>5.1f}  {status}")
    return "\n".join(lines)


def record_store(jobs: int | None = None) -> int:
    """Write the store of this Triton: one JSON line per (spec, arch) of RECORDED_LISTS that compiled, in the lists'
    order. A (spec, arch) whose key the store holds keeps its record (the daily sample re-checks those), the others
    are compiled, and records no list names any more are dropped: after a kernel change only its specs compile.
    FASTBERT_AOT_FRESH=1 compiles every one afresh. A spec that fails to compile is left out (it is compiled, and
    fails, every run)."""
    import triton
    os.environ["FASTBERT_AOT_VERIFY"] = "0"  # what the store holds is taken as it is (the children read this)
    lines, failed = [], 0
    for module_name, specs_fn in RECORDED_LISTS:
        result = compile_module(module_name, specs_fn, jobs=jobs, fresh=not use_store())
        if result["module_error"] or result["crash"]:
            print(f"{module_name}.{specs_fn}(): {result['module_error'] or result['crash']}")
            return 1
        for record in result["records"].values():
            if record.get("error") or record["key"] is None:
                failed += 1
                continue
            lines.append(json.dumps({"key": record["key"], "record": measured(record)}, sort_keys=True))
        compiled = sum(r["source"] != "record" for r in result["records"].values())
        print(f"{module_name}.{specs_fn}(): {len(result['records'])} records, {compiled} compiled afresh, in "
              f"{result['seconds']:.0f} s")
    os.makedirs(RECORDS_DIR, exist_ok=True)
    path = store_path(triton.__version__)
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"{path}: {len(lines)} records ({failed} compiles failed or had no key: not recorded)")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("modules", nargs="*", help="modules with aot_specs(), e.g. fastbert.kernels.bias_gelu")
    parser.add_argument("--arch", nargs="+", type=int, default=list(ARCHS))
    parser.add_argument("--specs-fn", default="aot_specs")
    parser.add_argument("--only", nargs="+", default=None, help="compile only these spec names")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--json", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--shard", nargs=2, type=int, default=(0, 1), help=argparse.SUPPRESS)
    parser.add_argument("--jobs", type=int, default=None, help="child processes (default: FASTBERT_AOT_JOBS or CPUs)")
    parser.add_argument("--record", action="store_true",
                        help="rewrite aot_records/ for this Triton: compile what it lacks, drop what no list names")
    args = parser.parse_args(argv)
    if args.child:
        return _child(args.child, args.specs_fn, args.arch, args.json, args.only, tuple(args.shard))
    reason = missing_tools()
    if reason:
        print(f"cannot compile ahead of time: {reason}")
        return 2
    if args.record:
        return record_store(args.jobs)
    status = 0
    for name in args.modules:
        result = compile_module(name, args.specs_fn, tuple(args.arch), args.only, jobs=args.jobs)
        if result["module_error"]:
            print(f"{name}: {result['module_error']}")
            status = 1
            continue
        records = list(result["records"].values())
        print(f"{name}: {len(result['specs'])} specs, {len(records)} compiles in {result['seconds']:.0f} s "
              f"(triton {result['triton']})")
        print(format_table(records))
        status |= any(problems(r) for r in records)
    return status


if __name__ == "__main__":
    sys.exit(main())
