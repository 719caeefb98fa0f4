"""Grouped-query attention (EuroBERT: fewer key/value heads than query heads) in the attention kernel and its twin,
against a float64 reference.

qkv is the grouped QKV GEMM's output viewed per head, [T, nh + 2 kv, hd] (q heads, then k heads, then v heads), and
query head h attends with key/value head h // (nh / kv). `reference64` writes that out on its own: each key/value head
repeated for its group as transformers' repeat_kv does (expand, reshape), q and k rotated in float64 by the fp32
cos/sin tables (rotate-half), softmax(q k^T * scale) v per sequence, finfo.min on padded keys (a fully padded row is
uniform over its S keys, HF eager's answer).
Cases: groups of 1 (the grouped layout with kv = nh), 2, 3 and 4, all query heads on one key/value head; rotary on and
off; packed sequences whose lengths cross the interpreter tile's edges (64 queries, 32 keys); padded rows, left and
right padded and with a fully padded row; memory layouts other than the GEMM's. Tolerances: fastbert.numerics' rule
(fp32 <= 1e-5 against the twin and the fp64 reference; fp16 <= 2x the twin's own error against fp64 + 1e-6).
Outputs are poisoned with NaN first, and NaN never passes. bf16: the interpreter cannot run its tl.dot
(test_attention.py says why); it runs on CUDA.
"""
import pytest
import torch
from helpers import DEVICE, assert_kernel_matches, make_grouped, max_error, poisoned, repeat_kv64, rotary_for, rotate64

from fastbert import dispatch, ops, twins
from fastbert.kernels.attention import attention, uniform_cu_seqlens
from fastbert.layout import TokenLayout
from fastbert.mask import AttentionMask
from fastbert.numerics import FP32_TOL
from fastbert.units import attention as attention_unit
from fastbert.units.attention import Extras

BF16_ON_CPU = pytest.mark.skipif(
    DEVICE == "cpu", reason="Triton's interpreter cannot run bf16 tl.dot (triton-lang/triton#11584); runs on CUDA")
DTYPES = [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=BF16_ON_CPU)]


# --------------------------------------------------------------------------------------------------------------------
# Inputs and the float64 reference
# --------------------------------------------------------------------------------------------------------------------
def attend64(q, k, v, scale, key_real=None):
    """One sequence, q, k, v [L, nh, hd] in float64 -> [L, nh*hd]; padded keys (key_real False) get finfo.min."""
    L, nh, hd = q.shape
    scores = torch.einsum("ihd,jhd->hij", q, k) * scale
    if key_real is not None:
        scores = scores.masked_fill(~key_real[None, None, :], torch.finfo(torch.float64).min)
    return torch.einsum("hij,jhd->ihd", torch.softmax(scores, dim=-1), v).reshape(L, nh * hd)


def reference64(qkv, kv, spans, scale, rotary=None, keep=None):
    """Each sequence (start, length) of grouped qkv alone, in float64, the key/value heads repeated first."""
    nh = qkv.shape[1] - 2 * kv
    out = []
    for b, (start, length) in enumerate(spans):
        x = qkv[start:start + length].double()
        q, k, v = x[:, :nh], x[:, nh:nh + kv], x[:, nh + kv:]
        if rotary is not None:
            cos, sin = rotary.cos[start:start + length], rotary.sin[start:start + length]
            q, k = rotate64(q, cos, sin), rotate64(k, cos, sin)
        k, v = repeat_kv64(k, nh // kv), repeat_kv64(v, nh // kv)
        out.append(attend64(q, k, v, scale, None if keep is None else keep[b]))
    return torch.cat(out)


def spans(lengths):
    starts = torch.tensor([0, *lengths]).cumsum(0).tolist()
    return list(zip(starts[:-1], lengths))


def packed(lengths, nh, kv, hd, dtype, rotate, layout="contiguous", seed=0):
    T = sum(lengths)
    qkv = make_grouped(T, nh, kv, hd, dtype, layout, seed)
    cu = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0).to(torch.int32).to(DEVICE)
    rotary = rotary_for(torch.cat([torch.arange(n) for n in lengths]), hd) if rotate else None
    return qkv, cu, TokenLayout.from_cu_seqlens(cu, max(lengths), lengths), rotary


def expanded(qkv, kv):
    """The same q, k, v as [T, 3, nh, hd], each key/value head repeated for its group (what repeat_kv builds)."""
    nh = qkv.shape[1] - 2 * kv
    q, k, v = qkv[:, :nh], qkv[:, nh:nh + kv], qkv[:, nh + kv:]
    return torch.stack((q, repeat_kv64(k, nh // kv), repeat_kv64(v, nh // kv)), dim=1)


# --------------------------------------------------------------------------------------------------------------------
# Packed sequences
# --------------------------------------------------------------------------------------------------------------------
VARLEN_CASES = [  # (lengths, nh, kv, hd, rotary, layout)
    ([1, 17, 64, 65, 130], 4, 2, 32, True, "contiguous"),
    ([1, 17, 64, 65, 130], 4, 1, 32, False, "slice"),  # every query head on one key/value head
    ([130, 1, 65], 4, 4, 32, True, "heads_major"),  # group 1 in the grouped layout
    ([64, 17, 1], 8, 2, 16, True, "contiguous"),  # groups of 4
    ([65, 1, 17], 3, 1, 64, True, "slice"),  # a group of 3
    ([40, 17], 2, 1, 128, True, "heads_major"),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("lengths,nh,kv,hd,rotate,layout", VARLEN_CASES,
                         ids=[f"L{'-'.join(map(str, c[0]))}-nh{c[1]}-kv{c[2]}-hd{c[3]}-{'rot' if c[4] else 'norot'}"
                              f"-{c[5]}" for c in VARLEN_CASES])
def test_varlen_matches_twin_and_fp64(lengths, nh, kv, hd, rotate, layout, dtype):
    """Sequences of 1 token, block-edge and multi-block lengths in one launch; the twin both ways (one sdpa per
    sequence, and into a workspace with q and k rotated for all tokens at once)."""
    qkv, cu, layout_, rotary = packed(lengths, nh, kv, hd, dtype, rotate, layout)
    scale = hd ** -0.5
    out = poisoned((qkv.shape[0], nh * hd), dtype)
    result = attention(qkv, cu, max(lengths), scale, out=out, rotary=rotary, kv_heads=kv)
    assert result.data_ptr() == out.data_ptr()
    ref = reference64(qkv, kv, spans(lengths), scale, rotary)
    twin = ops.attention_torch(qkv, layout_, scale, rotary=rotary, kv_heads=kv)[0]
    assert_kernel_matches(out, twin, ref, dtype)
    into = ops.attention_torch(qkv, layout_, scale, rotary=rotary, kv_heads=kv, workspace=twins.Workspace())[0]
    assert_kernel_matches(out, into, ref, dtype)


def test_dense_batch_matches_fp64():
    """Equal lengths: the twin's one sdpa over the dense batch (enable_gqa), and the kernel."""
    lengths, nh, kv, hd = [33, 33, 33], 6, 2, 32
    qkv, cu, layout_, rotary = packed(lengths, nh, kv, hd, torch.float32, True, seed=3)
    assert layout_.uniform
    ref = reference64(qkv, kv, spans(lengths), hd ** -0.5, rotary)
    twin = ops.attention_torch(qkv, layout_, hd ** -0.5, rotary=rotary, kv_heads=kv)[0]
    out = attention(qkv, cu, 33, hd ** -0.5, rotary=rotary, kv_heads=kv, out=poisoned((99, nh * hd), torch.float32))
    assert_kernel_matches(out, twin, ref, torch.float32)


def test_grouped_equals_the_expanded_heads_exactly():
    """The kernel over grouped heads computes what it computes over the repeated [T, 3, nh, hd], bit for bit: each
    query head reads its own group's key/value head, through the same arithmetic."""
    lengths, nh, kv, hd = [70, 1, 33], 6, 2, 32
    qkv, cu, _, rotary = packed(lengths, nh, kv, hd, torch.float32, True, seed=4)
    grouped = attention(qkv, cu, 70, hd ** -0.5, rotary=rotary, kv_heads=kv)
    assert torch.equal(grouped, attention(expanded(qkv, kv), cu, 70, hd ** -0.5, rotary=rotary))


# --------------------------------------------------------------------------------------------------------------------
# Padded rows
# --------------------------------------------------------------------------------------------------------------------
def make_padding(B, S, padding):
    """[B, S] bool, True = real. left: row b starts after ~b S / 3 + b padded tokens (its last token real); right:
    ragged right padding; fully_padded: row 1 has no real token, row 0 a padded second half."""
    keep = torch.ones(B, S, dtype=torch.bool)
    for b in range(B):
        if padding == "left":
            keep[b, :min(S - 1, (b * S) // 3 + b)] = False
        elif padding == "right":
            keep[b, max(1, S - (b + 1) * S // (B + 1)):] = False
    if padding == "fully_padded":
        keep[1] = False
        keep[0, S // 2:] = False
    return keep.to(DEVICE)


PADDED_CASES = [  # (B, S, nh, kv, hd, padding, rotary)
    (3, 70, 4, 2, 32, "left", True),
    (3, 37, 4, 1, 32, "fully_padded", True),
    (2, 65, 4, 4, 32, "left", False),
    (3, 33, 6, 2, 16, "fully_padded", False),
    (2, 40, 2, 1, 64, "right", True),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("B,S,nh,kv,hd,padding,rotate", PADDED_CASES,
                         ids=[f"B{c[0]}-S{c[1]}-nh{c[2]}-kv{c[3]}-hd{c[4]}-{c[5]}-{'rot' if c[6] else 'norot'}"
                              for c in PADDED_CASES])
def test_padded_matches_twin_and_fp64(B, S, nh, kv, hd, padding, rotate, dtype):
    """padding_free=False: every position is compared, padded queries of live rows and fully padded rows included."""
    qkv = make_grouped(B * S, nh, kv, hd, dtype, seed=1)
    keep = make_padding(B, S, padding)
    mask = AttentionMask.build(keep.long(), B, S, dtype)
    # positions are column indices (HF's default position_ids): with left padding a row's first real token is at
    # position > 0
    rotary = rotary_for(torch.arange(S).repeat(B), hd) if rotate else None
    scale = hd ** -0.5
    out = poisoned((B * S, nh * hd), dtype)
    attention(qkv, uniform_cu_seqlens(B, S, qkv.device), S, scale, key_valid=mask.key_valid, out=out, rotary=rotary,
              kv_heads=kv)
    twin = ops.attention_torch(qkv, mask, scale, rotary=rotary, kv_heads=kv)[0]
    ref = reference64(qkv, kv, [(b * S, S) for b in range(B)], scale, rotary, keep)
    # fp16: sdpa adds fp16's finfo.min in fp32, where it does not swamp the scores, so the twin's own error is measured
    # on rows with a real key (test_attention.py says more); the kernel's counts everywhere
    live = keep.any(dim=1).repeat_interleave(S)
    assert_kernel_matches(out, twin, ref, dtype, baseline_where=live)


def test_fully_padded_row_is_the_mean_of_its_values():
    """A row without a real token: each query head gets the mean over the row's S values of its group's key/value
    head (HF eager's uniform softmax), on the kernel and the twin."""
    B, S, nh, kv, hd = 3, 37, 4, 2, 32
    qkv = make_grouped(B * S, nh, kv, hd, torch.float32, seed=2)
    keep = make_padding(B, S, "fully_padded")
    mask = AttentionMask.build(keep.long(), B, S, torch.float32)
    kernel = attention(qkv, uniform_cu_seqlens(B, S, qkv.device), S, hd ** -0.5, key_valid=mask.key_valid, kv_heads=kv)
    twin = ops.attention_torch(qkv, mask, hd ** -0.5, kv_heads=kv)[0]
    values = qkv[S:2 * S, nh + kv:].double().mean(dim=0)  # [kv, hd]
    want = values.repeat_interleave(nh // kv, dim=0).reshape(nh * hd)  # query head h: value head h // 2
    for out in (kernel, twin):
        assert max_error(out[S:2 * S], want.expand(S, nh * hd)) <= FP32_TOL


def test_probabilities_are_hf_eager():
    """output_attentions: the twin's eager math over grouped heads returns HF eager's probabilities [B, nh, S, S] and
    context (key/value heads repeated as repeat_kv repeats them), a fully padded row uniform."""
    B, S, nh, kv, hd = 3, 21, 4, 1, 16
    qkv = make_grouped(B * S, nh, kv, hd, torch.float32, seed=5)
    keep = make_padding(B, S, "fully_padded")
    mask = AttentionMask.build(keep.long(), B, S, torch.float32)
    rotary = rotary_for(torch.arange(S).repeat(B), hd)
    ctx, probs = ops.attention_torch(qkv, mask, hd ** -0.5, return_probs=True, rotary=rotary, kv_heads=kv)
    x = qkv.double().view(B, S, nh + 2 * kv, hd)
    q = torch.stack([rotate64(x[b, :, :nh], rotary.cos[b * S:(b + 1) * S], rotary.sin[b * S:(b + 1) * S])
                     for b in range(B)])
    k = torch.stack([rotate64(x[b, :, nh:nh + kv], rotary.cos[b * S:(b + 1) * S], rotary.sin[b * S:(b + 1) * S])
                     for b in range(B)])
    k = k.repeat_interleave(nh // kv, dim=2)  # [B, S, nh, hd]
    scores = torch.einsum("bihd,bjhd->bhij", q, k) * hd ** -0.5
    scores = scores.masked_fill(~keep[:, None, None, :], torch.finfo(torch.float64).min)
    want = torch.softmax(scores, dim=-1)
    assert max_error(probs, want) <= FP32_TOL
    assert max_error(ctx, reference64(qkv, kv, [(b * S, S) for b in range(B)], hd ** -0.5, rotary, keep)) <= FP32_TOL


def test_dropout_draws_as_over_the_repeated_heads():
    """Train-mode dropout on CPU runs the twin's written-out math, which repeats the key/value heads for that call:
    the same seed gives the same mask, hence the same numbers, as over the repeated [T, 3, nh, hd]."""
    lengths, nh, kv, hd = [9, 30], 4, 2, 16
    qkv, _, layout_, rotary = packed(lengths, nh, kv, hd, torch.float32, True, seed=6)
    torch.manual_seed(11)
    grouped = ops.attention_torch(qkv, layout_, hd ** -0.5, dropout_p=0.3, rotary=rotary, kv_heads=kv)[0]
    torch.manual_seed(11)
    repeated = ops.attention_torch(expanded(qkv, kv), layout_, hd ** -0.5, dropout_p=0.3, rotary=rotary)[0]
    assert max_error(grouped, repeated) <= FP32_TOL


# --------------------------------------------------------------------------------------------------------------------
# The entry points above the kernel: ops.attention, the custom op, a traced forward's attention, "auto"'s contenders
# --------------------------------------------------------------------------------------------------------------------
def test_every_entry_point_passes_the_key_value_heads():
    """Each path reaches the kernel or the twin with kv_heads: each agrees with the fp64 reference (a path that
    dropped it would refuse the 3-D qkv or read the wrong heads)."""
    lengths, nh, kv, hd = [40, 3], 4, 2, 32
    qkv, cu, layout_, rotary = packed(lengths, nh, kv, hd, torch.float32, True, seed=7)
    scale = hd ** -0.5
    want = reference64(qkv, kv, spans(lengths), scale, rotary)
    tables = (None, rotary.cos, rotary.sin, None, None, None)  # bias, cos, sin, c2p, p2c, column
    got = {
        "ops triton": ops.attention(qkv, layout_, scale, backend="triton", rotary=rotary, kv_heads=kv)[0],
        "ops torch": ops.attention(qkv, layout_, scale, backend="torch", rotary=rotary, kv_heads=kv)[0],
        "custom op triton": torch.ops.fastbert.attention(qkv, cu, max(lengths), scale, None, False, "triton", -1,
                                                         *tables, kv_heads=kv),
        "custom op torch": torch.ops.fastbert.attention(qkv, cu, max(lengths), scale, None, False, "torch", -1,
                                                        *tables, kv),
    }
    for backend in ("triton", "torch"):
        run = dispatch.traced_ops(dict.fromkeys(ops.OPS, backend))["attention"]
        got[f"traced {backend}"] = run(qkv, layout_, scale, extras=Extras(rotary=rotary, kv_heads=kv))[0]
    B, S = 2, 40
    padded_qkv = make_grouped(B * S, nh, kv, hd, torch.float32, seed=8)
    mask = AttentionMask.build(make_padding(B, S, "left").long(), B, S, torch.float32)
    padded_want = reference64(padded_qkv, kv, [(0, S), (S, S)], scale, keep=mask.key_valid)
    run = dispatch.traced_ops(dict.fromkeys(ops.OPS, "triton"))["attention"]
    got["traced padded"] = run(padded_qkv, mask, scale, extras=Extras(kv_heads=kv))[0]
    for name, out in got.items():
        assert max_error(out, padded_want if name == "traced padded" else want) <= FP32_TOL, name


def test_custom_op_fake_shape():
    lengths, nh, kv, hd = [5, 3], 4, 2, 16
    qkv, cu, _, rotary = packed(lengths, nh, kv, hd, torch.float32, True)
    torch.library.opcheck(torch.ops.fastbert.attention.default,
                          (qkv, cu, max(lengths), hd ** -0.5, None, False, "torch", -1,
                           None, rotary.cos, rotary.sin, None, None, None, kv),
                          test_utils=("test_schema", "test_faketensor"))


def test_auto_times_the_grouped_layout():
    """"auto"'s contenders for a grouped Variant run the grouped op on both sides, and its key names the group."""
    from fastbert.measure import Shapes
    shapes = Shapes(tokens=96, hidden=128, intermediate=256, heads=4, head_dim=32, max_seqlen=64, activation="silu",
                    attention=attention_unit.Variant(rotary=True, group=2))
    assert attention_unit.key(torch.float32, shapes).endswith("|gqa2|rotary")
    assert "gqa" not in attention_unit.key(torch.float32, Shapes(96, 128, 256, 4, 32, 64, "silu"))
    calls = []

    def recording(fn):
        def run(qkv, attn, scale, dropout_p, return_probs, extras):
            calls.append((tuple(qkv.shape), extras.kv_heads))
            return fn(qkv, attn, scale, dropout_p, return_probs, extras)
        return run

    kernel_fn, twin_fn = attention_unit.contenders(torch.float32, shapes, DEVICE, recording(attention_unit.kernel),
                                                   recording(attention_unit.twin))
    kernel_out, twin_out = kernel_fn()[0], twin_fn()[0]
    T = kernel_out.shape[0]
    assert calls == [((T, 4 + 2 * 2, 32), 2)] * 2
    assert max_error(kernel_out, twin_out) <= FP32_TOL


# --------------------------------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------------------------------
def test_bad_key_value_heads_are_refused_quoting_them():
    qkv, cu, _, _ = packed([5, 3], 4, 2, 32, torch.float32, False)
    call = lambda x=qkv, **kw: attention(x, cu, 5, 0.1, **kw)  # noqa: E731
    with pytest.raises(ValueError, match=r"must be \[T, 3, num_heads, head_dim\] \(grouped, with kv_heads"):
        call()
    with pytest.raises(ValueError, match=r"kv_heads must be None or a positive int, got 0"):
        call(kv_heads=0)
    with pytest.raises(ValueError, match=r"got True"):
        call(kv_heads=True)
    with pytest.raises(ValueError, match=r"with kv_heads=2, qkv must be \[T, num_heads \+ 2\*kv_heads, head_dim\], "
                                         r"got shape \(8, 3, 2, 32\)"):
        call(qkv.new_zeros(8, 3, 2, 32), kv_heads=2)
    with pytest.raises(ValueError, match=r"qkv.shape\[1\]=8 leaves num_heads=2 query heads beside 2 x kv_heads=3"):
        call(kv_heads=3)
    with pytest.raises(ValueError, match=r"num_heads=1 query heads beside 2 x kv_heads=2; kv_heads must divide"):
        call(qkv[:, 1:6], kv_heads=2)
