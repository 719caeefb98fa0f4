"""The PyTorch twins of the four fused ops: the definitions the Triton kernels are tested against, and the path
for CPU, autograd and anything a kernel cannot serve.

Every op works on token-major 2-D matrices [T, features] (T = real tokens, packed).

    op                  twin (the contract)                                   Triton kernel fuses
    qkv_projection      x @ W_qkv^T + b_qkv viewed [T, 3, nh, hd]            one GEMM, bias in the epilogue
    attention           softmax(q k^T * scale + bias + mask) v -> [T, nh*hd] flash attention, online softmax
    bias_gelu           act(x @ W^T + b)                                      GEMM with bias+activation epilogue
    residual_layernorm  LN(y @ W^T + b + residual)                            bias+residual+LN in one pass per row

The ops grow parameters along the families' axes (fastbert/families.py), each a keyword that defaults to the
BERT form: attention takes `bias=` (a per-distance table), `window=` (keys within +-w positions only) and `rotary=`
(q and k rotated by per-token cos/sin) and `disentangled=` (DeBERTa's c2p/p2c terms, `Disentangled`); bias_gelu
takes `gated=` (act(a) * g over W's two halves); residual_layernorm takes `pre_norm=` (it returns the new residual
stream and its LayerNorm).
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .layout import TokenLayout
from .mask import AttentionMask, tracing

# hidden_act -> the activation name the kernels understand. HF's "gelu" is the exact erf GELU; "gelu_new" and
# "gelu_pytorch_tanh" are the same tanh approximation computed two ways.
ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}


def dropout(x: torch.Tensor, p: float) -> torch.Tensor:
    """Train-mode dropout with F.dropout's semantics: each element kept with probability 1 - p and scaled by
    1 / (1 - p), the same mask in backward, drawn from torch's default generator (torch.manual_seed fixes it); p = 0
    returns x itself. On CPU in float32 the mask comes from torch.rand_like, measured faster there than F.dropout's
    bernoulli_ (bench/RESULTS.md, "train-mode dropout"); elsewhere (CUDA, other dtypes: not measured) F.dropout."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got p={p!r}")
    if p == 0.0:
        return x
    if p == 1.0 or x.device.type != "cpu" or x.dtype != torch.float32:
        return F.dropout(x, p)
    # F.dropout's CPU math (x * noise, autograd saves only the noise) with uniform draws instead of bernoulli_
    noise = torch.rand_like(x).ge_(p).mul_(1.0 / (1.0 - p))
    return x * noise


class Workspace:
    """Buffers one inference forward on CPU reuses from layer to layer, by name: glibc returns every allocation over
    32 MB to the OS when it is freed, so a fresh [T, 3H] GEMM output page-faults in again in every layer (4.4 M minor
    faults a ModernBERT-base forward of 17,942 tokens: bench/RESULTS.md). Only for calls that neither autograd nor a
    trace records; a name's buffer is overwritten by the next layer, so nothing in one may outlive its layer."""

    def __init__(self):
        self._buffers: dict[str, torch.Tensor] = {}

    def take(self, name: str, shape: tuple, like: torch.Tensor) -> torch.Tensor:
        """The buffer `name` of `shape` with `like`'s dtype and device (allocated when its shape or dtype changes)."""
        buf = self._buffers.get(name)
        if buf is None or buf.shape != shape or buf.dtype != like.dtype or buf.device != like.device:
            buf = self._buffers[name] = torch.empty(shape, dtype=like.dtype, device=like.device)
        return buf


def _linear_into(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, workspace: Workspace,
                 name: str) -> torch.Tensor:
    """F.linear(x [T, K], W [N, K], b) into the workspace's buffer `name` (the same GEMM F.linear calls: addmm with a
    bias, mm without). The twins call F.linear themselves when there is no workspace: a call frame here would be
    host work on every op of every layer."""
    out = workspace.take(name, (x.shape[0], weight.shape[0]), x)
    return torch.mm(x, weight.t(), out=out) if bias is None else torch.addmm(bias, x, weight.t(), out=out)


def qkv_projection_torch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         num_heads: int, workspace: Workspace | None = None) -> torch.Tensor:
    """x [T, H] @ W_qkv[3*nh*hd, H]^T + b -> [T, 3, nh, hd] (a view of the GEMM output, no copy)."""
    h = F.linear(x, weight, bias) if workspace is None else _linear_into(x, weight, bias, workspace, "qkv")
    return h.view(x.shape[0], 3, num_heads, weight.shape[0] // (3 * num_heads))


class Rotary(NamedTuple):
    """Rotary position embeddings for one attention call: cos and sin of position * inv_freq, float32 [T, hd/2], one
    row per token in the attention's token order (packed T, or B*S padded). q and k are rotated in float32 by
    rotate-half (HF's apply_rotary_pos_emb: the frequencies repeat over both halves of a head) and rounded back to
    their dtype before the product, as HF does."""
    cos: torch.Tensor
    sin: torch.Tensor


def rotary_tables(positions: torch.Tensor, inv_freq: torch.Tensor) -> Rotary:
    """positions [T] (int) and inv_freq [hd/2] (float32) -> Rotary. The product is HF's (position as float32 times
    inv_freq), so every angle, and its cos and sin, is bit-identical to transformers'."""
    freqs = positions.float()[:, None] * inv_freq.float()[None, :]
    return Rotary(freqs.cos(), freqs.sin())


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., L, hd] rotated by cos/sin [L, hd/2] (broadcast over the leading dims), in float32, back in x's dtype:
    HF's q * cos + rotate_half(q) * sin with cos = cat(c, c)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def _rotate_qk_into(qkv: torch.Tensor, rotary: Rotary, workspace: Workspace) -> torch.Tensor:
    """q and k of every token of qkv [T, 3, nh, hd] (float32) rotated at once into a workspace buffer [T, 2, nh, hd]:
    `rotate`'s arithmetic, each half written in place (no cat)."""
    T, _, nh, hd = qkv.shape
    half = hd // 2
    qk = qkv[:, :2]
    out = workspace.take("rotated_qk", (T, 2, nh, hd), qkv)
    tmp = workspace.take("rotary_product", (T, 2, nh, half), qkv)
    cos, sin = rotary.cos[:, None, None, :], rotary.sin[:, None, None, :]
    x1, x2, o1, o2 = qk[..., :half], qk[..., half:], out[..., :half], out[..., half:]
    torch.mul(x1, cos, out=o1).sub_(torch.mul(x2, sin, out=tmp))  # x1 * cos - x2 * sin
    torch.mul(x2, cos, out=o2).add_(torch.mul(x1, sin, out=tmp))  # x2 * cos + x1 * sin
    return out


def _rotated(q, k, v, rotary: Rotary | None, rows: slice | None = None):
    """q, k [.., nh, L, hd] rotated by the rows `rows` of the per-token tables (all of them when None)."""
    if rotary is None:
        return q, k, v
    cos, sin = (rotary.cos, rotary.sin) if rows is None else (rotary.cos[rows], rotary.sin[rows])
    return rotate(q, cos, sin), rotate(k, cos, sin), v


def window_mask(num_queries: int, num_keys: int, window: int, device, query_start: int = 0,
                key_start: int = 0) -> torch.Tensor:
    """bool [num_queries, num_keys]: True where |i - j| <= window, i = query_start + row, j = key_start + column
    (HF's bidirectional sliding window: inclusive)."""
    i = torch.arange(query_start, query_start + num_queries, device=device)
    j = torch.arange(key_start, key_start + num_keys, device=device)
    return (j[None, :] - i[:, None]).abs() <= window


def relative_bias(table: torch.Tensor, num_queries: int, num_keys: int, dtype: torch.dtype, query_start: int = 0,
                  key_start: int = 0) -> torch.Tensor:
    """The scores bias of one sequence, [nh, num_queries, num_keys] in `dtype`, from a per-distance table:
    B[h, i, j] = table[h, (j - i) + L - 1] for a table [nh, 2L - 1], i = query_start + row, j = key_start + column.
    Distances beyond +-(L - 1) read the table's end columns (T5/MPNet buckets are constant from some distance on: a
    table reaching it is exact at every distance)."""
    reach = (table.shape[1] - 1) // 2
    keys = torch.arange(key_start, key_start + num_keys, device=table.device)
    queries = torch.arange(query_start, query_start + num_queries, device=table.device)
    distance = keys[None, :] - queries[:, None]  # [num_queries, num_keys]: j - i
    return table[:, (distance + reach).clamp_(0, 2 * reach)].to(dtype)


@dataclasses.dataclass(frozen=True)
class Disentangled:
    """DeBERTa-v2's position terms of one attention call, per token, never per (i, j) pair:
        score(i, j) = (q_i . k_j) * scale + c2p[tok(i), h, col] + p2c[tok(j), h, col],  col = column[j - i + L - 1]
    c2p: [T, nh, P] per query token, q_t . pk[h, p] / sqrt(d * sf) (None: no c2p term); p2c: [T, nh, P] per key token,
    k_t . pq[h, p] / sqrt(d * sf) (None: no p2c term); any float dtype, unit stride along P, any strides on T and nh.
    column: int32 [2L - 1], the rel_embeddings row (P = 2 * span of them) each distance j - i reads; |j - i| > L - 1
    reads the end entries (fastbert.relative.deberta_column_table). tok(i): the row of qkv holding query i. The terms
    are added in float32 before the softmax; at least one of c2p / p2c is given."""
    c2p: torch.Tensor | None
    p2c: torch.Tensor | None
    column: torch.Tensor


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


def _check_disentangled(d: Disentangled, bias, window, rotary) -> None:
    if bias is not None or window is not None or rotary is not None:
        given = [name for name, v in (("bias", bias), ("window", window), ("rotary", rotary)) if v is not None]
        raise ValueError(f"attention: disentangled= is never combined with {', '.join(given)} (DeBERTa has none)")
    if d.c2p is None and d.p2c is None:
        raise ValueError("attention: disentangled= needs at least one of c2p and p2c (pass disentangled=None)")


# Query rows per sdpa call of a windowed sequence: each call sees its rows' keys +-window, so a local layer costs
# ~L * (WINDOW_CHUNK + 2w) scores, not L^2. 64 rows: at w = 64 (ModernBERT) 17.4 ms a 1,719-token sequence and 12
# heads of 64, against 18.0 ms at 128 rows and 23.3 ms at 256 (CPU, 2 threads; full attention there: 62.6 ms).
WINDOW_CHUNK = 64


def _score_mask(bias, window, num_queries, num_keys, dtype, device, query_start=0, key_start=0):
    """What sdpa adds to one sequence's scores: the bias [nh, nq, nk] (float), the window [nq, nk] (bool), both
    (-inf outside the window), or None."""
    rel = None if bias is None else relative_bias(bias, num_queries, num_keys, dtype, query_start, key_start)
    if window is None:
        return rel
    allowed = window_mask(num_queries, num_keys, window, device, query_start, key_start)
    return allowed if rel is None else rel.masked_fill(~allowed, float("-inf"))


def _sdpa(q, k, v, attn_mask, dropout_p: float, scale: float) -> torch.Tensor:
    """F.scaled_dot_product_attention, but with dropout on CPU in float32 the math written out: sdpa's CPU kernel
    takes no dropout, so sdpa falls back to this same math with F.dropout's bernoulli_ mask, and `dropout`'s draws are
    cheaper. A bool attn_mask is True where a key is seen; the twins' masks leave every query at least one key."""
    if dropout_p == 0.0 or q.device.type != "cpu" or q.dtype != torch.float32:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, scale=scale)
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)  # [.., nq, nk], fresh: in place is safe for autograd
    if attn_mask is not None:
        scores = scores.masked_fill_(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool \
            else scores.add_(attn_mask)
    return torch.matmul(dropout(torch.softmax(scores, dim=-1), dropout_p), v)


def _sdpa_sequence(q, k, v, scale, dropout_p, bias, window, out: torch.Tensor | None = None):
    """q, k, v [b, nh, L, hd] of b sequences of one length L -> [b, nh, L, hd]. A window narrower than the sequence
    runs WINDOW_CHUNK query rows at a time against only the keys their window reaches. `out`: a [b, L, nh, hd] view
    to write the context into instead (no autograd: copies into it), returned."""
    L = q.shape[2]
    if window is None or L - 1 <= window:  # every key is within every query's window
        mask = _score_mask(bias, None, L, L, q.dtype, q.device)
        ctx = _sdpa(q, k, v, None if mask is None else mask[None], dropout_p, scale)
        return ctx if out is None else out.copy_(ctx.transpose(1, 2))
    chunks = []
    for start in range(0, L, WINDOW_CHUNK):
        stop = min(start + WINDOW_CHUNK, L)
        k0, k1 = max(0, start - window), min(L, stop + window)
        mask = _score_mask(bias, window, stop - start, k1 - k0, q.dtype, q.device, start, k0)
        ctx = _sdpa(q[:, :, start:stop], k[:, :, k0:k1], v[:, :, k0:k1], mask, dropout_p, scale)
        if out is None:
            chunks.append(ctx)
        else:
            out[:, start:stop].copy_(ctx.transpose(1, 2))
    return out if out is not None else torch.cat(chunks, dim=2)


def attention_torch(qkv: torch.Tensor, attn, scale: float, dropout_p: float = 0.0, return_probs: bool = False,
                    bias: torch.Tensor | None = None, window: int | None = None,
                    rotary: Rotary | None = None,
                    disentangled: Disentangled | None = None,
                    workspace: Workspace | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """qkv [T, 3, nh, hd] -> (context [T, nh*hd], probs [B, nh, S, S] or None). `attn` is a TokenLayout (packed
    sequences, padding-free) or an AttentionMask (padded rows, T = B*S). `bias`: None, or a float32 table
    [nh, 2L - 1] of an additive score bias that depends on (head, j - i) only (see `relative_bias`), added after the
    scale and before the softmax. `window`: None, or w: query i sees only keys j with |i - j| <= w (positions within
    its sequence). `rotary`: None, or the per-token cos/sin that rotate q and k first (`Rotary`). `disentangled`: None,
    or DeBERTa's per-token c2p/p2c terms (`Disentangled`), added after the scale; with padded rows HF's mask rule then
    holds: a padded query attends uniformly to all S keys. `workspace`: see Workspace (packed sequences only read
    it)."""
    if disentangled is not None:
        _check_disentangled(disentangled, bias, window, rotary)
    if isinstance(attn, TokenLayout):
        return attention_varlen_torch(qkv, attn, scale, dropout_p, bias, window, rotary, disentangled,
                                      workspace), None
    return attention_padded_torch(qkv, attn, scale, dropout_p, return_probs, bias, window, rotary, disentangled)


def attention_varlen_torch(qkv: torch.Tensor, layout: TokenLayout, scale: float, dropout_p: float = 0.0,
                           bias: torch.Tensor | None = None, window: int | None = None,
                           rotary: Rotary | None = None, disentangled: Disentangled | None = None,
                           workspace: Workspace | None = None) -> torch.Tensor:
    """Packed sequences -> context [T, nh*hd]. Equal lengths run as one dense batch; otherwise one sdpa per sequence
    on its [1, nh, L, hd] view: on CPU faster than padding to the longest with a mask, and than the same loop on
    3-D [nh, L, hd] inputs (bench/RESULTS.md, "Measurements cited by the code"). A `bias` table becomes one
    sequence's [1, nh, L, L] attn_mask (shared by the dense batch), never one for the whole batch; a `window`, a band
    of keys per block of queries; `disentangled` terms: each sequence's own [1, nh, L, L] (they depend on its
    tokens)."""
    T, _, nh, hd = qkv.shape
    # BERT's inference: sdpa as it is, no host work around it (a forward of short rows is Python-bound)
    plain = bias is None and window is None and dropout_p == 0.0 and disentangled is None
    if layout.uniform and disentangled is None:
        B, S = layout.batch_size, layout.seq_len
        q, k, v = qkv.view(B, S, 3, nh, hd).permute(2, 0, 3, 1, 4).unbind(0)  # each [B, nh, S, hd], strided views
        if rotary is not None:
            q, k, v = _rotated(q, k, v, Rotary(rotary.cos.view(B, 1, S, -1), rotary.sin.view(B, 1, S, -1)))
        ctx = F.scaled_dot_product_attention(q, k, v, scale=scale) if plain else \
            _sdpa_sequence(q, k, v, scale, dropout_p, bias, window)
        return ctx.transpose(1, 2).reshape(T, nh * hd)
    if layout.lengths is None:
        raise RuntimeError("the PyTorch attention twin needs the sequence lengths on the host; this layout has none "
                           "(a captured CUDA graph runs the Triton kernel)")
    if workspace is not None:
        return _attention_varlen_into(qkv, layout, scale, dropout_p, bias, window, rotary, workspace)
    contexts, start = [], 0
    for piece in qkv.split(layout.lengths):  # views; under autograd one SplitBackward, not a zeroed [T, ...] each
        length = piece.shape[0]
        q, k, v = piece.unsqueeze(0).permute(2, 0, 3, 1, 4).unbind(0)  # [1, nh, L, hd]
        q, k, v = _rotated(q, k, v, rotary, slice(start, start + length))
        if plain:
            ctx = F.scaled_dot_product_attention(q, k, v, scale=scale)
        elif disentangled is not None:
            mask = disentangled_bias(disentangled, start, length).to(q.dtype)[None]  # [1, nh, L, L]
            ctx = _sdpa(q, k, v, mask, dropout_p, scale)
        else:
            ctx = _sdpa_sequence(q, k, v, scale, dropout_p, bias, window)
        contexts.append(ctx[0].transpose(0, 1))  # [L, nh, hd], a strided view
        start += length
    return torch.cat(contexts).view(T, nh * hd)  # cat reads the strided views: the one copy


def _attention_varlen_into(qkv, layout, scale, dropout_p, bias, window, rotary, workspace) -> torch.Tensor:
    """attention_varlen_torch's ragged case with q and k rotated for all tokens at once (float32) and every
    sequence's context written straight into one workspace buffer [T, nh*hd] (no per-sequence cat, no final cat)."""
    T, _, nh, hd = qkv.shape
    rotated = None
    if rotary is not None and qkv.dtype == torch.float32:
        rotated, rotary = _rotate_qk_into(qkv, rotary, workspace), None  # [T, 2, nh, hd]
    ctx = workspace.take("context", (T, nh * hd), qkv)
    ctx_heads, start = ctx.view(T, nh, hd), 0
    for length in layout.lengths:
        rows = slice(start, start + length)
        q, k, v = qkv[rows].unsqueeze(0).permute(2, 0, 3, 1, 4).unbind(0)  # [1, nh, L, hd]
        if rotated is not None:
            q, k = rotated[rows].unsqueeze(0).permute(2, 0, 3, 1, 4).unbind(0)
        q, k, v = _rotated(q, k, v, rotary, rows)
        _sdpa_sequence(q, k, v, scale, dropout_p, bias, window, out=ctx_heads[rows].unsqueeze(0))
        start += length
    return ctx


def attention_padded_torch(qkv: torch.Tensor, mask: "AttentionMask", scale: float, dropout_p: float = 0.0,
                           return_probs: bool = False, bias: torch.Tensor | None = None, window: int | None = None,
                           rotary: Rotary | None = None,
                           disentangled: Disentangled | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Padded rows, qkv [B*S, 3, nh, hd] -> (context [B*S, nh*hd], probs [B, nh, S, S] or None). A `bias` table and a
    `window` are read at the padded positions (as HF does: distances count padding); a fully padded row still
    attends uniformly to all S keys (HF eager's answer there). With `disentangled` (DeBERTa) HF's mask is
    mask_i * mask_j: every padded query attends uniformly to all S keys, in any row."""
    B, S = mask.batch_size, mask.seq_len
    T, _, nh, hd = qkv.shape
    q, k, v = qkv.view(B, S, 3, nh, hd).permute(2, 0, 3, 1, 4).unbind(0)  # each [B, nh, S, hd], strided views
    if rotary is not None:
        q, k, v = _rotated(q, k, v, Rotary(rotary.cos.view(B, 1, S, -1), rotary.sin.view(B, 1, S, -1)))
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
    if return_probs:  # HF's eager math, because the caller wants the probabilities themselves
        scores = torch.matmul(q, k.transpose(-1, -2)) * scale
        if rel is not None:
            scores = scores + rel
        if mask.additive is not None:
            scores = scores + mask.additive
        if pairwise is not None:  # HF's masked_fill of every score of a padded query: uniform, in the graph
            scores = scores.masked_fill(pairwise, torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores, dim=-1)
        ctx = torch.matmul(dropout(probs, dropout_p), v)
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
    if mask.empty_rows is not None:
        # Fully padded rows: HF eager's uniform attention over all S keys, stated outright. Adding finfo.min only
        # equalises the scores when it swamps them; sdpa adds fp16's -65504 in fp32, where it does not.
        ctx = torch.where(mask.empty_rows, v.mean(dim=2, keepdim=True).to(ctx.dtype), ctx)
        if probs is not None:
            probs = torch.where(mask.empty_rows, torch.full_like(probs, 1.0 / S), probs)
    if pairwise is not None and probs is None:  # (the probabilities' path masked the scores themselves)
        ctx = torch.where(pairwise, v.mean(dim=2, keepdim=True).to(ctx.dtype), ctx)
    return ctx.transpose(1, 2).reshape(T, nh * hd), probs  # [B, S, nh, hd] -> [T, nh*hd]


def _activation_torch(h: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "gelu":
        return F.gelu(h)
    if activation == "gelu_tanh":
        return F.gelu(h, approximate="tanh")
    if activation == "relu":
        return F.relu(h)
    raise ValueError(f"activation={activation!r} is not one of {sorted(set(ACTIVATIONS.values()))}")


def _activation_into(a: torch.Tensor, activation: str, out: torch.Tensor) -> torch.Tensor:
    """_activation_torch(a) written into `out` (the same kernels: gelu's out= variant, not gelu_, which rounds
    differently)."""
    if activation == "gelu":
        return torch._C._nn.gelu(a, out=out)
    if activation == "gelu_tanh":
        return torch._C._nn.gelu(a, approximate="tanh", out=out)
    if activation == "relu":
        return torch.clamp_min(a, 0, out=out)
    raise ValueError(f"activation={activation!r} is not one of {sorted(set(ACTIVATIONS.values()))}")


def bias_gelu_torch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str = "gelu",
                    gated: bool = False, workspace: Workspace | None = None) -> torch.Tensor:
    """x [T, H] -> act(x @ W[I, H]^T + b) [T, I]; activation in {"gelu" (erf), "gelu_tanh", "relu"}. gated: W is
    [2I, H] (HF's Wi: the input half, then the gate half) and the result act(a) * g [T, I] for [a, g] = x @ W^T + b
    (GeGLU). `workspace`: see Workspace."""
    h = F.linear(x, weight, bias) if workspace is None else _linear_into(x, weight, bias, workspace, "ffn")
    if gated and workspace is not None:
        a, g = h.chunk(2, dim=-1)
        out = workspace.take("gated", a.shape, a)
        return _activation_into(a, activation, out).mul_(g)
    if gated:
        a, g = h.chunk(2, dim=-1)
        return _activation_torch(a, activation) * g
    return _activation_torch(h, activation)


def residual_layernorm_torch(y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor,
                             ln_weight: torch.Tensor, ln_bias: torch.Tensor | None, eps: float,
                             dropout_p: float = 0.0, pre_norm: bool = False, workspace: Workspace | None = None):
    """LayerNorm(dropout(y [T, K] @ W[H, K]^T + b) + residual [T, H]) -> [T, H] (post-norm: the new residual stream
    is the LayerNorm). pre_norm: (s, LayerNorm(s)) for s = dropout(y @ W^T + b) + residual, the new residual stream
    and the next sublayer's input. ln_bias None: a LayerNorm without bias. `workspace`: see Workspace (s is then its
    buffer: the layer must not return it)."""
    h = F.linear(y, weight, bias) if workspace is None else _linear_into(y, weight, bias, workspace, "stream")
    if dropout_p > 0:
        h = dropout(h, dropout_p)
    h += residual  # in place: h is a fresh tensor that autograd does not save, so this only saves an allocation
    normed = torch.layer_norm(h, (h.shape[-1],), ln_weight, ln_bias, eps)  # skips F.layer_norm's Python wrapper
    return (h, normed) if pre_norm else normed


def default_scale(head_dim: int) -> float:
    return head_dim ** -0.5  # written as HF writes it, so the float is bit-identical
