"""The GEMM-with-epilogue kernels: qkv_projection, bias_gelu and their shared core (kernels/gemm.py).

Each result is checked against the torch twin in fastbert/ops.py (the definition) and an fp64 reference computed
from the same rounded inputs; bias_gelu also against transformers' BertIntermediate with the weights shared.
Tolerances: fp32 <= 1e-5 absolute (outputs are O(1): weights ~ N(0, 1/K), so the K-term fp32 sum carries ~1e-6 of
rounding); fp16/bf16 <= 2x the twin's own max error against fp64 (+1e-6 so an exactly-rounded twin does not
force a zero). Outputs are poisoned with NaN first, and NaN never passes.

Without CUDA this runs Triton's interpreter (tests/conftest.py). The interpreter cannot run bf16 tl.dot
(triton-lang/triton#11584: it multiplies the bit patterns), so bf16 GEMM cases are skipped on CPU and run on CUDA.
"""
import pytest
import torch
import torch.nn.functional as F

from conftest import DEVICE, FP32_TOL, assert_kernel_matches, poisoned, tf32_matmuls
from fastbert import ops
from fastbert.kernels import utils as kernel_utils
from fastbert.kernels import gemm as gemm_core
from fastbert.kernels.bias_gelu import bias_gelu
from fastbert.kernels.qkv_projection import qkv_projection


BF16_GEMM_ON_CPU = pytest.mark.skipif(
    DEVICE == "cpu", reason="Triton's interpreter cannot run bf16 tl.dot (triton-lang/triton#11584); runs on CUDA")
DTYPES = [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=BF16_GEMM_ON_CPU)]


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


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "relu"])
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


def test_bias_gelu_large_T_fp16():
    """131 tokens x I=1536: several row and column blocks, the full FFN-in width of MiniLM."""
    dtype = torch.float16
    x, w, b = make((131, 384), dtype), make((1536, 384), dtype, 384 ** -0.5, 1), make((1536,), dtype, 0.5, 2)
    y = bias_gelu(x, w, b, "gelu", out=poisoned((131, 1536), dtype))
    assert_kernel_matches(y, ops.bias_gelu_torch(x, w, b, "gelu"), F.gelu(F.linear(x.double(), w.double(), b.double())), dtype)


@pytest.mark.parametrize("hidden_act", ["gelu", "gelu_new", "gelu_pytorch_tanh"])
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
        out = gemm_core.gemm(a, w, b, poisoned((M, N), dtype), "gelu", config=cfg)
        assert_kernel_matches(out, twin, ref64, dtype)


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


@pytest.mark.parametrize("allow_tf32", [False, True])
def test_tf32_switch(allow_tf32):
    """fp32 follows torch.backends.cuda.matmul.allow_tf32 ("ieee" when off); 16-bit types always compile one way."""
    T, H, I = 7, 384, 100
    x, w, b = make((T, H), torch.float32), make((I, H), torch.float32, H ** -0.5, 1), make((I,), torch.float32)
    with tf32_matmuls(allow_tf32):
        assert gemm_core.input_precision(torch.float32) == ("tf32" if allow_tf32 else "ieee")
        assert gemm_core.input_precision(torch.float16) == "ieee"
        y = bias_gelu(x, w, b, "gelu", out=poisoned((T, I), torch.float32))
    ref64 = F.gelu(F.linear(x.double(), w.double(), b.double()))
    # TF32 keeps 10 mantissa bits: ~1e-3 relative per product on a GPU; the interpreter computes in full fp32.
    tol = 2e-2 if (allow_tf32 and DEVICE == "cuda") else FP32_TOL
    assert torch.isfinite(y).all() and (y.double() - ref64).abs().max().item() <= tol


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
])
def test_bias_gelu_bad_inputs(case, exc, match):
    x, w, b = make((7, 384), torch.float32), make((100, 384), torch.float32), make((100,), torch.float32)
    activation, out = "gelu", None
    if case == "activation":
        activation = "swish"
    elif case == "out_shape":
        out = torch.empty((7, 99), device=DEVICE)
    elif case == "out_device":
        out = torch.empty((7, 100), device="meta")
    elif case == "bias_strided":
        b = make((200,), torch.float32)[::2]
    with pytest.raises(exc, match=match):
        bias_gelu(x, w, b, activation, out=out)


def test_cpu_tensors_need_the_interpreter(monkeypatch):
    """CPU tensors are refused unless TRITON_INTERPRET=1 (on a CUDA machine too: CPU tensors never launch)."""
    monkeypatch.setattr(kernel_utils, "INTERPRET", False)
    x, w, b = (t.cpu() for t in _qkv_args())
    with pytest.raises(ValueError, match=r"tensors are on cpu; the Triton kernels need CUDA tensors"):
        qkv_projection(x, w, b, 6)
    with pytest.raises(ValueError, match=r"tensors are on cpu"):
        bias_gelu(x, w, b)


def test_aot_specs_cover_every_config():
    from fastbert.kernels import bias_gelu as bias_gelu_mod, qkv_projection as qkv_mod

    for mod, activations in ((qkv_mod, [None]), (bias_gelu_mod, ["gelu", "gelu_tanh"])):
        specs = mod.aot_specs()
        names = [s["name"] for s in specs]
        assert len(names) == len(set(names))
        # fp32 twice (ieee and tf32), fp16 and bf16 once, for every config and activation
        assert len(specs) == (2 + 1 + 1) * len(gemm_core.gemm_configs(2)) * len(activations)
        for s in specs:
            assert s["fn"] is gemm_core.gemm_kernel
            params = set(gemm_core.gemm_kernel.arg_names)
            assert set(s["signature"]) | set(s["constexprs"]) == params
            assert not set(s["signature"]) & set(s["constexprs"])
            assert s["hints"] == {"M": None}  # the token count is arbitrary; the other ints are multiples of 16
            assert s["constexprs"]["ACTIVATION"] in activations
