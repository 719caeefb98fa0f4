"""residual_layernorm: LN(y @ W^T + b + residual), cuBLAS/torch GEMM + one Triton row kernel (bias+residual+LN).

Checked against the torch twin (fastbert/ops.py), an fp64 reference from the same rounded inputs, and transformers'
BertSelfOutput / BertOutput with the weights shared. fp32 <= 1e-5 absolute (LayerNorm outputs are O(1); the GEMM
part is the same torch matmul as the twin's, the row statistics are fp32 either way); fp16/bf16 <= 2x the twin's
own max error against fp64 (+1e-6). The row kernel has no tl.dot, so bf16 runs in the interpreter too. RMSNorm
(rms=True, EuroBERT) likewise, and against transformers' EuroBertRMSNorm, whose roundings it reproduces.
"""
import dataclasses

import pytest
import torch
import torch.nn.functional as F
import triton
from helpers import DEVICE, FP32_TOL, assert_kernel_matches, max_error, poisoned

from fastbert import ops
from fastbert.kernels import residual_layernorm as rln_mod
from fastbert.kernels import utils as kernel_utils
from fastbert.kernels.residual_layernorm import residual_layernorm
from fastbert.numerics import error_bound

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def make(shape, dtype, scale=1.0, shift=0.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale + shift).to(dtype).to(DEVICE)



def inputs(T, K, H, dtype, bias=True):
    y = make((T, K), dtype)
    w = make((H, K), dtype, scale=K ** -0.5, seed=1)
    b = make((H,), dtype, scale=0.5, seed=2) if bias else None
    res = make((T, H), dtype, seed=3)
    gamma = make((H,), dtype, scale=0.2, shift=1.0, seed=4)
    beta = make((H,), dtype, scale=0.2, seed=5)
    return y, w, b, res, gamma, beta


def reference64(y, w, b, res, gamma, beta, eps, pre_norm=False):
    d = lambda t: None if t is None else t.double()  # noqa: E731
    h = F.linear(d(y), d(w), d(b)) + d(res)
    normed = F.layer_norm(h, (h.shape[-1],), d(gamma), d(beta), eps)
    return (h, normed) if pre_norm else normed


CASES = [  # (T, K, H): attention-out (K = H) and FFN-out (K = I) shapes, I = 1536 and a non-multiple of 64
    (1, 384, 384),
    (7, 1536, 384),
    (13, 100, 384),
    (131, 384, 384),
    (7, 768, 768),
    (13, 100, 768),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T,K,H", CASES, ids=[f"T{t}-K{k}-H{h}" for t, k, h in CASES])
def test_residual_layernorm(T, K, H, dtype):
    y, w, b, res, gamma, beta = inputs(T, K, H, dtype)
    eps = 1e-12
    out = poisoned((T, H), dtype)
    got = residual_layernorm(y, w, b, res, gamma, beta, eps, out=out)
    assert got.data_ptr() == out.data_ptr()
    twin = ops.residual_layernorm_torch(y, w, b, res, gamma, beta, eps)
    assert_kernel_matches(got, twin, reference64(y, w, b, res, gamma, beta, eps), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("eps", [1e-5, 0.5])
def test_strided_inputs_no_bias_and_eps(dtype, eps):
    """y and residual as strided views (y = big[:, :K], residual = big[::2]); no dense bias; an eps large enough
    (0.5) that using it wrongly shows."""
    T, K, H = 13, 384, 384
    y = make((T, K + 40), dtype)[:, :K]
    res = make((2 * T, H), dtype, seed=3)[::2]
    _, w, _, _, gamma, beta = inputs(T, K, H, dtype)
    assert not y.is_contiguous() and not res.is_contiguous()
    got = residual_layernorm(y, w, None, res, gamma, beta, eps, out=poisoned((T, H), dtype))
    twin = ops.residual_layernorm_torch(y, w, None, res, gamma, beta, eps)
    assert_kernel_matches(got, twin, reference64(y, w, None, res, gamma, beta, eps), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("H,T", [(100, 7), (1023, 7), (1024, 7), (1536, 5), (640, 9), (32, 131)])
def test_row_widths(H, T, dtype):
    """Row widths around the chunk choices: 100 (one masked chunk of 128), 1023 (one masked lane), 1024 (one chunk),
    1536 (3 x 512), 640 (5 x 128 is not 1 or 3 power-of-two chunks: one masked chunk of 1024), 32 (128 rows per
    program, T = 131 leaves a partial program)."""
    K = 64
    y, w, b, res, gamma, beta = inputs(T, K, H, dtype)
    got = residual_layernorm(y, w, b, res, gamma, beta, 1e-12, out=poisoned((T, H), dtype))
    twin = ops.residual_layernorm_torch(y, w, b, res, gamma, beta, 1e-12)
    assert_kernel_matches(got, twin, reference64(y, w, b, res, gamma, beta, 1e-12), dtype)


def test_in_place_over_residual_and_default_out():
    """out=residual updates the residual stream in place; without out the result reuses the GEMM buffer."""
    T, K, H = 13, 384, 384
    dtype = torch.float32
    y, w, b, res, gamma, beta = inputs(T, K, H, dtype)
    want = ops.residual_layernorm_torch(y, w, b, res, gamma, beta, 1e-12)
    fresh = residual_layernorm(y, w, b, res, gamma, beta, 1e-12)
    assert fresh.is_contiguous() and (fresh - want).abs().max().item() <= FP32_TOL
    stream = res.clone()
    got = residual_layernorm(y, w, b, stream, gamma, beta, 1e-12, out=stream)
    assert got.data_ptr() == stream.data_ptr() and (got - want).abs().max().item() <= FP32_TOL


@pytest.mark.parametrize("H", [384, 768])
def test_nan_row_stays_in_its_row(H):
    """A program normalises several rows at once: a NaN in one row must poison that row only."""
    T, K = 13, 64
    dtype = torch.float32
    y, w, b, res, gamma, beta = inputs(T, K, H, dtype)
    rows = rln_mod.row_config(H)[0]
    bad = rows + 1  # inside the second program, next to rows of its own program
    res[bad, 5] = float("nan")
    got = residual_layernorm(y, w, b, res, gamma, beta, 1e-12, out=poisoned((T, H), dtype))
    assert torch.isnan(got[bad]).all()
    keep = torch.arange(T) != bad
    want = reference64(y, w, b, res, gamma, beta, 1e-12)
    assert torch.isfinite(got[keep]).all() and (got[keep].double() - want[keep]).abs().max().item() <= FP32_TOL


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_launch_without_checks_matches(dtype):
    """`launch` (what the model calls once its inputs are validated) computes the same as the checked function."""
    T, K, H = 13, 384, 384
    y, w, b, res, gamma, beta = inputs(T, K, H, dtype)
    checked = residual_layernorm(y, w, b, res, gamma, beta, 1e-12, out=poisoned((T, H), dtype))
    unchecked = rln_mod.launch(y, w, b, res, gamma, beta, 1e-12, out=poisoned((T, H), dtype))
    assert torch.equal(checked, unchecked)
    assert torch.equal(rln_mod.launch(y, w, b, res, gamma, beta, 1e-12), checked)  # out=None: a fresh buffer


def test_zero_tokens():
    y, w, b, res, gamma, beta = inputs(0, 384, 384, torch.float32)
    assert residual_layernorm(y, w, b, res, gamma, beta, 1e-12).shape == (0, 384)


@pytest.mark.parametrize("module_name,K", [("BertSelfOutput", 384), ("BertOutput", 1536)])
def test_matches_transformers(module_name, K):
    transformers = pytest.importorskip("transformers")
    from transformers.models.bert import modeling_bert

    config = transformers.BertConfig(hidden_size=384, intermediate_size=1536, num_attention_heads=6,
                                     layer_norm_eps=1e-12)
    torch.manual_seed(0)
    module = getattr(modeling_bert, module_name)(config).to(DEVICE).eval()
    with torch.no_grad():  # non-trivial LayerNorm parameters, so gamma/beta mix-ups show
        module.LayerNorm.weight.normal_(1.0, 0.2)
        module.LayerNorm.bias.normal_(0.0, 0.2)
    T = 13
    y, res = make((T, K), torch.float32), make((T, 384), torch.float32, seed=3)
    with torch.no_grad():
        want = module(y[None], res[None])[0]
        got = residual_layernorm(y, module.dense.weight, module.dense.bias, res, module.LayerNorm.weight,
                                 module.LayerNorm.bias, config.layer_norm_eps, out=poisoned((T, 384), torch.float32))
    assert torch.isfinite(got).all()
    assert (got - want).abs().max().item() <= FP32_TOL


def test_through_dispatch():
    y, w, b, res, gamma, beta = inputs(7, 384, 384, torch.float32)
    got = ops.residual_layernorm(y, w, b, res, gamma, beta, 1e-12, backend="triton")
    want = ops.residual_layernorm(y, w, b, res, gamma, beta, 1e-12, backend="torch")
    assert (got - want).abs().max().item() <= FP32_TOL


# --------------------------------------------------------------------------------------------------------------------
# Pre-norm (s, LN(s)) and LayerNorm without bias (ModernBERT)
# --------------------------------------------------------------------------------------------------------------------
PRE_NORM_CASES = [  # (T, K, H): T = 1; T = 37 a partial program at every width (8 rows per program at 384, 4 at 768);
    (1, 384, 384),  # H = 100 one masked chunk; 1024 one chunk; I = 100 a K that is no multiple of 64
    (37, 100, 384),
    (13, 64, 768),
    (7, 64, 100),
    (5, 64, 1024),
]


@pytest.mark.parametrize("has_bias,has_ln_bias", [(False, False), (True, False), (True, True)],
                         ids=["nobias-nolnbias", "bias-nolnbias", "bias-lnbias"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T,K,H", PRE_NORM_CASES, ids=[f"T{t}-K{k}-H{h}" for t, k, h in PRE_NORM_CASES])
def test_pre_norm(T, K, H, dtype, has_bias, has_ln_bias):
    """Both outputs against the twin and fp64: s (the new residual stream) and LN(s)."""
    y, w, b, res, gamma, beta = inputs(T, K, H, dtype, bias=has_bias)
    beta = beta if has_ln_bias else None
    eps = 1e-5
    s_out, ln_out = poisoned((T, H), dtype), poisoned((T, H), dtype)
    s, normed = residual_layernorm(y, w, b, res, gamma, beta, eps, pre_norm=True, out=ln_out, residual_out=s_out)
    assert s.data_ptr() == s_out.data_ptr() and normed.data_ptr() == ln_out.data_ptr()
    twin_s, twin_normed = ops.residual_layernorm_torch(y, w, b, res, gamma, beta, eps, pre_norm=True)
    ref_s, ref_normed = reference64(y, w, b, res, gamma, beta, eps, pre_norm=True)
    assert_kernel_matches(s, twin_s, ref_s, dtype)
    assert_kernel_matches(normed, twin_normed, ref_normed, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("H", [384, 100])
def test_post_norm_without_ln_bias(H, dtype):
    T, K = 13, 64
    y, w, b, res, gamma, _ = inputs(T, K, H, dtype)
    got = residual_layernorm(y, w, b, res, gamma, None, 1e-5, out=poisoned((T, H), dtype))
    twin = ops.residual_layernorm_torch(y, w, b, res, gamma, None, 1e-5)
    assert_kernel_matches(got, twin, reference64(y, w, b, res, gamma, None, 1e-5), dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_pre_norm_normalises_the_rounded_stream(dtype):
    """In 16-bit types LN is taken of s as stored (rounded), as the twin's `h += residual` does: a residual near 64
    with O(0.1) rows makes that rounding large against the row's spread, so LN of the unrounded sum is far off."""
    T, K, H = 8, 64, 384
    y, w, b, _, gamma, _ = inputs(T, K, H, dtype)
    w = w * 0.1
    res = make((T, H), dtype, scale=0.1, shift=64.0, seed=3)
    s, normed = residual_layernorm(y, w, b, res, gamma, None, 1e-5, pre_norm=True)
    of_stored = F.layer_norm(s.double(), (H,), gamma.double(), None, 1e-5)
    of_exact = reference64(y, w, b, res, gamma, None, 1e-5)
    ulp = 2 ** -10 if dtype == torch.float16 else 2 ** -7
    scale = of_stored.abs().max().item()
    assert max_error(normed, of_stored) <= ulp * scale  # one rounding of LN(stored s)
    assert max_error(normed, of_exact) > 10 * ulp * scale  # the other choice would be this far away


def test_pre_norm_default_outputs_and_in_place_stream():
    """Without outputs: s in the GEMM's buffer, LN(s) in a fresh one (two distinct tensors). residual_out=residual
    updates the stream in place."""
    T, K, H = 13, 384, 384
    y, w, b, res, gamma, _ = inputs(T, K, H, torch.float32)
    want_s, want_normed = ops.residual_layernorm_torch(y, w, b, res, gamma, None, 1e-5, pre_norm=True)
    s, normed = residual_layernorm(y, w, b, res, gamma, None, 1e-5, pre_norm=True)
    assert s.data_ptr() != normed.data_ptr() and s.is_contiguous() and normed.is_contiguous()
    assert max_error(s, want_s) <= FP32_TOL and max_error(normed, want_normed) <= FP32_TOL
    stream = res.clone()
    s, normed = residual_layernorm(y, w, b, stream, gamma, None, 1e-5, pre_norm=True, residual_out=stream)
    assert s.data_ptr() == stream.data_ptr()
    assert max_error(stream, want_s) <= FP32_TOL and max_error(normed, want_normed) <= FP32_TOL
    unchecked = rln_mod.launch(y, w, b, res, gamma, None, 1e-5, True)
    assert all(torch.equal(a, c) for a, c in zip(unchecked, residual_layernorm(y, w, b, res, gamma, None, 1e-5,
                                                                               pre_norm=True)))


def test_pre_norm_nan_row_stays_in_its_row():
    T, K, H = 13, 64, 768
    y, w, b, res, gamma, _ = inputs(T, K, H, torch.float32)
    bad = rln_mod.row_config(H)[0] + 1
    res[bad, 5] = float("nan")
    s, normed = residual_layernorm(y, w, b, res, gamma, None, 1e-5, pre_norm=True)
    assert torch.isnan(normed[bad]).all() and torch.isnan(s[bad, 5]) and torch.isfinite(s[bad, :5]).all()
    keep = torch.arange(T) != bad
    assert torch.isfinite(s[keep]).all() and torch.isfinite(normed[keep]).all()


def test_pre_norm_zero_tokens():
    y, w, b, res, gamma, _ = inputs(0, 384, 384, torch.float32)
    s, normed = residual_layernorm(y, w, b, res, gamma, None, 1e-5, pre_norm=True)
    assert s.shape == normed.shape == (0, 384)


def test_pre_norm_through_dispatch():
    y, w, b, res, gamma, _ = inputs(7, 384, 384, torch.float32)
    got = ops.residual_layernorm(y, w, b, res, gamma, None, 1e-5, pre_norm=True, backend="triton")
    want = ops.residual_layernorm(y, w, b, res, gamma, None, 1e-5, pre_norm=True, backend="torch")
    assert len(got) == len(want) == 2
    assert all(max_error(g, t) <= FP32_TOL for g, t in zip(got, want))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_pre_norm_custom_op(backend):
    """A traced forward records the pre-norm form as fastbert::residual_layernorm_pre (two outputs) and the
    post-norm form without LN bias as fastbert::residual_layernorm; torch.library checks both schemas and fakes."""
    from fastbert import dispatch
    y, w, b, res, gamma, _ = inputs(7, 384, 384, torch.float32)
    run = dispatch.traced_ops(dict.fromkeys(ops.OPS, backend))["residual_layernorm"]
    s, normed = run(y, w, b, res, gamma, None, 1e-5, pre_norm=True)
    want_s, want_normed = reference64(y, w, b, res, gamma, None, 1e-5, pre_norm=True)
    assert max_error(s, want_s) <= FP32_TOL and max_error(normed, want_normed) <= FP32_TOL
    post = run(y, w, b, res, gamma, None, 1e-5)
    assert max_error(post, reference64(y, w, b, res, gamma, None, 1e-5)) <= FP32_TOL
    for op in (torch.ops.fastbert.residual_layernorm_pre.default, torch.ops.fastbert.residual_layernorm.default):
        torch.library.opcheck(op, (y, w, b, res, gamma, None, 1e-5, backend),
                              test_utils=("test_schema", "test_faketensor"))


def test_traced_callables_take_the_twins_arguments():
    """Each traced op callable has its twin's signature (the layer calls either with the same arguments), less the
    twin's `fmt`: dispatch binds a number format into the twin, and a forward in one is never traced (dispatch
    refuses it)."""
    import inspect

    from fastbert import dispatch, units
    traced = dispatch.traced_ops(dict.fromkeys(ops.OPS, "torch"))
    for op in ops.OPS:
        def params(fn):
            return [(p.name, p.default) for p in inspect.signature(fn).parameters.values() if p.name != "fmt"]
        assert params(traced[op]) == params(units.UNITS[op].twin), op


# --------------------------------------------------------------------------------------------------------------------
# RMSNorm in LayerNorm's place (EuroBERT): rms=True, no LN bias, in either form
# --------------------------------------------------------------------------------------------------------------------
def rms_reference64(y, w, b, res, gamma, eps, pre_norm=False):
    """fp64 from the same rounded inputs: s = y @ W^T + b + residual, gamma * s / sqrt(mean(s^2) + eps)."""
    d = lambda t: None if t is None else t.double()  # noqa: E731
    s = F.linear(d(y), d(w), d(b)) + d(res)
    normed = d(gamma) * s / torch.sqrt(s.pow(2).mean(-1, keepdim=True) + eps)
    return (s, normed) if pre_norm else normed


def assert_rms_matches(out, twin, ref64, dtype):
    """assert_kernel_matches, except for bf16 in the interpreter: it rounds float32 -> bfloat16 toward zero (Triton's
    interpreter.py, cast_impl; measured under 3.6 and 3.9), compiled code to nearest even, so each of RMSNorm's three
    roundings (s, the normalised row, the output) may be off by a whole ulp where the twin's are off by half of one:
    the twin's error is doubled before the 2x rule."""
    if dtype == torch.bfloat16 and kernel_utils.INTERPRET:
        assert torch.isfinite(out).all() and out.dtype == dtype
        twin_err = max_error(twin, ref64)
        assert max_error(out, ref64) <= error_bound(dtype, 2 * twin_err), (max_error(out, ref64), twin_err)
    else:
        assert_kernel_matches(out, twin, ref64, dtype)


RMS_CASES = [  # (T, K, H): T = 1; partial programs (8 rows a program at 384, 4 at 768 and 1024, 16 at 200); K = H
    (1, 384, 384),  # and K = I (1536, and 100: no multiple of 64); H = 200 one masked chunk of 256
    (7, 1536, 384),
    (37, 100, 768),
    (13, 768, 768),
    (5, 64, 1024),
    (7, 64, 200),
    (131, 64, 200),
]


@pytest.mark.parametrize("pre_norm", [True, False], ids=["prenorm", "postnorm"])
@pytest.mark.parametrize("has_bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T,K,H", RMS_CASES, ids=[f"T{t}-K{k}-H{h}" for t, k, h in RMS_CASES])
def test_rms(T, K, H, dtype, has_bias, pre_norm):
    """The RMSNorm kernel against the twin (transformers' RMSNorm math) and fp64: s and RMS(s) (pre-norm), RMS(s)
    (post-norm)."""
    y, w, b, res, gamma, _ = inputs(T, K, H, dtype, bias=has_bias)
    eps = 1e-6
    ln_out, s_out = poisoned((T, H), dtype), poisoned((T, H), dtype) if pre_norm else None
    got = residual_layernorm(y, w, b, res, gamma, None, eps, pre_norm=pre_norm, out=ln_out, residual_out=s_out,
                             rms=True)
    twin = ops.residual_layernorm_torch(y, w, b, res, gamma, None, eps, pre_norm=pre_norm, rms=True)
    ref = rms_reference64(y, w, b, res, gamma, eps, pre_norm)
    if pre_norm:
        assert got[0].data_ptr() == s_out.data_ptr() and got[1].data_ptr() == ln_out.data_ptr()
        assert_rms_matches(got[0], twin[0], ref[0], dtype)
        assert_rms_matches(got[1], twin[1], ref[1], dtype)
    else:
        assert got.data_ptr() == ln_out.data_ptr()
        assert_rms_matches(got, twin, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("eps", [1e-6, 0.5])
def test_rms_strided_inputs_and_eps(dtype, eps):
    """y and residual as strided views; an eps (0.5) large against mean(s^2) (~2), so that using it wrongly (or a
    LayerNorm's centring) shows."""
    T, K, H = 13, 384, 768
    y = make((T, K + 40), dtype)[:, :K]
    res = make((2 * T, H), dtype, seed=3)[::2]
    _, w, b, _, gamma, _ = inputs(T, K, H, dtype)
    s, normed = residual_layernorm(y, w, b, res, gamma, None, eps, pre_norm=True, rms=True)
    twin_s, twin_normed = ops.residual_layernorm_torch(y, w, b, res, gamma, None, eps, pre_norm=True, rms=True)
    ref_s, ref_normed = rms_reference64(y, w, b, res, gamma, eps, pre_norm=True)
    assert_rms_matches(s, twin_s, ref_s, dtype)
    assert_rms_matches(normed, twin_normed, ref_normed, dtype)


def _eurobert_modules(H, dtype, eps=1e-5):
    """transformers' EuroBERT attention output projection (no bias, as EuroBERT-210m) and RMSNorm, non-trivial
    weights."""
    modeling = pytest.importorskip("transformers.models.eurobert.modeling_eurobert",
                                   reason="this transformers has no EuroBERT (5.24+)")
    torch.manual_seed(0)
    o_proj = torch.nn.Linear(H, H, bias=False)
    norm = modeling.EuroBertRMSNorm(H, eps=eps)
    with torch.no_grad():
        o_proj.weight.normal_(0.0, H ** -0.5)
        norm.weight.normal_(1.0, 0.3)
    return o_proj.to(DEVICE, dtype).requires_grad_(False), norm.to(DEVICE, dtype).requires_grad_(False)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_matches_transformers(dtype):
    """EuroBertDecoderLayer's `residual + o_proj(attn)`, then its post_attention_layernorm: the twin is transformers'
    computation op for op (equal bit for bit in every dtype); the kernel is within 1e-5 in fp32, and in fp16/bf16
    as close to fp64 as 2x transformers' own error."""
    T, H = 13, 384
    o_proj, norm = _eurobert_modules(H, dtype)
    ctx, res = make((T, H), dtype), make((T, H), dtype, seed=3)
    with torch.no_grad():
        want_s = res + o_proj(ctx)
        want = norm(want_s)
        twin_s, twin = ops.residual_layernorm_torch(ctx, o_proj.weight, None, res, norm.weight, None,
                                                    norm.variance_epsilon, pre_norm=True, rms=True)
        s, got = residual_layernorm(ctx, o_proj.weight, None, res, norm.weight, None, norm.variance_epsilon,
                                    pre_norm=True, out=poisoned((T, H), dtype), rms=True)
    assert torch.equal(twin_s, want_s) and torch.equal(twin, want)
    ref_s, ref = rms_reference64(ctx, o_proj.weight, None, res, norm.weight, norm.variance_epsilon, pre_norm=True)
    assert_rms_matches(s, want_s, ref_s, dtype)
    assert_rms_matches(got, want, ref, dtype)


# The interpreter rounds float32 -> bfloat16 toward zero (measured under Triton 3.6 and 3.9), compiled code to nearest
# even (cvt.rn): bf16's roundings can be checked bit for bit only on a GPU.
ROUNDING_DTYPES = [torch.float16] + ([torch.bfloat16] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("dtype", ROUNDING_DTYPES, ids=str)
def test_rms_rounds_as_transformers(dtype):
    """transformers rounds the normalised row to the input dtype and then multiplies by the weight in that dtype:
    two roundings. With s exact (y @ W^T = 0, s = residual) the kernel agrees with EuroBertRMSNorm bit for bit on
    nearly every element (an fp32 rsqrt may differ in its last bit), where one rounding of weight * normalised
    would agree on about three quarters only."""
    T, H = 16, 768
    _, norm = _eurobert_modules(H, dtype)
    res = make((T, H), dtype, seed=3)
    zero_y, zero_w = torch.zeros((T, 16), dtype=dtype, device=DEVICE), torch.zeros((H, 16), dtype=dtype, device=DEVICE)
    with torch.no_grad():
        want = norm(res)
        s, got = residual_layernorm(zero_y, zero_w, None, res, norm.weight, None, norm.variance_epsilon,
                                    pre_norm=True, rms=True)
    assert torch.equal(s, res)
    one_rounding = (norm.weight.double() * rms_reference64(zero_y, zero_w, None, res, torch.ones_like(norm.weight),
                                                           norm.variance_epsilon)).to(dtype)
    assert (one_rounding == want).float().mean().item() < 0.9  # the test can tell the two apart
    assert (got == want).float().mean().item() >= 0.99
    ulp = 2 ** -10 if dtype == torch.float16 else 2 ** -7
    assert max_error(got, want) <= ulp * want.abs().max().item()


def test_rms_nan_row_stays_in_its_row():
    T, K, H = 13, 64, 768
    y, w, b, res, gamma, _ = inputs(T, K, H, torch.float32)
    bad = rln_mod.row_config(H)[0] + 1
    res[bad, 5] = float("nan")
    s, normed = residual_layernorm(y, w, b, res, gamma, None, 1e-6, pre_norm=True, rms=True)
    assert torch.isnan(normed[bad]).all() and torch.isnan(s[bad, 5]) and torch.isfinite(s[bad, :5]).all()
    keep = torch.arange(T) != bad
    assert torch.isfinite(s[keep]).all() and torch.isfinite(normed[keep]).all()


def test_rms_twin_refuses_an_ln_bias():
    y, w, b, res, gamma, beta = inputs(7, 64, 384, torch.float32)
    with pytest.raises(ValueError, match="RMSNorm has no bias"):
        ops.residual_layernorm_torch(y, w, b, res, gamma, beta, 1e-6, pre_norm=True, rms=True)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_rms_custom_op(backend):
    """A traced forward records RMSNorm as the same two custom ops with rms=True; torch.library checks the schemas
    (rms defaults to False) and fakes."""
    from fastbert import dispatch
    y, w, b, res, gamma, _ = inputs(7, 384, 384, torch.float32)
    run = dispatch.traced_ops(dict.fromkeys(ops.OPS, backend))["residual_layernorm"]
    s, normed = run(y, w, b, res, gamma, None, 1e-6, pre_norm=True, rms=True)
    want_s, want_normed = rms_reference64(y, w, b, res, gamma, 1e-6, pre_norm=True)
    assert max_error(s, want_s) <= FP32_TOL and max_error(normed, want_normed) <= FP32_TOL
    post = run(y, w, b, res, gamma, None, 1e-6, rms=True)
    assert max_error(post, rms_reference64(y, w, b, res, gamma, 1e-6)) <= FP32_TOL
    for op in (torch.ops.fastbert.residual_layernorm_pre.default, torch.ops.fastbert.residual_layernorm.default):
        torch.library.opcheck(op, (y, w, b, res, gamma, None, 1e-6, backend, True),
                              test_utils=("test_schema", "test_faketensor"))


def test_rms_variant_key_and_contenders():
    """"auto" keys RMSNorm apart from LayerNorm, and times the RMS form: its two contenders compute the same."""
    from fastbert import measure, units
    unit = units.residual_layernorm
    rms = unit.Variant(pre_norm=True, rms=True)
    shapes = measure.Shapes(128, 768, 3072, 12, 64, 128, "silu", residual_layernorm=rms)
    assert measure.op_key(unit.OP, torch.bfloat16, shapes) == "residual_layernorm|bfloat16|T128|H768|I3072|prenorm|rms"
    layer_norm = dataclasses.replace(shapes, residual_layernorm=unit.Variant(pre_norm=True))
    assert measure.op_key(unit.OP, torch.bfloat16, layer_norm).endswith("|prenorm")
    small = measure.Shapes(7, 384, 96, 6, 64, 8, "silu", residual_layernorm=rms)
    kernel_fn, twin_fn = measure.contenders(unit.OP, torch.float32, small, DEVICE, unit.kernel, unit.twin)
    for got, want in zip(kernel_fn(), twin_fn()):  # after attention, after the FFN: (s, RMS(s)) each
        assert all(max_error(g, t) <= FP32_TOL for g, t in zip(got, want))


# --------------------------------------------------------------------------------------------------------------------
# Bad inputs
# --------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case,exc,match", [
    ("y_1d", ValueError, r"y must be 2-D"),
    ("k_mismatch", ValueError, r"y.shape\[1\]=384 must match weight.shape\[1\]=383"),
    ("bias_shape", ValueError, r"bias must be \[384\]"),
    ("residual_shape", ValueError, r"residual.shape=\(7, 383\) must be \(7, 384\)"),
    ("residual_column_stride", ValueError, r"residual must have a unit-stride last dimension"),
    ("gamma_shape", ValueError, r"ln_weight.shape=\(383,\) must be \(384,\)"),
    ("beta_strided", ValueError, r"ln_bias must be contiguous"),
    ("dtype_mismatch", TypeError, r"share one dtype.*ln_weight.dtype=torch.float16"),
    ("eps_negative", ValueError, r"eps must be a non-negative float; got eps=-1e-05"),
    ("eps_string", ValueError, r"eps must be a non-negative float"),
    ("too_wide", ValueError, r"hidden size H=16385 exceeds 16384"),
    ("device_mismatch", ValueError, r"one device.*residual on meta"),
    ("out_shape", ValueError, r"out.shape=\(7, 385\) must be \(7, 384\)"),
    ("out_dtype", TypeError, r"out.dtype=torch.float64 must be"),
    ("pre_norm_not_bool", TypeError, r"pre_norm must be a bool; got pre_norm=1"),
    ("residual_out_post_norm", ValueError, r"residual_out is the pre-norm form's second output"),
    ("residual_out_is_out", ValueError, r"out and residual_out .* must not overlap"),
    ("residual_out_shape", ValueError, r"out.shape=\(7, 383\) must be \(7, 384\)"),
    ("ln_bias_shape_pre_norm", ValueError, r"ln_bias.shape=\(383,\) must be \(384,\)"),
    ("rms_not_bool", TypeError, r"rms must be a bool; got rms=1"),
    ("rms_with_ln_bias", ValueError, r"RMSNorm has no bias .* got ln_bias of shape \(384,\)"),
])
def test_bad_inputs(case, exc, match):
    y, w, b, res, gamma, beta = inputs(7, 384, 384, torch.float32)
    eps, out, pre_norm, residual_out, rms = 1e-12, None, False, None, False
    if case == "y_1d":
        y = y[0]
    elif case == "k_mismatch":
        w = w[:, :383]
    elif case == "bias_shape":
        b = b[:-1]
    elif case == "residual_shape":
        res = res[:, :383]
    elif case == "residual_column_stride":
        res = make((384, 7), torch.float32).t()
    elif case == "gamma_shape":
        gamma = gamma[:-1]
    elif case == "beta_strided":
        beta = make((768,), torch.float32)[::2]
    elif case == "dtype_mismatch":
        gamma = gamma.half()
    elif case == "eps_negative":
        eps = -1e-5
    elif case == "eps_string":
        eps = "1e-12"
    elif case == "too_wide":
        y, w, b, res, gamma, beta = inputs(1, 1, 16385, torch.float32)
    elif case == "device_mismatch":
        res = torch.empty(res.shape, device="meta")
    elif case == "out_shape":
        out = torch.empty((7, 385), device=DEVICE)
    elif case == "out_dtype":
        out = torch.empty((7, 384), dtype=torch.float64, device=DEVICE)
    elif case == "pre_norm_not_bool":
        pre_norm = 1
    elif case == "residual_out_post_norm":
        residual_out = torch.empty((7, 384), device=DEVICE)
    elif case == "residual_out_is_out":
        pre_norm, out = True, torch.empty((7, 384), device=DEVICE)
        residual_out = out
    elif case == "residual_out_shape":
        pre_norm, residual_out = True, torch.empty((7, 383), device=DEVICE)
    elif case == "ln_bias_shape_pre_norm":
        pre_norm, beta = True, beta[:-1]
    elif case == "rms_not_bool":
        rms, beta = 1, None
    elif case == "rms_with_ln_bias":
        pre_norm, rms = True, True
    with pytest.raises(exc, match=match):
        residual_layernorm(y, w, b, res, gamma, beta, eps, pre_norm=pre_norm, out=out, residual_out=residual_out,
                           rms=rms)


def test_cpu_tensors_need_the_interpreter(monkeypatch):
    monkeypatch.setattr(kernel_utils, "INTERPRET", False)
    y, w, b, res, gamma, beta = (t.cpu() for t in inputs(7, 384, 384, torch.float32))
    with pytest.raises(ValueError, match=r"tensors are on cpu; the Triton kernels need CUDA tensors"):
        residual_layernorm(y, w, b, res, gamma, beta, 1e-12)


@pytest.mark.parametrize("hidden,expected", [(384, (8, 128, 3, 4)), (768, (4, 256, 3, 4)), (1024, (4, 1024, 1, 4))])
def test_no_idle_lanes_at_bert_sizes(hidden, expected):
    """BERT's hidden sizes as whole power-of-two chunks (3 x 128, 3 x 256, 1 x 1024); ~4K elements per program."""
    assert rln_mod.row_config(hidden) == expected


def test_every_width_takes_one_or_three_chunks():
    """The kernel has code for 1 and 3 chunks only (an odd part of at most 4 is 1 or 3): every width the launcher
    takes gets one of them, as whole chunks or one masked chunk."""
    for hidden in range(1, rln_mod.MAX_HIDDEN + 1):
        rows, chunk, num_chunks, warps = rln_mod.row_config(hidden)
        assert num_chunks in (1, 3), hidden
        assert chunk * num_chunks == hidden or (num_chunks == 1 and chunk == triton.next_power_of_2(hidden)), hidden


def test_kernel_refuses_other_chunk_counts():
    """A chunk count the kernel has no code for is refused when it is built, not computed as if it were 1."""
    T, H = 4, 128
    h, res = torch.randn(T, H, device=DEVICE), torch.randn(T, H, device=DEVICE)
    gamma, beta = torch.ones(H, device=DEVICE), torch.zeros(H, device=DEVICE)
    out = poisoned((T, H), torch.float32)
    for num_chunks in (2, 4):
        with pytest.raises(Exception, match="NUM_CHUNKS must be 1 or 3"):
            rln_mod.bias_residual_layernorm_kernel[(1,)](
                h, h, res, gamma, beta, out, out, out, T, H, 1e-5, H, H, H, H,
                HAS_BIAS=False, HAS_LN_BIAS=True, PRE_NORM=False, RMS=False, ROWS=4, CHUNK=H // num_chunks,
                NUM_CHUNKS=num_chunks, EVEN=True)


def test_row_config_fallback_and_limits():
    for hidden in (100, 640, 1023, 5, rln_mod.MAX_HIDDEN):
        rows, chunk, num_chunks, warps = rln_mod.row_config(hidden)
        assert chunk * num_chunks >= hidden and chunk & (chunk - 1) == 0 and rows & (rows - 1) == 0
        assert num_chunks == 1 or chunk * num_chunks == hidden
        assert rows * chunk * num_chunks // (32 * warps) <= 32  # values per thread per pass
    assert rln_mod.row_config(640)[1:3] == (1024, 1)


def test_aot_specs():
    """The post-norm kernel for every dtype x {bias, no bias} x kernel config row_config gives over 1..MAX_HIDDEN (40
    of them, the masked ones included), each with the config of the width it is named after; then the pre-norm,
    no-LN-bias and RMSNorm variants (ModernBERT's pre-norm without LN bias, pre-norm with one, post-norm without one,
    EuroBERT's pre-norm RMSNorm) at 384, 768 and 1024, for every dtype x {bias, no bias}. Training's forward (the
    pre-norm form writing the statistics, "-stats") and backward ("-backward"), for every dtype x norm kind of
    BACKWARD_VARIANTS at those widths, are checked in tests/kernels/test_residual_layernorm_backward.py."""
    every = rln_mod.aot_specs()
    names = [s["name"] for s in every]
    training = 3 * len(rln_mod.BACKWARD_VARIANTS) * len(rln_mod.BERT_HIDDEN)
    assert len(set(names)) == len(names) == 3 * 2 * 40 + 3 * 2 * 4 * 3 + 2 * training
    specs = [s for s in every if "-stats-" not in s["name"] and "-backward-" not in s["name"]]
    assert len(specs) == len(every) - 2 * training
    for must in ("residual_layernorm-fp16-H384-8x3x128-w4", "residual_layernorm-bf16-nobias-H768-4x3x256-w4",
                 "residual_layernorm-fp32-H1024-4x1x1024-w4", "residual_layernorm-fp16-H5-512x1x8-w4-masked",
                 "residual_layernorm-fp16-nobias-H8193-1x1x16384-w16-masked",
                 "residual_layernorm-bf16-nobias-prenorm-nolnbias-H768-4x3x256-w4",
                 "residual_layernorm-fp16-nobias-prenorm-nolnbias-H1024-4x1x1024-w4",
                 "residual_layernorm-fp16-prenorm-H384-8x3x128-w4",
                 "residual_layernorm-fp32-nolnbias-H1024-4x1x1024-w4",
                 "residual_layernorm-bf16-nobias-prenorm-rms-H768-4x3x256-w4",
                 "residual_layernorm-fp32-prenorm-rms-H384-8x3x128-w4"):
        assert must in names, must
    params = set(rln_mod.bias_residual_layernorm_kernel.arg_names) - {"STATS"}  # inference leaves it at its default
    for s in specs:
        assert s["fn"] is rln_mod.bias_residual_layernorm_kernel
        assert set(s["signature"]) | set(s["constexprs"]) == params and not set(s["signature"]) & set(s["constexprs"])
        c = s["constexprs"]
        hidden = int(s["name"].split("-H")[1].split("-")[0])
        assert (c["ROWS"], c["CHUNK"], c["NUM_CHUNKS"], s["num_warps"]) == rln_mod.row_config(hidden)
        assert c["EVEN"] == (c["CHUNK"] * c["NUM_CHUNKS"] == hidden) == ("-masked" not in s["name"])
        assert c["HAS_BIAS"] == ("-nobias" not in s["name"])
        assert c["PRE_NORM"] == ("-prenorm" in s["name"]) and c["RMS"] == ("-rms" in s["name"])
        assert c["HAS_LN_BIAS"] == ("-nolnbias" not in s["name"] and not c["RMS"])
        assert not c["RMS"] or c["PRE_NORM"]
        assert hidden in rln_mod.BERT_HIDDEN or (c["HAS_LN_BIAS"] and not c["PRE_NORM"])
        unhinted = {"T"} if hidden % 16 == 0 else {"T", "N", "stride_hm", "stride_rm", "stride_om", "stride_sm"}
        assert s["hints"] == dict.fromkeys(unhinted)
