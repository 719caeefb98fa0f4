"""Causal attention (Qwen3's decoder layers run as an embedder: query i sees keys j <= i of its sequence) in the
attention kernel and its twin, against a float64 reference written out here.

Cases: packed sequences whose lengths cross the interpreter tile's edges (64 queries, 32 keys), grouped key/value
heads and rotary on and off; padded rows, left and right padded, with a fully padded row (a query that sees no real
key gets the mean of its row's values, HF eager's uniform answer). The kernel visits no key block above the
diagonal: values after a query block's last query are NaN, and that block's outputs stay finite and exact.
Tolerances: fastbert.numerics' rule (fp32 <= 1e-5 against the twin and the fp64 reference; fp16 <= 2x the twin's
own error against fp64). Outputs are poisoned with NaN first.
"""
import pytest
import torch
from helpers import DEVICE, assert_kernel_matches, make_grouped, poisoned, repeat_kv64, rotary_for, rotate64

from fastbert.kernels.attention import attention, uniform_cu_seqlens
from fastbert.layout import TokenLayout
from fastbert.mask import AttentionMask
from fastbert.units import attention as attention_unit
from fastbert.units.attention import Extras

DTYPES = [torch.float32, torch.float16]


def causal64(x, nh, kv, scale, cos=None, sin=None, key_real=None):
    """One sequence of grouped qkv [L, nh + 2 kv, hd] in float64 -> [L, nh*hd]: finfo.min on keys after the query
    and on padded keys (a query left with no key is uniform over all L, as HF eager's finfo.min mask gives)."""
    x = x.double()
    L, hd = x.shape[0], x.shape[-1]
    q, k, v = x[:, :nh], x[:, nh:nh + kv], x[:, nh + kv:]
    if cos is not None:
        q, k = rotate64(q, cos, sin), rotate64(k, cos, sin)
    k, v = repeat_kv64(k, nh // kv), repeat_kv64(v, nh // kv)
    scores = torch.einsum("ihd,jhd->hij", q, k) * scale
    seen = torch.ones(L, L, dtype=torch.bool).tril()
    if key_real is not None:
        seen = seen & key_real.cpu()[None, :]
    scores = scores.masked_fill(~seen[None], torch.finfo(torch.float64).min)
    return torch.einsum("hij,jhd->ihd", torch.softmax(scores, dim=-1), v).reshape(L, nh * hd)


CASES = [  # (lengths, nh, kv, hd, rotary)
    ([1, 17, 64, 65, 130], 4, 2, 32, True),
    ([130, 1, 33], 2, 2, 16, False),
    ([97, 5], 8, 2, 64, True),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("lengths,nh,kv,hd,rotate", CASES,
                         ids=[f"L{'-'.join(map(str, c[0]))}-nh{c[1]}-kv{c[2]}-hd{c[3]}-{'rot' if c[4] else 'norot'}"
                              for c in CASES])
def test_packed_causal_matches_twin_and_fp64(lengths, nh, kv, hd, rotate, dtype):
    T = sum(lengths)
    qkv = make_grouped(T, nh, kv, hd, dtype, seed=3)
    cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32).to(DEVICE)
    rotary = rotary_for(torch.cat([torch.arange(n) for n in lengths]), hd) if rotate else None
    layout = TokenLayout.from_cu_seqlens(cu, max(lengths), lengths)
    scale = hd ** -0.5
    out = poisoned((T, nh * hd), dtype)
    attention(qkv, cu, max(lengths), scale, out=out, rotary=rotary, kv_heads=kv, causal=True)
    twin = attention_unit.twin(qkv, layout, scale, extras=Extras(rotary=rotary, kv_heads=kv, causal=True))[0]
    ref, start = [], 0
    for n in lengths:
        rows = slice(start, start + n)
        cos, sin = (None, None) if rotary is None else (rotary.cos[rows].cpu(), rotary.sin[rows].cpu())
        ref.append(causal64(qkv[rows].cpu(), nh, kv, scale, cos, sin))
        start += n
    assert_kernel_matches(out, twin, torch.cat(ref).to(out.device), dtype)
    # and it is causal: both ways differs by far more than the bar
    both = attention_unit.twin(qkv, layout, scale, extras=Extras(rotary=rotary, kv_heads=kv))[0]
    assert (both.float() - out.float()).abs().max() > 1e-2


@pytest.mark.filterwarnings("ignore:All-NaN slice encountered")  # the interpreter's max over the NaN launch
def test_no_key_block_above_the_diagonal_is_read():
    """One sequence of 100 tokens: values (and keys) from position 64 on are NaN. The first query block (64 queries
    on the interpreter's tile) must not load them: its outputs equal the reference of the first 64 tokens alone. The
    twin's sdpa is no witness here (it reads every key), so the reference is the fp64 one."""
    nh, kv, hd, L = 2, 2, 32, 100
    qkv = make_grouped(L, nh, kv, hd, torch.float32, seed=5)
    want = causal64(qkv[:64].cpu(), nh, kv, hd ** -0.5)
    qkv[64:, nh:] = float("nan")  # k and v of the second block's tokens
    cu = torch.tensor([0, L], dtype=torch.int32, device=DEVICE)
    out = poisoned((L, nh * hd), torch.float32)
    attention(qkv, cu, L, hd ** -0.5, out=out, kv_heads=kv, causal=True)
    assert torch.isfinite(out[:64]).all()
    assert (out[:64].double().cpu() - want).abs().max() <= 1e-5
    # the same launch attending both ways reads them, and turns NaN: the test can see a read
    both = attention(qkv, cu, L, hd ** -0.5, kv_heads=kv)
    assert torch.isnan(both[:64]).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("left", [False, True], ids=["right", "left"])
def test_padded_rows_causal(left, dtype):
    """Padded rows [B, S] with the key mask: real queries see the real keys at or before them; left padding's
    queries, which see no real key, and a fully padded row get the row's mean value, as in the twin."""
    B, S, nh, kv, hd = 4, 70, 4, 2, 16
    lengths = [70, 33, 1, 0]
    keep = torch.zeros(B, S, dtype=torch.bool)
    for b, n in enumerate(lengths):
        if left:
            keep[b, S - n:] = True
        else:
            keep[b, :n] = True
    keep = keep.to(DEVICE)
    qkv = make_grouped(B * S, nh, kv, hd, dtype, seed=7)
    scale = hd ** -0.5
    out = poisoned((B * S, nh * hd), dtype)
    attention(qkv, uniform_cu_seqlens(B, S, qkv.device), S, scale, keep, out=out, kv_heads=kv, causal=True)
    mask = AttentionMask.build(keep, B, S, qkv.dtype, flags=(False, False))
    twin = attention_unit.twin(qkv, mask, scale, extras=Extras(kv_heads=kv, causal=True))[0]
    ref = torch.cat([causal64(qkv[b * S:(b + 1) * S].cpu(), nh, kv, scale, key_real=keep[b]) for b in range(B)])
    assert_kernel_matches(out, twin, ref.to(out.device), dtype)
