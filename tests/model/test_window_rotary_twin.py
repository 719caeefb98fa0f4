"""The attention twin's window= and rotary= against ModernBERT's own math in float64.

The reference rotates q and k with transformers' apply_rotary_pos_emb (ModernBERT's module, cos/sin repeated over both
halves as its rotary embedding returns them) and masks an explicit band |i - j| <= w; the twin's own code is not used.
HF rotates in float32 (apply_rotary_pos_emb calls .float()), so q and k go in as float32 and the rotated tensors are
taken to float64 for the softmax and the products. fp32 bar: 1e-5.
"""
import pytest
import torch

from fastbert import ops, twins
from fastbert.layout import TokenLayout
from fastbert.mask import AttentionMask

modernbert = pytest.importorskip("transformers.models.modernbert.modeling_modernbert")


def hf_tables(positions, hd, theta):
    """cos, sin [T, hd] as ModernBertRotaryEmbedding returns them (frequencies repeated), and the [T, hd/2] halves."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float) / hd))
    freqs = positions[:, None].float() * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin(), inv_freq


def hf_reference(q, k, v, cos, sin, scale, window, key_real=None):
    """One sequence q, k, v [L, nh, hd] float32 -> [L, nh*hd] float64: HF's rotation, then softmax in float64 with
    -inf outside the band and finfo.min on padded keys."""
    L, nh, hd = q.shape
    qr, kr = modernbert.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])
    qr, kr, v = qr[0].double(), kr[0].double(), v.transpose(0, 1).double()  # [nh, L, hd]
    scores = qr @ kr.transpose(-1, -2) * scale
    if key_real is not None:
        scores = scores.masked_fill(~key_real[None, None, :], torch.finfo(torch.float64).min)
    if window is not None:
        i = torch.arange(L)
        scores = scores.masked_fill(((i[None, :] - i[:, None]).abs() > window)[None], float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v).transpose(0, 1).reshape(L, nh * hd)


@pytest.mark.parametrize("window", [None, 1, 4, 64], ids=lambda w: f"w{w}")
@pytest.mark.parametrize("theta", [10000.0, 160000.0], ids=["local-theta", "global-theta"])
def test_varlen_twin_matches_hf(window, theta):
    lengths, nh, hd = [1, 5, 9, 70, 300], 2, 32
    T = sum(lengths)
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(T, 3, nh, hd, generator=g)
    positions = torch.cat([torch.arange(n) for n in lengths])
    cos, sin, inv_freq = hf_tables(positions, hd, theta)
    rotary = twins.rotary_tables(positions, inv_freq)
    assert torch.equal(rotary.cos, cos[:, :hd // 2]) and torch.equal(rotary.sin, sin[:, :hd // 2])
    cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    layout = TokenLayout.from_cu_seqlens(cu, max(lengths), lengths)
    got = ops.attention_torch(qkv, layout, hd ** -0.5, window=window, rotary=rotary)[0]
    assert (got.double() - hf_packed_reference(qkv, lengths, cos, sin, hd ** -0.5, window)).abs().max().item() <= 1e-5


def hf_packed_reference(qkv, lengths, cos, sin, scale, window):
    """HF's math (hf_reference) on each packed sequence of qkv [T, 3, nh, hd] alone, concatenated."""
    ref, start = [], 0
    for n in lengths:
        q, k, v = qkv[start:start + n].unbind(1)
        ref.append(hf_reference(q, k, v, cos[start:start + n], sin[start:start + n], scale, window))
        start += n
    return torch.cat(ref)


@pytest.mark.parametrize("window", [None, 4, 64], ids=lambda w: f"w{w}")
def test_varlen_twin_into_a_workspace_matches_hf_and_the_allocating_twin(window):
    """The workspace path (q and k rotated for all tokens at once, contexts written into one buffer) against HF's
    math, and bit for bit against the allocating twin; one workspace serves two layouts in turn, the second
    smaller, so a stale or mis-sized buffer would show."""
    nh, hd = 2, 32
    ws = twins.Workspace()
    for lengths in ([1, 5, 9, 70, 300], [3, 130, 65]):
        T = sum(lengths)
        g = torch.Generator().manual_seed(T)
        qkv = torch.randn(T, 3, nh, hd, generator=g)
        positions = torch.cat([torch.arange(n) for n in lengths])
        cos, sin, inv_freq = hf_tables(positions, hd, 10000.0)
        rotary = twins.rotary_tables(positions, inv_freq)
        cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
        layout = TokenLayout.from_cu_seqlens(cu, max(lengths), lengths)
        got = ops.attention_torch(qkv, layout, hd ** -0.5, window=window, rotary=rotary, workspace=ws)[0]
        assert got.data_ptr() == ws.take("context", got.shape, got).data_ptr()
        fresh = ops.attention_torch(qkv, layout, hd ** -0.5, window=window, rotary=rotary)[0]
        assert torch.equal(got, fresh)
        assert (got.double() - hf_packed_reference(qkv, lengths, cos, sin, hd ** -0.5, window)).abs().max().item() \
            <= 1e-5


def test_padded_twin_matches_hf_on_real_tokens():
    """Left padding with HF's default position_ids (column indices, so a row's first real token is not at 0)."""
    B, S, nh, hd, window = 3, 40, 2, 32, 4
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(B * S, 3, nh, hd, generator=g)
    keep = torch.ones(B, S, dtype=torch.bool)
    keep[1, :17] = False
    keep[2, :3] = False
    keep[2, 20:26] = False
    positions = torch.arange(S).repeat(B)
    cos, sin, inv_freq = hf_tables(positions, hd, 10000.0)
    mask = AttentionMask.build(keep.long(), B, S, torch.float32)
    got = ops.attention_torch(qkv, mask, hd ** -0.5, window=window,
                                rotary=twins.rotary_tables(positions, inv_freq))[0]
    for b in range(B):
        rows = slice(b * S, (b + 1) * S)
        q, k, v = qkv[rows].unbind(1)
        ref = hf_reference(q, k, v, cos[rows], sin[rows], hd ** -0.5, window, keep[b])
        assert (got[rows][keep[b]].double() - ref[keep[b]]).abs().max().item() <= 1e-5
