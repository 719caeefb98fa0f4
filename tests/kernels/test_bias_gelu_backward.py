"""bias_gelu's backward (fastbert/units/bias_gelu.py's `train_kernel`, kernels/bias_gelu.py's derivative kernel).

The gradients of x, W and b through the kernel path are checked against the twin's autograd in the same dtype and
against the twin's autograd in fp64 from the same rounded inputs, for every activation, plain and gated, with and
without bias, at shapes with ragged edges (the derivative kernel's 1024-column block and the GEMM's tiles both end
inside a row). Gradients are sums over T or H of O(1) terms, so the fp32 bar is FP32_TOL relative to the largest
reference gradient (at least 1); fp16 follows fastbert.numerics (within 2x the twin's own error against fp64).
Pre-activations of +-30 must give finite gradients that saturate as the fp64 ones do. The derivative kernel alone is
checked elementwise against torch.autograd of twins.activate in fp64 (all three dtypes: it runs no tl.dot, so the
interpreter takes bf16 too), its output poisoned with NaN first.

Without CUDA this runs Triton's interpreter (tests/conftest.py); bf16 through the GEMMs runs on CUDA only
(triton-lang/triton#11584).
"""
import itertools

import pytest
import torch
from helpers import DEVICE, FP32_TOL, poisoned

from fastbert import twins
from fastbert.kernels import bias_gelu as kernel_mod
from fastbert.numerics import error_bound, max_error
from fastbert.units import bias_gelu as unit

# gemm._gelu_tanh lets exp2 overflow to inf for very negative x on purpose (the result is then -0.0, as tanh's);
# the interpreter's numpy says so
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp2:RuntimeWarning")

ACTIVATIONS = ("gelu", "gelu_tanh", "relu", "silu")
BF16_GEMM_ON_CPU = pytest.mark.skipif(
    DEVICE == "cpu", reason="Triton's interpreter cannot run bf16 tl.dot (triton-lang/triton#11584); runs on CUDA")
GEMM_DTYPES = [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=BF16_GEMM_ON_CPU)]
SHAPES = [(1, 32, 40), (7, 48, 100), (37, 32, 100), (37, 48, 40)]  # (T, K, I): M 1, 7, 37; K 32, 48; I 40, 100


def make(shape, dtype, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype).to(DEVICE)


def leaves(*tensors):
    return [None if t is None else t.detach().clone().requires_grad_() for t in tensors]


def grads(fn, x, w, b, dout, activation, gated):
    """(dx, dW, db) of fn(x, w, b, activation, gated) against dout, from fresh leaves (db None without bias)."""
    x, w, b = leaves(x, w, b)
    y = fn(x, w, b, activation, gated)
    inputs = [t for t in (x, w, b) if t is not None]
    got = torch.autograd.grad(y, inputs, dout.to(y.dtype))
    return (*got, None) if b is None else got


def assert_grads_match(got, twin, ref64, dtype):
    for name, g, t, r in zip(("dx", "dW", "db"), got, twin, ref64):
        if r is None:
            assert g is None and t is None
            continue
        assert g.shape == r.shape and g.dtype == dtype, (name, g.shape, g.dtype)
        assert torch.isfinite(g).all(), f"{name}: NaN/inf in the kernel path's gradient"
        err = max_error(g, r)
        if dtype == torch.float32:
            scale = max(1.0, r.abs().max().item())
            assert err <= FP32_TOL * scale, f"{name}: error {err:.3g} against fp64 > {FP32_TOL * scale:.3g}"
            diff = max_error(g, t)
            assert diff <= FP32_TOL * scale, f"{name}: kernel vs twin {diff:.3g} > {FP32_TOL * scale:.3g}"
        else:
            bound = error_bound(dtype, max_error(t, r))
            assert err <= bound, f"{name}: error {err:.3g} against fp64 > bound {bound:.3g}"


def check_case(x, w, b, dout, activation, gated, dtype):
    got = grads(unit.train_kernel, x, w, b, dout, activation, gated)
    twin = grads(unit.twin, x, w, b, dout, activation, gated)
    ref64 = grads(unit.twin, *(None if t is None else t.double() for t in (x, w, b)), dout.double(), activation,
                  gated)
    assert_grads_match(got, twin, ref64, dtype)
    return got, ref64


# --------------------------------------------------------------------------------------------------------------------
# Gradients through the kernel path
# --------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("has_bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", GEMM_DTYPES, ids=str)
@pytest.mark.parametrize("T,K,I", SHAPES, ids=[f"T{t}-K{k}-I{i}" for t, k, i in SHAPES])
def test_gradients(T, K, I, dtype, activation, gated, has_bias):
    N = 2 * I if gated else I
    x = make((T, K), dtype)
    w = make((N, K), dtype, scale=K ** -0.5, seed=1)
    b = make((N,), dtype, scale=0.5, seed=2) if has_bias else None
    dout = make((T, I), dtype, seed=3)
    check_case(x, w, b, dout, activation, gated, dtype)


@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_large_pre_activations_saturate(dtype, activation, gated):
    """Pre-activations spread over [-30, 30] (the bias carries them, x @ W^T is small): finite gradients, equal to
    fp64's; with one token and dOut = 1, db is act'(h) itself, 0 or 1 at |h| = 30 (gated: g act'(a) and act(a))."""
    I = 40
    N = 2 * I if gated else I
    x = make((1, 32), dtype, scale=1e-3)
    w = make((N, 32), dtype, scale=32 ** -0.5, seed=1)
    b = torch.linspace(-30, 30, N, dtype=torch.float64)
    if gated:  # a spans [-30, 30], g = +-30 alternately
        b = torch.cat((torch.linspace(-30, 30, I, dtype=torch.float64), 30 * (-1.0) ** torch.arange(I)))
    b = b.to(dtype).to(DEVICE)
    dout = torch.ones((1, I), dtype=dtype, device=DEVICE)
    got, ref64 = check_case(x, w, b, dout, activation, gated, dtype)
    db, db64 = got[2].double(), ref64[2]
    if gated:
        db_a, db64_a = db[:I], db64[:I]
        ends = [0, I - 1]
        assert torch.allclose(db_a[ends], db64_a[ends], atol=1e-3 * 30), (db_a[ends], db64_a[ends])
        assert db64_a[0].abs() < 1e-3 and (db64_a[-1] / 30).abs() == pytest.approx(1.0, abs=1e-3)
    else:
        assert db[0].abs() < 1e-6 and db[-1] == pytest.approx(1.0, abs=1e-3), (db[0], db[-1])


def test_expanded_and_strided_gradients():
    """dOut as autograd hands it after a .sum() (stride 0 everywhere), x with strided rows."""
    big = make((14, 96), torch.float32)
    x = big[::2, :48]
    w, b = make((200, 48), torch.float32, scale=48 ** -0.5, seed=1), make((200,), torch.float32, seed=2)
    for gated in (False, True):
        I = 100 if gated else 200
        dout = torch.ones((), dtype=torch.float32, device=DEVICE).expand(7, I)
        assert dout.stride() == (0, 0)
        check_case(x, w, b, dout, "gelu", gated, torch.float32)


def test_train_kernel_checks_its_arguments():
    x, w = make((3, 32), torch.float32), make((40, 32), torch.float32)
    with pytest.raises(ValueError, match="activation='tanh'"):
        unit.train_kernel(x, w, None, "tanh", checked=True)
    with pytest.raises(ValueError, match="x.shape\\[1\\]=32 must match weight.shape\\[1\\]=16"):
        unit.train_kernel(x, w[:, :16], None, checked=True)


def test_the_forward_is_the_inference_kernels_output():
    """train_kernel's forward is the inference launch, bit for bit (the epilogue kernel, h never written)."""
    x, w, b = make((7, 48), torch.float32), make((200, 48), torch.float32, 48 ** -0.5, 1), make((200,), torch.float32)
    for gated in (False, True):
        y = unit.train_kernel(*leaves(x, w, b), "silu", gated)
        assert y.requires_grad and torch.equal(y.detach(), kernel_mod.launch(x, w, b, "silu", gated))


# --------------------------------------------------------------------------------------------------------------------
# The derivative kernel alone
# --------------------------------------------------------------------------------------------------------------------
def derivative64(dout, h, activation, gated):
    h = h.double().requires_grad_()
    if gated:
        a, g = h.chunk(2, dim=-1)
        y = twins.activate(a, activation) * g
    else:
        y = twins.activate(h, activation)
    return torch.autograd.grad(y, h, dout.double())[0]


def pre_activations(T, N, dtype):
    """[-40, 40] densely (saturation, the kinks at 0), then random O(3) rows; 0 exactly somewhere."""
    h = torch.linspace(-40, 40, T * N, dtype=torch.float64).reshape(T, N)
    h[T // 2:] = make((T - T // 2, N), torch.float64, scale=3.0, seed=4)
    h[0, 0] = 0.0
    return h.to(dtype).to(DEVICE)


@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_derivative_kernel_matches_fp64_autograd(dtype, activation, gated):
    """dh = dOut * act'(h) (gated: [dOut g act'(a), dOut act(a)]) elementwise against fp64 autograd from the same
    rounded inputs: fp32 math to 1e-6 of each term's size, one rounding to the dtype on top (subnormals too).
    I = 1100 crosses the 1024-column block; dOut is a column slice (strided rows)."""
    T, I = 9, 1100
    h = pre_activations(T, 2 * I if gated else I, dtype)
    dout = make((T, I + 5), dtype, seed=5)[:, 2:I + 2]
    out = poisoned(tuple(h.shape), dtype)

    dh = kernel_mod.pre_activation_grad(dout, h, activation, gated, out=out)

    assert dh.data_ptr() == out.data_ptr() and torch.isfinite(dh).all()
    ref = derivative64(dout, h, activation, gated)
    # the size of each term: |dOut| (and |g| for the gated input half, |a| for the gated gate half)
    d = dout.double().abs()
    if gated:
        a, g = h.double().chunk(2, dim=-1)
        scale = torch.cat((d * (1 + g.abs()), d * (1 + a.abs())), dim=-1)
    else:
        scale = d
    # the rounding to the dtype: half an ulp, relative, or half the subnormal spacing (tiny * eps) near 0
    eps = 0.0 if dtype == torch.float32 else torch.finfo(dtype).eps
    tol = 1e-6 * scale + eps * (ref.abs() + torch.finfo(dtype).tiny)
    excess = ((dh.double() - ref).abs() - tol).max().item()
    assert excess <= 0, f"error exceeds the tolerance by {excess:.3g}"


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_derivative_kernel_in_place(activation):
    """out=h: dh overwrites the pre-activation (the backward's one [T, N] buffer), plain and gated."""
    for gated, (T, N) in itertools.product((False, True), [(5, 80)]):
        h = pre_activations(T, N, torch.float32)
        dout = make((T, N // 2 if gated else N), torch.float32, seed=6)
        want = kernel_mod.pre_activation_grad(dout, h, activation, gated)
        got = kernel_mod.pre_activation_grad(dout, h, activation, gated, out=h)
        assert got.data_ptr() == h.data_ptr() and torch.equal(got, want)
