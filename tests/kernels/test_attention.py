"""The masked flash-attention kernel (kernels/attention.py) against its torch twin, fp64 and HF's BertSelfAttention.

References. `attention_torch` (fastbert/ops.py) is the definition; `reference64` is HF eager's math in float64
(finfo.min masking, so a fully padded row attends uniformly to all of its keys); HF's own BertSelfAttention in eager
mode, with its weights copied into the packed qkv projection, closes the loop. Every position is compared, including
padded query positions of live rows (HF computes those too) and fully padded rows.
Tolerances: fp32 <= 1e-5 absolute (outputs are convex combinations of O(1) values; fp32 softmax rounding is ~1e-7);
fp16/bf16 <= 2x the twin's own max error against fp64 (+1e-6), flash-attention's rule. Outputs are poisoned with NaN
first, and NaN never passes.

Without CUDA this runs Triton's interpreter (tests/conftest.py) with the launcher's fixed interpreter tile (64x32);
`test_every_tile` runs each tile of the autotune menu once. The interpreter cannot run bf16 tl.dot
(triton-lang/triton#11584: it multiplies the bit patterns), so bf16 cases are skipped on CPU and run on CUDA.
"""
import math

import pytest
import torch
from helpers import assert_kernel_matches, launched_precisions, tf32_matmuls, tuning_in_fresh_processes

from fastbert import ops
from fastbert.kernels import attention as attention_module
from fastbert.kernels import utils as kernel_utils
from fastbert.kernels.attention import attention, uniform_cu_seqlens
from fastbert.numerics import FP32_TOL, max_error
from fastbert.ops import AttentionMask, attention_torch, qkv_projection_torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BF16_ON_CPU = pytest.mark.skipif(
    DEVICE == "cpu", reason="Triton's interpreter cannot run bf16 tl.dot (triton-lang/triton#11584); runs on CUDA")
DTYPES = [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=BF16_ON_CPU)]


# --------------------------------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------------------------------
def make_qkv(B, S, nh, hd, dtype, layout="contiguous", seed=0, q_gain=1.0):
    """qkv [B*S, 3, nh, hd] in one of several memory layouts, values ~ N(0, 1) (q scaled by q_gain).

    contiguous:   the view of a contiguous [T, 3H] GEMM output (what qkv_projection returns)
    slice:        columns 8..8+3H of a wider buffer (row stride 3H+24, base offset 8 elements)
    strided_rows: every other row of a [2T, 3H] buffer
    heads_major:  a permuted view of [T, nh, 3, hd] memory (q/k/v stride hd, head stride 3*hd)
    """
    T, H = B * S, nh * hd
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(T, 3, nh, hd, generator=g, dtype=torch.float64)
    values[:, 0] *= q_gain
    values = values.to(dtype)
    if layout == "contiguous":
        qkv = values.reshape(T, 3 * H).to(DEVICE).view(T, 3, nh, hd)
    elif layout == "slice":
        big = torch.zeros(T, 3 * H + 24, dtype=dtype, device=DEVICE)
        big[:, 8:8 + 3 * H] = values.reshape(T, 3 * H)
        qkv = big[:, 8:8 + 3 * H].view(T, 3, nh, hd)
    elif layout == "strided_rows":
        big = torch.zeros(2 * T, 3 * H, dtype=dtype, device=DEVICE)
        big[::2] = values.reshape(T, 3 * H)
        qkv = big[::2].view(T, 3, nh, hd)
    elif layout == "heads_major":
        qkv = values.permute(0, 2, 1, 3).contiguous().to(DEVICE).permute(0, 2, 1, 3)
    else:
        raise ValueError(layout)
    assert torch.equal(qkv.cpu(), values) and qkv.stride(-1) == 1
    assert (layout == "contiguous") == qkv.is_contiguous()
    return qkv


def make_padding(B, S, padding, seed=0):
    """attention_mask [B, S] of 0/1 (1 = real token), HF's convention.

    none:         all real
    right:        ragged right padding, lengths S, ~2S/3, ~S/4 ... (>= 1)
    left:         left padding, the last key of each row is real
    holes:        random holes, including key 0 and (in row 0) the last key; >= 1 real key per row
    fully_padded: row 1 has no real token at all; the others are right-ragged with a hole
    """
    mask = torch.ones(B, S, dtype=torch.long)
    g = torch.Generator().manual_seed(seed)
    if padding == "right":
        for b in range(B):
            mask[b, max(1, S - (b * S) // 3):] = 0
    elif padding == "left":
        for b in range(B):
            mask[b, :min(S - 1, (b * S) // 3 + b)] = 0
    elif padding == "holes":
        mask = (torch.rand(B, S, generator=g) < 0.6).long()
        mask[:, 0] = 0
        mask[0, -1] = 0
        for b in range(B):
            if mask[b].sum() == 0:
                mask[b, S // 2] = 1
    elif padding == "fully_padded":
        for b in range(B):
            mask[b, max(1, S - b * 5):] = 0
        mask[1] = 0
        if S > 3:
            mask[0, 2] = 0
    elif padding != "none":
        raise ValueError(padding)
    return mask.to(DEVICE)


def reference64(qkv, attention_mask, scale):
    """HF eager attention in float64: scores * scale, finfo.min on masked keys, softmax, @ v -> [T, nh*hd]."""
    T, _, nh, hd = qkv.shape
    B, S = attention_mask.shape
    q, k, v = qkv.double().view(B, S, 3, nh, hd).permute(2, 0, 3, 1, 4).unbind(0)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(attention_mask[:, None, None, :] == 0, torch.finfo(torch.float64).min)
    return torch.matmul(torch.softmax(scores, dim=-1), v).transpose(1, 2).reshape(T, nh * hd)


def padded_attention(qkv, S, scale, key_valid=None, out=None, config=None):
    """The kernel on the padded layout: T/S rows of S tokens each, keys masked by key_valid [B, S]."""
    B = qkv.shape[0] // S
    return attention(qkv, uniform_cu_seqlens(B, S, qkv.device), S, scale, key_valid=key_valid, out=out, config=config)


def poisoned(T, H, dtype):
    return torch.full((T, H), float("nan"), dtype=dtype, device=DEVICE)


def run_case(B, S, nh, hd, dtype, padding, layout, config=None, q_gain=1.0, seed=0):
    qkv = make_qkv(B, S, nh, hd, dtype, layout, seed=seed, q_gain=q_gain)
    attention_mask = make_padding(B, S, padding, seed=seed)
    mask = AttentionMask.build(attention_mask, B, S, dtype)
    assert (mask.key_valid is None) == (padding == "none")
    scale = ops.default_scale(hd)
    out = poisoned(B * S, nh * hd, dtype)
    result = padded_attention(qkv, S, scale, key_valid=mask.key_valid, out=out, config=config)
    assert result.data_ptr() == out.data_ptr()
    twin, _ = attention_torch(qkv, mask, scale)
    live_rows = attention_mask.bool().any(dim=1).repeat_interleave(S)
    # In fp16 the twin's SDPA adds the finfo(fp16).min mask in fp32, where -65504 does not swamp the scores, so on
    # a fully padded row it returns a softmax over the raw scores instead of HF eager's uniform average (fp32/bf16
    # minima do swamp them): the twin's error is measured on live rows only, the kernel's everywhere.
    assert_kernel_matches(out, twin, reference64(qkv, attention_mask, scale), dtype, baseline_where=live_rows)
    return qkv, attention_mask, out


# --------------------------------------------------------------------------------------------------------------------
# Parity: twin, fp64
# --------------------------------------------------------------------------------------------------------------------
CASES = [  # (B, S, nh, hd, padding, layout)
    (2, 1, 2, 32, "none", "contiguous"),
    (3, 1, 2, 64, "fully_padded", "slice"),
    (2, 7, 2, 32, "right", "slice"),
    (3, 7, 2, 64, "left", "contiguous"),
    (2, 7, 3, 32, "holes", "strided_rows"),
    (3, 7, 2, 32, "fully_padded", "heads_major"),
    (2, 65, 2, 64, "none", "slice"),
    (3, 65, 2, 32, "right", "contiguous"),
    (2, 65, 2, 64, "holes", "heads_major"),
    (3, 65, 1, 32, "left", "strided_rows"),
    (3, 65, 2, 64, "fully_padded", "slice"),
    (2, 130, 1, 64, "right", "contiguous"),
    (2, 130, 2, 32, "holes", "slice"),
    (3, 130, 1, 32, "fully_padded", "contiguous"),
    (2, 130, 2, 64, "left", "heads_major"),
    (2, 130, 1, 32, "none", "strided_rows"),
    (2, 33, 2, 16, "holes", "contiguous"),
    (2, 40, 1, 128, "right", "slice"),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("B,S,nh,hd,padding,layout", CASES, ids=[f"B{c[0]}-S{c[1]}-nh{c[2]}-hd{c[3]}-{c[4]}-{c[5]}"
                                                                 for c in CASES])
def test_matches_twin_and_fp64(B, S, nh, hd, padding, layout, dtype):
    run_case(B, S, nh, hd, dtype, padding, layout)


def test_fully_padded_row_is_mean_of_values():
    """HF eager's corner case, stated directly: every query of an all-padding row returns the mean of that row's V
    over all S keys, and the other rows are exactly what they are without that row."""
    B, S, nh, hd = 3, 37, 2, 32
    qkv, attention_mask, out = run_case(B, S, nh, hd, torch.float32, "fully_padded", "contiguous")
    assert attention_mask[1].sum() == 0
    v_mean = qkv[S:2 * S, 2].reshape(S, nh * hd).double().mean(dim=0)
    assert (out[S:2 * S].double() - v_mean).abs().max().item() <= FP32_TOL
    # Rows 0 and 2 alone (batch of one each) give bit-identical results: the padded row disturbs nothing.
    for b in (0, 2):
        rows = slice(b * S, (b + 1) * S)
        single = AttentionMask.build(attention_mask[b:b + 1], 1, S, torch.float32)
        alone = padded_attention(qkv[rows], S, ops.default_scale(hd), single.key_valid)
        assert torch.equal(alone, out[rows])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_peaked_scores(dtype):
    """Large scores (q * 6): the running max jumps between key blocks, so the online-softmax rescaling matters."""
    run_case(2, 97, 2, 32, dtype, "holes", "contiguous", q_gain=6.0, seed=3)


@pytest.mark.parametrize("allow_tf32", [False, True])
def test_tf32_switch_reaches_the_kernel(allow_tf32, monkeypatch):
    """fp32 launches with input_precision "tf32" exactly when torch's switch is on, fp16 always with "ieee". What
    the precision does to the numbers: test_tf32_switch_changes_the_numbers (CUDA)."""
    launched = launched_precisions(monkeypatch, attention_module._attention_fwd_kernel)
    with tf32_matmuls(allow_tf32):
        for dtype in (torch.float32, torch.float16):
            padded_attention(make_qkv(2, 5, 2, 32, dtype), 5, 0.125, config=_INTERPRETER_TILE)
    assert launched == [("tf32" if allow_tf32 else "ieee"), "ieee"]


@pytest.mark.cuda
@pytest.mark.skipif(DEVICE == "cpu", reason="Triton's interpreter runs every fp32 dot in full fp32 whatever "
                                            "input_precision says: only a GPU can tell ieee from tf32")
@pytest.mark.parametrize("allow_tf32", [False, True])
def test_tf32_switch_changes_the_numbers(allow_tf32):
    """One key per sequence: the output is p @ v with p = 1. v = 1 + 2^-12 is exact in fp32 ("ieee" returns it),
    and tf32's 10 mantissa bits round it to 1."""
    qkv = torch.full((16, 3, 2, 32), 1 + 2 ** -12, device=DEVICE)
    with tf32_matmuls(allow_tf32):
        out = padded_attention(qkv, 1, 0.125)
    assert torch.equal(out, torch.full_like(out, 1.0 if allow_tf32 else 1 + 2 ** -12)), out[0, :4].tolist()


_INTERPRETER_TILE = attention_module._INTERPRETER_CONFIG


def _tiles():
    seen = {}
    for config in attention_module._all_configs():
        seen.setdefault((config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"]), config)
    return list(seen.values())


@pytest.mark.parametrize("config", _tiles(), ids=lambda c: f"{c.kwargs['BLOCK_M']}x{c.kwargs['BLOCK_N']}")
def test_every_tile(config):
    """Each tile of the autotune menu on ragged, holed and fully padded rows with query and key tails."""
    run_case(3, 70, 1, 32, torch.float32, "fully_padded", "slice", config=config)
    run_case(2, 70, 1, 64, torch.float16, "holes", "contiguous", config=config, seed=1)


def test_dispatch_through_ops():
    """fastbert.ops.attention(backend="triton") reaches this kernel with the AttentionMask fields."""
    B, S, nh, hd = 2, 19, 2, 32
    qkv = make_qkv(B, S, nh, hd, torch.float32)
    mask = AttentionMask.build(make_padding(B, S, "right"), B, S, torch.float32)
    ctx, probs = ops.attention(qkv, mask, ops.default_scale(hd), backend="triton")
    assert probs is None
    twin, _ = attention_torch(qkv, mask, ops.default_scale(hd))
    assert (ctx - twin).abs().max().item() <= FP32_TOL


# --------------------------------------------------------------------------------------------------------------------
# Parity: transformers' BertSelfAttention (eager), weights copied into the packed projection
# --------------------------------------------------------------------------------------------------------------------
HF_CASES = [  # (B, S, nh, hd, padding)
    (2, 7, 2, 32, "right"),
    (3, 65, 2, 32, "fully_padded"),
    (2, 65, 2, 64, "left"),
    (2, 130, 1, 64, "holes"),
    (2, 9, 2, 64, "none"),
]


@pytest.mark.parametrize("B,S,nh,hd,padding", HF_CASES, ids=[f"B{c[0]}-S{c[1]}-hd{c[3]}-{c[4]}" for c in HF_CASES])
def test_matches_hf_bert_self_attention(B, S, nh, hd, padding):
    from transformers import BertConfig
    from transformers.models.bert.modeling_bert import BertSelfAttention

    H = nh * hd
    config = BertConfig(hidden_size=H, num_attention_heads=nh, intermediate_size=4 * H,
                        attention_probs_dropout_prob=0.0)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = BertSelfAttention(config).to(DEVICE).eval()
    x = torch.randn(B, S, H, device=DEVICE)
    attention_mask = make_padding(B, S, padding)
    mask = AttentionMask.build(attention_mask, B, S, torch.float32)
    # HF's extended mask: [B, 1, 1, S], 0 where attended, finfo.min where padded (None when nothing is padded).
    additive = mask.additive
    with torch.no_grad():
        expected = hf(x, attention_mask=additive)[0].reshape(B * S, H)
        weight = torch.cat([hf.query.weight, hf.key.weight, hf.value.weight])
        bias = torch.cat([hf.query.bias, hf.key.bias, hf.value.bias])
        qkv = qkv_projection_torch(x.reshape(B * S, H), weight, bias, nh)
    out = padded_attention(qkv, S, ops.default_scale(hd), mask.key_valid, out=poisoned(B * S, H, torch.float32))
    assert torch.isfinite(out).all()
    assert (out - expected).abs().max().item() <= FP32_TOL
    if padding == "fully_padded":  # HF eager's uniform attention over all S keys of the dead row
        v = qkv[S:2 * S, 2].reshape(S, H)
        assert (out[S:2 * S] - v.mean(dim=0)).abs().max().item() <= FP32_TOL


# --------------------------------------------------------------------------------------------------------------------
# Launcher plumbing: precision flag, autotune pruning, AOT specs
# --------------------------------------------------------------------------------------------------------------------
def test_input_precision_follows_allow_tf32():
    with tf32_matmuls(True):
        assert attention_module.input_precision(torch.float32) == "tf32"
        assert attention_module.input_precision(torch.float16) == "ieee"
    with tf32_matmuls(False):
        assert attention_module.input_precision(torch.float32) == "ieee"
        assert attention_module.input_precision(torch.bfloat16) == "ieee"


# The tiles attention_configs' docstring promises, written out by hand: (BLOCK_M, BLOCK_N, num_warps, num_stages,
# maxnreg) per (dtype, input precision, head dim). fp16/bf16: the 128x64 throughput tile, then a 64-query tile
# (64x32 at hd 128, ptxas's own register budget for 128x64 there); fp32: one tile per head dim and precision.
_HALF = [(128, 64, 8, 2, 255), (64, 64, 4, 2, 255)]
_HALF_HD128 = [(128, 64, 8, 2, None), (64, 32, 4, 2, 255)]
EXPECTED_TILES = {
    **{(dtype, "ieee", hd): _HALF for dtype in (torch.float16, torch.bfloat16) for hd in (16, 32, 64)},
    **{(dtype, "ieee", 128): _HALF_HD128 for dtype in (torch.float16, torch.bfloat16)},
    (torch.float32, "ieee", 16): [(64, 32, 8, 2, 255)], (torch.float32, "ieee", 32): [(64, 32, 8, 2, 255)],
    (torch.float32, "ieee", 64): [(64, 16, 4, 2, None)], (torch.float32, "ieee", 128): [(32, 16, 4, 2, None)],
    (torch.float32, "tf32", 16): [(64, 32, 8, 2, 255)], (torch.float32, "tf32", 32): [(64, 32, 8, 2, 255)],
    (torch.float32, "tf32", 64): [(64, 16, 4, 2, None)], (torch.float32, "tf32", 128): [(64, 32, 8, 2, 255)],
}


# rotary q/k at hd 64 in fp16/bf16: 64x32 as the short-sequence tile (64x64 spilled on sm_80 under Triton 3.6)
EXPECTED_ROTARY_TILES_HD64 = [(128, 64, 8, 2, 255), (64, 32, 4, 2, 255)]
# at hd 128 (EuroBERT-2.1B): 128x32 and 64x32 at 8 warps (128x64, and 64x32 at 4 warps, spilled on sm_80)
EXPECTED_ROTARY_TILES_HD128 = [(128, 32, 8, 2, None), (64, 32, 8, 2, 255)]
# DeBERTa's c2p/p2c in fp16/bf16: 64x32 as the short-sequence tile (64x64 spilled on sm_80); hd 128: 64x32 alone
# (128x64 spilled)
EXPECTED_DISENTANGLED_TILES = [(128, 64, 8, 2, 255), (64, 32, 4, 2, 255)]


@pytest.mark.parametrize("dtype,precision,head_dim", list(EXPECTED_TILES), ids=str)
def test_attention_configs_are_the_documented_tiles(dtype, precision, head_dim):
    got = [attention_module._key(c) for c in attention_module.attention_configs(dtype, head_dim, precision)]
    assert got == EXPECTED_TILES[dtype, precision, head_dim]
    rotary = [attention_module._key(c) for c in attention_module.attention_configs(dtype, head_dim, precision, True)]
    half = dtype != torch.float32
    assert rotary == (EXPECTED_ROTARY_TILES_HD64 if head_dim == 64 and half else
                      EXPECTED_ROTARY_TILES_HD128 if head_dim == 128 and half else got)
    disentangled = [attention_module._key(c) for c in
                    attention_module.attention_configs(dtype, head_dim, precision, disentangled=True)]
    if dtype == torch.float32:
        assert disentangled == got
    else:
        assert disentangled == (EXPECTED_DISENTANGLED_TILES if head_dim <= 64 else [(64, 32, 4, 2, 255)])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_prune_keeps_the_rotary_tiles(dtype):
    kept = attention_module._prune(attention_module._all_configs(), {"qkv_ptr": torch.empty(0, dtype=dtype),
                                   "seq_bucket": 512}, HEAD_DIM=64, INPUT_PRECISION="ieee", HAS_ROTARY=True)
    assert sorted(attention_module._key(c) for c in kept) == sorted(EXPECTED_ROTARY_TILES_HD64)


@pytest.mark.parametrize("terms", [dict(HAS_C2P=True), dict(HAS_P2C=True), dict(HAS_C2P=True, HAS_P2C=True)],
                         ids=["c2p", "p2c", "both"])
def test_prune_keeps_the_disentangled_tiles(terms):
    kept = attention_module._prune(attention_module._all_configs(), {"qkv_ptr": torch.empty(0, dtype=torch.float16),
                                   "seq_bucket": 512}, HEAD_DIM=64, INPUT_PRECISION="ieee", **terms)
    assert sorted(map(str, (attention_module._key(c) for c in kept))) == sorted(map(str, EXPECTED_DISENTANGLED_TILES))


@pytest.mark.parametrize("seq_bucket", [8, 64, 128, 512])
@pytest.mark.parametrize("dtype,precision,head_dim", list(EXPECTED_TILES), ids=str)
def test_prune_keeps_the_call_s_tiles(dtype, precision, head_dim, seq_bucket):
    """The autotuner tries exactly this call's documented tiles, minus the 128-query tile for sequences of <= 64
    tokens (never all of them)."""
    kept = attention_module._prune(attention_module._all_configs(),
                                   {"qkv_ptr": torch.empty(0, dtype=dtype), "seq_bucket": seq_bucket},
                                   HEAD_DIM=head_dim, INPUT_PRECISION=precision, HAS_MASK=True)
    expected = EXPECTED_TILES[dtype, precision, head_dim]
    if seq_bucket <= 64 and dtype != torch.float32:
        expected = expected[1:]  # the 64-query tile alone
    assert sorted(map(str, (attention_module._key(c) for c in kept))) == sorted(map(str, expected))


def test_aot_specs_well_formed():
    """Spec format (tests/tooling/test_aot.py compiles them): unique names, every kernel argument typed or constant, and
    exactly the documented tiles for each (dtype, precision, head dim) and mask variant: 48 kernels without a bias,
    the same tiles at head dim 64 (MPNet-base, DeBERTa-v3-base) with one: 12 more, and ModernBERT's window,
    window + rotary and rotary variants in fp16/bf16 at head dims 32 and 64: 48 more, and DeBERTa's at head dim 64
    (c2p + p2c in fp16 and bf16 packed, in fp16 padded; c2p alone in fp16 packed): 8 more, and EuroBERT's rotary
    over grouped key/value heads in fp16/bf16 at head dims 64 and 128: 16 more, and Qwen3's, the same at head dim 128
    with causal=True: 8 more."""
    specs = attention_module.aot_specs()
    names = [s["name"] for s in specs]
    assert len(names) == len(set(names)) == 140
    arg_names = set(attention_module._attention_fwd_kernel.arg_names)  # JITFunction or, here, InterpretedFunction
    for spec in specs:
        assert not set(spec["signature"]) & set(spec["constexprs"]), spec["name"]
        assert set(spec["signature"]) | set(spec["constexprs"]) == arg_names, spec["name"]
        assert set(spec["hints"]) <= set(spec["signature"]), spec["name"]
    tags = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16"}

    def covered(with_bias, window=False, rotary=False, c2p=False, p2c=False, grouped=False, causal=False):
        return sorted(str((s["signature"]["qkv_ptr"], s["constexprs"]["INPUT_PRECISION"], s["constexprs"]["HEAD_DIM"],
                           s["constexprs"]["HAS_MASK"], s["constexprs"]["BLOCK_M"], s["constexprs"]["BLOCK_N"],
                           s["num_warps"], s["num_stages"], s.get("maxnreg"))) for s in specs
                      if tuple(s["constexprs"][flag] for flag in ("HAS_BIAS", "HAS_WINDOW", "HAS_ROTARY", "HAS_C2P",
                                                                   "HAS_P2C", "CAUSAL"))
                      == (with_bias, window, rotary, c2p, p2c, causal) and ("kv_group" in s["signature"]) == grouped)

    def expected(head_dims, dtypes=tuple(tags)):
        return sorted(str((tags[dtype], precision, hd, mask) + tile) for (dtype, precision, hd), tiles in
                      EXPECTED_TILES.items() if hd in head_dims and dtype in dtypes
                      for mask in (True, False) for tile in tiles)

    assert covered(False) == expected((16, 32, 64, 128))
    assert covered(True) == expected((64,))
    half = (torch.float16, torch.bfloat16)
    assert covered(False, True, False) == expected((32, 64), half)
    rotary_hd64 = sorted(str((tags[dtype], "ieee", 64, mask) + tile) for dtype in half for mask in (True, False)
                         for tile in EXPECTED_ROTARY_TILES_HD64)
    for window in (True, False):
        assert covered(False, window, True) == sorted(expected((32,), half) + rotary_hd64)

    def disentangled(dtypes, masks):
        return sorted(str((dtype, "ieee", 64, mask) + tile) for dtype in dtypes for mask in masks
                      for tile in EXPECTED_DISENTANGLED_TILES)

    assert covered(False, c2p=True, p2c=True) == sorted(disentangled(("*fp16", "*bf16"), (False,)) +
                                                        disentangled(("*fp16",), (True,)))
    assert covered(False, c2p=True) == disentangled(("*fp16",), (False,))
    assert covered(False, p2c=True) == []
    assert covered(False, rotary=True, grouped=True) == sorted(
        str((tags[dtype], "ieee", hd, mask) + tile) for dtype in half for mask in (True, False)
        for hd, tiles in ((64, EXPECTED_ROTARY_TILES_HD64), (128, EXPECTED_ROTARY_TILES_HD128)) for tile in tiles)
    assert covered(False, rotary=True, grouped=True, causal=True) == sorted(
        str((tags[dtype], "ieee", 128, mask) + tile) for dtype in half for mask in (True, False)
        for tile in EXPECTED_ROTARY_TILES_HD128)
    assert all(s["constexprs"]["HAS_ROTARY"] and "kv_group" in s["signature"] for s in specs
               if s["constexprs"]["CAUSAL"])
    for spec in specs:  # the variants off: their arguments are the constant 1 the launcher passes
        constexprs = spec["constexprs"]
        assert constexprs["HAS_WINDOW"] or constexprs["window"] == 1, spec["name"]
        assert constexprs["HAS_ROTARY"] or constexprs["stride_rot_t"] == 1, spec["name"]
        assert constexprs["HAS_C2P"] or constexprs["stride_c2p_t"] == constexprs["stride_c2p_h"] == 1, spec["name"]
        assert constexprs["HAS_P2C"] or constexprs["stride_p2c_t"] == constexprs["stride_p2c_h"] == 1, spec["name"]
        terms = constexprs["HAS_C2P"] or constexprs["HAS_P2C"]
        assert (terms or constexprs["HAS_BIAS"]) == ("bias_reach" in spec["signature"]), spec["name"]
        # one key/value head per query head: the group size is the constant 1 (BERT's binaries)
        assert ("kv_group" in spec["signature"]) == ("-gqa-" in spec["name"]), spec["name"]
        assert "kv_group" in spec["signature"] or constexprs["kv_group"] == 1, spec["name"]


# --------------------------------------------------------------------------------------------------------------------
# Bad inputs
# --------------------------------------------------------------------------------------------------------------------
def _good(B=2, S=5, nh=2, hd=32, dtype=torch.float32):
    qkv = make_qkv(B, S, nh, hd, dtype)
    mask = AttentionMask.build(make_padding(B, S, "right"), B, S, dtype)
    return qkv, mask


@pytest.mark.parametrize("shape", [(10, 3, 64), (10, 2, 2, 32), (10, 3, 2, 32, 1)], ids=str)
def test_rejects_bad_qkv_shape(shape):
    with pytest.raises(ValueError, match=r"\[T, 3, num_heads, head_dim\]"):
        padded_attention(torch.zeros(shape, device=DEVICE), 5, 0.125)


def _cu(*values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


@pytest.mark.parametrize("cu_seqlens, max_seqlen, exc, words", [
    (_cu(0, 5, 9), 5, ValueError, r"rise from 0 to T=10 .* last 9"),
    (_cu(1, 5, 10), 5, ValueError, r"rise from 0 to T=10 .* first 1"),
    (_cu(0, 6, 4, 10), 6, ValueError, r"without going down.*a step of -2"),
    (_cu(0, 7, 10), 5, ValueError, r"max_seqlen=5 is shorter than the longest sequence \(7 tokens\)"),
    (_cu(0, 5, 10).long(), 5, TypeError, r"cu_seqlens must be a 1-D int32 tensor"),
    (_cu(0, 5, 10)[None], 5, TypeError, r"cu_seqlens must be a 1-D int32 tensor"),
    (_cu(0, 5, 10), -1, ValueError, r"max_seqlen must be a non-negative int"),
    (_cu(0, 5, 10), 2.5, ValueError, r"max_seqlen must be a non-negative int"),
])
def test_rejects_cu_seqlens_that_would_read_out_of_bounds(cu_seqlens, max_seqlen, exc, words):
    """Every value the kernel would index with is checked (one host read) before the launch."""
    qkv, _ = _good()
    with pytest.raises(exc, match=words):
        attention(qkv, cu_seqlens, max_seqlen, 0.125)


def test_rejects_key_valid_with_unequal_lengths():
    """key_valid means the padded layout: every row holds max_seqlen tokens."""
    qkv, _ = _good()
    with pytest.raises(ValueError, match="every sequence must have max_seqlen=7 tokens; got lengths 3..7"):
        attention(qkv, _cu(0, 3, 10), 7, 0.125, key_valid=torch.ones(2, 7, dtype=torch.bool, device=DEVICE))


def test_rejects_unsupported_head_dim():
    qkv = make_qkv(2, 5, 2, 24, torch.float32)
    with pytest.raises(ValueError, match="head_dim=24"):
        padded_attention(qkv, 5, 24 ** -0.5)


def test_rejects_unsupported_dtype():
    with pytest.raises(TypeError, match="float64"):
        padded_attention(make_qkv(2, 5, 2, 32, torch.float64), 5, 0.125)


def test_rejects_non_unit_stride_head_dim():
    qkv = torch.zeros(10, 3, 2, 64, device=DEVICE)[..., ::2]
    with pytest.raises(ValueError, match="unit-stride"):
        padded_attention(qkv, 5, 0.125)


def test_rejects_key_valid_wrong_dtype():
    qkv, mask = _good()
    with pytest.raises(TypeError, match="key_valid.dtype=torch.int64"):
        padded_attention(qkv, 5, 0.125, key_valid=mask.key_valid.long())


def test_rejects_key_valid_wrong_shape():
    qkv, mask = _good()
    with pytest.raises(ValueError, match=r"key_valid has shape \(2, 4\)"):
        padded_attention(qkv, 5, 0.125, key_valid=mask.key_valid[:, :4])
    with pytest.raises(ValueError, match=r"key_valid has shape \(10,\)"):
        padded_attention(qkv, 5, 0.125, key_valid=mask.key_valid.reshape(-1))


def test_rejects_key_valid_wrong_device():
    qkv, mask = _good()
    other = "meta"
    with pytest.raises(ValueError, match="key_valid is on meta"):
        padded_attention(qkv, 5, 0.125, key_valid=mask.key_valid.to(other))


def test_rejects_bad_out():
    qkv, _ = _good()
    with pytest.raises(ValueError, match=r"out has shape \(10, 32\)"):
        padded_attention(qkv, 5, 0.125, out=torch.empty(10, 32, device=DEVICE))
    with pytest.raises(TypeError, match="out.dtype=torch.float16"):
        padded_attention(qkv, 5, 0.125, out=torch.empty(10, 64, dtype=torch.float16, device=DEVICE))
    with pytest.raises(ValueError, match="out's last dim"):
        padded_attention(qkv, 5, 0.125, out=torch.empty(64, 10, device=DEVICE).t())
    with pytest.raises(ValueError, match="out is on meta"):
        padded_attention(qkv, 5, 0.125, out=torch.empty(10, 64, device="meta"))


def test_rejects_non_finite_scale():
    qkv, _ = _good()
    with pytest.raises(ValueError, match="scale"):
        padded_attention(qkv, 5, math.nan)


@pytest.mark.skipif(DEVICE == "cuda", reason="checks the CPU-without-interpreter refusal")
def test_rejects_cpu_without_interpreter(monkeypatch):
    monkeypatch.setattr(kernel_utils, "INTERPRET", False)
    qkv, _ = _good()
    with pytest.raises(ValueError, match="CUDA"):
        padded_attention(qkv, 5, 0.125)


def test_empty_batch():
    qkv = torch.zeros(0, 3, 2, 32, device=DEVICE)
    assert padded_attention(qkv, 5, 0.125).shape == (0, 64)


def test_grid_of_many_rows_fits_cudas_limits():
    """Rows ride on grid x (limit 2^31 - 1): 65536 rows of one token once exceeded grid z's 65535 and failed to
    launch. The interpreter takes ~6 minutes for that launch, so on CPU the grid is checked and the folded row index
    is exercised by every multi-row case above; test_many_rows_launch runs it on CUDA."""
    for block_m in (16, 32, 64, 128):
        x, y = attention_module.launch_grid(65536, 1, 12, block_m)
        assert (x, y) == (65536, 12) and x <= 2 ** 31 - 1 and y <= 65535
    assert attention_module.launch_grid(3, 130, 2, 64) == (9, 2)


@pytest.mark.skipif(DEVICE == "cpu", reason="65536 programs take ~6 minutes in the interpreter; the grid is "
                                            "checked on CPU by test_grid_of_many_rows_fits_cudas_limits")
def test_many_rows_launch():
    qkv = make_qkv(65536, 1, 2, 32, torch.float16)
    out = padded_attention(qkv, 1, 0.25)
    assert torch.equal(out, qkv[:, 2].reshape(65536, 64))  # one key: the output is its value


def test_last_real_key():
    """kv_end, which bounds every key read, as the launcher derives it from key_valid: 1 + the last real key's
    index, 0 for a fully padded row."""
    keep = torch.tensor([[1, 1, 0, 0, 0], [0, 0, 0, 0, 1], [0, 0, 0, 0, 0], [1, 0, 1, 0, 0]], dtype=torch.bool)
    assert attention_module.last_real_key(keep).tolist() == [2, 5, 0, 3]
    assert attention_module.last_real_key(keep).dtype == torch.int32


@pytest.mark.parametrize("entry", ["attention", "launch"])
def test_keys_past_the_last_real_key_are_never_read(entry):
    """The checked entry point and the model's unchecked one both bound key reads by key_valid's last real key:
    NaN in the keys and values past it (a block and a half of them, at the 32-key interpreter tile) never reaches
    the output, and the live rows match fp64."""
    B, S, nh, hd = 2, 70, 2, 32
    qkv = make_qkv(B, S, nh, hd, torch.float32)
    attention_mask = make_padding(B, S, "right")  # row 0: all 70 real; row 1: 47 real, then padding
    mask = AttentionMask.build(attention_mask, B, S, torch.float32)
    ends = (70, 47)
    assert attention_mask.sum(dim=1).tolist() == list(ends)
    reference = reference64(qkv, attention_mask, ops.default_scale(hd))
    qkv.view(B, S, 3, nh, hd)[1, ends[1]:, 1:] = float("nan")  # row 1's keys and values past its last real key
    fn = attention if entry == "attention" else attention_module.launch
    out = fn(qkv, uniform_cu_seqlens(B, S, qkv.device), S, ops.default_scale(hd), key_valid=mask.key_valid,
             out=poisoned(B * S, nh * hd, torch.float32))
    assert torch.isfinite(out).all()
    assert max_error(out, reference) <= FP32_TOL


# --------------------------------------------------------------------------------------------------------------------
# Varlen: packed sequences of any lengths, one launch, padding never computed
# --------------------------------------------------------------------------------------------------------------------
def varlen_reference64(qkv, lengths, scale):
    """Each sequence alone, in float64: softmax(q k^T * scale) v -> [T, nh*hd] (empty sequences contribute nothing)."""
    T, _, nh, hd = qkv.shape
    pieces, start = [], 0
    for length in lengths:
        q, k, v = qkv[start:start + length].double().permute(1, 2, 0, 3).unbind(0)  # [nh, L, hd]
        probs = torch.softmax(torch.matmul(q, k.transpose(-1, -2)) * scale, dim=-1)
        pieces.append(torch.matmul(probs, v).transpose(0, 1).reshape(length, nh * hd))
        start += length
    return torch.cat(pieces)


VARLEN_CASES = [  # (lengths, nh, hd, layout)
    ([5], 2, 32, "contiguous"),
    ([1, 1, 1], 2, 16, "slice"),
    ([7, 0, 3, 0, 1], 3, 32, "strided_rows"),
    ([63, 64, 65, 1, 129], 1, 64, "contiguous"),
    ([130, 2, 33], 2, 64, "heads_major"),
    ([40, 17], 1, 128, "slice"),
    ([0, 0, 9], 2, 32, "contiguous"),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("lengths,nh,hd,layout", VARLEN_CASES,
                         ids=[f"{'-'.join(map(str, c[0]))}-nh{c[1]}-hd{c[2]}-{c[3]}" for c in VARLEN_CASES])
def test_varlen_matches_twin_and_fp64(lengths, nh, hd, layout, dtype):
    """Sequences of 0, 1, block-edge and multi-block lengths in one launch, against each sequence alone in fp64 and the
    varlen twin. Outputs are NaN-poisoned: every token must be written, and only once per token."""
    from fastbert.layout import TokenLayout
    T = sum(lengths)
    qkv = make_qkv(1, T, nh, hd, dtype, layout)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    scale = ops.default_scale(hd)
    out = attention(qkv, cu, max(lengths), scale, out=poisoned(T, nh * hd, dtype))
    layout_ = TokenLayout(cu, max(lengths), T, tuple(lengths), None, len(lengths), max(lengths))
    twin = ops.attention_varlen_torch(qkv, layout_, scale)
    assert_kernel_matches(out, twin, varlen_reference64(qkv, lengths, scale), dtype)


def test_varlen_grid_larger_than_the_sequences():
    """A max_seqlen above every length (a CUDA graph's fixed grid) and zero-length sequences at the end (its spare
    sequence slots): programs past a sequence's end write nothing, tokens beyond cu_seqlens[-1] are untouched."""
    lengths = [9, 30, 1]
    T = sum(lengths)
    qkv = make_qkv(1, T + 7, 2, 32, torch.float32)  # 7 spare tokens no sequence owns
    cu = torch.tensor([0, 9, 39, 40, 40, 40], dtype=torch.int32, device=DEVICE)
    out = poisoned(T + 7, 64, torch.float32)
    qkv_real = qkv[:T]
    launched = attention_module.launch(qkv, cu, 128, 32 ** -0.5, out=out)
    assert launched.data_ptr() == out.data_ptr()
    assert torch.isnan(out[T:]).all()  # never written
    ref = varlen_reference64(qkv_real, lengths, 32 ** -0.5)
    assert (out[:T].double() - ref).abs().max().item() <= FP32_TOL


@pytest.mark.parametrize("config", _tiles(), ids=lambda c: f"{c.kwargs['BLOCK_M']}x{c.kwargs['BLOCK_N']}")
def test_every_tile_varlen(config):
    lengths = [70, 3, 0, 129]
    qkv = make_qkv(1, sum(lengths), 1, 32, torch.float32)
    cu = torch.tensor([0, 70, 73, 73, 202], dtype=torch.int32, device=DEVICE)
    out = attention(qkv, cu, 129, 32 ** -0.5, config=config)
    assert (out.double() - varlen_reference64(qkv, lengths, 32 ** -0.5)).abs().max().item() <= FP32_TOL


def test_varlen_dispatch_through_ops():
    """ops.attention with a TokenLayout reaches the varlen kernel on "triton" and matches the twin."""
    from fastbert.layout import TokenLayout
    keep = torch.tensor([[1, 1, 1, 0, 0], [0, 1, 1, 1, 1], [0, 0, 0, 0, 0]], dtype=torch.bool, device=DEVICE)
    layout_ = TokenLayout.from_mask(keep, [3, 4, 0], 7)
    qkv = make_qkv(1, 7, 2, 32, torch.float32)
    got, _ = ops.attention(qkv, layout_, 0.2, backend="triton")
    want, _ = ops.attention(qkv, layout_, 0.2, backend="torch")
    assert (got - want).abs().max().item() <= FP32_TOL


@pytest.mark.cuda
@pytest.mark.skipif(DEVICE == "cpu", reason="a CUDA test: Triton's interpreter switches the autotuner's disk cache off "
                                            "(Autotuner: cache_results ... and not knobs.runtime.interpret), and "
                                            "without it no compiled kernel runs")
def test_autotuner_keeps_its_choice_across_processes(tmp_path):
    """Attention tuned in one process is not benchmarked again in the next one sharing the Triton cache dir."""
    call = ("from fastbert.kernels import attention\n"
            "qkv = torch.randn(256, 3, 2, 64, device='cuda', dtype=torch.float16)\n"
            "cu = torch.tensor([0, 128, 256], dtype=torch.int32, device='cuda')\n"
            "attention.attention(qkv, cu, 128, 0.125)\n"
            "TUNER = attention._attention_fwd")
    first, second = tuning_in_fresh_processes(call, tmp_path)
    assert first["benchmarks"] > 0, first
    assert second == {"benchmarks": 0, "choice": first["choice"]}, (first, second)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_heads, causal", [(None, False), (2, False), (2, True)])
def test_runs_of_equal_lengths_give_the_per_sequence_bits(dtype, kv_heads, causal):
    """The CPU twin's inference runs each run of equal lengths as one dense sdpa: bit for bit what one sdpa per
    sequence gives (the loop autograd takes), so a text's context never depends on the texts beside it."""
    from fastbert.layout import TokenLayout
    lengths = [40, 40, 40, 17, 17, 9, 40, 1, 1, 0]
    nh, hd = 4, 32
    T = sum(lengths)
    g = torch.Generator().manual_seed(3)
    width = (3, nh) if kv_heads is None else (nh + 2 * kv_heads,)
    qkv = torch.randn(T, *width, hd, generator=g).to(dtype)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    layout = TokenLayout(cu, max(lengths), T, tuple(lengths), None, len(lengths), max(lengths))
    call = lambda: ops.attention_varlen_torch(qkv, layout, hd ** -0.5, kv_heads=kv_heads, causal=causal)  # noqa: E731
    per_sequence = call()  # autograd on: one sdpa per sequence
    with torch.inference_mode():
        runs = call()
    assert runs.shape == per_sequence.shape == (T, nh * hd) and runs.dtype == dtype
    assert torch.equal(runs, per_sequence)
    one = TokenLayout(torch.tensor([0, 17], dtype=torch.int32), 17, 17, (17,), None, 1, 17)
    alone = ops.attention_varlen_torch(qkv[120:137], one, hd ** -0.5, kv_heads=kv_heads, causal=causal)
    assert torch.equal(runs[120:137], alone)  # the first 17-token text, alone in its batch
