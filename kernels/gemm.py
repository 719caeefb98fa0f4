"""The one GEMM-with-epilogue core behind qkv_projection and bias_gelu:  C[M, N] = act(A[M, K] @ W[N, K]^T + bias[N]).

Why an epilogue pays. Unfused, a BERT FFN-in (T tokens, H -> I, 2-byte types) writes the pre-activation h [T, I],
then the activation reads h and writes y: 4TI extra bytes (BERT-base, T = 4096: 50 MB, ~12 us at 4.3 TB/s next to a
~40 us GEMM) plus a launch. Here bias and activation run on the fp32 accumulator in registers, the output is rounded
once, at the store. That only pays if the epilogue is cheap: see `_gelu_erf`.

Two kernels, one epilogue:
- `gemm_tma_kernel` (sm_90, fp16/bf16): persistent (one program per SM walks the tiles), operands and the output
  through TMA tensor descriptors made on the device (`tl.make_tensor_descriptor`, Triton >= 3.4: 3.6 and 3.9 alike),
  wgmma tiles up to 128x256 / 256x128. Device-side descriptors carry their block shape as a constexpr, so the
  autotuner needs no pre_hook, and Triton's on-disk autotune cache (`cache_results`, which refuses configs with
  pre_hooks) can keep its choice across processes. They need a scratch allocator (`_ensure_allocator`).
- `gemm_kernel` (sm_80, fp32, and any layout TMA cannot describe): pointer loads that Triton pipelines through
  cp.async; W is read through any strides.
Both run in Triton's interpreter (the tests run every config of both on CPU); what only the GPU shows (TMA, wgmma,
the pipelining) is proven ahead of time by tests/tooling/test_aot.py (UTMALDG, HGMMA, no spills).

Small T (BERT at 1x128): the GEMM streams W (BERT-base QKV: 3.5 MB), so the configs that matter read W once: a
128-row tile holds all of T <= 128, and 32-column panels give N/32 programs (72 for QKV, 96 for FFN-in: one wave on
132 SMs, every program streaming its own panel). Split-K would reach more SMs but needs a second pass (or atomics)
before a nonlinear epilogue; at ~1-2 us per GEMM the extra launch would cost what it saves.

The gated epilogue (GATED, GeGLU: ModernBERT's MLP in). W is HF's Wi [2N, K], the input half in rows 0..N-1 and the
gate half in rows N..2N-1, and the output is act(a) * g [M, N] for [a, g] = A @ W^T + b. The [M, 2N] pre-activation
never reaches memory: the program of output columns [n0, n0 + BLOCK_N) runs two accumulators over the same A tiles,
one over W rows n0.. and one over rows N + n0.., read in place. So W keeps HF's layout and its one copy (interleaving
a/g rows at load time would need a second copy or a relayout of the parameter); the FLOPs are the plain GEMM's over
2N columns. Both kernels take it (the TMA one through a second descriptor at the gate half, whose clipping at N rows
is then exact). A gated tile holds two accumulators and streams two W panels per K step, so its configs are the
plain lists with BLOCK_N halved (`gated_configs`): registers and shared memory stay where the plain tiles had them.
The TMA kernel's gated epilogue needed no other change, so no layout is refused to it.
With "silu" the gated epilogue is the SwiGLU of NomicBERT, GTE and EuroBERT.

fp32 honours torch.backends.cuda.matmul.allow_tf32 (tl.dot's input_precision "tf32", else "ieee"); 16-bit types
always pass "ieee" so the flag never causes a second compile.
"""
from __future__ import annotations

import functools
import itertools

import torch
import triton
import triton.language as tl
from triton.runtime import _allocation

from . import utils
from .utils import DTYPES, input_precision, loop_bound

ACTIVATIONS = ("gelu", "gelu_tanh", "relu", "silu")  # plus None: no activation
GROUP_M = 8

# On CUDA the epilogue's reciprocal is the hardware's rcp.approx (one MUFU op); the interpreter cannot run inline PTX
# and divides instead (they differ by at most 1 ulp of the reciprocal, far below the GELU approximation's error).
_FAST_RCP = tl.constexpr(not utils.INTERPRET)


# --------------------------------------------------------------------------------------------------------------------
# The epilogue
# --------------------------------------------------------------------------------------------------------------------
@triton.jit
def _rcp(x):
    # 1/x as Triton writes it is div.full.f32: ~11 SASS instructions with its range fix-ups; rcp.approx.ftz is one.
    if _FAST_RCP:
        y = tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True,
                                      pack=1)
    else:
        y = 1.0 / x
    return y


@triton.jit
def _gelu_erf(x):
    """Exact-erf GELU, x * Phi(x), to ~3e-7 absolute in fp32 (libdevice's erff costs 3x the instructions).

    x Phi(x) = max(x, 0) - |x| Phi(-|x|), and Phi(-|x|) = erfc(|x| / sqrt 2) / 2 by Abramowitz & Stegun 7.1.26:
    t p(t) exp(-x^2 / 2), t = 1 / (1 + 0.3275911 |x| / sqrt 2), |error| <= 1.5e-7 (halved here). |x| t is written
    (1 - t) / (0.3275911 / sqrt 2), so |x| = inf gives 0, not inf * 0. NaN stays NaN (through the tail term);
    +inf -> +inf, -inf -> 0 (the limit; torch's erf form gives NaN there)."""
    u = tl.abs(x) * 0.8493218002880191  # |x| sqrt(log2(e) / 2): exp2(-u^2) = exp(-x^2 / 2)
    e = tl.exp2(-(u * u))
    t = _rcp(1.0 + 0.27273748087922245 * u)
    p = 0.127414796 + t * (-0.142248368 + t * (0.7107068705 + t * (-0.7265760135 + t * 0.5307027145)))
    tail = (4.317008497401471 - 4.317008497401471 * t) * p * e  # |x| Phi(-|x|)
    return tl.maximum(x, 0.0) - tail


@triton.jit
def _gelu_tanh(x):
    # 0.5 x (1 + tanh(u)) = x sigmoid(2u) = x / (1 + exp2(-2 log2(e) u)), u = sqrt(2/pi) (x + 0.044715 x^3):
    # the same function with no tanh call. Very negative x: exp2 -> inf, rcp -> 0, the result -0.0 as tanh gives.
    z = x * (-2.302208198144325 - 0.1029432395800235 * (x * x))
    return x * _rcp(1.0 + tl.exp2(z))


@triton.jit
def _silu(x):
    """x sigmoid(x) in fp32 with two MUFU ops (ex2, rcp), as _gelu_tanh. F.silu's x / (1 + exp(-x)) rounds
    1 + exp(-x) near 1 for x > 0, an ulp of 1 lost in the sigmoid (|error| up to 1.3e-6 on [-24, 24]). Here
    e = exp(-|x|) <= 1 and t = x e / (1 + e); the result is x - t for x > 0 (t a small correction: within 3 eps)
    and t for x <= 0 (within (3 + 0.75|x|) eps: exp2's argument is rounded); |error| <= 1e-6 on [-24, 24]
    (tests/kernels/test_gemm.py). x is capped at 128 in t, past which e is 0: +inf gives +inf, not inf * 0. Very
    negative x (-3e38 too): e -> 0, the result -0.0, as F.silu's. NaN stays NaN (through e); -inf gives NaN
    (-inf * 0), as F.silu."""
    e = tl.exp2(-1.4426950408889634 * tl.abs(x))
    t = tl.minimum(x, 128.0) * e * _rcp(1.0 + e)
    return tl.where(x > 0, x - t, t)


@triton.jit
def _activate(x, ACTIVATION: tl.constexpr):
    """act(x) in fp32 (None: x itself): the epilogue's, and the backward's act(a) of a gated MLP."""
    if ACTIVATION == "gelu":
        x = _gelu_erf(x)
    elif ACTIVATION == "gelu_tanh":
        x = _gelu_tanh(x)
    elif ACTIVATION == "relu":
        x = tl.maximum(x, 0.0, propagate_nan=tl.PropagateNan.ALL)  # as torch.relu: NaN in, NaN out
    elif ACTIVATION == "silu":
        x = _silu(x)
    return x


@triton.jit
def _epilogue(acc, bias_ptr, offs_n, N, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr):
    """bias + activation on the fp32 accumulator tile."""
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    return _activate(acc, ACTIVATION)


@triton.jit
def _gated_epilogue(acc, acc_g, bias_ptr, offs_n, N, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr):
    """act(acc + b[:N]) * (acc_g + b[N:]) on the two fp32 accumulator tiles (the input and the gate half)."""
    a = _epilogue(acc, bias_ptr, offs_n, N, HAS_BIAS, ACTIVATION)
    g = _epilogue(acc_g, bias_ptr + N, offs_n, N, HAS_BIAS, None)
    return a * g


@triton.jit
def _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    # Grouped ordering: GROUP_M row-blocks walk down one column panel of W together, so the panel is reused from L2.
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = tile_id // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((tile_id % num_pid_in_group) % group_size_m)
    pid_n = (tile_id % num_pid_in_group) // group_size_m
    return pid_m, pid_n


# --------------------------------------------------------------------------------------------------------------------
# The kernels
# --------------------------------------------------------------------------------------------------------------------
# The token count M (and the TMA kernel's program count, which follows it at small T) only feed cdiv, masks, the
# wrap-around and descriptor shapes: not specialised, so every T shares one binary per config (kernels/__init__.py).
GEMM_DO_NOT_SPECIALIZE = ("M",)
GEMM_TMA_DO_NOT_SPECIALIZE = ("M", "NUM_PROGRAMS")


@triton.jit(do_not_specialize=GEMM_DO_NOT_SPECIALIZE)
def gemm_kernel(
    # pointers: A [M, K] (unit last stride), W [N, K] (any strides; [2N, K] when GATED), bias [N] ([2N] when GATED,
    # contiguous), C [M, N] (unit last stride)
    a_ptr, w_ptr, bias_ptr, c_ptr,
    # sizes; M_BUCKET is unused by the code, it only feeds the autotune key (next power of two of M)
    M, N, K, M_BUCKET,
    # strides, in elements
    stride_am, stride_wn, stride_wk, stride_cm,
    # epilogue and precision choices
    HAS_BIAS: tl.constexpr,  # add bias[N] to the fp32 accumulator
    ACTIVATION: tl.constexpr,  # None, "gelu" (erf), "gelu_tanh", "relu", "silu"
    INPUT_PRECISION: tl.constexpr,  # "ieee" or "tf32" (only matters for fp32 inputs)
    # tile shape
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    GATED: tl.constexpr = False,  # act(a) * g over W's two halves (N output columns from 2N weight rows)
):
    pid = tl.program_id(0).to(tl.int64)
    pid_m, pid_n = _tile_coords(pid, tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)

    # Rows/columns past the edge wrap around (% M, % N) instead of being masked: the loads stay unmasked along M and
    # N (full-width vector loads), and the wrapped rows/columns are simply not stored.
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_am = offs_m % M
    offs_wn = offs_n % N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_am[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + offs_k[:, None] * stride_wk + offs_wn[None, :] * stride_wn  # W^T tile [BLOCK_K, BLOCK_N]

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if GATED:  # the gate half: W rows N + offs_wn, the same A tile
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        wg_ptrs = w_ptrs + N * stride_wn
    for k in range(0, loop_bound(tl.cdiv(K, BLOCK_K))):
        k_remaining = K - k * BLOCK_K  # only the last K step is partial; masked lanes load 0 and add nothing
        a = tl.load(a_ptrs, mask=offs_k[None, :] < k_remaining, other=0.0)
        w = tl.load(w_ptrs, mask=offs_k[:, None] < k_remaining, other=0.0)
        acc = tl.dot(a, w, acc, input_precision=INPUT_PRECISION)
        if GATED:
            wg = tl.load(wg_ptrs, mask=offs_k[:, None] < k_remaining, other=0.0)
            acc_g = tl.dot(a, wg, acc_g, input_precision=INPUT_PRECISION)
            wg_ptrs += BLOCK_K * stride_wk
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk

    if GATED:
        acc = _gated_epilogue(acc, acc_g, bias_ptr, offs_n, N, HAS_BIAS, ACTIVATION)
    else:
        acc = _epilogue(acc, bias_ptr, offs_n, N, HAS_BIAS, ACTIVATION)
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :]
    c_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


@triton.jit(do_not_specialize=GEMM_TMA_DO_NOT_SPECIALIZE)
def gemm_tma_kernel(
    # pointers: A [M, K], W [N, K] ([2N, K] when GATED), C [M, N], all with unit last stride and 16-byte aligned
    # rows; bias [N] ([2N] when GATED)
    a_ptr, w_ptr, bias_ptr, c_ptr,
    # sizes (M_BUCKET only feeds the autotune key) and the number of programs the grid launched (<= SMs)
    M, N, K, M_BUCKET, NUM_PROGRAMS,
    # row strides, in elements
    stride_am, stride_wn, stride_cm,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,  # a producer warp group issues the TMA loads, the consumers run wgmma + epilogue
    GATED: tl.constexpr = False,  # act(a) * g over W's two halves (N output columns from 2N weight rows)
):
    # TMA clips the edges: loads past M, N or K read zeros, stores past M or N are dropped. No masks, no wrap-around.
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[stride_am, 1], block_shape=[BLOCK_M, BLOCK_K])
    w_desc = tl.make_tensor_descriptor(w_ptr, shape=[N, K], strides=[stride_wn, 1], block_shape=[BLOCK_N, BLOCK_K])
    c_desc = tl.make_tensor_descriptor(c_ptr, shape=[M, N], strides=[stride_cm, 1], block_shape=[BLOCK_M, BLOCK_N])
    if GATED:  # the gate half as its own [N, K] tensor: TMA clips its rows at N, as the input half's
        wg_desc = tl.make_tensor_descriptor(w_ptr + N * stride_wn, shape=[N, K], strides=[stride_wn, 1],
                                            block_shape=[BLOCK_N, BLOCK_K])
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    start = tl.program_id(0)
    # The epilogue's tile comes from its own counter, not from the loads' pid_m/pid_n: Triton's persistent-matmul
    # tutorial does the same to avoid a pipelining bug with a value used both in the loads and in the epilogue.
    tile_id_c = start - NUM_PROGRAMS
    # Persistent: each program walks tiles NUM_PROGRAMS apart. Without warp specialization, flatten=True lets Triton
    # pipeline the next tile's loads under this tile's epilogue; with it, Triton's Hopper pass splits the K loop
    # into producer and consumer partitions (it does not take a flattened loop).
    for tile_id in tl.range(loop_bound(start), loop_bound(num_pid_m * num_pid_n), loop_bound(NUM_PROGRAMS),
                            flatten=not WARP_SPECIALIZE):
        pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if GATED:
            acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in tl.range(loop_bound(k_tiles), warp_specialize=WARP_SPECIALIZE):
            a = a_desc.load([off_m, k * BLOCK_K])
            w = w_desc.load([off_n, k * BLOCK_K])
            acc = tl.dot(a, w.T, acc, input_precision=INPUT_PRECISION)
            if GATED:
                wg = wg_desc.load([off_n, k * BLOCK_K])
                acc_g = tl.dot(a, wg.T, acc_g, input_precision=INPUT_PRECISION)
        tile_id_c += NUM_PROGRAMS
        pid_m_c, pid_n_c = _tile_coords(tile_id_c, num_pid_m, num_pid_n, GROUP_M)
        offs_n = pid_n_c * BLOCK_N + tl.arange(0, BLOCK_N)
        if GATED:
            acc = _gated_epilogue(acc, acc_g, bias_ptr, offs_n, N, HAS_BIAS, ACTIVATION)
        else:
            acc = _epilogue(acc, bias_ptr, offs_n, N, HAS_BIAS, ACTIVATION)
        c_desc.store([pid_m_c * BLOCK_M, pid_n_c * BLOCK_N], acc.to(c_desc.dtype))


# --------------------------------------------------------------------------------------------------------------------
# Autotune configs: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)
# --------------------------------------------------------------------------------------------------------------------
def gemm_configs(element_size: int) -> list:
    """The pointer kernel's tiles (sm_80, and fp32 everywhere). BLOCK_K keeps stages * (BM + BN) * BK * bytes
    <= 96 KB, inside sm_80's 163 KB. The 128-row tiles with 64+ columns run 8 warps: at 4 warps the GELU epilogues
    spilled (128x128 on sm_90; 128x64 on sm_80, STACK 8). fp32 "ieee" dots run on FMA units with operands in
    registers: 64x32x16 is the narrow tile that does not spill there. 128x32 reads W once for T <= 128."""
    if element_size == 4:
        return [(128, 128, 32, 8, 3), (128, 64, 32, 8, 4), (64, 128, 32, 4, 4), (64, 64, 32, 4, 4),
                (64, 32, 16, 4, 4)]
    return [(128, 128, 64, 8, 3), (128, 64, 64, 8, 4), (64, 128, 64, 4, 4), (64, 64, 64, 4, 4),
            (64, 32, 128, 4, 4), (128, 32, 64, 4, 4)]


def gemm_tma_configs(warp_specialize: bool = utils.WARP_SPECIALIZE) -> list:
    """The sm_90 TMA kernel's tiles (fp16/bf16), + a 6th field: warp specialization. 128x256 and 256x128 at 8 warps
    (two warpgroups, 128 accumulators per thread) are the large-T throughput tiles; 3 stages of operands (144 KB)
    plus the output staging tile (64 KB) fit 227 KB. 128x128 at 8 warps with 4 stages; 128x64 / 64x128 mid-size;
    128x32 and 64x32 for T <= 128, where the GEMM streams W (see the header).
    `warp_specialize` (FASTBERT_WARP_SPECIALIZE=1; the AOT list always) appends the two 4-warp 128-row tiles with
    a TMA producer and a wgmma consumer partition (Triton 3.6 and 3.9 split 4-warp K loops on sm_90; 8-warp tiles
    stay unsplit, and 64x256 crashes Triton 3.9's lowering). Off by default: see utils.WARP_SPECIALIZE."""
    configs = [(128, 256, 64, 8, 3, False), (256, 128, 64, 8, 3, False), (128, 128, 64, 8, 4, False),
               (128, 64, 64, 4, 4, False), (64, 128, 64, 4, 4, False), (128, 32, 64, 4, 4, False),
               (64, 32, 64, 4, 4, False)]
    if warp_specialize:
        configs += [(128, 128, 64, 4, 4, True), (128, 64, 64, 4, 4, True)]
    return configs


def gated_configs(configs) -> list:
    """The gated kernel's tiles: each plain tile with BLOCK_N halved, so that its two accumulators and two W panels
    take the registers and shared memory one plain tile took (tests/tooling/test_aot.py: no spills). 32-column tiles
    stay as they are, and a tile that halves onto the shape (BLOCK_M x 32, warps) of one of them is left out: that
    tile serves it (the pointer kernel's 64x32x64 at 4 warps, which the 64x32x128 tile covers, spills 24 bytes on
    sm_80 under Triton 3.6)."""
    narrow = {(c[0], c[3], *c[5:]) for c in configs if c[1] <= 32}
    halved = [c if c[1] <= 32 else (c[0], c[1] // 2, *c[2:]) for c in configs]
    return list(dict.fromkeys(h for c, h in zip(configs, halved)
                              if c[1] <= 32 or h[1] > 32 or (h[0], h[3], *h[5:]) not in narrow))


INTERPRETER_CONFIG = (32, 128, 128, 4, 1)  # one fixed tile under TRITON_INTERPRET=1 (num_warps/stages are ignored)

_AUTOTUNE_KEY = ["N", "K", "M_BUCKET", "HAS_BIAS", "ACTIVATION", "INPUT_PRECISION", "GATED"]  # + dtypes, implicitly


def _meta(cfg) -> dict:
    """A config tuple's constexprs: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages[, warp specialization])."""
    meta = {"BLOCK_M": cfg[0], "BLOCK_N": cfg[1], "BLOCK_K": cfg[2], "GROUP_M": GROUP_M}
    if len(cfg) > 5:
        meta["WARP_SPECIALIZE"] = cfg[5]
    return meta


@functools.lru_cache(maxsize=None)
def _triton_config(cfg: tuple) -> "triton.Config":
    """The Config of a tile tuple, one object per tuple. A pinned launch passes its `all_kwargs()`, as the autotuner
    does: both then file under one JIT key and share one binary (and a capture finds the tuned launch's loaded)."""
    return triton.Config(_meta(cfg), num_warps=cfg[3], num_stages=cfg[4])


def prune_configs(configs, named_args, **kwargs):
    """Skip tiles with more rows than the bucketed token count has (they only compute zeros): fewer configs to
    benchmark at small T. Always keeps at least the tiles of the smallest BLOCK_M."""
    m_bucket = named_args["M_BUCKET"]
    smallest = min(c.kwargs["BLOCK_M"] for c in configs)
    return [c for c in configs if c.kwargs["BLOCK_M"] <= max(m_bucket, smallest)]


def _autotuned(fn, configs):
    return utils.autotune(fn, [_triton_config(c) for c in configs], _AUTOTUNE_KEY, prune_configs)


def kernel_configs(kernel: str, element_size: int, gated: bool = False,
                   warp_specialize: bool = utils.WARP_SPECIALIZE) -> list:
    """The autotune list of one (kernel, element size, gated) variant; `warp_specialize` as gemm_tma_configs'
    (the AOT list takes the opt-in tiles always: `gemm_aot_specs`)."""
    configs = gemm_tma_configs(warp_specialize) if kernel == "tma" else gemm_configs(element_size)
    return gated_configs(configs) if gated else configs


# One Autotuner per (kernel, element size, gated): each wraps the same JIT function, with that variant's tiles.
_VARIANTS = [("ptr", 2), ("ptr", 4), ("tma", 2)]
_AUTOTUNED = {(kernel, size, gated): _autotuned(gemm_tma_kernel if kernel == "tma" else gemm_kernel,
                                                kernel_configs(kernel, size, gated))
              for kernel, size in _VARIANTS for gated in (False, True)}
# What a launch takes instead of benchmarking while a CUDA graph is captured (see `gemm`): the first config of each
# default list, never a warp-specialized one (those come last, and only with the opt-in).
CAPTURE_CONFIGS = {(kernel, size, gated): (gated_configs if gated else list)(
                       gemm_tma_configs(warp_specialize=False) if kernel == "tma" else gemm_configs(size))[0]
                   for kernel, size in _VARIANTS for gated in (False, True)}


def config_name(cfg) -> str:
    bm, bn, bk, warps, stages = cfg[:5]
    return f"{bm}x{bn}x{bk}-w{warps}-s{stages}" + ("-ws" if len(cfg) > 5 and cfg[5] else "")


# --------------------------------------------------------------------------------------------------------------------
# Device facts, read once per device
# --------------------------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _device_facts(index: int) -> tuple:
    """(compute capability major, number of SMs) of CUDA device `index`."""
    props = torch.cuda.get_device_properties(index)
    return props.major, props.multi_processor_count


_ALLOCATOR = _allocation._allocator  # the ContextVar triton.set_allocator sets (Triton 3.6 and 3.9)
# (device, stream, size) -> the scratch buffer every eager TMA launch of that size on that stream reuses.
_SCRATCH: dict = {}


def _scratch(size: int, alignment: int, stream):
    """Global scratch for the device-side TMA descriptors (128 B per descriptor and program), which Triton's
    launcher asks for at every launch (3.6 and 3.9), on the launch's device (the launcher's device guard made it
    the current one); torch's allocations are 512-byte aligned, more than the descriptors' 64/128.

    Eager launches reuse one buffer per (device, stream, size): launches on one stream run in order, so two never
    use a buffer at once, and another stream (or device: stream handle 0 is every device's default stream) gets
    its own. Inside a CUDA-graph capture a fresh tensor each launch, from the graph's private pool, as any
    temporary of the captured forward (the pool reuses it in the capture's stream order); never the cache: an
    eager buffer recorded into a graph would be shared between its replays and later eager launches on another
    stream, and a pool buffer cached under the capture's stream would be shared with eager work on that stream
    once torch hands the stream out again. The cache stays small: sizes follow the grid (<= one program per SM)
    and torch hands out a fixed pool of streams. tests/kernels/test_launch.py counts the allocations."""
    device = torch.cuda.current_device()
    if torch.cuda.is_current_stream_capturing():
        return torch.empty(size, dtype=torch.int8, device=torch.device("cuda", device))
    key = (device, stream, size)
    buffer = _SCRATCH.get(key)
    if buffer is None:
        buffer = _SCRATCH[key] = torch.empty(size, dtype=torch.int8, device=torch.device("cuda", device))
    return buffer


def _ensure_allocator() -> None:
    """Device-side tensor descriptors need triton.set_allocator; install torch's unless the caller set one. The
    setting is a ContextVar (per thread), so this is checked at each TMA launch: one ContextVar read."""
    if isinstance(_ALLOCATOR.get(), _allocation.NullAllocator):
        triton.set_allocator(_scratch)


def tma_compatible(a: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> bool:
    """TMA describes a 2-D tensor by a 16-byte-aligned base, unit last stride and 16-byte-multiple row strides."""
    if a.dtype not in (torch.float16, torch.bfloat16):
        return False
    size = a.element_size()
    for t in (a, weight, out):
        if t.stride(1) != 1 or (t.stride(0) * size) % 16 or t.data_ptr() % 16:
            return False
    return True


def use_tma(a: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> bool:
    """The persistent TMA kernel runs on Hopper (sm_90) for 16-bit types when the layouts allow it."""
    if a.device.type != "cuda" or _device_facts(a.device.index or 0)[0] != 9:
        return False
    return tma_compatible(a, weight, out)


def num_programs(device: torch.device, M: int, N: int, block_m: int, block_n: int) -> int:
    """The persistent grid: one program per SM, or per tile when there are fewer tiles."""
    sms = _device_facts(device.index or 0)[1] if device.type == "cuda" else 4
    return max(1, min(sms, triton.cdiv(M, block_m) * triton.cdiv(N, block_n)))


# --------------------------------------------------------------------------------------------------------------------
# Validation shared by the public launchers (qkv_projection, bias_gelu, residual_layernorm)
# --------------------------------------------------------------------------------------------------------------------
def check_device(op: str, **tensors) -> torch.device:
    """All tensors on one device, and that device is CUDA (or CPU under TRITON_INTERPRET=1)."""
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        listing = ", ".join(f"{name} on {device}" for name, device in devices.items())
        raise ValueError(f"{op}: all tensors must be on one device; got {listing}")
    device = next(iter(devices.values()))
    if utils.device_unsupported(device):
        raise ValueError(f"{op}: the tensors are on {device}; the Triton kernels need CUDA tensors "
                         f"(or CPU tensors with TRITON_INTERPRET=1 to run them in Triton's interpreter)")
    return device


def check_dtypes(op: str, **tensors) -> torch.dtype:
    """All given tensors share one dtype out of fp32/fp16/bf16."""
    for name, t in tensors.items():
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    dtypes = {name: t.dtype for name, t in tensors.items() if t is not None}
    first_name, dtype = next(iter(dtypes.items()))
    if dtype not in DTYPES:
        raise TypeError(f"{op}: {first_name}.dtype={dtype} is not one of float32, float16, bfloat16")
    mismatched = {name: d for name, d in dtypes.items() if d != dtype}
    if mismatched:
        listing = ", ".join(f"{name}.dtype={d}" for name, d in dtypes.items())
        raise TypeError(f"{op}: all tensors must share one dtype; got {listing}")
    return dtype


def check_linear(op: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, x_name: str = "x",
                 unit_stride: bool = True):
    """x [M, K] (with a unit-stride last dim when `unit_stride`), weight [N, K], bias [N] or None. Returns (M, N, K)."""
    if x.dim() != 2:
        raise ValueError(f"{op}: {x_name} must be 2-D [tokens, features]; got {x_name}.shape={tuple(x.shape)}")
    if weight.dim() != 2:
        raise ValueError(f"{op}: weight must be 2-D [out_features, in_features]; "
                         f"got weight.shape={tuple(weight.shape)}")
    M, K = x.shape
    N = weight.shape[0]
    if weight.shape[1] != K:
        raise ValueError(f"{op}: {x_name}.shape[1]={K} must match weight.shape[1]={weight.shape[1]} "
                         f"(weight is [out_features, in_features] = {tuple(weight.shape)})")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != N):
        raise ValueError(f"{op}: bias must be [{N}] (weight.shape[0]); got bias.shape={tuple(bias.shape)}")
    if bias is not None and N > 1 and bias.stride(0) != 1:
        raise ValueError(f"{op}: bias must be contiguous; got bias.stride()={bias.stride()}")
    if unit_stride and K > 1 and x.stride(1) != 1:
        raise ValueError(f"{op}: {x_name} must have a unit-stride last dimension (rows may be strided); "
                         f"got {x_name}.stride()={x.stride()} for shape {tuple(x.shape)}")
    return M, N, K


def check_out(op: str, out: torch.Tensor, shape: tuple, dtype: torch.dtype, device: torch.device) -> None:
    """A caller-provided output: exact shape, dtype and device, unit-stride last dimension."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{op}: out must be a torch.Tensor, got {type(out).__name__}")
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"{op}: out.shape={tuple(out.shape)} must be {tuple(shape)}")
    if out.dtype != dtype:
        raise TypeError(f"{op}: out.dtype={out.dtype} must be the input dtype {dtype}")
    if out.device != device:
        raise ValueError(f"{op}: out is on {out.device} but the inputs are on {device}")
    if out.dim() >= 2 and out.shape[-1] > 1 and out.stride(-1) != 1:
        raise ValueError(f"{op}: out must have a unit-stride last dimension; got out.stride()={out.stride()}")


# --------------------------------------------------------------------------------------------------------------------
# The launcher (arguments already validated: by the op's public function, or once per forward by the model)
# --------------------------------------------------------------------------------------------------------------------
def gemm(a: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
         activation: str | None = None, *, gated: bool = False, config: tuple | None = None,
         kernel: str | None = None) -> torch.Tensor:
    """out[M, N] = act(a[M, K] @ weight[N, K]^T + bias); gated: weight [2N, K], bias [2N] and out = act(a) * g for
    [a, g] = a @ weight^T + bias (see the header). Cheap asserts only. `kernel` ("tma" / "ptr") and `config`
    (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) pin a kernel and a tile instead of the per-arch choice and the
    autotuner (the tests run every config of both kernels with them). Runs on a's device (a device guard). While a
    CUDA graph is captured, a key the autotuner has not tuned takes CAPTURE_CONFIGS (benchmarking would sync), and
    a binary that is not loaded yet is refused (utils.NotWarmedUp: warm up first)."""
    assert activation is None or activation in ACTIVATIONS, activation
    assert a.dim() == 2 and weight.dim() == 2 and a.shape[1] == weight.shape[1], (a.shape, weight.shape)
    assert out.shape == (a.shape[0], weight.shape[0] // (2 if gated else 1)), (out.shape, weight.shape, gated)
    assert not gated or weight.shape[0] % 2 == 0, weight.shape
    assert a.dtype == weight.dtype == out.dtype
    if utils.INTERPRET and a.dtype == torch.bfloat16:
        raise NotImplementedError(utils.INTERPRETER_BF16_DOT)
    M, K = a.shape
    N = out.shape[1]
    if M == 0 or N == 0:
        return out  # nothing to compute (a zero-size grid is not launchable)
    if kernel is None:
        kernel = "tma" if use_tma(a, weight, out) else "ptr"
    if config is None and utils.INTERPRET:
        config = INTERPRETER_CONFIG
    bias_arg = bias if bias is not None else a  # bias_ptr is never read when HAS_BIAS is False
    meta = dict(HAS_BIAS=bias is not None, ACTIVATION=activation, INPUT_PRECISION=input_precision(a.dtype),
                GATED=bool(gated))
    m_bucket = max(16, triton.next_power_of_2(M))
    variant = (kernel, a.element_size(), bool(gated))
    tma = kernel == "tma"

    with utils.device_guard(a):
        if tma:
            if a.device.type == "cuda":
                _ensure_allocator()
            # NUM_PROGRAMS is a runtime argument: the SM count, whatever tile wins (the grid clips it per config).
            args = [a, weight, bias_arg, out, M, N, K, m_bucket, num_programs(a.device, M, N, 1, 1),
                    a.stride(0), weight.stride(0), out.stride(0)]
        else:
            args = [a, weight, bias_arg, out, M, N, K, m_bucket, a.stride(0), weight.stride(0), weight.stride(1),
                    out.stride(0)]
        capture = utils.capturing(a)
        if config is None and utils.invariant():  # the same tile whatever the token count (utils.batch_invariant)
            config = CAPTURE_CONFIGS[variant]
        if config is None and not capture:
            if tma:
                grid = lambda META: (min(args[8], triton.cdiv(M, META["BLOCK_M"]) * triton.cdiv(N, META["BLOCK_N"])),)  # noqa: E731
            else:
                grid = lambda META: (triton.cdiv(M, META["BLOCK_M"]) * triton.cdiv(N, META["BLOCK_N"]),)  # noqa: E731
            _AUTOTUNED[variant][grid](*args, **meta)
            return out
        # A pinned tile, or a capture: launch the JIT function with the Config's own keyword arguments, as the
        # autotuner launches its choice (one JIT key for both).
        if config is None:
            config = utils.capture_config(_AUTOTUNED[variant], args, meta, _triton_config(CAPTURE_CONFIGS[variant]))
        elif tma:
            config = _triton_config(tuple(config) + (False,) * (6 - len(config)))
        else:
            config = _triton_config(tuple(config[:5]))
        block_m, block_n = config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"]
        kwargs = {**meta, **config.all_kwargs()}
        fn = gemm_tma_kernel if tma else gemm_kernel
        if tma:
            args[8] = num_programs(a.device, M, N, block_m, block_n)
            grid = (args[8],)
        else:
            grid = (triton.cdiv(M, block_m) * triton.cdiv(N, block_n),)
        if capture:
            utils.require_loaded(fn, args, kwargs, "gemm")
        fn[grid](*args, **kwargs)
    return out


# --------------------------------------------------------------------------------------------------------------------
# Ahead-of-time compile list
# --------------------------------------------------------------------------------------------------------------------
# Where each kernel runs: the TMA kernel on sm_90 only; the pointer kernel everywhere, since sm_90 takes it for fp32
# and for any 16-bit layout TMA cannot describe (`tma_compatible`), and there its autotuner benchmarks every tile of
# its list, as on sm_80. So each arch compiles every tile it can autotune: `kernel_configs`, the autotuners' own list.
AOT_ARCHS = {"tma": (90,), "ptr": (90, 80)}


def gemm_aot_specs(prefix: str, activations, gated_activations=()) -> list:
    """The kernels x dtypes x configs x activations x {bias, no bias} that run, named like
    "bias_gelu-fp16-gelu-tma-128x256x64-w8-s3" ("-nobias" after the activation without one), each with the archs it
    runs on ("archs", AOT_ARCHS). The configs are `kernel_configs`' with the warp-specialized TMA opt-in, i.e. every
    tile an autotuner can hold. `gated_activations`: the gated (GeGLU) epilogue for these activations in every dtype
    (fp32 too: a float32 ModernBERT runs it), with the `gated_configs` tiles, named
    "bias_gelu-bf16-gelu-gated-nobias-...". Pointers and the integers the JIT sees as multiples of 16 at BERT's sizes
    are compiled with that divisibility (tests/tooling/aot_compile.py's default); "hints" {"M": None} takes it back
    for the token count, which is arbitrary. stride_wk is the constant 1 the JIT specialises a contiguous weight to.
    Without the divisibility loads turn scalar and the pointer kernel spills (REG 255 STACK 32 at 128x128 GELU)."""
    specs = []
    for dtype, short in DTYPES.items():
        ptr = "*" + short
        precisions = ("ieee", "tf32") if dtype == torch.float32 else ("ieee",)
        size = torch.empty((), dtype=dtype).element_size()
        kinds = ("ptr", "tma") if size == 2 else ("ptr",)
        variants = [(kind, cfg, gated) for gated in ((False, True) if gated_activations else (False,))
                    for kind in kinds for cfg in kernel_configs(kind, size, gated, warp_specialize=True)]
        for kind, cfg, gated in variants:
            warps, stages, archs = cfg[3], cfg[4], AOT_ARCHS[kind]
            for activation, has_bias, precision in itertools.product(gated_activations if gated else activations,
                                                                     (True, False), precisions):
                parts = [prefix, short] + ([activation] if activation else []) + (["gated"] if gated else []) \
                        + ([] if has_bias else ["nobias"]) + ([precision] if dtype == torch.float32 else []) \
                        + [kind, config_name(cfg)]
                constexprs = {"HAS_BIAS": has_bias, "ACTIVATION": activation, "INPUT_PRECISION": precision,
                              "GATED": gated, **_meta(cfg)}
                signature = {"a_ptr": ptr, "w_ptr": ptr, "bias_ptr": ptr, "c_ptr": ptr,
                             "M": "i32", "N": "i32", "K": "i32", "M_BUCKET": "i32",
                             "stride_am": "i32", "stride_wn": "i32", "stride_cm": "i32"}
                if kind == "tma":
                    fn, hints = gemm_tma_kernel, {"M": None, "NUM_PROGRAMS": None}
                    signature["NUM_PROGRAMS"] = "i32"
                else:
                    fn, hints = gemm_kernel, {"M": None}
                    constexprs["stride_wk"] = 1
                specs.append({"name": "-".join(parts), "fn": fn, "signature": signature,
                              "constexprs": constexprs, "num_warps": warps, "num_stages": stages,
                              "hints": hints, "archs": archs, "tma": kind == "tma",
                              "warp_specialize": len(cfg) > 5 and cfg[5]})
    return specs

# No aot_specs() here: the core is compiled through the op modules that use it (qkv_projection: no activation;
# bias_gelu: each activation, and the gated epilogue; both with and without bias), which are exactly the variants
# that run.
