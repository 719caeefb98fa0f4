"""The GEMM-with-epilogue kernels: qkv_projection, bias_gelu and their shared core (kernels/gemm.py).

Each result is checked against the torch twin in fastbert/ops.py (the definition) and an fp64 reference computed
from the same rounded inputs; bias_gelu also against transformers' BertIntermediate with the weights shared.
Tolerances: fp32 <= 1e-5 absolute (outputs are O(1): weights ~ N(0, 1/K), so the K-term fp32 sum carries ~1e-6 of
rounding); fp16/bf16 <= 2x the twin's own max error against fp64 (+1e-6 so an exactly-rounded twin does not
force a zero). Outputs are poisoned with NaN first, and NaN never passes.

Without CUDA this runs Triton's interpreter (tests/conftest.py). The interpreter cannot run bf16 tl.dot
(triton-lang/triton#11584: it multiplies the bit patterns), so bf16 GEMM cases are skipped on CPU and run on CUDA.
"""
import contextlib

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from helpers import (
    DEVICE,
    FP32_TOL,
    assert_kernel_matches,
    launched_precisions,
    poisoned,
    tf32_matmuls,
    tuning_in_fresh_processes,
)

from fastbert import ops
from fastbert.kernels import attention as attention_mod
from fastbert.kernels import bias_gelu as bias_gelu_mod
from fastbert.kernels import gemm as gemm_core
from fastbert.kernels import qkv_projection as qkv_mod
from fastbert.kernels import residual_layernorm as rln_mod
from fastbert.kernels import utils as kernel_utils
from fastbert.kernels.bias_gelu import bias_gelu
from fastbert.kernels.qkv_projection import qkv_projection
from fastbert.numerics import error_bound, max_error

BF16_GEMM_ON_CPU = pytest.mark.skipif(
    DEVICE == "cpu", reason="Triton's interpreter cannot run bf16 tl.dot (triton-lang/triton#11584); runs on CUDA")
DTYPES = [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=BF16_GEMM_ON_CPU)]
TMA_DTYPES = [torch.float16, pytest.param(torch.bfloat16, marks=BF16_GEMM_ON_CPU)]
TMA_ON_CUDA = pytest.mark.skipif(
    DEVICE == "cuda" and not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9),
    reason="the TMA kernel is built for sm_90 (wgmma + TMA); this GPU is not one")


def make(shape, dtype, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype).to(DEVICE)


def strided_rows(T, H, dtype, seed=0):
    """x [T, H] whose rows are not contiguous: every other row of a wider buffer (x = big[::2, :H])."""
    big = make((2 * T, H + 64), dtype, seed=seed)
    x = big[::2, :H]
    assert not x.is_contiguous() and x.stride() == (2 * (H + 64), 1)
    return x



def act64(h, activation):
    if activation is None:
        return h
    if activation == "relu":
        return F.relu(h)
    if activation == "silu":
        return h * torch.sigmoid(h)
    return F.gelu(h, approximate="tanh" if activation == "gelu_tanh" else "none")


# --------------------------------------------------------------------------------------------------------------------
# qkv_projection
# --------------------------------------------------------------------------------------------------------------------
QKV_CASES = [  # (T, H, num_heads, x layout)
    (1, 384, 6, "contiguous"),
    (7, 384, 6, "strided_rows"),
    (13, 384, 6, "column_slice"),
    (131, 384, 6, "contiguous"),
    (7, 768, 12, "contiguous"),
    (13, 768, 12, "strided_rows"),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T,H,nh,layout", QKV_CASES, ids=[f"T{c[0]}-H{c[1]}-{c[3]}" for c in QKV_CASES])
def test_qkv_projection(T, H, nh, layout, dtype):
    if layout == "strided_rows":
        x = strided_rows(T, H, dtype)
    elif layout == "column_slice":  # x = big[:, :H]
        x = make((T, 3 * H), dtype)[:, :H]
    else:
        x = make((T, H), dtype)
    w = make((3 * H, H), dtype, scale=H ** -0.5, seed=1)
    b = make((3 * H,), dtype, scale=0.5, seed=2)
    out = poisoned((T, 3, nh, H // nh), dtype)

    qkv = qkv_projection(x, w, b, nh, out=out)

    assert qkv.data_ptr() == out.data_ptr() and qkv.shape == (T, 3, nh, H // nh)
    assert qkv.stride() == (3 * H, H, H // nh, 1)  # the packed [T, 3H] buffer attention reads through strides
    twin = ops.qkv_projection_torch(x, w, b, nh)
    ref64 = F.linear(x.double(), w.double(), b.double()).view(T, 3, nh, -1)
    assert_kernel_matches(qkv, twin, ref64, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_qkv_projection_no_bias_and_flat_out(dtype):
    T, H, nh = 13, 384, 6
    x, w = make((T, H), dtype), make((3 * H, H), dtype, scale=H ** -0.5, seed=1)
    out = poisoned((T, 3 * H), dtype)  # the flat [T, 3H] form is accepted too
    qkv = qkv_projection(x, w, None, nh, out=out)
    assert qkv.shape == (T, 3, nh, 64) and qkv.data_ptr() == out.data_ptr()
    assert_kernel_matches(qkv, ops.qkv_projection_torch(x, w, None, nh),
                   F.linear(x.double(), w.double()).view(T, 3, nh, -1), dtype)
    fresh = qkv_projection(x, w, None, nh)  # allocates its own contiguous buffer
    assert fresh.is_contiguous() and torch.equal(fresh, qkv)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_qkv_projection_grouped_heads(dtype):
    """Grouped key/value heads (EuroBERT): W [(nh + 2 kv) hd, H] -> [T, nh + 2 kv, hd], the q heads then the k and v
    heads, one GEMM; a width that does not split into those heads is refused by name."""
    T, H, nh, kv, hd = 13, 256, 4, 2, 64
    x, w = make((T, H), dtype), make(((nh + 2 * kv) * hd, H), dtype, scale=H ** -0.5, seed=1)
    b = make(((nh + 2 * kv) * hd,), dtype, scale=0.5, seed=2)
    out = poisoned((T, nh + 2 * kv, hd), dtype)
    qkv = qkv_projection(x, w, b, nh, out=out, kv_heads=kv)
    assert qkv.data_ptr() == out.data_ptr() and qkv.shape == (T, nh + 2 * kv, hd)
    assert_kernel_matches(qkv, ops.qkv_projection_torch(x, w, b, nh, kv_heads=kv),
                          F.linear(x.double(), w.double(), b.double()).view(T, nh + 2 * kv, hd), dtype)
    with pytest.raises(ValueError, match=r"divisible by num_heads \+ 2 \* kv_heads = 7"):
        qkv_projection(x, w, b, 3, kv_heads=2)


def test_qkv_projection_through_dispatch():
    """ops.qkv_projection(backend="triton") reaches this launcher and matches backend="torch"."""
    T, H, nh = 7, 384, 6
    x, w, b = make((T, H), torch.float32), make((3 * H, H), torch.float32, H ** -0.5, 1), make((3 * H,), torch.float32)
    got = ops.qkv_projection(x, w, b, nh, backend="triton")
    want = ops.qkv_projection(x, w, b, nh, backend="torch")
    assert (got - want).abs().max().item() <= FP32_TOL


# --------------------------------------------------------------------------------------------------------------------
# bias_gelu
# --------------------------------------------------------------------------------------------------------------------
BIAS_GELU_CASES = [  # (T, H, I, x layout)
    (1, 384, 1536, "contiguous"),
    (7, 384, 100, "strided_rows"),
    (13, 384, 1536, "column_slice"),
    (131, 384, 100, "contiguous"),
    (7, 768, 100, "contiguous"),
]


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "relu", "silu"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T,H,I,layout", BIAS_GELU_CASES,
                         ids=[f"T{c[0]}-H{c[1]}-I{c[2]}-{c[3]}" for c in BIAS_GELU_CASES])
def test_bias_gelu(T, H, I, layout, dtype, activation):
    if layout == "strided_rows":
        x = strided_rows(T, H, dtype)
    elif layout == "column_slice":
        x = make((T, H + 96), dtype)[:, :H]
    else:
        x = make((T, H), dtype)
    w = make((I, H), dtype, scale=H ** -0.5, seed=1)
    b = make((I,), dtype, scale=0.5, seed=2)
    out = poisoned((T, I), dtype)

    y = bias_gelu(x, w, b, activation, out=out)

    assert y.data_ptr() == out.data_ptr()
    twin = ops.bias_gelu_torch(x, w, b, activation)
    ref64 = act64(F.linear(x.double(), w.double(), b.double()), activation)
    assert_kernel_matches(y, twin, ref64, dtype)


PRIME_CASES = [(1, 97, 101), (13, 97, 131), (37, 193, 61)]  # (T, H, I): odd everywhere, one token, I < one tile


@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("T,H,I", PRIME_CASES, ids=[f"T{c[0]}-H{c[1]}-I{c[2]}" for c in PRIME_CASES])
def test_bias_gelu_silu_prime_shapes(T, H, I, dtype, gated):
    """SiLU (SwiGLU when gated) on prime sizes: partial tiles in T, H (K) and I, a single token. Plain: wide inputs
    (pre-activations of std 3, to ~+-12, where the sigmoid saturates; the whole range: test_gelu_epilogue_*); gated:
    unit ones, so that act(a) * g stays O(1) where the fp32 bar is absolute."""
    N = 2 * I if gated else I
    x = make((T, H), dtype, scale=1.0 if gated else 3.0)
    w = make((N, H), dtype, scale=H ** -0.5, seed=1)
    b = make((N,), dtype, scale=0.5, seed=2)
    y = bias_gelu(x, w, b, "silu", gated=gated, out=poisoned((T, I), dtype))
    twin = ops.bias_gelu_torch(x, w, b, "silu", gated=gated)
    ref64 = gated64(x, w, b, "silu") if gated else act64(F.linear(x.double(), w.double(), b.double()), "silu")
    assert_kernel_matches(y, twin, ref64, dtype)


def test_bias_gelu_large_T_fp16():
    """131 tokens x I=1536: several row and column blocks, the full FFN-in width of MiniLM."""
    dtype = torch.float16
    x, w, b = make((131, 384), dtype), make((1536, 384), dtype, 384 ** -0.5, 1), make((1536,), dtype, 0.5, 2)
    y = bias_gelu(x, w, b, "gelu", out=poisoned((131, 1536), dtype))
    assert_kernel_matches(y, ops.bias_gelu_torch(x, w, b, "gelu"),
                          F.gelu(F.linear(x.double(), w.double(), b.double())), dtype)


@pytest.mark.parametrize("hidden_act", ["gelu", "gelu_new", "gelu_pytorch_tanh", "silu"])
def test_bias_gelu_matches_bert_intermediate(hidden_act):
    transformers = pytest.importorskip("transformers")
    from transformers.models.bert.modeling_bert import BertIntermediate

    config = transformers.BertConfig(hidden_size=384, intermediate_size=1536, num_attention_heads=6,
                                     hidden_act=hidden_act)
    torch.manual_seed(0)
    module = BertIntermediate(config).to(DEVICE).eval()
    T = 13
    x = make((T, 384), torch.float32)
    with torch.no_grad():
        want = module(x[None])[0]
        got = bias_gelu(x, module.dense.weight, module.dense.bias, ops.ACTIVATIONS[hidden_act],
                        out=poisoned((T, 1536), torch.float32))
    assert torch.isfinite(got).all()
    assert (got - want).abs().max().item() <= FP32_TOL


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("hidden_act", sorted(ops.ACTIVATIONS))
def test_twin_activations_are_hf_act2fn(hidden_act, dtype):
    """Every hidden_act the model accepts: the twins' activation, allocating and into a buffer, is bit-for-bit
    transformers' ACT2FN[hidden_act], on a contiguous tensor and on a column slice (the gated twin's input half, which
    torch's kernels may round differently from a contiguous copy); so is the gated twin with a workspace against the
    allocating one. gelu_new is HF's Python formula of the tanh GELU, which the twin computes as F.gelu's tanh form:
    within the same bound of the fp64 function as HF's own rounding."""
    transformers = pytest.importorskip("transformers")
    from fastbert import twins
    g = torch.Generator().manual_seed(0)
    h = torch.cat([torch.randn(1000, 37, generator=g, dtype=torch.float64) * 6,
                   torch.tensor([[0.0, -0.0, 88.0, -88.0, 1e4, -1e4, 30.0] * 5 + [-30.0, 0.5]],
                                dtype=torch.float64)]).to(dtype)
    activation = ops.ACTIVATIONS[hidden_act]
    for a in (h, torch.cat([h, h], dim=1)[:, :37]):
        want = transformers.activations.ACT2FN[hidden_act](a)
        out = torch.empty_like(h)
        assert twins.activate_into(a, activation, out).data_ptr() == out.data_ptr()
        for got in (twins.activate(a, activation), out):
            if hidden_act == "gelu_new":
                ref64 = F.gelu(a.double(), approximate="tanh")
                assert max_error(got, ref64) <= error_bound(dtype, max_error(want, ref64)), hidden_act
            else:
                assert torch.equal(got, want), hidden_act
    x, w = make((13, 64), dtype), make((2 * 37, 64), dtype, 0.125, 1)
    assert torch.equal(ops.bias_gelu_torch(x, w, None, activation, gated=True, workspace=twins.Workspace()),
                       ops.bias_gelu_torch(x, w, None, activation, gated=True))


# --------------------------------------------------------------------------------------------------------------------
# bias_gelu, gated (GeGLU): weight [2I, H] = HF's Wi (input half, then gate half), act(a) * g [T, I]
# --------------------------------------------------------------------------------------------------------------------
def gated64(x, w, b, activation):
    """act(a) * g in fp64 from the same rounded inputs."""
    a, g = F.linear(x.double(), w.double(), None if b is None else b.double()).chunk(2, dim=-1)
    return act64(a, activation) * g


GATED_CASES = [  # (T, H, I, x layout, bias): the interpreter's tile is 32 x 128, so I = 100 and 200 leave partial
    (1, 64, 100, "contiguous", True),          # column blocks, T = 37 a partial row block, T = 1 a single token
    (37, 64, 200, "contiguous", False),
    (7, 384, 100, "strided_rows", True),
    (13, 96, 40, "column_slice", False),
]


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "silu"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T,H,I,layout,has_bias", GATED_CASES,
                         ids=[f"T{c[0]}-H{c[1]}-I{c[2]}-{c[3]}{'' if c[4] else '-nobias'}" for c in GATED_CASES])
def test_bias_gelu_gated(T, H, I, layout, has_bias, dtype, activation):
    if layout == "strided_rows":
        x = strided_rows(T, H, dtype)
    elif layout == "column_slice":
        x = make((T, H + 32), dtype)[:, :H]
    else:
        x = make((T, H), dtype)
    w = make((2 * I, H), dtype, scale=H ** -0.5, seed=1)
    b = make((2 * I,), dtype, scale=0.5, seed=2) if has_bias else None
    out = poisoned((T, I), dtype)

    y = bias_gelu(x, w, b, activation, gated=True, out=out)

    assert y.data_ptr() == out.data_ptr() and y.shape == (T, I)
    twin = ops.bias_gelu_torch(x, w, b, activation, gated=True)
    assert_kernel_matches(y, twin, gated64(x, w, b, activation), dtype)


def test_bias_gelu_gated_relu_and_fresh_output():
    """relu gated (the launcher takes every activation) and out=None: a fresh [T, I] tensor."""
    x, w, b = make((13, 64), torch.float32), make((200, 64), torch.float32, 0.125, 1), make((200,), torch.float32)
    y = bias_gelu(x, w, b, "relu", gated=True)
    assert y.shape == (13, 100) and y.is_contiguous()
    assert_kernel_matches(y, ops.bias_gelu_torch(x, w, b, "relu", gated=True), gated64(x, w, b, "relu"),
                          torch.float32)


@pytest.mark.parametrize("activation", ["gelu", "silu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_gemm_gated_every_config(dtype, activation):
    """Every gated tile of the pointer kernel on M=131, N=100 (2N = 200 weight rows), K=200: partial in M, N and K."""
    M, N, K = 131, 100, 200
    a, w, b = make((M, K), dtype), make((2 * N, K), dtype, K ** -0.5, 1), make((2 * N,), dtype, 0.5, 2)
    twin = ops.bias_gelu_torch(a, w, b, activation, gated=True)
    ref64 = gated64(a, w, b, activation)
    for cfg in gemm_core.gated_configs(gemm_core.gemm_configs(a.element_size())):
        out = gemm_core.gemm(a, w, b, poisoned((M, N), dtype), activation, gated=True, config=cfg, kernel="ptr")
        assert_kernel_matches(out, twin, ref64, dtype)


@TMA_ON_CUDA
@pytest.mark.parametrize("dtype", [torch.float16, pytest.param(torch.bfloat16, marks=BF16_GEMM_ON_CPU)], ids=str)
@pytest.mark.parametrize("has_bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("activation", ["gelu_tanh", "silu"])
def test_gemm_tma_gated_every_config(dtype, has_bias, activation):
    """The persistent TMA kernel's gated tiles: the gate half through its own descriptor at row N, clipped at N rows
    (M=131, N=104, K=200: 16-byte rows, partial tiles everywhere)."""
    M, N, K = 131, 104, 200
    a, w = make((M, K), dtype), make((2 * N, K), dtype, K ** -0.5, 1)
    b = make((2 * N,), dtype, 0.5, 2) if has_bias else None
    twin = ops.bias_gelu_torch(a, w, b, activation, gated=True)
    ref64 = gated64(a, w, b, activation)
    for cfg in gemm_core.gated_configs(gemm_core.gemm_tma_configs(warp_specialize=True)):
        out = gemm_core.gemm(a, w, b, poisoned((M, N), dtype), activation, gated=True, config=cfg, kernel="tma")
        assert_kernel_matches(out, twin, ref64, dtype)


def test_gated_weight_strides():
    """The gate half is found through the weight's strides: a transposed buffer (stride_wk = 2I) and a row slice of
    a wider buffer (stride_wn > K)."""
    M, N, K = 13, 100, 64
    a, b = make((M, K), torch.float32), make((2 * N,), torch.float32, 0.5, 2)
    transposed = make((K, 2 * N), torch.float32, K ** -0.5, 1).t()
    row_slice = make((2 * N, K + 32), torch.float32, K ** -0.5, 1)[:, :K]
    for w in (transposed, row_slice):
        y = bias_gelu(a, w, b, "gelu", gated=True, out=poisoned((M, N), torch.float32))
        assert_kernel_matches(y, ops.bias_gelu_torch(a, w, b, "gelu", gated=True), gated64(a, w, b, "gelu"),
                              torch.float32)


@pytest.mark.parametrize("hidden_activation", ["gelu", "silu"])
@pytest.mark.parametrize("mlp_bias", [False, True])
def test_gated_matches_modernbert_mlp(mlp_bias, hidden_activation):
    """The kernel, then Wo, is transformers' ModernBertMLP (GeGLU, or SwiGLU with "silu": its act is HF's
    ACT2FN[hidden_activation]; random weights) in fp32."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.modernbert.modeling_modernbert import ModernBertMLP

    config = transformers.ModernBertConfig(hidden_size=64, intermediate_size=100, mlp_bias=mlp_bias,
                                           hidden_activation=hidden_activation)
    torch.manual_seed(0)
    module = ModernBertMLP(config).to(DEVICE).eval()
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, 0.2)
    x = make((13, 64), torch.float32)
    with torch.no_grad():
        want = module(x)
        h = bias_gelu(x, module.Wi.weight, module.Wi.bias, ops.ACTIVATIONS[config.hidden_activation], gated=True,
                      out=poisoned((13, 100), torch.float32))
        got = F.linear(h, module.Wo.weight, module.Wo.bias)
    assert torch.isfinite(got).all()
    assert (got - want).abs().max().item() <= FP32_TOL


def test_gated_configs_halve_the_columns():
    """A gated tile holds two accumulators and reads two W panels: its list is the plain one with BLOCK_N halved
    (32-column tiles kept, and none halved onto their shape), and the autotuners and capture configs of the gated
    variants use it."""
    assert gemm_core.gated_configs(gemm_core.gemm_configs(2)) == [
        (128, 64, 64, 8, 3), (128, 32, 64, 8, 4), (64, 64, 64, 4, 4), (64, 32, 128, 4, 4), (128, 32, 64, 4, 4)]
    assert gemm_core.gated_configs(gemm_core.gemm_configs(4)) == [
        (128, 64, 32, 8, 3), (128, 32, 32, 8, 4), (64, 64, 32, 4, 4), (64, 32, 16, 4, 4)]
    assert gemm_core.gated_configs(gemm_core.gemm_tma_configs(warp_specialize=True)) == [
        (128, 128, 64, 8, 3, False), (256, 64, 64, 8, 3, False), (128, 64, 64, 8, 4, False),
        (64, 64, 64, 4, 4, False), (128, 32, 64, 4, 4, False), (64, 32, 64, 4, 4, False),
        (128, 64, 64, 4, 4, True), (128, 32, 64, 4, 4, True)]
    assert "GATED" in gemm_core._AUTOTUNE_KEY
    for (kernel, size, gated), tuner in gemm_core._AUTOTUNED.items():
        want = gemm_core.kernel_configs(kernel, size, gated)
        assert [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"]) for c in tuner.configs] == \
            [c[:3] for c in want]
        assert gemm_core.CAPTURE_CONFIGS[(kernel, size, gated)] == [c for c in want if len(c) < 6 or not c[5]][0]


def test_gated_launch_takes_the_gated_variant(monkeypatch):
    """A gated launch files under its own autotuner and, in a capture, takes the gated capture tile (half the
    columns), never the plain variant's."""
    monkeypatch.setattr(kernel_utils, "INTERPRET", False)
    monkeypatch.setattr(kernel_utils, "capturing", lambda t: True)
    fixed = []
    real_run = gemm_core.gemm_kernel.run
    monkeypatch.setattr(gemm_core.gemm_kernel, "run", lambda *args, **kwargs: (fixed.append(kwargs),
                                                                               real_run(*args, **kwargs)))
    a, w = make((5, 64), torch.float32), make((80, 64), torch.float32, 0.125, 1)
    out = poisoned((5, 40), torch.float32)
    with tf32_matmuls(False):
        gemm_core.gemm(a, w, None, out, "gelu", gated=True)
    assert len(fixed) == 1 and fixed[0]["GATED"] is True
    blocks = (fixed[0]["BLOCK_M"], fixed[0]["BLOCK_N"], fixed[0]["BLOCK_K"])
    assert blocks == gemm_core.CAPTURE_CONFIGS[("ptr", 4, True)][:3] != gemm_core.CAPTURE_CONFIGS[("ptr", 4, False)][:3]
    assert max_error(out, gated64(a, w, None, "gelu")) <= FP32_TOL


def test_gated_zero_tokens():
    x, w = make((0, 64), torch.float32), make((200, 64), torch.float32)
    assert bias_gelu(x, w, None, gated=True).shape == (0, 100)


def test_gated_through_dispatch():
    x, w, b = make((7, 64), torch.float32), make((200, 64), torch.float32, 0.125, 1), make((200,), torch.float32)
    got = ops.bias_gelu(x, w, b, "gelu_tanh", gated=True, backend="triton")
    want = ops.bias_gelu(x, w, b, "gelu_tanh", gated=True, backend="torch")
    assert got.shape == (7, 100) and max_error(got, want) <= FP32_TOL


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_gated_custom_op(backend):
    """fastbert::bias_gelu with gated=True, as a traced forward records it (traced_ops), on either backend; and
    torch.library's own checks of its schema and fake shapes ([T, I] from W [2I, H])."""
    from fastbert import dispatch
    x, w, b = make((7, 64), torch.float32), make((200, 64), torch.float32, 0.125, 1), make((200,), torch.float32)
    run = dispatch.traced_ops(dict.fromkeys(ops.OPS, backend))["bias_gelu"]
    got = run(x, w, b, "gelu", gated=True)
    assert got.shape == (7, 100) and max_error(got, gated64(x, w, b, "gelu")) <= FP32_TOL
    torch.library.opcheck(torch.ops.fastbert.bias_gelu.default, (x, w, b, "gelu", backend, True),
                          test_utils=("test_schema", "test_faketensor"))


# --------------------------------------------------------------------------------------------------------------------
# The GEMM core: every autotune config's edge handling, swizzle groups, weight strides, TF32 switch
# --------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_gemm_every_config(dtype):
    """M=131, N=100, K=200 is a partial tile in M, N and K for every config in the autotune list (on CUDA the
    configs really run here; the interpreter runs the same kernel code with each tile shape)."""
    M, N, K = 131, 100, 200
    a, w, b = make((M, K), dtype), make((N, K), dtype, K ** -0.5, 1), make((N,), dtype, 0.5, 2)
    ref64 = F.gelu(F.linear(a.double(), w.double(), b.double()))
    twin = ops.bias_gelu_torch(a, w, b, "gelu")
    for cfg in gemm_core.gemm_configs(a.element_size()):
        out = gemm_core.gemm(a, w, b, poisoned((M, N), dtype), "gelu", config=cfg, kernel="ptr")
        assert_kernel_matches(out, twin, ref64, dtype)


@TMA_ON_CUDA
@pytest.mark.parametrize("dtype", TMA_DTYPES, ids=str)
@pytest.mark.parametrize("activation", ["gelu", None])
def test_gemm_tma_every_config(dtype, activation):
    """The persistent TMA kernel, every config, on edges in M, N and K that TMA must clip (131 x 104 x 200: rows of
    16-byte multiples, as TMA requires). On CPU the interpreter runs it with 4 programs, so each program walks
    several tiles (the persistent loop); on an H100/H200 it is the real TMA + wgmma code."""
    M, N, K = 131, 104, 200
    a, w, b = make((M, K), dtype), make((N, K), dtype, K ** -0.5, 1), make((N,), dtype, 0.5, 2)
    h64 = F.linear(a.double(), w.double(), b.double())
    ref64 = F.gelu(h64) if activation else h64
    twin = ops.bias_gelu_torch(a, w, b, "gelu") if activation else F.linear(a, w, b)
    for cfg in gemm_core.gemm_tma_configs(warp_specialize=True):  # the opt-in tiles too
        out = gemm_core.gemm(a, w, b, poisoned((M, N), dtype), activation, config=cfg, kernel="tma")
        assert_kernel_matches(out, twin, ref64, dtype)


@TMA_ON_CUDA
def test_gemm_tma_strided_rows_no_bias():
    """x = big[::2, :H] (row stride a 16-byte multiple) and a single token, no bias: still TMA layouts."""
    dtype = torch.float16
    for T in (1, 67):
        x = strided_rows(T, 384, dtype) if T > 1 else make((1, 384), dtype)
        w = make((1152, 384), dtype, 384 ** -0.5, 1)
        assert gemm_core.tma_compatible(x, w, torch.empty((T, 1152), dtype=dtype))
        out = gemm_core.gemm(x, w, None, poisoned((T, 1152), dtype), None, config=(64, 128, 64, 4, 4), kernel="tma")
        assert_kernel_matches(out, F.linear(x, w), F.linear(x.double(), w.double()), dtype)


def test_tma_layout_rules():
    """TMA needs 16-byte row strides and bases and unit last strides; fp32 always takes the pointer kernel."""
    def t(*shape, dtype=torch.float16):
        return torch.empty(shape, dtype=dtype)
    a, w, out = t(7, 384), t(104, 384), t(7, 104)
    assert gemm_core.tma_compatible(a, w, out)
    assert not gemm_core.tma_compatible(a.float(), w.float(), out.float())
    assert not gemm_core.tma_compatible(t(7, 100), t(104, 100), out)  # K=100: 200-byte rows
    assert not gemm_core.tma_compatible(t(7, 388)[:, :384], w, out)  # row stride 776 B
    assert not gemm_core.tma_compatible(t(7, 385)[:, 1:], w, out)  # base 2 B past an aligned one
    assert not gemm_core.tma_compatible(a, t(384, 104).t(), out)  # W stored transposed
    assert not gemm_core.tma_compatible(a, w, t(7, 100))  # N=100: 200-byte output rows
    assert not gemm_core.use_tma(a, w, out)  # CPU tensors: never the TMA path by default


def test_prune_configs_skips_tiles_taller_than_the_tokens():
    configs = [gemm_core._triton_config(c) for c in gemm_core.gemm_tma_configs()]
    rows = lambda kept: sorted({c.kwargs["BLOCK_M"] for c in kept})  # noqa: E731
    assert rows(gemm_core.prune_configs(configs, {"M_BUCKET": 16})) == [64]
    assert rows(gemm_core.prune_configs(configs, {"M_BUCKET": 128})) == [64, 128]
    assert rows(gemm_core.prune_configs(configs, {"M_BUCKET": 4096})) == [64, 128, 256]


@pytest.mark.cuda
@pytest.mark.skipif(DEVICE == "cpu", reason="a CUDA test: Triton's interpreter switches the autotuner's disk cache off "
                                            "(Autotuner: cache_results ... and not knobs.runtime.interpret), and "
                                            "without it no compiled kernel runs")
def test_autotuner_keeps_its_choice_across_processes(tmp_path):
    """A GEMM tuned in one process is not benchmarked again in the next one sharing the Triton cache dir: the
    second process loads the first one's choice from disk."""
    call = ("from fastbert.kernels import gemm\n"
            "from fastbert.kernels.bias_gelu import bias_gelu\n"
            "x = torch.randn(64, 256, device='cuda', dtype=torch.float16)\n"
            "w = torch.randn(512, 256, device='cuda', dtype=torch.float16) * 0.06\n"
            "out = bias_gelu(x, w, torch.zeros(512, device='cuda', dtype=torch.float16), 'gelu')\n"
            "TUNER = gemm._AUTOTUNED[('tma' if gemm.use_tma(x, w, out) else 'ptr', 2, False)]")
    first, second = tuning_in_fresh_processes(call, tmp_path)
    assert first["benchmarks"] > 0, first
    assert second == {"benchmarks": 0, "choice": first["choice"]}, (first, second)


def test_warp_specialization_is_opt_in():
    """The default sm_90 autotune list has no warp-specialized tile; FASTBERT_WARP_SPECIALIZE=1 adds the two 4-warp
    ones. The autotuners are built at import, so each setting is checked in a fresh process."""
    import os
    import subprocess
    import sys
    default = gemm_core.gemm_tma_configs(warp_specialize=False)
    opted = gemm_core.gemm_tma_configs(warp_specialize=True)
    assert not any(c[5] for c in default)
    assert [c for c in opted if not c[5]] == default
    assert [c[:5] for c in opted if c[5]] == [(128, 128, 64, 4, 4), (128, 64, 64, 4, 4)]
    code = ("from fastbert.kernels import gemm; "
            "print(sum(bool(c.kwargs['WARP_SPECIALIZE']) for c in gemm._AUTOTUNED[('tma', 2, False)].configs))")
    base = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FASTBERT_WARP_SPECIALIZE")}
    for value, expected in ((None, "0"), ("0", "0"), ("1", "2")):
        env = dict(base) if value is None else {**base, "FASTBERT_WARP_SPECIALIZE": value}
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
        assert result.returncode == 0, result.stderr[-2000:]
        assert result.stdout.strip() == expected, (value, result.stdout)


def test_gemm_grouped_ordering_partial_group():
    """600 rows of 64 = 10 row-blocks: one full group of GROUP_M=8 and one partial group of 2, with 4 column
    blocks; every element must be written exactly by the right program."""
    M, N, K = 600, 100, 64
    dtype = torch.float16
    a, w = make((M, K), dtype), make((N, K), dtype, K ** -0.5, 1)
    cfg = [c for c in gemm_core.gemm_configs(2) if c[:2] == (64, 32)][0]
    out = gemm_core.gemm(a, w, None, poisoned((M, N), dtype), None, config=cfg)
    assert_kernel_matches(out, F.linear(a, w), F.linear(a.double(), w.double()), dtype)


@pytest.mark.parametrize("w_layout", ["transposed_storage", "row_slice"])
def test_gemm_weight_strides(w_layout):
    """W is read through its strides: a transposed buffer (stride_wk = N) and a column slice (stride_wn > K)."""
    M, N, K = 13, 100, 384
    dtype = torch.float32
    a = make((M, K), dtype)
    if w_layout == "transposed_storage":
        w = make((K, N), dtype, K ** -0.5, 1).t()
        assert w.stride() == (1, N)
    else:
        w = make((N, K + 32), dtype, K ** -0.5, 1)[:, :K]
    b = make((N,), dtype, 0.5, 2)
    y = bias_gelu(a, w, b, "gelu_tanh", out=poisoned((M, N), dtype))
    assert_kernel_matches(y, ops.bias_gelu_torch(a, w, b, "gelu_tanh"),
                   F.gelu(F.linear(a.double(), w.double(), b.double()), approximate="tanh"), dtype)


# 1 + 2^-12 is exact in fp32 but not in tf32 (10 mantissa bits), which rounds it to 1: a dot over K such values
# tells the two precisions apart by K * 2^-12.
TF32_BLIND = 1 + 2 ** -12


@pytest.mark.parametrize("allow_tf32", [False, True])
def test_tf32_switch_reaches_the_kernel(allow_tf32, monkeypatch):
    """fp32 launches with input_precision "tf32" exactly when torch's switch is on; fp16 always "ieee" (one
    compile). What the precision does to the numbers: test_tf32_switch_changes_the_numbers (CUDA)."""
    launched = launched_precisions(monkeypatch, gemm_core.gemm_kernel)
    with tf32_matmuls(allow_tf32):
        for dtype in (torch.float32, torch.float16):
            x, w = make((7, 64), dtype), make((32, 64), dtype, 0.125, 1)
            gemm_core.gemm(x, w, None, poisoned((7, 32), dtype), config=(64, 32, 32, 4, 1), kernel="ptr")
    assert launched == [("tf32" if allow_tf32 else "ieee"), "ieee"]


@pytest.mark.cuda
@pytest.mark.skipif(DEVICE == "cpu", reason="Triton's interpreter runs every fp32 dot in full fp32 whatever "
                                            "input_precision says: only a GPU can tell ieee from tf32")
@pytest.mark.parametrize("allow_tf32", [False, True])
def test_tf32_switch_changes_the_numbers(allow_tf32):
    """x = 1 + 2^-12 everywhere, W = 1: "ieee" gives K (1 + 2^-12) exactly, "tf32" rounds x to 1 and gives K."""
    M, N, K = 7, 48, 64
    x = torch.full((M, K), TF32_BLIND, device=DEVICE)
    w = torch.ones(N, K, device=DEVICE)
    with tf32_matmuls(allow_tf32):
        y = qkv_projection(x, w, None, 2).reshape(M, N)
    assert torch.equal(y, torch.full_like(y, K if allow_tf32 else K * TF32_BLIND)), y[0, :4].tolist()


def test_zero_tokens():
    x = make((0, 384), torch.float32)
    w, b = make((100, 384), torch.float32), make((100,), torch.float32)
    assert bias_gelu(x, w, b).shape == (0, 100)
    assert qkv_projection(x, make((1152, 384), torch.float32), None, 6).shape == (0, 3, 6, 64)


# --------------------------------------------------------------------------------------------------------------------
# Bad inputs: every one fails before launch, with a message naming the offending value
# --------------------------------------------------------------------------------------------------------------------
def _qkv_args(dtype=torch.float32):
    return make((7, 384), dtype), make((1152, 384), dtype), make((1152,), dtype)


@pytest.mark.parametrize("case,exc,match", [
    ("x_1d", ValueError, r"x must be 2-D"),
    ("x_3d", ValueError, r"x must be 2-D"),
    ("k_mismatch", ValueError, r"x.shape\[1\]=384 must match weight.shape\[1\]=383"),
    ("bias_shape", ValueError, r"bias must be \[1152\]"),
    ("dtype_mismatch", TypeError, r"share one dtype.*weight.dtype=torch.float16"),
    ("int_dtype", TypeError, r"x.dtype=torch.int64 is not one of"),
    ("not_a_tensor", TypeError, r"weight must be a torch.Tensor"),
    ("heads_not_dividing", ValueError, r"divisible by 3 \* num_heads = 15"),
    ("heads_zero", ValueError, r"num_heads must be a positive int"),
    ("weight_not_3h", ValueError, r"weight.shape\[0\]=1000 must be 3 \* num_heads \* head_dim"),
    ("device_mismatch", ValueError, r"one device.*weight on meta"),
    ("x_column_stride", ValueError, r"unit-stride last dimension"),
    ("x_column_stride_one_row", ValueError, r"x.stride\(\)=\(1, 2\) for shape \(1, 384\)"),
    ("out_shape", ValueError, r"out.shape=\(7, 1152, 1\) must be"),
    ("out_dtype", TypeError, r"out.dtype=torch.float16"),
    ("out_noncontiguous", ValueError, r"out must be contiguous"),
])
def test_qkv_projection_bad_inputs(case, exc, match):
    x, w, b = _qkv_args()
    nh, out = 6, None
    if case == "x_1d":
        x = x[0]
    elif case == "x_3d":
        x = x[None]
    elif case == "k_mismatch":
        w = w[:, :383]
    elif case == "bias_shape":
        b = b[:-1]
    elif case == "dtype_mismatch":
        w = w.half()
    elif case == "int_dtype":
        x, w, b = x.long(), w.long(), b.long()
    elif case == "not_a_tensor":
        w = w.tolist()
    elif case == "heads_not_dividing":
        nh = 5
    elif case == "heads_zero":
        nh = 0
    elif case == "weight_not_3h":
        w, b = w[:1000], b[:1000]
    elif case == "device_mismatch":
        w = torch.empty(w.shape, dtype=w.dtype, device="meta")
    elif case == "x_column_stride":
        x = make((384, 7), torch.float32).t()
    elif case == "x_column_stride_one_row":  # a single token still reads K elements through the column stride
        x = make((384, 2), torch.float32)[:, :1].t()
    elif case == "out_shape":
        out = torch.empty((7, 1152, 1), device=DEVICE)
    elif case == "out_dtype":
        out = torch.empty((7, 1152), dtype=torch.float16, device=DEVICE)
    elif case == "out_noncontiguous":
        out = torch.empty((7, 2000), device=DEVICE)[:, :1152]  # unit last stride, but rows 2000 apart
    with pytest.raises(exc, match=match):
        qkv_projection(x, w, b, nh, out=out)


@pytest.mark.parametrize("case,exc,match", [
    ("activation", ValueError, r"activation='swish' is not one of"),
    ("out_shape", ValueError, r"out.shape=\(7, 99\) must be \(7, 100\)"),
    ("out_device", ValueError, r"one device.*out on meta"),
    ("bias_strided", ValueError, r"bias must be contiguous"),
    ("gated_odd_rows", ValueError, r"gated needs weight.shape\[0\] even .*got weight.shape=\(99, 384\)"),
    ("gated_bias_half", ValueError, r"bias must be \[100\] \(weight.shape\[0\]\); got bias.shape=\(50,\)"),
    ("gated_out_full_width", ValueError, r"out.shape=\(7, 100\) must be \(7, 50\)"),
    ("gated_not_bool", TypeError, r"gated must be a bool; got gated='yes'"),
])
def test_bias_gelu_bad_inputs(case, exc, match):
    x, w, b = make((7, 384), torch.float32), make((100, 384), torch.float32), make((100,), torch.float32)
    activation, out, gated = "gelu", None, False
    if case == "activation":
        activation = "swish"
    elif case == "out_shape":
        out = torch.empty((7, 99), device=DEVICE)
    elif case == "out_device":
        out = torch.empty((7, 100), device="meta")
    elif case == "bias_strided":
        b = make((200,), torch.float32)[::2]
    elif case == "gated_odd_rows":
        w, b, gated = w[:99], b[:99], True
    elif case == "gated_bias_half":  # the gated bias covers both halves: [2I], not [I]
        b, gated = b[:50], True
    elif case == "gated_out_full_width":
        out, gated = torch.empty((7, 100), device=DEVICE), True
    elif case == "gated_not_bool":
        gated = "yes"
    with pytest.raises(exc, match=match):
        bias_gelu(x, w, b, activation, gated=gated, out=out)


def test_cpu_tensors_need_the_interpreter(monkeypatch):
    """CPU tensors are refused unless TRITON_INTERPRET=1 (on a CUDA machine too: CPU tensors never launch)."""
    monkeypatch.setattr(kernel_utils, "INTERPRET", False)
    x, w, b = (t.cpu() for t in _qkv_args())
    with pytest.raises(ValueError, match=r"tensors are on cpu; the Triton kernels need CUDA tensors"):
        qkv_projection(x, w, b, 6)
    with pytest.raises(ValueError, match=r"tensors are on cpu"):
        bias_gelu(x, w, b)


# The tiles gemm_configs / gemm_tma_configs document, written out by hand (BLOCK_M x BLOCK_N x BLOCK_K, warps,
# stages; "-ws": warp-specialized, an opt-in the AOT list always compiles).
PTR_TILES_16BIT = ["128x128x64-w8-s3", "128x64x64-w8-s4", "64x128x64-w4-s4", "64x64x64-w4-s4", "64x32x128-w4-s4",
                   "128x32x64-w4-s4"]
PTR_TILES_FP32 = ["128x128x32-w8-s3", "128x64x32-w8-s4", "64x128x32-w4-s4", "64x64x32-w4-s4", "64x32x16-w4-s4"]
TMA_TILES = ["128x256x64-w8-s3", "256x128x64-w8-s3", "128x128x64-w8-s4", "128x64x64-w4-s4", "64x128x64-w4-s4",
             "128x32x64-w4-s4", "64x32x64-w4-s4", "128x128x64-w4-s4-ws", "128x64x64-w4-s4-ws"]
# The gated tiles: the 16-bit lists with BLOCK_N halved; a tile halving onto a 32-column tile's shape is left out
# (the pointer kernel's 64x64x64-w4-s4 -> 64x32: 64x32x128-w4-s4 serves it; TMA's 128x64x64-w4-s4 -> 128x32x64-w4-s4).
PTR_TILES_GATED = ["128x64x64-w8-s3", "128x32x64-w8-s4", "64x64x64-w4-s4", "64x32x128-w4-s4", "128x32x64-w4-s4"]
TMA_TILES_GATED = ["128x128x64-w8-s3", "256x64x64-w8-s3", "128x64x64-w8-s4", "64x64x64-w4-s4", "128x32x64-w4-s4",
                   "64x32x64-w4-s4", "128x64x64-w4-s4-ws", "128x32x64-w4-s4-ws"]
# fp32 gated (a float32 ModernBERT): the fp32 list halved the same way (64x128x32 -> 64x64x32; 64x64x32 -> 64x32,
# which 64x32x16 serves)
PTR_TILES_GATED_FP32 = ["128x64x32-w8-s3", "128x32x32-w8-s4", "64x64x32-w4-s4", "64x32x16-w4-s4"]


def _expected_gemm_specs(prefix, activations):
    """{name: archs}: sm_90 compiles what it can autotune (TMA for 16-bit types, the pointer kernel for fp32 and,
    for layouts TMA cannot describe, every 16-bit pointer tile); sm_80 runs the pointer kernel for everything."""
    expected = {}
    for act in activations:
        for bias in ("", "-nobias"):
            head = f"{prefix}-{{}}{'-' + act if act else ''}{bias}"
            for precision in ("ieee", "tf32"):
                for tile in PTR_TILES_FP32:
                    expected[f"{head.format('fp32')}-{precision}-ptr-{tile}"] = (90, 80)
            for dtype in ("fp16", "bf16"):
                for tile in PTR_TILES_16BIT:
                    expected[f"{head.format(dtype)}-ptr-{tile}"] = (90, 80)
                for tile in TMA_TILES:
                    expected[f"{head.format(dtype)}-tma-{tile}"] = (90,)
    return expected


def _expected_gated_specs(prefix, activations):
    """{name: archs} of the gated epilogue: fp16/bf16 TMA on sm_90, the pointer kernel's tiles on both archs (sm_90
    autotunes them for layouts TMA cannot describe), fp32 the pointer kernel on both."""
    expected = {}
    for act in activations:
        for bias in ("", "-nobias"):
            for precision in ("ieee", "tf32"):
                for tile in PTR_TILES_GATED_FP32:
                    expected[f"{prefix}-fp32-{act}-gated{bias}-{precision}-ptr-{tile}"] = (90, 80)
            for dtype in ("fp16", "bf16"):
                head = f"{prefix}-{dtype}-{act}-gated{bias}"
                for tile in PTR_TILES_GATED:
                    expected[f"{head}-ptr-{tile}"] = (90, 80)
                for tile in TMA_TILES_GATED:
                    expected[f"{head}-tma-{tile}"] = (90,)
    return expected


@pytest.mark.parametrize("mod,activations,gated", [(qkv_mod, [None], []),
                                                   (bias_gelu_mod, ["gelu", "gelu_tanh", "relu", "silu"],
                                                    ["gelu", "gelu_tanh", "silu"])],
                         ids=["qkv_projection", "bias_gelu"])
def test_aot_specs_cover_every_config(mod, activations, gated):
    """Every dtype x tile x activation x {bias, no bias} the launchers can run, on the archs it runs on: 40 kernels
    per (activation, bias) pair, plus bias_gelu's gated epilogue (34 per gated activation and bias choice); the
    spec's constexprs are the ones its name says."""
    specs = mod.aot_specs()
    names = [s["name"] for s in specs]
    assert len(names) == len(set(names))
    expected = _expected_gemm_specs(mod.OP, activations)
    assert len(expected) == 40 * 2 * len(activations)
    expected_gated = _expected_gated_specs(mod.OP, gated)
    assert len(expected_gated) == 34 * 2 * len(gated)
    assert {s["name"]: tuple(s["archs"]) for s in specs} == {**expected, **expected_gated}
    for s in specs:
        tma = s["fn"] is gemm_core.gemm_tma_kernel
        assert tma or s["fn"] is gemm_core.gemm_kernel
        assert s["tma"] == tma and ("-tma-" in s["name"]) == tma
        assert set(s["signature"]) | set(s["constexprs"]) == set(s["fn"].arg_names)
        assert not set(s["signature"]) & set(s["constexprs"])
        assert s["hints"]["M"] is None  # the token count is arbitrary; N, K, strides are multiples of 16
        c = s["constexprs"]
        assert c["HAS_BIAS"] == ("-nobias" not in s["name"])
        assert (c["ACTIVATION"] or "") == next((a for a in activations if a and f"-{a}-" in s["name"]), "")
        assert c["INPUT_PRECISION"] == ("tf32" if "-tf32-" in s["name"] else "ieee")
        bm, bn, bk = (int(v) for v in s["name"].split("-ptr-" if not tma else "-tma-")[1].split("-")[0].split("x"))
        assert (c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"]) == (bm, bn, bk)
        assert s["warp_specialize"] == s["name"].endswith("-ws")
        assert c["GATED"] == ("-gated" in s["name"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_launch_without_checks_matches(dtype):
    """`launch` (what the model calls once its inputs are validated) computes what the checked functions do."""
    from fastbert.kernels import bias_gelu as bias_gelu_mod
    from fastbert.kernels import qkv_projection as qkv_mod

    T, H, nh = 13, 384, 6
    x, w, b = make((T, H), dtype), make((3 * H, H), dtype, H ** -0.5, 1), make((3 * H,), dtype, 0.5, 2)
    assert torch.equal(qkv_mod.launch(x, w, b, nh), qkv_projection(x, w, b, nh))
    out = poisoned((T, 3 * H), dtype)
    assert qkv_mod.launch(x, w, b, nh, out=out).data_ptr() == out.data_ptr()
    assert torch.equal(bias_gelu_mod.launch(x, w, b, "gelu_tanh"), bias_gelu(x, w, b, "gelu_tanh"))


# --------------------------------------------------------------------------------------------------------------------
# The GELU epilogues on their own: every input value, fp64 reference
# --------------------------------------------------------------------------------------------------------------------
def _epilogue_of(x: torch.Tensor, activation, kernel="ptr"):
    """act(x) computed by the GEMM's epilogue: x [M, 16] @ I^T + 0 gives exactly x as the fp32 accumulator."""
    eye = torch.eye(16, dtype=x.dtype, device=DEVICE)
    out = poisoned(x.shape, x.dtype)
    cfg = (64, 16, 16, 4, 1) if kernel == "ptr" else (64, 16, 16, 4, 1, False)
    return gemm_core.gemm(x, eye, None, out, activation, config=cfg, kernel=kernel)


def _wide_inputs(dtype):
    """|x| <= 10 densely (where GELU bends), tails out to +-1e4 (and +-1e30, 3e38 in fp32), both zeros: 16,384
    values."""
    dense = torch.linspace(-10, 10, 16384 - 48, dtype=torch.float64)
    huge = [3e38, 1e30] if dtype == torch.float32 else [6e4, 3e4]
    tails = torch.cat([torch.logspace(1, 4, 20, dtype=torch.float64), torch.tensor(huge + [0.0, -0.0])])
    return torch.cat([dense, tails, -tails]).to(dtype).reshape(-1, 16).to(DEVICE)


GELU64 = {"gelu": lambda x: x * 0.5 * torch.erfc(-x / 2 ** 0.5),  # erfc: no cancellation in the negative tail
          "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
          "silu": lambda x: x * torch.sigmoid(x)}  # SiLU rides along: the same ex2 + rcp form as the tanh GELU


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "silu"])
def test_gelu_epilogue_fp32_against_fp64(activation):
    """fp32: max |error| against fp64 <= 1e-6 everywhere (the bar is 1e-5 on O(1) outputs); the erf form is
    within 3.3e-7 by construction (A&S 7.1.26, 1.5e-7 on erf, halved). Relative error <= 1e-6 where |y| >= 1.
    fp32 takes the pointer kernel; the TMA kernel's epilogue is the same code, run in fp16 below."""
    x = _wide_inputs(torch.float32)
    got = _epilogue_of(x, activation, "ptr")
    want = GELU64[activation](x.double())
    err = (got.double() - want).abs()
    assert torch.isfinite(got).all()
    assert err.max().item() <= 1e-6, (err.max().item(), x.flatten()[err.flatten().argmax()].item())
    big = want.abs() >= 1
    assert (err[big] / want[big].abs()).max().item() <= 1e-6
    twin_err = (ops.bias_gelu_torch(x, torch.eye(16, device=DEVICE), None, activation).double() - want).abs().max()
    assert err.max().item() <= max(2 * twin_err.item(), 1e-6)


@pytest.mark.parametrize("kernel", ["ptr", pytest.param("tma", marks=TMA_ON_CUDA)])
@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "silu"])
def test_gelu_epilogue_fp16_against_fp64(activation, kernel):
    """fp16 output: error against fp64 at most 2x the twin's own (F.gelu in fp16 rounds once, too)."""
    x = _wide_inputs(torch.float16)
    got = _epilogue_of(x, activation, kernel)
    want = GELU64[activation](x.double())
    twin = ops.bias_gelu_torch(x, torch.eye(16, dtype=x.dtype, device=DEVICE), None, activation)
    err = (got.double() - want).abs().max().item()
    twin_err = (twin.double() - want).abs().max().item()
    assert torch.isfinite(got).all() and err <= error_bound(torch.float16, twin_err), (err, twin_err)


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "relu", "silu", None])
def test_epilogue_nan_and_inf(activation):
    """NaN stays NaN through every epilogue. +inf stays +inf; -inf gives the limit 0 for the erf GELU (torch's
    0.5x(1 + erf) form gives NaN there) and NaN for the tanh GELU and SiLU (as torch: -inf * 0)."""
    # The values ride in as the bias of a zero GEMM (x @ I would turn inf into inf * 0 = NaN in the dot).
    bias = torch.zeros(16, device=DEVICE)
    bias[:4] = torch.tensor([float("nan"), float("inf"), -float("inf"), 1.5])
    zeros = torch.zeros(64, 16, device=DEVICE)
    out = gemm_core.gemm(zeros, zeros[:16], bias, poisoned((64, 16), torch.float32), activation,
                         config=(64, 16, 16, 4, 1), kernel="ptr")
    assert torch.equal(out[1:].isnan(), out[:1].isnan().expand(63, 16))  # every row alike
    got = out[0, :4].tolist()
    assert got[0] != got[0]  # NaN
    assert got[1] == float("inf")
    expected_neg_inf = {"gelu": 0.0, "relu": 0.0, None: -float("inf")}.get(activation)
    if activation in ("gelu_tanh", "silu"):
        assert got[2] != got[2]
        assert act64(torch.tensor(-float("inf"), dtype=torch.float64), activation).isnan()  # torch's answer too
    else:
        assert got[2] == expected_neg_inf
    assert abs(got[3] - (act64(torch.tensor(1.5, dtype=torch.float64), activation).item())) <= 1e-6


@triton.jit
def _gelu_erf_probe(x_ptr, out_ptr, BLOCK: tl.constexpr):
    # The kernel's own erf-GELU epilogue function, alone, on a block of fp32 values.
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, gemm_core._gelu_erf(tl.load(x_ptr + offs)))


@triton.jit
def _rcp_one_ulp_up(x):
    r = 1.0 / x  # > 0 here (1 + a|x|): one more in the bit pattern is the next float up
    return (r.to(tl.int32, bitcast=True) + 1).to(tl.float32, bitcast=True)


@triton.jit
def _rcp_one_ulp_down(x):
    r = 1.0 / x
    return (r.to(tl.int32, bitcast=True) - 1).to(tl.float32, bitcast=True)


@pytest.mark.parametrize("rcp", [None, _rcp_one_ulp_down, _rcp_one_ulp_up], ids=["exact", "down", "up"])
def test_gelu_erf_bound_holds_with_a_one_ulp_reciprocal(rcp, monkeypatch):
    """kernels/gemm.py's _gelu_erf itself (its constants, its code), with its reciprocal exact (the interpreter's
    division) or pushed 1 ulp either way (the GPU's rcp.approx may be 1 ulp off): the fp32 error over 2^21 points
    of [-12, 12] stays <= 1e-6 (measured: ~3.3e-7)."""
    if rcp is not None:
        monkeypatch.setattr(gemm_core, "_rcp", rcp)
    n, block = 2 ** 21, (2 ** 20 if DEVICE == "cpu" else 1024)  # the interpreter: few programs, numpy-wide
    x = torch.linspace(-12, 12, n, dtype=torch.float32, device=DEVICE)
    out = poisoned((n,), torch.float32)
    _gelu_erf_probe[(n // block,)](x, out, BLOCK=block)
    err = max_error(out, GELU64["gelu"](x.double()))
    assert err <= 1e-6, err


@triton.jit
def _silu_probe(x_ptr, out_ptr, BLOCK: tl.constexpr):
    # The kernel's own SiLU epilogue function, alone, on a block of fp32 values.
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, gemm_core._silu(tl.load(x_ptr + offs)))


@pytest.mark.parametrize("rcp", [None, _rcp_one_ulp_down, _rcp_one_ulp_up], ids=["exact", "down", "up"])
def test_silu_bounds_hold_with_a_one_ulp_reciprocal(rcp, monkeypatch):
    """kernels/gemm.py's _silu itself, with its reciprocal exact or 1 ulp off either way (the GPU's rcp.approx), over
    2^21 points of [-24, 24] against x sigmoid(x) in fp64: |error| <= 1e-6 everywhere (measured 9.54e-7, the
    rounding of |y| in [16, 24); F.silu's x / (1 + exp(-x)) reaches 1.27e-6, its 1 + exp(-x) rounded near 1);
    relative error <= 3 eps for x > 0 (measured 2.35); for x <= 0 <= (3 + 0.75|x|) eps, the rounding of exp2's
    argument (measured 15.5 eps at x = -24, where y ~ -1e-9)."""
    if rcp is not None:
        monkeypatch.setattr(gemm_core, "_rcp", rcp)
    n, block = 2 ** 21, (2 ** 20 if DEVICE == "cpu" else 1024)
    x = torch.linspace(-24, 24, n, dtype=torch.float32, device=DEVICE)
    out = poisoned((n,), torch.float32)
    _silu_probe[(n // block,)](x, out, BLOCK=block)
    want = GELU64["silu"](x.double())
    err = (out.double() - want).abs()
    assert torch.isfinite(out).all() and err.max().item() <= 1e-6, err.max().item()
    eps, pos = torch.finfo(torch.float32).eps, x > 0
    neg = ~pos & (want.abs() >= torch.finfo(torch.float32).tiny)
    assert (err[pos] / want[pos]).max().item() <= 3 * eps
    assert (err[neg] / want[neg].abs() / (3 + 0.75 * x[neg].abs().double())).max().item() <= eps


# --------------------------------------------------------------------------------------------------------------------
# Launching (kernels/utils.py, shared by every launcher): the device guard, autotuning that survives a failing
# config, CUDA-graph capture
# --------------------------------------------------------------------------------------------------------------------
LAUNCHERS = ("qkv_projection", "bias_gelu", "attention", "residual_layernorm")


def _launcher_case(name, device):
    """(the Triton kernel `name`'s launcher runs, a call of the launcher, its fp32 reference), tensors on `device`."""
    g = torch.Generator().manual_seed(0)
    r = lambda *shape: torch.randn(*shape, generator=g).to(device)  # noqa: E731
    x, w, b = r(5, 64), r(96, 64) * 0.125, r(96)
    if name == "qkv_projection":
        return gemm_core.gemm_kernel, lambda: qkv_mod.launch(x, w, b, 2), F.linear(x, w, b).view(5, 3, 2, 16)
    if name == "bias_gelu":
        return gemm_core.gemm_kernel, lambda: bias_gelu_mod.launch(x, w, b, "gelu"), F.gelu(F.linear(x, w, b))
    if name == "residual_layernorm":
        res, lw, lb = r(5, 96), r(96), r(96)
        ref = F.layer_norm(F.linear(x, w, b) + res, (96,), lw, lb, 1e-5)
        return (rln_mod.bias_residual_layernorm_kernel,
                lambda: rln_mod.launch(x, w, b, res, lw, lb, 1e-5), ref)
    qkv, cu = r(9, 3, 2, 16), torch.tensor([0, 4, 9], dtype=torch.int32, device=device)
    per_seq = [qkv[s:e].permute(1, 2, 0, 3).unbind(0) for s, e in ((0, 4), (4, 9))]  # q, k, v [nh, L, hd]
    ref = torch.cat([(torch.softmax(q @ k.transpose(-1, -2) * 0.25, -1) @ v).transpose(0, 1).reshape(-1, 32)
                     for q, k, v in per_seq])
    return attention_mod._attention_fwd_kernel, lambda: attention_mod.launch(qkv, cu, 5, 0.25), ref


@pytest.mark.parametrize("name", LAUNCHERS)
def test_launcher_launches_under_a_device_guard_for_its_tensors(name, monkeypatch):
    """Triton launches on the current CUDA device: each launcher enters utils.device_guard with its input's device,
    and the kernel is launched inside it."""
    entered, active, launched = [], [], []

    @contextlib.contextmanager
    def guard(t):
        entered.append(t.device)
        active.append(True)
        try:
            yield
        finally:
            active.pop()

    monkeypatch.setattr(kernel_utils, "device_guard", guard)
    kernel, call, ref = _launcher_case(name, DEVICE)
    real_run = kernel.run

    def run(*args, **kwargs):
        launched.append(bool(active))
        return real_run(*args, **kwargs)

    monkeypatch.setattr(kernel, "run", run)
    with tf32_matmuls(False):
        out = call()
    assert entered == [ref.device], entered
    assert launched and all(launched), launched
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs two CUDA devices (runs every launcher on cuda:1 with cuda:0 current)")
@pytest.mark.parametrize("name", LAUNCHERS)
def test_launcher_runs_on_the_second_gpu_without_set_device(name):
    assert torch.cuda.current_device() == 0
    _, call, ref = _launcher_case(name, "cuda:1")
    with tf32_matmuls(False):
        out = call()
        torch.cuda.synchronize(1)
    assert out.device == torch.device("cuda:1") and torch.cuda.current_device() == 0
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_benchmark_skips_a_config_that_raises_and_names_the_kernel_when_all_do():
    """utils.Benchmark (the autotuners' do_bench): any error in one config times it as inf; a round whose every
    config failed raises RuntimeError naming the kernel, with the last error as its cause."""
    def bench(fn, quantiles):
        fn()
        return [1.0, 0.5, 2.0]

    def ok():
        pass

    def broken():
        raise ValueError("boom")

    benchmark = kernel_utils.Benchmark("toy_kernel", bench)
    prune = benchmark.prune(lambda configs, named_args, **kwargs: configs[:3])
    assert prune(list("abcd"), {}) == list("abc")  # a round of 3
    assert benchmark(broken, quantiles=(0.5, 0.2, 0.8)) == [float("inf")] * 3
    assert benchmark(ok, quantiles=(0.5, 0.2, 0.8)) == [1.0, 0.5, 2.0]
    assert benchmark(broken, quantiles=(0.5, 0.2, 0.8)) == [float("inf")] * 3
    prune(list("ab"), {})  # a new round of 2: both fail
    assert benchmark(broken, quantiles=(0.5, 0.2, 0.8)) == [float("inf")] * 3
    with pytest.raises(RuntimeError, match=r"toy_kernel: every autotune config failed \(2 of 2\); "
                                           r"the last: ValueError: boom") as info:
        benchmark(broken, quantiles=(0.5, 0.2, 0.8))
    assert isinstance(info.value.__cause__, ValueError)


def _tuned_gemm(configs, monkeypatch, tmp_path):
    """A real Triton Autotuner over the pointer GEMM (built like the launcher's, with a benchmark that runs each
    config once), run on a 5x40x64 fp32 problem: (autotuner, its args, meta, out, reference)."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # no winner from an earlier run on disk

    def bench(fn, quantiles):
        fn()
        return [1.0, 1.0, 1.0]

    tuner = kernel_utils.autotune(gemm_core.gemm_kernel, [gemm_core._triton_config(c) for c in configs],
                                  gemm_core._AUTOTUNE_KEY, gemm_core.prune_configs, bench=bench)
    a, w = make((5, 64), torch.float32), make((40, 64), torch.float32, 0.125, 1)
    out = poisoned((5, 40), torch.float32)
    args = (a, w, a, out, 5, 40, 64, 16, a.stride(0), w.stride(0), w.stride(1), out.stride(0))
    meta = dict(HAS_BIAS=False, ACTIVATION=None, INPUT_PRECISION="ieee")
    return tuner, args, meta, out, F.linear(a.double(), w.double())


def _grid(META):
    return (triton.cdiv(5, META["BLOCK_M"]) * triton.cdiv(40, META["BLOCK_N"]),)


@pytest.mark.skipif(DEVICE != "cpu", reason="runs Triton's autotuner in the interpreter")
def test_autotuner_skips_a_config_that_raises(monkeypatch, tmp_path):
    """BLOCK_K=24 is not a power of two: that config raises (a ValueError, which Triton's own handler would let end
    the call); the autotuner takes the other and files it under the key utils.autotune_key computes."""
    tuner, args, meta, out, ref = _tuned_gemm([(64, 32, 24, 4, 1), (64, 32, 32, 4, 1)], monkeypatch, tmp_path)
    tuner[_grid](*args, **meta)
    assert (out.double() - ref).abs().max() < FP32_TOL
    assert tuner.cache[kernel_utils.autotune_key(tuner, args, meta)].kwargs["BLOCK_K"] == 32


@pytest.mark.skipif(DEVICE != "cpu", reason="runs Triton's autotuner in the interpreter")
def test_autotuner_raises_naming_the_kernel_when_every_config_fails(monkeypatch, tmp_path):
    tuner, args, meta, out, _ = _tuned_gemm([(64, 32, 24, 4, 1), (64, 32, 48, 4, 1)], monkeypatch, tmp_path)
    with pytest.raises(RuntimeError, match=r"gemm_kernel: every autotune config failed \(2 of 2\)") as info:
        tuner[_grid](*args, **meta)
    assert info.value.__cause__ is not None
    assert not tuner.cache  # no choice recorded: the next call tunes again


@pytest.mark.parametrize("tuned", [False, True])
def test_gemm_takes_its_fixed_config_in_a_capture_for_a_key_not_tuned(tuned, monkeypatch):
    """While a CUDA graph is captured, a key the autotuner has not tuned launches CAPTURE_CONFIGS (benchmarking
    would synchronise); a tuned key launches the autotuner's choice, with the keyword arguments the autotuner passes
    (so the launch finds the binary the tuned eager launches loaded). On CPU: the capture predicate patched, the
    interpreter's fixed tile switched off."""
    monkeypatch.setattr(kernel_utils, "INTERPRET", False)
    monkeypatch.setattr(kernel_utils, "capturing", lambda t: True)
    tuner = gemm_core._AUTOTUNED[("ptr", 4, False)]
    a, w = make((5, 64), torch.float32), make((40, 64), torch.float32, 0.125, 1)
    out = poisoned((5, 40), torch.float32)
    args = (a, w, a, out, 5, 40, 64, 16, a.stride(0), w.stride(0), w.stride(1), out.stride(0))
    meta = dict(HAS_BIAS=False, ACTIVATION=None, INPUT_PRECISION=kernel_utils.input_precision(torch.float32),
                GATED=False)
    tuner_calls, fixed = [], []
    if tuned:
        monkeypatch.setitem(tuner.cache, kernel_utils.autotune_key(tuner, args, meta), tuner.configs[-1])
    monkeypatch.setattr(tuner, "run", lambda *args, **kwargs: tuner_calls.append(kwargs))
    real_run = gemm_core.gemm_kernel.run
    monkeypatch.setattr(gemm_core.gemm_kernel, "run", lambda *args, **kwargs: (fixed.append(kwargs),
                                                                               real_run(*args, **kwargs)))
    with tf32_matmuls(False):
        gemm_core.gemm(a, w, None, out)
    assert not tuner_calls and len(fixed) == 1
    blocks = (fixed[0]["BLOCK_M"], fixed[0]["BLOCK_N"], fixed[0]["BLOCK_K"])
    if tuned:
        chosen = tuner.configs[-1]
        assert {k: fixed[0][k] for k in chosen.all_kwargs()} == chosen.all_kwargs()
    else:
        assert blocks == gemm_core.CAPTURE_CONFIGS[("ptr", 4, False)][:3]
    assert (out.double() - F.linear(a.double(), w.double())).abs().max() < FP32_TOL
    assert not any(c[5] for c in gemm_core.CAPTURE_CONFIGS.values() if len(c) > 5)


def test_attention_takes_its_fixed_config_in_a_capture_for_a_key_not_tuned(monkeypatch):
    monkeypatch.setattr(kernel_utils, "INTERPRET", False)
    monkeypatch.setattr(kernel_utils, "capturing", lambda t: True)
    monkeypatch.setattr(attention_mod._attention_fwd, "run", lambda *a, **k: pytest.fail("the autotuner ran"))
    fixed = []
    real_run = attention_mod._attention_fwd_kernel.run
    monkeypatch.setattr(attention_mod._attention_fwd_kernel, "run",
                        lambda *args, **kwargs: (fixed.append(kwargs), real_run(*args, **kwargs)))
    _, call, ref = _launcher_case("attention", DEVICE)
    with tf32_matmuls(False):
        out = call()
    first = attention_mod.attention_configs(torch.float32, 16, "ieee")[0]
    assert len(fixed) == 1 and (fixed[0]["BLOCK_M"], fixed[0]["BLOCK_N"]) == (first.kwargs["BLOCK_M"],
                                                                             first.kwargs["BLOCK_N"])
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
