"""residual_layernorm's backward on the kernels (units.residual_layernorm.train_kernel): the forward row kernel
with its row statistics, the backward row kernel (dS, dgamma / dbeta partial sums), the GEMM gradients in torch.

Every input's gradient is checked against the twin's autograd and against an fp64 reference (the twin's autograd in
float64 on the same rounded inputs and output gradients). fp32: within 1e-5 of both, scaled by the gradient's size
(max(1, max |reference|): dW, dgamma and dbeta sum over the rows). fp16: error against fp64 within 2x the twin's own
(+1e-6). The kernels take fp32/fp16/bf16, not float64, so there is no float64 gradcheck: the fp64 reference is the
anchor. bf16 is left to the forward's tests and the AOT compile (no tl.dot here, but the twin's bf16 CPU backward is
no yardstick at these sizes).
"""
import pytest
import torch
from helpers import DEVICE, FP32_TOL, max_error
from helpers import RESIDUAL_LAYERNORM_INPUTS as NAMES
from helpers import check_gradient as check
from helpers import residual_layernorm_inputs as inputs
from helpers import seeded as make

from fastbert.kernels import residual_layernorm as rln_mod
from fastbert.units import residual_layernorm as unit

# (pre_norm, rms, has_bias, has_ln_bias): the forms the models run
VARIANTS = {
    "post-bias-beta": (False, False, True, True),  # BERT
    "post-nobias-beta": (False, False, False, True),
    "post-bias-nobeta": (False, False, True, False),
    "pre-nobias-nobeta": (True, False, False, False),  # ModernBERT
    "pre-rms": (True, True, False, False),  # EuroBERT
}
WIDTHS = [32, 200, 384, 768]  # 200: one masked chunk of 256
ROWS = [1, 7, 37]

def grads(fn, tensors, cotangents, pre_norm, rms, eps=1e-5, dtype=None):
    """Every input's gradient of sum(output * cotangent), computed by fn on the tensors cast to dtype."""
    leaves = [None if t is None else t.detach().to(dtype or t.dtype).requires_grad_() for t in tensors]
    out = fn(*leaves, eps, pre_norm=pre_norm, rms=rms)
    outs = out if pre_norm else (out,)
    loss = sum((o * c.to(o.dtype)).sum() for o, c in zip(outs, cotangents))
    live = [t for t in leaves if t is not None]
    got = iter(torch.autograd.grad(loss, live))
    return [o.detach() for o in outs], [None if t is None else next(got) for t in leaves]


def cotangents(T, H, dtype, pre_norm, zero=False):
    dn = torch.zeros((T, H), dtype=dtype, device=DEVICE) if zero else make((T, H), dtype, seed=6)
    return (make((T, H), dtype, seed=7), dn) if pre_norm else (dn,)


def run_case(T, K, H, dtype, variant, zero_dn=False):
    pre_norm, rms, has_bias, has_ln_bias = VARIANTS[variant]
    tensors = inputs(T, K, H, dtype, has_bias, has_ln_bias)
    cots = cotangents(T, H, dtype, pre_norm, zero_dn)
    outs, got = grads(unit.train_kernel, tensors, cots, pre_norm, rms)
    twin_outs, twin = grads(unit.twin, tensors, cots, pre_norm, rms)
    ref_outs, ref = grads(unit.twin, tensors, [c.double() for c in cots], pre_norm, rms, dtype=torch.float64)
    for o, r in zip(outs, ref_outs):  # the forward the backward starts from
        assert torch.isfinite(o).all()
    for name, g, t, r in zip(NAMES, got, twin, ref):
        check(name, dtype, g, t, r)
    return got


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("H", WIDTHS)
@pytest.mark.parametrize("T", ROWS)
def test_gradients_fp32(T, H, variant):
    run_case(T, 48, H, torch.float32, variant)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("H", WIDTHS)
def test_gradients_fp16(H, variant):
    run_case(37, 48, H, torch.float16, variant)


@pytest.mark.parametrize("variant", ["post-bias-beta", "pre-rms"])
@pytest.mark.parametrize("H,T", [(768, 37), (32, 1100)])  # 3 programs; 3 programs of 512 rows at the narrow width
def test_backward_is_deterministic_across_programs(H, T, variant):
    """Several programs' dgamma / dbeta partials, reduced in a fixed order: two backward runs are bit-identical."""
    first = run_case(T, 32, H, torch.float32, variant)
    second = run_case(T, 32, H, torch.float32, variant)
    for name, a, b in zip(NAMES, first, second):
        assert (a is None and b is None) or torch.equal(a, b), name


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_zero_output_gradient(variant):
    """dN = 0: every gradient is exactly zero (post-norm), or exactly the stream's own gradient passed through to
    the residual (pre-norm), never NaN."""
    T, K, H = 7, 48, 200
    pre_norm, rms, has_bias, has_ln_bias = VARIANTS[variant]
    tensors = inputs(T, K, H, torch.float32, has_bias, has_ln_bias)
    cots = cotangents(T, H, torch.float32, pre_norm, zero=True)
    _, got = grads(unit.train_kernel, tensors, cots, pre_norm, rms)
    for name, g in zip(NAMES, got):
        if g is None:
            continue
        if pre_norm and name == "residual":
            assert torch.equal(g, cots[0]), name
        elif pre_norm and name in ("y", "weight", "bias"):
            assert torch.isfinite(g).all(), name  # the GEMM gradients of the stream's own gradient
        else:
            assert torch.equal(g, torch.zeros_like(g)), name
    run_case(T, K, H, torch.float32, variant, zero_dn=True)


def test_broadcast_output_gradient():
    """out.sum() hands the backward a stride-0 gradient: read as what it is."""
    T, K, H = 7, 48, 384
    tensors = inputs(T, K, H, torch.float32, True, True)
    leaves = [t.detach().requires_grad_() for t in tensors]
    twin_leaves = [t.detach().requires_grad_() for t in tensors]
    unit.train_kernel(*leaves, 1e-5).sum().backward()
    unit.twin(*twin_leaves, 1e-5).sum().backward()
    for name, a, b in zip(NAMES, leaves, twin_leaves):
        assert max_error(a.grad, b.grad) <= FP32_TOL * max(1.0, float(b.grad.abs().max())), name


def test_inputs_without_grad_get_none():
    """The backward returns None for inputs that need no gradient (the GEMMs and reductions are skipped)."""
    T, K, H = 7, 48, 384
    y, w, b, res, gamma, beta = inputs(T, K, H, torch.float32, True, True)
    y.requires_grad_()
    gamma.requires_grad_()
    out = unit.train_kernel(y, w, b, res, gamma, beta, 1e-5)
    dy, dgamma = torch.autograd.grad(out.sum(), [y, gamma], retain_graph=True)
    assert dy.shape == y.shape and dgamma.shape == gamma.shape
    node = out.grad_fn
    returned = node.apply(torch.ones_like(out))
    # y, weight, bias, residual, ln_weight, ln_bias, then eps, dropout_p, pre_norm, rms (not tensors)
    assert [r is None for r in returned] == [False, True, True, True, False, True, True, True, True, True]


@pytest.mark.parametrize("rms", [False, True])
def test_forward_statistics(rms):
    """The statistics the forward writes are the norm's own: mean and 1/std of s (LayerNorm), 1/rms (RMSNorm)."""
    T, K, H = 37, 48, 200
    y, w, b, res, gamma, beta = inputs(T, K, H, torch.float32, True, not rms)
    s, _, stats = rln_mod.train_forward(y, w, b, res, gamma, beta, 1e-5, rms=rms)
    s64 = s.double()
    if rms:
        want = [torch.rsqrt(s64.pow(2).mean(-1) + 1e-5)]
    else:
        want = [s64.mean(-1), torch.rsqrt(s64.var(-1, unbiased=False) + 1e-5)]
    assert stats.shape == (len(want), T)
    for got, ref in zip(stats, want):
        assert max_error(got, ref) <= FP32_TOL


def test_forward_refuses_malformed_statistics():
    y, w, b, res, gamma, beta = inputs(7, 48, 384, torch.float32, True, True)
    with pytest.raises(ValueError, match=r"stats must be a contiguous float32 tensor of shape \(2, 7\)"):
        rln_mod.residual_layernorm(y, w, b, res, gamma, beta, 1e-5, stats=torch.empty(1, 7, device=DEVICE))
