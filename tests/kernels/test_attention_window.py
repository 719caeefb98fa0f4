"""The attention kernel's sliding window and rotary q/k (ModernBERT) against the twin and a float64 reference.

The twin (fastbert/twins.py attention_torch with window= and rotary=) is the definition; `reference64` below is the
same math written out in float64 (q and k rotated in float64 by the same fp32 cos/sin tables, an explicit band
mask, finfo.min on padded keys, the fully padded row rule), built without the twin's code.
Tolerances: fp32 <= 1e-5 against both; fp16 <= 2x the twin's own error against float64 (+1e-6). Outputs are poisoned
with NaN first, and NaN never passes. The interpreter runs the launcher's 64x32 tile, and 16x16 where a case asks for
it, so that small windows skip several key blocks at small shapes.
"""
import pytest
import torch
from helpers import assert_kernel_matches, poisoned

from fastbert import dispatch, ops, twins
from fastbert.kernels import attention as attention_module
from fastbert.kernels.attention import attention, uniform_cu_seqlens
from fastbert.layout import TokenLayout
from fastbert.mask import AttentionMask
from fastbert.units.attention import Extras

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16]  # bf16: the interpreter cannot run its tl.dot (test_attention.py says why)
TILE16 = attention_module._config(16, 16, 4, 2)


# --------------------------------------------------------------------------------------------------------------------
# Inputs and the float64 reference
# --------------------------------------------------------------------------------------------------------------------
def make_qkv(T, nh, hd, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, 3, nh, hd, generator=g, dtype=torch.float64).to(dtype).to(DEVICE)


def rotary_for(positions, hd, theta=10000.0):
    """ModernBERT's tables (HF's default RoPE inverse frequencies) for the given per-token positions."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float) / hd))
    return twins.rotary_tables(positions.to(DEVICE), inv_freq.to(DEVICE))


def rotate64(x, cos, sin):
    """x [L, nh, hd] rotated in float64 by cos/sin [L, hd/2] (rotate-half, the frequencies repeated)."""
    cos, sin = torch.cat([cos, cos], -1).double()[:, None], torch.cat([sin, sin], -1).double()[:, None]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


def attend64(q, k, v, scale, window, key_real=None):
    """One sequence [L, nh, hd] in float64 -> [L, nh*hd]: HF eager's one mask, keys outside the band |i - j| <=
    window or padded (key_real False) excluded; a query left with no key at all (a padded query whose band holds
    padding only, every query of a fully padded row) is uniform over all L keys, as HF's finfo.min on every key
    makes it."""
    L, nh, hd = q.shape
    scores = torch.einsum("ihd,jhd->hij", q, k) * scale
    allowed = torch.ones(L, L, dtype=torch.bool, device=q.device)
    if key_real is not None:
        allowed &= key_real[None, :]
    if window is not None:
        i = torch.arange(L, device=q.device)
        allowed &= (i[None, :] - i[:, None]).abs() <= window
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    scores = scores.masked_fill(~allowed.any(dim=-1)[None, :, None], 0.0)  # no key allowed: all equal, uniform
    return torch.einsum("hij,jhd->ihd", torch.softmax(scores, dim=-1), v).reshape(L, nh * hd)


def reference64(qkv, starts_lengths, scale, window, rotary, key_valid=None):
    out = []
    for b, (start, length) in enumerate(starts_lengths):
        q, k, v = qkv[start:start + length].double().unbind(1)
        if rotary is not None:
            cos, sin = rotary.cos[start:start + length], rotary.sin[start:start + length]
            q, k = rotate64(q, cos, sin), rotate64(k, cos, sin)
        out.append(attend64(q, k, v, scale, window, None if key_valid is None else key_valid[b]))
    return torch.cat(out)


def spans(lengths):
    starts = torch.tensor([0, *lengths]).cumsum(0).tolist()
    return list(zip(starts[:-1], lengths))


def run_varlen(lengths, nh, hd, dtype, window, rotate, config=None, position_offset=0, seed=0):
    T = sum(lengths)
    qkv = make_qkv(T, nh, hd, dtype, seed)
    cu = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0).to(torch.int32).to(DEVICE)
    layout = TokenLayout.from_cu_seqlens(cu, max(lengths), lengths)
    rotary = None
    if rotate:
        rotary = rotary_for(torch.cat([torch.arange(n) + position_offset for n in lengths]), hd)
    scale = hd ** -0.5
    out = poisoned((T, nh * hd), dtype)
    result = attention(qkv, cu, max(lengths), scale, out=out, window=window, rotary=rotary, config=config)
    assert result.data_ptr() == out.data_ptr()
    twin = ops.attention_torch(qkv, layout, scale, window=window, rotary=rotary)[0]
    assert_kernel_matches(out, twin, reference64(qkv, spans(lengths), scale, window, rotary), dtype)
    return qkv, out


def make_padding(B, S, padding):
    """[B, S] bool, True = real. left: left padding; holes: runs of padding wider than small windows; fully_padded:
    row 1 has no real token; right: right padding (padded queries far past the last real key)."""
    keep = torch.ones(B, S, dtype=torch.bool)
    if padding == "left":
        for b in range(B):
            keep[b, :min(S - 1, (b * S) // 3 + b)] = False
    elif padding == "holes":
        keep[:, 3:3 + S // 3] = False
        keep[0, -2:] = False
        keep[-1, :2] = False
    elif padding == "fully_padded":
        keep[1] = False
        keep[0, S // 2:] = False
    elif padding == "right":
        for b in range(B):
            keep[b, max(1, S - (b + 1) * S // (B + 1)):] = False
    return keep.to(DEVICE)


def run_padded(B, S, nh, hd, dtype, padding, window, rotate, config=None, seed=0):
    qkv = make_qkv(B * S, nh, hd, dtype, seed)
    keep = make_padding(B, S, padding)
    mask = AttentionMask.build(keep.long(), B, S, dtype)
    assert mask.key_valid is not None
    # positions are column indices (HF's default position_ids): with left padding a row's first real token is at
    # position > 0
    rotary = rotary_for(torch.arange(S).repeat(B), hd) if rotate else None
    scale = hd ** -0.5
    out = poisoned((B * S, nh * hd), dtype)
    attention(qkv, uniform_cu_seqlens(B, S, qkv.device), S, scale, key_valid=mask.key_valid, out=out,
              window=window, rotary=rotary, config=config)
    twin = ops.attention_torch(qkv, mask, scale, window=window, rotary=rotary)[0]
    ref = reference64(qkv, [(b * S, S) for b in range(B)], scale, window, rotary, keep)
    # The fp16 twin adds -65504 (fp16's finfo.min) in fp32, which does not swamp the scores: where a query's band
    # holds no real key (fully padded rows included) it is no yardstick. Its error is measured elsewhere; the
    # kernel's everywhere.
    i = torch.arange(S, device=keep.device)
    near = (i[None, :] - i[:, None]).abs() <= (S if window is None else window)  # [query, key]
    yardstick = (near[None] & keep[:, None, :]).any(dim=-1).reshape(B * S)
    assert_kernel_matches(out, twin, ref, dtype, baseline_where=yardstick)
    return qkv, keep, out


# --------------------------------------------------------------------------------------------------------------------
# Varlen (packed) sequences
# --------------------------------------------------------------------------------------------------------------------
VARLEN_CASES = [  # (lengths, nh, hd, window, rotary, tile)
    ([1], 1, 32, 3, True, None),
    ([2, 1, 3], 2, 16, 1, True, None),
    ([3, 4, 7, 1], 2, 32, 3, False, None),  # w, w + 1, 2w + 1 and 1 token
    ([31, 32, 33, 1, 2], 2, 32, 16, True, TILE16),  # BLOCK_N edges +-1 at w = 16
    ([63, 64, 65], 1, 64, 3, True, None),  # BLOCK_M edges +-1
    ([190, 17, 5], 2, 32, 16, True, None),  # ~3 * BLOCK_M: the middle query blocks skip key blocks on both sides
    ([97, 3, 16, 33, 1], 2, 16, 3, True, TILE16),  # ragged, many skipped blocks with 16-key blocks
    ([130, 2, 1], 1, 64, 1, False, TILE16),
    ([40, 9], 2, 32, None, True, None),  # rotary alone
    ([12, 5], 2, 64, 16, True, None),  # sequences shorter than the window: no key is cut off
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("lengths,nh,hd,window,rotate,tile", VARLEN_CASES,
                         ids=[f"L{'-'.join(map(str, c[0]))}-nh{c[1]}-hd{c[2]}-w{c[3]}-{'rot' if c[4] else 'norot'}"
                              f"{'-tile16' if c[5] else ''}" for c in VARLEN_CASES])
def test_varlen_matches_twin_and_fp64(lengths, nh, hd, window, rotate, tile, dtype):
    run_varlen(lengths, nh, hd, dtype, window, rotate, config=tile)


def test_rotary_reads_each_tokens_own_table_row():
    """Positions far from 0 (an offset of 1000 per sequence): the kernel reads each token's cos/sin row, it does
    not derive a position from the token's index."""
    run_varlen([37, 5, 70], 2, 32, torch.float32, 3, True, position_offset=1000)


def test_window_zero_returns_each_tokens_own_value():
    """w = 0: each query sees only itself, so its output is exactly its own V, whatever q, k and the rotation."""
    lengths, nh, hd = [70, 1, 33], 2, 32
    T = sum(lengths)
    qkv = make_qkv(T, nh, hd, torch.float32, seed=5)
    cu = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0).to(torch.int32).to(DEVICE)
    rotary = rotary_for(torch.cat([torch.arange(n) for n in lengths]), hd)
    out = attention(qkv, cu, max(lengths), hd ** -0.5, out=poisoned((T, nh * hd), torch.float32), window=0,
                    rotary=rotary)
    assert torch.equal(out, qkv[:, 2].reshape(T, nh * hd))


def test_key_blocks_outside_the_window_are_skipped():
    """V of the keys outside every block the window of query block 2 reaches (queries 128..191 with w = 3 reach keys
    125..194: key blocks 96..223 of the 64x32 tile) is NaN. A visited block would spread it to every query of the
    block: p = 0 times NaN is NaN in the PV dot, however masked the score. Query block 2 stays finite and right;
    query blocks 0 and 3, which visit poisoned blocks, do turn NaN (the poison works)."""
    L, nh, hd, w = 256, 2, 32, 3
    qkv = make_qkv(L, nh, hd, torch.float32, seed=2)
    cu = torch.tensor([0, L], dtype=torch.int32, device=DEVICE)
    rotary = rotary_for(torch.arange(L), hd)
    clean = attention(qkv, cu, L, hd ** -0.5, window=w, rotary=rotary)
    poisoned_qkv = qkv.clone()
    poisoned_qkv[:96, 2] = float("nan")
    poisoned_qkv[224:, 2] = float("nan")
    out = attention(poisoned_qkv, cu, L, hd ** -0.5, window=w, rotary=rotary)
    assert torch.equal(out[128:192], clean[128:192])
    assert torch.isnan(out[:64]).all() and torch.isnan(out[192:]).all()


# --------------------------------------------------------------------------------------------------------------------
# Padded rows
# --------------------------------------------------------------------------------------------------------------------
PADDED_CASES = [  # (B, S, nh, hd, padding, window, rotary, tile)
    (3, 70, 2, 32, "left", 3, True, None),
    (2, 40, 1, 64, "holes", 3, True, TILE16),  # padded queries whose band holds only padding
    (3, 37, 2, 16, "fully_padded", 3, True, TILE16),
    (3, 70, 2, 32, "fully_padded", 16, False, None),
    (3, 50, 2, 32, "right", 1, True, TILE16),  # padded queries past the row's last real key
    (2, 33, 2, 32, "left", None, True, None),  # rotary alone, positions from the row's first column
    (2, 9, 2, 32, "holes", 16, True, None),  # rows shorter than the window
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("B,S,nh,hd,padding,window,rotate,tile", PADDED_CASES,
                         ids=[f"B{c[0]}-S{c[1]}-hd{c[3]}-{c[4]}-w{c[5]}-{'rot' if c[6] else 'norot'}"
                              f"{'-tile16' if c[7] else ''}" for c in PADDED_CASES])
def test_padded_matches_twin_and_fp64(B, S, nh, hd, padding, window, rotate, tile, dtype):
    run_padded(B, S, nh, hd, dtype, padding, window, rotate, config=tile)


def test_fully_padded_row_ignores_the_window():
    """A row without a real token attends uniformly to all S keys, window or not (HF eager's answer), and the other
    rows are what they are alone."""
    B, S, nh, hd = 3, 37, 2, 32
    qkv, keep, out = run_padded(B, S, nh, hd, torch.float32, "fully_padded", 3, True)
    v_mean = qkv[S:2 * S, 2].reshape(S, nh * hd).double().mean(dim=0)
    assert (out[S:2 * S].double() - v_mean).abs().max().item() <= 1e-5
    rotary = rotary_for(torch.arange(S), hd)
    alone = attention(qkv[2 * S:], uniform_cu_seqlens(1, S, qkv.device), S, hd ** -0.5, key_valid=keep[2:],
                      window=3, rotary=rotary)
    assert torch.equal(alone, out[2 * S:])


def test_window_composes_with_a_relative_bias():
    """window, rotary and a per-distance bias table together, varlen and padded, against the twin in fp32."""
    nh, hd, reach = 2, 32, 9
    table = torch.randn(nh, 2 * reach - 1, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    lengths = [70, 5, 1]
    T = sum(lengths)
    qkv = make_qkv(T, nh, hd, torch.float32, seed=4)
    cu = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0).to(torch.int32).to(DEVICE)
    rotary = rotary_for(torch.cat([torch.arange(n) for n in lengths]), hd)
    out = attention(qkv, cu, max(lengths), hd ** -0.5, window=3, rotary=rotary, bias=table)
    layout = TokenLayout.from_cu_seqlens(cu, max(lengths), lengths)
    twin = ops.attention_torch(qkv, layout, hd ** -0.5, bias=table, window=3, rotary=rotary)[0]
    assert (out - twin).abs().max().item() <= 1e-5

    B, S = 2, 40
    qkv = make_qkv(B * S, nh, hd, torch.float32, seed=6)
    mask = AttentionMask.build(make_padding(B, S, "holes").long(), B, S, torch.float32)
    rotary = rotary_for(torch.arange(S).repeat(B), hd)
    out = attention(qkv, uniform_cu_seqlens(B, S, qkv.device), S, hd ** -0.5, key_valid=mask.key_valid, window=3,
                    rotary=rotary, bias=table)
    twin = ops.attention_torch(qkv, mask, hd ** -0.5, bias=table, window=3, rotary=rotary)[0]
    assert (out - twin).abs().max().item() <= 1e-5


# --------------------------------------------------------------------------------------------------------------------
# The entry points above the kernel: ops.attention, the custom op and a traced forward's run_attention
# --------------------------------------------------------------------------------------------------------------------
def _packed(lengths, nh, hd, seed=7):
    T = sum(lengths)
    qkv = make_qkv(T, nh, hd, torch.float32, seed)
    cu = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0).to(torch.int32).to(DEVICE)
    layout = TokenLayout.from_cu_seqlens(cu, max(lengths), lengths)
    return qkv, cu, layout, rotary_for(torch.cat([torch.arange(n) for n in lengths]), hd)


def test_ops_and_custom_op_pass_window_and_rotary():
    """Every path reaches the kernel or the twin with the window and the rotation: each agrees with the twin, and
    each differs from the same call without them (so neither was dropped on the way)."""
    lengths, nh, hd = [40, 3], 2, 32
    qkv, cu, layout, rotary = _packed(lengths, nh, hd)
    scale = hd ** -0.5
    want = ops.attention_torch(qkv, layout, scale, window=3, rotary=rotary)[0]
    plain = ops.attention_torch(qkv, layout, scale)[0]
    assert (want - plain).abs().max() > 0.1
    got = {
        "ops triton": ops.attention(qkv, layout, scale, backend="triton", window=3, rotary=rotary)[0],
        "ops torch": ops.attention(qkv, layout, scale, backend="torch", window=3, rotary=rotary)[0],
        "custom op triton": torch.ops.fastbert.attention(qkv, cu, max(lengths), scale, None, False, "triton", 3,
                                                         None, rotary.cos, rotary.sin, None, None, None),
        "custom op torch": torch.ops.fastbert.attention(qkv, cu, max(lengths), scale, None, False, "torch", 3,
                                                        None, rotary.cos, rotary.sin, None, None, None),
    }
    for backend in ("triton", "torch"):
        run = dispatch.traced_ops(dict.fromkeys(ops.OPS, backend))["attention"]
        got[f"traced {backend}"] = run(qkv, layout, scale, extras=Extras(window=3, rotary=rotary))[0]
    for name, out in got.items():
        assert (out - want).abs().max().item() <= 1e-5, name
    # -1: no window (a schema int cannot be None), the rotation still applied
    no_window = torch.ops.fastbert.attention(qkv, cu, max(lengths), scale, None, False, "triton", -1,
                                             None, rotary.cos, rotary.sin, None, None, None)
    assert (no_window - ops.attention_torch(qkv, layout, scale, rotary=rotary)[0]).abs().max().item() <= 1e-5


def test_custom_op_fake_shape():
    lengths, nh, hd = [5, 3], 2, 16
    qkv, cu, _, rotary = _packed(lengths, nh, hd)
    torch.library.opcheck(torch.ops.fastbert.attention.default,
                          (qkv, cu, max(lengths), hd ** -0.5, None, False, "torch", 2,
                           None, rotary.cos, rotary.sin, None, None, None),
                          test_utils=("test_schema", "test_faketensor"))


# --------------------------------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------------------------------
def test_bad_window_and_rotary_are_refused_quoting_them():
    lengths, nh, hd = [5, 3], 2, 32
    qkv, cu, _, rotary = _packed(lengths, nh, hd)
    call = lambda **kw: attention(qkv, cu, 5, 0.1, **kw)  # noqa: E731
    with pytest.raises(ValueError, match=r"window must be None or a non-negative int, got -1"):
        call(window=-1)
    with pytest.raises(ValueError, match=r"got True"):
        call(window=True)
    with pytest.raises(ValueError, match=r"got 2.0"):
        call(window=2.0)
    with pytest.raises(ValueError, match=r"rotary cos has shape \(8, 32\), expected \(T, head_dim / 2\)=\(8, 16\)"):
        call(rotary=(torch.zeros(8, 32, device=DEVICE), torch.zeros(8, 32, device=DEVICE)))
    with pytest.raises(TypeError, match=r"rotary sin.dtype=torch.float16"):
        call(rotary=(rotary.cos, rotary.sin.half()))
    with pytest.raises(ValueError, match=r"rotary cos's last dim must be unit-stride, got strides \(1, 8\)"):
        call(rotary=(rotary.cos.t().contiguous().t(), rotary.sin))
    with pytest.raises(ValueError, match=r"same strides, got \(16, 1\) and \(32, 1\)"):
        call(rotary=(rotary.cos, torch.zeros(8, 32, device=DEVICE)[:, :16]))
    with pytest.raises(TypeError, match=r"rotary must be None, a \(cos, sin\) pair .* got Tensor"):
        call(rotary=rotary.cos)
    with pytest.raises(TypeError, match=r"rotary cos must be a torch.Tensor, got list"):
        call(rotary=([0.0], rotary.sin))
