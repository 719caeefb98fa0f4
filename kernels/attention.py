"""Flash attention (forward) over BERT's packed qkv, one launch for a whole batch of sequences of any lengths.

    out[t] = softmax(q[t] k[seq]^T * scale + B) v[seq]    for every token t of sequence seq     -> [T, nh*hd]

Why it pays. HF's eager BERT attention, per layer, for B sequences padded to S tokens, nh heads of hd (H = nh*hd),
2-byte dtype: the matmul on transposed q/k views writes the scores [B, nh, S, S]; the scaling, the mask add and the
softmax each read and rewrite them; probs @ v reads them once more; the context is transposed back into a [T, H]
copy. At B=32, S=512, BERT-base the score tensor is 32*12*512*512*2 B = 200 MB and makes ~8 passes, ~1.6 GB of
traffic, for work a fused kernel does reading qkv once (T*3H*2 B = 75 MB) and writing the context once (25 MB).
Flash attention keeps a [BLOCK_M, BLOCK_N] tile of scores in registers, folds the softmax into a running max and
running sum (the "online softmax"), and never forms S x S.

Varlen (padding-free, the default). Tokens are packed: sequence i is tokens cu_seqlens[i] : cu_seqlens[i + 1]
(FlashAttention's varlen contract). The grid covers max_seqlen queries for every sequence; a program whose query
block starts past its sequence's length exits at once, so padding is never computed, and one launch serves any mix
of lengths (a captured CUDA graph fixes max_seqlen and the sequence count and still serves any lengths within them).

Padded (key_valid given: padding_free=False). Every sequence has the same length S (cu_seqlens = 0, S, 2S, ...) and
`key_valid[b, j]` says whether key j of row b is real. Key blocks at or past the row's last real key are never
loaded; other masked keys (left padding, holes) get score -inf, probability exactly 0, as HF's finfo.min mask gives
whenever the row has a real key. A fully padded row is HF eager's corner case: every score is finfo.min, softmax of
equal numbers is uniform, so each query attends uniformly to all S keys. The kernel reproduces that explicitly: all S
keys valid and a zero query, so every score is exactly 0. Padded *query* positions are computed like any other query
(HF computes them too; `uniform_padded_queries` gives DeBERTa's answer there, below).

Relative bias (optional). B[h, i, j] = table[h, clamp(j - i + L - 1, 0, 2L - 2)] from a float32 table [nh, 2L - 1]
(MPNet's T5-style buckets; ALiBi's slopes * distance), i, j positions within the sequence: a distance does not change
when sequences are packed, so one small table serves the whole batch. The kernel gathers a [BLOCK_M, BLOCK_N] tile of
it (one head's row is 4 KB at L = 512) and adds it to the scores in registers; nothing S x S is ever formed.

Sliding window (optional, ModernBERT's local layers). Query i sees key j only when |i - j| <= w (positions in the
sequence; in the row, padding included, with key_valid). A query block visits only the key blocks that meet
[first query - w, last query + w]: blocks wholly outside are skipped, not masked, so a local layer costs
~T x (BLOCK_M + 2w) scores per head; keys of visited blocks outside the band get -inf. With key_valid, a padded query
whose window holds padding only gets HF eager's answer, uniform over all S keys of its row (HF's one finfo.min mask
covers every key there): the kernel keeps such a query finite, and `launch` then writes its row's mean value; a fully
padded row ignores the window (uniform over all S keys, as without one).

Rotary (optional, ModernBERT). q and k are rotated by rotate-half with per-token cos/sin tables [T, hd/2] (float32,
one row per token: HF's apply_rotary_pos_emb), in fp32, rounded back to the input dtype before tl.dot, as the twin
rounds them. The Q tile is rotated once when loaded; each K tile every time a query block loads it (its partner
half read again through permuted column offsets, cos/sin gathered per token). Why here: rotary is a parameter of
attention (no new op, qkv stays the GEMM's view); rotating once elsewhere means a pass that reads and
writes q and k (4 x T x H x 2 bytes) or rotary inside the QKV GEMM's epilogue.
Prediction (not measured yet; bench/ should check it): each K element is rotated once per query block that visits
it, ~(BLOCK_N + 2w) / BLOCK_M + 1 times in a local layer (at w = 64: 2-3 with the 128x64 tile, 3-4 with 64x32) and
cdiv(L, BLOCK_M) times in a global layer (4 at L = 512, 64 at L = 8192 with 128 queries). Every visit also runs that
block's two dots, so the rotation costs the same share of an iteration in both: 4 FLOP per K element on CUDA cores
against 4 * BLOCK_M on tensor cores, plus the partner and cos/sin loads (all heads share the tables: L2 hits).
Predicted: rotary adds well under a fifth to the kernel's time, local or global.

Disentangled (optional, DeBERTa-v2/v3). score(i, j) = q_i.k_j * scale + c2p[tok(i), h, c] + p2c[tok(j), h, c] with
one column c = column[clamp(j - i + L - 1, 0, 2L - 2)] for both terms: `column` int32 [2L - 1] holds HF's
clamp(bucket(i - j) + span, 0, 2 span - 1); c2p [T, nh, P] is q_t . pk[h, p] / sqrt(d sf) per query token, p2c
[T, nh, P] is k_t . pq[h, p] / sqrt(d sf) per key token (P = 2 span, tok(i) the row of qkv holding position i). The
kernel gathers a column tile from the small int32 table, then c2p per row and p2c per column of the score tile, and
adds both (fp32, times log2(e)) to the scores; nothing S x S is formed.
Why gather from per-token tables (a prediction, not measured yet). The tables cost two GEMMs over the packed tokens
([T, d] x [d, P] per head, by cuBLAS): 4 T P d FLOP per head and T nh P x 4 bytes each, written once and gathered
from L2 (one token's row is P floats, 2 KB at P = 512). At DeBERTa-v3's P = 512 and S = 512 that matches attention's
own 4 T S d. The alternative computes q . pk[c] and k . pq[c] inside the kernel for only the buckets a tile reaches:
near the diagonal a 64x64 tile reaches 127 distances (as many log buckets), so each such tile adds two
[64, d] x [d, 128] dots to QK^T's and PV's [64, d] x [d, 64] (3x the tile's tensor-core work), per row about
(S / BLOCK_N) x 127 / P = 2x the tables' FLOPs at S = 512 (fewer far from the diagonal, where buckets merge), on the
kernel's critical path, plus a per-element gather out of the dots' results (a tl.dot output cannot be indexed). The
price of the tables: 2 x BLOCK_M x BLOCK_N gathered floats and one int32 column tile per score tile.
A padded query (key_valid given) gets HF's value when `uniform_padded_queries` is set: DeBERTa's mask is
mask_i * mask_j, so such a query's scores are all finfo.min and its softmax is uniform over the row's S keys;
`launch` writes the row's mean value there after the kernel (as for a window that holds only padding).

Causal (optional, Qwen3's decoder layers). Query i sees key j only when j <= i (positions in the sequence). A query
block stops its key loop at the block holding its last query: no key block above the diagonal is loaded or computed,
so a causal forward costs about half the score tiles of a bidirectional one; inside the diagonal's block the keys
after each query get -inf. Every query sees at least itself, so no live row is empty; with key_valid, a query before
its row's first real key (left padding) sees no real key, and `launch` writes HF eager's uniform answer there.

Layout. qkv is [T, 3, nh, hd]: the natural view of the QKV GEMM's [T, 3H] output, read through its strides (only hd
must be unit-stride), so no transpose or .contiguous() copy is made. The output is [T, nh*hd], exactly what the
attention output dense reads.

Grouped-query attention (optional, EuroBERT: kv key/value heads, each shared by G = nh / kv query heads). qkv is then
[T, nh + 2 kv, hd]: the QKV GEMM's output over [W_q; W_k; W_v] viewed per head, q heads, then k heads, then v heads
(the fused weight's row order), and query head h reads key/value head h // G (transformers' repeat_kv order). Each
K/V head is read where the GEMM wrote it, by the G programs of its group (neighbours on grid y), so the repeat costs
re-reads, never a copy: repeat_kv writes k and v out per query head, 2 x T x nh x hd elements, then attention reads
them back, (G - 1) / G of that being repeats of what the GEMM wrote. One layout rule serves both forms: the heads run
in blocks of kv (of nh at G = 1), q fills G blocks, k is block G and v block G + 1, so `stride_qkv_which` (one block)
and `kv_group` (G) place k and v for any G. G = 1 is [T, 3, nh, hd] with its own strides (heads-major views
included), and Triton specialises an integer argument equal to 1 into a constant: the non-grouped binaries are
BERT's as before (the same SASS), and one binary serves G = 2..15 (a multiple of 16 gets the JIT's divisibility
hint, a binary of its own).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import utils
from .utils import DTYPES as _DTYPES
from .utils import HEAD_DIMS as TRITON_HEAD_DIMS
from .utils import dropout_keep, input_precision, loop_bound

_LOG2E = 1.4426950408889634  # softmax runs on exp2: exp(x) = exp2(x * log2(e)), log2(e) folded into the scale
LOG2E = tl.constexpr(_LOG2E)  # the same factor on the bias table's values, inside the kernel
MASKED = tl.constexpr(-1.0e30)  # the running max's start, finite (see the kernel); a padded key's score in a window


@triton.jit
def _rotate(x, x_partner, cos, sin, sign):
    """HF's apply_rotary_pos_emb on one tile: x * cos + rotate_half(x) * sin in fp32, rounded back to x's dtype
    (what the twin feeds its QK^T). `x_partner` holds column (d + hd/2) % hd, `sign` is -1 for d < hd/2."""
    return (x.to(tl.float32) * cos + (sign * x_partner.to(tl.float32)) * sin).to(x.dtype)


@triton.jit
def _disentangled(column_ptr, c2p_base, p2c_base, stride_c2p_t, stride_p2c_t, offs_m, offs_n, reach, q_rows, k_rows,
                  HAS_C2P: tl.constexpr, HAS_P2C: tl.constexpr):
    """[BLOCK_M, BLOCK_N] fp32: c2p[tok(i), h, c] + p2c[tok(j), h, c] with c = column[clamp(j - i + reach)].
    `c2p_base` / `p2c_base` point at the sequence's first row of c2p / p2c (head applied); `q_rows` / `k_rows` are
    the query / key positions clamped into the sequence, so every load is in bounds without a mask (the scores of
    positions past the end are never used; masked gathers spilled on sm_80 under Triton 3.6). Offsets stay 32-bit:
    a 64-bit pointer tile costs two registers an element."""
    col = tl.load(column_ptr + tl.minimum(tl.maximum(offs_n[None, :] - offs_m[:, None] + reach, 0), 2 * reach))
    term = tl.zeros(col.shape, dtype=tl.float32)
    if HAS_C2P:
        term += tl.load(c2p_base + (q_rows[:, None] * stride_c2p_t + col)).to(tl.float32)
    if HAS_P2C:
        term += tl.load(p2c_base + (k_rows[None, :] * stride_p2c_t + col)).to(tl.float32)
    return term


# --------------------------------------------------------------------------------------------------------------------
# The kernel
# --------------------------------------------------------------------------------------------------------------------
# The sequence length and its bucket (and the padded layout's row stride S) change with every batch and only feed
# cdiv, masks and loop bounds: not specialised, so one binary per config serves every batch (kernels/__init__.py).
ATTENTION_DO_NOT_SPECIALIZE = ("max_seqlen", "stride_mask_b", "seq_bucket")


@triton.jit(do_not_specialize=ATTENTION_DO_NOT_SPECIALIZE)
def _attention_fwd_kernel(
    # pointers
    qkv_ptr,  # [T, 3, nh, hd], or grouped [T, nh + 2 kv, hd] (q heads, k heads, v heads); hd unit-stride
    cu_seqlens_ptr,  # [n + 1] int32: sequence i is tokens cu_seqlens[i] : cu_seqlens[i + 1]
    key_valid_ptr,  # [n, S] int8 (a bool tensor viewed as int8), 1 = real key; read only when HAS_MASK
    kv_end_ptr,  # [n] int32, 1 + index of the row's last real key, 0 = fully padded row; read only when HAS_MASK
    out_ptr,  # [T, nh*hd], hd unit-stride
    bias_ptr,  # [nh, 2L - 1] fp32, unit-stride columns: B[h, i, j] = bias[h, clamp(j - i + L - 1)]; when HAS_BIAS
    cos_ptr, sin_ptr,  # [T, hd/2] fp32, unit-stride columns: one row per token (packed T or B*S); when HAS_ROTARY
    column_ptr,  # [2L - 1] int32: the c2p/p2c column of distance j - i at j - i + L - 1; when HAS_C2P or HAS_P2C
    c2p_ptr,  # [T, nh, P] any float dtype, unit-stride P: per query token; when HAS_C2P
    p2c_ptr,  # [T, nh, P] any float dtype, unit-stride P: per key token; when HAS_P2C
    lse_ptr,  # [T, nh] fp32 (out): each query's log-sum-exp of its scores, natural log; written only when STORE_LSE
    seed_ptr,  # [1] int64 Philox seed (utils.dropout_seed); read only when DROPOUT
    # sizes
    max_seqlen,  # the longest sequence: the grid gives every sequence cdiv(max_seqlen, BLOCK_M) query blocks
    qk_scale,  # softmax scale * log2(e)
    bias_reach,  # L - 1: the per-distance table's largest distance (its entry of distance 0): bias or column
    window,  # w: query i sees key j only when |i - j| <= w (positions in the sequence); read only when HAS_WINDOW
    kv_group,  # G: query heads per key/value head (1: as many key/value heads as query heads)
    dropout_p,  # the probability of dropping an attention probability; read only when DROPOUT
    # strides (in elements)
    stride_qkv_t, stride_qkv_which, stride_qkv_h,  # token, a block of key/value heads (q -> k, k -> v at G = 1), head
    stride_mask_b, stride_mask_s,
    stride_out_t,
    stride_bias_h,
    stride_rot_t,  # the row stride of cos and sin (one stride for both)
    stride_c2p_t, stride_c2p_h,
    stride_p2c_t, stride_p2c_h,
    seq_bucket,  # next_power_of_2(max_seqlen): only an autotune key (a new length reuses the tuned config), not read
    # meta-parameters
    HEAD_DIM: tl.constexpr,
    HAS_MASK: tl.constexpr,  # padded rows with a key mask; False: varlen, every key of a sequence is real
    HAS_BIAS: tl.constexpr,  # add the per-distance bias table to the scores
    INPUT_PRECISION: tl.constexpr,  # "tf32" or "ieee" for fp32 inputs (torch's allow_tf32); fp16/bf16 ignore it
    BLOCK_M: tl.constexpr,  # queries per program
    BLOCK_N: tl.constexpr,  # keys per loop iteration
    HAS_WINDOW: tl.constexpr = False,  # a sliding window: key blocks wholly outside it are not visited
    HAS_ROTARY: tl.constexpr = False,  # rotate q and k (rotate-half) by the per-token cos/sin before QK^T
    HAS_C2P: tl.constexpr = False,  # add DeBERTa's content-to-position term, gathered from c2p per query row
    HAS_P2C: tl.constexpr = False,  # add its position-to-content term, gathered from p2c per key column
    STORE_LSE: tl.constexpr = False,  # also store the log-sum-exp the backward reads (off: inference's code)
    DROPOUT: tl.constexpr = False,  # drop probabilities (training): keep bits from Philox at each (head, query, key)
    CAUSAL: tl.constexpr = False,  # query i sees keys j <= i only: key blocks past the query block are not visited
):
    # Grid: (query blocks x sequences, heads), query blocks fastest, so the programs that run together share one
    # sequence's and one head's K/V. Sequences ride on grid x (up to 2^31 - 1), not y/z (65535).
    pid = tl.program_id(0)  # int32 division (cheaper than int64), then int64 for the offsets
    num_m_blocks = tl.cdiv(max_seqlen, BLOCK_M)
    seq = pid // num_m_blocks
    pid_m = pid % num_m_blocks
    head = tl.program_id(1).to(tl.int64)
    kv_head = (tl.program_id(1) // kv_group).to(tl.int64)  # the key/value head of this query head's group

    seq_start = tl.load(cu_seqlens_ptr + seq).to(tl.int64)  # the sequence's first token in T
    seq_len = tl.load(cu_seqlens_ptr + seq + 1) - tl.load(cu_seqlens_ptr + seq)
    # A query block past its sequence's end visits no key block and stores nothing (every lane masked). Written as
    # a zero loop bound rather than an early return, which cost a stack frame on sm_80 (cuobjdump STACK 8).
    live = pid_m * BLOCK_M < seq_len

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # query positions within the sequence
    offs_d = tl.arange(0, HEAD_DIM)
    offs_nb = tl.arange(0, BLOCK_N)
    # The sequence's base pointers, 64-bit once; offsets inside a sequence stay 32-bit (< max_seqlen * row stride)
    seq_base = qkv_ptr + head * stride_qkv_h + seq_start * stride_qkv_t

    if HAS_MASK:
        kv_end = tl.load(kv_end_ptr + seq)  # in [0, S] by construction: launch() derives it from key_valid
        # HF eager on a fully padded row (kv_end == 0): all S keys, equal scores. Run it as all S keys valid with
        # a zero query (every score exactly 0). (Written with tl.where on scalars, not `block & scalar_bool`,
        # which Triton 3.9's interpreter turns into an int32 mask it then refuses.)
        n_end = tl.where(kv_end == 0, seq_len, kv_end)
        if HAS_WINDOW:  # a padded query past the last real key still sees its window's padding (below)
            n_end = seq_len
        q_end = tl.where(kv_end == 0, 0, seq_len)
        bias_gain = tl.where(kv_end == 0, 0.0, LOG2E)  # HF's finfo.min swamps the bias there too: scores stay equal
    else:
        n_end = seq_len
        q_end = seq_len
        bias_gain = LOG2E
    n_end = tl.where(live, n_end, 0)
    q_mask = offs_m < q_end

    # The Q tile is loaded once and stays in registers for the whole key loop.
    q = tl.load(seq_base + offs_m[:, None] * stride_qkv_t + offs_d[None, :], mask=q_mask[:, None], other=0.0)
    if HAS_ROTARY:
        # rotate-half: column d pairs with (d + hd/2) % hd, negated for d < hd/2; cos/sin repeat over both halves
        HALF: tl.constexpr = HEAD_DIM // 2
        offs_partner = (offs_d + HALF) % HEAD_DIM
        sign = tl.where(offs_d < HALF, -1.0, 1.0)
        offs_freq = offs_d % HALF
        rot_base = seq_start * stride_rot_t
        q_partner = tl.load(seq_base + offs_m[:, None] * stride_qkv_t + offs_partner[None, :],
                            mask=q_mask[:, None], other=0.0)
        q_rot = rot_base + offs_m[:, None] * stride_rot_t + offs_freq[None, :]
        q = _rotate(q, q_partner, tl.load(cos_ptr + q_rot, mask=q_mask[:, None], other=0.0),
                    tl.load(sin_ptr + q_rot, mask=q_mask[:, None], other=0.0), sign[None, :])
    # K and V of the head's group: k is block G of the layout, v block G + 1 (the module docstring); at G = 1 this is
    # seq_base + stride_qkv_which and + 2 stride_qkv_which. K^T tile [HEAD_DIM, BLOCK_N] is read straight from it.
    kv_base = qkv_ptr + kv_head * stride_qkv_h + seq_start * stride_qkv_t
    k_base = kv_base + kv_group * stride_qkv_which
    v_base = kv_base + (kv_group + 1) * stride_qkv_which
    if HAS_BIAS:
        bias_row = bias_ptr + head * stride_bias_h
        bias_col = bias_reach - offs_m  # + key position = the table column of distance j - i
    c2p_base = c2p_ptr + head * stride_c2p_h + seq_start * stride_c2p_t
    p2c_base = p2c_ptr + head * stride_p2c_h + seq_start * stride_p2c_t

    # Online softmax state, fp32, in the log2 domain. m starts finite (not -inf) so that a block whose keys are all
    # masked (scores -inf) gives alpha = exp2(m - m_new) = 1 and p = exp2(-inf) = 0 instead of exp2(-inf + inf) = NaN.
    m_i = tl.full([BLOCK_M], MASKED, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    if DROPOUT:
        # Element (query token t, head, key position j) is number (t * nh + head) * max_seqlen + j: unique, and the
        # backward (kernels/attention_backward.py) numbers it the same way, so it regenerates this mask. A fully
        # padded row is HF's uniform answer, which the twin states without dropout: nothing is dropped there.
        drop_rows = ((seq_start + offs_m) * tl.num_programs(1) + head) * max_seqlen
        keep_scale = 1.0 / (1.0 - dropout_p)
        if HAS_MASK:
            undropped = kv_end == 0
            keep_scale = tl.where(undropped, 1.0, keep_scale)

    # Key blocks at or past n_end (the row's last real key, or the sequence's end) are never visited.
    lo = 0
    hi = n_end
    if HAS_WINDOW:
        # Only the key blocks that meet [first query - w, last query + w] are visited (a local layer costs
        # ~T x (BLOCK_M + 2w) scores per head, not T x S). A fully padded row keeps HF's uniform answer over all S
        # keys: no window there.
        if HAS_MASK:
            win = tl.where(kv_end == 0, max_seqlen, window)
        else:
            win = window
        q_first = pid_m * BLOCK_M
        lo = tl.maximum(q_first - win, 0) // BLOCK_N * BLOCK_N
        hi = tl.minimum(hi, q_first + BLOCK_M + win)
    if CAUSAL:
        # No key block above the diagonal is visited: the last one holds the block's last query. About half of a
        # sequence's blocks, so about half the work of attending both ways.
        hi = tl.minimum(hi, (pid_m + 1) * BLOCK_M)
    for start_n in range(loop_bound(lo), loop_bound(hi), BLOCK_N):
        offs_n = start_n + offs_nb
        in_range = offs_n < n_end
        k = tl.load(k_base + offs_n[None, :] * stride_qkv_t + offs_d[:, None], mask=in_range[None, :], other=0.0)
        if HAS_ROTARY:  # each K^T tile rotated as it is loaded (see the module docstring for the cost)
            k_partner = tl.load(k_base + offs_n[None, :] * stride_qkv_t + offs_partner[:, None],
                                mask=in_range[None, :], other=0.0)
            k_rot = rot_base + offs_n[None, :] * stride_rot_t + offs_freq[:, None]
            k = _rotate(k, k_partner, tl.load(cos_ptr + k_rot, mask=in_range[None, :], other=0.0),
                        tl.load(sin_ptr + k_rot, mask=in_range[None, :], other=0.0), sign[:, None])
        scores = tl.dot(q, k, input_precision=INPUT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N], fp32
        if HAS_BIAS:  # distances past the table read its end columns; every index is in bounds, no load mask
            col = tl.minimum(tl.maximum(bias_col[:, None] + offs_n[None, :], 0), 2 * bias_reach)
            scores += tl.load(bias_row + col) * bias_gain
        if HAS_C2P or HAS_P2C:
            scores += _disentangled(column_ptr, c2p_base, p2c_base, stride_c2p_t, stride_p2c_t, offs_m, offs_n,
                                    bias_reach, tl.minimum(offs_m, seq_len - 1), tl.minimum(offs_n, seq_len - 1),
                                    HAS_C2P, HAS_P2C) * bias_gain
        if HAS_WINDOW:
            near = tl.abs(offs_n[None, :] - offs_m[:, None]) <= win
            if HAS_MASK:
                # A padded query's window may hold padding only: padded keys score MASKED (= m_i's start, so
                # p = exp2(0) = 1 while no real key has been seen, 0 once one has), where -inf would give 0 / 0.
                # Such a query's row is then overwritten with HF's uniform answer (launch). Keys from kv_end on are
                # padding, not read.
                key_valid = tl.load(key_valid_ptr + seq * stride_mask_b + offs_n * stride_mask_s,
                                    mask=offs_n < kv_end, other=0)
                scores = tl.where((key_valid != 0)[None, :], scores, MASKED)
            if CAUSAL:
                near = near & (offs_n[None, :] <= offs_m[:, None])
            scores = tl.where(in_range[None, :] & near, scores, float("-inf"))
        else:
            if HAS_MASK:
                # Only keys before kv_end are read; the rest (all keys of a fully padded row) default to valid.
                key_valid = tl.load(key_valid_ptr + seq * stride_mask_b + offs_n * stride_mask_s,
                                    mask=offs_n < kv_end, other=1)
                keep = (key_valid != 0) & in_range
            else:
                keep = in_range
            if CAUSAL:  # the diagonal's block: the keys after each query
                scores = tl.where(keep[None, :] & (offs_n[None, :] <= offs_m[:, None]), scores, float("-inf"))
            else:
                scores = tl.where(keep[None, :], scores, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.math.exp2(m_i - m_new)  # rescales what was accumulated under the old max
        p = tl.math.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + offs_n[:, None] * stride_qkv_t + offs_d[None, :],
                    mask=in_range[:, None], other=0.0)
        if DROPOUT:  # l_i sums the probabilities before dropout: dropout acts on the normalised softmax
            keep = dropout_keep(seed_ptr, drop_rows[:, None] + offs_n[None, :], dropout_p)
            if HAS_MASK:
                keep = keep | undropped
            p = tl.where(keep, p * keep_scale, 0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
        m_i = m_new

    # l_i >= 1 for every live row (its max score contributes exp2(0)); 0 only if kv_end and key_valid disagree
    # (a kv_end > 0 with no real key before it). Divide by 1 there: zeros, not NaN.
    l_i = tl.where(l_i == 0.0, 1.0, l_i)
    # div.full (2 ulp) rather than IEEE division, whose slow-path subroutine call cost a stack frame on sm_80
    out = tl.fdiv(acc, l_i[:, None], ieee_rounding=False)
    out_ptrs = out_ptr + seq_start * stride_out_t + head * HEAD_DIM + offs_m[:, None] * stride_out_t + offs_d[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=(offs_m < seq_len)[:, None])
    if STORE_LSE:  # natural log: (m + log2 l) / log2(e), in the units of the scale's scores (and the bias table's)
        tl.store(lse_ptr + (seq_start + offs_m) * tl.num_programs(1) + head, (m_i + tl.log2(l_i)) / LOG2E,
                 mask=offs_m < seq_len)


# --------------------------------------------------------------------------------------------------------------------
# Autotune configs
# --------------------------------------------------------------------------------------------------------------------
def _config(block_m: int, block_n: int, num_warps: int, num_stages: int, maxnreg: int | None = 255) -> triton.Config:
    """maxnreg=255 by default: left to itself ptxas often aims at one more CTA per SM than the tile's registers
    allow (80 at 8 warps, 96 at 4) and parks a value or two on the stack (STACK 8-16 on sm_80, moving from tile to
    tile with every small code change); with the full budget it takes what the tile needs, with no stack."""
    return triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n}, num_warps=num_warps, num_stages=num_stages,
                         maxnreg=maxnreg)


def attention_configs(dtype: torch.dtype, head_dim: int, input_precision: str = "ieee",
                      rotary: bool = False, disentangled: bool = False,
                      dropout: bool = False) -> list[triton.Config]:
    """The tiles worth trying for one dtype / head dim / fp32 input precision. Each compiles for sm_90 and sm_80,
    masked and unmasked, without register spills on Triton 3.6 and 3.9 (cuobjdump STACK 0; tests/tooling/test_aot.py
    checks it via aot_specs()).

    fp16/bf16: 128x64 with 8 warps is the throughput tile for long sequences and big batches (the Triton tutorial's
    choice). A 64-query tile with 4 warps doubles the program count, which BERT's usual short sequences and small
    batches need (1 x 128 tokens x 12 heads makes 24 programs of 64 queries for 132 SMs): 64x64 up to hd 64, 64x32
    at hd 128, where 64x64 spills on sm_80. Two stages: the key loop of a BERT-length sequence is 2-8 iterations,
    and 3 stages spilled (hd 32, sm_80).
    fp32: not autotuned, one tile (it is the accuracy path, not the fast one). "tf32" runs on tensor cores; "ieee"
    (torch's default, allow_tf32 off) runs tl.dot on FMAs, which hold whole hd-long operand rows per thread: every
    128-query tile and 64x64 spill at hd 64/128; 64x32 with 8 warps fits up to hd 32, 64x16 with 4 warps at hd 64,
    32x16 with 4 warps at hd 128 (ptxas's own register budget there; 255 spills).
    rotary (fp16/bf16, hd 64): 64x32 as the short-sequence tile; 64x64 with the window spilled 8 bytes on sm_80
    under Triton 3.6 (REG 255). At hd 128 (EuroBERT-2.1B; the partner K^T tile and the cos/sin tiles are twice as
    wide) 128x64 at 8 warps and 64x32 at 4 warps spilled 8-16 bytes on sm_80 without a key mask, in either register
    budget (Triton 3.9); 128x32 at 8 warps in ptxas's own budget and 64x32 at 8 warps fit (REG 188-242 on sm_80,
    134-177 on sm_90, Triton 3.9 and 3.6). Chosen by registers, not timed yet.
    disentangled (fp16/bf16): the gathered column, c2p and p2c tiles hold registers in the key loop. Both terms at
    hd 64: 64x64 at 4 warps spilled on sm_80 (STACK 64 under Triton 3.9, 232 under 3.6), so the short-sequence tile
    is 64x32; 128x64 fits at maxnreg=255 (REG 222-250 on sm_80; in ptxas's own budget it took 128 registers at hd 32
    and spilled under Triton 3.6). At hd 128 128x64 spilled with any term (STACK 32-56, sm_90 and sm_80): 64x32 alone.
    dropout (training, fp16/bf16): the Philox draws hold registers in the key loop; 64x64 at 4 warps spilled on sm_80
    (REG 255, STACK 48, Triton 3.9) at hd 64, so the short-sequence tile is 64x32; 128x64 at 8 warps fits (REG 244).
    """
    if dtype == torch.float32:  # the FMA tiles at hd 64/128 need more than 255 registers' worth: ptxas's own budget
        if input_precision == "ieee" and head_dim > 64:
            return [_config(32, 16, 4, 2, maxnreg=None)]
        if head_dim == 64:  # tf32 at 64x32 w8 spilled 8 bytes on sm_80 once the rows moved onto grid x
            return [_config(64, 16, 4, 2, maxnreg=None)]
        return [_config(64, 32, 8, 2)]
    if disentangled and head_dim > 64:
        return [_config(64, 32, 4, 2)]
    if rotary and head_dim > 64:
        return [_config(128, 32, 8, 2, maxnreg=None), _config(64, 32, 8, 2)]
    # 128x64 at hd 128: ptxas's own budget (~244 on sm_80) does not spill; 255 spills 8 bytes there.
    big = _config(128, 64, 8, 2, maxnreg=None if head_dim > 64 else 255)
    narrow = head_dim > 64 or (rotary and head_dim == 64) or disentangled or dropout
    return [big, _config(64, 32, 4, 2) if narrow else _config(64, 64, 4, 2)]


def _key(config: triton.Config) -> tuple:
    return config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.num_warps, config.num_stages, config.maxnreg


def _all_configs() -> list[triton.Config]:
    unique = {}
    for dtype in _DTYPES:
        for precision in ("ieee", "tf32"):
            for head_dim in TRITON_HEAD_DIMS:
                for rotary, disentangled, dropout in ((False, False, False), (True, False, False),
                                                      (False, True, False), (False, False, True)):
                    for config in attention_configs(dtype, head_dim, precision, rotary, disentangled, dropout):
                        unique.setdefault(_key(config), config)
    return list(unique.values())


def _prune(configs, named_args, **kwargs):
    """Keep the configs of this call's dtype and head dim; drop 128-query tiles for sequences of <= 64 tokens
    (half of such a tile would be masked-off work, and it halves the program count)."""
    dtype, head_dim, precision = named_args["qkv_ptr"].dtype, kwargs["HEAD_DIM"], kwargs["INPUT_PRECISION"]
    wanted = {_key(c) for c in attention_configs(dtype, head_dim, precision, kwargs.get("HAS_ROTARY", False),
                                                 kwargs.get("HAS_C2P", False) or kwargs.get("HAS_P2C", False),
                                                 kwargs.get("DROPOUT", False))}
    kept = [c for c in configs if _key(c) in wanted]
    short = [c for c in kept if c.kwargs["BLOCK_M"] <= max(64, named_args["seq_bucket"])]
    return short or kept


# The autotuner adds the tensor dtypes to the key itself. seq_bucket (a power of two) rather than seq_len, so a new
# length re-uses the tuned config; the mask variant shares its unmasked twin's choice. A window (and its width: the
# keys a query block visits), rotary, DeBERTa's gathers and dropout's draws change the work per key block, so they tune
# apart.
_attention_fwd = utils.autotune(_attention_fwd_kernel, _all_configs(),
                                ["HEAD_DIM", "INPUT_PRECISION", "seq_bucket", "HAS_WINDOW", "window", "HAS_ROTARY",
                                 "HAS_C2P", "HAS_P2C", "DROPOUT", "CAUSAL"],
                                _prune)

# Under TRITON_INTERPRET=1 the autotuner would run every config several times through numpy (seconds to minutes
# per shape, measuring nothing real), so the launcher uses this one fixed tile instead. 64x32 is the smallest
# 64-row tile of the menu: it runs the most key-loop iterations and hits the query and key tails at the short
# lengths tests afford (tests/kernels/test_attention.py runs every other tile once through `config=`).
_INTERPRETER_CONFIG = _config(64, 32, 4, 2)


# --------------------------------------------------------------------------------------------------------------------
# The launchers: `attention` checks everything (for direct callers), `launch` trusts its caller (the model's hot path)
# --------------------------------------------------------------------------------------------------------------------
def invariant_config(dtype: torch.dtype, head_dim: int, input_precision: str, rotary: bool,
                     disentangled: bool) -> triton.Config:
    """The one tile a launch takes where it must not depend on the batch (inside utils.batch_invariant, and a key
    not tuned yet inside a CUDA-graph capture): the first of attention_configs(), the short-sequence tile."""
    return attention_configs(dtype, head_dim, input_precision, rotary, disentangled)[0]


def launch_grid(num_seqs: int, max_seqlen: int, num_heads: int, block_m: int) -> tuple[int, int]:
    """(query blocks x sequences, heads): sequences ride on grid x, whose limit is 2^31 - 1, not on y/z (65535)."""
    return triton.cdiv(max_seqlen, block_m) * num_seqs, num_heads


def last_real_key(keep: torch.Tensor) -> torch.Tensor:
    """[B] int32: 1 + the index of each row's last real key in a [B, S] bool mask, 0 for a fully padded row."""
    positions = torch.arange(1, keep.shape[1] + 1, device=keep.device, dtype=torch.int32)
    return (keep.to(torch.int32) * positions).amax(dim=1).to(torch.int32)


def uniform_cu_seqlens(batch: int, seq_len: int, device) -> torch.Tensor:
    """cu_seqlens of `batch` rows of `seq_len` tokens each: 0, S, 2S, ..., B*S (the padded layout)."""
    return torch.arange(0, (batch + 1) * seq_len, seq_len, dtype=torch.int32, device=device)


_PLACEHOLDERS: dict = {}


def _placeholder(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A typed stand-in for key_valid / kv_end when there is no mask (never read: HAS_MASK=False), so the unmasked
    launch has the same argument types as its ahead-of-time spec. One tiny tensor per device, made once."""
    key = (str(device), dtype)
    if key not in _PLACEHOLDERS:
        _PLACEHOLDERS[key] = torch.zeros(1, dtype=dtype, device=device)
    return _PLACEHOLDERS[key]


def rotary_tables(rotary) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) of a rotary argument: a (cos, sin) pair (fastbert's Rotary is one) or an object with .cos and
    .sin."""
    if isinstance(rotary, (tuple, list)):
        cos, sin = rotary
        return cos, sin
    return rotary.cos, rotary.sin


def launch(qkv: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, scale: float,
           key_valid: torch.Tensor | None = None, out: torch.Tensor | None = None,
           config: triton.Config | None = None, bias: torch.Tensor | None = None, window: int | None = None,
           rotary=None, c2p: torch.Tensor | None = None, p2c: torch.Tensor | None = None,
           column: torch.Tensor | None = None, uniform_padded_queries: bool = False,
           kv_heads: int | None = None, lse: torch.Tensor | None = None, dropout_p: float = 0.0,
           seed: torch.Tensor | None = None, causal: bool = False) -> torch.Tensor:
    """`attention` without the checks: the caller guarantees what `attention` checks (the model does, once per
    forward). No host read: safe inside a CUDA graph capture, where a key the autotuner has not tuned takes the
    first config of attention_configs() for its dtype and head dim (benchmarking would sync), and a binary not loaded
    yet is refused (utils.NotWarmedUp: warm up first). Runs on qkv's device.
    Training (`train_forward`): lse, an fp32 [T, nh] buffer, receives each query's log-sum-exp; dropout_p > 0 drops
    attention probabilities with keep bits drawn from `seed` (utils.dropout_seed). Both are passed to the kernel only
    when asked, so inference's launches keep their kwargs and their binaries."""
    T, num_heads, head_dim, kv_group, stride_which, stride_head = _heads(qkv, kv_heads)
    has_c2p, has_p2c = c2p is not None, p2c is not None
    if has_c2p or has_p2c:
        _refuse_with_disentangled(bias, window, rotary)
    if out is None:
        out = torch.empty((T, num_heads * head_dim), dtype=qkv.dtype, device=qkv.device)
    num_seqs = cu_seqlens.shape[0] - 1
    if T == 0 or num_seqs == 0 or max_seqlen == 0:
        return out
    if key_valid is not None:
        kv_end = last_real_key(key_valid)  # computed here, never taken from a caller: it bounds every key read
        mask_i8 = key_valid.view(torch.int8)  # same bytes; Triton loads it as int8
        stride_mask_b, stride_mask_s = mask_i8.stride()
    else:
        mask_i8, kv_end = _placeholder(qkv.device, torch.int8), _placeholder(qkv.device, torch.int32)
        stride_mask_b = stride_mask_s = 1  # never read; 1s so the unmasked kernel matches its AOT spec
    has_bias = bias is not None
    if has_bias:
        bias_reach, stride_bias_h = (bias.shape[1] - 1) // 2, bias.stride(0)
    else:  # never read; a typed placeholder and 1s, so the unbiased kernel matches its AOT spec
        bias, bias_reach, stride_bias_h = _placeholder(qkv.device, torch.float32), 1, 1
    # A window that reaches every key of the longest sequence is no window (the twin skips it the same way).
    has_window = window is not None and window < max_seqlen - 1
    if not has_window:
        window = 1  # never read; 1 as in the AOT spec
    has_rotary = rotary is not None
    if has_rotary:
        cos, sin = rotary_tables(rotary)
        stride_rot_t = cos.stride(0)
    else:  # never read
        cos = sin = _placeholder(qkv.device, torch.float32)
        stride_rot_t = 1
    # DeBERTa's terms; those absent are never read: a typed placeholder and 1s, as in the AOT spec
    if has_c2p or has_p2c:
        bias_reach = (column.shape[0] - 1) // 2  # the column table takes the bias table's place (never both)
    else:
        column = _placeholder(qkv.device, torch.int32)
    if has_c2p:
        stride_c2p_t, stride_c2p_h = c2p.stride(0), c2p.stride(1)
    else:
        c2p, stride_c2p_t, stride_c2p_h = _placeholder(qkv.device, torch.float32), 1, 1
    if has_p2c:
        stride_p2c_t, stride_p2c_h = p2c.stride(0), p2c.stride(1)
    else:
        p2c, stride_p2c_t, stride_p2c_h = _placeholder(qkv.device, torch.float32), 1, 1
    lse_buffer = lse if lse is not None else _placeholder(qkv.device, torch.float32)
    seed_buffer = seed if dropout_p > 0 else _placeholder(qkv.device, torch.int64)
    args = (qkv, cu_seqlens, mask_i8, kv_end, out, bias, cos, sin, column, c2p, p2c, lse_buffer, seed_buffer,
            max_seqlen, float(scale) * _LOG2E, bias_reach, int(window), kv_group, float(dropout_p),
            qkv.stride(0), stride_which, stride_head,
            stride_mask_b, stride_mask_s,
            out.stride(0), stride_bias_h, stride_rot_t,
            stride_c2p_t, stride_c2p_h, stride_p2c_t, stride_p2c_h,
            triton.next_power_of_2(max_seqlen))
    meta = dict(HEAD_DIM=head_dim, HAS_MASK=key_valid is not None, HAS_BIAS=has_bias,
                INPUT_PRECISION=input_precision(qkv.dtype), HAS_WINDOW=has_window, HAS_ROTARY=has_rotary,
                HAS_C2P=has_c2p, HAS_P2C=has_p2c)
    if lse is not None:
        meta["STORE_LSE"] = True
    if dropout_p > 0:
        meta["DROPOUT"] = True
    if causal:  # passed only when set, so the bidirectional launches keep their kwargs and their binaries
        meta["CAUSAL"] = True
    if config is None and utils.INTERPRET:
        config = _INTERPRETER_CONFIG
    with utils.device_guard(qkv):
        capture = utils.capturing(qkv)
        if config is None and utils.invariant():  # the same tile whatever the lengths (utils.batch_invariant)
            config = invariant_config(qkv.dtype, head_dim, meta["INPUT_PRECISION"], has_rotary, has_c2p or has_p2c)
        if config is None and capture:
            config = utils.capture_config(_attention_fwd, args, meta, invariant_config(
                qkv.dtype, head_dim, meta["INPUT_PRECISION"], has_rotary, has_c2p or has_p2c))
        if config is None:
            _attention_fwd[lambda META: launch_grid(num_seqs, max_seqlen, num_heads, META["BLOCK_M"])](*args, **meta)
        else:
            # the Config's own keyword arguments, as the autotuner launches its choice: one JIT key for both
            kwargs = {**meta, **config.all_kwargs()}
            if capture:
                utils.require_loaded(_attention_fwd_kernel, args, kwargs, "attention")
            _attention_fwd_kernel[launch_grid(num_seqs, max_seqlen, num_heads, config.kwargs["BLOCK_M"])](*args,
                                                                                                      **kwargs)
    if key_valid is not None and has_window:
        _uniform_where(qkv, kv_heads, _window_is_empty(key_valid, int(window)), out)
    if key_valid is not None and causal:  # left padding: a query before the row's first real key sees none
        _uniform_where(qkv, kv_heads, key_valid.to(torch.int32).cumsum(1) == 0, out)
    if key_valid is not None and uniform_padded_queries:
        _uniform_where(qkv, kv_heads, ~key_valid, out)
    return out


def train_forward(qkv: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, scale: float,
                  key_valid: torch.Tensor | None = None, *, bias: torch.Tensor | None = None,
                  window: int | None = None, rotary=None, kv_heads: int | None = None, dropout_p: float = 0.0,
                  seed: torch.Tensor | None = None, c2p: torch.Tensor | None = None, p2c: torch.Tensor | None = None,
                  column: torch.Tensor | None = None, uniform_padded_queries: bool = False,
                  config: triton.Config | None = None):
    """The forward training runs: (out [T, nh*hd], lse fp32 [T, nh]), `launch`'s output and each query's
    log-sum-exp of its scores (natural log, the scale and the bias included), which the backward reads to recompute
    the probabilities (kernels/attention_backward.py). dropout_p > 0 drops probabilities inside the kernel with keep
    bits drawn from `seed` (utils.dropout_seed), at the element numbers the backward regenerates. The caller
    (fastbert.units.attention.train_kernel) has checked the arguments."""
    T, num_heads = _heads(qkv, kv_heads)[:2]
    lse = torch.empty((T, num_heads), dtype=torch.float32, device=qkv.device)
    if dropout_p > 0 and seed is None:
        raise ValueError("train_forward: dropout_p > 0 needs a seed tensor (utils.dropout_seed)")
    out = launch(qkv, cu_seqlens, max_seqlen, scale, key_valid, config=config, bias=bias, window=window,
                 rotary=rotary, c2p=c2p, p2c=p2c, column=column, uniform_padded_queries=uniform_padded_queries,
                 kv_heads=kv_heads, lse=lse, dropout_p=dropout_p, seed=seed)
    return out, lse


def _heads(qkv: torch.Tensor, kv_heads: int | None) -> tuple:
    """(T, nh, hd, G, stride_qkv_which, stride_qkv_h) of qkv [T, 3, nh, hd] (kv_heads None) or grouped
    [T, nh + 2 kv, hd]: there a block of key/value heads is kv heads wide, and q holds G = nh / kv of them."""
    if kv_heads is None:
        T, _, num_heads, head_dim = qkv.shape
        return T, num_heads, head_dim, 1, qkv.stride(1), qkv.stride(2)
    T, width, head_dim = qkv.shape
    num_heads = width - 2 * kv_heads
    return T, num_heads, head_dim, num_heads // kv_heads, kv_heads * qkv.stride(1), qkv.stride(1)


def _refuse_with_disentangled(bias, window, rotary) -> None:
    """DeBERTa's terms take the per-distance table's place in the kernel, and no family combines them with a
    window or rotary: such a call is refused, not approximated (a cheap check, no tensor read)."""
    given = [f"{name}={shown}" for name, value, shown in (
        ("bias", bias, bias is not None and tuple(bias.shape)), ("window", window, repr(window)),
        ("rotary", rotary, type(rotary).__name__)) if value is not None]
    if given:
        raise ValueError(f"disentangled attention (c2p/p2c) cannot be combined with a bias, a window or rotary; got "
                         f"{', '.join(given)}")


def _window_is_empty(key_valid, window):
    """[B, S] bool: the queries whose window holds no real key. HF's one mask puts finfo.min on every key of such a
    query, so its softmax is uniform over all S keys; the kernel only visits the window's blocks."""
    S = key_valid.shape[1]
    counts = torch.nn.functional.pad(key_valid.to(torch.int32).cumsum(1), (1, 0))  # [B, S + 1]
    i = torch.arange(S, device=key_valid.device)
    return (counts[:, (i + window + 1).clamp(max=S)] - counts[:, (i - window).clamp(min=0)]) == 0


def _uniform_where(qkv, kv_heads, uniform, out):
    """Padded rows: the queries where `uniform` [B, S] is True get HF eager's answer for a query whose every key is
    masked, the mean of its row's S values. A few [B, S] tensor ops, no host read: fine inside a CUDA graph."""
    B, S = uniform.shape
    T, nh, hd, group = _heads(qkv, kv_heads)[:4]
    v = qkv[:, 2] if kv_heads is None else qkv[:, nh + kv_heads:]  # [T, kv, hd] (kv = nh without groups)
    mean = v.reshape(B, S, nh // group, hd).float().mean(dim=1).to(out.dtype)  # [B, kv, hd]
    mean = mean.repeat_interleave(group, dim=1) if group > 1 else mean  # [B, nh, hd]: each query head's group
    rows = out.view(B, S, nh, hd)
    rows.copy_(torch.where(uniform[:, :, None, None], mean[:, None], rows))


def _check_table(name: str, table, alternatives: str, what: str, device, shape_ok: bool, expected: str) -> None:
    """A float32 side table of attention (the bias table, a rotary cos/sin): its type, dtype, shape (`shape_ok`,
    described by `expected`), device and unit-stride last dimension, each a clear error naming `name`."""
    if not isinstance(table, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor{' ' + alternatives if alternatives else ''}, got "
                        f"{type(table).__name__}")
    if table.dtype != torch.float32:
        raise TypeError(f"{name}.dtype={table.dtype}; {what} must be torch.float32")
    if not shape_ok:
        raise ValueError(f"{name} has shape {tuple(table.shape)}, expected {expected}")
    if table.device != device:
        raise ValueError(f"{name} is on {table.device} but qkv is on {device}")
    if table.stride(-1) != 1:
        raise ValueError(f"{name}'s last dim must be unit-stride, got strides {tuple(table.stride())}")


def attention(qkv: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, scale: float,
              key_valid: torch.Tensor | None = None, out: torch.Tensor | None = None, *,
              config: triton.Config | None = None, bias: torch.Tensor | None = None, window: int | None = None,
              rotary=None, c2p: torch.Tensor | None = None, p2c: torch.Tensor | None = None,
              column: torch.Tensor | None = None, uniform_padded_queries: bool = False,
              kv_heads: int | None = None, causal: bool = False) -> torch.Tensor:
    """softmax(q k^T * scale + B) v per sequence, for packed qkv [T, 3, nh, hd] (or grouped, below) -> out [T, nh*hd].

    cu_seqlens: [n + 1] int32 (on qkv's device): 0 = cu_seqlens[0] <= ... <= cu_seqlens[n] = T; sequence i is tokens
                cu_seqlens[i] : cu_seqlens[i + 1]. Checked here with one host read (`launch` does not read it).
    max_seqlen: an int >= the longest sequence.
    key_valid:  None (varlen: every token of a sequence is real), or [n, S] bool for the padded layout, where every
                sequence has length S = max_seqlen and key j of row i is a real token where True.
    out:        optional [T, nh*hd] output (last dim unit-stride), same dtype and device as qkv.
    config:     force one triton.Config (BLOCK_M, BLOCK_N, warps, stages) instead of autotuning; for tests.
    bias:       None (B = 0), or a float32 table [nh, 2L - 1] (unit-stride columns, on qkv's device) of a bias that
                depends on (head, j - i) only: B[h, i, j] = bias[h, j - i + L - 1], i and j positions in the sequence
                (in the row, with key_valid), distances beyond +-(L - 1) clamped to the end columns.
    window:     None, or an int w >= 0: query i sees key j only when |i - j| <= w (positions in the sequence, in the
                row with key_valid; a fully padded row still attends to all S keys).
    rotary:     None, or (cos, sin) (a pair, or an object with .cos and .sin): float32 [T, hd/2] each, one row per
                token, unit-stride columns, the same strides; q and k are rotated (rotate-half) before q k^T.
    c2p, p2c, column: DeBERTa's disentangled terms (see the module docstring): c2p and p2c None or [T, nh, P] in
                a float dtype (any strides on T and nh, unit-stride P), at least one given; column int32 [2L - 1]
                of values in [0, P): the score of (i, j) gains c2p[tok(i), h, c] + p2c[tok(j), h, c] with
                c = column[clamp(j - i + L - 1, 0, 2L - 2)]. Not combined with bias, window or rotary.
    uniform_padded_queries: with key_valid, a padded query gets the mean of its row's S values (HF's answer where
                the mask is key_valid[i] * key_valid[j], as DeBERTa's); False: it attends to the row's real keys.
    kv_heads:   None, or grouped-query attention over kv key/value heads: qkv is then [T, nh + 2 kv, hd] (q heads,
                k heads, v heads, in that order along dim 1; any strides but hd's), kv divides nh, and query head h
                reads key/value head h // (nh / kv), never expanded (see the module docstring).
    causal:     query i sees key j only when j <= i (positions in the sequence, in the row with key_valid): key
                blocks past a query block's last query are not visited. With key_valid, a query before its row's
                first real key (left padding) gets the mean of its row's S values (HF eager's answer there).
    """
    if not isinstance(qkv, torch.Tensor):
        raise TypeError(f"qkv must be a torch.Tensor, got {type(qkv).__name__}")
    if kv_heads is None:
        if qkv.dim() != 4 or qkv.shape[1] != 3:
            raise ValueError(f"qkv must be [T, 3, num_heads, head_dim] (grouped, with kv_heads: "
                             f"[T, num_heads + 2*kv_heads, head_dim]), got shape {tuple(qkv.shape)}")
    else:
        if isinstance(kv_heads, bool) or not isinstance(kv_heads, int) or kv_heads < 1:
            raise ValueError(f"kv_heads must be None or a positive int, got {kv_heads!r}")
        if qkv.dim() != 3:
            raise ValueError(f"with kv_heads={kv_heads}, qkv must be [T, num_heads + 2*kv_heads, head_dim], got shape "
                             f"{tuple(qkv.shape)}")
        queries = qkv.shape[1] - 2 * kv_heads
        if queries < kv_heads or queries % kv_heads:
            raise ValueError(f"qkv.shape[1]={qkv.shape[1]} leaves num_heads={queries} query heads beside 2 x "
                             f"kv_heads={kv_heads}; kv_heads must divide num_heads")
    if qkv.dtype not in _DTYPES:
        raise TypeError(f"qkv.dtype={qkv.dtype} is not supported; use float32, float16 or bfloat16")
    T, num_heads, head_dim = _heads(qkv, kv_heads)[:3]
    if head_dim not in TRITON_HEAD_DIMS:
        raise ValueError(f"head_dim={head_dim} is not supported by the Triton attention kernel; "
                         f"supported head dims are {TRITON_HEAD_DIMS}")
    if qkv.stride(-1) != 1:
        raise ValueError(f"qkv's last dim must be unit-stride, got strides {tuple(qkv.stride())}")
    device = qkv.device
    if utils.device_unsupported(device):
        raise ValueError(f"qkv is on {device}: the Triton kernel needs CUDA tensors (or TRITON_INTERPRET=1 on CPU)")
    if utils.INTERPRET and qkv.dtype == torch.bfloat16:
        raise NotImplementedError(utils.INTERPRETER_BF16_DOT)
    if num_heads > 65535:  # CUDA's limit on grid dim y
        raise ValueError(f"num_heads={num_heads} must be <= 65535")
    if not math.isfinite(float(scale)):
        raise ValueError(f"scale must be finite, got {scale!r}")
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int) or max_seqlen < 0:
        raise ValueError(f"max_seqlen must be a non-negative int, got {max_seqlen!r}")

    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1 \
            or cu_seqlens.shape[0] < 1:
        raise TypeError(f"cu_seqlens must be a 1-D int32 tensor of n + 1 offsets, got "
                        f"{getattr(cu_seqlens, 'dtype', type(cu_seqlens).__name__)} "
                        f"{tuple(getattr(cu_seqlens, 'shape', ()))}")
    if cu_seqlens.device != device:
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but qkv is on {device}")
    n = cu_seqlens.shape[0] - 1
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    first, last, shortest, longest = torch.stack([
        cu_seqlens[0], cu_seqlens[-1], lengths.min() if n else cu_seqlens[0] * 0,
        lengths.max() if n else cu_seqlens[0] * 0]).tolist()
    if first != 0 or last != T or shortest < 0:
        raise ValueError(f"cu_seqlens must rise from 0 to T={T} (qkv.shape[0]) without going down; got first "
                         f"{first}, last {last}, a step of {shortest}")
    if longest > max_seqlen:
        raise ValueError(f"max_seqlen={max_seqlen} is shorter than the longest sequence ({longest} tokens)")

    if key_valid is not None:
        if not isinstance(key_valid, torch.Tensor):
            raise TypeError(f"key_valid must be a torch.Tensor or None, got {type(key_valid).__name__}")
        if key_valid.dtype != torch.bool:
            raise TypeError(f"key_valid.dtype={key_valid.dtype}; it must be torch.bool (True = real key)")
        if key_valid.device != device:
            raise ValueError(f"key_valid is on {key_valid.device} but qkv is on {device}")
        if tuple(key_valid.shape) != (n, max_seqlen):
            raise ValueError(f"key_valid has shape {tuple(key_valid.shape)}, expected (n, max_seqlen)=({n}, "
                             f"{max_seqlen})")
        if n and (shortest != max_seqlen or longest != max_seqlen):
            raise ValueError(f"with key_valid (the padded layout) every sequence must have max_seqlen={max_seqlen} "
                             f"tokens; got lengths {shortest}..{longest}")

    if bias is not None:
        _check_table("bias", bias, "or None", "the bias table", device,
                     isinstance(bias, torch.Tensor) and bias.dim() == 2 and bias.shape[0] == num_heads
                     and bias.shape[1] % 2 == 1,
                     f"(num_heads, 2L - 1)=({num_heads}, an odd width) for distances -(L - 1)..(L - 1)")

    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 0):
        raise ValueError(f"window must be None or a non-negative int, got {window!r}")
    if rotary is not None:
        pair = isinstance(rotary, (tuple, list)) and len(rotary) == 2
        if not pair and (isinstance(rotary, torch.Tensor) or not hasattr(rotary, "cos") or not hasattr(rotary, "sin")):
            raise TypeError(f"rotary must be None, a (cos, sin) pair or an object with .cos and .sin, got "
                            f"{type(rotary).__name__}")
        cos, sin = rotary_tables(rotary)
        for name, table in (("rotary cos", cos), ("rotary sin", sin)):
            _check_table(name, table, "", "the rotary tables", device,
                         isinstance(table, torch.Tensor) and tuple(table.shape) == (T, head_dim // 2),
                         f"(T, head_dim / 2)=({T}, {head_dim // 2})")
        if cos.stride() != sin.stride():
            raise ValueError(f"rotary cos and sin must have the same strides, got {tuple(cos.stride())} and "
                             f"{tuple(sin.stride())}")

    if c2p is not None or p2c is not None or column is not None:
        _check_disentangled(c2p, p2c, column, T, num_heads, device)
        _refuse_with_disentangled(bias, window, rotary)
    if not isinstance(uniform_padded_queries, bool):
        raise TypeError(f"uniform_padded_queries must be a bool, got {uniform_padded_queries!r}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    if causal and (c2p is not None or p2c is not None):
        raise ValueError("disentangled attention (c2p/p2c) cannot be combined with causal=True (no family does)")

    hidden = num_heads * head_dim
    if out is not None:
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out must be a torch.Tensor or None, got {type(out).__name__}")
        if tuple(out.shape) != (T, hidden):
            raise ValueError(f"out has shape {tuple(out.shape)}, expected (T, num_heads*head_dim)=({T}, {hidden})")
        if out.dtype != qkv.dtype:
            raise TypeError(f"out.dtype={out.dtype} does not match qkv.dtype={qkv.dtype}")
        if out.device != device:
            raise ValueError(f"out is on {out.device} but qkv is on {device}")
        if out.stride(-1) != 1:
            raise ValueError(f"out's last dim must be unit-stride, got strides {tuple(out.stride())}")
    return launch(qkv, cu_seqlens, max_seqlen, scale, key_valid, out, config, bias, window, rotary, c2p, p2c, column,
                  uniform_padded_queries, kv_heads, causal=causal)


_TERM_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _check_disentangled(c2p, p2c, column, T: int, num_heads: int, device) -> None:
    """The c2p / p2c tables [T, nh, P] and the int32 column table [2L - 1] of values in [0, P) (one host read)."""
    if c2p is None and p2c is None:
        raise ValueError("column was given without c2p or p2c: disentangled attention needs at least one of them")
    widths = set()
    for name, table in (("c2p", c2p), ("p2c", p2c)):
        if table is None:
            continue
        if not isinstance(table, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None, got {type(table).__name__}")
        if table.dtype not in _TERM_DTYPES:
            raise TypeError(f"{name}.dtype={table.dtype}; it must be one of {', '.join(map(str, _TERM_DTYPES))}")
        if table.dim() != 3 or tuple(table.shape[:2]) != (T, num_heads) or table.shape[2] < 1:
            raise ValueError(f"{name} has shape {tuple(table.shape)}, expected (T, num_heads, P)=({T}, {num_heads}, P)")
        if table.device != device:
            raise ValueError(f"{name} is on {table.device} but qkv is on {device}")
        if table.stride(-1) != 1 and table.shape[2] > 1:
            raise ValueError(f"{name}'s last dim (P) must be unit-stride, got strides {tuple(table.stride())}")
        widths.add(table.shape[2])
    if len(widths) > 1:
        raise ValueError(f"c2p and p2c must have the same P, got c2p {tuple(c2p.shape)} and p2c {tuple(p2c.shape)}")
    if not isinstance(column, torch.Tensor):
        raise TypeError(f"column must be an int32 torch.Tensor [2L - 1] with c2p/p2c, got {type(column).__name__}")
    if column.dtype != torch.int32:
        raise TypeError(f"column.dtype={column.dtype}; it must be torch.int32")
    if column.dim() != 1 or column.shape[0] % 2 != 1:
        raise ValueError(f"column has shape {tuple(column.shape)}, expected (2L - 1,) (an odd length) for distances "
                         f"-(L - 1)..(L - 1)")
    if column.device != device:
        raise ValueError(f"column is on {column.device} but qkv is on {device}")
    if column.stride(0) != 1 and column.shape[0] > 1:
        raise ValueError(f"column must be unit-stride, got stride {column.stride(0)}")
    width = widths.pop()
    low, high = torch.stack([column.min(), column.max()]).tolist()
    if low < 0 or high >= width:
        raise ValueError(f"column's values must lie in [0, P) = [0, {width}) (columns of c2p/p2c), got {low}..{high}")


# --------------------------------------------------------------------------------------------------------------------
# Ahead-of-time compile specs (tests/tooling/test_aot.py compiles each for sm_90 and sm_80 and rejects spills)
# --------------------------------------------------------------------------------------------------------------------
def aot_specs() -> list[dict]:
    """One spec per dtype (x input precision for fp32) x head dim x mask variant x config of attention_configs(),
    the bias variants (both mask variants) at the head dims of BIAS_AOT_HEAD_DIMS, the window/rotary variants at
    WINDOW_AOT_HEAD_DIMS and DeBERTa's (DISENTANGLED_AOT, below), each the specialisation the JIT builds at run time
    for BERT's tensors:
    - the unit stride of key_valid [n, S] is the constant 1 (Triton specialises an int argument equal to 1; the
      launcher passes 1 in the unmasked variant too, where it is not read); so are the bias table's row stride and
      reach in the unbiased variant;
    - qkv/out/cu_seqlens pointers and the qkv/out strides get the default divisibility-16 hint (torch allocations;
      3H, H, hd and nh*hd are multiples of 16 for every supported head dim), which is what lets loads vectorise and
      go through cp.async;
    - max_seqlen, the key_valid row stride (= S) and the bias table's reach and row stride (L - 1, 2L - 1) are
      arbitrary at run time: no hint; nor is the column table's reach L - 1. The c2p/p2c strides keep the default
      hint: [T, nh, P] or its [nh, T, P] transpose, P = 2 x 256 buckets in DeBERTa-v2/v3.
    - the group size kv_group is the constant 1 where every query head has its own key/value head (BERT's binaries
      unchanged); the grouped variants (GQA_AOT_HEAD_DIMS) take it as an i32 without a hint (EuroBERT's 3), and
      their block of key/value heads kv x hd keeps the default hint (hd is a multiple of 16).
    """
    return [spec for spec in _aot_specs() if _in_suite(spec)]


def _in_suite(spec: dict) -> bool:
    constexprs, qkv_type = spec["constexprs"], spec["signature"]["qkv_ptr"]
    if constexprs["CAUSAL"]:  # Qwen3-Embedding's layers: hd 128, fp16/bf16
        return constexprs["HEAD_DIM"] in CAUSAL_AOT_HEAD_DIMS and qkv_type in ("*fp16", "*bf16")
    if "kv_group" in spec["signature"]:
        return constexprs["HEAD_DIM"] in GQA_AOT_HEAD_DIMS and qkv_type in ("*fp16", "*bf16")
    if constexprs["HAS_C2P"] or constexprs["HAS_P2C"]:
        form = (constexprs["HAS_C2P"], constexprs["HAS_P2C"], constexprs["HAS_MASK"])
        return constexprs["HEAD_DIM"] == 64 and qkv_type in DISENTANGLED_AOT.get(form, ())
    if constexprs["HAS_BIAS"] and constexprs["HEAD_DIM"] not in BIAS_AOT_HEAD_DIMS:
        return False
    if constexprs["HAS_WINDOW"] or constexprs["HAS_ROTARY"]:
        return constexprs["HEAD_DIM"] in WINDOW_AOT_HEAD_DIMS and qkv_type in ("*fp16", "*bf16")
    return True


# The families with a relative bias (MPNet, DeBERTa-v3; ALiBi models) run hd 64; the others are compiled by hand
# with `python tests/tooling/aot_compile.py fastbert.kernels.attention --specs-fn all_aot_specs`
# (the suite keeps to 60).
BIAS_AOT_HEAD_DIMS = (64,)
# ModernBERT-base/large run hd 64 (window and rotary); hd 32 for the small models. fp16/bf16: the fast path.
WINDOW_AOT_HEAD_DIMS = (32, 64)
# DeBERTa-v2/v3 (hd 64) in the suite, (HAS_C2P, HAS_P2C, HAS_MASK) -> qkv dtypes: both terms packed in fp16 and
# bf16, padded in fp16; c2p alone packed in fp16. The rest (p2c alone, fp32, other head dims) only in all_aot_specs().
DISENTANGLED_AOT = {(True, True, False): ("*fp16", "*bf16"), (True, True, True): ("*fp16",),
                    (True, False, False): ("*fp16",)}
# Grouped-query attention with rotary q/k, as EuroBERT runs it (fp16/bf16): hd 64 (EuroBERT-210m/610m) and 128 (2.1B)
GQA_AOT_HEAD_DIMS = (64, 128)
# Causal rotary attention over grouped key/value heads, as Qwen3-Embedding runs it (hd 128 at 0.6B, 4B and 8B)
CAUSAL_AOT_HEAD_DIMS = (128,)
# (HAS_MASK, HAS_BIAS, HAS_WINDOW, HAS_ROTARY, HAS_C2P, HAS_P2C, grouped, CAUSAL): BERT's, the relative-bias
# families', ModernBERT's local layers (window and rotary; window alone) and global layers (rotary alone), DeBERTa's
# (c2p and p2c; either), EuroBERT's (rotary over grouped key/value heads), Qwen3's (the same, causal)
_VARIANTS = [(mask, bias, False, False, False, False, False, False) for bias in (False, True)
             for mask in (True, False)] + \
    [(mask, False, window, rotary, False, False, False, False) for window, rotary in ((True, False), (True, True),
                                                                                     (False, True))
     for mask in (True, False)] + \
    [(mask, False, False, False, c2p, p2c, False, False) for c2p, p2c in ((True, True), (True, False), (False, True))
     for mask in (True, False)] + \
    [(mask, False, False, True, False, False, True, causal) for causal in (False, True) for mask in (True, False)]


def all_aot_specs() -> list[dict]:
    """Every variant the launcher can run, at every dtype and head dim."""
    return _aot_specs()


def _aot_specs() -> list[dict]:
    specs = []
    for dtype, tag in _DTYPES.items():
        precisions = ("ieee", "tf32") if dtype == torch.float32 else ("ieee",)
        for precision in precisions:
            for head_dim in TRITON_HEAD_DIMS:
                for has_mask, has_bias, has_window, has_rotary, has_c2p, has_p2c, grouped, causal in _VARIANTS:
                    for config in attention_configs(dtype, head_dim, precision, has_rotary, has_c2p or has_p2c):
                        bm, bn, warps, stages, maxnreg = _key(config)
                        name = "-".join(["attention", tag] + ([precision] if dtype == torch.float32 else []) +
                                        [f"hd{head_dim}", "mask" if has_mask else "nomask"] +
                                        (["bias"] if has_bias else []) + (["window"] if has_window else []) +
                                        (["rotary"] if has_rotary else []) + (["c2p"] if has_c2p else []) +
                                        (["p2c"] if has_p2c else []) + (["gqa"] if grouped else []) +
                                        (["causal"] if causal else []) +
                                        [f"{bm}x{bn}-w{warps}-s{stages}" + (f"-r{maxnreg}" if maxnreg else "")])
                        bias_args = {"bias_reach": "i32", "stride_bias_h": "i32"} if has_bias else {}
                        # window: ModernBERT's 64 gets the JIT's divisibility-16 hint (the default here); so does
                        # the rotary tables' row stride hd/2 at hd >= 32
                        window_args = {"window": "i32"} if has_window else {}
                        rotary_args = {"stride_rot_t": "i32"} if has_rotary else {}
                        # the column table's reach takes bias_reach's place (never both)
                        reach_args = {"bias_reach": "i32"} if (has_c2p or has_p2c) and not has_bias else {}
                        c2p_args = {"stride_c2p_t": "i32", "stride_c2p_h": "i32"} if has_c2p else {}
                        p2c_args = {"stride_p2c_t": "i32", "stride_p2c_h": "i32"} if has_p2c else {}
                        group_args = {"kv_group": "i32"} if grouped else {}
                        specs.append({
                            "name": name,
                            "fn": _attention_fwd_kernel,
                            "signature": {
                                "qkv_ptr": f"*{tag}", "cu_seqlens_ptr": "*i32", "key_valid_ptr": "*i8",
                                "kv_end_ptr": "*i32", "out_ptr": f"*{tag}", "bias_ptr": "*fp32", "max_seqlen": "i32",
                                "lse_ptr": "*fp32", "seed_ptr": "*i64", "dropout_p": "fp32",
                                "qk_scale": "fp32", "stride_qkv_t": "i32", "stride_qkv_which": "i32",
                                "stride_qkv_h": "i32", "stride_mask_b": "i32", "stride_out_t": "i32",
                                "seq_bucket": "i32", "cos_ptr": "*fp32", "sin_ptr": "*fp32", **bias_args,
                                **window_args, **rotary_args, "column_ptr": "*i32", "c2p_ptr": "*fp32",
                                "p2c_ptr": "*fp32", **reach_args, **c2p_args, **p2c_args, **group_args,
                            },
                            "constexprs": {"stride_mask_s": 1, "HEAD_DIM": head_dim,
                                           "HAS_MASK": has_mask, "HAS_BIAS": has_bias, "INPUT_PRECISION": precision,
                                           "HAS_WINDOW": has_window, "HAS_ROTARY": has_rotary,
                                           "HAS_C2P": has_c2p, "HAS_P2C": has_p2c,
                                           "STORE_LSE": False, "DROPOUT": False,  # inference's: the defaults
                                           "CAUSAL": causal,
                                           "BLOCK_M": bm, "BLOCK_N": bn,
                                           **({} if has_bias else {"stride_bias_h": 1}),
                                           **({} if has_bias or reach_args else {"bias_reach": 1}),
                                           **({} if has_c2p else {"stride_c2p_t": 1, "stride_c2p_h": 1}),
                                           **({} if has_p2c else {"stride_p2c_t": 1, "stride_p2c_h": 1}),
                                           **({} if has_window else {"window": 1}),
                                           **({} if has_rotary else {"stride_rot_t": 1}),
                                           **({} if grouped else {"kv_group": 1})},
                            "hints": {"max_seqlen": None, "stride_mask_b": None, "seq_bucket": None,
                                      **{arg: None for arg in {**bias_args, **reach_args, **group_args}}},
                            "num_warps": warps,
                            "num_stages": stages,
                            **({"maxnreg": config.maxnreg} if config.maxnreg else {}),
                        })
    return specs
