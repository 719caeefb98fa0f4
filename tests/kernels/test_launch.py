"""How the launchers launch, checked without running a kernel: which arguments Triton specialises (one binary for
every token count, inference's kernels and training's: the forwards' dropout forms and the backward kernels), the
refusal to compile or load a binary inside a CUDA-graph capture, and the TMA GEMM's scratch buffers.

Here the kernels are Triton's InterpretedFunctions (tests/conftest.py), which keep the decorator's arguments; a GPU
builds a JITFunction from the same function and arguments. `jit_of` builds that JITFunction here, and its binder is
Triton's own (create_function_from_signature over an sm_90 backend, no driver needed): the specialisation key it
returns for a launch is the one a GPU's JIT files the launch's binary under. Launches are recorded by replacing the
kernel's run, so nothing executes unless a test says so.
"""
import functools
import types

import pytest
import torch
import torch.nn.functional as F
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

from fastbert.kernels import attention as attention_mod
from fastbert.kernels import attention_backward as attention_bwd
from fastbert.kernels import bias_gelu as bias_gelu_mod
from fastbert.kernels import gemm as gemm_core
from fastbert.kernels import residual_layernorm as rln_mod
from fastbert.kernels import utils as kernel_utils

TOKENS = (1, 203, 4096)  # a single token (Triton's ==1 constant), an odd count, a multiple of 16
SM90 = GPUTarget("cuda", 90, 32)

# kernel -> the arguments that follow the batch and must not be specialised (bias_gelu's derivative kernel takes the
# token count in its grid alone)
TOKEN_ARGUMENTS = {
    gemm_core.gemm_kernel: {"M"},
    gemm_core.gemm_tma_kernel: {"M", "NUM_PROGRAMS"},
    attention_mod._attention_fwd_kernel: {"max_seqlen", "seq_bucket", "stride_mask_b"},
    rln_mod.bias_residual_layernorm_kernel: {"T"},
    attention_bwd._attention_bwd_dkdv_kernel: {"max_seqlen", "seq_bucket", "stride_mask_b"},
    attention_bwd._attention_bwd_dq_kernel: {"max_seqlen", "seq_bucket", "stride_mask_b"},
    rln_mod.layernorm_backward_kernel: {"T"},
    bias_gelu_mod.bias_gelu_backward_kernel: set(),
}


def jit_of(kernel) -> JITFunction:
    """The JITFunction a GPU builds for `kernel` (the kernel itself there; here, from its function and the
    decorator's keyword arguments, which the InterpretedFunction keeps)."""
    if isinstance(kernel, JITFunction):
        return kernel
    return JITFunction(kernel.fn, **kernel.kwargs)


@functools.lru_cache(maxsize=None)
def binder_of(kernel):
    jit = jit_of(kernel)
    return create_function_from_signature(jit.signature, jit.params, make_backend(SM90))


def jit_key(kernel, args, kwargs) -> tuple:
    """What the JIT keys a launch's binary by: the specialisation of every argument and the launch options."""
    _, specialization, options = binder_of(kernel)(*args, **kwargs)
    return tuple(specialization), str(options)


def record(monkeypatch, kernel) -> list:
    """Replace `kernel`'s run: each launch is recorded as (args, kwargs) and nothing runs."""
    calls = []
    monkeypatch.setattr(kernel, "run", lambda *args, grid, warmup, **kwargs: calls.append((args, kwargs)))
    return calls


def test_token_count_arguments_are_not_specialised():
    """Each kernel's do_not_specialize (the attribute a GPU's JITFunction carries) lists its batch-dependent
    integer arguments, and each name is one of the kernel's parameters (Triton ignores a misspelt one)."""
    for kernel, names in TOKEN_ARGUMENTS.items():
        jit = jit_of(kernel)
        listed = set(jit.do_not_specialize)
        assert listed == names, (kernel.fn.__name__, listed)
        assert listed <= set(jit.arg_names)
        assert {p.name for p in jit.params if p.do_not_specialize} == names


def _gemm_launches(monkeypatch, kind):
    kernel = gemm_core.gemm_tma_kernel if kind == "tma" else gemm_core.gemm_kernel
    calls = record(monkeypatch, kernel)
    w = torch.randn(96, 64, dtype=torch.float16)
    for m in TOKENS:
        a = torch.randn(m, 64, dtype=torch.float16)
        gemm_core.gemm(a, w, torch.randn(96, dtype=torch.float16), torch.empty(m, 96, dtype=torch.float16), "gelu",
                       kernel=kind)
    return {kernel: calls}


def _attention_layout(t, padded):
    """(cu_seqlens, key_valid) of t tokens: one sequence, or one padded row of S = t keys whose last is padding (S
    is the mask's row stride)."""
    if not padded:
        return torch.tensor([0, t], dtype=torch.int32), None
    keep = torch.ones(1, t, dtype=torch.bool)
    keep[0, -1] = t == 1
    return attention_mod.uniform_cu_seqlens(1, t, "cpu"), keep


def _attention_launches(monkeypatch, padded, dropout=0.0):
    """The forward; with dropout, training's form (the log-sum-exp stored, probabilities dropped)."""
    calls = record(monkeypatch, attention_mod._attention_fwd_kernel)
    for t in TOKENS:
        qkv = torch.randn(t, 3, 2, 16, dtype=torch.float16)
        cu, keep = _attention_layout(t, padded)
        if dropout:
            attention_mod.train_forward(qkv, cu, t, 0.25, keep, dropout_p=dropout, seed=kernel_utils.dropout_seed(
                qkv.device))
        else:
            attention_mod.launch(qkv, cu, t, 0.25, key_valid=keep)
    return {attention_mod._attention_fwd_kernel: calls}


def _attention_backward_launches(monkeypatch, padded, dropout=0.0):
    """Both backward kernels (dK/dV, dQ) of training's forward."""
    calls = {kernel: record(monkeypatch, kernel)
             for kernel in (attention_bwd._attention_bwd_dkdv_kernel, attention_bwd._attention_bwd_dq_kernel)}
    for t in TOKENS:
        qkv, out = torch.randn(t, 3, 2, 16, dtype=torch.float16), torch.randn(t, 32, dtype=torch.float16)
        cu, keep = _attention_layout(t, padded)
        seed = kernel_utils.dropout_seed(qkv.device) if dropout else None
        attention_bwd.attention_backward(torch.randn(t, 32, dtype=torch.float16), qkv, out, torch.randn(t, 2), cu,
                                         t, 0.25, keep, dropout_p=dropout, seed=seed)
    return calls


def _row_launches(monkeypatch):
    calls = record(monkeypatch, rln_mod.bias_residual_layernorm_kernel)
    for t in TOKENS:
        h, r = torch.randn(t, 64), torch.randn(t, 64)
        rln_mod.bias_residual_layernorm(h, torch.randn(64), r, torch.ones(64), torch.zeros(64), 1e-12)
    return {rln_mod.bias_residual_layernorm_kernel: calls}


def _row_training_launches(monkeypatch, dropout):
    """Training's row kernels: the forward with its statistics and dropout, and the backward."""
    calls = {kernel: record(monkeypatch, kernel)
             for kernel in (rln_mod.bias_residual_layernorm_kernel, rln_mod.layernorm_backward_kernel)}
    for t in TOKENS:
        y, w, r = torch.randn(t, 48), torch.randn(64, 48), torch.randn(t, 64)
        seed = kernel_utils.dropout_seed(y.device) if dropout else None
        s, _, stats = rln_mod.train_forward(y, w, torch.randn(64), r, torch.ones(64), torch.zeros(64), 1e-12,
                                            dropout_p=dropout, seed=seed)
        rln_mod.layernorm_backward(torch.randn(t, 64), None, s, stats, torch.ones(64), True, dropout_p=dropout,
                                   seed=seed)
    return calls


def _bias_gelu_backward_launches(monkeypatch):
    calls = record(monkeypatch, bias_gelu_mod.bias_gelu_backward_kernel)
    for t in TOKENS:
        bias_gelu_mod.pre_activation_grad(torch.randn(t, 96, dtype=torch.float16),
                                          torch.randn(t, 96, dtype=torch.float16), "gelu")
    return {bias_gelu_mod.bias_gelu_backward_kernel: calls}


LAUNCHES = {
    "gemm-ptr": lambda mp: _gemm_launches(mp, "ptr"),
    "gemm-tma": lambda mp: _gemm_launches(mp, "tma"),
    "attention-varlen": lambda mp: _attention_launches(mp, False),
    "attention-padded": lambda mp: _attention_launches(mp, True),
    "residual_layernorm": _row_launches,
    "attention-dropout-varlen": lambda mp: _attention_launches(mp, False, dropout=0.1),
    "attention-dropout-padded": lambda mp: _attention_launches(mp, True, dropout=0.1),
    "attention-backward-varlen": lambda mp: _attention_backward_launches(mp, False),
    "attention-backward-padded": lambda mp: _attention_backward_launches(mp, True),
    "attention-backward-dropout": lambda mp: _attention_backward_launches(mp, False, dropout=0.1),
    "residual_layernorm-training": lambda mp: _row_training_launches(mp, 0.0),
    "residual_layernorm-training-dropout": lambda mp: _row_training_launches(mp, 0.1),
    "bias_gelu-backward": _bias_gelu_backward_launches,
}


@pytest.mark.parametrize("case", list(LAUNCHES))
def test_one_binary_serves_every_token_count(case, monkeypatch):
    """The launcher's own arguments at 1, 203 and 4096 tokens get one JIT key from Triton's binder: one compile
    on a cold GPU, not three, for inference's kernels and training's (the forwards' dropout forms, the backward
    kernels). Without the do_not_specialize lists they would get three (checked too, so the launches really do
    differ in those arguments), except for a kernel that takes the token count in its grid alone."""
    launched = LAUNCHES[case](monkeypatch)
    for kernel, calls in launched.items():
        name = kernel.fn.__name__
        assert len(calls) == len(TOKENS), name
        keys = {jit_key(kernel, args, kwargs) for args, kwargs in calls}
        assert len(keys) == 1, (name, keys)
        plain = jit_of(kernel)
        plain = JITFunction(plain.fn)  # the same kernel, everything specialised
        binder = create_function_from_signature(plain.signature, plain.params, make_backend(SM90))
        specialised = {str(binder(*args, **kwargs)[1]) for args, kwargs in calls}
        assert len(specialised) == (len(TOKENS) if TOKEN_ARGUMENTS[kernel] else 1), name


def test_the_gemm_autotuner_still_keys_on_the_token_bucket(monkeypatch):
    """do_not_specialize changes the JIT's key, not the autotuner's: that reads argument values (M_BUCKET)."""
    monkeypatch.setattr(kernel_utils, "INTERPRET", False)
    tuned = []
    tuner = gemm_core._AUTOTUNED[("ptr", 4, False)]
    monkeypatch.setattr(tuner, "run", lambda *args, **kwargs: tuned.append(
        kernel_utils.autotune_key(tuner, args, {k: v for k, v in kwargs.items() if k not in ("grid", "warmup")})))
    w = torch.randn(40, 64)
    for m in (203, 4096):
        gemm_core.gemm(torch.randn(m, 64), w, None, torch.empty(m, 40))
    assert [key[:3] for key in tuned] == [(40, 64, 256), (40, 64, 4096)]


# --------------------------------------------------------------------------------------------------------------------
# Capture: nothing compiled, tuned or loaded inside it
# --------------------------------------------------------------------------------------------------------------------
class FakeCompiled:
    """A CompiledKernel as the JIT's cache holds it: `module` is None until the first launch loads it."""
    module = None


def test_loaded_finds_the_key_jit_run_files(monkeypatch):
    """`loaded` computes the key JITFunction.run files a launch under (the installed Triton's run, driven here by
    a stand-in driver and compiler): found once run() has compiled it, loaded once its module is set; a launch
    with other options is another binary; another token count is the same one."""
    fake_driver = types.SimpleNamespace(active=types.SimpleNamespace(
        get_current_device=lambda: 0, get_current_stream=lambda device: 0, get_current_target=lambda: SM90))
    monkeypatch.setattr(triton.runtime.jit, "driver", fake_driver)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    jit = jit_of(rln_mod.bias_residual_layernorm_kernel)
    compiled = []

    def fake_compile(key, signature, device, constexprs, options, attrs, warmup):
        kernel = jit.device_caches[device][0][key] = FakeCompiled()
        compiled.append(kernel)
        return kernel

    monkeypatch.setattr(jit, "_do_compile", fake_compile)

    def launch(t, **options):
        h = torch.randn(t, 64)
        args = (h, h, h, h, h, h, h, h, t, 64, 1e-12, 64, 64, 64, 64)  # the eighth pointer: the statistics
        kwargs = dict(HAS_BIAS=True, HAS_LN_BIAS=True, PRE_NORM=False, RMS=False, ROWS=4, CHUNK=64, NUM_CHUNKS=1,
                      EVEN=True, num_warps=4, **options)
        return args, kwargs

    args, kwargs = launch(203)
    assert not kernel_utils.loaded(jit, args, kwargs)  # no binder for the device yet: nothing compiled
    assert jit.run(*args, grid=None, warmup=True, **kwargs) is compiled[0]
    assert not kernel_utils.loaded(jit, args, kwargs)  # compiled, not loaded
    compiled[0].module = object()
    assert kernel_utils.loaded(jit, args, kwargs)
    assert kernel_utils.loaded(jit, *launch(4096))
    assert kernel_utils.loaded(jit, *launch(1))
    assert not kernel_utils.loaded(jit, *launch(203, num_stages=2))
    jit.run(*args, grid=None, warmup=True, **kwargs)
    assert len(compiled) == 1  # run() found it: the same key


class RecordingCache(dict):
    """A JIT kernel cache that records the keys it is asked for."""

    def __init__(self):
        super().__init__()
        self.asked = []

    def get(self, key, default=None):
        self.asked.append(key)
        return super().get(key, default)


def _gemm_call():
    a, w = torch.randn(5, 64), torch.randn(40, 64) / 8
    out = torch.full((5, 40), float("nan"))
    return gemm_core.gemm_kernel, lambda: gemm_core.gemm(a, w, None, out), lambda: (out, F.linear(a, w))


def _attention_call():
    qkv = torch.randn(7, 3, 2, 16)
    cu = torch.tensor([0, 4, 7], dtype=torch.int32)

    def reference():
        q, k, v = qkv.unbind(1)
        parts = [F.scaled_dot_product_attention(q[s:e].transpose(0, 1), k[s:e].transpose(0, 1),
                                                v[s:e].transpose(0, 1), scale=0.25).transpose(0, 1).reshape(e - s, 32)
                 for s, e in ((0, 4), (4, 7))]
        return torch.cat(parts)

    result = {}
    return (attention_mod._attention_fwd_kernel,
            lambda: result.setdefault("out", attention_mod.launch(qkv, cu, 4, 0.25)),
            lambda: (result["out"], reference()))


def _row_call():
    h, r, b = torch.randn(6, 64), torch.randn(6, 64), torch.randn(64)
    result = {}
    return (rln_mod.bias_residual_layernorm_kernel,
            lambda: result.setdefault("out", rln_mod.bias_residual_layernorm(h, b, r, torch.ones(64),
                                                                            torch.zeros(64), 1e-12)),
            lambda: (result["out"], F.layer_norm(h + b + r, (64,), eps=1e-12)))


CALLS = {"gemm": _gemm_call, "attention": _attention_call, "residual_layernorm": _row_call}


@pytest.mark.parametrize("op", list(CALLS))
def test_a_capture_refuses_a_binary_not_loaded_and_launches_one_that_is(op, monkeypatch):
    """Simulated on CPU: a capture in progress (the launchers' predicate) and a JIT kernel cache without the
    launch's key. The launcher raises NotWarmedUp, saying to warm up, before anything is compiled or launched; once
    the key holds a loaded binary (what a warm-up leaves) the same call launches (here: the interpreter runs it)."""
    kernel, call, result = CALLS[op]()
    monkeypatch.setattr(kernel_utils, "INTERPRET", False)  # the launchers' capture path, not the interpreter's tile
    monkeypatch.setattr(kernel_utils, "capturing", lambda t: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    cache = RecordingCache()
    monkeypatch.setattr(kernel, "device_caches", {0: (cache, {}, SM90, None, binder_of(kernel))}, raising=False)
    monkeypatch.setattr(kernel, "debug", None, raising=False)
    with pytest.raises(kernel_utils.NotWarmedUp, match="eager forward") as refused:
        call()
    assert kernel.fn.__name__ in str(refused.value) and len(cache.asked) == 1
    loaded = FakeCompiled()
    loaded.module = object()
    cache[cache.asked[0]] = loaded
    call()
    got, want = result()
    assert (got - want).abs().max() <= 1e-4


def test_nothing_is_looked_up_outside_a_capture(monkeypatch):
    """The eager path pays one capture query per launch and no key computation."""
    monkeypatch.setattr(kernel_utils, "loaded", lambda *a: pytest.fail("looked up outside a capture"))
    for make in CALLS.values():
        _, call, result = make()
        call()
        got, want = result()
        assert (got - want).abs().max() <= 1e-4


def test_the_key_a_capture_asks_for_is_the_tuned_launchs(monkeypatch):
    """A pinned or captured launch passes the Config's all_kwargs(), as the autotuner passes its choice: the JIT key
    equals the autotuned launch's, so the binary an eager, tuned warm-up loaded is the one the capture finds."""
    tuner = gemm_core._AUTOTUNED[("ptr", 4, False)]
    a, w, out = torch.randn(5, 64), torch.randn(40, 64), torch.empty(5, 40)
    args = (a, w, a, out, 5, 40, 64, 16, a.stride(0), w.stride(0), w.stride(1), out.stride(0))
    meta = dict(HAS_BIAS=False, ACTIVATION=None, INPUT_PRECISION="ieee", GATED=False)
    choice = tuner.configs[1]
    tuned = []  # what Autotuner.run hands the JIT function for a cached choice
    monkeypatch.setattr(gemm_core.gemm_kernel, "run", lambda *a, grid, warmup, **k: tuned.append((a, k)))
    monkeypatch.setitem(tuner.cache, kernel_utils.autotune_key(tuner, args, meta), choice)
    tuner[(1,)](*args, **meta)
    monkeypatch.setattr(kernel_utils, "INTERPRET", False)
    monkeypatch.setattr(kernel_utils, "capturing", lambda t: True)
    captured = record(monkeypatch, gemm_core.gemm_kernel)
    gemm_core.gemm(a, w, None, out)
    pinned = record(monkeypatch, gemm_core.gemm_kernel)
    cfg = choice.kwargs
    monkeypatch.setattr(kernel_utils, "capturing", lambda t: False)
    gemm_core.gemm(a, w, None, out, config=(cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], choice.num_warps,
                                            choice.num_stages))
    assert len(tuned) == len(captured) == len(pinned) == 1
    assert jit_key(gemm_core.gemm_kernel, *tuned[0]) == jit_key(gemm_core.gemm_kernel, *captured[0]) == \
        jit_key(gemm_core.gemm_kernel, *pinned[0])


# --------------------------------------------------------------------------------------------------------------------
# The TMA GEMM's scratch: one buffer per (device, stream, size)
# --------------------------------------------------------------------------------------------------------------------
def test_one_scratch_buffer_per_device_stream_and_size(monkeypatch):
    """Triton's launcher calls the allocator at every TMA launch with (size, alignment, stream). Eagerly each
    (device, stream, size) allocates once; inside a capture every call allocates (from the graph's pool) and
    nothing is cached or handed out from the cache."""
    device, capturing, made = [0], [False], []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: device[0])
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    real_empty = torch.empty

    def counting_empty(size, dtype, device):
        assert dtype == torch.int8 and device.type == "cuda"
        made.append((device.index, size))
        return real_empty(size, dtype=dtype)

    monkeypatch.setattr(torch, "empty", counting_empty)
    monkeypatch.setattr(gemm_core, "_SCRATCH", {})
    first = gemm_core._scratch(16896, 128, 7)
    assert all(gemm_core._scratch(16896, 128, 7) is first for _ in range(100))
    assert made == [(0, 16896)]
    assert gemm_core._scratch(16896, 128, 8) is not first  # another stream
    assert gemm_core._scratch(512, 128, 7) is not first  # another size
    device[0] = 1
    assert gemm_core._scratch(16896, 128, 7) is not first  # another device, same stream handle (0 is everyone's)
    assert len(made) == 4
    capturing[0] = True
    device[0] = 0
    inside = [gemm_core._scratch(16896, 128, 7) for _ in range(3)]
    assert len(made) == 7 and all(t is not first for t in inside) and len(gemm_core._SCRATCH) == 4


def test_aot_specs_compile_the_unspecialised_arguments_unhinted():
    """tests/tooling/test_aot.py compiles what the JIT compiles: an argument in do_not_specialize is a plain i32
    there too (in the signature, hint None, never a constant), in every list it compiles: each op's aot_specs() and
    training's (the row kernels with dropout, attention's training forward and backward, bias_gelu's derivative)."""
    from fastbert.kernels import qkv_projection

    checked = 0
    lists = [module.aot_specs for module in (qkv_projection, bias_gelu_mod, attention_mod, rln_mod)]
    lists += [rln_mod.dropout_aot_specs, attention_bwd.backward_aot_specs, bias_gelu_mod.backward_aot_specs]
    for specs in lists:
        for spec in specs():
            for name in jit_of(spec["fn"]).do_not_specialize:
                assert spec["signature"].get(name) == "i32" and name not in spec["constexprs"], (spec["name"], name)
                assert name in spec.get("hints", {}) and spec["hints"][name] is None, (spec["name"], name)
                checked += 1
    assert checked > 100
