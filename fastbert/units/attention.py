"""attention: softmax(q k^T * scale + extras + mask) v over packed qkv [T, 3, nh, hd], per sequence, never across
sequences -> [T, nh*hd]. The kernel is flash attention over cu_seqlens (kernels/attention.py); the twin runs sdpa per
sequence (one dense batch when the lengths are equal), or HF's eager math on padded rows when the caller wants the
probabilities. What a family adds to the scores travels as one `Extras`.

Grouped-query attention (Extras.kv_heads = kv < nh): qkv is [T, nh + 2 kv, hd], the QKV GEMM's output viewed per
head (q heads, k heads, v heads), and query head h reads key/value head h // (nh / kv), transformers' repeat_kv order.
Neither side expands k and v for the whole batch: the kernel reads each key/value head in place for its group, the
twin hands sdpa the key/value heads (enable_gqa, per sequence). They are repeated, for one call, only where no fused
kernel takes groups: HF's eager math (beside the [B, nh, S, S] probabilities it forms anyway), the dropout math
written out on CPU, and sdpa on CUDA under a mask (`_sdpa`).
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..layout import TokenLayout
from ..mask import AttentionMask, tracing
from ..twins import Disentangled, Rotary, Workspace, dropout, relative_bias, rotary_tables, rotate, window_mask
from .common import kernel_reason, random_inputs, run_backend

OP = "attention"


def heads(qkv: torch.Tensor, kv_heads: int | None) -> tuple[int, int, int, int]:
    """(T, nh, kv, hd) of qkv [T, 3, nh, hd] (kv_heads None: kv = nh) or grouped [T, nh + 2 kv, hd]."""
    if kv_heads is None:
        T, _, nh, hd = qkv.shape
        return T, nh, nh, hd
    T, width, hd = qkv.shape
    return T, width - 2 * kv_heads, kv_heads, hd


def split_heads(qkv: torch.Tensor, batch: int, length: int, parts: tuple | None = None) -> tuple:
    """Strided views, no copy, of `batch` sequences of `length` tokens: qkv [T, n, nh, hd] -> n tensors
    [batch, nh, length, hd]; grouped [T, sum(parts), hd] -> one [batch, h, length, hd] per head count h of `parts`
    ((nh, kv, kv) for q, k, v)."""
    rows = qkv.view(batch, length, *qkv.shape[1:])
    if parts is None:
        return rows.permute(2, 0, 3, 1, 4).unbind(0)
    return rows.transpose(1, 2).split(parts, dim=1)


def _parts(nh: int, kv_heads: int | None) -> tuple | None:
    return None if kv_heads is None else (nh, kv_heads, kv_heads)


def repeat_kv(x: torch.Tensor, group: int) -> torch.Tensor:
    """[.., kv, L, hd] -> [.., kv * group, L, hd], each key/value head repeated for its group of query heads
    (transformers' repeat_kv); x itself when group == 1."""
    return x if group == 1 else x.repeat_interleave(group, dim=-3)


def _rotate_qk_into(qkv: torch.Tensor, rotary: Rotary, workspace: Workspace, kv_heads: int | None) -> torch.Tensor:
    """q and k of every token of qkv (float32) rotated at once into a workspace buffer: [T, 2, nh, hd], or grouped
    [T, nh + kv, hd] (q heads, then k heads): `rotate`'s arithmetic, each half written in place (no cat)."""
    half = qkv.shape[-1] // 2
    qk = qkv[:, :2] if kv_heads is None else qkv[:, :qkv.shape[1] - kv_heads]
    out = workspace.take("rotated_qk", tuple(qk.shape), qkv)
    tmp = workspace.take("rotary_product", (*qk.shape[:-1], half), qkv)
    cos, sin = rotary.cos[:, None], rotary.sin[:, None]  # [T, 1, hd/2]: the same angles for every head
    if qk.dim() == 4:  # and for q and k
        cos, sin = cos[:, None], sin[:, None]
    x1, x2, o1, o2 = qk[..., :half], qk[..., half:], out[..., :half], out[..., half:]
    torch.mul(x1, cos, out=o1).sub_(torch.mul(x2, sin, out=tmp))  # x1 * cos - x2 * sin
    torch.mul(x2, cos, out=o2).add_(torch.mul(x1, sin, out=tmp))  # x2 * cos + x1 * sin
    return out


def rotated_qk(q, k, v, rotary: Rotary | None, rows: slice | None = None):
    """q, k [.., nh, L, hd] rotated by the rows `rows` of the per-token tables (all of them when None)."""
    if rotary is None:
        return q, k, v
    cos, sin = (rotary.cos, rotary.sin) if rows is None else (rotary.cos[rows], rotary.sin[rows])
    return rotate(q, cos, sin), rotate(k, cos, sin), v


def _columns(column: torch.Tensor, num_queries: int, num_keys: int) -> torch.Tensor:
    """int64 [num_queries, num_keys]: column[(j - i) + L - 1] of each pair, clamped at the table's ends."""
    reach = (column.shape[0] + 1) // 2
    i = torch.arange(num_queries, device=column.device)
    j = torch.arange(num_keys, device=column.device)
    return column.long()[(j[None, :] - i[:, None] + (reach - 1)).clamp_(0, 2 * reach - 2)]


def disentangled_bias(d: Disentangled, start: int, length: int) -> torch.Tensor:
    """The position terms of one sequence whose tokens are rows start : start + length, float32 [nh, L, L]."""
    idx = _columns(d.column, length, length)  # [L(i), L(j)]
    bias = None
    if d.c2p is not None:
        c2p = d.c2p[start:start + length].float().transpose(0, 1)  # [nh, L(i), P]
        bias = torch.gather(c2p, 2, idx.expand(c2p.shape[0], length, length))
    if d.p2c is not None:
        p2c = d.p2c[start:start + length].float().transpose(0, 1)  # [nh, L(j), P]
        term = torch.gather(p2c, 2, idx.t().expand(p2c.shape[0], length, length)).transpose(1, 2)
        bias = term if bias is None else bias + term
    return bias


def disentangled_bias_padded(d: Disentangled, batch_size: int, seq_len: int) -> torch.Tensor:
    """The position terms of padded rows (token b * S + i), float32 [B, nh, S, S], at padded distances (as HF)."""
    B, S = batch_size, seq_len
    idx = _columns(d.column, S, S)
    bias = None
    if d.c2p is not None:
        c2p = d.c2p.float().reshape(B, S, *d.c2p.shape[1:]).transpose(1, 2)  # [B, nh, S(i), P]
        bias = torch.gather(c2p, 3, idx.expand(B, c2p.shape[1], S, S))
    if d.p2c is not None:
        p2c = d.p2c.float().reshape(B, S, *d.p2c.shape[1:]).transpose(1, 2)  # [B, nh, S(j), P]
        term = torch.gather(p2c, 3, idx.t().expand(B, p2c.shape[1], S, S)).transpose(2, 3)
        bias = term if bias is None else bias + term
    return bias


def _check_disentangled(d: Disentangled, bias, window, rotary, causal=False) -> None:
    if bias is not None or window is not None or rotary is not None or causal:
        given = [name for name, v in (("bias", bias), ("window", window), ("rotary", rotary),
                                      ("causal", causal or None)) if v is not None]
        raise ValueError(f"attention: disentangled= is never combined with {', '.join(given)} (DeBERTa has none)")
    if d.c2p is None and d.p2c is None:
        raise ValueError("attention: disentangled= needs at least one of c2p and p2c (pass disentangled=None)")


# Query rows per sdpa call of a windowed sequence: each call sees its rows' keys +-window, so a local layer costs
# ~L * (WINDOW_CHUNK + 2w) scores, not L^2. 64 rows: at w = 64 (ModernBERT) 17.4 ms a 1,719-token sequence and 12
# heads of 64, against 18.0 ms at 128 rows and 23.3 ms at 256 (CPU, 2 threads; full attention there: 62.6 ms).
WINDOW_CHUNK = 64


def _score_mask(bias, window, num_queries, num_keys, dtype, device, query_start=0, key_start=0, causal=False):
    """What sdpa adds to one sequence's scores: the bias [nh, nq, nk] (float), the keys allowed [nq, nk] (bool: the
    window, causal's j <= i, or both), both (-inf where a key is not allowed), or None."""
    rel = None if bias is None else relative_bias(bias, num_queries, num_keys, dtype, query_start, key_start)
    allowed = None if window is None else window_mask(num_queries, num_keys, window, device, query_start, key_start)
    if causal:
        before = causal_mask(num_queries, num_keys, device, query_start, key_start)
        allowed = before if allowed is None else allowed & before
    if allowed is None:
        return rel
    return allowed if rel is None else rel.masked_fill(~allowed, float("-inf"))


def causal_mask(num_queries: int, num_keys: int, device, query_start: int = 0, key_start: int = 0) -> torch.Tensor:
    """bool [num_queries, num_keys]: True where key j is at or before query i (positions within the sequence)."""
    i = torch.arange(query_start, query_start + num_queries, device=device)
    j = torch.arange(key_start, key_start + num_keys, device=device)
    return j[None, :] <= i[:, None]


def _sdpa(q, k, v, attn_mask, dropout_p: float, scale: float) -> torch.Tensor:
    """F.scaled_dot_product_attention, but with dropout on CPU in float32 the math written out: sdpa's CPU kernel
    takes no dropout, so sdpa falls back to this same math with F.dropout's bernoulli_ mask, and `dropout`'s draws are
    cheaper. A bool attn_mask is True where a key is seen; the twins' masks leave every query at least one key.
    k and v may hold fewer heads than q (grouped-query attention), which sdpa reads for each group (enable_gqa). The
    math written out, and sdpa on CUDA with a mask (whose fused kernels take no groups there: it would run its math
    kernel, the [.., nq, nk] scores in memory; transformers repeats there too), take them repeated, for this call."""
    group = int(q.shape[-3]) // int(k.shape[-3])  # model constants (torch.jit.trace hands sizes over as tensors)
    written_out = dropout_p != 0.0 and q.device.type == "cpu" and q.dtype == torch.float32
    if group > 1 and (written_out or attn_mask is not None and q.device.type == "cuda"):
        k, v, group = repeat_kv(k, group), repeat_kv(v, group), 1
    if not written_out:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, scale=scale,
                                              enable_gqa=group > 1)
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)  # [.., nq, nk], fresh: in place is safe for autograd
    if attn_mask is not None:
        scores = scores.masked_fill_(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool \
            else scores.add_(attn_mask)
    return torch.matmul(dropout(torch.softmax(scores, dim=-1), dropout_p), v)


def _sdpa_sequence(q, k, v, scale, dropout_p, bias, window, out: torch.Tensor | None = None, causal: bool = False):
    """q, k, v [b, nh, L, hd] of b sequences of one length L -> [b, nh, L, hd]. A window narrower than the sequence
    runs WINDOW_CHUNK query rows at a time against only the keys their window reaches (causal: none after the
    chunk's last query). `out`: a [b, L, nh, hd] view to write the context into instead (no autograd: copies into
    it), returned."""
    L = q.shape[2]
    if window is None or L - 1 <= window:  # every key is within every query's window
        if causal and bias is None and dropout_p == 0.0:  # sdpa's own causal form (its fused kernels take it)
            ctx = F.scaled_dot_product_attention(q, k, v, scale=scale, is_causal=True,
                                                 enable_gqa=int(q.shape[-3]) != int(k.shape[-3]))
            return ctx if out is None else out.copy_(ctx.transpose(1, 2))
        mask = _score_mask(bias, None, L, L, q.dtype, q.device, causal=causal)
        ctx = _sdpa(q, k, v, None if mask is None else mask[None], dropout_p, scale)
        return ctx if out is None else out.copy_(ctx.transpose(1, 2))
    chunks = []
    for start in range(0, L, WINDOW_CHUNK):
        stop = min(start + WINDOW_CHUNK, L)
        k0, k1 = max(0, start - window), min(L, stop if causal else stop + window)
        mask = _score_mask(bias, window, stop - start, k1 - k0, q.dtype, q.device, start, k0, causal)
        ctx = _sdpa(q[:, :, start:stop], k[:, :, k0:k1], v[:, :, k0:k1], mask, dropout_p, scale)
        if out is None:
            chunks.append(ctx)
        else:
            out[:, start:stop].copy_(ctx.transpose(1, 2))
    return out if out is not None else torch.cat(chunks, dim=2)


class Extras(NamedTuple):
    """What one attention call adds to softmax(q k^T * scale + mask) v, besides the mask: every field None is BERT's
    attention. Built by the layer, once per forward where it can be (MPNet's table, ModernBERT's rotary tables per
    layer type), and passed as it is to the twin, the kernel and the custom op.

    bias: a float32 table [nh, 2L - 1] of an additive score bias that depends on (head, j - i) only
        (twins.relative_bias; MPNet's buckets), added after the scale and before the softmax
    window: w: query i sees only keys j with |i - j| <= w (positions within its sequence; ModernBERT's local layers)
    rotary: twins.Rotary, the per-token cos/sin that rotate q and k first (ModernBERT)
    disentangled: twins.Disentangled, DeBERTa's per-token c2p/p2c terms, added after the scale; padded rows then
        follow HF's mask rule mask_i * mask_j (a padded query attends uniformly to all S keys). Never combined with
        the three above.
    kv_heads: grouped-query attention over kv key/value heads (EuroBERT): qkv is [T, nh + 2 kv, hd] (q heads, k
        heads, v heads; kv divides nh) and query head h attends with key/value head h // (nh / kv); None: qkv is
        [T, 3, nh, hd]. A layout rather than a score term, carried here so that every backend, the custom op and
        "auto" see it with the rest of the call.
    causal: query i sees only keys j <= i (positions within its sequence; Qwen3's decoder layers); False: both
        ways. Padded rows: a query with no real key at or before it (left padding) gets HF eager's answer for a
        query whose every key is masked, uniform over the row's S keys.
    """
    bias: torch.Tensor | None = None
    window: int | None = None
    rotary: Rotary | None = None
    disentangled: Disentangled | None = None
    kv_heads: int | None = None
    causal: bool = False


NONE = Extras()


def twin(qkv: torch.Tensor, attn, scale: float, dropout_p: float = 0.0, return_probs: bool = False,
         extras: Extras = NONE, workspace: Workspace | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """qkv [T, 3, nh, hd] (grouped: [T, nh + 2 kv, hd]) -> (context [T, nh*hd], probs [B, nh, S, S] or None). `attn`
    is a TokenLayout (packed sequences, padding-free) or an AttentionMask (padded rows, T = B*S); `extras`: see Extras.
    `workspace`: see twins.Workspace (packed sequences only read it)."""
    bias, window, rotary, disentangled, kv_heads, causal = extras
    if disentangled is not None:
        _check_disentangled(disentangled, bias, window, rotary, causal)
    if isinstance(attn, TokenLayout):
        return attention_varlen_torch(qkv, attn, scale, dropout_p, bias, window, rotary, disentangled,
                                      workspace, kv_heads, causal), None
    return attention_padded_torch(qkv, attn, scale, dropout_p, return_probs, bias, window, rotary, disentangled,
                                  kv_heads, causal)


def attention_torch(qkv: torch.Tensor, attn, scale: float, dropout_p: float = 0.0, return_probs: bool = False,
                    bias: torch.Tensor | None = None, window: int | None = None, rotary: Rotary | None = None,
                    disentangled: Disentangled | None = None, workspace: Workspace | None = None,
                    kv_heads: int | None = None, causal: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`twin` with the extras as keywords (Extras' fields)."""
    return twin(qkv, attn, scale, dropout_p, return_probs,
                Extras(bias, window, rotary, disentangled, kv_heads, causal), workspace)


def attention_varlen_torch(qkv: torch.Tensor, layout: TokenLayout, scale: float, dropout_p: float = 0.0,
                           bias: torch.Tensor | None = None, window: int | None = None,
                           rotary: Rotary | None = None, disentangled: Disentangled | None = None,
                           workspace: Workspace | None = None, kv_heads: int | None = None,
                           causal: bool = False) -> torch.Tensor:
    """Packed sequences -> context [T, nh*hd]. Equal lengths run as one dense batch; otherwise one sdpa per sequence
    on its [1, nh, L, hd] view: on CPU faster than padding to the longest with a mask, and than the same loop on
    3-D [nh, L, hd] inputs (bench/RESULTS.md, "Measurements cited by the code"). A `bias` table becomes one
    sequence's [1, nh, L, L] attn_mask (shared by the dense batch), never one for the whole batch; a `window`, a band
    of keys per block of queries; `disentangled` terms: each sequence's own [1, nh, L, L] (they depend on its
    tokens). Grouped (`kv_heads`): k and v keep their kv heads, [.., kv, L, hd], which sdpa reads for each group
    (enable_gqa). `causal`: each query sees the keys at or before it in its sequence (sdpa's is_causal per sequence,
    or that band in the masks above)."""
    T, nh, kv, hd = heads(qkv, kv_heads)
    parts, gqa = _parts(nh, kv_heads), kv < nh
    # BERT's inference: sdpa as it is, no host work around it (a forward of short rows is Python-bound)
    plain = bias is None and window is None and dropout_p == 0.0 and disentangled is None
    if layout.uniform and disentangled is None:
        B, S = layout.batch_size, layout.seq_len
        q, k, v = split_heads(qkv, B, S, parts)  # q [B, nh, S, hd], k and v [B, kv, S, hd]: strided views
        if rotary is not None:
            q, k, v = rotated_qk(q, k, v, Rotary(rotary.cos.view(B, 1, S, -1), rotary.sin.view(B, 1, S, -1)))
        ctx = F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=gqa, is_causal=causal) if plain \
            else _sdpa_sequence(q, k, v, scale, dropout_p, bias, window, causal=causal)
        return ctx.transpose(1, 2).reshape(T, nh * hd)
    if layout.lengths is None:
        raise RuntimeError("the PyTorch attention twin needs the sequence lengths on the host; this layout has none "
                           "(a captured CUDA graph runs the Triton kernel)")
    if workspace is not None:
        return _attention_varlen_into(qkv, layout, scale, dropout_p, bias, window, rotary, workspace, kv_heads,
                                      causal)
    if plain and rotary is None and qkv.device.type == "cpu" and not torch.is_grad_enabled():
        return _attention_runs(qkv, layout.lengths, scale, kv_heads, causal)
    contexts, start = [], 0
    for piece in qkv.split(layout.lengths):  # views; under autograd one SplitBackward, not a zeroed [T, ...] each
        length = piece.shape[0]
        q, k, v = split_heads(piece, 1, length, parts)  # [1, nh, L, hd], k and v [1, kv, L, hd]
        q, k, v = rotated_qk(q, k, v, rotary, slice(start, start + length))
        if plain:
            ctx = F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=gqa, is_causal=causal)
        elif disentangled is not None:
            mask = disentangled_bias(disentangled, start, length).to(q.dtype)[None]  # [1, nh, L, L]
            ctx = _sdpa(q, k, v, mask, dropout_p, scale)
        else:
            ctx = _sdpa_sequence(q, k, v, scale, dropout_p, bias, window, causal=causal)
        contexts.append(ctx[0].transpose(0, 1))  # [L, nh, hd], a strided view
        start += length
    return torch.cat(contexts).view(T, nh * hd)  # cat reads the strided views: the one copy


def _attention_runs(qkv, lengths, scale: float, kv_heads: int | None, causal: bool) -> torch.Tensor:
    """attention_varlen_torch's plain inference on CPU: each run of equal lengths (encode sorts its texts by length,
    so a batch holds many) as one dense [n, nh, L, hd] sdpa, written into one [T, nh*hd] output. The same bits as one
    sdpa per sequence: sdpa's CPU kernel computes each (sequence, head) on its own, blocked by L alone (a test holds
    them equal); fewer calls (MiniLM's forward of 4,096 tokens: ~20% less attention time, measured)."""
    T, nh, kv, hd = heads(qkv, kv_heads)
    parts = _parts(nh, kv_heads)
    out, start = qkv.new_empty(T, nh, hd), 0
    for length, run in itertools.groupby(lengths):
        n = sum(1 for _ in run)
        if length == 0:
            continue
        rows = slice(start, start + n * length)
        q, k, v = split_heads(qkv[rows], n, length, parts)  # [n, nh, L, hd], k and v [n, kv, L, hd]
        ctx = F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=kv < nh, is_causal=causal)
        out[rows].view(n, length, nh, hd).copy_(ctx.transpose(1, 2))
        start += n * length
    return out.view(T, nh * hd)


def _attention_varlen_into(qkv, layout, scale, dropout_p, bias, window, rotary, workspace, kv_heads,
                           causal=False) -> torch.Tensor:
    """attention_varlen_torch's ragged case with q and k rotated for all tokens at once (float32) and every
    sequence's context written straight into one workspace buffer [T, nh*hd] (no per-sequence cat, no final cat)."""
    T, nh, kv, hd = heads(qkv, kv_heads)
    parts = _parts(nh, kv_heads)
    rotated = None
    if rotary is not None and qkv.dtype == torch.float32:
        rotated, rotary = _rotate_qk_into(qkv, rotary, workspace, kv_heads), None  # [T, 2, nh, hd] / [T, nh + kv, hd]
    ctx = workspace.take("context", (T, nh * hd), qkv)
    ctx_heads, start = ctx.view(T, nh, hd), 0
    for length in layout.lengths:
        rows = slice(start, start + length)
        q, k, v = split_heads(qkv[rows], 1, length, parts)  # [1, nh, L, hd], k and v [1, kv, L, hd]
        if rotated is not None:
            q, k = split_heads(rotated[rows], 1, length, None if parts is None else parts[:2])
        q, k, v = rotated_qk(q, k, v, rotary, rows)
        _sdpa_sequence(q, k, v, scale, dropout_p, bias, window, out=ctx_heads[rows].unsqueeze(0), causal=causal)
        start += length
    return ctx


def attention_padded_torch(qkv: torch.Tensor, mask: "AttentionMask", scale: float, dropout_p: float = 0.0,
                           return_probs: bool = False, bias: torch.Tensor | None = None, window: int | None = None,
                           rotary: Rotary | None = None, disentangled: Disentangled | None = None,
                           kv_heads: int | None = None,
                           causal: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Padded rows, qkv [B*S, 3, nh, hd] (grouped: [B*S, nh + 2 kv, hd]) -> (context [B*S, nh*hd], probs
    [B, nh, S, S] or None). A `bias` table and a `window` are read at the padded positions (as HF does: distances
    count padding); a fully padded row still attends uniformly to all S keys (HF eager's answer there). With
    `disentangled` (DeBERTa) HF's mask is mask_i * mask_j: every padded query attends uniformly to all S keys, in any
    row."""
    B, S = mask.batch_size, mask.seq_len
    T, nh, kv, hd = heads(qkv, kv_heads)
    q, k, v = split_heads(qkv, B, S, _parts(nh, kv_heads))  # q [B, nh, S, hd], k and v [B, kv, S, hd]: views
    if rotary is not None:
        q, k, v = rotated_qk(q, k, v, Rotary(rotary.cos.view(B, 1, S, -1), rotary.sin.view(B, 1, S, -1)))
    rel = None if bias is None else relative_bias(bias, S, S, qkv.dtype)[None]  # [1, nh, S, S]
    if disentangled is not None:
        rel = disentangled_bias_padded(disentangled, B, S).to(qkv.dtype)  # [B, nh, S, S]
    # HF's DeBERTa masks (i, j) unless both are real: every score of a padded query is finfo.min, so it attends
    # uniformly to all S keys
    pairwise = ~mask.key_valid[:, None, :, None] if (disentangled is not None or mask.pairwise) \
        and mask.key_valid is not None else None  # [B, 1, S, 1]
    if window is not None and S - 1 > window and not mask.custom:  # (a custom 3-D/4-D mask is the whole mask: HF
        # applies no window on top of one)
        # HF's one mask: finfo.min wherever the window or the padding excludes a key (once, not summed), so a padded
        # query whose window holds no real key attends uniformly to all S keys, as HF eager computes it
        low = torch.finfo(qkv.dtype).min
        band = window_mask(S, S, window, qkv.device)
        additive = torch.zeros((), dtype=qkv.dtype, device=qkv.device) if mask.additive is None else mask.additive
        mask = dataclasses.replace(mask, additive=torch.where(band, additive, low))
    if causal and not mask.custom:  # HF's causal mask: finfo.min on every key after the query (with the padding's:
        # a left-padded query, which sees no real key, attends uniformly to all S keys, as HF eager computes it)
        low = torch.finfo(qkv.dtype).min
        additive = torch.zeros((), dtype=qkv.dtype, device=qkv.device) if mask.additive is None else mask.additive
        mask = dataclasses.replace(mask, additive=torch.where(causal_mask(S, S, qkv.device), additive, low))
    if return_probs:  # HF's eager math, because the caller wants the probabilities themselves
        # grouped: HF's repeat_kv, for this call only, beside the [B, nh, S, S] probabilities formed anyway
        k, v = repeat_kv(k, nh // kv), repeat_kv(v, nh // kv)
        scores = torch.matmul(q, k.transpose(-1, -2)) * scale
        if rel is not None:
            scores = scores + rel
        if mask.additive is not None:
            scores = scores + mask.additive
        if pairwise is not None:  # HF's masked_fill of every score of a padded query: uniform, in the graph
            scores = scores.masked_fill(pairwise, torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores, dim=-1)
        if mask.empty_rows is not None:  # fully padded rows uniform (below), before the product reads them
            probs = torch.where(mask.empty_rows, torch.full_like(probs, 1.0 / S), probs)
        # HF returns the probabilities after dropout, the very tensor its context multiplies: so does this path,
        # and a gradient retained on them is the context's (train mode included)
        probs = dropout(probs, dropout_p)
        ctx = torch.matmul(probs, v)
    else:
        probs = None
        if rel is not None and rel.shape[0] == 1 and mask.additive is not None and mask.additive.shape[-2] == 1 \
                and not tracing():
            # key mask [B, 1, 1, S] + bias [1, nh, S, S]: one row at a time, so no [B, nh, S, S] sum is formed (a
            # traced graph keeps the batch dynamic instead: one broadcast sum)
            ctx = torch.cat([_sdpa(q[b:b + 1], k[b:b + 1], v[b:b + 1], rel + mask.additive[b:b + 1], dropout_p, scale)
                             for b in range(B)])
        else:
            attn_mask = mask.additive if rel is None else rel if mask.additive is None else rel + mask.additive
            ctx = _sdpa(q, k, v, attn_mask, dropout_p, scale)
    if mask.empty_rows is not None and probs is None:
        # Fully padded rows: HF eager's uniform attention over all S keys, stated outright. Adding finfo.min only
        # equalises the scores when it swamps them; sdpa adds fp16's -65504 in fp32, where it does not.
        ctx = torch.where(mask.empty_rows, _mean_value(v, nh).to(ctx.dtype), ctx)
    if pairwise is not None and probs is None:  # (the probabilities' path masked the scores themselves)
        ctx = torch.where(pairwise, _mean_value(v, nh).to(ctx.dtype), ctx)
    return ctx.transpose(1, 2).reshape(T, nh * hd), probs  # [B, S, nh, hd] -> [T, nh*hd]


def _mean_value(v: torch.Tensor, num_heads: int) -> torch.Tensor:
    """v [B, kv, S, hd] -> [B, nh, 1, hd]: the mean value of each row, for each query head (its group's)."""
    return repeat_kv(v.mean(dim=2, keepdim=True), num_heads // v.shape[1])


# ---- the kernel ----------------------------------------------------------------------------------------------------
_KERNEL = []  # [fastbert.kernels.attention] once imported (Triton is imported only where a kernel runs)


def kernels():
    if not _KERNEL:
        from ..kernels import attention as module
        _KERNEL.append(module)
    return _KERNEL[0]


def kernel(qkv, attn, scale, dropout_p=0.0, return_probs=False, extras: Extras = NONE, workspace=None,
           checked=False):
    """The kernel behind twin's signature (dropout and probabilities have been ruled out by `reason`). Packed
    sequences run over their cu_seqlens; padded rows over uniform cu_seqlens with the key mask, DeBERTa's padded
    queries (attn.pairwise) uniform over their row."""
    k = kernels()
    run = k.attention if checked else k.launch
    if isinstance(attn, TokenLayout):
        return run(qkv, attn.cu_seqlens, attn.max_seqlen, scale, **_launch_extras(extras)), None
    cu_seqlens = k.uniform_cu_seqlens(attn.batch_size, attn.seq_len, qkv.device)
    return run(qkv, cu_seqlens, attn.seq_len, scale, key_valid=attn.key_valid, **_launch_extras(extras),
               uniform_padded_queries=attn.pairwise), None


def _launch_extras(extras: Extras) -> dict:
    """Extras as the kernel's launcher takes them: DeBERTa's terms as plain tensors (the kernel is a leaf)."""
    bias, window, rotary, dis, kv_heads, causal = extras
    terms = {} if dis is None else dict(c2p=dis.c2p, p2c=dis.p2c, column=dis.column)
    return dict(bias=bias, window=window, rotary=rotary, kv_heads=kv_heads, causal=causal, **terms)


# ---- training on the kernels ---------------------------------------------------------------------------------------
# Qwen3's layers: the forward kernel takes causal=True, its backward (kernels/attention_backward.py) does not. The
# model's plan says so before any kernel runs (train_reason, from the model's attention Variant): "triton" raises
# with this reason, "auto" warns once and trains attention on its twin; the other ops train on their kernels.
CAUSAL_NO_BACKWARD = ("causal attention has no backward in the kernels yet (its forward kernel is inference only): "
                      "training a causal model runs attention on its twin (kernels='auto', or "
                      "set_kernels(attention='torch'))")
def train_unsupported(attn, dropout_p: float, return_probs: bool, extras: Extras) -> str | None:
    """Why `train_kernel` cannot serve this call (None when it can): what the kernels' backward does not build."""
    if return_probs:
        return "the probabilities were asked for (return_probs): the kernels never form them"
    if not 0.0 <= dropout_p < 1.0:
        return f"dropout_p={dropout_p} is outside [0, 1) (p = 1 drops everything: the twin serves it)"
    if extras.causal:
        return CAUSAL_NO_BACKWARD
    if extras.disentangled is not None:
        d = extras.disentangled
        if extras.bias is not None or extras.window is not None or extras.rotary is not None:
            return "DeBERTa's c2p/p2c terms combined with a bias table, a window or rotary (no family does)"
        if d.c2p is None and d.p2c is None:
            return "disentangled= without c2p or p2c"
    if isinstance(attn, AttentionMask):
        if attn.custom:
            return "a custom 3-D/4-D attention mask (only the twin applies those)"
        if extras.window is not None and attn.key_valid is not None:
            return ("a window over padded rows has no backward in the kernels yet (a padded query whose window holds "
                    "only padding is HF's uniform answer, written after the kernel); unpad the batch")
    elif not isinstance(attn, TokenLayout):
        return f"attn must be a TokenLayout or an AttentionMask, got {type(attn).__name__}"
    return None


class TrainKernel(torch.autograd.Function):
    """attention on the kernels with a backward: `train_forward` (the forward kernel, also storing each query's
    log-sum-exp, dropout drawn inside it from a Philox seed) and `attention_backward` (kernels/attention_backward.py:
    a dK/dV kernel and a dQ kernel recomputing the probabilities from q, k and the log-sum-exp). Call it through
    `train_kernel`. Gradients: qkv, the bias table and DeBERTa's c2p / p2c tables (fp32 atomics: the dQ kernel adds
    into the bias table and c2p, the dK/dV kernel into p2c; the order of those sums, so their last bits, vary from
    run to run; qkv's gradient has no atomics).

    Saved for the backward, per token (e = the dtype's bytes, H = nh * hd, G-grouped: qkv is (nh + 2 kv) * hd wide):
        qkv        3·H·e  (the QKV GEMM's output itself, not a copy; (nh + 2 kv)·hd·e grouped)
        out        H·e    (the returned context, which the output dense keeps anyway)
        lse        4·nh B (fp32 log-sum-exp per head)
    = 4·H·e + 4·nh bytes: 6,192 B at BERT-base in fp16 (H = 768, nh = 12). Besides: cu_seqlens (or the [B, S] key
    mask: 1 B per padded token), the model's own rotary tables (4·hd B per token, shared by the layers) and bias
    table, an 8-byte dropout seed. Nothing S-wide: no probabilities, no dropout mask, no rotated q/k.
    The twin's autograd (sdpa per sequence) saves, per token: q, k and v (views of qkv: 3·H·e), sdpa's output
    (H·e; the twin returns a [T, H] copy of it, which the output dense keeps), and, where a fused sdpa backend runs
    (CUDA flash/efficient, CPU flash), the same fp32 log-sum-exp: 4·H·e + 4·nh, as much as the kernels. It saves
    more where it forms S-wide tensors: a bias table becomes a [1, nh, S, S] mask per call (nh·S²·e; at B = 4,
    S = 128 another 768 B per token in fp16, growing with S / B), and dropout runs sdpa's math (or the written-out
    math on CPU), which keeps the probabilities, the scores and the dropout mask: measured 27,648 B per token at
    BERT-base, B = 4, S = 128 on CPU, against the kernels' 6,192 in fp16 (12,336 in fp32); its share grows with S.
    Rotary adds the rotated q and k copies (2·H·e: measured 9,520 B per token against the kernels' 6,448 with the
    tables, BERT-base fp16). None of these is stored by the kernels.
    (Measured with torch.autograd.graph.saved_tensors_hooks, unique storages: dense, padded and bias calls in fp16
    and fp32 save 4·H·e + 4·nh per token through the kernels, plus per-call bytes; the twin the same dense.)"""

    @staticmethod
    def forward(ctx, qkv, bias, c2p, p2c, column, cu_seqlens, max_seqlen, scale, key_valid, pairwise, window, rotary,
                kv_heads, dropout_p):
        k = kernels()
        seed = k.utils.dropout_seed(qkv.device) if dropout_p > 0 else None
        out, lse = k.train_forward(qkv, cu_seqlens, max_seqlen, scale, key_valid, bias=bias, window=window,
                                   rotary=rotary, kv_heads=kv_heads, dropout_p=dropout_p, seed=seed, c2p=c2p,
                                   p2c=p2c, column=column, uniform_padded_queries=pairwise)
        cos, sin = (None, None) if rotary is None else (rotary.cos, rotary.sin)
        ctx.save_for_backward(qkv, out, lse, cu_seqlens, key_valid, bias, cos, sin, seed, c2p, p2c, column)
        ctx.call = (max_seqlen, scale, pairwise, window, kv_heads, dropout_p)
        return out

    @staticmethod
    def backward(ctx, dout):
        qkv, out, lse, cu_seqlens, key_valid, bias, cos, sin, seed, c2p, p2c, column = ctx.saved_tensors
        max_seqlen, scale, pairwise, window, kv_heads, dropout_p = ctx.call
        dqkv, dbias, dc2p, dp2c = backward_kernels().attention_backward(
            dout, qkv, out, lse, cu_seqlens, max_seqlen, scale, key_valid, bias=bias, window=window,
            rotary=None if cos is None else (cos, sin), kv_heads=kv_heads, dropout_p=dropout_p, seed=seed, c2p=c2p,
            p2c=p2c, column=column, uniform_padded_queries=pairwise)
        needs = ctx.needs_input_grad

        def cast(grad, like, need):
            return grad.to(like.dtype) if need and grad is not None else None

        return (dqkv if needs[0] else None, cast(dbias, bias, needs[1]), cast(dc2p, c2p, needs[2]),
                cast(dp2c, p2c, needs[3])) + (None,) * 10


def train_kernel(qkv: torch.Tensor, attn, scale: float, dropout_p: float = 0.0, return_probs: bool = False,
                 extras: Extras = NONE, workspace: Workspace | None = None) -> tuple[torch.Tensor, None]:
    """`twin`'s contract on the kernels, with gradients for qkv, the bias table and DeBERTa's c2p / p2c (see
    TrainKernel for what it saves): (context [T, nh*hd], None). Dropout (p < 1) is drawn inside the kernels from a
    seed taken from torch's generator, so torch.manual_seed reproduces it (not the twin's mask: another generator).
    `workspace` is not read. Raises ValueError with `train_unsupported`'s reason for a call the kernels' backward
    does not serve."""
    why = train_unsupported(attn, dropout_p, return_probs, extras)
    if why is None:
        why = kernels().utils.call_unsupported(OP, qkv.dtype, heads(qkv, extras.kv_heads)[3])
    if why is not None:
        raise ValueError(f"{OP}: train_kernel cannot serve this call: {why}")
    if qkv.stride(-1) != 1:
        raise ValueError(f"{OP}: qkv's last dim must be unit-stride, got strides {tuple(qkv.stride())}")
    k = kernels()
    if isinstance(attn, TokenLayout):
        cu_seqlens, max_seqlen, key_valid = attn.cu_seqlens, attn.max_seqlen, None
    else:
        cu_seqlens = k.uniform_cu_seqlens(attn.batch_size, attn.seq_len, qkv.device)
        max_seqlen, key_valid = attn.seq_len, attn.key_valid
    dis = extras.disentangled
    c2p, p2c, column = (None, None, None) if dis is None else (dis.c2p, dis.p2c, dis.column)
    # DeBERTa's padded rows: HF's mask_i * mask_j (attn.pairwise, or any padded rows with its terms, as the twin)
    pairwise = key_valid is not None and (attn.pairwise or dis is not None)
    out = TrainKernel.apply(qkv, extras.bias, c2p, p2c, column, cu_seqlens, max_seqlen, scale, key_valid, pairwise,
                            extras.window, extras.rotary, extras.kv_heads, float(dropout_p))
    return out, None


_BACKWARD_KERNEL = []  # [fastbert.kernels.attention_backward] once imported


def backward_kernels():
    if not _BACKWARD_KERNEL:
        from ..kernels import attention_backward as module
        _BACKWARD_KERNEL.append(module)
    return _BACKWARD_KERNEL[0]


# ---- the custom op (a traced forward records one node) -------------------------------------------------------------
def _flat(extras: Extras) -> tuple:
    """Extras as the schema holds them: the window (-1: none), its tensors (None where absent), the key/value heads
    (-1: as many as the query heads). One optional tensor each, not a Tensor?[] (torch.jit.trace takes no list of
    optional tensors)."""
    bias, window, rotary, dis, kv_heads, causal = extras
    cos, sin = (None, None) if rotary is None else rotary
    c2p, p2c, column = (None, None, None) if dis is None else (dis.c2p, dis.p2c, dis.column)
    return (-1 if window is None else window, bias, cos, sin, c2p, p2c, column, -1 if kv_heads is None else kv_heads,
            bool(causal))


def _unflat(window: int, bias, cos, sin, c2p, p2c, column, kv_heads: int, causal: bool = False) -> Extras:
    return Extras(bias, None if window < 0 else window, None if cos is None else Rotary(cos, sin),
                  None if column is None else Disentangled(c2p, p2c, column), None if kv_heads < 0 else kv_heads,
                  causal)


@torch.library.custom_op("fastbert::attention", mutates_args=())
def custom_op(qkv: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, scale: float,
              key_valid: torch.Tensor | None, pairwise: bool, backend: str, window: int, bias: torch.Tensor | None,
              cos: torch.Tensor | None, sin: torch.Tensor | None, c2p: torch.Tensor | None,
              p2c: torch.Tensor | None, column: torch.Tensor | None, kv_heads: int = -1,
              causal: bool = False) -> torch.Tensor:
    """Packed qkv [T, 3, nh, hd] (grouped: [T, nh + 2 kv, hd]) -> [T, nh*hd]; key_valid [n, S] for padded rows (then
    every row has S tokens; pairwise: DeBERTa's mask_i * mask_j); window and the arguments after it: the Extras
    (`_flat`)."""
    extras = _unflat(window, bias, cos, sin, c2p, p2c, column, kv_heads, causal)

    def twin_call():
        if key_valid is None:
            lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()  # the twin loops over sequences on the host
            attn = TokenLayout.from_cu_seqlens(cu_seqlens, max_seqlen, lengths)
        else:
            B, S = key_valid.shape
            attn = AttentionMask.build(key_valid, B, S, qkv.dtype, flags=(False, False))
            if pairwise:
                attn = dataclasses.replace(attn, pairwise=True)
        return twin(qkv, attn, scale, extras=extras)[0]

    def kernel_call():
        return kernels().launch(qkv, cu_seqlens, max_seqlen, scale, key_valid=key_valid, **_launch_extras(extras),
                                uniform_padded_queries=pairwise)

    return run_backend(OP, backend, qkv, kernel_call, twin_call)


@custom_op.register_fake
def _(qkv, cu_seqlens, max_seqlen, scale, key_valid, pairwise, backend, window, bias, cos, sin, c2p, p2c, column,
      kv_heads=-1, causal=False):
    _, nh, _, hd = heads(qkv, None if kv_heads < 0 else kv_heads)
    return qkv.new_empty(qkv.shape[0], nh * hd)


def traced(backend: str):
    """twin's signature, recording one fastbert::attention node (padded rows: uniform cu_seqlens and the key mask)."""
    def run(qkv, attn, scale, dropout_p=0.0, return_probs=False, extras: Extras = NONE, workspace=None):
        if isinstance(attn, TokenLayout):
            cu_seqlens, max_seqlen, key_valid, pairwise = attn.cu_seqlens, attn.max_seqlen, None, False
        else:  # padded rows (what a traced forward runs)
            B, S = attn.batch_size, attn.seq_len
            cu_seqlens = torch.arange(0, (B + 1) * S, S, dtype=torch.int32, device=qkv.device)
            max_seqlen, key_valid, pairwise = S, attn.key_valid, attn.pairwise
            if key_valid is None:
                key_valid = torch.ones(B, S, dtype=torch.bool, device=qkv.device)
        return torch.ops.fastbert.attention(qkv, cu_seqlens, max_seqlen, scale, key_valid, pairwise, backend,
                                            *_flat(extras)), None
    return run


# ---- when the kernel serves a call, and what "auto" times ----------------------------------------------------------
def reason(situation, facts) -> str | None:
    """The probabilities or a custom mask (situation.padded) leave attention on its twin, and what every op shares."""
    return situation.padded or kernel_reason(OP, situation, facts, train_reason, situation.head_dim)


def train_reason(situation) -> str | None:
    """Why train_kernel cannot serve a training forward's situation (what `train_unsupported` says of a call that
    the situation already shows); a window over padded rows comes as situation.padded (the model's forward)."""
    if situation.attention_dropout >= 1.0:
        return f"the attention dropout is {situation.attention_dropout} (p = 1 drops everything: the twin serves it)"
    if any(isinstance(v, Variant) and v.causal for v in situation.variants):
        return CAUSAL_NO_BACKWARD
    return None


class Variant(NamedTuple):
    """What attention's speed depends on beyond the shapes every op shares (measure.Shapes.attention)."""
    bias_reach: int = 0  # a per-distance bias table [nh, 2R - 1] of this reach R, or 0 for none
    window: int | None = None  # a sliding window of +-w keys, or None
    rotary: bool = False  # q and k rotated by per-token cos/sin tables
    disentangled: int = 0  # c2p and p2c terms over P columns, or 0 for none
    group: int = 1  # query heads per key/value head (grouped-query attention), 1 for none
    causal: bool = False  # each query sees the keys at or before it only


def key(dtype: torch.dtype, shapes) -> str:
    dt = str(dtype).replace("torch.", "")
    # the twin is one sdpa on a dense batch, a host loop on a ragged one
    layout = "ragged" if shapes.ragged else "dense"
    key = f"{OP}|{dt}|T{shapes.tokens}|nh{shapes.heads}|hd{shapes.head_dim}|S{shapes.max_seqlen}|{layout}"
    v = shapes.attention
    # a bias table: the kernel gathers it into every score tile, the twin forms a [1, nh, L, L] mask per sequence
    key += f"|bias{v.bias_reach}" if v.bias_reach else ""
    # a window: the kernel skips the key blocks outside it, the twin runs a band of keys per chunk of queries;
    # rotary: both rotate q and k first (the kernel once per visited key block)
    key += f"|window{v.window}" if v.window is not None else ""
    # DeBERTa: the kernel gathers two per-token tables into every score tile, the twin forms each sequence's bias
    key += f"|dis{v.disentangled}" if v.disentangled else ""
    # grouped key/value heads: the kernel reads each one for its group, the twin hands sdpa the groups (enable_gqa)
    key += f"|gqa{v.group}" if v.group > 1 else ""
    # causal: the kernel visits the key blocks up to the diagonal only (about half), the twin runs sdpa's causal form
    key += "|causal" if v.causal else ""
    return key + ("|rotary" if v.rotary else "")


def contenders(dtype, shapes, device, kernel, twin):
    rand, g = random_inputs(device, dtype)
    layout = measured_layout(shapes.tokens, shapes.max_seqlen, shapes.ragged, device)
    v = shapes.attention
    kv_heads = shapes.heads // v.group if v.group > 1 else None
    qkv = rand(layout.num_tokens, 3, shapes.heads, shapes.head_dim) if kv_heads is None else \
        rand(layout.num_tokens, shapes.heads + 2 * kv_heads, shapes.head_dim)  # the grouped GEMM's output
    bias = rand(shapes.heads, 2 * v.bias_reach - 1).float() if v.bias_reach else None
    rotary = None
    if v.rotary:  # the tables of each token's position in its sequence, as the model builds them
        positions = torch.cat([torch.arange(n, device=device) for n in layout.lengths])
        half = torch.arange(0, shapes.head_dim, 2, device=device).float() / shapes.head_dim
        rotary = rotary_tables(positions, 1.0 / (10000.0 ** half))
    dis = None
    if v.disentangled:  # both terms (DeBERTa-v3's form), columns over the table as the log buckets spread
        P, L = v.disentangled, shapes.max_seqlen
        column = torch.randint(0, P, (2 * L - 1,), generator=g, device=device, dtype=torch.int32)
        dis = Disentangled(rand(layout.num_tokens, shapes.heads, P).float(),
                           rand(layout.num_tokens, shapes.heads, P).float(), column)
    args = (qkv, layout, shapes.head_dim ** -0.5, 0.0, False,
            Extras(bias, v.window, rotary, dis, kv_heads, v.causal))
    return (lambda: kernel(*args)), (lambda: twin(*args))


def measured_layout(tokens: int, max_seqlen: int, ragged: bool, device) -> TokenLayout:
    """The layout attention is timed on: `tokens` tokens in sequences of at most `max_seqlen`. Dense: equal rows.
    Ragged: lengths spread evenly over [max_seqlen / 8, max_seqlen], as a real batch of mixed texts, so that the
    twin is timed with the per-sequence loop it runs on such a batch."""
    L = max(1, min(max_seqlen, tokens))
    if not ragged:
        return TokenLayout.dense(max(1, tokens // L), L, device)
    if L == tokens > 1:  # one sequence would fill the bucket: a ragged batch has at least two lengths
        L = max(1, 2 * tokens // 3)
    spread = [max(1, L - (i * (L - L // 8)) // 7) for i in range(8)]  # L down to ~L/8 in 8 steps
    lengths, total = [], 0
    while total < tokens:
        length = min(spread[len(lengths) % len(spread)], tokens - total)
        lengths.append(length)
        total += length
    cu = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0).to(device=device, dtype=torch.int32)
    return TokenLayout.from_cu_seqlens(cu, max(lengths), lengths)
