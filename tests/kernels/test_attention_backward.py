"""attention's backward on the kernels (units.attention.train_kernel): the forward kernel storing its log-sum-exp, the
dK/dV and dQ kernels of kernels/attention_backward.py.

The reference is the twin itself, run with autograd in float64 on the same rounded inputs and output gradient (the
twin is attention's definition: sdpa per sequence, HF's uniform answer on a fully padded row). Dropout draws another
mask than the twin's, so its cases use `attend64` instead: softmax, the kernels' keep mask (read back from the
forward kernel, or drawn by `keep_mask` from the same seed and element numbers), the 1 / (1 - p) scale, in float64.
Tolerances: fastbert.numerics' rule for gradients, as tests/kernels/test_residual_layernorm_backward.py states it:
fp32 within 1e-5 of the reference scaled by max(1, max |reference|) (dk and dv sum over queries, the bias table's
gradient over every pair); fp16 within 2x the twin's own fp16 error against fp64, + 1e-6. NaN never passes: the
direct launcher test poisons dqkv with NaN, and every test checks that the gradients are finite.
Tiles under the interpreter (kernels/attention_backward.py): dK/dV programs of 32 keys stepping over 16 queries, dQ
programs of 32 queries stepping over 16 keys; lengths 1, 15-17, 31-33 and 40-70 cross both kernels' edges.
bf16: the interpreter cannot run its tl.dot (tests/kernels/test_attention.py says why); it runs on CUDA.
"""
import dataclasses

import pytest
import torch
import triton
import triton.language as tl
from helpers import DEVICE, FP32_TOL, max_error, poisoned

from fastbert import twins
from fastbert.kernels import attention as attention_kernels
from fastbert.kernels import attention_backward as backward_kernels
from fastbert.kernels.utils import dropout_keep, dropout_seed
from fastbert.layout import TokenLayout
from fastbert.mask import AttentionMask
from fastbert.numerics import error_bound
from fastbert.units import attention as unit
from fastbert.units.attention import Extras

BF16_ON_CPU = pytest.mark.skipif(
    DEVICE == "cpu", reason="Triton's interpreter cannot run bf16 tl.dot (triton-lang/triton#11584); runs on CUDA")
DTYPES = [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=BF16_ON_CPU)]


# --------------------------------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------------------------------
def randn(shape, seed, scale=1.0):
    """Seeded N(0, scale^2) values in float64 on DEVICE (drawn on the CPU: the same values on any machine)."""
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale).to(DEVICE)


def make_qkv(T, nh, hd, dtype, kv=None, seed=0):
    """[T, 3, nh, hd], or grouped [T, nh + 2 kv, hd] when kv is given: values ~ N(0, 1) in dtype."""
    shape = (T, 3, nh, hd) if kv is None else (T, nh + 2 * kv, hd)
    return randn(shape, seed).to(dtype).to(DEVICE)


def varlen(lengths) -> TokenLayout:
    cu = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0).to(torch.int32).to(DEVICE)
    return TokenLayout.from_cu_seqlens(cu, max(lengths), list(lengths))


def padded(rows) -> AttentionMask:
    """Padded rows from strings of '1' (a real key) and '0' (padding)."""
    keep = torch.tensor([[c == "1" for c in row] for row in rows], device=DEVICE)
    return AttentionMask.build(keep, keep.shape[0], keep.shape[1], torch.float32)


def mask_in(attn: AttentionMask, dtype) -> AttentionMask:
    """The same mask built for another compute dtype (the twin adds finfo(dtype).min)."""
    if attn.key_valid is None:
        return attn
    rebuilt = AttentionMask.build(attn.key_valid, attn.batch_size, attn.seq_len, dtype)
    return dataclasses.replace(rebuilt, pairwise=attn.pairwise)


def rotary_for(attn, hd):
    """HF's default RoPE tables at each token's position in its sequence (or row)."""
    if isinstance(attn, TokenLayout):
        positions = torch.cat([torch.arange(n) for n in attn.lengths])
    else:
        positions = torch.arange(attn.seq_len).repeat(attn.batch_size)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, hd, 2, dtype=torch.float) / hd))
    return twins.rotary_tables(positions.to(DEVICE), inv_freq.to(DEVICE))


def gradients(fn, qkv, attn, scale, extras, dout, dtype, dropout_p=0.0):
    """(out, dqkv, {name: gradient} of the tables) of sum(fn(...) * dout) with qkv cast to dtype; the side tables
    (the bias table, DeBERTa's c2p and p2c) stay fp32 unless dtype is float64."""
    x = qkv.detach().to(dtype).requires_grad_()
    table = torch.float64 if dtype == torch.float64 else torch.float32

    def leaf(t):
        return None if t is None else t.detach().to(table).requires_grad_()

    bias, dis, rotary = leaf(extras.bias), extras.disentangled, extras.rotary
    tables = {"bias": bias}
    if dis is not None:
        dis = twins.Disentangled(leaf(dis.c2p), leaf(dis.p2c), dis.column)
        tables.update(c2p=dis.c2p, p2c=dis.p2c)
    if rotary is not None and dtype == torch.float64:
        rotary = twins.Rotary(rotary.cos.double(), rotary.sin.double())
    call_attn = mask_in(attn, dtype) if isinstance(attn, AttentionMask) else attn
    out, probs = fn(x, call_attn, scale, dropout_p, False, extras._replace(bias=bias, rotary=rotary,
                                                                          disentangled=dis))
    assert probs is None
    tables = {name: t for name, t in tables.items() if t is not None}
    grads = torch.autograd.grad((out * dout.to(out.dtype)).sum(), [x, *tables.values()])
    return out.detach(), grads[0], dict(zip(tables, grads[1:]))


def check(name, dtype, got, twin, ref, stored=None):
    """fastbert.numerics' rule for one gradient computed in `dtype` and stored in `stored` (default: dtype)."""
    assert got.shape == ref.shape and got.dtype == (stored or dtype), (name, got.shape, ref.shape, got.dtype)
    assert torch.isfinite(got).all(), f"{name}: NaN/inf in the kernels' gradient"
    err = max_error(got, ref)
    if dtype == torch.float32:
        bar = FP32_TOL * max(1.0, float(ref.abs().max()))
        assert err <= bar, f"{name}: {err:.3g} from fp64 > {bar:.3g}"
    else:
        bound = error_bound(dtype, max_error(twin, ref))
        assert err <= bound, f"{name}: {err:.3g} from fp64 > {bound:.3g} (2x the twin's + 1e-6)"


def run_case(attn, nh, hd, dtype, kv=None, window=None, rotary=False, bias_reach=None, seed=0, terms=None):
    """terms: DeBERTa's ("c2p", "p2c" or both) over P = 12 columns, with a column table of reach max_seqlen - 3 (the
    longest distances clamp to its ends)."""
    T = attn.num_tokens if isinstance(attn, TokenLayout) else attn.batch_size * attn.seq_len
    qkv = make_qkv(T, nh, hd, dtype, kv, seed)
    dout = randn((T, nh * hd), seed + 1).to(dtype).to(DEVICE)
    bias = None if bias_reach is None else randn((nh, 2 * bias_reach - 1), seed + 2).float().to(DEVICE)
    dis = None
    if terms:
        P, reach = 12, (attn.max_seqlen if isinstance(attn, TokenLayout) else attn.seq_len) - 3
        column = torch.randint(0, P, (2 * reach - 1,), generator=torch.Generator().manual_seed(seed + 3),
                               dtype=torch.int32).to(DEVICE)
        dis = twins.Disentangled(randn((T, nh, P), seed + 4).float().to(DEVICE) if "c2p" in terms else None,
                                 randn((T, nh, P), seed + 5).float().to(DEVICE) if "p2c" in terms else None, column)
    extras = Extras(bias=bias, window=window, rotary=rotary_for(attn, hd) if rotary else None, disentangled=dis,
                    kv_heads=kv)
    scale = hd ** -0.5
    out, dqkv, dbias = gradients(unit.train_kernel, qkv, attn, scale, extras, dout, dtype)
    twin_out, twin_dqkv, twin_dbias = gradients(unit.twin, qkv, attn, scale, extras, dout, dtype)
    ref_out, ref_dqkv, ref_dbias = gradients(unit.twin, qkv, attn, scale, extras, dout, torch.float64)
    check("out", dtype, out, twin_out, ref_out)
    parts = ("q", "k", "v") if kv is None else ("q", "k", "v")
    splits = qkv.unbind(1) if kv is None else None
    if splits is None:  # grouped: q heads, k heads, v heads along dim 1
        for name, cols in zip(parts, (slice(0, nh), slice(nh, nh + kv), slice(nh + kv, nh + 2 * kv))):
            check("d" + name, dtype, dqkv[:, cols], twin_dqkv[:, cols], ref_dqkv[:, cols])
    else:
        for i, name in enumerate(parts):
            check("d" + name, dtype, dqkv[:, i], twin_dqkv[:, i], ref_dqkv[:, i])
    assert set(dbias) == set(ref_dbias)
    for name in dbias:  # fp32 in every dtype: the tables' own
        check("d" + name, dtype, dbias[name], twin_dbias[name], ref_dbias[name], torch.float32)
    return dqkv


# --------------------------------------------------------------------------------------------------------------------
# (a) varlen, padded rows, grouped key/value heads
# --------------------------------------------------------------------------------------------------------------------
DTYPES_INTERPRETED = [torch.float32, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lengths", [(1,), (17, 1, 40), (33, 70, 16)], ids=["one-token", "ragged", "edges"])
def test_varlen_matches_fp64(lengths, dtype):
    run_case(varlen(lengths), nh=2, hd=32, dtype=dtype)


PADDED = {
    "right": ["1" * 20 + "0" * 17, "1" * 37, "1" * 5 + "0" * 32],
    "left-and-holes": ["0" * 10 + "1" * 27, "1" * 15 + "0" * 3 + "1" * 10 + "0" * 9, "10" * 18 + "1"],
    "fully-padded-row": ["1" * 37, "0" * 37, "1" * 33 + "0" * 4],
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", list(PADDED), ids=list(PADDED))
def test_padded_rows_match_fp64(rows, dtype):
    dqkv = run_case(padded(PADDED[rows]), nh=2, hd=16, dtype=dtype)
    if rows == "fully-padded-row":  # HF's uniform answer depends on v alone: no gradient reaches q or k there
        assert torch.equal(dqkv[37:74, :2], torch.zeros_like(dqkv[37:74, :2]))


@pytest.mark.parametrize("dtype", DTYPES_INTERPRETED)
@pytest.mark.parametrize("group", [1, 2, 4])
def test_grouped_heads_match_fp64(group, dtype):
    nh = 4
    run_case(varlen((19, 35)), nh=nh, hd=16, dtype=dtype, kv=nh // group)


@pytest.mark.parametrize("group", [2, 4])
def test_grouped_heads_padded_match_fp64(group):
    run_case(padded(PADDED["fully-padded-row"]), nh=4, hd=16, dtype=torch.float32, kv=4 // group)


def test_head_dim_64_and_a_heads_major_layout():
    """hd 64 (BERT's), and qkv read through other strides than the GEMM's (a heads-major copy viewed back)."""
    attn = varlen((30, 45))
    T, nh, hd = 75, 2, 64
    qkv = make_qkv(T, nh, hd, torch.float32).permute(1, 2, 0, 3).contiguous().permute(2, 0, 1, 3)
    dout = randn((T, nh * hd), 5).float()
    got = gradients(unit.train_kernel, qkv, attn, hd ** -0.5, Extras(), dout, torch.float32)[1]
    ref = gradients(unit.twin, qkv, attn, hd ** -0.5, Extras(), dout, torch.float64)[1]
    check("dqkv", torch.float32, got, ref, ref)


def test_launcher_writes_every_element_of_a_poisoned_buffer():
    """attention_backward into a NaN-filled dqkv, varlen with a one-token sequence and a fully padded row: every
    element is written (keys past a row's last real key with zeros)."""
    for attn, key_valid in ((varlen((1, 40, 7)), None), (padded(PADDED["fully-padded-row"]), True)):
        T = attn.num_tokens if key_valid is None else attn.batch_size * attn.seq_len
        if key_valid is None:
            cu, max_seqlen, mask = attn.cu_seqlens, attn.max_seqlen, None
        else:
            cu = attention_kernels.uniform_cu_seqlens(attn.batch_size, attn.seq_len, DEVICE)
            max_seqlen, mask = attn.seq_len, attn.key_valid
        qkv = make_qkv(T, 2, 16, torch.float32)
        out, lse = attention_kernels.train_forward(qkv, cu, max_seqlen, 0.25, mask)
        dqkv = poisoned(qkv.shape, qkv.dtype)
        backward_kernels.attention_backward(randn(out.shape, 3).float(), qkv, out, lse, cu, max_seqlen, 0.25, mask,
                                            dqkv=dqkv)
        assert torch.isfinite(dqkv).all()


def test_lse_is_the_log_sum_exp_of_the_scores():
    attn = varlen((1, 33))
    qkv = make_qkv(34, 2, 16, torch.float32)
    _, lse = attention_kernels.train_forward(qkv, attn.cu_seqlens, attn.max_seqlen, 0.25)
    want = []
    for start, n in ((0, 1), (1, 33)):
        q, k = qkv[start:start + n, 0].double(), qkv[start:start + n, 1].double()
        want.append(torch.logsumexp(torch.einsum("ihd,jhd->ijh", q, k) * 0.25, dim=1))
    assert max_error(lse, torch.cat(want)) <= 1e-5


# --------------------------------------------------------------------------------------------------------------------
# (b) window and rotary
# --------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [3, 20])
def test_window_matches_fp64(window, dtype):
    """w = 3: a band narrower than every tile (blocks outside it skipped); w = 20 crosses tiles."""
    run_case(varlen((70, 9, 41)), nh=2, hd=16, dtype=dtype, window=window)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_matches_fp64(dtype):
    run_case(varlen((33, 1, 20)), nh=2, hd=32, dtype=dtype, rotary=True)


def test_rotary_padded_and_grouped_match_fp64():
    run_case(padded(PADDED["left-and-holes"]), nh=4, hd=32, dtype=torch.float32, rotary=True, kv=2)


def test_rotary_with_a_window_matches_fp64():
    run_case(varlen((50, 18)), nh=2, hd=16, dtype=torch.float32, rotary=True, window=6)


# --------------------------------------------------------------------------------------------------------------------
# what train_kernel refuses
# --------------------------------------------------------------------------------------------------------------------
def test_train_unsupported_names_what_is_not_built():
    layout = varlen((4,))
    mask = padded(["1100"])
    assert unit.train_unsupported(layout, 0.0, False, Extras()) is None
    assert unit.train_unsupported(mask, 0.0, False, Extras(window=2, rotary=None)) is not None
    assert "probabilities" in unit.train_unsupported(layout, 0.0, True, Extras())
    dis = twins.Disentangled(torch.zeros(4, 1, 2), None, torch.zeros(7, dtype=torch.int32))
    assert unit.train_unsupported(layout, 0.0, False, Extras(disentangled=dis)) is None
    assert "c2p" in unit.train_unsupported(layout, 0.0, False, Extras(disentangled=dis, window=2))
    assert "custom" in unit.train_unsupported(dataclasses.replace(mask, custom=True), 0.0, False, Extras())
    assert "dropout_p" in unit.train_unsupported(layout, 1.0, False, Extras())
    with pytest.raises(ValueError, match="probabilities"):
        unit.train_kernel(make_qkv(4, 1, 16, torch.float32), layout, 0.25, return_probs=True)


# --------------------------------------------------------------------------------------------------------------------
# (c) dropout inside the kernels
# --------------------------------------------------------------------------------------------------------------------
@triton.jit
def _keep_kernel(seed_ptr, keep_ptr, n, p, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(keep_ptr + offsets, dropout_keep(seed_ptr, offsets.to(tl.int64), p).to(tl.int8), mask=offsets < n)


def keep_mask(seed, T, nh, max_seqlen, p):
    """bool [T, nh, max_seqlen]: the keep bit of (query token t, head h, key position j), element number
    (t * nh + h) * max_seqlen + j, drawn by utils.dropout_keep as the kernels draw it."""
    n = T * nh * max_seqlen
    keep = torch.empty(n, dtype=torch.int8, device=DEVICE)
    _keep_kernel[(triton.cdiv(n, 4096),)](seed, keep, n, p, BLOCK=4096)
    return keep.view(T, nh, max_seqlen).bool()


def sequences(attn):
    """(first token, length, key_valid row or None) of each sequence or padded row."""
    if isinstance(attn, TokenLayout):
        starts = attn.cu_seqlens.tolist()
        return [(s, n, None) for s, n in zip(starts, attn.lengths)]
    rows = attn.key_valid if attn.key_valid is not None else [None] * attn.batch_size
    return [(b * attn.seq_len, attn.seq_len, rows[b]) for b in range(attn.batch_size)]


def attend64(qkv, attn, scale, keep, p, kv=None):
    """softmax(q k^T * scale) with keep's dropout (kept probabilities scaled by 1 / (1 - p)), times v, per sequence,
    written out for float64 qkv; padded keys -inf, a fully padded row HF's uniform answer (the mean value, no
    dropout)."""
    if kv is None:
        q, k, v = qkv.unbind(1)
    else:
        nh = qkv.shape[1] - 2 * kv
        q, k, v = (qkv[:, :nh], qkv[:, nh:nh + kv].repeat_interleave(nh // kv, 1),
                   qkv[:, nh + kv:].repeat_interleave(nh // kv, 1))
    outs = []
    for start, n, key_real in sequences(attn):
        rows = slice(start, start + n)
        if key_real is not None and not bool(key_real.any()):
            outs.append(v[rows].mean(0, keepdim=True).expand(n, -1, -1))
            continue
        scores = torch.einsum("ihd,jhd->hij", q[rows], k[rows]) * scale
        if key_real is not None:
            scores = scores.masked_fill(~key_real[None, None, :], float("-inf"))
        probs = scores.softmax(-1) * keep[rows, :, :n].permute(1, 0, 2) / (1.0 - p)
        outs.append(torch.einsum("hij,jhd->ihd", probs, v[rows]))
    return torch.cat(outs).reshape(qkv.shape[0], -1)


def test_dropout_keeps_one_minus_p_at_the_documented_element_numbers():
    """The forward's mask read back through v = one-hot of each key's position and q = 0 (uniform probabilities
    1/64, exact): out[t, h, j] = keep[t, h, j] / (64 (1 - p)). 16 x 64 tokens x 16 heads x 64 keys = 1,048,576
    draws: the keep rate lies within 5 sigma of 1 - p, and the mask is utils.dropout_keep's at element numbers
    (t * nh + h) * max_seqlen + j (keep_mask)."""
    B, L, nh, p = 16, 64, 16, 0.1
    qkv = torch.zeros(B * L, 3, nh, L, device=DEVICE)
    qkv[:, 1] = randn((B * L, nh, L), 7).float()
    qkv[:, 2] = torch.eye(L, device=DEVICE).repeat(B, 1)[:, None, :]
    attn = varlen((L,) * B)
    seed = dropout_seed(DEVICE)
    out, _ = attention_kernels.train_forward(qkv, attn.cu_seqlens, L, 0.125, dropout_p=p, seed=seed)
    out = out.view(B * L, nh, L)
    kept = out != 0
    assert torch.allclose(out[kept], torch.full_like(out[kept], 1.0 / (L * (1.0 - p))), rtol=1e-6)
    draws = kept.numel()
    rate = kept.double().mean().item()
    sigma = ((1 - p) * p / draws) ** 0.5
    assert abs(rate - (1 - p)) <= 5 * sigma, (rate, 1 - p, sigma)
    assert torch.equal(kept, keep_mask(seed, B * L, nh, L, p))


def dropout_gradients(qkv, attn, p, dout, kv=None, torch_seed=1234):
    """train_kernel's (out, dqkv) under torch.manual_seed(torch_seed), and the seed tensor its forward drew."""
    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if DEVICE == "cuda" else []):
        torch.manual_seed(torch_seed)
        x = qkv.detach().clone().requires_grad_()
        out, _ = unit.train_kernel(x, attn, qkv.shape[-1] ** -0.5, p, extras=Extras(kv_heads=kv))
        (dqkv,) = torch.autograd.grad((out * dout).sum(), [x])
        torch.manual_seed(torch_seed)
        seed = dropout_seed(DEVICE)  # the draw train_kernel made: the generator's first
    return out.detach(), dqkv, seed


@pytest.mark.parametrize("case", ["varlen", "padded-grouped"])
def test_dropout_gradients_use_the_forwards_mask(case):
    """The backward regenerates the forward's mask: train_kernel's output and every gradient match attend64 in
    float64 with the mask drawn from the same seed (fp32 bar). Padded rows: holes, a fully padded row (never
    dropped: the twin's uniform answer there has no dropout), grouped key/value heads."""
    p, nh, hd = 0.3, 4, 16
    if case == "varlen":
        attn, kv, T, max_seqlen = varlen((1, 40, 17)), None, 58, 40
    else:
        attn, kv = padded(["1" * 15 + "0" * 3 + "1" * 15, "0" * 33, "0" * 4 + "1" * 29]), 2
        T, max_seqlen = 99, 33
    qkv = make_qkv(T, nh, hd, torch.float32, kv, seed=3)
    dout = randn((T, nh * hd), 4).float()
    out, dqkv, seed = dropout_gradients(qkv, attn, p, dout, kv)
    keep = keep_mask(seed, T, nh, max_seqlen, p)
    x = qkv.double().requires_grad_()
    ref = attend64(x, attn, hd ** -0.5, keep, p, kv)
    (ref_dqkv,) = torch.autograd.grad((ref * dout.double()).sum(), [x])
    ref = ref.detach()
    check("out", torch.float32, out, ref, ref)
    check("dqkv", torch.float32, dqkv, ref_dqkv, ref_dqkv)
    # the mask matters: without it the gradients are far off
    plain = attend64(x, attn, hd ** -0.5, torch.ones_like(keep), 0.0, kv).detach()
    assert max_error(out, plain) > 1e-2


def test_dropout_same_seed_same_gradients():
    attn = varlen((33, 20))
    qkv = make_qkv(53, 2, 16, torch.float32, seed=5)
    dout = randn((53, 32), 6).float()
    first = dropout_gradients(qkv, attn, 0.2, dout)
    again = dropout_gradients(qkv, attn, 0.2, dout)
    other = dropout_gradients(qkv, attn, 0.2, dout, torch_seed=99)
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    assert not torch.equal(first[1], other[1])


# --------------------------------------------------------------------------------------------------------------------
# (d) MPNet's relative-bias table
# --------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES_INTERPRETED)
@pytest.mark.parametrize("reach", [8, 41], ids=["clamped", "wide"])
def test_bias_table_gradient_matches_fp64(reach, dtype):
    """reach 8: sequences of up to 40 tokens reach past the table's ends (every farther distance adds into the end
    columns); reach 41: every distance has its own column."""
    run_case(varlen((40, 1, 23)), nh=2, hd=16, dtype=dtype, bias_reach=reach)


def test_bias_table_gradient_padded_matches_fp64():
    """Padded rows count distances over padding (as HF); a fully padded row adds nothing to the table's gradient."""
    run_case(padded(PADDED["fully-padded-row"]), nh=2, hd=16, dtype=torch.float32, bias_reach=12)


# --------------------------------------------------------------------------------------------------------------------
# (e) DeBERTa's c2p / p2c terms, and its padded-query rule
# --------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES_INTERPRETED)
@pytest.mark.parametrize("terms", [("c2p", "p2c"), ("c2p",), ("p2c",)], ids=["both", "c2p", "p2c"])
def test_disentangled_gradients_match_fp64(terms, dtype):
    run_case(varlen((40, 1, 23)), nh=2, hd=16, dtype=dtype, terms=terms)


@pytest.mark.parametrize("dtype", DTYPES_INTERPRETED)
def test_disentangled_padded_rows_match_fp64(dtype):
    """HF's DeBERTa mask (mask_i * mask_j): every padded query is its row's mean value, so its gradient reaches v
    alone (dO / S to each value), and a fully padded row's too."""
    dqkv = run_case(padded(PADDED["left-and-holes"][:2] + PADDED["fully-padded-row"][1:2]), nh=2, hd=16, dtype=dtype,
                    terms=("c2p", "p2c"))
    assert torch.equal(dqkv[:10, :2], torch.zeros_like(dqkv[:10, :2]))  # row 0's left padding: no dq, no dk


def test_uniform_padded_queries_without_terms_match_fp64():
    attn = dataclasses.replace(padded(PADDED["right"]), pairwise=True)
    run_case(attn, nh=4, hd=16, dtype=torch.float32, kv=2)


def test_launcher_reads_strided_do_and_writes_a_strided_dqkv():
    """dO as a column slice of a wider buffer and dqkv as a view into one (any strides but hd's): the same gradients
    as with contiguous tensors, bit for bit (the kernels read and write through the strides)."""
    attn = varlen((33, 9))
    T, nh, hd, kv = 42, 4, 16, 2
    qkv = make_qkv(T, nh, hd, torch.float32, kv)
    out, lse = attention_kernels.train_forward(qkv, attn.cu_seqlens, attn.max_seqlen, 0.25, kv_heads=kv)
    do = randn((T, nh * hd), 8).float()
    want = backward_kernels.attention_backward(do, qkv, out, lse, attn.cu_seqlens, attn.max_seqlen, 0.25,
                                               kv_heads=kv)[0]
    wide = torch.zeros(T, nh * hd + 24, device=DEVICE)
    wide[:, 8:8 + nh * hd] = do
    buffer = torch.full((T, nh + 2 * kv + 1, hd), float("nan"), device=DEVICE)
    dqkv = buffer[:, 1:]
    got = backward_kernels.attention_backward(wide[:, 8:8 + nh * hd], qkv, out, lse, attn.cu_seqlens,
                                              attn.max_seqlen, 0.25, kv_heads=kv, dqkv=dqkv)[0]
    assert got is dqkv and torch.equal(got, want)
    assert torch.isnan(buffer[:, 0]).all()  # nothing written outside the view
