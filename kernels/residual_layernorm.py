"""residual_layernorm: LayerNorm(y[T, K] @ W[H, K]^T + b[H] + residual[T, H]) -> [T, H]  (BertSelfOutput, BertOutput).

The choice: cuBLAS GEMM, then one Triton row kernel (bias + residual + LayerNorm in one pass per row).

What the unfused sequence moves, per layer-norm site, counting only the [T, H] passes (fp16, 2 bytes each; the
GEMM's own reads of y and W are common to every option):

    twin (HF):  h = linear(y, W, b)   write h                  2TH
                s = h + residual      read h, residual; write  6TH
                out = layer_norm(s)   read s; write out        4TH     -> 12TH bytes, 3 launches
    here:       h = y @ W^T (cuBLAS)  write h                  2TH
                row kernel            read h, residual; write  6TH     ->  8TH bytes, 2 launches
    ideal:      GEMM epilogue         read residual; write out 4TH     ->  4TH bytes, 1 launch

So the row kernel leaves 4TH bytes on the table against a perfect epilogue: BERT-base, T = 4096, H = 768 is
12.6 MB, ~3 us at 4.3 TB/s, next to ~25-35 us for the FFN-out GEMM (2*4096*768*3072 = 19 GFLOP) and ~8 us for the
attention-out GEMM (K = 768). Why not the epilogue: LayerNorm's mean and variance are reductions over the whole
row, so a program can only normalise rows it owns completely, i.e. its tile needs BLOCK_N >= H (768 for base, 1024
for large, 384 for MiniLM). The fp32 accumulator of a BLOCK_M x H tile is BLOCK_M * H * 4 bytes: at H = 768 and
BLOCK_M = 64 that is 192 KB, three quarters of an SM's whole 256 KB register file (192 registers per thread at
8 warps before a single operand is loaded), and at H = 1024 it does not fit at all. Shrinking BLOCK_M to 16-32
fixes registers but (a) under-fills wgmma, whose minimum M per warpgroup is 64, and (b) leaves T/BLOCK_M programs
that each stream all of W (H x K; 4.7 MB for the FFN-out weight) through L2: T = 4096 -> 128-256 full passes over W,
0.6-1.2 GB of L2 traffic, slower than the GEMM itself. The other fix, split rows with a cross-program reduction
of (sum, sum of squares), needs a second pass over h anyway. cuBLAS at full tile efficiency plus an 8TH-byte row
pass is the better trade at H = 384-1024; the epilogue would win only for small H (a full row in one 128-wide tile).
Without a GPU to measure this here, that is the estimate; bench/ measures it.

The row kernel: ROWS rows per program, each row held in registers as NUM_CHUNKS chunks of CHUNK lanes, where
CHUNK * NUM_CHUNKS == H exactly for BERT's sizes (384 = 3 x 128, 768 = 3 x 256, 1024 = 1 x 1024): no idle lanes,
every thread moves whole 16-byte vectors (tests/tooling/test_aot.py checks the PTX: only v4 loads and stores of rows).
Other widths take one masked chunk of next_pow2(H). ~4K elements per program (ROWS = 8 at H = 384, 4 at 768 and
1024: 24-32 fp32 values per thread per chunk set) keeps enough bytes in flight with T/ROWS programs (1024 at
T = 4096, ~8 per SM); the bias, gamma and beta chunks are loaded once per program, not once per row. That is the
case for reaching >= 80% of copy bandwidth, a prediction: no GPU has timed it (bench/ measures GB/s against the
device's copy ceiling). Statistics: mean, then the biased variance of the centred values, rstd, all fp32, like
torch's layer_norm (which for fp16/bf16 also keeps fp32 statistics and rounds once); compared with the twin the
kernel skips one rounding (h + residual is not rounded before the norm). Row offsets are int64 (T * H can exceed
2^31). The GEMM is torch.matmul without the bias, so it honours torch.backends.cuda.matmul.allow_tf32 like the
twin's F.linear; inside utils.batch_invariant it is the Triton GEMM at its pinned tile instead (cuBLAS chooses its
algorithm, split-K included, by the token count). Each program reads its rows before it stores them, so `out` may
alias `residual` or h.

Pre-norm (ModernBERT: x = x + sublayer(norm(x))): `pre_norm=True` returns (s, LN(s)) for s = h + bias + residual,
the new residual stream and the next sublayer's input, both from the one row pass (PRE_NORM writes s as a second
output). s is rounded to the input dtype when it is stored, and LN is computed from that rounded s, not from the
fp32 sum: the twin does the same (its `h += residual` rounds), and the stream the later layers add to is the rounded
s, so the LN a layer reads and the residual it adds back describe the same tensor (in fp32 the two are one).
LayerNorm without bias (ModernBERT's norm_bias=False): ln_bias None, in either form (HAS_LN_BIAS).

RMSNorm (EuroBERT, whose pre-norm layer runs it after attention: transformers' EuroBertRMSNorm, Llama's): `rms=True`
(RMS), in either form, weight only (ln_bias None). No mean is taken: rstd = 1 / sqrt(mean(s^2) + eps) in fp32, and
the row sum LayerNorm needs is dead code there (the LayerNorm specialisations compile to the same PTX as before RMS
existed). transformers rounds twice: the normalised row s * rstd to the input dtype, then weight times it in that
dtype. The kernel makes the same two roundings: it rounds the normalised row, multiplies in fp32 and rounds once,
and the product of two fp16 or bf16 values is exact in fp32, so that last rounding is the 16-bit multiply's. Against
EuroBertRMSNorm the kernel differs only where its fp32 sum of squares (another order than torch's mean) or its
1 / sqrt moves the normalised row across a rounding boundary: a rare last-bit difference (fp16 in the interpreter:
none in 12,288 values, tests/kernels/test_residual_layernorm.py; not yet counted on a GPU, whose sqrt is
approximate). The rounding it skips is LayerNorm's: with a dense bias, h + bias is not rounded before the residual
joins it; without one (EuroBERT's default, attention_bias=False) s is transformers' sum exactly.

Training: `train_forward` runs the pre-norm form with STATS (the row's fp32 mean and rstd, or rstd, also stored; a
constexpr that inference leaves at its default) for either norm placement, and `layernorm_backward` is the row pass
backwards (see the comment above layernorm_backward_kernel); fastbert.units.residual_layernorm.TrainKernel joins
them with the GEMM's gradients.

Hidden dropout (DROPOUT, training only): the row kernel drops h + bias out before the residual joins, where the twin's
dropout acts, with element e = row * H + col kept when Philox(seed, e) >= p (utils.dropout_keep) and scaled by
1 / (1 - p); the backward kernel regenerates the same bits from the same seed tensor and writes, next to dS (the
residual's gradient), dH = dS * keep / (1 - p) (the GEMM's). No mask is stored or read: the 8-byte seed replaces the
twin's T x H-byte mask. The price is arithmetic: utils.dropout_keep runs a 10-round Philox per element (tl.rand keeps
one of its four outputs), ~60 SASS instructions per element (sm_90, fp16, H = 768, 24 elements per thread: the
forward grows from 608 to 2,024 instructions, the backward from 952 to 2,392). At BERT-base, T = 4096, that is ~190M
thread-instructions, ~6 us of issue on an H200 (132 SMs x 128 lanes at ~2 GHz), about the time of the forward's
25 MB of row traffic (~6 us): with dropout the row pass sits near the point where arithmetic, not memory, bounds
it (an estimate; not measured).
Inference's kernels compile exactly as before: the dropout arguments default to None, which Triton makes constants.
"""
from __future__ import annotations

import numbers

import torch
import triton
import triton.language as tl

from . import utils
from .gemm import DTYPES, check_device, check_dtypes, check_linear, check_out, gemm
from .utils import dropout_keep

OP = "residual_layernorm"
MAX_HIDDEN = 16384  # a row must fit in one program's registers: 16384 fp32 over 16 warps = 32 per thread
# Dropout draws element e = row * H + col's keep bit at Philox counter e, numbered in int32 while every e fits, in int64
# for calls of more elements than this. Triton's randint4x feeds an int64 counter's high word to Philox as its second
# counter word (zero below 2^32), so both numberings draw the same bits: the int64 one only costs more instructions.
DROPOUT_I32_ELEMENTS = 2 ** 31


@triton.jit
def _row_chunk(h_ptr, bias_ptr, res_ptr, h_rows, r_rows, cols, param_cols, mask, e_rows, seed_ptr, dropout_p,
               dropout_scale, HAS_BIAS: tl.constexpr, DROPOUT: tl.constexpr):
    """dropout(h + bias) + residual for one [ROWS, CHUNK] chunk, in fp32 (DROPOUT: keep bits at the element numbers
    e_rows + cols, kept values scaled by dropout_scale = 1 / (1 - p), where the twin's dropout acts: before the
    residual joins)."""
    x = tl.load(h_ptr + h_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        x += tl.load(bias_ptr + param_cols).to(tl.float32)[None, :]
    if DROPOUT:
        keep = dropout_keep(seed_ptr, e_rows + cols[None, :], dropout_p)
        x = tl.where(keep, x * dropout_scale, 0.0)
    x += tl.load(res_ptr + r_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    return x


@triton.jit
def _element_rows(rows, N, DROPOUT: tl.constexpr, OFFSETS_I64: tl.constexpr):
    """The element number of each row's first value, row * N, as a [ROWS, 1] column: dropout draws element e's keep
    bit at Philox counter e. int32 unless OFFSETS_I64 (T * N > DROPOUT_I32_ELEMENTS). Without DROPOUT a placeholder
    that nothing reads."""
    if DROPOUT:
        e_rows = rows * N
        if not OFFSETS_I64:
            e_rows = e_rows.to(tl.int32)
    else:
        e_rows = rows
    return e_rows[:, None]


@triton.jit
def _stream_chunk(x, s_ptr, s_rows, cols, mask, PRE_NORM: tl.constexpr):
    """Pre-norm: store the chunk of s (rounded to the stream's dtype) and go on with the rounded values."""
    if PRE_NORM:
        rounded = x.to(s_ptr.dtype.element_ty)
        tl.store(s_ptr + s_rows + cols[None, :], rounded, mask=mask)
        x = rounded.to(tl.float32)
    return x


@triton.jit
def _store_chunk(out_ptr, o_rows, centred, rstd, ln_w_ptr, ln_b_ptr, cols, param_cols, mask,
                 HAS_LN_BIAS: tl.constexpr, RMS: tl.constexpr):
    gamma = tl.load(ln_w_ptr + param_cols).to(tl.float32)
    if RMS:  # HF rounds the normalised row to the input dtype before the weight multiplies it: so here
        normed = (centred * rstd[:, None]).to(out_ptr.dtype.element_ty).to(tl.float32)
        y = normed * gamma[None, :]
    else:
        y = centred * rstd[:, None] * gamma[None, :]
    if HAS_LN_BIAS:
        y += tl.load(ln_b_ptr + param_cols).to(tl.float32)[None, :]
    tl.store(out_ptr + o_rows + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


# The row count T only feeds the row mask: not specialised, so one binary per width serves every token count.
RESIDUAL_LAYERNORM_DO_NOT_SPECIALIZE = ("T",)


@triton.jit(do_not_specialize=RESIDUAL_LAYERNORM_DO_NOT_SPECIALIZE)
def bias_residual_layernorm_kernel(
    # pointers: h [T, H] (the GEMM output), bias [H], residual [T, H], LayerNorm gamma/beta [H], out [T, H],
    # s [T, H] (pre-norm: the new residual stream)
    h_ptr, bias_ptr, res_ptr, ln_w_ptr, ln_b_ptr, out_ptr, s_ptr,
    # stats fp32 (STATS only; training): LayerNorm [2, T] = mean, rstd; RMSNorm [1, T] = rstd
    stats_ptr,
    # sizes and LayerNorm epsilon
    T, N, eps,
    # row strides in elements (every last dim is unit-stride)
    stride_hm, stride_rm, stride_om, stride_sm,
    # meta-parameters
    HAS_BIAS: tl.constexpr,  # add bias[H] before the residual
    HAS_LN_BIAS: tl.constexpr,  # add beta[H] after the scale (False: a LayerNorm without bias)
    PRE_NORM: tl.constexpr,  # also store s = h + bias + residual (rounded; the norm is taken of the rounded s)
    RMS: tl.constexpr,  # RMSNorm instead of LayerNorm: no mean, rstd of the mean square (HAS_LN_BIAS is False)
    ROWS: tl.constexpr,  # rows per program
    CHUNK: tl.constexpr, NUM_CHUNKS: tl.constexpr,  # a row is NUM_CHUNKS (1 or 3) chunks of CHUNK lanes
    EVEN: tl.constexpr,  # CHUNK * NUM_CHUNKS == N: no column mask (keeps the accesses 16-byte vectors)
    STATS: tl.constexpr = False,  # also store the row statistics the backward reads (off: inference's code)
    DROPOUT: tl.constexpr = False,  # dropout on h + bias before the residual joins (training; off: inference's code)
    OFFSETS_I64: tl.constexpr = False,  # dropout's element numbers in int64 (T * N > DROPOUT_I32_ELEMENTS)
    # dropout (DROPOUT only): the int64 [1] Philox seed (utils.dropout_seed), the drop probability and 1 / (1 - p)
    # (0 at p = 1: nothing is kept). Inference leaves them None, which Triton compiles as constants: its kernel keeps
    # the parameters it had before dropout.
    seed_ptr=None, dropout_p=None, dropout_scale=None,
):
    # row_config gives 1 or 3: an odd part of at most 4 is 1 or 3 (a width of 2^k or 3 x 2^k).
    tl.static_assert(NUM_CHUNKS == 1 or NUM_CHUNKS == 3, "NUM_CHUNKS must be 1 or 3")
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < T
    h_rows = (rows * stride_hm)[:, None]
    r_rows = (rows * stride_rm)[:, None]
    o_rows = (rows * stride_om)[:, None]
    s_rows = (rows * stride_sm)[:, None]
    e_rows = _element_rows(rows, N, DROPOUT, OFFSETS_I64)
    c0 = tl.arange(0, CHUNK)
    if EVEN:
        m0 = row_ok[:, None]
        p0 = c0  # the columns of bias / gamma / beta
    else:  # one chunk wider than the row: lanes past N are masked, and read in-bounds copies of the parameters
        m0 = row_ok[:, None] & (c0 < N)[None, :]
        p0 = tl.minimum(c0, N - 1)
    # Chunks are separate variables (Triton tensors have power-of-two shapes, 768 = 3 x 256 is not one): the
    # constexpr branches unroll, and every chunk stays in registers between the passes.
    x0 = _row_chunk(h_ptr, bias_ptr, res_ptr, h_rows, r_rows, c0, p0, m0, e_rows, seed_ptr, dropout_p,
                    dropout_scale, HAS_BIAS, DROPOUT)
    x0 = _stream_chunk(x0, s_ptr, s_rows, c0, m0, PRE_NORM)
    if not EVEN:
        x0 = tl.where(m0, x0, 0.0)
    total = tl.sum(x0, axis=1)
    if NUM_CHUNKS == 3:
        c1 = c0 + CHUNK
        x1 = _row_chunk(h_ptr, bias_ptr, res_ptr, h_rows, r_rows, c1, c1, m0, e_rows, seed_ptr, dropout_p,
                        dropout_scale, HAS_BIAS, DROPOUT)
        x1 = _stream_chunk(x1, s_ptr, s_rows, c1, m0, PRE_NORM)
        c2 = c0 + 2 * CHUNK
        x2 = _row_chunk(h_ptr, bias_ptr, res_ptr, h_rows, r_rows, c2, c2, m0, e_rows, seed_ptr, dropout_p,
                        dropout_scale, HAS_BIAS, DROPOUT)
        x2 = _stream_chunk(x2, s_ptr, s_rows, c2, m0, PRE_NORM)
        total += tl.sum(x1, axis=1) + tl.sum(x2, axis=1)

    # Statistics in fp32. LayerNorm: two passes, the mean, then the biased variance of the centred values (masked
    # lanes are excluded from the centred sum). RMSNorm: the mean square of the row itself (`total` goes unused and
    # is compiled away).
    if not RMS:
        mean = total / N
        if STATS:
            tl.store(stats_ptr + rows, mean, mask=row_ok)
        x0 = x0 - mean[:, None]
        if not EVEN:
            x0 = tl.where(m0, x0, 0.0)
    sq = tl.sum(x0 * x0, axis=1)
    if NUM_CHUNKS == 3:
        if not RMS:
            x1 = x1 - mean[:, None]
            x2 = x2 - mean[:, None]
        sq += tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
    rstd = 1.0 / tl.sqrt(sq / N + eps)  # LayerNorm: 1 / std (biased variance); RMSNorm: 1 / rms
    if STATS:  # [1, T] rstd (RMSNorm) or [2, T] mean (stored above), rstd
        tl.store(stats_ptr + (0 if RMS else T) + rows, rstd, mask=row_ok)

    _store_chunk(out_ptr, o_rows, x0, rstd, ln_w_ptr, ln_b_ptr, c0, p0, m0, HAS_LN_BIAS, RMS)
    if NUM_CHUNKS == 3:
        _store_chunk(out_ptr, o_rows, x1, rstd, ln_w_ptr, ln_b_ptr, c1, c1, m0, HAS_LN_BIAS, RMS)
        _store_chunk(out_ptr, o_rows, x2, rstd, ln_w_ptr, ln_b_ptr, c2, c2, m0, HAS_LN_BIAS, RMS)


def row_config(hidden: int) -> tuple:
    """(ROWS, CHUNK, NUM_CHUNKS, num_warps) for rows of `hidden` elements: the row as 1 or 3 power-of-two chunks when
    it splits exactly (384 -> 3 x 128, 768 -> 3 x 256, 1024 -> 1 x 1024), else one masked chunk of next_pow2;
    ~4K elements per program; 4 warps up to 4K elements, then one warp per 1K (<= 32 values per thread)."""
    chunk, num_chunks = triton.next_power_of_2(hidden), 1
    low_bit = hidden & -hidden  # the largest power of two dividing hidden
    if hidden // low_bit <= 3:  # the odd part: 1 or 3
        chunk, num_chunks = low_bit, hidden // low_bit
    width = chunk * num_chunks
    rows = max(1, 4096 // width)
    rows = 1 << (rows.bit_length() - 1)  # a power of two (tl.arange)
    warps = min(16, max(4, rows * width // 1024))
    warps = 1 << (warps.bit_length() - 1)
    return rows, chunk, num_chunks, warps


def residual_layernorm(y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor,
                       ln_weight: torch.Tensor, ln_bias: torch.Tensor | None, eps: float, pre_norm: bool = False,
                       out: torch.Tensor | None = None, residual_out: torch.Tensor | None = None, rms: bool = False,
                       stats: torch.Tensor | None = None, dropout_p: float = 0.0, seed: torch.Tensor | None = None):
    """LN(y [T, K] @ weight[H, K]^T + bias[H] + residual[T, H]) with gamma=ln_weight, beta=ln_bias (None: no beta)
    -> [T, H]. pre_norm: (s, LN(s)) for s = y @ weight^T + bias + residual, each [T, H] (see the header). rms:
    RMSNorm (weight ln_weight, no beta: ln_bias must be None) in place of LayerNorm, in either form.

    y may have any strides (cuBLAS reads it); residual, out and residual_out need a unit-stride last dimension. out
    (the LayerNorm) may be `residual` itself in the post-norm form (in-place update of the residual stream);
    residual_out (pre_norm only: where s goes) may be `residual` itself. stats (training): a contiguous float32
    [2, T] (LayerNorm: mean, rstd) or [1, T] (RMSNorm: rstd) that receives the row statistics the backward reads.
    dropout_p > 0 (training): y @ weight^T + bias is dropped out before the residual joins, keep bits drawn from
    seed (utils.dropout_seed: int64 [1] on the tensors' device) at the element numbers row * H + col, which
    `layernorm_backward` regenerates from the same seed.
    """
    if not isinstance(pre_norm, bool):
        raise TypeError(f"{OP}: pre_norm must be a bool; got pre_norm={pre_norm!r}")
    if not isinstance(rms, bool):
        raise TypeError(f"{OP}: rms must be a bool; got rms={rms!r}")
    if rms and ln_bias is not None:
        raise ValueError(f"{OP}: RMSNorm has no bias (rms=True takes ln_bias=None); got ln_bias of shape "
                         f"{tuple(ln_bias.shape)}")
    if residual_out is not None and not pre_norm:
        raise ValueError(f"{OP}: residual_out is the pre-norm form's second output; the post-norm form "
                         f"(pre_norm=False) returns the LayerNorm only (pass out=)")
    check_dtypes(OP, y=y, weight=weight, bias=bias, residual=residual, ln_weight=ln_weight, ln_bias=ln_bias)
    T, H, _ = check_linear(OP, y, weight, bias, x_name="y", unit_stride=False)
    if residual.dim() != 2 or tuple(residual.shape) != (T, H):
        raise ValueError(f"{OP}: residual.shape={tuple(residual.shape)} must be {(T, H)} "
                         f"(y.shape[0]={T}, weight.shape[0]={H})")
    if H > 1 and residual.stride(1) != 1:
        raise ValueError(f"{OP}: residual must have a unit-stride last dimension; "
                         f"got residual.stride()={residual.stride()}")
    for name, t in (("ln_weight", ln_weight), ("ln_bias", ln_bias)):
        if t is None and name == "ln_bias":
            continue
        if t.dim() != 1 or t.shape[0] != H:
            raise ValueError(f"{OP}: {name}.shape={tuple(t.shape)} must be {(H,)} (the hidden size weight.shape[0])")
        if H > 1 and t.stride(0) != 1:
            raise ValueError(f"{OP}: {name} must be contiguous; got {name}.stride()={t.stride()}")
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not eps >= 0:
        raise ValueError(f"{OP}: eps must be a non-negative float; got eps={eps!r}")
    if H > MAX_HIDDEN:
        raise ValueError(f"{OP}: hidden size H={H} exceeds {MAX_HIDDEN}, the widest row one program holds")
    device = check_device(OP, y=y, weight=weight, bias=bias, residual=residual, ln_weight=ln_weight, ln_bias=ln_bias,
                          out=out, residual_out=residual_out)
    if out is not None:
        check_out(OP, out, (T, H), y.dtype, device)
    if residual_out is not None:
        check_out(OP, residual_out, (T, H), y.dtype, device)
        if out is not None and _overlap(out, residual_out):
            raise ValueError(f"{OP}: out and residual_out are the two outputs of the pre-norm form and must not "
                             f"overlap; got out.data_ptr()={out.data_ptr()}, "
                             f"residual_out.data_ptr()={residual_out.data_ptr()}")
    if stats is not None:
        want = (1 if rms else 2, T)
        if (not isinstance(stats, torch.Tensor) or stats.dtype != torch.float32 or tuple(stats.shape) != want
                or not stats.is_contiguous() or stats.device != device):
            raise ValueError(f"{OP}: stats must be a contiguous float32 tensor of shape {want} on {device}; got "
                             + (f"{stats.dtype} {tuple(stats.shape)} stride {stats.stride()} on {stats.device}"
                                if isinstance(stats, torch.Tensor) else type(stats).__name__))
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real) or not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"{OP}: dropout_p must be a probability in [0, 1]; got dropout_p={dropout_p!r}")
    if dropout_p > 0 and (not isinstance(seed, torch.Tensor) or seed.dtype != torch.int64 or seed.numel() != 1
                          or seed.device != device):
        raise ValueError(f"{OP}: dropout_p={dropout_p} needs seed, an int64 tensor of one element on {device} "
                         f"(utils.dropout_seed); got "
                         + (f"{seed.dtype} {tuple(seed.shape)} on {seed.device}" if isinstance(seed, torch.Tensor)
                            else type(seed).__name__))
    return launch(y, weight, bias, residual, ln_weight, ln_bias, eps, pre_norm, out, residual_out, rms, stats,
                  dropout_p, seed)


def _keep_scale(dropout_p: float) -> float:
    """What a kept value is multiplied by, 1 / (1 - p) as the twin's dropout computes it (in double, then rounded to
    float32 by the launch); 0 for p = 1, where nothing is kept."""
    return 1.0 / (1.0 - dropout_p) if dropout_p < 1 else 0.0


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors' storage spans intersect (a cheap, conservative test)."""
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    span = lambda t: (t.data_ptr(), t.data_ptr() + ((t.shape[0] - 1) * t.stride(0) + t.shape[1]) * t.element_size())  # noqa: E731
    (a0, a1), (b0, b1) = span(a), span(b)
    return a.numel() > 0 and b.numel() > 0 and a0 < b1 and b0 < a1


def launch(y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor,
           ln_weight: torch.Tensor, ln_bias: torch.Tensor | None, eps: float, pre_norm: bool = False,
           out: torch.Tensor | None = None, residual_out: torch.Tensor | None = None, rms: bool = False,
           stats: torch.Tensor | None = None, dropout_p: float = 0.0, seed: torch.Tensor | None = None):
    """`residual_layernorm` for arguments the caller has validated (the model does it once per forward). Without
    outputs given, the post-norm form writes the LayerNorm into the GEMM's buffer; the pre-norm form writes s there
    (the twin's `h += residual`) and the LayerNorm into a fresh tensor."""
    if utils.invariant():  # cuBLAS picks its algorithm by the token count; the pinned Triton GEMM does not
        h = gemm(y, weight, None, y.new_empty(y.shape[0], weight.shape[0]))
    else:
        h = torch.matmul(y, weight.t())  # [T, H], cuBLAS (no bias: it is added in fp32 in the row kernel)
    if not pre_norm:
        return bias_residual_layernorm(h, bias, residual, ln_weight, ln_bias, eps, out=out if out is not None else h,
                                       rms=rms, stats=stats, dropout_p=dropout_p, seed=seed)
    return bias_residual_layernorm(h, bias, residual, ln_weight, ln_bias, eps, out=out, pre_norm=True,
                                   residual_out=residual_out if residual_out is not None else h, rms=rms, stats=stats,
                                   dropout_p=dropout_p, seed=seed)


def bias_residual_layernorm(h: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor,
                            ln_weight: torch.Tensor, ln_bias: torch.Tensor | None, eps: float,
                            out: torch.Tensor | None = None, pre_norm: bool = False,
                            residual_out: torch.Tensor | None = None, rms: bool = False,
                            stats: torch.Tensor | None = None, dropout_p: float = 0.0,
                            seed: torch.Tensor | None = None):
    """The row pass alone: LN(h + bias + residual) for a GEMM output h [T, H], unit-stride rows, arguments
    validated by the caller (cheap asserts only); pre_norm: (s, LN(s)) with s written to residual_out (a fresh
    tensor when None); rms: RMSNorm for LN (ln_bias None). The benchmarks call it to measure the row kernel's GB/s.
    out may be h or residual itself; residual_out too, but not out. stats, dropout_p and seed: see
    `residual_layernorm`."""
    T, H = h.shape
    assert residual.shape == h.shape and ln_weight.shape == (H,), (h.shape, residual.shape, ln_weight.shape)
    assert ln_bias is None or ln_bias.shape == (H,) and not rms, (ln_bias.shape, rms)
    assert H <= 1 or h.stride(1) == residual.stride(1) == 1, (h.stride(), residual.stride())
    if out is None:
        out = torch.empty_like(h)
    if pre_norm and residual_out is None:
        residual_out = torch.empty_like(h)
    assert residual_out is None or residual_out is not out, "the pre-norm form's two outputs must be two tensors"
    result = (residual_out, out) if pre_norm else out
    if T == 0 or H == 0:
        return result
    stream = residual_out if pre_norm else out  # s_ptr is never written unless PRE_NORM
    rows, chunk, num_chunks, num_warps = row_config(H)
    args = (h, bias if bias is not None else h, residual, ln_weight, ln_bias if ln_bias is not None else ln_weight,
            out, stream, stats if stats is not None else out, T, H, float(eps),
            h.stride(0), residual.stride(0), out.stride(0), stream.stride(0))
    kwargs = dict(HAS_BIAS=bias is not None, HAS_LN_BIAS=ln_bias is not None, PRE_NORM=bool(pre_norm), RMS=bool(rms),
                  ROWS=rows, CHUNK=chunk, NUM_CHUNKS=num_chunks, EVEN=chunk * num_chunks == H, num_warps=num_warps)
    if stats is not None:  # passed only when asked: inference's launch keeps its key and its kwargs
        assert stats.dtype == torch.float32 and stats.shape == (1 if rms else 2, T), (stats.dtype, stats.shape)
        kwargs["STATS"] = True
    if dropout_p > 0:  # likewise: p = 0 launches the kernel without dropout, as inference does
        assert seed is not None and seed.dtype == torch.int64 and seed.numel() == 1, seed
        kwargs.update(DROPOUT=True, OFFSETS_I64=T * H > DROPOUT_I32_ELEMENTS, seed_ptr=seed,
                      dropout_p=float(dropout_p), dropout_scale=_keep_scale(dropout_p))
    with utils.device_guard(h):  # Triton launches on the current device: make it h's
        if utils.capturing(h):  # a binary not loaded yet cannot be loaded inside a capture
            utils.require_loaded(bias_residual_layernorm_kernel, args, kwargs, OP)
        bias_residual_layernorm_kernel[(triton.cdiv(T, rows),)](*args, **kwargs)
    return result


# ---- training: the backward of the row pass ---------------------------------------------------------------------
# With x_hat = (s - mean) * rstd (RMSNorm: s * rstd) and g = dN * gamma, per row of N values:
#     dS = rstd * (g - mean(g) - x_hat * mean(g * x_hat))       (RMSNorm: without mean(g))
#     dgamma = sum over rows of dN * x_hat,   dbeta = sum over rows of dN
# The RMSNorm forward's rounding of the normalised row (transformers') is a cast to autograd, whose gradient passes
# through: dS and dgamma use the fp32 x_hat. dS is also d(residual) and, through the GEMM, gives dy, dW and the dense
# bias's gradient (the unit does those with torch). Each program takes BLOCKS blocks of ROWS rows and writes its
# dgamma / dbeta partial sums to one row of a [programs, N] fp32 buffer; torch sums that buffer over its first
# dimension, a fixed order, so the same inputs give bit-identical gradients (no atomics). BLOCKS = 4: at BERT-base,
# T = 4096, 256 programs, and the partial buffers (2 x 256 x 768 x 4 B = 1.5 MB) are an eighth of what the kernel
# must read anyway (s and dN in fp16: 12.6 MB).
BACKWARD_BLOCKS = 4


@triton.jit
def _backward_chunk(s_ptr, dn_ptr, ln_w_ptr, s_rows, dn_rows, cols, param_cols, mask, mean, rstd,
                    RMS: tl.constexpr, EVEN: tl.constexpr):
    """x_hat, dN and g = dN * gamma for one [ROWS, CHUNK] chunk, in fp32 (zero on masked lanes and rows)."""
    s = tl.load(s_ptr + s_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    dn = tl.load(dn_ptr + dn_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    gamma = tl.load(ln_w_ptr + param_cols).to(tl.float32)
    if RMS:
        x_hat = s * rstd[:, None]
    else:
        x_hat = (s - mean[:, None]) * rstd[:, None]
    if not EVEN:  # a masked lane of a live row reads s = 0, whose x_hat is -mean * rstd
        x_hat = tl.where(mask, x_hat, 0.0)
    return x_hat, dn, dn * gamma[None, :]


@triton.jit
def _backward_store(ds_ptr, dsx_ptr, dh_ptr, ds_rows, dsx_rows, e_rows, cols, mask, x_hat, g, mean_g, mean_gx, rstd,
                    seed_ptr, dropout_p, dropout_scale, HAS_DS_EXTRA: tl.constexpr, RMS: tl.constexpr,
                    DROPOUT: tl.constexpr):
    ds = g - x_hat * mean_gx[:, None]
    if not RMS:
        ds -= mean_g[:, None]
    ds *= rstd[:, None]
    if HAS_DS_EXTRA:  # pre-norm: the gradient that reached the returned stream s joins the norm's
        ds += tl.load(dsx_ptr + dsx_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(ds_ptr + ds_rows + cols[None, :], ds.to(ds_ptr.dtype.element_ty), mask=mask)
    if DROPOUT:  # the forward's keep bits, regenerated: dH = dS * keep / (1 - p), in dS's layout
        keep = dropout_keep(seed_ptr, e_rows + cols[None, :], dropout_p)
        dh = tl.where(keep, ds * dropout_scale, 0.0)
        tl.store(dh_ptr + ds_rows + cols[None, :], dh.to(dh_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=RESIDUAL_LAYERNORM_DO_NOT_SPECIALIZE)
def layernorm_backward_kernel(
    # pointers: dN [T, N] (grad of the norm), dS_extra [T, N] (pre-norm: grad of the returned s), s [T, N] (the
    # norm's input, saved by the forward), stats fp32 ([2, T] mean, rstd; RMSNorm [1, T] rstd), gamma [N],
    # dS [T, N] (out), dgamma / dbeta partial sums fp32 [programs, N] (out)
    dn_ptr, dsx_ptr, s_ptr, stats_ptr, ln_w_ptr, ds_ptr, dw_part_ptr, db_part_ptr,
    # sizes
    T, N,
    # row strides in elements (every last dim is unit-stride)
    stride_dnm, stride_dsxm, stride_sm, stride_dsm,
    # meta-parameters
    HAS_DS_EXTRA: tl.constexpr,  # add dS_extra to dS (pre-norm)
    HAS_LN_BIAS: tl.constexpr,  # write dbeta's partial sums
    RMS: tl.constexpr,  # RMSNorm: no mean (stats holds rstd only)
    ROWS: tl.constexpr, CHUNK: tl.constexpr, NUM_CHUNKS: tl.constexpr, EVEN: tl.constexpr,  # as the forward's
    BLOCKS: tl.constexpr,  # blocks of ROWS rows per program (a constant bound: Triton 3.6 takes no tensor bound)
    DROPOUT: tl.constexpr = False,  # the forward dropped h + bias out: also write dH, dS with its keep bits applied
    OFFSETS_I64: tl.constexpr = False,  # as the forward's
    # dropout (DROPOUT only; None otherwise, compiled as constants): dH [T, N] (out, dS's strides), the forward's
    # seed tensor, probability and 1 / (1 - p)
    dh_ptr=None, seed_ptr=None, dropout_p=None, dropout_scale=None,
):
    tl.static_assert(NUM_CHUNKS == 1 or NUM_CHUNKS == 3, "NUM_CHUNKS must be 1 or 3")
    pid = tl.program_id(0).to(tl.int64)
    c0 = tl.arange(0, CHUNK)
    c1 = c0 + CHUNK
    c2 = c0 + 2 * CHUNK
    if EVEN:
        p0 = c0
    else:
        p0 = tl.minimum(c0, N - 1)
    dw0 = tl.zeros([CHUNK], dtype=tl.float32)
    db0 = tl.zeros([CHUNK], dtype=tl.float32)
    dw1 = tl.zeros([CHUNK], dtype=tl.float32)
    db1 = tl.zeros([CHUNK], dtype=tl.float32)
    dw2 = tl.zeros([CHUNK], dtype=tl.float32)
    db2 = tl.zeros([CHUNK], dtype=tl.float32)
    for block in range(BLOCKS):
        rows = (pid * BLOCKS + block) * ROWS + tl.arange(0, ROWS)
        row_ok = rows < T
        if EVEN:
            m0 = row_ok[:, None]
        else:
            m0 = row_ok[:, None] & (c0 < N)[None, :]
        if RMS:
            rstd = tl.load(stats_ptr + rows, mask=row_ok, other=0.0)
            mean = rstd  # unused
        else:
            mean = tl.load(stats_ptr + rows, mask=row_ok, other=0.0)
            rstd = tl.load(stats_ptr + T + rows, mask=row_ok, other=0.0)
        s_rows = (rows * stride_sm)[:, None]
        dn_rows = (rows * stride_dnm)[:, None]
        x0, dn0, g0 = _backward_chunk(s_ptr, dn_ptr, ln_w_ptr, s_rows, dn_rows, c0, p0, m0, mean, rstd, RMS, EVEN)
        sum_gx = tl.sum(g0 * x0, axis=1)
        sum_g = tl.sum(g0, axis=1)
        dw0 += tl.sum(dn0 * x0, axis=0)
        db0 += tl.sum(dn0, axis=0)
        if NUM_CHUNKS == 3:
            x1, dn1, g1 = _backward_chunk(s_ptr, dn_ptr, ln_w_ptr, s_rows, dn_rows, c1, c1, m0, mean, rstd, RMS,
                                          EVEN)
            x2, dn2, g2 = _backward_chunk(s_ptr, dn_ptr, ln_w_ptr, s_rows, dn_rows, c2, c2, m0, mean, rstd, RMS,
                                          EVEN)
            sum_gx += tl.sum(g1 * x1, axis=1) + tl.sum(g2 * x2, axis=1)
            sum_g += tl.sum(g1, axis=1) + tl.sum(g2, axis=1)
            dw1 += tl.sum(dn1 * x1, axis=0)
            db1 += tl.sum(dn1, axis=0)
            dw2 += tl.sum(dn2 * x2, axis=0)
            db2 += tl.sum(dn2, axis=0)
        mean_gx = sum_gx / N
        mean_g = sum_g / N  # unused by RMSNorm
        ds_rows = (rows * stride_dsm)[:, None]
        dsx_rows = (rows * stride_dsxm)[:, None]
        e_rows = _element_rows(rows, N, DROPOUT, OFFSETS_I64)
        _backward_store(ds_ptr, dsx_ptr, dh_ptr, ds_rows, dsx_rows, e_rows, c0, m0, x0, g0, mean_g, mean_gx, rstd,
                        seed_ptr, dropout_p, dropout_scale, HAS_DS_EXTRA, RMS, DROPOUT)
        if NUM_CHUNKS == 3:
            _backward_store(ds_ptr, dsx_ptr, dh_ptr, ds_rows, dsx_rows, e_rows, c1, m0, x1, g1, mean_g, mean_gx,
                            rstd, seed_ptr, dropout_p, dropout_scale, HAS_DS_EXTRA, RMS, DROPOUT)
            _backward_store(ds_ptr, dsx_ptr, dh_ptr, ds_rows, dsx_rows, e_rows, c2, m0, x2, g2, mean_g, mean_gx,
                            rstd, seed_ptr, dropout_p, dropout_scale, HAS_DS_EXTRA, RMS, DROPOUT)
    part = pid * N
    if EVEN:
        col_ok = c0 < CHUNK
    else:
        col_ok = c0 < N
    tl.store(dw_part_ptr + part + c0, dw0, mask=col_ok)
    if HAS_LN_BIAS:
        tl.store(db_part_ptr + part + c0, db0, mask=col_ok)
    if NUM_CHUNKS == 3:
        tl.store(dw_part_ptr + part + c1, dw1)
        tl.store(dw_part_ptr + part + c2, dw2)
        if HAS_LN_BIAS:
            tl.store(db_part_ptr + part + c1, db1)
            tl.store(db_part_ptr + part + c2, db2)


def train_forward(y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor,
                  ln_weight: torch.Tensor, ln_bias: torch.Tensor | None, eps: float, rms: bool = False,
                  dropout_p: float = 0.0, seed: torch.Tensor | None = None):
    """The forward training runs: (s, LN(s), stats), the pre-norm form of `residual_layernorm` (validated the same
    way) with its row statistics, for either norm placement: s is what the backward needs, and a post-norm caller
    returns LN(s) alone. stats: fp32 [2, T] (mean, rstd) for LayerNorm, [1, T] (rstd) for RMSNorm. Through the
    pre-norm form the LayerNorm reads s rounded to the input dtype, as the twin's does (in fp32 the two forms are
    one). dropout_p > 0: s = dropout(y @ W^T + bias) + residual with keep bits from `seed` (utils.dropout_seed),
    which the backward is handed again; no mask is stored."""
    stats = torch.empty((1 if rms else 2, y.shape[0] if y.dim() == 2 else 0), device=y.device, dtype=torch.float32)
    s, normed = residual_layernorm(y, weight, bias, residual, ln_weight, ln_bias, eps, pre_norm=True, rms=rms,
                                   stats=stats, dropout_p=dropout_p, seed=seed)
    return s, normed, stats


def layernorm_backward(dn: torch.Tensor, ds_extra: torch.Tensor | None, s: torch.Tensor, stats: torch.Tensor,
                       ln_weight: torch.Tensor, has_ln_bias: bool, rms: bool = False, dropout_p: float = 0.0,
                       seed: torch.Tensor | None = None):
    """(dS, dH, dgamma, dbeta) from the norm's output gradient dn [T, H] (and ds_extra [T, H], the gradient of the
    returned stream s in the pre-norm form, or None), the saved s [T, H] and stats of `train_forward`. dS (the
    residual's gradient) has s's dtype; dH is the gradient of y @ W^T + bias: dS itself without dropout, and with
    dropout_p > 0 dS * keep / (1 - p), a second output whose keep bits the kernel regenerates from the forward's
    `seed`. dgamma and dbeta (None unless has_ln_bias) are fp32 [H], reduced over programs in a fixed order.
    Arguments come from the unit's autograd function (cheap asserts only); the row tensors need a unit-stride last
    dimension."""
    T, H = s.shape
    assert dn.shape == s.shape and ln_weight.shape == (H,), (dn.shape, s.shape, ln_weight.shape)
    assert ds_extra is None or ds_extra.shape == s.shape, (ds_extra.shape, s.shape)
    assert stats.dtype == torch.float32 and stats.shape == (1 if rms else 2, T), (stats.dtype, stats.shape)
    assert H <= 1 or all(t.stride(1) == 1 for t in (dn, s) + ((ds_extra,) if ds_extra is not None else ())), (
        dn.stride(), s.stride())
    ds = torch.empty_like(s)
    dh = torch.empty_like(s) if dropout_p > 0 else ds
    assert dh.stride() == ds.stride(), (dh.stride(), ds.stride())  # the kernel addresses dH with dS's row stride
    rows, chunk, num_chunks, num_warps = row_config(H)
    programs = triton.cdiv(T, rows * BACKWARD_BLOCKS)
    dw_part = torch.empty((programs, H), device=s.device, dtype=torch.float32)
    db_part = torch.empty((programs, H), device=s.device, dtype=torch.float32) if has_ln_bias else None
    if T == 0 or H == 0:
        zero = torch.zeros(H, device=s.device, dtype=torch.float32)
        return ds, dh, zero, zero.clone() if has_ln_bias else None
    extra = ds_extra if ds_extra is not None else dn
    args = (dn, extra, s, stats, ln_weight, ds, dw_part, db_part if db_part is not None else dw_part, T, H,
            dn.stride(0), extra.stride(0), s.stride(0), ds.stride(0))
    kwargs = dict(HAS_DS_EXTRA=ds_extra is not None, HAS_LN_BIAS=bool(has_ln_bias), RMS=bool(rms), ROWS=rows,
                  CHUNK=chunk, NUM_CHUNKS=num_chunks, EVEN=chunk * num_chunks == H, BLOCKS=BACKWARD_BLOCKS,
                  num_warps=num_warps)
    if dropout_p > 0:  # the forward's choices: the same seed, probability and element numbers
        assert seed is not None and seed.dtype == torch.int64 and seed.numel() == 1, seed
        kwargs.update(DROPOUT=True, OFFSETS_I64=T * H > DROPOUT_I32_ELEMENTS, dh_ptr=dh, seed_ptr=seed,
                      dropout_p=float(dropout_p), dropout_scale=_keep_scale(dropout_p))
    with utils.device_guard(s):
        layernorm_backward_kernel[(programs,)](*args, **kwargs)
    return ds, dh, dw_part.sum(0), db_part.sum(0) if db_part is not None else None


BERT_HIDDEN = (384, 768, 1024)  # MiniLM / BERT-base / BERT-large


def row_configs() -> dict:
    """{row_config(H) + (EVEN,): the smallest H that gets it} over every H the kernel takes (1..MAX_HIDDEN):
    every distinct kernel the launcher can build for a dtype and bias choice."""
    configs = {}
    for hidden in range(1, MAX_HIDDEN + 1):
        rows, chunk, num_chunks, warps = row_config(hidden)
        configs.setdefault((rows, chunk, num_chunks, warps, chunk * num_chunks == hidden), hidden)
    return configs


# The pre-norm, LayerNorm-without-bias and RMSNorm variants compiled ahead of time: ModernBERT's (pre-norm, no LN
# bias), the pre-norm form with an LN bias, the post-norm form without one, and EuroBERT's (pre-norm RMSNorm), at
# BERT's, ModernBERT's and EuroBERT-210m's widths (base 768, large 1024; 384 for MiniLM-sized models). Other widths
# run the same code with the row_configs of `aot_specs`.
NORM_VARIANTS = ((True, False, False), (True, True, False), (False, False, False), (True, False, True))
# (pre_norm, has_ln_bias, rms)


def _spec(short: str, has_bias: bool, config: tuple, hidden: int, pre_norm: bool = False,
          has_ln_bias: bool = True, rms: bool = False, stats: bool = False, dropout: str = "") -> dict:
    rows, chunk, num_chunks, num_warps, even = config
    ptr = "*" + short
    hints = {"T": None}
    if hidden % 16:
        hints.update(N=None, stride_hm=None, stride_rm=None, stride_om=None, stride_sm=None)
    variant = ("" if has_bias else "-nobias") + ("-prenorm" if pre_norm else "") + (
        "-rms" if rms else "" if has_ln_bias else "-nolnbias") + ("-stats" if stats else "") + _dropout_name(dropout)
    constexprs = {"HAS_BIAS": has_bias, "HAS_LN_BIAS": has_ln_bias, "PRE_NORM": pre_norm, "RMS": rms,
                  "ROWS": rows, "CHUNK": chunk, "NUM_CHUNKS": num_chunks, "EVEN": even}
    if stats:  # inference's specs leave STATS at its default, as its launches do
        constexprs["STATS"] = True
    signature = {"h_ptr": ptr, "bias_ptr": ptr, "res_ptr": ptr, "ln_w_ptr": ptr, "ln_b_ptr": ptr, "out_ptr": ptr,
                 "s_ptr": ptr, "stats_ptr": "*fp32" if stats else ptr, "T": "i32", "N": "i32", "eps": "fp32",
                 "stride_hm": "i32", "stride_rm": "i32", "stride_om": "i32", "stride_sm": "i32"}
    _dropout_args(dropout, signature, constexprs, ("seed_ptr", "dropout_p", "dropout_scale"))
    return {
        "name": f"{OP}-{short}{variant}-H{hidden}-{rows}x{num_chunks}x{chunk}-w{num_warps}{'' if even else '-masked'}",
        "fn": bias_residual_layernorm_kernel,
        "signature": signature,
        "constexprs": constexprs,
        "num_warps": num_warps, "num_stages": 1, "hints": hints,
    }


# Dropout's specialisations: "i32" (element numbers in int32, every call up to DROPOUT_I32_ELEMENTS elements) and
# "i64" (beyond); "" without dropout.
DROPOUT_KINDS = ("i32", "i64")


def _dropout_name(dropout: str) -> str:
    return {"": "", "i32": "-dropout", "i64": "-dropout-i64"}[dropout]


def _dropout_args(dropout: str, signature: dict, constexprs: dict, names: tuple) -> None:
    """The dropout arguments of a spec, as the launchers pass them: with dropout the seed (and dH) pointers, the
    probability and scale, DROPOUT and OFFSETS_I64; without, DROPOUT off and the None defaults, which Triton compiles
    as constants."""
    if not dropout:
        constexprs.update(dict.fromkeys(names), DROPOUT=False, OFFSETS_I64=False)
        return
    constexprs.update(DROPOUT=True, OFFSETS_I64=dropout == "i64")
    types = {"seed_ptr": "*i64", "dropout_p": "fp32", "dropout_scale": "fp32", "dh_ptr": signature.get("ds_ptr")}
    signature.update({name: types[name] for name in names})


def aot_specs() -> list:
    """The post-norm row kernel (with an LN bias) for every dtype x {bias, no bias} x config of `row_configs()` (the
    masked EVEN=False ones included), each named by the smallest width that gets it; then NORM_VARIANTS for every
    dtype x {bias, no bias} at BERT_HIDDEN ("-prenorm", "-nolnbias", "-rms" in the name). Pointers are compiled as
    multiples of 16 (tests/tooling/aot_compile.py's default), as the JIT sees torch allocations; the width N and the
    row strides too when that width is a multiple of 16; "hints" takes it back for T (any token count) and for the
    other widths."""
    specs = []
    for short in DTYPES.values():
        for has_bias in (True, False):
            for config, hidden in row_configs().items():
                specs.append(_spec(short, has_bias, config, hidden))
    for short in DTYPES.values():
        for has_bias in (True, False):
            for pre_norm, has_ln_bias, rms in NORM_VARIANTS:
                for hidden in BERT_HIDDEN:
                    config = row_config(hidden) + (True,)
                    specs.append(_spec(short, has_bias, config, hidden, pre_norm, has_ln_bias, rms))
    # training: the forward that also writes the statistics (always the pre-norm form, see `train_forward`), and the
    # backward, for each norm kind training runs at BERT_HIDDEN (with dropout: `dropout_aot_specs`)
    for short in DTYPES.values():
        for has_ln_bias, rms, ds_extra in BACKWARD_VARIANTS:
            for hidden in BERT_HIDDEN:
                config = row_config(hidden) + (True,)
                specs.append(_spec(short, True, config, hidden, True, has_ln_bias, rms, stats=True))
                specs.append(_backward_spec(short, config, hidden, has_ln_bias, rms, ds_extra))
    return specs


def dropout_aot_specs() -> list:
    """Training's row kernels with dropout ("-dropout"), the forward (with statistics) and the backward, for every
    dtype x norm kind of BACKWARD_VARIANTS at BERT_HIDDEN; with int64 element numbers ("-dropout-i64", calls of more
    than DROPOUT_I32_ELEMENTS elements) at BERT-base's width. Hints as in `aot_specs`."""
    specs = []
    for short in DTYPES.values():
        for has_ln_bias, rms, ds_extra in BACKWARD_VARIANTS:
            for hidden in BERT_HIDDEN:
                config = row_config(hidden) + (True,)
                for dropout in DROPOUT_KINDS if hidden == 768 else DROPOUT_KINDS[:1]:
                    specs.append(_spec(short, True, config, hidden, True, has_ln_bias, rms, stats=True,
                                       dropout=dropout))
                    specs.append(_backward_spec(short, config, hidden, has_ln_bias, rms, ds_extra, dropout))
    return specs


# (has_ln_bias, rms, ds_extra): BERT's post-norm LayerNorm, ModernBERT's pre-norm LayerNorm without bias, EuroBERT's
# pre-norm RMSNorm
BACKWARD_VARIANTS = ((True, False, False), (False, False, True), (False, True, True))


def _backward_spec(short: str, config: tuple, hidden: int, has_ln_bias: bool, rms: bool, ds_extra: bool,
                   dropout: str = "") -> dict:
    rows, chunk, num_chunks, num_warps, even = config
    ptr = "*" + short
    variant = ("-prenorm" if ds_extra else "") + ("-rms" if rms else "" if has_ln_bias else "-nolnbias") + (
        _dropout_name(dropout))
    signature = {"dn_ptr": ptr, "dsx_ptr": ptr, "s_ptr": ptr, "stats_ptr": "*fp32", "ln_w_ptr": ptr, "ds_ptr": ptr,
                 "dw_part_ptr": "*fp32", "db_part_ptr": "*fp32", "T": "i32", "N": "i32",
                 "stride_dnm": "i32", "stride_dsxm": "i32", "stride_sm": "i32", "stride_dsm": "i32"}
    constexprs = {"HAS_DS_EXTRA": ds_extra, "HAS_LN_BIAS": has_ln_bias, "RMS": rms, "ROWS": rows, "CHUNK": chunk,
                  "NUM_CHUNKS": num_chunks, "EVEN": even, "BLOCKS": BACKWARD_BLOCKS}
    _dropout_args(dropout, signature, constexprs, ("dh_ptr", "seed_ptr", "dropout_p", "dropout_scale"))
    return {
        "name": f"{OP}-backward-{short}{variant}-H{hidden}-{rows}x{num_chunks}x{chunk}-b{BACKWARD_BLOCKS}"
                f"-w{num_warps}",
        "fn": layernorm_backward_kernel,
        "signature": signature,
        "constexprs": constexprs,
        "num_warps": num_warps, "num_stages": 1, "hints": {"T": None},
    }
