"""Flash attention's backward over BERT's packed qkv: dq, dk, dv (and the bias table's gradient) from the saved
log-sum-exp, never an S x S tensor in memory.

    P = softmax(S),  S = q k^T * scale + B,  O = (P o M / (1 - p)) v    (M: dropout's keep mask; no dropout: M = 1)
    dV = (P o M / (1 - p))^T dO
    dP = (dO v^T) o M / (1 - p)
    dS = P o (dP - delta),   delta_i = sum_j P_ij dP_ij = rowsum(dO o O)_i
    dq = dS k * scale,   dk = dS^T q * scale,   dB[h, d] = sum over (i, j) at distance d of dS_ij
    dc2p[tok(i), h, c] = sum over j with column c of dS_ij,   dp2c[tok(j), h, c] = sum over i with column c of dS_ij

Why it pays. Autograd through HF's eager attention keeps the probabilities [B, nh, S, S] (and dropout's mask) for the
backward, and runs ~6 passes over S x S tensors there (dP, the softmax backward's product, sum and subtraction, the
mask's and the scale's gradients): at B = 32, S = 512, BERT-base in fp16 that is 200 MB saved per layer and over 1 GB
of backward traffic. Here the forward saves one fp32 number per (query, head) (its log-sum-exp, `lse`), and each
backward program recomputes its tiles of P from q, k and lse in registers: the traffic is reading qkv, O and dO and
writing dqkv, a few times T x nh x hd.

Two kernels, no atomics for q, k and v (FlashAttention-2's split):
- dK/dV: one program per (key block, key/value head, sequence), k and v of its block held in registers, looping over
  the query blocks that see them, and, with grouped key/value heads (EuroBERT), over the G query heads of its group,
  so a key's gradient sums its group's heads in registers and is stored once.
- dQ: one program per (query block, query head, sequence), looping over the key blocks as the forward does; it also
  reduces the bias table's gradient (MPNet), with fp32 atomics into [nh, 2L - 1]: every score of a head at one
  distance adds into one entry, so the sum's order (and its last bits) varies from run to run.
- DeBERTa's terms (c2p per query token, p2c per key token, [T, nh, P], one column per distance): the dQ kernel adds
  dS into c2p's gradient rows of its queries, the dK/dV kernel into p2c's rows of its keys, fp32 atomics because
  many pairs of a tile share a column (the same caveat on the order). Its padded-query rule (mask_i * mask_j: such a
  query is its row's mean value) runs the kernels with that query's dO zeroed, and one torch reduction gives each
  value of the row dO / S.
delta = rowsum(dO o O) is one small torch reduction ([T, nh] fp32) before both.

The forward's rules hold here as there (kernels/attention.py): varlen sequences over cu_seqlens, or padded rows with
key_valid (holes, left padding; a fully padded row is HF's uniform answer, run as a zero query over all S keys, so its
queries get no gradient, and each of its keys gets dO / S into dv); the window's blocks (query blocks outside a key
block's band are not visited, as key blocks outside a query block's are not); rotary (q and k rotated as they are
loaded, and dq, dk rotated back, by the transpose of the rotation, before they are stored: the gradient is w.r.t. the
unrotated qkv); dropout's keep bits drawn again from the forward's seed at the same element numbers
((query token * nh + head) * max_seqlen + key position), so the mask is the forward's. fp32 accumulation; tl.dot
honours the input_precision rule of the forward (tf32 for fp32 only when torch's allow_tf32 is on).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import utils
from .attention import _LOG2E, LOG2E, _heads, _placeholder, _rotate, last_real_key
from .utils import DTYPES as _DTYPES
from .utils import dropout_keep, input_precision, loop_bound

# As the forward: the lengths and the padded row stride change with every batch and are not specialised.
BACKWARD_DO_NOT_SPECIALIZE = ("max_seqlen", "stride_mask_b", "seq_bucket")


@triton.jit
def _load_qk(base, rows, cols, mask, stride_t, cos_ptr, sin_ptr, rot_base, stride_rot_t,
             HEAD_DIM: tl.constexpr, HAS_ROTARY: tl.constexpr):
    """A q or k tile, token positions `rows` and head-dim columns `cols` (broadcastable 2-D index tiles, either
    orientation), rotated (rotate-half, per-token cos/sin) as the forward rotates it when HAS_ROTARY."""
    x = tl.load(base + rows * stride_t + cols, mask=mask, other=0.0)
    if HAS_ROTARY:
        HALF: tl.constexpr = HEAD_DIM // 2
        partner = tl.load(base + rows * stride_t + (cols + HALF) % HEAD_DIM, mask=mask, other=0.0)
        rot = rot_base + rows * stride_rot_t + cols % HALF
        x = _rotate(x, partner, tl.load(cos_ptr + rot, mask=mask, other=0.0),
                    tl.load(sin_ptr + rot, mask=mask, other=0.0), tl.where(cols < HALF, -1.0, 1.0))
    return x


@triton.jit
def _unrotate(g, rows, row_mask, cos_ptr, sin_ptr, rot_base, stride_rot_t, HEAD_DIM: tl.constexpr):
    """The gradient w.r.t. the unrotated rows from `g` [R, HEAD_DIM] (fp32), the gradient w.r.t. the rotated ones:
    the rotation's transpose, (g1, g2) -> (g1 cos + g2 sin, g2 cos - g1 sin) on the two halves."""
    HALF: tl.constexpr = HEAD_DIM // 2
    R: tl.constexpr = g.shape[0]
    rot = rot_base + rows[:, None] * stride_rot_t + tl.arange(0, HALF)[None, :]
    cos = tl.load(cos_ptr + rot, mask=row_mask[:, None], other=0.0)
    sin = tl.load(sin_ptr + rot, mask=row_mask[:, None], other=0.0)
    g1, g2 = tl.split(tl.permute(tl.reshape(g, [R, 2, HALF]), (0, 2, 1)))
    back = tl.join(g1 * cos + g2 * sin, g2 * cos - g1 * sin)  # [R, HALF, 2]
    return tl.reshape(tl.permute(back, (0, 2, 1)), [R, HEAD_DIM])


@triton.jit
def _probs(s, lse2, qi, kj, live, bias_row, bias_reach, bias_gain, window,
           HAS_BIAS: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """The forward's probabilities of one tile, recomputed: s = q.k * scale * log2(e), the bias added as the forward
    adds it, exp2(s - lse * log2(e)); 0 where `live` (real query and key) is False or outside the window. qi / kj:
    query / key positions as broadcastable 2-D tiles (either orientation)."""
    if HAS_BIAS:
        s += tl.load(bias_row + tl.minimum(tl.maximum(kj - qi + bias_reach, 0), 2 * bias_reach)) * bias_gain
    if HAS_WINDOW:
        live = live & (tl.abs(kj - qi) <= window)
    return tl.where(live, tl.math.exp2(s - lse2), 0.0)


@triton.jit
def _terms(column_ptr, c2p_base, p2c_base, stride_c2p_t, stride_p2c_t, qi, kj, reach, q_rows, k_rows,
           HAS_C2P: tl.constexpr, HAS_P2C: tl.constexpr):
    """DeBERTa's terms of one tile as the forward gathers them (kernels/attention.py, _disentangled), with the column
    of each pair (where its gradient goes), for broadcastable 2-D position tiles qi / kj (either orientation); q_rows
    / k_rows are the positions clamped into the sequence."""
    col = tl.load(column_ptr + tl.minimum(tl.maximum(kj - qi + reach, 0), 2 * reach))
    term = tl.zeros(col.shape, dtype=tl.float32)
    if HAS_C2P:
        term += tl.load(c2p_base + (q_rows * stride_c2p_t + col)).to(tl.float32)
    if HAS_P2C:
        term += tl.load(p2c_base + (k_rows * stride_p2c_t + col)).to(tl.float32)
    return term, col


@triton.jit(do_not_specialize=BACKWARD_DO_NOT_SPECIALIZE)
def _attention_bwd_dkdv_kernel(
    # pointers
    qkv_ptr,  # [T, 3, nh, hd] or grouped [T, nh + 2 kv, hd], as the forward read it
    do_ptr,  # [T, nh*hd] the output's gradient, hd unit-stride
    lse_ptr, delta_ptr,  # [T, nh] fp32: the forward's log-sum-exp, rowsum(dO o O)
    cu_seqlens_ptr, key_valid_ptr, kv_end_ptr,  # as the forward's
    bias_ptr, cos_ptr, sin_ptr, seed_ptr,  # as the forward's (read only when HAS_BIAS / HAS_ROTARY / DROPOUT)
    column_ptr, c2p_ptr, p2c_ptr,  # DeBERTa's tables, as the forward's (read only when HAS_C2P / HAS_P2C)
    dqkv_ptr,  # [T, 3, nh, hd] or grouped (out): this kernel writes its dk and dv parts
    dterm_ptr,  # [T, nh, P] fp32, zeroed (out, atomics): p2c's gradient; written only when HAS_P2C
    # sizes
    max_seqlen, qk_scale, sm_scale, bias_reach, window, kv_group, dropout_p,
    # strides (in elements)
    stride_qkv_t, stride_qkv_which, stride_qkv_h,
    stride_dqkv_t, stride_dqkv_which, stride_dqkv_h,
    stride_do_t, stride_mask_b, stride_mask_s, stride_bias_h, stride_rot_t,
    stride_c2p_t, stride_c2p_h, stride_p2c_t, stride_p2c_h,
    stride_dterm_t, stride_dterm_h,  # of the fp32 gradient tables (contiguous [T, nh, P]: nh P, P)
    seq_bucket,  # next_power_of_2(max_seqlen): a tuning key only, not read
    # meta-parameters
    HEAD_DIM: tl.constexpr, HAS_MASK: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,  # queries per loop iteration
    BLOCK_N: tl.constexpr,  # keys per program
    HAS_BIAS: tl.constexpr = False, HAS_WINDOW: tl.constexpr = False, HAS_ROTARY: tl.constexpr = False,
    DROPOUT: tl.constexpr = False, HAS_C2P: tl.constexpr = False, HAS_P2C: tl.constexpr = False,
):
    # Grid: (key blocks x sequences, key/value heads)
    pid = tl.program_id(0)
    num_n_blocks = tl.cdiv(max_seqlen, BLOCK_N)
    seq = pid // num_n_blocks
    start_n = (pid % num_n_blocks) * BLOCK_N
    kv_head = tl.program_id(1).to(tl.int64)
    num_heads = tl.num_programs(1) * kv_group

    seq_start = tl.load(cu_seqlens_ptr + seq).to(tl.int64)
    seq_len = tl.load(cu_seqlens_ptr + seq + 1) - tl.load(cu_seqlens_ptr + seq)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_mb = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    if HAS_MASK:  # the forward's rules, see kernels/attention.py
        kv_end = tl.load(kv_end_ptr + seq)
        n_end = tl.where(kv_end == 0, seq_len, kv_end)
        q_end = tl.where(kv_end == 0, 0, seq_len)
        bias_gain = tl.where(kv_end == 0, 0.0, LOG2E)
        bias_on = tl.where(kv_end == 0, 0.0, 1.0)
        key_valid = tl.load(key_valid_ptr + seq * stride_mask_b + offs_n * stride_mask_s, mask=offs_n < kv_end,
                            other=1)
        key_ok = (key_valid != 0) & (offs_n < n_end)
    else:
        n_end = seq_len
        q_end = seq_len
        bias_gain = LOG2E
        bias_on = 1.0
        key_ok = offs_n < n_end
    in_range = offs_n < n_end
    rot_base = seq_start * stride_rot_t
    kv_base = qkv_ptr + kv_head * stride_qkv_h + seq_start * stride_qkv_t
    k = _load_qk(kv_base + kv_group * stride_qkv_which, offs_n[:, None], offs_d[None, :], in_range[:, None],
                 stride_qkv_t, cos_ptr, sin_ptr, rot_base, stride_rot_t, HEAD_DIM, HAS_ROTARY)
    v = tl.load(kv_base + (kv_group + 1) * stride_qkv_which + offs_n[:, None] * stride_qkv_t + offs_d[None, :],
                mask=in_range[:, None], other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    if DROPOUT:
        keep_scale = 1.0 / (1.0 - dropout_p)
        if HAS_MASK:
            undropped = kv_end == 0
            keep_scale = tl.where(undropped, 1.0, keep_scale)

    # The queries that saw this key block: all of the sequence's (none when the block lies past the row's last real
    # key, which no query read), or with a window those of [start_n - w, start_n + BLOCK_N - 1 + w].
    lo = 0
    hi = tl.where(start_n < n_end, seq_len, 0)
    if HAS_WINDOW:
        lo = tl.maximum(start_n - window, 0) // BLOCK_M * BLOCK_M
        hi = tl.minimum(hi, start_n + BLOCK_N + window)
    for g in range(0, loop_bound(kv_group)):
        head = kv_head * kv_group + g
        q_base = qkv_ptr + head * stride_qkv_h + seq_start * stride_qkv_t
        do_base = do_ptr + seq_start * stride_do_t + head * HEAD_DIM
        bias_row = bias_ptr + head * stride_bias_h
        c2p_base = c2p_ptr + head * stride_c2p_h + seq_start * stride_c2p_t
        p2c_base = p2c_ptr + head * stride_p2c_h + seq_start * stride_p2c_t
        dp2c_base = dterm_ptr + head * stride_dterm_h + seq_start * stride_dterm_t
        for start_m in range(loop_bound(lo), loop_bound(hi), BLOCK_M):
            offs_m = start_m + offs_mb
            row_ok = offs_m < seq_len
            q_t = _load_qk(q_base, offs_m[None, :], offs_d[:, None], (offs_m < q_end)[None, :], stride_qkv_t,
                           cos_ptr, sin_ptr, rot_base, stride_rot_t, HEAD_DIM, HAS_ROTARY)  # [HEAD_DIM, BLOCK_M]
            do = tl.load(do_base + offs_m[:, None] * stride_do_t + offs_d[None, :], mask=row_ok[:, None], other=0.0)
            stat = (seq_start + offs_m) * num_heads + head
            lse2 = tl.load(lse_ptr + stat, mask=row_ok, other=0.0) * LOG2E
            delta = tl.load(delta_ptr + stat, mask=row_ok, other=0.0)
            # P^T [BLOCK_N, BLOCK_M]: keys on rows, so dV and dK are plain dots
            s_t = tl.dot(k, q_t, input_precision=INPUT_PRECISION) * qk_scale
            if HAS_C2P or HAS_P2C:
                term, col = _terms(column_ptr, c2p_base, p2c_base, stride_c2p_t, stride_p2c_t, offs_m[None, :],
                                   offs_n[:, None], bias_reach, tl.minimum(offs_m, seq_len - 1)[None, :],
                                   tl.minimum(offs_n, seq_len - 1)[:, None], HAS_C2P, HAS_P2C)
                s_t += term * bias_gain
            p_t = _probs(s_t, lse2[None, :], offs_m[None, :], offs_n[:, None], key_ok[:, None] & row_ok[None, :],
                         bias_row, bias_reach, bias_gain, window, HAS_BIAS, HAS_WINDOW)
            dp_t = tl.dot(v, tl.trans(do), input_precision=INPUT_PRECISION)
            if DROPOUT:
                keep = dropout_keep(seed_ptr, stat[None, :] * max_seqlen + offs_n[:, None], dropout_p)
                if HAS_MASK:
                    keep = keep | undropped
                dv += tl.dot(tl.where(keep, p_t * keep_scale, 0.0).to(do.dtype), do,
                             input_precision=INPUT_PRECISION)
                dp_t = tl.where(keep, dp_t * keep_scale, 0.0)
            else:
                dv += tl.dot(p_t.to(do.dtype), do, input_precision=INPUT_PRECISION)
            ds_t = p_t * (dp_t - delta[None, :])
            dk += tl.dot(ds_t.to(q_t.dtype), tl.trans(q_t), input_precision=INPUT_PRECISION)
            if HAS_P2C:  # dp2c[tok(j), h, column] += dS_ij: this program's keys, many queries to one column
                tl.atomic_add(dp2c_base + offs_n[:, None] * stride_dterm_t + col, ds_t * bias_on,
                              mask=key_ok[:, None] & row_ok[None, :])

    dk *= sm_scale
    store_ok = offs_n < seq_len  # keys past the row's last real key get zeros: no query read them
    if HAS_ROTARY:
        dk = _unrotate(dk, offs_n, store_ok, cos_ptr, sin_ptr, rot_base, stride_rot_t, HEAD_DIM)
    dkv_base = dqkv_ptr + kv_head * stride_dqkv_h + seq_start * stride_dqkv_t
    rows = offs_n[:, None] * stride_dqkv_t + offs_d[None, :]
    tl.store(dkv_base + kv_group * stride_dqkv_which + rows, dk.to(dqkv_ptr.dtype.element_ty),
             mask=store_ok[:, None])
    tl.store(dkv_base + (kv_group + 1) * stride_dqkv_which + rows, dv.to(dqkv_ptr.dtype.element_ty),
             mask=store_ok[:, None])


@triton.jit(do_not_specialize=BACKWARD_DO_NOT_SPECIALIZE)
def _attention_bwd_dq_kernel(
    # pointers: as the dK/dV kernel's, and the bias table's gradient
    qkv_ptr, do_ptr, lse_ptr, delta_ptr, cu_seqlens_ptr, key_valid_ptr, kv_end_ptr, bias_ptr, cos_ptr, sin_ptr,
    seed_ptr, column_ptr, c2p_ptr, p2c_ptr,
    dqkv_ptr,  # (out): this kernel writes its dq part
    dterm_ptr,  # [T, nh, P] fp32, zeroed (out, atomics): c2p's gradient; written only when HAS_C2P
    dbias_ptr,  # [nh, 2L - 1] fp32, zeroed by the launcher (out, atomics); written only when HAS_BIAS
    # sizes
    max_seqlen, qk_scale, sm_scale, bias_reach, window, kv_group, dropout_p,
    # strides (in elements)
    stride_qkv_t, stride_qkv_which, stride_qkv_h,
    stride_dqkv_t, stride_dqkv_which, stride_dqkv_h,
    stride_do_t, stride_mask_b, stride_mask_s, stride_bias_h, stride_rot_t,
    stride_c2p_t, stride_c2p_h, stride_p2c_t, stride_p2c_h, stride_dterm_t, stride_dterm_h,
    seq_bucket,
    # meta-parameters
    HEAD_DIM: tl.constexpr, HAS_MASK: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,  # queries per program
    BLOCK_N: tl.constexpr,  # keys per loop iteration
    HAS_BIAS: tl.constexpr = False, HAS_WINDOW: tl.constexpr = False, HAS_ROTARY: tl.constexpr = False,
    DROPOUT: tl.constexpr = False, HAS_C2P: tl.constexpr = False, HAS_P2C: tl.constexpr = False,
):
    # Grid: (query blocks x sequences, query heads), as the forward's
    pid = tl.program_id(0)
    num_m_blocks = tl.cdiv(max_seqlen, BLOCK_M)
    seq = pid // num_m_blocks
    start_m = (pid % num_m_blocks) * BLOCK_M
    head = tl.program_id(1).to(tl.int64)
    kv_head = (tl.program_id(1) // kv_group).to(tl.int64)
    num_heads = tl.num_programs(1)

    seq_start = tl.load(cu_seqlens_ptr + seq).to(tl.int64)
    seq_len = tl.load(cu_seqlens_ptr + seq + 1) - tl.load(cu_seqlens_ptr + seq)
    live = start_m < seq_len
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_nb = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    if HAS_MASK:
        kv_end = tl.load(kv_end_ptr + seq)
        n_end = tl.where(kv_end == 0, seq_len, kv_end)
        q_end = tl.where(kv_end == 0, 0, seq_len)
        bias_gain = tl.where(kv_end == 0, 0.0, LOG2E)
        bias_on = tl.where(kv_end == 0, 0.0, 1.0)  # a fully padded row's scores ignore the table
    else:
        n_end = seq_len
        q_end = seq_len
        bias_gain = LOG2E
        bias_on = 1.0
    n_end = tl.where(live, n_end, 0)
    row_ok = offs_m < seq_len
    rot_base = seq_start * stride_rot_t
    q = _load_qk(qkv_ptr + head * stride_qkv_h + seq_start * stride_qkv_t, offs_m[:, None], offs_d[None, :],
                 (offs_m < q_end)[:, None], stride_qkv_t, cos_ptr, sin_ptr, rot_base, stride_rot_t, HEAD_DIM,
                 HAS_ROTARY)
    do = tl.load(do_ptr + seq_start * stride_do_t + head * HEAD_DIM + offs_m[:, None] * stride_do_t + offs_d[None, :],
                 mask=row_ok[:, None], other=0.0)
    stat = (seq_start + offs_m) * num_heads + head
    lse2 = tl.load(lse_ptr + stat, mask=row_ok, other=0.0) * LOG2E
    delta = tl.load(delta_ptr + stat, mask=row_ok, other=0.0)
    kv_base = qkv_ptr + kv_head * stride_qkv_h + seq_start * stride_qkv_t
    k_base = kv_base + kv_group * stride_qkv_which
    v_base = kv_base + (kv_group + 1) * stride_qkv_which
    bias_row = bias_ptr + head * stride_bias_h
    dbias_row = dbias_ptr + head * (2 * bias_reach + 1)
    c2p_base = c2p_ptr + head * stride_c2p_h + seq_start * stride_c2p_t
    p2c_base = p2c_ptr + head * stride_p2c_h + seq_start * stride_p2c_t
    dc2p_base = dterm_ptr + head * stride_dterm_h + seq_start * stride_dterm_t
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    if DROPOUT:
        keep_scale = 1.0 / (1.0 - dropout_p)
        if HAS_MASK:
            undropped = kv_end == 0
            keep_scale = tl.where(undropped, 1.0, keep_scale)

    lo = 0
    hi = n_end
    if HAS_WINDOW:  # the forward's band of key blocks
        lo = tl.maximum(start_m - window, 0) // BLOCK_N * BLOCK_N
        hi = tl.minimum(hi, start_m + BLOCK_M + window)
    for start_n in range(loop_bound(lo), loop_bound(hi), BLOCK_N):
        offs_n = start_n + offs_nb
        in_range = offs_n < n_end
        k_t = _load_qk(k_base, offs_n[None, :], offs_d[:, None], in_range[None, :], stride_qkv_t, cos_ptr, sin_ptr,
                       rot_base, stride_rot_t, HEAD_DIM, HAS_ROTARY)  # [HEAD_DIM, BLOCK_N]
        v_t = tl.load(v_base + offs_n[None, :] * stride_qkv_t + offs_d[:, None], mask=in_range[None, :], other=0.0)
        if HAS_MASK:
            key_valid = tl.load(key_valid_ptr + seq * stride_mask_b + offs_n * stride_mask_s, mask=offs_n < kv_end,
                                other=1)
            key_ok = (key_valid != 0) & in_range
        else:
            key_ok = in_range
        live_tile = row_ok[:, None] & key_ok[None, :]
        s = tl.dot(q, k_t, input_precision=INPUT_PRECISION) * qk_scale
        if HAS_C2P or HAS_P2C:
            term, col = _terms(column_ptr, c2p_base, p2c_base, stride_c2p_t, stride_p2c_t, offs_m[:, None],
                               offs_n[None, :], bias_reach, tl.minimum(offs_m, seq_len - 1)[:, None],
                               tl.minimum(offs_n, seq_len - 1)[None, :], HAS_C2P, HAS_P2C)
            s += term * bias_gain
        p = _probs(s, lse2[:, None], offs_m[:, None], offs_n[None, :], live_tile, bias_row, bias_reach, bias_gain,
                   window, HAS_BIAS, HAS_WINDOW)
        dp = tl.dot(do, v_t, input_precision=INPUT_PRECISION)
        if DROPOUT:
            keep = dropout_keep(seed_ptr, stat[:, None] * max_seqlen + offs_n[None, :], dropout_p)
            if HAS_MASK:
                keep = keep | undropped
            dp = tl.where(keep, dp * keep_scale, 0.0)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k_t.dtype), tl.trans(k_t), input_precision=INPUT_PRECISION)
        if HAS_BIAS:  # dB[h, d] += dS at distance d (the clamped end columns collect every farther distance)
            col = tl.minimum(tl.maximum(offs_n[None, :] - offs_m[:, None] + bias_reach, 0), 2 * bias_reach)
            tl.atomic_add(dbias_row + col, ds * bias_on, mask=live_tile)
        if HAS_C2P:  # dc2p[tok(i), h, column] += dS_ij: this program's queries, many keys to one column
            tl.atomic_add(dc2p_base + offs_m[:, None] * stride_dterm_t + col, ds * bias_on, mask=live_tile)

    dq = tl.where((offs_m < q_end)[:, None], dq * sm_scale, 0.0)  # a fully padded row's queries: no gradient
    if HAS_ROTARY:
        dq = _unrotate(dq, offs_m, row_ok, cos_ptr, sin_ptr, rot_base, stride_rot_t, HEAD_DIM)
    tl.store(dqkv_ptr + head * stride_dqkv_h + seq_start * stride_dqkv_t + offs_m[:, None] * stride_dqkv_t
             + offs_d[None, :], dq.to(dqkv_ptr.dtype.element_ty), mask=row_ok[:, None])


# --------------------------------------------------------------------------------------------------------------------
# Tiles
# --------------------------------------------------------------------------------------------------------------------
def _config(block_m: int, block_n: int, num_warps: int, num_stages: int = 1,
            maxnreg: int | None = None) -> triton.Config:
    return triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n}, num_warps=num_warps, num_stages=num_stages,
                         maxnreg=maxnreg)


def backward_configs(dtype: torch.dtype, head_dim: int, input_precision: str = "ieee",
                     gathers: bool = False) -> tuple:
    """(dK/dV tile, dQ tile) for one dtype / head dim / fp32 input precision. BLOCK_N is the dK/dV program's keys and
    the dQ loop's step; BLOCK_M the dK/dV loop's step and the dQ program's queries. The program's own dimension is
    the wide one (FlashAttention-2's split: 32 x 64 / 64 x 32), since its accumulators (dk and dv, or dq) stay in
    registers across the loop. Not autotuned yet: the bias and c2p/p2c atomics would add up over the autotuner's
    trial runs; one tile per key, chosen by registers (tests/tooling/test_aot.py: no spills on sm_90 and sm_80), not
    timed yet:
    - fp32: ptxas's own budget except the dK/dV tile at hd <= 64 (STACK 8 on sm_80 with a key mask there; 255 fits);
    - hd 128: at 4 warps the dQ tile spilled on sm_80 (REG 255, STACK 88-96, Triton 3.9) and the dK/dV tile too
      (STACK 8-16 on sm_90 and sm_80, Triton 3.6); at 8 warps both fit (REG 172-254);
    - `gathers` (a bias table, or DeBERTa's terms): the dK/dV kernel gathers the table (or c2p, p2c and the column
      tile, and adds p2c's gradient) in every tile; at 32 x 64 it spilled on sm_80 (bias with a key mask: STACK 8,
      Triton 3.6; both terms: STACK 208-288 at 4 warps, 40 at 8, Triton 3.9): 16 queries a step (REG 128-233)."""
    if dtype == torch.float32:  # FMA (ieee) or tf32 dots, the accuracy path: small tiles
        if head_dim > 64:
            return _config(16, 16, 4), _config(16, 16, 4)
        return _config(16, 32, 4, maxnreg=255), _config(32, 16, 4)
    if head_dim > 64:
        return _config(32, 64, 8), _config(64, 32, 8, maxnreg=255)
    if gathers:
        return _config(16, 64, 4), _config(64, 32, 4)
    return _config(32, 64, 4), _config(64, 32, 4)


# Under TRITON_INTERPRET=1: small tiles of different heights, so that the short lengths tests afford cross the query
# and key blocks' edges at different places in the two kernels.
_INTERPRETER_CONFIGS = (_config(16, 32, 4), _config(32, 16, 4))


# --------------------------------------------------------------------------------------------------------------------
# The launcher
# --------------------------------------------------------------------------------------------------------------------
def attention_backward(do: torch.Tensor, qkv: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                       cu_seqlens: torch.Tensor, max_seqlen: int, scale: float,
                       key_valid: torch.Tensor | None = None, *, bias: torch.Tensor | None = None,
                       window: int | None = None, rotary=None, kv_heads: int | None = None,
                       dropout_p: float = 0.0, seed: torch.Tensor | None = None,
                       c2p: torch.Tensor | None = None, p2c: torch.Tensor | None = None,
                       column: torch.Tensor | None = None, uniform_padded_queries: bool = False,
                       dqkv: torch.Tensor | None = None, configs: tuple | None = None):
    """(dqkv, dbias, dc2p, dp2c) for the forward `attention.train_forward(qkv, cu_seqlens, max_seqlen, scale,
    key_valid, ...)` that returned (out, lse), given the output's gradient do [T, nh*hd]. dqkv has qkv's shape and
    dtype (contiguous unless given: any strides with a unit-stride head dim); dbias is fp32 [nh, 2L - 1] when a bias
    table was given, dc2p / dp2c fp32 [T, nh, P] when c2p / p2c were, else None. Every element of dqkv is written.
    uniform_padded_queries (DeBERTa's padded rows): a padded query's output is its row's mean value, so its gradient
    goes to v alone, dO / S to each of the row's S values; the kernels run with that query's dO zeroed (no
    contribution anywhere) and one [B, S] torch reduction adds the rest. The arguments are the forward's, checked by
    its caller (the unit's autograd function); a window with key_valid is not supported
    (fastbert.units.attention.train_unsupported says why). `configs`: force (dK/dV tile, dQ tile), for tests."""
    T, num_heads, head_dim, kv_group, stride_which, stride_head = _heads(qkv, kv_heads)
    assert do.shape == (T, num_heads * head_dim) and out.shape == do.shape, (do.shape, out.shape)
    assert lse.shape == (T, num_heads) and lse.dtype == torch.float32 and lse.is_contiguous(), (lse.shape, lse.dtype)
    assert not (window is not None and key_valid is not None), "a window with key_valid has no backward yet"
    if dqkv is None:
        dqkv = torch.empty(qkv.shape, dtype=qkv.dtype, device=qkv.device)
    assert dqkv.shape == qkv.shape and dqkv.dtype == qkv.dtype and dqkv.stride(-1) == 1, (dqkv.shape, dqkv.stride())
    dbias = None
    if bias is not None:
        dbias = torch.zeros(bias.shape, dtype=torch.float32, device=qkv.device)
    dc2p = None if c2p is None else torch.zeros(c2p.shape, dtype=torch.float32, device=qkv.device)
    dp2c = None if p2c is None else torch.zeros(p2c.shape, dtype=torch.float32, device=qkv.device)
    num_seqs = cu_seqlens.shape[0] - 1
    if T == 0 or num_seqs == 0 or max_seqlen == 0:
        return dqkv, dbias, dc2p, dp2c
    if do.stride(-1) != 1:
        do = do.contiguous()
    padded_queries = None
    if uniform_padded_queries and key_valid is not None:
        padded_queries = ~key_valid.reshape(T, 1)
        do_padded = do.masked_fill(~padded_queries, 0.0)  # the padded queries' dO alone
        do = do.masked_fill(padded_queries, 0.0)
    # delta_i = rowsum(dO o O): one fp32 reduction, [T, nh]
    delta = (do.float() * out.float()).view(T, num_heads, head_dim).sum(-1).contiguous()
    d_which, d_head = _heads(dqkv, kv_heads)[4:]

    device = qkv.device
    if key_valid is not None:
        kv_end = last_real_key(key_valid)
        mask_i8 = key_valid.view(torch.int8)
        stride_mask_b, stride_mask_s = mask_i8.stride()
    else:
        mask_i8, kv_end = _placeholder(device, torch.int8), _placeholder(device, torch.int32)
        stride_mask_b = stride_mask_s = 1
    has_bias = bias is not None
    if has_bias:
        bias_reach, stride_bias_h = (bias.shape[1] - 1) // 2, bias.stride(0)
    else:
        bias, bias_reach, stride_bias_h = _placeholder(device, torch.float32), 1, 1
        dbias_buffer = bias
    if has_bias:
        assert bias.stride(1) == 1, bias.stride()
        dbias_buffer = dbias
    has_window = window is not None and window < max_seqlen - 1
    if not has_window:
        window = 1
    has_rotary = rotary is not None
    if has_rotary:
        cos, sin = (rotary if isinstance(rotary, (tuple, list)) else (rotary.cos, rotary.sin))
        stride_rot_t = cos.stride(0)
    else:
        cos = sin = _placeholder(device, torch.float32)
        stride_rot_t = 1
    has_c2p, has_p2c = c2p is not None, p2c is not None
    if has_c2p or has_p2c:
        bias_reach = (column.shape[0] - 1) // 2  # the column table takes the bias table's place (never both)
        width = (c2p if has_c2p else p2c).shape[2]
        dterm_strides = (num_heads * width, width)
    else:
        column = _placeholder(device, torch.int32)
        dterm_strides = (1, 1)
    if has_c2p:
        c2p_strides = (c2p.stride(0), c2p.stride(1))
    else:
        c2p, c2p_strides = _placeholder(device, torch.float32), (1, 1)
    if has_p2c:
        p2c_strides = (p2c.stride(0), p2c.stride(1))
    else:
        p2c, p2c_strides = _placeholder(device, torch.float32), (1, 1)
    dropout = dropout_p > 0
    if dropout:
        assert seed is not None and seed.dtype == torch.int64, "dropout needs the forward's seed tensor"
    else:
        seed = _placeholder(device, torch.int64)
    head_args = (max_seqlen, float(scale) * _LOG2E, float(scale), bias_reach, int(window), kv_group, float(dropout_p),
                 qkv.stride(0), stride_which, stride_head, dqkv.stride(0), d_which, d_head,
                 do.stride(0), stride_mask_b, stride_mask_s, stride_bias_h, stride_rot_t,
                 *c2p_strides, *p2c_strides, *dterm_strides, triton.next_power_of_2(max_seqlen))
    meta = dict(HEAD_DIM=head_dim, HAS_MASK=key_valid is not None, INPUT_PRECISION=input_precision(qkv.dtype),
                HAS_BIAS=has_bias, HAS_WINDOW=has_window, HAS_ROTARY=has_rotary, DROPOUT=dropout,
                HAS_C2P=has_c2p, HAS_P2C=has_p2c)
    if configs is None:
        configs = _INTERPRETER_CONFIGS if utils.INTERPRET else backward_configs(
            qkv.dtype, head_dim, meta["INPUT_PRECISION"], has_bias or has_c2p or has_p2c)
    dkdv_config, dq_config = configs
    kv_count = num_heads // kv_group
    with utils.device_guard(qkv):
        for fn, config, grid, pointers in (
                (_attention_bwd_dkdv_kernel, dkdv_config,
                 (triton.cdiv(max_seqlen, dkdv_config.kwargs["BLOCK_N"]) * num_seqs, kv_count),
                 (qkv, do, lse, delta, cu_seqlens, mask_i8, kv_end, bias, cos, sin, seed, column, c2p, p2c, dqkv,
                  dp2c if has_p2c else column)),
                (_attention_bwd_dq_kernel, dq_config,
                 (triton.cdiv(max_seqlen, dq_config.kwargs["BLOCK_M"]) * num_seqs, num_heads),
                 (qkv, do, lse, delta, cu_seqlens, mask_i8, kv_end, bias, cos, sin, seed, column, c2p, p2c, dqkv,
                  dc2p if has_c2p else column, dbias_buffer))):
            kwargs = {**meta, **config.all_kwargs()}
            if utils.capturing(qkv):
                utils.require_loaded(fn, pointers + head_args, kwargs, "attention backward")
            fn[grid](*pointers, *head_args, **kwargs)
    if padded_queries is not None:  # each padded query's dO / S to every value of its row (its group's head)
        B, S = key_valid.shape
        share = do_padded.float().view(B, S, kv_count, kv_group, head_dim).sum(dim=(1, 3)) / S  # [B, kv, hd]
        dv = dqkv[:, 2] if kv_heads is None else dqkv[:, num_heads + kv_count:]  # [T, kv, hd]
        dv.copy_((dv.float().view(B, S, kv_count, head_dim) + share[:, None]).view(dv.shape).to(dv.dtype))
    return dqkv, dbias, dc2p, dp2c


# --------------------------------------------------------------------------------------------------------------------
# Ahead-of-time compile specs (tests/tooling/test_aot.py's BACKWARD_SPEC_LISTS: sm_90 and sm_80, no spills)
# --------------------------------------------------------------------------------------------------------------------
# (HAS_MASK, HAS_BIAS, HAS_WINDOW, HAS_ROTARY, DROPOUT, grouped, c2p and p2c): BERT's (varlen or padded, with and
# without dropout), the relative-bias families' (MPNet), ModernBERT's local and global layers (window and rotary,
# rotary), EuroBERT's (rotary over grouped key/value heads), DeBERTa's (both terms, varlen or padded)
BACKWARD_VARIANTS = [(mask, False, False, False, dropout, False, False) for mask in (False, True)
                     for dropout in (False, True)] \
    + [(mask, True, False, False, False, False, False) for mask in (False, True)] \
    + [(False, False, True, True, False, False, False), (False, False, False, True, False, False, False),
       (False, False, False, True, False, True, False)] \
    + [(mask, False, False, False, False, False, True) for mask in (False, True)]
# The variants at hd 64 (BERT-base/large, MPNet, ModernBERT, EuroBERT-210m); the plain ones also at hd 32 and 128
BACKWARD_AOT_HEAD_DIMS = (32, 64, 128)


def backward_aot_specs() -> list[dict]:
    """The training forward (STORE_LSE, with and without DROPOUT; the forward's tiles, packed and padded) and both
    backward kernels for every dtype (fp32 under "ieee" and "tf32") x BACKWARD_VARIANTS at hd 64, the plain variants
    (no bias, window, rotary or dropout; varlen and padded) also at hd 32 and 128 in fp16/bf16. Each is the
    specialisation the JIT builds for BERT's tensors, as the forward's aot_specs(): integers equal to 1 (the key
    mask's unit stride; the group size, the bias table's reach and stride, the window and the rotary stride where
    unused) are constants; max_seqlen, the padded row stride, seq_bucket, the table's reach and row stride and the
    group size (EuroBERT's 3) get no divisibility hint; pointers and qkv / dqkv / dO strides keep the default
    multiple-of-16 hint."""
    from . import attention

    specs = []
    for dtype, tag in _DTYPES.items():
        precisions = ("ieee", "tf32") if dtype == torch.float32 else ("ieee",)
        for precision in precisions:
            for head_dim in BACKWARD_AOT_HEAD_DIMS:
                for variant in BACKWARD_VARIANTS:
                    plain = not any(variant[1:])
                    if head_dim != 64 and (not plain or dtype == torch.float32):
                        continue
                    if dtype == torch.float32 and not plain:
                        continue
                    for fn, config in zip((_attention_bwd_dkdv_kernel, _attention_bwd_dq_kernel),
                                          backward_configs(dtype, head_dim, precision, variant[1] or variant[6])):
                        specs.append(_backward_spec(fn, config, tag, precision, head_dim, *variant))
    # the training forward: BERT's packed and padded layouts, with and without dropout (its own tiles), fp16/bf16 at
    # hd 64: the forward's spec of that variant, STORE_LSE (and DROPOUT) set, at each tile attention_configs() gives
    for spec in attention.all_aot_specs():
        c = spec["constexprs"]
        if (c["HEAD_DIM"] != 64 or spec["signature"]["qkv_ptr"] not in ("*fp16", "*bf16") or c["HAS_BIAS"]
                or c["HAS_WINDOW"] or c["HAS_ROTARY"] or c["HAS_C2P"] or c["HAS_P2C"]
                or "kv_group" in spec["signature"] or c["BLOCK_M"] != 128):
            continue
        dtype = torch.float16 if spec["signature"]["qkv_ptr"] == "*fp16" else torch.bfloat16
        for dropout in (False, True):
            for config in attention.attention_configs(dtype, 64, dropout=dropout):
                bm, bn, warps, stages, maxnreg = attention._key(config)
                tile = f"{bm}x{bn}-w{warps}-s{stages}" + (f"-r{maxnreg}" if maxnreg else "")
                name = spec["name"].replace("attention-", "attention-train-lse-" + ("dropout-" if dropout else ""), 1)
                specs.append({**spec, "name": name.rsplit("-128x64", 1)[0] + "-" + tile,
                              "constexprs": {**c, "STORE_LSE": True, "DROPOUT": dropout, "BLOCK_M": bm,
                                             "BLOCK_N": bn},
                              "num_warps": warps, "num_stages": stages,
                              **({"maxnreg": maxnreg} if maxnreg else {})})
    return specs


def _backward_spec(fn, config, tag, precision, head_dim, has_mask, has_bias, has_window, has_rotary, dropout,
                   grouped, terms) -> dict:
    bm, bn, warps, stages = config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.num_warps, config.num_stages
    kind = "dkdv" if fn is _attention_bwd_dkdv_kernel else "dq"
    name = "-".join([f"attention_backward-{kind}", tag] + ([precision] if tag == "fp32" else []) +
                    [f"hd{head_dim}", "mask" if has_mask else "nomask"] + (["bias"] if has_bias else []) +
                    (["window"] if has_window else []) + (["rotary"] if has_rotary else []) +
                    (["dropout"] if dropout else []) + (["gqa"] if grouped else []) + (["c2p-p2c"] if terms else []) +
                    [f"{bm}x{bn}-w{warps}-s{stages}"])
    signature = {"qkv_ptr": f"*{tag}", "do_ptr": f"*{tag}", "lse_ptr": "*fp32", "delta_ptr": "*fp32",
                 "cu_seqlens_ptr": "*i32", "key_valid_ptr": "*i8", "kv_end_ptr": "*i32", "bias_ptr": "*fp32",
                 "cos_ptr": "*fp32", "sin_ptr": "*fp32", "seed_ptr": "*i64", "dqkv_ptr": f"*{tag}",
                 "column_ptr": "*i32", "c2p_ptr": "*fp32", "p2c_ptr": "*fp32", "dterm_ptr": "*fp32",
                 "max_seqlen": "i32", "qk_scale": "fp32", "sm_scale": "fp32", "dropout_p": "fp32",
                 "stride_qkv_t": "i32", "stride_qkv_which": "i32", "stride_qkv_h": "i32",
                 "stride_dqkv_t": "i32", "stride_dqkv_which": "i32", "stride_dqkv_h": "i32",
                 "stride_do_t": "i32", "stride_mask_b": "i32", "seq_bucket": "i32"}
    if kind == "dq":
        signature["dbias_ptr"] = "*fp32"
    constexprs = {"stride_mask_s": 1, "HEAD_DIM": head_dim, "HAS_MASK": has_mask, "INPUT_PRECISION": precision,
                  "BLOCK_M": bm, "BLOCK_N": bn, "HAS_BIAS": has_bias, "HAS_WINDOW": has_window,
                  "HAS_ROTARY": has_rotary, "DROPOUT": dropout, "HAS_C2P": terms, "HAS_P2C": terms}
    hints = {"max_seqlen": None, "stride_mask_b": None, "seq_bucket": None}
    # DeBERTa: the column table's reach takes bias_reach's place; the tables' strides keep the default hint
    # ([T, nh, P] with P = 2 x 256 buckets), and so do the fp32 gradient tables' (nh P, P)
    for arg, used in (("bias_reach", has_bias or terms), ("stride_bias_h", has_bias), ("window", has_window),
                      ("stride_rot_t", has_rotary), ("kv_group", grouped), ("stride_c2p_t", terms),
                      ("stride_c2p_h", terms), ("stride_p2c_t", terms), ("stride_p2c_h", terms),
                      ("stride_dterm_t", terms), ("stride_dterm_h", terms)):
        if used:
            signature[arg] = "i32"
            if arg in ("bias_reach", "stride_bias_h", "kv_group"):
                hints[arg] = None
        else:
            constexprs[arg] = 1
    return {"name": name, "fn": fn, "signature": signature, "constexprs": constexprs, "hints": hints,
            "num_warps": warps, "num_stages": stages, **({"maxnreg": config.maxnreg} if config.maxnreg else {})}
