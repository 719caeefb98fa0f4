"""The attention kernel with DeBERTa's disentangled terms (c2p, p2c, one column table) against a dense reference.

`reference` is the definition written out per sequence: the [nh, n, n] bias
    B[h, i, j] = c2p[tok(i), h, c] + p2c[tok(j), h, c],   c = column[clamp(j - i + L - 1, 0, 2L - 2)]
built by explicit indexing (Python ints for c, then c2p/p2c indexed at [token, :, c]), added to q k^T * scale,
HF's finfo.min masking on padded rows (masked_fill, as DebertaV2's attention does), softmax, @ v. Run in float64 it is
the reference; run in the test's dtype it is PyTorch's own error in that dtype, the yardstick of the rule of
fastbert.numerics (fp32 1e-5; fp16 at most twice that error). Outputs are poisoned with NaN first.
The column table itself is checked against transformers' own DebertaV2 position code, and the kernel against HF's
DisentangledSelfAttention module.
"""
import dataclasses
from types import SimpleNamespace

import pytest
import torch
from helpers import DEVICE, assert_kernel_matches, max_error, poisoned

from fastbert.kernels import attention as attention_module
from fastbert.kernels.attention import attention, launch, uniform_cu_seqlens
from fastbert.layout import TokenLayout
from fastbert.mask import AttentionMask
from fastbert.units import attention as attention_unit
from fastbert.units.attention import Extras

SPAN = 8  # P = 2 * SPAN columns in c2p / p2c
REACH = 24  # L: the column table covers distances -(L - 1)..(L - 1); longer distances read its end entries
LENGTHS = (1, 40, 17, 33)  # across the interpreter tile's 32-key and 64-query edges, longer than L and than SPAN
TILE16 = attention_module._config(16, 16, 4, 2)
FORMS = {"both": (True, True), "c2p": (True, False), "p2c": (False, True)}


# --------------------------------------------------------------------------------------------------------------------
# Inputs and the dense reference
# --------------------------------------------------------------------------------------------------------------------
def make_qkv(T, nh, hd, dtype, seed=0, strided=False):
    """qkv [T, 3, nh, hd]; strided: a column slice of a wider buffer (row stride 3H + 16)."""
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(T, 3 * nh * hd, generator=g, dtype=torch.float64).to(dtype)
    if strided:
        big = torch.zeros(T, 3 * nh * hd + 16, dtype=dtype)
        big[:, 8:8 + 3 * nh * hd] = values
        values = big[:, 8:8 + 3 * nh * hd]
    return values.to(DEVICE).view(T, 3, nh, hd)


def make_terms(T, nh, form, seed=1, transposed=False, dtype=torch.float32):
    """(c2p, p2c) [T, nh, 2 SPAN] with O(1) entries, None where the form has no such term. transposed: each a
    [nh, T, P] tensor seen through .transpose(0, 1), as a per-head bmm returns it."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for wanted in FORMS[form]:
        table = torch.randn(nh, T, 2 * SPAN, generator=g).to(dtype)
        table = table.to(DEVICE).transpose(0, 1) if transposed else table.transpose(0, 1).contiguous().to(DEVICE)
        out.append(table if wanted else None)
    return out


def make_column(reach=REACH, seed=2):
    """int32 [2L - 1] of arbitrary columns in [0, 2 SPAN), so that a wrong gather cannot hide behind a pattern."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2 * SPAN, (2 * reach - 1,), generator=g, dtype=torch.int32).to(DEVICE)


def dense_terms(c2p, p2c, column, start, n, nh, dtype):
    """[nh, n, n]: c2p[start + i, h, c(i, j)] + p2c[start + j, h, c(i, j)], c(i, j) read one pair at a time."""
    table, reach = column.tolist(), (column.shape[0] - 1) // 2
    c = torch.tensor([[table[min(max(j - i + reach, 0), 2 * reach)] for j in range(n)] for i in range(n)])
    i = torch.arange(n)[:, None].expand(n, n)
    term = torch.zeros(nh, n, n, dtype=dtype)
    if c2p is not None:
        term += c2p.cpu().to(dtype)[start + i, :, c].permute(2, 0, 1)  # [n, n, nh] -> [nh, n, n]
    if p2c is not None:
        term += p2c.cpu().to(dtype)[start + i.T, :, c].permute(2, 0, 1)
    return term


def reference(qkv, lengths, scale, c2p, p2c, column, dtype=torch.float64, key_valid=None, query_mask=False):
    """Per sequence: softmax(q k^T * scale + B, masked) v in `dtype` -> [T, nh*hd]. key_valid [B, S] (padded rows):
    masked_fill(finfo.min) where key j is padding, and with query_mask also where query i is (HF's
    mask_i * mask_j): a padded query, like every query of a fully padded row, is then uniform over the row."""
    T, _, nh, hd = qkv.shape
    x = qkv.cpu().to(dtype)
    out, start = torch.empty(T, nh * hd, dtype=dtype), 0
    for row, n in enumerate(lengths):
        q, k, v = x[start:start + n].permute(1, 2, 0, 3).unbind(0)  # [nh, n, hd]
        scores = q @ k.transpose(-1, -2) * scale + dense_terms(c2p, p2c, column, start, n, nh, dtype)
        if key_valid is not None:
            real = key_valid[row].cpu()
            allowed = real[None, :] & real[:, None] if query_mask else real[None, :].expand(n, n)
            scores = scores.masked_fill(~allowed, torch.finfo(dtype).min)
        out[start:start + n] = (torch.softmax(scores, dim=-1) @ v).transpose(0, 1).reshape(n, nh * hd)
        start += n
    return out.to(DEVICE)


def packed(lengths):
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    return cu, max(lengths)


def check(out, qkv, lengths, scale, c2p, p2c, column, dtype, **mask):
    ref64 = reference(qkv, lengths, scale, c2p, p2c, column, **mask)
    baseline = reference(qkv, lengths, scale, c2p, p2c, column, dtype=dtype, **mask)
    assert_kernel_matches(out, baseline.to(dtype), ref64, dtype)


# --------------------------------------------------------------------------------------------------------------------
# Packed (varlen)
# --------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_varlen_matches_reference(dtype, form):
    """Ragged packed sequences (lengths 1..40, past the column table's L = 24 and the span's 8), hd 64, each form of
    the terms; c2p/p2c as transposed [nh, T, P] views for fp16 (any T / nh strides), qkv a strided view for fp32."""
    nh, hd, T = 2, 64, sum(LENGTHS)
    qkv = make_qkv(T, nh, hd, dtype, strided=dtype == torch.float32)
    c2p, p2c = make_terms(T, nh, form, transposed=dtype == torch.float16)
    column, scale = make_column(), (hd * 3) ** -0.5
    cu, max_seqlen = packed(LENGTHS)
    out = poisoned((T, nh * hd), dtype)
    result = attention(qkv, cu, max_seqlen, scale, out=out, c2p=c2p, p2c=p2c, column=column)
    assert result.data_ptr() == out.data_ptr()
    check(out, qkv, LENGTHS, scale, c2p, p2c, column, dtype)


def test_varlen_hd32_small_tiles_and_half_terms():
    """hd 32 on 16x16 tiles (every block edge at these lengths), the terms in fp16 and bf16 (read as they are,
    added in fp32), a table shorter than SPAN's reach (L = 5: every distance past 4 clamps)."""
    nh, hd, lengths = 3, 32, (19, 1, 35)
    T = sum(lengths)
    qkv = make_qkv(T, nh, hd, torch.float32, seed=3)
    c2p, _ = make_terms(T, nh, "c2p", seed=4, dtype=torch.float16)
    _, p2c = make_terms(T, nh, "p2c", seed=5, dtype=torch.bfloat16)
    column, scale = make_column(reach=5, seed=6), hd ** -0.5
    cu, max_seqlen = packed(lengths)
    out = attention(qkv, cu, max_seqlen, scale, c2p=c2p, p2c=p2c, column=column, config=TILE16,
                    out=poisoned((T, nh * hd), torch.float32))
    check(out, qkv, lengths, scale, c2p, p2c, column, torch.float32)


def test_terms_are_shift_invariant_under_packing():
    """A sequence's output does not depend on where it sits in the packed batch: positions are within the sequence,
    the tables' rows are its tokens'."""
    nh, hd, lengths = 2, 32, (33, 20)
    qkv = make_qkv(sum(lengths), nh, hd, torch.float32)
    c2p, p2c = make_terms(sum(lengths), nh, "both")
    column, scale = make_column(), hd ** -0.5
    cu, max_seqlen = packed(lengths)
    together = attention(qkv, cu, max_seqlen, scale, c2p=c2p, p2c=p2c, column=column)
    cu_alone, _ = packed((20,))
    alone = attention(qkv[33:], cu_alone, 20, scale, c2p=c2p[33:], p2c=p2c[33:], column=column)
    assert max_error(alone, together[33:]) <= 1e-6


# --------------------------------------------------------------------------------------------------------------------
# Padded rows (key_valid)
# --------------------------------------------------------------------------------------------------------------------
def padding(B, S):
    """[B, S] bool: row 0 right-padded, row 1 fully padded, row 2 left-padded with a hole, row 3 all real."""
    keep = torch.ones(B, S, dtype=torch.bool)
    keep[0, 29:] = False
    keep[1] = False
    keep[2, :11] = False
    keep[2, 20] = False
    return keep.to(DEVICE)


@pytest.mark.parametrize("uniform", [False, True], ids=["keys-only", "uniform-padded-queries"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_padded_matches_reference(dtype, uniform):
    """Padded rows of S = 37 with both terms: padded keys get probability 0; a fully padded row is uniform over its
    S keys; a padded query attends to its row's real keys, or, with uniform_padded_queries (DeBERTa's
    mask_i * mask_j), is uniform over all S keys too."""
    B, S, nh, hd = 4, 37, 2, 64
    qkv = make_qkv(B * S, nh, hd, dtype, seed=7)
    c2p, p2c = make_terms(B * S, nh, "both", seed=8, transposed=True)
    column, scale = make_column(seed=9), (hd * 3) ** -0.5
    keep = padding(B, S)
    out = attention(qkv, uniform_cu_seqlens(B, S, qkv.device), S, scale, key_valid=keep, c2p=c2p, p2c=p2c,
                    column=column, uniform_padded_queries=uniform, out=poisoned((B * S, nh * hd), dtype))
    check(out, qkv, [S] * B, scale, c2p, p2c, column, dtype, key_valid=keep, query_mask=uniform)
    if uniform:  # exactly the row's mean value at every padded query
        v_mean = qkv[:, 2].reshape(B, S, nh * hd).double().mean(dim=1)
        padded = ~keep.reshape(-1)
        rows = torch.arange(B, device=DEVICE).repeat_interleave(S)[padded]
        assert max_error(out[padded], v_mean[rows]) <= (1e-6 if dtype == torch.float32 else 1e-3)


# --------------------------------------------------------------------------------------------------------------------
# The column table from transformers' own DeBERTa-v2 code, and HF's attention module
# --------------------------------------------------------------------------------------------------------------------
def hf_column(deberta, reach, buckets, max_position):
    """column[d + L - 1] for d = j - i in -(L - 1)..(L - 1), read off HF's c2p index clamp(r + span) with HF's
    relative positions r of an L x L sequence: d >= 0 from query 0, d < 0 from key 0."""
    x = torch.zeros(1, reach, 1)
    rel = deberta.build_relative_position(x, x, bucket_size=buckets, max_position=max_position)[0]  # [L, L]
    c2p_pos = torch.clamp(rel + buckets, 0, 2 * buckets - 1)
    d = torch.arange(-(reach - 1), reach)
    return c2p_pos[(-d).clamp(min=0), d.clamp(min=0)].to(torch.int32)


def test_one_column_table_reproduces_both_hf_gathers():
    """HF gathers c2p at clamp(r[i, j] + span) and p2c at clamp(-r[j, i] + span), then transposes: the claim is
    that one table indexed by j - i gives both, for distances past the table too (L = 20 < n = 40: HF's log buckets
    have saturated by then), and that make_log_bucket_position is antisymmetric (why the two agree)."""
    deberta = pytest.importorskip("transformers.models.deberta_v2.modeling_deberta_v2")
    buckets, max_position, reach, n = SPAN, 16, 20, 40
    d = torch.arange(-3 * n, 3 * n)
    bucket = deberta.make_log_bucket_position(d, buckets, max_position)
    assert torch.equal(bucket, -deberta.make_log_bucket_position(-d, buckets, max_position))
    assert len(torch.unique(bucket)) > 2 * buckets - 2  # log buckets at work, not a plain clamp

    x = torch.zeros(1, n, 1)
    r = deberta.build_relative_position(x, x, bucket_size=buckets, max_position=max_position)[0]  # [n, n]
    assert torch.equal(r, bucket[(torch.arange(n)[:, None] - torch.arange(n)[None, :]) + 3 * n])
    c2p_pos = torch.clamp(r + buckets, 0, 2 * buckets - 1)  # HF's c2p index at (query i, key j)
    p2c_pos = torch.clamp(-r + buckets, 0, 2 * buckets - 1).T  # HF's p2c index, gathered at (j, i), transposed
    column = hf_column(deberta, reach, buckets, max_position)
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    from_table = column[(j - i + reach - 1).clamp(0, 2 * reach - 2)]
    assert torch.equal(from_table, c2p_pos) and torch.equal(from_table, p2c_pos)


@pytest.mark.parametrize("share_att_key", [True, False], ids=["shared-keys", "own-position-projections"])
def test_kernel_matches_hf_disentangled_self_attention(share_att_key):
    """transformers' DisentangledSelfAttention on a padded batch (right padding, a fully padded row, left padding)
    with HF's own mask_i * mask_j and relative positions, against the kernel fed the per-token tables its
    projections give (scale 1/sqrt(d * 3), uniform_padded_queries): fp32 within 1e-5 at every position."""
    transformers = pytest.importorskip("transformers")
    deberta = transformers.models.deberta_v2.modeling_deberta_v2
    config = transformers.DebertaV2Config(
        hidden_size=64, num_attention_heads=2, intermediate_size=37, relative_attention=True, position_buckets=SPAN,
        max_relative_positions=16, pos_att_type=["p2c", "c2p"], share_att_key=share_att_key, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    module = deberta.DisentangledSelfAttention(config).eval()
    B, S, H, nh, hd = 3, 30, 64, 2, 32
    hidden = torch.randn(B, S, H)
    rel_embeddings = torch.randn(2 * SPAN, H)
    keep = torch.ones(B, S, dtype=torch.bool)
    keep[0, 22:] = False
    keep[1] = False
    keep[2, :5] = False
    mask = keep[:, None, None, :] & keep[:, None, :, None]  # what DebertaV2Encoder.get_attention_mask builds
    x = torch.zeros(1, S, 1)
    relative_pos = deberta.build_relative_position(x, x, bucket_size=SPAN, max_position=16)
    with torch.no_grad():
        want, _ = module(hidden, mask, relative_pos=relative_pos, rel_embeddings=rel_embeddings)

        flat = hidden.reshape(B * S, H)
        q, k, v = (proj(flat).view(B * S, nh, hd) for proj in (module.query_proj, module.key_proj, module.value_proj))
        pos_key = (module.key_proj if share_att_key else module.pos_key_proj)(rel_embeddings).view(2 * SPAN, nh, hd)
        pos_query = (module.query_proj if share_att_key else module.pos_query_proj)(rel_embeddings)
        pos_query = pos_query.view(2 * SPAN, nh, hd)
        scale = (hd * 3) ** -0.5
        c2p = torch.einsum("thd,phd->htp", q, pos_key).transpose(0, 1) * scale  # [T, nh, P], strided
        p2c = torch.einsum("thd,phd->htp", k, pos_query).transpose(0, 1) * scale
        column = hf_column(deberta, S, SPAN, 16)
        qkv = torch.stack([q, k, v], dim=1).to(DEVICE)
        got = attention(qkv, uniform_cu_seqlens(B, S, qkv.device), S, scale, key_valid=keep.to(DEVICE),
                        c2p=c2p.to(DEVICE), p2c=p2c.to(DEVICE), column=column.to(DEVICE),
                        uniform_padded_queries=True, out=poisoned((B * S, H), torch.float32))
    assert max_error(got, want.reshape(B * S, H).to(DEVICE)) <= 1e-5


# --------------------------------------------------------------------------------------------------------------------
# The attention unit's kernel adapter (the model's path)
# --------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("checked", [False, True], ids=["launch", "checked"])
def test_the_unit_passes_the_terms(checked):
    """The attention unit's kernel takes the terms as one object (.c2p, .p2c, .column) and hands the kernel plain
    tensors: packed, and padded, where DeBERTa's padded queries are uniform (HF's mask_i * mask_j)."""
    nh, hd, lengths = 2, 32, (25, 6)
    T = sum(lengths)
    qkv = make_qkv(T, nh, hd, torch.float32, seed=10)
    c2p, p2c = make_terms(T, nh, "both", seed=11)
    column, scale = make_column(), (hd * 3) ** -0.5
    terms = SimpleNamespace(c2p=c2p, p2c=p2c, column=column)
    cu, max_seqlen = packed(lengths)
    layout = TokenLayout.from_cu_seqlens(cu, max_seqlen, list(lengths))
    ctx, probs = attention_unit.kernel(qkv, layout, scale, extras=Extras(disentangled=terms), checked=checked)
    assert probs is None
    assert max_error(ctx, reference(qkv, lengths, scale, c2p, p2c, column)) <= 1e-5

    B, S = 2, 20
    qkv = make_qkv(B * S, nh, hd, torch.float32, seed=12)
    c2p, p2c = make_terms(B * S, nh, "both", seed=13)
    keep = torch.ones(B, S, dtype=torch.bool, device=DEVICE)
    keep[0, 13:] = False
    # the model builds DeBERTa's padded rows as pairwise masks (HF's mask_i * mask_j)
    mask = dataclasses.replace(AttentionMask.build(keep.long(), B, S, torch.float32), pairwise=True)
    terms = SimpleNamespace(c2p=c2p, p2c=p2c, column=column)
    ctx, _ = attention_unit.kernel(qkv, mask, scale, extras=Extras(disentangled=terms), checked=checked)
    ref = reference(qkv, [S] * B, scale, c2p, p2c, column, key_valid=keep, query_mask=True)
    assert max_error(ctx, ref) <= 1e-5


# --------------------------------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------------------------------
def _bad_call_cases():
    nh, T = 2, 5
    P = 2 * SPAN

    def table(*shape, dtype=torch.float32):
        return torch.zeros(*shape, dtype=dtype, device=DEVICE)

    good = dict(c2p=table(T, nh, P), p2c=table(T, nh, P), column=make_column())
    steps = torch.arange(2 * REACH - 1, dtype=torch.int32, device=DEVICE)
    return [
        ("c2p-dtype", dict(good, c2p=table(T, nh, P, dtype=torch.int32)), TypeError, r"c2p.dtype=torch.int32"),
        ("p2c-shape", dict(good, p2c=table(T, nh + 1, P)), ValueError,
         r"p2c has shape \(5, 3, 16\), expected \(T, num_heads, P\)=\(5, 2, P\)"),
        ("c2p-2d", dict(good, c2p=table(T, nh * P)), ValueError, r"c2p has shape \(5, 32\)"),
        ("c2p-stride", dict(good, c2p=table(T, P, nh).transpose(1, 2)), ValueError,
         r"c2p's last dim \(P\) must be unit-stride, got strides \(32, 1, 2\)"),
        ("widths", dict(good, p2c=table(T, nh, P + 2)), ValueError,
         r"same P, got c2p \(5, 2, 16\) and p2c \(5, 2, 18\)"),
        ("c2p-list", dict(good, c2p=[0.0]), TypeError, r"c2p must be a torch.Tensor or None, got list"),
        ("device", dict(good, p2c=torch.zeros(T, nh, P, device="meta")), ValueError, r"p2c is on meta"),
        ("no-terms", dict(column=make_column()), ValueError, r"column was given without c2p or p2c"),
        ("no-column", dict(good, column=None), TypeError, r"column must be an int32 torch.Tensor .* got NoneType"),
        ("column-int64", dict(good, column=make_column().long()), TypeError, r"column.dtype=torch.int64"),
        ("column-even", dict(good, column=make_column()[:46]), ValueError, r"column has shape \(46,\)"),
        ("column-stride", dict(good, column=torch.zeros(94, dtype=torch.int32, device=DEVICE)[::2]), ValueError,
         r"column must be unit-stride, got stride 2"),
        ("column-values", dict(good, column=steps % 17), ValueError,
         r"column's values must lie in \[0, P\) = \[0, 16\) .* got 0\.\.16"),
        ("negative-column", dict(good, column=steps % 16 - 1), ValueError, r"got -1\.\.14"),
        ("with-bias", dict(good, bias=table(nh, 9)), ValueError,
         r"cannot be combined with a bias, a window or rotary; got bias=\(2, 9\)"),
        ("with-window", dict(good, window=3), ValueError, r"got window=3"),
        ("with-rotary", dict(good, rotary=(table(T, 16), table(T, 16))), ValueError, r"got rotary=tuple"),
        ("uniform-flag", dict(good, uniform_padded_queries=1), TypeError,
         r"uniform_padded_queries must be a bool, got 1"),
    ]


@pytest.mark.parametrize("kwargs,error,match", [c[1:] for c in _bad_call_cases()],
                         ids=[c[0] for c in _bad_call_cases()])
def test_bad_terms_are_refused_quoting_them(kwargs, error, match):
    qkv = make_qkv(5, 2, 32, torch.float32)
    with pytest.raises(error, match=match):
        attention(qkv, *packed((5,)), 0.1, **kwargs)


def test_unchecked_launch_refuses_the_combinations_too():
    """The model's path (no checks) still refuses a bias or window with the terms: they would share the kernel's
    per-distance table reach."""
    qkv = make_qkv(5, 2, 32, torch.float32)
    c2p, _ = make_terms(5, 2, "c2p")
    with pytest.raises(ValueError, match=r"got bias=\(2, 9\)"):
        launch(qkv, *packed((5,)), 0.1, c2p=c2p, column=make_column(), bias=torch.zeros(2, 9, device=DEVICE))
    with pytest.raises(ValueError, match=r"got window=2"):
        launch(qkv, *packed((5,)), 0.1, c2p=c2p, column=make_column(), window=2)
