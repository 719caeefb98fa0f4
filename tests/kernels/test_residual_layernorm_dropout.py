"""Dropout inside residual_layernorm's row kernels (units.residual_layernorm.train_kernel with dropout_p > 0).

The forward drops y @ W^T + b out before the residual joins, keep bits drawn from Philox at the element numbers
row * H + col with a seed taken from torch's generator; the backward regenerates the same bits from the same seed.
The kernels' mask is not the twin's (torch draws its own), so the reference here is the twin's math with the
kernel's own mask, recovered from a forward: a call whose GEMM output is all ones and whose residual is zero
returns s = keep / (1 - p), the mask itself. Gradients are checked against that reference in float64 with
tests/helpers.py's check_gradient bars (fp32: 1e-5 scaled by the gradient's size; fp16: 2x the same reference's
own fp16 error, + 1e-6).
"""
import math

import pytest
import torch
import torch.nn.functional as F
from helpers import DEVICE, max_error
from helpers import RESIDUAL_LAYERNORM_INPUTS as NAMES
from helpers import check_gradient as check
from helpers import residual_layernorm_inputs as inputs
from helpers import seeded as make

from fastbert.kernels import residual_layernorm as rln_mod
from fastbert.kernels import utils
from fastbert.units import residual_layernorm as unit

# (pre_norm, rms, has_bias, has_ln_bias)
VARIANTS = {
    "post-ln": (False, False, True, True),  # BERT
    "pre-ln": (True, False, False, False),  # ModernBERT
    "pre-rms": (True, True, False, False),  # EuroBERT
}
WIDTHS = [100, 384, 768]  # 100: one masked chunk of 128; 384 = 3 x 128 (8 rows a program); 768 = 3 x 256
EPS = 1e-5


def kernel_mask(seed: torch.Tensor, T: int, H: int, p: float) -> torch.Tensor:
    """The kernel's keep mask [T, H] (bool) for `seed`: the forward of a GEMM output of ones (a zero y and weight,
    a bias of ones) and a zero residual, whose stream s is 1 / (1 - p) where kept and exactly 0 where dropped."""
    y = torch.zeros((T, 1), device=DEVICE)
    w = torch.zeros((H, 1), device=DEVICE)
    ones = torch.ones(H, device=DEVICE)
    s, _, _ = rln_mod.train_forward(y, w, ones, torch.zeros((T, H), device=DEVICE), ones, None, EPS,
                                    dropout_p=p, seed=seed)
    return s != 0


def backward_mask(seed: torch.Tensor, T: int, H: int, p: float) -> torch.Tensor:
    """dH of the backward kernel for dS = 1 (a zero norm gradient, a stream gradient of ones): keep / (1 - p)."""
    s = torch.zeros((T, H), device=DEVICE)
    stats = torch.zeros((1, T), device=DEVICE)
    ds, dh, _, _ = rln_mod.layernorm_backward(torch.zeros_like(s), torch.ones_like(s), s, stats,
                                              torch.ones(H, device=DEVICE), False, rms=True, dropout_p=p, seed=seed)
    assert torch.equal(ds, torch.ones_like(ds))  # the residual's gradient does not pass the mask
    return dh


def masked_twin(y, weight, bias, residual, ln_weight, ln_bias, eps, keep, dropout_p, pre_norm=False, rms=False):
    """The twin's math with a given keep mask in place of torch's dropout."""
    h = F.linear(y, weight, bias) * keep.to(y.dtype) * (1.0 / (1.0 - dropout_p))
    s = h + residual
    normed = unit.rms_norm(s, ln_weight, eps) if rms else torch.layer_norm(s, (s.shape[-1],), ln_weight, ln_bias,
                                                                             eps)
    return (s, normed) if pre_norm else normed


def run(fn, tensors, cots, pre_norm, rms, p, dtype=None, **extra):
    """Outputs and every input's gradient of sum(output * cotangent), fn on the tensors cast to dtype."""
    leaves = [None if t is None else t.detach().to(dtype or t.dtype).requires_grad_() for t in tensors]
    out = fn(*leaves, EPS, dropout_p=p, pre_norm=pre_norm, rms=rms, **extra)
    outs = out if pre_norm else (out,)
    loss = sum((o * c.to(o.dtype)).sum() for o, c in zip(outs, cots))
    live = [t for t in leaves if t is not None]
    got = iter(torch.autograd.grad(loss, live))
    return [o.detach() for o in outs], [None if t is None else next(got) for t in leaves]


def cotangents(T, H, dtype, pre_norm):
    dn = make((T, H), dtype, seed=6)
    return (make((T, H), dtype, seed=7), dn) if pre_norm else (dn,)


def spy_launches(monkeypatch, kernel_name: str) -> list:
    """Records the keyword arguments of every launch of rln_mod.<kernel_name> (and still launches it)."""
    launches = []
    real = getattr(rln_mod, kernel_name)

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append(kwargs)
                return real[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(rln_mod, kernel_name, Spy())
    return launches


def seeded_call(seed_value, fn, *args, **kwargs):
    torch.manual_seed(seed_value)
    return fn(*args, **kwargs)


# ---- the keep bits ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_keep_rate_and_backward_mask(p):
    """Over 1,024,000 draws the keep rate is within 5 sigma of 1 - p; the backward regenerates exactly the forward's
    mask (dH = keep / (1 - p), dropped elements exactly 0); rows and columns are not copies of each other."""
    T, H = 1000, 1024
    torch.manual_seed(11)
    seed = utils.dropout_seed(DEVICE)
    keep = kernel_mask(seed, T, H, p)
    n = keep.numel()
    rate = keep.double().mean().item()
    sigma = math.sqrt(p * (1 - p) / n)
    assert abs(rate - (1 - p)) <= 5 * sigma, f"keep rate {rate:.6f} vs {1 - p} (5 sigma = {5 * sigma:.2e})"
    dh = backward_mask(seed, T, H, p)
    assert torch.equal(dh != 0, keep)
    scale = dh[keep]
    assert torch.equal(scale, torch.full_like(scale, scale[0].item()))
    assert abs(scale[0].item() - 1 / (1 - p)) <= 1e-6 / (1 - p)
    # the element number moves the stream along rows and columns (a row-only or column-only offset would repeat)
    assert not torch.equal(keep[0], keep[1]) and not torch.equal(keep[:, 0], keep[:, 1])


def test_seed_value_changes_the_mask():
    T, H = 37, 384
    first = kernel_mask(torch.tensor([5], dtype=torch.int64, device=DEVICE), T, H, 0.5)
    again = kernel_mask(torch.tensor([5], dtype=torch.int64, device=DEVICE), T, H, 0.5)
    other = kernel_mask(torch.tensor([6], dtype=torch.int64, device=DEVICE), T, H, 0.5)
    assert torch.equal(first, again) and not torch.equal(first, other)
    assert 0.4 < (first != other).double().mean().item() < 0.6  # two independent masks at p = 0.5 differ by half


def test_int64_element_numbers(monkeypatch):
    """Calls of more than DROPOUT_I32_ELEMENTS elements number them in int64: the same keep bits as the int32
    numbering (Philox takes the high word as a second counter word, zero here), forward and backward agree, and the
    gradients match the masked fp64 reference. The threshold is lowered so that a small call takes that path."""
    T, K, H, p = 37, 48, 768, 0.25
    seed = torch.tensor([123456789], dtype=torch.int64, device=DEVICE)
    narrow = kernel_mask(seed, T, H, p)
    monkeypatch.setattr(rln_mod, "DROPOUT_I32_ELEMENTS", T * H - 1)
    forward = spy_launches(monkeypatch, "bias_residual_layernorm_kernel")
    backward = spy_launches(monkeypatch, "layernorm_backward_kernel")
    wide = kernel_mask(seed, T, H, p)
    assert torch.equal(wide, narrow)
    assert torch.equal(backward_mask(seed, T, H, p) != 0, wide)
    assert [k["OFFSETS_I64"] for k in forward + backward] == [True, True]
    run_reference_case(T, K, H, torch.float32, "pre-rms", p)


# ---- gradients ----------------------------------------------------------------------------------------------------
def run_reference_case(T, K, H, dtype, variant, p, gen_seed=1234):
    pre_norm, rms, has_bias, has_ln_bias = VARIANTS[variant]
    tensors = inputs(T, K, H, dtype, has_bias, has_ln_bias)
    cots = cotangents(T, H, dtype, pre_norm)
    keep = kernel_mask(seeded_call(gen_seed, utils.dropout_seed, DEVICE), T, H, p)  # the seed train_kernel draws
    outs, got = seeded_call(gen_seed, run, unit.train_kernel, tensors, cots, pre_norm, rms, p)
    base_outs, base = run(masked_twin, tensors, cots, pre_norm, rms, p, keep=keep)
    ref_outs, ref = run(masked_twin, tensors, [c.double() for c in cots], pre_norm, rms, p, dtype=torch.float64,
                        keep=keep)
    for name, o, b, r in zip(("s", "normed") if pre_norm else ("normed",), outs, base_outs, ref_outs):
        check(name, dtype, o, b, r)
    for name, g, b, r in zip(NAMES, got, base, ref):
        check(name, dtype, g, b, r)
    return outs, got


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("H", WIDTHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_gradients_match_masked_fp64(dtype, H, variant):
    """T = 37: not a multiple of any width's rows per program (4 or 8), nor of the backward's 4 blocks of them."""
    run_reference_case(37, 48, H, dtype, variant, 0.1)


@pytest.mark.parametrize("variant", ["post-ln", "pre-rms"])
def test_gradients_at_half_dropout(variant):
    run_reference_case(37, 48, 384, torch.float32, variant, 0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_gradient_through_the_mask_is_keep_over_one_minus_p(dtype, p):
    """Pre-norm, gradient of sum(s) alone: the GEMM output's gradient is exactly keep / (1 - p), in the forward's
    pattern. y is the identity, so dW = dH^T exactly; the residual is zero, so s is 0 exactly where dropped."""
    T, H = 37, 100
    y = torch.eye(T, dtype=dtype, device=DEVICE)
    w = (torch.rand((H, T), generator=torch.Generator().manual_seed(3), dtype=torch.float64) + 0.5).to(dtype)
    w = w.to(DEVICE).requires_grad_()
    residual = torch.zeros((T, H), dtype=dtype, device=DEVICE, requires_grad=True)
    gamma = torch.ones(H, dtype=dtype, device=DEVICE)
    torch.manual_seed(7)
    s, normed = unit.train_kernel(y, w, None, residual, gamma, None, EPS, dropout_p=p, pre_norm=True)
    dw, dres = torch.autograd.grad(s.sum(), [w, residual])  # the norm's gradient: zeros
    keep = s.detach() != 0
    assert 0 < keep.sum() < keep.numel()
    dh = dw.t()
    assert torch.equal(dh != 0, keep)
    scale = dh[keep]
    assert torch.equal(scale, torch.full_like(scale, scale[0].item()))
    assert abs(scale[0].item() - 1 / (1 - p)) <= (1e-6 if dtype == torch.float32 else 1e-3) / (1 - p)
    assert torch.equal(dres, torch.ones_like(dres))  # the residual's gradient skips the mask
    # and the forward scaled the kept values by the same factor: s = W^T / (1 - p) where kept
    want = (w.detach().t().double() / (1 - p)).to(dtype)
    assert max_error(s.detach()[keep], want[keep]) <= (1e-6 if dtype == torch.float32 else 4e-3)  # 1 ulp at 3


# ---- reproducibility ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["post-ln", "pre-rms"])
def test_manual_seed_reproduces_outputs_and_gradients(variant):
    pre_norm, rms, has_bias, has_ln_bias = VARIANTS[variant]
    T, K, H = 37, 48, 384
    tensors = inputs(T, K, H, torch.float32, has_bias, has_ln_bias)
    cots = cotangents(T, H, torch.float32, pre_norm)
    first = seeded_call(3, run, unit.train_kernel, tensors, cots, pre_norm, rms, 0.1)
    second = seeded_call(3, run, unit.train_kernel, tensors, cots, pre_norm, rms, 0.1)
    other = seeded_call(4, run, unit.train_kernel, tensors, cots, pre_norm, rms, 0.1)
    for a, b, c in zip(first[0] + first[1], second[0] + second[1], other[0] + other[1]):
        if a is None:
            continue
        assert torch.equal(a, b)
    assert not torch.equal(first[0][-1], other[0][-1])  # the outputs
    assert not torch.equal(first[1][0], other[1][0])  # dy
    # without reseeding the generator moves on: the next call draws another mask
    torch.manual_seed(3)
    a = run(unit.train_kernel, tensors, cots, pre_norm, rms, 0.1)[0][-1]
    b = run(unit.train_kernel, tensors, cots, pre_norm, rms, 0.1)[0][-1]
    assert not torch.equal(a, b)


def test_no_dropout_draws_no_seed_and_launches_inference_code(monkeypatch):
    """dropout_p = 0: the generator is not touched, the row kernel is launched without DROPOUT (the kernel inference
    runs, plus STATS), and its outputs are the inference launch's, bit for bit."""
    T, K, H = 37, 48, 384
    tensors = inputs(T, K, H, torch.float32, True, True)
    cots = cotangents(T, H, torch.float32, True)
    inference = rln_mod.residual_layernorm(*tensors, EPS, pre_norm=True)
    launches = spy_launches(monkeypatch, "bias_residual_layernorm_kernel")
    backward = spy_launches(monkeypatch, "layernorm_backward_kernel")
    state = torch.get_rng_state()
    outs, _ = run(unit.train_kernel, tensors, cots, True, False, 0.0)
    assert torch.equal(torch.get_rng_state(), state)
    assert len(launches) == 1 and not {"DROPOUT", "OFFSETS_I64", "seed_ptr", "dropout_p"} & set(launches[0])
    assert len(backward) == 1 and not {"DROPOUT", "OFFSETS_I64", "dh_ptr", "seed_ptr", "dropout_p"} & set(backward[0])
    for got, want in zip(outs, inference):
        assert torch.equal(got, want)


# ---- edges --------------------------------------------------------------------------------------------------------
def test_dropout_one_drops_everything():
    """p = 1 (torch allows it): s is the residual, LN(residual) the output, and the GEMM's gradients are exactly
    zero, never NaN (1 / (1 - p) is never applied to a kept value)."""
    T, K, H = 7, 48, 100
    tensors = inputs(T, K, H, torch.float32, True, True)
    cots = cotangents(T, H, torch.float32, True)
    outs, got = run(unit.train_kernel, tensors, cots, True, False, 1.0)
    assert torch.equal(outs[0], tensors[3])
    for name, g in zip(NAMES[:3], got[:3]):
        assert torch.equal(g, torch.zeros_like(g)), name


@pytest.mark.parametrize("p", [-0.1, 1.5, float("nan")])
def test_refuses_probabilities_outside_0_1(p):
    y, w, b, res, gamma, beta = inputs(7, 48, 384, torch.float32, True, True)
    with pytest.raises(ValueError, match="dropout_p must be a probability in"):
        unit.train_kernel(y, w, b, res, gamma, beta, EPS, dropout_p=p)


def test_refuses_a_malformed_seed():
    y, w, b, res, gamma, beta = inputs(7, 48, 384, torch.float32, True, True)
    with pytest.raises(ValueError, match="needs seed, an int64 tensor of one element"):
        rln_mod.train_forward(y, w, b, res, gamma, beta, EPS, dropout_p=0.1, seed=torch.tensor([1.0]))
    with pytest.raises(ValueError, match="needs seed"):
        rln_mod.train_forward(y, w, b, res, gamma, beta, EPS, dropout_p=0.1)


# ---- what is compiled ahead of time -------------------------------------------------------------------------------
def test_dropout_aot_specs():
    """dropout_aot_specs: the forward (pre-norm form with statistics) and the backward with dropout for every dtype x
    norm kind of BACKWARD_VARIANTS at 384, 768 and 1024, and with int64 element numbers at 768; each spec gives
    every kernel parameter a type or a value, the dropout ones as the launchers pass them. aot_specs() holds none."""
    specs = rln_mod.dropout_aot_specs()
    names = [s["name"] for s in specs]
    kinds = 3 * len(rln_mod.BACKWARD_VARIANTS)
    assert len(set(names)) == len(names) == 2 * kinds * (len(rln_mod.BERT_HIDDEN) + 1)
    assert not any("-dropout" in s["name"] for s in rln_mod.aot_specs())
    for s in specs:
        fn, c, sig = s["fn"], s["constexprs"], s["signature"]
        backward = fn is rln_mod.layernorm_backward_kernel
        assert backward == ("-backward-" in s["name"]) and (backward or fn is rln_mod.bias_residual_layernorm_kernel)
        assert set(sig) | set(c) == set(fn.arg_names)
        assert not set(sig) & set(c)
        assert c["DROPOUT"] is True and c["OFFSETS_I64"] == s["name"].split("-H")[0].endswith("-i64")
        assert sig["seed_ptr"] == "*i64" and sig["dropout_p"] == sig["dropout_scale"] == "fp32"
        if backward:
            assert sig["dh_ptr"] == sig["ds_ptr"]
        else:
            assert c["STATS"] is True and c["PRE_NORM"] is True
    for must in ("residual_layernorm-fp16-prenorm-stats-dropout-H768-4x3x256-w4",
                 "residual_layernorm-backward-bf16-prenorm-rms-dropout-H1024-4x1x1024-b4-w4",
                 "residual_layernorm-backward-fp32-dropout-i64-H768-4x3x256-b4-w4"):
        assert must in names, must
